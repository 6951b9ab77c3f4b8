//! The model as the parameter server sees it: named dense f32 tensors and embedding
//! tables, cut into blocks.
//!
//! A block is the unit of placement, synchronization state, load accounting and
//! migration: a slice of a dense tensor, or a range of a table's rows
//! ([`BlockKind::Rows`]). Blocks are numbered densely from 0, the tensors' blocks in
//! tensor order, then the tables' in table order, so a block id is also an index into
//! [`Partition::blocks`].

use rand::{Rng, SeedableRng, rngs::StdRng};
use serde::{Deserialize, Serialize};

use crate::CoreError;
use crate::optimizer::TensorOptimizer;
use crate::rows::{KEY_POSITIONS, RowInit, RowLimits, RowRule, SparseOptimizer, key_position, row_key};

pub use crate::ids::{BlockId, fnv1a};

/// How a tensor's initial values are drawn on the server that owns it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum Init {
    /// All zeros (biases).
    Zeros,
    /// Uniform in `[low, high)`.
    Uniform {
        /// Inclusive lower bound.
        low: f32,
        /// Exclusive upper bound.
        high: f32,
    },
    /// A constant value in every element (tests use it to make outcomes exact).
    Constant(f32),
}

/// One named dense tensor of the model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorSpec {
    /// Unique name, e.g. `fc1.weight`.
    pub name: String,
    /// Shape; the tensor holds the product of its dimensions f32 values.
    pub shape: Vec<usize>,
    /// How the server initialises it.
    pub init: Init,
}

impl TensorSpec {
    /// Number of f32 elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// True if the tensor holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// How a table's rows are named.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum TableKeys {
    /// Row ids `0..rows`, cut into row ranges of at most `block_bytes`.
    #[default]
    Indexed,
    /// Any u64 key (a hashed feature id). The key space is cut into `ranges` equal ranges
    /// of [`key_position`]s (a hash of the key, so that sequential keys spread), each
    /// range a block ([`BlockKind::Keys`]).
    Hashed {
        /// Ranges the table starts with (1..=65,536); psld splits hot ones further.
        ranges: u32,
    },
}

/// The rows a hashed table's whole key space weighs in placement before any server
/// reports its rows ([`BlockSpec::bytes`]).
pub const KEY_RANGE_NOMINAL_ROWS: u64 = 1 << 16;

/// Most ranges a hashed table may start with.
pub const MAX_KEY_RANGES: u32 = 1 << 16;

/// One embedding table of the model: `rows x dim` f32 values, pulled and pushed by row
/// ids (`PullRows`, `PushRows`), its rows created on the server when first pushed to.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TableSpec {
    /// Unique name among tensors and tables, e.g. `emb.user`.
    pub name: String,
    /// Rows (ids `0..rows`); a hashed table's positions, [`KEY_POSITIONS`].
    pub rows: u64,
    /// Values per row.
    pub dim: u32,
    /// How a row's initial values are drawn (seeded by the job's seed, the table's name
    /// and the row id).
    pub init: RowInit,
    /// The table's update rule on sparse gradients.
    pub optimizer: SparseOptimizer,
    /// Indexed rows or hashed keys.
    pub keys: TableKeys,
    /// Its memory bound (`max_rows` per server, as the job starts), expiry and admission.
    pub limits: RowLimits,
}

impl TableSpec {
    /// A table of `rows x dim` with `torch.nn.Embedding`'s N(0, 1) rows and SGD at lr 0.01.
    pub fn new(name: impl Into<String>, rows: u64, dim: u32) -> Self {
        Self {
            name: name.into(),
            rows,
            dim,
            init: RowInit::default(),
            optimizer: SparseOptimizer::default(),
            keys: TableKeys::Indexed,
            limits: RowLimits::default(),
        }
    }

    /// A table keyed by any u64, `dim` values per row, starting as `ranges` key ranges
    /// ([`TableKeys::Hashed`]), with [`TableSpec::new`]'s initializer and optimizer.
    pub fn hashed(name: impl Into<String>, dim: u32, ranges: u32) -> Self {
        Self { keys: TableKeys::Hashed { ranges }, ..Self::new(name, KEY_POSITIONS, dim) }
    }

    /// This table with its rows bounded, expired or admitted by `limits`.
    pub fn with_limits(self, limits: RowLimits) -> Self {
        Self { limits, ..self }
    }

