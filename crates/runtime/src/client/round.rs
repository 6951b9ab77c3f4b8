//! The driver loop: carries out the effects of the worker's client machine
//! ([`elasticps_node::worker::Client`]) over the client's server connections.
//!
//! The machine decides everything (which servers to dial, what to say first, what to
//! send where and when, how many requests may be in flight to one server, how long each
//! may wait, what to resend, which connections to drop); this loop only dials, writes
//! what it is told (a push's values straight from the caller's gradient slice), reads
//! the replies (a pull's values straight into the caller's tensor), fetches the layout
//! when asked, hands every event back ([`ClientEvent`]), and sleeps until the machine's
//! `poll_timeout`.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use elasticps_core::model::BlockSpec;
use elasticps_core::sync::Clock;
use elasticps_node::worker::{ClientEvent, Effect, Finished, PushOp, RowsOp, Target};
use elasticps_node::{ConnId, Machine};
use elasticps_wire::{Control, FrameHeader, Layout, Message};
use futures::StreamExt;
use futures::stream::FuturesUnordered;

use super::frames::{Sink, Source};
use super::rows::{RowPayloads, RowSink};
use super::server_conn::{self, Sent, ServerConn, WriteJob, Written};
use super::{Client, Waits};
use crate::CALL_TIMEOUT;
use crate::error::{Result, RuntimeError};
use crate::timer::Timer;

