//! The server's decisions as a plain state machine: which blocks it owns, how a push or
//! pull reaches one, the sync policy's held pulls, live migration of one block (both
//! ends), load reports, the adaptive policy, when a drained server may leave. Events in
//! (a frame on a data connection, a message from the scheduler, the answer of another
//! server, time), actions out (reply, send to the scheduler, send to a server, trace,
//! exit). One struct, `&mut self`, no locks, no threads, no clock of its own: every
//! event comes with `now_us`.
//!
//! - [`slot`]: one block's slot and its typed phase (serving, copying, frozen, gone).
//! - [`migrate`](self): the migration's steps, old owner and new owner.
//! - [`config`]: the shard's configuration, the adaptive policy, tensor optimizers.
//! - [`counters`]: stats, metrics snapshot, load.
//! - [`capacity`]: the link's rate, from the time data frames take to arrive.
//! - [`replica`](self): `--replicas`, the primary's forwarding and the backups' copies.
//! - [`split`](self): a hot row block split in two in place.
//!
//! Registration is part of the state machine: [`Server::start`] returns the
//! `RegisterServer` call, so a harness drives a server from birth.

use std::collections::BTreeMap;
use std::sync::Arc;

use elasticps_core::block::{Answer, Block, BlockState};
use elasticps_core::model::BlockId;
use elasticps_core::placement::ServerId;
use elasticps_core::sync::{Clock, SyncPolicy};
use elasticps_wire::{
    Assignment, CheckpointEntry, CheckpointPlan, Control, Credential, ErrorCode, KeyId, Message, PeerRole,
    RowBlockLoad, RowIds, ServerLoad, ServerStats, Values,
};
use rand::SeedableRng;
use rand::rngs::StdRng;

pub mod capacity;
pub mod config;
pub mod counters;
mod migrate;
mod opt_state;
mod replica;
pub mod slot;
mod split;

pub use config::{Refusal, Shard, error};
pub use counters::{ServerSnapshot, staleness_bound};
pub use slot::{FrozenStep, Outgoing, Owned, Parked, Phase, Request, Slot, Token};

use counters::{Counters, Sum};

pub use crate::ConnId;
use crate::authz::{self, Class, Receiver, Verdict};

/// How often a server reports its load and evaluates its adaptive policy, µs.
pub const STATS_INTERVAL_US: u64 = 1_000_000;
/// How long each step of a migration may take, µs.
pub const STEP_TIMEOUT_US: u64 = 30_000_000;
/// How long the scheduler may take to accept this server, µs.
pub const REGISTER_TIMEOUT_US: u64 = 120_000_000;
/// How long a drained server waits for a request before it leaves anyway, µs.
pub const LINGER_QUIET_US: u64 = 10_000_000;
/// How often a server says what it waits for (no assignment yet, a pull held long), µs.
pub const WAIT_LOG_EVERY_US: u64 = 10_000_000;
/// A pull held longer than this is logged with what it waits for, µs.
pub const LONG_HOLD_US: u64 = 5_000_000;
/// After `Shutdown`, how long a server waits for its running migrations, µs.
pub const SHUTDOWN_WAIT_US: u64 = 2 * STEP_TIMEOUT_US;
/// A pull whose clock is more than this many clocks past its block's `done` is refused
/// (`--max-clock-lead`): no policy answers it soon, and holding it would hold memory.
pub const MAX_CLOCK_LEAD: u32 = 1_000;
/// At most this many pulls held for one connection; one more is refused.
pub const MAX_HELD_PER_CONN: usize = 65_536;
/// At most this many pulls held on one server; one more is refused.
pub const MAX_HELD_PER_SERVER: usize = 1_048_576;
const _: () = assert!(MAX_HELD_PER_CONN <= MAX_HELD_PER_SERVER, "the per-connection bound is checked first");

/// Something that happened at the server.
#[derive(Debug)]
pub enum Event {
    /// A data connection opened (optional: a frame from an unknown connection opens it,
    /// as one of the cluster key).
    Opened {
        /// The connection.
        conn: ConnId,
        /// The key its handshake proved (a worker-key connection can only be a worker).
        key: KeyId,
    },
    /// A frame from a data connection (a worker after Hello, or a server streaming a block).
    Received {
        /// The connection.
        conn: ConnId,
        /// The frame's request id.
        request_id: u64,
        /// The message.
        msg: Message,
    },
    /// A data connection closed.
    Closed {
        /// The connection.
        conn: ConnId,
    },
    /// A message from the scheduler: a notification (request id 0) or the answer to a
    /// call ([`Action::ToScheduler`] with that request id).
    FromScheduler {
        /// 0, or the request id of the call answered.
        request_id: u64,
        /// The message.
        msg: Message,
    },
    /// The answer of another server to a migration step this server sent, or its failure
    /// (connection failed, timed out).
    FromServer {
        /// The call ([`Action::ToServer`]) answered.
        call: u64,
        /// The answer, or why there is none.
        reply: Result<Message, String>,
    },
    /// The deadline of [`Server::poll_timeout`] came (load reports, adaptive staleness,
    /// migration step deadlines, replica resyncs, long holds, a drained server's linger).
    Timeout,
    /// The runtime wrote a block of a checkpoint ([`Action::Checkpoint`]): its entry for
    /// the manifest, or why it could not.
    CheckpointWritten {
        /// The checkpoint's clock.
        clock: Clock,
        /// The block.
        block: BlockId,
        /// The file written, or the error.
        result: Result<CheckpointEntry, String>,
    },
    /// The runtime read the blocks of the checkpoint the job resumes from
    /// ([`Action::Restore`]), or why it could not.
    Restored(Result<Vec<BlockState>, String>),
    /// The runtime carried out the actions before an [`Action::Continue`] (the pushes
    /// forwarded to the backups are on their links): the server applies what it
    /// deferred. Any other event does that first too, so nothing waits for this one.
    Continue,
}

/// What the runtime must do.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Send `msg` on data connection `conn`, answering `request_id`.
    Reply {
        /// The connection.
        conn: ConnId,
        /// The request answered.
        request_id: u64,
        /// The answer.
        msg: Message,
    },
    /// Send `msg` to the scheduler. Request id 0: a notification; otherwise a call whose
    /// answer comes back as [`Event::FromScheduler`] with this request id (a call that
    /// fails needs no event: the server's own deadline covers it).
    ToScheduler {
        /// 0, or the call's id.
        request_id: u64,
        /// The message.
        msg: Message,
    },
    /// A migration step to another server, answered by [`Event::FromServer`] with `call`.
    ToServer {
        /// The call's id.
        call: u64,
        /// The server.
        server: ServerId,
        /// Its data address.
        addr: String,
        /// The step.
        msg: Message,
    },
    /// An answered pull, for the runtime's `--trace` file (only if enabled with
    /// [`Server::with_trace`]).
    Trace(PullTrace),
    /// Write `state`, block `state.spec.id` at checkpoint `clock`, into the checkpoint
    /// directory (durably: fsync before the answer), then answer with
    /// [`Event::CheckpointWritten`].
    Checkpoint {
        /// The directory.
        dir: String,
        /// The checkpoint's clock.
        clock: Clock,
        /// The block's state: exactly the pushes of the clocks before `clock`.
        state: BlockState,
    },
    /// Read (and check against their checksums) these blocks of the checkpoint in `dir`,
    /// then answer with [`Event::Restored`].
    Restore {
        /// The directory.
        dir: String,
        /// The blocks assigned here.
        blocks: Vec<CheckpointEntry>,
    },
    /// Close data connection `conn` once the replies already handed out are written (a
    /// `Hello` whose credential does not hold).
    Close {
        /// The connection.
        conn: ConnId,
    },
    /// Stop.
    Exit(Exit),
    /// Hand the messages to other servers decided so far to their links, then give the
    /// server [`Event::Continue`] at once: a primary forwards a push to its backups
    /// before it applies it, so that the backups apply it while it does (docs/PROTOCOL.md
    /// §12). Emitted at most once per event, after the forwards.
    Continue,
}

/// One answered pull, as the `--trace` file records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PullTrace {
    /// The block.
    pub block: BlockId,
    /// The worker that pulled.
    pub worker: u32,
    /// The pull's clock.
    pub clock: u32,
    /// The block's `done` clock when it was answered.
    pub done: u32,
    /// How long it was held, if it was.
    pub held_us: Option<u64>,
}

