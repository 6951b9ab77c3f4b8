//! `elasticps`: the parameter server's command-line binary.
//!
//! One binary, several roles: `scheduler`, `server` and `worker` are the processes of a
//! cluster (run them by hand on several hosts, or let a launcher do it); `train` starts a
//! whole local cluster and trains the MNIST MLP end to end; `launch` starts the scheduler
//! and servers and runs the user's own training command as the workers; `sim` runs a job
//! on the deterministic harness (virtual time, simulated links); `bench` measures.
//!
//! - [`roles`]: the role commands.
//! - [`job`]: the worker's training loop (MLP or synthetic model, straggler injection).
//! - [`train`]: the main job: run, print, write its report.
//! - [`launch_cmd`]: `elasticps launch -- CMD`, the user's command as the workers.
//! - [`ops`]: `status` and `scale`, against a running job's scheduler.
//! - [`events`]: the JSON lines roles print for the launcher.
//!
//! The libraries beneath it: `elasticps-launch` (the job's flags, the local processes, the
//! job runner that `train`, `launch` and the benchmarks share), `elasticps-report`
//! (report.json, summary.md, the plots) and `elasticps-bench` (`elasticps bench ...`:
//! this binary only parses its flags and calls it).

mod events;
mod job;
mod launch_cmd;
mod ops;
mod roles;
mod train;

use clap::{Parser, Subcommand};
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
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let default_level = match cli.command {
        Command::Train(_) | Command::Launch(_) | Command::Bench(_) | Command::Sim(_) => "warn",
        _ => "info",
    };
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level)))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
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
            return std::process::ExitCode::FAILURE;
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
        }
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
