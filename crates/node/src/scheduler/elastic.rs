//! The scheduler's elasticity as a plain state machine: load reports in; migrations,
//! server starts and stops out. The decisions themselves (which blocks, when to scale)
//! are the core's ([`elasticps_core::balance::Balancer`]); this part executes them one
//! migration at a time, tracks server states (joining, serving, draining, removed) and
//! records the history for the report.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use elasticps_core::balance::{self, BalanceParams, Balancer, Decision, Move, View};
use elasticps_core::dtype::Dtype;
use elasticps_core::load::{LinkSample, LoadModel, link_rate};
use elasticps_core::placement::{Placement, ServerId};
use elasticps_wire::{
    ClusterStatus, Control, ErrorCode, Message, MigrationReport, ScaleRequest, ServerLoad, ServerStatus, WorkerLoad,
    WorkerStatus,
};

use super::history::{BalanceLog, DecisionRecord, LoadSample, MigrationEvent, ScaleEvent, ServerPoint, ServerRows};
use super::hosts::start_node;
use super::{Action, Caller, ConnId, Role, Scheduler};
use elasticps_core::balance::BalanceMode;

/// A migration that takes longer than this is written off (the old owner reports its
/// own failure after 30 s per step; this only guards against a lost report).
const MIGRATION_TIMEOUT_US: u64 = 300_000_000;
/// A requested server that has not registered after this long is not coming.
const JOIN_TIMEOUT_US: u64 = 60_000_000;
/// How often the scheduler samples the load timeline and the balancer decides, µs.
pub const BALANCE_EVERY_US: u64 = 1_000_000;
/// Rate estimates: old samples weigh half after this long.
const HALF_LIFE_US: u64 = 3_000_000;

/// Where a server is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ServerState {
    /// Registered, loading its (empty) assignment.
    Joining,
    /// Serves and may receive blocks.
    Serving,
    /// Gives its blocks away, then stops.
    Draining,
    /// Stopped.
    Removed,
}

impl ServerState {
    fn name(self) -> &'static str {
        match self {
            ServerState::Joining => "joining",
            ServerState::Serving => "serving",
            ServerState::Draining => "draining",
            ServerState::Removed => "gone",
        }
    }
}

/// What the scheduler must do for elasticity.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Order {
    /// Ask `from` to move `block` to `to`; the placement becomes `epoch`.
    Migrate { block: u32, from: ServerId, to: ServerId, epoch: u64 },
    /// Ask `owner` to split row block `block` at row `at`; the placement becomes `epoch`.
    Split { block: u32, at: u64, owner: ServerId, epoch: u64 },
    /// Start one more server through the launcher.
    StartServer,
    /// Tell this (drained) server to stop.
    Stop { server: ServerId, reason: String },
    /// Tell `to`, the new owner of `block`'s migration at `epoch`, who owns the block now
    /// (itself if the move was recorded, the old owner if it failed or was written off).
    Settle { block: u32, to: ServerId, epoch: u64, owner: ServerId },
    /// The wire dtypes of blocks changed ([`Elastic::wire`], rule 5c): the placement's
    /// epoch goes up and every worker gets the new layout.
    Wire,
}

/// A split asked of a row block's owner, until its `SplitDone`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Splitting {
    block: u32,
    at: u64,
    owner: ServerId,
    epoch: u64,
    started_us: u64,
}

/// Who asked for a server that has not registered yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Requester {
    Balancer,
    Operator,
}

/// A table is split into at most this many live blocks.
pub const MAX_TABLE_BLOCKS: usize = 64;

/// Migrations whose mean time tells the balancer how long the next will take.
pub const MIGRATION_SAMPLES: usize = 16;

/// Most samples one server report gives the load model (one per data frame).
pub const RX_SAMPLES: u32 = 8;

/// Iterations over which a row block's memory is amortized in its weight
/// ([`row_block_weight`]). 50 (the balancer's horizon) hid a hot block of a small table
/// (6 rows of 8 dims a push) behind its cold neighbours' 64 live rows, and psld no longer
/// split it (cli test `scheduler_restart`): memory counts once a range holds more than
/// about 1,000 pushes' worth of rows.
pub const ROW_MEMORY_HORIZON: u64 = 1000;

/// A row block's weight in the load model, bytes per iteration: what a worker pushes to
/// it per push ([`RowBlockLoad::push_bytes`](elasticps_wire::RowBlockLoad::push_bytes)),
/// plus its live rows' bytes over [`ROW_MEMORY_HORIZON`] iterations. Traffic decides
/// while the rows are few (a hot range is split and moved as before); a range whose live
/// rows grow past about 1,000 pushes' worth weighs its memory, so it is split and moved
/// before its server fills up. Not `max(push, memory)`: every range of a trained table
/// holds far more than one push, so its memory would hide the traffic the balancer
/// relieves (docs/BENCHMARKS.md, key-range tables).
pub fn row_block_weight(r: &elasticps_wire::RowBlockLoad) -> u64 {
    r.push_bytes().saturating_add(r.live_bytes() / ROW_MEMORY_HORIZON)
}

/// The elastic part of the scheduler's state.
pub(super) struct Elastic {
    mode: BalanceMode,
    balancer: Option<Balancer>,
    load: LoadModel,
    sizes: Vec<u64>,
    queue: VecDeque<Move>,
    /// The migration under way: the move, when it started, the epoch it leads to.
    in_flight: Option<(Move, u64, u64)>,
    /// The split under way (one at a time, and never beside a migration).
    splitting: Option<Splitting>,
    /// The row to split each row block at, as its server last reported it.
    split_hints: BTreeMap<u32, u64>,
    states: BTreeMap<ServerId, ServerState>,
    /// Servers asked of the launcher that have not registered yet, with when.
    requested: VecDeque<(Requester, u64)>,
    joining_by: BTreeMap<ServerId, Requester>,
    server_loads: BTreeMap<ServerId, ServerLoad>,
    /// Each server's row blocks, from its load reports (the job report's).
    server_rows: BTreeMap<ServerId, ServerRows>,
    /// The load model is fed by the servers' own rates ([`Elastic::server_load`]).
    rates_from_servers: bool,
    workers: BTreeMap<u32, WorkerStatus>,
    /// Iterations and their summed time reported since the last timeline sample.
    window: (u64, u64),
    /// The mean time of the iterations of the last interval (`None`: none completed).
    iter_us: Option<f64>,
    /// The iterations completed in the last interval.
    iterations: u64,
    /// Per server whose data frames are small (`load::LinkSample::small_frames`), the
    /// handling time of one request it last reported (busy time over
    /// requests): the job's fixed cost per request is the least of them.
    request_us: BTreeMap<ServerId, f64>,
    last_sample_us: u64,
    migrations: u32,
    log: BalanceLog,
    max_servers: u32,
    /// Fewest servers serving (`--min-servers`): an operator's `RemoveServer` never goes
    /// below it, as the balancer's scale-in does not.
    min_servers: u32,
    /// Workers the job runs (its configuration): the divisor of a server's link rate
    /// until some finish.
    job_workers: u32,
    /// The wire dtype of each block, by block id (f32 past the end), as the balancer's
    /// rule 5c set it (`--balance-compress`).
    wire: Vec<Dtype>,
    /// Per server, the share of its last measured time its handling took (busy time over
    /// the longer of that and its frames' time on the link): what compressing its bytes
    /// cannot shorten (rule 5c).
    fixed_share: BTreeMap<ServerId, f64>,
}

impl std::fmt::Debug for Elastic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Elastic")
            .field("mode", &self.mode)
            .field("states", &self.states)
            .field("queue", &self.queue.len())
            .field("in_flight", &self.in_flight)
            .finish_non_exhaustive()
    }
}

impl Elastic {
    /// The balancer moves at most `bytes` per round (the sim shrinks the model, and this
    /// budget with it).
    pub fn set_balance_budget(&mut self, bytes: u64) {
        if let Some(b) = &self.balancer {
            self.balancer = Some(Balancer::new(BalanceParams { budget_bytes: bytes, ..*b.params() }));
        }
    }

    /// The job may run between `min` and `max` servers (a job across hosts learns its size
    /// when its hosts joined, before any server registered).
    pub fn set_bounds(&mut self, min_servers: u32, max_servers: u32) {
        self.max_servers = max_servers;
        self.min_servers = min_servers;
        if let Some(b) = &self.balancer {
            self.balancer = Some(Balancer::new(BalanceParams { min_servers, max_servers, ..*b.params() }));
        }
    }