impl PullTrace {
    /// The trace line (JSON, no newline): `{"block":..,"worker":..,"clock":..,"done":..,"held_us":..}`.
    pub fn json(&self) -> String {
        format!(
            r#"{{"block":{},"worker":{},"clock":{},"done":{},"held_us":{}}}"#,
            self.block,
            self.worker,
            self.clock,
            self.done,
            self.held_us.map_or("null".to_string(), |u| u.to_string())
        )
    }
}

/// Why a server stops.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Exit {
    /// The scheduler shut the job down (a drained server lingered first).
    Shutdown {
        /// The scheduler's reason.
        reason: String,
    },
    /// The server cannot take part: registration refused or timed out, or an assignment
    /// that cannot be built.
    Failed {
        /// What went wrong.
        reason: String,
    },
}

/// One data connection as the server sees it.
#[derive(Clone, Copy, Debug, Default)]
struct Conn {
    /// The key its handshake proved.
    key: KeyId,
    /// The identity its `Hello` proved (a worker's rank, a server's id).
    proven: Option<(PeerRole, u32)>,
}

impl Conn {
    /// The worker rank it proved, if it is a worker's.
    fn rank(&self) -> Option<u32> {
        match self.proven {
            Some((PeerRole::Worker, r)) => Some(r),
            _ => None,
        }
    }

    /// The server id it proved, if it is a server's.
    fn server(&self) -> Option<ServerId> {
        match self.proven {
            Some((PeerRole::Server, id)) => Some(id),
            _ => None,
        }
    }

    /// Its class in the authorization table.
    fn class(&self) -> Class {
        Class::of(self.key, self.proven.map(|(role, _)| role))
    }
}

/// The snapshot of a block on its way here (a migration's step 2), until its delta.
#[derive(Debug)]
struct Incoming {
    /// The server that sent it: the delta must come from it too.
    from: ServerId,
    /// The placement epoch the block is to have here.
    epoch: u64,
    /// The block's state.
    state: BlockState,
}

/// What a call in flight is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Call {
    /// `RegisterServer`.
    Register,
    /// A step of the migration of this block (to a server, or `MigrateDone`).
    Migration(BlockId),
    /// A push of `block` forwarded to its backup `backup`.
    Replicate { block: BlockId, backup: ServerId },
    /// The whole state of `block` sent to its backup `backup`.
    ReplicaSync { block: BlockId, backup: ServerId },
}

/// A data request forwarded to the backups, to be applied here at [`Event::Continue`].
#[derive(Debug)]
struct Deferred {
    rank: u32,
    to: Token,
    request: Request,
    /// The block's `done` when it came (its checkpoint is due from it).
    done: Clock,
}

/// After `Shutdown`: when it came, and why.
#[derive(Clone, Debug)]
struct Stopping {
    reason: String,
    since_us: u64,
    lingering: bool,
    /// When try_exit looks again (the end of the wait for migrations or checkpoint
    /// writes, or of a drained server's linger).
    recheck_us: Option<u64>,
}

/// The server's state.
#[derive(Debug)]
pub struct Server {
    data_addr: String,
    trace: bool,
    /// The cluster secret: credentials presented in `Hello` are checked with it.
    secret: Vec<u8>,
    /// This server's credential (from its `Welcome`): its job, and what it presents in
    /// the `Hello` of its connections to other servers.
    credential: Option<Credential>,
    /// `--max-clock-lead`.
    max_clock_lead: u32,
    /// The largest payload a reply may have (the codec's limit, `--max-frame-mib`): a
    /// row pull whose reply would be larger is refused before its rows are gathered.
    max_payload: u64,
    /// The id the scheduler gave, once registered.
    id: Option<ServerId>,
    started_us: u64,
    register_deadline_us: Option<u64>,
    shard: Option<Shard>,
    slots: BTreeMap<BlockId, Slot>,
    /// Snapshots of blocks on their way here.
    incoming: BTreeMap<BlockId, Incoming>,
    /// Workers removed from every quorum: a block arriving later leaves them out too.
    removed_workers: Vec<u32>,
    /// Removed workers taken back (restarted): a block arriving later takes them back too.
    added_workers: Vec<u32>,
    counters: Counters,
    conns: BTreeMap<ConnId, Conn>,
    calls: BTreeMap<u64, Call>,
    next_call: u64,
    next_stats_us: u64,
    last_report_us: u64,
    next_wait_log_us: u64,
    /// When the last data request arrived.
    last_request_us: u64,
    stopping: Option<Stopping>,
    exited: bool,
    /// The job's checkpoints (from `Checkpointing`), if it has any.
    checkpoint: Option<CheckpointPlan>,
    /// An assignment waiting for its blocks to be read from the checkpoint.
    restoring: Option<Assignment>,
    /// Checkpoint blocks handed to the runtime and not reported written yet (a server
    /// shutting down waits for them).
    checkpoint_writes: u32,
    /// `--replicas`: backup copies held here, and the pushes waiting for backups.
    replication: replica::Replication,
    /// Data requests whose push was forwarded to the backups and is applied at
    /// [`Event::Continue`] (or before any other event), in arrival order.
    deferred: std::collections::VecDeque<Deferred>,
    /// At least the number of pulls held here: the exact count when last counted, plus
    /// every pull that reached a policy since (held pulls come from those alone). The
    /// bounds on held pulls are counted exactly only once it reaches them, so a pull
    /// costs no scan of the blocks.
    held_at_most: std::cell::Cell<usize>,
}

impl Server {
    /// A server that will serve data on `data_addr` (the address workers dial).
    pub fn new(data_addr: impl Into<String>) -> Self {
        Self {
            data_addr: data_addr.into(),
            trace: false,
            secret: Vec::new(),
            credential: None,
            max_clock_lead: MAX_CLOCK_LEAD,
            max_payload: u64::from(elasticps_wire::DEFAULT_MAX_PAYLOAD),
            id: None,
            started_us: 0,
            register_deadline_us: None,
            shard: None,
            slots: BTreeMap::new(),
            incoming: BTreeMap::new(),
            removed_workers: Vec::new(),
            added_workers: Vec::new(),
            counters: Counters::default(),
            conns: BTreeMap::new(),
            calls: BTreeMap::new(),
            next_call: 1,
            next_stats_us: 0,
            last_report_us: 0,
            next_wait_log_us: 0,
            last_request_us: 0,
            stopping: None,
            exited: false,
            checkpoint: None,
            restoring: None,
            checkpoint_writes: 0,
            replication: replica::Replication::default(),
            deferred: std::collections::VecDeque::new(),
            held_at_most: std::cell::Cell::new(0),
        }
    }

    /// Says whether answered pulls come out as [`Action::Trace`] too.
    pub fn with_trace(mut self, on: bool) -> Self {
        self.trace = on;
        self
    }

    /// Checks the credentials of `Hello` with this cluster secret (empty by default, as
    /// the runtime's codec).
    pub fn with_secret(mut self, secret: &[u8]) -> Self {
        self.secret = secret.to_vec();
        self
    }

    /// Refuses pulls more than `lead` clocks past their block's `done` (`--max-clock-lead`).
    pub fn with_max_clock_lead(mut self, lead: u32) -> Self {
        self.max_clock_lead = lead;
        self
    }

    /// Refuses row pulls whose reply would exceed `bytes` (the codec's payload limit).
    pub fn with_max_payload(mut self, bytes: u32) -> Self {
        self.max_payload = u64::from(bytes);
        self
    }

    /// This server's credential, once registered: what it presents in the `Hello` of a
    /// connection to another server.
    pub fn credential(&self) -> Option<&Credential> {
        self.credential.as_ref()
    }

    /// Starts the server at `now_us`: the `RegisterServer` call to the scheduler.
    pub fn start(&mut self, now_us: u64) -> Vec<Action> {
        self.started_us = now_us;
        self.next_stats_us = now_us;
        self.next_wait_log_us = now_us + WAIT_LOG_EVERY_US;
        self.register_deadline_us = Some(now_us + REGISTER_TIMEOUT_US);
        let call = self.call(Call::Register);
        vec![Action::ToScheduler {
            request_id: call,
            msg: Control::RegisterServer { data_addr: self.data_addr.clone() }.into(),
        }]
    }

