//! The server's adapter: the real [`Server`] state machine on the simulated network.
//!
//! It does what the runtime's server does with sockets and tokio: one connection to the
//! scheduler, calls to other servers for migrations (a lost connection fails them), a
//! ticker, and the straggler injection of its assignment (a bandwidth cap on its link and
//! an interference factor on its CPU, from `at_us` after the assignment, for
//! [`ServerModel::injection_lasts_us`] if that is set). Optionally it models the server's
//! CPU as one FIFO queue: a push takes its nominal bytes over [`ServerModel::apply_bps`]
//! (times the injection's interference factor while it is on), and the replies of a data
//! request leave when the
//! CPU is done with it. The state machine itself takes each request as it arrives: what
//! others can observe (the replies) comes out in FIFO completion order, as from a busy
//! server, without an event per request.
//!
//! It also checks, on every answered pull, the bound of the sync policy the server runs
//! ([`SyncPolicy::violates_bound`], the one place that rule lives).

use std::collections::BTreeSet;

use elasticps_core::block::BlockState;
use elasticps_core::sync::{Clock, SyncPolicy};
use elasticps_wire::{CheckpointEntry, Control, Injection, Message};

use crate::cluster::{Outbox, Role};
use crate::link::SchedLink;
use crate::net::{LinkSpec, LostWhy, NodeId, Weigh};
use crate::wake::Wake;
use elasticps_node::link::{self, Links, Tag};
use elasticps_node::server::{Action, Event, Exit, PullTrace, Server};
use elasticps_node::session::{self, REATTACH_ID};
use elasticps_node::{ConnId, Machine};

/// Timer tokens of the server adapter.
const TIMEOUT: u64 = 0;
const INJECT: u64 = 1;
const SESSION: u64 = 2;
const HEAL: u64 = 3;

/// Request id of the `Hello` that opens a connection to another server.
const HELLO: u64 = u64::MAX - 1;

/// What the adapter models beyond the state machine.
#[derive(Clone, Copy, Debug, Default)]
pub struct ServerModel {
    /// How fast pushes are applied, nominal bytes per second (0: instantly).
    pub apply_bps: u64,
    /// Check every answered pull against the sync policy's bound (keeps a trace).
    pub check_bound: bool,
    /// A straggler injection ends this long after it started, µs: the link and the CPU
    /// are the server's own again (`None`: it lasts to the end).
    pub injection_lasts_us: Option<u64>,
}

/// A pull answered while the sync policy forbade it.
#[derive(Clone, Debug, PartialEq)]
pub struct BoundViolation {
    /// When (virtual µs).
    pub at_us: u64,
    /// The policy the server ran.
    pub sync: SyncPolicy,
    /// The answer.
    pub trace: PullTrace,
}

/// A simulated server process.
pub struct ServerRole {
    model: ServerModel,
    server: Option<Server>,
    /// The links to other servers (the node layer's machine: connections, `Hello`, calls
    /// in flight); a call's id is its request id.
    links: Links,
    /// Every connection this server has (to close them when it exits).
    conns: BTreeSet<ConnId>,
    /// The buffer the state machine's actions go to (reused: no allocation per event).
    actions: Vec<Action>,
    /// When the modelled CPU is done with what it was given.
    busy_until_us: u64,
    /// Replies of the step under way leave no earlier than this.
    reply_at_us: u64,
    injection: Injection,
    /// The injection is on: the link it replaced (`Some`, a bandwidth cap) or `None`
    /// (interference only); `None` outside: not started, or over.
    injected: Option<Option<LinkSpec>>,
    violations: Vec<BoundViolation>,
    exit: Option<Exit>,
    weigh: Weigh,
    /// The checkpoint states this server took, in order: (clock, state).
    checkpoints: Vec<(Clock, BlockState)>,
    /// Events the runtime would feed back after I/O (a checkpoint written), fed after
    /// the step that asked for them.
    later: Vec<Event>,
    /// The link to the scheduler (heartbeats, redial, reattach, calls made again).
    link: SchedLink,
    /// The timer armed for the server's deadline.
    wake: Wake,
}

