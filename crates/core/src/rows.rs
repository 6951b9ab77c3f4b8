//! Embedding tables on a server: rows created lazily with a seeded initializer, and the
//! sparse optimizers (PyTorch's `SGD`, `Adagrad` and `SparseAdam` on sparse gradients,
//! and a lazy Adam with a step count per row), with their state kept per row.
//!
//! A row block ([`crate::model::BlockKind::Rows`]) holds a [`RowStore`]: only the rows a
//! push touched cost memory (values, and the optimizer's state of that row). A pull of a
//! row never pushed answers its initial value, computed on the fly from
//! (`seed`, table name, row id), so every server that creates a row gets the same values,
//! and a migrated or restored block too.
//!
//! The arithmetic is PyTorch's, operation for operation, in f32 with the hyperparameters
//! held as f64 (Python floats) and rounded where PyTorch rounds them:
//!
//! - `sgd`: `p += (-lr) * g` for every (row, gradient) in the order given (torch's `add_` of
//!   an uncoalesced sparse gradient: a repeated row takes each of its gradients in turn).
//! - `adagrad` (`_single_tensor_adagrad`, sparse branch): `clr = lr / (1 + (step - 1) *
//!   lr_decay)`; `sum += g * g`; `p += (-clr) * (g / (sqrt(sum) + eps))`, `sum` starting at
//!   `initial_accumulator_value`.
//! - `sparse_adam` (`torch.optim.SparseAdam`): for the touched rows only,
//!   `m' = m + (g - m) * (1 - b1)`, `v' = v + (g * g - v) * (1 - b2)`,
//!   `p += (-lr * sqrt(1 - b2^t) / (1 - b1^t)) * (m' / (sqrt(v') + eps))`, `t` the table's
//!   step count: every step of the table counts, even one whose gradient touched no row
//!   of this block (an empty push).
//! - `lazy_adam`: the same with a step count per row (only the touched rows step).

use std::collections::{HashMap, HashSet, VecDeque};

use rand::{Rng, SeedableRng, rngs::StdRng};
use serde::{Deserialize, Serialize};

use crate::CoreError;
use crate::ids::{BlockId, fnv1a};

/// How a table's rows get their initial values. Each row's values depend only on the
/// job's seed, the table's name and the row id ([`RowInit::fill`]).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum RowInit {
    /// Normal with this mean and standard deviation (`torch.nn.Embedding`'s default is
    /// N(0, 1)).
    Normal {
        /// Mean.
        mean: f32,
        /// Standard deviation.
        std: f32,
    },
    /// Uniform in `[low, high)`.
    Uniform {
        /// Inclusive lower bound.
        low: f32,
        /// Exclusive upper bound.
        high: f32,
    },
    /// The same value everywhere (tests use it to make outcomes exact).
    Constant(f32),
}

impl Default for RowInit {
    /// `torch.nn.Embedding`'s default: N(0, 1).
    fn default() -> Self {
        RowInit::Normal { mean: 0.0, std: 1.0 }
    }
}

impl RowInit {
    /// Checks that the parameters are usable (finite, `std >= 0`, `low <= high`).
    pub fn validate(&self) -> Result<(), CoreError> {
        let ok = match *self {
            RowInit::Normal { mean, std } => mean.is_finite() && std.is_finite() && std >= 0.0,
            RowInit::Uniform { low, high } => low.is_finite() && high.is_finite() && low <= high,
            RowInit::Constant(c) => c.is_finite(),
        };
        if ok { Ok(()) } else { Err(CoreError::InvalidModel(format!("row initializer {self:?}: bad parameters"))) }
    }

    /// Writes the initial values of row `row` into `out` (its `dim` values). `key` is
    /// [`row_key`] of the job's seed and the table's name.
    pub fn fill(&self, key: u64, row: u64, out: &mut [f32]) {
        if let RowInit::Constant(c) = *self {
            out.fill(c);
            return;
        }
        let mut rng = StdRng::seed_from_u64(key ^ row.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        match *self {
            RowInit::Uniform { low, high } => {
                out.iter_mut().for_each(|x| *x = low + (high - low) * rng.random::<f32>());
            }
            RowInit::Normal { mean, std } => {
                // Box-Muller in f64, one normal per pair of uniforms.
                for x in out.iter_mut() {
                    let u1 = 1.0 - rng.random::<f64>();
                    let u2 = rng.random::<f64>();
                    let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
                    *x = (f64::from(mean) + f64::from(std) * z) as f32;
                }
            }
            RowInit::Constant(_) => unreachable!("handled above"),
        }
    }
}

/// Positions of a hashed table's key space: a key's [`key_position`] is below it.
pub const KEY_POSITIONS: u64 = 1 << 32;

/// Where key `id` of a hashed table falls: the top 32 bits of a 64-bit mix of it
/// (splitmix64's finalizer, a bijection), so that sequential and clustered ids spread
/// over every range.
pub fn key_position(id: u64) -> u64 {
    let mut z = id.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)) >> 32
}

/// Which rows a bounded table evicts first.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Eviction {
    /// The least recently pushed (ties: the least pushed, then the lower key).
    #[default]
    Lru,
    /// The least pushed (ties: the least recently pushed, then the lower key).
    Lfu,
}

/// How a table's rows are bounded: a memory bound and what it evicts first, an expiry in
/// steps, and admission. The default bounds nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowLimits {
    /// At most this many rows (0: no bound). A [`crate::model::TableSpec`]'s is per
    /// server as the job starts; a [`RowRule`]'s is its block's share of that times the
    /// servers ([`crate::model::Partition::row_rule`]).
    pub max_rows: u64,
    /// What goes first once `max_rows` is passed.
    pub eviction: Eviction,
    /// A row not pushed for more than this many steps of its table is evicted (0: never).
    pub ttl_steps: u64,
    /// A key gets a row at its `admit_after`-th push (0 or 1: at its first). Before, a
    /// pull reads its initial values and its gradients are dropped.
    pub admit_after: u32,
}

/// A bound block evicts down to `max_rows - max_rows / EVICT_SLACK` at once, so that
/// choosing the rows (a linear pass) is paid once per that many new rows.
pub const EVICT_SLACK: u64 = 16;
/// An expiry is swept every `ttl_steps / TTL_SWEEPS` steps (at least every step).
pub const TTL_SWEEPS: u64 = 8;
/// Keys counted for admission per block and generation: when one generation holds this
/// many, it becomes the old one and the older is forgotten (at most twice this many
/// counters per block).
pub const ADMISSION_CANDIDATES: usize = 1 << 16;
/// Evicted keys remembered per block for exports, at least (else twice the block's
/// bound): an export since a step older than the oldest forgotten one is refused.
pub const MIN_TOMBSTONES: usize = 1 << 16;

/// What a row store did to its rows, counted since it came to this server (not carried
/// by migration).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RowCounters {
    /// Rows created.
    pub created: u64,
    /// Rows evicted by the memory bound.
    pub evicted: u64,
    /// Rows evicted by the expiry.
    pub expired: u64,
    /// Gradients of rows not admitted yet, dropped.
    pub refused_grads: u64,
    /// Reads of rows that do not exist (answered with initial values, nothing stored).
    pub init_reads: u64,
}

/// Rows of a store changed since an export, as [`RowStore::export`] reads them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RowExport {
    /// The block's step count when this export's first page was read: what the next
    /// export asks changes since.
    pub steps: u64,
    /// Keys, ascending, each past the page's `after`.
    pub ids: Vec<u64>,
    /// Their values, `ids.len() * dim`.
    pub values: Vec<f32>,
    /// Keys evicted since, that exist no more, past `after` (ascending).
    pub deleted: Vec<u64>,
    /// More rows or deleted keys follow past the last of this page.
    pub more: bool,
}

/// The key a table's rows are seeded with: the job's seed and the table's name.
pub fn row_key(seed: u64, table: &str) -> u64 {
    seed ^ fnv1a(table.as_bytes()).rotate_left(17)
}

