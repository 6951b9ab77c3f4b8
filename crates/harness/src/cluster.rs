//! A cluster on the simulated network: the real [`Scheduler`] and any number of roles
//! plugged in through [`Role`], driven by one event loop on virtual time.

use std::collections::{BTreeSet, VecDeque};

use elasticps_wire::{CheckpointEntry, KeyId, Message};

use crate::net::{Delivery, LinkSpec, LostWhy, NetStats, Network, NodeId, NodeKind};
use elasticps_node::ConnId;
use elasticps_node::agent::Spawn;
use elasticps_node::scheduler::hosts::HostsConfig;
use elasticps_node::scheduler::{Action, Event, JobConfig, Persisted, SavedState, Scheduler};

/// A role on the simulated network: a small adapter that feeds a state machine the
/// events the network delivers and carries its actions out through the [`Outbox`].
///
/// Each method runs at the virtual time [`Outbox::now_us`]; nothing in it may block
/// or read the system clock.
pub trait Role {
    /// The node was added to the cluster (connect to the scheduler and register here).
    fn on_start(&mut self, out: &mut Outbox<'_>) {
        let _ = out;
    }
    /// A message arrived on `conn`.
    fn on_message(&mut self, out: &mut Outbox<'_>, conn: ConnId, request_id: u64, msg: Message);
    /// `conn` is gone (closed by either end, dropped, or the peer crashed).
    fn on_lost(&mut self, out: &mut Outbox<'_>, conn: ConnId, why: LostWhy);
    /// A timer set with [`Outbox::wake_at`] fired.
    fn on_timer(&mut self, out: &mut Outbox<'_>, token: u64) {
        let _ = (out, token);
    }
    /// Whether the process exited, as its host's agent would see it: `Some((ok,
    /// status))` once it did (for a node watched with [`Cluster::watch_exit`]).
    fn exit_status(&self) -> Option<(bool, String)> {
        None
    }
}

impl<R: Role + ?Sized> Role for Box<R> {
    fn on_start(&mut self, out: &mut Outbox<'_>) {
        (**self).on_start(out)
    }
    fn on_message(&mut self, out: &mut Outbox<'_>, conn: ConnId, request_id: u64, msg: Message) {
        (**self).on_message(out, conn, request_id, msg)
    }
    fn on_lost(&mut self, out: &mut Outbox<'_>, conn: ConnId, why: LostWhy) {
        (**self).on_lost(out, conn, why)
    }
    fn on_timer(&mut self, out: &mut Outbox<'_>, token: u64) {
        (**self).on_timer(out, token)
    }
    fn exit_status(&self) -> Option<(bool, String)> {
        (**self).exit_status()
    }
}

/// What a role can do while it handles an event: send, close, connect, set timers, ask
/// for a server, end the run. Sends go straight into the network (no buffer).
pub struct Outbox<'a> {
    net: &'a mut Network,
    me: NodeId,
    scheduler: NodeId,
    signals: &'a mut Signals,
}

impl Outbox<'_> {
    /// How long the message being handled took to come in over this node's downlink,
    /// first byte to last, ns ([`Network::last_transfer_ns`]).
    pub fn last_transfer_ns(&self) -> u64 {
        self.net.last_transfer_ns()
    }

    /// The virtual time, in microseconds.
    pub fn now_us(&self) -> u64 {
        self.net.now_us()
    }

    /// This node.
    pub fn me(&self) -> NodeId {
        self.me
    }

    /// The address this node serves at ([`Network::addr`]).
    pub fn my_addr(&self) -> String {
        self.net.addr(self.me)
    }

    /// The IP address of `node`'s simulated host, if it runs on one ([`Network::ip`]).
    pub fn ip_of(&self, node: NodeId) -> Option<String> {
        self.net.ip(node).map(str::to_string)
    }

    /// The scheduler's node (connect to it to register).
    pub fn scheduler(&self) -> NodeId {
        self.scheduler
    }

    /// Sends `msg` on `conn`; false if the connection is closed or gone (nothing sent).
    pub fn send(&mut self, conn: ConnId, request_id: u64, msg: Message) -> bool {
        self.net.send(self.me, conn, request_id, msg)
    }

