//! The PSLD balancer: which blocks to move, when to probe, when to add or remove a server.
//!
//! # Model
//!
//! Each server `j` serves the pushes of a worker at a rate `r_j` (bytes/s, estimated by
//! [`LoadModel`]). Its *service time* per iteration is `T_j = bytes of its blocks / r_j`,
//! and a synchronous round waits for the slowest server, so the goal is to minimise
//! `max_j T_j`. The model holds only samples that measured a link
//! ([`crate::load::link_rate`]: the fixed cost of a request taken out, small frames not
//! taken), so a server without an estimate has an *unknown* rate and is assumed to run at
//! the median rate of the others (neither a straggler nor shunned: it is then tried, and
//! the verdict of rule 2 measures it).
//!
//! **The rank rule** (no thrash): no move goes onto a server the model ranks at or below its
//! source, that is one that, holding the block, would not finish before the source does now
//! with its rate [`RANK_Z`] standard errors pessimistic and the source's as many optimistic.
//! Every rule but a probe obeys it (`loads::Loads::ranks_above`, checked after each plan).
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
//! 2. **Verdicts** ([`verdict`]). After a migration round or a probe the balancer decides
//!    nothing else until its verdict: from [`TRIAL_SETTLE_US`] after the round finished,
//!    for `trial_us` (8 s, or 3 iterations if longer), it measures the iteration time and
//!    compares it with the window before ([`Window`]: a stall counts its elapsed time). It
//!    returns [`Decision::Judged`] with the record; a round that did not pay
//!    ([`verdict::pays`]) is undone by a `Migrate` back (why `revert (...)`), the cool-down
//!    doubles, and the round's sources give no block for [`REVERT_HOLDOFF_US`] (doubling).
//!    No rule decides before [`VERDICT_MIN_STEPS`] steps since the last busy one (the
//!    window before), and no round predicted to save less than [`MIN_ITER_GAIN`] of the
//!    iteration time is proposed.
//!
//!    **Scale-out trial.** After [`Decision::ScaleOut`] the balancer waits for
//!    [`Balancer::joined`] and decides nothing else (it gives up after `join_timeout_us`,
//!    30 s, which counts as a revert). The next step emits a `Migrate` with [`fill`]. Once
//!    that has finished and `trial_us` (8 s) has passed, it compares the mean `iter_us` of
//!    the trial (steps at least [`TRIAL_SETTLE_US`] after the fill finished) with the
//!    baseline (mean of the last [`BASELINE_STEPS`] `iter_us` before the scale-out, since
//!    the last busy step): improved by `keep_gain` (5%) or more -> [`Decision::Keep`],
//!    otherwise [`Decision::ScaleIn`] of the new server (a revert), each after a
//!    [`Decision::Judged`]; a stall counts as in rule 2. Without iteration
//!    times it compares the predicted max service time instead. After a revert no
//!    scale-out for [`REVERT_HOLDOFF_US`] (60 s), doubling with each consecutive revert up
//!    to 16x; a `Keep` resets the doubling.
//!
//!    **2b. Split.** In the steady phase, a row block that the server holding it reports a
//!    split point for (`View::splittable`) and whose size is above `(1 + threshold)`
//!    times the fair share, `total bytes / servers`, is split there
//!    ([`Decision::Split`], [`split::heavy_row_block`]): no placement can balance it
//!    whole. The heaviest first, one per step; a split restarts no cool-down.
//! 3. **Cool-down.** Nothing else until the cool-down has passed.
//! 4. **Confidence gate.** Nothing until some server in `servers` has an estimate and
//!    every one that has an estimate and owns bytes has a confidence of at least
//!    [`MIN_CONFIDENCE`] (0.5; see [`crate::load`]). The model takes only samples that
//!    measured a link ([`crate::load::link_rate`]): a server without an estimate has an
//!    unknown rate and runs at the median one, and does not hold the gate.
//! 5. **Exploit.** If some server is a straggler, [`rebalance`] within
//!    [`BalanceParams::budget`] (64 MiB per started [`BUDGET_SERVERS`] servers), by the rank
//!    rule, and emit `Migrate` only if the max service time drops by `min_gain` (10%)
//!    or more AND the gain over `horizon_iters` (50) iterations,
//!    `(max_before - max_after) * horizon_iters` seconds, exceeds the migration cost,
//!    `Σ bytes / min(rate of source, rate of destination)` seconds. No rule acts while
//!    a straggler has lasted less than [`STRAGGLE_MIN_US`] (or 3 iterations). The round
//!    carries out the plan's first moves, as many as fit in [`ROUND_US`] (or 3
//!    iterations) at [`View::migration_us`] a move (an iteration before any was seen,
//!    at most [`FIRST_ROUND_MOVES`]); the next rounds do the rest.
//!
//!    **5c. Compress** (opt-in, [`BalanceParams::compress`], `--balance-compress bf16`;
//!    [`wire`]). The model counts each block's bytes on the wire ([`View::wire`],
//!    [`wire_sizes`]) and servers measure their rates in wire bytes. The worst lasting
//!    straggler whose time is bytes over its link (the share of its measured time its
//!    handling takes, [`View::fixed_share`], at most [`wire::MAX_FIXED_SHARE`]) gets all
//!    its blocks sent in the narrower dtype ([`Decision::Wire`]) instead of the round of
//!    rule 5 when that is predicted to bring the max service time at least as low
//!    (`T_j` after = `max(narrow bytes / rate, fixed share * T_j)`), by the gain tests
//!    of rule 5 (no migration cost). Judged by rule 2 like a round: a revert sets the
//!    blocks back to f32, doubles the cool-down and holds that server's compression off
//!    for [`REVERT_HOLDOFF_US`], doubling. Like a round, it excludes every other decision
//!    while it is judged.
//! 6. **Scale out.** If `servers.len() < max_servers`, no hold-off runs, and even the best
//!    unbudgeted [`rebalance`] leaves `max T > (1 + threshold) * target`, where the target
//!    `total bytes / (n * median rate)` is the max service time of `n` servers all as fast
//!    as the median one with the load spread evenly: rebalancing cannot reach the target
//!    (and the fill of one more server at the median rate would save [`MIN_ITER_GAIN`] of
//!    the iteration time), so emit `ScaleOut` (the baseline is remembered) and run the trial of rule 2.
//! 7. **Scale in.** If `servers.len() > max(min_servers, 1)`: a server that owns no block,
//!    or whose service time has been below [`IDLE_FRACTION`] (10%) of the max for
//!    [`IDLE_US`] (10 s), is drained and stopped (`ScaleIn`) if draining it raises the
//!    predicted max service time by at most [`SCALE_IN_MAX_RAISE`] (5%). Candidates are
//!    tried from the smallest service time, ties to the highest id (the newest server).
//! 8. **Under-loaded server.** If the max service time exceeds the perfectly balanced one,
//!    `total bytes / Σ rates`, by more than `threshold` (no server straggles but one has
//!    too little, e.g. a straggler that recovered), the exploit of rule 5 with the same
//!    gain and cost tests.
//! 9. **Explore (re-probe).** A server is *uncertain* if its estimate is below the
//!    median rate and it is in doubt: its confidence is below [`MIN_CONFIDENCE`], it owns
//!    blocks but has had no sample for [`STALE_US`] (5 s), or it owns less than
//!    [`FEW_BYTES`] (10%) of the mean bytes per server (a straggler that gave its blocks
//!    away). A server without an estimate is not probed: it runs at the median rate. The first uncertain server (in id order)
//!    whose probe time has come gets the smallest block of the server with the largest
//!    service time, so that fresh samples come in (unless that would leave the source with
//!    less than [`FEW_BYTES`] of the mean): a recovered straggler wins its blocks back
//!    through rule 5 or 8. Probes of one server are [`PROBE_INTERVAL_US`] (10 s)
//!    apart, doubling with each further probe up to [`PROBE_MAX_INTERVAL_US`] (60 s) so a
//!    server that stays slow costs little; the interval resets once the server carries at
//!    least half the mean bytes with a certain estimate.
//!
//! Scale-out and scale-in are never proposed in the same step. Hysteresis comes from the
//! straggler threshold, the gain and cost tests, the cool-down, the idle time, the probe
//! intervals and the scale-out hold-off.
//!
//! # Layout: one module per rule, each with its post-condition
//!
//! Like quickwit's scheduling `solve`, the step runs in phases and each phase's plan is
//! checked after it (in debug builds, so in every test): [`Balancer::step`] and the
//! control-loop types are here; [`wire`] rule 5c with [`compress_plan`] (check: only the
//! straggler's blocks, each wider than the dtype, max not worse); [`exploit`] holds rules 5 and 8 with [`rebalance`] and
//! [`stragglers`] (check: no block lost, budget kept, max service time not worse);
//! `explore` rule 9 (check: one real move onto the uncertain server); [`scale_out`] rule 6,
//! the trial of rule 2 and [`fill`] (check: moves only onto the new server, max not
//! worse); [`scale_in`] rule 7 and [`drain`] (check: the drained server owns nothing);
//! `loads` the shared [`service_times`], the greedy best fit and the plan check every
//! phase starts from.

