//! The world of the worker's client machine ([`elasticps_node::worker::Client`]) over the
//! client's server connections, run by [`crate::driver::drive`].
//!
//! The machine decides everything (which servers to dial, what to say first, what to
//! send where and when, how many requests may be in flight to one server, how long each
//! may wait, what to resend, which connections to drop); this world only dials, writes
//! what it is told (a push's values straight from the caller's gradient slice), reads
//! the replies (a pull's values straight into the caller's tensor), fetches the layout
//! when asked, and hands every event back ([`ClientEvent`]); the loop sleeps until the
//! machine's `poll_timeout`.

use std::collections::VecDeque;
use std::future::Future;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Duration;

use elasticps_core::model::BlockSpec;
use elasticps_core::sync::Clock;
use elasticps_node::worker::{self, ClientEvent, Effect, Finished, PushOp, RowsOp, Target};
use elasticps_node::{ConnId, Machine};
use elasticps_wire::{Codec, Control, FrameHeader, Layout, Message};
use futures::StreamExt;
use futures::stream::FuturesUnordered;

use super::frames::{Links, Sink, Source, Tensors};
use super::rows::{RowPayloads, RowSink};
use super::server_conn::{self, Sent, ServerConn, WriteJob, Written};
use super::{Client, Waits};
use crate::CALL_TIMEOUT;
use crate::driver::{self, World};
use crate::error::{Result, RuntimeError};
use crate::session::SchedLink;
use crate::timer::Timer;

/// How a run ended.
pub(super) enum Outcome {
    /// The round is done.
    Round(Finished),
    /// The row round must be planned again (a block of its table was split under it).
    Replan,
    /// The call's answer.
    Answered(Message),
    /// Every effect was carried out (a layout installed outside a round).
    Settled,
}

impl Client {
    /// One round trip with every server at once: for each block, the push (if any),
    /// then, once the block's server acknowledged all of this round's pushes, the pull
    /// (if any), or both in one push_pull ([`super::ClientOptions::fuse`]); a block whose
    /// server answered `Moved` is resent after a layout refresh.
    pub(super) async fn round_direct(
        &mut self,
        push: Option<(PushOp, &[Option<&[f32]>])>,
        mut pull: Option<(Clock, &mut [Option<&mut [f32]>])>,
    ) -> Result<()> {
        self.follow_pushed_layout().await?;
        // Gradient compression: each tensor's gradient through its error feedback; each
        // block gets its part as a sparse payload.
        let sparse = match push {
            Some((PushOp::Grad(_), grads)) => self.compression.compress(grads),
            _ => Vec::new(),
        };
        let push_mask: Vec<bool> = push.map_or_else(Vec::new, |(_, g)| g.iter().map(Option::is_some).collect());
        let pull_mask: Vec<bool> =
            pull.as_ref().map_or_else(Vec::new, |(_, p)| p.iter().map(Option::is_some).collect());
        let mut effects = Vec::new();
        let iteration = self.machine.start(
            self.clock.now(),
            push.map(|(op, _)| (op, &push_mask[..])),
            pull.as_ref().map(|(clock, _)| (*clock, &pull_mask[..])),
            &mut effects,
        )?;
        if let (Some(m), Some(it)) = (&self.opts.metrics, iteration) {
            m.iteration(it.clock, it.since_last_us.map(Duration::from_micros));
        }
        let grads = push.map_or(&[][..], |(_, g)| g);
        let blocks = self.layout().map_or(&[][..], |l| &l.partition.blocks[..]);
        let dtypes = (0..self.layout().map_or(0, |l| l.partition.tensors.len() as u32)).map(|t| self.wire_dtype(t));
        let wire = self.layout().map_or(&[][..], |l| &l.wire[..]);
        let tensors = Tensors::new(grads, dtypes.collect(), &sparse, blocks, wire);
        match self.run(effects, Source::Tensors(&tensors), Sink::Tensors(&mut pull), false).await? {
            Outcome::Round(finished) => {
                self.round_done(finished);
                Ok(())
            }
            _ => Err(unexpected_outcome()),
        }
    }

