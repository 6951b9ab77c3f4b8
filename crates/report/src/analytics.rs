//! The numbers a benchmark draws from a run's [`Report`]:
//!
//! - [`RunNumbers`]: throughput (every worker's iterations / the longest training time, and
//!   the sum of each worker's own rate), the sync counters of the servers (held pulls, hold
//!   times, releases, the largest lead), test accuracy over time ([`EvalPoint`]);
//! - [`BalanceNumbers`]: the run lined up with the scheduler's [`BalanceLog`]: the settle
//!   time ([`settle_unix_ms`]), the window measured after it and its rate
//!   ([`window_rate`]), migrations, and the spikes around migrations and scale-outs;
//! - [`mean_rate`], [`second_half_rate`], [`mean_iter_ms`]: rates that the simulator's and
//!   the real processes' reports share.

use elasticps_core::stats::median;
use serde::Serialize;

use crate::summary::max;
use crate::{BalanceLog, Report, WorkerReport};

/// Migrations smaller than this are the balancer's probes (a server's smallest block moved
/// to re-measure an uncertain server): they do not delay the settle.
pub const PROBE_BYTES: u64 = 64 * 1024;

/// One test evaluation of worker 0.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct EvalPoint {
    /// Seconds since the launch of the run.
    pub t_s: f64,
    /// Iteration of worker 0.
    pub iteration: u64,
    /// Test accuracy in [0, 1].
    pub accuracy: f64,
}

/// Throughput, sync counters and accuracy of one completed run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RunNumbers {
    /// Iterations per worker.
    pub iterations: u64,
    /// From the first spawn to the last exit, s.
    pub wall_s: f64,
    /// The longest worker's training time, s.
    pub train_s: f64,
    /// Every worker's iterations / the longest training time.
    pub iters_per_s: f64,
    /// Sum over workers of iterations / own training time.
    pub worker_rate: f64,
    /// Mean over workers of the mean iteration time, ms.
    pub iter_ms_mean: f64,
    /// Mean iteration time of the delayed ranks, ms.
    pub straggler_iter_ms: f64,
    /// Mean iteration time of the other ranks, ms.
    pub other_iter_ms: f64,
    /// Pulls answered by every server (per block).
    pub pulls: u64,
    /// Pulls the sync policy held (per block), summed over servers.
    pub pulls_held: u64,
    /// Mean hold of a held pull, ms.
    pub hold_ms_mean: f64,
    /// Largest per-server p99 hold, ms.
    pub hold_p99_ms: f64,
    /// Sync events (releases of held pulls), summed over servers.
    pub releases: u64,
    /// Largest lead between the fastest and the slowest worker, clocks.
    pub max_lead: u64,
    /// Final test accuracy (a model with a test set).
    pub accuracy: Option<f64>,
    /// Mean of the last three evaluations: less noisy than the last one alone.
    pub accuracy_last3: Option<f64>,
    /// Accuracy at a wall-clock budget, filled in once the budget is known ([`Self::accuracy_at`]).
    pub accuracy_at_budget: Option<f64>,
    /// Worker 0's evaluations.
    pub evals: Vec<EvalPoint>,
}

