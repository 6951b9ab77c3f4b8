//! The per-block state machine a server runs: values, optimizer state, clocks, held
//! pulls and counters of one block.
//!
//! Events come in as method calls with the current time in microseconds (the core has
//! no clock of its own); the pulls that can be answered come back as [`Answer`]s, which
//! the runtime sends. `T` is the runtime's opaque handle for where to send an answer.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::CoreError;
use crate::model::{BlockId, BlockSpec};
use crate::optimizer::{OptState, OptimizerConfig};
use crate::rows::{PendingRows, RowHistogram, RowRule, RowState, RowStore};
use crate::stats::Histogram;
use rand::Rng;

use crate::sync::{Clock, Clocks, PullView, SyncPolicy, Verdict};

/// How a server treats the blocks it owns; sent by the scheduler with the assignment.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardConfig {
    /// When pulls are answered.
    pub sync: SyncPolicy,
    /// How pushes become updates.
    pub optimizer: OptimizerConfig,
    /// Number of workers in the job (ranks `0..workers`).
    pub workers: u32,
}

/// Counters of one block (or, summed, of one server): the papers' metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockStats {
    /// Pushes applied (duplicates excluded).
    pub pushes: u64,
    /// Pulls answered.
    pub pulls: u64,
    /// Pulls that were held by the sync policy before being answered.
    pub pulls_held: u64,
    /// Total time pulls spent held, in microseconds.
    pub hold_us: u64,
    /// Times held pulls were released (sync events).
    pub releases: u64,
    /// Payload bytes received in pushes.
    pub bytes_in: u64,
    /// Payload bytes sent in pull replies.
    pub bytes_out: u64,
    /// Largest lead seen between the fastest and the slowest worker, in clocks.
    pub max_lead: u64,
    /// Rows pushed and pulled (row blocks; a row named twice counts twice).
    pub rows: u64,
}

impl BlockStats {
    /// Adds `other` into `self`.
    pub fn merge(&mut self, other: &BlockStats) {
        self.pushes += other.pushes;
        self.pulls += other.pulls;
        self.pulls_held += other.pulls_held;
        self.hold_us += other.hold_us;
        self.releases += other.releases;
        self.bytes_in += other.bytes_in;
        self.bytes_out += other.bytes_out;
        self.max_lead = self.max_lead.max(other.max_lead);
        self.rows += other.rows;
    }
}

/// What a block's oldest held pull waits for ("pull(17) of worker 1 waits for worker 2
/// to push clock 15").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Waiting {
    /// The worker whose pull is held.
    pub worker: u32,
    /// The clock of that pull.
    pub clock: Clock,
    /// The slowest worker, whose next push moves `done`.
    pub slowest: u32,
    /// The clock the slowest worker must push next.
    pub next_clock: Clock,
    /// How long the pull has been held.
    pub held_us: u64,
}

/// A pull the server can answer now.
#[derive(Clone, Debug)]
pub struct Answer<T> {
    /// The runtime's handle of the request.
    pub token: T,
    /// Rank of the worker that pulled.
    pub worker: u32,
    /// The clock of the pull.
    pub clock: Clock,
    /// The block's `done` clock when the pull was answered (for traces and invariants).
    pub done: Clock,
    /// How long the pull was held, if it was.
    pub held_us: Option<u64>,
    /// The values to send (shared; the next push copies on write if this is still alive).
    /// For a row pull, the rows asked for, in the order asked.
    pub values: Arc<Vec<f32>>,
    /// For a row pull ([`Block::pull_rows`]), the row ids it asked for; `None` for a
    /// dense pull.
    pub rows: Option<Arc<[u64]>>,
}

#[derive(Clone, Debug)]
struct HeldPull<T> {
    token: T,
    worker: u32,
    clock: Clock,
    /// A row pull's ids.
    rows: Option<Arc<[u64]>>,
    /// The `done` clock that releases it.
    until: Clock,
    since_us: u64,
    /// Its place in the order the pulls were held: released pulls are answered in it.
    seq: u64,
}

/// A block's held pulls, with what the hot path asks of them kept at hand: the pulls by
/// the `done` clock that releases them (a push that releases nothing looks at one key,
/// and one that releases some takes out those alone: with 1,000,000 pulls held far ahead,
/// an honest worker's push costs no scan of them) and how many are held per clock (a pull
/// asks whether one of its clock is held). At 1,000 workers a scan per push or pull would
/// dominate.
#[derive(Debug)]
struct HeldPulls<T> {
    /// By `until`, each in the order held.
    by_until: BTreeMap<Clock, Vec<HeldPull<T>>>,
    len: usize,
    per_clock: BTreeMap<Clock, u32>,
    next_seq: u64,
}

impl<T> HeldPulls<T> {
    fn new() -> Self {
        Self { by_until: BTreeMap::new(), len: 0, per_clock: BTreeMap::new(), next_seq: 0 }
    }

    fn len(&self) -> usize {
        self.len
    }

    fn hold(&mut self, mut pull: HeldPull<T>) {
        pull.seq = self.next_seq;
        self.next_seq += 1;
        *self.per_clock.entry(pull.clock).or_default() += 1;
        self.by_until.entry(pull.until).or_default().push(pull);
        self.len += 1;
    }

    fn any_at(&self, clock: Clock) -> bool {
        self.per_clock.contains_key(&clock)
    }

    fn iter(&self) -> impl Iterator<Item = &HeldPull<T>> {
        self.by_until.values().flatten()
    }

    fn oldest(&self) -> Option<&HeldPull<T>> {
        self.iter().min_by_key(|h| (h.since_us, h.seq))
    }

    /// Counts `taken` out, and returns them in the order they were held.
    fn taken(&mut self, mut taken: Vec<HeldPull<T>>) -> Vec<HeldPull<T>> {
        self.len -= taken.len();
        for h in &taken {
            if let std::collections::btree_map::Entry::Occupied(mut e) = self.per_clock.entry(h.clock) {
                *e.get_mut() -= 1;
                if *e.get() == 0 {
                    e.remove();
                }
            }
        }
        taken.sort_unstable_by_key(|h| h.seq);
        taken
    }

    /// Takes out the pulls for which `keep` is false (a scan of every pull held).
    fn take_unless(&mut self, keep: impl Fn(&HeldPull<T>) -> bool) -> Vec<HeldPull<T>> {
        let mut taken = Vec::new();
        self.by_until.retain(|_, pulls| {
            let (kept, out): (Vec<_>, Vec<_>) = pulls.drain(..).partition(|h| keep(h));
            *pulls = kept;
            taken.extend(out);
            !pulls.is_empty()
        });
        self.taken(taken)
    }

    /// The pulls `done` releases: those alone are looked at.
    fn take_ready(&mut self, done: Clock) -> Vec<HeldPull<T>> {
        let mut ready = Vec::new();
        while let Some(e) = self.by_until.first_entry()
            && *e.key() <= done
        {
            ready.extend(e.remove());
        }
        if ready.is_empty() {
            return ready;
        }
        self.taken(ready)
    }
}

/// What one push carries for its block. On the wire (a `Push`, `PushPull` or `Forward`
/// payload, a [`LoggedPush`]) a dense gradient is its values, and no gradient is an empty
/// payload ([`Gradient::from_payload`]): blocks are never empty, so the two cannot be
/// confused. A sparse gradient ([`crate::compress`]) carries its indices beside its values.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Gradient<'a> {
    /// One value per element of the block.
    Dense(&'a [f32]),
    /// The gradient at some elements, zero at the others (a worker's top-k or random-k,
    /// [`crate::compress::SparseGrad`]): applied as the dense gradient with zeros elsewhere
    /// would be, bit for bit, without densifying the block where that can be
    /// ([`Block::push_gradient`]). Checked by [`Gradient::check`].
    Sparse {
        /// Strictly ascending, each below the block's length, at least one.
        indices: &'a [u32],
        /// One per index.
        values: &'a [f32],
    },
    /// No gradient this clock (a parameter unused in the forward pass, PyTorch's
    /// `p.grad is None`; a table block a worker touched no row of): the push counts for
    /// the clock (sync policies, the exactly-once clock state, logs, replicas) and applies
    /// nothing, so optimizer state (momentum, Adam's moments and step count) does not move.
    None,
}

impl<'a> Gradient<'a> {
    /// A push's payload as a gradient: empty is [`Gradient::None`].
    pub fn from_payload(values: &'a [f32]) -> Self {
        if values.is_empty() { Gradient::None } else { Gradient::Dense(values) }
    }

    /// The values it carries: a dense gradient's, a sparse one's (one per index), empty
    /// for [`Gradient::None`].
    pub const fn payload(self) -> &'a [f32] {
        match self {
            Gradient::Dense(g) | Gradient::Sparse { values: g, .. } => g,
            Gradient::None => &[],
        }
    }

    /// Why it does not fit block `block` of `len` elements: a dense gradient of another
    /// length ([`CoreError::WrongLength`]); a sparse one without an index, with indices not
    /// strictly ascending or past the end, or not one value per index
    /// ([`CoreError::BadSparse`]). Linear in what it carries; never panics.
    pub fn check(self, block: BlockId, len: usize) -> Result<(), CoreError> {
        match self {
            Gradient::None => Ok(()),
            Gradient::Dense(g) if g.len() == len => Ok(()),
            Gradient::Dense(g) => Err(CoreError::WrongLength { block, expected: len, got: g.len() }),
            Gradient::Sparse { indices, values } => {
                let bad = |why: String| Err(CoreError::BadSparse { block, len, why });
                if indices.len() != values.len() {
                    return bad(format!("{} indices but {} values", indices.len(), values.len()));
                }
                if indices.is_empty() {
                    return bad("no index (a push without a gradient carries no payload)".into());
                }
                if let Some(at) = indices.windows(2).position(|w| w[0] >= w[1]) {
                    return bad(format!(
                        "index {} at position {} does not follow {} (indices must be strictly ascending)",
                        indices[at + 1],
                        at + 1,
                        indices[at]
                    ));
                }
                // Ascending: the last is the largest.
                match indices.last() {
                    Some(last) if *last as usize >= len => bad(format!("index {last} is past the end")),
                    _ => Ok(()),
                }
            }
        }
    }
}

/// Everything a block carries to its new owner when it migrates: values, optimizer state,
/// clock state and the aggregate buffer. Held pulls stay behind (the old owner answers
/// them `Moved` and the workers re-issue them); counters stay with the server that
/// counted them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BlockState {
    /// The block.
    pub spec: BlockSpec,
    /// Its values.
    #[serde(with = "crate::f32s")]
    pub values: Vec<f32>,
    /// Its optimizer state.
    pub opt: OptState,
    /// Which clocks each worker has pushed (what makes a resent push a duplicate).
    pub clocks: Clocks,
    /// Aggregate mode: the sums of clocks not yet complete.
    pub pending: Vec<PendingSum>,
    /// A row block's rows, their optimizer state and its aggregate sums (then `values`,
    /// `opt` and `pending` are empty); `None` for a dense block.
    pub rows: Option<Box<RowState>>,
}

impl BlockState {
    /// Number of f32s it carries (values, optimizer state, aggregate sums), as
    /// [`Block::state_len`] counts them.
    pub fn state_len(&self) -> usize {
        self.values.len()
            + self.opt.m.len()
            + self.opt.v.len()
            + self.pending.iter().map(|p| p.sum.len()).sum::<usize>()
            + self.rows.as_ref().map_or(0, |r| {
                r.values.len() + r.m.len() + r.v.len() + r.pending.iter().map(|p| p.grads.len()).sum::<usize>()
            })
    }
}

impl BlockState {
    /// The states of the two halves of a row block split at row `at`
    /// ([`crate::model::Partition::split_rows`]): `left` and `right` are the new blocks'
    /// specs. Each half has the rows of its range with their optimizer state, and both
    /// keep the whole clock state and step count (each push the block took counts as
    /// taken by both), so a resent push is a duplicate on either half. Aggregate sums are
    /// cut by row, each half keeping the count of pushes. Refused for a dense state and
    /// halves that do not cut this block's range at one row.
    pub fn split_rows(self, left: BlockSpec, right: BlockSpec) -> Result<(BlockState, BlockState), CoreError> {
        let id = self.spec.id;
        let (Some((start, end, dim)), Some((ls, le, ld)), Some((rs, re, rd))) =
            (self.spec.row_range(), left.row_range(), right.row_range())
        else {
            return Err(CoreError::NotRows(id));
        };
        if ls != start || re != end || le != rs || ls >= le || rs >= re || ld != dim || rd != dim {
            return Err(CoreError::BadRowState {
                block: id,
                why: format!("rows {ls}..{le} and {rs}..{re} do not cut its rows {start}..{end} in two"),
            });
        }
        let Some(rows) = self.rows else { return Err(CoreError::NotRows(id)) };
        let cut = |spec: BlockSpec, (s, e): (u64, u64)| {
            let mut part = rows.part(|r| spec.holds(r));
            // Each half bounds its rows by its share of the block's bound, as
            // `Partition::row_rule` gives each block its share of the table's.
            let max = part.rule.limits.max_rows;
            if max > 0 {
                let share = (u128::from(max) * u128::from(e - s)).div_ceil(u128::from(end - start));
                part.rule.limits.max_rows = u64::try_from(share).unwrap_or(u64::MAX).max(1);
            }
            BlockState {
                spec,
                values: Vec::new(),
                opt: OptState::default(),
                clocks: self.clocks.clone(),
                pending: Vec::new(),
                rows: Some(Box::new(part)),
            }
        };
        Ok((cut(left, (ls, le)), cut(right, (rs, re))))
    }
}

/// Aggregate mode: the sum of the pushes of one clock received so far, and how many.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PendingSum {
    /// The clock.
    pub clock: Clock,
    /// Sum of the gradients pushed for it; empty while every push of the clock carried
    /// no gradient ([`Gradient::None`]).
    #[serde(with = "crate::f32s")]
    pub sum: Vec<f32>,
    /// Number of pushes received for it, those without a gradient included.
    pub count: u32,
}