/// A table's update rule on sparse gradients, with PyTorch's hyperparameters (f64, as
/// Python floats are).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum SparseOptimizer {
    /// `torch.optim.SGD` on a sparse gradient: `p -= lr * g`, duplicates summed.
    Sgd {
        /// Learning rate.
        lr: f64,
    },
    /// `torch.optim.Adagrad` on a sparse gradient (row-wise accumulators).
    Adagrad {
        /// Learning rate.
        lr: f64,
        /// Learning-rate decay per step.
        lr_decay: f64,
        /// Denominator guard (torch's default 1e-10).
        eps: f64,
        /// The accumulator's starting value.
        initial_accumulator_value: f64,
    },
    /// `torch.optim.SparseAdam`: moments of the touched rows only, bias correction with
    /// the table's step count.
    SparseAdam {
        /// Learning rate.
        lr: f64,
        /// First-moment decay.
        beta1: f64,
        /// Second-moment decay.
        beta2: f64,
        /// Denominator guard.
        eps: f64,
    },
    /// Lazy Adam: `SparseAdam`'s arithmetic with a step count per row (only the touched
    /// rows step, so a rare row's bias correction is its own).
    LazyAdam {
        /// Learning rate.
        lr: f64,
        /// First-moment decay.
        beta1: f64,
        /// Second-moment decay.
        beta2: f64,
        /// Denominator guard.
        eps: f64,
    },
}

impl Default for SparseOptimizer {
    /// SGD with learning rate 0.01.
    fn default() -> Self {
        SparseOptimizer::Sgd { lr: 0.01 }
    }
}

impl SparseOptimizer {
    /// `torch.optim.Adagrad`'s defaults with this learning rate.
    pub fn adagrad(lr: f64) -> Self {
        SparseOptimizer::Adagrad { lr, lr_decay: 0.0, eps: 1e-10, initial_accumulator_value: 0.0 }
    }

    /// `torch.optim.SparseAdam`'s defaults with this learning rate.
    pub fn sparse_adam(lr: f64) -> Self {
        SparseOptimizer::SparseAdam { lr, beta1: 0.9, beta2: 0.999, eps: 1e-8 }
    }

    /// Lazy Adam with `SparseAdam`'s defaults and this learning rate.
    pub fn lazy_adam(lr: f64) -> Self {
        SparseOptimizer::LazyAdam { lr, beta1: 0.9, beta2: 0.999, eps: 1e-8 }
    }

    /// Checks that the hyperparameters are usable (finite, in range).
    pub fn validate(&self) -> Result<(), CoreError> {
        let finite_nonneg = |x: f64| x.is_finite() && x >= 0.0;
        let ok = match *self {
            SparseOptimizer::Sgd { lr } => finite_nonneg(lr),
            SparseOptimizer::Adagrad { lr, lr_decay, eps, initial_accumulator_value } => {
                finite_nonneg(lr)
                    && finite_nonneg(lr_decay)
                    && finite_nonneg(eps)
                    && finite_nonneg(initial_accumulator_value)
            }
            SparseOptimizer::SparseAdam { lr, beta1, beta2, eps }
            | SparseOptimizer::LazyAdam { lr, beta1, beta2, eps } => {
                finite_nonneg(lr)
                    && (0.0..1.0).contains(&beta1)
                    && (0.0..1.0).contains(&beta2)
                    && eps > 0.0
                    && eps.is_finite()
            }
        };
        if ok {
            Ok(())
        } else {
            Err(CoreError::InvalidModel(format!("sparse optimizer {self:?}: bad hyperparameters")))
        }
    }

    /// How many f32 of state it keeps per value of a row (0 for SGD, 1 for Adagrad, 2 for
    /// the Adams).
    pub fn state_per_value(&self) -> usize {
        match self {
            SparseOptimizer::Sgd { .. } => 0,
            SparseOptimizer::Adagrad { .. } => 1,
            SparseOptimizer::SparseAdam { .. } | SparseOptimizer::LazyAdam { .. } => 2,
        }
    }
}

/// How a row block makes and updates its rows: the table's width, initializer and
/// optimizer, and the key of its seeded rows.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct RowRule {
    /// Values per row.
    pub dim: u32,
    /// Initial values of a row.
    pub init: RowInit,
    /// [`row_key`] of the job's seed and the table's name.
    pub key: u64,
    /// The update rule.
    pub optimizer: SparseOptimizer,
    /// This block's bound, expiry and admission.
    pub limits: RowLimits,
}

/// The rows of one row block that exist (were pushed to), with their optimizer state.
/// Memory is proportional to the rows touched, not to the range, and bounded by the
/// rule's [`RowLimits`].
#[derive(Clone, Debug)]
pub struct RowStore {
    rule: RowRule,
    /// Row id -> slot.
    index: HashMap<u64, u32>,
    /// Slot -> row id.
    ids: Vec<u64>,
    /// Each row's bookkeeping (one entry per slot, so that a push touches one cache line).
    meta: Vec<RowMeta>,
    /// Admission: pushes counted of keys without a row, this generation and the last.
    candidates: [HashMap<u64, u32>; 2],
    /// Keys evicted that an export may have held, with the step that evicted them.
    tombstones: VecDeque<(u64, u64)>,
    /// The step of the newest tombstone dropped (exports since before it are refused).
    forgotten: u64,
    /// The step at which an export last read this block.
    exported_at: u64,
    counters: RowCounters,
    /// `ids.len() * dim` values.
    values: Vec<f32>,
    /// Adagrad's accumulator, or Adam's first moment (`ids.len() * dim`, else empty).
    m: Vec<f32>,
    /// Adam's second moment.
    v: Vec<f32>,
    /// Lazy Adam's steps per row.
    row_steps: Vec<u64>,
    /// Steps of the table this block took (Adagrad's and SparseAdam's `step`).
    steps: u64,
}

/// When a row was created and last pushed, and how often.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RowMeta {
    /// The step that last pushed it.
    last: u64,
    /// The step that created it.
    born: u64,
    /// Pushes since its creation.
    hits: u32,
}

/// A row store as it travels (migration, checkpoint, replica copy): every field, rows in
/// creation order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RowState {
    /// The block's rule.
    pub rule: RowRule,
    /// Steps of the table taken.
    pub steps: u64,
    /// The rows that exist, in creation order.
    pub ids: Vec<u64>,
    /// Their values, `ids.len() * dim`.
    #[serde(with = "crate::f32s")]
    pub values: Vec<f32>,
    /// First optimizer buffer (Adagrad's sums, Adam's first moment), or empty.
    #[serde(with = "crate::f32s")]
    pub m: Vec<f32>,
    /// Second optimizer buffer (Adam's second moment), or empty.
    #[serde(with = "crate::f32s")]
    pub v: Vec<f32>,
    /// Lazy Adam's step per row, or empty.
    pub row_steps: Vec<u64>,
    /// The step that last pushed each row.
    pub last: Vec<u64>,
    /// Pushes of each row since its creation.
    pub hits: Vec<u32>,
    /// The step that created each row.
    pub born: Vec<u64>,
    /// Admission counters, this generation's then the last's: (key, pushes).
    pub candidates: [Vec<(u64, u32)>; 2],
    /// Keys evicted that an export may hold, oldest first: (key, step).
    pub tombstones: Vec<(u64, u64)>,
    /// The step of the newest tombstone dropped.
    pub forgotten: u64,
    /// The step at which an export last read the block.
    pub exported_at: u64,
    /// Aggregate mode: the row pushes of clocks not yet complete.
    pub pending: Vec<PendingRows>,
}

impl RowState {
    /// The part of this state whose rows `keep` holds: every row's values and
    /// bookkeeping, admission counters, tombstones and pending gradients (each pending
    /// clock keeps its count of pushes); step counts as they are.
    pub fn part(&self, keep: impl Fn(u64) -> bool) -> RowState {
        let d = self.rule.dim as usize;
        let mut half = RowState {
            rule: self.rule,
            steps: self.steps,
            ids: Vec::new(),
            values: Vec::new(),
            m: Vec::new(),
            v: Vec::new(),
            row_steps: Vec::new(),
            last: Vec::new(),
            hits: Vec::new(),
            born: Vec::new(),
            candidates: self.candidates.clone().map(|c| c.into_iter().filter(|(k, _)| keep(*k)).collect()),
            tombstones: self.tombstones.iter().filter(|(k, _)| keep(*k)).copied().collect(),
            forgotten: self.forgotten,
            exported_at: self.exported_at,
            pending: Vec::new(),
        };
        for (slot, row) in self.ids.iter().enumerate().filter(|(_, r)| keep(**r)) {
            half.ids.push(*row);
            half.values.extend_from_slice(&self.values[slot * d..][..d]);
            if !self.m.is_empty() {
                half.m.extend_from_slice(&self.m[slot * d..][..d]);
            }
            if !self.v.is_empty() {
                half.v.extend_from_slice(&self.v[slot * d..][..d]);
            }
            if !self.row_steps.is_empty() {
                half.row_steps.push(self.row_steps[slot]);
            }
            half.last.push(self.last[slot]);
            half.hits.push(self.hits[slot]);
            half.born.push(self.born[slot]);
        }
        for p in &self.pending {
            let mut part = PendingRows { clock: p.clock, ids: Vec::new(), grads: Vec::new(), count: p.count };
            for (k, row) in p.ids.iter().enumerate().filter(|(_, r)| keep(**r)) {
                part.ids.push(*row);
                part.grads.extend_from_slice(&p.grads[k * d..][..d]);
            }
            half.pending.push(part);
        }
        half
    }
}

