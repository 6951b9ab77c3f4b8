//! The PSLD balancer: which blocks to move, when to probe, when to add or remove a server.
//!
//! # Model
//!
//! Each server `j` serves the pushes of a worker at a rate `r_j` (bytes/s, estimated by
//! [`LoadModel`]). Its *service time* per iteration is `T_j = bytes of its blocks / r_j`,
//! and a synchronous round waits for the slowest server, so the goal is to minimise
//! `max_j T_j`. A server without an estimate is assumed to run at the median rate of the
//! others (optimistic: it is then tried rather than shunned).
//!
//! The pure functions: [`service_times`], [`stragglers`] (`T_j > median * (1 + threshold)`),
//! [`rebalance`] (greedy best-fit moves off the server with the largest `T`, within a byte
//! budget), [`drain`] (empty one server), [`fill`] (load a new server). Each block moves at
//! most once in a plan, so a plan is a list of independent migrations.
//!
//! # The control loop ([`Balancer::step`], about once a second)
//!
//! At most one [`Decision`] per step. In order:
//!
//! 1. **Busy.** While migrations are queued or in flight (`View::busy`) nothing is
//!    decided, and the cool-down (`cooldown_us`, 3 s) restarts: it counts from the end of
//!    the last migration round, or from the last decision if no busy step was seen.
//! 2. **Scale-out trial.** After [`Decision::ScaleOut`] the balancer waits for
//!    [`Balancer::joined`] and decides nothing else (it gives up after `join_timeout_us`,
//!    30 s, which counts as a revert). The next step emits a `Migrate` with [`fill`]. Once
//!    that has finished and `trial_us` (8 s) has passed, it compares the mean `iter_us` of
//!    the trial (steps at least [`TRIAL_SETTLE_US`] after the fill finished) with the
//!    baseline (mean of the last [`BASELINE_STEPS`] `iter_us` before the scale-out, since
//!    the last busy step): improved by `keep_gain` (5%) or more -> [`Decision::Keep`],
//!    otherwise [`Decision::ScaleIn`] of the new server (a revert). Without iteration
//!    times it compares the predicted max service time instead. After a revert no
//!    scale-out for [`REVERT_HOLDOFF_US`] (60 s), doubling with each consecutive revert up
//!    to 16x; a `Keep` resets the doubling.
//! 3. **Cool-down.** Nothing else until the cool-down has passed.
//! 4. **Confidence gate.** Nothing until every server in `servers` that owns blocks has an
//!    estimate with confidence >= [`MIN_CONFIDENCE`] (0.5; see [`crate::load`]).
//! 5. **Exploit.** If some server is a straggler, [`rebalance`] within `budget_bytes`
//!    (64 MiB) and emit `Migrate` only if the max service time drops by `min_gain` (10%)
//!    or more AND the gain over `horizon_iters` (50) iterations,
//!    `(max_before - max_after) * horizon_iters` seconds, exceeds the migration cost,
//!    `Σ bytes / min(rate of source, rate of destination)` seconds.
//! 6. **Scale out.** If `servers.len() < max_servers`, no hold-off runs, and even the best
//!    unbudgeted [`rebalance`] leaves `max T > (1 + threshold) * target`, where the target
//!    `total bytes / (n * median rate)` is the max service time of `n` servers all as fast
//!    as the median one with the load spread evenly: rebalancing cannot reach the target,
//!    so emit `ScaleOut` (the baseline is remembered) and run the trial of rule 2.
//! 7. **Scale in.** If `servers.len() > max(min_servers, 1)`: a server that owns no block,
//!    or whose service time has been below [`IDLE_FRACTION`] (10%) of the max for
//!    [`IDLE_US`] (10 s), is drained and stopped (`ScaleIn`) if draining it raises the
//!    predicted max service time by at most [`SCALE_IN_MAX_RAISE`] (5%). Candidates are
//!    tried from the smallest service time, ties to the highest id (the newest server).
//! 8. **Under-loaded server.** If the max service time exceeds the perfectly balanced one,
//!    `total bytes / Σ rates`, by more than `threshold` (no server straggles but one has
//!    too little, e.g. a straggler that recovered), the exploit of rule 5 with the same
//!    gain and cost tests.
//! 9. **Explore (re-probe).** A server is *uncertain* if it has no estimate, its
//!    confidence is below [`MIN_CONFIDENCE`], it owns blocks but has had no sample for
//!    [`STALE_US`] (5 s), or it owns less than [`FEW_BYTES`] (10%) of the mean bytes per
//!    server (its samples, if any, say little). The first uncertain server (in id order)
//!    whose probe time has come gets the smallest block of the server with the largest
//!    service time, so that fresh samples come in: a recovered straggler wins its blocks
//!    back through rule 5 or 8. Probes of one server are [`PROBE_INTERVAL_US`] (10 s)
//!    apart, doubling with each further probe up to [`PROBE_MAX_INTERVAL_US`] (60 s) so a
//!    server that stays slow costs little; the interval resets once the server carries at
//!    least half the mean bytes with a certain estimate.
//!
//! Scale-out and scale-in are never proposed in the same step. Hysteresis comes from the
//! straggler threshold, the gain and cost tests, the cool-down, the idle time, the probe
//! intervals and the scale-out hold-off.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::load::LoadModel;
use crate::model::BlockId;
use crate::placement::{Placement, ServerId};
use crate::stats::median;

/// Least confidence of every block owner's estimate before anything is decided.
pub const MIN_CONFIDENCE: f64 = 0.5;
/// A server that owns blocks and has had no sample for this long is uncertain.
pub const STALE_US: u64 = 5_000_000;
/// A server owning less than this fraction of the mean bytes per server is uncertain.
pub const FEW_BYTES: f64 = 0.1;
/// Least time between two probes of the same server.
pub const PROBE_INTERVAL_US: u64 = 10_000_000;
/// Cap of the doubling probe interval of a server that stays uncertain.
pub const PROBE_MAX_INTERVAL_US: u64 = 60_000_000;
/// A server whose service time is below this fraction of the max is idle.
pub const IDLE_FRACTION: f64 = 0.1;
/// How long a server must be idle before it is scaled in.
pub const IDLE_US: u64 = 10_000_000;
/// Draining a server to scale it in may raise the predicted max service time by this much.
pub const SCALE_IN_MAX_RAISE: f64 = 0.05;
/// No scale-out for this long after a reverted one (doubling per consecutive revert).
pub const REVERT_HOLDOFF_US: u64 = 60_000_000;
/// Most doublings of [`REVERT_HOLDOFF_US`].
pub const MAX_HOLDOFF_DOUBLINGS: u32 = 4;
/// Iteration times of a scale-out trial count from this long after the fill finished.
pub const TRIAL_SETTLE_US: u64 = 2_000_000;
/// Number of recent iteration times averaged into the baseline of a scale-out.
pub const BASELINE_STEPS: usize = 10;

/// Relative tolerance of "strictly lower" comparisons of service times.
const EPS: f64 = 1e-9;

/// Tuning of the balancer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BalanceParams {
    /// Straggler: service time > median * (1 + threshold); default 0.2.
    pub threshold: f64,
    /// Act only if the predicted max service time drops by this fraction; default 0.1.
    pub min_gain: f64,
    /// Bytes moved per round at most; default 64 MiB.
    pub budget_bytes: u64,
    /// The predicted gain over this many iterations must beat the migration cost; default 50.
    pub horizon_iters: f64,
    /// After the last move or scale finished, wait this long; default 3 s.
    pub cooldown_us: u64,
    /// Never scale in below this many servers.
    pub min_servers: u32,
    /// Never scale out above this many servers.
    pub max_servers: u32,
    /// Scale-out evaluation window after the new server got its load; default 8 s.
    pub trial_us: u64,
    /// Keep a scaled-out server if the mean iteration time improved by this fraction; default 0.05.
    pub keep_gain: f64,
    /// Give up waiting for a requested server after this; default 30 s.
    pub join_timeout_us: u64,
}