    /// [`Outbox::send`], leaving no earlier than `at_us` (the reply of a busy CPU).
    pub fn send_at(&mut self, conn: ConnId, request_id: u64, msg: Message, at_us: u64) -> bool {
        self.net.send_at(self.me, conn, request_id, msg, at_us.saturating_mul(1_000))
    }

    /// Closes `conn` after what was sent on it ([`Network::close`]).
    pub fn close(&mut self, conn: ConnId) {
        self.net.close(self.me, conn)
    }

    /// Opens a connection to `to`; the peer learns of it with the first message.
    pub fn connect(&mut self, to: NodeId) -> ConnId {
        self.net.connect(self.me, to)
    }

    /// The other end of `conn`.
    pub fn peer(&self, conn: ConnId) -> Option<NodeId> {
        self.net.peer(self.me, conn)
    }

    /// What `node` is.
    pub fn kind_of(&self, node: NodeId) -> Option<NodeKind> {
        self.net.kind(node)
    }

    /// Wakes this node at `at_us` ([`Role::on_timer`] with `token`). A timer cannot be
    /// cancelled: a role ignores the tokens it no longer waits for.
    pub fn wake_at(&mut self, at_us: u64, token: u64) {
        self.net.set_timer(self.me, at_us, token)
    }

    /// This node's link.
    pub fn my_link(&self) -> LinkSpec {
        self.net.link(self.me).unwrap_or_default()
    }

    /// Changes this node's link (a straggler injection that starts now).
    pub fn set_my_link(&mut self, link: LinkSpec) {
        self.net.set_link(self.me, link)
    }

    /// Asks the cluster's owner to start one more server ([`Stop::StartServer`]).
    pub fn start_server(&mut self) {
        self.signals.start_requests += 1;
    }

    /// Asks the cluster's owner to start a node for this host agent ([`Stop::Spawn`]).
    pub fn spawn(&mut self, spawn: Spawn) {
        self.signals.spawns.push_back((self.me, spawn));
    }

    /// Ends the run ([`Stop::Finished`]); the first call wins.
    pub fn finish(&mut self, ok: bool, reason: String) {
        self.signals.finished.get_or_insert((ok, reason));
    }
}

#[derive(Debug, Default)]
struct Signals {
    start_requests: u32,
    /// Nodes host agents asked for: (the agent, what to start).
    spawns: VecDeque<(NodeId, Spawn)>,
    /// Watched nodes that exited: (node, ok, status).
    exits: VecDeque<(NodeId, bool, String)>,
    finished: Option<(bool, String)>,
    finish_reported: bool,
}

/// Why [`Cluster::run`] returned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Stop {
    /// The job ended (the scheduler's [`Action::Finish`], or a role's
    /// [`Outbox::finish`]). Reported once; a later `run` carries on delivering (the
    /// `Shutdown` messages, say).
    Finished {
        /// True if every worker finished.
        ok: bool,
        /// Why it ended.
        reason: String,
    },
    /// The scheduler asked for a server ([`Action::StartServer`]): add one with
    /// [`Cluster::add`] (or don't) and call `run` again. One per request.
    StartServer,
    /// A host agent asked for a node ([`Outbox::spawn`]): start it and hand the agent
    /// its outcome, then call `run` again. One per request.
    Spawn {
        /// The agent's node.
        agent: NodeId,
        /// What to start.
        spawn: Spawn,
    },
    /// A node watched with [`Cluster::watch_exit`] exited (or was killed): tell its
    /// host's agent, then call `run` again.
    Exited {
        /// The node.
        node: NodeId,
        /// Status 0.
        ok: bool,
        /// How it ended, in words.
        status: String,
    },
    /// The virtual time limit was reached.
    Until,
    /// The event budget was used up.
    Events,
    /// Nothing is scheduled any more.
    Idle,
}

