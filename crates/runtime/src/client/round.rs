//! The round loop: carries out one worker [`Round`] over the client's server connections.
//!
//! The round decides everything (what to send where and when, how many requests may be in
//! flight to one server, how long each may wait, what to resend); this loop only writes
//! the sends it returns (a push's values straight from the caller's gradient slice),
//! reads the replies (a pull's values straight into the caller's tensor), fetches the
//! layout when asked, hands every event back ([`RoundEvent`]), and sleeps until the
//! round's [`Round::poll_timeout`].

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use elasticps_core::model::BlockSpec;
use elasticps_core::sync::Clock;
use elasticps_node::worker::{Action, Answer, Op, PushOp, Round, RoundEvent, RowsOp};
use elasticps_wire::{Control, FrameHeader, Kind, Message};
use futures::StreamExt;
use futures::stream::FuturesUnordered;

use super::rows::{RowPayloads, RowSink};
use super::server_conn::{self, Sent, ServerConn, WriteJob, Written};
use super::{Client, Waits};
use crate::CALL_TIMEOUT;
use crate::error::{Result, RuntimeError};

impl Client {
    /// One round trip with every server at once: for each block, the push (if any),
    /// then, once the block's server acknowledged all of this round's pushes, the pull
    /// (if any), or both in one push_pull ([`super::ClientOptions::fuse`]); a block whose
    /// server answered `Moved` is resent after a layout refresh.
    /// The plan ([`Round`]) decides; this task writes its requests and reads the replies
    /// itself, all servers at once (a pull reply straight into `pull`'s tensor).
    pub(super) async fn round(
        &mut self,
        push: Option<(PushOp, &[Option<&[f32]>])>,
        mut pull: Option<(Clock, &mut [Option<&mut [f32]>])>,
    ) -> Result<()> {
        let layout = self.current_layout()?;
        self.fresh_connections();
        let push_mask: Vec<bool> = push.map_or_else(Vec::new, |(_, g)| g.iter().map(Option::is_some).collect());
        let pull_mask: Vec<bool> =
            pull.as_ref().map_or_else(Vec::new, |(_, p)| p.iter().map(Option::is_some).collect());
        let (plan, actions) = self
            .worker
            .start(
                self.clock.now(),
                &layout,
                push.map(|(op, _)| (op, &push_mask[..])),
                pull.as_ref().map(|(clock, _)| (*clock, &pull_mask[..])),
            )
            .map_err(RuntimeError::from)?;
        if let (Some(m), Some(it)) = (&self.opts.metrics, plan.iteration()) {
            m.iteration(it.clock, it.since_last_us.map(Duration::from_micros));
        }
        let grads = push.map_or(&[][..], |(_, g)| g);
        self.drive(plan, actions, Source::Tensors(grads), Sink::Tensors(&mut pull)).await
    }

    /// A row round of table `table` ([`RowsOp`]): `payloads` holds the request of each
    /// block to send to (every block of the table for a push, those holding rows asked
    /// for a pull), `sink` where a pull's rows go. The plan decides what goes where and
    /// when, as for tensors.
    pub(super) async fn rows_round(
        &mut self,
        table: u32,
        op: RowsOp,
        payloads: &RowPayloads,
        sink: Option<&mut RowSink<'_>>,
    ) -> Result<()> {
        let layout = self.current_layout()?;
        self.fresh_connections();
        let wanted = |b: &BlockSpec| payloads.by_block.contains_key(&b.id);
        let (plan, actions) =
            self.worker.start_rows(self.clock.now(), &layout, table, op, &wanted).map_err(RuntimeError::from)?;
        self.drive(plan, actions, Source::Rows(payloads), Sink::Rows(sink)).await
    }

    /// A round that failed half-way left requests on some connections: their late
    /// replies must not be taken for the next round's, so those connections start afresh.
    fn fresh_connections(&mut self) {
        self.servers.retain(|_, c| {
            c.start_round();
            c.is_idle()
        });
    }