    /// Handles one event at `now_us` (the runtime's clock, µs, never going back).
    pub fn handle(&mut self, now_us: u64, ev: Event) -> Vec<Action> {
        let mut out = Vec::new();
        self.handle_into(now_us, ev, &mut out);
        out
    }

    /// When the server next wants [`Event::Timeout`] (absolute µs): the earliest of the
    /// registration's deadline, the next load report and wait log, a migration step's
    /// deadline, a replica's resync, and (after `Shutdown`) the end of the wait for
    /// migrations or of a drained server's linger. `None` once exited.
    pub fn poll_timeout(&self) -> Option<u64> {
        if self.exited {
            return None;
        }
        let stopping = self.stopping.as_ref().and_then(|s| s.recheck_us);
        [self.register_deadline_us, Some(self.next_stats_us), Some(self.next_wait_log_us), stopping]
            .into_iter()
            .flatten()
            .chain(self.step_deadlines())
            .chain(self.replication.next_resync_us())
            .min()
    }

    /// [`Server::handle`], appending the actions to `out` (a caller that reuses one buffer
    /// allocates nothing per event).
    pub fn handle_into(&mut self, now_us: u64, ev: Event, out: &mut Vec<Action>) {
        if self.exited {
            return;
        }

        let from = out.len();
        // What an earlier event forwarded and deferred is applied before anything else.
        self.apply_deferred(now_us, out);
        // The drivers skip poll_timeout after a data request: it never moves a deadline
        // earlier (checked here in debug builds).
        let data_before = match &ev {
            Event::Received { msg, .. } if cfg!(debug_assertions) && msg.is_data_request() => Some(self.poll_timeout()),
            _ => None,
        };
        match ev {
            Event::Opened { conn, key } => {
                self.conns.insert(conn, Conn { key, proven: None });
            }
            Event::Received { conn, request_id, msg } => self.received(now_us, conn, request_id, msg, out),
            Event::Closed { conn } => {
                self.conns.remove(&conn);
            }
            Event::FromScheduler { request_id, msg } => self.scheduler_said(now_us, request_id, msg, out),
            Event::FromServer { call, reply } => self.step_answered(now_us, call, reply, out),
            Event::Timeout => self.on_timeout(now_us, out),
            Event::CheckpointWritten { clock, block, result } => self.checkpoint_written(clock, block, result, out),
            Event::Restored(states) => self.restored(now_us, states, out),
            Event::Continue => {}
        }
        if self.stopping.is_some() {
            self.try_exit(now_us, out);
        }
        self.gate_replies(from, out);
        if let (Some(before), Some(after)) = (data_before, self.poll_timeout()) {
            debug_assert!(
                before.is_some_and(|b| after >= b),
                "a data request moved the server's deadline earlier: {before:?} -> {after}"
            );
        }
    }

    // ---- queries ----------------------------------------------------------------------

    /// The id the scheduler gave this server, once registered.
    pub fn id(&self) -> Option<ServerId> {
        self.id
    }

    /// The shard's configuration, once assigned.
    pub fn shard(&self) -> Option<&Shard> {
        self.shard.as_ref()
    }

    /// The slot of `block`, if this server has one (owned or gone).
    pub fn slot(&self, block: BlockId) -> Option<&Slot> {
        self.slots.get(&block)
    }

    /// The backup copy of `block` held here (`--replicas`), once its primary's state came.
    pub fn backup_copy(&self, block: BlockId) -> Option<&Block<Token>> {
        self.replication.copy(block)
    }

    /// The blocks owned here (in any phase but gone), in id order.
    pub fn owned(&self) -> Vec<BlockId> {
        self.slots.iter().filter(|(_, s)| matches!(s, Slot::Owned(_))).map(|(b, _)| *b).collect()
    }

    /// Whether data connection `conn` proved who it is (its `Hello` was taken): before
    /// that the runtime bounds the wait for its first frame.
    pub fn introduced(&self, conn: ConnId) -> bool {
        self.conns.get(&conn).is_some_and(|c| c.proven.is_some())
    }

    /// Open data connections.
    pub fn open_connections(&self) -> usize {
        self.conns.len()
    }

    /// True after `Shutdown` while a drained server waits for workers to stop using it.
    pub fn lingering(&self) -> bool {
        self.stopping.as_ref().is_some_and(|s| s.lingering)
    }

    /// True once the scheduler said `Shutdown` (the server finishes its migrations and,
    /// if drained, lingers before it exits).
    pub fn shutting_down(&self) -> bool {
        self.stopping.is_some()
    }

    /// True once [`Action::Exit`] was returned: every later event is ignored.
    pub fn exited(&self) -> bool {
        self.exited
    }

    /// Adds time the runtime measured: handling data requests (`busy_us`) and frames
    /// waiting for the bandwidth cap (`shaped_us`). Both go into the next load report.
    pub fn charge(&mut self, busy_us: u64, shaped_us: u64) {
        self.counters.busy_us += busy_us;
        self.counters.shaped_us += shaped_us;
    }

    /// A data frame's payload of `bytes` took `transfer_ns` to arrive, from its first byte
    /// to its last, as the runtime measured it: the link's rate goes into the next load
    /// report ([`capacity`]).
    pub fn arrived(&mut self, bytes: u64, transfer_ns: u64) {
        self.counters.capacity.received(bytes, transfer_ns);
    }

    /// The server's counters (final report), under its registered id.
    pub fn stats(&self) -> ServerStats {
        self.stats_as(self.id.unwrap_or(u32::MAX))
    }

    /// The counters as the metrics show them.
    pub fn metrics_snapshot(&self) -> ServerSnapshot {
        let c = self.sum();
        let (server_id, sync, staleness_bound) = match &self.shard {
            Some(s) => (Some(s.id), Some(s.config.sync), staleness_bound(s.config.sync, s.staleness())),
            None => (None, None, 0),
        };
        ServerSnapshot {
            server_id,
            sync,
            staleness_bound,
            blocks: c.blocks,
            bytes: c.bytes,
            totals: c.totals,
            hold: c.hold.buckets().to_vec(),
            migrations_in: self.counters.migrations_in,
            migrations_out: self.counters.migrations_out,
        }
    }

    /// The load since the last call (counters reset), over `interval_us`.
    pub fn take_load(&mut self, interval_us: u64) -> ServerLoad {
        let (mut blocks, mut bytes) = (0, 0);
        let mut row_blocks = Vec::new();
        let mut rows_seen = BTreeMap::new();
        for (id, slot) in &self.slots {
            if let Slot::Owned(o) = slot {
                blocks += 1;
                bytes += o.block.spec().bytes() as u64;
                if o.block.spec().is_rows() {
                    let now = *o.block.stats();
                    // A block that arrived again since counts from zero.
                    let before = self.counters.rows_seen.get(id).filter(|b| b.pushes <= now.pushes).copied();
                    let before = before.unwrap_or_default();
                    let load = RowBlockLoad {
                        block: *id,
                        pushes: now.pushes - before.pushes,
                        pulls: now.pulls.saturating_sub(before.pulls),
                        rows: now.rows.saturating_sub(before.rows),
                        bytes_in: now.bytes_in.saturating_sub(before.bytes_in),
                        bytes_out: now.bytes_out.saturating_sub(before.bytes_out),
                        split_at: o.block.split_hint().unwrap_or(0),
                    };
                    if load.pushes + load.pulls > 0 {
                        row_blocks.push(load);
                    }
                    rows_seen.insert(*id, now);
                }
            }
        }
        let c = &mut self.counters;
        c.rows_seen = rows_seen;
        // Spins of the injected interference on several threads overlap: the busy time an
        // interval can hold back is at most the interval.
        let rx = c.capacity.take(c.busy_us.min(interval_us));
        ServerLoad {
            server_id: self.id.unwrap_or(u32::MAX),
            interval_us,
            bytes_in: std::mem::take(&mut c.bytes_in),
            bytes_out: std::mem::take(&mut c.bytes_out),
            requests: std::mem::take(&mut c.requests),
            busy_us: std::mem::take(&mut c.busy_us),
            shaped_us: std::mem::take(&mut c.shaped_us),
            blocks,
            bytes,
            rx_bps: rx.map_or(0.0, |m| m.bps),
            rx_frames: rx.map_or(0, |m| m.frames),
            row_blocks,
        }
    }

