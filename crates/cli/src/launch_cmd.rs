//! `elasticps launch [JOB FLAGS] -- CMD ARGS...`: like `train`, but the workers are
//! `--workers` copies of the user's own command (e.g. `python train.py`), as `torchrun`
//! or `bpslaunch` run them.
//!
//! The contract with a worker command (the Python package and `elasticps worker` keep it):
//!
//! - its environment adds `ELASTICPS_SCHEDULER=HOST:PORT`, `ELASTICPS_WORKER_SECRET` (a
//!   worker secret of its own: `--worker-secret`, or one derived from the cluster secret;
//!   `ELASTICPS_SECRET` is empty, so a script never holds the cluster secret),
//!   `ELASTICPS_MAX_FRAME_MIB`, `ELASTICPS_WORKERS=N`, `ELASTICPS_LOCAL_RANK=I` (its spawn
//!   index; the scheduler still assigns the rank), `ELASTICPS_EVENTS_FD=3`, and
//!   `ELASTICPS_REQUEST_TIMEOUT` when `--request-timeout-s` is given, and
//!   `ELASTICPS_WORKER_JITTER=P:MS` when `--worker-jitter` is (`elasticps worker` reads it;
//!   a script of the user's may), `ELASTICPS_WIRE_DTYPE` when `--wire-dtype` is and
//!   `ELASTICPS_COMPRESS` when `--compress` is (the Python package and `elasticps worker`
//!   read them);
//! - it writes JSON event lines ([`crate::events::Event`]: `log`, `progress`, `eval`,
//!   `worker_done`) to file descriptor 3, a pipe to the launcher;
//! - its stdout and stderr are the user's: every line is printed on the launcher's
//!   stdout (stderr) as `[worker I] LINE` and written to `DIR/logs/worker-I.log`;
//! - it runs in its own process group, killed with the job.

use std::time::Duration;

use clap::Args;

use elasticps_core::sync::SyncPolicy;
use elasticps_launch::args::{JobArgs, NetArgs, RunArgs};
use elasticps_launch::hosts::{HostArgs, HostOutcome, HostSpec, run_host};
use elasticps_launch::process::shell_words;
use elasticps_launch::runner::{
    JobSpec, RunOutcome, Workers, assemble_report, job_config_json, print_cluster_summary, run_job,
};
use elasticps_report::Report;

/// `elasticps launch`.
#[derive(Args, Clone, Debug)]
pub struct LaunchCmd {
    /// The job (servers, workers, sync, optimizer, placement, balancing, stragglers...).
    #[command(flatten)]
    pub job: JobArgs,
    /// Transport settings.
    #[command(flatten)]
    pub net: NetArgs,
    /// How long one push or pull of a worker may wait for its server, in seconds
    /// (passed to the workers as ELASTICPS_REQUEST_TIMEOUT).
    #[arg(long, env = "ELASTICPS_REQUEST_TIMEOUT")]
    pub request_timeout_s: Option<u64>,
    /// Transient stragglers: P:MS, passed to the workers as ELASTICPS_WORKER_JITTER (an
    /// `elasticps worker` then sleeps MS ms with probability P after each iteration).
    #[arg(long, value_name = "P:MS", value_parser = parse_jitter)]
    pub worker_jitter: Option<elasticps_train::Jitter>,
    /// The dtype the workers' gradients and pulled values travel in (f32, bf16, fp16),
    /// passed to them as ELASTICPS_WIRE_DTYPE; `DistributedOptimizer(compression=...)`
    /// overrides it per optimizer.
    #[arg(long, env = "ELASTICPS_WIRE_DTYPE", value_parser = parse_dtype)]
    pub wire_dtype: Option<elasticps_core::dtype::Dtype>,
    /// Compress every gradient with error feedback (`topk:0.01`, `randomk:0.01`), passed
    /// to the workers as ELASTICPS_COMPRESS; `DistributedOptimizer(compression=...)`
    /// overrides it per optimizer.
    #[arg(long, env = "ELASTICPS_COMPRESS", value_parser = parse_sparsifier)]
    pub compress: Option<elasticps_core::compress::Sparsifier>,
    /// Report, progress bars, metrics.
    #[command(flatten)]
    pub run: RunArgs,
    /// A job across hosts: run this same command on every host (`--nnodes`, `--rdzv`).
    #[command(flatten)]
    pub hosts: HostArgs,
    /// Once every worker has exited, how long the scheduler and the servers may take to
    /// end the job before they are stopped and the launch fails, in seconds (a worker that
    /// exits without finishing leaves the scheduler waiting).
    #[arg(long, env = "ELASTICPS_END_TIMEOUT", default_value_t = elasticps_launch::runner::JOB_END_TIMEOUT.as_secs_f64())]
    pub end_timeout_s: f64,
    /// Keep ps-lite's arithmetic under bsp: every worker's push is an optimizer step of its
    /// own (2 steps per clock with 2 workers). By default a `launch` job whose servers all
    /// run bsp takes DDP's arithmetic instead, as if `--aggregate` were given: one step per
    /// clock with the mean of the workers' gradients, so a DDP script moved here follows the
    /// same loss curve. The default holds for every launch job, whatever its command: which
    /// arithmetic a job gets never depends on guessing what the command is (`train` and the
    /// roles keep per-push steps unless given `--aggregate`).
    #[arg(long, env = "ELASTICPS_NO_AGGREGATE", conflicts_with = "aggregate")]
    pub no_aggregate: bool,
    /// The worker command and its arguments, after `--` (e.g. `-- python train.py --epochs 2`).
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<String>,
}