/// How the cluster is set up.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// The job, as `elasticps scheduler` takes it.
    pub job: JobConfig,
    /// The scheduler declares a node dead after this long without a message from it.
    pub heartbeat_timeout_us: u64,
    /// Seed of the network's jitter.
    pub seed: u64,
    /// Extra delay per message, uniform in `[0, jitter_us]`.
    pub jitter_us: u64,
    /// Whether the owner starts servers on [`Stop::StartServer`].
    pub can_launch: bool,
    /// The scheduler's link.
    pub scheduler_link: LinkSpec,
    /// The balancer's budget per round, bytes (its default if `None`).
    pub balance_budget_bytes: Option<u64>,
    /// A job across hosts (`launch --nnodes MIN:MAX --rdzv`): the scheduler's host rules,
    /// with host agents joining it; `None`: the nodes are started by the cluster's owner.
    pub hosts: Option<HostsConfig>,
}

impl ClusterConfig {
    /// The runtime's defaults for `job` ([`elasticps_node::timing`]): its heartbeat timeout (2 s
    /// with replicas, else 10 s), seed 0, no jitter, no launcher, a default link.
    pub fn new(job: JobConfig) -> Self {
        Self {
            heartbeat_timeout_us: elasticps_node::timing::heartbeat_timeout_us(job.replicas),
            job,
            seed: 0,
            jitter_us: 0,
            can_launch: false,
            scheduler_link: LinkSpec::default(),
            balance_budget_bytes: None,
            hosts: None,
        }
    }

    /// The scheduler `self` describes, deciding at most `can_launch` starts.
    fn scheduler(&self, scheduler: Scheduler) -> Scheduler {
        let mut scheduler = scheduler.with_launcher(self.can_launch);
        if let Some(bytes) = self.balance_budget_bytes {
            scheduler = scheduler.with_balance_budget(bytes);
        }
        match &self.hosts {
            Some(hosts) => scheduler.with_hosts(hosts.clone()),
            None => scheduler,
        }
    }
}

/// The real scheduler as a [`Role`]: messages and losses become its events, one timer at
/// its [`Scheduler::poll_timeout`] hands it [`Event::Timeout`], and its actions go out
/// through the [`Outbox`]. The reference for the other roles' adapters.
#[derive(Debug)]
pub struct SchedulerRole {
    scheduler: Scheduler,
    /// The timer set for the scheduler's deadline: (at, token). A timer cannot be
    /// cancelled: one replaced by an earlier deadline fires with a stale token, ignored.
    timer: Option<(u64, u64)>,
    /// The token of the last timer set.
    tokens: u64,
    manifests: Vec<(u32, Vec<CheckpointEntry>)>,
    /// The state as the runtime's `--state-dir` would hold it (with its version), kept
    /// once [`Cluster::keep_scheduler_state`] asked for it.
    saved: Option<(Persisted, SavedState)>,
    /// Connections from nodes on simulated hosts the scheduler was told of
    /// ([`Event::Connected`] with their host's address), until they are lost.
    announced: BTreeSet<ConnId>,
}

impl SchedulerRole {
    /// Wraps `scheduler`.
    pub fn new(scheduler: Scheduler) -> Self {
        Self { scheduler, timer: None, tokens: 0, manifests: Vec::new(), saved: None, announced: BTreeSet::new() }
    }

    /// The state last saved ([`Cluster::keep_scheduler_state`]).
    pub fn saved_state(&self) -> Option<&SavedState> {
        self.saved.as_ref().map(|(_, s)| s)
    }

    /// Before a step's actions are carried out: the state, if kept and [`Persisted::due`].
    fn save(&mut self) {
        let Some((persisted, state)) = &mut self.saved else { return };
        if let Some((version, due)) = persisted.due(&self.scheduler) {
            *state = due;
            persisted.written(version);
        }
    }

    /// The scheduler's state.
    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    /// The checkpoints the scheduler completed (the manifests it wrote), in order.
    pub fn manifests(&self) -> &[(u32, Vec<CheckpointEntry>)] {
        &self.manifests
    }