    // ---- internals --------------------------------------------------------------------

    fn call(&mut self, what: Call) -> u64 {
        let id = self.next_call;
        self.next_call += 1;
        self.calls.insert(id, what);
        id
    }

    fn stats_as(&self, id: ServerId) -> ServerStats {
        let Sum { blocks, bytes, totals, hold } = self.sum();
        let sync = self.shard.as_ref().map_or_else(String::new, Shard::policy_name);
        ServerStats { server_id: id, sync, blocks, bytes, totals, hold_p99_us: hold.quantile(0.99) }
    }

    /// The counters summed over the owned blocks and the blocks that left.
    fn sum(&self) -> Sum {
        let mut c = Sum::default();
        if self.shard.is_none() {
            return c;
        }
        for slot in self.slots.values() {
            if let Slot::Owned(o) = slot {
                c.totals.merge(o.block.stats());
                c.hold.merge(o.block.hold_histogram());
                c.blocks += 1;
                c.bytes += o.block.spec().bytes() as u64;
            }
        }
        c.totals.merge(&self.counters.departed);
        c.hold.merge(&self.counters.departed_hold);
        c
    }

    fn received(&mut self, now_us: u64, conn: ConnId, request_id: u64, msg: Message, out: &mut Vec<Action>) {
        let c = *self.conns.entry(conn).or_default();
        let reply = |msg| Action::Reply { conn, request_id, msg };
        let token = |block| Token { conn, request_id, block };
        let name = authz::name_of(&msg);
        // Named only in a refusal (no allocation on the data path).
        let proven = || authz::proven_name(c.proven, c.key);
        let forbidden = match authz::check(Receiver::Server, c.class(), name) {
            Verdict::Allowed => self.sender_may_not(&c, &msg),
            Verdict::Forbidden => {
                let hint = if c.proven.is_none() { " (say Hello with a credential first)" } else { "" };
                Some(format!(
                    "{} may not send {name} to a server{hint} (docs/PROTOCOL.md §7.1); nothing changed",
                    proven()
                ))
            }
            Verdict::NotTaken => {
                let what = format!("a server does not take {name} messages (docs/PROTOCOL.md §7.1)");
                // Well-formed but out of turn: refuse it and keep the connection (PROTOCOL.md §7).
                tracing::warn!(server = self.id, conn, %what, "request refused");
                return out.push(reply(error(ErrorCode::BadRequest, what)));
            }
        };
        if let Some(refused) = forbidden {
            tracing::warn!(server = self.id, conn, message = name, claimed = %authz::claimed(&msg), proven = %proven(), %refused, "forbidden message refused");
            return out.push(reply(error(ErrorCode::Forbidden, refused)));
        }
        let rank = c.rank().unwrap_or(u32::MAX);
        let answer = match msg {
            Message::Control(Control::Hello { credential }) => match self.check_credential(&c, &credential) {
                Ok(()) => {
                    tracing::debug!(server = self.id, conn, peer = %credential, "connection introduced");
                    self.conns.insert(conn, Conn { proven: Some((credential.role, credential.id)), ..c });
                    Some(Control::Ok.into())
                }
                Err((code, message)) => {
                    tracing::warn!(server = self.id, conn, claimed = %credential, proven = %proven(), %message, "hello refused");
                    out.push(reply(error(code, message)));
                    if code == ErrorCode::Unauthenticated {
                        self.conns.remove(&conn);
                        out.push(Action::Close { conn });
                    }
                    return;
                }
            },
            Message::Control(Control::GetStats) => {
                let sid = self.shard.as_ref().map_or(u32::MAX, |s| s.id);
                Some(Control::Stats(self.stats_as(sid)).into())
            }
            Message::Control(Control::BlockSnapshot { epoch, state }) => {
                Some(self.take_snapshot(c.server().unwrap_or(u32::MAX), epoch, state))
            }
            Message::Control(Control::BlockDelta { block, epoch, pushes }) => {
                Some(self.take_delta(now_us, c.server().unwrap_or(u32::MAX), block, epoch, &pushes, out))
            }
            Message::Control(Control::Replicate { block, init, push }) => {
                let rows = Some(RowIds::from_vec(push.rows));
                let fwd = replica::Fwd {
                    worker: push.worker,
                    clock: push.clock,
                    init,
                    values: Values::from_vec(push.grad),
                    rows,
                };
                self.take_replicated(now_us, (conn, request_id), block, fwd, out)
            }
            Message::Forward { block, clock, worker, init, values } => {
                let fwd = replica::Fwd { worker, clock, init, values, rows: None };
                self.take_replicated(now_us, (conn, request_id), block, fwd, out)
            }
            Message::Control(Control::ReplicaSnapshot(state)) => Some(self.take_replica_snapshot(now_us, state, out)),
            Message::Push { block, clock, values } => {
                self.serve(now_us, rank, token(block), Request::Push { clock, values }, true, out)
            }
            Message::Pull { block, clock } => {
                self.serve(now_us, rank, token(block), Request::Pull { clock }, true, out)
            }
            Message::PushPull { block, clock, values } => {
                self.serve(now_us, rank, token(block), Request::PushPull { clock, values }, true, out)
            }
            Message::Init { block, values } => {
                self.serve(now_us, rank, token(block), Request::Init { values }, true, out)
            }
            Message::PullRows { block, clock, ids } => {
                self.serve(now_us, rank, token(block), Request::PullRows { clock, ids }, true, out)
            }
            Message::PushRows { block, clock, dim, ids, grads } => {
                self.serve(now_us, rank, token(block), Request::PushRows { clock, dim, ids, grads }, true, out)
            }
            Message::Control(Control::SetOptimizer { tensor, optimizer }) => match self.shard.as_mut() {
                None => Some(Refusal::NotReady.reply(0)),
                Some(shard) => match shard.set_optimizer(tensor, optimizer) {
                    Ok(()) => {
                        tracing::info!(server = shard.id, rank, tensor, ?optimizer, "tensor optimizer set");
                        Some(Control::Ok.into())
                    }
                    Err(e) => Some(error(ErrorCode::BadRequest, e.to_string())),
                },
            },
            Message::Control(Control::GetOptState { block }) => Some(self.opt_state_request(rank, block, None)),
            Message::Control(Control::SetOptState { block, state }) => {
                Some(self.opt_state_request(rank, block, Some(state)))
            }
            Message::Control(Control::SetValues { block, values }) => {
                Some(self.set_values_request(rank, block, &values))
            }
            other => {
                // The table allows what this match does not take: refused, nothing changed.
                Some(error(
                    ErrorCode::BadRequest,
                    format!("a server does not take {} messages", authz::name_of(&other)),
                ))
            }
        };
        if let Some(msg) = answer {
            out.push(reply(msg));
        }
    }

    /// Whether the credential of a `Hello` on connection `c` holds: made with this
    /// cluster's secret, for this job, of a role the connection's key may be, and naming
    /// a worker of the job. `Unauthenticated` closes the connection.
    fn check_credential(&self, c: &Conn, credential: &Credential) -> Result<(), (ErrorCode, String)> {
        let Some(own) = &self.credential else {
            return Err((ErrorCode::NotReady, "this server is not registered yet: say Hello again later".into()));
        };
        let refuse = |message: String| Err((ErrorCode::Unauthenticated, message));
        if let Err(e) = credential.verify_for(&self.secret, own.job) {
            return refuse(e.to_string());
        }
        if c.key == KeyId::Worker && credential.role != PeerRole::Worker {
            return refuse(format!("a connection of the worker secret cannot be {credential}"));
        }
        if credential.role == PeerRole::Worker
            && let Some(shard) = &self.shard
            && credential.id >= shard.config.workers
        {
            return refuse(format!("{credential} is not in this job of {} workers", shard.config.workers));
        }
        Ok(())
    }