use std::collections::{BTreeMap, BTreeSet};

use crate::dtype::Dtype;
use crate::load::LoadModel;
use crate::model::BlockId;
use crate::placement::{Placement, ServerId};

pub mod exploit;
mod explore;
mod loads;
pub mod scale_in;
pub mod scale_out;
pub mod split;
#[cfg(test)]
mod tests;
pub mod verdict;
pub mod wire;

pub use exploit::{rebalance, stragglers};
use loads::{Loads, Tabu};
pub use loads::{RANK_Z, service_times};
pub use scale_in::drain;
pub use scale_out::fill;
pub use verdict::{Verdict, Window};
pub use wire::{Compression, compress_plan, wire_sizes};

/// A round of moves lasts about this long at most, or [`verdict::WINDOW_ITERATIONS`]
/// iterations if longer: it has as many moves as migrations take in that time
/// ([`View::migration_us`]).
pub const ROUND_US: u64 = 10_000_000;
/// Moves of a round before any migration was seen to take its time.
pub const FIRST_ROUND_MOVES: usize = 16;

/// A straggler is relieved (rule 5) once it has straggled this long, or
/// [`verdict::WINDOW_ITERATIONS`] iterations if longer: a round takes about as long, and
/// one made for a straggler that is gone by its end is a loss, and its revert another.
pub const STRAGGLE_MIN_US: u64 = 10_000_000;

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
/// The budget of one round grows by `budget_bytes` per this many servers ([`BalanceParams::budget`]).
pub const BUDGET_SERVERS: usize = 16;
/// Number of recent steps whose iteration times make the baseline of a decision.
pub const BASELINE_STEPS: usize = 10;
/// Steps of baseline a decision needs before it is made (so that it can be judged).
pub const VERDICT_MIN_STEPS: usize = 5;
/// A migration round must be predicted to save this share of the iteration time (when
/// the job reports one): a smaller gain would not show in the verdict's measurement.
pub const MIN_ITER_GAIN: f64 = 0.05;