impl RunNumbers {
    /// The numbers of `report`; `delayed` are the ranks a persistent straggler delays.
    pub fn of(report: &Report, delayed: &[u32]) -> Self {
        let w = &report.workers;
        let iterations: u64 = w.iter().map(|w| w.iterations).sum();
        let train_s = w.iter().map(|w| w.train_s).fold(0.0, f64::max);
        let is_delayed = |r: &WorkerReport| delayed.contains(&r.rank);
        let s = &report.servers;
        let held: u64 = s.iter().map(|s| s.pulls_held).sum();
        let hold_ms: f64 = s.iter().map(|s| s.hold_ms).sum();
        let evals: Vec<EvalPoint> = report
            .curve
            .iter()
            .filter_map(|p| Some(EvalPoint { t_s: p.t_s, iteration: p.iteration, accuracy: p.test_accuracy? }))
            .collect();
        RunNumbers {
            iterations: report.iterations,
            wall_s: report.wall_s,
            train_s,
            iters_per_s: if train_s > 0.0 { iterations as f64 / train_s } else { 0.0 },
            worker_rate: w.iter().filter(|w| w.train_s > 0.0).map(|w| w.iterations as f64 / w.train_s).sum(),
            iter_ms_mean: mean(w.iter().map(|w| w.iter_ms_mean)),
            straggler_iter_ms: mean(w.iter().filter(|w| is_delayed(w)).map(|w| w.iter_ms_mean)),
            other_iter_ms: mean(w.iter().filter(|w| !is_delayed(w)).map(|w| w.iter_ms_mean)),
            pulls: s.iter().map(|s| s.pulls).sum(),
            pulls_held: held,
            hold_ms_mean: if held > 0 { hold_ms / held as f64 } else { 0.0 },
            hold_p99_ms: s.iter().map(|s| s.hold_p99_ms).fold(0.0, f64::max),
            releases: s.iter().map(|s| s.releases).sum(),
            max_lead: s.iter().map(|s| s.max_lead).max().unwrap_or(0),
            accuracy: report.test_accuracy.is_finite().then_some(report.test_accuracy),
            accuracy_at_budget: None,
            accuracy_last3: last_mean(&evals, 3),
            evals,
        }
    }

    /// The last accuracy measured at or before `budget_s`.
    pub fn accuracy_at(&self, budget_s: f64) -> Option<f64> {
        self.evals.iter().filter(|e| e.t_s <= budget_s).max_by(|a, b| a.t_s.total_cmp(&b.t_s)).map(|e| e.accuracy)
    }
}

/// The mean of `values`, NaN when there is none.
fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let (n, s) = values.fold((0usize, 0.0), |(n, s), v| (n + 1, s + v));
    if n == 0 { f64::NAN } else { s / n as f64 }
}

/// The mean accuracy of the last `n` evaluations.
pub fn last_mean(evals: &[EvalPoint], n: usize) -> Option<f64> {
    let tail = &evals[evals.len().saturating_sub(n)..];
    (!tail.is_empty()).then(|| tail.iter().map(|e| e.accuracy).sum::<f64>() / tail.len() as f64)
}

/// The sum over workers of 1 / mean iteration time, iterations/s: the same for a real
/// and a simulated run (a real worker's `train_s` starts at its first pull, a simulated
/// worker's after it, so iterations / train_s would not be).
pub fn mean_rate(report: &Report) -> f64 {
    report.workers.iter().filter(|w| w.iter_ms_mean > 0.0).map(|w| 1e3 / w.iter_ms_mean).sum()
}

/// As [`mean_rate`], over each worker's second half of iterations (once a balancer has
/// settled), without the last one (it pushes without pulling).
pub fn second_half_rate(report: &Report) -> f64 {
    report
        .workers
        .iter()
        .filter_map(|w| {
            let it = &w.iter_ms[..w.iter_ms.len().saturating_sub(1)];
            let half = &it[it.len() / 2..];
            let ms: f64 = half.iter().map(|v| f64::from(*v)).sum();
            (ms > 0.0).then(|| half.len() as f64 * 1e3 / ms)
        })
        .sum()
}

/// Iterations/s of all workers in each of `windows` equal spans of the run (from the
/// earliest worker's start to the last iteration's end), by the iterations that end in
/// the span; each worker's last iteration stays out (it pushes without pulling). How fast
/// a job ran over time: a balancer's time to converge is the slow spans at the start.
pub fn rate_by_window(report: &Report, windows: usize) -> Vec<f64> {
    let ends: Vec<Vec<f64>> = report
        .workers
        .iter()
        .map(|w| {
            let e = w.iteration_ends_unix_ms();
            e[..e.len().saturating_sub(1)].to_vec()
        })
        .collect();
    let start = report.workers.iter().map(|w| w.started_unix_ms).fold(f64::INFINITY, f64::min);
    let end = ends.iter().flatten().copied().fold(f64::NEG_INFINITY, f64::max);
    if windows == 0 || end.partial_cmp(&start) != Some(std::cmp::Ordering::Greater) {
        return Vec::new();
    }
    let span = (end - start) / windows as f64;
    let mut counts = vec![0u64; windows];
    for e in ends.iter().flatten() {
        let k = (((e - start) / span) as usize).min(windows - 1);
        counts[k] += 1;
    }
    counts.iter().map(|&c| c as f64 / (span / 1e3)).collect()
}

