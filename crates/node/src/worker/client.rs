//! The worker's client as one machine ([`Client`]): its connections to the servers, the
//! layout it installs, the `Hello` each connection says first, the round (with its window
//! and deadlines) and the calls outside a round. The runtime's client and the harness's
//! worker drive it; they only move bytes and time.
//!
//! - **The connection set.** Installing a layout dials every server it lists that has no
//!   connection ([`Effect::Dial`]); a connection to a server the layout no longer lists
//!   is closed once nothing waits on it, one to a server listed at another address (a
//!   replaced server) at once, as a lost one. A connection that closes (or could not be
//!   opened) is forgotten; the next layout dials the server again.
//! - **`Hello`.** A dialled connection says `Hello` first ([`HELLO_ID`]); what the answer
//!   means is [`hello_answer`] (`NotReady`: again after a while). Requests for a server
//!   wait in the machine until its `Hello` is accepted.
//! - **The round.** [`Client::start`] and [`Client::start_rows`] plan a [`Round`]; its
//!   sends go out as [`Effect::Request`] (the driver puts the values in), its layout
//!   refreshes as [`Effect::RefreshLayout`], its end as [`Effect::RoundDone`]. A row round
//!   whose table was split under it is planned again ([`Effect::Replan`]) at most
//!   [`super::MAX_RECUTS`] times ([`replan_rows`]). A round left unfinished (failed, or
//!   dropped by its driver) closes the connections it waits on: their late replies are
//!   not the next round's.
//! - **Calls.** [`Client::call`]: one request outside a round, following `Moved` and
//!   waiting out `NotReady` (`call.rs`), answered [`Effect::Answered`].

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use elasticps_core::model::BlockSpec;
use elasticps_core::sync::Clock;
use elasticps_wire::{Control, Credential, Layout, Message, WorkerLoad};

use super::call::{Call, Stage as CallStage, Step, Target};
use super::conn::{HelloAnswer, hello_answer, replan_rows};
use super::{Action, Answer, Iteration, Op, PushOp, Round, RoundEvent, RowsOp, Tag, Worker};
use crate::{ConnId, NodeError, Result};

/// The request id of `Hello` on a server connection (a call's ids follow it, a round's
/// tags are at least 2^32).
pub const HELLO_ID: u64 = 1;

/// What happened, for the client ([`Client::handle`](crate::Machine::handle)).
#[derive(Debug)]
pub enum Event<'a> {
    /// The scheduler's layout (the answer to `DefineModel` or to [`Effect::RefreshLayout`]).
    Layout(Arc<Layout>),
    /// A layout the scheduler sent unasked (the balancer changed the wire dtype of blocks,
    /// `--balance-compress`): installed as [`Event::Layout`] if its epoch is newer than the
    /// installed one's, else ignored (an older push overtaken by a refresh).
    LayoutPushed(Arc<Layout>),
    /// The connection of [`Effect::Dial`] is open.
    Dialled {
        /// The connection.
        conn: ConnId,
    },
    /// A frame on `conn`: the answer to `Hello`, to a call, or to a round's request.
    Frame {
        /// The connection.
        conn: ConnId,
        /// The request it answers.
        request_id: u64,
        /// The message.
        msg: &'a Message,
    },
    /// The answer to a round's request `tag` as the driver read it without decoding it
    /// (a pull's values went straight into the caller's tensor).
    Answer {
        /// The request.
        tag: Tag,
        /// What the reply said.
        answer: Answer<'a>,
    },
    /// `conn` closed, or could not be opened: the driver forgets it.
    Closed {
        /// The connection.
        conn: ConnId,
    },
    /// The scheduler's failover notice (`Replicas`): the servers it no longer lists are
    /// lost as a closed connection is (their host may be silent).
    Failover(&'a Message),
    /// The time of [`Client::poll_timeout`](crate::Machine::poll_timeout) came.
    Timeout,
}

