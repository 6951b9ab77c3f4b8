//! `elasticps bench straggler`: a straggling server, with and without the PSLD balancer.
//!
//! Every run is a real local cluster ([`elasticps_launch::train::run_local`]): the scheduler, 4
//! servers and 4 workers as processes, `synthetic:resnet50` (ResNet-50's 161 tensors,
//! 102 MB of parameters, random gradients, 20 ms of compute per iteration), bsp, sgd,
//! `bestfit` placement (every server holds a quarter of the bytes).
//!
//! **The network.** On loopback nothing limits a server but the CPU, and on 2 cores the
//! CPU is what the whole cluster shares: a "slow" server would slow everyone alike. So every
//! run caps *every* server's sockets at `--rate-mbps` R (each direction; 200 MB/s by
//! default, measured to make the caps, not the CPUs, the bottleneck: see the `uncapped`
//! reference row), and a straggler is a server with less than the others.
//!
//! Scenarios (server 1 straggles in each):
//!
//! - **a** bandwidth: server 1 capped at R/4;
//! - **b** interference: server 1 burns `--interference` times the CPU of each request
//!   (the default 32 is what makes a visible straggler under the cap: 4 is lost in the
//!   bandwidth waits);
//! - **c** skewed: `--placement skewed:1`, at least 70% of the bytes on server 1;
//! - **d** mid-run: as a, but every injection (all caps included) starts `--straggler-at`
//!   seconds in (about a third of the psld run), so the balancer must react to a change;
//! - **e** scale-out: as a, psld with `--max-servers 5` (the fifth server capped at R too);
//!   its static run is a's.
//!
//! Each scenario runs `static` (the initial placement stays) and `psld` (`--balance psld
//! --max-servers 4`); a `baseline` (every server at R, no straggler) runs once and is shared,
//! and so is an `uncapped` reference (no cap at all). Static runs are shorter than psld runs
//! (they are 2-4x slower per iteration and need no settling): the numbers are rates.
//!
//! Numbers per run, from every worker's per-iteration times (`WorkerReport::iter_ms`, with
//! its wall-clock start) lined up with the scheduler's [`BalanceLog`]:
//!
//! - **settle**: the end of the last migration or scaling event of the balancer, ignoring
//!   probe moves (a migration of less than [`PROBE_BYTES`] does not delay it) and the
//!   `kept` verdict on a scale-out (it changes nothing), on the
//!   workers' clock; for static runs, the straggler's start. Reported as the settling time:
//!   seconds from the straggler's start (the start of training, or `--straggler-at`).
//! - **it/s**: over the window from the settle (at least the straggler's start, and after
//!   every worker's first iteration) to the end, the sum over workers of (iterations ending
//!   in the window - 1) / (last end - first end), without the last iteration (it pushes
//!   without pulling): the job's throughput once balanced.
//! - **migrations**, bytes moved, freeze and request-to-handover times (p50 / max).
//! - **spike**: for every migration, the iterations of every worker that overlap its window
//!   `[at_s - total_ms, at_s]`; the largest one divided by that worker's median iteration
//!   time over the run (the issue's measure), and divided by the median of the worker's 3
//!   iterations just before the window that started after the straggler did (the
//!   disturbance the migration itself added: while the straggler is not yet balanced every
//!   iteration is slow, migration or not). The same around
//!   scale-out events (from `scale-out` to the server's `joined`).
//!
//! It writes `bench-straggler.json` (every run), `bench-straggler.md` (the table, checks and
//! targets), `straggler.png` ([`crate::plots::straggler`]) and, per run, the full report with
//! its `balance.png` under `runs/`. The check (fails the command): every run completes, and
//! in scenario a psld's it/s is above [`QUICK_MARGIN`] x static's. The issue's targets are
//! reported, met or missed.

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::error::Context as _;
use clap::Args;
use elasticps_core::stats::ratio;
use serde::Serialize;

use crate::checks::{Check, Target, checks_and_targets_markdown, ensure_no_check_failed};
use crate::job::run_train;
use crate::machine::{Machine, MachineWatch};
use crate::plots::straggler as straggler_plot;
use elasticps_core::stats::median;
use elasticps_launch::args::NetArgs;
use elasticps_report::summary::max;
use elasticps_report::table::markdown_table;
use elasticps_report::{BalanceLog, Report, WorkerReport};

/// psld must beat static in scenario a by this factor (the check). Nine quick runs on a
/// shared 2-core machine measured 2.15-2.69x, 2.45x with two busy loops beside it (65% of the
/// CPU to other processes): the runs are bound by the bandwidth caps, which other work does
/// not slow. What could fail it is a psld run that settles late, leaving few iterations.
pub const QUICK_MARGIN: f64 = 1.5;
/// Migrations smaller than this are the balancer's probes (a server's smallest block moved
/// to re-measure an uncertain server): they do not delay the settling time.
pub const PROBE_BYTES: u64 = 64 * 1024;

/// `elasticps bench straggler`.
#[derive(Args, Clone, Debug)]
pub struct StragglerBenchCmd {
    /// A short run for CI (under a minute on 2 cores): scenario a only, static and psld,
    /// fewer iterations; checks psld > QUICK_MARGIN x static.
    #[arg(long)]
    pub quick: bool,
    /// Scenarios to run, comma-separated letters: a (bandwidth), b (interference), c
    /// (skewed placement), d (mid-run), e (scale-out) [default: all; quick: a].
    #[arg(long, value_delimiter = ',')]
    pub scenarios: Option<Vec<Scenario>>,
    /// Bandwidth cap of every server, MB/s per direction (the straggler gets a quarter).
    #[arg(long, default_value_t = 200.0)]
    pub rate_mbps: f64,
    /// CPU factor of the straggler in scenario b.
    #[arg(long, default_value_t = 32.0)]
    pub interference: f64,
    /// When the straggler starts in scenario d, seconds after the servers get their blocks.
    #[arg(long, default_value_t = 8.0)]
    pub straggler_at: f64,
    /// Iterations per worker of every psld run (default: 24, d 30, e 30; quick 20).
    #[arg(long)]
    pub psld_iterations: Option<u32>,
    /// Iterations per worker of every static run (default: 10, d 20; quick 6).
    #[arg(long)]
    pub static_iterations: Option<u32>,
    /// Skip the baseline and uncapped reference runs (quick never runs them).
    #[arg(long)]
    pub no_baseline: bool,
    /// Write bench-straggler.json, bench-straggler.md, straggler.png and every run's report here.
    #[arg(long, default_value = "target/bench-straggler")]
    pub out: PathBuf,
    /// Transport settings of the clusters.
    #[command(flatten)]
    pub net: NetArgs,
}

/// Where server 1 straggles.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Scenario {
    /// a: server 1 at a quarter of the others' bandwidth.
    Bandwidth,
    /// b: server 1 with CPU interference.
    Interference,
    /// c: most blocks on server 1.
    Skewed,
    /// d: as a, from `--straggler-at` on.
    MidRun,
    /// e: as a, psld may add a fifth server.
    ScaleOut,
}