/// The mean over workers of their mean iteration time, ms (NaN without workers).
pub fn mean_iter_ms(report: &Report) -> f64 {
    mean(report.workers.iter().map(|w| w.iter_ms_mean))
}

/// How a run's window is chosen ([`BalanceNumbers::of`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Window {
    /// A reference run without a straggler: from the warm-up on.
    Reference,
    /// The straggler under static placement: from the straggler's start.
    Static,
    /// The straggler under the balancer: from the settle (at least the straggler's start).
    Balanced,
}

/// The worst iteration around one event.
#[derive(Clone, Debug, Serialize)]
pub struct Spike {
    /// `migration` or `scale-out`.
    pub kind: &'static str,
    /// End of the event's window, seconds since the start of training.
    pub at_s: f64,
    /// The block moved (migrations).
    pub block: Option<u32>,
    /// The worker whose iteration it was.
    pub rank: u32,
    /// That iteration, ms.
    pub iter_ms: f64,
    /// The worker's median iteration time over the run, ms.
    pub median_ms: f64,
    /// `iter_ms / median_ms`.
    pub ratio: f64,
}

/// A scaling event, on the workers' clock.
#[derive(Clone, Debug, Serialize)]
pub struct Scaling {
    /// Seconds since the start of training.
    pub at_s: f64,
    /// What happened.
    pub action: String,
    /// The server.
    pub server: Option<u32>,
    /// Why.
    pub reason: String,
}

/// A run lined up with its balance log: the window after the settle, its rate,
/// migrations, spikes. Times are seconds since the start of training (the first worker's
/// first iteration).
#[derive(Clone, Debug, Serialize)]
pub struct BalanceNumbers {
    /// When the measured window starts.
    pub window_from_s: f64,
    /// Iterations (all workers) counted in the window.
    pub window_iterations: u64,
    /// it/s over the window ([`window_rate`]); NaN when too few iterations are left.
    pub iters_per_s: f64,
    /// When the straggler started (0 for a reference run).
    pub straggler_from_s: f64,
    /// Balanced: the end of the last non-probe migration or scaling event (`None`: nothing
    /// moved).
    pub settled_at_s: Option<f64>,
    /// The balance log's own `settled_s` (every migration counts).
    pub log_settled_at_s: Option<f64>,
    /// Settling time: from the straggler's start to the settle, s (0 for static runs).
    pub settling_s: Option<f64>,
    /// Successful migrations.
    pub migrations: usize,
    /// Failed migrations.
    pub failed_migrations: usize,
    /// Bytes moved by successful migrations.
    pub bytes_moved: u64,
    /// Block frozen, ms: p50 and max.
    pub freeze_ms: (f64, f64),
    /// Request to handover, ms: p50 and max.
    pub migration_ms: (f64, f64),
    /// Mean over workers of the median iteration time, ms.
    pub median_iter_ms: f64,
    /// The largest migration spike (by `ratio`).
    pub migration_spike: Option<Spike>,
    /// The largest scale-out spike.
    pub scale_out_spike: Option<Spike>,
    /// Scaling events.
    pub scaling: Vec<Scaling>,
    /// Servers at the end: (id, bytes owned) from the last load sample.
    pub final_bytes: Vec<(u32, u64)>,
    /// For a plot: worker 0's (end of iteration s, iteration ms).
    #[serde(skip)]
    pub series: Vec<(f64, f64)>,
    /// For a plot: migrations as (end s, source server).
    #[serde(skip)]
    pub migration_marks: Vec<(f64, u32)>,
}