    /// Why connection `c`'s proven server may not send `msg`, a check beyond the table: a
    /// copy of a block this server serves comes only from a server that owned the block
    /// before (a promoted backup's old primary, forwarding what it applied). A copy of a
    /// block served elsewhere is taken from any proven server: this server's placement
    /// may lag the scheduler's (it learns a promotion or a settled move by a broadcast),
    /// and refusing the block's new primary there would leave its pushes unacknowledged.
    fn sender_may_not(&self, c: &Conn, msg: &Message) -> Option<String> {
        let sender = c.server()?;
        let block = match msg {
            Message::Control(Control::Replicate { block, .. }) | Message::Forward { block, .. } => *block,
            Message::Control(Control::ReplicaSnapshot(state)) => state.spec.id,
            _ => return None,
        };
        let shard = self.shard.as_ref()?;
        let serving =
            self.slots.get(&block).is_some_and(|s| matches!(s, Slot::Owned(o) if matches!(o.phase, Phase::Serving)));
        if serving && !shard.owned_before(block, sender) {
            return Some(format!(
                "server {sender} sent a copy of block {block}, which this server serves (server {sender} never owned it)"
            ));
        }
        None
    }

    /// A data request: answered now (the reply returned), later (a held pull: `None`,
    /// the answer comes from a push), or parked while its block is frozen.
    ///
    /// A push to a block with backups is forwarded to them first, then applied here:
    /// with `defer`, at [`Event::Continue`] (the request is deferred and
    /// [`Action::Continue`] emitted, so the runtime sends the forwards before this server
    /// spends the time to apply the push, and the backups apply it while it does); its
    /// reply waits for both. Requests replayed from a parked list are applied at once.
    fn serve(
        &mut self,
        now_us: u64,
        rank: u32,
        to: Token,
        request: Request,
        defer: bool,
        out: &mut Vec<Action>,
    ) -> Option<Message> {
        let block = to.block;
        self.last_request_us = now_us;
        let Some(shard) = self.shard.as_ref() else { return Some(Refusal::NotReady.reply(block)) };
        let o = match self.slots.get_mut(&block) {
            Some(Slot::Owned(o)) => o,
            Some(Slot::Gone { .. }) | None => return Some(shard.refusal(block).reply(block)),
        };
        if let Request::PullRows { ids, .. } = &request
            && let Some((_, _, dim)) = o.block.spec().row_range()
            && ids.len() as u64 * u64::from(dim) * 4 > self.max_payload
        {
            let (rows, limit) = (ids.len(), self.max_payload);
            let refused = format!(
                "a pull of {rows} rows of {dim} values from block {block} would be answered with {} bytes, above \
                 the frame limit of {limit} bytes: pull fewer rows per request",
                rows as u64 * u64::from(dim) * 4
            );
            tracing::warn!(server = shard.id, rank, block, %refused, "row pull refused");
            return Some(error(ErrorCode::BadRequest, refused));
        }
        if let Phase::Frozen { parked, .. } | Phase::Arrived { parked, .. } = &mut o.phase {
            parked.push(Parked { rank, to, request });
            return None;
        }
        // A worker that rejoined may go on past its next clock on this block: the clocks
        // between are skipped before anything waits on them (its push must not park for a
        // checkpoint of a clock only the skip completes).
        let rejoined = self.added_workers.contains(&rank);
        if rejoined && let Request::Push { clock, .. } | Request::PushPull { clock, .. } = &request {
            let before = o.block.done();
            let answers = o.block.skip_to(&shard.config_for(o.block.spec()), rank, *clock, now_us);
            if o.block.done() != before {
                self.answer_pulls(answers, out);
                self.checkpoint_if_due(now_us, block, before, out);
            }
        }
        let Some(shard) = self.shard.as_ref() else { return Some(Refusal::NotReady.reply(block)) };
        let Some(Slot::Owned(o)) = self.slots.get_mut(&block) else { return None };
        let done = o.block.done();
        let pulled = match &request {
            Request::Pull { clock } | Request::PullRows { clock, .. } => Some(*clock),
            // The pull of the next clock (the last clock has none: refused below).
            Request::PushPull { clock, .. } => clock.checked_add(1),
            _ => None,
        };
        if let Some(clock) = pulled
            && let Some(refused) = self.pull_bound(to.conn, block, clock, done)
        {
            tracing::warn!(server = shard.id, rank, block, %refused, "pull refused");
            return Some(error(ErrorCode::BadRequest, refused));
        }
        let Some(Slot::Owned(o)) = self.slots.get_mut(&block) else { return None };
        if let Request::Push { clock, .. } | Request::PushPull { clock, .. } | Request::PushRows { clock, .. } =
            &request
            && next_checkpoint(self.checkpoint.as_ref(), done).is_some_and(|c| *clock >= c)
        {
            o.checkpoint_parked.push(Parked { rank, to, request });
            return None;
        }
        self.counters.requests += 1;
        // Forwarded only if this server takes it too (a duplicate too: a backup that
        // missed it gets it): a refused push is refused here alone.
        let forward = if shard.placement.backups_of(block).is_empty() {
            None
        } else {
            replica::carried(rank, &request).filter(|f| {
                if f.init {
                    !matches!(o.phase, Phase::Copying { .. })
                        && !o.block.spec().is_rows()
                        && f.values.len() == o.block.spec().len
                } else if let Request::PushRows { dim, ids, grads, .. } = &request {
                    check_dim(&o.block, *dim, ids.len()).is_ok()
                        && o.block.check_push_rows(rank, f.clock, &ids.to_vec(), grads.len(), rejoined).is_ok()
                } else {
                    o.block.check_push(rank, f.clock, f.values.len(), rejoined).is_ok()
                }
            })
        };
        if let Some(f) = forward {
            self.forward(now_us, to, f, out);
            if defer {
                if self.deferred.is_empty() {
                    out.push(Action::Continue);
                }
                self.deferred.push_back(Deferred { rank, to, request, done });
                return None;
            }
        }
        self.apply_request(now_us, rank, to, request, done, out)
    }

    /// Applies the requests deferred by [`Server::serve`], in order, and sends their
    /// replies (held back by their gates until the backups answered).
    fn apply_deferred(&mut self, now_us: u64, out: &mut Vec<Action>) {
        while let Some(Deferred { rank, to, request, done }) = self.deferred.pop_front() {
            if let Some(msg) = self.apply_request(now_us, rank, to, request, done, out) {
                out.push(Action::Reply { conn: to.conn, request_id: to.request_id, msg });
            }
        }
    }