impl Scenario {
    /// Every scenario, in order.
    pub const ALL: [Scenario; 5] =
        [Scenario::Bandwidth, Scenario::Interference, Scenario::Skewed, Scenario::MidRun, Scenario::ScaleOut];

    /// The letter of the issue.
    pub fn letter(self) -> &'static str {
        match self {
            Scenario::Bandwidth => "a",
            Scenario::Interference => "b",
            Scenario::Skewed => "c",
            Scenario::MidRun => "d",
            Scenario::ScaleOut => "e",
        }
    }

    /// Letter and short name, for tables.
    pub fn label(self) -> &'static str {
        match self {
            Scenario::Bandwidth => "a bandwidth",
            Scenario::Interference => "b interference",
            Scenario::Skewed => "c skewed",
            Scenario::MidRun => "d mid-run",
            Scenario::ScaleOut => "e scale-out",
        }
    }

    /// Whether the issue sets targets for it (a, c, d).
    fn has_targets(self) -> bool {
        matches!(self, Scenario::Bandwidth | Scenario::Skewed | Scenario::MidRun)
    }
}

impl std::str::FromStr for Scenario {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Scenario::ALL
            .into_iter()
            .find(|c| c.letter() == s.trim())
            .ok_or_else(|| format!("unknown scenario {s:?}: expected a, b, c, d or e"))
    }
}

/// How a run balances (or what it is the reference of).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// No straggler, every server at R, static placement.
    Baseline,
    /// No cap, no straggler: shows that R, not the CPUs, limits the baseline.
    Uncapped,
    /// The straggler, static placement.
    Static,
    /// The straggler, `--balance psld`.
    Psld,
}

impl Mode {
    /// Short name.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Baseline => "baseline",
            Mode::Uncapped => "uncapped",
            Mode::Static => "static",
            Mode::Psld => "psld",
        }
    }
}

/// What is run, resolved from the flags.
#[derive(Clone, Debug, Serialize)]
struct Plan {
    quick: bool,
    workers: u32,
    servers: u32,
    model: String,
    compute_ms: f64,
    rate_mbps: f64,
    slow_mbps: f64,
    interference: f64,
    straggler_at: f64,
    scenarios: Vec<Scenario>,
    baseline: bool,
    psld_iterations: Option<u32>,
    static_iterations: Option<u32>,
}

impl Plan {
    fn new(cmd: &StragglerBenchCmd) -> crate::Result<Self> {
        let mut scenarios = cmd
            .scenarios
            .clone()
            .unwrap_or_else(|| if cmd.quick { vec![Scenario::Bandwidth] } else { Scenario::ALL.to_vec() });
        scenarios.sort();
        scenarios.dedup();
        crate::error::ensure_flags!(!scenarios.is_empty(), "--scenarios: nothing to run");
        crate::error::ensure_flags!(
            cmd.rate_mbps.is_finite() && cmd.rate_mbps >= 0.01,
            "--rate-mbps must be at least 0.01"
        );
        crate::error::ensure_flags!(
            cmd.interference.is_finite() && cmd.interference >= 1.0,
            "--interference must be >= 1"
        );
        crate::error::ensure_flags!(
            cmd.straggler_at.is_finite() && cmd.straggler_at >= 0.0,
            "--straggler-at must be >= 0"
        );
        for n in [cmd.psld_iterations, cmd.static_iterations].into_iter().flatten() {
            crate::error::ensure_flags!(n >= 4, "a run needs at least 4 iterations per worker");
        }
        Ok(Plan {
            quick: cmd.quick,
            workers: 4,
            servers: 4,
            model: "synthetic:resnet50".into(),
            compute_ms: 20.0,
            rate_mbps: cmd.rate_mbps,
            slow_mbps: cmd.rate_mbps / 4.0,
            interference: cmd.interference,
            straggler_at: cmd.straggler_at,
            scenarios,
            baseline: !cmd.quick && !cmd.no_baseline,
            psld_iterations: cmd.psld_iterations,
            static_iterations: cmd.static_iterations,
        })
    }

    /// Iterations per worker of a run.
    fn iterations(&self, scenario: Option<Scenario>, mode: Mode) -> u32 {
        match (mode, scenario) {
            (Mode::Baseline | Mode::Uncapped, _) => 16,
            (Mode::Static, s) => self.static_iterations.unwrap_or(match s {
                _ if self.quick => 6,
                Some(Scenario::MidRun) => 20,
                _ => 10,
            }),
            (Mode::Psld, s) => self.psld_iterations.unwrap_or(match s {
                _ if self.quick => 20,
                Some(Scenario::MidRun | Scenario::ScaleOut) => 30,
                _ => 24,
            }),
        }
    }

    /// When the straggler starts, seconds after the servers get their blocks.
    fn straggler_start(&self, scenario: Option<Scenario>) -> f64 {
        if scenario == Some(Scenario::MidRun) { self.straggler_at } else { 0.0 }
    }

    /// Every run, in order: the references, then each scenario's static and psld runs
    /// (alternating which goes first, so neither always follows the other). Scenario e's
    /// static run is a's when a runs.
    fn runs(&self) -> Vec<(Option<Scenario>, Mode)> {
        let mut out = Vec::new();
        if self.baseline {
            out.push((None, Mode::Baseline));
            out.push((None, Mode::Uncapped));
        }
        for (i, s) in self.scenarios.iter().enumerate() {
            let shares_static = *s == Scenario::ScaleOut && self.scenarios.contains(&Scenario::Bandwidth);
            let modes: &[Mode] = if shares_static {
                &[Mode::Psld]
            } else if i % 2 == 0 {
                &[Mode::Static, Mode::Psld]
            } else {
                &[Mode::Psld, Mode::Static]
            };
            out.extend(modes.iter().map(|m| (Some(*s), *m)));
        }
        out
    }

    /// The `elasticps train` flags of one run.
    fn train_flags(&self, scenario: Option<Scenario>, mode: Mode) -> Vec<String> {
        let s = |v: &str| v.to_string();
        let max_servers = if scenario == Some(Scenario::ScaleOut) && mode == Mode::Psld { 5 } else { self.servers };
        let mut f: Vec<String> = vec![
            s("--servers"),
            self.servers.to_string(),
            s("--workers"),
            self.workers.to_string(),
            // Spelled out, so that ELASTICPS_* variables of the shell do not change the job.
            s("--sync"),
            s("bsp"),
            s("--optimizer"),
            s("sgd"),
            s("--lr"),
            s("0.01"),
            s("--placement"),
            s(if scenario == Some(Scenario::Skewed) { "skewed:1" } else { "bestfit" }),
            s("--block-bytes"),
            (4 << 20).to_string(),
            s("--seed"),
            s("42"),
            s("--model"),
            self.model.clone(),
            s("--compute-ms"),
            self.compute_ms.to_string(),
            s("--batch-size"),
            s("32"),
            s("--data-seed"),
            s("7"),
            s("--iterations"),
            self.iterations(scenario, mode).to_string(),
            // An iteration takes seconds at most: a stuck run fails in 30 s, not 300.
            s("--request-timeout-s"),
            s("30"),
            s("--balance"),
            s(if mode == Mode::Psld { "psld" } else { "static" }),
            s("--max-servers"),
            max_servers.to_string(),
            s("--min-servers"),
            self.servers.to_string(),
            s("--straggler-at"),
            self.straggler_start(scenario).to_string(),
        ];
        if mode != Mode::Uncapped {
            let slow = matches!(scenario, Some(Scenario::Bandwidth | Scenario::MidRun | Scenario::ScaleOut))
                && mode != Mode::Baseline;
            let caps: Vec<String> = (0..max_servers)
                .map(|i| format!("{i}={}", if slow && i == 1 { self.slow_mbps } else { self.rate_mbps }))
                .collect();
            f.extend([s("--server-bandwidth"), caps.join(",")]);
        }
        if scenario == Some(Scenario::Interference) && mode != Mode::Baseline {
            f.extend([s("--server-interference"), format!("1={}", self.interference)]);
        }
        f
    }
}