impl BalanceParams {
    /// The defaults, for a job of `min_servers..=max_servers` servers.
    pub fn new(min_servers: u32, max_servers: u32) -> Self {
        Self {
            threshold: 0.2,
            min_gain: 0.1,
            budget_bytes: 64 << 20,
            horizon_iters: 50.0,
            cooldown_us: 3_000_000,
            min_servers,
            max_servers,
            trial_us: 8_000_000,
            keep_gain: 0.05,
            join_timeout_us: 30_000_000,
        }
    }
}

/// Move one block from its owner to another server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Move {
    /// The block.
    pub block: BlockId,
    /// Its owner now.
    pub from: ServerId,
    /// Its owner after the move.
    pub to: ServerId,
}

/// The outcome of [`rebalance`].
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// The moves, in the order they were chosen; each block appears at most once.
    pub moves: Vec<Move>,
    /// Max service time (seconds per iteration) before the moves.
    pub max_before: f64,
    /// Predicted max service time after the moves.
    pub max_after: f64,
}

/// Estimated seconds per iteration of each server in `servers`: sum of the bytes of its
/// blocks / its rate. A server without an estimate gets the median rate of the others
/// (optimistic; if none has one, 1.0 — then everything is relative). Blocks owned by a
/// server not in `servers` are not counted; `sizes[block]` missing counts as 0 bytes.
pub fn service_times(
    placement: &Placement,
    sizes: &[u64],
    servers: &[ServerId],
    rates: &BTreeMap<ServerId, f64>,
) -> BTreeMap<ServerId, f64> {
    Loads::new(placement, sizes, servers, rates).times()
}

/// Servers whose service time exceeds the median by more than `threshold`, in id order.
pub fn stragglers(times: &BTreeMap<ServerId, f64>, threshold: f64) -> Vec<ServerId> {
    let values: Vec<f64> = times.values().copied().collect();
    let Some(median) = median(&values) else { return Vec::new() };
    let bound = median * (1.0 + threshold);
    times.iter().filter(|&(_, &t)| t > 0.0 && t > bound).map(|(&s, _)| s).collect()
}

/// Exploit: greedy best-fit moves from the server with the largest service time to the
/// ones with the most headroom so as to minimise max_j T_j, within budget_bytes; stop
/// when no single move lowers the max. Pure, deterministic (ties broken by id).
///
/// Each step takes the server with the largest `T` (ties: lowest id) and, among its
/// not-yet-moved blocks that fit the remaining budget and every other server, the move
/// that makes `max(T_from, T_to)` smallest, provided it is below the current `T_from`
/// (ties: smaller `T_to`, then lower block id, then lower server id). So the max never
/// rises and each block moves at most once.
pub fn rebalance(
    placement: &Placement,
    sizes: &[u64],
    servers: &[ServerId],
    rates: &BTreeMap<ServerId, f64>,
    params: &BalanceParams,
) -> Plan {
    let mut loads = Loads::new(placement, sizes, servers, rates);
    let max_before = loads.max_time();
    let mut owned = loads.owned_blocks(placement, sizes);
    let moves = greedy(&mut loads, &mut owned, None, params.budget_bytes);
    Plan { moves, max_before, max_after: loads.max_time() }
}

/// Every block of `server` moved to the others, best fit (largest block first into the
/// server whose resulting service time is smallest; ties: lower block id, lower server
/// id). `server` may or may not be in `servers`; empty if there is no other server.
pub fn drain(
    placement: &Placement,
    sizes: &[u64],
    server: ServerId,
    servers: &[ServerId],
    rates: &BTreeMap<ServerId, f64>,
) -> Vec<Move> {
    let others: Vec<ServerId> = servers.iter().copied().filter(|&s| s != server).collect();
    let mut loads = Loads::new(placement, sizes, &others, rates);
    if loads.ids.is_empty() {
        return Vec::new();
    }
    let mut blocks: Vec<(u64, BlockId)> = placement.blocks_of(server).map(|b| (size_of(sizes, b), b)).collect();
    blocks.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    blocks
        .into_iter()
        .map(|(size, block)| {
            let to = (0..loads.ids.len())
                .min_by(|&a, &b| loads.time_with(a, size).total_cmp(&loads.time_with(b, size)).then(a.cmp(&b)))
                .unwrap_or(0);
            loads.bytes[to] += size;
            Move { block, from: server, to: loads.ids[to] }
        })
        .collect()
}

/// Give `new_server` (already in `servers`, owning nothing) about the average load:
/// best-fit descending, taking blocks from the heaviest (largest service time) servers,
/// while that lowers max_j T_j. This is [`rebalance`] with `new_server` as the only
/// destination and no budget.
pub fn fill(
    placement: &Placement,
    sizes: &[u64],
    new_server: ServerId,
    servers: &[ServerId],
    rates: &BTreeMap<ServerId, f64>,
) -> Vec<Move> {
    let mut all = servers.to_vec();
    all.push(new_server);
    let mut loads = Loads::new(placement, sizes, &all, rates);
    let Some(dst) = loads.index(new_server) else { return Vec::new() };
    let mut owned = loads.owned_blocks(placement, sizes);
    greedy(&mut loads, &mut owned, Some(dst), u64::MAX)
}

/// What the cluster looks like to the balancer at one instant.
#[derive(Clone, Copy, Debug)]
pub struct View<'a> {
    /// The current time, µs.
    pub now_us: u64,
    /// The current placement.
    pub placement: &'a Placement,
    /// Bytes of each block, indexed by block id.
    pub sizes: &'a [u64],
    /// Servers that serve and may receive blocks (not draining).
    pub servers: &'a [ServerId],
    /// The rate estimates.
    pub load: &'a LoadModel,
    /// Mean worker iteration time over the last interval, µs.
    pub iter_us: Option<f64>,
    /// Migrations queued or in flight: decide nothing.
    pub busy: bool,
}

/// What the balancer wants done.
#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    /// Carry out these moves.
    Migrate {
        /// The moves; each block at most once.
        moves: Vec<Move>,
        /// Why, for the event log.
        why: String,
    },
    /// Start one more server; report it with [`Balancer::joined`].
    ScaleOut {
        /// Why, for the event log.
        why: String,
    },
    /// Drain this server, then stop it (also used to revert a scale-out).
    ScaleIn {
        /// The server to remove.
        server: ServerId,
        /// Why, for the event log.
        why: String,
    },
    /// Verdict of a scale-out trial: the scaled-out server stays.
    Keep {
        /// The server that stays.
        server: ServerId,
        /// Why, for the event log.
        why: String,
    },
}

/// Where the balancer is in a scale-out.
#[derive(Clone, Debug, PartialEq)]
enum Phase {
    /// No scale-out under way.
    Steady,
    /// Asked for a server at `asked_us`, waiting for [`Balancer::joined`].
    AwaitJoin { asked_us: u64, baseline: Option<f64>, predicted: f64 },
    /// The server joined; the next step gives it its load.
    Filling { server: ServerId, joined_us: u64, baseline: Option<f64>, predicted: f64 },
    /// The server has its load; measuring from `start_us`.
    Trial { server: ServerId, start_us: u64, baseline: Option<f64>, predicted: f64, samples: Vec<f64> },
}

/// Probe bookkeeping of one server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Probe {
    next_us: u64,
    interval_us: u64,
}

/// The PSLD control loop as a state machine: hysteresis, cool-down, exploit, explore, scale.
/// See the module doc for the rules.
#[derive(Clone, Debug)]
pub struct Balancer {
    params: BalanceParams,
    phase: Phase,
    /// The last busy step or decision: the cool-down counts from here.
    quiet_since: Option<u64>,
    /// Iteration times seen since the last busy step.
    iters: VecDeque<f64>,
    /// Since when each server has been idle (service time below IDLE_FRACTION of the max).
    idle_since: BTreeMap<ServerId, u64>,
    probes: BTreeMap<ServerId, Probe>,
    /// No scale-out before this time.
    scale_out_after_us: u64,
    /// Consecutive reverted scale-outs.
    reverts: u32,
}

impl Balancer {
    /// A balancer with these parameters, in the steady phase.
    pub fn new(params: BalanceParams) -> Self {
        Self {
            params,
            phase: Phase::Steady,
            quiet_since: None,
            iters: VecDeque::new(),
            idle_since: BTreeMap::new(),
            probes: BTreeMap::new(),
            scale_out_after_us: 0,
            reverts: 0,
        }
    }

