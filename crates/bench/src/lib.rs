//! `elasticps bench ...`: benchmarks that compare side by side in one run and print ratios.
//! The `elasticps` binary parses the flags ([`BenchCmd`]) and calls [`run`]; every job a
//! benchmark runs is a real local cluster of that binary's roles, started through
//! `elasticps-launch` (the same runner as `elasticps train`).
//!
//! Every benchmark goes through one pipeline ([`pipeline`]): a [`pipeline::Bench`] runs its
//! plan, decides its checks and targets, and renders its Markdown and plots; the pipeline
//! adds the machine and the command line, prints, writes and fails the command on a failed
//! check. Jobs are typed ([`job::TrainSpec`]: `elasticps-launch`'s `JobArgs` and
//! `DataArgs`), and what a run measured is one [`job::RunResult`], from the analytics of
//! `elasticps-report`.
//!
//! - [`transport`]: push/pull throughput and latency of the parameter server against the
//!   same bytes over plain TCP socket pairs (`elasticps bench transport`).
//! - [`sparse`]: embedding tables' `pull_rows`/`push_rows` against dense pulls/pushes of
//!   the same bytes, and the server's RSS for a 10^7-row table with 10^5 rows touched
//!   (`elasticps bench sparse`).
//! - [`hot_rows`]: Zipf row ids under static placement and psld, which splits the hot
//!   row block (`elasticps bench hot-rows`).
//! - [`sink`]: the raw TCP peer of that comparison, a separate process
//!   (`elasticps bench tcp-sink`, hidden) so both sides pay the same process costs.
//! - [`pipeline`]: the one pipeline of every benchmark.
//! - [`machine`]: CPU model, kernel, and the CPU share other processes took during a run;
//!   [`machine::Machine`], the machine line of every benchmark.
//! - [`checks`]: the checks (fail the command) and targets (reported) that end every
//!   benchmark's report, and their Markdown.
//! - [`sync`]: every sync policy on the same straggler job, side by side
//!   (`elasticps bench sync`); [`plots::sync`] draws its `sync.png`; [`transient`] is its
//!   transient-straggler scenario, each policy against the replay of its own hold rule.
//! - [`straggler`]: a straggling server (bandwidth, CPU, skewed placement, mid-run) under
//!   static placement and under the PSLD balancer (`elasticps bench straggler`);
//!   [`plots::straggler`] draws its `straggler.png`.
//! - [`sim`]: `elasticps sim` at 1,000 workers x 100 servers, the balancer's decision time,
//!   static vs PSLD and the sync policies at scale, and a cross-check of the sim against
//!   real processes (`elasticps bench sim`); [`plots::sim`] draws its `sim.png`.
//! - [`suite`]: the balancer on seeded random simulated jobs, static vs psld vs the
//!   no-straggler ceiling, every model, 3 to 1,000 servers, no, one or many stragglers,
//!   noise (`elasticps bench sim --suite`).
//! - [`chaos`]: servers killed and a worker restarted under load with `--replicas 2`:
//!   detection, recovery, iteration spikes, exact final parameters, the cost of replicas
//!   (`elasticps bench chaos`).
//! - [`hosts`]: static vs PSLD on a job across 3 namespace hosts (`scripts/testnet`), one
//!   host's link capped with tbf, a spare host for scale-out, against the raw TCP rate of
//!   that link (`elasticps bench hosts`; `bench tcp-rate`, hidden, is its raw client).
//! - [`roles`]: a job's scheduler and servers as processes, for the benchmarks that drive
//!   their own workers in process (`transport`, `chaos`).
//! - [`job`]: their train jobs, typed, the one runner of them (through
//!   `elasticps-launch`), and the one [`job::RunResult`] of a job measured.
//! - [`plots`]: those figures, in the house style of `elasticps-report`.

use clap::Subcommand;

use crate::pipeline::execute;