impl LaunchCmd {
    /// The command with launch's default arithmetic applied to its job: under bsp on
    /// every server, one step per clock with the mean of the workers' pushes (DDP's),
    /// unless `--no-aggregate`.
    pub fn with_default_arithmetic(mut self) -> Self {
        let bsp = |p: &SyncPolicy| *p == SyncPolicy::Bsp;
        if !self.no_aggregate && bsp(&self.job.sync) && self.job.server_sync.iter().all(|(_, p)| bsp(p)) {
            self.job.aggregate = true;
        }
        self
    }
}

/// `elasticps launch`: run, print the summary, write the report.
pub async fn launch(cmd: LaunchCmd) -> anyhow::Result<()> {
    let mut cmd = cmd.with_default_arithmetic();
    // The scripts hold a worker secret of their own, never the cluster secret.
    if cmd.net.secure_for_scripts(cmd.hosts.spans_hosts()) && !cmd.run.quiet {
        println!(
            "note: no --secret given: the job's nodes use a cluster secret drawn for it, and the scripts a worker \
             secret of their own; launch with --secret (ELASTICPS_SECRET) to reach the job with `elasticps status` \
             or `elasticps scale`"
        );
    }
    let mut env = Vec::new();
    if let Some(s) = cmd.request_timeout_s {
        env.push(("ELASTICPS_REQUEST_TIMEOUT".to_string(), s.to_string()));
    }
    if let Some(j) = cmd.worker_jitter {
        env.push(("ELASTICPS_WORKER_JITTER".to_string(), j.to_string()));
    }
    if let Some(d) = cmd.wire_dtype {
        env.push(("ELASTICPS_WIRE_DTYPE".to_string(), d.to_string()));
    }
    if let Some(c) = cmd.compress {
        env.push(("ELASTICPS_COMPRESS".to_string(), c.to_string()));
    }
    let end_timeout = Duration::try_from_secs_f64(cmd.end_timeout_s)
        .map_err(|_| anyhow::anyhow!("--end-timeout-s must be a non-negative number of seconds"))?;
    if cmd.hosts.spans_hosts() {
        let spec = HostSpec {
            hosts: &cmd.hosts,
            job: &cmd.job,
            net: &cmd.net,
            report: cmd.run.report.as_deref(),
            quiet: cmd.run.quiet,
            command: &cmd.command,
            env,
            end_timeout,
            restart_workers: cmd.run.restart_workers,
            restart_servers: cmd.run.restart_servers,
        };
        match run_host(&spec).await? {
            HostOutcome::Left(reason) => {
                println!("this host is done: {reason}");
                return Ok(());
            }
            HostOutcome::Job(outcome) => return finish(&cmd, &outcome),
        }
    }
    let outcome = run_job(&JobSpec {
        job: &cmd.job,
        net: &cmd.net,
        report: cmd.run.report.as_deref(),
        quiet: cmd.run.quiet,
        extra_server_args: &[],
        workers: Workers::Command { argv: &cmd.command, env },
        end_timeout,
        metrics: cmd.run.metrics,
        restart_workers: cmd.run.restart_workers,
        restart_servers: cmd.run.restart_servers,
    })
    .await?;
    finish(&cmd, &outcome)
}

/// Prints the job's summary and writes its report.
fn finish(cmd: &LaunchCmd, outcome: &RunOutcome) -> anyhow::Result<()> {
    let report = build_report(cmd, outcome);
    if report.test_accuracy.is_nan() {
        println!("{} steps per worker (no test accuracy logged)", report.iterations);
    } else {
        let loss = if report.test_loss.is_nan() { String::new() } else { format!(" (loss {:.4})", report.test_loss) };
        println!(
            "test accuracy {:.2}%{loss} after {} steps per worker",
            report.test_accuracy * 100.0,
            report.iterations
        );
    }
    print_cluster_summary(&cmd.job, &report);
    // Across hosts, the job's size is the hosts' offers: the ranks that reported.
    let workers = if cmd.hosts.spans_hosts() { outcome.workers.len() as u32 } else { cmd.job.workers };
    let missing = missing_ranks(workers, outcome);
    if !missing.is_empty() {
        let ranks: Vec<String> = missing.iter().map(u32::to_string).collect();
        println!(
            "note: {} of {} workers sent no final report (worker_done): rank {}; their numbers are missing above",
            missing.len(),
            workers,
            ranks.join(", ")
        );
    }
    if let Some(dir) = &cmd.run.report {
        elasticps_report::write(dir, &report)?;
        println!("report written to {}", dir.display());
    }
    Ok(())
}

