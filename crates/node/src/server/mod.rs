//! The server's decisions as a plain state machine: which blocks it owns, how a push or
//! pull reaches one, the sync policy's held pulls, live migration of one block (both
//! ends), load reports, the adaptive policy, when a drained server may leave. Events in
//! (a frame on a data connection, a message from the scheduler, the answer of another
//! server, time), actions out (reply, send to the scheduler, send to a server, trace,
//! exit). One struct, `&mut self`, no locks, no threads, no clock of its own: every
//! event comes with `now_us`.
//!
//! This module holds the state, the public API and the dispatch: each event, and each
//! message by its family, goes to its handler in a module of its own.
//!
//! - [`event`](self): what happens at the server and what the runtime must do.
//! - [`access`](self): who may send what (a connection's `Hello`, its credential).
//! - [`request`]: a data request (the whole block or rows; push, pull, push_pull,
//!   init) and its sender.
//! - [`data`](self): the data path, from a request to its block: refused, parked,
//!   forwarded to the backups, applied.
//! - [`holds`](self): the sync policy's held pulls (bounds, answers, long waits).
//! - [`slot`]: one block's slot and its typed phase (serving, copying, frozen, gone).
//! - [`migrate`](self): the migration's steps, old owner and new owner.
//! - [`replica`](self): `--replicas`, the primary's forwarding and the backups' copies.
//! - [`split`](self): a hot row block split in two in place.
//! - [`assign`](self): registration, and the blocks assigned (or restored).
//! - [`quorum`](self): workers removed from and taken back into every quorum.
//! - [`checkpoint`](self): when a block's state goes to disk.
//! - [`opt_state`](self): a tensor's optimizer, a block's optimizer state and values.
//! - [`export`]: a page of a block for `elasticps export`.
//! - [`stop`](self): after `Shutdown`, the waits and the exit.
//! - [`config`]: the shard's configuration, the adaptive policy, tensor optimizers.
//! - [`counters`] and [`report`](self): stats, metrics snapshot, load.
//! - [`capacity`]: the link's rate, from the time data frames take to arrive.
//!
//! Registration is part of the state machine: [`Server::start`] returns the
//! `RegisterServer` call, so a harness drives a server from birth.

use std::collections::{BTreeMap, BTreeSet};

use elasticps_core::block::Block;
use elasticps_core::model::BlockId;
use elasticps_core::placement::ServerId;
use elasticps_wire::{Assignment, CheckpointPlan, Control, Credential, ErrorCode, Message};

mod access;
mod assign;
pub mod capacity;
mod checkpoint;
pub mod config;
pub mod counters;
mod data;
mod event;
pub mod export;
mod holds;
mod migrate;
mod opt_state;
mod quorum;
mod replica;
mod report;
pub mod request;
pub mod slot;
mod split;
mod stop;

pub use config::{Refusal, Shard, error};
pub use counters::{RowTotals, ServerSnapshot, staleness_bound};
pub use data::pull_coin_seed;
pub use event::{Action, Event, Exit, PullTrace};
pub use request::{Op, Request, Sender, What};
pub use slot::{FrozenStep, Outgoing, Owned, Parked, Phase, Slot, Token};

use access::Conn;
use counters::Counters;
use migrate::Incoming;
use stop::Stopping;

pub use crate::ConnId;

/// How often a server reports its load and evaluates its adaptive policy, µs.
pub const STATS_INTERVAL_US: u64 = 1_000_000;
/// How long another server may take to answer a call (a migration step, a forwarded
/// push, a backup's snapshot), and the scheduler to record a migration, µs: the one
/// deadline of every call in flight ([`Server::poll_timeout`]).
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