    /// The parameters.
    pub fn params(&self) -> &BalanceParams {
        &self.params
    }

    /// The server of the scale-out under way (joined, being filled or on trial), if any.
    pub fn trial_server(&self) -> Option<ServerId> {
        match self.phase {
            Phase::Filling { server, .. } | Phase::Trial { server, .. } => Some(server),
            _ => None,
        }
    }

    /// True while a requested server has not joined yet.
    pub fn awaiting_join(&self) -> bool {
        matches!(self.phase, Phase::AwaitJoin { .. })
    }

    /// A server the balancer asked for (ScaleOut) registered and owns nothing yet.
    /// Ignored unless the balancer is waiting for one.
    pub fn joined(&mut self, server: ServerId, now_us: u64) {
        if let Phase::AwaitJoin { baseline, predicted, .. } = self.phase {
            self.phase = Phase::Filling { server, joined_us: now_us, baseline, predicted };
        }
    }

    /// Called about once a second. Returns what to do now (often nothing, at most one
    /// decision).
    pub fn step(&mut self, view: &View) -> Vec<Decision> {
        let now = view.now_us;
        if view.busy {
            self.quiet_since = Some(now);
            self.iters.clear();
            self.idle_since.clear();
            if let Phase::Trial { start_us, samples, .. } = &mut self.phase {
                *start_us = now;
                samples.clear();
            }
            return Vec::new();
        }
        if let Some(it) = view.iter_us.filter(|i| i.is_finite() && *i > 0.0) {
            self.iters.push_back(it);
            if self.iters.len() > BASELINE_STEPS {
                self.iters.pop_front();
            }
        }
        let mut servers = view.servers.to_vec();
        servers.sort_unstable();
        servers.dedup();
        let rates = view.load.rates(now);
        let loads = Loads::new(view.placement, view.sizes, &servers, &rates);
        self.track_idle(&loads, now);

        let decision = match self.phase.clone() {
            Phase::Steady => self.steady(view, &servers, &rates, &loads),
            Phase::AwaitJoin { asked_us, .. } => {
                if now.saturating_sub(asked_us) > self.params.join_timeout_us {
                    self.phase = Phase::Steady;
                    self.revert_holdoff(now);
                }
                None
            }
            Phase::Filling { server, joined_us, baseline, predicted } => {
                self.filling(view, &servers, &rates, (server, joined_us, baseline, predicted))
            }
            Phase::Trial { server, .. } => self.trial(view, &servers, &loads, server),
        };
        match decision {
            Some(d) => {
                self.quiet_since = Some(now);
                vec![d]
            }
            None => Vec::new(),
        }
    }

    /// Updates since when each server has been idle.
    fn track_idle(&mut self, loads: &Loads, now: u64) {
        let max = loads.max_time();
        for (i, &id) in loads.ids.iter().enumerate() {
            if max > 0.0 && loads.time(i) < IDLE_FRACTION * max {
                self.idle_since.entry(id).or_insert(now);
            } else {
                self.idle_since.remove(&id);
            }
        }
        self.idle_since.retain(|id, _| loads.index(*id).is_some());
    }

    /// Starts the scale-out hold-off after a revert (or a server that never joined).
    fn revert_holdoff(&mut self, now: u64) {
        self.reverts = self.reverts.saturating_add(1);
        let doublings = (self.reverts - 1).min(MAX_HOLDOFF_DOUBLINGS);
        self.scale_out_after_us = now.saturating_add(REVERT_HOLDOFF_US << doublings);
    }

    fn cooled(&self, now: u64) -> bool {
        self.quiet_since.is_none_or(|t| now >= t.saturating_add(self.params.cooldown_us))
    }

    /// The step after `joined`: give the new server its load (`Phase::Filling` fields).
    fn filling(
        &mut self,
        view: &View,
        servers: &[ServerId],
        rates: &BTreeMap<ServerId, f64>,
        (server, joined_us, baseline, predicted): (ServerId, u64, Option<f64>, f64),
    ) -> Option<Decision> {
        let now = view.now_us;
        if servers.binary_search(&server).is_err() {
            if now.saturating_sub(joined_us) > self.params.join_timeout_us {
                self.phase = Phase::Steady;
                self.revert_holdoff(now);
            }
            return None;
        }
        let moves = fill(view.placement, view.sizes, server, servers, rates);
        if moves.is_empty() {
            self.phase = Phase::Steady;
            self.revert_holdoff(now);
            return Some(Decision::ScaleIn {
                server,
                why: format!("scale-out reverted: nothing to give server {server}"),
            });
        }
        let bytes: u64 = moves.iter().map(|m| size_of(view.sizes, m.block)).sum();
        self.phase = Phase::Trial { server, start_us: now, baseline, predicted, samples: Vec::new() };
        Some(Decision::Migrate {
            why: format!("fill new server {server}: {} blocks, {bytes} bytes", moves.len()),
            moves,
        })
    }

    fn trial(&mut self, view: &View, servers: &[ServerId], loads: &Loads, server: ServerId) -> Option<Decision> {
        let now = view.now_us;
        let Phase::Trial { start_us, baseline, predicted, samples, .. } = &mut self.phase else { return None };
        if servers.binary_search(&server).is_err() {
            // It left (failed or removed by someone else): the trial is void.
            self.phase = Phase::Steady;
            return None;
        }
        if now >= start_us.saturating_add(TRIAL_SETTLE_US)
            && let Some(it) = view.iter_us.filter(|i| i.is_finite() && *i > 0.0)
        {
            samples.push(it);
        }
        if now < start_us.saturating_add(self.params.trial_us) {
            return None;
        }
        let (gain, basis) = match (*baseline, mean(samples)) {
            (Some(before), Some(after)) => {
                ((before - after) / before, format!("mean iteration {:.1} ms -> {:.1} ms", before / 1e3, after / 1e3))
            }
            _ => {
                let after = loads.max_time();
                let gain = if *predicted > 0.0 { (*predicted - after) / *predicted } else { 0.0 };
                (gain, format!("predicted max service time {:.1} ms -> {:.1} ms", *predicted * 1e3, after * 1e3))
            }
        };
        self.phase = Phase::Steady;
        if gain >= self.params.keep_gain {
            self.reverts = 0;
            Some(Decision::Keep { server, why: format!("scale-out kept: {basis} ({:+.1}%)", -gain * 100.0) })
        } else {
            self.revert_holdoff(now);
            Some(Decision::ScaleIn { server, why: format!("scale-out reverted: {basis} ({:+.1}%)", -gain * 100.0) })
        }
    }