/// What the driver does for the client.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // taken out one at a time, never stored long
pub enum Effect {
    /// Open connection `conn` to server `server` at `addr`; then [`Event::Dialled`] or
    /// [`Event::Closed`].
    Dial {
        /// The connection's id (the server's id in its low 32 bits).
        conn: ConnId,
        /// The server.
        server: u32,
        /// Its data address.
        addr: String,
    },
    /// Write `msg` as request `request_id` on `conn` (a `Hello`, a call).
    Send {
        /// The connection.
        conn: ConnId,
        /// The request id.
        request_id: u64,
        /// The message.
        msg: Message,
    },
    /// Write a round's request on `conn`, with request id `tag`: `op` of `block`, its
    /// values taken from the caller's tensors (or rows) by the driver.
    Request {
        /// The connection.
        conn: ConnId,
        /// The request's tag (its request id).
        tag: Tag,
        /// The server.
        server: u32,
        /// The block.
        block: BlockSpec,
        /// What to send.
        op: Op,
    },
    /// Close `conn`; nothing more is read from it.
    Close {
        /// The connection.
        conn: ConnId,
    },
    /// Fetch the layout from the scheduler and hand it back ([`Event::Layout`]).
    RefreshLayout,
    /// The round is done.
    RoundDone(Finished),
    /// The row round of `table` was split under it: plan its payloads from the current
    /// layout and start it again ([`Client::start_rows`]).
    Replan {
        /// The table.
        table: u32,
    },
    /// The call's answer.
    Answered(Message),
    /// The round or the call failed.
    Failed(NodeError),
}

/// What a finished round measured ([`Effect::RoundDone`]).
#[derive(Debug, Default)]
pub struct Finished {
    /// The servers waited for, in id order, with how long (µs).
    pub waited: Vec<(u32, u64)>,
    /// The wait per server id, µs, covering every server of the layout.
    pub per_server_us: Vec<u64>,
    /// The load report to send to the scheduler, when one is due.
    pub report: Option<WorkerLoad>,
}

/// Where one connection stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// [`Effect::Dial`] given.
    Dialling,
    /// `Hello` said first at `first_us`; said again at `again_us` if set.
    Hello { first_us: u64, again_us: Option<u64> },
    /// `Hello` accepted.
    Ready,
}

/// A request waiting for its connection's `Hello` to be accepted.
#[derive(Debug)]
enum Held {
    Request { tag: Tag, block: BlockSpec, op: Op },
    Call { request_id: u64, msg: Message },
}

/// One server's connection.
#[derive(Debug)]
struct Conn {
    id: ConnId,
    addr: String,
    state: State,
    held: Vec<Held>,
    /// The layout no longer lists the server: closed once nothing waits on it.
    departing: bool,
}

/// The worker's client (see the module).
#[derive(Debug)]
pub struct Client {
    worker: Worker,
    credential: Credential,
    layout: Option<Arc<Layout>>,
    conns: BTreeMap<u32, Conn>,
    /// Connections dialled so far (the high 32 bits of a connection's id).
    dialled: u64,
    round: Option<Round>,
    /// The table of the row round under way.
    rows: Option<u32>,
    /// Times the row call under way was planned again.
    recuts: u32,
    /// The last effect was [`Effect::Replan`]: the next row round is the same call's.
    replanning: bool,
    call: Option<Call>,
    next_call_id: u64,
    /// Some connection is departing.
    departing: bool,
    /// When to say `Hello` again to which server (an entry whose connection no longer
    /// waits for that is skipped).
    hello_wakes: BTreeSet<(u64, u32)>,
}

impl Client {
    /// The client of `worker` (its rounds' plans), saying `credential` in every `Hello`.
    pub fn new(worker: Worker, credential: Credential) -> Self {
        Self {
            worker,
            credential,
            layout: None,
            conns: BTreeMap::new(),
            dialled: 0,
            round: None,
            rows: None,
            recuts: 0,
            replanning: false,
            call: None,
            next_call_id: HELLO_ID + 1,
            departing: false,
            hello_wakes: BTreeSet::new(),
        }
    }

    /// The rounds' plans and the load report.
    pub fn worker(&self) -> &Worker {
        &self.worker
    }

    /// The layout installed last.
    pub fn layout(&self) -> Option<&Arc<Layout>> {
        self.layout.as_ref()
    }