    /// The data request's effect on its block (owned and not frozen: [`Server::serve`]
    /// checked), and its reply if it has one now. `done` is the block's before.
    fn apply_request(
        &mut self,
        now_us: u64,
        rank: u32,
        to: Token,
        request: Request,
        done: Clock,
        out: &mut Vec<Action>,
    ) -> Option<Message> {
        let block = to.block;
        let Some(shard) = self.shard.as_ref() else { return Some(Refusal::NotReady.reply(block)) };
        let Some(Slot::Owned(o)) = self.slots.get_mut(&block) else { return Some(shard.refusal(block).reply(block)) };
        let rejoined = self.added_workers.contains(&rank);
        let push = if rejoined { Block::push_rejoined } else { Block::push };
        let reply = match request {
            Request::Push { clock, values } => {
                self.counters.bytes_in += values.as_bytes().len() as u64;
                // Only a push needs the tensor's own optimizer.
                let config = shard.config_for(o.block.spec());
                match push(&mut o.block, &config, rank, clock, &values.to_f32s(), now_us) {
                    Ok(answers) => {
                        self.answer_pulls(answers, out);
                        Some(Message::PushAck { block, clock })
                    }
                    Err(e) => Some(error(ErrorCode::BadRequest, e.to_string())),
                }
            }
            Request::Init { .. } if matches!(o.phase, Phase::Copying { .. }) => Some(error(
                ErrorCode::NotReady,
                format!("block {block} is migrating: initial values must be set before training starts"),
            )),
            Request::Init { values } => match o.block.set_initial(&values.to_f32s()) {
                Ok(()) => Some(Message::PushAck { block, clock: 0 }),
                Err(e) => Some(error(ErrorCode::BadRequest, e.to_string())),
            },
            Request::Pull { clock } => {
                // One coin per pull request, not per block: every block (on every server) of
                // worker `rank`'s pull(clock) draws the same value, so a probabilistic policy
                // pauses the whole pull or none of it.
                // A rejoined worker's pull says where it goes on from on this block: it
                // pushes no clock before it.
                let mut answers = Vec::new();
                if rejoined {
                    answers = o.block.skip_to(&shard.config_for(o.block.spec()), rank, clock, now_us);
                }
                let mut coin = StdRng::seed_from_u64(pull_coin_seed(shard.seed, rank, clock));
                let pulled = o.block.pull(&shard.effective(), to, rank, clock, now_us, &mut coin);
                let refused = match pulled {
                    Ok(answer) => {
                        answers.extend(answer);
                        None
                    }
                    Err(e) => Some(error(ErrorCode::BadRequest, e.to_string())),
                };
                self.answer_pulls(answers, out);
                refused
            }
            Request::PushRows { clock, dim, ids, grads } => {
                self.counters.bytes_in += (ids.as_bytes().len() + grads.as_bytes().len()) as u64;
                let config = shard.config_for(o.block.spec());
                let pushed = check_dim(&o.block, dim, ids.len()).and_then(|()| {
                    let push_rows = if rejoined { Block::push_rows_rejoined } else { Block::push_rows };
                    push_rows(&mut o.block, &config, rank, clock, &ids.to_vec(), &grads.to_f32s(), now_us)
                });
                match pushed {
                    Ok(answers) => {
                        self.answer_pulls(answers, out);
                        Some(Message::PushAck { block, clock })
                    }
                    Err(e) => Some(error(ErrorCode::BadRequest, e.to_string())),
                }
            }
            Request::PullRows { clock, ids } => {
                // As a Pull: a rejoined worker's pull says where it goes on from; one coin
                // per pull request.
                let mut answers = Vec::new();
                if rejoined && o.block.spec().is_rows() {
                    answers = o.block.skip_to(&shard.config_for(o.block.spec()), rank, clock, now_us);
                }
                let mut coin = StdRng::seed_from_u64(pull_coin_seed(shard.seed, rank, clock));
                let ids: Arc<[u64]> = ids.iter().collect();
                let pulled = o.block.pull_rows(&shard.effective(), to, rank, clock, ids, now_us, &mut coin);
                let refused = match pulled {
                    Ok(answer) => {
                        answers.extend(answer);
                        None
                    }
                    Err(e) => Some(error(ErrorCode::BadRequest, e.to_string())),
                };
                self.answer_pulls(answers, out);
                refused
            }
            Request::PushPull { clock, values } => {
                // The push exactly as a Push (a duplicate is dropped by the clock state), then
                // the pull of the next clock exactly as a Pull: answered now or held, with the
                // same coin. Its `PullReply` (under the request's id) acknowledges the push;
                // a held pull's push is acknowledged at once on its own (`PushAck` under the
                // same id, the `PullReply` later), so that the worker's window never fills
                // with held pulls while its other pushes wait (issue 33).
                let Some(next) = clock.checked_add(1) else {
                    return Some(error(ErrorCode::BadRequest, format!("push_pull of block {block} at the last clock")));
                };
                self.counters.bytes_in += values.as_bytes().len() as u64;
                let config = shard.config_for(o.block.spec());
                let mut answers = match push(&mut o.block, &config, rank, clock, &values.to_f32s(), now_us) {
                    Ok(answers) => answers,
                    Err(e) => return Some(error(ErrorCode::BadRequest, e.to_string())),
                };
                let mut coin = StdRng::seed_from_u64(pull_coin_seed(shard.seed, rank, next));
                let pulled = o.block.pull(&shard.effective(), to, rank, next, now_us, &mut coin);
                let reply = match pulled {
                    Ok(Some(answer)) => {
                        answers.push(answer);
                        None
                    }
                    Ok(None) => Some(Message::PushAck { block, clock }),
                    Err(e) => Some(error(ErrorCode::BadRequest, e.to_string())),
                };
                self.answer_pulls(answers, out);
                reply
            }
        };
        self.checkpoint_if_due(now_us, block, done, out);
        reply
    }

    /// Why a pull (or a push_pull's pull) of `block` at `clock` on connection `conn` is
    /// refused before the policy sees it: a clock no policy answers soon
    /// (`--max-clock-lead` past `done`), or one pull more than a bound on held pulls.
    fn pull_bound(&self, conn: ConnId, block: BlockId, clock: Clock, done: Clock) -> Option<String> {
        let lead = self.max_clock_lead;
        // asp answers every pull at once, however far ahead: nothing would be held.
        let holds = self.shard.as_ref().is_some_and(|s| !matches!(s.effective().sync, SyncPolicy::Asp));
        if holds && clock.saturating_sub(done) > lead {
            return Some(format!(
                "a pull of block {block} at clock {clock} is more than {lead} clocks past its done clock {done} \
                 (--max-clock-lead {lead})"
            ));
        }
        let at_most = self.held_at_most.get();
        if at_most < MAX_HELD_PER_CONN {
            // Neither bound can be reached (MAX_HELD_PER_CONN <= MAX_HELD_PER_SERVER).
            self.held_at_most.set(at_most + 1);
            return None;
        }
        let held = |pred: &dyn Fn(&Token) -> bool| -> usize {
            self.slots.values().map(|s| if let Slot::Owned(o) = s { o.block.held_matching(pred) } else { 0 }).sum()
        };
        let total: usize = self.slots.values().map(|s| if let Slot::Owned(o) = s { o.block.held() } else { 0 }).sum();
        self.held_at_most.set(total + 1);
        if total >= MAX_HELD_PER_SERVER {
            self.held_at_most.set(total);
            return Some(format!(
                "this server holds {total} pulls already, its bound (MAX_HELD_PER_SERVER {MAX_HELD_PER_SERVER})"
            ));
        }
        if total >= MAX_HELD_PER_CONN {
            let mine = held(&|t: &Token| t.conn == conn);
            if mine >= MAX_HELD_PER_CONN {
                self.held_at_most.set(total);
                return Some(format!(
                    "this server holds {mine} pulls of this connection already, its bound per connection \
                     (MAX_HELD_PER_CONN {MAX_HELD_PER_CONN})"
                ));
            }
        }
        None
    }

    /// Replies to the pulls the core released (and traces them).
    fn answer_pulls(&mut self, answers: Vec<Answer<Token>>, out: &mut Vec<Action>) {
        for a in answers {
            if self.trace {
                let t = PullTrace {
                    block: a.token.block,
                    worker: a.worker,
                    clock: a.clock,
                    done: a.done,
                    held_us: a.held_us,
                };
                out.push(Action::Trace(t));
            }
            self.counters.bytes_out += a.values.len() as u64 * 4;
            let (block, clock, values) = (a.token.block, a.clock, Values::from_shared(a.values));
            let msg = if a.rows.is_some() {
                Message::PullRowsReply { block, clock, values }
            } else {
                Message::PullReply { block, clock, values }
            };
            out.push(Action::Reply { conn: a.token.conn, request_id: a.token.request_id, msg });
        }
    }

    fn scheduler_said(&mut self, now_us: u64, request_id: u64, msg: Message, out: &mut Vec<Action>) {
        if request_id != 0 {
            match self.calls.remove(&request_id) {
                Some(Call::Register) => self.welcome(msg, out),
                Some(Call::Migration(block)) => self.recorded(now_us, block, request_id, msg, out),
                Some(Call::Replicate { .. } | Call::ReplicaSync { .. }) | None => {
                    tracing::debug!(request_id, "an answer of the scheduler to no call")
                }
            }
            return;
        }
        if let Message::Control(Control::AddWorker { rank }) = msg {
            // Answered even while shutting down: a restarted worker waits for every server.
            return self.add_worker(rank, out);
        }
        if self.stopping.is_some() {
            // Shutting down: the scheduler said its last word.
            return;
        }
        match msg {
            Message::Control(Control::Assign(a)) => self.assign(now_us, *a, out),
            Message::Control(Control::Migrate { block, to, to_addr, epoch }) => {
                self.migrate_out(now_us, block, to, to_addr, epoch, out)
            }
            Message::Control(Control::RemoveWorker { rank }) => self.remove_worker(now_us, rank, out),
            Message::Control(Control::Checkpointing(plan)) => {
                tracing::info!(server = self.id, dir = %plan.dir, every = plan.every, resume = ?plan.resume.as_ref().map(|r| r.clock), "checkpoint plan");
                self.checkpoint = Some(plan);
            }
            Message::Control(Control::Settled { block, epoch, owner }) => {
                self.settled(now_us, block, epoch, owner, out)
            }
            Message::Control(Control::SplitBlock { block, at, epoch, recorded }) => {
                self.split_block(now_us, (block, at, epoch), recorded, out)
            }
            Message::Control(Control::Replicas { placement, servers }) => {
                self.replicas_changed(now_us, placement, servers, out)
            }
            Message::Control(Control::Shutdown { reason }) => {
                tracing::info!(server = self.id, %reason, "server shuts down");
                self.stopping = Some(Stopping { reason, since_us: now_us, lingering: false, recheck_us: None });
                self.shutdown_handovers(out);
            }
            other => tracing::warn!(server = self.id, kind = ?other.kind(), "unexpected message from the scheduler"),
        }
    }