    /// Elasticity for a job of `job_workers` workers that may run between `min` and `max`
    /// servers.
    pub fn new(mode: BalanceMode, min_servers: u32, max_servers: u32, job_workers: u32) -> Self {
        let balancer = match mode {
            BalanceMode::Psld => Some(Balancer::new(BalanceParams::new(min_servers, max_servers))),
            BalanceMode::Static => None,
        };
        Self {
            mode,
            balancer,
            load: LoadModel::new(HALF_LIFE_US),
            sizes: Vec::new(),
            queue: VecDeque::new(),
            in_flight: None,
            splitting: None,
            split_hints: BTreeMap::new(),
            states: BTreeMap::new(),
            requested: VecDeque::new(),
            joining_by: BTreeMap::new(),
            server_loads: BTreeMap::new(),
            server_rows: BTreeMap::new(),
            workers: BTreeMap::new(),
            rates_from_servers: false,
            window: (0, 0),
            iter_us: None,
            iterations: 0,
            request_us: BTreeMap::new(),
            last_sample_us: 0,
            migrations: 0,
            log: BalanceLog { mode: mode.to_string(), ..Default::default() },
            max_servers,
            min_servers,
            job_workers,
            wire: Vec::new(),
            fixed_share: BTreeMap::new(),
        }
    }

    /// The balancer may send a bandwidth-bound straggler's blocks in `dtype` instead of
    /// moving them (`--balance-compress`; rule 5c); `None`: never.
    pub fn set_compress(&mut self, dtype: Option<Dtype>) {
        if let Some(b) = &self.balancer {
            self.balancer = Some(Balancer::new(BalanceParams { compress: dtype, ..*b.params() }));
        }
    }

    /// The wire dtype of each block the balancer narrowed, by block id (f32 past the end;
    /// empty while every block travels as its tensor chooses).
    pub fn wire(&self) -> &[Dtype] {
        let narrowed = self.wire.iter().rposition(|d| *d != Dtype::F32).map_or(0, |i| i + 1);
        &self.wire[..narrowed]
    }

    /// When the scheduler's clock started, in ms since the Unix epoch.
    pub fn set_clock_origin(&mut self, unix_ms: f64) {
        self.log.started_unix_ms = unix_ms;
    }

    /// The model is placed: block sizes in bytes, indexed by block id (a row block's
    /// nominal size, every row of its range, until its server reports its traffic:
    /// [`Elastic::server_load`]).
    pub fn model_placed(&mut self, sizes: Vec<u64>) {
        self.sizes = sizes;
    }

    /// Servers that may hold blocks or backup copies (serving), in id order.
    pub(super) fn serving(&self) -> Vec<ServerId> {
        self.states.iter().filter(|(_, s)| **s == ServerState::Serving).map(|(id, _)| *id).collect()
    }

    /// Servers that count against `max_servers`: all but removed, plus requested ones.
    pub fn active(&self) -> u32 {
        self.states.values().filter(|s| **s != ServerState::Removed).count() as u32 + self.requested.len() as u32
    }

    /// Servers registered and not removed.
    pub fn registered_count(&self) -> u32 {
        self.states.values().filter(|s| **s != ServerState::Removed).count() as u32
    }

    /// A server registered; `initial` for the job's first servers.
    pub fn registered(&mut self, id: ServerId, initial: bool, now_us: u64) {
        self.states.insert(id, if initial { ServerState::Serving } else { ServerState::Joining });
        if !initial {
            let by = self.requested.pop_front().map_or(Requester::Operator, |(r, _)| r);
            self.joining_by.insert(id, by);
            self.event(now_us, "joined", Some(id), "a new server registered".into());
        }
    }

    /// A joining server holds its (empty) assignment and serves.
    pub fn serving_now(&mut self, id: ServerId, placement: &Placement, now_us: u64) -> Vec<Order> {
        if self.states.get(&id) != Some(&ServerState::Joining) {
            return Vec::new();
        }
        self.states.insert(id, ServerState::Serving);
        match (self.joining_by.remove(&id), self.balancer.as_mut()) {
            (Some(Requester::Balancer), Some(b)) => b.joined(id, now_us),
            _ => {
                // An operator's server: give it about the average load now.
                let rates = self.load.rates(now_us);
                let moves = balance::fill(placement, &self.sizes, id, &self.serving(), &rates);
                self.queue.extend(moves);
            }
        }
        self.next_migration(placement, now_us)
    }

    /// A server's connection is gone. Returns true if the job can go on: it was stopped,
    /// or it was still joining (owning nothing: a failed scale-out).
    pub fn lost(&mut self, id: ServerId, now_us: u64) -> bool {
        self.load.remove(id);
        self.fixed_share.remove(&id);
        self.request_us.remove(&id);
        match self.states.get(&id) {
            Some(ServerState::Removed) => true,
            Some(ServerState::Joining) => {
                self.states.insert(id, ServerState::Removed);
                self.joining_by.remove(&id);
                self.event(now_us, "scale-out-failed", Some(id), "the new server left before it served".into());
                true
            }
            _ => false,
        }
    }

    /// Server `id` was lost with its blocks failed over (`promoted` of them) in
    /// `placement`: it is gone, no move involves it any more, and a migration from it
    /// under way is settled with the promoted owner (its new owner drops the copy).
    pub fn failed(
        &mut self,
        id: ServerId,
        detection: &str,
        promoted: usize,
        placement: &Placement,
        now_us: u64,
    ) -> Vec<Order> {
        self.load.remove(id);
        self.fixed_share.remove(&id);
        self.request_us.remove(&id);
        self.states.insert(id, ServerState::Removed);
        self.joining_by.remove(&id);
        self.queue.retain(|m| m.from != id && m.to != id);
        self.event(now_us, "server-lost", Some(id), detection.to_string());
        let mut orders = Vec::new();
        if let Some((m, _, epoch)) = self.in_flight
            && m.from == id
            && let Some(owner) = placement.owner(m.block)
        {
            self.in_flight = None;
            self.log_migration_error(now_us, m, "the old owner was lost");
            orders.push(Order::Settle { block: m.block, to: m.to, epoch, owner });
        }
        let why = format!("{promoted} blocks promoted to their first backup; placement epoch {}", placement.epoch);
        self.event(now_us, "failover", Some(id), why);
        orders.extend(self.next_migration(placement, now_us));
        orders
    }

    /// A migration that ended without a report from its old owner, in the history.
    fn log_migration_error(&mut self, now_us: u64, m: Move, why: &str) {
        self.log.migrations.push(MigrationEvent {
            at_s: now_us as f64 / 1e6,
            block: m.block,
            from: m.from,
            to: m.to,
            bytes: 0,
            freeze_ms: 0.0,
            total_ms: 0.0,
            held: 0,
            error: Some(why.into()),
        });
    }

    /// The server `block` is migrating to, if its migration is under way.
    pub fn migrating_to(&self, block: u32) -> Option<ServerId> {
        self.in_flight.filter(|(m, _, _)| m.block == block).map(|(m, _, _)| m.to)
    }