    /// A row round of table `table` ([`RowsOp`]): `payloads` holds the request of each
    /// block to send to (every block of the table for a push, those holding rows asked
    /// for a pull), `sink` where a pull's rows go. `Ok(false)`: a block of the table was
    /// split under it, plan it again.
    pub(super) async fn rows_round(
        &mut self,
        table: u32,
        op: RowsOp,
        payloads: &RowPayloads,
        sink: Option<&mut RowSink<'_>>,
    ) -> Result<bool> {
        let wanted = |b: &BlockSpec| payloads.by_block.contains_key(&b.id);
        let mut effects = Vec::new();
        self.machine.start_rows(self.clock.now(), table, op, &wanted, &mut effects)?;
        match self.run(effects, Source::Rows(payloads), Sink::Rows(sink), false).await? {
            Outcome::Round(finished) => {
                self.round_done(finished);
                Ok(true)
            }
            Outcome::Replan => Ok(false),
            _ => Err(unexpected_outcome()),
        }
    }

    /// Sends `msg` to `target` outside a round (following `Moved`, waiting out a
    /// migration: the machine's rules) and returns the answer.
    pub(super) async fn server_call(&mut self, target: Target, msg: Control) -> Result<Message> {
        let mut effects = Vec::new();
        self.machine.call(self.clock.now(), target, msg, &mut effects);
        match self.run(effects, Source::Tensors(&Tensors::default()), Sink::None, false).await? {
            Outcome::Answered(msg) => Ok(msg),
            _ => Err(unexpected_outcome()),
        }
    }

    /// Installs the layout the scheduler answered with: dials the servers it adds (their
    /// `Hello` is read by the next run), drops those that left it.
    pub(super) async fn install_layout(&mut self, reply: Message) -> Result<()> {
        let layout = match reply {
            Message::Control(Control::Layout(l)) => Arc::new(l),
            other => return Err(RuntimeError::unexpected("scheduler", "Layout", &other)),
        };
        let mut effects = Vec::new();
        self.machine.handle(self.clock.now(), ClientEvent::Layout(layout), &mut effects);
        self.run(effects, Source::Tensors(&Tensors::default()), Sink::None, true).await.map(|_| ())
    }

    /// Hands the machine the layout the scheduler sent unasked (the balancer changed the
    /// wire dtype of blocks, `--balance-compress`), which it installs if newer than its
    /// own: from this round on, those blocks travel in it.
    async fn follow_pushed_layout(&mut self) -> Result<()> {
        let Some(layout) = self.ending.borrow().layout.clone() else { return Ok(()) };
        let mut effects = Vec::new();
        self.machine.handle(self.clock.now(), ClientEvent::LayoutPushed(layout), &mut effects);
        if effects.is_empty() {
            return Ok(());
        }
        self.run(effects, Source::Tensors(&Tensors::default()), Sink::None, true).await.map(|_| ())
    }

    /// Records a finished round's waits and sends its load report when one is due.
    fn round_done(&mut self, finished: Finished) {
        self.waits = Waits { per_server: finished.per_server_us.into_iter().map(Duration::from_micros).collect() };
        if let Some(m) = &self.opts.metrics {
            for (server, waited) in finished.waited {
                m.waited(server, Duration::from_micros(waited));
            }
        }
        if let Some(report) = finished.report {
            let _ = self.sched.notify(Control::WorkerLoad(report).into());
        }
    }

    /// Runs the machine from `effects` in [`driver::drive`], in a [`Wire`]: until it says
    /// how the run ends (its writes done) or, with `settle`, until nothing is left to
    /// carry out. Sent values come from `source`, pulled values go into `sink`.
    async fn run<'g>(
        &mut self,
        effects: Vec<Effect>,
        source: Source<'g>,
        sink: Sink<'_, '_, '_, '_>,
        settle: bool,
    ) -> Result<Outcome> {
        for conn in self.servers.values_mut() {
            conn.start_run();
        }
        let mut wire = Wire {
            links: Links { rank: self.rank, servers: &mut self.servers, ending: &mut self.ending, clock: self.clock },
            codec: &self.opts.codec,
            sched: &self.sched,
            writes: FuturesUnordered::new(),
            start_write: server_conn::run_write,
            source,
            sink,
            outcome: None,
            settle,
            turn: 0,
        };
        // One timer for the whole run, armed at the machine's poll_timeout.
        let mut timer = Timer::new(self.clock);
        driver::drive(&mut self.machine, &mut wire, &mut timer, VecDeque::from(effects)).await
    }
}