/// Aggregate mode: the row pushes of one clock received so far, concatenated, and how many
/// pushes (empty ones too).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PendingRows {
    /// The clock.
    pub clock: u32,
    /// The rows pushed, every push's in arrival order (duplicates kept).
    pub ids: Vec<u64>,
    /// Their gradients, `ids.len() * dim`.
    #[serde(with = "crate::f32s")]
    pub grads: Vec<f32>,
    /// Pushes received.
    pub count: u32,
}

impl RowStore {
    /// An empty store (no row exists yet).
    pub fn new(rule: RowRule) -> Self {
        Self {
            rule,
            index: HashMap::new(),
            ids: Vec::new(),
            values: Vec::new(),
            m: Vec::new(),
            v: Vec::new(),
            row_steps: Vec::new(),
            steps: 0,
            meta: Vec::new(),
            candidates: [HashMap::new(), HashMap::new()],
            tombstones: VecDeque::new(),
            forgotten: 0,
            exported_at: 0,
            counters: RowCounters::default(),
        }
    }

    /// Whether the rule bounds, expires or admits rows (else [`RowStore::enforce`] has
    /// nothing to do).
    pub fn is_limited(&self) -> bool {
        let l = self.rule.limits;
        l.max_rows > 0 || l.ttl_steps > 0
    }

    /// What this store did to its rows since it came here.
    pub fn counters(&self) -> RowCounters {
        self.counters
    }

    /// Puts back counters taken before pushes that were counted elsewhere (a migration's
    /// delta, counted by the old owner: [`crate::block::Block::replay`]).
    pub(crate) fn restore_counters(&mut self, counters: RowCounters) {
        self.counters = counters;
    }

    /// Keys counted for admission (both generations).
    pub fn candidates(&self) -> usize {
        self.candidates.iter().map(HashMap::len).sum()
    }

    /// Whether row `row` exists.
    pub fn contains(&self, row: u64) -> bool {
        self.index.contains_key(&row)
    }

    /// The rule.
    pub fn rule(&self) -> &RowRule {
        &self.rule
    }

    /// Values per row.
    pub fn dim(&self) -> usize {
        self.rule.dim as usize
    }

    /// Rows that exist.
    pub fn rows(&self) -> usize {
        self.ids.len()
    }

    /// Steps of the table taken here.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// f32 values held (values and optimizer state).
    pub fn state_len(&self) -> usize {
        self.values.len() + self.m.len() + self.v.len()
    }

    /// The current values of row `row` (its initial ones if it was never pushed to) into
    /// `out` (`dim` values); false if the row does not exist.
    pub fn read(&self, row: u64, out: &mut [f32]) -> bool {
        let dim = self.dim();
        match self.index.get(&row) {
            Some(&slot) => {
                out.copy_from_slice(&self.values[slot as usize * dim..][..dim]);
                true
            }
            None => {
                self.rule.init.fill(self.rule.key, row, out);
                false
            }
        }
    }

    /// The rows `ids`, in that order, `ids.len() * dim` values, and how many of them do
    /// not exist.
    fn read_all(&self, ids: &[u64]) -> (Vec<f32>, u64) {
        let dim = self.dim();
        let mut out = vec![0.0; ids.len() * dim];
        let mut missing = 0;
        for (row, chunk) in ids.iter().zip(out.chunks_exact_mut(dim.max(1))) {
            missing += u64::from(!self.read(*row, chunk));
        }
        (out, missing)
    }

    /// The rows `ids`, in that order, `ids.len() * dim` values.
    pub fn gather(&self, ids: &[u64]) -> Vec<f32> {
        self.read_all(ids).0
    }

    /// [`RowStore::gather`] for a worker's pull: the reads of rows that do not exist are
    /// counted ([`RowCounters::init_reads`]).
    pub fn pull(&mut self, ids: &[u64]) -> Vec<f32> {
        let (out, missing) = self.read_all(ids);
        self.counters.init_reads += missing;
        out
    }

    /// The slot of row `row`, created with its initial values and fresh optimizer state.
    fn slot(&mut self, row: u64) -> usize {
        if let Some(&slot) = self.index.get(&row) {
            return slot as usize;
        }
        let dim = self.dim();
        let slot = self.ids.len();
        self.index.insert(row, slot as u32);
        self.ids.push(row);
        self.meta.push(RowMeta { last: self.steps, born: self.steps, hits: 0 });
        self.counters.created += 1;
        self.values.resize(self.values.len() + dim, 0.0);
        self.rule.init.fill(self.rule.key, row, &mut self.values[slot * dim..]);
        match self.rule.optimizer {
            SparseOptimizer::Sgd { .. } => {}
            SparseOptimizer::Adagrad { initial_accumulator_value, .. } => {
                self.m.resize(self.m.len() + dim, initial_accumulator_value as f32);
            }
            SparseOptimizer::SparseAdam { .. } | SparseOptimizer::LazyAdam { .. } => {
                self.m.resize(self.m.len() + dim, 0.0);
                self.v.resize(self.v.len() + dim, 0.0);
                if matches!(self.rule.optimizer, SparseOptimizer::LazyAdam { .. }) {
                    self.row_steps.push(0);
                }
            }
        }
        slot
    }

    /// One step of the table: the gradient `grads` (`ids.len() * dim`; duplicates summed
    /// in the order given, except for SGD, which takes them in turn as torch does), scaled
    /// by `scale` (1, or the mean's `1 / pushes` of aggregate
    /// mode), applied to the rows `ids`. An empty gradient still counts as a step of the
    /// table. A key without a row gets one only at its `admit_after`-th push (a push
    /// naming it twice counts once); until then its gradients are dropped and counted.
    /// The caller checked the lengths; it then calls [`RowStore::enforce`].
    pub fn step(&mut self, ids: &[u64], grads: &[f32], scale: f32) {
        let dim = self.dim();
        debug_assert_eq!(ids.len() * dim, grads.len());
        self.steps = self.steps.saturating_add(1);
        let refused = self.admit(ids);
        if let SparseOptimizer::Sgd { lr } = self.rule.optimizer {
            // torch's `p.add_(g, alpha=-lr)` of an uncoalesced sparse gradient: every
            // (row, gradient) in the order given, a repeated row once per occurrence.
            let alpha = -lr as f32;
            for (row, g) in ids.iter().zip(grads.chunks_exact(dim.max(1))) {
                if !refused.is_empty() && refused.contains(row) {
                    self.counters.refused_grads += 1;
                    continue;
                }
                let slot = self.touch(*row);
                let p = &mut self.values[slot * dim..][..dim];
                p.iter_mut().zip(g).for_each(|(p, g)| *p += alpha * (g * scale));
            }
            return;
        }
        let (rows, summed) = coalesce(ids, grads, dim);
        let mut g = vec![0.0f32; dim];
        for (k, row) in rows.iter().enumerate() {
            if !refused.is_empty() && refused.contains(row) {
                self.counters.refused_grads += ids.iter().filter(|r| *r == row).count() as u64;
                continue;
            }
            g.copy_from_slice(&summed[k * dim..][..dim]);
            if scale != 1.0 {
                g.iter_mut().for_each(|x| *x *= scale);
            }
            let slot = self.touch(*row);
            self.apply(slot, &g);
        }
    }

    /// The slot of row `row` (created if new), marked pushed by this step.
    fn touch(&mut self, row: u64) -> usize {
        let slot = self.slot(row);
        let meta = &mut self.meta[slot];
        meta.last = self.steps;
        meta.hits = meta.hits.saturating_add(1);
        slot
    }