/// The worst iteration around one event.
#[derive(Clone, Debug, Serialize)]
pub struct Spike {
    /// `migration` or `scale-out`.
    pub kind: &'static str,
    /// End of the event's window, seconds since the start of training.
    pub at_s: f64,
    /// The block moved (migrations).
    pub block: Option<u32>,
    /// The worker whose iteration it was.
    pub rank: u32,
    /// That iteration, ms.
    pub iter_ms: f64,
    /// The worker's median iteration time over the run, ms.
    pub median_ms: f64,
    /// `iter_ms / median_ms`.
    pub ratio: f64,
    /// `iter_ms` / the median of the worker's 3 iterations before the window, of those that
    /// started after the straggler did (NaN when there is none).
    pub local_ratio: f64,
}

/// A scaling event, on the workers' clock.
#[derive(Clone, Debug, Serialize)]
pub struct Scaling {
    /// Seconds since the start of training.
    pub at_s: f64,
    /// What happened.
    pub action: String,
    /// The server.
    pub server: Option<u32>,
    /// Why.
    pub reason: String,
}

/// Everything one run produced.
#[derive(Clone, Debug, Serialize)]
pub struct RunResult {
    /// The scenario (`None`: a reference run).
    pub scenario: Option<Scenario>,
    /// How it balanced.
    pub mode: Mode,
    /// The `elasticps train` flags of the run.
    pub flags: Vec<String>,
    /// Why it failed (`None`: it completed).
    pub error: Option<String>,
    /// Iterations per worker.
    pub iterations: u64,
    /// From the first spawn to the last exit, s.
    pub wall_s: f64,
    /// The longest worker's training time, s.
    pub train_s: f64,
    /// Every worker's iterations / the longest training time.
    pub run_iters_per_s: f64,
    /// When the measured window starts, seconds since the start of training.
    pub window_from_s: f64,
    /// Iterations (all workers) counted in the window.
    pub window_iterations: u64,
    /// it/s over the window (see the module docs); NaN when too few iterations are left.
    pub iters_per_s: f64,
    /// When the straggler started, seconds since the start of training (0 for the
    /// references and scenarios a-c, about `--straggler-at` for d).
    pub straggler_from_s: f64,
    /// psld: the end of the last non-probe migration or scaling event, seconds since the
    /// start of training (`None`: nothing moved).
    pub settled_at_s: Option<f64>,
    /// The balance log's own `settled_s` (every migration counts), seconds since the start of training.
    pub log_settled_at_s: Option<f64>,
    /// Settling time: from the straggler's start to the settle, s (0 for static runs).
    pub settling_s: Option<f64>,
    /// Successful migrations.
    pub migrations: usize,
    /// Failed migrations.
    pub failed_migrations: usize,
    /// Bytes moved by successful migrations.
    pub bytes_moved: u64,
    /// Block frozen, ms: p50 and max.
    pub freeze_ms: (f64, f64),
    /// Request to handover, ms: p50 and max.
    pub migration_ms: (f64, f64),
    /// Mean over workers of the median iteration time, ms.
    pub median_iter_ms: f64,
    /// The largest migration spike (by `ratio`).
    pub migration_spike: Option<Spike>,
    /// The largest migration spike by `local_ratio`.
    pub migration_spike_local: Option<Spike>,
    /// The largest scale-out spike.
    pub scale_out_spike: Option<Spike>,
    /// Scaling events.
    pub scaling: Vec<Scaling>,
    /// Servers at the end: (id, bytes owned) from the last load sample.
    pub final_bytes: Vec<(u32, u64)>,
    /// For the plot: worker 0's (end of iteration s, iteration ms).
    #[serde(skip)]
    pub series: Vec<(f64, f64)>,
    /// For the plot: migrations as (end s, source server).
    #[serde(skip)]
    pub migration_marks: Vec<(f64, u32)>,
}

impl RunResult {
    fn failed(scenario: Option<Scenario>, mode: Mode, flags: Vec<String>, error: String, wall_s: f64) -> Self {
        RunResult {
            scenario,
            mode,
            flags,
            error: Some(error),
            iterations: 0,
            wall_s,
            train_s: f64::NAN,
            run_iters_per_s: f64::NAN,
            window_from_s: f64::NAN,
            window_iterations: 0,
            iters_per_s: f64::NAN,
            straggler_from_s: f64::NAN,
            settled_at_s: None,
            log_settled_at_s: None,
            settling_s: None,
            migrations: 0,
            failed_migrations: 0,
            bytes_moved: 0,
            freeze_ms: (f64::NAN, f64::NAN),
            migration_ms: (f64::NAN, f64::NAN),
            median_iter_ms: f64::NAN,
            migration_spike: None,
            migration_spike_local: None,
            scale_out_spike: None,
            scaling: Vec::new(),
            final_bytes: Vec::new(),
            series: Vec::new(),
            migration_marks: Vec::new(),
        }
    }
}

/// Everything the benchmark wrote into bench-straggler.json.
#[derive(Clone, Debug, Serialize)]
struct Output {
    command: String,
    machine: Machine,
    plan: Plan,
    took_s: f64,
    runs: Vec<RunResult>,
    checks: Vec<Check>,
    targets: Vec<Target>,
}

/// Runs the benchmark, writes its files and prints the table.
pub async fn run(cmd: StragglerBenchCmd) -> crate::Result<()> {
    let plan = Plan::new(&cmd)?;
    std::fs::create_dir_all(&cmd.out).with_context(|| format!("creating {}", cmd.out.display()))?;
    let watch = MachineWatch::start();
    let started = Instant::now();
    let all = plan.runs();
    let mut runs = Vec::new();
    for (i, (scenario, mode)) in all.iter().enumerate() {
        let what = scenario.map_or_else(|| mode.name().to_string(), |s| format!("{} {}", s.label(), mode.name()));
        eprint!("bench straggler: [{}/{}] {what} ... ", i + 1, all.len());
        let t = Instant::now();
        let r = one_run(&plan, &cmd, *scenario, *mode).await;
        match &r.error {
            None => eprintln!(
                "{:.1} s: {:.2} it/s after {:.1} s, {} migrations{}",
                t.elapsed().as_secs_f64(),
                r.iters_per_s,
                r.window_from_s,
                r.migrations,
                if r.scaling.is_empty() { String::new() } else { format!(", {} scaling events", r.scaling.len()) }
            ),
            Some(e) => eprintln!("FAILED after {:.1} s: {e}", t.elapsed().as_secs_f64()),
        }
        runs.push(r);
    }
    let out = Output {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        machine: watch.finish(),
        checks: checks(&runs),
        targets: targets(&runs),
        took_s: started.elapsed().as_secs_f64(),
        plan,
        runs,
    };
    let md = render(&out);
    print!("{md}");
    let json = elasticps_report::to_json(&out)?;
    crate::write_results(&cmd.out, "bench-straggler", json, &md, "straggler.png", |png| {
        straggler_plot::draw(png, &plot_data(&out))
    })?;
    println!("\nwritten to {} (bench-straggler.json, bench-straggler.md, straggler.png, runs/)", cmd.out.display());
    ensure_no_check_failed(&out.checks)
}

