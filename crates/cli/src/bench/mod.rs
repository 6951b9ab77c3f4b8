//! `elasticps bench ...`: benchmarks that compare side by side in one run and print ratios.

use clap::Subcommand;

/// The benchmarks.
#[derive(Subcommand, Debug)]
pub enum BenchCmd {
    /// Push/pull throughput and latency against raw TCP.
    Transport,
}

/// Runs a benchmark.
pub async fn run(cmd: BenchCmd) -> anyhow::Result<()> {
    match cmd {
        BenchCmd::Transport => anyhow::bail!("not yet"),
    }
}
