//! The scheduler's decisions as a plain state machine: who is in the job, the model's
//! layout, barriers, optimizer changes, the balancer's migrations and scaling, when the
//! job ends. Events in with the time (a message on a connection, a lost connection, a
//! deadline reached), actions out (send, close, start a server, finish), and the next
//! deadline ([`Scheduler::poll_timeout`]); no I/O and no clock of its own.
//!
//! This module holds the state, the public API and the dispatch: each message goes to the
//! handler of its family, in a module of its own.
//!
//! - [`membership`](self): who registers, rejoins and is welcomed; heartbeats; a worker
//!   done; a node lost; connections that never register.
//! - [`barrier`](self): workers waiting in a `Barrier`.
//! - [`layout`](self): the model's definition, its placement and `Assign`s, the layout
//!   workers wait for, the start clock.
//! - [`optimizers`](self): a tensor's optimizer changed while training runs, recorded and
//!   sent to every server; the worker is answered once they all applied it.
//! - [`replicas`](self): the backup copies of every block, and a lost server's failover.
//! - [`elastic`](self): which servers are live, draining or on trial; the one migration
//!   at a time; the balancer's orders, load reports and operator `Scale` requests.
//! - [`recovery`](self): the saved state, and a restarted scheduler's nodes reattaching.
//! - [`hosts`]: the hosts of a job that spans them, their slots, where a node starts,
//!   and a lost host.
//! - [`checkpoint`](self): the checkpoint writes the servers report, and the manifest.
//! - [`end`](self): when the job ends, and its closing wait for the last checkpoint
//!   writes, the manifests and the host agents' last events.
//! - [`BalanceLog`]: the history of migrations, scaling events and load, for reports.

use std::collections::{BTreeMap, BTreeSet};

use elasticps_core::block::ShardConfig;
use elasticps_core::dtype::Dtype;
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
mod optimizers;
mod recovery;
mod replicas;
#[cfg(test)]
mod testkit;

