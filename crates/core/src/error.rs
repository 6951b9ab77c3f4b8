//! The one error type of the core.

use crate::model::BlockId;

/// Everything the core can refuse.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum CoreError {
    /// The model definition cannot be used.
    #[error("invalid model: {0}")]
    InvalidModel(String),
    /// A request named a block the model does not have.
    #[error("unknown block {0}")]
    UnknownBlock(BlockId),
    /// A request named a worker outside `0..num_workers`.
    #[error("unknown worker {0}")]
    UnknownWorker(u32),
    /// A push or pull whose payload does not fit the block.
    #[error("block {block} holds {expected} values, the request carries {got}")]
    WrongLength {
        /// The block.
        block: BlockId,
        /// Its length.
        expected: usize,
        /// What arrived.
        got: usize,
    },
    /// Initial values sent for a block that has already taken pushes.
    #[error("block {0} has already taken pushes: its initial values can no longer be set")]
    AlreadyTrained(BlockId),
    /// A push that skips a clock: pushes of one worker to one block come in clock order.
    #[error("worker {worker} pushed clock {got} to block {block}, expected clock {expected}")]
    ClockGap {
        /// The block.
        block: BlockId,
        /// The worker.
        worker: u32,
        /// The clock the server expects next from that worker.
        expected: u32,
        /// The clock that arrived.
        got: u32,
    },
    /// A configuration that names a server the job does not have.
    #[error("{what} names server {server}, but the job has servers 0..{servers}")]
    UnknownServer {
        /// The server named.
        server: u32,
        /// How many servers the job has.
        servers: u32,
        /// What named it (a flag or setting, e.g. "placement skewed").
        what: &'static str,
    },
    /// A configuration string (policy, optimizer, placement) that does not parse.
    #[error("invalid {what} {input:?}: {why}")]
    Parse {
        /// What was being parsed.
        what: &'static str,
        /// The input.
        input: String,
        /// Why it was refused, with the accepted forms.
        why: String,
    },
    /// A row block's state (from a migration, a replica or a checkpoint) that does not
    /// hold together.
    #[error("the row state of block {block} is malformed: {why}")]
    BadRowState {
        /// The block.
        block: BlockId,
        /// What does not fit.
        why: String,
    },
    /// An export asked for the rows changed since a step older than the evicted keys
    /// the block still remembers.
    #[error(
        "cannot export the changes since step {since}: keys evicted before step {forgotten} are forgotten; take a full \
         export (without --since)"
    )]
    ExportTooOld {
        /// The step asked.
        since: u64,
        /// The step of the newest evicted key forgotten.
        forgotten: u64,
    },
    /// A row id outside the row range of the block it was sent to.
    #[error("row {row} is not in block {block}, which holds rows {start}..{end}")]
    RowOutOfRange {
        /// The block.
        block: BlockId,
        /// The row asked for.
        row: u64,
        /// The block's first row.
        start: u64,
        /// One past its last row.
        end: u64,
    },
    /// A row push whose rows are not the table's width.
    #[error("block {block} holds rows of {expected} values, the push carries rows of {got}")]
    WrongDim {
        /// The block.
        block: BlockId,
        /// The table's dim.
        expected: u32,
        /// What arrived.
        got: u32,
    },
    /// A row id past the end of its table.
    #[error("table {table:?} has rows 0..{rows}, not row {row}")]
    NoSuchRow {
        /// The table's name.
        table: String,
        /// The row asked for.
        row: u64,
        /// The table's rows.
        rows: u64,
    },
    /// A row operation (PullRows, PushRows) on a block of a dense tensor.
    #[error("block {0} is a slice of a dense tensor: pull and push it whole (Pull, Push), not by rows")]
    NotRows(BlockId),
    /// A dense operation (Pull, Push, PushPull, Init) on a block of an embedding table.
    #[error("block {0} is a range of a table's rows: pull and push it by rows (PullRows, PushRows)")]
    NotDense(BlockId),
    /// A wire dtype name that is not f32, bf16 or fp16.
    #[error("unknown wire dtype {0:?}: use f32, bf16 or fp16")]
    BadDtype(String),
    /// A sparse gradient ([`Gradient::Sparse`](crate::block::Gradient::Sparse)) that does
    /// not fit its block: no index, indices not strictly ascending or past the block's
    /// end, or not one value per index.
    #[error("block {block} holds {len} values; its sparse gradient is refused: {why}")]
    BadSparse {
        /// The block.
        block: BlockId,
        /// Its length.
        len: usize,
        /// What does not fit.
        why: String,
    },
}
