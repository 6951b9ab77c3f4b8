//! The per-block state machine a server runs.

use serde::{Deserialize, Serialize};

use crate::optimizer::OptimizerConfig;
use crate::sync::SyncPolicy;

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
}
