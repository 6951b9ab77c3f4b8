//! The lines of a node's event stream ([`Event`]) and a worker's statistics over the run
//! ([`WorkerReport`]): the types a launcher, a report and the Python package read and
//! write, below every I/O crate. Where the lines are written is the runtime's
//! (`elasticps_runtime::events::Emitter`), and what they say is documented there.
//!
//! Non-finite numbers (a diverged loss) are written as `null` by `serde_json`; they read
//! back as `NaN`, so such a line is never dropped.

use std::collections::BTreeMap;

use elasticps_wire::ServerStats;
use serde::{Deserialize, Deserializer, Serialize};

use crate::scheduler::BalanceLog;

/// One line of a node's event stream.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// The scheduler is listening.
    Listening {
        /// Its bound address.
        addr: String,
    },
    /// The scheduler of a job across hosts still waits for the job to assemble (every
    /// 5 s): hosts, servers and workers, counted and named.
    Waiting {
        /// What it waits for.
        what: String,
    },
    /// A node serves Prometheus metrics at `http://ADDR/metrics` (`--metrics-listen`).
    Metrics {
        /// `scheduler`, `server 1` (its id) or `worker 0` (its rank).
        node: String,
        /// The bound address.
        addr: String,
    },
    /// A worker joined the job as `rank`: the launcher that started its process learns
    /// the rank to restart it with, before the worker logs anything.
    Joined {
        /// Worker rank.
        rank: u32,
    },
    /// A worker's progress.
    Progress {
        /// Worker rank.
        rank: u32,
        /// Iterations done.
        iteration: u32,
        /// Planned iterations.
        total: u32,
        /// Training loss of the last batch.
        #[serde(deserialize_with = "f32_or_nan")]
        loss: f32,
    },
    /// Worker 0 evaluated the model on the test set.
    Eval {
        /// Worker rank.
        rank: u32,
        /// Iterations done when the parameters were pulled.
        iteration: u32,
        /// Test accuracy in [0, 1].
        #[serde(deserialize_with = "f32_or_nan")]
        accuracy: f32,
        /// Test loss.
        #[serde(deserialize_with = "f32_or_nan")]
        loss: f32,
    },
    /// Metrics a training script logged (Python's `elasticps.log(**metrics)`). The
    /// launcher reads `total` as the progress bar's length, `loss` as its message and a
    /// curve point, `accuracy` (or `test_accuracy`) and `test_loss` as a test evaluation;
    /// every other key is kept in the report's curve.
    Log {
        /// Worker rank.
        rank: u32,
        /// The script's step (the progress bar's position).
        step: u64,
        /// Named values.
        #[serde(deserialize_with = "metrics_or_nan")]
        metrics: BTreeMap<String, f64>,
    },
    /// A worker finished.
    WorkerDone(WorkerReport),
    /// A server's final counters.
    ServerStats(ServerStats),
    /// The scheduler's balancing history (migrations, scaling, load timeline), at the end.
    Balance(BalanceLog),
}

/// Statistics of one worker over the run (report.json's `workers`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct WorkerReport {
    /// Worker rank.
    pub rank: u32,
    /// Training iterations the worker completed.
    pub iterations: u64,
    /// Examples processed.
    #[serde(default)]
    pub samples: u64,
    /// Total time spent waiting on parameter servers (push and pull), in milliseconds.
    #[serde(deserialize_with = "f64_or_nan")]
    pub wait_ms: f64,
    /// Training loss at the worker's last iteration.
    #[serde(deserialize_with = "f64_or_nan")]
    pub final_loss: f64,
    /// Seconds from the first pull to the last push.
    #[serde(default, deserialize_with = "f64_or_nan")]
    pub train_s: f64,
    /// Mean iteration time (compute + communication), ms.
    #[serde(default, deserialize_with = "f64_or_nan")]
    pub iter_ms_mean: f64,
    /// 99th percentile of the iteration time (upper bound of its log2 bucket), ms.
    #[serde(default, deserialize_with = "f64_or_nan")]
    pub iter_ms_p99: f64,
    /// Mean communication time per iteration (the overlapped push + pull), ms.
    #[serde(default, deserialize_with = "f64_or_nan")]
    pub comm_ms_per_iter: f64,
    /// Total time each server took to answer this worker's rounds, ms, by server id.
    #[serde(default)]
    pub wait_ms_by_server: Vec<f64>,
    /// When the worker's first iteration started, ms since the Unix epoch (the clock of
    /// [`BalanceLog::started_unix_ms`], so iterations line up with migrations).
    #[serde(default, deserialize_with = "f64_or_nan")]
    pub started_unix_ms: f64,
    /// Every iteration's duration, ms (microsecond resolution), in order. The iterations
    /// tile the training loop: iteration k ends `sum(iter_ms[..=k])` after
    /// `started_unix_ms`.
    #[serde(default)]
    pub iter_ms: Vec<f32>,
}

impl WorkerReport {
    /// When each iteration ended, ms since the Unix epoch.
    pub fn iteration_ends_unix_ms(&self) -> Vec<f64> {
        let mut at = self.started_unix_ms;
        self.iter_ms
            .iter()
            .map(|ms| {
                at += f64::from(*ms);
                at
            })
            .collect()
    }
}

/// Deserializes an `f64` that `serde_json` may have written as `null` (it does so for
/// `NaN` and infinities); `null` becomes `NaN`.
pub fn f64_or_nan<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// [`f64_or_nan`] for `f32`.
fn f32_or_nan<'de, D: Deserializer<'de>>(d: D) -> Result<f32, D::Error> {
    Ok(Option::<f32>::deserialize(d)?.unwrap_or(f32::NAN))
}

/// A map of numbers whose `null`s (non-finite values) read back as `NaN`.
fn metrics_or_nan<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<String, f64>, D::Error> {
    let raw = BTreeMap::<String, Option<f64>>::deserialize(d)?;
    Ok(raw.into_iter().map(|(k, v)| (k, v.unwrap_or(f64::NAN))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_lines_round_trip_with_non_finite_values() {
        let mut metrics = BTreeMap::new();
        metrics.insert("loss".to_string(), f64::NAN);
        metrics.insert("accuracy".to_string(), 0.97);
        let line = serde_json::to_string(&Event::Log { rank: 1, step: 7, metrics }).unwrap();
        assert_eq!(line, r#"{"event":"log","rank":1,"step":7,"metrics":{"accuracy":0.97,"loss":null}}"#);
        let Event::Log { rank, step, metrics } = serde_json::from_str(&line).unwrap() else { panic!("{line}") };
        assert_eq!((rank, step, metrics["accuracy"]), (1, 7, 0.97));
        assert!(metrics["loss"].is_nan());
        // A diverged progress line still parses too.
        let p: Event = serde_json::from_str(r#"{"event":"progress","rank":0,"iteration":1,"total":2,"loss":null}"#)
            .expect("a progress line with a null loss");
        assert!(matches!(p, Event::Progress { loss, .. } if loss.is_nan()));
    }

    #[test]
    fn worker_done_reads_an_older_line() {
        let line = r#"{"event":"worker_done","rank":2,"iterations":5,"wait_ms":1.5,"final_loss":null}"#;
        let Event::WorkerDone(w) = serde_json::from_str(line).unwrap() else { panic!("{line}") };
        assert_eq!((w.rank, w.iterations, w.wait_ms), (2, 5, 1.5));
        assert!(w.final_loss.is_nan() && w.iter_ms.is_empty());
    }
}