/// A call in flight: what it is for and when the server stops waiting for it (`None`:
/// registration, whose deadline is the server's own).
#[derive(Clone, Copy, Debug)]
struct Pending {
    what: Call,
    deadline_us: Option<u64>,
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
    /// The calls in flight, by id.
    calls: BTreeMap<u64, Pending>,
    /// Their deadlines, earliest first: `(deadline_us, call)`. On [`Event::Timeout`] every
    /// call past its deadline is failed, as its link failing would.
    call_deadlines: BTreeSet<(u64, u64)>,
    next_call: u64,
    next_stats_us: u64,
    last_report_us: u64,
    next_wait_log_us: u64,
    /// When the last data request arrived.
    last_request_us: u64,
    /// The log budget of the refusals peers cause (`crate::throttle`).
    refusal_log: crate::throttle::Throttle,
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
    /// The pulls held here, in all and per connection: the bounds on held pulls cost a
    /// pull O(1), and a closed connection's pulls are found without a scan.
    held: holds::HeldCount,
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
            call_deadlines: BTreeSet::new(),
            next_call: 1,
            next_stats_us: 0,
            last_report_us: 0,
            next_wait_log_us: 0,
            last_request_us: 0,
            refusal_log: Default::default(),
            stopping: None,
            exited: false,
            checkpoint: None,
            restoring: None,
            checkpoint_writes: 0,
            replication: replica::Replication::default(),
            held: holds::HeldCount::default(),
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
        let call = self.call(now_us, Call::Register);
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
    /// registration's deadline, the next load report and wait log, the earliest deadline
    /// of a call in flight (to another server, or a migration's record at the scheduler:
    /// O(log n), the first of `call_deadlines`), a replica's resync, and (after
    /// `Shutdown`) the end of the wait for migrations or of a drained server's linger.
    /// `None` once exited.
    pub fn poll_timeout(&self) -> Option<u64> {
        if self.exited {
            return None;
        }
        let stopping = self.stopping.as_ref().and_then(|s| s.recheck_us);
        [self.register_deadline_us, Some(self.next_stats_us), Some(self.next_wait_log_us), stopping]
            .into_iter()
            .flatten()
            .chain(self.call_deadlines.first().map(|(at, _)| *at))
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
            Event::Closed { conn } => self.conn_closed(conn),
            Event::FromScheduler { request_id, msg } => self.scheduler_said(now_us, request_id, msg, out),
            Event::FromServer { call, reply } => self.step_answered(now_us, call, reply, out),
            Event::Timeout => self.on_timeout(now_us, out),
            Event::CheckpointWritten { clock, block, result } => self.checkpoint_written(clock, block, result, out),
            Event::Restored(states) => self.restored(now_us, states, out),
        }
        if self.stopping.is_some() {
            self.try_exit(now_us, out);
        }
        self.gate_replies(from, out);
        // Every event keeps the counts of held pulls equal to the blocks' (checked while a
        // recount is cheap).
        #[cfg(test)]
        if self.held.total() <= 4_096
            && let Err(e) = self.recount()
        {
            panic!("{e}");
        }
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

    // ---- internals --------------------------------------------------------------------

    /// A new call for `what`, made at `now_us`: a call to another server (or a
    /// migration's record at the scheduler) fails at `now_us + STEP_TIMEOUT_US` if
    /// nothing answered it.
    fn call(&mut self, now_us: u64, what: Call) -> u64 {
        let id = self.next_call;
        self.next_call += 1;
        let deadline_us = match what {
            Call::Register => None,
            Call::Migration(_) | Call::Replicate { .. } | Call::ReplicaSync { .. } => Some(now_us + STEP_TIMEOUT_US),
        };
        if let Some(at) = deadline_us {
            self.call_deadlines.insert((at, id));
        }
        self.calls.insert(id, Pending { what, deadline_us });
        id
    }

    /// Call `call` is over (answered, failed, or no longer waited for): what it was for.
    fn end_call(&mut self, call: u64) -> Option<Call> {
        let p = self.calls.remove(&call)?;
        if let Some(at) = p.deadline_us {
            self.call_deadlines.remove(&(at, call));
        }
        Some(p.what)
    }