/// Tuning of the balancer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BalanceParams {
    /// Straggler: service time > median * (1 + threshold); default 0.2.
    pub threshold: f64,
    /// Act only if the predicted max service time drops by this fraction; default 0.1.
    pub min_gain: f64,
    /// Bytes moved per round at most, per [`BUDGET_SERVERS`] servers (a cluster of 100
    /// servers moves 7 times as much per round as one of 16); default 64 MiB.
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
    /// Rule 5c (`--balance-compress`): the dtype a bandwidth-bound straggler's blocks may
    /// be sent in instead of being moved; `None` (the default): never.
    pub compress: Option<Dtype>,
}

impl BalanceParams {
    /// Bytes one round may move in a cluster of `servers` servers: `budget_bytes` per
    /// started [`BUDGET_SERVERS`] servers, so the stragglers of a large cluster are
    /// relieved in as many rounds as those of a small one.
    pub fn budget(&self, servers: usize) -> u64 {
        let shares = servers.div_ceil(BUDGET_SERVERS).max(1) as u64;
        self.budget_bytes.saturating_mul(shares)
    }

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
            compress: None,
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
    /// Mean time of the iterations the workers completed since the last step, µs
    /// (`None`: none completed, or the job reports no iteration times).
    pub iter_us: Option<f64>,
    /// Iterations the workers completed since the last step (summed over workers): with
    /// none, a stall, the time since the last completed one counts ([`Window`]).
    pub iterations: u64,
    /// Migrations queued or in flight: decide nothing.
    pub busy: bool,
    /// How long a migration has been taking, µs (the mean of the last ones; `None`
    /// before any): a round has as many moves as fit in [`ROUND_US`].
    pub migration_us: Option<f64>,
    /// Row blocks that may be split, each with the row its server reports to split it at
    /// (rule 2b, [`split::heavy_row_block`]).
    pub splittable: &'a BTreeMap<BlockId, u64>,
    /// The wire dtype of each block, indexed by block id (f32 past the end: an empty
    /// slice is every block in f32). The model counts a block's bytes on the wire
    /// ([`wire_sizes`]).
    pub wire: &'a [Dtype],
    /// Per server, the share of its measured time that bytes do not cost (its handling
    /// time over the longer of that and its frames' time on the link): rule 5c compresses
    /// only a server with a low one. A server without an entry is not compressed.
    pub fixed_share: &'a BTreeMap<ServerId, f64>,
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
    /// Split row block `block` at row `at` into two blocks on its owner (rule 2b), which
    /// later moves may place apart.
    Split {
        /// The row block.
        block: BlockId,
        /// The first row of the second half.
        at: u64,
        /// Why, for the event log.
        why: String,
    },
    /// The verdict on an earlier decision (rule 2), for the report; a revert comes with
    /// it as a `Migrate` (or `ScaleIn`).
    Judged(Verdict),
    /// Send these blocks in `dtype` from now on (rule 5c; `F32` undoes a compression): the
    /// layout names each block's wire dtype, and its epoch goes up.
    Wire {
        /// The blocks, each at most once.
        blocks: Vec<BlockId>,
        /// Their wire dtype.
        dtype: Dtype,
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
    AwaitJoin { asked_us: u64, baseline: Baseline, predicted: f64 },
    /// The server joined; the next step gives it its load.
    Filling { server: ServerId, joined_us: u64, baseline: Baseline, predicted: f64 },
    /// The server has its load; measuring in `window`.
    Trial { server: ServerId, baseline: Baseline, predicted: f64, window: Window },
    /// A migration round (or a probe) under judgement (rule 2).
    Judging(Box<Judging>),
}

/// The window before a decision: its mean iteration time (µs), the relative standard
/// error of that mean, and when the decision was made. `mean_us` is `None` when the job
/// reported no iteration time.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Baseline {
    mean_us: Option<f64>,
    rse: f64,
    decided_us: u64,
    /// The share of the iteration time a scale-out decided then was predicted to save.
    predicted_gain: f64,
}

