//! A server's counters: what its stats, metrics and load reports show.

use elasticps_core::block::BlockStats;
use elasticps_core::placement::ServerId;
use elasticps_core::rows::RowCounters;
use elasticps_core::stats::Histogram;
use elasticps_core::sync::SyncPolicy;

/// A server's counters at one instant: what its metric families show.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ServerSnapshot {
    /// The server's id, once assigned.
    pub server_id: Option<ServerId>,
    /// The configured sync policy (`bsp`, `ssp:3`, `adaptive:0:8`), once assigned.
    pub sync: Option<SyncPolicy>,
    /// The staleness bound in force: see [`staleness_bound`].
    pub staleness_bound: i64,
    /// Blocks owned now.
    pub blocks: u32,
    /// Bytes of values owned now.
    pub bytes: u64,
    /// Counters over every block this server served (including blocks that left).
    pub totals: BlockStats,
    /// How long held pulls were held: the buckets of the server's log2 histogram of
    /// microseconds ([`elasticps_core::stats::Histogram::buckets`]).
    pub hold: Vec<u64>,
    /// Blocks that arrived by migration.
    pub migrations_in: u64,
    /// Blocks handed over to another server.
    pub migrations_out: u64,
    /// Its row blocks' live rows and row counters.
    pub rows: RowTotals,
}

/// The staleness bound a policy enforces now, as `elasticps_server_staleness_bound`
/// shows it: `bsp` 0; `ssp:s`, `lazy:s`, `pssp:s:p`, `dpssp:s` s (the probabilistic
/// policies pause only beyond s); `adaptive` the s it currently uses (`current_s`);
/// `asp` -1 (no bound).
pub fn staleness_bound(policy: SyncPolicy, current_s: u32) -> i64 {
    match policy.resolve(current_s) {
        SyncPolicy::Bsp => 0,
        SyncPolicy::Asp => -1,
        SyncPolicy::Ssp(s) | SyncPolicy::Lazy(s) | SyncPolicy::Dpssp(s) | SyncPolicy::Pssp { s, .. } => s.into(),
        SyncPolicy::Adaptive { .. } => i64::from(current_s),
    }
}

/// Load since the last report, plus the counters that outlive blocks.
#[derive(Clone, Debug, Default)]
pub(super) struct Counters {
    /// Payload bytes received in pushes since the last report.
    pub bytes_in: u64,
    /// Payload bytes sent in pull replies since the last report.
    pub bytes_out: u64,
    /// Data requests handled since the last report.
    pub requests: u64,
    /// Time the runtime measured handling data requests since the last report.
    pub busy_us: u64,
    /// Time frames waited for the bandwidth cap since the last report.
    pub shaped_us: u64,
    /// Counters of blocks that left this server.
    pub departed: BlockStats,
    /// Hold times of blocks that left this server.
    pub departed_hold: Histogram,
    /// Blocks that arrived by migration.
    pub migrations_in: u64,
    /// Blocks handed over to another server.
    pub migrations_out: u64,
    /// The link's rate, from data frames that arrived back to back.
    pub capacity: super::capacity::Capacity,
    /// Each row block's counters at the last report (its traffic since is reported).
    pub rows_seen: std::collections::BTreeMap<elasticps_core::model::BlockId, (BlockStats, RowCounters)>,
    /// Row counters of row blocks that left this server (migrated away or split).
    pub departed_rows: RowCounters,
}

/// `into += from`, counter by counter.
pub(super) fn add_rows(into: &mut RowCounters, from: &RowCounters) {
    into.created += from.created;
    into.evicted += from.evicted;
    into.expired += from.expired;
    into.refused_grads += from.refused_grads;
    into.init_reads += from.init_reads;
}

/// What a server's row blocks hold and did, as its metrics show it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RowTotals {
    /// Rows that exist in the row blocks it owns now.
    pub live_rows: u64,
    /// What its row blocks did since they came here (counted on even after they left):
    /// rows created, evicted by the bound, expired, gradients refused, reads of absent rows.
    pub counters: RowCounters,
}

/// Counters summed over a server's blocks.
#[derive(Default)]
pub(super) struct Sum {
    pub blocks: u32,
    pub bytes: u64,
    pub totals: BlockStats,
    pub hold: Histogram,
    pub rows: RowTotals,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staleness_bounds_per_policy() {
        assert_eq!(staleness_bound(SyncPolicy::Bsp, 5), 0);
        assert_eq!(staleness_bound(SyncPolicy::Asp, 5), -1);
        assert_eq!(staleness_bound(SyncPolicy::Ssp(2), 5), 2);
        assert_eq!(staleness_bound(SyncPolicy::Adaptive { min: 0, max: 8 }, 5), 5);
        assert_eq!(staleness_bound(SyncPolicy::Adaptive { min: 0, max: 8 }, 20), 8, "clamped as the policy is");
    }
}