/// The world of one run of the client machine ([`Client::run`]): its [`Links`], its
/// writes in flight, where sent values come from and pulled ones go, and how it ends.
struct Wire<'c, 'g, 's, 'a, 'b, 'r, W> {
    links: Links<'c>,
    codec: &'c Codec,
    sched: &'c SchedLink,
    /// The writes in flight (one per connection and batch of requests).
    writes: FuturesUnordered<W>,
    /// Makes a write of a job ([`server_conn::run_write`]).
    start_write: fn(WriteJob<'g>) -> W,
    source: Source<'g>,
    sink: Sink<'s, 'a, 'b, 'r>,
    /// How the run ends, once the machine said it (its writes may still be in flight).
    outcome: Option<Outcome>,
    /// End once every effect is carried out (a layout installed outside a round).
    settle: bool,
    /// Which connection's header is polled first ([`server_conn::poll_any_header`]).
    turn: usize,
}

/// What woke a run (the machine's timeout aside: [`driver::drive`] waits for that).
enum Woken {
    /// A write finished (or failed).
    Wrote(Written),
    /// A connection's next frame header came (or it failed or closed: `None`).
    Header(ConnId, Result<Option<FrameHeader>>),
    /// The scheduler's link said something about the job (a failover, its end).
    Failover,
}

impl<W: Future<Output = Written>> World<worker::Client> for Wire<'_, '_, '_, '_, '_, '_, W> {
    type Woken = Woken;
    type End = Result<Outcome>;

    /// Waits for a write to finish, a frame header, or word of a failover.
    async fn wait(&mut self) -> Woken {
        self.turn = self.turn.wrapping_add(1);
        let (turn, servers) = (self.turn, &mut *self.links.servers);
        tokio::select! {
            Some(written) = self.writes.next(), if !self.writes.is_empty() => Woken::Wrote(written),
            (conn, got) = std::future::poll_fn(|cx| server_conn::poll_any_header(servers, turn, cx)) => {
                Woken::Header(conn, got)
            }
            Ok(()) = self.links.ending.changed() => Woken::Failover,
        }
    }

    /// Hands the machine what came: a frame (its payload read first, a pull's values
    /// into the sink), a lost connection, a failover, or its timeout (`None`).
    async fn feed(
        &mut self,
        machine: &mut worker::Client,
        now_us: u64,
        woken: Option<Woken>,
        out: &mut Vec<Effect>,
    ) -> ControlFlow<Result<Outcome>> {
        let links = &mut self.links;
        let fed = match woken {
            None => {
                machine.handle(now_us, ClientEvent::Timeout, out);
                Ok(())
            }
            Some(Woken::Wrote((_, None | Some(Ok(()))))) => Ok(()),
            Some(Woken::Wrote((conn, Some(Err(e))))) => links.closed(machine, conn, e, out),
            Some(Woken::Header(conn, Ok(Some(header)))) => {
                links.on_header(machine, conn, header, &mut self.sink, out).await
            }
            Some(Woken::Header(conn, Ok(None))) => {
                let name = links.servers.get(&conn).map_or_else(String::new, |c| c.name.clone());
                links.closed(machine, conn, RuntimeError::Closed(name), out)
            }
            Some(Woken::Header(conn, Err(e))) => links.closed(machine, conn, e, out),
            Some(Woken::Failover) => {
                links.failover(machine, out);
                Ok(())
            }
        };
        go_on(fed)
    }

    /// Carries out one effect (a request with the requests right behind it, as one write
    /// per connection), feeding its outcome back.
    async fn carry_out(
        &mut self,
        machine: &mut worker::Client,
        _now_us: u64,
        effect: Effect,
        queue: &mut VecDeque<Effect>,
    ) -> ControlFlow<Result<Outcome>> {
        let mut more = Vec::new();
        let carried = self.carry_out_into(machine, effect, queue, &mut more).await;
        queue.extend(more);
        go_on(carried)
    }

