//! `elasticps bench sync`: the same job under every synchronization policy, side by side.
//!
//! Two workloads, each run once per policy on a real local cluster (scheduler, 2 servers,
//! 8 workers as processes, [`elasticps_launch::train::run_local`]), with ranks 0 and 4 delayed by
//! N(50 ms, 10 ms) per iteration on top of their compute time (FluentPS's stragglers):
//!
//! 1. `synthetic:resnet56` (ResNet-56's tensors, random gradients, `--compute-ms` of
//!    sleep per iteration): throughput and the papers' sync metrics (delayed pulls, hold
//!    time, sync events, lead). Every policy runs once per round (`--rounds`, forward then
//!    backward) and the table shows its fastest round, so that a burst of load from another
//!    process does not decide an ordering.
//! 2. The MLP on the bundled MNIST subset: test accuracy after a fixed number of
//!    iterations, and after a fixed wall-clock budget (the last evaluation of worker 0 at or
//!    before it; the budget is a share of the first policy's run, `bsp` by default).
//!
//! Numbers per run:
//!
//! - iterations/s = the iterations of every worker / the longest worker's training time
//!   (the job's throughput: how fast the fixed amount of work is done);
//! - worker rate = the sum of each worker's own iterations / its own training time (what a
//!   run that lets every worker go on for a fixed time would process);
//! - delayed pulls = the servers' `pulls_held`, summed (counted per block);
//! - mean / p99 hold of a delayed pull, sync events (`releases`), the largest lead.
//!
//! It writes `bench-sync.json` (every run), `bench-sync.md` (the table, the checks, the
//! targets) and `sync.png` ([`crate::plots::sync`]) into `--out`, and prints the Markdown.
//! The *checks* are orderings with wide margins that must hold on a noisy 2-core machine
//! (a failed check fails the command); the issue's *targets* are reported, met or missed,
//! with the measured ratio.

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::error::Context as _;
use clap::Args;
use elasticps_core::placement::PlacementKind;
use elasticps_core::stats::ratio;
use elasticps_core::sync::SyncPolicy;
use serde::Serialize;

use crate::checks::{Check, Target, checks_and_targets_markdown};
use crate::job::{RunResult, TrainSpec, fastest, in_rounds, measure, policy};
use crate::pipeline::{Bench, Written};
use crate::plots::sync as sync_plot;
use elasticps_launch::args::{DataArgs, JobArgs, NetArgs, StragglerSpec};
use elasticps_report::table::markdown_table;
use elasticps_train::{Jitter, ModelKind, Profile};

use crate::transient::{self, TransientOutput, TransientPlan};

/// Every policy of the default run, in table order.
pub const DEFAULT_POLICIES: &[&str] = &["bsp", "asp", "ssp:3", "lazy:3", "pssp:3:0.5", "dpssp:3", "adaptive"];
/// The synthetic half of `--quick`: what the checks need.
const QUICK_SYNTHETIC: &[&str] = &["bsp", "asp", "ssp:3", "lazy:3", "pssp:3:0.5"];
/// The MNIST half of `--quick`.
const QUICK_MNIST: &[&str] = &["bsp", "pssp:3:0.5"];