    fn welcome(&mut self, msg: Message, out: &mut Vec<Action>) {
        self.register_deadline_us = None;
        match msg {
            Message::Control(Control::Welcome { node_id, credential, .. }) => {
                self.id = Some(node_id);
                self.credential = Some(credential);
                tracing::info!(server = node_id, addr = %self.data_addr, "server registered");
            }
            Message::Error(e) => {
                self.exit(Exit::Failed { reason: format!("scheduler answered {:?}: {}", e.code, e.message) }, out)
            }
            other => self.exit(
                Exit::Failed {
                    reason: format!("protocol error with scheduler: expected Welcome, got {:?}", other.kind()),
                },
                out,
            ),
        }
    }

    fn assign(&mut self, now_us: u64, a: Assignment, out: &mut Vec<Action>) {
        if let Some(CheckpointPlan { dir, resume: Some(r), .. }) = &self.checkpoint {
            // The blocks come from the checkpoint: read them first.
            let mine: Vec<BlockId> = a.placement.blocks_of(a.server_id).collect();
            let blocks: Vec<CheckpointEntry> = r.blocks.iter().filter(|e| mine.contains(&e.block)).cloned().collect();
            if let Some(b) = mine.iter().find(|b| !blocks.iter().any(|e| e.block == **b)) {
                let reason = format!(
                    "the checkpoint of clock {} in {dir} has no block {b}: resume with the same model and \
                     --block-bytes",
                    r.clock
                );
                return self.exit(Exit::Failed { reason }, out);
            }
            out.push(Action::Restore { dir: dir.clone(), blocks });
            self.restoring = Some(a);
            return;
        }
        let mut slots = BTreeMap::new();
        let built: Result<(), elasticps_core::CoreError> = (|| {
            for b in a.placement.blocks_of(a.server_id) {
                let spec = *a.partition.block(b)?;
                let block = match a.partition.row_rule(b, a.seed)? {
                    Some(rule) => Block::new_rows(spec, rule, &a.config)?,
                    None => Block::new(spec, a.partition.init_values(b, a.seed)?, &a.config)?,
                };
                slots.insert(b, Slot::Owned(Owned::serving(block, 0)));
            }
            Ok(())
        })();
        match built {
            Ok(()) => self.take_assignment(now_us, a, slots, out),
            Err(e) => self.exit(Exit::Failed { reason: e.to_string() }, out),
        }
    }

    /// The blocks of the checkpoint the job resumes from, read for the assignment waiting.
    fn restored(&mut self, now_us: u64, states: Result<Vec<BlockState>, String>, out: &mut Vec<Action>) {
        let Some(a) = self.restoring.take() else { return };
        let clock = self.checkpoint.as_ref().and_then(|p| p.resume.as_ref()).map_or(0, |r| r.clock);
        let shard = Shard::new(&a);
        let built: Result<BTreeMap<BlockId, Slot>, String> = states.and_then(|states| {
            let mut slots = BTreeMap::new();
            for state in states {
                let id = state.spec.id;
                let spec = a.partition.block(id).map_err(|e| e.to_string())?;
                if *spec != state.spec {
                    return Err(format!(
                        "block {id} of the checkpoint is {:?}, the model's is {:?}: resume with the same model and \
                         --block-bytes",
                        state.spec, spec
                    ));
                }
                if state.clocks.done() != clock {
                    return Err(format!(
                        "block {id} of the checkpoint is at clock {}, not {clock}",
                        state.clocks.done()
                    ));
                }
                let config = shard.config_for(spec);
                let block = Block::from_state(state, &[], &config).map_err(|e| {
                    format!("block {id} of the checkpoint does not fit this job ({e}): resume with the same workers")
                })?;
                slots.insert(id, Slot::Owned(Owned::serving(block, 0)));
            }
            Ok(slots)
        });
        match built {
            Ok(slots) => {
                tracing::info!(
                    server = a.server_id,
                    clock,
                    blocks = slots.len(),
                    "blocks restored from the checkpoint"
                );
                self.take_assignment(now_us, a, slots, out)
            }
            Err(e) => self.exit(Exit::Failed { reason: format!("cannot resume from the checkpoint: {e}") }, out),
        }
    }

    /// Serves `slots`, the blocks of assignment `a`.
    fn take_assignment(&mut self, now_us: u64, a: Assignment, slots: BTreeMap<BlockId, Slot>, out: &mut Vec<Action>) {
        let shard = Shard::new(&a);
        if a.inject.bandwidth_bps > 0 || a.inject.interference > 1.0 {
            tracing::info!(
                server = a.server_id,
                bandwidth_bps = a.inject.bandwidth_bps,
                interference = a.inject.interference,
                after_s = a.inject.at_us as f64 / 1e6,
                "straggler injection"
            );
        }
        let copies = a.placement.backups_on(a.server_id).count();
        tracing::info!(server = a.server_id, blocks = slots.len(), copies, sync = %shard.config.sync, "blocks assigned");
        self.assign_copies(&a.placement, a.server_id);
        self.shard = Some(shard);
        self.slots = slots;
        self.incoming.clear();
        self.removed_workers.clear();
        self.added_workers.clear();
        self.counters.departed = Default::default();
        self.counters.departed_hold = Default::default();
        self.last_report_us = now_us;
        let server_id = self.id.unwrap_or(a.server_id);
        out.push(Action::ToScheduler { request_id: 0, msg: Control::AssignDone { server_id }.into() });
    }

    fn remove_worker(&mut self, now_us: u64, rank: u32, out: &mut Vec<Action>) {
        let Some(shard) = self.shard.as_ref() else { return };
        tracing::info!(server = shard.id, rank, "worker removed from every quorum");
        self.removed_workers.push(rank);
        self.added_workers.retain(|r| *r != rank);
        let mut answers = Vec::new();
        let mut before = Vec::new();
        for (id, slot) in self.slots.iter_mut() {
            if let Slot::Owned(o) = slot {
                let config = shard.config_for(o.block.spec());
                before.push((*id, o.block.done()));
                answers.extend(o.block.remove_worker(&config, rank, now_us));
            }
        }
        for copy in self.replication.copies_mut() {
            let config = shard.config_for(copy.spec());
            copy.remove_worker(&config, rank, now_us);
        }
        self.answer_pulls(answers, out);
        for (block, done) in before {
            self.checkpoint_if_due(now_us, block, done, out);
        }
    }

    /// A removed worker restarted: every block here takes it back into its quorum (and a
    /// block arriving later too); the scheduler learns the largest of the blocks' next
    /// clocks for it (the worker goes on from the largest over every server, so each
    /// clock of its new life reaches every block or none).
    fn add_worker(&mut self, rank: u32, out: &mut Vec<Action>) {
        self.removed_workers.retain(|r| *r != rank);
        if !self.added_workers.contains(&rank) {
            self.added_workers.push(rank);
        }
        let mut clock: Option<Clock> = None;
        for slot in self.slots.values_mut() {
            if let Slot::Owned(o) = slot
                && let Some(next) = o.block.add_worker(rank)
            {
                clock = clock.max(Some(next));
            }
        }
        let clock = clock.unwrap_or(u32::MAX);
        for copy in self.replication.copies_mut() {
            copy.add_worker(rank);
        }
        tracing::info!(server = self.id, rank, clock, "worker taken back into every quorum");
        out.push(Action::ToScheduler { request_id: 0, msg: Control::WorkerAdded { rank, clock }.into() });
    }

