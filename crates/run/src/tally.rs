//! What a worker measures of its own run, for the launcher's report
//! ([`WorkerReport`]): every iteration's duration, the time spent communicating, and the
//! time each server took. The Rust worker role, the Python client and the sim use it.
//!
//! Iteration k lasts from the end of iteration k - 1 (or from [`Tally::start`]) to
//! [`Tally::iteration_ends`], so the durations tile the training loop without gaps:
//! iteration k ends `sum(iter_ms[..=k])` after `started_unix_ms`, which lets a benchmark
//! line them up with the scheduler's clock (migrations, scaling events).

use std::time::{Duration, Instant};

use elasticps_core::stats::Histogram;
use elasticps_node::events::WorkerReport;

/// Per-iteration timings of one worker.
#[derive(Clone, Debug)]
pub struct Tally {
    iterations: Histogram,
    iter_total: Duration,
    comm: Duration,
    per_server: Vec<Duration>,
    /// Where the current iteration started.
    mark: Instant,
    /// Wall-clock time of the first iteration's start, ms since the Unix epoch.
    started_unix_ms: f64,
    /// Every iteration's duration, ms, in order.
    iter_ms: Vec<f32>,
}

impl Default for Tally {
    fn default() -> Self {
        Self {
            iterations: Histogram::default(),
            iter_total: Duration::ZERO,
            comm: Duration::ZERO,
            per_server: Vec::new(),
            mark: Instant::now(),
            started_unix_ms: unix_ms(),
            iter_ms: Vec::new(),
        }
    }
}

impl Tally {
    /// The first iteration starts now.
    pub fn start(&mut self) {
        self.mark = Instant::now();
        self.started_unix_ms = unix_ms();
    }

    /// The first iteration started at `unix_ms` (a clock of the caller's: the sim's
    /// virtual time); the iterations are then given by [`Tally::iteration`].
    pub fn started_at(&mut self, unix_ms: f64) {
        self.started_unix_ms = unix_ms;
    }

    /// The current iteration ended now (the next one starts).
    pub fn iteration_ends(&mut self) {
        let now = Instant::now();
        let iteration = now.saturating_duration_since(self.mark);
        self.mark = now;
        self.iteration(iteration);
    }

    /// One iteration that lasted `iteration` ended.
    pub fn iteration(&mut self, iteration: Duration) {
        self.iterations.record(iteration.as_micros() as u64);
        self.iter_total += iteration;
        // Microsecond resolution, written as a short decimal in report.json.
        self.iter_ms.push(iteration.as_micros() as f32 / 1e3);
    }

    /// A push or pull round took `spent`, waiting `waits[s]` on server `s`.
    pub fn communicated(&mut self, spent: Duration, waits: &[Duration]) {
        self.comm += spent;
        if self.per_server.len() < waits.len() {
            self.per_server.resize(waits.len(), Duration::ZERO);
        }
        for (total, w) in self.per_server.iter_mut().zip(waits) {
            *total += *w;
        }
    }

    /// Iterations ended so far.
    pub fn iterations(&self) -> u64 {
        self.iter_ms.len() as u64
    }

    /// The report of worker `rank`, which trained on `samples` examples in `train_s`
    /// seconds and ended at loss `final_loss`.
    pub fn report(&self, rank: u32, samples: u64, final_loss: f64, train_s: f64) -> WorkerReport {
        let iterations = self.iterations();
        let per_iter = |d: Duration| if iterations == 0 { 0.0 } else { d.as_secs_f64() * 1e3 / iterations as f64 };
        WorkerReport {
            rank,
            iterations,
            samples,
            wait_ms: self.comm.as_secs_f64() * 1e3,
            final_loss,
            train_s,
            iter_ms_mean: per_iter(self.iter_total),
            iter_ms_p99: self.iterations.quantile(0.99) as f64 / 1e3,
            comm_ms_per_iter: per_iter(self.comm),
            wait_ms_by_server: self.per_server.iter().map(|d| d.as_secs_f64() * 1e3).collect(),
            started_unix_ms: self.started_unix_ms,
            iter_ms: self.iter_ms.clone(),
        }
    }

    /// Seconds from [`Tally::start`] to the end of the last iteration.
    pub fn train_s(&self) -> f64 {
        self.iter_total.as_secs_f64()
    }
}

/// Milliseconds since the Unix epoch, now (0 if the clock is before 1970).
fn unix_ms() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iterations_tile_the_run_and_waits_add_up_per_server() {
        let mut t = Tally::default();
        t.start();
        t.communicated(Duration::from_millis(4), &[Duration::from_millis(1), Duration::from_millis(3)]);
        t.iteration_ends();
        t.communicated(Duration::from_millis(2), &[Duration::from_millis(2)]);
        t.iteration_ends();
        let r = t.report(3, 64, 0.5, t.train_s());
        assert_eq!((r.rank, r.iterations, r.samples), (3, 2, 64));
        assert_eq!(r.wait_ms_by_server, vec![3.0, 3.0]);
        assert_eq!(r.comm_ms_per_iter, 3.0);
        assert!((r.iter_ms.iter().map(|x| f64::from(*x)).sum::<f64>() / 1e3 - r.train_s).abs() < 1e-3);
    }
}