    /// The round under way.
    pub fn round(&self) -> Option<&Round> {
        self.round.as_ref()
    }

    /// The server of connection `conn`, if it is still its server's connection.
    pub fn server_of(&self, conn: ConnId) -> Option<u32> {
        let server = conn as u32;
        self.conns.get(&server).is_some_and(|c| c.id == conn).then_some(server)
    }

    /// The open connections: (server, connection).
    pub fn connections(&self) -> impl Iterator<Item = (u32, ConnId)> + '_ {
        self.conns.iter().map(|(s, c)| (*s, c.id))
    }

    /// Starts a round over the installed layout ([`Worker::start`]); its first requests
    /// go into `out`. The round counted an iteration, if it pushes a gradient.
    pub fn start(
        &mut self,
        now_us: u64,
        push: Option<(PushOp, &[bool])>,
        pull: Option<(Clock, &[bool])>,
        out: &mut Vec<Effect>,
    ) -> Result<Option<Iteration>> {
        self.abandon(out);
        let layout = self.installed()?;
        let (round, actions) = self.worker.start(now_us, &layout, push, pull)?;
        let iteration = round.iteration();
        self.round = Some(round);
        self.rows = None;
        self.on_round(now_us, Ok(actions), out);
        Ok(iteration)
    }

    /// Starts a row round of table `table` ([`Worker::start_rows`]); after
    /// [`Effect::Replan`], the same call's round planned again.
    pub fn start_rows(
        &mut self,
        now_us: u64,
        table: u32,
        op: RowsOp,
        wanted: &dyn Fn(&BlockSpec) -> bool,
        out: &mut Vec<Effect>,
    ) -> Result<()> {
        self.abandon(out);
        if !std::mem::take(&mut self.replanning) {
            self.recuts = 0;
        }
        let layout = self.installed()?;
        let (round, actions) = self.worker.start_rows(now_us, &layout, table, op, wanted)?;
        self.round = Some(round);
        self.rows = Some(table);
        self.on_round(now_us, Ok(actions), out);
        Ok(())
    }

    /// Sends `msg` to `target` outside a round; its answer comes as [`Effect::Answered`].
    pub fn call(&mut self, now_us: u64, target: Target, msg: Control, out: &mut Vec<Effect>) {
        self.abandon(out);
        self.call = Some(Call::new(target, msg, now_us));
        self.send_call(now_us, out);
    }

    fn installed(&self) -> Result<Arc<Layout>> {
        self.layout.clone().ok_or_else(|| NodeError::Refused("register_model first".into()))
    }

    /// A round or call left unfinished: the connections it waits on are closed (their
    /// late replies are not the next one's) and dialled again. A server without a
    /// connection is dialled by the next layout that lists it (or by a call to it).
    fn abandon(&mut self, out: &mut Vec<Effect>) {
        let mut busy: Vec<u32> = Vec::new();
        if let Some(round) = self.round.take() {
            busy.extend(self.conns.keys().copied().filter(|s| round.waiting_on(*s).next().is_some()));
        }
        if let Some((_, server)) = self.call.take().and_then(|c| c.awaits()) {
            busy.push(server);
        }
        for server in busy {
            if let Some(c) = self.conns.remove(&server) {
                tracing::debug!(server, "a request left unanswered: its connection starts afresh");
                out.push(Effect::Close { conn: c.id });
                self.dial(server, c.addr, out);
            }
        }
    }

    /// Dials every server of the layout that has no connection.
    fn connect_listed(&mut self, out: &mut Vec<Effect>) {
        let Some(layout) = self.layout.clone() else { return };
        for s in &layout.servers {
            match self.conns.get_mut(&s.id) {
                Some(c) => c.departing = false,
                None => self.dial(s.id, s.addr.clone(), out),
            }
        }
    }

    /// Opens a new connection to `server` at `addr`.
    fn dial(&mut self, server: u32, addr: String, out: &mut Vec<Effect>) {
        self.dialled += 1;
        let id = (self.dialled << 32) | ConnId::from(server);
        out.push(Effect::Dial { conn: id, server, addr: addr.clone() });
        self.conns.insert(server, Conn { id, addr, state: State::Dialling, held: Vec::new(), departing: false });
    }

    /// Installs `layout`: closes the connections of replaced servers (lost), marks those
    /// of servers it no longer lists departing, dials the new ones.
    fn install(&mut self, now_us: u64, layout: Arc<Layout>, out: &mut Vec<Effect>) {
        let replaced: Vec<u32> = layout
            .servers
            .iter()
            .filter(|s| self.conns.get(&s.id).is_some_and(|c| c.addr != s.addr))
            .map(|s| s.id)
            .collect();
        for c in self.conns.values_mut() {
            c.departing = !layout.servers.iter().any(|s| s.id == c.id as u32);
            self.departing |= c.departing;
        }
        self.layout = Some(layout);
        let mut lost = Vec::new();
        for server in replaced {
            if let Some(c) = self.conns.remove(&server) {
                tracing::info!(server, "server replaced: its old connection is lost");
                out.push(Effect::Close { conn: c.id });
                lost.push(server);
            }
        }
        self.connect_listed(out);
        for server in lost {
            self.lost(now_us, server, out);
        }
        self.sweep(out);
    }

    /// Closes the departing connections nothing waits on any more.
    fn sweep(&mut self, out: &mut Vec<Effect>) {
        if !self.departing {
            return;
        }
        let round = self.round.as_ref();
        let call = self.call.as_ref().and_then(Call::awaits).map(|(_, s)| s);
        let mut left = false;
        self.conns.retain(|server, c| {
            if !c.departing {
                return true;
            }
            if round.is_some_and(|r| r.waiting_on(*server).next().is_some()) || call == Some(*server) {
                left = true;
                return true;
            }
            tracing::debug!(server, "server left the layout: its connection closes");
            out.push(Effect::Close { conn: c.id });
            false
        });
        self.departing = left;
    }

    /// Server `server`'s connection is gone: the call waiting on it fails, the round
    /// resends what it left unanswered after a layout refresh (which dials the server
    /// again if it still lists it).
    fn lost(&mut self, now_us: u64, server: u32, out: &mut Vec<Effect>) {
        if self.call.as_ref().and_then(Call::awaits).is_some_and(|(_, s)| s == server) {
            let call = self.call.take().map(|c| c.describe(server)).unwrap_or_default();
            out.push(Effect::Failed(NodeError::Closed(format!("server {server} (waiting for {call})"))));
        }
        self.round_event(now_us, RoundEvent::ServerLost { server }, out);
    }

    fn round_event(&mut self, now_us: u64, event: RoundEvent<'_>, out: &mut Vec<Effect>) {
        let Some(round) = self.round.as_mut() else { return };
        let result = round.handle(now_us, event);
        self.on_round(now_us, result, out);
    }

    /// Carries out what the round asked, then ends it if it is done.
    fn on_round(&mut self, now_us: u64, result: Result<Vec<Action>>, out: &mut Vec<Effect>) {
        let done = result.and_then(|actions| self.carry(now_us, actions, out));
        if let Err(e) = done {
            return self.round_failed(e, out);
        }
        if !self.round.as_ref().is_some_and(Round::is_done) {
            return;
        }
        let Some(round) = self.round.take() else { return };
        let waited = round.waited().collect();
        let per_server_us = round.waits_per_server_us();
        let report = self.worker.finish(now_us, round);
        self.rows = None;
        out.push(Effect::RoundDone(Finished { waited, per_server_us, report }));
        self.sweep(out);
    }

    /// The round's sends, to the servers' connections (held until `Hello` is accepted;
    /// a server without one is lost), and its refreshes.
    fn carry(&mut self, now_us: u64, actions: Vec<Action>, out: &mut Vec<Effect>) -> Result<()> {
        let mut todo = VecDeque::from(actions);
        while let Some(action) = todo.pop_front() {
            match action {
                Action::Send { tag, server, block, op } => match self.conns.get_mut(&server) {
                    Some(c) if c.state == State::Ready => {
                        out.push(Effect::Request { conn: c.id, tag, server, block, op })
                    }
                    Some(c) => c.held.push(Held::Request { tag, block, op }),
                    None => {
                        let Some(round) = self.round.as_mut() else { break };
                        todo.extend(round.handle(now_us, RoundEvent::ServerLost { server })?);
                    }
                },
                Action::RefreshLayout => out.push(Effect::RefreshLayout),
            }
        }
        Ok(())
    }

    /// The round failed with `e`: a split row round is planned again (within
    /// [`replan_rows`]); anything else ends it.
    fn round_failed(&mut self, e: NodeError, out: &mut Vec<Effect>) {
        let table = self.rows.take();
        self.abandon(out);
        match (e, table) {
            (NodeError::Recut { block }, Some(table)) => {
                self.recuts += 1;
                match replan_rows(table, self.recuts) {
                    Ok(()) => {
                        tracing::debug!(table, block, recuts = self.recuts, "row round planned again after a split");
                        self.replanning = true;
                        out.push(Effect::Replan { table });
                    }
                    Err(e) => out.push(Effect::Failed(e)),
                }
            }
            (e, _) => out.push(Effect::Failed(e)),
        }
    }

    /// Sends the call (again) to its server, as the layout names it.
    fn send_call(&mut self, now_us: u64, out: &mut Vec<Effect>) {
        let (Some(call), Some(layout)) = (self.call.as_mut(), self.layout.clone()) else {
            if self.call.take().is_some() {
                out.push(Effect::Failed(NodeError::Refused("register_model first".into())));
            }
            return;
        };
        let server = match call.server(&layout) {
            Ok(server) => server,
            Err(e) => {
                self.call = None;
                return out.push(Effect::Failed(e));
            }
        };
        let request_id = self.next_call_id;
        self.next_call_id = if self.next_call_id >= u64::from(u32::MAX) { HELLO_ID + 1 } else { request_id + 1 };
        call.stage = CallStage::Sent { request_id, server, sent_us: now_us };
        let msg = Message::from(call.msg.clone());
        if !self.conns.contains_key(&server)
            && let Some(s) = layout.servers.iter().find(|s| s.id == server)
        {
            self.dial(server, s.addr.clone(), out);
        }
        match self.conns.get_mut(&server) {
            Some(c) if c.state == State::Ready => out.push(Effect::Send { conn: c.id, request_id, msg }),
            Some(c) => c.held.push(Held::Call { request_id, msg }),
            None => {}
        }
    }

    fn on_call_answer(&mut self, now_us: u64, msg: &Message, out: &mut Vec<Effect>) {
        let Some(call) = self.call.as_mut() else { return };
        match call.answer(now_us, msg) {
            Step::Refresh => out.push(Effect::RefreshLayout),
            Step::Wait => {}
            Step::Done(msg) => {
                self.call = None;
                out.push(Effect::Answered(msg));
            }
            Step::Failed(e) => {
                self.call = None;
                out.push(Effect::Failed(e));
            }
        }
        self.sweep(out);
    }

    /// Server `server` answered `Hello` with `msg`.
    fn on_hello(&mut self, now_us: u64, server: u32, msg: &Message, out: &mut Vec<Effect>) {
        let Some(c) = self.conns.get_mut(&server) else { return };
        let State::Hello { first_us, .. } = c.state else { return };
        match hello_answer(server, msg, now_us.saturating_sub(first_us)) {
            HelloAnswer::Accepted => {
                c.state = State::Ready;
                let conn = c.id;
                for held in std::mem::take(&mut c.held) {
                    out.push(match held {
                        Held::Request { tag, block, op } => Effect::Request { conn, tag, server, block, op },
                        Held::Call { request_id, msg } => Effect::Send { conn, request_id, msg },
                    });
                }
            }
            HelloAnswer::Again { after_us } => {
                c.state = State::Hello { first_us, again_us: Some(now_us + after_us) };
                self.hello_wakes.insert((now_us + after_us, server));
            }
            HelloAnswer::Refused(e) => {
                self.abandon(out);
                out.push(Effect::Failed(e));
            }
        }
    }

    fn on_frame(&mut self, now_us: u64, conn: ConnId, request_id: u64, msg: &Message, out: &mut Vec<Effect>) {
        let Some(server) = self.server_of(conn) else { return };
        if request_id == HELLO_ID {
            return self.on_hello(now_us, server, msg, out);
        }
        if self.call.as_ref().and_then(Call::awaits).is_some_and(|(id, _)| id == request_id) {
            return self.on_call_answer(now_us, msg, out);
        }
        self.round_event(now_us, RoundEvent::Reply { tag: request_id, msg }, out);
        self.sweep(out);
    }

    fn on_timeout(&mut self, now_us: u64, out: &mut Vec<Effect>) {
        while let Some(&(at, server)) = self.hello_wakes.first()
            && at <= now_us
        {
            self.hello_wakes.pop_first();
            let Some(c) = self.conns.get_mut(&server) else { continue };
            if let State::Hello { first_us, again_us: Some(again) } = c.state
                && again == at
            {
                c.state = State::Hello { first_us, again_us: None };
                let msg = Control::Hello { credential: self.credential.clone() }.into();
                out.push(Effect::Send { conn: c.id, request_id: HELLO_ID, msg });
            }
        }
        if let Some(call) = &self.call {
            match call.timeout(now_us) {
                Ok(true) => self.send_call(now_us, out),
                Ok(false) => {}
                Err(e) => {
                    self.abandon(out);
                    out.push(Effect::Failed(e));
                }
            }
        }
        if self.round.as_ref().and_then(Round::poll_timeout).is_some_and(|at| at <= now_us) {
            self.round_event(now_us, RoundEvent::Timeout, out);
        }
    }
}

