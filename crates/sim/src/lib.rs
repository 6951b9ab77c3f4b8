//! elasticps-sim: `elasticps sim`, the job `train` runs, on the deterministic harness.
//!
//! The same state machines as the real processes (the scheduler, the servers, the
//! workers' round plan from `elasticps-node`) run on virtual time over simulated links
//! with latency and bandwidth, so a job of 1,000 workers and 100 servers fits on one
//! machine. The sim carries tensor sizes instead of tensor bytes ([`model`]): each value
//! stands for `--scale` values of the real model, and the links charge the nominal bytes.
//! Compute time is modelled as `train` sleeps it (`--compute-ms`, `--worker-delay`,
//! `--worker-jitter`, drawn as a real worker draws them), a
//! server's CPU as a queue applying pushes at `--apply-mbps`.
//!
//! - [`args`]: the flags (`train`'s job flags plus the simulated machine).
//! - [`model`]: the scaled model and what a message weighs.
//! - [`run()`]: one simulated job and its outcome, in the shape of a real run's.

pub mod args;
pub mod error;
pub mod model;
pub mod run;

pub use args::{SimArgs, SimCmd};
pub use error::{Result, SimError};
pub use run::{SimOutcome, simulate};

use elasticps_report::Report;
use elasticps_run::report::{assemble_report, job_config_json, print_cluster_summary};

/// `elasticps sim`: simulate, print the papers' metrics, write the report.
pub fn run(cmd: &SimCmd) -> Result<SimOutcome> {
    let out = simulate(cmd)?;
    let report = report(cmd, &out);
    println!(
        "simulated {} workers x {} servers, {} ({} blocks, 1 value = {} values): {:.1} iterations/s, \
         {:.1} s simulated in {:.1} s wall ({:.1} M events)",
        cmd.job.workers,
        cmd.job.servers,
        cmd.data.model,
        out.model.blocks(),
        out.model.scale,
        out.iterations_per_s,
        out.virtual_s,
        out.wall_s,
        out.events as f64 / 1e6
    );
    print_cluster_summary(&cmd.job, &report);
    println!("{}", load_line(&report));
    if let Some(dir) = &cmd.run.report {
        elasticps_report::write(dir, &report)?;
        println!("report written to {}", dir.display());
    }
    Ok(out)
}

/// The report `train` writes, from a simulated run.
pub fn report(cmd: &SimCmd, out: &SimOutcome) -> Report {
    let mut config = job_config_json(&cmd.job);
    let extra = serde_json::json!({
        "simulated": true,
        "model": cmd.data.model.to_string(),
        "iterations": cmd.data.iterations,
        "compute_ms": cmd.data.compute_ms,
        "worker_delay": cmd.data.worker_delay.as_ref().map(ToString::to_string),
        "worker_jitter": cmd.data.worker_jitter.as_ref().map(ToString::to_string),
        "fuse": !cmd.data.no_fuse,
        "batch_size": cmd.data.batch_size,
        "latency_us": cmd.sim.latency_us,
        "link_mbps": cmd.sim.link_mbps,
        "apply_mbps": cmd.sim.apply_mbps,
        "scale": out.model.scale,
        "sim_seed": cmd.sim.sim_seed,
        "jitter_us": cmd.sim.jitter_us,
        "straggler_for_s": cmd.sim.straggler_for_s,
        "sim_wall_s": out.wall_s,
        "sim_events": out.events,
    });
    if let serde_json::Value::Object(extra) = extra {
        config.extend(extra);
    }
    assemble_report(&out.run, config.into(), f64::NAN, f64::NAN)
}

/// The load per server, as the balancer sees it: bytes pushed to each, min / median / max.
fn load_line(report: &Report) -> String {
    let mut bytes: Vec<f64> = report.servers.iter().map(|s| s.bytes as f64 / 1e6).collect();
    bytes.sort_by(f64::total_cmp);
    match (bytes.first(), bytes.last()) {
        (Some(min), Some(max)) => format!(
            "load per server (MB of parameters held): min {min:.1}, median {:.1}, max {max:.1}",
            elasticps_core::stats::median(&bytes).unwrap_or(0.0)
        ),
        _ => "no server reported".into(),
    }
}