    /// True for a table keyed by any u64.
    pub fn is_hashed(&self) -> bool {
        matches!(self.keys, TableKeys::Hashed { .. })
    }

    /// This table with rows drawn by `init`.
    pub fn with_init(self, init: RowInit) -> Self {
        Self { init, ..self }
    }

    /// This table updated by `optimizer`.
    pub fn with_optimizer(self, optimizer: SparseOptimizer) -> Self {
        Self { optimizer, ..self }
    }

    /// Rows per block when blocks hold at most `block_bytes`: `block_bytes / (dim * 4)`,
    /// at least 1.
    pub fn rows_per_block(&self, block_bytes: usize) -> u64 {
        (block_bytes as u64 / (u64::from(self.dim) * 4).max(1)).max(1)
    }
}

/// What a block holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum BlockKind {
    /// A slice `[offset, offset + len)` of dense tensor `tensor` (pulled and pushed whole).
    Dense,
    /// Rows of table `tensor` (its index in [`Partition::tables`]), `dim` values each,
    /// pulled and pushed by row id: rows `offset / dim .. (offset + len) / dim`
    /// ([`BlockSpec::row_range`]).
    Rows {
        /// Values per row.
        dim: u32,
    },
    /// Keys of hashed table `tensor` whose [`key_position`] falls in positions
    /// `offset / dim .. (offset + len) / dim`, `dim` values each: a row block in every
    /// other respect.
    Keys {
        /// Values per row.
        dim: u32,
    },
}

/// One block: a contiguous slice of a tensor, or a range of a table's rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockSpec {
    /// Dense block id.
    pub id: BlockId,
    /// Index of the tensor in the model's tensor list (of the table in its table list
    /// for a row block).
    pub tensor: u32,
    /// First element of the tensor held by this block (for a row block, `start * dim`).
    pub offset: usize,
    /// Number of f32 elements (for a row block, `(end - start) * dim`: what it holds once
    /// every row exists; placement and load weigh blocks by it).
    pub len: usize,
    /// Dense slice or row range.
    pub kind: BlockKind,
}

impl BlockSpec {
    /// A slice `[offset, offset + len)` of tensor `tensor`.
    pub fn dense(id: BlockId, tensor: u32, offset: usize, len: usize) -> Self {
        Self { id, tensor, offset, len, kind: BlockKind::Dense }
    }

    /// Rows `[start, end)` of table `table`, `dim` values each.
    pub fn rows(id: BlockId, table: u32, start: u64, end: u64, dim: u32) -> Self {
        let len = (end - start) as usize * dim as usize;
        Self { id, tensor: table, offset: start as usize * dim as usize, len, kind: BlockKind::Rows { dim } }
    }

    /// The keys of hashed table `table` whose positions are `[start, end)`, `dim` values each.
    pub fn keys(id: BlockId, table: u32, start: u64, end: u64, dim: u32) -> Self {
        Self { kind: BlockKind::Keys { dim }, ..Self::rows(id, table, start, end, dim) }
    }

    /// A block of the same table and kind as this one (row block), over `[start, end)`.
    pub fn with_range(&self, id: BlockId, start: u64, end: u64) -> Self {
        let dim = self.row_range().map_or(1, |(_, _, d)| d);
        Self { kind: self.kind, ..Self::rows(id, self.tensor, start, end, dim) }
    }

    /// Where key or row `id` falls in this block's table: its [`key_position`] in a
    /// hashed table, the row itself otherwise.
    pub fn position(&self, id: u64) -> u64 {
        if matches!(self.kind, BlockKind::Keys { .. }) { key_position(id) } else { id }
    }

    /// Whether this row block holds row or key `id`.
    pub fn holds(&self, id: u64) -> bool {
        self.row_range().is_some_and(|(start, end, _)| (start..end).contains(&self.position(id)))
    }

    /// Size in bytes of the block's values (a row block's once every row exists). A key
    /// range has no such size: until its server reports its rows, it weighs its share of
    /// [`KEY_RANGE_NOMINAL_ROWS`] rows for the whole key space.
    pub fn bytes(&self) -> usize {
        match self.kind {
            BlockKind::Keys { dim } => {
                let width = (self.len / dim.max(1) as usize) as u64;
                let rows =
                    (u128::from(width) * u128::from(KEY_RANGE_NOMINAL_ROWS) / u128::from(KEY_POSITIONS)) as usize;
                rows.max(1) * dim as usize * 4
            }
            _ => self.len * 4,
        }
    }