impl std::fmt::Debug for ServerRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerRole").field("id", &self.server.as_ref().and_then(Server::id)).finish()
    }
}

impl ServerRole {
    /// A server with `model`; `weigh` tells what a push weighs (the sim's scale).
    pub fn new(model: ServerModel, weigh: Weigh) -> Self {
        Self {
            model,
            server: None,
            links: Links::new(),
            conns: BTreeSet::new(),
            actions: Vec::new(),
            busy_until_us: 0,
            reply_at_us: 0,
            injection: Injection::default(),
            injected: None,
            violations: Vec::new(),
            exit: None,
            weigh,
            checkpoints: Vec::new(),
            later: Vec::new(),
            link: SchedLink::new(0, SESSION),
            wake: Wake::default(),
        }
    }

    /// A lost scheduler is redialled for `us` and the server reattaches to it
    /// (`ReattachServer`), as the runtime's server does ([`Session`](elasticps_node::session::Session)).
    pub fn with_scheduler_retry(mut self, us: u64) -> Self {
        self.link = SchedLink::new(us, SESSION);
        self
    }

    /// An event of the scheduler's link ([`SchedLink`]); a link that ends without a
    /// `Shutdown` ends the server, as a runtime's server exits.
    fn session(&mut self, out: &mut Outbox<'_>, event: session::Event<'_>) {
        let addr = out.my_addr();
        let server = self.server.as_ref();
        let hello = || server.and_then(|s| elasticps_node::scheduler::reattach_message(s, &addr)).map(Message::from);
        let ended = self.link.handle(out, event, hello);
        if let Some(conn) = self.link.conn() {
            self.conns.insert(conn);
        }
        if let Some(Some(reason)) = ended {
            for conn in std::mem::take(&mut self.conns) {
                out.close(conn);
            }
            self.exit.get_or_insert(Exit::Failed { reason });
        }
    }

    /// The state machine (once started).
    pub fn server(&self) -> Option<&Server> {
        self.server.as_ref()
    }

    /// Pulls answered against the sync policy's bound (with [`ServerModel::check_bound`]).
    pub fn violations(&self) -> &[BoundViolation] {
        &self.violations
    }

    /// The block states this server took for checkpoints, in order: (clock, state). The
    /// harness keeps them in memory (no directory is written).
    pub fn checkpoints(&self) -> &[(Clock, BlockState)] {
        &self.checkpoints
    }

    /// Why the server stopped, if it did.
    pub fn exit(&self) -> Option<&Exit> {
        self.exit.as_ref()
    }

    fn step(&mut self, out: &mut Outbox<'_>, event: Event) {
        let Some(server) = self.server.as_mut() else { return };
        if self.exit.is_some() {
            return;
        }
        if let Event::FromScheduler { msg: Message::Control(Control::Assign(a)), .. } = &event {
            self.injection = a.inject;
            if a.inject.bandwidth_bps > 0 || a.inject.interference > 1.0 {
                out.wake_at(out.now_us() + a.inject.at_us, INJECT);
            }
        }
        // As the runtime's server: a data request never moves a deadline earlier.
        let data = matches!(&event, Event::Received { msg, .. } if msg.is_data_request());
        let mut actions = std::mem::take(&mut self.actions);
        server.handle_into(out.now_us(), event, &mut actions);
        let next = if data { None } else { server.poll_timeout() };
        self.carry_out(out, &mut actions);
        self.actions = actions;
        self.wake.arm(out, next, TIMEOUT);
        for event in std::mem::take(&mut self.later) {
            self.step(out, event);
        }
    }