    /// The calls past their deadline at `now_us`, each failed as if its link had said so
    /// ([`Event::FromServer`] with an error naming the server and the step).
    fn calls_overdue(&mut self, now_us: u64, out: &mut Vec<Action>) {
        while let Some(&(at, call)) = self.call_deadlines.first()
            && at <= now_us
        {
            self.call_deadlines.pop_first();
            let Some(what) = self.calls.get(&call).map(|p| p.what) else { continue };
            let after = STEP_TIMEOUT_US / 1_000_000;
            match what {
                Call::Register => {}
                Call::Migration(block) => self.migration_overdue(now_us, block, call, after, out),
                Call::Replicate { block, backup } => {
                    let e =
                        format!("server {backup} did not answer a forwarded push of block {block} within {after} s");
                    self.step_answered(now_us, call, Err(e), out);
                }
                Call::ReplicaSync { block, backup } => {
                    let e = format!("server {backup} did not answer the state of block {block} within {after} s");
                    self.step_answered(now_us, call, Err(e), out);
                }
            }
        }
    }

    /// A frame from a data connection: refused if its sender may not send it, else to the
    /// handler of its family (a data request first: the data path).
    fn received(&mut self, now_us: u64, conn: ConnId, request_id: u64, msg: Message, out: &mut Vec<Action>) {
        let c = *self.conns.entry(conn).or_default();
        let reply = |msg| Action::Reply { conn, request_id, msg };
        if let Some(refused) = self.refused(now_us, conn, &c, &msg) {
            return out.push(reply(refused));
        }
        let rank = c.rank().unwrap_or(u32::MAX);
        let answer = match Request::of(msg) {
            Ok((block, reply, request)) => {
                self.serve(now_us, rank, Token { conn, request_id, block, reply }, request, out)
            }
            Err(Message::Control(Control::Hello { credential })) => {
                self.hello(now_us, conn, request_id, c, credential, out)
            }
            Err(Message::Control(Control::GetStats)) => {
                let sid = self.shard.as_ref().map_or(u32::MAX, |s| s.id);
                Some(Control::Stats(self.stats_as(sid)).into())
            }
            Err(Message::Control(control @ (Control::BlockSnapshot { .. } | Control::BlockDelta { .. }))) => {
                Some(self.on_migration(now_us, c.server().unwrap_or(u32::MAX), control, out))
            }
            Err(
                msg @ (Message::Forward { .. }
                | Message::Control(Control::Replicate { .. } | Control::ReplicaSnapshot(_))),
            ) => self.on_replica(now_us, (conn, request_id), msg, out),
            Err(Message::Control(
                control @ (Control::GetOptState { .. } | Control::SetOptState { .. } | Control::SetValues { .. }),
            )) => Some(self.on_tensor(rank, control)),
            Err(Message::Control(Control::ExportBlock { block, since, after })) => {
                Some(self.export_request(block, since, after))
            }
            // The table allows what this match does not take: refused, nothing changed.
            Err(other) => Some(not_taken(&other)),
        };
        if let Some(msg) = answer {
            out.push(reply(msg));
        }
    }

    fn scheduler_said(&mut self, now_us: u64, request_id: u64, msg: Message, out: &mut Vec<Action>) {
        if request_id != 0 {
            match self.end_call(request_id) {
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
        if let Message::Control(Control::SetOptimizer { tensor, optimizer }) = msg {
            // Answered even while shutting down: a worker waits for every server.
            return self.scheduler_set_optimizer(tensor, optimizer, out);
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
        self.calls_overdue(now_us, out);
        self.resync_due(now_us, out);
    }
}

/// The answer to a message a server does not take: refused, nothing changed.
fn not_taken(msg: &Message) -> Message {
    error(ErrorCode::BadRequest, format!("a server does not take {} messages", crate::authz::name_of(msg)))
}

#[cfg(test)]
mod tests;
