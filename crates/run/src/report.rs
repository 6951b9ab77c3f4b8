//! A run's report: its job flags in report.json's `config`, the [`Report`] assembled from
//! a [`RunOutcome`], and the summary lines printed after the run's headline.

use elasticps_report::{Report, ServerReport, WorkerReport};

use crate::args::JobArgs;
use crate::outcome::RunOutcome;

/// The flags of the job itself in report.json's `config` (train and launch add theirs).
pub fn job_config_json(job: &JobArgs) -> serde_json::Map<String, serde_json::Value> {
    let value = serde_json::json!({
        "servers": job.servers,
        "workers": job.workers,
        "sync": job.sync.to_string(),
        "optimizer": job.optimizer.to_string(),
        "lr": job.lr.to_string().parse::<f64>().unwrap_or(f64::NAN),
        "aggregate": job.aggregate,
        "placement": job.placement.to_string(),
        "block_bytes": job.block_bytes,
        "seed": job.seed,
        "server_sync": job.server_sync.iter().map(|(i, p)| format!("{i}={p}")).collect::<Vec<_>>(),
        "server_bandwidth": job.server_bandwidth.iter().map(|(i, mbps)| format!("{i}={mbps}")).collect::<Vec<_>>(),
        "server_interference": job.server_interference.iter().map(|(i, f)| format!("{i}={f}")).collect::<Vec<_>>(),
        "straggler_at": job.straggler_at,
        "balance": job.balance.to_string(),
        "max_servers": job.max_servers.unwrap_or(job.servers),
        "min_servers": job.min_servers.unwrap_or(job.servers),
    });
    match value {
        serde_json::Value::Object(map) => map,
        _ => serde_json::Map::new(),
    }
}

/// The report of a run, with the caller's `config` and final test evaluation.
pub fn assemble_report(o: &RunOutcome, config: serde_json::Value, test_accuracy: f64, test_loss: f64) -> Report {
    let workers: Vec<WorkerReport> = o.workers.values().cloned().collect();
    let samples: u64 = workers.iter().map(|w| w.samples).sum();
    let train_s = workers.iter().map(|w| w.train_s).fold(0.0, f64::max);
    // Without any worker's final report, the furthest step it logged.
    let iterations = workers
        .iter()
        .map(|w| w.iterations)
        .max()
        .unwrap_or_else(|| o.curve.iter().map(|p| p.iteration).max().unwrap_or(0));
    let servers = o
        .servers
        .values()
        .map(|s| ServerReport {
            id: s.server_id,
            sync: s.sync.clone(),
            blocks: s.blocks,
            bytes: s.bytes,
            pushes: s.totals.pushes,
            pulls: s.totals.pulls,
            pulls_held: s.totals.pulls_held,
            hold_ms: s.totals.hold_us as f64 / 1e3,
            hold_p99_ms: s.hold_p99_us as f64 / 1e3,
            releases: s.totals.releases,
            max_lead: s.totals.max_lead,
        })
        .collect();
    Report {
        config,
        test_accuracy,
        test_loss,
        // Unknown (NaN, "unknown" in the summary, null in report.json) when no worker
        // reported a sample: a script that logged no `samples` did not train zero.
        samples_per_sec: if train_s > 0.0 && samples > 0 { samples as f64 / train_s } else { f64::NAN },
        wall_s: o.wall.as_secs_f64(),
        iterations,
        servers,
        workers,
        curve: o.curve.clone(),
        balance: o.balance.clone(),
    }
}

/// Prints the lines after the headline: throughput and holds, then the balancing.
pub fn print_cluster_summary(job: &JobArgs, report: &Report) {
    let held: u64 = report.servers.iter().map(|s| s.pulls_held).sum();
    let hold_ms: f64 = report.servers.iter().map(|s| s.hold_ms).sum();
    let sync = if job.aggregate { format!("{} --aggregate", job.sync) } else { job.sync.to_string() };
    // NaN: no worker reported a sample (a script that logged no `samples`).
    let rate = if report.samples_per_sec.is_finite() {
        format!("{:.0}", report.samples_per_sec)
    } else {
        "unknown".to_string()
    };
    println!(
        "{} servers, {} workers, {sync}: {rate} samples/s, wall {:.1} s, pulls held {held} ({hold_ms:.1} ms in total)",
        job.servers, job.workers, report.wall_s
    );
    if let Some(log) = &report.balance
        && (log.mode != "static" || !log.migrations.is_empty())
    {
        let done: Vec<_> = log.migrations.iter().filter(|m| m.error.is_none()).collect();
        let mb: f64 = done.iter().map(|m| m.bytes as f64).sum::<f64>() / 1e6;
        let freeze = done.iter().map(|m| m.freeze_ms).fold(0.0, f64::max);
        let scaling: Vec<String> = log
            .scaling
            .iter()
            .map(|e| format!("{} {}", e.action, e.server.map_or("-".into(), |s| s.to_string())))
            .collect();
        let kept = log.decisions.iter().filter(|d| d.kept()).count();
        println!(
            "balance {}: {} migrations ({mb:.1} MB moved, longest freeze {freeze:.1} ms), verdicts: {kept} kept, {} reverted, scaling: {}",
            log.mode,
            done.len(),
            log.decisions.len() - kept,
            if scaling.is_empty() { "none".to_string() } else { scaling.join(", ") }
        );
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use elasticps_report::CurvePoint;

    use super::*;
    use crate::tally::Tally;

    fn point(rank: u32, iteration: u64) -> CurvePoint {
        CurvePoint { t_s: 0.0, iteration, rank, loss: Some(1.0), test_accuracy: None, metrics: Default::default() }
    }

    #[test]
    fn a_run_without_final_reports_counts_the_furthest_step_logged_at_an_unknown_rate() {
        let o =
            RunOutcome { curve: vec![point(0, 3), point(1, 7)], wall: Duration::from_secs(2), ..RunOutcome::default() };
        let r = assemble_report(&o, serde_json::Value::Null, f64::NAN, f64::NAN);
        assert_eq!((r.iterations, r.wall_s), (7, 2.0));
        assert!(r.samples_per_sec.is_nan(), "no worker reported a sample: {}", r.samples_per_sec);
    }

    #[test]
    fn the_rate_is_every_sample_over_the_slowest_workers_time() {
        let mut o = RunOutcome::default();
        for (rank, samples, train_s) in [(0, 300, 2.0), (1, 100, 4.0)] {
            let mut t = Tally::default();
            t.iteration(Duration::from_millis(5));
            o.workers.insert(rank, t.report(rank, samples, 0.5, train_s));
        }
        let r = assemble_report(&o, serde_json::Value::Null, 0.9, 0.1);
        assert_eq!((r.samples_per_sec, r.iterations, r.workers.len()), (100.0, 1, 2));
        assert_eq!((r.test_accuracy, r.test_loss), (0.9, 0.1));
    }

    #[test]
    fn the_job_config_names_the_server_bounds_even_when_not_given() {
        let job = JobArgs { servers: 3, ..JobArgs::default() };
        let c = job_config_json(&job);
        assert_eq!((c["max_servers"].as_u64(), c["min_servers"].as_u64()), (Some(3), Some(3)));
        assert_eq!(c["sync"].as_str(), Some(job.sync.to_string().as_str()));
    }
}