/// `elasticps bench sync`.
#[derive(Args, Clone, Debug)]
pub struct SyncBenchCmd {
    /// A short run for CI (about 1.5 minutes on 2 cores): fewer iterations, the synthetic
    /// half with bsp, asp, ssp:3, lazy:3 and pssp:3:0.5 only, the MNIST half with bsp and
    /// pssp:3:0.5, the transient scenario at 8 workers with bsp, ssp:3 and pssp:3:0.5.
    #[arg(long)]
    pub quick: bool,
    /// Policies to compare, comma-separated (default: bsp, asp, ssp:3, lazy:3, pssp:3:0.5,
    /// dpssp:3, adaptive). Checks that need a missing policy are skipped.
    #[arg(long, value_delimiter = ',', value_parser = parse_policy)]
    pub policies: Option<Vec<SyncPolicy>>,
    /// Iterations per worker of the synthetic ResNet-56 runs (default 60, quick 30; 0 skips
    /// them).
    #[arg(long)]
    pub synthetic_iterations: Option<u32>,
    /// Rounds of the synthetic half: every policy runs once per round, in turn (forward,
    /// then backward), and the table shows each policy's fastest round, so a burst of
    /// load from another process does not decide an ordering.
    #[arg(long, default_value_t = 2)]
    pub rounds: u32,
    /// Iterations per worker of the MNIST runs (default 210, quick 60; 0 skips MNIST).
    /// A worker's shard of the subset is 1,250 images, 40 batches of 32 whose last holds
    /// only 2 images, so every 40th iteration takes a noisy step; the defaults end 10 or 20
    /// iterations after one rather than right on it.
    #[arg(long)]
    pub mnist_iterations: Option<u32>,
    /// Compute time per iteration of the synthetic model, ms.
    #[arg(long, default_value_t = 20.0)]
    pub compute_ms: f64,
    /// Stragglers: RANKS:MEAN_MS:SD_MS.
    #[arg(long, default_value = "0,4:50:10")]
    pub worker_delay: StragglerSpec,
    /// Workers per job.
    #[arg(long, default_value_t = 8)]
    pub workers: u32,
    /// Servers per job.
    #[arg(long, default_value_t = 2)]
    pub servers: u32,
    /// Wall-clock budget of "accuracy after a fixed time", in seconds from the launch
    /// (default: half of the first MNIST run's last evaluation time).
    #[arg(long)]
    pub budget_s: Option<f64>,
    /// Worker 0 evaluates the MNIST model every this many iterations.
    #[arg(long, default_value_t = 20)]
    pub eval_every: u32,
    /// Write bench-sync.json, bench-sync.md, sync.png, each run's report.json and the
    /// nodes' logs here.
    #[arg(long, default_value = "reports/bench-sync")]
    pub out: PathBuf,
    /// Worker counts of the transient scenario, comma-separated (default 8,16; quick 8).
    #[arg(long, value_delimiter = ',')]
    pub transient_workers: Option<Vec<u32>>,
    /// Policies of the transient scenario (default: bsp, asp, ssp:3, ssp:6, lazy:3,
    /// pssp:3:0.5, dpssp:3; quick: bsp, ssp:3, pssp:3:0.5).
    #[arg(long, value_delimiter = ',', value_parser = parse_policy)]
    pub transient_policies: Option<Vec<SyncPolicy>>,
    /// Iterations per worker of the transient scenario (default 60, quick 40; 0 skips it).
    #[arg(long)]
    pub transient_iterations: Option<u32>,
    /// The transient stragglers: every worker slow by MS ms with probability P at every
    /// iteration (default 0.1:80, the issue's; quick 0.2:150, strong enough that the hold
    /// rule and not the CPU of a debug build on 2 cores decides the ordering).
    #[arg(long, value_name = "P:MS", value_parser = parse_jitter)]
    pub transient_jitter: Option<Jitter>,
    /// Compute time per iteration of the transient scenario, ms (default 10, quick 20).
    #[arg(long)]
    pub transient_compute_ms: Option<f64>,
    /// Transport settings of the clusters.
    #[command(flatten)]
    pub net: NetArgs,
}

fn parse_jitter(s: &str) -> Result<Jitter, String> {
    s.parse().map_err(|e: elasticps_train::TrainError| e.to_string())
}

fn parse_policy(s: &str) -> Result<SyncPolicy, String> {
    s.parse().map_err(|e: elasticps_core::CoreError| e.to_string())
}

/// The two halves of the benchmark.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Workload {
    /// `synthetic:resnet56`: throughput and sync metrics.
    Resnet56,
    /// The MLP on the MNIST subset: accuracy.
    Mnist,
}

impl Workload {
    /// Short name, for tables and file names.
    pub fn name(self) -> &'static str {
        match self {
            Workload::Resnet56 => "resnet56",
            Workload::Mnist => "mnist",
        }
    }
}

/// What is run, resolved from the flags.
#[derive(Clone, Debug, Serialize)]
struct Plan {
    quick: bool,
    workers: u32,
    servers: u32,
    worker_delay: String,
    #[serde(skip)]
    delay: StragglerSpec,
    compute_ms: f64,
    synthetic_policies: Vec<String>,
    synthetic_iterations: u32,
    rounds: u32,
    mnist_policies: Vec<String>,
    mnist_iterations: u32,
    eval_every: u32,
}

impl Plan {
    fn new(cmd: &SyncBenchCmd) -> crate::Result<Self> {
        let names = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let given = cmd.policies.as_ref().map(|p| p.iter().map(ToString::to_string).collect::<Vec<_>>());
        let (synthetic_policies, mnist_policies) = match (given, cmd.quick) {
            (Some(p), _) => (p.clone(), p),
            (None, true) => (names(QUICK_SYNTHETIC), names(QUICK_MNIST)),
            (None, false) => (names(DEFAULT_POLICIES), names(DEFAULT_POLICIES)),
        };
        let synthetic_iterations = cmd.synthetic_iterations.unwrap_or(if cmd.quick { 30 } else { 60 });
        let mnist_iterations = cmd.mnist_iterations.unwrap_or(if cmd.quick { 60 } else { 210 });
        crate::error::ensure_flags!((1..=20).contains(&cmd.rounds), "--rounds must be from 1 to 20");
        crate::error::ensure_flags!(!synthetic_policies.is_empty(), "--policies: nothing to compare");
        crate::error::ensure_flags!(cmd.workers > 0 && cmd.servers > 0, "--workers and --servers must be at least 1");
        crate::error::ensure_flags!(
            cmd.compute_ms.is_finite() && cmd.compute_ms >= 0.0,
            "--compute-ms must be non-negative"
        );
        if let Some(b) = cmd.budget_s {
            crate::error::ensure_flags!(b.is_finite() && b > 0.0, "--budget-s must be positive");
        }
        Ok(Plan {
            quick: cmd.quick,
            workers: cmd.workers,
            servers: cmd.servers,
            worker_delay: cmd.worker_delay.to_string(),
            delay: cmd.worker_delay.clone(),
            compute_ms: cmd.compute_ms,
            synthetic_policies: if synthetic_iterations == 0 { Vec::new() } else { synthetic_policies },
            synthetic_iterations,
            rounds: cmd.rounds,
            mnist_policies: if mnist_iterations == 0 { Vec::new() } else { mnist_policies },
            mnist_iterations,
            eval_every: cmd.eval_every,
        })
    }

