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

use std::collections::HashMap;

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
}

/// The rows of one row block that exist (were pushed to), with their optimizer state.
/// Memory is proportional to the rows touched, not to the range.
#[derive(Clone, Debug)]
pub struct RowStore {
    rule: RowRule,
    /// Row id -> slot.
    index: HashMap<u64, u32>,
    /// Slot -> row id, in creation order.
    ids: Vec<u64>,
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
    /// Aggregate mode: the row pushes of clocks not yet complete.
    pub pending: Vec<PendingRows>,
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
        }
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
    /// `out` (`dim` values).
    pub fn read(&self, row: u64, out: &mut [f32]) {
        let dim = self.dim();
        match self.index.get(&row) {
            Some(&slot) => out.copy_from_slice(&self.values[slot as usize * dim..][..dim]),
            None => self.rule.init.fill(self.rule.key, row, out),
        }
    }

    /// The rows `ids`, in that order, `ids.len() * dim` values.
    pub fn gather(&self, ids: &[u64]) -> Vec<f32> {
        let dim = self.dim();
        let mut out = vec![0.0; ids.len() * dim];
        for (row, chunk) in ids.iter().zip(out.chunks_exact_mut(dim.max(1))) {
            self.read(*row, chunk);
        }
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
    /// table. The caller checked the lengths.
    pub fn step(&mut self, ids: &[u64], grads: &[f32], scale: f32) {
        let dim = self.dim();
        debug_assert_eq!(ids.len() * dim, grads.len());
        self.steps = self.steps.saturating_add(1);
        if let SparseOptimizer::Sgd { lr } = self.rule.optimizer {
            // torch's `p.add_(g, alpha=-lr)` of an uncoalesced sparse gradient: every
            // (row, gradient) in the order given, a repeated row once per occurrence.
            let alpha = -lr as f32;
            for (row, g) in ids.iter().zip(grads.chunks_exact(dim.max(1))) {
                let at = self.slot(*row) * dim;
                let p = &mut self.values[at..at + dim];
                p.iter_mut().zip(g).for_each(|(p, g)| *p += alpha * (g * scale));
            }
            return;
        }
        let (rows, summed) = coalesce(ids, grads, dim);
        let mut g = vec![0.0f32; dim];
        for (k, row) in rows.iter().enumerate() {
            g.copy_from_slice(&summed[k * dim..][..dim]);
            if scale != 1.0 {
                g.iter_mut().for_each(|x| *x *= scale);
            }
            let slot = self.slot(*row);
            self.apply(slot, &g);
        }
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
        {
            return Err(bad(format!("{n} rows of {dim} values, and buffers of other lengths")));
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

    /// Counts the rows of one push (a row named twice counts twice: it was sent twice).
    pub fn record(&mut self, ids: &[u64]) {
        for id in ids {
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
        RowRule { dim, init: RowInit::Constant(0.5), key: 7, optimizer }
    }

    #[test]
    fn rows_are_created_only_when_pushed_and_read_their_initial_values_before() {
        let init = RowInit::Normal { mean: 0.0, std: 1.0 };
        let mut s = RowStore::new(RowRule {
            dim: 4,
            init,
            key: row_key(1, "emb"),
            optimizer: SparseOptimizer::Sgd { lr: 1.0 },
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
        h.record(&[1000, 1001, 1005, 1012, 1012, 1639]);
        // Three rows below 1010, three at or past it.
        assert_eq!(h.split_at(), Some(1010));
        // All in the first bucket: the cut isolates it.
        let mut hot = RowHistogram::new(0, 100_000);
        hot.record(&[0, 1, 2, 3, 7]);
        assert_eq!(hot.split_at(), Some(1563));
        // A range of two rows cuts between them; one row cannot be cut.
        let mut two = RowHistogram::new(5, 7);
        two.record(&[6, 6]);
        assert_eq!(two.split_at(), Some(6));
        let mut one = RowHistogram::new(5, 6);
        one.record(&[5]);
        assert_eq!(one.split_at(), None);
        // All in one bucket past the first: the cut is at its start (the half holding it
        // is the narrower one, and a later split of it cuts it finer).
        let mut late = RowHistogram::new(0, 640);
        late.record(&[305, 301, 309]);
        assert_eq!(late.split_at(), Some(300));
        let mut last = RowHistogram::new(0, 640);
        last.record(&[639]);
        assert_eq!(last.split_at(), Some(630));
        // Rows outside the range are not counted.
        let mut out = RowHistogram::new(10, 20);
        out.record(&[3, 25]);
        assert_eq!(out.total(), 0);
    }
}