    /// A server's load report. A server that measured its link's rate (`rx_bps`, from the
    /// time its data frames took to arrive) gives the load model its samples: the rate
    /// each worker gets from it, `rx_bps` over the live workers, counted as one sample per
    /// frame up to [`RX_SAMPLES`]. From the first such report on, the model is fed by
    /// the servers alone (it starts afresh then): a worker's own view of a server includes
    /// its queue behind its other pushes and, in the fused round, the barrier's hold, which
    /// make a server with a small block look slow and a capped one with a large block fast.
    /// The live workers are the job's workers less those that finished, not those that have
    /// reported so far (the first reports, from one worker, would make every rate W times
    /// too high and the model's spread grow until it trusted nothing).
    ///
    /// A row block's weight in the model (its entry in the sizes the balancer plans with)
    /// becomes [`row_block_weight`]: what a worker pushed to it per push over the interval,
    /// plus the memory of its live rows amortized over the balancer's horizon, as its
    /// server reports them: a hot row range weighs what its traffic costs, a cold one
    /// little, whatever their ranges, and a range whose rows keep growing comes to weigh
    /// its memory.
    pub fn server_load(&mut self, load: ServerLoad, now_us: u64) {
        for r in load.row_blocks.iter().filter(|r| r.pushes > 0) {
            if let Some(size) = self.sizes.get_mut(r.block as usize) {
                *size = row_block_weight(r);
            }
            if r.split_at > 0 {
                self.split_hints.insert(r.block, r.split_at);
            }
        }
        let mean_block = self.sizes.iter().sum::<u64>() as f64 / self.sizes.len().max(1) as f64;
        let sample = LinkSample { bytes: load.bytes_in, frames: load.rx_frames, bps: load.rx_bps };
        // The rate is over the longer of the frames' time and the handling time: the share
        // of it the handling took is what no narrower dtype shortens (rule 5c).
        if load.rx_frames > 0 && load.rx_bps > 0.0 && load.bytes_in > 0 {
            let seconds = load.bytes_in as f64 / load.rx_bps;
            let share = (load.busy_us as f64 / 1e6 / seconds).clamp(0.0, 1.0);
            self.fixed_share.insert(load.server_id, share);
        }
        if sample.small_frames(mean_block) && load.requests > 0 {
            // Where frames are small, handling a request is all fixed cost.
            self.request_us.insert(load.server_id, load.busy_us as f64 / load.requests as f64);
        }
        if load.rx_frames > 0 && load.rx_bps > 0.0 && self.states.contains_key(&load.server_id) {
            if !self.rates_from_servers {
                self.rates_from_servers = true;
                self.load = LoadModel::new(self.load.half_life_us());
            }
            let done = self.workers.values().filter(|w| w.done).count() as u32;
            let live = self.workers.len().max(self.job_workers as usize) as u32;
            let workers = live.saturating_sub(done).max(1);
            // The fixed cost of a request: the least handling time per request of the
            // servers with small frames (0 while there is none: then it is negligible
            // beside the frames that matter).
            let fixed_s = self.request_us.values().copied().fold(f64::INFINITY, f64::min) / 1e6;
            let fixed_s = if fixed_s.is_finite() { fixed_s } else { 0.0 };
            let rate = link_rate(sample, fixed_s, mean_block);
            tracing::debug!(
                server = load.server_id,
                rx_bps = load.rx_bps,
                frames = load.rx_frames,
                workers,
                fixed_s,
                rate,
                "link rate"
            );
            // A sample too small to measure the link leaves the server's rate as it was.
            if let Some(rate) = rate {
                for _ in 0..load.rx_frames.min(RX_SAMPLES) {
                    self.load.observe_rate(load.server_id, rate / workers as f64, now_us);
                }
            }
        }
        if !load.row_blocks.is_empty() {
            let rows = self.server_rows.entry(load.server_id).or_default();
            *rows = rows.reported(&load.row_blocks);
        }
        self.server_loads.insert(load.server_id, load);
    }

    /// A worker's load report.
    pub fn worker_load(&mut self, w: WorkerLoad, now_us: u64) {
        let samples = if self.rates_from_servers { &[][..] } else { &w.per_server[..] };
        for s in samples.iter().filter(|s| self.states.contains_key(&s.server)) {
            self.load.observe(s.server, s.push_bytes, s.push_us, now_us);
        }
        self.window.0 = self.window.0.saturating_add(u64::from(w.iterations));
        self.window.1 = self.window.1.saturating_add(w.iter_us);
        let iter_ms = if w.iterations > 0 { w.iter_us as f64 / f64::from(w.iterations) / 1e3 } else { f64::NAN };
        let entry = self.workers.entry(w.rank).or_insert(WorkerStatus { rank: w.rank, clock: 0, iter_ms, done: false });
        entry.clock = w.clock;
        if iter_ms.is_finite() {
            entry.iter_ms = iter_ms;
        }
    }

    /// A worker finished or died.
    pub fn worker_left(&mut self, rank: u32) {
        self.workers.entry(rank).or_insert(WorkerStatus { rank, clock: 0, iter_ms: f64::NAN, done: true }).done = true;
    }

    /// A lost worker was restarted and is back in the job.
    pub fn worker_rejoined(&mut self, rank: u32) {
        if let Some(w) = self.workers.get_mut(&rank) {
            w.done = false;
        }
    }

    /// The old owner reports the end of a migration; on success the placement changes.
    /// Returns false if the report does not match the migration in flight.
    pub fn migrated(&mut self, r: &MigrationReport, placement: &mut Placement, now_us: u64) -> (bool, Vec<Order>) {
        let expected = match self.in_flight {
            Some((m, _, epoch)) if m.block == r.block && m.from == r.from && m.to == r.to && epoch == r.epoch => {
                Some(epoch)
            }
            _ => None,
        };
        let Some(epoch) = expected else { return (false, Vec::new()) };
        self.in_flight = None;
        if r.error.is_none() && self.states.get(&r.to) == Some(&ServerState::Removed) {
            // The new owner was lost after it took the block: the old owner keeps it.
            let m = Move { block: r.block, from: r.from, to: r.to };
            self.log_migration_error(now_us, m, "the new owner was lost");
            return (false, self.next_migration(placement, now_us));
        }
        let owner = if r.error.is_none() { r.to } else { r.from };
        let settle = Order::Settle { block: r.block, to: r.to, epoch, owner };
        if r.error.is_none() {
            // A move onto one of the block's backups (it stayed one while the block moved,
            // so that a copy survives the old owner's loss): it is the owner now, and
            // another server backs the block up instead.
            if let Some(backups) = placement.backups.get_mut(r.block as usize) {
                backups.retain(|s| *s != r.to);
            }
            if let Err(e) = placement.apply(r.block, r.to, epoch) {
                tracing::warn!(block = r.block, to = r.to, epoch, error = %e, "migration of an unknown block");
            }
            self.migrations += 1;
            self.log.settled_s = Some(now_us as f64 / 1e6);
        }
        self.log.migrations.push(MigrationEvent {
            at_s: now_us as f64 / 1e6,
            block: r.block,
            from: r.from,
            to: r.to,
            bytes: r.bytes,
            freeze_ms: r.freeze_us as f64 / 1e3,
            total_ms: r.total_us as f64 / 1e3,
            held: r.held,
            error: r.error.clone(),
        });
        let mut orders = vec![settle];
        orders.extend(self.next_migration(placement, now_us));
        (true, orders)
    }

    /// `server`'s `SplitDone` for the split at `epoch` of `block` at `at`: true if it is the
    /// split under way and it was done (the caller records it: [`Elastic::split_recorded`]).
    pub fn split_done(
        &mut self,
        server: ServerId,
        (block, at, epoch): (u32, u64, u64),
        error: Option<&str>,
        now_us: u64,
    ) -> bool {
        let ours = self.splitting.is_some_and(|s| (s.block, s.at, s.owner, s.epoch) == (block, at, server, epoch));
        if !ours {
            tracing::warn!(server, block, at, epoch, "a SplitDone of no split under way");
            return false;
        }
        self.splitting = None;
        match error {
            Some(e) => {
                self.event(now_us, "split-refused", Some(server), format!("block {block} at row {at}: {e}"));
                false
            }
            None => true,
        }
    }

    /// Row block `block` is now `halves` (split on its owner, recorded in the placement):
    /// each half weighs half of it until its server reports its traffic.
    pub fn split_recorded(&mut self, block: u32, at: u64, halves: [u32; 2], now_us: u64) {
        self.split_hints.remove(&block);
        let size = self.sizes.get(block as usize).copied().unwrap_or(0);
        let len = self.sizes.len().max(halves[1] as usize + 1);
        self.sizes.resize(len, 0);
        for h in halves {
            self.sizes[h as usize] = size.div_ceil(2);
        }
        if let Some(s) = self.sizes.get_mut(block as usize) {
            *s = 0;
        }
        let why = format!("row block {block} split at row {at} into blocks {} and {}", halves[0], halves[1]);
        self.event(now_us, "split", None, why);
    }

    /// The row to split each row block at, as its server last reported it.
    pub fn split_hints(&self) -> &BTreeMap<u32, u64> {
        &self.split_hints
    }

    /// An operator's scaling request. `can_launch`: the scheduler has a launcher.
    pub fn scale(
        &mut self,
        req: ScaleRequest,
        placement: &Placement,
        can_launch: bool,
        now_us: u64,
    ) -> Result<Vec<Order>, String> {
        match req {
            ScaleRequest::AddServer => {
                if !can_launch {
                    return Err("this scheduler has no launcher: start a server by hand with \
                                `elasticps server --scheduler ADDR`; it joins and receives blocks"
                        .into());
                }
                if self.active() >= self.max_servers {
                    return Err(format!(
                        "the job already runs {} servers (--max-servers {})",
                        self.active(),
                        self.max_servers
                    ));
                }
                self.requested.push_back((Requester::Operator, now_us));
                self.event(now_us, "scale-out", None, "operator: add-server".into());
                Ok(vec![Order::StartServer])
            }
            ScaleRequest::RemoveServer(id) => {
                match self.states.get(&id) {
                    Some(ServerState::Serving) => {}
                    Some(s) => return Err(format!("server {id} is {}, not serving", s.name())),
                    None => return Err(format!("there is no server {id}")),
                }
                let serving = self.serving().len() as u32;
                if serving <= 1 {
                    return Err(format!("server {id} is the last one serving: it cannot be removed"));
                }
                if serving <= self.min_servers {
                    return Err(format!(
                        "the job runs {serving} servers and may not go below {} (--min-servers {}): \
                         start it with a lower --min-servers to remove one",
                        self.min_servers, self.min_servers
                    ));
                }
                Ok(self.drain(id, placement, now_us, "operator: remove-server".into()))
            }
            ScaleRequest::MoveBlock { block, to } => {
                let from = placement.owner(block).ok_or_else(|| {
                    format!("block {block} does not exist: the model has {} blocks", placement.owners.len())
                })?;
                if self.states.get(&to) != Some(&ServerState::Serving) {
                    return Err(format!("server {to} is not serving"));
                }
                // Chained moves of one block are planned from where it will be by then.
                let mut planned = self.in_flight.iter().map(|(m, _, _)| m).chain(self.queue.iter());
                let from = planned.rfind(|m| m.block == block).map_or(from, |m| m.to);
                if from == to {
                    return Err(format!("block {block} is already on server {to}"));
                }
                self.queue.push_back(Move { block, from, to });
                Ok(self.next_migration(placement, now_us))
            }
        }
    }