impl BalanceNumbers {
    /// The numbers of a run that has none (it failed): NaN rates, no events.
    pub const NONE: BalanceNumbers = BalanceNumbers {
        window_from_s: f64::NAN,
        window_iterations: 0,
        iters_per_s: f64::NAN,
        straggler_from_s: f64::NAN,
        settled_at_s: None,
        log_settled_at_s: None,
        settling_s: None,
        migrations: 0,
        failed_migrations: 0,
        bytes_moved: 0,
        freeze_ms: (f64::NAN, f64::NAN),
        migration_ms: (f64::NAN, f64::NAN),
        median_iter_ms: f64::NAN,
        migration_spike: None,
        scale_out_spike: None,
        scaling: Vec::new(),
        final_bytes: Vec::new(),
        series: Vec::new(),
        migration_marks: Vec::new(),
    };

    /// The numbers of `report`, its window chosen by `window`, the straggler starting
    /// `straggler_at` seconds after the first worker's first iteration.
    pub fn of(report: &Report, window: Window, straggler_at: f64) -> Self {
        let iters: Vec<Iterations> = report.workers.iter().map(Iterations::of).collect();
        // Time zero: the first worker's first iteration.
        let t0 = report.workers.iter().map(|w| w.started_unix_ms).fold(f64::INFINITY, f64::min);
        let rel = |unix_ms: f64| (unix_ms - t0) / 1e3;
        let straggler_from = t0 + straggler_at * 1e3;
        // Every worker's warm-up iteration stays out.
        let warm = iters.iter().filter_map(|w| w.ends.first().copied()).fold(t0, f64::max);
        let log = report.balance.as_ref();
        let settle = log.and_then(settle_unix_ms);
        let from = match window {
            Window::Balanced => settle.unwrap_or(straggler_from).max(straggler_from),
            _ => straggler_from,
        }
        .max(warm);
        let (iters_per_s, window_iterations) = window_rate(&iters, from);
        let mut result = BalanceNumbers {
            window_from_s: rel(from),
            window_iterations,
            iters_per_s,
            straggler_from_s: if window == Window::Reference { 0.0 } else { straggler_at },
            median_iter_ms: mean(iters.iter().map(|w| w.median_ms)),
            series: iters
                .iter()
                .find(|w| w.rank == 0)
                .map(|w| w.ends.iter().zip(&w.ms).map(|(e, ms)| (rel(*e), *ms)).collect())
                .unwrap_or_default(),
            ..Self::NONE
        };
        match window {
            Window::Balanced => {
                result.settled_at_s = settle.map(rel);
                result.settling_s = settle.map(|s| (s - straggler_from).max(0.0) / 1e3);
            }
            Window::Static => result.settling_s = Some(0.0),
            Window::Reference => {}
        }
        let Some(log) = log else { return result };
        let to_unix = |at_s: f64| log.started_unix_ms + at_s * 1e3;
        result.log_settled_at_s = log.settled_s.map(|s| rel(to_unix(s)));
        let ok: Vec<_> = log.migrations.iter().filter(|m| m.error.is_none()).collect();
        result.migrations = ok.len();
        result.failed_migrations = log.migrations.len() - ok.len();
        result.bytes_moved = ok.iter().map(|m| m.bytes).sum();
        let freeze: Vec<f64> = ok.iter().map(|m| m.freeze_ms).collect();
        let total: Vec<f64> = ok.iter().map(|m| m.total_ms).collect();
        result.freeze_ms = (median(&freeze).unwrap_or(f64::NAN), max(&freeze));
        result.migration_ms = (median(&total).unwrap_or(f64::NAN), max(&total));
        result.migration_marks = ok.iter().map(|m| (rel(to_unix(m.at_s)), m.from)).collect();
        result.final_bytes =
            log.timeline.last().map(|s| s.servers.iter().map(|p| (p.id, p.bytes)).collect()).unwrap_or_default();
        result.scaling = log
            .scaling
            .iter()
            .map(|e| Scaling {
                at_s: rel(to_unix(e.at_s)),
                action: e.action.clone(),
                server: e.server,
                reason: e.reason.clone(),
            })
            .collect();

        // Spikes: the worst iteration of any worker around each event.
        let worst = |kind: &'static str, block: Option<u32>, from: f64, to: f64| -> Option<Spike> {
            iters
                .iter()
                .filter_map(|w| {
                    let ms = w.worst_in(from, to)?;
                    Some(Spike {
                        kind,
                        at_s: rel(to),
                        block,
                        rank: w.rank,
                        iter_ms: ms,
                        median_ms: w.median_ms,
                        ratio: ms / w.median_ms,
                    })
                })
                .max_by(|a, b| a.ratio.total_cmp(&b.ratio))
        };
        let spikes: Vec<Spike> = ok
            .iter()
            .filter_map(|m| worst("migration", Some(m.block), to_unix(m.at_s - m.total_ms / 1e3), to_unix(m.at_s)))
            .collect();
        result.migration_spike = spikes.iter().max_by(|a, b| a.ratio.total_cmp(&b.ratio)).cloned();
        // A scale-out lasts from the request to the new server's registration (or 2 s).
        let scale_outs =
            log.scaling.iter().enumerate().filter(|(_, e)| e.action == "scale-out").filter_map(|(i, e)| {
                let joined =
                    log.scaling[i + 1..].iter().find(|j| j.action == "joined").map_or(e.at_s + 2.0, |j| j.at_s);
                worst("scale-out", None, to_unix(e.at_s), to_unix(joined.max(e.at_s)))
            });
        result.scale_out_spike = scale_outs.max_by(|a, b| a.ratio.total_cmp(&b.ratio));
        result
    }
}