/// The ranks that sent no `worker_done`.
fn missing_ranks(workers: u32, o: &RunOutcome) -> Vec<u32> {
    (0..workers).filter(|r| !o.workers.contains_key(r)).collect()
}

/// Turns a run's events into the report: the job's flags plus the workers' command line.
pub fn build_report(cmd: &LaunchCmd, o: &RunOutcome) -> Report {
    let (test_accuracy, test_loss) = o.final_eval.map_or((f64::NAN, f64::NAN), |(a, l)| (a.into(), l.into()));
    let mut config = job_config_json(&cmd.job);
    config.insert("command".into(), shell_words(&cmd.command).into());
    if let Some(s) = cmd.request_timeout_s {
        config.insert("request_timeout_s".into(), s.into());
    }
    if let Some(j) = cmd.worker_jitter {
        config.insert("worker_jitter".into(), j.to_string().into());
    }
    assemble_report(o, config.into(), test_accuracy, test_loss)
}

fn parse_jitter(s: &str) -> Result<elasticps_train::Jitter, String> {
    s.parse().map_err(|e: elasticps_train::TrainError| e.to_string())
}

fn parse_dtype(s: &str) -> Result<elasticps_core::dtype::Dtype, String> {
    s.parse().map_err(|e: elasticps_core::CoreError| e.to_string())
}

fn parse_sparsifier(s: &str) -> Result<elasticps_core::compress::Sparsifier, String> {
    s.parse().map_err(|e: elasticps_core::CoreError| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        launch: LaunchCmd,
    }

    fn parse(args: &[&str]) -> Result<LaunchCmd, clap::Error> {
        Cli::try_parse_from(std::iter::once("launch").chain(args.iter().copied())).map(|c| c.launch)
    }

    #[test]
    fn the_command_comes_after_the_job_flags() {
        let c = parse(&["--workers", "3", "--sync", "ssp:2", "--", "python", "train.py", "--lr", "0.1"]).unwrap();
        assert_eq!(c.job.workers, 3);
        assert_eq!(c.command, ["python", "train.py", "--lr", "0.1"]);
        // The command's own flags are never taken for the launcher's.
        assert_eq!(c.job.lr, 0.001);
        let err = parse(&["--workers", "2"]).expect_err("a missing command is refused").to_string();
        assert!(err.contains("required") && err.contains("CMD"), "{err}");
    }

    #[test]
    fn launch_takes_ddps_arithmetic_under_bsp_unless_told_otherwise() {
        let aggregate = |args: &[&str]| {
            let all: Vec<&str> = args.iter().copied().chain(["--", "python", "train.py"]).collect();
            parse(&all).unwrap().with_default_arithmetic().job.aggregate
        };
        assert!(aggregate(&[]), "bsp by default: one step per clock with the mean, as DDP");
        assert!(aggregate(&["--aggregate"]));
        assert!(!aggregate(&["--no-aggregate"]), "ps-lite's per-push steps on request");
        assert!(!aggregate(&["--sync", "ssp:2"]), "the default is bsp's alone");
        assert!(!aggregate(&["--server-sync", "1=asp"]), "a server that is not bsp keeps per-push steps");
        assert!(aggregate(&["--sync", "ssp:2", "--aggregate"]), "an explicit --aggregate holds everywhere");
        let both = parse(&["--aggregate", "--no-aggregate", "--", "python"]).expect_err("contradictory");
        assert!(both.to_string().contains("cannot be used with"), "{both}");
    }

    #[test]
    fn the_report_records_the_command_and_tolerates_missing_workers() {
        let c = parse(&["--workers", "2", "--request-timeout-s", "9", "--", "python", "my train.py"]).unwrap();
        let mut o = RunOutcome::default();
        o.workers.insert(1, elasticps_report::WorkerReport { rank: 1, iterations: 4, ..Default::default() });
        let r = build_report(&c, &o);
        assert_eq!(r.config["command"], "python 'my train.py'");
        assert_eq!(r.config["request_timeout_s"], 9);
        assert_eq!((r.workers.len(), r.iterations), (1, 4));
        assert!(r.test_accuracy.is_nan());
        assert_eq!(missing_ranks(2, &o), [0]);
    }
}
