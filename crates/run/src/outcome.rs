//! What a run produced: the workers' and servers' final numbers, the curve, the balancing
//! history, the restarts, in one [`RunOutcome`] that a real run (`elasticps-launch`'s
//! runner) and a simulated one (`elasticps-sim`) fill alike.

use std::collections::BTreeMap;
use std::time::Duration;

use elasticps_report::{BalanceLog, CurvePoint, WorkerReport};

/// Everything a run produced, real (the launcher's nodes) or simulated (the sim's harness).
#[derive(Debug, Default)]
pub struct RunOutcome {
    /// Wall time from the first spawn to the last exit.
    pub wall: Duration,
    /// Final numbers of each rank.
    pub workers: BTreeMap<u32, WorkerReport>,
    /// Final counters of each server.
    pub servers: BTreeMap<u32, elasticps_wire::ServerStats>,
    /// Loss and accuracy points over time.
    pub curve: Vec<CurvePoint>,
    /// The last evaluation of the lowest rank that evaluated: (accuracy, loss; NaN if
    /// not logged).
    pub final_eval: Option<(f32, f32)>,
    /// The scheduler's balancing history.
    pub balance: Option<BalanceLog>,
    /// Workers the launcher restarted (`--restart-workers`).
    pub restarts: Vec<Restart>,
    /// Servers that died while the job went on (`--replicas`), and whether a new one was
    /// started for each (`--restart-servers`).
    pub server_exits: Vec<ServerExit>,
}

/// A server that died in a job with replicas (its blocks failed over to their backups).
#[derive(Clone, Debug)]
pub struct ServerExit {
    /// Its spawn index (`server I`).
    pub index: u32,
    /// When it exited, seconds since the launch.
    pub t_s: f64,
    /// How it exited.
    pub status: String,
    /// A new server was started in its place.
    pub replaced: bool,
}

/// A worker that died and was restarted with its rank.
#[derive(Clone, Debug)]
pub struct Restart {
    /// Its rank.
    pub rank: u32,
    /// When it died, seconds since the launch.
    pub t_s: f64,
    /// How it exited.
    pub status: String,
}