pub use elasticps_core::balance::BalanceMode;
pub use end::CLOSING_WAIT_US;
pub use history::{BalanceLog, DecisionRecord, LoadSample, MigrationEvent, ScaleEvent, ServerPoint, ServerRows};
pub use membership::{MAX_UNREGISTERED, REGISTER_WITHIN_US};
pub use optimizers::MAX_PENDING_SETS_PER_WORKER;
pub use recovery::{Persisted, RECOVER_WAIT_US, STATE_VERSION, SavedState, reattach_message};

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
    /// The dtype psld may send a bandwidth-bound straggler's blocks in instead of moving
    /// them (`--balance-compress`; it changes the training arithmetic, so only when
    /// asked); `None`: never.
    pub balance_compress: Option<Dtype>,
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
#[allow(clippy::large_enum_variant)] // one at a time, never stored
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
    /// The deadline [`Scheduler::poll_timeout`] named was reached: the driver hands this
    /// in at that time (or later), with no fixed period of its own.
    Timeout,
    /// The outcome of [`Action::WriteManifest`]: checkpoint `clock` is complete (`error`
    /// `None`), or its manifest could not be written.
    ManifestWritten {
        /// The checkpoint's clock.
        clock: u32,
        /// Why the manifest is not on disk, if it is not.
        error: Option<String>,
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
    /// makes the checkpoint complete. Its outcome comes back as [`Event::ManifestWritten`].
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
    nodes: membership::Nodes,
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
    /// A restarted scheduler that could not recover its saved state, saying so
    /// ([`Scheduler::unrecoverable`]).
    unrecoverable: Option<recovery::Unrecoverable>,
    elastic: Elastic,
    can_launch: bool,
    /// Checkpoints under way: clock -> the blocks written so far.
    checkpoints: BTreeMap<u32, BTreeMap<BlockId, CheckpointEntry>>,
    /// The latest checkpoint whose manifest was ordered written (or the one resumed from).
    last_checkpoint: Option<u32>,
    /// The latest checkpoint whose manifest is on disk (or the one resumed from).
    complete_checkpoint: Option<u32>,
    /// Manifests ordered written whose outcome has not come back: the job ends after them.
    manifests_pending: BTreeSet<u32>,
    /// A restarted scheduler waiting for its nodes to reattach ([`Scheduler::recover`]).
    recovering: Option<recovery::Recovering>,
    /// The job's hosts, when it spans hosts (`--nnodes`).
    hosts: Option<hosts::Hosts>,
    /// The IP address each connection came from.
    peers: BTreeMap<ConnId, String>,
    /// Each open connection's handshake key, and when it opened (µs): one that has not
    /// registered within [`REGISTER_WITHIN_US`] is closed.
    opened: BTreeMap<ConnId, (KeyId, u64)>,
    /// The open connections that may not have registered yet, by when they opened (or
    /// last asked an operator's question); registered ones leave from the front.
    registering: BTreeSet<(u64, ConnId)>,
    /// At most this many connections wait to register at once ([`MAX_UNREGISTERED`]).
    max_unregistered: usize,
    /// When the scheduler last handled [`Event::Timeout`] (µs).
    checked_us: Option<u64>,
    /// `--join-timeout-s` (µs), until it was checked once: a job that has not assembled
    /// that long after its first worker registered ends, saying what it waits for
    /// ([`Scheduler::join_deadline_us`]).
    join_timeout_us: Option<u64>,
    /// When the first worker registered (µs): the join timeout counts from it.
    first_worker_us: Option<u64>,
    /// Connections closed for not registering: what they sent before the close reached
    /// the runtime is dropped (it must not be taken as from a fresh connection).
    shut: BTreeSet<ConnId>,
    /// Workers' `SetOptimizer` calls waiting for the servers to apply them.
    optimizer_sets: optimizers::OptimizerSets,
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
            nodes: membership::Nodes::default(),
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
            unrecoverable: None,
            elastic: {
                let mut e = Elastic::new(config.balance, config.min_servers, config.max_servers, config.workers);
                e.set_compress(config.balance_compress);
                e
            },
            can_launch: false,
            checkpoints: BTreeMap::new(),
            last_checkpoint: config.checkpoint.as_ref().and_then(|p| p.resume.as_ref()).map(|r| r.clock),
            complete_checkpoint: config.checkpoint.as_ref().and_then(|p| p.resume.as_ref()).map(|r| r.clock),
            manifests_pending: BTreeSet::new(),
            recovering: None,
            hosts: None,
            peers: BTreeMap::new(),
            opened: BTreeMap::new(),
            registering: BTreeSet::new(),
            max_unregistered: MAX_UNREGISTERED,
            checked_us: None,
            join_timeout_us: None,
            first_worker_us: None,
            shut: BTreeSet::new(),
            optimizer_sets: optimizers::OptimizerSets::default(),
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

    /// Ends a job that has not assembled (every server and worker, or every host, joined)
    /// within `us` (`--join-timeout-s`) of its first worker's registration, telling
    /// everyone that came why (`Scheduler::join_deadline_us`).
    pub fn with_join_timeout(mut self, us: u64) -> Self {
        self.join_timeout_us = Some(us);
        self
    }

    /// When the job must have assembled: the join timeout after the first worker
    /// registered. Before any has, the join timeout after the start while hosts or servers
    /// are still missing, and no deadline once only workers are: a worker's process may
    /// take its time to start (importing torch, building its model) before it registers,
    /// and the launcher watches it meanwhile.
    fn join_deadline_us(&self) -> Option<u64> {
        let join = self.join_timeout_us?;
        match self.first_worker_us {
            Some(first) => Some(first.saturating_add(join)),
            None => {
                let hosts_in = self.hosts.as_ref().and_then(hosts::Hosts::waiting_for).is_none();
                let only_workers_missing = hosts_in && self.servers.len() as u32 >= self.config.servers;
                (!only_workers_missing).then_some(join)
            }
        }
    }

    /// At most `n` connections (at least 1) wait to register at once instead of
    /// [`MAX_UNREGISTERED`]; one more takes the place of the oldest.
    pub fn with_max_unregistered(mut self, n: usize) -> Self {
        self.max_unregistered = n.max(1);
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

    /// Where the scheduler's clock (the `now_us` of [`Scheduler::handle`]) starts, in milliseconds since the Unix epoch
    /// (for the report, to align with the workers' clocks).
    pub fn with_clock_origin(mut self, unix_ms: f64) -> Self {
        self.elastic.set_clock_origin(unix_ms);
        self
    }

    /// The model's blocks once defined (with every split recorded).
    pub fn partition(&self) -> Option<&elasticps_core::model::Partition> {
        self.partition.as_ref()
    }

    /// The placement as the scheduler records it (once the model is placed): who owns
    /// each block, and the epoch.
    pub fn placement(&self) -> Option<&Placement> {
        self.placement.as_ref()
    }

    /// The ranks of the restarted workers that asked to rejoin and are not welcomed yet
    /// (some server has not taken them back).
    pub fn rejoining(&self) -> impl Iterator<Item = u32> + '_ {
        self.rejoining.keys().copied()
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

    /// Hands the scheduler one event at `now_us` (its clock, µs; it never goes back: an
    /// earlier time counts as the latest one seen); returns what to do. What the event
    /// records (a node last heard from, a server lost and when) has this time.
    pub fn handle(&mut self, now_us: u64, event: Event) -> Vec<Action> {
        let mut out = Vec::new();
        self.handle_into(now_us, event, &mut out);
        out
    }

    /// [`Scheduler::handle`], adding the actions to `out`.
    pub fn handle_into(&mut self, now_us: u64, event: Event, out: &mut Vec<Action>) {
        self.now_us = self.now_us.max(now_us);
        if self.over {
            return;
        }
        if self.unrecoverable.is_some() {
            self.refuse_unrecoverable(event, out);
            return;
        }
        let from = match &event {
            Event::Received { conn, .. } => Some(*conn),
            _ => None,
        };
        self.dispatch(event, out);
        if let Some(conn) = from {
            self.forget_if_registered(conn);
        }
        self.forget_registered();
        if self.first_worker_us.is_none() && !self.workers.is_empty() {
            self.first_worker_us = Some(self.now_us);
        }
    }

    /// When the scheduler next has something to do without a message (µs, its clock):
    /// hand it [`Event::Timeout`] then. `None`: nothing, until an event (the job is over).
    ///
    /// The soonest of: a node's or a host's heartbeat expiry, a connection's deadline to
    /// register ([`REGISTER_WITHIN_US`]), the end of the wait for lost workers to rejoin,
    /// a recovered scheduler's waits, the balancer's next round (and the timeouts of a
    /// migration or a requested server), the next report of what the job waits for
    /// ([`WAIT_REPORT_EVERY_US`]), the end of the closing wait. A deadline that passed at
    /// the last timeout and still stands (its rule could not act yet) is checked again
    /// [`SCHEDULER_TICK_US`](crate::timing::SCHEDULER_TICK_US) after it.
    pub fn poll_timeout(&self) -> Option<u64> {
        if self.over {
            return None;
        }
        if let Some(c) = &self.closing {
            return Some(c.until_us);
        }
        if let Some(u) = &self.unrecoverable {
            return Some(u.until_us.unwrap_or(self.now_us));
        }
        let mut soonest: Option<u64> = None;
        let mut at = |deadline: u64| {
            let deadline = match self.checked_us {
                Some(checked) if deadline <= checked => checked.saturating_add(crate::timing::SCHEDULER_TICK_US),
                _ => deadline,
            };
            soonest = Some(soonest.map_or(deadline, |s| s.min(deadline)));
        };
        if let Some(seen) = self.nodes.oldest_seen_us() {
            at(seen.saturating_add(self.heartbeat_timeout_us).saturating_add(1));
        }
        if let Some(expiry) = self.hosts.as_ref().and_then(hosts::Hosts::next_expiry_us) {
            at(expiry);
        }
        if let Some(deadline) = self.register_deadline_us() {
            at(deadline);
        }
        if let Some(deadline) = self.join_deadline_us() {
            at(deadline.saturating_add(1));
        }
        if let Some(since) = self.awaiting_rejoin_since {
            at(since.saturating_add(self.config.rejoin_wait_us));
        }
        if let Some(deadline) = self.recovery_deadline_us() {
            at(deadline);
        }
        if self.layout_ready && self.placement.is_some() {
            at(self.elastic.next_deadline_us());
        }
        if self.waits() {
            at(self.last_wait_log_us.saturating_add(WAIT_REPORT_EVERY_US));
        }
        soonest
    }

    /// Whether [`Scheduler::waiting_for`] says something, without saying it.
    fn waits(&self) -> bool {
        self.recovery_waits()
            || self.hosts.as_ref().is_some_and(hosts::Hosts::waiting)
            || (self.servers.len() as u32) < self.config.servers
            || (self.workers.len() as u32) < self.config.workers
            || self.partition.is_none()
            || !self.layout_ready
    }

    fn dispatch(&mut self, event: Event, out: &mut Vec<Action>) {
        if let Event::Received { conn, request_id, msg } = &event {
            if self.shut.contains(conn) {
                return;
            }
            if matches!(msg, Message::Control(Control::GetStatus | Control::Scale(_) | Control::GetLayout)) {
                // An operator tool (`elasticps status --watch`, `export`) stays while it
                // keeps asking.
                self.still_asking(*conn);
            }
            if let Some(refused) = self.forbidden(*conn, msg) {
                out.push(Action::Send { conn: *conn, request_id: *request_id, msg: refused });
                return;
            }
        }
        if self.closing.is_some() {
            self.step_closing(event, out);
            return;
        }
        match event {
            Event::Connected { conn, peer, key } => {
                self.peers.insert(conn, peer);
                self.connection_opened(conn, key, out);
            }
            Event::Received { conn, request_id, msg } => {
                self.nodes.heard(conn, self.now_us);
                let Message::Control(control) = msg else {
                    // Data frames are for servers: refused, and the connection closed
                    // (a host agent's too), PROTOCOL.md §7.
                    let message = format!("the scheduler takes control messages only, got {:?}", msg.kind());
                    tracing::warn!(conn, %message, "refused");
                    let msg = Message::Error(ErrorReply { code: ErrorCode::BadRequest, message });
                    out.push(Action::Send { conn, request_id, msg });
                    out.push(Action::Close(conn));
                    return;
                };
                if self.hosts.as_ref().is_some_and(|h| h.is_agent(conn)) {
                    self.on_agent_message(conn, request_id, control, out);
                } else {
                    self.on_message(conn, request_id, control, out);
                }
            }
            Event::Lost { conn, why } => {
                self.peers.remove(&conn);
                self.connection_closed(conn);
                self.shut.remove(&conn);
                match self.hosts.as_mut().and_then(|h| h.connection_lost(conn, &why)) {
                    Some(lost) => self.host_lost(lost, out),
                    None => self.on_lost(conn, &why, out),
                }
            }
            Event::Timeout => self.on_timeout(out),
            Event::ManifestWritten { clock, error } => self.manifest_written(clock, error),
        }
    }

    /// The time-driven rules, at [`Scheduler::poll_timeout`]'s deadline (or later): lost
    /// hosts and silent nodes, connections that never registered, the end of the wait for
    /// lost workers, a recovered scheduler's waits, the balancer, the wait report.
    fn on_timeout(&mut self, out: &mut Vec<Action>) {
        let now_us = self.now_us;
        self.checked_us = Some(now_us);
        if let Some(join) = self.join_timeout_us.filter(|_| self.join_deadline_us().is_some_and(|d| now_us > d)) {
            self.join_timeout_us = None;
            if let Some(what) = self.waiting_for() {
                let since = if self.first_worker_us.is_some() { " of its first worker's registration" } else { "" };
                let reason = format!("the job did not assemble within {} s{since}: {what}", join / 1_000_000);
                tracing::error!(%reason, "the job ends");
                return self.finish(false, reason, out);
            }
        }
        for lost in self.hosts.as_mut().map(|h| h.lose_silent(now_us)).unwrap_or_default() {
            let conn = lost.conn;
            self.host_lost(lost, out);
            out.push(Action::Close(conn));
        }
        self.lose_silent_nodes(out);
        self.close_unregistered(out);
        if self.awaiting_rejoin_since.is_some() {
            self.maybe_end(out);
        }
        self.recovery_timeout(out);
        if self.layout_ready {
            let splittable = self.splittable();
            if let Some(placement) = self.placement.as_ref() {
                let orders = self.elastic.on_timeout(placement, &splittable, now_us);
                self.carry_out(orders, out);
            }
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
            Control::DefineModel { .. } | Control::GetLayout | Control::AssignDone { .. } | Control::GetStartClock => {
                self.on_layout(call, control, out)
            }
            Control::SetOptimizer { tensor, optimizer } => match call.role {
                Some(Role::Worker(rank)) => self.set_optimizer(call, rank, tensor, optimizer, out),
                _ => call.refuse_now(out, Control::SetOptimizer { tensor, optimizer }),
            },
            Control::OptimizerSet { tensor } => match call.role {
                Some(Role::Server(id)) => self.optimizer_set(id, tensor, out),
                _ => call.refuse_now(out, control),
            },
            Control::Barrier => self.on_barrier(call, control, out),
            Control::ServerLoad(_)
            | Control::WorkerLoad(_)
            | Control::MigrateDone(_)
            | Control::SplitDone { .. }
            | Control::Scale(_) => self.on_elastic(call, control, out),
            Control::CheckpointWritten { .. } => self.on_checkpoint(call, control, out),
            Control::GetStatus => call.reply(out, Control::Status(self.status()).into()),
            other => call.refuse_now(out, other),
        }
    }
}

#[cfg(test)]
mod tests {
    use elasticps_wire::Control;

    use super::elastic::BALANCE_EVERY_US;
    use super::testkit::*;
    use super::*;

    #[test]
    fn an_idle_scheduler_has_a_deadline_only_for_its_periodic_work() {
        // Nobody came yet: it says every 5 s what it waits for.
        let m = Scheduler::new(config(), 10_000_000);
        assert!(m.waits() && m.waiting_for().is_some());
        assert_eq!(m.poll_timeout(), Some(WAIT_REPORT_EVERY_US));
        // Running, every node heard just now: the balancer's next round comes first.
        let mut m = running(config(), 24);
        assert!(!m.waits() && m.waiting_for().is_none());
        assert_eq!(m.poll_timeout(), Some(BALANCE_EVERY_US));
        m.handle(BALANCE_EVERY_US, Event::Timeout);
        assert_eq!(m.poll_timeout(), Some(2 * BALANCE_EVERY_US));
        // Over: nothing to wake for.
        recv(&mut m, 1, 5, Control::WorkerDone { rank: 0 });
        let a = recv(&mut m, 2, 5, Control::WorkerDone { rank: 1 });
        assert!(a.iter().any(|x| matches!(x, Action::Finish { ok: true, .. })), "{a:?}");
        assert_eq!(m.poll_timeout(), None);
    }

    #[test]
    fn a_connection_that_does_not_register_is_closed_at_its_deadline() {
        let mut m = Scheduler::new(config(), 10_000_000);
        m.handle(7, Event::Connected { conn: 5, peer: "10.0.0.1".into(), key: KeyId::Cluster });
        m.handle(8, Event::Connected { conn: 6, peer: "10.0.0.1".into(), key: KeyId::Cluster });
        recv(&mut m, 6, 1, Control::RegisterWorker);
        // The wait reports (every 5 s), then connection 5's deadline (not the registered
        // one's), then worker 0's heartbeat expiry.
        let mut woken = Vec::new();
        for _ in 0..3 {
            let at = m.poll_timeout().unwrap();
            woken.push(at);
            let a = m.handle(at, Event::Timeout);
            assert_eq!(a.contains(&Action::Close(5)), at == 7 + REGISTER_WITHIN_US + 1, "at {at}: {a:?}");
            assert!(!a.contains(&Action::Close(6)), "{a:?}");
        }
        assert_eq!(woken, [WAIT_REPORT_EVERY_US, 2 * WAIT_REPORT_EVERY_US, 7 + REGISTER_WITHIN_US + 1]);
        assert_eq!(m.poll_timeout(), Some(8 + 10_000_000 + 1));
    }

    #[test]
    fn a_job_that_does_not_assemble_within_the_join_timeout_ends_saying_what_it_waits_for() {
        let mut m = Scheduler::new(config(), 10_000_000).with_join_timeout(8_000_000);
        m.handle(7, Event::Connected { conn: 5, peer: "10.0.0.1".into(), key: KeyId::Cluster });
        recv(&mut m, 5, 1, Control::RegisterWorker);
        // The wait report at 5 s, then the join timeout, just past 8 s after the worker came.
        assert_eq!(m.poll_timeout(), Some(WAIT_REPORT_EVERY_US));
        assert!(!m.handle(WAIT_REPORT_EVERY_US, Event::Timeout).iter().any(|a| matches!(a, Action::Finish { .. })));
        assert_eq!(m.poll_timeout(), Some(8_000_008));
        let a = m.handle(8_000_008, Event::Timeout);
        let told = a.iter().any(|x| {
            matches!(x, Action::Send { conn: 5, msg: Message::Control(Control::Shutdown { reason }), .. }
                if reason.starts_with("the job did not assemble within 8 s of its first worker's registration: "))
        });
        assert!(told, "the worker that came hears why: {a:?}");
        assert!(a.iter().any(|x| matches!(x, Action::Finish { ok: false, .. })), "{a:?}");
        // One that assembled in time is not ended by it.
        let mut m = running(config(), 24).with_join_timeout(1);
        let a = m.handle(BALANCE_EVERY_US, Event::Timeout);
        assert!(!a.iter().any(|x| matches!(x, Action::Finish { .. })), "{a:?}");
    }

    #[test]
    fn the_join_timeout_counts_from_the_first_workers_registration_not_from_the_start() {
        let mut m = Scheduler::new(config(), 60_000_000).with_join_timeout(8_000_000);
        recv(&mut m, 10, 1, Control::RegisterServer { data_addr: "s0".into() });
        // A missing server is waited for from the start.
        assert_eq!(m.join_deadline_us(), Some(8_000_000));
        recv(&mut m, 11, 1, Control::RegisterServer { data_addr: "s1".into() });
        // Only the workers are missing: their scripts import torch and build their models.
        assert_eq!(m.join_deadline_us(), None);
        let a = m.handle(20_000_000, Event::Timeout);
        assert!(!a.iter().any(|x| matches!(x, Action::Finish { .. })), "20 s of a script's start: {a:?}");
        m.handle(30_000_000, Event::Connected { conn: 1, peer: "10.0.0.1".into(), key: KeyId::Cluster });
        recv(&mut m, 1, 1, Control::RegisterWorker);
        assert_eq!(m.join_deadline_us(), Some(38_000_000), "8 s from the first worker's registration");
        let a = m.handle(37_000_000, Event::Timeout);
        assert!(!a.iter().any(|x| matches!(x, Action::Finish { .. })), "{a:?}");
        assert!(m.poll_timeout().is_some_and(|t| t <= 38_000_001), "{:?}", m.poll_timeout());
        let a = m.handle(38_000_001, Event::Timeout);
        assert!(a.iter().any(|x| matches!(x, Action::Finish { ok: false, .. })), "the second worker never came: {a:?}");
    }
}