    /// Starts draining `id`: its blocks go to the others, then it stops.
    fn drain(&mut self, id: ServerId, placement: &Placement, now_us: u64, why: String) -> Vec<Order> {
        self.states.insert(id, ServerState::Draining);
        self.event(now_us, "scale-in", Some(id), why);
        let rates = self.load.rates(now_us);
        let moves = balance::drain(placement, &self.sizes, id, &self.serving(), &rates);
        self.queue.retain(|m| m.to != id);
        self.queue.extend(moves);
        self.next_migration(placement, now_us)
    }

    /// The next time [`Elastic::on_timeout`] has something to do, µs: the balancer's next
    /// round, or the timeout of the migration in flight or of a requested server.
    pub fn next_deadline_us(&self) -> u64 {
        let round = self.last_sample_us.saturating_add(BALANCE_EVERY_US);
        let migration = self.in_flight.map(|(_, started, _)| started.saturating_add(MIGRATION_TIMEOUT_US) + 1);
        let split = self.splitting.map(|s| s.started_us.saturating_add(MIGRATION_TIMEOUT_US) + 1);
        let join = self.requested.front().map(|(_, at)| at.saturating_add(JOIN_TIMEOUT_US) + 1);
        [migration, split, join].into_iter().flatten().fold(round, u64::min)
    }

    /// Time passed (a deadline of [`Elastic::next_deadline_us`], or later): write off a
    /// lost migration or server; every [`BALANCE_EVERY_US`] sample the timeline and let
    /// the balancer decide; move on.
    pub fn on_timeout(&mut self, placement: &Placement, splittable: &BTreeMap<u32, u64>, now_us: u64) -> Vec<Order> {
        let mut out = Vec::new();
        if let Some(sp) = self.splitting
            && now_us.saturating_sub(sp.started_us) > MIGRATION_TIMEOUT_US
        {
            tracing::warn!(block = sp.block, owner = sp.owner, "split never reported; written off");
            self.splitting = None;
        }
        if let Some((m, started, epoch)) = self.in_flight
            && now_us.saturating_sub(started) > MIGRATION_TIMEOUT_US
        {
            tracing::warn!(block = m.block, from = m.from, to = m.to, "migration never reported; written off");
            self.in_flight = None;
            out.push(Order::Settle { block: m.block, to: m.to, epoch, owner: m.from });
        }
        while let Some(&(_, at)) = self.requested.front()
            && now_us.saturating_sub(at) > JOIN_TIMEOUT_US
        {
            // The launcher failed or the server died before registering; the balancer
            // gives up on its own (its join timeout) and decides afresh.
            self.requested.pop_front();
            self.event(now_us, "scale-out-failed", None, "no server registered within 60 s".into());
        }
        if now_us.saturating_sub(self.last_sample_us) >= BALANCE_EVERY_US {
            self.last_sample_us = now_us;
            // An interval in which no iteration completed has no iteration time: the
            // balancer counts it as a stall (`balance::Window`), never as the last one.
            self.iterations = self.window.0;
            self.iter_us = (self.window.0 > 0).then(|| self.window.1 as f64 / self.window.0 as f64);
            self.window = (0, 0);
            let sample = LoadSample {
                t_s: now_us as f64 / 1e6,
                iter_ms: self.iter_us.map(|u| u / 1e3),
                servers: self.points(placement, now_us),
            };
            self.log.timeline.push(sample);
            out.extend(self.decide(placement, splittable, now_us));
        }
        out.extend(self.next_migration(placement, now_us));
        out
    }

    /// The balancer's decisions, turned into orders. `splittable`: the row blocks that
    /// may be split, each with the row to split it at.
    fn decide(&mut self, placement: &Placement, splittable: &BTreeMap<u32, u64>, now_us: u64) -> Vec<Order> {
        let serving = self.serving();
        let busy = self.in_flight.is_some()
            || self.splitting.is_some()
            || !self.queue.is_empty()
            || self.requested.iter().any(|(r, _)| *r == Requester::Operator)
            || self.states.values().any(|s| matches!(s, ServerState::Joining | ServerState::Draining));
        let migration_us = self.migration_us();
        let Some(balancer) = self.balancer.as_mut() else { return Vec::new() };
        if self.sizes.is_empty() {
            return Vec::new();
        }
        let view = View {
            now_us,
            placement,
            sizes: &self.sizes,
            servers: &serving,
            load: &self.load,
            iter_us: self.iter_us,
            iterations: self.iterations,
            busy,
            migration_us,
            splittable,
            wire: &self.wire,
            fixed_share: &self.fixed_share,
        };
        let decisions = balancer.step(&view);
        let mut out = Vec::new();
        for d in decisions {
            match d {
                Decision::Migrate { moves, why } => {
                    tracing::info!(moves = moves.len(), %why, "balancer moves blocks");
                    self.queue.extend(moves);
                }
                Decision::ScaleOut { why } => {
                    tracing::info!(%why, "balancer scales out");
                    self.requested.push_back((Requester::Balancer, now_us));
                    self.event(now_us, "scale-out", None, why);
                    out.push(Order::StartServer);
                }
                Decision::ScaleIn { server, why } => {
                    tracing::info!(server, %why, "balancer scales in");
                    out.extend(self.drain(server, placement, now_us, why));
                }
                Decision::Judged(v) => {
                    tracing::info!(kept = v.kept, what = %v.what, predicted = v.predicted_gain, measured = v.measured_gain, "balancer verdict");
                    self.log.decisions.push(DecisionRecord::of(&v));
                }
                Decision::Keep { server, why } => {
                    tracing::info!(server, %why, "balancer keeps the new server");
                    self.event(now_us, "kept", Some(server), why);
                }
                Decision::Wire { blocks, dtype, why } => {
                    tracing::info!(blocks = blocks.len(), dtype = dtype.name(), %why, "balancer sets the wire dtype of blocks");
                    if let Some(&last) = blocks.iter().max() {
                        let len = self.wire.len().max(last as usize + 1);
                        self.wire.resize(len, Dtype::F32);
                    }
                    for &b in &blocks {
                        self.wire[b as usize] = dtype;
                    }
                    let server = blocks.first().and_then(|&b| placement.owner(b));
                    let action = if dtype == Dtype::F32 { "decompress" } else { "compress" };
                    self.event(now_us, action, server, why);
                    out.push(Order::Wire);
                }
                Decision::Split { block, at, why } => {
                    let Some(owner) = placement.owner(block) else { continue };
                    tracing::info!(block, at, owner, %why, "balancer splits a row block");
                    let epoch = placement.epoch.saturating_add(1);
                    self.splitting = Some(Splitting { block, at, owner, epoch, started_us: now_us });
                    out.push(Order::Split { block, at, owner, epoch });
                }
            }
        }
        out
    }

    /// How long the last [`MIGRATION_SAMPLES`] migrations that succeeded took, on average,
    /// µs (`None` before any).
    fn migration_us(&self) -> Option<f64> {
        let last: Vec<f64> = self
            .log
            .migrations
            .iter()
            .rev()
            .filter(|m| m.error.is_none())
            .take(MIGRATION_SAMPLES)
            .map(|m| m.total_ms * 1e3)
            .collect();
        (!last.is_empty()).then(|| last.iter().sum::<f64>() / last.len() as f64)
    }