    /// True for a range of a table's rows (or keys).
    pub fn is_rows(&self) -> bool {
        matches!(self.kind, BlockKind::Rows { .. } | BlockKind::Keys { .. })
    }

    /// True for a row block that was split into two others ([`Partition::split_rows`]):
    /// it holds no row, and its id answers no request.
    pub fn is_retired(&self) -> bool {
        self.is_rows() && self.len == 0
    }

    /// A row block's rows `[start, end)` and values per row; `None` for a dense block.
    pub fn row_range(&self) -> Option<(u64, u64, u32)> {
        match self.kind {
            BlockKind::Rows { dim } | BlockKind::Keys { dim } => {
                let d = u64::from(dim.max(1));
                Some((self.offset as u64 / d, (self.offset + self.len) as u64 / d, dim))
            }
            BlockKind::Dense => None,
        }
    }
}

/// A model cut into blocks of at most `block_bytes`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Partition {
    /// The tensors, in the order the user registered them.
    pub tensors: Vec<TensorSpec>,
    /// The embedding tables, in the order the user registered them.
    pub tables: Vec<TableSpec>,
    /// The blocks, `blocks[i].id == i`: the tensors' in tensor order, then the tables'.
    pub blocks: Vec<BlockSpec>,
    /// Each tensor's own optimizer (`optimizers[t]`), or none: then the job's. Empty when
    /// no tensor has one.
    pub optimizers: Vec<Option<TensorOptimizer>>,
    /// The servers the job started with: a table's bound per server becomes each block's
    /// share of `max_rows x servers` ([`Partition::row_rule`]).
    pub servers: u32,
}

impl Partition {
    /// Cuts `tensors` into blocks of at most `block_bytes` bytes (at least one f32).
    pub fn new(tensors: Vec<TensorSpec>, block_bytes: usize) -> Result<Self, CoreError> {
        Self::with_tables(tensors, Vec::new(), block_bytes)
    }

    /// Cuts `tensors` into blocks of at most `block_bytes` bytes (at least one f32), then
    /// `tables` into row ranges of [`TableSpec::rows_per_block`] rows. Names are unique
    /// among tensors and tables; a table has rows and a dim; the model has at least one
    /// tensor or table.
    pub fn with_tables(
        tensors: Vec<TensorSpec>,
        tables: Vec<TableSpec>,
        block_bytes: usize,
    ) -> Result<Self, CoreError> {
        if tensors.is_empty() && tables.is_empty() {
            return Err(CoreError::InvalidModel("the model has no tensor and no table".into()));
        }
        let max_len = (block_bytes / 4).max(1);
        let mut blocks = Vec::new();
        for (t, spec) in tensors.iter().enumerate() {
            if spec.is_empty() {
                return Err(CoreError::InvalidModel(format!("tensor {:?} is empty", spec.name)));
            }
            if tensors[..t].iter().any(|o| o.name == spec.name) {
                return Err(CoreError::InvalidModel(format!("tensor name {:?} is used twice", spec.name)));
            }
            let mut offset = 0;
            while offset < spec.len() {
                let len = max_len.min(spec.len() - offset);
                let id = BlockId::try_from(blocks.len())
                    .map_err(|_| CoreError::InvalidModel("more than 2^32 blocks".into()))?;
                blocks.push(BlockSpec::dense(id, t as u32, offset, len));
                offset += len;
            }
        }
        for (t, table) in tables.iter().enumerate() {
            if tensors.iter().any(|o| o.name == table.name) || tables[..t].iter().any(|o| o.name == table.name) {
                return Err(CoreError::InvalidModel(format!("table name {:?} is used twice", table.name)));
            }
            if table.rows == 0 || table.dim == 0 {
                return Err(CoreError::InvalidModel(format!(
                    "table {:?} has {} rows of {} values: both must be at least 1",
                    table.name, table.rows, table.dim
                )));
            }
            if table.rows.checked_mul(u64::from(table.dim)).is_none_or(|n| usize::try_from(n).is_err()) {
                return Err(CoreError::InvalidModel(format!("table {:?} is too large", table.name)));
            }
            table.init.validate()?;
            table.optimizer.validate()?;
            let (per, hashed) = match table.keys {
                TableKeys::Indexed => (table.rows_per_block(block_bytes), false),
                TableKeys::Hashed { ranges } => {
                    if table.rows != KEY_POSITIONS || ranges == 0 || ranges > MAX_KEY_RANGES {
                        return Err(CoreError::InvalidModel(format!(
                            "hashed table {:?}: {ranges} ranges over {} positions (1..={MAX_KEY_RANGES} ranges over \
                             {KEY_POSITIONS})",
                            table.name, table.rows
                        )));
                    }
                    (KEY_POSITIONS.div_ceil(u64::from(ranges)), true)
                }
            };
            let mut start = 0;
            while start < table.rows {
                let end = table.rows.min(start.saturating_add(per));
                let id = BlockId::try_from(blocks.len())
                    .map_err(|_| CoreError::InvalidModel("more than 2^32 blocks".into()))?;
                let make = if hashed { BlockSpec::keys } else { BlockSpec::rows };
                blocks.push(make(id, t as u32, start, end, table.dim));
                start = end;
            }
        }
        Ok(Self { tensors, tables, blocks, optimizers: Vec::new(), servers: 1 })
    }