/// A push applied while its block was being copied to a new owner, which replays it
/// (in order) on top of the snapshot: the "delta" of a migration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LoggedPush {
    /// The worker that pushed.
    pub worker: u32,
    /// The clock it pushed.
    pub clock: Clock,
    /// The gradient (for a row push, `rows.len() x dim`; for a sparse push, one value per
    /// index); empty for a push without one ([`Gradient::None`]).
    #[serde(with = "crate::f32s")]
    pub grad: Vec<f32>,
    /// A row push's row ids (empty for an empty row push); for a push to a dense block,
    /// empty for a dense gradient and a sparse gradient's indices ([`Gradient::Sparse`],
    /// kept sparse: a 1% push logs 1% of the block).
    pub rows: Vec<u64>,
}

impl LoggedPush {
    /// A dense push.
    pub fn dense(worker: u32, clock: Clock, grad: Vec<f32>) -> Self {
        Self { worker, clock, grad, rows: Vec::new() }
    }

    /// A push of `grad` to a dense block, as logged: dense, sparse or none.
    pub fn of(worker: u32, clock: Clock, grad: Gradient<'_>) -> Self {
        let rows = match grad {
            Gradient::Sparse { indices, .. } => indices.iter().map(|i| u64::from(*i)).collect(),
            Gradient::Dense(_) | Gradient::None => Vec::new(),
        };
        Self { worker, clock, grad: grad.payload().to_vec(), rows }
    }
}

/// A row block's part of a [`Block`]: the rows that exist, and aggregate mode's row
/// pushes of clocks not yet complete.
#[derive(Debug)]
struct RowPart {
    store: RowStore,
    pending: BTreeMap<Clock, PendingRows>,
    /// Where the pushes since the block came here fell: its split point.
    hist: RowHistogram,
}

/// One block owned by a server.
#[derive(Debug)]
pub struct Block<T> {
    spec: BlockSpec,
    values: Arc<Vec<f32>>,
    opt: OptState,
    clocks: Clocks,
    /// Aggregate mode: per clock, the sum of the gradients received (empty while none
    /// came) and how many pushes.
    pending: BTreeMap<Clock, (Vec<f32>, u32)>,
    held: HeldPulls<T>,
    stats: BlockStats,
    hold_hist: Histogram,
    /// While a migration copies the block: the pushes applied since the snapshot.
    log: Option<Vec<LoggedPush>>,
    /// A row block's rows (then `values` is empty).
    rows: Option<Box<RowPart>>,
}

impl<T> Block<T> {
    /// A block with its initial values, expecting pushes from `config.workers` workers.
    pub fn new(spec: BlockSpec, values: Vec<f32>, config: &ShardConfig) -> Result<Self, CoreError> {
        if values.len() != spec.len {
            return Err(CoreError::WrongLength { block: spec.id, expected: spec.len, got: values.len() });
        }
        Ok(Self {
            spec,
            values: Arc::new(values),
            opt: OptState::default(),
            clocks: Clocks::new(config.workers),
            pending: BTreeMap::new(),
            held: HeldPulls::new(),
            stats: BlockStats::default(),
            hold_hist: Histogram::default(),
            log: None,
            rows: None,
        })
    }

    /// A row block ([`BlockKind::Rows`](crate::model::BlockKind)) with no row yet, making
    /// and updating its rows by `rule` (its table's), expecting pushes from
    /// `config.workers` workers.
    pub fn new_rows(spec: BlockSpec, rule: RowRule, config: &ShardConfig) -> Result<Self, CoreError> {
        let Some((start, end, dim)) = spec.row_range() else { return Err(CoreError::NotRows(spec.id)) };
        if dim != rule.dim {
            return Err(CoreError::WrongDim { block: spec.id, expected: dim, got: rule.dim });
        }
        let mut block = Self::new(BlockSpec { len: 0, ..spec }, Vec::new(), config)?;
        block.spec = spec;
        let hist = RowHistogram::new(start, end);
        block.rows = Some(Box::new(RowPart { store: RowStore::new(rule), pending: BTreeMap::new(), hist }));
        Ok(block)
    }

    /// A block arriving by migration: `state` as the old owner sent it, then the pushes it
    /// applied after its snapshot, replayed in order (duplicates are dropped by the clock
    /// state, so a push is applied exactly once). Counters start at zero.
    pub fn from_state(state: BlockState, delta: &[LoggedPush], config: &ShardConfig) -> Result<Self, CoreError> {
        let spec = state.spec;
        if let Some(rows) = state.rows {
            return Self::from_row_state(spec, state.clocks, *rows, delta, config);
        }
        if spec.is_rows() {
            return Err(CoreError::NotDense(spec.id));
        }
        let lens_ok = state.values.len() == spec.len
            && [&state.opt.m, &state.opt.v].iter().all(|v| v.is_empty() || v.len() == spec.len)
            && state.pending.iter().all(|p| (p.sum.is_empty() || p.sum.len() == spec.len) && p.count > 0);
        if !lens_ok {
            return Err(CoreError::WrongLength { block: spec.id, expected: spec.len, got: state.values.len() });
        }
        if !state.clocks.is_consistent() || state.clocks.workers() != config.workers {
            return Err(CoreError::UnknownWorker(state.clocks.workers()));
        }
        let mut block = Self {
            spec,
            values: Arc::new(state.values),
            opt: state.opt,
            clocks: state.clocks,
            pending: state.pending.into_iter().map(|p| (p.clock, (p.sum, p.count))).collect(),
            held: HeldPulls::new(),
            stats: BlockStats::default(),
            hold_hist: Histogram::default(),
            log: None,
            rows: None,
        };
        block.replay(config, delta, &[])?;
        Ok(block)
    }

    /// [`Block::from_state`] of a row block.
    fn from_row_state(
        spec: BlockSpec,
        clocks: Clocks,
        rows: RowState,
        delta: &[LoggedPush],
        config: &ShardConfig,
    ) -> Result<Self, CoreError> {
        let Some((_, _, dim)) = spec.row_range() else { return Err(CoreError::NotRows(spec.id)) };
        if rows.rule.dim != dim {
            return Err(CoreError::WrongDim { block: spec.id, expected: dim, got: rows.rule.dim });
        }
        if let Some(row) = rows.ids.iter().chain(rows.pending.iter().flat_map(|p| &p.ids)).find(|r| !spec.holds(**r)) {
            let (start, end, _) = spec.row_range().unwrap_or_default();
            return Err(CoreError::RowOutOfRange { block: spec.id, row: *row, start, end });
        }
        if !clocks.is_consistent() || clocks.workers() != config.workers {
            return Err(CoreError::UnknownWorker(clocks.workers()));
        }
        let (store, pending) = RowStore::from_state(spec.id, rows)?;
        let mut block = Self::new_rows(spec, *store.rule(), config)?;
        block.clocks = clocks;
        if let Some(part) = block.rows.as_mut() {
            part.store = store;
            part.pending = pending.into_iter().map(|p| (p.clock, p)).collect();
        }
        block.replay(config, delta, &[])?;
        Ok(block)
    }

    /// Replays the pushes `delta` of a migration in order (duplicates dropped). A push of
    /// a worker in `rejoined` past its next clock skips it there ([`Block::push_rejoined`]).
    /// The counters stay as they were, the rows' too (created, evicted): the pushes were
    /// counted by the old owner.
    pub fn replay(&mut self, config: &ShardConfig, delta: &[LoggedPush], rejoined: &[u32]) -> Result<(), CoreError> {
        let stats = self.stats;
        let row_counters = self.rows.as_ref().map(|r| r.store.counters());
        for p in delta {
            let rejoined = rejoined.contains(&p.worker);
            if self.rows.is_some() {
                if rejoined {
                    self.clocks.skip_to(p.worker, p.clock);
                }
                self.push_rows(config, p.worker, p.clock, &p.rows, &p.grad, 0)?;
            } else {
                // A sparse push's indices (an index past u32 is past the end of any block,
                // and refused as such).
                let indices: Vec<u32> = p.rows.iter().map(|i| u32::try_from(*i).unwrap_or(u32::MAX)).collect();
                let grad = if p.rows.is_empty() {
                    Gradient::from_payload(&p.grad)
                } else {
                    Gradient::Sparse { indices: &indices, values: &p.grad }
                };
                if rejoined {
                    self.clocks.skip_to(p.worker, p.clock);
                }
                self.push_gradient(config, p.worker, p.clock, grad, 0)?;
            }
        }
        self.stats = stats;
        if let (Some(part), Some(counters)) = (self.rows.as_mut(), row_counters) {
            part.store.restore_counters(counters);
        }
        Ok(())
    }

    /// [`Block::push`] from a worker that rejoined (restarted with its rank): a clock past
    /// its next one skips the clocks between instead of being refused as a gap (each copy
    /// of a block may have taken it back at another clock).
    pub fn push_rejoined(
        &mut self,
        config: &ShardConfig,
        worker: u32,
        clock: Clock,
        grad: &[f32],
        now_us: u64,
    ) -> Result<Vec<Answer<T>>, CoreError> {
        self.clocks.skip_to(worker, clock);
        self.push(config, worker, clock, grad, now_us)
    }

    /// Replaces the initial values (the first worker's parameters, broadcast), allowed
    /// only before any push: afterwards the values carry training and stay.
    pub fn set_initial(&mut self, values: &[f32]) -> Result<(), CoreError> {
        if self.rows.is_some() {
            return Err(CoreError::NotDense(self.spec.id));
        }
        if values.len() != self.spec.len {
            return Err(CoreError::WrongLength { block: self.spec.id, expected: self.spec.len, got: values.len() });
        }
        if self.clocks.fast().is_some() || !self.pending.is_empty() || self.log.is_some() {
            return Err(CoreError::AlreadyTrained(self.spec.id));
        }
        Arc::make_mut(&mut self.values).copy_from_slice(values);
        Ok(())
    }

    /// The block's state for a migration, and from now on a log of the pushes applied
    /// after it ([`Block::take_log`]).
    pub fn snapshot(&mut self) -> BlockState {
        self.log = Some(Vec::new());
        self.state()
    }

    /// The block's state as it is (values, optimizer, clock state, aggregate sums): what
    /// a checkpoint keeps of it. Unlike [`Block::snapshot`], no log starts.
    pub fn state(&self) -> BlockState {
        BlockState {
            spec: self.spec,
            values: self.values.as_ref().clone(),
            opt: self.opt.clone(),
            clocks: self.clocks.clone(),
            pending: self
                .pending
                .iter()
                .map(|(clock, (sum, count))| PendingSum { clock: *clock, sum: sum.clone(), count: *count })
                .collect(),
            rows: self.rows.as_ref().map(|r| Box::new(r.store.state(r.pending.values().cloned().collect()))),
        }
    }

    /// Number of f32s a snapshot carries (values, optimizer state, aggregate sums).
    pub fn state_len(&self) -> usize {
        self.values.len()
            + self.opt.m.len()
            + self.opt.v.len()
            + self.pending.values().map(|(s, _)| s.len()).sum::<usize>()
            + self
                .rows
                .as_ref()
                .map_or(0, |r| r.store.state_len() + r.pending.values().map(|p| p.grads.len()).sum::<usize>())
    }

    /// Where to split this row block so that each half takes about half of the rows
    /// pushed to it since it came here ([`RowHistogram::split_at`]); `None` for a dense
    /// block, one not pushed yet, or a single row.
    pub fn split_hint(&self) -> Option<u64> {
        self.rows.as_ref().and_then(|r| r.hist.split_at())
    }

    /// A row block's rows (`None` for a dense block).
    pub fn rows(&self) -> Option<&RowStore> {
        self.rows.as_ref().map(|r| &r.store)
    }

    /// A page of this row block's rows changed since step `since` ([`RowStore::export`]);
    /// refused for a dense block.
    pub fn export_rows(
        &mut self,
        since: Option<u64>,
        after: Option<u64>,
        max_rows: usize,
    ) -> Result<crate::rows::RowExport, CoreError> {
        match self.rows.as_mut() {
            Some(part) => part.store.export(since, after, max_rows),
            None => Err(CoreError::NotRows(self.spec.id)),
        }
    }

    /// The pushes applied since [`Block::snapshot`]; logging stops (also to abandon a
    /// migration).
    pub fn take_log(&mut self) -> Vec<LoggedPush> {
        self.log.take().unwrap_or_default()
    }

    /// The block's description.
    pub fn spec(&self) -> &BlockSpec {
        &self.spec
    }

    /// Current values.
    pub fn values(&self) -> &Arc<Vec<f32>> {
        &self.values
    }

    /// The optimizer state of a dense block (steps, momentum or Adam's moments).
    pub fn opt_state(&self) -> Result<&OptState, CoreError> {
        if self.rows.is_some() {
            return Err(CoreError::NotDense(self.spec.id));
        }
        Ok(&self.opt)
    }

    /// Overwrites the values of a dense block (a PyTorch model's buffers, which one
    /// worker computes and every worker pulls), leaving its optimizer and clock state alone.
    pub fn set_values(&mut self, values: &[f32]) -> Result<(), CoreError> {
        if self.rows.is_some() {
            return Err(CoreError::NotDense(self.spec.id));
        }
        if values.len() != self.spec.len {
            return Err(CoreError::WrongLength { block: self.spec.id, expected: self.spec.len, got: values.len() });
        }
        Arc::make_mut(&mut self.values).copy_from_slice(values);
        Ok(())
    }

    /// Replaces the optimizer state of a dense block (a PyTorch optimizer's
    /// `load_state_dict`). `m` and `v` are each empty (no state) or as long as the block.
    pub fn set_opt_state(&mut self, state: OptState) -> Result<(), CoreError> {
        if self.rows.is_some() {
            return Err(CoreError::NotDense(self.spec.id));
        }
        for got in [state.m.len(), state.v.len()] {
            if got != 0 && got != self.spec.len {
                return Err(CoreError::WrongLength { block: self.spec.id, expected: self.spec.len, got });
            }
        }
        self.opt = state;
        Ok(())
    }