    /// Once every effect is carried out: the run's outcome when its writes are done
    /// (with `settle`, when there is nothing left), or the error of a run that would wait
    /// with nothing in flight and no timer (a bug in the machine, not a hang).
    fn settled(&mut self, machine: &worker::Client) -> ControlFlow<Result<Outcome>> {
        if !self.writes.is_empty() {
            return ControlFlow::Continue(());
        }
        match self.outcome.take() {
            Some(outcome) => ControlFlow::Break(Ok(outcome)),
            None if self.settle => ControlFlow::Break(Ok(Outcome::Settled)),
            None if machine.poll_timeout().is_none() => ControlFlow::Break(Err(stalled())),
            None => ControlFlow::Continue(()),
        }
    }
}

impl<'g, W: Future<Output = Written>> Wire<'_, 'g, '_, '_, '_, '_, W> {
    /// Carries out `effect` (taking the requests right behind it from `queue`): dials,
    /// writes, drops, layout fetches; the machine's effects in answer go to `more`; notes
    /// how the run ends.
    async fn carry_out_into(
        &mut self,
        machine: &mut worker::Client,
        effect: Effect,
        queue: &mut VecDeque<Effect>,
        more: &mut Vec<Effect>,
    ) -> Result<()> {
        let links = &mut self.links;
        match effect {
            Effect::Request { conn, tag, server, block, op } => {
                // This request and every one right behind it: one write per connection.
                let mut batch = vec![(conn, tag, Sent { server, block, op })];
                while let Some(&Effect::Request { conn, tag, server, block, op }) = queue.front() {
                    batch.push((conn, tag, Sent { server, block, op }));
                    queue.pop_front();
                }
                let mut jobs = Vec::new();
                let started = links.start_writes(machine, batch, self.source, &mut jobs, more);
                self.writes.extend(jobs.into_iter().map(self.start_write));
                started?;
            }
            Effect::Dial { conn, server, addr } => match ServerConn::connect(server, &addr, self.codec.clone()).await {
                Ok(c) => {
                    links.servers.insert(conn, c);
                    links.feed(machine, ClientEvent::Dialled { conn }, more);
                }
                Err(e @ (RuntimeError::Closed(_) | RuntimeError::Io { .. })) => {
                    tracing::warn!(rank = links.rank, server, %addr, error = %e, "server unreachable");
                    links.feed(machine, ClientEvent::Closed { conn }, more);
                }
                Err(e) => return Err(e),
            },
            Effect::Send { conn, request_id, msg } => {
                let sent = match links.servers.get(&conn) {
                    Some(c) => c.send(request_id, msg).await,
                    None => Err(RuntimeError::Closed(format!("connection {conn}"))),
                };
                if let Err(e) = sent {
                    links.closed(machine, conn, e, more)?;
                }
            }
            Effect::Close { conn } => drop(links.servers.remove(&conn)),
            Effect::RefreshLayout => {
                let layout = self.fetch_layout().await?;
                self.links.feed(machine, ClientEvent::Layout(layout), more);
            }
            Effect::RoundDone(finished) => self.outcome = Some(Outcome::Round(finished)),
            Effect::Replan { .. } => self.outcome = Some(Outcome::Replan),
            Effect::Answered(msg) => self.outcome = Some(Outcome::Answered(msg)),
            Effect::Failed(e) => return Err(super::explain(self.links.ending, e.into())),
        }
        Ok(())
    }

    /// The scheduler's current layout.
    async fn fetch_layout(&mut self) -> Result<Arc<Layout>> {
        let what = || "the scheduler to send the layout".into();
        let reply = super::call_scheduler(self.sched, Control::GetLayout.into(), CALL_TIMEOUT, what).await?;
        match reply {
            Message::Control(Control::Layout(l)) => Ok(Arc::new(l)),
            other => Err(RuntimeError::unexpected("scheduler", "Layout", &other)),
        }
    }
}

/// The loop goes on after `Ok`, ends with the error.
fn go_on(done: Result<()>) -> ControlFlow<Result<Outcome>> {
    match done {
        Ok(()) => ControlFlow::Continue(()),
        Err(e) => ControlFlow::Break(Err(e)),
    }
}

/// A run that waits with nothing in flight and no timer (a bug in the machine, not a
/// hang).
fn stalled() -> RuntimeError {
    RuntimeError::Protocol { peer: "servers".into(), what: "the worker waits with no request in flight".into() }
}

fn unexpected_outcome() -> RuntimeError {
    RuntimeError::Protocol { peer: "servers".into(), what: "the worker's client ended a run unexpectedly".into() }
}