    /// Starts the next queued migration if none is in flight; stops drained servers.
    fn next_migration(&mut self, placement: &Placement, now_us: u64) -> Vec<Order> {
        let mut out = Vec::new();
        if self.in_flight.is_none() && self.queue.is_empty() {
            // A draining server that still owns blocks (a block arrived after its drain was
            // planned, or a move failed): plan the rest.
            let rates = self.load.rates(now_us);
            let serving = self.serving();
            for (id, _) in self.states.iter().filter(|(_, s)| **s == ServerState::Draining) {
                self.queue.extend(balance::drain(placement, &self.sizes, *id, &serving, &rates));
            }
        }
        if self.in_flight.is_none() && self.splitting.is_none() {
            while let Some(m) = self.queue.pop_front() {
                let valid = placement.owner(m.block) == Some(m.from)
                    && m.from != m.to
                    && self.states.get(&m.to) == Some(&ServerState::Serving);
                if valid {
                    let epoch = placement.epoch.saturating_add(1);
                    self.in_flight = Some((m, now_us, epoch));
                    out.push(Order::Migrate { block: m.block, from: m.from, to: m.to, epoch });
                    break;
                }
            }
        }
        let drained: Vec<ServerId> = self
            .states
            .iter()
            .filter(|(id, s)| {
                **s == ServerState::Draining
                    && placement.blocks_of(**id).next().is_none()
                    && !matches!(self.in_flight, Some((m, _, _)) if m.from == **id || m.to == **id)
            })
            .map(|(id, _)| *id)
            .collect();
        for id in drained {
            self.states.insert(id, ServerState::Removed);
            self.event(now_us, "removed", Some(id), "drained: it owns no blocks".into());
            out.push(Order::Stop { server: id, reason: "drained: scaled in".into() });
        }
        out
    }

    fn points(&self, placement: &Placement, now_us: u64) -> Vec<ServerPoint> {
        let rates = self.load.rates(now_us);
        let serving = self.serving();
        let times = balance::service_times(placement, &self.sizes, &serving, &rates);
        let stragglers = balance::stragglers(&times, BalanceParams::new(1, 1).threshold);
        self.states
            .iter()
            .filter(|(_, s)| **s != ServerState::Removed)
            .map(|(id, _)| {
                let (blocks, bytes) = self.owned(placement, *id);
                let load = self.server_loads.get(id);
                let per_s = |x: u64| load.map_or(0.0, |l| x as f64 / (l.interval_us.max(1) as f64 / 1e6));
                ServerPoint {
                    id: *id,
                    blocks,
                    bytes,
                    rate_bps: rates.get(id).copied().unwrap_or(0.0),
                    confidence: self.load.estimate(*id, now_us).map_or(0.0, |e| e.confidence),
                    in_mbps: load.map_or(0.0, |l| per_s(l.bytes_in) / 1e6),
                    out_mbps: load.map_or(0.0, |l| per_s(l.bytes_out) / 1e6),
                    queued_ms_per_s: load.map_or(0.0, |l| per_s(l.shaped_us) / 1e3),
                    // Without any rate the model's times are relative: not worth plotting.
                    service_ms: if rates.is_empty() { 0.0 } else { times.get(id).map_or(0.0, |t| t * 1e3) },
                    straggler: !rates.is_empty() && stragglers.contains(id),
                    rows: self.server_rows.get(id).copied(),
                }
            })
            .collect()
    }

    fn owned(&self, placement: &Placement, id: ServerId) -> (u32, u64) {
        placement
            .blocks_of(id)
            .fold((0, 0), |(n, b), blk| (n + 1, b + self.sizes.get(blk as usize).copied().unwrap_or(0)))
    }

    /// The serving server with the lowest estimated rate (the straggler a scale-out
    /// relieves), if any is measured.
    pub fn slowest(&self, now_us: u64) -> Option<ServerId> {
        let serving = self.serving();
        self.load
            .rates(now_us)
            .into_iter()
            .filter(|(s, _)| serving.contains(s))
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(s, _)| s)
    }

    pub(super) fn event(&mut self, now_us: u64, action: &str, server: Option<ServerId>, reason: String) {
        tracing::info!(action, server, %reason, "scaling event");
        self.log.scaling.push(ScaleEvent { at_s: now_us as f64 / 1e6, action: action.into(), server, reason });
        self.log.settled_s = Some(now_us as f64 / 1e6);
    }

    /// The cluster as `elasticps status` shows it.
    pub fn status(&self, placement: Option<&Placement>, addrs: &[(ServerId, String)], now_us: u64) -> ClusterStatus {
        let points: BTreeMap<ServerId, ServerPoint> =
            placement.map(|p| self.points(p, now_us)).unwrap_or_default().into_iter().map(|p| (p.id, p)).collect();
        let servers = addrs
            .iter()
            .map(|(id, addr)| {
                let p = points.get(id);
                ServerStatus {
                    id: *id,
                    addr: addr.clone(),
                    state: self.states.get(id).map_or("registered", |s| s.name()).into(),
                    blocks: p.map_or(0, |p| p.blocks),
                    bytes: p.map_or(0, |p| p.bytes),
                    rate_bps: p.map_or(0.0, |p| p.rate_bps),
                    confidence: self.load.estimate(*id, now_us).map_or(0.0, |e| e.confidence),
                    service_ms: p.map_or(0.0, |p| p.service_ms),
                    straggler: p.is_some_and(|p| p.straggler),
                }
            })
            .collect();
        ClusterStatus {
            balance: self.mode.to_string(),
            epoch: placement.map_or(0, |p| p.epoch),
            migrations: self.migrations,
            servers,
            workers: self.workers.values().cloned().collect(),
        }
    }

    /// The history so far, for the report.
    pub fn log(&self) -> &BalanceLog {
        &self.log
    }

    /// Server ids that are stopped (not in the layout any more).
    pub fn removed(&self) -> BTreeSet<ServerId> {
        self.states.iter().filter(|(_, s)| **s == ServerState::Removed).map(|(id, _)| *id).collect()
    }
}

/// A migration as saved: (block, from, to, epoch).
pub(super) type SavedMove = (u32, ServerId, ServerId, u64);

/// A split as saved: (block, at, owner, epoch).
pub(super) type SavedSplit = (u32, u64, ServerId, u64);

/// What of the elastic state survives a scheduler restart: server states, the migration in
/// flight, the migration count, the history.
pub(super) type SavedElastic = (Vec<(ServerId, String)>, Option<SavedMove>, u32, BalanceLog);

/// What of the elastic state survives a scheduler restart ([`super::recovery`]): server
/// states, the history, the migration under way. The load model, the balancer's window
/// and pending scale-outs start afresh.
impl Elastic {
    /// The saved part: (server id, state name), the migration in flight (block, from, to,
    /// epoch), the migration count, the history (its load timeline left out).
    pub(super) fn saved(&self) -> SavedElastic {
        let states = self.states.iter().map(|(id, s)| (*id, s.name().to_string())).collect();
        let in_flight = self.in_flight.map(|(m, _, epoch)| (m.block, m.from, m.to, epoch));
        let log = BalanceLog { timeline: Vec::new(), ..self.log.clone() };
        (states, in_flight, self.migrations, log)
    }

    /// Restores [`Elastic::saved`] at `now_us` (the migration in flight restarts its timeout).
    pub(super) fn restore(
        &mut self,
        states: &[(ServerId, String)],
        in_flight: Option<SavedMove>,
        migrations: u32,
        log: BalanceLog,
        now_us: u64,
    ) {
        for (id, name) in states {
            let state = match name.as_str() {
                "joining" => ServerState::Joining,
                "draining" => ServerState::Draining,
                "gone" => ServerState::Removed,
                _ => ServerState::Serving,
            };
            self.states.insert(*id, state);
        }
        self.in_flight = in_flight.map(|(block, from, to, epoch)| (Move { block, from, to }, now_us, epoch));
        self.migrations = migrations;
        let started = self.log.started_unix_ms;
        self.log = BalanceLog {
            started_unix_ms: if log.started_unix_ms > 0.0 { log.started_unix_ms } else { started },
            ..log
        };
    }

    /// The migration in flight, if any: (block, from, to, epoch).
    /// The split asked of an owner and not reported yet: (block, at, owner, epoch).
    pub(super) fn split_in_flight(&self) -> Option<SavedSplit> {
        self.splitting.map(|s| (s.block, s.at, s.owner, s.epoch))
    }

    pub(super) fn in_flight(&self) -> Option<SavedMove> {
        self.in_flight.map(|(m, _, epoch)| (m.block, m.from, m.to, epoch))
    }

    /// Records a migration the servers finished while the scheduler was down (the new
    /// owner holds the block): the same as its `MigrateDone`.
    pub(super) fn recovered_migration(&mut self, placement: &mut Placement, now_us: u64) -> Vec<Order> {
        let Some((m, _, epoch)) = self.in_flight else { return Vec::new() };
        let report = MigrationReport {
            block: m.block,
            from: m.from,
            to: m.to,
            epoch,
            bytes: 0,
            freeze_us: 0,
            total_us: 0,
            held: 0,
            error: None,
        };
        self.migrated(&report, placement, now_us).1
    }
}