    /// After a push or a removal took `block` from clock `before` on: if it just reached a
    /// checkpoint clock, its state goes to disk and the pushes parked for it are served.
    fn checkpoint_if_due(&mut self, now_us: u64, block: BlockId, before: Clock, out: &mut Vec<Action>) {
        let Some(plan) = &self.checkpoint else { return };
        let Some(Slot::Owned(o)) = self.slots.get_mut(&block) else { return };
        let done = o.block.done();
        if done == before || next_checkpoint(Some(plan), before) != Some(done) {
            return;
        }
        debug_assert!(done > before, "a block's done clock never goes back");
        out.push(Action::Checkpoint { dir: plan.dir.clone(), clock: done, state: o.block.state() });
        self.checkpoint_writes += 1;
        let parked = std::mem::take(&mut o.checkpoint_parked);
        self.serve_parked(now_us, parked, out);
    }

    /// A block of checkpoint `clock` is on disk (or not): tell the scheduler.
    fn checkpoint_written(
        &mut self,
        clock: Clock,
        block: BlockId,
        result: Result<CheckpointEntry, String>,
        out: &mut Vec<Action>,
    ) {
        self.checkpoint_writes = self.checkpoint_writes.saturating_sub(1);
        match result {
            Ok(entry) => out.push(Action::ToScheduler {
                request_id: 0,
                msg: Control::CheckpointWritten { clock, blocks: vec![entry] }.into(),
            }),
            Err(error) => {
                tracing::warn!(server = self.id, clock, block, %error, "checkpoint block not written; that checkpoint stays incomplete")
            }
        }
    }

    fn on_timeout(&mut self, now_us: u64, out: &mut Vec<Action>) {
        if let Some(deadline) = self.register_deadline_us
            && now_us >= deadline
        {
            let after = REGISTER_TIMEOUT_US as f64 / 1e6;
            let reason = format!("timed out after {after:.1} s: the scheduler to accept this server");
            return self.exit(Exit::Failed { reason }, out);
        }
        if now_us >= self.next_stats_us {
            self.next_stats_us = now_us + STATS_INTERVAL_US;
            let totals = self.sum().totals;
            if let Some(shard) = self.shard.as_mut() {
                if let Some((from, to)) = shard.observe(&totals) {
                    tracing::info!(server = shard.id, from, to, "adaptive staleness changed");
                }
                let interval = now_us.saturating_sub(self.last_report_us);
                self.last_report_us = now_us;
                let load = self.take_load(interval);
                out.push(Action::ToScheduler { request_id: 0, msg: Control::ServerLoad(load).into() });
            }
        }
        if now_us >= self.next_wait_log_us {
            self.next_wait_log_us = now_us + WAIT_LOG_EVERY_US;
            self.log_waits(now_us);
        }
        self.check_deadlines(now_us, out);
        self.resync_due(now_us, out);
    }

    /// After `Shutdown`: [`Server::try_exit`] looks again at `at_us`
    /// ([`Server::poll_timeout`]).
    fn recheck_at(&mut self, at_us: u64) {
        if let Some(s) = self.stopping.as_mut() {
            s.recheck_us = Some(at_us);
        }
    }

    /// Says what the server waits for: an assignment, or (for a pull held for more than
    /// 5 s) the push that releases it. A held pull is the one wait on a server that no
    /// timeout ends (the worker's request timeout does).
    fn log_waits(&self, now_us: u64) {
        let Some(shard) = &self.shard else {
            tracing::info!(
                server = self.id,
                "server waits for the scheduler to assign blocks (a worker must define the model and every server must join)"
            );
            return;
        };
        let longest = self
            .slots
            .iter()
            .filter_map(|(b, s)| match s {
                Slot::Owned(o) => o.block.waiting(now_us).map(|w| (*b, w)),
                Slot::Gone { .. } => None,
            })
            .max_by_key(|(_, w)| w.held_us);
        for (block, o) in self.slots.iter().filter_map(|(b, s)| match s {
            Slot::Owned(o) => Some((b, o)),
            Slot::Gone { .. } => None,
        }) {
            if let Phase::Arrived { since_us, parked } = &o.phase
                && now_us.saturating_sub(*since_us) > LONG_HOLD_US
            {
                tracing::warn!(
                    server = shard.id,
                    block,
                    epoch = o.epoch,
                    parked = parked.len(),
                    "block {block} arrived by migration waits for the scheduler to settle the move"
                );
            }
        }
        if let Some((block, w)) = longest.filter(|(_, w)| w.held_us > LONG_HOLD_US) {
            tracing::warn!(
                server = shard.id,
                block,
                held_s = w.held_us / 1_000_000,
                "pull({}) of worker {} waits for worker {} to push clock {}",
                w.clock,
                w.worker,
                w.slowest,
                w.next_clock
            );
        }
    }

    /// After `Shutdown`: leaves once the migrations out ended (or waited too long) and,
    /// for a drained server, once workers stopped using it: a worker whose layout is older
    /// than the drain still sends it requests, which must get `Moved`, not a closed
    /// socket. It lingers until every data connection is closed (workers drop a server
    /// that left their layout) or no request came for [`LINGER_QUIET_US`].
    fn try_exit(&mut self, now_us: u64, out: &mut Vec<Action>) {
        if let Some(s) = self.stopping.as_mut() {
            s.recheck_us = None;
        }
        let Some(stopping) = self.stopping.as_ref() else { return };
        let migrating = self
            .slots
            .values()
            .filter(|s| matches!(s, Slot::Owned(Owned { phase: Phase::Copying { .. } | Phase::Frozen { .. }, .. })))
            .count();
        let wait_end = stopping.since_us + SHUTDOWN_WAIT_US;
        if migrating > 0 {
            if now_us < wait_end {
                return self.recheck_at(wait_end);
            }
            tracing::warn!(server = self.id, pending = migrating, "migrations still running at shutdown");
        }
        if self.checkpoint_writes > 0 && now_us < wait_end {
            // The last checkpoint's blocks are on their way to disk.
            return self.recheck_at(wait_end);
        }
        let drained = self.shard.is_some() && self.slots.values().all(|s| matches!(s, Slot::Gone { .. }));
        if drained {
            let open = self.conns.len();
            let quiet_us = now_us.saturating_sub(self.last_request_us);
            if open > 0 && quiet_us <= LINGER_QUIET_US {
                if let Some(s) = self.stopping.as_mut() {
                    s.lingering = true;
                }
                return self.recheck_at(self.last_request_us + LINGER_QUIET_US + 1);
            }
            tracing::info!(server = self.id, open, quiet_s = quiet_us as f64 / 1e6, "drained server leaves");
        }
        let reason = self.stopping.as_ref().map(|s| s.reason.clone()).unwrap_or_default();
        self.exit(Exit::Shutdown { reason }, out);
    }

    fn exit(&mut self, exit: Exit, out: &mut Vec<Action>) {
        self.exited = true;
        out.push(Action::Exit(exit));
    }
}

/// The first checkpoint clock after `done` (a push of that clock or later waits for the
/// block to reach it), if the job checkpoints.
pub(super) fn next_checkpoint(plan: Option<&CheckpointPlan>, done: Clock) -> Option<Clock> {
    let every = plan?.every;
    if every == 0 {
        return None;
    }
    (done / every).checked_add(1)?.checked_mul(every)
}

/// Why a row push of `count` rows of `dim` values does not fit `block`: not a row block,
/// or another width than its table's (an empty push may say any width).
fn check_dim(block: &Block<Token>, dim: u32, count: usize) -> Result<(), elasticps_core::CoreError> {
    let spec = block.spec();
    let Some((_, _, d)) = spec.row_range() else { return Err(elasticps_core::CoreError::NotRows(spec.id)) };
    if count > 0 && dim != d {
        return Err(elasticps_core::CoreError::WrongDim { block: spec.id, expected: d, got: dim });
    }
    Ok(())
}

/// The seed of the coin of worker `rank`'s pull(clock): the same on every server.
pub fn pull_coin_seed(job_seed: u64, rank: u32, clock: u32) -> u64 {
    let key = (u64::from(rank) << 32) | u64::from(clock);
    (job_seed ^ key.wrapping_mul(0x9E37_79B9_7F4A_7C15)).rotate_left(29)
}

#[cfg(test)]
mod tests;
