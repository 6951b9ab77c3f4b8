//! The scheduler's decisions as a plain state machine: who is in the job, the model's
//! layout, barriers, optimizer changes, the balancer's migrations and scaling, when the
//! job ends. Events in (a message on a connection, a lost connection, a tick with the
//! time), actions out (send, close, start a server, finish); no I/O and no clock of its
//! own.
//!
//! - [`elastic`](self): which servers are live, draining or on trial; the one migration
//!   at a time; the balancer's orders.
//! - [`hosts`]: the hosts of a job that spans them, their slots, where a node starts,
//!   and a lost host.
//! - [`BalanceLog`]: the history of migrations, scaling events and load, for reports.

use std::collections::{BTreeMap, BTreeSet};

use elasticps_core::block::ShardConfig;
use elasticps_core::model::{BlockId, Partition, TensorSpec};
use elasticps_core::optimizer::TensorOptimizer;
use elasticps_core::placement::{Placement, PlacementKind};
use elasticps_core::sync::SyncPolicy;

mod elastic;
mod history;
pub mod hosts;
mod recovery;

pub use elasticps_core::balance::BalanceMode;
pub use history::{BalanceLog, LoadSample, MigrationEvent, ScaleEvent, ServerPoint};
pub use recovery::{RECOVER_WAIT_US, STATE_VERSION, SavedState, reattach_message};

use elastic::{Elastic, Order};
use elasticps_wire::{
    Assignment, CheckpointEntry, CheckpointPlan, ClusterStatus, Control, Credential, ErrorCode, ErrorReply, Injection,
    KeyId, Layout, Message, PeerRole, ServerAddr, ServerLoad, WorkerLoad,
};
#[cfg(test)]
use elasticps_wire::{MigrationReport, ScaleRequest};

pub use crate::ConnId;
use crate::authz::{self, Class, Receiver, Verdict};

/// A connection that has not registered (as a server, a worker or a host agent) within
/// this long is closed, µs. An operator tool's `GetStatus` or `Scale` is answered
/// meanwhile.
pub const REGISTER_WITHIN_US: u64 = 10_000_000;

/// The job as the scheduler was told to run it.
#[derive(Clone, Debug)]
pub struct JobConfig {
    /// Number of servers to wait for.
    pub servers: u32,
    /// Number of workers to wait for.
    pub workers: u32,
    /// Maximum block size in bytes.
    pub block_bytes: usize,
    /// Initial placement policy.
    pub placement: PlacementKind,
    /// Sync policy, optimizer, worker count, for every server.
    pub shard: ShardConfig,
    /// Per-server sync policies that override `shard.sync`: (server id, policy).
    pub server_sync: Vec<(u32, SyncPolicy)>,
    /// Seed of the initial values.
    pub seed: u64,
    /// Straggler injection per server id (experiments): (server id, injection).
    pub inject: Vec<(u32, Injection)>,
    /// Whether the scheduler moves blocks and scales servers while training runs.
    pub balance: BalanceMode,
    /// The balancer may scale out up to this many servers (at least `servers`).
    pub max_servers: u32,
    /// The balancer may scale in down to this many servers (at most `servers`).
    pub min_servers: u32,
    /// Checkpoints (`--checkpoint-dir`, `--checkpoint-every`) and the checkpoint the job
    /// resumes from (`--resume`), if any.
    pub checkpoint: Option<CheckpointPlan>,
    /// Once every worker still in the job is done, how long to wait for lost ones to
    /// rejoin (restarted by a launcher's `--restart-workers`) before the job ends without
    /// them, µs (0: it ends at once).
    pub rejoin_wait_us: u64,
    /// Copies of every block (`--replicas`): a primary and `replicas - 1` backups on
    /// distinct servers; 1 (no backup) by default.
    pub replicas: u32,
}

impl JobConfig {
    /// The straggler injection of server `id` (none for most servers).
    pub fn injection(&self, id: u32) -> Injection {
        self.inject.iter().rev().find(|(s, _)| *s == id).map_or_else(Injection::default, |(_, i)| *i)
    }

    /// The configuration of server `id`: the job's, with its own sync policy if it has one.
    pub fn shard_config(&self, id: u32) -> ShardConfig {
        let sync = self.server_sync.iter().rev().find(|(s, _)| *s == id).map_or(self.shard.sync, |(_, p)| *p);
        ShardConfig { sync, ..self.shard }
    }
}

/// Something that happened at the scheduler.
#[derive(Debug)]
pub enum Event {
    /// A message arrived on a connection.
    Received {
        /// The connection.
        conn: ConnId,
        /// Its request id (0: a notification).
        request_id: u64,
        /// The message.
        msg: Message,
    },
    /// A connection was opened (authenticated) from `peer`, the IP address it came from
    /// (a host's nodes are known by their address).
    Connected {
        /// The connection.
        conn: ConnId,
        /// The peer's IP address.
        peer: String,
        /// The key its handshake proved (a worker-key connection can only be a worker).
        key: KeyId,
    },
    /// A connection closed or failed.
    Lost {
        /// The connection.
        conn: ConnId,
        /// Why, for the log.
        why: String,
    },
    /// Time passed; `now_us` is the scheduler's clock.
    Tick {
        /// Microseconds since the scheduler started.
        now_us: u64,
    },
}