    /// This partition for a job of `servers` servers at its start (at least 1): what a
    /// table's bound per server is multiplied by.
    pub fn with_servers(self, servers: u32) -> Self {
        Self { servers: servers.max(1), ..self }
    }

    /// The table with this name and its index, if the model has one.
    pub fn table(&self, name: &str) -> Option<(u32, &TableSpec)> {
        self.tables.iter().enumerate().find(|(_, t)| t.name == name).map(|(i, t)| (i as u32, t))
    }

    /// The live blocks of table `table` (not split into others), in row order: together
    /// they cover its rows `0..rows` without overlap.
    pub fn table_blocks(&self, table: u32) -> Vec<&BlockSpec> {
        let mut blocks: Vec<&BlockSpec> =
            self.blocks.iter().filter(|b| b.is_rows() && b.tensor == table && !b.is_retired()).collect();
        blocks.sort_by_key(|b| b.offset);
        blocks
    }

    /// The block of table `table` that holds row (or key) `row`, if the table has that row.
    pub fn row_block(&self, table: u32, row: u64) -> Option<&BlockSpec> {
        let spec = self.tables.get(table as usize)?;
        let row = if spec.is_hashed() { key_position(row) } else { row };
        if row >= spec.rows {
            return None;
        }
        let blocks = self.table_blocks(table);
        let at = blocks.partition_point(|b| b.row_range().is_some_and(|(_, end, _)| end <= row));
        blocks.get(at).copied()
    }

    /// Splits row block `block` (rows `s..e`) at row `at` (`s < at < e`): two new blocks,
    /// ids `blocks.len()` (rows `s..at`) and the next (rows `at..e`), take its place, and
    /// `block` is retired ([`BlockSpec::is_retired`]: no rows, kept so that ids stay
    /// dense and stable). Returns the two new ids. Refused for a dense, retired or unknown
    /// block, and for `at` outside `s + 1 ..= e - 1`.
    pub fn split_rows(&mut self, block: BlockId, at: u64) -> Result<[BlockId; 2], CoreError> {
        let spec = *self.block(block)?;
        let Some((start, end, dim)) = spec.row_range().filter(|_| !spec.is_retired()) else {
            return Err(CoreError::NotRows(block));
        };
        if at <= start || at >= end {
            return Err(CoreError::RowOutOfRange { block, row: at, start: start + 1, end });
        }
        let first = BlockId::try_from(self.blocks.len())
            .ok()
            .filter(|f| f.checked_add(1).is_some())
            .ok_or_else(|| CoreError::InvalidModel("more than 2^32 blocks".into()))?;
        debug_assert!(dim > 0);
        self.blocks.push(spec.with_range(first, start, at));
        self.blocks.push(spec.with_range(first + 1, at, end));
        self.blocks[block as usize].len = 0;
        debug_assert_eq!(self.check_tables(), Ok(()));
        Ok([first, first + 1])
    }