    fn step(&mut self, out: &mut Outbox<'_>, event: Event) {
        let actions = self.scheduler.handle(out.now_us(), event);
        self.save();
        let mut written = Vec::new();
        for action in actions {
            match action {
                Action::Send { conn, request_id, msg } => {
                    out.send(conn, request_id, msg);
                }
                Action::Close(conn) => out.close(conn),
                Action::StartServer => out.start_server(),
                Action::Relay(_) | Action::Waiting(_) => {}
                Action::WriteManifest { clock, blocks, .. } => {
                    self.manifests.push((clock, blocks));
                    written.push(clock);
                }
                Action::Finish { ok, reason } => out.finish(ok, reason),
            }
        }
        // A manifest is on disk as soon as it is asked for: its outcome comes straight back.
        for clock in written {
            self.step(out, Event::ManifestWritten { clock, error: None });
        }
        self.arm(out);
    }

    /// Sets the timer for the scheduler's next deadline, unless one as early is set.
    fn arm(&mut self, out: &mut Outbox<'_>) {
        let Some(at_us) = self.scheduler.poll_timeout() else { return };
        let at_us = at_us.max(out.now_us());
        if self.timer.is_some_and(|(set, _)| set <= at_us) {
            return;
        }
        self.tokens += 1;
        self.timer = Some((at_us, self.tokens));
        out.wake_at(at_us, self.tokens);
    }
}

impl Role for SchedulerRole {
    fn on_start(&mut self, out: &mut Outbox<'_>) {
        self.arm(out);
    }

    fn on_message(&mut self, out: &mut Outbox<'_>, conn: ConnId, request_id: u64, msg: Message) {
        // A node on a simulated host: the scheduler learns the address it came from, as
        // the runtime tells it a connection's peer address once its handshake is done.
        if let Some(peer) = out.peer(conn).and_then(|n| out.ip_of(n))
            && self.announced.insert(conn)
        {
            self.step(out, Event::Connected { conn, peer, key: KeyId::Cluster });
        }
        self.step(out, Event::Received { conn, request_id, msg });
    }

    fn on_lost(&mut self, out: &mut Outbox<'_>, conn: ConnId, why: LostWhy) {
        self.announced.remove(&conn);
        self.step(out, Event::Lost { conn, why: why.as_str().to_string() });
    }

    fn on_timer(&mut self, out: &mut Outbox<'_>, token: u64) {
        if self.timer.is_none_or(|(_, set)| set != token) {
            return; // replaced by an earlier one
        }
        self.timer = None;
        if self.scheduler.poll_timeout().is_some_and(|at_us| at_us <= out.now_us()) {
            self.step(out, Event::Timeout);
        } else {
            self.arm(out);
        }
    }
}

/// The real scheduler and the roles `R` (servers, workers, test drivers) on one
/// simulated network. `R` is `Box<dyn Role>` by default; a simulator that wants its
/// roles back typed uses an enum of them.
pub struct Cluster<R: Role = Box<dyn Role>> {
    net: Network,
    /// What a restarted scheduler is started with.
    config: ClusterConfig,
    scheduler: SchedulerRole,
    sched: NodeId,
    roles: Vec<Option<R>>,
    signals: Signals,
    events: u64,
    /// Nodes whose exit is reported ([`Stop::Exited`]), until it is.
    watched: BTreeSet<NodeId>,
}

impl<R: Role> std::fmt::Debug for Cluster<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster").field("net", &self.net).field("events", &self.events).finish()
    }
}

impl<R: Role> Cluster<R> {
    /// A cluster with its scheduler (node 0) and nothing else, at time 0.
    pub fn new(config: ClusterConfig) -> Self {
        let mut net = Network::new(config.seed);
        net.set_jitter_us(config.jitter_us);
        let sched = net.add_node(NodeKind::Scheduler, config.scheduler_link);
        let scheduler = config.scheduler(Scheduler::new(config.job.clone(), config.heartbeat_timeout_us));
        let mut cluster = Self {
            net,
            scheduler: SchedulerRole::new(scheduler),
            config,
            sched,
            roles: Vec::new(),
            signals: Signals::default(),
            events: 0,
            watched: BTreeSet::new(),
        };
        let mut out = Outbox { net: &mut cluster.net, me: sched, scheduler: sched, signals: &mut cluster.signals };
        cluster.scheduler.on_start(&mut out);
        cluster
    }