pub mod chaos;
pub mod checks;
mod error;
pub mod hosts;
pub mod hot_rows;
pub mod job;
pub mod machine;
pub mod pipeline;
pub mod plots;
pub mod roles;
pub mod sim;
pub mod sink;
pub mod sparse;
pub mod straggler;
pub mod suite;
pub mod sync;
pub mod transient;
pub mod transport;

pub use error::{BenchError, Result};

/// The benchmarks.
#[derive(Subcommand, Debug)]
pub enum BenchCmd {
    /// Push/pull throughput and latency against raw TCP.
    Transport(transport::TransportCmd),
    /// Embedding tables: pull_rows/push_rows against dense pulls/pushes of the same bytes, and a 10^7-row table's RSS for the rows touched.
    Sparse(sparse::SparseCmd),
    /// Zipf row ids on an embedding table: static vs PSLD, which splits the hot row block and moves the pieces; every push applied exactly once.
    HotRows(hot_rows::HotRowsCmd),
    /// The raw TCP peer of `bench transport` (started by it; not for direct use).
    #[command(hide = true)]
    TcpSink(sink::SinkCmd),
    /// Every sync policy on the same job with two stragglers: throughput, delayed pulls, accuracy.
    Sync(sync::SyncBenchCmd),
    /// A straggling server under static placement and under the PSLD balancer: it/s, settling, migration spikes.
    Straggler(straggler::StragglerBenchCmd),
    /// The simulator: 1,000 x 100 wall time, balancer decision time, psld and sync policies at scale, sim vs real processes; with --suite, the balancer on seeded random jobs.
    Sim(sim::SimBenchCmd),
    /// Failures under load with --replicas 2: servers killed with kill -9, a worker restarted; detection, recovery, spikes, the cost of replicas.
    Chaos(chaos::ChaosCmd),
    /// Static vs PSLD across 3 namespace hosts (needs root): a capped host, a spare for scale-out, the raw TCP rate of the capped link.
    Hosts(hosts::HostsBenchCmd),
    /// The raw TCP client of `bench hosts`, run inside a bed host (started by it; not for direct use).
    #[command(hide = true)]
    TcpRate(hosts::TcpRateCmd),
}

/// Runs a benchmark.
pub async fn run(cmd: BenchCmd) -> Result<()> {
    match cmd {
        BenchCmd::Transport(cmd) => execute(transport::TransportBench::new(cmd)?).await,
        BenchCmd::TcpSink(cmd) => sink::run(cmd).await,
        BenchCmd::Sparse(cmd) => execute(sparse::SparseBench::new(cmd)?).await,
        BenchCmd::HotRows(cmd) => execute(hot_rows::HotRowsBench::new(cmd)?).await,
        BenchCmd::Sync(cmd) => execute(sync::SyncBench::new(cmd)?).await,
        BenchCmd::Straggler(cmd) => execute(straggler::StragglerBench::new(cmd)?).await,
        BenchCmd::Sim(cmd) if cmd.suite => execute(suite::SuiteBench::new(cmd)?).await,
        BenchCmd::Sim(cmd) => execute(sim::SimBench::new(cmd)).await,
        BenchCmd::Chaos(cmd) => execute(chaos::ChaosBench::new(cmd)?).await,
        BenchCmd::Hosts(cmd) => execute(hosts::HostsBench::new(cmd)?).await,
        BenchCmd::TcpRate(cmd) => hosts::tcp_rate(cmd).await,
    }
}

/// Where a benchmark's nodes write their logs: `out/logs`, or a directory of this process
/// in the system's temporary directory.
pub(crate) fn log_dir(out: Option<&std::path::Path>) -> std::path::PathBuf {
    match out {
        Some(dir) => dir.join("logs"),
        None => std::env::temp_dir().join(format!("elasticps-bench-{}", std::process::id())),
    }
}

/// A tokio runtime with `threads` worker threads, like the one every role process runs
/// on (`main.rs` gives the launcher-style commands, `bench` among them, a single thread).
pub fn multi_thread_runtime(threads: usize) -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().worker_threads(threads).enable_all().build()?)
}
