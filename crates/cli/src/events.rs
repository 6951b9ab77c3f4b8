//! Machine-readable progress that roles print on stdout (one JSON object per line) when
//! started with `--events`; `elasticps train` reads them to draw progress bars and write
//! the report. Logs go to stderr, so the two never mix.

use std::io::Write;

use elasticps_runtime::scheduler::BalanceLog;
use elasticps_wire::ServerStats;

use crate::report::WorkerReport;
use serde::{Deserialize, Serialize};

/// One line of a role's event stream.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// The scheduler is listening.
    Listening {
        /// Its bound address.
        addr: String,
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
        loss: f32,
    },
    /// Worker 0 evaluated the model on the test set.
    Eval {
        /// Worker rank.
        rank: u32,
        /// Iterations done when the parameters were pulled.
        iteration: u32,
        /// Test accuracy in [0, 1].
        accuracy: f32,
        /// Test loss.
        loss: f32,
    },
    /// A worker finished.
    WorkerDone(WorkerReport),
    /// A server's final counters.
    ServerStats(ServerStats),
    /// The scheduler's balancing history (migrations, scaling, load timeline), at the end.
    Balance(BalanceLog),
    /// A node serves Prometheus metrics at `http://ADDR/metrics` (`--metrics-listen`).
    Metrics {
        /// `scheduler`, `server 1` (its id) or `worker 0` (its rank).
        node: String,
        /// The bound address.
        addr: String,
    },
}

/// Writes events to stdout when enabled.
#[derive(Clone, Copy, Debug)]
pub struct Emitter {
    enabled: bool,
}

impl Emitter {
    /// An emitter that prints only if `enabled`.
    pub fn new(enabled: bool) -> Self {
        Self { enabled }
    }

    /// Prints one event line (and flushes, so a reader sees it at once).
    pub fn emit(&self, event: &Event) {
        if !self.enabled {
            return;
        }
        if let Ok(line) = serde_json::to_string(event) {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{line}");
            let _ = out.flush();
        }
    }
}