    /// Counters so far.
    pub fn stats(&self) -> &BlockStats {
        &self.stats
    }

    /// Distribution of hold times, in microseconds.
    pub fn hold_histogram(&self) -> &Histogram {
        &self.hold_hist
    }

    /// The smallest clock not yet pushed by every active worker.
    pub fn done(&self) -> Clock {
        self.clocks.done()
    }

    /// The clock state.
    pub fn clocks(&self) -> &Clocks {
        &self.clocks
    }

    /// Number of pulls currently held.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// The tokens of the pulls currently held (in no particular order).
    pub fn held_tokens(&self) -> impl Iterator<Item = &T> {
        self.held.iter().map(|h| &h.token)
    }

    /// Drops the held pulls whose token matches `pred`, unanswered (their connection
    /// closed: nobody waits for the answer), and returns how many. A scan of the pulls
    /// held here; releases nothing (`done` does not move).
    pub fn drop_held(&mut self, pred: impl Fn(&T) -> bool) -> usize {
        self.held.take_unless(|h| !pred(&h.token)).len()
    }

    /// What the oldest held pull waits for, for logs: (worker and clock of that pull,
    /// the slowest worker and the clock it must push next), with how long it has waited.
    pub fn waiting(&self, now_us: u64) -> Option<Waiting> {
        let h = self.held.oldest()?;
        Some(Waiting {
            worker: h.worker,
            clock: h.clock,
            slowest: self.clocks.slowest()?,
            next_clock: self.clocks.done(),
            held_us: now_us.saturating_sub(h.since_us),
        })
    }

    /// What [`Block::push`] (`rejoined`: [`Block::push_rejoined`]) would say about a push
    /// of `len` values from `worker` at `clock`, without changing anything: `Ok(false)`
    /// for a duplicate (dropped), `Ok(true)` for one it applies, else its error. A
    /// primary checks a push with it before it forwards the push to its backups. `len` 0
    /// is a push without a gradient ([`Gradient::None`]). A sparse push is checked with
    /// [`Block::check_gradient`].
    pub fn check_push(&self, worker: u32, clock: Clock, len: usize, rejoined: bool) -> Result<bool, CoreError> {
        if len == 0 {
            // No gradient: any block takes it.
        } else if self.rows.is_some() {
            return Err(CoreError::NotDense(self.spec.id));
        } else if len != self.spec.len {
            return Err(CoreError::WrongLength { block: self.spec.id, expected: self.spec.len, got: len });
        }
        self.clocks.check(self.spec.id, worker, clock, rejoined)
    }

    /// [`Block::check_push`] of any gradient, a sparse one included: what
    /// [`Block::push_gradient`] would say, without changing anything (its indices are
    /// checked, [`Gradient::check`]).
    pub fn check_gradient(
        &self,
        worker: u32,
        clock: Clock,
        grad: Gradient<'_>,
        rejoined: bool,
    ) -> Result<bool, CoreError> {
        self.check_dense(grad)?;
        self.clocks.check(self.spec.id, worker, clock, rejoined)
    }

    /// Why `grad` does not fit this block: a gradient for a row block, or one that does
    /// not fit a dense block's length ([`Gradient::check`]).
    fn check_dense(&self, grad: Gradient<'_>) -> Result<(), CoreError> {
        if self.rows.is_some() && !matches!(grad, Gradient::None) {
            return Err(CoreError::NotDense(self.spec.id));
        }
        grad.check(self.spec.id, self.spec.len)
    }

    /// A worker pushed clock `clock`, with `grad` its payload: the gradient, or empty for
    /// none ([`Gradient::from_payload`]). Applies it (or buffers it in aggregate mode)
    /// exactly once, and returns the held pulls it releases. A duplicate push (a clock the
    /// worker already pushed) changes nothing. A push without a gradient counts for the
    /// clock and applies nothing; in aggregate mode a clock none of whose pushes carried a
    /// gradient takes no step at all, and otherwise the step's gradient is the sum of
    /// those that came over the number of pushes (PyTorch DDP with
    /// `find_unused_parameters`).
    pub fn push(
        &mut self,
        config: &ShardConfig,
        worker: u32,
        clock: Clock,
        grad: &[f32],
        now_us: u64,
    ) -> Result<Vec<Answer<T>>, CoreError> {
        self.push_gradient(config, worker, clock, Gradient::from_payload(grad), now_us)
    }

    /// [`Block::push`] of any gradient. A sparse one ([`Gradient::Sparse`], checked first:
    /// a malformed one is refused, [`CoreError::BadSparse`]) is applied as the dense
    /// gradient with zeros elsewhere would be, bit for bit, and costs what it carries
    /// where it can: in aggregate mode it is added into the clock's sum at its indices
    /// alone (the sum is allocated once per clock, as for dense pushes); otherwise plain
    /// SGD without weight decay updates its indices alone
    /// ([`OptimizerConfig::step_sparse`]). Every other rule (momentum, Adam, AdamW, any
    /// weight decay) moves every element even where the gradient is zero, so the push is
    /// densified into a scratch vector and takes the dense step. A migration logs it
    /// sparse ([`LoggedPush::of`]).
    pub fn push_gradient(
        &mut self,
        config: &ShardConfig,
        worker: u32,
        clock: Clock,
        grad: Gradient<'_>,
        now_us: u64,
    ) -> Result<Vec<Answer<T>>, CoreError> {
        self.check_dense(grad)?;
        if !self.clocks.record(self.spec.id, worker, clock)? {
            return Ok(Vec::new());
        }
        self.stats.pushes += 1;
        self.stats.bytes_in += match grad {
            Gradient::Sparse { indices, values } => std::mem::size_of_val(indices) + std::mem::size_of_val(values),
            Gradient::Dense(_) | Gradient::None => std::mem::size_of_val(grad.payload()),
        } as u64;
        if let Some(log) = &mut self.log {
            log.push(LoggedPush::of(worker, clock, grad));
        }
        self.stats.max_lead = self.stats.max_lead.max(self.clocks.lead().into());
        let opt = config.optimizer;
        if opt.aggregate {
            let len = self.spec.len;
            let (sum, count) = self.pending.entry(clock).or_insert_with(|| (Vec::new(), 0));
            if !matches!(grad, Gradient::None) && sum.is_empty() {
                sum.resize(len, 0.0);
            }
            match grad {
                Gradient::Dense(g) => {
                    for (s, g) in sum.iter_mut().zip(g) {
                        *s += g;
                    }
                }
                Gradient::Sparse { indices, values } => {
                    // The sum starts at +0.0 and never becomes -0.0, so `s + 0.0` is `s`
                    // bit for bit: skipping the zeros is exactly the dense sum.
                    for (i, g) in indices.iter().zip(values) {
                        sum[*i as usize] += g;
                    }
                }
                Gradient::None => {}
            }
            *count += 1;
            self.apply_complete_clocks(opt);
        } else {
            let w = Arc::make_mut(&mut self.values).as_mut_slice();
            match grad {
                Gradient::Dense(g) => opt.step(w, &mut self.opt, g),
                Gradient::Sparse { indices, values } => opt.step_sparse(w, &mut self.opt, indices, values),
                Gradient::None => {}
            }
        }
        Ok(self.release(config.sync, now_us))
    }

    /// [`Block::push_gradient`] from a worker that rejoined (as [`Block::push_rejoined`]).
    pub fn push_gradient_rejoined(
        &mut self,
        config: &ShardConfig,
        worker: u32,
        clock: Clock,
        grad: Gradient<'_>,
        now_us: u64,
    ) -> Result<Vec<Answer<T>>, CoreError> {
        self.check_dense(grad)?;
        self.clocks.skip_to(worker, clock);
        self.push_gradient(config, worker, clock, grad, now_us)
    }

    /// A worker asks for the values at clock `clock`. Returns the answer now, or `None`
    /// if the sync policy holds the pull; it then comes back from a later `push` or
    /// `remove_worker`. `rng` feeds the probabilistic policies' coin.
    pub fn pull(
        &mut self,
        config: &ShardConfig,
        token: T,
        worker: u32,
        clock: Clock,
        now_us: u64,
        rng: &mut impl Rng,
    ) -> Result<Option<Answer<T>>, CoreError> {
        if self.rows.is_some() {
            return Err(CoreError::NotDense(self.spec.id));
        }
        self.pull_inner(config, token, worker, clock, None, now_us, rng)
    }

    /// Why rows `ids` with `grads` (`None`: a pull) do not fit this block: not a row
    /// block, a row outside its range, a gradient that is not `ids.len() x dim`.
    pub fn check_rows(&self, ids: &[u64], grads: Option<usize>) -> Result<(), CoreError> {
        let Some((start, end, dim)) = self.spec.row_range() else { return Err(CoreError::NotRows(self.spec.id)) };
        if let Some(row) = ids.iter().find(|r| !self.spec.holds(**r)) {
            return Err(CoreError::RowOutOfRange { block: self.spec.id, row: *row, start, end });
        }
        if let Some(len) = grads
            && len != ids.len() * dim as usize
        {
            return Err(CoreError::WrongLength { block: self.spec.id, expected: ids.len() * dim as usize, got: len });
        }
        Ok(())
    }

    /// What [`Block::push_rows`] would say about a row push, without changing anything
    /// (as [`Block::check_push`]).
    pub fn check_push_rows(
        &self,
        worker: u32,
        clock: Clock,
        ids: &[u64],
        grads: usize,
        rejoined: bool,
    ) -> Result<bool, CoreError> {
        self.check_rows(ids, Some(grads))?;
        self.clocks.check(self.spec.id, worker, clock, rejoined)
    }

    /// A worker pushed the gradient `grads` (`ids.len() x dim`) of rows `ids` at clock
    /// `clock` (an empty push: no row of this block was touched, the clock still counts).
    /// Applied (or buffered in aggregate mode) exactly once, duplicates in `ids` summed;
    /// returns the held pulls it releases. A duplicate push changes nothing.
    pub fn push_rows(
        &mut self,
        config: &ShardConfig,
        worker: u32,
        clock: Clock,
        ids: &[u64],
        grads: &[f32],
        now_us: u64,
    ) -> Result<Vec<Answer<T>>, CoreError> {
        self.check_rows(ids, Some(grads.len()))?;
        if !self.clocks.record(self.spec.id, worker, clock)? {
            return Ok(Vec::new());
        }
        self.stats.pushes += 1;
        self.stats.bytes_in += (grads.len() * 4 + ids.len() * 8) as u64;
        self.stats.rows += ids.len() as u64;
        if let Some(log) = &mut self.log {
            log.push(LoggedPush { worker, clock, grad: grads.to_vec(), rows: ids.to_vec() });
        }
        self.stats.max_lead = self.stats.max_lead.max(self.clocks.lead().into());
        let Some(part) = self.rows.as_mut() else { return Err(CoreError::NotRows(self.spec.id)) };
        let spec = self.spec;
        part.hist.record(ids.iter().map(|r| spec.position(*r)));
        if config.optimizer.aggregate {
            let p = part.pending.entry(clock).or_insert_with(|| PendingRows {
                clock,
                ids: Vec::new(),
                grads: Vec::new(),
                count: 0,
            });
            p.ids.extend_from_slice(ids);
            p.grads.extend_from_slice(grads);
            p.count += 1;
            self.apply_complete_clocks(config.optimizer);
        } else {
            part.store.step(ids, grads, 1.0);
            part.store.enforce(|_| false);
        }
        Ok(self.release(config.sync, now_us))
    }

    /// [`Block::push_rows`] from a worker that rejoined (as [`Block::push_rejoined`]).
    #[allow(clippy::too_many_arguments)]
    pub fn push_rows_rejoined(
        &mut self,
        config: &ShardConfig,
        worker: u32,
        clock: Clock,
        ids: &[u64],
        grads: &[f32],
        now_us: u64,
    ) -> Result<Vec<Answer<T>>, CoreError> {
        self.check_rows(ids, Some(grads.len()))?;
        self.clocks.skip_to(worker, clock);
        self.push_rows(config, worker, clock, ids, grads, now_us)
    }

    /// A worker asks for rows `ids` of this row block at clock `clock`: answered now (the
    /// rows in the order asked), or held by the sync policy as [`Block::pull`] is.
    #[allow(clippy::too_many_arguments)]
    pub fn pull_rows(
        &mut self,
        config: &ShardConfig,
        token: T,
        worker: u32,
        clock: Clock,
        ids: Arc<[u64]>,
        now_us: u64,
        rng: &mut impl Rng,
    ) -> Result<Option<Answer<T>>, CoreError> {
        self.check_rows(&ids, None)?;
        self.pull_inner(config, token, worker, clock, Some(ids), now_us, rng)
    }

    #[allow(clippy::too_many_arguments)]
    fn pull_inner(
        &mut self,
        config: &ShardConfig,
        token: T,
        worker: u32,
        clock: Clock,
        rows: Option<Arc<[u64]>>,
        now_us: u64,
        rng: &mut impl Rng,
    ) -> Result<Option<Answer<T>>, CoreError> {
        if worker >= self.clocks.workers() {
            return Err(CoreError::UnknownWorker(worker));
        }
        let view = PullView {
            clock,
            done: self.clocks.done(),
            fast: self.clocks.fast(),
            same_clock_held: self.held.any_at(clock),
        };
        match config.sync.on_pull(&view, rng) {
            Verdict::Hold { until } => {
                self.held.hold(HeldPull { token, worker, clock, rows, until, since_us: now_us, seq: 0 });
                Ok(None)
            }
            Verdict::Answer => Ok(Some(self.answer(config.sync, token, worker, clock, rows, None))),
        }
    }

