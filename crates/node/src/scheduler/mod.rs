//! The scheduler's decisions as a plain state machine: who is in the job, the model's
//! layout, barriers, optimizer changes, the balancer's migrations and scaling, when the
//! job ends. Events in (a message on a connection, a lost connection, a tick with the
//! time), actions out (send, close, start a server, finish); no I/O and no clock of its
//! own.
//!
//! This module holds the state, the public API and the dispatch: each message goes to the
//! handler of its family, in a module of its own.
//!
//! - [`membership`](self): who registers, rejoins and is welcomed; heartbeats; a worker
//!   done; a node lost; connections that never register.
//! - [`barrier`](self): workers waiting in a `Barrier`.
//! - [`layout`](self): the model's definition, its placement and `Assign`s, the layout
//!   workers wait for, the start clock, tensor optimizers.
//! - [`replicas`](self): the backup copies of every block, and a lost server's failover.
//! - [`elastic`](self): which servers are live, draining or on trial; the one migration
//!   at a time; the balancer's orders, load reports and operator `Scale` requests.
//! - [`recovery`](self): the saved state, and a restarted scheduler's nodes reattaching.
//! - [`hosts`]: the hosts of a job that spans them, their slots, where a node starts,
//!   and a lost host.
//! - [`checkpoint`](self): the checkpoint writes the servers report, and the manifest.
//! - [`end`](self): when the job ends, and its closing wait for the last checkpoint.
//! - [`BalanceLog`]: the history of migrations, scaling events and load, for reports.

use std::collections::{BTreeMap, BTreeSet};

use elasticps_core::block::ShardConfig;
use elasticps_core::model::{BlockId, Partition};
use elasticps_core::placement::{Placement, PlacementKind};
use elasticps_core::sync::SyncPolicy;

mod barrier;
mod checkpoint;
mod elastic;
mod end;
mod history;
pub mod hosts;
mod layout;
mod membership;
mod recovery;
mod replicas;
#[cfg(test)]
mod testkit;

pub use elasticps_core::balance::BalanceMode;
pub use end::CLOSING_WAIT_US;
pub use history::{BalanceLog, LoadSample, MigrationEvent, ScaleEvent, ServerPoint};
pub use membership::REGISTER_WITHIN_US;
pub use recovery::{RECOVER_WAIT_US, STATE_VERSION, SavedState, reattach_message};

use elastic::Elastic;
use elasticps_wire::{
    CheckpointEntry, CheckpointPlan, ClusterStatus, Control, ErrorCode, ErrorReply, Injection, KeyId, Message, PeerRole,
};
use end::Closing;
use membership::Rejoin;

pub use crate::ConnId;
use crate::authz::{self, Class, Receiver, Verdict};

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

#[derive(Debug)]
struct Node {
    role: Role,
    last_seen_us: u64,
}

/// Who sent the message being handled: its connection, the request id to answer, and
/// the role it registered as (none yet: `None`).
#[derive(Clone, Copy, Debug)]
struct Caller {
    conn: ConnId,
    request_id: u64,
    role: Option<Role>,
}

impl Caller {
    /// Answers the call with `msg`.
    fn reply(&self, out: &mut Vec<Action>, msg: Message) {
        out.push(Action::Send { conn: self.conn, request_id: self.request_id, msg });
    }

    /// Answers the call with an `Error` of `code`, and logs it.
    fn refuse(&self, out: &mut Vec<Action>, code: ErrorCode, message: String) {
        let conn = self.conn;
        tracing::warn!(conn, %message, "refused");
        self.reply(out, Message::Error(ErrorReply { code, message }));
    }

    /// Refuses `control`, which the scheduler does not take from this caller now.
    fn refuse_now(&self, out: &mut Vec<Action>, control: Control) {
        let who = self.role.map_or("an unregistered peer".to_string(), |r| format!("{r:?}").to_lowercase());
        self.refuse(
            out,
            ErrorCode::BadRequest,
            format!("{who} sent {control:?}, which the scheduler does not take now"),
        );
    }
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
                self.lose_silent_nodes(&mut out);
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

    /// A control message from a node or an operator tool (not a host agent): to the
    /// handler of its family.
    fn on_message(&mut self, conn: ConnId, request_id: u64, control: Control, out: &mut Vec<Action>) {
        let call = Caller { conn, request_id, role: self.nodes.get(&conn).map(|n| n.role) };
        match control {
            Control::JoinHost(offer) if call.role.is_none() => self.join_host(conn, request_id, offer, out),
            Control::RegisterServer { .. }
            | Control::RegisterWorker
            | Control::RejoinWorker { .. }
            | Control::WorkerAdded { .. }
            | Control::Heartbeat
            | Control::WorkerDone { .. } => self.on_membership(call, control, out),
            Control::ReattachServer { .. } | Control::ReattachWorker { .. } => self.on_reattach(call, control, out),
            Control::DefineModel { .. }
            | Control::GetLayout
            | Control::AssignDone { .. }
            | Control::GetStartClock
            | Control::SetOptimizer { .. } => self.on_layout(call, control, out),
            Control::Barrier => self.on_barrier(call, control, out),
            Control::ServerLoad(_) | Control::WorkerLoad(_) | Control::MigrateDone(_) | Control::Scale(_) => {
                self.on_elastic(call, control, out)
            }
            Control::CheckpointWritten { .. } => self.on_checkpoint(call, control, out),
            Control::GetStatus => call.reply(out, Control::Status(self.status()).into()),
            other => call.refuse_now(out, other),
        }
    }
}