/// `OUT/runs/a-psld`, `OUT/runs/baseline`.
fn run_dir(out: &Path, scenario: Option<Scenario>, mode: Mode) -> PathBuf {
    out.join("runs").join(match scenario {
        Some(s) => format!("{}-{}", s.letter(), mode.name()),
        None => mode.name().to_string(),
    })
}

/// One run; a failure is recorded in the result (the other runs still go ahead).
async fn one_run(plan: &Plan, cmd: &StragglerBenchCmd, scenario: Option<Scenario>, mode: Mode) -> RunResult {
    let flags = plan.train_flags(scenario, mode);
    let t = Instant::now();
    let dir = run_dir(&cmd.out, scenario, mode);
    match run_and_report(cmd, &flags, &dir).await {
        Ok(report) => measure(&report, scenario, mode, plan.straggler_start(scenario), flags),
        Err(e) => RunResult::failed(
            scenario,
            mode,
            flags,
            format!("{e:#} (logs in {})", dir.join("logs").display()),
            t.elapsed().as_secs_f64(),
        ),
    }
}

async fn run_and_report(cmd: &StragglerBenchCmd, flags: &[String], dir: &Path) -> crate::Result<Report> {
    // A fresh directory: no stale report or log of an earlier run.
    let _ = std::fs::remove_dir_all(dir);
    let report = run_train(flags, &cmd.net, dir).await?;
    elasticps_report::write(dir, &report)?;
    Ok(report)
}

/// One worker's iterations on the wall clock.
struct Iterations {
    rank: u32,
    /// Where iteration k starts (ms since the epoch): the end of k - 1.
    starts: Vec<f64>,
    /// Where it ends.
    ends: Vec<f64>,
    /// Its duration, ms.
    ms: Vec<f64>,
    median_ms: f64,
}

impl Iterations {
    fn of(w: &WorkerReport) -> Self {
        let ends = w.iteration_ends_unix_ms();
        let starts = std::iter::once(w.started_unix_ms).chain(ends.iter().copied()).take(ends.len()).collect();
        let ms: Vec<f64> = w.iter_ms.iter().map(|v| f64::from(*v)).collect();
        Iterations { rank: w.rank, starts, ends, median_ms: median(&ms).unwrap_or(f64::NAN), ms }
    }

    /// The longest iteration overlapping `[from, to]` (ms since the epoch), with the median of
    /// the (up to) 3 iterations that ended before `from` and started at or after `since`
    /// (the straggler's start: iterations before it say nothing about a migration's cost).
    fn worst_in(&self, from: f64, to: f64, since: f64) -> Option<(f64, f64)> {
        let overlapping = (0..self.ms.len()).filter(|&k| self.starts[k] < to && self.ends[k] > from);
        let worst = overlapping.map(|k| self.ms[k]).fold(f64::NAN, f64::max);
        if !worst.is_finite() {
            return None;
        }
        let before: Vec<f64> = (0..self.ms.len())
            .filter(|&k| self.ends[k] <= from && self.starts[k] >= since)
            .map(|k| self.ms[k])
            .collect::<Vec<_>>();
        let before = &before[before.len().saturating_sub(3)..];
        Some((worst, median(before).unwrap_or(f64::NAN)))
    }
}

/// The settle time (ms since the epoch) of a balance log: the end of the last migration of
/// at least [`PROBE_BYTES`] or scaling event (but a `kept` verdict); `None` if there was none.
pub fn settle_unix_ms(log: &BalanceLog) -> Option<f64> {
    let moves = log.migrations.iter().filter(|m| m.error.is_none() && m.bytes >= PROBE_BYTES).map(|m| m.at_s);
    // A `kept` verdict changes nothing.
    let scaling = log.scaling.iter().filter(|e| e.action != "kept").map(|e| e.at_s);
    let last = moves.chain(scaling).filter(|t| t.is_finite()).fold(f64::NAN, f64::max);
    last.is_finite().then_some(log.started_unix_ms + last * 1e3)
}

/// it/s of all workers over the iterations that end at or after `from` (ms since the
/// epoch): per worker (n - 1) / (last end - first end), summed; with the iterations counted.
/// A worker's last iteration stays out (it pushes without pulling: shorter). NaN when a
/// worker has fewer than 3 iterations there.
fn window_rate(iters: &[Iterations], from: f64) -> (f64, u64) {
    let mut rate = 0.0;
    let mut counted = 0u64;
    for w in iters {
        let all = &w.ends[..w.ends.len().saturating_sub(1)];
        let ends: Vec<f64> = all.iter().copied().filter(|e| *e >= from).collect();
        counted += ends.len() as u64;
        match (ends.first(), ends.last()) {
            (Some(a), Some(b)) if ends.len() >= 3 && b > a => rate += (ends.len() - 1) as f64 / ((b - a) / 1e3),
            _ => return (f64::NAN, counted),
        }
    }
    (rate, counted)
}