    /// Takes a worker out of the quorum (it died or left) and returns the pulls that no
    /// longer have to wait for it, and the tokens of the removed worker's own held pulls,
    /// dropped unanswered.
    pub fn remove_worker(&mut self, config: &ShardConfig, worker: u32, now_us: u64) -> (Vec<Answer<T>>, Vec<T>) {
        self.clocks.remove_worker(worker);
        let dropped = self.held.take_unless(|h| h.worker != worker).into_iter().map(|h| h.token).collect();
        if config.optimizer.aggregate {
            self.apply_complete_clocks(config.optimizer);
        }
        (self.release(config.sync, now_us), dropped)
    }

    /// Takes a removed worker back into the quorum ([`Clocks::add_worker`]); returns the
    /// next clock it is to push here.
    pub fn add_worker(&mut self, worker: u32) -> Option<Clock> {
        self.clocks.add_worker(worker)
    }

    /// A worker that rejoined goes on from `clock` here (its pull of `clock`: it pushes no
    /// clock before it): the clocks between are skipped ([`Clocks::skip_to`]). Returns the
    /// held pulls this releases.
    pub fn skip_to(&mut self, config: &ShardConfig, worker: u32, clock: Clock, now_us: u64) -> Vec<Answer<T>> {
        let before = self.clocks.done();
        self.clocks.skip_to(worker, clock);
        if self.clocks.done() == before {
            return Vec::new();
        }
        if config.optimizer.aggregate {
            self.apply_complete_clocks(config.optimizer);
        }
        self.release(config.sync, now_us)
    }

    /// Takes every held pull out, for a block that is leaving this server.
    pub fn take_held(&mut self) -> Vec<(T, u32, Clock)> {
        self.held.take_unless(|_| false).into_iter().map(|h| (h.token, h.worker, h.clock)).collect()
    }

    fn apply_complete_clocks(&mut self, opt: OptimizerConfig) {
        let done = self.clocks.done();
        if let Some(part) = self.rows.as_mut() {
            while let Some(entry) = part.pending.first_entry() {
                if *entry.key() >= done {
                    break;
                }
                let p = entry.remove();
                part.store.step(&p.ids, &p.grads, 1.0 / p.count as f32);
            }
            if part.store.is_limited() {
                // The rows of clocks not complete yet are the targets of pushes in flight.
                let pending: HashSet<u64> = part.pending.values().flat_map(|p| p.ids.iter().copied()).collect();
                part.store.enforce(|id| pending.contains(&id));
            }
        }
        while let Some(entry) = self.pending.first_entry() {
            if *entry.key() >= done {
                break;
            }
            let (mut sum, count) = entry.remove();
            if sum.is_empty() {
                // No push of this clock carried a gradient: no step (PyTorch skips a
                // parameter whose `grad` is None).
                continue;
            }
            let scale = 1.0 / count as f32;
            sum.iter_mut().for_each(|s| *s *= scale);
            opt.step(Arc::make_mut(&mut self.values).as_mut_slice(), &mut self.opt, &sum);
        }
    }

    fn release(&mut self, sync: SyncPolicy, now_us: u64) -> Vec<Answer<T>> {
        let ready = self.held.take_ready(self.clocks.done());
        if ready.is_empty() {
            return Vec::new();
        }
        self.stats.releases += 1;
        ready
            .into_iter()
            .map(|h| {
                let waited = now_us.saturating_sub(h.since_us);
                self.answer(sync, h.token, h.worker, h.clock, h.rows, Some(waited))
            })
            .collect()
    }