impl Baseline {
    /// `floor_us`, or [`verdict::WINDOW_ITERATIONS`] iterations of this baseline if longer:
    /// how long the window after a decision lasts.
    fn span_us(&self, floor_us: u64) -> u64 {
        floor_us.max(self.mean_us.map_or(0, |m| (verdict::WINDOW_ITERATIONS * m) as u64))
    }
}

/// A migration round awaiting its verdict.
#[derive(Clone, Debug, PartialEq)]
struct Judging {
    /// The moves, to undo.
    moves: Vec<Move>,
    /// What was decided, for the record.
    what: String,
    /// A probe (rule 9), not a round of moves off the bottleneck.
    probe: bool,
    /// Destinations the model had no rate for when it decided (taken at the median).
    unknown: BTreeSet<ServerId>,
    baseline: Baseline,
    /// Max service time before the round and predicted after, s (the model's view).
    max_before: f64,
    max_after: f64,
    /// Measuring since the round finished (`None` while it runs).
    window: Option<Window>,
    /// A compression (rule 5c) instead of moves: the server and the blocks it set to a
    /// narrower dtype, to set back to f32 on a revert.
    compress: Option<(ServerId, Vec<BlockId>)>,
}

/// A plan of moves a rule proposes, with the model's prediction.
#[derive(Clone, Debug, PartialEq)]
struct Proposal {
    moves: Vec<Move>,
    why: String,
    /// Max service time before and predicted after, s.
    max_before: f64,
    max_after: f64,
    /// A probe (rule 9): it predicts no gain.
    probe: bool,
}

/// What the rules of one steady step read: the view, the serving servers (sorted, no
/// duplicates), their rates and their loads.
#[derive(Clone, Copy)]
struct Round<'a> {
    view: &'a View<'a>,
    servers: &'a [ServerId],
    rates: &'a BTreeMap<ServerId, f64>,
    loads: &'a Loads,
    /// The stragglers among `loads` ([`stragglers`]).
    straggling: &'a [ServerId],
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
    /// Iteration times seen since the last busy step (the last [`BASELINE_STEPS`]).
    baseline: Window,
    /// Consecutive reverted migration rounds: the cool-down is doubled this many times.
    backoff: u32,
    /// Moves ruled out by a revert (rule 2), until the time given.
    tabu: BTreeMap<Tabu, u64>,
    /// The job has reported a completed iteration: from then on, a step without one is
    /// a stall ([`Window`]), not a job without iteration times.
    iterating: bool,
    /// Since when each server has been idle (service time below IDLE_FRACTION of the max).
    idle_since: BTreeMap<ServerId, u64>,
    /// Since when each server has been a straggler, without a break.
    straggling_since: BTreeMap<ServerId, u64>,
    probes: BTreeMap<ServerId, Probe>,
    /// No scale-out before this time.
    scale_out_after_us: u64,
    /// Consecutive reverted scale-outs.
    reverts: u32,
    /// Per server, no compression (rule 5c) before this time, and its reverts so far.
    compress_after_us: BTreeMap<ServerId, (u64, u32)>,
}