    /// The invariant of tables: the live blocks of every table cover its rows exactly once,
    /// in order. The first table that breaks it, as an error.
    pub fn check_tables(&self) -> Result<(), String> {
        for (t, spec) in self.tables.iter().enumerate() {
            let mut next = 0;
            for b in self.table_blocks(t as u32) {
                let (start, end, _) = b.row_range().unwrap_or_default();
                if start != next || end <= start {
                    return Err(format!(
                        "table {:?}: block {} holds rows {start}..{end}, expected from {next}",
                        spec.name, b.id
                    ));
                }
                next = end;
            }
            if next != spec.rows {
                return Err(format!("table {:?}: its blocks end at row {next}, not {}", spec.name, spec.rows));
            }
        }
        Ok(())
    }

    /// Row ids of table `table` grouped by the block that holds them: every block of the
    /// table in row order, each with the positions in `ids` of its rows (empty where no
    /// id falls in it: a worker pushes to every block of a table on every clock). Refused
    /// for a table the model does not have or a row past its end.
    pub fn rows_by_block(&self, table: u32, ids: &[u64]) -> Result<Vec<(BlockId, Vec<usize>)>, CoreError> {
        let spec = self.tables.get(table as usize).ok_or_else(|| {
            CoreError::InvalidModel(format!("table {table} does not exist: the model has {} tables", self.tables.len()))
        })?;
        let blocks = self.table_blocks(table);
        let ends: Vec<u64> = blocks.iter().map(|b| b.row_range().map_or(0, |(_, end, _)| end)).collect();
        let mut out: Vec<(BlockId, Vec<usize>)> = blocks.iter().map(|b| (b.id, Vec::new())).collect();
        let hashed = spec.is_hashed();
        for (i, row) in ids.iter().enumerate() {
            let at = if hashed { key_position(*row) } else { *row };
            if at >= spec.rows {
                return Err(CoreError::NoSuchRow { table: spec.name.clone(), row: *row, rows: spec.rows });
            }
            out[ends.partition_point(|end| *end <= at)].1.push(i);
        }
        Ok(out)
    }

    /// How row block `id` makes and updates its rows (its table's dim, initializer and
    /// optimizer, keyed by the job's `seed`); `None` for a dense block.
    pub fn row_rule(&self, id: BlockId, seed: u64) -> Result<Option<RowRule>, CoreError> {
        let block = self.block(id)?;
        if !block.is_rows() {
            return Ok(None);
        }
        let t = &self.tables[block.tensor as usize];
        let (start, end, _) = block.row_range().unwrap_or_default();
        // The block's share of the table's bound over the servers the job started with.
        let max_rows = match t.limits.max_rows {
            0 => 0,
            per_server => {
                let total = u128::from(per_server) * u128::from(self.servers.max(1));
                let share = (total * u128::from(end - start)).div_ceil(u128::from(t.rows.max(1)));
                u64::try_from(share).unwrap_or(u64::MAX).max(1)
            }
        };
        let limits = RowLimits { max_rows, ..t.limits };
        Ok(Some(RowRule { dim: t.dim, init: t.init, key: row_key(seed, &t.name), optimizer: t.optimizer, limits }))
    }

    /// This partition with per-tensor optimizers: `optimizers` is empty or has one entry
    /// per tensor, each valid.
    pub fn with_optimizers(mut self, optimizers: Vec<Option<TensorOptimizer>>) -> Result<Self, CoreError> {
        if !optimizers.is_empty() && optimizers.len() != self.tensors.len() {
            return Err(CoreError::InvalidModel(format!(
                "{} optimizers for {} tensors",
                optimizers.len(),
                self.tensors.len()
            )));
        }
        for o in optimizers.iter().flatten() {
            o.validate()?;
        }
        self.optimizers = optimizers;
        Ok(self)
    }

    /// The optimizer of tensor `tensor`, if it has its own.
    pub fn optimizer(&self, tensor: u32) -> Option<&TensorOptimizer> {
        self.optimizers.get(tensor as usize).and_then(Option::as_ref)
    }

    /// Gives tensor `tensor` its own optimizer (a learning-rate change, say).
    pub fn set_optimizer(&mut self, tensor: u32, optimizer: TensorOptimizer) -> Result<(), CoreError> {
        if tensor as usize >= self.tensors.len() {
            return Err(CoreError::InvalidModel(format!(
                "tensor {tensor} does not exist: the model has {} tensors",
                self.tensors.len()
            )));
        }
        optimizer.validate()?;
        self.optimizers.resize(self.tensors.len(), None);
        self.optimizers[tensor as usize] = Some(optimizer);
        Ok(())
    }