    fn carry_out(&mut self, out: &mut Outbox<'_>, actions: &mut Vec<Action>) {
        for action in actions.drain(..) {
            match action {
                Action::Reply { conn, request_id, msg } => {
                    out.send_at(conn, request_id, msg, self.reply_at_us);
                }
                Action::ToScheduler { request_id, msg } => self.session(out, session::Event::Send { request_id, msg }),
                Action::ToServer { call, server, addr, msg } => self.call_server(out, call, server, &addr, msg),
                Action::Trace(t) => self.check(out.now_us(), t),
                Action::Checkpoint { clock, state, .. } => {
                    let block = state.spec.id;
                    let entry = CheckpointEntry { block, file: format!("memory/{clock}/{block}"), len: 0, crc32: 0 };
                    self.checkpoints.push((clock, state));
                    self.later.push(Event::CheckpointWritten { clock, block, result: Ok(entry) });
                }
                Action::Restore { .. } => {
                    self.later.push(Event::Restored(Err("the harness keeps no checkpoint to resume from".into())))
                }
                Action::Close { conn } => {
                    self.conns.remove(&conn);
                    out.close(conn);
                }
                Action::Exit(exit) => {
                    for conn in std::mem::take(&mut self.conns) {
                        out.close(conn);
                    }
                    self.exit = Some(exit);
                    return;
                }
            }
        }
    }

    fn call_server(&mut self, out: &mut Outbox<'_>, call: u64, server: u32, addr: &str, msg: Message) {
        let credential = self.server.as_ref().and_then(Server::credential).cloned();
        self.link(out, link::Input::Send { call, server, addr, msg, credential: credential.as_ref() });
    }

    /// Hands the links' machine `input` and carries out its effects on the simulated
    /// network: a dial connects at once (or fails for an address no simulated server
    /// has), a send that finds its connection closed is a loss, an answer goes to the
    /// server machine.
    fn link(&mut self, out: &mut Outbox<'_>, input: link::Input<'_>) {
        let mut effects = Vec::new();
        self.links.handle(out.now_us(), input, &mut effects);
        for effect in effects {
            match effect {
                link::Effect::Dial { addr } => match NodeId::from_addr(&addr) {
                    Some(node) => {
                        let conn = out.connect(node);
                        self.conns.insert(conn);
                        self.link(out, link::Input::Dialled { addr: &addr, conn });
                    }
                    None => {
                        let why = format!("no simulated server at {addr}");
                        self.link(out, link::Input::DialFailed { addr: &addr, why });
                    }
                },
                link::Effect::Send { conn, tag, msg } => {
                    let request_id = match tag {
                        Tag::Hello => HELLO,
                        Tag::Call(call) => call,
                    };
                    if !out.send(conn, request_id, msg) {
                        self.link(out, link::Input::Lost { conn, why: "the connection is closed".into() });
                    }
                }
                link::Effect::Close { conn } => {
                    self.conns.remove(&conn);
                    out.close(conn);
                }
                link::Effect::Answered { call, reply } => self.step(out, Event::FromServer { call, reply }),
            }
        }
    }

    fn check(&mut self, at_us: u64, trace: PullTrace) {
        let Some(sync) = self.server.as_ref().and_then(Server::shard).map(|s| s.effective().sync) else { return };
        if sync.violates_bound(trace.clock, trace.done) {
            self.violations.push(BoundViolation { at_us, sync, trace });
        }
    }

    /// A data request: the modelled CPU takes it after what it already has, and its
    /// replies leave when it is done.
    fn data_request(&mut self, out: &mut Outbox<'_>, conn: ConnId, request_id: u64, msg: Message) {
        let start = self.busy_until_us.max(out.now_us());
        let cost = self.cost_us(&msg);
        self.busy_until_us = start + cost;
        self.reply_at_us = self.busy_until_us;
        if let Some(server) = self.server.as_mut() {
            // The time the modelled CPU spends on it, as a real server's runtime charges
            // its handling time: a CPU slowed by interference shows in the server's rate.
            server.charge(cost, 0);
        }
        self.step(out, Event::Received { conn, request_id, msg });
        self.reply_at_us = 0;
    }