impl crate::Machine for Client {
    type Input<'a> = Event<'a>;
    type Output = Effect;

    fn handle(&mut self, now_us: u64, input: Event<'_>, out: &mut Vec<Effect>) {
        match input {
            Event::LayoutPushed(layout) => {
                if self.layout.as_ref().is_none_or(|l| l.placement.epoch < layout.placement.epoch) {
                    self.handle(now_us, Event::Layout(layout), out);
                }
            }
            Event::Layout(layout) => {
                self.install(now_us, layout.clone(), out);
                if self.call.as_ref().is_some_and(|c| c.stage == CallStage::Refreshing) {
                    self.send_call(now_us, out);
                }
                self.round_event(now_us, RoundEvent::Layout(&layout), out);
            }
            Event::Dialled { conn } => {
                let Some(c) = self.server_of(conn).and_then(|s| self.conns.get_mut(&s)) else { return };
                c.state = State::Hello { first_us: now_us, again_us: None };
                let msg = Control::Hello { credential: self.credential.clone() }.into();
                out.push(Effect::Send { conn, request_id: HELLO_ID, msg });
            }
            Event::Frame { conn, request_id, msg } => self.on_frame(now_us, conn, request_id, msg, out),
            Event::Answer { tag, answer } => {
                self.round_event(now_us, RoundEvent::Answer { tag, answer }, out);
                self.sweep(out);
            }
            Event::Closed { conn } => {
                let Some(server) = self.server_of(conn) else { return };
                self.conns.remove(&server);
                tracing::debug!(server, "server connection closed");
                self.lost(now_us, server, out);
            }
            Event::Failover(notice) => {
                for server in crate::session::servers_lost(notice, self.conns.keys().copied()) {
                    if let Some(c) = self.conns.remove(&server) {
                        out.push(Effect::Close { conn: c.id });
                    }
                    self.lost(now_us, server, out);
                }
            }
            Event::Timeout => self.on_timeout(now_us, out),
        }
    }

    fn poll_timeout(&self) -> Option<u64> {
        let hello = self.hello_wakes.first().map(|(at, _)| *at);
        let call = self.call.as_ref().and_then(Call::poll_timeout);
        let round = self.round.as_ref().and_then(Round::poll_timeout);
        hello.into_iter().chain(call).chain(round).min()
    }
}

#[cfg(test)]
#[path = "client_tests.rs"]
mod tests;