/// The numbers of one completed run (see the module docs); `bench hosts` measures its
/// runs with it too.
pub(crate) fn measure(
    report: &Report,
    scenario: Option<Scenario>,
    mode: Mode,
    straggler_at: f64,
    flags: Vec<String>,
) -> RunResult {
    let iters: Vec<Iterations> = report.workers.iter().map(Iterations::of).collect();
    // Time zero: the first worker's first iteration.
    let t0 = report.workers.iter().map(|w| w.started_unix_ms).fold(f64::INFINITY, f64::min);
    let rel = |unix_ms: f64| (unix_ms - t0) / 1e3;
    let straggler_from = t0 + straggler_at * 1e3;
    // Every worker's warm-up iteration stays out.
    let warm = iters.iter().filter_map(|w| w.ends.first().copied()).fold(t0, f64::max);
    let log = report.balance.as_ref();
    let settle = log.and_then(settle_unix_ms);
    let from = match mode {
        Mode::Psld => settle.unwrap_or(straggler_from).max(straggler_from),
        _ => straggler_from,
    }
    .max(warm);
    let (iters_per_s, window_iterations) = window_rate(&iters, from);
    let train_s = report.workers.iter().map(|w| w.train_s).fold(0.0, f64::max);
    let all: u64 = report.workers.iter().map(|w| w.iterations).sum();

    let mut result = RunResult::failed(scenario, mode, flags, String::new(), report.wall_s);
    result.error = None;
    result.iterations = report.iterations;
    result.train_s = train_s;
    result.run_iters_per_s = if train_s > 0.0 { all as f64 / train_s } else { f64::NAN };
    result.window_from_s = rel(from);
    result.window_iterations = window_iterations;
    result.iters_per_s = iters_per_s;
    result.straggler_from_s = if matches!(mode, Mode::Baseline | Mode::Uncapped) { 0.0 } else { straggler_at };
    result.median_iter_ms = {
        let m: Vec<f64> = iters.iter().map(|w| w.median_ms).collect();
        m.iter().sum::<f64>() / m.len().max(1) as f64
    };
    result.series = iters
        .iter()
        .find(|w| w.rank == 0)
        .map(|w| w.ends.iter().zip(&w.ms).map(|(e, ms)| (rel(*e), *ms)).collect())
        .unwrap_or_default();
    match mode {
        Mode::Psld => {
            result.settled_at_s = settle.map(rel);
            result.settling_s = settle.map(|s| (s - straggler_from).max(0.0) / 1e3);
        }
        Mode::Static => result.settling_s = Some(0.0),
        _ => {}
    }
    let Some(log) = log else { return result };
    let to_unix = |at_s: f64| log.started_unix_ms + at_s * 1e3;
    result.log_settled_at_s = log.settled_s.map(|s| rel(to_unix(s)));
    let ok: Vec<_> = log.migrations.iter().filter(|m| m.error.is_none()).collect();
    result.migrations = ok.len();
    result.failed_migrations = log.migrations.len() - ok.len();
    result.bytes_moved = ok.iter().map(|m| m.bytes).sum();
    let freeze: Vec<f64> = ok.iter().map(|m| m.freeze_ms).collect();
    let total: Vec<f64> = ok.iter().map(|m| m.total_ms).collect();
    result.freeze_ms = (median(&freeze).unwrap_or(f64::NAN), max(&freeze));
    result.migration_ms = (median(&total).unwrap_or(f64::NAN), max(&total));
    result.migration_marks = ok.iter().map(|m| (rel(to_unix(m.at_s)), m.from)).collect();
    result.final_bytes =
        log.timeline.last().map(|s| s.servers.iter().map(|p| (p.id, p.bytes)).collect()).unwrap_or_default();
    result.scaling = log
        .scaling
        .iter()
        .map(|e| Scaling {
            at_s: rel(to_unix(e.at_s)),
            action: e.action.clone(),
            server: e.server,
            reason: e.reason.clone(),
        })
        .collect();

    // Spikes: the worst iteration of any worker around each event.
    let worst = |kind: &'static str, block: Option<u32>, from: f64, to: f64| -> Option<Spike> {
        iters
            .iter()
            .filter_map(|w| {
                let (ms, before) = w.worst_in(from, to, straggler_from)?;
                Some(Spike {
                    kind,
                    at_s: rel(to),
                    block,
                    rank: w.rank,
                    iter_ms: ms,
                    median_ms: w.median_ms,
                    ratio: ms / w.median_ms,
                    local_ratio: ms / before,
                })
            })
            .max_by(|a, b| a.ratio.total_cmp(&b.ratio))
    };
    let spikes: Vec<Spike> = ok
        .iter()
        .filter_map(|m| worst("migration", Some(m.block), to_unix(m.at_s - m.total_ms / 1e3), to_unix(m.at_s)))
        .collect();
    result.migration_spike = spikes.iter().max_by(|a, b| a.ratio.total_cmp(&b.ratio)).cloned();
    result.migration_spike_local = spikes
        .iter()
        .filter(|s| s.local_ratio.is_finite())
        .max_by(|a, b| a.local_ratio.total_cmp(&b.local_ratio))
        .cloned();
    // A scale-out lasts from the request to the new server's registration (or 2 s).
    let scale_outs = log.scaling.iter().enumerate().filter(|(_, e)| e.action == "scale-out").filter_map(|(i, e)| {
        let joined = log.scaling[i + 1..].iter().find(|j| j.action == "joined").map_or(e.at_s + 2.0, |j| j.at_s);
        worst("scale-out", None, to_unix(e.at_s), to_unix(joined.max(e.at_s)))
    });
    result.scale_out_spike = scale_outs.max_by(|a, b| a.ratio.total_cmp(&b.ratio));
    result
}

fn find(runs: &[RunResult], scenario: Option<Scenario>, mode: Mode) -> Option<&RunResult> {
    runs.iter().find(|r| r.scenario == scenario && r.mode == mode && r.error.is_none())
}

/// The static run a scenario compares with (e uses a's when it has none of its own).
fn static_of(runs: &[RunResult], s: Scenario) -> Option<&RunResult> {
    find(runs, Some(s), Mode::Static)
        .or_else(|| (s == Scenario::ScaleOut).then(|| find(runs, Some(Scenario::Bandwidth), Mode::Static)).flatten())
}

/// `a / b` as `87%`.
fn percent(a: f64, b: f64) -> String {
    if a.is_finite() && b.is_finite() && b > 0.0 { format!("{:.0}%", a / b * 100.0) } else { "-".into() }
}

/// The checks that fail the command.
fn checks(runs: &[RunResult]) -> Vec<Check> {
    let mut out = Vec::new();
    let failed: Vec<String> = runs
        .iter()
        .filter(|r| r.error.is_some())
        .map(|r| r.scenario.map_or(r.mode.name().to_string(), |s| format!("{} {}", s.letter(), r.mode.name())))
        .collect();
    out.push(Check {
        what: "every run completes".into(),
        measured: if failed.is_empty() {
            format!("{} runs", runs.len())
        } else {
            format!("{} of {} failed: {}", failed.len(), runs.len(), failed.join(", "))
        },
        pass: Some(failed.is_empty()),
    });
    let ran = runs.iter().any(|r| r.scenario == Some(Scenario::Bandwidth));
    let (p, s) =
        (find(runs, Some(Scenario::Bandwidth), Mode::Psld), find(runs, Some(Scenario::Bandwidth), Mode::Static));
    // psld's rate after its settle; if the balancer moved again so late that no window is
    // left (a rebalance in the last iterations), its rate over the whole run instead, which
    // counts the unbalanced start against psld: the check only gets harder.
    let psld_rate = |p: &RunResult| {
        if p.iters_per_s.is_finite() {
            (p.iters_per_s, "")
        } else {
            (p.run_iters_per_s, " (whole run: settled too late)")
        }
    };
    out.push(Check {
        what: format!("a bandwidth: psld it/s > {QUICK_MARGIN} x static it/s"),
        measured: match (p, s) {
            (Some(p), Some(s)) => {
                let (rate, how) = psld_rate(p);
                format!("{rate:.2}{how} vs {:.2} it/s ({})", s.iters_per_s, ratio(rate, s.iters_per_s))
            }
            _ if ran => "a run failed".into(),
            _ => "not run".into(),
        },
        pass: match (p, s) {
            // NaN (no rate at all) fails.
            (Some(p), Some(s)) => Some(psld_rate(p).0 > QUICK_MARGIN * s.iters_per_s),
            _ if ran => Some(false),
            _ => None,
        },
    });
    out
}