/// One worker's iterations on the wall clock.
pub struct Iterations {
    /// The worker's rank.
    pub rank: u32,
    /// Where iteration k starts (ms since the epoch): the end of k - 1.
    pub starts: Vec<f64>,
    /// Where it ends.
    pub ends: Vec<f64>,
    /// Its duration, ms.
    pub ms: Vec<f64>,
    /// The median duration, ms.
    pub median_ms: f64,
}

impl Iterations {
    /// The iterations of worker `w`.
    pub fn of(w: &WorkerReport) -> Self {
        let ends = w.iteration_ends_unix_ms();
        let starts = std::iter::once(w.started_unix_ms).chain(ends.iter().copied()).take(ends.len()).collect();
        let ms: Vec<f64> = w.iter_ms.iter().map(|v| f64::from(*v)).collect();
        Iterations { rank: w.rank, starts, ends, median_ms: median(&ms).unwrap_or(f64::NAN), ms }
    }

    /// The longest iteration overlapping `[from, to]` (ms since the epoch).
    pub fn worst_in(&self, from: f64, to: f64) -> Option<f64> {
        let overlapping = (0..self.ms.len()).filter(|&k| self.starts[k] < to && self.ends[k] > from);
        let worst = overlapping.map(|k| self.ms[k]).fold(f64::NAN, f64::max);
        worst.is_finite().then_some(worst)
    }
}

/// The settle time (ms since the epoch) of a balance log: the end of the last migration of
/// at least [`PROBE_BYTES`] or scaling event (but a `kept` verdict, which changes nothing);
/// `None` if there was none.
pub fn settle_unix_ms(log: &BalanceLog) -> Option<f64> {
    let moves = log.migrations.iter().filter(|m| m.error.is_none() && m.bytes >= PROBE_BYTES).map(|m| m.at_s);
    let scaling = log.scaling.iter().filter(|e| e.action != "kept").map(|e| e.at_s);
    let last = moves.chain(scaling).filter(|t| t.is_finite()).fold(f64::NAN, f64::max);
    last.is_finite().then_some(log.started_unix_ms + last * 1e3)
}