    fn steady(
        &mut self,
        view: &View,
        servers: &[ServerId],
        rates: &BTreeMap<ServerId, f64>,
        loads: &Loads,
    ) -> Option<Decision> {
        let now = view.now_us;
        if !self.cooled(now) {
            return None;
        }
        let total: u64 = loads.bytes.iter().sum();
        if total == 0 {
            return None;
        }
        // Confidence gate.
        for (i, &id) in loads.ids.iter().enumerate() {
            if loads.bytes[i] > 0 && view.load.estimate(id, now).is_none_or(|e| e.confidence < MIN_CONFIDENCE) {
                return None;
            }
        }
        let times = loads.times();
        let max = loads.max_time();

        // Exploit: a straggler.
        let straggling = stragglers(&times, self.params.threshold);
        if !straggling.is_empty() {
            let why = format!("straggler {straggling:?}");
            if let Some(d) = self.exploit(view, servers, rates, loads, &why) {
                return Some(d);
            }
        }

        // Scale out: rebalancing cannot reach the target.
        let n = loads.ids.len();
        if n < self.params.max_servers as usize && now >= self.scale_out_after_us {
            let unlimited = BalanceParams { budget_bytes: u64::MAX, ..self.params };
            let best = rebalance(view.placement, view.sizes, servers, rates, &unlimited).max_after;
            let median_rate = median(&loads.rate).unwrap_or(1.0);
            let target = total as f64 / (n as f64 * median_rate);
            if best > (1.0 + self.params.threshold) * target {
                let baseline =
                    mean(self.iters.iter().rev().take(BASELINE_STEPS).copied().collect::<Vec<_>>().as_slice());
                self.phase = Phase::AwaitJoin { asked_us: now, baseline, predicted: best };
                return Some(Decision::ScaleOut {
                    why: format!(
                        "max service time {:.1} ms at best with {n} servers, target {:.1} ms",
                        best * 1e3,
                        target * 1e3
                    ),
                });
            }
        }

        // Scale in: an idle server whose load the others absorb.
        if n > (self.params.min_servers.max(1)) as usize {
            let mut candidates: Vec<usize> = (0..n)
                .filter(|&i| {
                    loads.bytes[i] == 0
                        || self.idle_since.get(&loads.ids[i]).is_some_and(|&t| now >= t.saturating_add(IDLE_US))
                })
                .collect();
            candidates.sort_by(|&a, &b| loads.time(a).total_cmp(&loads.time(b)).then(b.cmp(&a)));
            for i in candidates {
                let id = loads.ids[i];
                let moves = drain(view.placement, view.sizes, id, servers, rates);
                let mut after = view.placement.clone();
                let epoch = after.epoch.saturating_add(1);
                for m in &moves {
                    // drain() moves only blocks of the placement: none is refused.
                    let _ = after.apply(m.block, m.to, epoch);
                }
                let others: Vec<ServerId> = servers.iter().copied().filter(|&s| s != id).collect();
                let max_after = Loads::new(&after, view.sizes, &others, rates).max_time();
                if max_after <= max * (1.0 + SCALE_IN_MAX_RAISE) + EPS * max {
                    let raise = if max > 0.0 { (max_after - max) / max * 100.0 } else { 0.0 };
                    return Some(Decision::ScaleIn {
                        server: id,
                        why: format!(
                            "server {id} idle ({} bytes, {:.1} ms of {:.1} ms); draining it changes the max by {raise:+.1}%",
                            loads.bytes[i],
                            loads.time(i) * 1e3,
                            max * 1e3
                        ),
                    });
                }
            }
        }

        // An under-loaded server (e.g. a recovered straggler).
        let ideal = total as f64 / loads.rate.iter().sum::<f64>();
        if straggling.is_empty() && max > (1.0 + self.params.threshold) * ideal {
            let why = format!("imbalance: max {:.1} ms vs balanced {:.1} ms", max * 1e3, ideal * 1e3);
            if let Some(d) = self.exploit(view, servers, rates, loads, &why) {
                return Some(d);
            }
        }

        self.probe(view, loads, total)
    }

    /// Rule 5: a budgeted rebalance, if it pays.
    fn exploit(
        &self,
        view: &View,
        servers: &[ServerId],
        rates: &BTreeMap<ServerId, f64>,
        loads: &Loads,
        reason: &str,
    ) -> Option<Decision> {
        let plan = rebalance(view.placement, view.sizes, servers, rates, &self.params);
        if plan.moves.is_empty() || plan.max_before <= 0.0 {
            return None;
        }
        let gain = plan.max_before - plan.max_after;
        if gain / plan.max_before < self.params.min_gain {
            return None;
        }
        let rate = |s: ServerId| loads.index(s).map_or(1.0, |i| loads.rate[i]);
        let cost: f64 =
            plan.moves.iter().map(|m| size_of(view.sizes, m.block) as f64 / rate(m.from).min(rate(m.to))).sum();
        if gain * self.params.horizon_iters <= cost {
            return None;
        }
        let bytes: u64 = plan.moves.iter().map(|m| size_of(view.sizes, m.block)).sum();
        Some(Decision::Migrate {
            why: format!(
                "{reason}: max service time {:.1} ms -> {:.1} ms, {} moves, {bytes} bytes, cost {:.2} s",
                plan.max_before * 1e3,
                plan.max_after * 1e3,
                plan.moves.len(),
                cost
            ),
            moves: plan.moves,
        })
    }

    /// Rule 9: a small move onto an uncertain server.
    fn probe(&mut self, view: &View, loads: &Loads, total: u64) -> Option<Decision> {
        let now = view.now_us;
        let n = loads.ids.len();
        let mean_bytes = total as f64 / n as f64;
        let uncertain: Vec<bool> = (0..n)
            .map(|i| {
                let owns = loads.bytes[i];
                (owns as f64) < FEW_BYTES * mean_bytes
                    || view
                        .load
                        .estimate(loads.ids[i], now)
                        .is_none_or(|e| e.confidence < MIN_CONFIDENCE || (owns > 0 && e.age_us > STALE_US))
            })
            .collect();
        // Reset the backoff of servers that are clearly in use again.
        self.probes.retain(|id, _| {
            loads.index(*id).is_some_and(|i| uncertain[i] || (loads.bytes[i] as f64) < 0.5 * mean_bytes)
        });
        for i in (0..n).filter(|&i| uncertain[i]) {
            let id = loads.ids[i];
            let probe = self.probes.get(&id).copied();
            if probe.is_some_and(|p| now < p.next_us) {
                continue;
            }
            let Some(src) = loads.argmax(Some(i)).filter(|&s| loads.bytes[s] > 0) else { continue };
            let from = loads.ids[src];
            let Some(block) = view
                .placement
                .blocks_of(from)
                .filter(|&b| size_of(view.sizes, b) > 0)
                .min_by_key(|&b| (size_of(view.sizes, b), b))
            else {
                continue;
            };
            let interval = probe.map_or(PROBE_INTERVAL_US, |p| p.interval_us);
            self.probes.insert(
                id,
                Probe {
                    next_us: now.saturating_add(interval),
                    interval_us: interval.saturating_mul(2).min(PROBE_MAX_INTERVAL_US),
                },
            );
            return Some(Decision::Migrate {
                moves: vec![Move { block, from, to: id }],
                why: format!(
                    "probe server {id}: uncertain estimate, {} bytes; block {block} ({} bytes) from server {from}",
                    loads.bytes[i],
                    size_of(view.sizes, block)
                ),
            });
        }
        None
    }
}

/// Bytes and rates of the servers under consideration, by index into sorted ids.
#[derive(Clone, Debug)]
struct Loads {
    ids: Vec<ServerId>,
    rate: Vec<f64>,
    bytes: Vec<u64>,
}

impl Loads {
    fn new(placement: &Placement, sizes: &[u64], servers: &[ServerId], rates: &BTreeMap<ServerId, f64>) -> Self {
        let mut ids = servers.to_vec();
        ids.sort_unstable();
        ids.dedup();
        let valid = |s: &ServerId| rates.get(s).copied().filter(|r| r.is_finite() && *r > 0.0);
        let known: Vec<f64> = ids.iter().filter_map(valid).collect();
        let fallback = median(&known).unwrap_or(1.0);
        let rate = ids.iter().map(|s| valid(s).unwrap_or(fallback)).collect();
        let mut bytes = vec![0u64; ids.len()];
        for (block, owner) in placement.owners.iter().enumerate() {
            if let Ok(i) = ids.binary_search(owner) {
                bytes[i] = bytes[i].saturating_add(sizes.get(block).copied().unwrap_or(0));
            }
        }
        Self { ids, rate, bytes }
    }

    fn index(&self, server: ServerId) -> Option<usize> {
        self.ids.binary_search(&server).ok()
    }

    fn time(&self, i: usize) -> f64 {
        self.bytes[i] as f64 / self.rate[i]
    }

    /// Service time of server `i` with `extra` more bytes.
    fn time_with(&self, i: usize, extra: u64) -> f64 {
        self.bytes[i].saturating_add(extra) as f64 / self.rate[i]
    }

    fn max_time(&self) -> f64 {
        (0..self.ids.len()).map(|i| self.time(i)).fold(0.0, f64::max)
    }

    /// The server with the largest service time (ties: lowest id), except `skip`.
    fn argmax(&self, skip: Option<usize>) -> Option<usize> {
        (0..self.ids.len())
            .filter(|&i| Some(i) != skip)
            .min_by(|&a, &b| self.time(b).total_cmp(&self.time(a)).then(a.cmp(&b)))
    }

