//! The benchmarks' train jobs: a [`TrainSpec`] (the typed flags of `elasticps train`,
//! [`JobArgs`] and [`DataArgs`] built from struct fields) runs on a real local cluster
//! through `elasticps-launch` (the runner `elasticps train` itself uses), quietly, with the
//! benchmark's transport settings and its nodes' logs under the run's directory
//! ([`run_train`]), or on the simulator ([`TrainSpec::sim_cmd`]). Its report becomes the one
//! [`RunResult`] of every benchmark (the numbers of `elasticps-report`'s analytics).

use std::path::Path;

use clap::Parser;
use elasticps_core::sync::SyncPolicy;
use elasticps_launch::args::{DataArgs, JobArgs, NetArgs, RunArgs};
use elasticps_launch::train::{TrainCmd, build_report, run_local};
use elasticps_report::analytics::{BalanceNumbers, RunNumbers};
use elasticps_report::{Report, ServerReport, WorkerReport};
use elasticps_sim::SimCmd;
use elasticps_sim::args::SimArgs;
use serde::Serialize;

use crate::Result;

/// One train job, typed: what `elasticps train` (or `elasticps sim`) would take as flags.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TrainSpec {
    /// The job (servers, workers, sync, optimizer, placement, stragglers, balance...).
    pub job: JobArgs,
    /// The model and schedule.
    pub data: DataArgs,
}

impl TrainSpec {
    /// The `elasticps train` flags of the spec (rendered, for the reports).
    pub fn flags(&self) -> Vec<String> {
        let mut f = self.job.to_flags();
        f.extend(self.data.to_flags());
        f
    }

    /// The simulated job of the spec, on the machine `sim`.
    pub fn sim_cmd(&self, sim: SimArgs) -> SimCmd {
        SimCmd { job: self.job.clone(), data: self.data.clone(), run: RunArgs::default(), sim }
    }
}

/// `elasticps sim`'s machine as its command line without flags describes it.
pub fn sim_defaults() -> SimArgs {
    #[derive(Parser)]
    struct Sim {
        #[command(flatten)]
        sim: SimArgs,
    }
    Sim::parse_from(["sim"]).sim
}

/// Runs the train job of `spec` with the transport settings `net`, without progress bars,
/// the nodes' logs in `dir/logs`; returns its report (writing it is the caller's choice).
pub async fn run_train(spec: &TrainSpec, net: &NetArgs, dir: &Path) -> Result<Report> {
    let train = TrainCmd {
        job: spec.job.clone(),
        data: spec.data.clone(),
        net: net.clone(),
        // Only the nodes' logs go to `dir`: run_local writes no report itself.
        run: RunArgs { quiet: true, report: Some(dir.to_path_buf()), ..RunArgs::default() },
    };
    let outcome = run_local(&train, &[]).await?;
    Ok(build_report(&train, &outcome)?)
}

/// One train job of a benchmark, measured (or why it failed).
#[derive(Clone, Debug, Default, Serialize)]
pub struct RunResult {
    /// The `elasticps train` flags of the run.
    pub flags: Vec<String>,
    /// Why it failed (`None`: it completed).
    pub error: Option<String>,
    /// Throughput, sync counters, accuracy.
    #[serde(flatten)]
    pub numbers: RunNumbers,
    /// The run lined up with its balance log (the benchmarks of a straggling server).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub balance: Option<BalanceNumbers>,
    /// Every server's counters (`bench sync`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub servers: Vec<ServerReport>,
    /// Every worker's numbers (`bench sync`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub workers: Vec<WorkerReport>,
}

/// A run reads as its numbers (`run.iters_per_s`).
impl std::ops::Deref for RunResult {
    type Target = RunNumbers;

    fn deref(&self) -> &RunNumbers {
        &self.numbers
    }
}

/// The balance numbers of a run that has none.
static NO_BALANCE: BalanceNumbers = BalanceNumbers::NONE;

impl RunResult {
    /// The numbers of a completed run of `flags`; `delayed` are the ranks a persistent
    /// straggler delays.
    pub fn of(report: &Report, flags: Vec<String>, delayed: &[u32]) -> Self {
        RunResult { flags, numbers: RunNumbers::of(report, delayed), ..RunResult::default() }
    }