    /// Counts one push of every key of `ids` without a row; the keys that are not
    /// admitted by it (empty when the rule admits at the first push).
    fn admit(&mut self, ids: &[u64]) -> HashSet<u64> {
        let mut refused = HashSet::new();
        let need = self.rule.limits.admit_after;
        if need <= 1 {
            return refused;
        }
        let mut seen = HashSet::new();
        for &id in ids {
            if self.index.contains_key(&id) || !seen.insert(id) {
                continue;
            }
            let [current, previous] = &mut self.candidates;
            let count = current.remove(&id).or_else(|| previous.remove(&id)).unwrap_or(0) + 1;
            if count >= need {
                continue;
            }
            if current.len() >= ADMISSION_CANDIDATES {
                // A new generation: the keys counted two generations ago are forgotten.
                *previous = std::mem::take(current);
            }
            self.candidates[0].insert(id, count);
            refused.insert(id);
        }
        refused
    }

    /// Applies the rule's expiry (every `ttl_steps / TTL_SWEEPS` steps) and bound: rows
    /// not pushed for more than `ttl_steps` go, and past `max_rows` the rows the
    /// eviction policy puts first go until `max_rows - max_rows / EVICT_SLACK` remain.
    /// Never a row this step pushed, nor one `protected` names (the target of a push
    /// not applied yet). Returns the rows removed.
    pub fn enforce(&mut self, protected: impl Fn(u64) -> bool) -> u64 {
        if !self.is_limited() {
            return 0;
        }
        let RowLimits { max_rows, eviction, ttl_steps, .. } = self.rule.limits;
        let now = self.steps;
        let before = self.ids.len();
        let mut victims: Vec<usize> = Vec::new();
        if ttl_steps > 0 && now.is_multiple_of((ttl_steps / TTL_SWEEPS).max(1)) {
            victims.extend(
                (0..self.ids.len()).filter(|&s| now - self.meta[s].last > ttl_steps && !protected(self.ids[s])),
            );
            self.counters.expired += victims.len() as u64;
            self.remove(&mut victims);
        }
        let rows = self.ids.len() as u64;
        if max_rows > 0 && rows > max_rows {
            let excess = (rows - (max_rows - max_rows / EVICT_SLACK)) as usize;
            let mut free: Vec<usize> =
                (0..self.ids.len()).filter(|&s| self.meta[s].last < now && !protected(self.ids[s])).collect();
            let key = |s: &usize| match eviction {
                Eviction::Lru => (self.meta[*s].last, u64::from(self.meta[*s].hits), self.ids[*s]),
                Eviction::Lfu => (u64::from(self.meta[*s].hits), self.meta[*s].last, self.ids[*s]),
            };
            if free.len() > excess {
                free.select_nth_unstable_by_key(excess, key);
                free.truncate(excess);
            }
            self.counters.evicted += free.len() as u64;
            victims = free;
            self.remove(&mut victims);
        }
        let removed = before - self.ids.len();
        debug_assert!(removed == 0 || self.check().is_ok(), "{:?}", self.check());
        removed as u64
    }

    /// Removes the rows in `slots` (distinct), remembering for exports the keys an
    /// export may have held (created no later than the last export read this block).
    fn remove(&mut self, slots: &mut [usize]) {
        let dim = self.dim();
        let keep = if self.rule.limits.max_rows > 0 {
            MIN_TOMBSTONES.max(2 * self.rule.limits.max_rows as usize)
        } else {
            MIN_TOMBSTONES
        };
        // Highest slot first: each swap_remove moves the last row, never one still to go.
        slots.sort_unstable_by(|a, b| b.cmp(a));
        for &slot in slots.iter() {
            let id = self.ids[slot];
            if self.meta[slot].born <= self.exported_at {
                self.tombstones.push_back((id, self.steps));
                if self.tombstones.len() > keep
                    && let Some((_, step)) = self.tombstones.pop_front()
                {
                    self.forgotten = step;
                }
            }
            self.index.remove(&id);
            let last = self.ids.len() - 1;
            for buf in [&mut self.values, &mut self.m, &mut self.v] {
                if !buf.is_empty() {
                    buf.copy_within(last * dim..(last + 1) * dim, slot * dim);
                    buf.truncate(last * dim);
                }
            }
            if !self.row_steps.is_empty() {
                self.row_steps.swap_remove(slot);
            }
            self.ids.swap_remove(slot);
            self.meta.swap_remove(slot);
            if slot < last {
                self.index.insert(self.ids[slot], slot as u32);
            }
        }
    }

    /// The invariant of the store: every buffer fits its rows, and the index names every
    /// row at its slot. What breaks it, as an error.
    pub fn check(&self) -> Result<(), String> {
        let (n, dim) = (self.ids.len(), self.dim());
        let per = self.rule.optimizer.state_per_value();
        let lens = [
            (self.values.len(), n * dim),
            (self.m.len(), if per >= 1 { n * dim } else { 0 }),
            (self.v.len(), if per >= 2 { n * dim } else { 0 }),
            (self.meta.len(), n),
        ];
        if lens.iter().any(|(got, want)| got != want) || self.index.len() != n {
            return Err(format!("{n} rows: buffers of {lens:?}, an index of {}", self.index.len()));
        }
        match self.ids.iter().enumerate().find(|(s, id)| self.index.get(id) != Some(&(*s as u32))) {
            Some((s, id)) => Err(format!("row {id} at slot {s} is indexed at {:?}", self.index.get(id))),
            None => Ok(()),
        }
    }

    /// A page of the rows changed since step `since` (every row for `None`) and, with a
    /// `since`, of the keys evicted since that exist no more: their keys past `after`, in
    /// ascending order, at most `max_rows` rows and deleted keys together. Reading a page
    /// marks the block exported at its current step (so that a later eviction of a row
    /// this page may hold is remembered). Refused for a `since` older than the evicted
    /// keys this store still remembers.
    pub fn export(&mut self, since: Option<u64>, after: Option<u64>, max_rows: usize) -> Result<RowExport, CoreError> {
        if let Some(s) = since
            && s < self.forgotten
        {
            return Err(CoreError::ExportTooOld { since: s, forgotten: self.forgotten });
        }
        let past = |id: u64| after.is_none_or(|a| id > a);
        // (key, its slot, or None for a key evicted since `since`).
        let mut page: Vec<(u64, Option<usize>)> = (0..self.ids.len())
            .filter(|&s| since.is_none_or(|t| self.meta[s].last > t) && past(self.ids[s]))
            .map(|s| (self.ids[s], Some(s)))
            .collect();
        if let Some(s) = since {
            page.extend(
                self.tombstones
                    .iter()
                    .filter(|(id, step)| *step > s && past(*id) && !self.index.contains_key(id))
                    .map(|(id, _)| (*id, None)),
            );
        }
        page.sort_unstable();
        page.dedup();
        let more = page.len() > max_rows;
        page.truncate(max_rows);
        let dim = self.dim();
        let mut out = RowExport { steps: self.steps, more, ..RowExport::default() };
        for (id, slot) in page {
            match slot {
                Some(s) => {
                    out.ids.push(id);
                    out.values.extend_from_slice(&self.values[s * dim..][..dim]);
                }
                None => out.deleted.push(id),
            }
        }
        self.exported_at = self.exported_at.max(self.steps);
        Ok(out)
    }