    /// The transient scenario's plan, `None` to skip it.
    fn transient(cmd: &SyncBenchCmd) -> crate::Result<Option<TransientPlan>> {
        let names = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let policies = match (&cmd.transient_policies, cmd.quick) {
            (Some(p), _) => p.iter().map(ToString::to_string).collect(),
            (None, true) => names(transient::QUICK_POLICIES),
            (None, false) => names(transient::POLICIES),
        };
        let workers = cmd.transient_workers.clone().unwrap_or(if cmd.quick { vec![8] } else { vec![8, 16] });
        let iterations = cmd.transient_iterations.unwrap_or(if cmd.quick { 30 } else { 60 });
        let (jitter, compute_ms, margin) = if cmd.quick {
            (Jitter { p: 0.2, ms: 150.0 }, 20.0, transient::QUICK_MARGIN)
        } else {
            (Jitter { p: 0.1, ms: 80.0 }, 10.0, transient::FULL_MARGIN)
        };
        TransientPlan::new(
            workers,
            cmd.servers,
            policies,
            iterations,
            cmd.rounds,
            cmd.transient_compute_ms.unwrap_or(compute_ms),
            cmd.transient_jitter.unwrap_or(jitter),
            margin,
        )
    }

    /// The train job of one run.
    fn spec(&self, workload: Workload, sync: &str) -> crate::Result<TrainSpec> {
        let job = JobArgs {
            servers: self.servers,
            workers: self.workers,
            sync: policy(sync)?,
            placement: PlacementKind::Range,
            ..JobArgs::default()
        };
        let data = DataArgs { worker_delay: Some(self.delay.clone()), ..DataArgs::default() };
        let data = match workload {
            Workload::Resnet56 => DataArgs {
                model: ModelKind::Synthetic(Profile::ResNet56),
                compute_ms: self.compute_ms,
                iterations: Some(self.synthetic_iterations),
                ..data
            },
            Workload::Mnist => {
                DataArgs { iterations: Some(self.mnist_iterations), eval_every: self.eval_every, ..data }
            }
        };
        Ok(TrainSpec { job, data })
    }

    /// Every run, in order: (workload, policy, round). Odd rounds go backwards, so no
    /// policy always runs first or last.
    fn runs(&self) -> Vec<(Workload, String, u32)> {
        let synthetic = in_rounds(&self.synthetic_policies, self.rounds).into_iter();
        let mut out: Vec<_> = synthetic.map(|(p, round)| (Workload::Resnet56, p, round)).collect();
        out.extend(self.mnist_policies.iter().map(|p| (Workload::Mnist, p.clone(), 0)));
        out
    }
}

/// One run of the benchmark.
#[derive(Clone, Debug, Serialize)]
pub struct SyncRun {
    /// Which half.
    pub workload: Workload,
    /// The policy asked for.
    pub policy: String,
    /// Round of the run (the synthetic half runs every policy once per round).
    pub round: u32,
    /// True for the run the table shows: the fastest round of its workload and policy.
    pub chosen: bool,
    /// What it measured.
    #[serde(flatten)]
    pub run: RunResult,
}

/// What the runs measured (the body of bench-sync.json).
#[derive(Clone, Debug, Serialize)]
pub struct Body {
    plan: Plan,
    budget_s: Option<f64>,
    runs: Vec<SyncRun>,
    transient: Option<TransientOutput>,
}

/// `elasticps bench sync`, its plans resolved.
pub struct SyncBench {
    cmd: SyncBenchCmd,
    plan: Plan,
    transient: Option<TransientPlan>,
}

impl SyncBench {
    /// The plans of `cmd`.
    pub fn new(cmd: SyncBenchCmd) -> crate::Result<Self> {
        Ok(SyncBench { plan: Plan::new(&cmd)?, transient: Plan::transient(&cmd)?, cmd })
    }
}

impl Bench for SyncBench {
    const STEM: &'static str = "bench-sync";
    type Body = Body;

    fn out(&self) -> Option<&Path> {
        Some(&self.cmd.out)
    }