impl Balancer {
    /// A balancer with these parameters, in the steady phase.
    pub fn new(params: BalanceParams) -> Self {
        Self {
            params,
            phase: Phase::Steady,
            quiet_since: None,
            baseline: Window::starting(0),
            backoff: 0,
            tabu: BTreeMap::new(),
            iterating: false,
            idle_since: BTreeMap::new(),
            straggling_since: BTreeMap::new(),
            probes: BTreeMap::new(),
            scale_out_after_us: 0,
            reverts: 0,
            compress_after_us: BTreeMap::new(),
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
        // Every rule plans with the blocks' bytes on the wire (rule 5c).
        let (sizes, narrow);
        let view = if view.wire.iter().any(|d| *d != Dtype::F32) {
            sizes = wire_sizes(view.sizes, view.wire);
            narrow = View { sizes: &sizes, ..*view };
            &narrow
        } else {
            view
        };
        let now = view.now_us;
        if view.busy {
            self.quiet_since = Some(now);
            self.baseline = Window::starting(now);
            self.idle_since.clear();
            match &mut self.phase {
                Phase::Trial { window, .. } => *window = Window::starting(now.saturating_add(TRIAL_SETTLE_US)),
                Phase::Judging(j) => j.window = None,
                _ => {}
            }
            return Vec::new();
        }
        self.iterating |= view.iterations > 0 && view.iter_us.is_some();
        self.baseline.push(now, view.iterations, view.iter_us);
        // The window before spans BASELINE_STEPS steps, or WINDOW_ITERATIONS iterations of
        // a slow job.
        let span = self.baseline.completed_mean_us().map_or(0.0, |m| verdict::WINDOW_ITERATIONS * m);
        self.baseline.keep_last(BASELINE_STEPS, span as u64);
        self.tabu.retain(|_, until| *until > now);
        let mut servers = view.servers.to_vec();
        servers.sort_unstable();
        servers.dedup();
        // The model holds only samples that measured a link (`load::link_rate`): a server
        // without one runs at the median rate, neither slow nor fast, and a straggler that
        // gave its blocks away keeps the rate it was measured at.
        let rates = view.load.rates(now);
        let spread: BTreeMap<ServerId, f64> =
            rates.keys().filter_map(|&id| view.load.estimate(id, now).map(|e| (id, e.rse))).collect();
        let tabu: BTreeSet<Tabu> = self.tabu.keys().copied().collect();
        let loads = Loads::new(view.placement, view.sizes, &servers, &rates).with_spread(&spread).with_tabu(tabu);
        self.track_idle(&loads, now);
        let straggling = stragglers(&loads.times(), self.params.threshold);
        self.straggling_since.retain(|id, _| straggling.contains(id));
        for &id in &straggling {
            self.straggling_since.entry(id).or_insert(now);
        }

        let decision = match self.phase.clone() {
            Phase::Steady => {
                self.steady(&Round { view, servers: &servers, rates: &rates, loads: &loads, straggling: &straggling })
            }
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
            Phase::Trial { server, .. } => return self.trial(view, &servers, &loads, server),
            Phase::Judging(_) => return self.judge(view, &servers, &loads),
        };
        match decision {
            Some(d) => {
                // A split moves no byte and leaves every rate as it was: no cool-down.
                if !matches!(d, Decision::Split { .. }) {
                    self.quiet_since = Some(now);
                }
                vec![d]
            }
            None => Vec::new(),
        }
    }

    /// The baseline of a decision made now: the window since the last busy step.
    fn baseline(&self, now: u64) -> Baseline {
        Baseline {
            mean_us: self.mean_us(&self.baseline),
            rse: self.baseline.rse(),
            decided_us: now,
            predicted_gain: 0.0,
        }
    }

    /// A window's mean iteration time, if the job reports iteration times at all.
    fn mean_us(&self, window: &Window) -> Option<f64> {
        window.mean_us().filter(|_| self.iterating)
    }

    /// A proposal becomes a decision under judgement (rule 2).
    fn propose(&mut self, view: &View, p: Proposal) -> Decision {
        let moves = p.moves.clone();
        let why = self.propose_with(view, p, None);
        Decision::Migrate { moves, why }
    }

    /// The judging phase of a proposal (of moves, or of the compression `compress`).
    fn propose_with(&mut self, view: &View, p: Proposal, compress: Option<(ServerId, Vec<BlockId>)>) -> String {
        let now = view.now_us;
        let unknown = p.moves.iter().map(|m| m.to).filter(|&s| view.load.estimate(s, now).is_none()).collect();
        self.phase = Phase::Judging(Box::new(Judging {
            moves: p.moves.clone(),
            what: p.why.clone(),
            probe: p.probe,
            unknown,
            baseline: self.baseline(now),
            max_before: p.max_before,
            max_after: p.max_after,
            window: None,
            compress,
        }));
        p.why
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

    /// The cool-down, doubled for each consecutive revert (rule 2).
    fn cooldown_us(&self) -> u64 {
        self.params.cooldown_us << self.backoff.min(MAX_HOLDOFF_DOUBLINGS)
    }

    fn cooled(&self, now: u64) -> bool {
        self.quiet_since.is_none_or(|t| now >= t.saturating_add(self.cooldown_us()))
    }

    /// The steady phase: rule 2b, then rules 3 to 9 in order, the first that decides wins.
    fn steady(&mut self, round: &Round) -> Option<Decision> {
        let Round { view, loads, servers, .. } = *round;
        let now = view.now_us;
        // Rule 2b: a row block too heavy for any one server.
        if let Some(d) =
            split::heavy_row_block(view.placement, view.sizes, servers, view.splittable, self.params.threshold)
        {
            return Some(d);
        }
        // Rule 3: the cool-down.
        if !self.cooled(now) {
            return None;
        }
        let total: u64 = loads.bytes.iter().sum();
        if total == 0 {
            return None;
        }
        // Rule 4: the confidence gate, over the servers with an estimate (the model holds
        // only samples that measured a link, `load::link_rate`; the others run at the
        // median rate), and nothing before the first.
        let mut measured = 0;
        for (i, &id) in loads.ids.iter().enumerate() {
            match view.load.estimate(id, now) {
                Some(e) if loads.bytes[i] > 0 && e.confidence < MIN_CONFIDENCE => return None,
                Some(_) => measured += 1,
                None => {}
            }
        }
        if measured == 0 {
            return None;
        }
        // Rule 2 needs a window before the decision to judge it by: steps, and in a job
        // that reports iterations, two steps at which some completed (one iteration of a
        // slow job would not say how long iterations take).
        if self.baseline.len() < VERDICT_MIN_STEPS || (self.iterating && self.baseline.progress_steps() < 2) {
            return None;
        }
        let straggling = round.straggling;
        // A straggler is relieved once it has lasted: until then no rule acts.
        let least = self.baseline(now).span_us(STRAGGLE_MIN_US);
        let lasting = |id: &ServerId| self.straggling_since.get(id).is_some_and(|&t| now >= t.saturating_add(least));
        if !straggling.is_empty() && !straggling.iter().any(lasting) {
            return None;
        }
        // Rule 5, or 5c where compressing the straggler does at least as well.
        let round_plan = self.exploit_stragglers(round);
        if let Some(c) = self.compress(round, round_plan.as_ref()) {
            return Some(self.propose_compress(view, c));
        }
        if let Some(p) = round_plan {
            return Some(self.propose(view, p));
        }
        if let Some(d) = self.scale_out(round) {
            return Some(d);
        }
        if let Some(d) = self.scale_in(round) {
            return Some(d);
        }
        if let Some(p) = self.exploit_imbalance(round) {
            return Some(self.propose(view, p));
        }
        let p = self.probe(view, loads)?;
        Some(self.propose(view, p))
    }
}

/// `--balance`: keep the initial placement, or rebalance and scale as PSLD does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BalanceMode {
    /// The initial placement stays (ps-lite, BytePS); operators may still `scale`.
    #[default]
    Static,
    /// Measure, move blocks off stragglers, scale out and in (DESIGN.md §4).
    Psld,
}

impl std::fmt::Display for BalanceMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BalanceMode::Static => "static",
            BalanceMode::Psld => "psld",
        })
    }
}

impl std::str::FromStr for BalanceMode {
    type Err = crate::CoreError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "static" => Ok(BalanceMode::Static),
            "psld" => Ok(BalanceMode::Psld),
            other => Err(crate::CoreError::Parse {
                what: "balance mode",
                input: other.to_string(),
                why: "expected static or psld".into(),
            }),
        }
    }
}