    /// The network: links, faults, the size hook, the trace, the digest.
    pub fn network(&self) -> &Network {
        &self.net
    }

    /// The network, to change links, inject faults, or set the size hook.
    pub fn network_mut(&mut self) -> &mut Network {
        &mut self.net
    }

    /// The scheduler's state.
    pub fn scheduler(&self) -> &Scheduler {
        self.scheduler.scheduler()
    }

    /// The scheduler's adapter (what it did beyond its state: the manifests it wrote).
    pub fn scheduler_role(&self) -> &SchedulerRole {
        &self.scheduler
    }

    /// The scheduler's node.
    pub fn scheduler_node(&self) -> NodeId {
        self.sched
    }

    /// Adds a node running `role` with `link`, and starts it ([`Role::on_start`]) now.
    pub fn add(&mut self, kind: NodeKind, link: LinkSpec, role: R) -> NodeId {
        self.add_on(None, kind, link, role)
    }

    /// [`Cluster::add`] on the simulated host of IP address `ip`, if any
    /// ([`Network::set_ip`]).
    pub fn add_on(&mut self, ip: Option<&str>, kind: NodeKind, link: LinkSpec, role: R) -> NodeId {
        let id = self.net.add_node(kind, link);
        if let Some(ip) = ip {
            self.net.set_ip(id, ip);
        }
        let i = id.0 as usize;
        if self.roles.len() <= i {
            self.roles.resize_with(i + 1, || None);
        }
        let role = self.roles[i].insert(role);
        let mut out = Outbox { net: &mut self.net, me: id, scheduler: self.sched, signals: &mut self.signals };
        role.on_start(&mut out);
        id
    }

    /// The role of `node` (not the scheduler's: [`Cluster::scheduler`]).
    pub fn role(&self, node: NodeId) -> Option<&R> {
        self.roles.get(node.0 as usize)?.as_ref()
    }

    /// The role of `node`, mutably.
    pub fn role_mut(&mut self, node: NodeId) -> Option<&mut R> {
        self.roles.get_mut(node.0 as usize)?.as_mut()
    }

    /// Every role with its node, in the order they were added.
    pub fn roles(&self) -> impl Iterator<Item = (NodeId, &R)> {
        self.roles.iter().enumerate().filter_map(|(i, r)| Some((NodeId(i as u32), r.as_ref()?)))
    }

    /// A fault: `node` crashes ([`Network::crash`]). A watched node's exit is reported
    /// as a kill ([`Stop::Exited`]).
    pub fn crash(&mut self, node: NodeId, peers_notice: bool) {
        self.net.crash(node, peers_notice);
        if self.watched.remove(&node) {
            self.signals.exits.push_back((node, false, "killed by signal 9".into()));
        }
    }

    /// From now on `node`'s exit ([`Role::exit_status`]) is reported once, as
    /// [`Stop::Exited`]: a process its host's agent started.
    pub fn watch_exit(&mut self, node: NodeId) {
        self.watched.insert(node);
    }