    async fn run(&self) -> crate::Result<Body> {
        let (plan, cmd) = (&self.plan, &self.cmd);
        let all = plan.runs();
        let mut runs = Vec::new();
        for (i, (workload, policy, round)) in all.iter().enumerate() {
            eprint!("bench sync: [{}/{}] {} {policy} ... ", i + 1, all.len(), workload.name());
            let t = Instant::now();
            let dir = run_dir(&cmd.out, *workload, policy, *round);
            let run = measure(&plan.spec(*workload, policy)?, &cmd.net, &dir, &plan.delay.ranks)
                .await
                .with_context(|| format!("{} under {policy}", workload.name()))?;
            let n = &run.numbers;
            eprintln!(
                "{:.1} s: {:.1} it/s, {} delayed pulls{}",
                t.elapsed().as_secs_f64(),
                n.iters_per_s,
                n.pulls_held,
                n.accuracy.map_or(String::new(), |a| format!(", accuracy {:.2}%", a * 100.0))
            );
            runs.push(SyncRun { workload: *workload, policy: policy.clone(), round: *round, chosen: false, run });
        }
        let transient = match &self.transient {
            Some(t) => Some(transient::run(t, &cmd.net, &cmd.out).await?),
            None => None,
        };
        choose(&mut runs);
        let budget_s = cmd.budget_s.or_else(|| default_budget(&runs));
        if let Some(b) = budget_s {
            for r in runs.iter_mut().filter(|r| r.workload == Workload::Mnist) {
                r.run.numbers.accuracy_at_budget = r.run.accuracy_at(b);
            }
        }
        Ok(Body { plan: plan.clone(), budget_s, runs, transient })
    }

    fn verdicts(&self, body: &Body) -> (Vec<Check>, Vec<Target>) {
        let (mut all_checks, mut all_targets) = (checks(&body.runs), targets(&body.runs));
        if let Some(t) = &body.transient {
            all_checks.extend(transient::checks(t));
            all_targets.extend(transient::targets(t));
        }
        (all_checks, all_targets)
    }

    fn markdown(&self, written: &Written<Body>) -> String {
        render(written)
    }

    fn plots(&self, written: &Written<Body>, dir: &Path) -> crate::Result<Vec<String>> {
        crate::pipeline::draw(dir, "sync.png", |png| sync_plot::draw(png, &plot_data(&written.body)))
    }
}

/// Half of the first MNIST run's last evaluation time (that run reaches it by definition).
fn default_budget(runs: &[SyncRun]) -> Option<f64> {
    let first = runs.iter().find(|r| r.workload == Workload::Mnist)?;
    let last = first.run.evals.iter().map(|e| e.t_s).fold(f64::NAN, f64::max);
    last.is_finite().then(|| (last * 0.5 * 10.0).round() / 10.0)
}

/// `OUT/runs/resnet56-pssp_3_0.5-r1`.
fn run_dir(out: &Path, workload: Workload, policy: &str, round: u32) -> PathBuf {
    out.join("runs").join(format!("{}-{}-r{round}", workload.name(), policy.replace(':', "_")))
}

/// Marks, for each workload and policy, its fastest round as the one the table shows.
fn choose(runs: &mut [SyncRun]) {
    let chosen = fastest(runs, |r| (r.workload, r.policy.clone()), |r| r.run.iters_per_s);
    runs.iter_mut().zip(chosen).for_each(|(r, c)| r.chosen = c);
}

/// The run the table shows for `workload` and `policy`.
fn find<'a>(runs: &'a [SyncRun], workload: Workload, policy: &str) -> Option<&'a SyncRun> {
    runs.iter().find(|r| r.workload == workload && r.policy == policy && r.chosen)
}

/// it/s of every round of `workload` and `policy`, in round order.
fn rounds_of(runs: &[SyncRun], workload: Workload, policy: &str) -> Vec<f64> {
    let mut v: Vec<(u32, f64)> = runs
        .iter()
        .filter(|r| r.workload == workload && r.policy == policy)
        .map(|r| (r.round, r.run.iters_per_s))
        .collect();
    v.sort_by_key(|x| x.0);
    v.into_iter().map(|x| x.1).collect()
}

