//! The `elasticps train` job: its flags ([`TrainCmd`]), running it on a local cluster
//! ([`run_local`]) and turning what it produced into its report ([`build_report`]). The
//! binary's `train` command and the benchmarks (which run many train jobs) share them.

use clap::Args;
use elasticps_report::Report;
use elasticps_train::synthetic::ModelKind;

use crate::args::{DataArgs, JobArgs, NetArgs, RunArgs};
use crate::runner::{JobSpec, RunOutcome, Workers, assemble_report, job_config_json, run_job};
use crate::{LaunchError, Result};

/// `elasticps train`.
#[derive(Args, Clone, Debug)]
pub struct TrainCmd {
    /// The job (servers, workers, sync, optimizer, placement...).
    #[command(flatten)]
    pub job: JobArgs,
    /// Data and schedule.
    #[command(flatten)]
    pub data: DataArgs,
    /// Transport settings.
    #[command(flatten)]
    pub net: NetArgs,
    /// Report, progress bars, metrics.
    #[command(flatten)]
    pub run: RunArgs,
}

/// Runs one job on a local cluster and collects its events.
pub async fn run_local(cmd: &TrainCmd, extra_server_args: &[String]) -> Result<RunOutcome> {
    run_job(&JobSpec {
        job: &cmd.job,
        net: &cmd.net,
        report: cmd.run.report.as_deref(),
        quiet: cmd.run.quiet,
        extra_server_args,
        workers: Workers::Role(&cmd.data),
        end_timeout: crate::runner::JOB_END_TIMEOUT,
        metrics: cmd.run.metrics,
        restart_workers: cmd.run.restart_workers,
        restart_servers: cmd.run.restart_servers,
    })
    .await
}

/// Turns a run's events into the report.
pub fn build_report(cmd: &TrainCmd, o: &RunOutcome) -> Result<Report> {
    // A synthetic model has no test set: its accuracy is NaN (null in report.json).
    let (test_accuracy, test_loss) = match (o.final_eval, cmd.data.model) {
        (Some(e), _) => e,
        (None, ModelKind::Synthetic(_)) => (f32::NAN, f32::NAN),
        (None, ModelKind::Mlp) => return Err(LaunchError::Incomplete("worker 0 reported no test evaluation".into())),
    };
    if o.workers.len() as u32 != cmd.job.workers {
        return Err(LaunchError::Incomplete(format!(
            "only {} of {} workers reported their end",
            o.workers.len(),
            cmd.job.workers
        )));
    }
    let mut config = job_config_json(&cmd.job);
    let data = serde_json::json!({
        "dataset": cmd.data.dataset.as_str(),
        "batch_size": cmd.data.batch_size,
        "epochs": cmd.data.epochs,
        "iterations": cmd.data.iterations,
        "model": cmd.data.model.to_string(),
        "compute_ms": cmd.data.compute_ms,
        "worker_delay": cmd.data.worker_delay.as_ref().map(ToString::to_string),
        "worker_jitter": cmd.data.worker_jitter.as_ref().map(ToString::to_string),
        "fuse": !cmd.data.no_fuse,
    });
    if let serde_json::Value::Object(data) = data {
        config.extend(data);
    }
    Ok(assemble_report(o, config.into(), test_accuracy.into(), test_loss.into()))
}