    fn times(&self) -> BTreeMap<ServerId, f64> {
        self.ids.iter().enumerate().map(|(i, &id)| (id, self.time(i))).collect()
    }

    /// Per server: the blocks it owns, grouped by size.
    fn owned_blocks(&self, placement: &Placement, sizes: &[u64]) -> Vec<BTreeMap<u64, BTreeSet<BlockId>>> {
        let mut owned = vec![BTreeMap::<u64, BTreeSet<BlockId>>::new(); self.ids.len()];
        for (block, owner) in placement.owners.iter().enumerate() {
            if let Some(i) = self.index(*owner) {
                owned[i].entry(size_of(sizes, block as BlockId)).or_default().insert(block as BlockId);
            }
        }
        owned
    }
}

/// The greedy of [`rebalance`] and [`fill`]: moves off the max server while a move lowers
/// `max(T_from, T_to)` below the current `T_from`; `only_to` restricts the destination.
fn greedy(
    loads: &mut Loads,
    owned: &mut [BTreeMap<u64, BTreeSet<BlockId>>],
    only_to: Option<usize>,
    budget: u64,
) -> Vec<Move> {
    let mut moves = Vec::new();
    let mut used = 0u64;
    let n = loads.ids.len();
    // (pair max, T_to, block, destination, size)
    type Candidate = (f64, f64, BlockId, usize, u64);
    let better = |a: &Candidate, b: &Candidate| {
        a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)).then(a.2.cmp(&b.2)).then(a.3.cmp(&b.3)) == Ordering::Less
    };
    while let Some(src) = loads.argmax(None) {
        let t_src = loads.time(src);
        if t_src <= 0.0 || Some(src) == only_to {
            break;
        }
        let remaining = budget - used;
        if remaining == 0 {
            break;
        }
        let mut best: Option<Candidate> = None;
        for (&size, set) in owned[src].range(1..=remaining) {
            let Some(&block) = set.first() else { continue };
            let t_from = (loads.bytes[src] - size) as f64 / loads.rate[src];
            for dst in (0..n).filter(|&d| d != src && only_to.is_none_or(|o| o == d)) {
                let t_to = loads.time_with(dst, size);
                let pair = t_from.max(t_to);
                if pair >= t_src * (1.0 - EPS) {
                    continue;
                }
                let candidate = (pair, t_to, block, dst, size);
                if best.is_none_or(|b| better(&candidate, &b)) {
                    best = Some(candidate);
                }
            }
        }
        let Some((_, _, block, dst, size)) = best else { break };
        if let Some(set) = owned[src].get_mut(&size) {
            set.remove(&block);
            if set.is_empty() {
                owned[src].remove(&size);
            }
        }
        loads.bytes[src] -= size;
        loads.bytes[dst] += size;
        used += size;
        moves.push(Move { block, from: loads.ids[src], to: loads.ids[dst] });
    }
    moves
}

fn size_of(sizes: &[u64], block: BlockId) -> u64 {
    sizes.get(block as usize).copied().unwrap_or(0)
}