/// The issue's targets, reported.
fn targets(runs: &[RunResult]) -> Vec<Target> {
    let mut out = Vec::new();
    let baseline = find(runs, None, Mode::Baseline);
    for s in Scenario::ALL.into_iter().filter(|s| s.has_targets()) {
        if !runs.iter().any(|r| r.scenario == Some(s)) {
            continue;
        }
        let (p, st) = (find(runs, Some(s), Mode::Psld), static_of(runs, s));
        out.push(Target {
            what: format!("{}: psld >= 1.8x the it/s of static", s.label()),
            measured: match (p, st) {
                (Some(p), Some(st)) => format!(
                    "{} ({:.2} vs {:.2} it/s)",
                    ratio(p.iters_per_s, st.iters_per_s),
                    p.iters_per_s,
                    st.iters_per_s
                ),
                _ => "a run failed".into(),
            },
            met: p.zip(st).map(|(p, st)| p.iters_per_s >= 1.8 * st.iters_per_s),
        });
        out.push(Target {
            what: format!("{}: psld >= 80% of the baseline's it/s", s.label()),
            measured: match (p, baseline) {
                (Some(p), Some(b)) => {
                    format!(
                        "{} ({:.2} vs {:.2} it/s)",
                        percent(p.iters_per_s, b.iters_per_s),
                        p.iters_per_s,
                        b.iters_per_s
                    )
                }
                (_, None) => "no baseline run".into(),
                _ => "a run failed".into(),
            },
            met: p.zip(baseline).map(|(p, b)| p.iters_per_s >= 0.8 * b.iters_per_s),
        });
    }
    let psld: Vec<&RunResult> = runs.iter().filter(|r| r.mode == Mode::Psld && r.error.is_none()).collect();
    let worst = psld
        .iter()
        .filter_map(|r| r.migration_spike.as_ref().map(|s| (r, s)))
        .max_by(|a, b| a.1.ratio.total_cmp(&b.1.ratio));
    out.push(Target {
        what: "no worker's iteration during a migration exceeds 2x its median iteration time".into(),
        measured: match worst {
            Some((r, s)) => format!(
                "worst {:.2}x ({}, worker {}, {:.0} ms vs median {:.0} ms, block {})",
                s.ratio,
                r.scenario.map_or("-", |s| s.label()),
                s.rank,
                s.iter_ms,
                s.median_ms,
                s.block.map_or("-".into(), |b| b.to_string())
            ),
            None => "no migration".into(),
        },
        met: worst.map(|(_, s)| s.ratio <= 2.0),
    });
    let local = psld
        .iter()
        .filter_map(|r| r.migration_spike_local.as_ref().map(|s| (r, s)))
        .max_by(|a, b| a.1.local_ratio.total_cmp(&b.1.local_ratio));
    out.push(Target {
        what: "(same, against the worker's 3 iterations just before the migration)".into(),
        measured: match local {
            Some((r, s)) => format!(
                "worst {:.2}x ({}, worker {}, {:.0} ms, block {})",
                s.local_ratio,
                r.scenario.map_or("-", |s| s.label()),
                s.rank,
                s.iter_ms,
                s.block.map_or("-".into(), |b| b.to_string())
            ),
            None => "no migration".into(),
        },
        met: local.map(|(_, s)| s.local_ratio <= 2.0),
    });
    let scale = psld.iter().filter_map(|r| r.scale_out_spike.as_ref()).max_by(|a, b| a.ratio.total_cmp(&b.ratio));
    if let Some(s) = scale {
        out.push(Target {
            what: "iteration time during a scale-out within 2x the median (reported like a migration)".into(),
            measured: format!(
                "worst {:.2}x (worker {}, {:.0} ms vs median {:.0} ms)",
                s.ratio, s.rank, s.iter_ms, s.median_ms
            ),
            met: Some(s.ratio <= 2.0),
        });
    }
    out
}

/// The rows in table order: references, then each scenario's static and psld.
fn table_order(out: &Output) -> Vec<&RunResult> {
    let mode_key = |m: Mode| match m {
        Mode::Baseline => 0,
        Mode::Uncapped => 1,
        Mode::Static => 2,
        Mode::Psld => 3,
    };
    let mut rows: Vec<&RunResult> = out.runs.iter().collect();
    rows.sort_by_key(|r| (r.scenario.is_some(), r.scenario, mode_key(r.mode)));
    rows
}

fn fixed(x: f64, decimals: usize) -> String {
    if x.is_finite() { format!("{x:.decimals$}") } else { "-".into() }
}