    fn answer(
        &mut self,
        sync: SyncPolicy,
        token: T,
        worker: u32,
        clock: Clock,
        rows: Option<Arc<[u64]>>,
        held_us: Option<u64>,
    ) -> Answer<T> {
        let done = self.clocks.done();
        debug_assert!(!sync.violates_bound(clock, done), "pull({clock}) answered while done = {done} under {sync}");
        self.stats.pulls += 1;
        let values = match (&rows, &mut self.rows) {
            (Some(ids), Some(part)) => {
                self.stats.rows += ids.len() as u64;
                Arc::new(part.store.pull(ids))
            }
            _ => Arc::clone(&self.values),
        };
        self.stats.bytes_out += values.len() as u64 * 4;
        if let Some(us) = held_us {
            self.stats.pulls_held += 1;
            self.stats.hold_us += us;
            self.hold_hist.record(us);
        }
        Answer { token, worker, clock, done, held_us, values, rows }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optimizer::OptimizerKind;
    use rand::SeedableRng;

    pub(super) fn rng() -> rand::rngs::StdRng {
        rand::rngs::StdRng::seed_from_u64(1)
    }

    fn config(sync: SyncPolicy, aggregate: bool, workers: u32) -> ShardConfig {
        ShardConfig {
            sync,
            optimizer: OptimizerConfig { kind: OptimizerKind::Sgd, lr: 1.0, aggregate, weight_decay: 0.0 },
            workers,
        }
    }

    fn block(len: usize, cfg: &ShardConfig) -> Block<u32> {
        Block::new(BlockSpec::dense(0, 0, 0, len), vec![0.0; len], cfg).unwrap()
    }

    #[test]
    fn bsp_holds_pull_until_every_worker_pushed_the_previous_clock() {
        let cfg = config(SyncPolicy::Bsp, false, 2);
        let mut b = block(1, &cfg);
        assert!(b.pull(&cfg, 10, 0, 0, 0, &mut rng()).unwrap().is_some());
        assert!(b.push(&cfg, 0, 0, &[1.0], 1).unwrap().is_empty());
        assert!(b.pull(&cfg, 11, 0, 1, 2, &mut rng()).unwrap().is_none());
        let w = b.waiting(7).unwrap();
        assert_eq!((w.worker, w.clock, w.slowest, w.next_clock, w.held_us), (0, 1, 1, 0, 5));
        let released = b.push(&cfg, 1, 0, &[2.0], 12).unwrap();
        assert_eq!(released.len(), 1);
        assert_eq!((released[0].token, released[0].held_us, released[0].done), (11, Some(10), 1));
        assert_eq!(*released[0].values, vec![-3.0]);
        assert_eq!(b.stats().pulls_held, 1);
        assert_eq!(b.stats().releases, 1);
        assert_eq!(b.waiting(20), None);
    }

    #[test]
    fn aggregate_takes_one_step_with_the_mean_once_the_clock_is_complete() {
        let cfg = config(SyncPolicy::Bsp, true, 2);
        let mut b = block(2, &cfg);
        b.push(&cfg, 0, 0, &[1.0, 2.0], 0).unwrap();
        assert_eq!(**b.values(), vec![0.0, 0.0]);
        b.push(&cfg, 1, 0, &[3.0, 6.0], 0).unwrap();
        assert_eq!(**b.values(), vec![-2.0, -4.0]);
    }

    /// A push without a gradient ([`Gradient::None`]): its payload is empty.
    const NO_GRAD: &[f32] = Gradient::None.payload();

    #[test]
    fn a_push_without_a_gradient_counts_for_the_clock_and_applies_nothing() {
        let momentum = OptimizerKind::Momentum { beta: 0.5 };
        let cfg = ShardConfig { sync: SyncPolicy::Bsp, ..opt_config(momentum, false, 2) };
        let mut b: Block<u32> = Block::new(spec(2), vec![1.0, 2.0], &cfg).unwrap();
        b.push(&cfg, 0, 0, &[1.0, 1.0], 0).unwrap();
        let after_one = (b.values().to_vec(), b.state().opt);
        // Worker 0's pull(1) waits for worker 1's clock 0, which carries no gradient.
        assert!(b.check_push(1, 0, 0, false).unwrap());
        assert!(b.pull(&cfg, 9, 0, 1, 0, &mut rng()).unwrap().is_none());
        let released = b.push(&cfg, 1, 0, NO_GRAD, 5).unwrap();
        assert_eq!(released.len(), 1, "the push without a gradient released the pull");
        assert_eq!((b.values().to_vec(), b.state().opt), after_one, "nothing applied, no momentum step");
        assert_eq!((b.done(), b.stats().pushes, b.stats().bytes_in), (1, 2, 8));
        // A duplicate is dropped as any other, and one of the next clock is a gap.
        assert!(b.push(&cfg, 1, 0, NO_GRAD, 6).unwrap().is_empty());
        assert!(matches!(b.push(&cfg, 1, 2, NO_GRAD, 6), Err(CoreError::ClockGap { .. })));
        // The next gradient steps momentum from where it was: m = 0.5 * 1 + 1.
        b.push(&cfg, 0, 1, &[1.0, 1.0], 7).unwrap();
        assert_eq!(**b.values(), vec![1.0 - 0.01 - 0.01 * 1.5, 2.0 - 0.01 - 0.01 * 1.5]);
        // A payload of another length is still refused.
        assert!(matches!(b.push(&cfg, 1, 1, &[1.0], 8), Err(CoreError::WrongLength { .. })));
        assert!(b.check_push(1, 1, 1, false).is_err());
    }

    #[test]
    fn aggregate_steps_with_the_gradients_that_came_over_every_push() {
        // 2 workers, one sends no gradient: the step's gradient is the other's over 2 (the
        // absent one counts as zeros), as DDP with find_unused_parameters averages.
        let adam = OptimizerKind::Adam { beta1: 0.9, beta2: 0.999, eps: 1e-8 };
        let cfg = opt_config(adam, true, 2);
        let mut b: Block<u32> = Block::new(spec(2), vec![0.5, -0.5], &cfg).unwrap();
        b.push(&cfg, 0, 0, NO_GRAD, 0).unwrap();
        b.push(&cfg, 1, 0, &[3.0, -1.0], 0).unwrap();
        let mut expected = vec![0.5, -0.5];
        let mut st = OptState::default();
        cfg.optimizer.step(&mut expected, &mut st, &[1.5, -0.5]);
        assert_eq!((bits(b.values()), b.state().opt), (bits(&expected), st.clone()));

        // Both send none: no step at all (no Adam step count, no moment decay), and the
        // clock is still complete.
        assert!(b.pull(&cfg, 1, 0, 1, 0, &mut rng()).unwrap().is_some());
        b.push(&cfg, 0, 1, NO_GRAD, 0).unwrap();
        assert_eq!(b.state().pending, [PendingSum { clock: 1, sum: Vec::new(), count: 1 }]);
        b.push(&cfg, 1, 1, NO_GRAD, 0).unwrap();
        assert_eq!((b.done(), b.state().pending.len()), (2, 0));
        assert_eq!(
            (bits(b.values()), b.state().opt),
            (bits(&expected), st.clone()),
            "a clock without gradients stepped"
        );

        // The next clock's step is Adam's second (bias corrections of t = 2).
        b.push(&cfg, 0, 2, &[1.0, 1.0], 0).unwrap();
        b.push(&cfg, 1, 2, &[1.0, 3.0], 0).unwrap();
        cfg.optimizer.step(&mut expected, &mut st, &[1.0, 2.0]);
        assert_eq!(st.steps, 2);
        assert_eq!((bits(b.values()), b.state().opt), (bits(&expected), st));
    }

    #[test]
    fn pushes_without_a_gradient_migrate_and_replay_exactly() {
        // A clock half done with no gradient yet (an empty pending sum) in the snapshot,
        // and pushes without gradients in the delta.
        for aggregate in [false, true] {
            let cfg = opt_config(OptimizerKind::Momentum { beta: 0.9 }, aggregate, 2);
            let mut old: Block<u32> = Block::new(spec(3), vec![1.0; 3], &cfg).unwrap();
            old.push(&cfg, 0, 0, &grad(0, 0, 3), 0).unwrap();
            old.push(&cfg, 1, 0, &grad(1, 0, 3), 0).unwrap();
            old.push(&cfg, 0, 1, NO_GRAD, 0).unwrap();
            let snapshot = old.snapshot();
            let back: BlockState = postcard::from_bytes(&postcard::to_allocvec(&snapshot).unwrap()).unwrap();
            assert_eq!(back, snapshot);
            old.push(&cfg, 1, 1, NO_GRAD, 0).unwrap();
            old.push(&cfg, 0, 2, NO_GRAD, 0).unwrap();
            old.push(&cfg, 1, 2, &grad(1, 2, 3), 0).unwrap();
            let log = old.take_log();
            assert_eq!(log.iter().map(|p| p.grad.len()).collect::<Vec<_>>(), [0, 0, 3]);
            let mut new: Block<u32> = Block::from_state(back, &log, &cfg).unwrap();
            assert_eq!(fingerprint(&mut new), fingerprint(&mut old), "aggregate={aggregate}");
        }
    }

    #[test]
    fn duplicate_pushes_are_applied_once_and_gaps_refused() {
        let cfg = config(SyncPolicy::Asp, false, 1);
        let mut b = block(1, &cfg);
        b.push(&cfg, 0, 0, &[1.0], 0).unwrap();
        b.push(&cfg, 0, 0, &[1.0], 0).unwrap();
        assert_eq!(**b.values(), vec![-1.0]);
        assert_eq!(b.stats().pushes, 1);
        assert!(b.push(&cfg, 0, 5, &[1.0], 0).is_err());
        assert!(b.push(&cfg, 0, 1, &[1.0, 2.0], 0).is_err());
        assert!(b.pull(&cfg, 0, 3, 0, 0, &mut rng()).is_err());
    }

    #[test]
    fn dropped_held_pulls_are_never_answered_and_the_others_are_released_in_the_order_held() {
        let cfg = config(SyncPolicy::Ssp(0), false, 2);
        let mut b = block(1, &cfg);
        // Held for clock 0 (pull 1: until 1) and clock 1 (pull 2: until 2), interleaved.
        for (token, clock) in [(10, 2), (11, 1), (12, 2), (13, 1), (14, 1)] {
            assert!(b.pull(&cfg, token, 0, clock, 0, &mut rng()).unwrap().is_none());
        }
        assert_eq!(b.drop_held(|t| *t == 11 || *t == 12), 2);
        assert_eq!(b.drop_held(|t| *t == 99), 0);
        assert_eq!(b.held(), 3);
        let mut left: Vec<u32> = b.held_tokens().copied().collect();
        left.sort_unstable();
        assert_eq!(left, vec![10, 13, 14]);
        b.push(&cfg, 0, 0, &[1.0], 1).unwrap();
        b.push(&cfg, 0, 1, &[1.0], 1).unwrap();
        // Worker 1 goes on from clock 2: done 2 at once, both clocks' pulls come out, in
        // the order they were held.
        let released = b.skip_to(&cfg, 1, 2, 2);
        assert_eq!(released.iter().map(|a| a.token).collect::<Vec<_>>(), vec![10, 13, 14]);
        assert_eq!((b.held(), b.held_tokens().count()), (0, 0));
        // A worker's own held pulls are dropped when it is removed, and named.
        assert!(b.pull(&cfg, 20, 1, 3, 3, &mut rng()).unwrap().is_none());
        let (answers, dropped) = b.remove_worker(&cfg, 1, 4);
        assert!(answers.is_empty());
        assert_eq!((dropped, b.held()), (vec![20], 0));
    }

    #[test]
    fn removing_a_worker_releases_what_waited_for_it() {
        let cfg = config(SyncPolicy::Ssp(1), true, 2);
        let mut b = block(1, &cfg);
        b.push(&cfg, 0, 0, &[4.0], 0).unwrap();
        b.push(&cfg, 0, 1, &[4.0], 0).unwrap();
        assert!(b.pull(&cfg, 7, 0, 2, 0, &mut rng()).unwrap().is_none());
        let (released, _) = b.remove_worker(&cfg, 1, 5);
        assert_eq!(released.len(), 1);
        assert_eq!(**b.values(), vec![-8.0]);
    }

    #[test]
    fn pull_replies_share_values_until_the_next_push_copies() {
        let cfg = config(SyncPolicy::Asp, false, 1);
        let mut b = block(3, &cfg);
        let a = b.pull(&cfg, 0, 0, 0, 0, &mut rng()).unwrap().unwrap();
        assert!(Arc::ptr_eq(&a.values, b.values()));
        b.push(&cfg, 0, 0, &[1.0; 3], 0).unwrap();
        assert_eq!(*a.values, vec![0.0; 3]);
        assert_eq!(**b.values(), vec![-1.0; 3]);
    }

    // Migration: snapshot, logged pushes, rebuild on the new owner.

    #[test]
    fn initial_values_are_set_only_before_the_first_push() {
        let cfg = config(SyncPolicy::Asp, false, 1);
        let spec = BlockSpec::dense(0, 0, 0, 2);
        let mut b: Block<u32> = Block::new(spec, vec![0.0; 2], &cfg).unwrap();
        b.set_initial(&[1.0, 2.0]).unwrap();
        assert_eq!(b.values().as_slice(), &[1.0, 2.0]);
        assert!(matches!(b.set_initial(&[1.0]), Err(CoreError::WrongLength { .. })));
        b.push(&cfg, 0, 0, &[1.0, 1.0], 0).unwrap();
        assert!(matches!(b.set_initial(&[5.0, 5.0]), Err(CoreError::AlreadyTrained(0))));
        assert_eq!(b.values().as_slice(), &[0.0, 1.0]);
    }

    fn opt_config(kind: OptimizerKind, aggregate: bool, workers: u32) -> ShardConfig {
        ShardConfig {
            sync: SyncPolicy::Ssp(2),
            optimizer: OptimizerConfig { kind, lr: 0.01, aggregate, weight_decay: 0.0 },
            workers,
        }
    }

    fn spec(len: usize) -> BlockSpec {
        BlockSpec::dense(7, 1, 12, len)
    }

    /// A gradient that differs per (worker, clock) and is not a round number, so that the
    /// order of the optimizer's operations shows in the bits.
    fn grad(worker: u32, clock: Clock, len: usize) -> Vec<f32> {
        (0..len).map(|i| ((worker * 31 + clock * 7 + i as u32) as f32 * 0.37).sin() * 1.3 - 0.11).collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Everything of a block that a migration must carry, bit for bit (the pending sums of
    /// aggregate mode included); `snapshot` starts a log, which the caller then ignores.
    type Fingerprint = (Vec<u32>, u64, Vec<u32>, Vec<u32>, Clocks, Vec<(Clock, Vec<u32>, u32)>);

    fn fingerprint(b: &mut Block<u32>) -> Fingerprint {
        let s = b.snapshot();
        b.take_log();
        let pending = s.pending.iter().map(|p| (p.clock, bits(&p.sum), p.count)).collect();
        (bits(&s.values), s.opt.steps, bits(&s.opt.m), bits(&s.opt.v), s.clocks, pending)
    }

    const KINDS: [OptimizerKind; 3] = [
        OptimizerKind::Sgd,
        OptimizerKind::Momentum { beta: 0.9 },
        OptimizerKind::Adam { beta1: 0.9, beta2: 0.999, eps: 1e-8 },
    ];

    #[test]
    fn a_block_rebuilt_from_snapshot_and_log_is_bit_identical() {
        const LEN: usize = 5;
        for kind in KINDS {
            for aggregate in [false, true] {
                let cfg = opt_config(kind, aggregate, 3);
                let init: Vec<f32> = (0..LEN).map(|i| i as f32 * 0.25 - 0.5).collect();
                let mut old: Block<u32> = Block::new(spec(LEN), init, &cfg).unwrap();
                // Before the snapshot: clock 0 complete, clock 1 half done (workers 0 and 1).
                for (w, t) in [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1)] {
                    old.push(&cfg, w, t, &grad(w, t, LEN), 0).unwrap();
                }
                let snapshot = old.snapshot();
                assert_eq!(snapshot.spec, spec(LEN));
                assert_eq!(snapshot.pending.len(), usize::from(aggregate), "{kind} aggregate={aggregate}");
                if let Some(p) = snapshot.pending.first() {
                    assert_eq!((p.clock, p.count), (1, 2));
                }
                // While the snapshot travels: clock 1 completes, clock 2 is half done, and a
                // duplicate push is dropped (not logged).
                for (w, t) in [(2, 1), (0, 2), (0, 2), (1, 2)] {
                    old.push(&cfg, w, t, &grad(w, t, LEN), 0).unwrap();
                }
                let log = old.take_log();
                let logged: Vec<_> = log.iter().map(|p| (p.worker, p.clock)).collect();
                assert_eq!(logged, [(2, 1), (0, 2), (1, 2)]);
                assert_eq!(log[1].grad, grad(0, 2, LEN));

                let mut new: Block<u32> = Block::from_state(snapshot, &log, &cfg).unwrap();
                assert_eq!(fingerprint(&mut new), fingerprint(&mut old), "{kind} aggregate={aggregate}");
                assert_ne!(bits(new.values()), bits(&(0..LEN).map(|i| i as f32 * 0.25 - 0.5).collect::<Vec<_>>()));
                assert_eq!(new.done(), 2);
                assert_eq!(*new.stats(), BlockStats::default(), "counters stay with the old owner");
                assert_eq!(new.held(), 0);

                // Both go on identically: the rebuilt block is the same state machine.
                for (w, t) in [(2, 2), (0, 3), (1, 3), (2, 3)] {
                    old.push(&cfg, w, t, &grad(w, t, LEN), 0).unwrap();
                    new.push(&cfg, w, t, &grad(w, t, LEN), 0).unwrap();
                }
                assert_eq!(fingerprint(&mut new), fingerprint(&mut old), "{kind} aggregate={aggregate}, later");
                if kind != OptimizerKind::Sgd {
                    assert!(!new.snapshot().opt.m.is_empty());
                }
            }
        }
    }

    #[test]
    fn the_new_owner_drops_duplicates_of_migrated_pushes() {
        let cfg = opt_config(OptimizerKind::Momentum { beta: 0.9 }, false, 2);
        let mut old: Block<u32> = Block::new(spec(3), vec![1.0; 3], &cfg).unwrap();
        old.push(&cfg, 0, 0, &grad(0, 0, 3), 0).unwrap();
        let snapshot = old.snapshot();
        old.push(&cfg, 1, 0, &grad(1, 0, 3), 0).unwrap();
        let log = old.take_log();
        // A delta that repeats a push (of the snapshot, then of the delta) applies it once.
        let mut doubled = log.clone();
        doubled.insert(0, LoggedPush::dense(0, 0, grad(0, 0, 3)));
        doubled.push(log[0].clone());
        let mut new: Block<u32> = Block::from_state(snapshot.clone(), &doubled, &cfg).unwrap();
        assert_eq!(fingerprint(&mut new), fingerprint(&mut old));

        // A worker resends pushes the new owner already has (it got Moved, or its ack was
        // lost): acknowledged, dropped, nothing changes.
        let mut new: Block<u32> = Block::from_state(snapshot, &log, &cfg).unwrap();
        let before = fingerprint(&mut new);
        for (w, t) in [(0, 0), (1, 0)] {
            assert!(new.push(&cfg, w, t, &grad(w, t, 3), 1).unwrap().is_empty());
        }
        assert_eq!(new.stats().pushes, 0);
        assert_eq!(fingerprint(&mut new), before);
        // The next clock is applied.
        new.push(&cfg, 0, 1, &grad(0, 1, 3), 2).unwrap();
        assert_eq!(new.stats().pushes, 1);
        assert_eq!(new.clocks().pushed(0), Some(2));
    }

    #[test]
    fn a_rebuilt_block_holds_and_releases_pulls_like_the_old_one() {
        let cfg = config(SyncPolicy::Bsp, true, 2);
        let mut old = block(2, &cfg);
        old.push(&cfg, 0, 0, &[1.0, 2.0], 0).unwrap();
        let mut new: Block<u32> = Block::from_state(old.snapshot(), &old.take_log(), &cfg).unwrap();
        // Worker 0's pull(1), re-issued to the new owner after Moved, waits for worker 1.
        assert!(new.pull(&cfg, 5, 0, 1, 10, &mut rng()).unwrap().is_none());
        let released = new.push(&cfg, 1, 0, &[3.0, 4.0], 20).unwrap();
        assert_eq!(released.len(), 1);
        assert_eq!((released[0].token, released[0].held_us), (5, Some(10)));
        assert_eq!(*released[0].values, vec![-2.0, -3.0]);
    }

    #[test]
    fn a_removal_after_the_snapshot_is_replayed_by_removing_the_worker_again() {
        // The log carries pushes only: a worker removed while the snapshot travels must be
        // removed on the new owner too (in aggregate mode that applies the clocks that only
        // waited for it).
        let cfg = config(SyncPolicy::Bsp, true, 2);
        let mut old = block(1, &cfg);
        old.push(&cfg, 0, 0, &[4.0], 0).unwrap();
        let snapshot = old.snapshot();
        old.remove_worker(&cfg, 1, 0);
        assert_eq!(**old.values(), vec![-4.0]);
        let log = old.take_log();
        assert!(log.is_empty());
        let mut new: Block<u32> = Block::from_state(snapshot, &log, &cfg).unwrap();
        assert_eq!(**new.values(), vec![0.0], "the removal did not travel");
        new.remove_worker(&cfg, 1, 0);
        assert_eq!(fingerprint(&mut new), fingerprint(&mut old));
    }

    #[test]
    fn take_log_stops_logging() {
        let cfg = config(SyncPolicy::Asp, false, 1);
        let mut b = block(2, &cfg);
        b.push(&cfg, 0, 0, &[1.0, 1.0], 0).unwrap();
        assert!(b.take_log().is_empty(), "no snapshot, no log");
        b.push(&cfg, 0, 1, &[1.0, 1.0], 0).unwrap();
        assert!(b.take_log().is_empty());

        let s = b.snapshot();
        assert_eq!(s.clocks.pushed(0), Some(2));
        b.push(&cfg, 0, 2, &[0.5, 0.25], 0).unwrap();
        b.push(&cfg, 0, 3, &[1.5, 2.5], 0).unwrap();
        let log = b.take_log();
        assert_eq!(log, [LoggedPush::dense(0, 2, vec![0.5, 0.25]), LoggedPush::dense(0, 3, vec![1.5, 2.5])]);
        // Abandoned (or finished): later pushes are not logged.
        b.push(&cfg, 0, 4, &[1.0, 1.0], 0).unwrap();
        assert!(b.take_log().is_empty());
        // A new snapshot starts a fresh log.
        b.snapshot();
        b.push(&cfg, 0, 5, &[1.0, 1.0], 0).unwrap();
        assert_eq!(b.take_log().len(), 1);
    }

    #[test]
    fn from_state_refuses_a_state_that_does_not_fit() {
        let cfg = opt_config(OptimizerKind::Adam { beta1: 0.9, beta2: 0.999, eps: 1e-8 }, true, 2);
        let mut b: Block<u32> = Block::new(spec(3), vec![0.0; 3], &cfg).unwrap();
        b.push(&cfg, 0, 0, &[1.0; 3], 0).unwrap();
        b.push(&cfg, 1, 0, &[1.0; 3], 0).unwrap();
        b.push(&cfg, 0, 1, &[1.0; 3], 0).unwrap();
        let good = b.snapshot();
        assert_eq!((good.opt.m.len(), good.opt.v.len(), good.pending.len()), (3, 3, 1));
        assert!(Block::<u32>::from_state(good.clone(), &[], &cfg).is_ok());

        let wrong_len = |edit: &dyn Fn(&mut BlockState)| {
            let mut s = good.clone();
            edit(&mut s);
            match Block::<u32>::from_state(s, &[], &cfg) {
                Err(CoreError::WrongLength { block: 7, .. }) => {}
                other => panic!("expected WrongLength, got {other:?}"),
            }
        };
        wrong_len(&|s| s.values.push(0.0));
        wrong_len(&|s| s.values.clear());
        wrong_len(&|s| s.opt.m.truncate(2));
        wrong_len(&|s| s.opt.v.push(0.0));
        wrong_len(&|s| {
            s.pending[0].sum.pop();
        });
        wrong_len(&|s| s.spec.len = 4);
        // Empty optimizer buffers are fine (a block that never took a momentum/Adam step).
        let mut fresh = good.clone();
        fresh.opt = OptState::default();
        assert!(Block::<u32>::from_state(fresh, &[], &cfg).is_ok());

        // A clock state for another number of workers.
        for workers in [1, 3] {
            let other = ShardConfig { workers, ..cfg };
            assert_eq!(Block::<u32>::from_state(good.clone(), &[], &other).unwrap_err(), CoreError::UnknownWorker(2));
        }
        // A delta that does not fit: wrong gradient length, unknown worker, clock gap.
        let bad_deltas = [
            (LoggedPush::dense(1, 1, vec![1.0; 2]), "length"),
            (LoggedPush::dense(2, 0, vec![1.0; 3]), "worker"),
            (LoggedPush::dense(1, 3, vec![1.0; 3]), "gap"),
        ];
        for (p, what) in bad_deltas {
            let err = Block::<u32>::from_state(good.clone(), &[p], &cfg).unwrap_err();
            let ok = match what {
                "length" => matches!(err, CoreError::WrongLength { .. }),
                "worker" => err == CoreError::UnknownWorker(2),
                _ => matches!(err, CoreError::ClockGap { worker: 1, expected: 1, got: 3, .. }),
            };
            assert!(ok, "{what}: {err:?}");
        }
    }

    // Row blocks.

    fn row_block(cfg: &ShardConfig, optimizer: crate::rows::SparseOptimizer) -> Block<u32> {
        let rule = RowRule {
            dim: 2,
            init: crate::rows::RowInit::Constant(1.0),
            key: 3,
            optimizer,
            limits: Default::default(),
        };
        Block::new_rows(BlockSpec::rows(4, 0, 10, 20, 2), rule, cfg).unwrap()
    }

    fn sgd(lr: f64) -> crate::rows::SparseOptimizer {
        crate::rows::SparseOptimizer::Sgd { lr }
    }

    #[test]
    fn a_row_pull_waits_under_bsp_and_answers_the_rows_in_the_order_asked() {
        let cfg = config(SyncPolicy::Bsp, false, 2);
        let mut b = row_block(&cfg, sgd(1.0));
        let ids: Arc<[u64]> = Arc::from(vec![12, 11, 12]);
        let a = b.pull_rows(&cfg, 1, 0, 0, ids.clone(), 0, &mut rng()).unwrap().unwrap();
        assert_eq!(*a.values, vec![1.0; 6]);
        assert_eq!(a.rows.as_deref(), Some(&[12, 11, 12][..]));
        // Worker 0 pushes clock 0 (row 12 twice: summed) and pulls clock 1: held for worker 1.
        b.push_rows(&cfg, 0, 0, &[12, 12], &[0.5, 0.0, 0.25, 1.0], 1).unwrap();
        assert!(b.pull_rows(&cfg, 2, 0, 1, ids, 2, &mut rng()).unwrap().is_none());
        // Worker 1's empty push completes clock 0 and releases the pull.
        let released = b.push_rows(&cfg, 1, 0, &[], &[], 5).unwrap();
        assert_eq!(released.len(), 1);
        assert_eq!((released[0].token, released[0].held_us), (2, Some(3)));
        assert_eq!(*released[0].values, vec![0.25, 0.0, 1.0, 1.0, 0.25, 0.0]);
        assert_eq!(b.rows().unwrap().rows(), 1, "only the pushed row exists");
        assert_eq!(b.stats().pushes, 2);
    }

    #[test]
    fn aggregate_row_steps_take_the_mean_over_the_clocks_pushes() {
        let cfg = config(SyncPolicy::Bsp, true, 2);
        let mut b = row_block(&cfg, sgd(1.0));
        b.push_rows(&cfg, 0, 0, &[10, 11], &[2.0, 2.0, 4.0, 4.0], 0).unwrap();
        assert_eq!(b.rows().unwrap().rows(), 0, "buffered until the clock completes");
        b.push_rows(&cfg, 1, 0, &[11], &[2.0, 0.0], 0).unwrap();
        // Row 10: (2 + nothing) / 2 = 1; row 11: (4 + 2) / 2 = 3 and (4 + 0) / 2 = 2.
        let a = b.pull_rows(&cfg, 0, 0, 1, Arc::from(vec![10, 11]), 0, &mut rng()).unwrap().unwrap();
        assert_eq!(*a.values, vec![0.0, 0.0, -2.0, -1.0]);
        assert_eq!(b.rows().unwrap().steps(), 1);
    }

    #[test]
    fn row_and_dense_operations_are_refused_on_the_other_kind() {
        let cfg = config(SyncPolicy::Asp, false, 1);
        let mut rows = row_block(&cfg, sgd(1.0));
        assert_eq!(rows.push(&cfg, 0, 0, &[1.0; 20], 0).unwrap_err(), CoreError::NotDense(4));
        assert_eq!(rows.pull(&cfg, 0, 0, 0, 0, &mut rng()).unwrap_err(), CoreError::NotDense(4));
        assert_eq!(rows.set_initial(&[0.0; 20]).unwrap_err(), CoreError::NotDense(4));
        assert_eq!(rows.check_push(0, 0, 20, false).unwrap_err(), CoreError::NotDense(4));
        let out = rows.push_rows(&cfg, 0, 0, &[9], &[1.0, 1.0], 0).unwrap_err();
        assert_eq!(out, CoreError::RowOutOfRange { block: 4, row: 9, start: 10, end: 20 });
        assert!(rows.pull_rows(&cfg, 0, 0, 0, Arc::from(vec![20]), 0, &mut rng()).is_err());
        let short = rows.push_rows(&cfg, 0, 0, &[10], &[1.0], 0).unwrap_err();
        assert!(matches!(short, CoreError::WrongLength { block: 4, expected: 2, got: 1 }), "{short:?}");
        assert_eq!(rows.clocks().pushed(0), Some(0), "nothing refused counted");
        let mut dense = block(2, &cfg);
        assert_eq!(dense.push_rows(&cfg, 0, 0, &[0], &[1.0], 0).unwrap_err(), CoreError::NotRows(0));
        assert!(matches!(
            dense.pull_rows(&cfg, 0, 0, 0, Arc::from(vec![0]), 0, &mut rng()),
            Err(CoreError::NotRows(0))
        ));
    }

    #[test]
    fn a_row_block_rebuilt_from_snapshot_and_log_is_identical() {
        use crate::rows::SparseOptimizer;
        for opt in [
            sgd(0.1),
            SparseOptimizer::adagrad(0.1),
            SparseOptimizer::sparse_adam(0.1),
            SparseOptimizer::lazy_adam(0.1),
        ] {
            for aggregate in [false, true] {
                let cfg = ShardConfig { sync: SyncPolicy::Ssp(2), ..config(SyncPolicy::Ssp(2), aggregate, 3) };
                let mut old = row_block(&cfg, opt);
                let g = |w: u32, t: u32| grad(w, t, 4);
                for (w, t) in [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1)] {
                    old.push_rows(&cfg, w, t, &[10 + w as u64, 15], &g(w, t), 0).unwrap();
                }
                let snapshot = old.snapshot();
                assert!(snapshot.values.is_empty() && snapshot.rows.is_some());
                for (w, t) in [(2, 1), (0, 2), (0, 2), (1, 2)] {
                    old.push_rows(&cfg, w, t, &[19, 15], &g(w, t), 0).unwrap();
                }
                old.push_rows(&cfg, 2, 2, &[], &[], 0).unwrap();
                let log = old.take_log();
                assert_eq!(log.len(), 4, "the duplicate is not logged");
                assert_eq!(log[3].rows, Vec::<u64>::new());
                let bytes = postcard::to_allocvec(&snapshot).unwrap();
                let snapshot: BlockState = postcard::from_bytes(&bytes).unwrap();
                let mut new: Block<u32> = Block::from_state(snapshot, &log, &cfg).unwrap();
                assert_eq!(new.state(), old.state(), "{opt:?} aggregate={aggregate}");
                for (w, t) in [(0, 3), (1, 3), (2, 3)] {
                    old.push_rows(&cfg, w, t, &[11], &g(w, t)[..2], 0).unwrap();
                    new.push_rows(&cfg, w, t, &[11], &g(w, t)[..2], 0).unwrap();
                }
                assert_eq!(new.state(), old.state(), "{opt:?} aggregate={aggregate}, later");
                assert_eq!(new.state_len(), old.state().state_len());
            }
        }
    }

    /// The old owner counted the rows its logged pushes created and evicted: a block
    /// rebuilt from its snapshot and log counts none of them again (nor later than that).
    /// Mutation: `replay` keeping the block's stats but not its row counters fails it.
    #[test]
    fn a_replayed_delta_does_not_count_its_rows_again() {
        let cfg = config(SyncPolicy::Asp, false, 1);
        let mut old = row_block(&cfg, sgd(1.0));
        if let Some(part) = old.rows.as_mut() {
            let rule =
                RowRule { limits: crate::rows::RowLimits { max_rows: 1, ..Default::default() }, ..*part.store.rule() };
            part.store = crate::rows::RowStore::new(rule);
        }
        old.push_rows(&cfg, 0, 0, &[10], &[1.0, 1.0], 0).unwrap();
        let snapshot = old.snapshot();
        for (t, row) in [(1, 11), (2, 12)] {
            old.push_rows(&cfg, 0, t, &[row], &[1.0, 1.0], 0).unwrap();
        }
        let counted = old.rows().map(|r| (r.counters().created, r.counters().evicted));
        assert_eq!(counted, Some((3, 2)), "each logged push created a row and evicted the one before");
        let mut new: Block<u32> = Block::from_state(snapshot, &old.take_log(), &cfg).unwrap();
        assert_eq!(new.state(), old.state());
        assert_eq!(new.rows().map(|r| r.counters()), Some(crate::rows::RowCounters::default()));
        new.push_rows(&cfg, 0, 3, &[13], &[1.0, 1.0], 0).unwrap();
        assert_eq!(new.rows().map(|r| (r.counters().created, r.counters().evicted)), Some((1, 1)), "its own push");
    }

    #[test]
    fn a_row_state_that_does_not_fit_its_block_is_refused() {
        let cfg = config(SyncPolicy::Asp, false, 1);
        let mut b = row_block(&cfg, sgd(1.0));
        b.push_rows(&cfg, 0, 0, &[10], &[1.0, 1.0], 0).unwrap();
        let good = b.state();
        assert!(Block::<u32>::from_state(good.clone(), &[], &cfg).is_ok());
        let mut outside = good.clone();
        outside.rows.as_mut().unwrap().ids[0] = 25;
        assert!(matches!(Block::<u32>::from_state(outside, &[], &cfg), Err(CoreError::RowOutOfRange { row: 25, .. })));
        let mut short = good.clone();
        short.rows.as_mut().unwrap().values.pop();
        assert!(Block::<u32>::from_state(short, &[], &cfg).is_err());
        let mut dense_spec = good.clone();
        dense_spec.spec = BlockSpec::dense(4, 0, 0, 20);
        assert!(Block::<u32>::from_state(dense_spec, &[], &cfg).is_err());
        let mut no_rows = good;
        no_rows.rows = None;
        assert_eq!(Block::<u32>::from_state(no_rows, &[], &cfg).unwrap_err(), CoreError::NotDense(4));
    }

    #[test]
    fn block_state_survives_postcard_bit_for_bit() {
        let cfg = opt_config(OptimizerKind::Adam { beta1: 0.9, beta2: 0.999, eps: 1e-8 }, true, 3);
        let mut b: Block<u32> = Block::new(spec(4), vec![0.0; 4], &cfg).unwrap();
        for (w, t) in [(0, 0), (1, 0), (2, 0), (0, 1), (2, 1)] {
            b.push(&cfg, w, t, &grad(w, t, 4), 0).unwrap();
        }
        b.remove_worker(&cfg, 1, 0);
        b.push(&cfg, 0, 2, &grad(0, 2, 4), 0).unwrap();
        let mut state = b.snapshot();
        // Odd values travel unchanged too: signed zero, infinities, NaN payloads, subnormals.
        state.values = vec![-0.0, f32::INFINITY, f32::from_bits(0x7fc0_1234), f32::from_bits(1)];
        state.pending[0].sum[3] = f32::from_bits(0xffff_ffff);
        let bytes = postcard::to_allocvec(&state).unwrap();
        let back: BlockState = postcard::from_bytes(&bytes).unwrap();
        assert_eq!(bits(&back.values), bits(&state.values));
        assert_eq!(bits(&back.opt.m), bits(&state.opt.m));
        assert_eq!(bits(&back.opt.v), bits(&state.opt.v));
        assert_eq!(back.opt.steps, state.opt.steps);
        assert_eq!((back.spec, &back.clocks), (state.spec, &state.clocks));
        assert_eq!(back.clocks.active_workers(), 2);
        let sums = |s: &BlockState| s.pending.iter().map(|p| (p.clock, bits(&p.sum), p.count)).collect::<Vec<_>>();
        assert_eq!(sums(&back), sums(&state));
        // f32 vectors are one byte string each (16-byte length prefix 0x10, then raw bytes).
        let mut values = vec![0x10];
        values.extend(state.values.iter().flat_map(|x| x.to_le_bytes()));
        assert!(bytes.windows(values.len()).any(|w| w == values), "{bytes:02x?}");
        // And a logged push.
        let p = LoggedPush::dense(2, 9, vec![f32::NEG_INFINITY, 1e-40]);
        let back: LoggedPush = postcard::from_bytes(&postcard::to_allocvec(&p).unwrap()).unwrap();
        assert_eq!((back.worker, back.clock, bits(&back.grad)), (2, 9, bits(&p.grad)));
    }

    // Sparse gradients (top-k, random-k).

    fn sparse<'a>(indices: &'a [u32], values: &'a [f32]) -> Gradient<'a> {
        Gradient::Sparse { indices, values }
    }

    #[test]
    fn a_malformed_sparse_gradient_is_refused_and_changes_nothing() {
        let cfg = config(SyncPolicy::Asp, false, 1);
        let mut b = block(4, &cfg);
        let bad: [(&[u32], &[f32], &str); 6] = [
            (&[2, 1], &[1.0, 1.0], "does not follow"),
            (&[1, 1], &[1.0, 1.0], "does not follow"),
            (&[0, 4], &[1.0, 1.0], "past the end"),
            (&[u32::MAX], &[1.0], "past the end"),
            (&[0, 1], &[1.0], "2 indices but 1 values"),
            (&[], &[], "no index"),
        ];
        for (indices, values, why) in bad {
            for e in [
                b.check_gradient(0, 0, sparse(indices, values), false),
                b.push_gradient(&cfg, 0, 0, sparse(indices, values), 0).map(|_| true),
            ] {
                match e {
                    Err(CoreError::BadSparse { block: 0, len: 4, why: w }) => {
                        assert!(w.contains(why), "{indices:?}: {w}")
                    }
                    other => panic!("{indices:?} {values:?}: {other:?}"),
                }
            }
        }
        assert_eq!((b.stats().pushes, b.clocks().pushed(0), bits(b.values())), (0, Some(0), bits(&[0.0; 4])));
        // A good one is taken at clock 0, and a row block refuses a sparse gradient.
        assert_eq!(b.check_gradient(0, 0, sparse(&[0, 3], &[1.0, 2.0]), false), Ok(true));
        b.push_gradient(&cfg, 0, 0, sparse(&[0, 3], &[1.0, 2.0]), 0).unwrap();
        assert_eq!(**b.values(), vec![-1.0, 0.0, 0.0, -2.0]);
        assert_eq!(b.stats().bytes_in, 16, "two indices and two values");
        let rows = row_block(&cfg, sgd(1.0));
        assert_eq!(rows.check_gradient(0, 0, sparse(&[0], &[1.0]), false), Err(CoreError::NotDense(rows.spec().id)));
    }

    #[test]
    fn a_sparse_push_is_logged_sparse_and_replayed_by_the_new_owner() {
        let cfg = opt_config(OptimizerKind::Sgd, false, 2);
        let mut old: Block<u32> = Block::new(spec(6), vec![1.0; 6], &cfg).unwrap();
        let snapshot = old.snapshot();
        old.push_gradient(&cfg, 0, 0, sparse(&[1, 4], &[0.5, -2.0]), 0).unwrap();
        old.push_gradient_rejoined(&cfg, 1, 3, sparse(&[5], &[4.0]), 0).unwrap();
        let log = old.take_log();
        assert_eq!((log[0].rows.as_slice(), log[0].grad.as_slice()), ([1, 4].as_slice(), [0.5, -2.0].as_slice()));
        // Worker 1 rejoined: its logged push skips to clock 3 on the new owner too.
        let mut new: Block<u32> = Block::from_state(snapshot, &[], &cfg).unwrap();
        new.replay(&cfg, &log, &[1]).unwrap();
        assert_eq!(fingerprint(&mut new), fingerprint(&mut old));
        assert_eq!(**new.values(), vec![1.0, 1.0 - 0.01 * 0.5, 1.0, 1.0, 1.0 + 0.01 * 2.0, 1.0 - 0.01 * 4.0]);
        // A logged index past u32 is refused, not truncated.
        let huge = LoggedPush { worker: 0, clock: 0, grad: vec![1.0], rows: vec![u64::from(u32::MAX) + 2] };
        let err = Block::<u32>::from_state(old.state(), &[huge], &cfg).unwrap_err();
        assert!(matches!(err, CoreError::BadSparse { .. }), "{err}");
    }

    fn any_kind() -> impl proptest::strategy::Strategy<Value = (OptimizerKind, f32)> {
        use proptest::prelude::*;
        prop_oneof![
            Just((OptimizerKind::Sgd, 0.0)),
            Just((OptimizerKind::Sgd, 0.01)),
            Just((OptimizerKind::Momentum { beta: 0.9 }, 0.0)),
            Just((OptimizerKind::Adam { beta1: 0.9, beta2: 0.999, eps: 1e-8 }, 0.0)),
            Just((OptimizerKind::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8 }, 0.1)),
        ]
    }

