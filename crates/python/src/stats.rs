//! What a Python worker measures of its own run, for the launcher's report
//! (`WorkerDone`): iterations, their durations, time spent communicating.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use elasticps_core::sync::Clock;

/// A worker's numbers so far.
#[derive(Clone, Debug, Default)]
pub struct RunStats {
    /// The worker's rank (set at the end).
    pub rank: u32,
    /// When the first push of each new clock started, and that clock.
    last: Option<(Instant, Clock)>,
    /// Unix time of the first push, ms.
    pub started_unix_ms: f64,
    /// Every iteration's duration (first push of a clock to the first push of the next).
    pub iter_ms: Vec<f32>,
    /// Time spent in push and pull rounds.
    pub comm: Duration,
    /// Time each server took to answer rounds, by server id.
    pub wait_by_server: Vec<Duration>,
}

impl RunStats {
    /// A round pushing `clock` starts at `now`.
    pub fn clock_starts(&mut self, clock: Clock, now: Instant) {
        match self.last {
            Some((_, c)) if c == clock => {}
            Some((t, _)) => {
                self.iter_ms.push(now.duration_since(t).as_secs_f32() * 1e3);
                self.last = Some((now, clock));
            }
            None => {
                self.started_unix_ms =
                    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64() * 1e3);
                self.last = Some((now, clock));
            }
        }
    }

    /// A round took `spent`, waiting `per_server[s]` on server `s`.
    pub fn communicated(&mut self, spent: Duration, per_server: &[Duration]) {
        self.comm += spent;
        if self.wait_by_server.len() < per_server.len() {
            self.wait_by_server.resize(per_server.len(), Duration::ZERO);
        }
        for (total, w) in self.wait_by_server.iter_mut().zip(per_server) {
            *total += *w;
        }
    }

    /// Clocks pushed (the last one counts once it started).
    pub fn iterations(&self) -> u64 {
        self.iter_ms.len() as u64 + u64::from(self.last.is_some())
    }
}