fn mean(values: &[f64]) -> Option<f64> {
    if values.is_empty() { None } else { Some(values.iter().sum::<f64>() / values.len() as f64) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng, rngs::StdRng};

    const S: u64 = 1_000_000;
    const MIB: u64 = 1 << 20;
    const MB: f64 = 1e6;

    fn rates(pairs: &[(ServerId, f64)]) -> BTreeMap<ServerId, f64> {
        pairs.iter().copied().collect()
    }

    /// Applies `moves` in order, checking each one takes a block from its owner.
    fn apply(placement: &mut Placement, moves: &[Move]) {
        let epoch = placement.epoch + 1;
        for m in moves {
            assert_eq!(placement.owner(m.block), Some(m.from), "{m:?} from a server that does not own it");
            placement.apply(m.block, m.to, epoch).unwrap();
        }
    }

    fn count(placement: &Placement, server: ServerId) -> usize {
        placement.blocks_of(server).count()
    }

    #[test]
    fn service_times_use_the_median_rate_for_unknown_servers() {
        let p = Placement { epoch: 1, owners: vec![0, 0, 1, 2, 3] };
        let sizes = [100, 100, 100, 100, 100];
        let t = service_times(&p, &sizes, &[0, 1, 2, 3], &rates(&[(0, 100.0), (1, 50.0), (2, 200.0)]));
        assert_eq!(t[&0], 2.0);
        assert_eq!(t[&1], 2.0);
        assert_eq!(t[&2], 0.5);
        assert_eq!(t[&3], 1.0); // median of 50, 100, 200
        let relative = service_times(&p, &sizes, &[0, 1], &BTreeMap::new());
        assert_eq!(relative, rates(&[(0, 200.0), (1, 100.0)]));
        assert_eq!(stragglers(&t, 0.2), vec![0, 1]); // median 1.5
        assert_eq!(stragglers(&rates(&[(0, 1.0), (1, 1.1), (2, 1.0)]), 0.2), Vec::<ServerId>::new());
        assert!(stragglers(&BTreeMap::new(), 0.2).is_empty());
    }

    #[test]
    fn rebalance_moves_only_off_a_slow_server_to_near_the_optimum() {
        let sizes = vec![MIB; 40];
        let p = Placement { epoch: 1, owners: (0..40).map(|b| b % 4).collect() };
        let r = rates(&[(0, 100.0 * MB), (1, 25.0 * MB), (2, 100.0 * MB), (3, 100.0 * MB)]);
        let params = BalanceParams::new(1, 4);
        let plan = rebalance(&p, &sizes, &[0, 1, 2, 3], &r, &params);
        assert!(!plan.moves.is_empty());
        assert!(plan.moves.iter().all(|m| m.from == 1 && m.to != 1), "{:?}", plan.moves);
        let bound = (40 * MIB) as f64 / (325.0 * MB);
        assert!(plan.max_after <= bound * 1.15, "max after {} vs bound {bound}", plan.max_after);
        assert!(plan.max_after >= bound * (1.0 - 1e-9));
        assert!((plan.moves.len() as u64) * MIB <= params.budget_bytes);
        let mut after = p.clone();
        apply(&mut after, &plan.moves);
        let t = service_times(&after, &sizes, &[0, 1, 2, 3], &r);
        assert!((t.values().copied().fold(0.0, f64::max) - plan.max_after).abs() < 1e-12);
        // Deterministic.
        assert_eq!(rebalance(&p, &sizes, &[3, 2, 1, 0], &r, &params), plan);

        // Within the budget: 3 MiB allows three moves.
        let small = BalanceParams { budget_bytes: 3 * MIB, ..params };
        let plan = rebalance(&p, &sizes, &[0, 1, 2, 3], &r, &small);
        assert_eq!(plan.moves.len(), 3);
        assert!(plan.max_after < plan.max_before);
    }

    #[test]
    fn rebalance_leaves_a_balanced_placement_alone() {
        let sizes = vec![MIB; 40];
        let p = Placement { epoch: 1, owners: (0..40).map(|b| b % 4).collect() };
        let r = rates(&[(0, 100.0 * MB), (1, 100.0 * MB), (2, 100.0 * MB), (3, 100.0 * MB)]);
        let plan = rebalance(&p, &sizes, &[0, 1, 2, 3], &r, &BalanceParams::new(1, 4));
        assert!(plan.moves.is_empty());
        assert_eq!(plan.max_before, plan.max_after);
    }

    #[test]
    fn rebalance_spreads_a_skewed_placement() {
        // Server 0 holds 28 of 40 equal blocks (70%).
        let sizes = vec![MIB; 40];
        let owners = (0..40).map(|b| if b < 28 { 0 } else { 1 + (b % 3) }).collect();
        let p = Placement { epoch: 1, owners };
        let r = rates(&[(0, 100.0 * MB), (1, 100.0 * MB), (2, 100.0 * MB), (3, 100.0 * MB)]);
        let plan = rebalance(&p, &sizes, &[0, 1, 2, 3], &r, &BalanceParams::new(1, 4));
        assert!(plan.moves.iter().all(|m| m.from == 0));
        let mut after = p.clone();
        apply(&mut after, &plan.moves);
        for s in 0..4 {
            assert_eq!(count(&after, s), 10, "server {s} in {after:?}");
        }
        assert!((plan.max_after - (10 * MIB) as f64 / (100.0 * MB)).abs() < 1e-12);
    }

    #[test]
    fn drain_and_fill_best_fit() {
        let sizes = vec![400, 300, 200, 100, 100, 100];
        let p = Placement { epoch: 1, owners: vec![0, 0, 1, 1, 2, 2] };
        let r = rates(&[(0, 1.0), (1, 1.0), (2, 1.0)]);
        // Drain 0: 400 to the least loaded (1 and 2 have 300 and 200: to 2), then 300 to 1.
        let moves = drain(&p, &sizes, 0, &[1, 2], &r);
        assert_eq!(moves, vec![Move { block: 0, from: 0, to: 2 }, Move { block: 1, from: 0, to: 1 }]);
        assert_eq!(drain(&p, &sizes, 0, &[0], &r), vec![]);
        // Fill a new server 3 owning nothing: it takes from the heaviest while the max drops.
        let moves = fill(&p, &sizes, 3, &[0, 1, 2, 3], &r);
        assert!(moves.iter().all(|m| m.to == 3));
        assert_eq!(moves[0], Move { block: 1, from: 0, to: 3 });
        let mut after = p.clone();
        apply(&mut after, &moves);
        let t = service_times(&after, &sizes, &[0, 1, 2, 3], &r);
        assert!(t.values().copied().fold(0.0, f64::max) <= 400.0);
        assert!(t[&3] >= 200.0, "{t:?}");
    }

    /// A cluster driven second by second: workers report samples drawn from the true
    /// rates (with seeded noise), migrations finish within the next second, a requested
    /// server joins two seconds later.
    struct Sim {
        now: u64,
        sizes: Vec<u64>,
        placement: Placement,
        servers: Vec<ServerId>,
        /// True rate of a server (bytes/s) at a time (µs).
        rate: Box<dyn Fn(ServerId, u64) -> f64>,
        noise: f64,
        rng: StdRng,
        workers: u32,
        load: LoadModel,
        balancer: Balancer,
        pending: Vec<Move>,
        stopping: Option<ServerId>,
        join: Option<(ServerId, u64)>,
        next_id: ServerId,
        /// A fixed iteration time (worker-bound job); else 20 ms + the max service time.
        iter_fixed: Option<f64>,
        /// Report no iteration times at all.
        no_iter: bool,
        log: Vec<(u64, Decision)>,
        /// Blocks owned per server after each tick.
        history: Vec<(u64, BTreeMap<ServerId, usize>)>,
    }

    impl Sim {
        /// `n` servers owning 24 blocks of 1 MiB round-robin.
        fn new(n: u32, min: u32, max: u32, rate: impl Fn(ServerId, u64) -> f64 + 'static) -> Self {
            let blocks = 24;
            Sim {
                now: 0,
                sizes: vec![MIB; blocks],
                placement: Placement { epoch: 1, owners: (0..blocks as u32).map(|b| b % n).collect() },
                servers: (0..n).collect(),
                rate: Box::new(rate),
                noise: 0.1,
                rng: StdRng::seed_from_u64(7),
                workers: 2,
                load: LoadModel::new(3 * S),
                balancer: Balancer::new(BalanceParams::new(min, max)),
                pending: Vec::new(),
                stopping: None,
                join: None,
                next_id: n,
                iter_fixed: None,
                no_iter: false,
                log: Vec::new(),
                history: Vec::new(),
            }
        }

        fn owned_bytes(&self) -> BTreeMap<ServerId, u64> {
            let mut bytes = BTreeMap::new();
            for (b, &o) in self.placement.owners.iter().enumerate() {
                *bytes.entry(o).or_insert(0) += self.sizes[b];
            }
            bytes
        }

        fn tick(&mut self) {
            let now = self.now;
            if let Some((id, at)) = self.join
                && now >= at
            {
                self.servers.push(id);
                self.balancer.joined(id, now);
                self.join = None;
            }
            let owned = self.owned_bytes();
            let mut max_t: f64 = 0.0;
            for (&s, &bytes) in &owned {
                let truth = (self.rate)(s, now);
                max_t = max_t.max(bytes as f64 / truth);
                for _ in 0..self.workers {
                    let r = truth * (1.0 + self.noise * (2.0 * self.rng.random::<f64>() - 1.0));
                    self.load.observe(s, bytes, (bytes as f64 / r * 1e6).round() as u64, now);
                }
            }
            let iter_us = self.iter_fixed.unwrap_or(20_000.0 + max_t * 1e6);
            let busy = !self.pending.is_empty() || self.stopping.is_some();
            let decisions = self.balancer.step(&View {
                now_us: now,
                placement: &self.placement,
                sizes: &self.sizes,
                servers: &self.servers,
                load: &self.load,
                iter_us: (!self.no_iter).then_some(iter_us),
                busy,
            });
            assert!(!busy || decisions.is_empty(), "decided while busy: {decisions:?}");
            assert!(decisions.len() <= 1);
            // Migrations queued last second finish now.
            if busy {
                let moves = std::mem::take(&mut self.pending);
                apply(&mut self.placement, &moves);
                if let Some(s) = self.stopping.take() {
                    assert_eq!(count(&self.placement, s), 0, "stopped server {s} still owns blocks");
                    self.load.remove(s);
                }
            }
            for d in decisions {
                match &d {
                    Decision::Migrate { moves, .. } => {
                        let mut seen = BTreeSet::new();
                        for m in moves {
                            assert!(seen.insert(m.block), "block {} moved twice in {moves:?}", m.block);
                            assert_eq!(self.placement.owners[m.block as usize], m.from);
                            assert!(self.servers.contains(&m.to) && m.from != m.to, "{m:?}");
                        }
                        self.pending.extend(moves.iter().copied());
                    }
                    Decision::ScaleOut { .. } => {
                        assert!(self.join.is_none());
                        self.join = Some((self.next_id, now + 2 * S));
                        self.next_id += 1;
                    }
                    Decision::ScaleIn { server, .. } => {
                        self.servers.retain(|s| s != server);
                        let r = self.load.rates(now);
                        let moves = drain(&self.placement, &self.sizes, *server, &self.servers, &r);
                        self.pending.extend(moves);
                        self.stopping = Some(*server);
                    }
                    Decision::Keep { .. } => {}
                }
                self.log.push((now, d));
            }
            let counts = self.servers.iter().map(|&s| (s, count(&self.placement, s))).collect();
            self.history.push((now, counts));
            self.now += S;
        }

        fn run_until(&mut self, t: u64) {
            while self.now < t {
                self.tick();
            }
        }

        fn decisions(&self, from: u64, to: u64) -> Vec<&Decision> {
            self.log.iter().filter(|(t, _)| *t >= from && *t < to).map(|(_, d)| d).collect()
        }

        fn migrations(&self) -> Vec<(u64, &Vec<Move>, &String)> {
            self.log
                .iter()
                .filter_map(|(t, d)| match d {
                    Decision::Migrate { moves, why } => Some((*t, moves, why)),
                    _ => None,
                })
                .collect()
        }
    }

    fn base(rate: f64) -> impl Fn(ServerId, u64) -> f64 {
        move |_, _| rate * MB
    }

    #[test]
    fn scenario_a_bandwidth_straggler_is_relieved_then_settles() {
        let mut sim = Sim::new(4, 1, 4, |s, _| if s == 1 { 25.0 * MB } else { 100.0 * MB });
        sim.run_until(100 * S);
        let migrations = sim.migrations();
        assert!(!migrations.is_empty(), "no reaction to the straggler");
        for (_, moves, why) in &migrations {
            assert!(moves.iter().all(|m| m.from == 1), "{why}: {moves:?}");
        }
        let (last, _, _) = migrations.last().unwrap();
        assert!(*last < 20 * S, "still moving at {last}: {:?}", sim.log);
        assert!(sim.decisions(20 * S, 100 * S).is_empty(), "no settling: {:?}", sim.log);
        let n1 = count(&sim.placement, 1);
        assert!((1..=3).contains(&n1), "server 1 should keep about a quarter share: {n1}");
    }

    #[test]
    fn scenario_b_no_straggler_and_noise_never_flaps() {
        let mut sim = Sim::new(4, 1, 8, base(100.0));
        sim.noise = 0.15;
        sim.run_until(300 * S);
        assert!(sim.log.is_empty(), "{:?}", sim.log);
        // With fewer samples (one worker) still nothing.
        let mut sim = Sim::new(4, 1, 8, base(100.0));
        sim.noise = 0.15;
        sim.workers = 1;
        sim.rng = StdRng::seed_from_u64(99);
        sim.run_until(300 * S);
        assert!(sim.log.is_empty(), "{:?}", sim.log);
    }

    #[test]
    fn scenario_c_reacts_after_a_straggler_appears_not_before() {
        let mut sim = Sim::new(4, 1, 4, |s, t| if s == 2 && t >= 30 * S { 25.0 * MB } else { 100.0 * MB });
        sim.run_until(90 * S);
        assert!(sim.decisions(0, 30 * S).is_empty(), "{:?}", sim.log);
        let (t, moves, _) = sim.migrations().first().copied().expect("no reaction");
        assert!((30 * S..40 * S).contains(&t), "reacted at {t}");
        assert!(moves.iter().all(|m| m.from == 2));
        assert!(count(&sim.placement, 2) < 6);
    }

    /// Three servers, server 1 at a tenth of the others' rate: moving cannot reach the target.
    fn slow_one(max: u32) -> Sim {
        Sim::new(3, 3, max, |s, _| if s == 1 { 10.0 * MB } else { 100.0 * MB })
    }

    /// The decisions of a scale-out trial: (ScaleOut time, fill, verdict).
    fn trial(sim: &Sim) -> (u64, Vec<Move>, (u64, Decision)) {
        let i = sim.log.iter().position(|(_, d)| matches!(d, Decision::ScaleOut { .. })).expect("no scale-out");
        let t_out = sim.log[i].0;
        for (_, d) in &sim.log[..i] {
            assert!(matches!(d, Decision::Migrate { .. }), "before the scale-out: {d:?}");
        }
        let Decision::Migrate { moves, why } = &sim.log[i + 1].1 else { panic!("no fill: {:?}", sim.log) };
        assert!(why.starts_with("fill"), "{why}");
        (t_out, moves.clone(), sim.log[i + 2].clone())
    }

    #[test]
    fn scenario_d_scale_out_is_kept_when_iterations_speed_up() {
        let mut sim = slow_one(4);
        sim.run_until(60 * S);
        let (t_out, fill_moves, (t_verdict, verdict)) = trial(&sim);
        // Exploit first, then scale out.
        let first = sim.migrations()[0];
        assert!(first.0 < t_out && first.1.iter().all(|m| m.from == 1));
        assert!(!fill_moves.is_empty() && fill_moves.iter().all(|m| m.to == 3));
        assert_eq!(verdict, Decision::Keep { server: 3, why: verdict_why(&verdict) });
        assert!(t_verdict >= t_out + 2 * S + 8 * S, "verdict at {t_verdict}, scale-out at {t_out}");
        assert!(sim.servers.contains(&3) && count(&sim.placement, 3) >= 6);
        // max_servers reached: never another scale-out.
        assert_eq!(sim.log.iter().filter(|(_, d)| matches!(d, Decision::ScaleOut { .. })).count(), 1);
    }

    fn verdict_why(d: &Decision) -> String {
        match d {
            Decision::Keep { why, .. } | Decision::ScaleIn { why, .. } => why.clone(),
            _ => String::new(),
        }
    }

    #[test]
    fn scenario_d_scale_out_is_reverted_when_iterations_do_not_improve() {
        let mut sim = slow_one(4);
        sim.iter_fixed = Some(200_000.0); // worker-bound: servers do not matter
        sim.run_until(100 * S);
        let (_, fill_moves, (t_verdict, verdict)) = trial(&sim);
        assert!(fill_moves.iter().all(|m| m.to == 3));
        assert!(matches!(verdict, Decision::ScaleIn { server: 3, .. }), "{verdict:?}");
        assert!(!sim.servers.contains(&3));
        // Held off for 60 s after the revert.
        assert!(
            !sim.decisions(t_verdict + 1, t_verdict + 60 * S).iter().any(|d| matches!(d, Decision::ScaleOut { .. })),
            "{:?}",
            sim.log
        );
    }

    #[test]
    fn scenario_d_without_iteration_times_judges_by_predicted_service_time() {
        let mut sim = slow_one(4);
        sim.no_iter = true;
        sim.run_until(60 * S);
        let (_, _, (_, verdict)) = trial(&sim);
        assert!(matches!(&verdict, Decision::Keep { server: 3, why } if why.contains("predicted")), "{verdict:?}");
    }

    #[test]
    fn scenario_e_never_scales_out_beyond_max_servers() {
        let mut sim = slow_one(3);
        sim.run_until(120 * S);
        assert!(!sim.migrations().is_empty());
        assert!(
            sim.log.iter().all(|(_, d)| !matches!(d, Decision::ScaleOut { .. } | Decision::ScaleIn { .. })),
            "{:?}",
            sim.log
        );
        assert_eq!(sim.servers, vec![0, 1, 2]);
    }

    /// Four servers, server 3 owns nothing.
    fn with_empty_server(min: u32) -> Sim {
        let mut sim = Sim::new(4, min, 4, base(100.0));
        sim.placement = Placement { epoch: 1, owners: (0..24).map(|b| b % 3).collect() };
        sim
    }

    #[test]
    fn scenario_f_empty_server_is_scaled_in_above_min_servers() {
        let mut sim = with_empty_server(3);
        sim.run_until(60 * S);
        assert!(matches!(sim.log.first(), Some((_, Decision::ScaleIn { server: 3, .. }))), "{:?}", sim.log);
        assert_eq!(sim.log.len(), 1, "{:?}", sim.log);
        assert_eq!(sim.servers, vec![0, 1, 2]);
    }

    #[test]
    fn scenario_f_empty_server_at_min_servers_is_not_scaled_in_but_used() {
        let mut sim = with_empty_server(4);
        sim.run_until(60 * S);
        assert!(sim.log.iter().all(|(_, d)| matches!(d, Decision::Migrate { .. })), "{:?}", sim.log);
        assert_eq!(sim.servers, vec![0, 1, 2, 3]);
        assert_eq!(count(&sim.placement, 3), 6, "{:?}", sim.placement);
    }

    #[test]
    fn scenario_g_recovered_straggler_is_probed_and_wins_its_blocks_back() {
        let mut sim = Sim::new(3, 3, 3, |s, t| if s == 1 && t < 60 * S { 5.0 * MB } else { 100.0 * MB });
        sim.run_until(150 * S);
        // While slow it holds at most a probe block.
        for (t, counts) in &sim.history {
            if (8 * S..60 * S).contains(t) {
                assert!(counts[&1] <= 1, "at {t}: {counts:?}");
            }
        }
        let probes: Vec<_> = sim.migrations().into_iter().filter(|(_, _, why)| why.starts_with("probe")).collect();
        assert!(probes.iter().all(|(_, moves, _)| moves.len() == 1 && moves[0].to == 1));
        assert!(probes.iter().any(|(t, _, _)| *t < 60 * S), "no probe while slow");
        let probe_times: Vec<u64> = probes.iter().map(|(t, _, _)| *t).collect();
        for w in probe_times.windows(2) {
            assert!(w[1] - w[0] >= PROBE_INTERVAL_US, "probes too close: {probe_times:?}");
        }
        let after = probes.iter().find(|(t, _, _)| *t >= 60 * S).expect("no probe after the recovery").0;
        assert!(after <= 60 * S + PROBE_MAX_INTERVAL_US + 5 * S);
        // Then it wins its blocks back in one exploit round.
        assert!(
            sim.migrations().iter().any(|(t, moves, _)| *t > after && moves.iter().filter(|m| m.to == 1).count() >= 5),
            "{:?}",
            sim.log
        );
        assert!(count(&sim.placement, 1) >= 7, "{:?}", sim.placement);
        let last = sim.log.last().unwrap().0;
        assert!(sim.decisions(last + 1, 150 * S).is_empty());
    }

    #[test]
    fn waits_for_confidence_and_cooldown() {
        // All 8 blocks on server 0, server 1 empty and unmeasured.
        let sizes = vec![MIB; 8];
        let p = Placement { epoch: 1, owners: vec![0; 8] };
        let servers = [0, 1];
        let mut b = Balancer::new(BalanceParams::new(2, 4));
        let step = |b: &mut Balancer, load: &LoadModel, now_us, busy| {
            b.step(&View { now_us, placement: &p, sizes: &sizes, servers: &servers, load, iter_us: None, busy })
        };
        // No samples: nothing, even with a badly skewed placement.
        let mut load = LoadModel::new(3 * S);
        assert!(step(&mut b, &load, 0, false).is_empty());
        // One sample: confidence too low.
        load.observe(0, 8 * MIB, 80_000, 0);
        assert!(step(&mut b, &load, S, false).is_empty());
        for _ in 0..4 {
            load.observe(0, 8 * MIB, 80_000, S);
        }
        // Busy: nothing, and the cool-down restarts.
        assert!(step(&mut b, &load, S, true).is_empty());
        assert!(step(&mut b, &load, 3 * S, false).is_empty());
        let d = step(&mut b, &load, 4 * S, false);
        assert!(
            matches!(d.as_slice(), [Decision::Migrate { moves, .. }] if moves.len() == 4 && moves.iter().all(|m| m.to == 1)),
            "{d:?}"
        );
        // Right after a decision: cool-down again.
        assert!(step(&mut b, &load, 5 * S, false).is_empty());
    }

    #[test]
    fn gives_up_a_scale_out_whose_server_never_joins() {
        // Servers 0 and 2 fast and loaded, server 1 twenty times slower and empty.
        let sizes = vec![MIB; 4];
        let p = Placement { epoch: 1, owners: vec![0, 0, 2, 2] };
        let servers = [0, 1, 2];
        let mut load = LoadModel::new(3 * S);
        for _ in 0..8 {
            load.observe(0, 2 * MIB, 20_000, 0);
            load.observe(1, 2 * MIB, 400_000, 0);
            load.observe(2, 2 * MIB, 20_000, 0);
        }
        let mut b = Balancer::new(BalanceParams::new(3, 4));
        let step = |b: &mut Balancer, now_us| {
            b.step(&View {
                now_us,
                placement: &p,
                sizes: &sizes,
                servers: &servers,
                load: &load,
                iter_us: Some(1e5),
                busy: false,
            })
        };
        let d = step(&mut b, 0);
        assert!(matches!(d.as_slice(), [Decision::ScaleOut { .. }]), "{d:?}");
        assert!(b.awaiting_join());
        for now in (S..=31 * S).step_by(S as usize) {
            assert!(step(&mut b, now).is_empty(), "decided while waiting for the server");
        }
        assert!(!b.awaiting_join());
        // Held off after giving up, then asks again.
        for now in (32 * S..91 * S).step_by(S as usize) {
            let d = step(&mut b, now);
            assert!(d.iter().all(|d| !matches!(d, Decision::ScaleOut { .. })), "{d:?} at {now}");
        }
        assert!(matches!(step(&mut b, 91 * S).as_slice(), [Decision::ScaleOut { .. }]));
        // A late or unexpected join of another server is ignored outside a scale-out.
        let mut idle = Balancer::new(BalanceParams::new(1, 4));
        idle.joined(9, 0);
        assert_eq!(idle.trial_server(), None);
    }
}