    proptest::proptest! {
        /// A sparse push applies exactly, bit for bit, what the dense push with zeros
        /// elsewhere applies (values, optimizer state, aggregate sums, clocks), for every
        /// rule, aggregate or not, with pushes without a gradient between, and through a
        /// migration at any point (the sparse block's pushes logged sparse and replayed).
        #[test]
        fn a_sparse_push_applies_exactly_what_the_dense_push_with_zeros_applies(
            (kind, weight_decay) in any_kind(),
            aggregate in proptest::bool::ANY,
            len in 1usize..9,
            pushes in proptest::collection::vec(
                (proptest::bool::ANY, proptest::collection::vec(proptest::option::of(-4.0f32..4.0), 8)),
                1..16,
            ),
            migrate_at in 0usize..16,
        ) {
            let cfg = ShardConfig {
                optimizer: OptimizerConfig { kind, lr: 0.125, aggregate, weight_decay },
                ..opt_config(kind, aggregate, 2)
            };
            let init: Vec<f32> = (0..len).map(|i| i as f32 * 0.3 - 1.0).collect();
            let mut sparse_block: Block<u32> = Block::new(spec(len), init.clone(), &cfg).unwrap();
            let mut dense_block: Block<u32> = Block::new(spec(len), init, &cfg).unwrap();
            let mut clocks = [0u32; 2];
            let mut snapshot = None;
            for (k, (second, entries)) in pushes.iter().enumerate() {
                if k == migrate_at {
                    snapshot = Some(sparse_block.snapshot());
                }
                let w = usize::from(*second);
                let mut indices: Vec<u32> = (0..len as u32).filter(|i| entries[*i as usize].is_some()).collect();
                if indices.is_empty() {
                    // Every fifth empty choice is a push without a gradient on both.
                    if k % 5 == 4 {
                        sparse_block.push_gradient(&cfg, w as u32, clocks[w], Gradient::None, 0).unwrap();
                        dense_block.push(&cfg, w as u32, clocks[w], &[], 0).unwrap();
                        clocks[w] += 1;
                        continue;
                    }
                    indices.push(0);
                }
                let values: Vec<f32> = indices.iter().map(|i| entries[*i as usize].unwrap_or(-0.0)).collect();
                let g = crate::compress::SparseGrad { indices, values };
                sparse_block.push_gradient(&cfg, w as u32, clocks[w], g.as_gradient(), 0).unwrap();
                dense_block.push(&cfg, w as u32, clocks[w], &g.densify(len), 0).unwrap();
                clocks[w] += 1;
            }
            if let Some(snapshot) = snapshot {
                let log = sparse_block.take_log();
                sparse_block = Block::from_state(snapshot, &log, &cfg).unwrap();
            }
            proptest::prop_assert_eq!(fingerprint(&mut sparse_block), fingerprint(&mut dense_block));
        }
    }