    /// Carries out a planned round: writes its sends (values from `source`), reads the
    /// replies (pulled values into `sink`), fetches the layout when asked, until the plan
    /// is done; then records the waits and sends the load report when one is due.
    async fn drive<'g>(
        &mut self,
        mut plan: Round,
        actions: Vec<Action>,
        source: Source<'g>,
        mut sink: Sink<'_, '_, '_, '_>,
    ) -> Result<()> {
        let mut writes = FuturesUnordered::new();
        let mut todo = VecDeque::from(actions);
        // One timer for the whole round, set to the plan's poll_timeout (`armed`).
        let sleep = tokio::time::sleep(self.opts.request_timeout);
        tokio::pin!(sleep);
        let mut armed = None;
        let mut turn = 0usize;
        loop {
            while let Some(action) = todo.pop_front() {
                match action {
                    Action::Send { tag, server, block, op } => {
                        // This send and every send right behind it: one write per server.
                        let mut batch = vec![(tag, Sent { server, block, op })];
                        while let Some(&Action::Send { tag, server, block, op }) = todo.front() {
                            batch.push((tag, Sent { server, block, op }));
                            todo.pop_front();
                        }
                        let (jobs, unreachable) = self.start_writes(batch, source)?;
                        writes.extend(jobs.into_iter().map(server_conn::run_write));
                        for server in unreachable {
                            todo.extend(self.hand(&mut plan, RoundEvent::ServerLost { server })?);
                        }
                    }
                    Action::RefreshLayout => {
                        let reply = self
                            .call_scheduler(Control::GetLayout.into(), CALL_TIMEOUT, || {
                                "the scheduler to send the layout".into()
                            })
                            .await?;
                        self.install_layout(reply, true).await?;
                        let layout = self.current_layout()?;
                        todo.extend(self.hand(&mut plan, RoundEvent::Layout(&layout))?);
                    }
                }
            }
            if plan.is_done() && writes.is_empty() {
                break;
            }
            let wake = plan.poll_timeout();
            if wake.is_none() && writes.is_empty() {
                return Err(stalled(&plan));
            }
            if wake != armed {
                // No wake-up: only writes to wait for.
                let after = wake
                    .map_or(self.opts.request_timeout, |at| Duration::from_micros(at.saturating_sub(self.clock.now())));
                sleep.as_mut().reset(tokio::time::Instant::now() + after);
                armed = wake;
            }
            turn = turn.wrapping_add(1);
            let event = tokio::select! {
                Some(written) = writes.next(), if !writes.is_empty() => Event::Wrote(written),
                (server, got) = std::future::poll_fn(|cx| server_conn::poll_any_header(&mut self.servers, turn, cx)) => {
                    Event::Header(server, got)
                }
                () = &mut sleep => Event::Timer,
                Ok(()) = self.ending.changed() => Event::Failover,
            };
            let more = match event {
                Event::Wrote((_, _, None | Some(Ok(())))) => Vec::new(),
                Event::Wrote((server, serial, Some(Err(e)))) => {
                    if self.servers.get(&server).is_none_or(|c| c.serial != serial) {
                        continue;
                    }
                    self.drop_server(server, e, &mut plan)?
                }
                Event::Header(server, Ok(Some(header))) => self.on_header(server, header, &mut plan, &mut sink).await?,
                Event::Header(server, Ok(None)) => {
                    let closed = RuntimeError::Closed(format!("server {server}"));
                    self.drop_server(server, closed, &mut plan)?
                }
                Event::Header(server, Err(e)) => self.drop_server(server, e, &mut plan)?,
                Event::Failover => self.drop_failed_over(&mut plan)?,
                Event::Timer => {
                    armed = None;
                    match wake {
                        Some(_) => self.hand(&mut plan, RoundEvent::Timeout)?,
                        None => Vec::new(),
                    }
                }
            };
            todo.extend(more);
        }
        self.waits = Waits { per_server: plan.waits_per_server_us().into_iter().map(Duration::from_micros).collect() };
        if let Some(m) = &self.opts.metrics {
            for (server, waited) in plan.waited() {
                m.waited(server, Duration::from_micros(waited));
            }
        }
        if let Some(report) = self.worker.finish(self.clock.now(), plan) {
            let _ = self.sched.notify(Control::WorkerLoad(report).into());
        }
        Ok(())
    }

    /// Hands the plan `event`, now.
    fn hand(&self, plan: &mut Round, event: RoundEvent<'_>) -> Result<Vec<Action>> {
        plan.handle(self.clock.now(), event).map_err(RuntimeError::from)
    }

    /// A reply's header came from `server`: reads its payload (a pull's values straight
    /// into the caller's tensor) and hands the answer to the plan.
    async fn on_header(
        &mut self,
        server: u32,
        header: FrameHeader,
        plan: &mut Round,
        sink: &mut Sink<'_, '_, '_, '_>,
    ) -> Result<Vec<Action>> {
        let Some(conn) = self.servers.get_mut(&server) else {
            return Ok(Vec::new());
        };
        // The request stays pending until its payload is read: a round dropped half-way
        // through the read (a cancelled call) leaves the connection mid-frame, and a
        // pending request is what makes the next round drop it (`is_idle`).
        let Some(&(tag, sent)) = conn.pending.get(&header.request_id) else {
            // A notification, or the reply to a request no round waits for: read, dropped.
            return match conn.reader.payload(&header).await {
                Ok(msg) => {
                    tracing::warn!(peer = %conn.name, id = header.request_id, kind = ?msg.kind(), "reply to no request");
                    Ok(Vec::new())
                }
                Err(e) => self.drop_server(server, e, plan),
            };
        };
        let b = sent.block;
        if let Sink::Rows(rows) = sink {
            return self.on_rows_header(server, header, tag, sent, rows.as_deref_mut(), plan).await;
        }
        let Sink::Tensors(pull) = sink else { return Ok(Vec::new()) };
        // Where a pull reply of the expected length goes: the block's range of its tensor.
        let dest = match (header.kind, pull.as_mut()) {
            (Kind::PullReply, Some((_, params))) if sent.op.is_pull() && header.payload_len as usize == b.len * 4 => {
                params
                    .get_mut(b.tensor as usize)
                    .and_then(Option::as_mut)
                    .and_then(|p| p.get_mut(b.offset..b.offset + b.len))
            }
            _ => None,
        };
        let read = match dest {
            Some(dest) => conn.reader.payload_into(&header, bytemuck::cast_slice_mut(dest)).await.map(|()| {
                #[cfg(target_endian = "big")]
                for v in dest.iter_mut() {
                    *v = f32::from_bits(u32::from_le(v.to_bits()));
                }
                None
            }),
            None => conn.reader.payload(&header).await.map(Some),
        };
        let msg = match read {
            Ok(msg) => {
                // A held push_pull's PushAck: its PullReply follows under the same id.
                if sent.op.ends_with(header.kind) {
                    conn.pending.remove(&header.request_id);
                }
                msg
            }
            // Unanswered after all: the connection is lost, with this request on it.
            Err(e) => return self.drop_server(server, e, plan),
        };
        let answer = match &msg {
            Some(msg) => Answer::of(msg),
            None => Answer::Pulled { len: b.len },
        };
        self.hand(plan, RoundEvent::Answer { tag, answer })
    }

    /// A reply's header came from `server` for request `tag` of a row round: reads it, puts
    /// a `PullRowsReply`'s rows where they were asked for (its length must be the rows the
    /// request asked times the dim), and hands the answer to the plan.
    async fn on_rows_header(
        &mut self,
        server: u32,
        header: FrameHeader,
        tag: u64,
        sent: Sent,
        rows: Option<&mut RowSink<'_>>,
        plan: &mut Round,
    ) -> Result<Vec<Action>> {
        let Some(conn) = self.servers.get_mut(&server) else {
            return Ok(Vec::new());
        };
        let msg = match conn.reader.payload(&header).await {
            Ok(msg) => {
                conn.pending.remove(&header.request_id);
                msg
            }
            Err(e) => return self.drop_server(server, e, plan),
        };
        let b = sent.block;
        if let (Message::PullRowsReply { values, .. }, Op::PullRows(_)) = (&msg, sent.op) {
            let want = rows.as_ref().and_then(|r| r.expected_len(b.id));
            if want != Some(values.len()) {
                return Err(RuntimeError::Protocol {
                    peer: format!("server {server}"),
                    what: format!(
                        "answered pull_rows of block {} with {} values, {} were asked for",
                        b.id,
                        values.len(),
                        want.unwrap_or(0)
                    ),
                });
            }
            if let Some(rows) = rows {
                rows.scatter(b.id, &values.to_vec());
            }
        }
        self.hand(plan, RoundEvent::Answer { tag, answer: Answer::of(&msg) })
    }

    /// Starts the writes of a round's requests, one vectored write per server: a push,
    /// push_pull or init straight from the caller's gradient slice (no copy of the values),
    /// a pull as its header, a row request with its block's payload.
    /// Returns the writes, and the servers of the requests that have no connection (lost,
    /// or unreachable at the last layout: handed to the plan as lost).
    fn start_writes<'g>(&mut self, batch: Vec<(u64, Sent)>, source: Source<'g>) -> Result<Started<'g>> {
        let mut jobs = Vec::new();
        let mut unreachable = Vec::new();
        let mut servers: Vec<u32> = batch.iter().map(|(_, s)| s.server).collect();
        servers.sort_unstable();
        servers.dedup();
        for server in servers {
            let mine = batch.iter().filter(|(_, s)| s.server == server);
            if self.conn(server)?.is_none() {
                unreachable.push(server);
                continue;
            }
            let mut frames = Vec::new();
            for &(tag, sent) in mine {
                let b = sent.block;
                let grads = match source {
                    Source::Tensors(grads) => grads,
                    Source::Rows(_) => &[][..],
                };
                let values = || match grads.get(b.tensor as usize) {
                    Some(Some(grad)) if b.offset + b.len <= grad.len() => Ok(&grad[b.offset..b.offset + b.len]),
                    // No gradient for the tensor: an empty push to each of its blocks.
                    Some(Some([])) => Ok(&[][..]),
                    _ => {
                        Err(RuntimeError::Usage(format!("no values of tensor {} to push to block {}", b.tensor, b.id)))
                    }
                };
                let row_payload = || match source {
                    Source::Rows(p) => p.by_block.get(&b.id).map(Vec::as_slice).ok_or_else(|| {
                        RuntimeError::Usage(format!("no rows of table {} for block {}", b.tensor, b.id))
                    }),
                    Source::Tensors(_) => {
                        Err(RuntimeError::Usage(format!("a row request of block {} in a tensor round", b.id)))
                    }
                };
                let (kind, clock, bytes): (Kind, Clock, &'g [u8]) = match sent.op {
                    Op::Push(clock) => (Kind::Push, clock, bytemuck::cast_slice(values()?)),
                    Op::Init => (Kind::Init, 0, bytemuck::cast_slice(values()?)),
                    Op::Pull(clock) => (Kind::Pull, clock, &[][..]),
                    Op::PushPull(clock) => (Kind::PushPull, clock, bytemuck::cast_slice(values()?)),
                    // No gradient for the table this clock: an empty Push.
                    Op::PushRows(clock) => match row_payload()? {
                        [] => (Kind::Push, clock, &[][..]),
                        rows => (Kind::PushRows, clock, rows),
                    },
                    Op::PullRows(clock) => (Kind::PullRows, clock, row_payload()?),
                };
                let id = self.next_request;
                self.next_request += 1;
                let Some(conn) = self.servers.get_mut(&server) else { break };
                frames.push((conn.writer().tensor_header(kind, id, b.id, clock, bytes.len())?, bytes));
                conn.pending.insert(id, (tag, sent));
            }
            if let Some(conn) = self.servers.get_mut(&server) {
                jobs.push(conn.write(server, frames));
            }
        }
        Ok((jobs, unreachable))
    }

    /// The connection to server `owner`, if open (`None`: lost, or unreachable at the last
    /// layout), or the error for a layout that does not list it.
    pub(super) fn conn(&mut self, owner: u32) -> Result<Option<&mut ServerConn>> {
        let listed = self.layout.as_ref().is_some_and(|l| l.servers.iter().any(|s| s.id == owner));
        match self.servers.get_mut(&owner) {
            Some(c) => Ok(Some(c)),
            None if listed => Ok(None),
            None => Err(RuntimeError::Protocol {
                peer: "scheduler".into(),
                what: format!("layout names server {owner}, which it does not list"),
            }),
        }
    }

    /// The connection to `server` failed (`why`): it is dropped (the next layout naming
    /// the server connects again), and the plan learns the server is lost: it resends
    /// what the server left unanswered, with what it held back for its window, to the
    /// owner a refreshed layout names.
    /// After the scheduler's `Shutdown` a lost request is the job's end instead.
    fn drop_server(&mut self, server: u32, why: RuntimeError, plan: &mut Round) -> Result<Vec<Action>> {
        let Some(conn) = self.servers.remove(&server) else {
            return Ok(Vec::new());
        };
        if conn.pending.is_empty() {
            // Nothing was lost (a server that left the job closes its connections).
            tracing::debug!(rank = self.rank, server, error = %why, "idle server connection closed");
            return Ok(Vec::new());
        }
        if self.shutting_down() {
            return Err(self.explain(RuntimeError::Closed(format!("server {server}"))));
        }
        tracing::warn!(rank = self.rank, server, error = %why, "server connection lost; resending after a layout refresh");
        self.hand(plan, RoundEvent::ServerLost { server })
    }

    /// After a failover, the servers the scheduler no longer lists are lost as a closed
    /// connection is: their host may be silent, and no close would ever come.
    fn drop_failed_over(&mut self, plan: &mut Round) -> Result<Vec<Action>> {
        let Some(notice) = self.ending.borrow_and_update().failover.clone() else { return Ok(Vec::new()) };
        let mut todo = Vec::new();
        for server in elasticps_node::session::servers_lost(&notice, self.servers.keys().copied()) {
            let lost = RuntimeError::Closed(format!("server {server} (lost: its blocks failed over)"));
            todo.extend(self.drop_server(server, lost, plan)?);
        }
        Ok(todo)
    }

    /// Connects to the layout's new servers (Hello) and drops those that left it. During a
    /// round (`in_round`) a server that cannot be reached is left out: the requests the plan
    /// sends it come back lost, and the plan refreshes the layout again.
    pub(super) async fn install_layout(&mut self, reply: Message, in_round: bool) -> Result<()> {
        let layout = match reply {
            Message::Control(Control::Layout(l)) => l,
            other => return Err(RuntimeError::unexpected("scheduler", "Layout", &other)),
        };
        for s in &layout.servers {
            if self.servers.contains_key(&s.id) {
                continue;
            }
            let (serial, hello_id) = (self.next_request, self.next_request + 1);
            self.next_request += 2;
            match ServerConn::connect(s, self.opts.codec.clone(), &self.credential, serial, hello_id).await {
                Ok(conn) => {
                    self.servers.insert(s.id, conn);
                }
                Err(e @ (RuntimeError::Closed(_) | RuntimeError::Io { .. })) if in_round => {
                    tracing::warn!(rank = self.rank, server = s.id, addr = %s.addr, error = %e, "server unreachable");
                }
                Err(e) => return Err(e),
            }
        }
        // Servers that left the job (scaled in): drop their connections, once no request
        // waits there (its reply, or the connection's close, is still to be read).
        self.servers.retain(|id, c| !c.is_idle() || layout.servers.iter().any(|s| s.id == *id));
        self.layout = Some(Arc::new(layout));
        Ok(())
    }
}