    fn apply(&mut self, slot: usize, g: &[f32]) {
        let dim = self.dim();
        let at = slot * dim;
        let p = &mut self.values[at..at + dim];
        match self.rule.optimizer {
            SparseOptimizer::Sgd { .. } => unreachable!("sgd steps row by row in RowStore::step"),
            SparseOptimizer::Adagrad { lr, lr_decay, eps, .. } => {
                let clr = lr / (1.0 + (self.steps as f64 - 1.0) * lr_decay);
                let alpha = -clr as f32;
                let eps = eps as f32;
                let sum = &mut self.m[at..at + dim];
                for ((p, g), s) in p.iter_mut().zip(g).zip(sum.iter_mut()) {
                    *s += g * g;
                    let std = s.sqrt() + eps;
                    *p += alpha * (g / std);
                }
            }
            SparseOptimizer::SparseAdam { lr, beta1, beta2, eps }
            | SparseOptimizer::LazyAdam { lr, beta1, beta2, eps } => {
                let t = if matches!(self.rule.optimizer, SparseOptimizer::LazyAdam { .. }) {
                    self.row_steps[slot] = self.row_steps[slot].saturating_add(1);
                    self.row_steps[slot]
                } else {
                    self.steps
                };
                let t = t.min(i32::MAX as u64) as i32;
                let bc1 = 1.0 - beta1.powi(t);
                let bc2 = 1.0 - beta2.powi(t);
                let step_size = lr * bc2.sqrt() / bc1;
                let alpha = (-step_size) as f32;
                let (d1, d2, eps) = ((1.0 - beta1) as f32, (1.0 - beta2) as f32, eps as f32);
                let m = &mut self.m[at..at + dim];
                let v = &mut self.v[at..at + dim];
                for (((p, g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
                    let m_update = (g - *m) * d1;
                    let v_update = (g * g - *v) * d2;
                    let numer = m_update + *m;
                    let denom = (v_update + *v).sqrt() + eps;
                    *m += m_update;
                    *v += v_update;
                    *p += alpha * (numer / denom);
                }
            }
        }
    }

    /// The store as it travels, with the aggregate sums `pending`.
    pub fn state(&self, pending: Vec<PendingRows>) -> RowState {
        RowState {
            rule: self.rule,
            steps: self.steps,
            ids: self.ids.clone(),
            values: self.values.clone(),
            m: self.m.clone(),
            v: self.v.clone(),
            row_steps: self.row_steps.clone(),
            last: self.meta.iter().map(|m| m.last).collect(),
            hits: self.meta.iter().map(|m| m.hits).collect(),
            born: self.meta.iter().map(|m| m.born).collect(),
            candidates: self.candidates.clone().map(|c| {
                let mut c: Vec<(u64, u32)> = c.into_iter().collect();
                c.sort_unstable();
                c
            }),
            tombstones: self.tombstones.iter().copied().collect(),
            forgotten: self.forgotten,
            exported_at: self.exported_at,
            pending,
        }
    }

    /// The store a [`RowState`] describes, and its aggregate sums; refused (naming what)
    /// when its lengths do not fit or a row repeats (`block`: whose state it is, for the error).
    pub fn from_state(block: BlockId, state: RowState) -> Result<(Self, Vec<PendingRows>), CoreError> {
        let bad = |why: String| CoreError::BadRowState { block, why };
        let dim = state.rule.dim as usize;
        let n = state.ids.len();
        let per = state.rule.optimizer.state_per_value();
        let lazy = matches!(state.rule.optimizer, SparseOptimizer::LazyAdam { .. });
        if dim == 0
            || state.values.len() != n * dim
            || state.m.len() != if per >= 1 { n * dim } else { 0 }
            || state.v.len() != if per >= 2 { n * dim } else { 0 }
            || state.row_steps.len() != if lazy { n } else { 0 }
            || state.last.len() != n
            || state.hits.len() != n
            || state.born.len() != n
        {
            return Err(bad(format!("{n} rows of {dim} values, and buffers of other lengths")));
        }
        if state.last.iter().chain(&state.born).any(|s| *s > state.steps) || state.exported_at > state.steps {
            return Err(bad(format!("a row or an export dated past the block's step {}", state.steps)));
        }
        if state.candidates.iter().any(|c| c.len() > ADMISSION_CANDIDATES) {
            return Err(bad(format!("more than {ADMISSION_CANDIDATES} admission counters in a generation")));
        }
        if let Some(p) = state.pending.iter().find(|p| p.grads.len() != p.ids.len() * dim || p.count == 0) {
            return Err(bad(format!("the pending rows of clock {} do not fit rows of {dim} values", p.clock)));
        }
        let mut index = HashMap::with_capacity(n);
        for (slot, id) in state.ids.iter().enumerate() {
            if index.insert(*id, slot as u32).is_some() {
                return Err(bad(format!("row {id} appears twice")));
            }
        }
        let store = Self {
            rule: state.rule,
            index,
            ids: state.ids,
            values: state.values,
            m: state.m,
            v: state.v,
            row_steps: state.row_steps,
            steps: state.steps,
            meta: (0..n).map(|s| RowMeta { last: state.last[s], born: state.born[s], hits: state.hits[s] }).collect(),
            candidates: state.candidates.map(|c| c.into_iter().collect()),
            tombstones: state.tombstones.into(),
            forgotten: state.forgotten,
            exported_at: state.exported_at,
            counters: RowCounters::default(),
        };
        Ok((store, state.pending))
    }
}

/// The distinct rows of `ids` in ascending order and their summed gradients (each row's
/// gradients added in the order given), as `torch.Tensor.coalesce` does.
pub fn coalesce(ids: &[u64], grads: &[f32], dim: usize) -> (Vec<u64>, Vec<f32>) {
    let mut order: Vec<usize> = (0..ids.len()).collect();
    order.sort_by_key(|&i| ids[i]);
    let mut rows: Vec<u64> = Vec::with_capacity(ids.len());
    let mut sums: Vec<f32> = Vec::with_capacity(grads.len());
    for i in order {
        let g = &grads[i * dim..][..dim];
        if rows.last() == Some(&ids[i]) {
            let at = sums.len() - dim;
            sums[at..].iter_mut().zip(g).for_each(|(s, g)| *s += g);
        } else {
            rows.push(ids[i]);
            sums.extend_from_slice(g);
        }
    }
    (rows, sums)
}

/// Buckets of a [`RowHistogram`] (fewer for a range of fewer rows).
pub const HISTOGRAM_BUCKETS: u64 = 64;

/// Where a row block's pushed rows fall, in up to [`HISTOGRAM_BUCKETS`] equal buckets of
/// its range: what the server reports as the row to split a hot block at
/// ([`RowHistogram::split_at`]), so that each half carries about half of its traffic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowHistogram {
    start: u64,
    end: u64,
    width: u64,
    counts: Vec<u64>,
}

impl RowHistogram {
    /// An empty histogram of rows `start..end`.
    pub fn new(start: u64, end: u64) -> Self {
        let span = end.saturating_sub(start).max(1);
        let width = span.div_ceil(HISTOGRAM_BUCKETS);
        Self { start, end, width, counts: vec![0; span.div_ceil(width) as usize] }
    }

    /// Counts the rows of one push by their positions (a row named twice counts twice: it
    /// was sent twice).
    pub fn record(&mut self, positions: impl IntoIterator<Item = u64>) {
        for id in positions {
            if let Some(c) = id.checked_sub(self.start).and_then(|o| self.counts.get_mut((o / self.width) as usize)) {
                *c += 1;
            }
        }
    }