#[cfg(test)]
mod proptests {
    use super::*;
    use proptest::prelude::*;

    /// servers (sparse ids), placement, sizes, rates (some missing).
    fn cluster() -> impl Strategy<Value = (Vec<ServerId>, Placement, Vec<u64>, BTreeMap<ServerId, f64>)> {
        (
            1usize..6,
            proptest::collection::vec((0u64..5000, 0usize..6), 1..40),
            proptest::collection::vec(proptest::option::of(1.0f64..1000.0), 6),
            0u32..3,
        )
            .prop_map(|(n, blocks, rates, offset)| {
                let servers: Vec<ServerId> = (0..n as u32).map(|i| i * 2 + offset).collect();
                let owners = blocks.iter().map(|&(_, o)| servers[o % n]).collect();
                let sizes = blocks.iter().map(|&(s, _)| s).collect();
                let rates = servers.iter().zip(&rates).filter_map(|(&s, r)| r.map(|r| (s, r))).collect();
                (servers, Placement { epoch: 1, owners }, sizes, rates)
            })
    }

    fn max_time(p: &Placement, sizes: &[u64], servers: &[ServerId], rates: &BTreeMap<ServerId, f64>) -> f64 {
        service_times(p, sizes, servers, rates).values().copied().fold(0.0, f64::max)
    }