/// The orderings that fail the command. Their margins leave room for a noisy machine:
/// see docs/BENCHMARKS.md ("Sync") for the spread they were chosen from.
fn checks(runs: &[SyncRun]) -> Vec<Check> {
    let syn = |p: &str| find(runs, Workload::Resnet56, p);
    let mut out = Vec::new();
    let held = |p: &str| syn(p).map(|r| r.run.pulls_held as f64);
    // Held pulls (counts of the servers, barely touched by timing noise): lazy and pssp
    // hold clearly fewer than raw SSP, SSP fewer than BSP, ASP none.
    for (p, factor) in [("lazy:3", 2.0), ("pssp:3:0.5", 1.3)] {
        out.push(Check::compare(
            format!("resnet56: delayed pulls of {p} x {factor} < those of ssp:3"),
            (held(p), held("ssp:3")),
            |a, b| format!("{a:.0} vs {b:.0} (ssp:3 / {p} = {})", ratio(b, a)),
            |a, b| a * factor < b,
        ));
    }
    out.push(Check::compare(
        "resnet56: delayed pulls of ssp:3 < those of bsp",
        (held("ssp:3"), held("bsp")),
        |a, b| format!("{a:.0} vs {b:.0}"),
        |a, b| a < b,
    ));
    out.push(Check {
        what: "resnet56: asp delays no pull".into(),
        measured: held("asp").map_or("not run".into(), |h| format!("{h:.0}")),
        pass: held("asp").map(|h| h == 0.0),
    });
    // Throughput. Persistent stragglers set the pace of every policy that bounds staleness
    // (docs/BENCHMARKS.md, "Sync"): only asp, where nobody waits, is far ahead of bsp (on
    // the worker rate); the relaxed policies must at least not be slower than bsp. The
    // quick form measured asp at 1.43x to 1.88x bsp over repeated runs on the 2-core CI
    // machine: 1.25x keeps the check meaningful and lets it hold on a noisy machine.
    let rate = |p: &str| syn(p).map(|r| r.run.worker_rate);
    out.push(Check::compare(
        "resnet56: worker rate of asp > 1.25 x bsp",
        (rate("asp"), rate("bsp")),
        |a, b| format!("{a:.1} vs {b:.1} it/s ({})", ratio(a, b)),
        |a, b| a > 1.25 * b,
    ));
    let it_s = |p: &str| syn(p).map(|r| r.run.iters_per_s);
    for p in ["ssp:3", "lazy:3", "pssp:3:0.5"] {
        out.push(Check::compare(
            format!("resnet56: iterations/s of {p} > {THROUGHPUT_FLOOR} x bsp"),
            (it_s(p), it_s("bsp")),
            |a, b| format!("{a:.1} vs {b:.1} ({})", ratio(a, b)),
            |a, b| a > THROUGHPUT_FLOOR * b,
        ));
    }
    // Every policy still trains the model (a sync bug that serves wrong values would not).
    let mnist: Vec<&SyncRun> = runs.iter().filter(|r| r.chosen && r.workload == Workload::Mnist).collect();
    let lowest =
        mnist.iter().filter_map(|r| r.run.accuracy.map(|a| (a, r.policy.as_str()))).min_by(|a, b| a.0.total_cmp(&b.0));
    out.push(Check {
        what: format!("mnist: every policy ends above {:.0}% test accuracy", MIN_ACCURACY * 100.0),
        measured: lowest.map_or("not run".into(), |(a, p)| format!("lowest {:.2}% ({p})", a * 100.0)),
        pass: if mnist.is_empty() {
            None
        } else {
            Some(mnist.iter().all(|r| r.run.accuracy.is_some_and(|a| a > MIN_ACCURACY)))
        },
    });
    out
}

/// Every MNIST run must end above this test accuracy (60 iterations reach about 85-90%).
const MIN_ACCURACY: f64 = 0.7;

/// The relaxed policies' iterations/s must be above this share of bsp's.
const THROUGHPUT_FLOOR: f64 = 0.9;

/// The targets, reported.
fn targets(runs: &[SyncRun]) -> Vec<Target> {
    let syn = |p: &str| find(runs, Workload::Resnet56, p);
    let mut out = Vec::new();
    let held = |p: &str| syn(p).map(|r| r.run.pulls_held as f64);
    let it_s = |p: &str| syn(p).map(|r| r.run.iters_per_s);
    for p in ["lazy:3", "pssp:3:0.5"] {
        out.push(Target::compare(
            format!("{p} delays at least 10x fewer pulls than ssp:3"),
            (held(p), held("ssp:3")),
            |a, b| format!("{} fewer ({a:.0} vs {b:.0})", ratio(b, a)),
            |a, b| a * 10.0 <= b,
        ));
    }
    for p in ["lazy:3", "pssp:3:0.5"] {
        out.push(Target::compare(
            format!("with the two stragglers, {p} runs at least 2x the iterations/s of bsp"),
            (it_s(p), it_s("bsp")),
            |a, b| format!("{} ({a:.1} vs {b:.1} it/s)", ratio(a, b)),
            |a, b| a >= 2.0 * b,
        ));
    }
    let bsp = find(runs, Workload::Mnist, "bsp").and_then(|r| r.run.accuracy);
    for r in runs.iter().filter(|r| r.chosen && r.workload == Workload::Mnist && r.policy != "bsp" && r.policy != "asp")
    {
        out.push(Target::compare(
            format!(
                "mnist after {} iterations: {} within 1 point of bsp's accuracy (not more than 1 point below)",
                r.run.iterations, r.policy
            ),
            (r.run.accuracy, bsp),
            |a, b| format!("{:.2}% vs {:.2}% ({:+.2} points)", a * 100.0, b * 100.0, (a - b) * 100.0),
            |a, b| a >= b - 0.01,
        ));
    }
    out
}