    /// A run that failed with `error`.
    pub fn failed(flags: Vec<String>, error: String) -> Self {
        RunResult { flags, error: Some(error), ..RunResult::default() }
    }

    /// Its balance numbers ([`BalanceNumbers::NONE`] when it has none).
    pub fn balance(&self) -> &BalanceNumbers {
        self.balance.as_ref().unwrap_or(&NO_BALANCE)
    }
}

/// Runs `spec` in `dir` (a fresh one: no stale report or log of an earlier run), writes its
/// report there (`full`: with summary.md and the plots, else report.json alone).
pub async fn run_and_write(spec: &TrainSpec, net: &NetArgs, dir: &Path, full: bool) -> Result<Report> {
    use crate::error::Context as _;
    let _ = std::fs::remove_dir_all(dir);
    let report = run_train(spec, net, dir).await?;
    if full {
        elasticps_report::write(dir, &report)?;
    } else {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("report.json"), serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing {}", dir.join("report.json").display()))?;
    }
    Ok(report)
}

/// Runs `spec` in `dir` (its report.json and nodes' logs there) and measures it, with
/// every server's and worker's numbers; `delayed` are the ranks a persistent straggler
/// delays.
pub async fn measure(spec: &TrainSpec, net: &NetArgs, dir: &Path, delayed: &[u32]) -> Result<RunResult> {
    let report = run_and_write(spec, net, dir, false).await?;
    Ok(RunResult {
        servers: report.servers.clone(),
        workers: report.workers.clone(),
        ..RunResult::of(&report, spec.flags(), delayed)
    })
}

/// Every one of `keys` once per round, with its round: odd rounds go backwards, so no key
/// always runs first or last.
pub fn in_rounds<K: Clone>(keys: &[K], rounds: u32) -> Vec<(K, u32)> {
    let round = |r: u32| keys.iter().map(move |k| (k.clone(), r));
    (0..rounds)
        .flat_map(|r| -> Vec<(K, u32)> {
            if r % 2 == 1 { round(r).rev().collect() } else { round(r).collect() }
        })
        .collect()
}

/// Per group of runs (same `group`), whether each is the fastest of its group by `rate`
/// (the earlier one on a tie): the run a table shows.
pub fn fastest<T, G: PartialEq>(runs: &[T], group: impl Fn(&T) -> G, rate: impl Fn(&T) -> f64) -> Vec<bool> {
    (0..runs.len())
        .map(|i| {
            let g = group(&runs[i]);
            let best = (0..runs.len())
                .filter(|&j| group(&runs[j]) == g)
                .max_by(|&a, &b| rate(&runs[a]).total_cmp(&rate(&runs[b])).then(b.cmp(&a)));
            best == Some(i)
        })
        .collect()
}

/// A sync policy's name parsed (the plans keep them as names).
pub fn policy(name: &str) -> Result<SyncPolicy> {
    name.parse().map_err(|e: elasticps_core::CoreError| crate::BenchError::Flags(format!("{name}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spec_renders_the_flags_of_train_and_sim() {
        let spec = TrainSpec {
            job: JobArgs { servers: 3, sync: "ssp:2".parse().unwrap(), ..JobArgs::default() },
            data: DataArgs { iterations: Some(12), ..DataArgs::default() },
        };
        #[derive(Parser)]
        struct Train {
            #[command(flatten)]
            cmd: TrainCmd,
        }
        let t = Train::try_parse_from(std::iter::once("train".to_string()).chain(spec.flags())).unwrap().cmd;
        assert_eq!(TrainSpec { job: t.job, data: t.data }, spec);
        let sim = spec.sim_cmd(SimArgs { latency_us: 250.0, ..sim_defaults() });
        assert_eq!((sim.job.servers, sim.sim.latency_us, sim.sim.link_mbps), (3, 250.0, 1250.0));
    }

    #[test]
    fn rounds_alternate_and_the_fastest_of_each_group_is_shown() {
        assert_eq!(in_rounds(&["a", "b"], 3), [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]);
        let runs = [("a", 1.0), ("b", 2.0), ("a", 3.0), ("b", 2.0)];
        assert_eq!(fastest(&runs, |r| r.0, |r| r.1), [false, true, true, false]);
    }
}