    /// Rows counted.
    pub fn total(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// The bucket boundary strictly inside the range that cuts the counted rows closest
    /// to half and half (ties to the lower row), or `None` with nothing counted or a
    /// range of one row. When every counted row is in one bucket, no boundary divides
    /// them: the cut is at that bucket's edge, so that the half holding it is narrower
    /// (its start if it is not the first bucket, else its end), and a later split of that
    /// half cuts it finer.
    pub fn split_at(&self) -> Option<u64> {
        let total = self.total();
        if total == 0 || self.end <= self.start + 1 {
            return None;
        }
        let boundary = |k: usize| self.start + k as u64 * self.width;
        let inside = |at: u64| at > self.start && at < self.end;
        if let Some(k) = self.counts.iter().position(|c| *c == total) {
            return [boundary(k), boundary(k + 1)].into_iter().find(|at| inside(*at));
        }
        let mut best: Option<(u64, u64)> = None;
        let mut below = 0;
        for (k, c) in self.counts.iter().enumerate().take(self.counts.len() - 1) {
            below += c;
            let at = boundary(k + 1);
            let off = (2 * below).abs_diff(total);
            if inside(at) && best.is_none_or(|(o, _)| off < o) {
                best = Some((off, at));
            }
        }
        best.map(|(_, at)| at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(dim: u32, optimizer: SparseOptimizer) -> RowRule {
        RowRule { dim, init: RowInit::Constant(0.5), key: 7, optimizer, limits: RowLimits::default() }
    }

    #[test]
    fn rows_are_created_only_when_pushed_and_read_their_initial_values_before() {
        let init = RowInit::Normal { mean: 0.0, std: 1.0 };
        let mut s = RowStore::new(RowRule {
            dim: 4,
            init,
            key: row_key(1, "emb"),
            optimizer: SparseOptimizer::Sgd { lr: 1.0 },
            limits: RowLimits::default(),
        });
        let before = s.gather(&[10, 3, 10]);
        assert_eq!(s.rows(), 0, "a pull creates nothing");
        assert_eq!(before[..4], before[8..], "the same row twice reads the same values");
        assert_ne!(before[..4], before[4..8]);
        // Same key and row: same values anywhere (another store, another server).
        let other = RowStore::new(*s.rule());
        assert_eq!(other.gather(&[3]), before[4..8]);
        s.step(&[3], &[1.0; 4], 1.0);
        assert_eq!(s.rows(), 1);
        let after = s.gather(&[3]);
        for (a, b) in after.iter().zip(&before[4..8]) {
            assert_eq!(*a, b - 1.0);
        }
        // Another seed or table name: other values.
        assert_ne!(RowStore::new(RowRule { key: row_key(1, "other"), ..*s.rule() }).gather(&[3]), before[4..8]);
    }

    #[test]
    fn normal_init_has_the_asked_mean_and_spread() {
        let init = RowInit::Normal { mean: 1.0, std: 2.0 };
        let mut all = Vec::new();
        for row in 0..2000 {
            let mut out = [0.0; 8];
            init.fill(5, row, &mut out);
            all.extend(out);
        }
        let n = all.len() as f64;
        let mean = all.iter().map(|x| f64::from(*x)).sum::<f64>() / n;
        let var = all.iter().map(|x| (f64::from(*x) - mean).powi(2)).sum::<f64>() / n;
        assert!((mean - 1.0).abs() < 0.05, "{mean}");
        assert!((var.sqrt() - 2.0).abs() < 0.05, "{}", var.sqrt());
    }

    #[test]
    fn sgd_takes_a_repeated_rows_gradients_in_turn() {
        let mut s = RowStore::new(rule(2, SparseOptimizer::Sgd { lr: 0.5 }));
        s.step(&[4, 9, 4], &[1.0, 2.0, 10.0, 10.0, 3.0, 4.0], 1.0);
        assert_eq!(s.gather(&[4, 9]), vec![0.5 - 0.5 * 4.0, 0.5 - 0.5 * 6.0, 0.5 - 5.0, 0.5 - 5.0]);
        assert_eq!(s.rows(), 2);
    }

    #[test]
    fn adagrad_is_torchs_sparse_branch() {
        // Worked by hand from _single_tensor_adagrad: lr 0.1, lr_decay 0.5, eps 1e-10,
        // initial accumulator 0.25; p0 = 0.5.
        let opt = SparseOptimizer::Adagrad { lr: 0.1, lr_decay: 0.5, eps: 1e-10, initial_accumulator_value: 0.25 };
        let mut s = RowStore::new(rule(1, opt));
        s.step(&[0], &[2.0], 1.0);
        // step 1: clr = 0.1; sum = 0.25 + 4 = 4.25; p = 0.5 - 0.1 * 2 / sqrt(4.25).
        let mut sum = 0.25f32 + 4.0;
        let mut p = 0.5f32 + (-0.1f32) * (2.0 / (sum.sqrt() + 1e-10));
        assert_eq!(s.gather(&[0]), vec![p]);
        // step 2 (row 0 not touched: only the table's step count moves), step 3 touches it.
        s.step(&[], &[], 1.0);
        s.step(&[0, 0], &[1.0, 0.5], 1.0);
        let clr = (0.1f64 / (1.0 + 2.0 * 0.5)) as f32;
        sum += 1.5 * 1.5;
        p += -clr * (1.5 / (sum.sqrt() + 1e-10));
        assert_eq!(s.gather(&[0]), vec![p]);
        assert_eq!(s.steps(), 3);
    }

    /// SparseAdam as torch/optim/_functional.py computes it, written out for one value.
    #[allow(clippy::too_many_arguments)]
    fn torch_sparse_adam(
        p: &mut f32,
        m: &mut f32,
        v: &mut f32,
        g: f32,
        step: i32,
        lr: f64,
        b1: f64,
        b2: f64,
        eps: f64,
    ) {
        let old_m = *m;
        let m_upd = (g - old_m) * (1.0 - b1) as f32;
        *m += m_upd;
        let old_v = *v;
        let v_upd = (g * g - old_v) * (1.0 - b2) as f32;
        *v += v_upd;
        let numer = m_upd + old_m;
        let denom = (v_upd + old_v).sqrt() + eps as f32;
        let step_size = lr * (1.0 - b2.powi(step)).sqrt() / (1.0 - b1.powi(step));
        *p += (-step_size) as f32 * (numer / denom);
    }

    #[test]
    fn sparse_adam_steps_with_the_tables_count_and_lazy_adam_with_the_rows() {
        let (lr, b1, b2, eps) = (0.01, 0.9, 0.999, 1e-8);
        let mut sparse = RowStore::new(rule(1, SparseOptimizer::SparseAdam { lr, beta1: b1, beta2: b2, eps }));
        let mut lazy = RowStore::new(rule(1, SparseOptimizer::LazyAdam { lr, beta1: b1, beta2: b2, eps }));
        // Clock 0 touches row 1; clock 1 is empty here; clock 2 touches rows 1 and 2.
        let pushes: [(&[u64], &[f32]); 3] = [(&[1], &[0.3]), (&[], &[]), (&[2, 1], &[-0.7, 0.2])];
        for (ids, g) in pushes {
            sparse.step(ids, g, 1.0);
            lazy.step(ids, g, 1.0);
        }
        let (mut p1, mut m1, mut v1) = (0.5, 0.0, 0.0);
        let (mut p2, mut m2, mut v2) = (0.5, 0.0, 0.0);
        torch_sparse_adam(&mut p1, &mut m1, &mut v1, 0.3, 1, lr, b1, b2, eps);
        torch_sparse_adam(&mut p1, &mut m1, &mut v1, 0.2, 3, lr, b1, b2, eps);
        torch_sparse_adam(&mut p2, &mut m2, &mut v2, -0.7, 3, lr, b1, b2, eps);
        assert_eq!(sparse.gather(&[1, 2]), vec![p1, p2]);
        // Lazy: row 1 took its steps 1 and 2, row 2 its step 1.
        let (mut q1, mut n1, mut w1) = (0.5, 0.0, 0.0);
        let (mut q2, mut n2, mut w2) = (0.5, 0.0, 0.0);
        torch_sparse_adam(&mut q1, &mut n1, &mut w1, 0.3, 1, lr, b1, b2, eps);
        torch_sparse_adam(&mut q1, &mut n1, &mut w1, 0.2, 2, lr, b1, b2, eps);
        torch_sparse_adam(&mut q2, &mut n2, &mut w2, -0.7, 1, lr, b1, b2, eps);
        assert_eq!(lazy.gather(&[1, 2]), vec![q1, q2]);
        assert_ne!(p1, q1);
        // The first step moves a row by about lr against the gradient's sign.
        assert!((q2 - 0.5 - 0.01).abs() < 1e-4, "{q2}");
    }

    /// The same steps as `torch.optim.{SGD, Adagrad, SparseAdam}` on a 4 x 3
    /// `nn.Parameter` of 0.5 with sparse gradients, and torch 2.15's results (f32 bits,
    /// printed by the script in the comment): rows 1, 3, 1 (row 1 twice); an empty step;
    /// rows 2, 1; row 1.
    ///
    /// ```python
    /// w = torch.nn.Parameter(torch.full((4, 3), 0.5)); opt = make([w])
    /// for ids, rows in steps:
    ///     w.grad = torch.sparse_coo_tensor(torch.tensor([ids]), torch.tensor(rows), (4, 3))
    ///     opt.step()   # an empty step: indices (1, 0), values (0, 3)
    /// ```
    #[test]
    fn sgd_adagrad_and_sparse_adam_match_torch() {
        let steps: [(&[u64], &[f32]); 4] = [
            (&[1, 3, 1], &[0.3, -0.7, 1.1, 0.05, 0.2, -0.4, -0.9, 0.6, 0.25]),
            (&[], &[]),
            (&[2, 1], &[1.5, -0.1, 0.33, -0.2, 0.8, -1.7]),
            (&[1], &[0.01, -0.02, 0.03]),
        ];
        let torch: [(SparseOptimizer, [u32; 12]); 3] = [
            (
                SparseOptimizer::Sgd { lr: 0.1 },
                [
                    0x3f000000, 0x3f000000, 0x3f000000, 0x3f143958, 0x3edd2f1a, 0x3f083126, 0x3eb33333, 0x3f028f5c,
                    0x3eef1aa0, 0x3efd70a4, 0x3ef5c28f, 0x3f0a3d71,
                ],
            ),
            (
                SparseOptimizer::Adagrad { lr: 0.1, lr_decay: 0.01, eps: 1e-10, initial_accumulator_value: 0.1 },
                [
                    0x3f000000, 0x3f000000, 0x3f000000, 0x3f1d64f9, 0x3ee23745, 0x3ef45e43, 0x3ecee22f, 0x3f07913d,
                    0x3edbc1ff, 0x3ef80100, 0x3ee4a1e8, 0x3f141511,
                ],
            ),
            (
                SparseOptimizer::SparseAdam { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-8 },
                [
                    0x3f000000, 0x3f000000, 0x3f000000, 0x3f0604c6, 0x3efff46a, 0x3efc2b1b, 0x3efcbab2, 0x3f01a2a7,
                    0x3efcbab2, 0x3efae14a, 0x3efae148, 0x3f028f5c,
                ],
            ),
        ];
        for (opt, want) in torch {
            let mut s = RowStore::new(rule(3, opt));
            for (ids, g) in steps {
                s.step(ids, g, 1.0);
            }
            let got = s.gather(&[0, 1, 2, 3]);
            let want: Vec<f32> = want.iter().map(|b| f32::from_bits(*b)).collect();
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "{opt:?} value {i}: {g} vs torch {w}");
            }
            let exact = got.iter().zip(&want).filter(|(g, w)| g.to_bits() == w.to_bits()).count();
            assert!(exact >= 12, "{opt:?}: {exact} of 12 values bit for bit: {got:?} vs {want:?}");
        }
    }

    #[test]
    fn a_store_survives_its_state() {
        for opt in [
            SparseOptimizer::Sgd { lr: 0.1 },
            SparseOptimizer::adagrad(0.1),
            SparseOptimizer::sparse_adam(0.1),
            SparseOptimizer::lazy_adam(0.1),
        ] {
            let mut s = RowStore::new(rule(3, opt));
            s.step(&[5, 1], &[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], 1.0);
            let pending = vec![PendingRows { clock: 2, ids: vec![7], grads: vec![1.0; 3], count: 1 }];
            let state = s.state(pending.clone());
            let (mut back, p) = RowStore::from_state(0, state.clone()).unwrap();
            assert_eq!(p, pending);
            s.step(&[1], &[1.0; 3], 0.5);
            back.step(&[1], &[1.0; 3], 0.5);
            assert_eq!(s.state(vec![]), back.state(vec![]), "{opt:?}");
            let mut bad = state.clone();
            bad.values.pop();
            assert!(RowStore::from_state(0, bad).is_err());
            let mut dup = state;
            dup.ids[1] = dup.ids[0];
            assert!(RowStore::from_state(0, dup).is_err());
        }
    }

    fn limited(dim: u32, limits: RowLimits) -> RowStore {
        RowStore::new(RowRule { limits, ..rule(dim, SparseOptimizer::Sgd { lr: 1.0 }) })
    }

    /// One push of gradient 1 to each of `keys`, then the rule's limits.
    fn push(s: &mut RowStore, keys: &[u64]) {
        s.step(keys, &vec![1.0; keys.len() * s.dim()], 1.0);
        s.enforce(|_| false);
    }

    #[test]
    fn a_bound_evicts_the_least_recently_pushed_down_to_its_slack() {
        let mut s = limited(1, RowLimits { max_rows: 16, ..RowLimits::default() });
        for k in 0..16 {
            push(&mut s, &[k]);
        }
        push(&mut s, &[0]);
        assert_eq!((s.rows(), s.counters().evicted), (16, 0), "at the bound nothing goes");
        push(&mut s, &[100]);
        // 17 rows: down to 16 - 16/16 = 15, the two least recently pushed (1 and 2) go.
        assert_eq!(s.rows(), 15);
        assert_eq!(s.counters().evicted, 2);
        assert!(!s.contains(1) && !s.contains(2));
        assert!(s.contains(0) && s.contains(100) && s.contains(3));
        // An evicted row comes back from its initializer.
        assert_eq!(s.gather(&[1, 0]), vec![0.5, 0.5 - 2.0]);
    }

    #[test]
    fn lfu_evicts_the_least_pushed_first() {
        let mut s = limited(1, RowLimits { max_rows: 4, eviction: Eviction::Lfu, ..RowLimits::default() });
        push(&mut s, &[7, 8, 9, 10]);
        push(&mut s, &[7, 9, 10]);
        push(&mut s, &[9]);
        // 8 was pushed once, 7 and 10 twice, 9 three times; 11 is new this step.
        push(&mut s, &[11]);
        assert_eq!(s.rows(), 4, "5 rows, evicted down to 4 - 4/16 = 4");
        assert!(!s.contains(8));
        let mut l = limited(1, RowLimits { max_rows: 4, eviction: Eviction::Lru, ..RowLimits::default() });
        push(&mut l, &[7, 8, 9, 10]);
        push(&mut l, &[7, 9, 10]);
        push(&mut l, &[9]);
        push(&mut l, &[8]);
        push(&mut l, &[11]);
        // Under LRU the oldest push goes: 7 and 10 were last pushed at step 2, 7 < 10.
        assert!(l.contains(8) && !l.contains(7) && l.contains(10));
    }

    #[test]
    fn a_row_not_pushed_for_ttl_steps_expires() {
        let mut s = limited(1, RowLimits { ttl_steps: 4, ..RowLimits::default() });
        push(&mut s, &[1]);
        push(&mut s, &[2]);
        for _ in 0..3 {
            push(&mut s, &[]);
        }
        // Step 5: row 1 last pushed at step 1 (4 steps ago) stays; at step 6 it goes.
        assert!(s.contains(1));
        push(&mut s, &[]);
        assert!(!s.contains(1) && s.contains(2));
        push(&mut s, &[]);
        assert!(!s.contains(2));
        assert_eq!(s.counters().expired, 2);
        assert_eq!(s.counters().evicted, 0);
    }

    #[test]
    fn a_key_gets_a_row_at_its_nth_push_and_its_gradients_before_are_dropped() {
        let mut s = limited(1, RowLimits { admit_after: 3, ..RowLimits::default() });
        // A push naming a key twice counts once.
        s.step(&[5, 5], &[1.0, 1.0], 1.0);
        push(&mut s, &[5]);
        assert!(!s.contains(5));
        assert_eq!(s.gather(&[5]), vec![0.5], "a pull reads the initializer");
        assert_eq!(s.counters().refused_grads, 3);
        s.step(&[5, 6], &[2.0, 1.0], 1.0);
        // The third push created the row and applied its gradient alone.
        assert_eq!(s.gather(&[5]), vec![0.5 - 2.0]);
        assert!(!s.contains(6));
        assert_eq!(s.candidates(), 1);
        assert_eq!(s.counters().created, 1);
    }

    #[test]
    fn neither_a_row_pushed_this_step_nor_a_protected_one_is_evicted() {
        let mut s = limited(1, RowLimits { max_rows: 2, ..RowLimits::default() });
        s.step(&[1, 2, 3, 4], &[1.0; 4], 1.0);
        assert_eq!(s.enforce(|_| false), 0, "every row was pushed by this step");
        assert_eq!(s.rows(), 4);
        s.step(&[], &[], 1.0);
        assert_eq!(s.enforce(|k| k != 4), 1);
        assert_eq!(s.rows(), 3, "only the unprotected row may go");
        assert!(!s.contains(4));
        s.enforce(|_| false);
        assert_eq!(s.rows(), 2);
    }

    #[test]
    fn an_export_pages_the_rows_changed_since_a_step_and_names_the_evicted_keys() {
        let mut s = limited(2, RowLimits { max_rows: 4, ..RowLimits::default() });
        push(&mut s, &[30, 10, 20]);
        let first = s.export(None, None, 2).unwrap();
        assert_eq!((first.ids.clone(), first.more, first.steps), (vec![10, 20], true, 1));
        assert_eq!(first.values, vec![-0.5; 4]);
        let rest = s.export(None, Some(20), 2).unwrap();
        assert_eq!((rest.ids, rest.more), (vec![30], false));
        // Two steps later: 10 is pushed again, 40 and 50 are new; the bound evicts 20 and
        // 30 (pushed at step 1, no later). 20 and 30 were exported: they are named.
        push(&mut s, &[10, 40]);
        push(&mut s, &[50, 60]);
        let delta = s.export(Some(first.steps), None, 100).unwrap();
        assert_eq!(delta.ids, vec![10, 40, 50, 60]);
        assert_eq!(delta.deleted, vec![20, 30]);
        // Paged two keys at a time, rows and deleted keys together, by key.
        let (mut ids, mut deleted, mut after) = (Vec::new(), Vec::new(), None);
        loop {
            let page = s.export(Some(first.steps), after, 2).unwrap();
            assert!(page.ids.len() + page.deleted.len() <= 2);
            after = page.ids.iter().chain(&page.deleted).max().copied();
            ids.extend(page.ids);
            deleted.extend(page.deleted);
            if !page.more {
                break;
            }
        }
        assert_eq!((ids, deleted), (delta.ids.clone(), delta.deleted.clone()));
        // Rows created and evicted between two exports are not named.
        push(&mut s, &[70, 80]);
        push(&mut s, &[90, 91]);
        let next = s.export(Some(delta.steps), None, 100).unwrap();
        assert_eq!(next.ids, vec![70, 80, 90, 91]);
        assert_eq!(next.deleted, vec![10, 40, 50, 60]);
        assert!(s.check().is_ok());
    }

    #[test]
    fn an_export_since_a_forgotten_step_is_refused() {
        let mut s = limited(1, RowLimits { max_rows: 1, ..RowLimits::default() });
        push(&mut s, &[0]);
        s.export(None, None, 10).unwrap();
        // Export before each eviction, so that every evicted key is remembered.
        for k in 1..=(MIN_TOMBSTONES as u64 + 1) {
            push(&mut s, &[k]);
            s.export(Some(s.steps()), None, 0).unwrap();
        }
        let err = s.export(Some(1), None, 10).unwrap_err();
        assert!(matches!(err, CoreError::ExportTooOld { since: 1, .. }), "{err}");
        assert!(s.export(Some(s.steps()), None, 10).is_ok());
    }

    #[test]
    fn a_limited_store_survives_its_state_and_its_parts() {
        let limits = RowLimits { max_rows: 8, eviction: Eviction::Lfu, ttl_steps: 5, admit_after: 2 };
        let mut s = RowStore::new(RowRule { limits, ..rule(2, SparseOptimizer::lazy_adam(0.1)) });
        for k in 0..12u64 {
            s.step(&[k, k + 1, 3], &[0.25; 6], 1.0);
            s.enforce(|_| false);
            if k == 4 {
                s.export(None, None, 100).unwrap();
            }
        }
        let state = s.state(Vec::new());
        let (mut back, _) = RowStore::from_state(0, state.clone()).unwrap();
        assert_eq!(back.state(Vec::new()), state);
        for t in [&mut s, &mut back] {
            t.step(&[20, 3, 11], &[1.0; 6], 1.0);
            t.enforce(|_| false);
        }
        assert_eq!(s.state(Vec::new()), back.state(Vec::new()), "the same steps on both give the same state");
        let (odd, even) = (state.part(|k| k % 2 == 1), state.part(|k| k % 2 == 0));
        assert_eq!(odd.ids.len() + even.ids.len(), state.ids.len());
        assert!(odd.ids.iter().all(|k| k % 2 == 1));
        assert!(odd.candidates.iter().flatten().all(|(k, _)| k % 2 == 1));
        RowStore::from_state(0, odd).unwrap();
        RowStore::from_state(0, even).unwrap();
        let mut bad = state;
        bad.last[0] = bad.steps + 1;
        assert!(RowStore::from_state(0, bad).is_err());
    }

    #[test]
    fn key_positions_spread_sequential_keys_over_the_key_space() {
        let ranges = 16u64;
        let mut counts = vec![0u32; ranges as usize];
        for id in 0..16_000u64 {
            let at = key_position(id);
            assert!(at < KEY_POSITIONS);
            counts[(at / (KEY_POSITIONS / ranges)) as usize] += 1;
        }
        assert!(counts.iter().all(|c| (800..1200).contains(c)), "{counts:?}");
        assert_ne!(key_position(u64::MAX), key_position(0));
    }

    proptest::proptest! {
        /// Any mix of pushes, migrations (the state rebuilt) and splits (the state cut in
        /// two by key) under any limits: every row present holds exactly its pushes since
        /// its last creation, and a row pushed by a step is never evicted by it.
        #[test]
        fn a_limited_store_holds_exactly_the_pushes_since_each_rows_creation(
            max_rows in 0u64..6,
            lfu in proptest::bool::ANY,
            ttl_steps in 0u64..5,
            admit_after in 0u32..3,
            ops in proptest::collection::vec((0u8..10, proptest::collection::vec((0u64..12, 1i8..4), 0..6)), 1..40),
        ) {
            let eviction = if lfu { Eviction::Lfu } else { Eviction::Lru };
            let limits = RowLimits { max_rows, eviction, ttl_steps, admit_after };
            let mut stores = vec![RowStore::new(RowRule { limits, ..rule(1, SparseOptimizer::Sgd { lr: 1.0 }) })];
            // Key -> the sum of its gradients since its row was created (None: no row).
            let mut model: HashMap<u64, f32> = HashMap::new();
            for (op, pushes) in ops {
                match op {
                    0 => {
                        let moved = stores.iter().map(|s| RowStore::from_state(0, s.state(Vec::new())).unwrap().0).collect();
                        stores = moved;
                    }
                    1 if stores.len() == 1 => {
                        let state = stores[0].state(Vec::new());
                        stores = vec![
                            RowStore::from_state(0, state.part(|k| k % 2 == 0)).unwrap().0,
                            RowStore::from_state(0, state.part(|k| k % 2 == 1)).unwrap().0,
                        ];
                    }
                    _ => {
                        let parts = stores.len();
                        for (part, store) in stores.iter_mut().enumerate() {
                            let mine = |k: u64| parts == 1 || k % 2 == part as u64;
                            let (ids, grads): (Vec<u64>, Vec<f32>) =
                                pushes.iter().filter(|(k, _)| mine(*k)).map(|(k, g)| (*k, f32::from(*g))).unzip();
                            let before: HashSet<u64> = ids.iter().copied().filter(|k| store.contains(*k)).collect();
                            store.step(&ids, &grads, 1.0);
                            store.enforce(|_| false);
                            for k in &before {
                                proptest::prop_assert!(store.contains(*k), "row {} pushed by this step was evicted", k);
                            }
                            for (k, g) in ids.iter().zip(&grads) {
                                if store.contains(*k) {
                                    *model.entry(*k).or_insert(0.0) += g;
                                }
                            }
                        }
                    }
                }
                let parts = stores.len();
                for k in 0..12u64 {
                    let store = &stores[if parts == 1 { 0 } else { (k % 2) as usize }];
                    if !store.contains(k) {
                        model.remove(&k);
                        continue;
                    }
                    let want = 0.5 - model.get(&k).copied().unwrap_or(0.0);
                    proptest::prop_assert_eq!(store.gather(&[k]), vec![want], "row {}", k);
                }
                for s in &stores {
                    proptest::prop_assert!(s.check().is_ok());
                    if max_rows > 0 {
                        proptest::prop_assert!(s.rows() as u64 <= max_rows.max(6), "{} rows", s.rows());
                    }
                }
            }
        }
    }

    #[test]
    fn memory_follows_the_rows_touched() {
        let mut s = RowStore::new(rule(64, SparseOptimizer::sparse_adam(0.01)));
        let ids: Vec<u64> = (0..1000).map(|i| i * 10_007).collect();
        s.step(&ids, &vec![0.1; ids.len() * 64], 1.0);
        assert_eq!(s.rows(), 1000);
        assert_eq!(s.state_len(), 1000 * 64 * 3);
    }

    #[test]
    fn a_histogram_splits_where_half_of_the_rows_pushed_fall_on_each_side() {
        // 640 rows in 64 buckets of 10.
        let mut h = RowHistogram::new(1000, 1640);
        assert_eq!(h.split_at(), None);
        h.record([1000, 1001, 1005, 1012, 1012, 1639]);
        // Three rows below 1010, three at or past it.
        assert_eq!(h.split_at(), Some(1010));
        // All in the first bucket: the cut isolates it.
        let mut hot = RowHistogram::new(0, 100_000);
        hot.record([0, 1, 2, 3, 7]);
        assert_eq!(hot.split_at(), Some(1563));
        // A range of two rows cuts between them; one row cannot be cut.
        let mut two = RowHistogram::new(5, 7);
        two.record([6, 6]);
        assert_eq!(two.split_at(), Some(6));
        let mut one = RowHistogram::new(5, 6);
        one.record([5]);
        assert_eq!(one.split_at(), None);
        // All in one bucket past the first: the cut is at its start (the half holding it
        // is the narrower one, and a later split of it cuts it finer).
        let mut late = RowHistogram::new(0, 640);
        late.record([305, 301, 309]);
        assert_eq!(late.split_at(), Some(300));
        let mut last = RowHistogram::new(0, 640);
        last.record([639]);
        assert_eq!(last.split_at(), Some(630));
        // Rows outside the range are not counted.
        let mut out = RowHistogram::new(10, 20);
        out.record([3, 25]);
        assert_eq!(out.total(), 0);
    }
}