fn render(out: &Written<Body>) -> String {
    let headers = [
        "workload",
        "policy",
        "it/s",
        "it/s by round",
        "vs bsp",
        "worker rate it/s",
        "iter ms (delayed / other)",
        "delayed pulls",
        "vs ssp:3",
        "mean hold ms",
        "p99 hold ms",
        "sync events",
        "max lead",
        "acc @ budget",
        "acc @ iters",
        "acc, last 3 evals",
    ];
    let pct = |v: Option<f64>| v.map_or("-".to_string(), |a| format!("{:.2}%", a * 100.0));
    let rows: Vec<Vec<String>> = table_order(&out.body)
        .into_iter()
        .map(|r| {
            let bsp = find(&out.body.runs, r.workload, "bsp");
            let ssp = find(&out.body.runs, r.workload, "ssp:3");
            vec![
                r.workload.name().to_string(),
                r.policy.clone(),
                format!("{:.1}", r.run.iters_per_s),
                rounds_of(&out.body.runs, r.workload, &r.policy)
                    .iter()
                    .map(|v| format!("{v:.1}"))
                    .collect::<Vec<_>>()
                    .join(" / "),
                bsp.map_or("-".into(), |b| ratio(r.run.iters_per_s, b.run.iters_per_s)),
                format!("{:.1}", r.run.worker_rate),
                format!("{:.1} / {:.1}", r.run.straggler_iter_ms, r.run.other_iter_ms),
                r.run.pulls_held.to_string(),
                ssp.map_or("-".into(), |s| format!("{:.3}", r.run.pulls_held as f64 / s.run.pulls_held.max(1) as f64)),
                format!("{:.1}", r.run.hold_ms_mean),
                format!("{:.1}", r.run.hold_p99_ms),
                r.run.releases.to_string(),
                r.run.max_lead.to_string(),
                pct(r.run.accuracy_at_budget),
                pct(r.run.accuracy),
                pct(r.run.accuracy_last3),
            ]
        })
        .collect();
    let p = &out.body.plan;
    let mut s = out.heading("bench sync");
    s.push_str(&format!(
        "{} workers, {} servers, ranks {} delayed by N({} ms, {} ms) per iteration. resnet56: \
         synthetic:resnet56, {} ms compute, {} iterations per worker, {} rounds (the table shows each \
         policy's fastest). mnist: MLP 784-256-128-10 on \
         the MNIST subset, batch 32, adam 0.001, {} iterations per worker, worker 0 evaluates every {}; \
         budget {}.\n\n",
        p.workers,
        p.servers,
        p.worker_delay.split(':').next().unwrap_or(""),
        p.worker_delay.split(':').nth(1).unwrap_or(""),
        p.worker_delay.split(':').nth(2).unwrap_or(""),
        p.compute_ms,
        p.synthetic_iterations,
        p.rounds,
        p.mnist_iterations,
        p.eval_every,
        out.body.budget_s.map_or("none".into(), |b| format!("{b:.1} s after the launch")),
    ));
    s.push_str(&markdown_table(&headers, &rows));
    s.push_str(
        "\nit/s: every worker's iterations / the longest worker's training time (the job's \
         throughput). worker rate: the sum of each worker's iterations / its own training time. \
         delayed pulls: pulls the servers held (per block), summed; vs ssp:3 = delayed pulls / \
         those of ssp:3. sync events: releases of held pulls. acc @ budget: worker 0's last test \
         accuracy at or before the budget; acc @ iters: after the last iteration.\n",
    );
    if let Some(t) = &out.body.transient {
        s.push_str(&transient::render(t));
    }
    s.push_str(&checks_and_targets_markdown(&out.checks, &out.targets));
    s
}

/// The runs the table shows: the synthetic half, then MNIST, each in the plan's order.
fn table_order(out: &Body) -> Vec<&SyncRun> {
    let key = |r: &SyncRun| {
        let list = match r.workload {
            Workload::Resnet56 => &out.plan.synthetic_policies,
            Workload::Mnist => &out.plan.mnist_policies,
        };
        (r.workload == Workload::Mnist, list.iter().position(|p| *p == r.policy).unwrap_or(usize::MAX))
    };
    let mut rows: Vec<&SyncRun> = out.runs.iter().filter(|r| r.chosen).collect();
    rows.sort_by_key(|r| key(r));
    rows
}

