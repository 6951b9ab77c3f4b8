//! `elasticps`: the parameter server's command line, as a library: the `elasticps` binary
//! and the Python package's `elasticps` command (`elasticps._native.cli_main`) both call
//! [`main_with_args`], so they are the same program.
//!
//! One program, several roles: `scheduler`, `server` and `worker` are the processes of a
//! cluster (run them by hand on several hosts, or let a launcher do it); `train` starts a
//! whole local cluster and trains the MNIST MLP end to end; `launch` starts the scheduler
//! and servers and runs the user's own training command as the workers; `sim` runs a job
//! on the deterministic harness (virtual time, simulated links); `bench` measures.
//!
//! - `roles`: the role commands.
//! - `job`: the worker's training loop (MLP or synthetic model, straggler injection).
//! - `train`: the main job: run, print, write its report.
//! - `launch_cmd`: `elasticps launch -- CMD`, the user's command as the workers.
//! - `ops`: `status` and `scale`, against a running job's scheduler.
//! - `export`: `elasticps export`, a running job's values for serving (docs/EXPORT.md).
//! - `events`: the JSON lines roles print for the launcher.
//!
//! The libraries beneath it: `elasticps-launch` (the job's flags, the local processes, the
//! job runner that `train`, `launch` and the benchmarks share), `elasticps-report`
//! (report.json, summary.md, the plots) and `elasticps-bench` (`elasticps bench ...`:
//! this binary only parses its flags and calls it).

mod events;
mod export;
mod job;
mod launch_cmd;
mod ops;
mod roles;
mod train;

use clap::{Parser, Subcommand};
pub use elasticps_launch::process::set_self_command;
use tracing_subscriber::EnvFilter;

/// A parameter server for distributed deep-learning training.
#[derive(Parser, Debug)]
#[command(name = "elasticps", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Start a local cluster (scheduler, servers, workers as processes) and train the MNIST MLP.
    Train(train::TrainCmd),
    /// Start the scheduler and servers locally and run `--workers` copies of your training
    /// command as the workers: `elasticps launch [JOB FLAGS] -- python train.py ARGS`.
    Launch(launch_cmd::LaunchCmd),
    /// Run the scheduler: membership, layout, heartbeats, the end of the job.
    Scheduler(roles::SchedulerCmd),
    /// Run a server: owns blocks, applies pushes, answers pulls.
    Server(roles::ServerCmd),
    /// Run a worker: trains the MLP on its shard of the data.
    Worker(roles::WorkerCmd),
    /// Simulate a job (the same state machines on virtual time and simulated links), up to
    /// thousands of workers and servers: `train`'s job flags plus the simulated machine.
    Sim(elasticps_sim::SimCmd),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(elasticps_bench::BenchCmd),
    /// Show a running job: servers, workers, balancing, migrations.
    Status(ops::StatusCmd),
    /// Ask a running job's scheduler to add a server, drain and remove one, or move a block.
    Scale(ops::ScaleCmd),
    /// Write a running job's values for serving: every row changed since the last export
    /// (`--since`) and the dense tensors, as a manifest and binary shards (docs/EXPORT.md).
    Export(export::ExportCmd),
}

/// Runs the `elasticps` command with `args` (the program's name first, as
/// `std::env::args_os`) and returns its exit status: 0 on success, 1 on a failed command,
/// 2 on a usage error (after printing it).
///
/// A host whose executable is not `elasticps` (the Python interpreter) declares how to start
/// this program again first, with [`set_self_command`]: the launchers start their nodes
/// with it.
pub fn main_with_args<I, T>(args: I) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            // --help and --version are "errors" that print to stdout and exit 0.
            let _ = e.print();
            return if e.use_stderr() { 2 } else { 0 };
        }
    };
    init_logs(&cli.command);
    let runtime = match cli.command {
        // The launchers only move lines and wait on children: one thread is plenty, and it
        // stays alive for the whole run (children die with the thread that spawned them).
        Command::Train(_) | Command::Launch(_) | Command::Bench(_) | Command::Sim(_) => {
            tokio::runtime::Builder::new_current_thread().enable_all().build()
        }
        _ => tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build(),
    };
    let runtime = match runtime {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return 1;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Train(cmd) => train::train(cmd).await,
            Command::Launch(cmd) => launch_cmd::launch(cmd).await,
            Command::Scheduler(cmd) => roles::scheduler(cmd).await,
            Command::Server(cmd) => roles::server(cmd).await,
            Command::Worker(cmd) => roles::worker(cmd).await,
            Command::Bench(cmd) => elasticps_bench::run(cmd).await.map_err(Into::into),
            Command::Sim(cmd) => elasticps_sim::run(&cmd).map(|_| ()).map_err(Into::into),
            Command::Status(cmd) => ops::status(cmd).await,
            Command::Scale(cmd) => ops::scale(cmd).await,
            Command::Export(cmd) => export::export(cmd).await,
        }
    });
    // A host that outlives the call (the Python interpreter) does not flush Rust's stdout.
    let _ = std::io::Write::flush(&mut std::io::stdout());
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e:#}");
            1
        }
    }
}

/// Logs on stderr, `RUST_LOG` or the command's default level. A host that installed a
/// subscriber already (the Python module, for its workers) keeps it.
fn init_logs(command: &Command) {
    let default_level = match command {
        Command::Train(_) | Command::Launch(_) | Command::Bench(_) | Command::Sim(_) => "warn",
        _ => "info",
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level)))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}