    /// Apply cost of a 1% sparse push against a dense push on a block of 1M elements, one
    /// worker (each push completes its clock), the median and the fastest of 41 pushes
    /// (`cargo nextest run -p elasticps-core --release --run-ignored only sparse_apply_cost
    /// --no-capture`).
    #[test]
    #[ignore = "a measurement, not a test"]
    fn sparse_apply_cost() {
        use crate::compress::{ErrorFeedback, Sparsifier};
        use std::time::{Duration, Instant};
        const LEN: usize = 1 << 20;
        const ROUNDS: u32 = 41;
        let summary = |mut t: Vec<Duration>| {
            t.sort_unstable();
            format!("median {:>9.1?}, fastest {:>9.1?}", t[t.len() / 2], t[0])
        };
        let grad: Vec<f32> = (0..LEN).map(|i| (i as f32 * 0.37).sin()).collect();
        for sparsifier in [Sparsifier::TopK { ratio: 0.01 }, Sparsifier::RandomK { ratio: 0.01 }] {
            let mut ef = ErrorFeedback::new(sparsifier, 1);
            let times = (0..ROUNDS)
                .map(|_| {
                    let started = Instant::now();
                    std::hint::black_box(ef.compress(&grad));
                    started.elapsed()
                })
                .collect();
            println!("compress {sparsifier} of 1M: {}", summary(times));
        }
        let sent = ErrorFeedback::new(Sparsifier::TopK { ratio: 0.01 }, 1).compress(&grad);
        let kinds = [
            ("sgd", OptimizerKind::Sgd),
            ("momentum", OptimizerKind::Momentum { beta: 0.9 }),
            ("adam", OptimizerKind::Adam { beta1: 0.9, beta2: 0.999, eps: 1e-8 }),
        ];
        for (name, kind) in kinds {
            for aggregate in [false, true] {
                let cfg = ShardConfig {
                    sync: SyncPolicy::Asp,
                    optimizer: OptimizerConfig { kind, lr: 0.01, aggregate, weight_decay: 0.0 },
                    workers: 1,
                };
                let mut b: Block<u32> = Block::new(spec(LEN), vec![0.0; LEN], &cfg).unwrap();
                let mut clock = 0;
                let mut time = |b: &mut Block<u32>, grad: Gradient<'_>| {
                    let started = Instant::now();
                    b.push_gradient(&cfg, 0, clock, grad, 0).unwrap();
                    clock += 1;
                    started.elapsed()
                };
                let dense: Vec<Duration> = (0..ROUNDS).map(|_| time(&mut b, Gradient::Dense(&grad))).collect();
                let sparse: Vec<Duration> = (0..ROUNDS).map(|_| time(&mut b, sent.as_gradient())).collect();
                println!(
                    "{name:>8} aggregate={aggregate:<5}: dense push {}; 1% sparse push {}",
                    summary(dense),
                    summary(sparse)
                );
            }
        }
    }
}

/// A deterministic driver for one block and a few workers, shared by the scenario tests
/// and the property tests: each worker loops pull(t) -> (answered) -> push(t), taking a
/// step whenever the schedule names it and it is not held.
#[cfg(test)]
pub(crate) mod sim {
    use super::*;
    use crate::optimizer::{OptimizerConfig, OptimizerKind};
    use rand::SeedableRng;

    /// What happened in a run.
    #[derive(Debug, Default)]
    pub struct Outcome {
        /// Every answered pull: (worker, clock, done when answered, held?).
        pub answers: Vec<(u32, Clock, Clock, bool)>,
        /// Pulls held.
        pub held: u64,
        /// Release events.
        pub releases: u64,
        /// The block's final value (aggregate SGD, lr 1, every push = 1.0).
        pub value: f32,
        /// Pulls still held at the end.
        pub still_held: usize,
        /// Largest lead seen.
        pub max_lead: u64,
    }

    /// Runs `clocks` iterations of `workers` workers under `sync`, in the order `schedule`
    /// gives (then round-robin until everyone is done).
    pub fn run(sync: SyncPolicy, workers: u32, clocks: u32, schedule: &[u32], seed: u64) -> Outcome {
        let cfg = ShardConfig {
            sync,
            optimizer: OptimizerConfig { kind: OptimizerKind::Sgd, lr: 1.0, aggregate: true, weight_decay: 0.0 },
            workers,
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut b: Block<(u32, Clock)> = Block::new(BlockSpec::dense(0, 0, 0, 1), vec![0.0], &cfg).unwrap();
        let mut out = Outcome::default();
        // Phase 0: must pull, 1: pull held, 2: pull answered, may push.
        let mut next = vec![0u32; workers as usize];
        let mut phase = vec![0u8; workers as usize];
        let tail = (0..workers * clocks * 4).map(|i| i % workers);
        for (now, w) in schedule.iter().map(|w| w % workers).chain(tail).enumerate() {
            let wi = w as usize;
            let t = next[wi];
            if t >= clocks {
                continue;
            }
            let mut record = |a: Answer<(u32, Clock)>, phase: &mut Vec<u8>| {
                assert_eq!(a.token, (a.worker, a.clock));
                out.answers.push((a.worker, a.clock, a.done, a.held_us.is_some()));
                phase[a.worker as usize] = 2;
            };
            match phase[wi] {
                0 => match b.pull(&cfg, (w, t), w, t, now as u64, &mut rng).unwrap() {
                    Some(a) => record(a, &mut phase),
                    None => phase[wi] = 1,
                },
                2 => {
                    for a in b.push(&cfg, w, t, &[1.0], now as u64).unwrap() {
                        record(a, &mut phase);
                    }
                    next[wi] += 1;
                    phase[wi] = 0;
                }
                _ => {}
            }
        }
        out.held = b.stats().pulls_held;
        out.releases = b.stats().releases;
        out.max_lead = b.stats().max_lead;
        out.value = b.values()[0];
        out.still_held = b.held();
        out
    }

    /// A straggler schedule: worker `slow` gets one step for every `every` steps of each
    /// other worker.
    pub fn straggler(workers: u32, slow: u32, every: u32, steps: u32) -> Vec<u32> {
        let mut s = Vec::new();
        for i in 0..steps {
            for w in 0..workers {
                if w != slow || i % every == 0 {
                    s.push(w);
                }
            }
        }
        s
    }
}

#[cfg(test)]
mod scenarios {
    use super::sim::{run, straggler};
    use crate::sync::SyncPolicy;

    fn policy(s: &str) -> SyncPolicy {
        s.parse().unwrap()
    }