impl Scheduler {
    /// `ServerLoad`, `WorkerLoad`, `MigrateDone`, and an operator's `Scale`.
    pub(super) fn on_elastic(&mut self, call: Caller, control: Control, out: &mut Vec<Action>) {
        let request_id = call.request_id;
        match (control, call.role) {
            (Control::ServerLoad(load), Some(Role::Server(id))) => {
                self.elastic.server_load(ServerLoad { server_id: id, ..load }, self.now_us);
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
                        call.reply(out, Control::Ok.into());
                    } else {
                        let block = report.block;
                        call.refuse(
                            out,
                            ErrorCode::BadRequest,
                            format!("no migration of block {block} from server {id} is under way"),
                        );
                    }
                }
                self.carry_out(orders, out);
            }
            (Control::SplitDone { block, at, epoch, error }, Some(Role::Server(id))) => {
                let ours = self.elastic.split_done(id, (block, at, epoch), error.as_deref(), self.now_us);
                // The owner's report of a split it did is the record, even of a split no
                // longer awaited here (written off after its timeout): its server answers
                // the old id `Moved` to no server from then on.
                let owns = self.placement.as_ref().and_then(|p| p.owner(block)) == Some(id);
                if ours || (error.is_none() && owns) {
                    self.record_split(id, (block, at, epoch), out);
                }
                // The split is over (done, refused or not awaited): the next migration may start.
                let orders = self.placement.as_ref().map(|p| self.elastic.next_migration(p, self.now_us));
                self.carry_out(orders.unwrap_or_default(), out);
            }
            (Control::Scale(req), _) => {
                let Some(placement) = self.placement.as_ref().filter(|_| self.layout_ready) else {
                    call.refuse(out, ErrorCode::NotReady, "the job is not running yet: no model is placed".into());
                    return;
                };
                match self.elastic.scale(req, placement, self.can_launch, self.now_us) {
                    Ok(orders) => {
                        call.reply(out, Control::Ok.into());
                        self.carry_out(orders, out);
                    }
                    Err(message) => call.refuse(out, ErrorCode::BadRequest, message),
                }
            }
            (other, _) => call.refuse_now(out, other),
        }
    }

    /// The row blocks the balancer may split now, each with the row its server reported
    /// to split it at: a live row block with that row inside its range, in a table of
    /// fewer than [`MAX_TABLE_BLOCKS`] blocks. None in a job with replicas or checkpoints
    /// (their copies and files are per block id, and are not split).
    pub(super) fn splittable(&self) -> BTreeMap<u32, u64> {
        let Some(p) = self.partition.as_ref() else { return BTreeMap::new() };
        if self.config.replicas > 1 || self.config.checkpoint.is_some() {
            return BTreeMap::new();
        }
        let inside = |block: u32, at: u64| {
            p.block(block).ok().filter(|b| !b.is_retired()).is_some_and(|b| {
                b.row_range().is_some_and(|(s, e, _)| s < at && at < e)
                    && p.table_blocks(b.tensor).len() < MAX_TABLE_BLOCKS
            })
        };
        self.elastic.split_hints().iter().filter(|(b, at)| inside(**b, **at)).map(|(b, at)| (*b, *at)).collect()
    }

    /// The owner `owner` split row block `block` at row `at` (`SplitDone` at `epoch`):
    /// the model and placement say so from now on (the epoch goes up), and every other
    /// server is told to follow.
    pub(super) fn record_split(&mut self, owner: ServerId, (block, at, epoch): (u32, u64, u64), out: &mut Vec<Action>) {
        let (Some(partition), Some(placement)) = (self.partition.as_ref(), self.placement.as_ref()) else { return };
        let (partition, placement, halves) =
            match elasticps_core::placement::split_row_block(partition, placement, block, at, epoch) {
                Ok(split) => split,
                Err(e) => {
                    tracing::error!(block, at, owner, error = %e, "a split the owner reports cannot be recorded");
                    return;
                }
            };
        self.partition = Some(partition);
        let placement = self.placement.insert(placement);
        tracing::info!(block, at, owner, epoch = placement.epoch, ?halves, "row block split recorded");
        self.elastic.split_recorded(block, at, halves, self.now_us);
        let others: Vec<ConnId> = self
            .servers
            .iter()
            .enumerate()
            .filter(|(id, (c, _))| *id as u32 != owner && self.nodes.contains_key(c))
            .map(|(_, (c, _))| *c)
            .collect();
        for conn in others {
            let msg = Control::SplitBlock { block, at, epoch, recorded: true }.into();
            out.push(Action::Send { conn, request_id: 0, msg });
        }
    }

    /// The balancer changed the wire dtype of blocks (rule 5c): the placement's epoch goes
    /// up and every worker is sent the layout (request id 0), whose `wire` its client
    /// follows from its next round; servers decode any dtype and need not know.
    fn publish_wire(&mut self, out: &mut Vec<Action>) {
        let Some(placement) = self.placement.as_mut() else { return };
        placement.epoch = placement.epoch.saturating_add(1);
        let Some(layout) = self.layout() else { return };
        tracing::info!(
            epoch = layout.placement.epoch,
            narrowed = layout.wire.len(),
            "wire dtypes published to the workers"
        );
        let msg: Message = Control::Layout(layout).into();
        for (conn, n) in self.nodes.iter() {
            if matches!(n.role, Role::Worker(_)) {
                out.push(Action::Send { conn: *conn, request_id: 0, msg: msg.clone() });
            }
        }
    }

    /// Turns elasticity orders into actions; then keeps the copies on serving servers
    /// (a server that starts draining hands its backups on, one that joined takes those a
    /// lost server left short).
    pub(super) fn carry_out(&mut self, orders: Vec<Order>, out: &mut Vec<Action>) {
        let before = self.placement.as_ref().map(|p| p.backups.clone());
        self.carry_out_orders(orders, out);
        self.rebuild_copies();
        if self.placement.as_ref().map(|p| &p.backups) != before.as_ref() {
            self.broadcast_replicas(out);
        }
    }

    pub(super) fn carry_out_orders(&mut self, orders: Vec<Order>, out: &mut Vec<Action>) {
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
                Order::Split { block, at, owner, epoch } => {
                    let Some((conn, _)) = self.servers.get(owner as usize) else { continue };
                    tracing::info!(block, at, owner, epoch, "split starts");
                    out.push(Action::Send {
                        conn: *conn,
                        request_id: 0,
                        msg: Control::SplitBlock { block, at, epoch, recorded: false }.into(),
                    });
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
                Order::Wire => self.publish_wire(out),
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn placement(owners: Vec<u32>) -> Placement {
        Placement::new(1, owners)
    }

    #[test]
    fn remove_server_never_goes_below_min_servers() {
        let p = placement(vec![0, 1, 2, 0, 1, 2]);
        let mut e = Elastic::new(BalanceMode::Static, 3, 3, 2);
        e.model_placed(vec![16; 6]);
        for id in 0..3 {
            e.registered(id, true, 0);
        }
        let err = e.scale(ScaleRequest::RemoveServer(1), &p, false, 10).expect_err("3 servers, --min-servers 3");
        assert!(err.contains("--min-servers 3") && err.contains("runs 3 servers"), "{err}");
        assert_eq!(e.serving(), [0, 1, 2], "nothing drains");
        // A job across hosts learns its bounds late: they hold from then on.
        e.set_bounds(2, 3);
        assert!(e.scale(ScaleRequest::RemoveServer(1), &p, false, 10).is_ok());
        let err = e.scale(ScaleRequest::RemoveServer(2), &p, false, 11).expect_err("2 serving, --min-servers 2");
        assert!(err.contains("--min-servers 2"), "{err}");
    }

    #[test]
    fn remove_server_drains_one_block_at_a_time_then_stops_it() {
        let mut e = Elastic::new(BalanceMode::Static, 1, 3, 2);
        let mut p = placement(vec![0, 1, 2, 0, 1, 2, 0, 1]);
        e.model_placed(vec![16; 8]);
        for id in 0..3 {
            e.registered(id, true, 0);
        }
        let orders = e.scale(ScaleRequest::RemoveServer(1), &p, false, 10).expect("accepted");
        assert!(
            matches!(orders[..], [Order::Migrate { from: 1, .. }]),
            "one migration at a time, nothing stopped yet: {orders:?}"
        );
        let mut stopped = false;
        for step in 0..10 {
            let Some((m, _, _)) = e.in_flight else { break };
            let r = MigrationReport {
                block: m.block,
                from: m.from,
                to: m.to,
                epoch: p.epoch + 1,
                bytes: 16,
                freeze_us: 1,
                total_us: 2,
                held: 0,
                error: None,
            };
            let (ok, orders) = e.migrated(&r, &mut p, 100 + step);
            assert!(ok);
            stopped |= orders.iter().any(|o| matches!(o, Order::Stop { server: 1, .. }));
            if stopped {
                assert_eq!(p.blocks_of(1).count(), 0, "stopped only once drained");
            }
        }
        assert!(stopped, "server 1 stops once drained");
        assert_eq!(p.epoch, 4, "one epoch per migration");
        assert!(p.owners.iter().all(|o| *o != 1));
        assert!(e.removed().contains(&1));
        assert!(e.lost(1, 200), "its connection closing is expected");
    }

    #[test]
    fn a_row_block_weighs_what_its_pushes_carry_once_its_server_reports_them() {
        let mut e = Elastic::new(BalanceMode::Psld, 2, 2, 2);
        e.registered(0, true, 0);
        e.model_placed(vec![4096; 4]);
        let rows =
            |block, pushes, bytes_in| elasticps_wire::RowBlockLoad { block, pushes, bytes_in, ..Default::default() };
        let load =
            ServerLoad { server_id: 0, row_blocks: vec![rows(2, 4, 4000), rows(3, 4, 40)], ..Default::default() };
        e.server_load(load, 1_000_000);
        assert_eq!(e.sizes, vec![4096, 4096, 1000, 10], "the hot range weighs 100x the cold one");
        // A block with pulls only keeps its last weight.
        let load = ServerLoad { server_id: 0, row_blocks: vec![rows(2, 0, 0)], ..Default::default() };
        e.server_load(load, 2_000_000);
        assert_eq!(e.sizes[2], 1000);
    }

    #[test]
    fn a_row_block_weighs_its_live_rows_over_the_horizon_beside_its_traffic() {
        let mut e = Elastic::new(BalanceMode::Psld, 2, 2, 2);
        e.registered(0, true, 0);
        e.model_placed(vec![4096; 4]);
        let rows = |block, bytes_in, live_rows| elasticps_wire::RowBlockLoad {
            block,
            pushes: 1,
            bytes_in,
            live_rows,
            row_bytes: 256,
            ..Default::default()
        };
        // Few rows: traffic decides. A range of 4,096 live rows (1 MiB) each, one hot
        // (400 kB a push), one cold (40 kB): the hot one still weighs about 7x the cold
        // one (the same memory does not hide the traffic, as max(push, memory) would).
        let load = ServerLoad {
            server_id: 0,
            row_blocks: vec![rows(2, 400_000, 4096), rows(3, 40_000, 4096)],
            ..Default::default()
        };
        e.server_load(load, 1_000_000);
        let mem = 4096 * 256 / ROW_MEMORY_HORIZON;
        assert_eq!(e.sizes[2..], [400_000 + mem, 40_000 + mem]);
        assert!(e.sizes[2] > 6 * e.sizes[3], "{:?}", e.sizes);
        // A cold range whose rows grew to 10^7 (2.56 GB) weighs its memory: 2.6 MB an
        // iteration, more than the hot one, so the balancer splits and moves it.
        let load = ServerLoad { server_id: 0, row_blocks: vec![rows(3, 40_000, 10_000_000)], ..Default::default() };
        e.server_load(load, 2_000_000);
        assert_eq!(e.sizes[3], 40_000 + 2_560_000_000 / ROW_MEMORY_HORIZON);
        assert!(e.sizes[3] > 6 * e.sizes[2], "{:?}", e.sizes);
    }

    #[test]
    fn a_link_rate_is_shared_by_the_jobs_workers_from_the_first_report_on() {
        // 4 workers, of which only one has reported when the servers' first reports come:
        // every sample is the link's rate over the 4, so the estimate holds still and its
        // spread stays 0 (dividing by the workers heard from so far gave 4x, then 1x).
        let mut e = Elastic::new(BalanceMode::Psld, 2, 2, 4);
        e.registered(0, true, 0);
        let server = |t: u64| ServerLoad {
            server_id: 0,
            rx_bps: 400e6,
            rx_frames: 8,
            bytes_in: 8 << 20,
            interval_us: t,
            ..Default::default()
        };
        e.worker_load(WorkerLoad { rank: 0, ..Default::default() }, 0);
        for t in 1..=4 {
            if t == 3 {
                for rank in 1..4 {
                    e.worker_load(WorkerLoad { rank, ..Default::default() }, t * 1_000_000);
                }
            }
            e.server_load(server(1_000_000), t * 1_000_000);
            let est = e.load.estimate(0, t * 1_000_000).expect("an estimate");
            assert!((est.bps - 100e6).abs() < 1.0, "at {t} s: {est:?}");
            assert!(est.rse < 1e-9, "at {t} s: {est:?}");
        }
        // Two workers finished: the link is shared by the other two.
        e.worker_left(1);
        e.worker_left(2);
        e.server_load(server(1_000_000), 30_000_000);
        let est = e.load.estimate(0, 30_000_000).expect("an estimate");
        assert!(est.bps > 150e6, "{est:?}");
    }
    #[test]
    fn a_server_of_small_frames_gets_no_rate_and_gives_the_fixed_cost_per_request() {
        // Blocks of 4 MiB and one of 248 bytes; server 1 holds the small one.
        let mut e = Elastic::new(BalanceMode::Psld, 2, 2, 1);
        e.model_placed(vec![4 << 20, 4 << 20, 248]);
        e.registered(0, true, 0);
        e.registered(1, true, 0);
        let big = ServerLoad {
            server_id: 0,
            rx_bps: 100e6,
            rx_frames: 10,
            bytes_in: 40 << 20,
            requests: 20,
            busy_us: 20_000,
            interval_us: 1_000_000,
            ..Default::default()
        };
        // 10 frames of 248 bytes, 50 us of handling each: 2.5 MB/s, all of it fixed cost.
        let small = ServerLoad {
            server_id: 1,
            rx_bps: 2480.0 / 500e-6,
            rx_frames: 10,
            bytes_in: 2480,
            requests: 10,
            busy_us: 500,
            interval_us: 1_000_000,
            ..Default::default()
        };
        for t in 1..=4 {
            e.server_load(small.clone(), t * 1_000_000);
            e.server_load(big.clone(), t * 1_000_000);
        }
        assert_eq!(e.load.estimate(1, 4_000_000), None, "248-byte frames measure no link");
        assert_eq!(e.request_us.get(&1), Some(&50.0));
        // Server 0's 10 frames cost 0.5 ms of fixed cost out of 419 ms: its link rate.
        let est = e.load.estimate(0, 4_000_000).expect("an estimate");
        let seconds = (40 << 20) as f64 / 100e6;
        assert!((est.bps - (40 << 20) as f64 / (seconds - 10.0 * 50e-6)).abs() < 1.0, "{est:?}");
    }
}

#[cfg(test)]
mod scheduler_tests {
    use super::super::testkit::*;
    use super::super::{Action, Event, JobConfig};
    use elasticps_wire::{Control, Message, MigrationReport, ScaleRequest};

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
        let mut m = running(JobConfig { min_servers: 1, ..config() }, 8);
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
        let a = step(&mut m, Event::Lost { conn: 11, why: "closed".into() });
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

    /// A psld job of two blocks, server 1's link half as fast as server 0's, fed a minute
    /// of load reports: the layouts the scheduler pushed to the workers unasked, with the
    /// epoch before.
    fn capped_link_job(compress: Option<elasticps_core::dtype::Dtype>) -> (Vec<(u64, elasticps_wire::Layout)>, u64) {
        use elasticps_wire::{ServerLoad, WorkerLoad};
        let config =
            JobConfig { balance: elasticps_core::balance::BalanceMode::Psld, balance_compress: compress, ..config() };
        let mut m = running(config, 8);
        assert_eq!(m.placement().map(|p| p.owners.clone()), Some(vec![0, 1]));
        let epoch = m.placement().map_or(0, |p| p.epoch);
        let mut pushed = Vec::new();
        for t in 1..=60u64 {
            let now = t * 1_000_000;
            for (conn, server_id, rx_bps) in [(10, 0, 1600.0), (11, 1, 800.0)] {
                // Eight 16-byte frames a second, at the link's rate; 1 ms of handling.
                let load = ServerLoad {
                    server_id,
                    interval_us: 1_000_000,
                    bytes_in: 128,
                    requests: 8,
                    busy_us: 1_000,
                    rx_bps,
                    rx_frames: 8,
                    blocks: 1,
                    bytes: 16,
                    ..Default::default()
                };
                m.handle(now, Event::Received { conn, request_id: 0, msg: Control::ServerLoad(load).into() });
            }
            // Iterations as long as the slower server's frames take: 20 ms, 10 once halved.
            let narrow = pushed.last().is_some_and(|(_, l): &(u64, elasticps_wire::Layout)| !l.wire.is_empty());
            let iter_us = if narrow { 10_000 } else { 20_000 };
            for (conn, rank) in [(1, 0), (2, 1)] {
                let w = WorkerLoad {
                    rank,
                    clock: t as u32 * 50,
                    iterations: 50,
                    iter_us: 50 * iter_us,
                    per_server: vec![],
                };
                m.handle(now, Event::Received { conn, request_id: 0, msg: Control::WorkerLoad(w).into() });
            }
            let a = m.handle(now, Event::Timeout);
            for conn in [1, 2] {
                for msg in sent_to(&a, conn) {
                    if let Message::Control(Control::Layout(l)) = msg {
                        pushed.push((conn, l.clone()));
                    }
                }
            }
        }
        (pushed, epoch)
    }

    #[test]
    fn a_compression_bumps_the_epoch_and_is_pushed_to_every_worker_only_with_the_flag() {
        use elasticps_core::dtype::Dtype;
        let (pushed, epoch) = capped_link_job(Some(Dtype::Bf16));
        assert!(pushed.len() >= 2, "{pushed:?}");
        let ((w0, first), (w1, second)) = (&pushed[0], &pushed[1]);
        assert_eq!((*w0, *w1), (1, 2), "every worker");
        assert_eq!(first, second);
        assert_eq!(first.wire, vec![Dtype::F32, Dtype::Bf16], "server 1's block in bf16");
        assert_eq!(first.placement.epoch, epoch + 1, "the epoch goes up");
        assert_eq!(first.placement.owners, vec![0, 1], "nothing moved");
        // Without --balance-compress the same job gets no compression, and no layout.
        let (none, _) = capped_link_job(None);
        assert!(none.is_empty(), "{none:?}");
    }

    /// A psld job of one tensor (block 0) and a table of 16 rows x 1 in blocks of 4 rows
    /// (1..=4); blocks 0..=2 on server 0 (connection 10), 3 and 4 on server 1 (11).
    fn table_job() -> super::super::Scheduler {
        use elasticps_core::model::{Init, TableSpec, TensorSpec};
        let config = JobConfig { balance: elasticps_core::balance::BalanceMode::Psld, ..config() };
        let mut m = super::super::Scheduler::new(config, 10_000_000);
        recv(&mut m, 1, 1, Control::RegisterWorker);
        recv(&mut m, 2, 1, Control::RegisterWorker);
        let tensors = vec![TensorSpec { name: "w".into(), shape: vec![4], init: Init::Zeros }];
        let tables = vec![TableSpec::new("emb", 16, 1)];
        recv(&mut m, 1, 2, Control::DefineModel { tensors, optimizers: Vec::new(), tables });
        recv(&mut m, 10, 1, Control::RegisterServer { data_addr: "s0".into() });
        recv(&mut m, 11, 1, Control::RegisterServer { data_addr: "s1".into() });
        recv(&mut m, 10, 0, Control::AssignDone { server_id: 0 });
        recv(&mut m, 11, 0, Control::AssignDone { server_id: 1 });
        assert_eq!(m.placement().map(|p| p.owners.clone()), Some(vec![0, 0, 0, 1, 1]));
        m
    }

    fn split_block_sent(a: &[Action], conn: u64) -> Vec<(u32, u64, bool)> {
        sent_to(a, conn)
            .into_iter()
            .filter_map(|m| match m {
                Message::Control(Control::SplitBlock { block, at, recorded, .. }) => Some((*block, *at, *recorded)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_heavy_row_block_is_split_on_its_owner_then_recorded_and_told_to_the_others() {
        let mut m = table_job();
        let epoch = m.placement().map(|p| p.epoch).unwrap();
        // Block 1 carries nearly all the load, and its server says where to cut it.
        let rows = |block, bytes_in, split_at| elasticps_wire::RowBlockLoad {
            block,
            pushes: 10,
            bytes_in,
            split_at,
            ..Default::default()
        };
        let load = elasticps_wire::ServerLoad {
            server_id: 0,
            row_blocks: vec![rows(1, 10_000, 2), rows(2, 10, 0)],
            ..Default::default()
        };
        recv(&mut m, 10, 0, Control::ServerLoad(load));
        let a = m.handle(2_000_000, Event::Timeout);
        assert_eq!(split_block_sent(&a, 10), [(1, 2, false)], "{a:?}");
        // Nothing else starts while the split runs; the owner reports it done.
        let a = recv(&mut m, 10, 0, Control::SplitDone { block: 1, at: 2, epoch: epoch + 1, error: None });
        assert_eq!(split_block_sent(&a, 11), [(1, 2, true)], "the other server follows");
        assert!(split_block_sent(&a, 10).is_empty(), "the owner did it");
        let (p, pl) = (m.partition().unwrap(), m.placement().unwrap());
        assert_eq!(
            (p.blocks.len(), pl.owner(5), pl.owner(6), pl.owner(1), pl.epoch),
            (7, Some(0), Some(0), None, epoch + 1)
        );
        assert_eq!(p.check_tables(), Ok(()));
        // A report from a server that does not own the block changes nothing; an owner's
        // report of a split no longer awaited (written off) is the record.
        recv(&mut m, 10, 0, Control::SplitDone { block: 3, at: 10, epoch: epoch + 2, error: None });
        assert_eq!(m.partition().unwrap().blocks.len(), 7);
        let a = recv(&mut m, 11, 0, Control::SplitDone { block: 3, at: 10, epoch: epoch + 2, error: None });
        assert_eq!(split_block_sent(&a, 10), [(3, 10, true)]);
        assert_eq!(m.partition().unwrap().blocks.len(), 9);
        assert_eq!(m.placement().unwrap().owner(8), Some(1));
    }

    /// Issue 33: the scheduler dies between `SplitBlock` and `SplitDone` (a notification,
    /// lost with it). The restarted one learns the split from the halves its owner holds
    /// when it reattaches, records it and tells the other server; the job goes on.
    #[test]
    fn a_scheduler_restarted_between_split_block_and_split_done_records_the_split_from_the_owner() {
        use elasticps_wire::{Credential, HeldBlock, PeerRole};
        let mut m = table_job();
        let epoch = m.placement().map(|p| p.epoch).unwrap();
        let rows =
            elasticps_wire::RowBlockLoad { block: 1, pushes: 10, bytes_in: 10_000, split_at: 2, ..Default::default() };
        recv(
            &mut m,
            10,
            0,
            Control::ServerLoad(elasticps_wire::ServerLoad {
                server_id: 0,
                row_blocks: vec![rows],
                ..Default::default()
            }),
        );
        let a = m.handle(2_000_000, Event::Timeout);
        assert_eq!(split_block_sent(&a, 10), [(1, 2, false)], "{a:?}");
        // The state as the runtime wrote it before sending SplitBlock, through JSON.
        let json = serde_json::to_string(&m.saved_state()).unwrap();
        let config = JobConfig { balance: elasticps_core::balance::BalanceMode::Psld, ..config() };
        let mut r = super::super::Scheduler::recover(config, serde_json::from_str(&json).unwrap(), 10_000_000).unwrap();
        let reattach = |r: &mut super::super::Scheduler, conn, server_id: u32, blocks: &[u32], at_epoch: u64| {
            let blocks = blocks
                .iter()
                .map(|&block| HeldBlock { block, epoch: if block > 4 { at_epoch } else { 0 }, arrived: false })
                .collect();
            let credential = Credential::issue(b"", 0, PeerRole::Server, server_id);
            recv(
                r,
                conn,
                1,
                Control::ReattachServer { server_id, credential, data_addr: format!("s{server_id}"), blocks },
            )
        };
        // The owner split block 1 into 5 and 6 before the restart.
        reattach(&mut r, 30, 0, &[0, 2, 5, 6], epoch + 1);
        let a = reattach(&mut r, 31, 1, &[3, 4], epoch + 1);
        assert!(!a.iter().any(|x| matches!(x, Action::Finish { .. })), "the job goes on: {a:?}");
        assert_eq!(split_block_sent(&a, 31), [(1, 2, true)], "the other server follows: {a:?}");
        let (p, pl) = (r.partition().unwrap(), r.placement().unwrap());
        assert_eq!((p.blocks.len(), pl.owner(5), pl.owner(6), pl.owner(1)), (7, Some(0), Some(0), None));
        assert!(!r.recovering());
    }
}