/// How a run of the loop ended.
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
    pub(super) async fn round(
        &mut self,
        push: Option<(PushOp, &[Option<&[f32]>])>,
        mut pull: Option<(Clock, &mut [Option<&mut [f32]>])>,
    ) -> Result<()> {
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
        match self.run(effects, Source::Tensors(grads), Sink::Tensors(&mut pull), false).await? {
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
        match self.run(effects, Source::Tensors(&[]), Sink::None, false).await? {
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
        self.run(effects, Source::Tensors(&[]), Sink::None, true).await.map(|_| ())
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

    /// Hands the machine `event` now; its effects join `todo`.
    pub(super) fn feed(&mut self, event: ClientEvent<'_>, todo: &mut VecDeque<Effect>) {
        self.machine.handle(self.clock.now(), event, &mut self.effects);
        todo.extend(self.effects.drain(..));
    }

    /// Carries out `effects` and what follows them, until the machine says how the run
    /// ends (its writes done) or, with `settle`, until nothing is left to carry out:
    /// writes its sends (values from `source`), reads the replies (pulled values into
    /// `sink`), fetches the layout when asked, wakes the machine at its `poll_timeout`.
    async fn run<'g>(
        &mut self,
        effects: Vec<Effect>,
        source: Source<'g>,
        mut sink: Sink<'_, '_, '_, '_>,
        settle: bool,
    ) -> Result<Outcome> {
        for conn in self.servers.values_mut() {
            conn.start_run();
        }
        let mut writes = FuturesUnordered::new();
        let mut todo = VecDeque::from(effects);
        let mut outcome = None;
        // One timer for the whole run, armed at the machine's poll_timeout (`armed`).
        let mut timer = Timer::new(self.clock);
        let mut armed = None;
        let mut turn = 0usize;
        loop {
            let mut jobs = Vec::new();
            let carried = self.carry_out(&mut todo, &mut jobs, source, &mut outcome).await;
            writes.extend(jobs.into_iter().map(server_conn::run_write));
            carried?;
            if writes.is_empty() {
                match outcome.take() {
                    Some(outcome) => return Ok(outcome),
                    None if settle => return Ok(Outcome::Settled),
                    None => {}
                }
            }
            let wake = self.machine.poll_timeout();
            if wake.is_none() && writes.is_empty() && outcome.is_none() {
                return Err(stalled());
            }
            if wake != armed {
                // No wake-up (`None`): only writes to wait for, the timer stays quiet.
                timer.arm(wake);
                armed = wake;
            }
            turn = turn.wrapping_add(1);
            let event = tokio::select! {
                Some(written) = writes.next(), if !writes.is_empty() => Event::Wrote(written),
                (conn, got) = std::future::poll_fn(|cx| server_conn::poll_any_header(&mut self.servers, turn, cx)) => {
                    Event::Header(conn, got)
                }
                () = timer.fired() => Event::Timer,
                Ok(()) = self.ending.changed() => Event::Failover,
            };
            match event {
                Event::Wrote((_, None | Some(Ok(())))) => {}
                Event::Wrote((conn, Some(Err(e)))) => self.closed(conn, e, &mut todo)?,
                Event::Header(conn, Ok(Some(header))) => self.on_header(conn, header, &mut sink, &mut todo).await?,
                Event::Header(conn, Ok(None)) => {
                    let name = self.servers.get(&conn).map_or_else(String::new, |c| c.name.clone());
                    self.closed(conn, RuntimeError::Closed(name), &mut todo)?
                }
                Event::Header(conn, Err(e)) => self.closed(conn, e, &mut todo)?,
                Event::Failover => {
                    let Some(notice) = self.ending.borrow_and_update().failover.clone() else { continue };
                    tracing::info!(rank = self.rank, "a server failed over: requests to it go to the promoted owners");
                    self.feed(ClientEvent::Failover(&notice), &mut todo);
                }
                Event::Timer => {
                    armed = None;
                    self.feed(ClientEvent::Timeout, &mut todo);
                }
            }
        }
    }

    /// Carries out the machine's effects in order, feeding their outcomes back: dials,
    /// writes (a batch of requests as one write per connection, into `jobs`), drops,
    /// layout fetches; notes how the run ends in `outcome`.
    async fn carry_out<'g>(
        &mut self,
        todo: &mut VecDeque<Effect>,
        jobs: &mut Vec<WriteJob<'g>>,
        source: Source<'g>,
        outcome: &mut Option<Outcome>,
    ) -> Result<()> {
        while let Some(effect) = todo.pop_front() {
            match effect {
                Effect::Request { conn, tag, server, block, op } => {
                    // This request and every one right behind it: one write per connection.
                    let mut batch = vec![(conn, tag, Sent { server, block, op })];
                    while let Some(&Effect::Request { conn, tag, server, block, op }) = todo.front() {
                        batch.push((conn, tag, Sent { server, block, op }));
                        todo.pop_front();
                    }
                    self.start_writes(batch, source, jobs, todo)?;
                }
                Effect::Dial { conn, server, addr } => {
                    match ServerConn::connect(server, &addr, self.opts.codec.clone()).await {
                        Ok(c) => {
                            self.servers.insert(conn, c);
                            self.feed(ClientEvent::Dialled { conn }, todo);
                        }
                        Err(e @ (RuntimeError::Closed(_) | RuntimeError::Io { .. })) => {
                            tracing::warn!(rank = self.rank, server, %addr, error = %e, "server unreachable");
                            self.feed(ClientEvent::Closed { conn }, todo);
                        }
                        Err(e) => return Err(e),
                    }
                }
                Effect::Send { conn, request_id, msg } => {
                    let sent = match self.servers.get(&conn) {
                        Some(c) => c.send(request_id, msg).await,
                        None => Err(RuntimeError::Closed(format!("connection {conn}"))),
                    };
                    if let Err(e) = sent {
                        self.closed(conn, e, todo)?;
                    }
                }
                Effect::Close { conn } => drop(self.servers.remove(&conn)),
                Effect::RefreshLayout => {
                    let layout = self.fetch_layout().await?;
                    self.feed(ClientEvent::Layout(layout), todo);
                }
                Effect::RoundDone(finished) => *outcome = Some(Outcome::Round(finished)),
                Effect::Replan { .. } => *outcome = Some(Outcome::Replan),
                Effect::Answered(msg) => *outcome = Some(Outcome::Answered(msg)),
                Effect::Failed(e) => return Err(self.explain(e.into())),
            }
        }
        Ok(())
    }

    /// The scheduler's current layout.
    async fn fetch_layout(&mut self) -> Result<Arc<Layout>> {
        let reply = self
            .call_scheduler(Control::GetLayout.into(), CALL_TIMEOUT, || "the scheduler to send the layout".into())
            .await?;
        match reply {
            Message::Control(Control::Layout(l)) => Ok(Arc::new(l)),
            other => Err(RuntimeError::unexpected("scheduler", "Layout", &other)),
        }
    }
}

/// What a run's wait ended with.
enum Event {
    /// A write finished (or failed).
    Wrote(Written),
    /// A connection's next frame header came (or it failed or closed: `None`).
    Header(ConnId, Result<Option<FrameHeader>>),
    /// The machine's poll_timeout came.
    Timer,
    /// The scheduler's link said something about the job (a failover, its end).
    Failover,
}

/// A run that waits with nothing in flight and no timer (a bug in the machine, not a
/// hang).
fn stalled() -> RuntimeError {
    RuntimeError::Protocol { peer: "servers".into(), what: "the worker waits with no request in flight".into() }
}

fn unexpected_outcome() -> RuntimeError {
    RuntimeError::Protocol { peer: "servers".into(), what: "the worker's client ended a run unexpectedly".into() }
}