fn render(out: &Output) -> String {
    let headers = [
        "scenario",
        "mode",
        "it/s",
        "vs static",
        "vs baseline",
        "it/s whole run",
        "window from s",
        "settling s",
        "migrations",
        "MB moved",
        "freeze ms p50 / max",
        "handover ms p50 / max",
        "spike vs median",
        "spike vs before",
        "scale-out spike",
        "wall s",
    ];
    let baseline = find(&out.runs, None, Mode::Baseline);
    let rows: Vec<Vec<String>> = table_order(out)
        .into_iter()
        .map(|r| {
            let name = r.scenario.map_or("-".to_string(), |s| s.label().to_string());
            if r.error.is_some() {
                return vec![name, r.mode.name().into(), "failed (below)".into()];
            }
            let vs_static = match (r.mode, r.scenario) {
                (Mode::Psld, Some(s)) => {
                    static_of(&out.runs, s).map_or("-".into(), |st| ratio(r.iters_per_s, st.iters_per_s))
                }
                _ => "-".into(),
            };
            let vs_baseline = match (r.mode, baseline) {
                (Mode::Baseline, _) | (_, None) => "-".into(),
                (_, Some(b)) => percent(r.iters_per_s, b.iters_per_s),
            };
            let pair = |(a, b): (f64, f64), d: usize| {
                if r.migrations == 0 { "-".into() } else { format!("{} / {}", fixed(a, d), fixed(b, d)) }
            };
            vec![
                name,
                r.mode.name().into(),
                fixed(r.iters_per_s, 2),
                vs_static,
                vs_baseline,
                fixed(r.run_iters_per_s, 2),
                fixed(r.window_from_s, 1),
                match (r.mode, r.settling_s) {
                    (Mode::Psld, None) => "never moved".into(),
                    (_, s) => s.map_or("-".into(), |s| fixed(s, 1)),
                },
                if r.failed_migrations > 0 {
                    format!("{} (+{} failed)", r.migrations, r.failed_migrations)
                } else {
                    r.migrations.to_string()
                },
                if r.migrations == 0 { "-".into() } else { fixed(r.bytes_moved as f64 / 1e6, 1) },
                pair(r.freeze_ms, 1),
                pair(r.migration_ms, 0),
                r.migration_spike.as_ref().map_or("-".into(), |s| format!("{:.2}x", s.ratio)),
                r.migration_spike_local.as_ref().map_or("-".into(), |s| format!("{:.2}x", s.local_ratio)),
                r.scale_out_spike.as_ref().map_or("-".into(), |s| format!("{:.2}x", s.ratio)),
                fixed(r.wall_s, 1),
            ]
        })
        .collect();
    let p = &out.plan;
    let mut s = String::new();
    s.push_str("## bench straggler\n\n");
    s.push_str(&format!("`{}`\n\n", out.command));
    s.push_str(&out.machine.markdown(out.took_s));
    s.push_str(&format!(
        "{} workers, {} servers, {} ({} ms compute), bsp, sgd, bestfit placement. Every server's sockets \
         capped at {} MB/s each way (uncapped: none). Straggler: server 1 — a: capped at {} MB/s; b: CPU \
         interference x{}; c: `--placement skewed:1`; d: as a from {} s on (every cap starts then); e: as a, \
         psld may scale out to 5 servers. psld: `--balance psld --max-servers 4`. Iterations per worker: \
         static {}, psld {}{}.\n\n",
        p.workers,
        p.servers,
        p.model,
        p.compute_ms,
        p.rate_mbps,
        p.slow_mbps,
        p.interference,
        p.straggler_at,
        p.static_iterations
            .map_or_else(|| if p.quick { "6".to_string() } else { "10 (d 20)".to_string() }, |n| n.to_string()),
        p.psld_iterations
            .map_or_else(|| if p.quick { "20".to_string() } else { "24 (d, e 30)".to_string() }, |n| n.to_string()),
        if p.baseline { ", baseline and uncapped 16" } else { "" },
    ));
    s.push_str(&markdown_table(&headers, &rows));
    s.push_str(
        "\nit/s: the sum over workers of each worker's iterations per second over the window (from `window \
         from s`, seconds since the start of training, to the end): from the settle for psld, from the \
         straggler's start for static, after the warm-up iteration and without the last one (push only). \
         it/s whole run: every iteration / the longest training time. settling s: from the straggler's \
         start to the end of the last migration of at least 64 KiB or scaling event (probe moves of a \
         smallest block and the `kept` verdict of a scale-out do not count). spike vs median: the longest \
         iteration of any worker overlapping a migration / that worker's median iteration time; vs before: \
         / the median of its 3 iterations before the migration (since the straggler's start). Each run's \
         report.json, summary.md and balance.png are under runs/.\n",
    );
    s.push_str(&checks_and_targets_markdown(&out.checks, &out.targets));
    let failures: Vec<&RunResult> = out.runs.iter().filter(|r| r.error.is_some()).collect();
    if !failures.is_empty() {
        s.push_str("\nFailed runs:\n\n");
        for r in failures {
            s.push_str(&format!(
                "- {} {}: {}\n",
                r.scenario.map_or("-", |s| s.label()),
                r.mode.name(),
                r.error.as_deref().unwrap_or("")
            ));
        }
    }
    s
}