    /// Calls `f` with `node`'s role and its [`Outbox`] now (an input from the cluster's
    /// owner, such as an agent's spawned node); `None` if `node` has no role or crashed.
    pub fn with_role<T>(&mut self, node: NodeId, f: impl FnOnce(&mut R, &mut Outbox<'_>) -> T) -> Option<T> {
        if !self.net.is_alive(node) {
            return None;
        }
        let role = self.roles.get_mut(node.0 as usize)?.as_mut()?;
        let mut out = Outbox { net: &mut self.net, me: node, scheduler: self.sched, signals: &mut self.signals };
        let result = f(role, &mut out);
        self.check_exit(node);
        Some(result)
    }

    /// From now on the scheduler's state is saved whenever it changes (the runtime's
    /// `--state-dir`), for [`Cluster::restart_scheduler`].
    pub fn keep_scheduler_state(&mut self) {
        let s = &mut self.scheduler;
        s.saved = Some((Persisted::of(&s.scheduler), s.scheduler.saved_state()));
    }

    /// Starts the scheduler again (crashed before, [`Cluster::crash`]) from its saved
    /// state, on the same node (the same address): the roles that reattach find it there.
    pub fn restart_scheduler(&mut self) -> Result<(), String> {
        let saved = self.scheduler.saved.clone().ok_or("no scheduler state was kept (keep_scheduler_state)")?;
        let c = &self.config;
        let scheduler = c.scheduler(Scheduler::recover(c.job.clone(), saved.1.clone(), c.heartbeat_timeout_us)?);
        self.net.revive(self.sched);
        let mut role = SchedulerRole::new(scheduler);
        role.manifests = std::mem::take(&mut self.scheduler.manifests);
        role.saved = Some((Persisted::of(&role.scheduler), saved.1));
        self.scheduler = role;
        let mut out = Outbox { net: &mut self.net, me: self.sched, scheduler: self.sched, signals: &mut self.signals };
        // Its clock starts where the network's is (the runtime's starts at 0 with it).
        self.scheduler.step(&mut out, Event::Timeout);
        Ok(())
    }

    /// The end of the job, once it ended: (ok, reason).
    pub fn finished(&self) -> Option<(bool, &str)> {
        self.signals.finished.as_ref().map(|(ok, r)| (*ok, r.as_str()))
    }

    /// Events handled so far (deliveries, losses, timers).
    pub fn events(&self) -> u64 {
        self.events
    }

    /// The network's counters.
    pub fn stats(&self) -> NetStats {
        self.net.stats()
    }

    /// Handles events until virtual time `until_us`, `max_events` events, the end of
    /// the job, a request for a server, or nothing left to do; says which.
    pub fn run(&mut self, until_us: u64, max_events: u64) -> Stop {
        let until_ns = until_us.saturating_mul(1_000);
        for _ in 0..max_events {
            if let Some(stop) = self.take_signal() {
                return stop;
            }
            let Some(d) = self.net.next_before(until_ns) else {
                return if self.net.queued() == 0 { Stop::Idle } else { Stop::Until };
            };
            self.events += 1;
            self.dispatch(d);
        }
        self.take_signal().unwrap_or(Stop::Events)
    }

    fn take_signal(&mut self) -> Option<Stop> {
        let s = &mut self.signals;
        if let Some((ok, reason)) = s.finished.as_ref().filter(|_| !s.finish_reported) {
            let stop = Stop::Finished { ok: *ok, reason: reason.clone() };
            s.finish_reported = true;
            return Some(stop);
        }
        if s.start_requests > 0 {
            s.start_requests -= 1;
            return Some(Stop::StartServer);
        }
        if let Some((agent, spawn)) = s.spawns.pop_front() {
            return Some(Stop::Spawn { agent, spawn });
        }
        s.exits.pop_front().map(|(node, ok, status)| Stop::Exited { node, ok, status })
    }

    fn dispatch(&mut self, d: Delivery) {
        let node = match &d {
            Delivery::Message { node, .. } | Delivery::Lost { node, .. } | Delivery::Timer { node, .. } => *node,
        };
        let mut out = Outbox { net: &mut self.net, me: node, scheduler: self.sched, signals: &mut self.signals };
        if node == self.sched {
            deliver(&mut self.scheduler, &mut out, d);
        } else if let Some(Some(role)) = self.roles.get_mut(node.0 as usize) {
            deliver(role, &mut out, d);
            self.check_exit(node);
        }
    }

    /// A watched node that exited is reported ([`Stop::Exited`]).
    fn check_exit(&mut self, node: NodeId) {
        if !self.watched.contains(&node) {
            return;
        }
        if let Some((ok, status)) = self.role(node).and_then(Role::exit_status) {
            self.watched.remove(&node);
            self.signals.exits.push_back((node, ok, status));
        }
    }
}

fn deliver<R: Role + ?Sized>(role: &mut R, out: &mut Outbox<'_>, d: Delivery) {
    match d {
        Delivery::Message { conn, request_id, msg, .. } => role.on_message(out, conn, request_id, msg),
        Delivery::Lost { conn, why, .. } => role.on_lost(out, conn, why),
        Delivery::Timer { token, .. } => role.on_timer(out, token),
    }
}