fn plot_data(out: &Body) -> sync_plot::PlotData {
    let rows = table_order(out);
    let syn: Vec<&SyncRun> = rows.iter().copied().filter(|r| r.workload == Workload::Resnet56).collect();
    let mut policies: Vec<String> = Vec::new();
    for r in &rows {
        if !policies.contains(&r.policy) {
            policies.push(r.policy.clone());
        }
    }
    sync_plot::PlotData {
        policies,
        rates: syn.iter().map(|r| (r.policy.clone(), r.run.iters_per_s)).collect(),
        held: syn.iter().map(|r| (r.policy.clone(), r.run.pulls_held)).collect(),
        accuracy: rows
            .iter()
            .filter(|r| r.workload == Workload::Mnist)
            .map(|r| (r.policy.clone(), r.run.evals.iter().map(|e| (e.t_s, e.accuracy * 100.0)).collect()))
            .collect(),
        budget_s: out.budget_s,
        subtitle: format!(
            "{} workers, {} servers, ranks {} delayed",
            out.plan.workers,
            out.plan.servers,
            out.plan.worker_delay.split(':').next().unwrap_or("")
        ),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use elasticps_report::analytics::{EvalPoint, RunNumbers};

    fn numbers(it_s: f64, held: u64, acc: Option<f64>) -> RunNumbers {
        RunNumbers {
            iterations: 100,
            wall_s: 10.0,
            train_s: 9.0,
            iters_per_s: it_s,
            worker_rate: it_s,
            iter_ms_mean: 90.0,
            straggler_iter_ms: 95.0,
            other_iter_ms: 85.0,
            pulls: 1000,
            pulls_held: held,
            hold_ms_mean: 1.0,
            hold_p99_ms: 2.0,
            releases: 10,
            max_lead: 3,
            accuracy: acc,
            accuracy_at_budget: None,
            accuracy_last3: acc,
            evals: vec![
                EvalPoint { t_s: 1.0, iteration: 0, accuracy: 0.1 },
                EvalPoint { t_s: 5.0, iteration: 50, accuracy: 0.8 },
                EvalPoint { t_s: 9.0, iteration: 100, accuracy: acc.unwrap_or(0.9) },
            ],
        }
    }

    fn run(workload: Workload, policy: &str, it_s: f64, held: u64, acc: Option<f64>) -> SyncRun {
        let run = RunResult { numbers: numbers(it_s, held, acc), ..RunResult::default() };
        SyncRun { workload, policy: policy.into(), round: 0, chosen: true, run }
    }

    #[test]
    fn plans_build_train_jobs() {
        let cmd = SyncBenchCmd::try_parse_from_args(&["--quick"]);
        let plan = Plan::new(&cmd).unwrap();
        assert_eq!(plan.synthetic_policies, QUICK_SYNTHETIC);
        for (w, p, _) in plan.runs() {
            let t = plan.spec(w, &p).unwrap();
            assert_eq!(t.job.workers, 8);
            assert_eq!(t.job.sync.to_string(), p);
            assert_eq!(t.data.worker_delay.as_ref().map(|d| d.ranks.clone()), Some(vec![0, 4]));
        }
        let full = Plan::new(&SyncBenchCmd::try_parse_from_args(&[])).unwrap();
        assert_eq!(full.runs().len(), 3 * DEFAULT_POLICIES.len());
        assert_eq!(full.runs()[DEFAULT_POLICIES.len()].1, "adaptive");
        let none = Plan::new(&SyncBenchCmd::try_parse_from_args(&["--mnist-iterations", "0"])).unwrap();
        assert!(none.runs().iter().all(|(w, _, _)| *w == Workload::Resnet56));
        let only = SyncBenchCmd::try_parse_from_args(&["--synthetic-iterations", "0", "--mnist-iterations", "0"]);
        assert!(Plan::new(&only).unwrap().runs().is_empty());
        let t = Plan::transient(&only).unwrap().unwrap();
        assert_eq!((t.workers.clone(), t.policies.len(), t.jitter.as_str()), (vec![8, 16], 7, "0.1:80"));
        let quick = Plan::transient(&SyncBenchCmd::try_parse_from_args(&["--quick"])).unwrap().unwrap();
        assert_eq!((quick.workers.clone(), quick.policies.len(), quick.jitter.as_str()), (vec![8], 3, "0.2:150"));
        let skip = SyncBenchCmd::try_parse_from_args(&["--transient-iterations", "0"]);
        assert!(Plan::transient(&skip).unwrap().is_none());
    }

    #[test]
    fn checks_and_targets_decide_on_the_numbers() {
        let runs = vec![
            run(Workload::Resnet56, "bsp", 80.0, 1000, None),
            run(Workload::Resnet56, "asp", 100.0, 0, None),
            run(Workload::Resnet56, "ssp:3", 85.0, 900, None),
            run(Workload::Resnet56, "lazy:3", 90.0, 50, None),
            run(Workload::Resnet56, "pssp:3:0.5", 70.0, 800, None),
            run(Workload::Mnist, "bsp", 50.0, 10, Some(0.92)),
            run(Workload::Mnist, "pssp:3:0.5", 50.0, 10, Some(0.905)),
        ];
        let c = checks(&runs);
        let pass = |needle: &str| c.iter().find(|c| c.what.contains(needle)).and_then(|c| c.pass);
        assert_eq!(pass("lazy:3 x 2"), Some(true));
        assert_eq!(pass("pssp:3:0.5 x 1.3"), Some(false));
        assert_eq!(pass("ssp:3 < those of bsp"), Some(true));
        assert_eq!(pass("asp delays"), Some(true));
        assert_eq!(pass("worker rate of asp"), Some(false));
        assert_eq!(pass("of pssp:3:0.5 >"), Some(false));
        assert_eq!(pass("of lazy:3 >"), Some(true));
        assert_eq!(pass("mnist: every"), Some(true));
        let t = targets(&runs);
        assert_eq!(t[0].met, Some(true)); // lazy: 18x fewer
        assert_eq!(t[1].met, Some(false));
        assert_eq!(t.last().and_then(|t| t.met), Some(false)); // 1.5 points below
        // A missing policy skips, it does not fail.
        assert!(checks(&runs[..1]).iter().all(|c| c.pass.is_none()));
    }

    #[test]
    fn the_default_budget_is_half_the_first_mnist_run() {
        let r = run(Workload::Mnist, "bsp", 1.0, 0, Some(0.9));
        assert_eq!(default_budget(&[r]), Some(4.5));
    }

    #[test]
    fn renders_and_draws() {
        let runs = vec![
            run(Workload::Resnet56, "bsp", 80.0, 1000, None),
            run(Workload::Resnet56, "asp", 100.0, 0, None),
            run(Workload::Mnist, "bsp", 50.0, 10, Some(0.92)),
            run(Workload::Mnist, "asp", 50.0, 0, Some(0.93)),
        ];
        let out = Written {
            command: "elasticps bench sync".into(),
            machine: crate::machine::Machine::example(),
            took_s: 1.0,
            checks: checks(&runs),
            targets: targets(&runs),
            body: Body {
                plan: Plan::new(&SyncBenchCmd::try_parse_from_args(&["--quick"])).unwrap(),
                budget_s: Some(4.5),
                transient: Some(transient_output()),
                runs,
            },
        };
        let md = render(&out);
        assert!(md.contains("| resnet56 | asp"), "{md}");
        assert!(md.contains("### Transient stragglers"), "{md}");
        // 150 measured against a ceiling of 160: 94%.
        assert!(md.lines().any(|l| l.contains("| ssp:3 ") && l.contains(" 94% |")), "{md}");
        assert!(md.contains("SKIP") && md.contains("PASS"), "{md}");
        let dir = std::env::temp_dir().join(format!("elasticps-bench-sync-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let png = dir.join("sync.png");
        sync_plot::draw(&png, &plot_data(&out.body)).unwrap();
        let bytes = std::fs::read(&png).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A transient scenario of bsp, ssp:3 and pssp:3:0.5 at 8 workers, ssp:3 at 1.5x bsp
    /// and pssp:3:0.5 at 1.05x.
    fn transient_output() -> TransientOutput {
        let cmd = SyncBenchCmd::try_parse_from_args(&["--quick"]);
        let plan = Plan::transient(&cmd).unwrap().unwrap();
        let row = |policy: &str, it_s: f64, ceiling_it_s: f64| transient::TransientRun {
            workers: 8,
            policy: policy.into(),
            round: 0,
            chosen: true,
            run: run(Workload::Resnet56, policy, it_s, 100, None).run,
            requests_held: 10.0,
            comm_ms: Some(20.0),
            ceiling: Some(transient::Ceiling {
                flags: Vec::new(),
                latency_us: 5000.0,
                comm_ms: 20.0,
                iters_per_s: ceiling_it_s,
                pulls_held: 100,
                requests_held: 10.0,
                pulls: 1000,
            }),
            cpu: None,
        };
        TransientOutput {
            plan,
            runs: vec![row("bsp", 100.0, 110.0), row("ssp:3", 150.0, 160.0), row("pssp:3:0.5", 105.0, 160.0)],
            reference: vec![transient::ReferenceRow { policy: "bsp".into(), iters_per_s: 50.0, held_share: 0.5 }],
            took_s: 1.0,
        }
    }

    #[test]
    fn transient_checks_and_targets_decide_on_the_numbers() {
        let t = transient_output();
        let c = transient::checks(&t);
        let pass = |needle: &str| c.iter().find(|c| c.what.contains(needle)).and_then(|c| c.pass);
        assert_eq!(pass("of ssp:3 >"), Some(true));
        assert_eq!(pass("of pssp:3:0.5 >"), Some(false));
        assert_eq!(pass("asp delays"), None);
        let targets = transient::targets(&t);
        let first = &targets[0];
        assert_eq!(first.met, Some(false), "{first:?}");
        assert!(first.measured.contains("pssp:3:0.5 at 8 workers 66%"), "{first:?}");
        assert_eq!(targets[1].met, Some(false)); // ssp:3 at 1.5x, not 1.7x
    }

    impl SyncBenchCmd {
        fn try_parse_from_args(args: &[&str]) -> Self {
            #[derive(Parser)]
            struct Wrap {
                #[command(flatten)]
                cmd: SyncBenchCmd,
            }
            Wrap::try_parse_from(std::iter::once("sync").chain(args.iter().copied())).unwrap().cmd
        }
    }
}