/// What [`Client::start_writes`] started: the writes, and the servers of the requests
/// that found no connection.
type Started<'g> = (Vec<WriteJob<'g>>, Vec<u32>);

/// Where a round's sent values come from: the caller's gradient slices (a tensor round),
/// or each block's row payload (a row round).
#[derive(Clone, Copy)]
enum Source<'g> {
    Tensors(&'g [Option<&'g [f32]>]),
    Rows(&'g RowPayloads),
}

/// Where a round's pulled values go: the caller's tensors at the pull's clock, or the
/// rows' places (a row pull; `None` for a row push).
enum Sink<'s, 'a, 'b, 'r> {
    Tensors(&'s mut Option<(Clock, &'a mut [Option<&'b mut [f32]>])>),
    Rows(Option<&'s mut RowSink<'r>>),
}

/// What a round's wait ended with.
enum Event {
    /// A write finished (or failed).
    Wrote(Written),
    /// A server's next frame header came (or its connection failed or closed: `None`).
    Header(u32, Result<Option<FrameHeader>>),
    /// The plan's poll_timeout came.
    Timer,
    /// The scheduler's link said something about the job (a failover, its end).
    Failover,
}

/// A round that waits for replies with none in flight (a bug in the plan, not a hang).
fn stalled(plan: &Round) -> RuntimeError {
    RuntimeError::Protocol {
        peer: "servers".into(),
        what: format!("the round waits with no request in flight ({} refreshes)", plan.refreshes()),
    }
}