/// it/s of all workers over the iterations that end at or after `from` (ms since the
/// epoch): per worker (n - 1) / (last end - first end), summed; with the iterations counted.
/// A worker's last iteration stays out (it pushes without pulling: shorter). NaN when a
/// worker has fewer than 3 iterations there.
pub fn window_rate(iters: &[Iterations], from: f64) -> (f64, u64) {
    let mut rate = 0.0;
    let mut counted = 0u64;
    for w in iters {
        let all = &w.ends[..w.ends.len().saturating_sub(1)];
        let ends: Vec<f64> = all.iter().copied().filter(|e| *e >= from).collect();
        counted += ends.len() as u64;
        match (ends.first(), ends.last()) {
            (Some(a), Some(b)) if ends.len() >= 3 && b > a => rate += (ends.len() - 1) as f64 / ((b - a) / 1e3),
            _ => return (f64::NAN, counted),
        }
    }
    (rate, counted)
}

#[cfg(test)]
mod tests {
    use super::*;
    use elasticps_node::scheduler::{MigrationEvent, ScaleEvent};

    /// A worker whose iterations last `ms`, starting at `start`.
    fn worker(rank: u32, start: f64, ms: &[f32]) -> WorkerReport {
        WorkerReport {
            rank,
            iterations: ms.len() as u64,
            train_s: ms.iter().map(|m| f64::from(*m)).sum::<f64>() / 1e3,
            started_unix_ms: start,
            iter_ms: ms.to_vec(),
            iter_ms_mean: ms.iter().map(|m| f64::from(*m)).sum::<f64>() / ms.len() as f64,
            ..WorkerReport::default()
        }
    }

    fn migration(at_s: f64, bytes: u64, total_ms: f64) -> MigrationEvent {
        MigrationEvent { at_s, block: 7, from: 1, to: 2, bytes, freeze_ms: 2.0, total_ms, held: 0, error: None }
    }

    fn report(workers: Vec<WorkerReport>, balance: Option<BalanceLog>) -> Report {
        Report {
            config: serde_json::Value::Null,
            test_accuracy: f64::NAN,
            test_loss: f64::NAN,
            samples_per_sec: 0.0,
            wall_s: 20.0,
            iterations: 16,
            servers: Vec::new(),
            workers,
            curve: Vec::new(),
            balance,
        }
    }

    #[test]
    fn measures_windows_settling_and_spikes() {
        // The scheduler starts at 1,000,000 ms; training at +2 s. Four slow iterations of
        // 2 s, then 1 s ones, except the 6th (9 .. 10.5 s of training): 1.5 s.
        let t0 = 1_002_000.0;
        let mut ms = vec![2000.0f32; 4];
        ms.push(1000.0);
        ms.push(1500.0);
        ms.extend([1000.0; 10]);
        let workers = vec![worker(0, t0, &ms), worker(1, t0 + 100.0, &ms)];
        let log = BalanceLog {
            mode: "psld".into(),
            started_unix_ms: 1_000_000.0,
            // The real move ends at 10.0 s after the scheduler's start = +8 s of training;
            // a probe at 20 s does not delay the settle.
            migrations: vec![migration(10.0, 4 << 20, 400.0), migration(20.0, 2048, 1.0)],
            // The `kept` verdict at 19 s does not delay the settle either.
            scaling: vec![
                ScaleEvent { at_s: 12.0, action: "scale-out".into(), server: None, reason: "r".into() },
                ScaleEvent { at_s: 19.0, action: "kept".into(), server: Some(4), reason: "r".into() },
            ],
            timeline: Vec::new(),
            settled_s: Some(20.0),
            decisions: Vec::new(),
        };
        let report = report(workers, Some(log));
        let r = BalanceNumbers::of(&report, Window::Balanced, 0.0);
        // Settled by the scale-out event at 12 s = +10 s of training.
        assert!((r.settled_at_s.unwrap() - 10.0).abs() < 1e-9, "{:?}", r.settled_at_s);
        assert!((r.log_settled_at_s.unwrap() - 18.0).abs() < 1e-9);
        assert_eq!(r.settling_s, Some(10.0));
        // Each worker's ends from 10 s on but the last (10.5, ..., 19.5 s for worker 0): 1 it/s.
        assert!((r.iters_per_s - 2.0).abs() < 1e-9, "{}", r.iters_per_s);
        assert_eq!((r.migrations, r.bytes_moved), (2, (4 << 20) + 2048));
        // Migration 1 spans +7.6..+8.0 s: worker 0's 4th iteration (6..8 s, 2 s) against a
        // median of 1 s: 2x.
        let spike = r.migration_spike.unwrap();
        assert_eq!((spike.iter_ms, spike.median_ms, spike.ratio), (2000.0, 1000.0, 2.0));
        // The scale-out (+10 .. +12 s, no `joined`) overlaps the 1.5 s iteration.
        let s = r.scale_out_spike.unwrap();
        assert_eq!(s.iter_ms, 1500.0);

        // Static: the window starts after the warm-up iteration; nothing moved.
        let mut st = report.clone();
        st.balance = None;
        let r = BalanceNumbers::of(&st, Window::Static, 0.0);
        assert!((r.window_from_s - 2.1).abs() < 1e-9, "{}", r.window_from_s);
        assert_eq!(r.settling_s, Some(0.0));
        assert!(r.migration_spike.is_none());
        assert_eq!(BalanceNumbers::of(&st, Window::Reference, 3.0).straggler_from_s, 0.0);
        // Too few iterations left in the window: NaN, not a number from 1 iteration.
        let mut late = report.clone();
        late.balance.as_mut().unwrap().scaling[0].at_s = 22.5;
        assert!(BalanceNumbers::of(&late, Window::Balanced, 0.0).iters_per_s.is_nan());
    }