    #[test]
    fn lazy_releases_a_clock_s_pulls_together_and_the_lead_drops_to_zero() {
        // 3 workers, worker 2 runs one step for every 4 of the others.
        let o = run(policy("lazy:1"), 3, 12, &straggler(3, 2, 4, 60), 1);
        // Every held pull of the fast workers was answered at a full catch-up (done == t)...
        let held: Vec<_> = o.answers.iter().filter(|a| a.3).collect();
        assert!(!held.is_empty());
        assert!(held.iter().all(|(_, t, done, _)| done >= t), "{held:?}");
        // ...together: each release event answered both fast workers' pulls of one clock.
        for (w, t, _, _) in &held {
            if *w != 2 {
                assert!(
                    held.iter().any(|(w2, t2, _, _)| w2 != w && *w2 != 2 && t2 == t),
                    "pull({t}) of worker {w} released alone"
                );
            }
        }
        // At a release the lead is 0: everybody has pushed exactly t clocks.
        assert!(held.iter().all(|(_, t, done, _)| done == t));
    }

    #[test]
    fn with_a_straggler_lazy_and_pssp_hold_far_fewer_pulls_than_ssp() {
        let sched = straggler(4, 3, 3, 400);
        let ssp = run(policy("ssp:3"), 4, 60, &sched, 1);
        let lazy = run(policy("lazy:3"), 4, 60, &sched, 1);
        let pssp = run(policy("pssp:3:0.5"), 4, 60, &sched, 1);
        let bsp = run(policy("bsp"), 4, 60, &sched, 1);
        let asp = run(policy("asp"), 4, 60, &sched, 1);
        assert_eq!(asp.held, 0);
        assert!(ssp.held > 0 && bsp.held >= ssp.held, "bsp {} ssp {}", bsp.held, ssp.held);
        assert!(lazy.held * 2 <= ssp.held, "lazy {} vs ssp {}", lazy.held, ssp.held);
        assert!(pssp.held * 2 <= ssp.held, "pssp {} vs ssp {}", pssp.held, ssp.held);
        for o in [&ssp, &lazy, &pssp, &bsp, &asp] {
            assert_eq!(o.answers.len(), 4 * 60);
            assert_eq!(o.value, -60.0);
        }
    }

    #[test]
    fn pssp_with_p_1_holds_only_the_fastest_worker() {
        let o = run(policy("pssp:1:1"), 3, 20, &straggler(3, 2, 3, 100), 1);
        assert!(o.held > 0);
        assert!(o.answers.iter().filter(|a| a.3).all(|a| a.0 != 2), "the straggler was held: {:?}", o.answers);
    }
}

#[cfg(test)]
mod proptests {
    use super::sim::run;
    use crate::sync::SyncPolicy;
    use proptest::prelude::*;

    fn any_policy() -> impl Strategy<Value = SyncPolicy> {
        prop_oneof![
            Just(SyncPolicy::Bsp),
            Just(SyncPolicy::Asp),
            (0u32..4).prop_map(SyncPolicy::Ssp),
            (0u32..4).prop_map(SyncPolicy::Lazy),
            (0u32..4, 0.0f64..=1.0).prop_map(|(s, p)| SyncPolicy::Pssp { s, p }),
            (0u32..4).prop_map(SyncPolicy::Dpssp),
        ]
    }

    /// Two workers push rows of a row block (rows 10..20 of a table of 20 rows, dim 2) in
    /// the order `order` (each entry: which worker pushes its next clock, with the next
    /// rows of `rows`); before push `before` the block is split at row `at`
    /// ([`Partition::split_rows`](crate::model::Partition::split_rows),
    /// [`BlockState::split_rows`](super::BlockState::split_rows)), the last push taken
    /// before is resent to both halves (a duplicate there), and each later push goes to
    /// both halves, each with the rows of its range (an empty push where it has none), as
    /// a worker that learned the split sends it. Returns every row as the whole block ends
    /// and as the halves end.
    pub(super) fn split_run(
        aggregate: bool,
        optimizer: crate::rows::SparseOptimizer,
        order: &[bool],
        rows: &[Vec<u64>],
        before: usize,
        at: u64,
    ) -> (Vec<f32>, Vec<f32>) {
        use super::*;
        use crate::model::{Partition, TableSpec};
        use crate::rows::RowInit;
        let cfg = ShardConfig {
            sync: SyncPolicy::Asp,
            optimizer: crate::optimizer::OptimizerConfig {
                kind: crate::optimizer::OptimizerKind::Sgd,
                lr: 1.0,
                aggregate,
                weight_decay: 0.0,
            },
            workers: 2,
        };
        let table = TableSpec::new("t", 20, 2).with_init(RowInit::Constant(1.0)).with_optimizer(optimizer);
        let mut partition = Partition::with_tables(vec![], vec![table], 80).unwrap();
        let rule = partition.row_rule(1, 3).unwrap().unwrap();
        let mut whole = Block::<u32>::new_rows(partition.blocks[1], rule, &cfg).unwrap();
        let mut halves: Vec<Block<u32>> = Vec::new();
        let mut clocks = [0u32; 2];
        let mut last: Option<(u32, u32, Vec<u64>, Vec<f32>)> = None;
        for k in 0..=order.len() {
            if k == before {
                let ids = partition.split_rows(1, at).unwrap();
                let [l, r] = ids.map(|b| partition.blocks[b as usize]);
                let (l, r) = whole.state().split_rows(l, r).unwrap();
                halves = vec![Block::from_state(l, &[], &cfg).unwrap(), Block::from_state(r, &[], &cfg).unwrap()];
                if let Some((w, c, ids, grads)) = &last {
                    for half in &mut halves {
                        let (ids, grads) = in_range(half.spec(), ids, grads);
                        let steps = half.rows().map(|r| r.steps());
                        half.push_rows(&cfg, *w, *c, &ids, &grads, 0).unwrap();
                        assert_eq!(half.rows().map(|r| r.steps()), steps, "a resend is a duplicate");
                    }
                }
            }
            let Some(w) = order.get(k).map(|w| usize::from(*w)) else { break };
            let ids = &rows[k % rows.len()];
            let grads: Vec<f32> = ids.iter().flat_map(|r| [*r as f32 * 0.125, -0.25]).collect();
            whole.push_rows(&cfg, w as u32, clocks[w], ids, &grads, 0).unwrap();
            last = Some((w as u32, clocks[w], ids.clone(), grads.clone()));
            for half in &mut halves {
                let (ids, grads) = in_range(half.spec(), ids, &grads);
                half.push_rows(&cfg, w as u32, clocks[w], &ids, &grads, 0).unwrap();
            }
            clocks[w] += 1;
        }
        assert_eq!(partition.check_tables(), Ok(()));
        let all: Vec<u64> = (10..20).collect();
        let mut split = halves[0].rows().unwrap().gather(&(10..at).collect::<Vec<_>>());
        split.extend(halves[1].rows().unwrap().gather(&(at..20).collect::<Vec<_>>()));
        (whole.rows().unwrap().gather(&all), split)
    }

    /// The ids of `ids` in `spec`'s range and their gradients.
    fn in_range(spec: &crate::model::BlockSpec, ids: &[u64], grads: &[f32]) -> (Vec<u64>, Vec<f32>) {
        let (start, end, _) = spec.row_range().unwrap();
        let keep: Vec<usize> = (0..ids.len()).filter(|i| (start..end).contains(&ids[*i])).collect();
        (keep.iter().map(|i| ids[*i]).collect(), keep.iter().flat_map(|i| grads[i * 2..i * 2 + 2].to_vec()).collect())
    }

    /// Two workers push keys of one bounded key-range block under aggregate mode and asp
    /// (`order`: which worker pushes its next clock, with keys `keys[k]` and integer
    /// gradients), so that clocks wait for the slower worker with their keys in flight.
    /// Fails when a key of a clock in flight that had a row when pushed has none before
    /// its clock applies, or when a row present does not hold exactly the mean gradients
    /// of the clocks applied since it was created.
    pub(super) fn bounded_aggregate_run(
        max_rows: u64,
        admit_after: u32,
        order: &[bool],
        keys: &[Vec<(u64, i8)>],
    ) -> Result<(), String> {
        use super::*;
        use crate::model::{Partition, TableSpec};
        use crate::rows::{RowInit, RowLimits};
        use std::collections::HashMap;
        let cfg = ShardConfig {
            sync: SyncPolicy::Asp,
            optimizer: crate::optimizer::OptimizerConfig {
                kind: crate::optimizer::OptimizerKind::Sgd,
                lr: 1.0,
                aggregate: true,
                weight_decay: 0.0,
            },
            workers: 2,
        };
        let limits = RowLimits { max_rows, admit_after, ..RowLimits::default() };
        let table = TableSpec::hashed("t", 1, 1)
            .with_init(RowInit::Constant(0.0))
            .with_optimizer(crate::rows::SparseOptimizer::Sgd { lr: 1.0 })
            .with_limits(limits);
        let partition = Partition::with_tables(vec![], vec![table], 80).unwrap();
        let rule = partition.row_rule(0, 3).unwrap().unwrap();
        let mut block = Block::<u32>::new_rows(partition.blocks[0], rule, &cfg).unwrap();
        let mut clocks = [0u32; 2];
        // Clock -> (key -> summed gradient, keys that had a row when pushed).
        let mut flight: BTreeMap<u32, (HashMap<u64, f32>, Vec<u64>)> = BTreeMap::new();
        let mut model: HashMap<u64, f32> = HashMap::new();
        let rows = |b: &Block<u32>| b.rows().unwrap().clone();
        for (k, w) in order.iter().map(|w| usize::from(*w)).enumerate() {
            let push = &keys[k % keys.len()];
            let (ids, grads): (Vec<u64>, Vec<f32>) = push.iter().map(|(id, g)| (*id, f32::from(*g))).unzip();
            let before = rows(&block);
            let clock = clocks[w];
            let entry = flight.entry(clock).or_default();
            for (id, g) in ids.iter().zip(&grads) {
                *entry.0.entry(*id).or_insert(0.0) += g;
                if before.contains(*id) {
                    entry.1.push(*id);
                }
            }
            block.push_rows(&cfg, w as u32, clock, &ids, &grads, 0).map_err(|e| e.to_string())?;
            clocks[w] += 1;
            let after = rows(&block);
            let done = clocks[0].min(clocks[1]);
            let applied: Vec<u32> = flight.range(..done).map(|(c, _)| *c).collect();
            let mut touched = HashMap::new();
            for c in applied {
                for (id, g) in flight.remove(&c).unwrap().0 {
                    *touched.entry(id).or_insert(0.0) += g / 2.0;
                }
            }
            for (id, g) in &touched {
                let base = if before.contains(*id) { model.get(id).copied().unwrap_or(0.0) } else { 0.0 };
                model.insert(*id, base + g);
            }
            model.retain(|id, _| after.contains(*id));
            for (c, (_, present)) in &flight {
                if let Some(id) = present.iter().find(|id| !after.contains(**id)) {
                    return Err(format!("key {id} of clock {c}, in flight, lost its row"));
                }
            }
            for (id, v) in &model {
                let got = after.gather(&[*id])[0];
                if got != -v {
                    return Err(format!("key {id} holds {got}, its pushes since its creation {}", -v));
                }
            }
        }
        Ok(())
    }

    fn any_sparse() -> impl Strategy<Value = crate::rows::SparseOptimizer> {
        use crate::rows::SparseOptimizer;
        prop_oneof![
            Just(SparseOptimizer::Sgd { lr: 0.5 }),
            Just(SparseOptimizer::adagrad(0.5)),
            Just(SparseOptimizer::sparse_adam(0.1)),
            Just(SparseOptimizer::lazy_adam(0.1)),
        ]
    }

    proptest! {
        /// A bounded key-range block under aggregate mode never evicts a row that a clock
        /// in flight pushes to, and every row holds exactly its pushes since its creation.
        #[test]
        fn a_bounded_block_keeps_the_rows_of_pushes_in_flight(
            max_rows in 1u64..5,
            admit_after in 0u32..3,
            order in proptest::collection::vec(any::<bool>(), 1..40),
            keys in proptest::collection::vec(proptest::collection::vec((0u64..10, -3i8..4), 0..5), 1..8),
        ) {
            prop_assert_eq!(bounded_aggregate_run(max_rows, admit_after, &order, &keys), Ok(()));
        }
    }

    proptest! {
        /// A row block split at any row, at any point of two workers' pushes (repeated
        /// rows, empty pushes, aggregate or not, every sparse optimizer), ends with exactly
        /// the rows the unsplit block ends with, and a push taken before the split and
        /// resent to the halves is a duplicate on both.
        #[test]
        fn a_split_row_block_ends_with_the_rows_of_the_unsplit_one(
            aggregate in any::<bool>(),
            optimizer in any_sparse(),
            order in proptest::collection::vec(any::<bool>(), 1..16),
            rows in proptest::collection::vec(proptest::collection::vec(10u64..20, 0..4), 1..6),
            before in 0usize..16,
            at in 11u64..20,
        ) {
            let before = before.min(order.len());
            let (whole, split) = split_run(aggregate, optimizer, &order, &rows, before, at);
            prop_assert_eq!(whole, split);
        }
    }

    proptest! {
        /// Whatever order workers run in and whatever the policy: no pull(t) is answered
        /// while done < t - s (for the policies with a bound), every pull is answered
        /// exactly once by the time every worker has pushed its last clock, and with
        /// aggregate + integer gradients the result is exact.
        #[test]
        fn no_policy_answers_early_or_loses_a_pull(
            sync in any_policy(),
            workers in 1u32..4,
            schedule in proptest::collection::vec(0u32..4, 1..200),
            seed in any::<u64>(),
        ) {
            const CLOCKS: u32 = 6;
            let o = run(sync, workers, CLOCKS, &schedule, seed);
            for (w, t, done, _) in &o.answers {
                prop_assert!(!sync.violates_bound(*t, *done), "{sync}: pull({t}) of worker {w} answered at done {done}");
            }
            let mut seen = std::collections::HashSet::new();
            prop_assert!(o.answers.iter().all(|(w, t, _, _)| seen.insert((*w, *t))));
            prop_assert_eq!(o.answers.len() as u32, workers * CLOCKS);
            prop_assert_eq!(o.still_held, 0);
            prop_assert_eq!(o.value, -(CLOCKS as f32));
        }
    }
}