fn plot_data(out: &Output) -> straggler_plot::PlotData {
    let baseline = find(&out.runs, None, Mode::Baseline);
    straggler_plot::PlotData {
        subtitle: format!(
            "{} workers, {} servers, {}, bsp; every server capped at {} MB/s",
            out.plan.workers, out.plan.servers, out.plan.model, out.plan.rate_mbps
        ),
        baseline_it_s: baseline.map(|b| b.iters_per_s),
        uncapped_it_s: find(&out.runs, None, Mode::Uncapped).map(|b| b.iters_per_s),
        baseline_iter_ms: baseline.map(|b| b.median_iter_ms),
        scenarios: out
            .plan
            .scenarios
            .iter()
            .map(|s| {
                let run = |m: Mode| {
                    let r = if m == Mode::Static { static_of(&out.runs, *s) } else { find(&out.runs, Some(*s), m) };
                    r.map(|r| straggler_plot::RunSeries {
                        it_s: r.iters_per_s,
                        series: r.series.clone(),
                        migrations: r.migration_marks.clone(),
                        window_from_s: r.window_from_s,
                        scaling: r.scaling.iter().map(|e| (e.at_s, e.action.clone())).collect(),
                    })
                };
                straggler_plot::ScenarioData {
                    label: s.label().to_string(),
                    straggler_from_s: if *s == Scenario::MidRun { Some(out.plan.straggler_at) } else { None },
                    static_run: run(Mode::Static),
                    psld_run: run(Mode::Psld),
                }
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use elasticps_runtime::scheduler::{MigrationEvent, ScaleEvent};

    fn cmd(args: &[&str]) -> StragglerBenchCmd {
        #[derive(Parser)]
        struct Wrap {
            #[command(flatten)]
            cmd: StragglerBenchCmd,
        }
        Wrap::try_parse_from(std::iter::once("straggler").chain(args.iter().copied())).unwrap().cmd
    }

    fn parse(flags: Vec<String>) -> elasticps_launch::train::TrainCmd {
        crate::job::train_cmd(&flags).unwrap()
    }

    #[test]
    fn plans_parse_into_train_commands() {
        let quick = Plan::new(&cmd(&["--quick"])).unwrap();
        assert_eq!(
            quick.runs(),
            vec![(Some(Scenario::Bandwidth), Mode::Static), (Some(Scenario::Bandwidth), Mode::Psld)]
        );
        let t = parse(quick.train_flags(Some(Scenario::Bandwidth), Mode::Psld));
        assert_eq!((t.job.workers, t.job.servers, t.job.max_servers), (4, 4, Some(4)));
        assert_eq!(t.job.balance.to_string(), "psld");
        assert_eq!(t.job.server_bandwidth, vec![(0, 200.0), (1, 50.0), (2, 200.0), (3, 200.0)]);
        assert_eq!(t.data.iterations, Some(20));

        let full = Plan::new(&cmd(&["--scenarios", "e,a,b,c,d"])).unwrap();
        let runs = full.runs();
        assert_eq!(runs[..2], [(None, Mode::Baseline), (None, Mode::Uncapped)]);
        // e shares a's static run.
        assert_eq!(runs.iter().filter(|r| r.0 == Some(Scenario::ScaleOut)).count(), 1);
        assert_eq!(runs.len(), 2 + 4 * 2 + 1);
        let base = parse(full.train_flags(None, Mode::Baseline));
        assert!(base.job.server_bandwidth.iter().all(|(_, r)| *r == 200.0));
        assert!(base.job.server_interference.is_empty());
        assert!(parse(full.train_flags(None, Mode::Uncapped)).job.server_bandwidth.is_empty());
        let b = parse(full.train_flags(Some(Scenario::Interference), Mode::Static));
        assert_eq!(b.job.server_interference, vec![(1, 32.0)]);
        assert!(b.job.server_bandwidth.iter().all(|(_, r)| *r == 200.0));
        let c = parse(full.train_flags(Some(Scenario::Skewed), Mode::Static));
        assert_eq!(c.job.placement.to_string(), "skewed:1");
        let d = parse(full.train_flags(Some(Scenario::MidRun), Mode::Static));
        assert_eq!((d.job.straggler_at, d.data.iterations), (8.0, Some(20)));
        let e = parse(full.train_flags(Some(Scenario::ScaleOut), Mode::Psld));
        assert_eq!((e.job.max_servers, e.job.server_bandwidth.len()), (Some(5), 5));
        assert!(Plan::new(&cmd(&["--scenarios", "a", "--psld-iterations", "2"])).is_err());
        assert!("f".parse::<Scenario>().is_err());
    }

    /// A worker whose iterations last `ms`, starting at `start`.
    fn worker(rank: u32, start: f64, ms: &[f32]) -> WorkerReport {
        WorkerReport {
            rank,
            iterations: ms.len() as u64,
            train_s: ms.iter().map(|m| f64::from(*m)).sum::<f64>() / 1e3,
            started_unix_ms: start,
            iter_ms: ms.to_vec(),
            ..WorkerReport::default()
        }
    }

    fn migration(at_s: f64, bytes: u64, total_ms: f64) -> MigrationEvent {
        MigrationEvent { at_s, block: 7, from: 1, to: 2, bytes, freeze_ms: 2.0, total_ms, held: 0, error: None }
    }

    #[test]
    fn measures_windows_settling_and_spikes() {
        // The scheduler starts at 1,000,000 ms; training at +2 s. Four slow iterations of
        // 2 s, then 1 s ones, except the 6th (9 .. 10.5 s of training): 1.5 s.
        let t0 = 1_002_000.0;
        let mut ms = vec![2000.0f32; 4];
        ms.push(1000.0);
        ms.push(1500.0);
        ms.extend([1000.0; 10]);
        let workers = vec![worker(0, t0, &ms), worker(1, t0 + 100.0, &ms)];
        let log = BalanceLog {
            mode: "psld".into(),
            started_unix_ms: 1_000_000.0,
            // The real move ends at 10.0 s after the scheduler's start = +8 s of training;
            // a probe at 20 s does not delay the settle.
            migrations: vec![migration(10.0, 4 << 20, 400.0), migration(20.0, 2048, 1.0)],
            // The `kept` verdict at 19 s does not delay the settle either.
            scaling: vec![
                ScaleEvent { at_s: 12.0, action: "scale-out".into(), server: None, reason: "r".into() },
                ScaleEvent { at_s: 19.0, action: "kept".into(), server: Some(4), reason: "r".into() },
            ],
            timeline: Vec::new(),
            settled_s: Some(20.0),
        };
        let report = Report {
            config: serde_json::Value::Null,
            test_accuracy: f64::NAN,
            test_loss: f64::NAN,
            samples_per_sec: 0.0,
            wall_s: 20.0,
            iterations: 16,
            servers: Vec::new(),
            workers,
            curve: Vec::new(),
            balance: Some(log),
        };
        let r = measure(&report, Some(Scenario::Bandwidth), Mode::Psld, 0.0, Vec::new());
        assert!(r.error.is_none());
        // Settled by the scale-out event at 12 s = +10 s of training.
        assert!((r.settled_at_s.unwrap() - 10.0).abs() < 1e-9, "{:?}", r.settled_at_s);
        assert!((r.log_settled_at_s.unwrap() - 18.0).abs() < 1e-9);
        assert_eq!(r.settling_s, Some(10.0));
        // Each worker's ends from 10 s on but the last (10.5, ..., 19.5 s for worker 0): 1 it/s.
        assert!((r.iters_per_s - 2.0).abs() < 1e-9, "{}", r.iters_per_s);
        assert_eq!((r.migrations, r.bytes_moved), (2, (4 << 20) + 2048));
        // Migration 1 spans +7.6..+8.0 s: worker 0's 4th iteration (6..8 s, 2 s) against a
        // median of 1 s: 2x; against the 3 before it (2 s each): 1x.
        let spike = r.migration_spike.unwrap();
        assert_eq!((spike.iter_ms, spike.median_ms, spike.ratio), (2000.0, 1000.0, 2.0));
        let local = r.migration_spike_local.unwrap();
        assert!((local.local_ratio - 1.0).abs() < 1e-9, "{}", local.local_ratio);
        // The scale-out (+10 .. +12 s, no `joined`) overlaps the 1.5 s iteration.
        let s = r.scale_out_spike.unwrap();
        assert_eq!(s.iter_ms, 1500.0);

        // Static: the window starts after the warm-up iteration; nothing moved.
        let mut st = report.clone();
        st.balance = None;
        let r = measure(&st, Some(Scenario::Bandwidth), Mode::Static, 0.0, Vec::new());
        assert!((r.window_from_s - 2.1).abs() < 1e-9, "{}", r.window_from_s);
        assert_eq!(r.settling_s, Some(0.0));
        assert!(r.migration_spike.is_none());
        // Too few iterations left in the window: NaN, not a number from 1 iteration.
        let mut late = report.clone();
        late.balance.as_mut().unwrap().scaling[0].at_s = 22.5;
        assert!(measure(&late, Some(Scenario::Bandwidth), Mode::Psld, 0.0, Vec::new()).iters_per_s.is_nan());
    }

    #[test]
    fn checks_targets_and_rendering() {
        let ok = |scenario, mode, it_s: f64| {
            let mut r = RunResult::failed(scenario, mode, Vec::new(), String::new(), 10.0);
            r.error = None;
            r.iters_per_s = it_s;
            r
        };
        let a = Some(Scenario::Bandwidth);
        let mut runs = vec![ok(None, Mode::Baseline, 4.0), ok(a, Mode::Static, 1.5), ok(a, Mode::Psld, 3.5)];
        let c = checks(&runs);
        assert_eq!(c.iter().map(|c| c.pass).collect::<Vec<_>>(), vec![Some(true), Some(true)]);
        let t = targets(&runs);
        assert_eq!(t[0].met, Some(true)); // 2.33x
        assert_eq!(t[1].met, Some(true)); // 87%
        runs[2].iters_per_s = 2.0;
        assert_eq!(checks(&runs)[1].pass, Some(false));
        runs[2].iters_per_s = f64::NAN;
        assert_eq!(checks(&runs)[1].pass, Some(false));
        runs.push(RunResult::failed(Some(Scenario::Skewed), Mode::Psld, Vec::new(), "boom".into(), 1.0));
        let c = checks(&runs);
        assert_eq!(c[0].pass, Some(false));
        assert!(c[0].measured.contains("c psld"), "{}", c[0].measured);
        let out = Output {
            command: "elasticps bench straggler".into(),
            machine: Machine {
                nproc: 2,
                cpu: "cpu".into(),
                kernel: "6".into(),
                loadavg_before: "0.1 0 0".into(),
                loadavg_after: "1 0 0".into(),
                other_cpu_share: Some(0.05),
            },
            plan: Plan::new(&cmd(&[])).unwrap(),
            took_s: 1.0,
            checks: c,
            targets: targets(&runs),
            runs,
        };
        let md = render(&out);
        assert!(md.contains("| a bandwidth | psld     | -"), "{md}");
        assert!(md.contains("| a bandwidth | static   | 1.50"), "{md}");
        assert!(md.contains("FAIL every run completes") && md.contains("boom"), "{md}");
        let dir = std::env::temp_dir().join(format!("elasticps-bench-straggler-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let png = dir.join("straggler.png");
        straggler_plot::draw(&png, &plot_data(&out)).unwrap();
        assert_eq!(&std::fs::read(&png).unwrap()[..8], b"\x89PNG\r\n\x1a\n");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