    /// Applies the moves, checking each is from the block's owner, to one of `servers`,
    /// and that no block moves twice.
    fn apply_checked(p: &Placement, moves: &[Move], servers: &[ServerId]) -> Result<Placement, TestCaseError> {
        let mut after = p.clone();
        let mut seen = BTreeSet::new();
        for m in moves {
            prop_assert!(seen.insert(m.block), "block {} moved twice", m.block);
            prop_assert_eq!(after.owner(m.block), Some(m.from), "{:?} from a non-owner", m);
            prop_assert!(servers.contains(&m.to) && m.to != m.from, "{:?}", m);
            prop_assert!(after.apply(m.block, m.to, p.epoch + 1).is_ok());
        }
        prop_assert!(after.owners.iter().all(|o| servers.contains(o)));
        Ok(after)
    }

    proptest! {
        #[test]
        fn rebalance_keeps_owners_valid_and_never_raises_the_max(
            (servers, p, sizes, rates) in cluster(),
            budget in 0u64..40_000,
        ) {
            let params = BalanceParams { budget_bytes: budget, ..BalanceParams::new(1, 8) };
            let plan = rebalance(&p, &sizes, &servers, &rates, &params);
            let after = apply_checked(&p, &plan.moves, &servers)?;
            let moved: u64 = plan.moves.iter().map(|m| sizes[m.block as usize]).sum();
            prop_assert!(moved <= budget);
            let before = max_time(&p, &sizes, &servers, &rates);
            let now = max_time(&after, &sizes, &servers, &rates);
            prop_assert!((plan.max_before - before).abs() <= 1e-9 * before.max(1.0));
            prop_assert!((plan.max_after - now).abs() <= 1e-9 * now.max(1.0));
            prop_assert!(now <= before * (1.0 + 1e-12), "max rose from {} to {}", before, now);
            prop_assert_eq!(rebalance(&p, &sizes, &servers, &rates, &params), plan);
        }

        #[test]
        fn drain_moves_every_block_of_the_server_to_the_others(
            (servers, p, sizes, rates) in cluster(),
            pick in 0usize..6,
        ) {
            let server = servers[pick % servers.len()];
            let others: Vec<ServerId> = servers.iter().copied().filter(|&s| s != server).collect();
            let moves = drain(&p, &sizes, server, &servers, &rates);
            if others.is_empty() {
                prop_assert!(moves.is_empty());
            } else {
                prop_assert!(moves.iter().all(|m| m.from == server));
                let after = apply_checked(&p, &moves, &others)?;
                prop_assert_eq!(after.blocks_of(server).count(), 0);
            }
        }

        #[test]
        fn fill_only_loads_the_new_server_and_never_raises_the_max(
            (servers, p, sizes, rates) in cluster(),
        ) {
            let new = 100;
            let mut all = servers.clone();
            all.push(new);
            let moves = fill(&p, &sizes, new, &all, &rates);
            prop_assert!(moves.iter().all(|m| m.to == new));
            let after = apply_checked(&p, &moves, &all)?;
            let before = max_time(&p, &sizes, &all, &rates);
            prop_assert!(max_time(&after, &sizes, &all, &rates) <= before * (1.0 + 1e-12));
        }
    }
}