    /// Total number of f32 values of the model's dense tensors.
    pub fn total_len(&self) -> usize {
        self.tensors.iter().map(TensorSpec::len).sum()
    }

    /// The block with this id, or an error naming it.
    pub fn block(&self, id: BlockId) -> Result<&BlockSpec, CoreError> {
        self.blocks.get(id as usize).ok_or(CoreError::UnknownBlock(id))
    }

    /// Deterministic initial values of one block: depends only on `seed`, the tensor's
    /// name and init, and the element index, never on how the tensor is cut.
    /// A row block has no dense values: empty (its rows come from [`Partition::row_rule`]).
    pub fn init_values(&self, id: BlockId, seed: u64) -> Result<Vec<f32>, CoreError> {
        let block = *self.block(id)?;
        if block.is_rows() {
            return Ok(Vec::new());
        }
        let spec = &self.tensors[block.tensor as usize];
        Ok(match spec.init {
            Init::Zeros => vec![0.0; block.len],
            Init::Constant(c) => vec![c; block.len],
            Init::Uniform { low, high } => {
                // One RNG stream per chunk of 1024 elements, keyed by the tensor name, so
                // any cut at a chunk boundary or not gives the same values.
                const CHUNK: usize = 1024;
                let key = seed ^ fnv1a(spec.name.as_bytes());
                let mut out = Vec::with_capacity(block.len);
                let end = block.offset + block.len;
                let mut i = block.offset;
                while i < end {
                    let chunk = i / CHUNK;
                    let mut rng =
                        StdRng::seed_from_u64(key.wrapping_add((chunk as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)));
                    let chunk_start = chunk * CHUNK;
                    for _ in chunk_start..i {
                        let _: f32 = rng.random();
                    }
                    let chunk_end = ((chunk + 1) * CHUNK).min(end);
                    for _ in i..chunk_end {
                        out.push(low + (high - low) * rng.random::<f32>());
                    }
                    i = chunk_end;
                }
                out
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(name: &str, len: usize, init: Init) -> TensorSpec {
        TensorSpec { name: name.into(), shape: vec![len], init }
    }

    #[test]
    fn cuts_tensors_into_blocks_of_at_most_block_bytes() {
        let p = Partition::new(vec![tensor("a", 10, Init::Zeros), tensor("b", 3, Init::Zeros)], 16).unwrap();
        let lens: Vec<_> = p.blocks.iter().map(|b| (b.tensor, b.offset, b.len)).collect();
        assert_eq!(lens, vec![(0, 0, 4), (0, 4, 4), (0, 8, 2), (1, 0, 3)]);
        assert!(p.blocks.iter().enumerate().all(|(i, b)| b.id as usize == i));
        assert_eq!(p.total_len(), 13);
    }

    #[test]
    fn rejects_empty_and_duplicate_tensors() {
        assert!(Partition::new(vec![], 16).is_err());
        assert!(Partition::new(vec![tensor("a", 0, Init::Zeros)], 16).is_err());
        assert!(Partition::new(vec![tensor("a", 1, Init::Zeros), tensor("a", 1, Init::Zeros)], 16).is_err());
    }

    #[test]
    fn a_hashed_table_is_cut_into_key_ranges_that_route_any_u64() {
        use crate::rows::{KEY_POSITIONS, RowLimits, key_position};
        let limits = RowLimits { max_rows: 1000, ..RowLimits::default() };
        let table = TableSpec::hashed("h", 4, 8).with_limits(limits);
        let mut p = Partition::with_tables(vec![tensor("w", 5, Init::Zeros)], vec![table], 16).unwrap().with_servers(2);
        let keys: Vec<&BlockSpec> = p.table_blocks(0);
        assert_eq!(keys.len(), 8);
        assert!(keys.iter().all(|b| matches!(b.kind, BlockKind::Keys { dim: 4 })));
        assert_eq!(keys[7].row_range(), Some((7 * KEY_POSITIONS / 8, KEY_POSITIONS, 4)));
        assert_eq!(p.check_tables(), Ok(()));
        // Any u64, sequential or not, goes to the block whose positions hold it.
        let ids: Vec<u64> = (0..64).chain([u64::MAX, 1 << 63, 12_345_678_901]).collect();
        let groups = p.rows_by_block(0, &ids).unwrap();
        let mut seen = 0;
        for (block, at) in &groups {
            let spec = p.blocks[*block as usize];
            for i in at {
                assert!(spec.holds(ids[*i]), "key {} in block {block}", ids[*i]);
                assert_eq!(p.row_block(0, ids[*i]).unwrap().id, *block);
            }
            seen += at.len();
        }
        assert_eq!(seen, ids.len());
        assert!(groups.iter().filter(|(_, at)| !at.is_empty()).count() >= 6, "64 sequential keys spread");
        // Until its rows are reported, a range weighs its share of 2^16 rows.
        assert_eq!(keys[0].bytes(), (1 << 13) * 4 * 4);
        // Each range's bound is its share of 1000 rows per server x 2 servers.
        assert_eq!(p.row_rule(keys[0].id, 1).unwrap().unwrap().limits.max_rows, 250);
        // A split keeps the kind: its halves hold keys by position.
        let first = keys[0].id;
        let at = KEY_POSITIONS / 32;
        let [l, r] = p.split_rows(first, at).unwrap();
        assert!(matches!(p.blocks[l as usize].kind, BlockKind::Keys { .. }));
        let low = (0u64..).find(|k| key_position(*k) < at).unwrap();
        assert!(p.blocks[l as usize].holds(low) && !p.blocks[r as usize].holds(low));
        assert_eq!(p.row_rule(l, 1).unwrap().unwrap().limits.max_rows, 63);
        assert_eq!(p.check_tables(), Ok(()));
        // Out of range: a hashed table refuses 0 ranges and more than MAX_KEY_RANGES.
        for ranges in [0, MAX_KEY_RANGES + 1] {
            assert!(Partition::with_tables(vec![], vec![TableSpec::hashed("h", 4, ranges)], 16).is_err());
        }
    }

    #[test]
    fn tables_are_cut_into_row_ranges_after_the_tensors() {
        let tables = vec![TableSpec::new("emb", 10, 2), TableSpec::new("small", 1, 100)];
        let p = Partition::with_tables(vec![tensor("w", 5, Init::Zeros)], tables, 16).unwrap();
        // 16 bytes hold 2 rows of 2 f32; a row of 100 f32 is one block on its own.
        let kinds: Vec<_> = p.blocks.iter().map(|b| (b.id, b.tensor, b.kind)).collect();
        let rows = |dim| BlockKind::Rows { dim };
        assert_eq!(kinds[..3], [(0, 0, BlockKind::Dense), (1, 0, BlockKind::Dense), (2, 0, rows(2))]);
        assert_eq!(kinds[6..], [(6, 0, rows(2)), (7, 1, rows(100))]);
        assert_eq!(p.blocks[2].row_range(), Some((0, 2, 2)));
        assert_eq!(p.blocks[6].row_range(), Some((8, 10, 2)));
        assert_eq!(p.blocks[7].row_range(), Some((0, 1, 100)));
        assert_eq!(p.blocks[0].row_range(), None);
        assert_eq!(p.blocks[3].len, 4);
        assert_eq!(p.blocks[7].bytes(), 400);
        assert_eq!(p.row_block(0, 9).unwrap().id, 6);
        assert_eq!(p.row_block(0, 4).unwrap().id, 4);
        assert!(p.row_block(0, 10).is_none());
        assert_eq!(p.table_blocks(0).len(), 5);
        assert_eq!(p.table("small").unwrap().0, 1);
        assert!(p.row_rule(0, 1).unwrap().is_none());
        assert_eq!(p.row_rule(7, 1).unwrap().unwrap().dim, 100);
        assert!(p.init_values(3, 1).unwrap().is_empty());
        // A batch's ids by block: every block of the table, with the positions of its rows.
        let by = p.rows_by_block(0, &[9, 0, 1, 9]).unwrap();
        assert_eq!(by, vec![(2, vec![1, 2]), (3, vec![]), (4, vec![]), (5, vec![]), (6, vec![0, 3])]);
        assert_eq!(p.rows_by_block(1, &[]).unwrap(), vec![(7, vec![])]);
        let past = p.rows_by_block(0, &[10]).unwrap_err();
        assert_eq!(past.to_string(), "table \"emb\" has rows 0..10, not row 10");
        assert!(p.rows_by_block(2, &[0]).is_err());
    }

    #[test]
    fn a_split_row_block_is_retired_and_its_halves_cover_its_rows() {
        let mut p =
            Partition::with_tables(vec![tensor("w", 5, Init::Zeros)], vec![TableSpec::new("emb", 10, 2)], 16).unwrap();
        // Blocks 2..=6 hold rows 0..2, 2..4, ..., 8..10; split block 3 (rows 2..4) at row 3.
        assert_eq!(p.split_rows(3, 3).unwrap(), [7, 8]);
        assert!(p.blocks[3].is_retired() && !p.blocks[7].is_retired());
        assert_eq!((p.blocks[7].row_range(), p.blocks[8].row_range()), (Some((2, 3, 2)), Some((3, 4, 2))));
        let live: Vec<BlockId> = p.table_blocks(0).iter().map(|b| b.id).collect();
        assert_eq!(live, [2, 7, 8, 4, 5, 6]);
        assert_eq!(p.row_block(0, 3).unwrap().id, 8);
        assert_eq!(p.row_block(0, 9).unwrap().id, 6);
        let by = p.rows_by_block(0, &[3, 2, 9]).unwrap();
        assert_eq!(by, vec![(2, vec![]), (7, vec![1]), (8, vec![0]), (4, vec![]), (5, vec![]), (6, vec![2])]);
        assert_eq!(p.check_tables(), Ok(()));
        // A retired, dense or unknown block, or a cut at an end of the range: refused.
        assert!(p.split_rows(3, 3).is_err());
        assert!(p.split_rows(0, 1).is_err());
        assert!(p.split_rows(99, 1).is_err());
        assert!(p.split_rows(7, 2).is_err() && p.split_rows(7, 3).is_err());
        assert_eq!(p.blocks.len(), 9, "a refused split changes nothing");
        // A table whose blocks leave a gap breaks the invariant.
        p.blocks[8].len = 0;
        assert!(p.check_tables().unwrap_err().contains("expected from 3"));
    }

    #[test]
    fn refuses_duplicate_and_empty_tables() {
        let w = || vec![tensor("w", 5, Init::Zeros)];
        let dup = vec![TableSpec::new("e", 4, 2), TableSpec::new("e", 4, 2)];
        assert!(Partition::with_tables(w(), dup, 16).is_err());
        assert!(Partition::with_tables(w(), vec![TableSpec::new("w", 4, 2)], 16).is_err());
        assert!(Partition::with_tables(w(), vec![TableSpec::new("e", 0, 2)], 16).is_err());
        assert!(Partition::with_tables(w(), vec![TableSpec::new("e", 4, 0)], 16).is_err());
        let bad = TableSpec::new("e", 4, 2).with_optimizer(SparseOptimizer::Sgd { lr: f64::NAN });
        assert!(Partition::with_tables(w(), vec![bad], 16).is_err());
        // Tables alone make a model.
        assert!(Partition::with_tables(vec![], vec![TableSpec::new("e", 4, 2)], 16).is_ok());
    }

    #[test]
    fn a_table_of_ten_million_rows_is_a_list_of_ranges() {
        let p = Partition::with_tables(vec![], vec![TableSpec::new("big", 10_000_000, 64)], 4 << 20).unwrap();
        assert_eq!(p.blocks.len(), 611);
        assert_eq!(p.row_block(0, 9_999_999).unwrap().id, 610);
    }

    #[test]
    fn initial_values_do_not_depend_on_the_cut() {
        let t = vec![tensor("w", 5000, Init::Uniform { low: -1.0, high: 1.0 })];
        let whole = Partition::new(t.clone(), 1 << 20).unwrap();
        let cut = Partition::new(t, 4 * 700).unwrap();
        let a = whole.init_values(0, 7).unwrap();
        let b: Vec<f32> = cut.blocks.iter().flat_map(|b| cut.init_values(b.id, 7).unwrap()).collect();
        assert_eq!(a, b);
        assert!(a.iter().all(|v| (-1.0..1.0).contains(v)));
        assert_ne!(a, whole.init_values(0, 8).unwrap());
    }
}