    fn cost_us(&self, msg: &Message) -> u64 {
        if self.model.apply_bps == 0
            || !matches!(msg, Message::Push { .. } | Message::Init { .. } | Message::PushPull { .. })
        {
            return 0;
        }
        let factor = if self.injected.is_some() { f64::from(self.injection.interference.max(1.0)) } else { 1.0 };
        let bytes = (self.weigh)(msg) as f64;
        (bytes * 1e6 / self.model.apply_bps as f64 * factor) as u64
    }
}

impl Role for ServerRole {
    fn exit_status(&self) -> Option<(bool, String)> {
        match self.exit.as_ref()? {
            Exit::Shutdown { .. } => Some((true, "exit status 0".into())),
            Exit::Failed { reason } => Some((false, format!("exit status 1: {reason}"))),
        }
    }

    fn on_start(&mut self, out: &mut Outbox<'_>) {
        let sched = self.link.connect(out);
        self.conns.insert(sched);
        let mut server = Server::new(out.my_addr()).with_trace(self.model.check_bound);
        let mut actions = server.start(out.now_us());
        let next = server.poll_timeout();
        self.server = Some(server);
        self.carry_out(out, &mut actions);
        self.wake.arm(out, next, TIMEOUT);
    }

    fn on_message(&mut self, out: &mut Outbox<'_>, conn: ConnId, request_id: u64, msg: Message) {
        if self.exit.is_some() {
            // An exited process has no sockets: a connection opened to it since is refused
            // (a migration that started at the job's end learns it and abandons).
            return out.close(conn);
        }
        if self.link.is(conn) {
            self.session(out, session::Event::Received { request_id, msg: &msg });
            if request_id == REATTACH_ID {
                return;
            }
            return self.step(out, Event::FromScheduler { request_id, msg });
        }
        if self.links.owns(conn) {
            let tag = if request_id == HELLO { Tag::Hello } else { Tag::Call(request_id) };
            return self.link(out, link::Input::Answered { conn, tag, msg });
        }
        let data = msg.is_data_request();
        if !data {
            // A connection opens with Hello (a worker) or BlockSnapshot (a server): data
            // requests only come on connections already known.
            self.conns.insert(conn);
        }
        let payload = if data { crate::net::payload_bytes(&msg) } else { 0 };
        if let (true, Some(server)) = (payload > 0, self.server.as_mut()) {
            // What a real server's reader measures of every data frame with a payload
            // (the runtime's `arrived`): the frame's time on the link.
            server.arrived(payload, out.last_transfer_ns());
        }
        if data && self.model.apply_bps > 0 {
            return self.data_request(out, conn, request_id, msg);
        }
        self.step(out, Event::Received { conn, request_id, msg });
    }

    fn on_lost(&mut self, out: &mut Outbox<'_>, conn: ConnId, why: LostWhy) {
        self.conns.remove(&conn);
        if self.link.is(conn) {
            // Redialled if the session says so (the scheduler may be restarted with its
            // saved state); after `Shutdown` the server finishes without it.
            tracing::debug!(?why, "simulated server lost the scheduler");
            return self.session(out, session::Event::Lost);
        }
        if self.links.owns(conn) {
            self.link(out, link::Input::Lost { conn, why: format!("connection lost ({why:?})") });
        }
        self.step(out, Event::Closed { conn });
    }

    fn on_timer(&mut self, out: &mut Outbox<'_>, token: u64) {
        match token {
            SESSION if self.exit.is_none() => self.session(out, session::Event::Timeout),
            TIMEOUT => {
                self.wake.fired(out);
                self.step(out, Event::Timeout);
            }
            INJECT if self.injected.is_none() => {
                let bps = self.injection.bandwidth_bps;
                let before = (bps > 0).then(|| out.my_link());
                if bps > 0 {
                    out.set_my_link(LinkSpec { up_bps: bps, down_bps: bps, ..out.my_link() });
                }
                self.injected = Some(before);
                if let Some(lasts) = self.model.injection_lasts_us {
                    out.wake_at(out.now_us() + lasts, HEAL);
                }
            }
            HEAL => {
                if let Some(Some(link)) = self.injected.take() {
                    out.set_my_link(link);
                }
            }
            _ => {}
        }
    }
}
