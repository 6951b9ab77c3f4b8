//! What the scheduler records about balancing for the report: every migration, every
//! scaling event, and a per-interval timeline of server load and iteration time.

use serde::{Deserialize, Serialize};

/// The balancing history of one job (report.json's `balance`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct BalanceLog {
    /// `static` or `psld`.
    pub mode: String,
    /// When the scheduler started, in milliseconds since the Unix epoch: every `*_s` time
    /// of this log counts from there (to align with the workers' clocks).
    pub started_unix_ms: f64,
    /// Every migration, in the order they ended.
    pub migrations: Vec<MigrationEvent>,
    /// Every scaling event.
    pub scaling: Vec<ScaleEvent>,
    /// One sample per stats interval once training runs.
    pub timeline: Vec<LoadSample>,
    /// Every judged decision of the balancer: what it predicted, what was measured,
    /// kept or reverted (DESIGN.md §4, the verdict loop).
    #[serde(default)]
    pub decisions: Vec<DecisionRecord>,
    /// Seconds since the scheduler started at which the last migration or scaling
    /// decision ended (`None`: the placement never changed).
    pub settled_s: Option<f64>,
}

/// One block migration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MigrationEvent {
    /// When it ended, seconds since the scheduler started.
    pub at_s: f64,
    /// The block.
    pub block: u32,
    /// Old owner.
    pub from: u32,
    /// New owner.
    pub to: u32,
    /// Bytes sent (snapshot and delta).
    pub bytes: u64,
    /// How long the block was frozen, in milliseconds.
    pub freeze_ms: f64,
    /// From the request to the handover, in milliseconds.
    pub total_ms: f64,
    /// Pulls held by the sync policy at the freeze, re-issued at the new owner.
    pub held: u32,
    /// Why it failed (`None`: it succeeded).
    pub error: Option<String>,
}

/// The verdict on one decision of the balancer. Read leniently: a field a record lacks
/// reads as its default.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DecisionRecord {
    /// When it was decided, seconds since the scheduler started.
    pub at_s: f64,
    /// When it was judged.
    pub judged_s: f64,
    /// What was decided and why.
    pub what: String,
    /// Blocks it moved.
    pub moves: usize,
    /// The share of the iteration time it was predicted to save.
    pub predicted_gain: f64,
    /// The share measured (negative: it cost).
    pub measured_gain: f64,
    /// Mean iteration time before it, ms (`None`: judged by the load model).
    pub before_ms: Option<f64>,
    /// Mean iteration time after it, ms.
    pub after_ms: Option<f64>,
    /// `kept` or `reverted`.
    pub verdict: String,
}

impl DecisionRecord {
    /// The record of a balancer's verdict (its times in µs since the scheduler started).
    pub fn of(v: &elasticps_core::balance::Verdict) -> Self {
        Self {
            at_s: v.decided_us as f64 / 1e6,
            judged_s: v.judged_us as f64 / 1e6,
            what: v.what.clone(),
            moves: v.moves,
            predicted_gain: v.predicted_gain,
            measured_gain: v.measured_gain,
            before_ms: v.before_ms,
            after_ms: v.after_ms,
            verdict: if v.kept { "kept" } else { "reverted" }.into(),
        }
    }

    /// True if the decision was kept.
    pub fn kept(&self) -> bool {
        self.verdict == "kept"
    }
}

/// One scaling event.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScaleEvent {
    /// When, seconds since the scheduler started.
    pub at_s: f64,
    /// `scale-out` (a server was requested), `joined` (it registered), `scale-in` (a
    /// server is being drained), `removed` (it was stopped), `kept` / `reverted` (the
    /// verdict on a scale-out).
    pub action: String,
    /// The server concerned, once it has an id.
    pub server: Option<u32>,
    /// Why, in words.
    pub reason: String,
}

/// The cluster at one instant.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LoadSample {
    /// Seconds since the scheduler started.
    pub t_s: f64,
    /// Mean iteration time of the workers over the last interval, in milliseconds.
    pub iter_ms: Option<f64>,
    /// Every server that owns blocks or is joining.
    pub servers: Vec<ServerPoint>,
}

/// One server in a [`LoadSample`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ServerPoint {
    /// Server id.
    pub id: u32,
    /// Blocks owned.
    pub blocks: u32,
    /// Bytes owned.
    pub bytes: u64,
    /// Estimated service rate, bytes/s (0: unknown).
    pub rate_bps: f64,
    /// Confidence of that estimate, 0..=1.
    #[serde(default)]
    pub confidence: f64,
    /// Payload received and sent per second, as the server reported its last interval (MB/s).
    #[serde(default)]
    pub in_mbps: f64,
    /// See `in_mbps`.
    #[serde(default)]
    pub out_mbps: f64,
    /// Time its frames waited for a bandwidth cap, per second of its last interval
    /// (queueing delay; 0 without a cap).
    #[serde(default)]
    pub queued_ms_per_s: f64,
    /// Estimated service time per iteration, in milliseconds (0: no rate known yet).
    pub service_ms: f64,
    /// Flagged as a straggler.
    pub straggler: bool,
    /// Its row blocks, as it reported them (`None`: it reported none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows: Option<ServerRows>,
}

/// A server's row blocks in a [`ServerPoint`]: what they hold, from its last load report,
/// and what they did, summed over its load reports since the job started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerRows {
    /// Rows that exist in its row blocks.
    pub live_rows: u64,
    /// Bytes they hold (values and optimizer state).
    pub live_bytes: u64,
    /// Rows evicted by a memory bound.
    pub evicted: u64,
    /// Rows evicted by an expiry (TTL).
    pub expired: u64,
    /// Gradients of keys not admitted yet, dropped.
    pub refused_grads: u64,
    /// Reads of rows that did not exist (answered with initial values).
    pub init_reads: u64,
}

impl ServerRows {
    /// This server's rows after the load report of row blocks `blocks`: what they hold
    /// now, and their counters added to the sums.
    pub fn reported(self, blocks: &[elasticps_wire::RowBlockLoad]) -> Self {
        let sum = |f: fn(&elasticps_wire::RowBlockLoad) -> u64| blocks.iter().map(f).sum::<u64>();
        Self {
            live_rows: sum(|b| b.live_rows),
            live_bytes: sum(|b| b.live_bytes()),
            evicted: self.evicted + sum(|b| b.evicted),
            expired: self.expired + sum(|b| b.expired),
            refused_grads: self.refused_grads + sum(|b| b.refused_grads),
            init_reads: self.init_reads + sum(|b| b.init_reads),
        }
    }
}