    #[test]
    fn run_numbers_rates_and_accuracy_at_a_budget() {
        let mut r = report(vec![worker(0, 0.0, &[100.0; 10]), worker(4, 0.0, &[200.0; 10])], None);
        r.curve = [(1.0, 0, 0.1), (5.0, 50, 0.8), (9.0, 100, 0.9)]
            .map(|(t_s, iteration, a)| crate::CurvePoint {
                t_s,
                iteration,
                rank: 0,
                loss: None,
                test_accuracy: Some(a),
                metrics: Default::default(),
            })
            .to_vec();
        let n = RunNumbers::of(&r, &[4]);
        // 20 iterations over the longest training time (2 s).
        assert!((n.iters_per_s - 10.0).abs() < 1e-9 && (n.worker_rate - 15.0).abs() < 1e-9, "{n:?}");
        assert_eq!((n.straggler_iter_ms, n.other_iter_ms), (200.0, 100.0));
        assert_eq!(n.accuracy_at(0.5), None);
        assert_eq!(n.accuracy_at(5.0), Some(0.8));
        assert_eq!(n.accuracy_at(100.0), Some(0.9));
        assert!((n.accuracy_last3.unwrap() - 0.6).abs() < 1e-9);
        assert!((mean_rate(&r) - 15.0).abs() < 1e-9);
        assert!((second_half_rate(&r) - 15.0).abs() < 1e-9);
        assert_eq!(mean_iter_ms(&r), 150.0);
    }

    #[test]
    fn rate_by_window_shows_a_job_that_speeds_up() {
        // Two workers: 4 iterations of 500 ms, then 4 of 250 ms (3 s), plus a last one.
        let ms = [500.0, 500.0, 500.0, 500.0, 250.0, 250.0, 250.0, 250.0, 10.0];
        let r = rate_by_window(&report(vec![worker(0, 0.0, &ms), worker(1, 0.0, &ms)], None), 2);
        // Ends at 0.5, 1.0 | 1.5, 2.0, 2.25, 2.5, 2.75, 3.0 s (the last one, at 3.01 s, out;
        // a span holds its start): two spans of 1.5 s, two workers.
        assert_eq!(r, vec![2.0 * 2.0 / 1.5, 2.0 * 6.0 / 1.5]);
        assert!(rate_by_window(&report(Vec::new(), None), 4).is_empty());
    }
}