/// What the runtime must do.
#[derive(Debug, PartialEq)]
pub enum Action {
    /// Send a message on a connection.
    Send {
        /// The connection.
        conn: ConnId,
        /// Request id to answer (0 for a notification).
        request_id: u64,
        /// The message.
        msg: Message,
    },
    /// Close a connection (after its pending sends).
    Close(ConnId),
    /// Start one more server (through the launcher, if the scheduler has one).
    StartServer,
    /// Print this event line (a node's, relayed by its host agent) on the scheduler's
    /// event stream, where the launch that runs the scheduler builds the job's report.
    Relay(String),
    /// A job across hosts still waits for this (said every [`WAIT_REPORT_EVERY_US`]
    /// while it assembles): the launch that runs the scheduler prints it.
    Waiting(String),
    /// Every block of checkpoint `clock` is on disk: write its manifest (atomically), which
    /// makes the checkpoint complete.
    WriteManifest {
        /// The checkpoint directory.
        dir: String,
        /// The checkpoint's clock.
        clock: u32,
        /// Every block's file, in block order.
        blocks: Vec<CheckpointEntry>,
    },
    /// The job is over: shut down and exit, successfully or not.
    Finish {
        /// True if every worker finished its run.
        ok: bool,
        /// Why it ended.
        reason: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Role {
    Server(u32),
    Worker(u32),
}

impl Role {
    /// The role a credential names.
    fn peer_role(self) -> PeerRole {
        match self {
            Role::Server(_) => PeerRole::Server,
            Role::Worker(_) => PeerRole::Worker,
        }
    }

    /// The server id or the worker rank.
    fn id(self) -> u32 {
        match self {
            Role::Server(id) | Role::Worker(id) => id,
        }
    }
}

/// How often the scheduler says what the job still waits for, µs.
pub const WAIT_REPORT_EVERY_US: u64 = 5_000_000;

/// How long a job with checkpoints waits after `Shutdown` for its servers to finish their
/// checkpoint writes and leave, µs.
pub const CLOSING_WAIT_US: u64 = 30_000_000;

/// The end of a job with checkpoints: how it ended, and the servers not gone yet.
#[derive(Debug)]
struct Closing {
    ok: bool,
    reason: String,
    until_us: u64,
    servers: BTreeSet<ConnId>,
}

/// A restarted worker waiting for the servers to take its rank back.
#[derive(Debug)]
struct Rejoin {
    conn: ConnId,
    request_id: u64,
    /// Servers (by id) that have not answered `AddWorker` yet.
    waiting: BTreeSet<u32>,
    /// The smallest next clock they answered.
    clock: u32,
}

#[derive(Debug)]
struct Node {
    role: Role,
    last_seen_us: u64,
}

/// The scheduler's state.
#[derive(Debug)]
pub struct Scheduler {
    config: JobConfig,
    nodes: BTreeMap<ConnId, Node>,
    servers: Vec<(ConnId, String)>,
    workers: Vec<ConnId>,
    partition: Option<Partition>,
    placement: Option<Placement>,
    assigned: BTreeSet<u32>,
    layout_ready: bool,
    waiting_for_layout: Vec<(ConnId, u64)>,
    /// Workers waiting in a `Barrier`: (connection, request id, rank).
    barrier: Vec<(ConnId, u64, u32)>,
    finished_workers: BTreeSet<u32>,
    /// Workers lost before they finished: rank -> why (a rank that rejoins leaves it).
    failed_workers: BTreeMap<u32, String>,
    /// Restarted workers waiting for every server to take them back: rank -> the wait.
    rejoining: BTreeMap<u32, Rejoin>,
    /// The first clock of each worker that rejoined.
    rejoin_clocks: BTreeMap<u32, u32>,
    /// Every worker left but some were lost: since when the job waits for them to rejoin.
    awaiting_rejoin_since: Option<u64>,
    /// The job is over, and its servers are finishing their checkpoint writes.
    closing: Option<Closing>,
    now_us: u64,
    last_wait_log_us: u64,
    heartbeat_timeout_us: u64,
    over: bool,
    elastic: Elastic,
    can_launch: bool,
    /// Checkpoints under way: clock -> the blocks written so far.
    checkpoints: BTreeMap<u32, BTreeMap<BlockId, CheckpointEntry>>,
    /// The latest checkpoint whose manifest was written (or the one resumed from).
    last_checkpoint: Option<u32>,
    /// A restarted scheduler waiting for its nodes to reattach ([`Scheduler::recover`]).
    recovering: Option<recovery::Recovering>,
    /// The job's hosts, when it spans hosts (`--nnodes`).
    hosts: Option<hosts::Hosts>,
    /// The IP address each connection came from.
    peers: BTreeMap<ConnId, String>,
    /// Each open connection's handshake key, and when it opened (µs): one that has not
    /// registered within [`REGISTER_WITHIN_US`] is closed.
    opened: BTreeMap<ConnId, (KeyId, u64)>,
    /// Connections closed for not registering: what they sent before the close reached
    /// the runtime is dropped (it must not be taken as from a fresh connection).
    shut: BTreeSet<ConnId>,
    /// The cluster secret the credentials are made with.
    secret: Vec<u8>,
    /// This job's id in its credentials.
    job: u64,
}

impl Scheduler {
    /// A scheduler for `config` that declares a node dead after `heartbeat_timeout_us`
    /// without a message from it.
    pub fn new(config: JobConfig, heartbeat_timeout_us: u64) -> Self {
        Self {
            nodes: BTreeMap::new(),
            servers: Vec::new(),
            workers: Vec::new(),
            partition: None,
            placement: None,
            assigned: BTreeSet::new(),
            layout_ready: false,
            waiting_for_layout: Vec::new(),
            barrier: Vec::new(),
            finished_workers: BTreeSet::new(),
            failed_workers: BTreeMap::new(),
            rejoining: BTreeMap::new(),
            rejoin_clocks: BTreeMap::new(),
            awaiting_rejoin_since: None,
            closing: None,
            now_us: 0,
            last_wait_log_us: 0,
            heartbeat_timeout_us,
            over: false,
            elastic: Elastic::new(config.balance, config.min_servers, config.max_servers),
            can_launch: false,
            checkpoints: BTreeMap::new(),
            last_checkpoint: config.checkpoint.as_ref().and_then(|p| p.resume.as_ref()).map(|r| r.clock),
            recovering: None,
            hosts: None,
            peers: BTreeMap::new(),
            opened: BTreeMap::new(),
            shut: BTreeSet::new(),
            secret: Vec::new(),
            job: 0,
            config,
        }
    }

    /// Issues the nodes' credentials with the cluster `secret` for job `job` (a random
    /// number the runtime draws; a recovered scheduler keeps its saved one). Without it,
    /// the secret is empty and the job 0, as in a harness.
    pub fn with_credentials(mut self, secret: &[u8], job: u64) -> Self {
        self.secret = secret.to_vec();
        if self.recovering.is_none() {
            self.job = job;
        }
        self
    }

    /// The job's id in its credentials.
    pub fn job(&self) -> u64 {
        self.job
    }

    /// A job that spans hosts: host agents join ([`Control::JoinHost`]) and the
    /// scheduler tells them what to start ([`hosts`]); scale-out starts servers on them.
    pub fn with_hosts(mut self, config: hosts::HostsConfig) -> Self {
        self.hosts = Some(hosts::Hosts::new(config));
        self.can_launch = true;
        self
    }

    /// Says whether the runtime can start servers ([`Action::StartServer`]).
    pub fn with_launcher(mut self, can_launch: bool) -> Self {
        self.can_launch = can_launch || self.hosts.is_some();
        self
    }

    /// The balancer moves at most `bytes` per round instead of its default (the sim,
    /// whose model is shrunk, shrinks this budget by the same factor).
    pub fn with_balance_budget(mut self, bytes: u64) -> Self {
        self.elastic.set_balance_budget(bytes);
        self
    }

    /// Where the clock of `Tick { now_us }` starts, in milliseconds since the Unix epoch
    /// (for the report, to align with the workers' clocks).
    pub fn with_clock_origin(mut self, unix_ms: f64) -> Self {
        self.elastic.set_clock_origin(unix_ms);
        self
    }

    /// The placement as the scheduler records it (once the model is placed): who owns
    /// each block, and the epoch.
    pub fn placement(&self) -> Option<&Placement> {
        self.placement.as_ref()
    }

    /// The balancing history so far (migrations, scaling, load timeline).
    pub fn balance_log(&self) -> &BalanceLog {
        self.elastic.log()
    }

    /// The cluster as `elasticps status` shows it (servers, workers, epoch, migrations).
    pub fn status(&self) -> ClusterStatus {
        let addrs: Vec<(u32, String)> =
            self.servers.iter().enumerate().map(|(id, (_, a))| (id as u32, a.clone())).collect();
        self.elastic.status(self.placement.as_ref(), &addrs, self.now_us)
    }

    /// What the scheduler waits for right now, in words, or `None` while training runs.
    pub fn waiting_for(&self) -> Option<String> {
        if let Some(what) = self.recovery_wait() {
            return Some(what);
        }
        if let Some(what) = self.hosts.as_ref().and_then(hosts::Hosts::waiting_for) {
            return Some(what);
        }
        let (s, w) = (self.servers.len() as u32, self.workers.len() as u32);
        if s < self.config.servers || w < self.config.workers {
            return Some(format!(
                "scheduler waits for {} servers and {} workers to register (has {s} servers, {w} workers)",
                self.config.servers, self.config.workers
            ));
        }
        if self.partition.is_none() {
            return Some("scheduler waits for a worker to define the model".into());
        }
        if !self.layout_ready {
            let missing: Vec<_> = (0..self.config.servers).filter(|s| !self.assigned.contains(s)).collect();
            return Some(format!("scheduler waits for servers {missing:?} to load their blocks"));
        }
        None
    }

    /// Moves the scheduler's clock to `now_us` (never back) without the work of a
    /// [`Event::Tick`]: a runtime calls it before each event, so that what the event
    /// records (a node last heard from, a server lost and when) has the event's time.
    pub fn advance(&mut self, now_us: u64) {
        self.now_us = self.now_us.max(now_us);
    }

    /// Feeds one event; returns what to do.
    pub fn step(&mut self, event: Event) -> Vec<Action> {
        let mut out = Vec::new();
        if self.over {
            return out;
        }
        if let Event::Received { conn, request_id, msg } = &event {
            if self.shut.contains(conn) {
                return out;
            }
            if let (Message::Control(Control::GetStatus | Control::Scale(_)), Some((_, since))) =
                (msg, self.opened.get_mut(conn))
            {
                // An operator tool (`elasticps status --watch`) stays while it keeps asking.
                *since = self.now_us;
            }
            if let Some(refused) = self.forbidden(*conn, msg) {
                out.push(Action::Send { conn: *conn, request_id: *request_id, msg: refused });
                return out;
            }
        }
        if self.closing.is_some() {
            self.step_closing(event, &mut out);
            return out;
        }
        match event {
            Event::Connected { conn, peer, key } => {
                self.peers.insert(conn, peer);
                self.opened.insert(conn, (key, self.now_us));
            }
            Event::Received { conn, request_id, msg } => {
                if let Some(node) = self.nodes.get_mut(&conn) {
                    node.last_seen_us = self.now_us;
                }
                let Message::Control(control) = msg else {
                    // Data frames are for servers: refused, and the connection closed
                    // (a host agent's too), PROTOCOL.md §7.
                    let message = format!("the scheduler takes control messages only, got {:?}", msg.kind());
                    tracing::warn!(conn, %message, "refused");
                    let msg = Message::Error(ErrorReply { code: ErrorCode::BadRequest, message });
                    out.push(Action::Send { conn, request_id, msg });
                    out.push(Action::Close(conn));
                    return out;
                };
                if self.hosts.as_ref().is_some_and(|h| h.is_agent(conn)) {
                    self.on_agent_message(conn, request_id, control, &mut out);
                } else {
                    self.on_message(conn, request_id, control, &mut out);
                }
            }
            Event::Lost { conn, why } => {
                self.peers.remove(&conn);
                self.opened.remove(&conn);
                self.shut.remove(&conn);
                match self.hosts.as_mut().and_then(|h| h.connection_lost(conn, &why)) {
                    Some(lost) => self.host_lost(lost, &mut out),
                    None => self.on_lost(conn, &why, &mut out),
                }
            }
            Event::Tick { now_us } => {
                self.now_us = now_us;
                for lost in self.hosts.as_mut().map(|h| h.tick(now_us)).unwrap_or_default() {
                    let conn = lost.conn;
                    self.host_lost(lost, &mut out);
                    out.push(Action::Close(conn));
                }
                let dead: Vec<ConnId> = self
                    .nodes
                    .iter()
                    .filter(|(_, n)| now_us.saturating_sub(n.last_seen_us) > self.heartbeat_timeout_us)
                    .map(|(c, _)| *c)
                    .collect();
                for conn in dead {
                    let secs = self.heartbeat_timeout_us as f64 / 1e6;
                    self.on_lost(conn, &format!("no heartbeat for {secs:.0} s"), &mut out);
                    out.push(Action::Close(conn));
                }
                self.close_unregistered(&mut out);
                if self.awaiting_rejoin_since.is_some() {
                    self.maybe_end(&mut out);
                }
                self.recovery_tick(&mut out);
                if self.layout_ready
                    && let Some(placement) = self.placement.as_ref()
                {
                    let orders = self.elastic.tick(placement, now_us);
                    self.carry_out(orders, &mut out);
                }
                if now_us.saturating_sub(self.last_wait_log_us) >= WAIT_REPORT_EVERY_US {
                    self.last_wait_log_us = now_us;
                    if let Some(what) = self.waiting_for() {
                        tracing::info!("{what}");
                        if self.hosts.is_some() {
                            // The launch on the rendezvous host prints it.
                            out.push(Action::Waiting(what));
                        }
                    }
                }
            }
        }
        out
    }

    /// The `Error` that refuses `msg` on connection `conn` before it changes anything:
    /// the authorization table says its class may not send it (PROTOCOL.md §7.1), or it
    /// names a rank other than the connection's own. `None`: it goes on to its handler
    /// (which refuses what the scheduler does not take at all).
    fn forbidden(&self, conn: ConnId, msg: &Message) -> Option<Message> {
        let name = authz::name_of(msg);
        let role = self.nodes.get(&conn).map(|n| n.role);
        let key = self.opened.get(&conn).map_or(KeyId::Cluster, |(k, _)| *k);
        let (class, proven) = if self.hosts.as_ref().is_some_and(|h| h.is_agent(conn)) {
            (Class::Agent, "a host agent".to_string())
        } else {
            let proven = role.map(|r| (r.peer_role(), r.id()));
            (Class::of(key, proven.map(|(r, _)| r)), authz::proven_name(proven, key))
        };
        let why = match (authz::check(Receiver::Scheduler, class, name), msg, role) {
            (Verdict::Forbidden, _, _) => {
                format!("{proven} may not send {name} to the scheduler (docs/PROTOCOL.md §7.1)")
            }
            (_, Message::Control(Control::WorkerDone { rank }), Some(Role::Worker(own))) if *rank != own => {
                format!("{proven} may not say that worker {rank} is done")
            }
            (_, Message::Control(Control::WorkerLoad(load)), Some(Role::Worker(own))) if load.rank != own => {
                format!("{proven} may not report the load of worker {}", load.rank)
            }
            (_, Message::Control(Control::ServerLoad(load)), Some(Role::Server(own))) if load.server_id != own => {
                format!("{proven} may not report the load of server {}", load.server_id)
            }
            (_, Message::Control(Control::AssignDone { server_id }), Some(Role::Server(own))) if *server_id != own => {
                format!("{proven} may not say that server {server_id} holds its blocks")
            }
            (_, Message::Control(Control::MigrateDone(r)), Some(Role::Server(own))) if r.from != own => {
                format!("{proven} may not report a migration from server {}", r.from)
            }
            _ => return None,
        };
        tracing::warn!(conn, message = name, claimed = %authz::claimed(msg), %proven, %why, "forbidden message refused");
        Some(Message::Error(ErrorReply { code: ErrorCode::Forbidden, message: format!("{why}; nothing changed") }))
    }

    /// Closes every connection that has not registered within [`REGISTER_WITHIN_US`].
    fn close_unregistered(&mut self, out: &mut Vec<Action>) {
        let now_us = self.now_us;
        let late: Vec<ConnId> = self
            .opened
            .iter()
            .filter(|(c, (_, since))| {
                now_us.saturating_sub(*since) > REGISTER_WITHIN_US
                    && !self.nodes.contains_key(c)
                    && !self.rejoining.values().any(|r| r.conn == **c)
                    && !self.hosts.as_ref().is_some_and(|h| h.is_agent(**c))
            })
            .map(|(c, _)| *c)
            .collect();
        for conn in late {
            tracing::warn!(conn, within_s = REGISTER_WITHIN_US / 1_000_000, "connection closed: it did not register");
            let message = format!(
                "closed: this connection did not register within {} s (RegisterServer, RegisterWorker, JoinHost, ...)",
                REGISTER_WITHIN_US / 1_000_000
            );
            let msg = Message::Error(ErrorReply { code: ErrorCode::BadRequest, message });
            out.push(Action::Send { conn, request_id: 0, msg });
            out.push(Action::Close(conn));
            self.opened.remove(&conn);
            self.shut.insert(conn);
        }
    }

    fn on_message(&mut self, conn: ConnId, request_id: u64, control: Control, out: &mut Vec<Action>) {
        let reply = |out: &mut Vec<Action>, msg: Message| out.push(Action::Send { conn, request_id, msg });
        let refuse = |out: &mut Vec<Action>, code: ErrorCode, message: String| {
            tracing::warn!(conn, %message, "refused");
            out.push(Action::Send { conn, request_id, msg: Message::Error(ErrorReply { code, message }) });
        };
        let role = self.nodes.get(&conn).map(|n| n.role);
        match (control, role) {
            (Control::JoinHost(offer), None) => self.join_host(conn, request_id, offer, out),
            (Control::RegisterServer { data_addr }, None) => {
                let id = self.servers.len() as u32;
                let initial = id < self.config.servers;
                let late_ok = self.layout_ready && self.elastic.registered_count() < self.config.max_servers;
                if !initial && !late_ok {
                    let max = self.config.max_servers.max(self.config.servers);
                    refuse(
                        out,
                        ErrorCode::BadRequest,
                        format!("the job already has its {max} servers (--max-servers)"),
                    );
                    out.push(Action::Close(conn));
                    return;
                }
                tracing::info!(server = id, addr = %data_addr, initial, "server joined");
                if let Some(h) = self.hosts.as_mut() {
                    h.server_registered(id, &data_addr, self.peers.get(&conn).map(String::as_str));
                }
                self.servers.push((conn, data_addr));
                self.nodes.insert(conn, Node { role: Role::Server(id), last_seen_us: self.now_us });
                self.elastic.registered(id, initial, self.now_us);
                reply(out, self.welcome(PeerRole::Server, id));
                if initial {
                    self.try_assign(out);
                } else if let Some(a) = self.assignment(id) {
                    self.send_assignment(conn, a, out);
                }
            }
            (Control::RegisterWorker, None) => {
                let rank = self.workers.len() as u32;
                if rank >= self.config.workers {
                    refuse(
                        out,
                        ErrorCode::BadRequest,
                        format!("the job already has its {} workers", self.config.workers),
                    );
                    out.push(Action::Close(conn));
                    return;
                }
                tracing::info!(rank, "worker joined");
                if let Some(h) = self.hosts.as_mut() {
                    h.worker_registered(rank, self.peers.get(&conn).map(String::as_str));
                }
                self.workers.push(conn);
                self.nodes.insert(conn, Node { role: Role::Worker(rank), last_seen_us: self.now_us });
                reply(out, self.welcome(PeerRole::Worker, rank));
            }
            (Control::DefineModel { tensors, optimizers }, Some(Role::Worker(rank))) => {
                if let Err(message) = self.define(tensors, optimizers, rank) {
                    refuse(out, ErrorCode::BadRequest, message);
                    return;
                }
                self.waiting_for_layout.push((conn, request_id));
                self.try_assign(out);
                self.answer_layout_waiters(out);
            }
            (Control::GetStartClock, Some(role)) => {
                let rejoined = match role {
                    Role::Worker(rank) => self.rejoin_clocks.get(&rank).copied(),
                    Role::Server(_) => None,
                };
                reply(out, Control::StartClock { clock: rejoined.unwrap_or(self.start_clock()) }.into())
            }
            (Control::RejoinWorker { rank }, None) => {
                if let Err(message) = self.rejoin(conn, request_id, rank, out) {
                    refuse(out, ErrorCode::BadRequest, message);
                    out.push(Action::Close(conn));
                }
            }
            (Control::ReattachServer { server_id, credential, data_addr, blocks }, None) => {
                if let Err((code, message)) = self.check_credential(&credential, PeerRole::Server, server_id) {
                    refuse(out, code, message);
                    out.push(Action::Close(conn));
                } else if let Err(message) = self.reattach_server(conn, request_id, server_id, data_addr, blocks, out) {
                    refuse(out, ErrorCode::BadRequest, message);
                    out.push(Action::Close(conn));
                }
            }
            (Control::ReattachWorker { rank, credential }, None) => {
                if let Err((code, message)) = self.check_credential(&credential, PeerRole::Worker, rank) {
                    refuse(out, code, message);
                    out.push(Action::Close(conn));
                } else if let Err(message) = self.reattach_worker(conn, request_id, rank, out) {
                    refuse(out, ErrorCode::BadRequest, message);
                    out.push(Action::Close(conn));
                }
            }
            (Control::WorkerAdded { rank, clock }, Some(Role::Server(id))) => self.worker_added(rank, id, clock, out),
            (Control::CheckpointWritten { clock, blocks }, Some(Role::Server(_))) => {
                self.checkpoint_written(clock, blocks, out)
            }
            (Control::GetLayout, Some(_)) => {
                if self.partition.is_none() {
                    refuse(out, ErrorCode::NotReady, "no model is defined yet".into());
                    return;
                }
                self.waiting_for_layout.push((conn, request_id));
                self.answer_layout_waiters(out);
            }
            (Control::AssignDone { .. }, Some(Role::Server(id))) if self.layout_ready => {
                if let Some(placement) = self.placement.as_ref() {
                    let orders = self.elastic.serving_now(id, placement, self.now_us);
                    self.carry_out(orders, out);
                }
            }
            (Control::AssignDone { .. }, Some(Role::Server(id))) => {
                self.assigned.insert(id);
                if self.assigned.len() as u32 == self.config.servers {
                    tracing::info!(servers = self.config.servers, "every server holds its blocks: training can start");
                    self.layout_ready = true;
                    self.answer_layout_waiters(out);
                }
            }
            (Control::Heartbeat, Some(_)) => {}
            (Control::ServerLoad(load), Some(Role::Server(id))) => {
                self.elastic.server_load(ServerLoad { server_id: id, ..load });
            }
            (Control::WorkerLoad(load), Some(Role::Worker(rank))) => {
                self.elastic.worker_load(WorkerLoad { rank, ..load }, self.now_us);
            }
            (Control::MigrateDone(report), Some(Role::Server(id))) if report.from == id => {
                let Some(placement) = self.placement.as_mut() else { return };
                let backups = placement.backups.clone();
                let (expected, orders) = self.elastic.migrated(&report, placement, self.now_us);
                if placement.backups != backups {
                    // The new owner was a backup of the block: it is not any more.
                    self.broadcast_replicas(out);
                }
                if request_id != 0 {
                    if expected || self.move_recorded(&report) {
                        reply(out, Control::Ok.into());
                    } else {
                        let block = report.block;
                        refuse(
                            out,
                            ErrorCode::BadRequest,
                            format!("no migration of block {block} from server {id} is under way"),
                        );
                    }
                }
                self.carry_out(orders, out);
            }
            (Control::GetStatus, _) => reply(out, Control::Status(self.status()).into()),
            (Control::Scale(req), _) => {
                let Some(placement) = self.placement.as_ref().filter(|_| self.layout_ready) else {
                    refuse(out, ErrorCode::NotReady, "the job is not running yet: no model is placed".into());
                    return;
                };
                match self.elastic.scale(req, placement, self.can_launch, self.now_us) {
                    Ok(orders) => {
                        reply(out, Control::Ok.into());
                        self.carry_out(orders, out);
                    }
                    Err(message) => refuse(out, ErrorCode::BadRequest, message),
                }
            }
            (Control::Barrier, Some(Role::Worker(rank))) => {
                self.barrier.retain(|(_, _, r)| *r != rank);
                self.barrier.push((conn, request_id, rank));
                self.release_barrier(out);
            }
            (Control::SetOptimizer { tensor, optimizer }, Some(Role::Worker(rank))) => {
                let Some(partition) = self.partition.as_mut() else {
                    refuse(out, ErrorCode::NotReady, "no model is defined yet".into());
                    return;
                };
                match partition.set_optimizer(tensor, optimizer) {
                    Ok(()) => {
                        tracing::info!(rank, tensor, ?optimizer, "tensor optimizer set");
                        reply(out, Control::Ok.into());
                    }
                    Err(e) => refuse(out, ErrorCode::BadRequest, e.to_string()),
                }
            }
            (Control::WorkerDone { .. }, Some(Role::Worker(rank))) => {
                tracing::info!(rank, "worker finished");
                reply(out, Control::Ok.into());
                self.worker_left(rank, out);
                self.done_again(rank, out);
            }
            (other, role) => {
                let who = role.map_or("an unregistered peer".to_string(), |r| format!("{r:?}").to_lowercase());
                refuse(
                    out,
                    ErrorCode::BadRequest,
                    format!("{who} sent {other:?}, which the scheduler does not take now"),
                );
            }
        }
    }

    /// A message from a host agent, or one that asks to become one.
    fn on_agent_message(&mut self, conn: ConnId, request_id: u64, control: Control, out: &mut Vec<Action>) {
        let Some(hosts) = self.hosts.as_mut() else { return };
        hosts.heard(conn, self.now_us);
        match control {
            Control::Heartbeat => {}
            Control::HostEvent { line } => out.push(Action::Relay(line)),
            Control::NodeExited { slot, ok, status, rank } => {
                tracing::info!(slot, ok, %status, ?rank, "a host's node exited");
                if let Some(start) = hosts.exited(conn, slot, ok, rank) {
                    out.push(start_node(start, self.config.workers));
                }
            }
            other => {
                let message = format!("a host agent sent {}, which the scheduler does not take from it", other.name());
                tracing::warn!(conn, %message, "refused");
                out.push(Action::Send {
                    conn,
                    request_id,
                    msg: Message::Error(ErrorReply { code: ErrorCode::BadRequest, message }),
                });
            }
        }
    }

    /// A host agent asks to join the job.
    fn join_host(&mut self, conn: ConnId, request_id: u64, offer: elasticps_wire::HostOffer, out: &mut Vec<Action>) {
        let refuse = |out: &mut Vec<Action>, message: String| {
            tracing::warn!(conn, %message, "host refused");
            out.push(Action::Send {
                conn,
                request_id,
                msg: Message::Error(ErrorReply { code: ErrorCode::BadRequest, message }),
            });
            out.push(Action::Close(conn));
        };
        let Some(hosts) = self.hosts.as_mut() else {
            return refuse(out, "this scheduler runs a job on its own host: start it with `elasticps launch --nnodes MIN:MAX --rdzv HOST:PORT` for hosts to join".into());
        };
        match hosts.join(conn, offer, self.now_us) {
            Ok(host) => {
                out.push(Action::Send { conn, request_id, msg: Control::HostWelcome { host }.into() });
                if let Some(r) = hosts.initial() {
                    self.resize(r.servers, r.workers);
                    out.extend(r.starts.into_iter().map(|s| start_node(s, r.workers)));
                }
            }
            Err(message) => refuse(out, message),
        }
    }

    /// The job's size, once its hosts joined (before any node registered): the flags'
    /// bounds on scaling widen to include it.
    fn resize(&mut self, servers: u32, workers: u32) {
        let c = &mut self.config;
        (c.servers, c.workers, c.shard.workers) = (servers, workers, workers);
        c.max_servers = c.max_servers.max(servers);
        c.min_servers = c.min_servers.min(servers);
        self.elastic.set_bounds(c.min_servers, c.max_servers);
    }

    /// A host left the job: its servers and workers are lost with it (servers fail over
    /// with replicas), and what can be started again elsewhere is.
    fn host_lost(&mut self, lost: hosts::LostHost, out: &mut Vec<Action>) {
        let why = format!("host {} lost: {}", lost.label, lost.why);
        self.elastic.event(
            self.now_us,
            "host-lost",
            None,
            format!("{}; servers {:?}, workers {:?}", why, lost.servers, lost.ranks),
        );
        let mut conns: Vec<ConnId> = Vec::new();
        for id in &lost.servers {
            conns.extend(self.servers.get(*id as usize).map(|(c, _)| *c).filter(|c| self.nodes.contains_key(c)));
        }
        for rank in &lost.ranks {
            conns.extend(self.workers.get(*rank as usize).copied().filter(|c| self.nodes.contains_key(c)));
        }
        for conn in conns {
            self.on_lost(conn, &why, out);
            out.push(Action::Close(conn));
        }
        if self.over {
            return;
        }
        let Some(hosts) = self.hosts.as_mut() else { return };
        let (starts, missed) = hosts.replace(&lost);
        out.extend(starts.into_iter().map(|s| start_node(s, self.config.workers)));
        for m in missed {
            tracing::warn!(host = %lost.label, "not started again: {m}");
        }
        if hosts.agents().is_empty() {
            self.finish(false, format!("{why}; no host is left in the job"), out);
        }
    }

    /// The `Welcome` of a node registered as `role` `node_id`, with its credential.
    fn welcome(&self, role: PeerRole, node_id: u32) -> Message {
        let credential = Credential::issue(&self.secret, self.job, role, node_id);
        Control::Welcome { node_id, num_workers: self.config.workers, num_servers: self.config.servers, credential }
            .into()
    }

    /// Whether a reattaching node's credential is this job's for `role` `id`.
    fn check_credential(&self, credential: &Credential, role: PeerRole, id: u32) -> Result<(), (ErrorCode, String)> {
        credential.verify_for(&self.secret, self.job).map_err(|e| (ErrorCode::Unauthenticated, e.to_string()))?;
        if (credential.role, credential.id) != (role, id) {
            let message = format!("the credential of {credential} cannot reattach as {role:?} {id}");
            return Err((ErrorCode::Unauthenticated, message.to_lowercase()));
        }
        Ok(())
    }

    fn define(
        &mut self,
        tensors: Vec<TensorSpec>,
        optimizers: Vec<Option<TensorOptimizer>>,
        rank: u32,
    ) -> Result<(), String> {
        match &self.partition {
            Some(p) if p.tensors == tensors => Ok(()),
            Some(p) => Err(format!(
                "worker {rank} defined a model that differs from the one already defined ({} tensors, first {:?}; got {} tensors)",
                p.tensors.len(),
                p.tensors.first().map(|t| &t.name),
                tensors.len()
            )),
            None => {
                let p = Partition::new(tensors, self.config.block_bytes)
                    .and_then(|p| p.with_optimizers(optimizers))
                    .map_err(|e| e.to_string())?;
                tracing::info!(
                    tensors = p.tensors.len(),
                    blocks = p.blocks.len(),
                    values = p.total_len(),
                    "model defined"
                );
                self.partition = Some(p);
                Ok(())
            }
        }
    }

    /// Answers a barrier once every worker still in the job (registered or yet to come,
    /// not done and not removed) waits in it.
    fn release_barrier(&mut self, out: &mut Vec<Action>) {
        let live = (self.config.workers as usize).saturating_sub(self.finished_workers.len());
        if self.barrier.is_empty() || self.barrier.len() < live {
            return;
        }
        tracing::debug!(workers = self.barrier.len(), "barrier released");
        for (conn, request_id, _) in self.barrier.drain(..) {
            out.push(Action::Send { conn, request_id, msg: Control::Ok.into() });
        }
    }

    fn try_assign(&mut self, out: &mut Vec<Action>) {
        let Some(partition) = &self.partition else { return };
        if self.placement.is_some() || (self.servers.len() as u32) < self.config.servers {
            return;
        }
        if let Some(r) = self.config.checkpoint.as_ref().and_then(|p| p.resume.as_ref())
            && r.blocks.len() != partition.blocks.len()
        {
            let reason = format!(
                "the checkpoint of clock {} holds {} blocks, this model in blocks of {} bytes has {}: resume with the \
                 same model and --block-bytes",
                r.clock,
                r.blocks.len(),
                self.config.block_bytes,
                partition.blocks.len()
            );
            self.finish(false, reason, out);
            return;
        }
        let placement = match Placement::initial(self.config.placement, partition, self.config.servers)
            .and_then(|p| p.with_replicas(self.config.replicas, self.config.servers))
        {
            Ok(p) => p,
            Err(e) => {
                self.finish(false, format!("cannot place the model: {e}"), out);
                return;
            }
        };
        self.elastic.model_placed(partition.blocks.iter().map(|b| b.bytes() as u64).collect());
        self.placement = Some(placement);
        for id in 0..self.servers.len() {
            if let Some(a) = self.assignment(id as u32) {
                self.send_assignment(self.servers[id].0, a, out);
            }
        }
    }

    /// `Assign` to a server, after the checkpoint plan if the job has one.
    fn send_assignment(&self, conn: ConnId, a: Assignment, out: &mut Vec<Action>) {
        if let Some(plan) = &self.config.checkpoint {
            out.push(Action::Send { conn, request_id: 0, msg: Control::Checkpointing(plan.clone()).into() });
        }
        out.push(Action::Send { conn, request_id: 0, msg: Control::Assign(a).into() });
        if let Some(msg) = self.replicas_message() {
            out.push(Action::Send { conn, request_id: 0, msg });
        }
    }

    /// `Replicas` (who holds which copy, and where the servers are) for a job with
    /// replicas.
    fn replicas_message(&self) -> Option<Message> {
        if self.config.replicas <= 1 {
            return None;
        }
        let layout = self.layout()?;
        Some(Control::Replicas { placement: layout.placement, servers: layout.servers }.into())
    }

    /// Sends `Replicas` to every server still in the job.
    fn broadcast_replicas(&self, out: &mut Vec<Action>) {
        let Some(msg) = self.replicas_message() else { return };
        for (conn, n) in &self.nodes {
            if matches!(n.role, Role::Server(_)) {
                out.push(Action::Send { conn: *conn, request_id: 0, msg: msg.clone() });
            }
        }
    }

    /// Keeps every block at `replicas - 1` backups on serving servers: a backup on a
    /// server that drains (or left) is dropped, and a block short of backups gets new
    /// ones on the serving servers with the fewest copies that hold none of it (and are
    /// not where it migrates to). A block stays short while too few servers serve (one
    /// more joining fixes it). The caller tells the servers if a copy changed.
    fn rebuild_copies(&mut self) {
        let want = self.config.replicas.saturating_sub(1) as usize;
        if want == 0 {
            return;
        }
        let serving = self.elastic.serving();
        let moving: Vec<Option<u32>> = match &self.placement {
            Some(p) => (0..p.owners.len() as BlockId).map(|b| self.elastic.migrating_to(b)).collect(),
            None => return,
        };
        let Some(placement) = self.placement.as_mut() else { return };
        let (mut dropped, mut added, mut short) = (0, 0, 0);
        for backups in placement.backups.iter_mut() {
            let before = backups.len();
            backups.retain(|s| serving.contains(s));
            dropped += before - backups.len();
        }
        let mut copies: BTreeMap<u32, usize> = serving.iter().map(|s| (*s, 0)).collect();
        for b in 0..placement.owners.len() as BlockId {
            for s in placement.backups_of(b).iter().chain(placement.owner(b).as_slice()) {
                if let Some(c) = copies.get_mut(s) {
                    *c += 1;
                }
            }
        }
        for b in 0..placement.owners.len() as BlockId {
            while placement.backups_of(b).len() < want {
                let target = copies
                    .iter()
                    .filter(|(s, _)| !placement.holds_copy(b, **s) && moving[b as usize] != Some(**s))
                    .min_by_key(|(s, c)| (**c, **s));
                let Some((&s, _)) = target else {
                    short += 1;
                    break;
                };
                if placement.add_backup(b, s).is_err() {
                    break;
                }
                *copies.entry(s).or_default() += 1;
                added += 1;
            }
        }
        debug_assert_eq!(placement.check_copies(), Ok(()));
        if dropped + added == 0 {
            return;
        }
        let why = format!(
            "{dropped} backup copies dropped from servers that left or drain, {added} placed; {short} blocks short of \
             {want} backups (too few servers)"
        );
        self.elastic.event(self.now_us, "copies-rebuilt", None, why);
    }

    /// Server `id` is lost in a job with replicas: its primaries are promoted to their
    /// first backups (the epoch goes up), its copies are rebuilt elsewhere, and training
    /// goes on. A block with no other copy ends the job.
    fn failover(&mut self, id: u32, why: &str, silent_us: u64, out: &mut Vec<Action>) {
        let addr = self.servers.get(id as usize).map_or(String::new(), |(_, a)| a.clone());
        let Some(placement) = self.placement.as_mut().filter(|_| self.layout_ready) else {
            return self.finish(false, format!("server {id} ({addr}) is gone before training started: {why}"), out);
        };
        let detection = format!("{why}; last heard from {:.2} s before", silent_us as f64 / 1e6);
        match placement.fail_server(id) {
            Err(block) => {
                let reason = format!("server {id} ({addr}) is gone: {detection}; block {block} had no other copy");
                self.finish(false, reason, out);
            }
            Ok(promoted) => {
                tracing::warn!(server = id, %addr, %detection, promoted = promoted.len(), epoch = placement.epoch, "server lost: its blocks fail over to their backups");
                let orders = self.elastic.failed(id, &detection, promoted.len(), placement, self.now_us);
                self.rebuild_copies();
                self.broadcast_replicas(out);
                self.carry_out(orders, out);
            }
        }
    }

    /// A server wrote blocks of checkpoint `clock`: once every block is written, the
    /// manifest makes it complete (and older checkpoints still under way are dropped).
    fn checkpoint_written(&mut self, clock: u32, blocks: Vec<CheckpointEntry>, out: &mut Vec<Action>) {
        let (Some(plan), Some(partition)) = (&self.config.checkpoint, &self.partition) else { return };
        if self.last_checkpoint.is_some_and(|last| clock <= last) {
            return;
        }
        let written = self.checkpoints.entry(clock).or_default();
        for e in blocks {
            written.entry(e.block).or_insert(e);
        }
        if written.len() < partition.blocks.len() {
            return;
        }
        let blocks: Vec<CheckpointEntry> = self.checkpoints.remove(&clock).unwrap_or_default().into_values().collect();
        self.checkpoints.retain(|c, _| *c > clock);
        self.last_checkpoint = Some(clock);
        tracing::info!(clock, blocks = blocks.len(), dir = %plan.dir, "checkpoint complete");
        out.push(Action::WriteManifest { dir: plan.dir.clone(), clock, blocks });
    }

    /// The first clock of the job: the resumed checkpoint's, or 0.
    pub fn start_clock(&self) -> u32 {
        self.config.checkpoint.as_ref().and_then(|p| p.resume.as_ref()).map_or(0, |r| r.clock)
    }

    /// What server `id` is to hold now (for a late server: nothing, until blocks move to it).
    fn assignment(&self, id: u32) -> Option<Assignment> {
        Some(Assignment {
            server_id: id,
            partition: self.partition.clone()?,
            placement: self.placement.clone()?,
            config: self.config.shard_config(id),
            seed: self.config.seed,
            inject: self.config.injection(id),
        })
    }

    /// Turns elasticity orders into actions; then keeps the copies on serving servers
    /// (a server that starts draining hands its backups on, one that joined takes those a
    /// lost server left short).
    fn carry_out(&mut self, orders: Vec<Order>, out: &mut Vec<Action>) {
        let before = self.placement.as_ref().map(|p| p.backups.clone());
        self.carry_out_orders(orders, out);
        self.rebuild_copies();
        if self.placement.as_ref().map(|p| &p.backups) != before.as_ref() {
            self.broadcast_replicas(out);
        }
    }

    fn carry_out_orders(&mut self, orders: Vec<Order>, out: &mut Vec<Action>) {
        for order in orders {
            match order {
                Order::Migrate { block, from, to, epoch } => {
                    let (Some((conn, _)), Some((_, to_addr))) =
                        (self.servers.get(from as usize), self.servers.get(to as usize))
                    else {
                        continue;
                    };
                    tracing::info!(block, from, to, epoch, "migration starts");
                    let msg = Control::Migrate { block, to, to_addr: to_addr.clone(), epoch }.into();
                    out.push(Action::Send { conn: *conn, request_id: 0, msg });
                }
                Order::StartServer => match self.hosts.as_mut() {
                    None => out.push(Action::StartServer),
                    Some(h) => {
                        let slowest = self.placement.as_ref().and_then(|_| self.elastic.slowest(self.now_us));
                        match h.start_server(slowest) {
                            Ok(start) => out.push(start_node(start, self.config.workers)),
                            Err(e) => {
                                tracing::warn!(error = %e, "the balancer's new server cannot be started");
                                self.elastic.event(self.now_us, "scale-out-failed", None, e);
                            }
                        }
                    }
                },
                Order::Stop { server, reason } => {
                    if let Some((conn, _)) = self.servers.get(server as usize) {
                        tracing::info!(server, %reason, "server stops");
                        out.push(Action::Send { conn: *conn, request_id: 0, msg: Control::Shutdown { reason }.into() });
                    }
                }
                Order::Settle { block, to, epoch, owner } => {
                    // The new owner first; then every other server, whose placement then
                    // names the block's owner (a server takes a block's snapshot from the
                    // owner it knows only).
                    tracing::debug!(block, to, epoch, owner, "migration settled");
                    let first = self.servers.get(to as usize).map(|(c, _)| *c);
                    let others = self.servers.iter().map(|(c, _)| *c).filter(|c| Some(*c) != first);
                    let conns: Vec<ConnId> =
                        first.into_iter().chain(others).filter(|c| self.nodes.contains_key(c)).collect();
                    for conn in conns {
                        let msg = Control::Settled { block, epoch, owner }.into();
                        out.push(Action::Send { conn, request_id: 0, msg });
                    }
                }
            }
        }
    }

    fn layout(&self) -> Option<Layout> {
        let removed = self.elastic.removed();
        Some(Layout {
            partition: self.partition.clone()?,
            placement: self.placement.clone()?,
            servers: self
                .servers
                .iter()
                .enumerate()
                .filter(|(id, _)| !removed.contains(&(*id as u32)))
                .map(|(id, (_, addr))| ServerAddr { id: id as u32, addr: addr.clone() })
                .collect(),
            seed: self.config.seed,
        })
    }

    fn answer_layout_waiters(&mut self, out: &mut Vec<Action>) {
        if !self.layout_ready {
            return;
        }
        let Some(layout) = self.layout() else { return };
        for (conn, request_id) in self.waiting_for_layout.drain(..) {
            out.push(Action::Send { conn, request_id, msg: Control::Layout(layout.clone()).into() });
        }
    }

    /// A restarted worker asks to come back as `rank`: every live server is asked to take
    /// it back ([`Control::AddWorker`]); it is welcomed once they all answered.
    fn rejoin(&mut self, conn: ConnId, request_id: u64, rank: u32, out: &mut Vec<Action>) -> Result<(), String> {
        if rank >= self.config.workers {
            return Err(format!("worker {rank} cannot rejoin: the job has workers 0..{}", self.config.workers));
        }
        if rank as usize >= self.workers.len() {
            return Err(format!("worker {rank} cannot rejoin: it never joined (RegisterWorker)"));
        }
        if self.finished_workers.contains(&rank) && !self.failed_workers.contains_key(&rank) {
            return Err(format!("worker {rank} cannot rejoin: it finished"));
        }
        if !self.failed_workers.contains_key(&rank) {
            // Its old process is gone (it was restarted) but its connection has not been
            // seen closing yet: the new one takes the rank over. Only with the cluster
            // secret: a worker-secret connection proves no rank, and could take a live one.
            let old = self.nodes.iter().find(|(_, n)| n.role == Role::Worker(rank)).map(|(c, _)| *c);
            if old.is_some() && self.opened.get(&conn).is_some_and(|(k, _)| *k == KeyId::Worker) {
                return Err(format!(
                    "worker {rank} is connected: a connection of the worker secret rejoins only a rank the scheduler \
                     lost"
                ));
            }
            if let Some(old) = old {
                self.on_lost(old, "replaced by a restarted worker with its rank", out);
                out.push(Action::Close(old));
            }
        }
        if self.rejoining.contains_key(&rank) {
            return Err(format!("worker {rank} is already rejoining"));
        }
        let live: Vec<(u32, ConnId)> = self
            .nodes
            .iter()
            .filter_map(|(c, n)| match n.role {
                Role::Server(id) => Some((id, *c)),
                Role::Worker(_) => None,
            })
            .collect();
        tracing::info!(rank, servers = live.len(), "a restarted worker rejoins");
        let mut waiting = BTreeSet::new();
        for (id, server) in live {
            waiting.insert(id);
            out.push(Action::Send { conn: server, request_id: 0, msg: Control::AddWorker { rank }.into() });
        }
        self.rejoining.insert(rank, Rejoin { conn, request_id, waiting, clock: u32::MAX });
        self.worker_added(rank, u32::MAX, u32::MAX, out);
        Ok(())
    }

    /// Server `server` took `rank` back (its next clock there is `clock`); the last one
    /// to answer welcomes the worker.
    fn worker_added(&mut self, rank: u32, server: u32, clock: u32, out: &mut Vec<Action>) {
        let Some(r) = self.rejoining.get_mut(&rank) else { return };
        r.waiting.remove(&server);
        r.clock = r.clock.min(clock);
        if !r.waiting.is_empty() {
            return;
        }
        let Some(r) = self.rejoining.remove(&rank) else { return };
        let clock = if r.clock == u32::MAX { self.start_clock() } else { r.clock };
        tracing::info!(rank, clock, "worker rejoined");
        self.failed_workers.remove(&rank);
        self.finished_workers.remove(&rank);
        self.elastic.worker_rejoined(rank);
        self.rejoin_clocks.insert(rank, clock);
        if let Some(h) = self.hosts.as_mut() {
            h.worker_registered(rank, self.peers.get(&r.conn).map(String::as_str));
        }
        if let Some(c) = self.workers.get_mut(rank as usize) {
            *c = r.conn;
        }
        self.nodes.insert(r.conn, Node { role: Role::Worker(rank), last_seen_us: self.now_us });
        out.push(Action::Send { conn: r.conn, request_id: r.request_id, msg: self.welcome(PeerRole::Worker, rank) });
    }

    fn worker_left(&mut self, rank: u32, out: &mut Vec<Action>) {
        if !self.finished_workers.insert(rank) {
            return;
        }
        self.elastic.worker_left(rank);
        self.barrier.retain(|(_, _, r)| *r != rank);
        self.release_barrier(out);
        for (conn, _) in &self.servers {
            out.push(Action::Send { conn: *conn, request_id: 0, msg: Control::RemoveWorker { rank }.into() });
        }
        self.maybe_end(out);
    }

    /// Ends the job once every worker left: well if none was lost, else (after waiting
    /// `rejoin_wait_us` for lost ones to rejoin) without them.
    fn maybe_end(&mut self, out: &mut Vec<Action>) {
        if self.finished_workers.len() as u32 == self.config.workers && self.rejoining.is_empty() {
            let waited = self.awaiting_rejoin_since.map(|since| self.now_us.saturating_sub(since));
            if self.failed_workers.is_empty() {
                self.finish(true, "every worker finished".into(), out);
            } else if self.config.rejoin_wait_us > 0 && waited.is_none_or(|w| w < self.config.rejoin_wait_us) {
                if waited.is_none() {
                    let lost: Vec<&u32> = self.failed_workers.keys().collect();
                    tracing::info!(
                        ?lost,
                        wait_s = self.config.rejoin_wait_us as f64 / 1e6,
                        "every other worker is done; the job waits for lost workers to rejoin"
                    );
                    self.awaiting_rejoin_since = Some(self.now_us);
                }
            } else {
                let failed: Vec<String> =
                    self.failed_workers.iter().map(|(r, why)| format!("worker {r} ({why})")).collect();
                let reason = format!("the job ended without {}", failed.join(", "));
                self.finish(false, reason, out);
            }
        }
    }

    fn on_lost(&mut self, conn: ConnId, why: &str, out: &mut Vec<Action>) {
        let Some(node) = self.nodes.remove(&conn) else { return };
        let silent_us = self.now_us.saturating_sub(node.last_seen_us);
        if let Role::Server(id) = node.role {
            // A restarted worker waits for no server that left.
            let ranks: Vec<u32> = self.rejoining.keys().copied().collect();
            for rank in ranks {
                self.worker_added(rank, id, u32::MAX, out);
            }
        }
        match node.role {
            Role::Server(id) if self.elastic.lost(id, self.now_us) => {
                tracing::info!(server = id, %why, "a removed server left");
                // Its backup copies (a drained server backs up blocks it does not own).
                if let Some(p) = self.placement.as_mut()
                    && p.backups_on(id).next().is_some()
                    && p.fail_server(id).is_ok()
                {
                    self.rebuild_copies();
                    self.broadcast_replicas(out);
                }
            }
            Role::Server(id) if self.config.replicas > 1 => self.failover(id, why, silent_us, out),
            Role::Server(id) => {
                let addr = self.servers.get(id as usize).map_or("", |(_, a)| a.as_str());
                let resume = match (&self.config.checkpoint, self.last_checkpoint) {
                    (Some(plan), Some(clock)) => {
                        format!("; resume from its latest checkpoint (clock {clock}) with --resume {}", plan.dir)
                    }
                    (Some(plan), None) => format!("; no checkpoint in {} is complete yet", plan.dir),
                    (None, _) => "; with --checkpoint-dir DIR --checkpoint-every N a job can be resumed".into(),
                };
                self.finish(false, format!("server {id} ({addr}) is gone: {why}{resume}"), out);
            }
            Role::Worker(rank) if !self.finished_workers.contains(&rank) => {
                tracing::error!(rank, %why, "worker lost before it finished; removing it from every quorum");
                self.failed_workers.insert(rank, why.to_string());
                self.worker_left(rank, out);
            }
            Role::Worker(_) => {}
        }
    }

    fn finish(&mut self, ok: bool, reason: String, out: &mut Vec<Action>) {
        if self.defer_finish(ok, &reason) {
            return;
        }
        // Workers still waiting for the layout learn why there will be none.
        for (conn, request_id) in std::mem::take(&mut self.waiting_for_layout) {
            let reply = ErrorReply { code: ErrorCode::ShuttingDown, message: reason.clone() };
            out.push(Action::Send { conn, request_id, msg: Message::Error(reply) });
        }
        if self.closing.is_some() {
            return;
        }
        let agents = self.hosts.as_ref().map(hosts::Hosts::agents).unwrap_or_default();
        for conn in self.nodes.keys().chain(&agents) {
            out.push(Action::Send {
                conn: *conn,
                request_id: 0,
                msg: Control::Shutdown { reason: reason.clone() }.into(),
            });
        }
        let servers: BTreeSet<ConnId> =
            self.nodes.iter().filter(|(_, n)| matches!(n.role, Role::Server(_))).map(|(c, _)| *c).collect();
        if self.config.checkpoint.is_some() && !servers.is_empty() {
            // A checkpoint of the last clocks may still be on its way to disk: its manifest
            // is written once the servers report it, so wait for them to leave.
            tracing::info!(servers = servers.len(), "the job is over; waiting for the servers' last checkpoint writes");
            self.closing = Some(Closing { ok, reason, until_us: self.now_us + CLOSING_WAIT_US, servers });
            return;
        }
        out.push(Action::Finish { ok, reason });
        self.over = true;
    }

    /// After `Shutdown` in a job with checkpoints: only checkpoint reports and servers
    /// leaving count, until every server left or the wait is over.
    fn step_closing(&mut self, event: Event, out: &mut Vec<Action>) {
        match event {
            Event::Received { conn, msg: Message::Control(Control::CheckpointWritten { clock, blocks }), .. }
                if self.nodes.contains_key(&conn) =>
            {
                self.checkpoint_written(clock, blocks, out)
            }
            Event::Received { conn, request_id, .. } if request_id != 0 => {
                // A call after the end (an operator's request, say) learns that it is over.
                let reason = self.closing.as_ref().map_or_else(String::new, |c| c.reason.clone());
                let reply = ErrorReply { code: ErrorCode::ShuttingDown, message: format!("the job is over: {reason}") };
                out.push(Action::Send { conn, request_id, msg: Message::Error(reply) });
            }
            Event::Received { .. } | Event::Connected { .. } => {}
            Event::Lost { conn, .. } => {
                self.nodes.remove(&conn);
                if let Some(c) = self.closing.as_mut() {
                    c.servers.remove(&conn);
                }
            }
            Event::Tick { now_us } => self.now_us = now_us,
        }
        if let Some(c) = self.closing.take_if(|c| c.servers.is_empty() || self.now_us >= c.until_us) {
            if !c.servers.is_empty() {
                tracing::warn!(servers = c.servers.len(), "servers still running after the checkpoint wait");
            }
            out.push(Action::Finish { ok: c.ok, reason: c.reason });
            self.over = true;
        }
    }
}

/// The message that tells a host's agent to start a node of a job of `workers` workers.
fn start_node(start: hosts::Start, workers: u32) -> Action {
    let msg = Control::StartNode { slot: start.slot, role: start.role, workers }.into();
    Action::Send { conn: start.conn, request_id: 0, msg }
}

#[cfg(test)]
mod tests {
    use super::*;
    use elasticps_core::model::Init;
    use elasticps_core::optimizer::{OptimizerConfig, OptimizerKind};

    fn config() -> JobConfig {
        JobConfig {
            servers: 2,
            workers: 2,
            block_bytes: 16,
            placement: PlacementKind::Range,
            shard: ShardConfig {
                sync: SyncPolicy::Bsp,
                optimizer: OptimizerConfig { kind: OptimizerKind::Sgd, lr: 0.1, aggregate: false, weight_decay: 0.0 },
                workers: 2,
            },
            seed: 1,
            server_sync: vec![(1, SyncPolicy::Ssp(2))],
            inject: Vec::new(),
            balance: Default::default(),
            max_servers: 2,
            min_servers: 2,
            checkpoint: None,
            rejoin_wait_us: 0,
            replicas: 1,
        }
    }

    fn recv(m: &mut Scheduler, conn: ConnId, request_id: u64, c: Control) -> Vec<Action> {
        m.step(Event::Received { conn, request_id, msg: c.into() })
    }

    fn model() -> Vec<TensorSpec> {
        vec![TensorSpec { name: "w".into(), shape: vec![8], init: Init::Zeros }]
    }

    fn sent_to(actions: &[Action], conn: ConnId) -> Vec<&Message> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Send { conn: c, msg, .. } if *c == conn => Some(msg),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn layout_is_answered_once_every_server_holds_its_blocks() {
        let mut m = Scheduler::new(config(), 10_000_000);
        recv(&mut m, 1, 1, Control::RegisterWorker);
        let a = recv(&mut m, 1, 2, Control::DefineModel { tensors: model(), optimizers: Vec::new() });
        assert!(a.is_empty(), "no servers yet: {a:?}");
        recv(&mut m, 10, 1, Control::RegisterServer { data_addr: "s0".into() });
        let a = recv(&mut m, 11, 1, Control::RegisterServer { data_addr: "s1".into() });
        assert!(matches!(sent_to(&a, 10)[0], Message::Control(Control::Assign(x)) if x.config.sync == SyncPolicy::Bsp));
        assert!(
            matches!(sent_to(&a, 11)[1], Message::Control(Control::Assign(x)) if x.config.sync == SyncPolicy::Ssp(2))
        );
        assert!(recv(&mut m, 10, 0, Control::AssignDone { server_id: 0 }).is_empty());
        let a = recv(&mut m, 11, 0, Control::AssignDone { server_id: 1 });
        match &a[..] {
            [Action::Send { conn: 1, request_id: 2, msg: Message::Control(Control::Layout(l)) }] => {
                assert_eq!(l.partition.blocks.len(), 2);
                assert_eq!(l.servers[1].addr, "s1");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            m.waiting_for(),
            Some("scheduler waits for 2 servers and 2 workers to register (has 2 servers, 1 workers)".into())
        );
    }

    fn join(m: &mut Scheduler, conn: ConnId, name: &str, ip: &str, servers: u32, workers: u32) -> Vec<Action> {
        m.step(Event::Connected { conn, peer: ip.into(), key: KeyId::Cluster });
        let offer = elasticps_wire::HostOffer {
            name: name.into(),
            addr: ip.into(),
            servers,
            workers,
            server_slots: servers + 1,
            worker_slots: workers + 1,
        };
        recv(m, conn, 1, Control::JoinHost(offer))
    }

    fn starts(actions: &[Action], conn: ConnId) -> Vec<elasticps_wire::NodeRole> {
        sent_to(actions, conn)
            .into_iter()
            .filter_map(|m| match m {
                Message::Control(Control::StartNode { role, workers: 2, .. }) => Some(*role),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_job_across_hosts_says_every_5_s_which_hosts_it_waits_for() {
        let hosts = hosts::HostsConfig { min_hosts: 2, max_hosts: 2, restart_workers: 0, restart_servers: 0 };
        let mut m = Scheduler::new(config(), 2_000_000).with_hosts(hosts);
        join(&mut m, 100, "a", "10.0.0.1", 1, 1);
        m.advance(WAIT_REPORT_EVERY_US - 100_000);
        recv(&mut m, 100, 0, Control::Heartbeat);
        let a = m.step(Event::Tick { now_us: WAIT_REPORT_EVERY_US });
        let what =
            "scheduler waits for hosts: 1 of at least 2 joined (a (10.0.0.1)); they offer 1 servers and 1 workers";
        assert_eq!(a, [Action::Waiting(what.into())]);
        assert!(m.step(Event::Tick { now_us: WAIT_REPORT_EVERY_US + 500_000 }).is_empty(), "once per 5 s");
    }

    #[test]
    fn a_job_across_hosts_starts_its_nodes_there_and_a_lost_host_fails_over_and_restarts_its_worker() {
        let hosts = hosts::HostsConfig { min_hosts: 2, max_hosts: 3, restart_workers: 1, restart_servers: 0 };
        let mut m = Scheduler::new(JobConfig { replicas: 2, ..config() }, 2_000_000).with_hosts(hosts);
        let a = join(&mut m, 100, "a", "10.0.0.1", 1, 1);
        assert!(matches!(sent_to(&a, 100)[..], [Message::Control(Control::HostWelcome { host: 0 })]));
        assert!(starts(&a, 100).is_empty(), "one host of two: {a:?}");
        assert!(m.waiting_for().unwrap().contains("1 of at least 2 joined (a (10.0.0.1))"));
        let a = join(&mut m, 200, "b", "10.0.0.2", 1, 1);
        let worker = elasticps_wire::NodeRole::Worker { rank: None };
        assert_eq!(starts(&a, 100), [elasticps_wire::NodeRole::Server, worker]);
        assert_eq!(starts(&a, 200), [elasticps_wire::NodeRole::Server, worker]);
        // The nodes register from their hosts; the job runs.
        for (conn, ip) in [(10, "10.0.0.1"), (20, "10.0.0.2"), (1, "10.0.0.1"), (2, "10.0.0.2")] {
            m.step(Event::Connected { conn, peer: ip.into(), key: KeyId::Cluster });
        }
        recv(&mut m, 10, 1, Control::RegisterServer { data_addr: "10.0.0.1:7100".into() });
        recv(&mut m, 20, 1, Control::RegisterServer { data_addr: "10.0.0.2:7100".into() });
        recv(&mut m, 1, 1, Control::RegisterWorker);
        recv(&mut m, 2, 1, Control::RegisterWorker);
        recv(&mut m, 1, 2, Control::DefineModel { tensors: model(), optimizers: Vec::new() });
        recv(&mut m, 10, 0, Control::AssignDone { server_id: 0 });
        recv(&mut m, 20, 0, Control::AssignDone { server_id: 1 });
        assert_eq!(m.waiting_for(), None);
        // Host b goes silent: after 2 s it is lost, its server fails over, its worker
        // restarts with its rank on host a.
        for t in 1..=4 {
            m.step(Event::Tick { now_us: t * 500_000 });
            for conn in [100, 10, 1] {
                recv(&mut m, conn, 0, Control::Heartbeat);
            }
        }
        let epoch = m.placement().unwrap().epoch;
        let a = m.step(Event::Tick { now_us: 2_600_000 });
        assert_eq!(starts(&a, 100), [elasticps_wire::NodeRole::Worker { rank: Some(1) }], "{a:?}");
        assert!(a.contains(&Action::Close(200)));
        assert!(m.placement().unwrap().epoch > epoch, "server 1's blocks failed over");
        assert!(m.placement().unwrap().owners.iter().all(|o| *o == 0));
        let log = m.balance_log();
        let lost = log.scaling.iter().find(|e| e.action == "host-lost").expect("a host-lost event");
        assert!(lost.reason.contains("b (10.0.0.2)") && lost.reason.contains("no heartbeat"), "{}", lost.reason);
        // The job goes on; at the end every agent is told.
        let a = recv(&mut m, 1, 3, Control::WorkerDone { rank: 0 });
        assert!(starts(&a, 100).is_empty());
    }

    #[test]
    fn a_barrier_opens_when_every_live_worker_waits_in_it() {
        let mut m = Scheduler::new(config(), 10_000_000);
        recv(&mut m, 1, 1, Control::RegisterWorker);
        recv(&mut m, 2, 1, Control::RegisterWorker);
        assert!(recv(&mut m, 1, 7, Control::Barrier).is_empty());
        let a = recv(&mut m, 2, 9, Control::Barrier);
        assert_eq!(
            a,
            vec![
                Action::Send { conn: 1, request_id: 7, msg: Control::Ok.into() },
                Action::Send { conn: 2, request_id: 9, msg: Control::Ok.into() }
            ]
        );
        // A worker that dies while the other waits lets it through.
        assert!(recv(&mut m, 1, 8, Control::Barrier).is_empty());
        let a = m.step(Event::Lost { conn: 2, why: "killed".into() });
        assert!(a.contains(&Action::Send { conn: 1, request_id: 8, msg: Control::Ok.into() }), "{a:?}");
    }

    #[test]
    fn tensor_optimizers_are_defined_with_the_model_and_changed_later() {
        let mut m = Scheduler::new(config(), 10_000_000);
        recv(&mut m, 1, 1, Control::RegisterWorker);
        let sgd = TensorOptimizer { kind: OptimizerKind::Sgd, lr: 0.1, weight_decay: 0.0 };
        recv(&mut m, 1, 2, Control::DefineModel { tensors: model(), optimizers: vec![Some(sgd)] });
        let slower = TensorOptimizer { lr: 0.01, ..sgd };
        let a = recv(&mut m, 1, 3, Control::SetOptimizer { tensor: 0, optimizer: slower });
        assert_eq!(a, vec![Action::Send { conn: 1, request_id: 3, msg: Control::Ok.into() }]);
        assert_eq!(m.partition.as_ref().unwrap().optimizer(0), Some(&slower));
        let a = recv(&mut m, 1, 4, Control::SetOptimizer { tensor: 5, optimizer: slower });
        assert!(matches!(sent_to(&a, 1)[0], Message::Error(e) if e.message.contains("tensor 5")));
    }

    #[test]
    fn refuses_extra_nodes_and_a_different_model() {
        let mut m = Scheduler::new(config(), 10_000_000);
        recv(&mut m, 1, 1, Control::RegisterWorker);
        recv(&mut m, 2, 1, Control::RegisterWorker);
        let a = recv(&mut m, 3, 1, Control::RegisterWorker);
        assert!(a.contains(&Action::Close(3)));
        recv(&mut m, 1, 2, Control::DefineModel { tensors: model(), optimizers: Vec::new() });
        let mut other = model();
        other[0].shape = vec![9];
        let a = recv(&mut m, 2, 2, Control::DefineModel { tensors: other, optimizers: Vec::new() });
        assert!(matches!(sent_to(&a, 2)[0], Message::Error(e) if e.message.contains("differs")));
    }

    #[test]
    fn job_ends_when_every_worker_is_done_and_fails_when_a_server_dies() {
        let mut m = Scheduler::new(config(), 10_000_000);
        recv(&mut m, 10, 1, Control::RegisterServer { data_addr: "s0".into() });
        recv(&mut m, 1, 1, Control::RegisterWorker);
        recv(&mut m, 2, 1, Control::RegisterWorker);
        let a = recv(&mut m, 1, 5, Control::WorkerDone { rank: 0 });
        assert!(sent_to(&a, 10).iter().any(|m| matches!(m, Message::Control(Control::RemoveWorker { rank: 0 }))));
        let a = recv(&mut m, 2, 5, Control::WorkerDone { rank: 1 });
        assert!(a.iter().any(|x| matches!(x, Action::Finish { ok: true, .. })));

        let mut m = Scheduler::new(config(), 10_000_000);
        recv(&mut m, 10, 1, Control::RegisterServer { data_addr: "s0".into() });
        let a = m.step(Event::Lost { conn: 10, why: "closed".into() });
        assert!(a.iter().any(|x| matches!(x, Action::Finish { ok: false, reason } if reason.contains("server 0"))));
    }

    #[test]
    fn a_silent_node_is_declared_dead_after_the_heartbeat_timeout() {
        let mut m = Scheduler::new(config(), 1_000);
        recv(&mut m, 1, 1, Control::RegisterWorker);
        recv(&mut m, 2, 1, Control::RegisterWorker);
        assert!(m.step(Event::Tick { now_us: 500 }).is_empty());
        recv(&mut m, 2, 0, Control::Heartbeat);
        let a = m.step(Event::Tick { now_us: 1_400 });
        assert!(a.contains(&Action::Close(1)));
        assert!(!a.contains(&Action::Close(2)));
    }

    /// Two servers and two workers with a model of `len` values (blocks of 4) placed.
    #[test]
    fn a_lost_worker_rejoins_once_every_server_took_it_back_and_the_job_then_ends_well() {
        let mut m = running(config(), 24);
        let refused = |a: &[Action], conn| sent_to(a, conn).iter().any(|m| matches!(m, Message::Error(_)));
        assert!(refused(&recv(&mut m, 4, 1, Control::RejoinWorker { rank: 7 }), 4), "no rank 7");
        let a = m.step(Event::Lost { conn: 2, why: "closed".into() });
        assert!(sent_to(&a, 10).iter().any(|m| matches!(m, Message::Control(Control::RemoveWorker { rank: 1 }))));
        // Restarted: every server is asked to take rank 1 back; the worker waits for both.
        let a = recv(&mut m, 5, 1, Control::RejoinWorker { rank: 1 });
        for server in [10, 11] {
            assert!(sent_to(&a, server).iter().any(|m| matches!(m, Message::Control(Control::AddWorker { rank: 1 }))));
        }
        assert!(sent_to(&a, 5).is_empty(), "no welcome before the servers answered");
        assert!(recv(&mut m, 10, 0, Control::WorkerAdded { rank: 1, clock: 9 }).is_empty());
        let a = recv(&mut m, 11, 0, Control::WorkerAdded { rank: 1, clock: 7 });
        assert!(matches!(sent_to(&a, 5)[..], [Message::Control(Control::Welcome { node_id: 1, .. })]), "{a:?}");
        let a = recv(&mut m, 5, 2, Control::GetStartClock);
        assert!(matches!(sent_to(&a, 5)[..], [Message::Control(Control::StartClock { clock: 7 })]), "{a:?}");
        recv(&mut m, 1, 5, Control::WorkerDone { rank: 0 });
        assert!(refused(&recv(&mut m, 6, 1, Control::RejoinWorker { rank: 0 }), 6), "rank 0 finished");
        let a = recv(&mut m, 5, 5, Control::WorkerDone { rank: 1 });
        assert!(a.iter().any(|x| matches!(x, Action::Finish { ok: true, .. })), "{a:?}");
    }

    #[test]
    fn a_restarted_worker_takes_its_rank_over_from_a_connection_not_seen_closing_yet() {
        let mut m = running(config(), 24);
        let a = recv(&mut m, 5, 1, Control::RejoinWorker { rank: 1 });
        assert!(a.contains(&Action::Close(2)), "the old connection of rank 1 is dropped: {a:?}");
        assert!(sent_to(&a, 10).iter().any(|m| matches!(m, Message::Control(Control::RemoveWorker { rank: 1 }))));
        assert!(sent_to(&a, 10).iter().any(|m| matches!(m, Message::Control(Control::AddWorker { rank: 1 }))));
        recv(&mut m, 10, 0, Control::WorkerAdded { rank: 1, clock: 4 });
        let a = recv(&mut m, 11, 0, Control::WorkerAdded { rank: 1, clock: 4 });
        assert!(matches!(sent_to(&a, 5)[..], [Message::Control(Control::Welcome { node_id: 1, .. })]), "{a:?}");
    }

    fn running(config: JobConfig, len: usize) -> Scheduler {
        let mut m = Scheduler::new(config, 10_000_000).with_launcher(true);
        recv(&mut m, 1, 1, Control::RegisterWorker);
        recv(&mut m, 2, 1, Control::RegisterWorker);
        let tensors = vec![TensorSpec { name: "w".into(), shape: vec![len], init: Init::Zeros }];
        recv(&mut m, 1, 2, Control::DefineModel { tensors, optimizers: Vec::new() });
        recv(&mut m, 10, 1, Control::RegisterServer { data_addr: "s0".into() });
        recv(&mut m, 11, 1, Control::RegisterServer { data_addr: "s1".into() });
        recv(&mut m, 10, 0, Control::AssignDone { server_id: 0 });
        recv(&mut m, 11, 0, Control::AssignDone { server_id: 1 });
        assert_eq!(m.waiting_for(), None);
        m
    }

    #[test]
    fn an_operator_adds_a_server_which_joins_empty_and_receives_blocks() {
        let mut m = running(JobConfig { max_servers: 3, ..config() }, 24);
        let a = recv(&mut m, 50, 1, Control::Scale(ScaleRequest::AddServer));
        assert!(a.contains(&Action::StartServer), "{a:?}");
        assert!(matches!(sent_to(&a, 50)[0], Message::Control(Control::Ok)));
        // A fourth would exceed --max-servers.
        let a = recv(&mut m, 50, 2, Control::Scale(ScaleRequest::AddServer));
        assert!(matches!(sent_to(&a, 50)[0], Message::Error(e) if e.message.contains("--max-servers")), "{a:?}");
        // The launched server registers late: an assignment that owns nothing.
        let a = recv(&mut m, 12, 1, Control::RegisterServer { data_addr: "s2".into() });
        match &sent_to(&a, 12)[..] {
            [Message::Control(Control::Welcome { node_id: 2, .. }), Message::Control(Control::Assign(x))] => {
                assert_eq!(x.placement.blocks_of(2).count(), 0);
            }
            other => panic!("{other:?}"),
        }
        // Once it serves, blocks start moving to it (6 blocks: 2 of them), one at a time.
        let a = recv(&mut m, 12, 0, Control::AssignDone { server_id: 2 });
        let migrations: Vec<_> = a
            .iter()
            .filter_map(|x| match x {
                Action::Send { msg: Message::Control(Control::Migrate { to, to_addr, epoch, .. }), .. } => {
                    Some((*to, to_addr.clone(), *epoch))
                }
                _ => None,
            })
            .collect();
        assert_eq!(migrations, [(2, "s2".to_string(), 2)], "{a:?}");
        // The layout lists the new server for the workers.
        let a = recv(&mut m, 1, 3, Control::GetLayout);
        assert!(matches!(sent_to(&a, 1)[0], Message::Control(Control::Layout(l)) if l.servers.len() == 3));
    }

    #[test]
    fn a_removed_server_leaving_does_not_end_the_job_and_status_shows_it_gone() {
        let mut m = running(config(), 8);
        // Server 1 owns block 1 (range over 2 blocks): removing it moves that block first.
        let a = recv(&mut m, 50, 1, Control::Scale(ScaleRequest::RemoveServer(1)));
        let report = a.iter().find_map(|x| match x {
            Action::Send { conn: 11, msg: Message::Control(Control::Migrate { block, to, epoch, .. }), .. } => {
                Some(MigrationReport {
                    block: *block,
                    from: 1,
                    to: *to,
                    epoch: *epoch,
                    bytes: 16,
                    freeze_us: 5,
                    total_us: 9,
                    held: 0,
                    error: None,
                })
            }
            _ => None,
        });
        let report = report.unwrap_or_else(|| panic!("a migration off server 1: {a:?}"));
        let a = recv(&mut m, 11, 7, Control::MigrateDone(report));
        assert!(matches!(sent_to(&a, 11)[0], Message::Control(Control::Ok)), "{a:?}");
        assert!(
            sent_to(&a, 11).iter().any(|x| matches!(x, Message::Control(Control::Shutdown { .. }))),
            "drained, so stopped: {a:?}"
        );
        let a = m.step(Event::Lost { conn: 11, why: "closed".into() });
        assert!(!a.iter().any(|x| matches!(x, Action::Finish { .. })), "{a:?}");
        let a = recv(&mut m, 50, 2, Control::GetStatus);
        match &sent_to(&a, 50)[..] {
            [Message::Control(Control::Status(s))] => {
                assert_eq!(s.migrations, 1);
                assert_eq!(s.epoch, 2);
                assert_eq!(s.servers[1].state, "gone");
                assert_eq!(s.servers[0].blocks, 2);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(m.balance_log().migrations.len(), 1);
    }
}
