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
//! its wall-clock start) lined up with the scheduler's `BalanceLog`:
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
//!   time over the run (an earlier issue's measure). The same around scale-out events (from
//!   `scale-out` to the server's `joined`).
//! - **p99 around / median before** (the migration spike, [`MigrationSpike`]), per
//!   migration `m` whose span is `[s, e]` on the workers' clock (`e` = the scheduler's
//!   `at_s`, `s` = `e - total_ms`: from `Migrate` to the handover):
//!   - the window **around** it is `[s - AROUND_PAD_MS, e + AROUND_PAD_MS]`: every
//!     iteration of every worker that overlaps it (starts before its end and ends after its
//!     start), so the resends after the handover (the `Moved` answers, the first requests
//!     at the new owner) count too;
//!   - the window **before** it is the [`BEFORE_MS`] ending where the window around starts:
//!     every iteration of every worker that ends in `[s - AROUND_PAD_MS - BEFORE_MS,
//!     s - AROUND_PAD_MS)` and started at or after the straggler's start (while the
//!     straggler is not yet balanced every iteration is slow, migration or not);
//!   - the figure is the p99 (nearest rank) of the iterations around / the median of those
//!     before. Every worker's first iteration (warm-up: connections, first pull) and last
//!     (it pushes without pulling) stay out of both. A migration with no iteration before
//!     it (the first seconds of a run) has no figure. The target: at most
//!     [`SPIKE_TARGET`] for every migration of every psld run.
//!
//! It writes `bench-straggler.json` (every run), `bench-straggler.md` (the table, checks and
//! targets), `straggler.png` ([`crate::plots::straggler`]) and, per run, the full report with
//! its `balance.png` under `runs/`. The check (fails the command): every run completes, and
//! in scenario a psld's it/s is above [`QUICK_MARGIN`] x static's. The targets are
//! reported, met or missed.

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use elasticps_core::balance::BalanceMode;
use elasticps_core::optimizer::OptimizerKind;
use elasticps_core::placement::PlacementKind;
use elasticps_core::stats::ratio;
use serde::Serialize;

use crate::checks::{Check, Target, checks_and_targets_markdown};
use crate::job::{RunResult, TrainSpec, run_and_write};
use crate::pipeline::{Bench, Written};
use crate::plots::straggler as straggler_plot;
use elasticps_core::stats::median;
use elasticps_launch::args::{DataArgs, JobArgs, NetArgs};
use elasticps_report::Report;
use elasticps_report::analytics::{BalanceNumbers, Iterations, Window};
use elasticps_report::table::{fixed, markdown_table, percent};
use elasticps_train::{ModelKind, Profile};

/// psld must beat static in scenario a by this factor (the check). Nine quick runs on a
/// shared 2-core machine measured 2.15-2.69x, 2.45x with two busy loops beside it (65% of the
/// CPU to other processes): the runs are bound by the bandwidth caps, which other work does
/// not slow. What could fail it is a psld run that settles late, leaving few iterations.
pub const QUICK_MARGIN: f64 = 1.5;
pub use elasticps_report::analytics::PROBE_BYTES;

/// The window around a migration: its span widened by this much each side, ms (about one
/// balanced iteration: the resends after the handover land in it).
pub const AROUND_PAD_MS: f64 = 500.0;
/// The window before a migration: this long, ending where the window around starts, ms.
pub const BEFORE_MS: f64 = 3000.0;
/// The target: the p99 iteration around a migration at most this many times the
/// median before it.
pub const SPIKE_TARGET: f64 = 1.2;

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
    /// Iterations per worker of every psld run (default: 24, d 45, e 30; quick 20).
    #[arg(long)]
    pub psld_iterations: Option<u32>,
    /// Iterations per worker of every static run (default: 10, d 30, as the straggler starts
    /// at 8 s, some 24 iterations in on this machine; quick 6).
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
    /// How the run's window is chosen.
    fn window(self) -> Window {
        match self {
            Mode::Baseline | Mode::Uncapped => Window::Reference,
            Mode::Static => Window::Static,
            Mode::Psld => Window::Balanced,
        }
    }

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
                Some(Scenario::MidRun) => 30,
                _ => 10,
            }),
            (Mode::Psld, s) => self.psld_iterations.unwrap_or(match s {
                _ if self.quick => 20,
                Some(Scenario::MidRun) => 45,
                Some(Scenario::ScaleOut) => 30,
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

    /// The train job of one run.
    fn spec(&self, scenario: Option<Scenario>, mode: Mode) -> TrainSpec {
        let max_servers = if scenario == Some(Scenario::ScaleOut) && mode == Mode::Psld { 5 } else { self.servers };
        let slow = matches!(scenario, Some(Scenario::Bandwidth | Scenario::MidRun | Scenario::ScaleOut))
            && matches!(mode, Mode::Static | Mode::Psld);
        let rate = |i| if slow && i == 1 { self.slow_mbps } else { self.rate_mbps };
        let job = JobArgs {
            servers: self.servers,
            workers: self.workers,
            optimizer: OptimizerKind::Sgd,
            lr: 0.01,
            placement: if scenario == Some(Scenario::Skewed) {
                PlacementKind::Skewed(1)
            } else {
                PlacementKind::BestFit
            },
            balance: if mode == Mode::Psld { BalanceMode::Psld } else { BalanceMode::Static },
            max_servers: Some(max_servers),
            min_servers: Some(self.servers),
            straggler_at: self.straggler_start(scenario),
            server_bandwidth: if mode == Mode::Uncapped {
                Vec::new()
            } else {
                (0..max_servers).map(|i| (i, rate(i))).collect()
            },
            server_interference: if scenario == Some(Scenario::Interference) && mode != Mode::Baseline {
                vec![(1, self.interference as f32)]
            } else {
                Vec::new()
            },
            ..JobArgs::default()
        };
        let data = DataArgs {
            model: ModelKind::Synthetic(Profile::ResNet50),
            compute_ms: self.compute_ms,
            iterations: Some(self.iterations(scenario, mode)),
            // An iteration takes seconds at most: a stuck run fails in 30 s, not 300.
            request_timeout_s: 30,
            ..DataArgs::default()
        };
        TrainSpec { job, data }
    }
}

/// One run of the benchmark.
#[derive(Clone, Debug, Serialize)]
pub struct StragglerRun {
    /// The scenario (`None`: a reference run).
    pub scenario: Option<Scenario>,
    /// How it balanced.
    pub mode: Mode,
    /// What it measured.
    #[serde(flatten)]
    pub run: RunResult,
    /// Each migration's p99 iteration around it against the median before it.
    pub spikes: Vec<MigrationSpike>,
}

/// The iterations around one migration against those before it (the module docs define
/// the windows).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MigrationSpike {
    /// The block moved.
    pub block: u32,
    /// Old owner.
    pub from: u32,
    /// New owner.
    pub to: u32,
    /// Bytes sent (snapshot and delta).
    pub bytes: u64,
    /// The handover, seconds since the start of training.
    pub at_s: f64,
    /// From `Migrate` to the handover, ms.
    pub total_ms: f64,
    /// How long the block was frozen, ms.
    pub freeze_ms: f64,
    /// Pulls held at the old owner when the block froze (answered `Moved`, resent).
    pub held: u32,
    /// Iterations (all workers) overlapping the window around.
    pub around: usize,
    /// Their p99 (nearest rank), ms.
    pub p99_ms: f64,
    /// Iterations (all workers) in the window before.
    pub before: usize,
    /// Their median, ms (NaN when there is none).
    pub before_median_ms: f64,
    /// `p99_ms / before_median_ms` (NaN when there is nothing before).
    pub ratio: f64,
}

/// The `q` quantile of `values` by nearest rank (NaN when empty).
fn nearest_rank(values: &[f64], q: f64) -> f64 {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

/// Every successful migration of `report`'s balance log with its p99 iteration around it
/// and the median before it; the straggler starts `straggler_at` s after the first
/// worker's first iteration.
pub fn migration_spikes(report: &Report, straggler_at: f64) -> Vec<MigrationSpike> {
    let Some(log) = report.balance.as_ref() else { return Vec::new() };
    let iters: Vec<Iterations> = report.workers.iter().map(Iterations::of).collect();
    let t0 = report.workers.iter().map(|w| w.started_unix_ms).fold(f64::INFINITY, f64::min);
    let since = t0 + straggler_at * 1e3;
    // (start, end, ms) of every iteration but each worker's first and last.
    let all: Vec<(f64, f64, f64)> = iters
        .iter()
        .flat_map(|w| {
            let n = w.ms.len();
            (1..n.saturating_sub(1)).map(move |k| (w.starts[k], w.ends[k], w.ms[k]))
        })
        .collect();
    log.migrations
        .iter()
        .filter(|m| m.error.is_none())
        .map(|m| {
            let end = log.started_unix_ms + m.at_s * 1e3;
            let (from, to) = (end - m.total_ms - AROUND_PAD_MS, end + AROUND_PAD_MS);
            let around: Vec<f64> = all.iter().filter(|(s, e, _)| *s < to && *e > from).map(|i| i.2).collect();
            let before: Vec<f64> = all
                .iter()
                .filter(|(s, e, _)| *s >= since && *e < from && *e >= from - BEFORE_MS)
                .map(|i| i.2)
                .collect();
            let p99_ms = nearest_rank(&around, 0.99);
            let before_median_ms = median(&before).unwrap_or(f64::NAN);
            MigrationSpike {
                block: m.block,
                from: m.from,
                to: m.to,
                bytes: m.bytes,
                at_s: (end - t0) / 1e3,
                total_ms: m.total_ms,
                freeze_ms: m.freeze_ms,
                held: m.held,
                around: around.len(),
                p99_ms,
                before: before.len(),
                before_median_ms,
                ratio: p99_ms / before_median_ms,
            }
        })
        .collect()
}

/// The worst of `spikes` by ratio, and how many exceed [`SPIKE_TARGET`] of those with one.
fn worst_spike(spikes: &[MigrationSpike]) -> Option<(&MigrationSpike, usize, usize)> {
    worst_by(spikes, |s| s.ratio)
}

/// The item of `items` with the largest finite `ratio`, how many exceed [`SPIKE_TARGET`],
/// and how many have a finite one.
fn worst_by<T>(items: &[T], ratio: impl Fn(&T) -> f64) -> Option<(&T, usize, usize)> {
    let measured: Vec<&T> = items.iter().filter(|s| ratio(s).is_finite()).collect();
    let over = measured.iter().filter(|s| ratio(s) > SPIKE_TARGET).count();
    let n = measured.len();
    measured.into_iter().max_by(|a, b| ratio(a).total_cmp(&ratio(b))).map(|w| (w, over, n))
}

impl StragglerRun {
    /// The run lined up with its balance log.
    fn b(&self) -> &BalanceNumbers {
        self.run.balance()
    }
}

/// What the runs measured (the body of bench-straggler.json).
#[derive(Clone, Debug, Serialize)]
pub struct Body {
    plan: Plan,
    runs: Vec<StragglerRun>,
}

/// `elasticps bench straggler`, its plan resolved.
pub struct StragglerBench {
    cmd: StragglerBenchCmd,
    plan: Plan,
}

impl StragglerBench {
    /// The plan of `cmd`.
    pub fn new(cmd: StragglerBenchCmd) -> crate::Result<Self> {
        Ok(StragglerBench { plan: Plan::new(&cmd)?, cmd })
    }
}

impl Bench for StragglerBench {
    const STEM: &'static str = "bench-straggler";
    const RUNS_DIR: bool = true;
    type Body = Body;

    fn out(&self) -> Option<&Path> {
        Some(&self.cmd.out)
    }

    async fn run(&self) -> crate::Result<Body> {
        let all = self.plan.runs();
        let mut runs = Vec::new();
        for (i, (scenario, mode)) in all.iter().enumerate() {
            let what = scenario.map_or_else(|| mode.name().to_string(), |s| format!("{} {}", s.label(), mode.name()));
            eprint!("bench straggler: [{}/{}] {what} ... ", i + 1, all.len());
            let t = Instant::now();
            let r = self.one_run(*scenario, *mode).await;
            match &r.run.error {
                None => eprintln!(
                    "{:.1} s: {:.2} it/s after {:.1} s, {} migrations{}",
                    t.elapsed().as_secs_f64(),
                    r.b().iters_per_s,
                    r.b().window_from_s,
                    r.b().migrations,
                    if r.b().scaling.is_empty() {
                        String::new()
                    } else {
                        format!(", {} scaling events", r.b().scaling.len())
                    }
                ),
                Some(e) => eprintln!("FAILED after {:.1} s: {e}", t.elapsed().as_secs_f64()),
            }
            runs.push(r);
        }
        Ok(Body { plan: self.plan.clone(), runs })
    }

    fn verdicts(&self, body: &Body) -> (Vec<Check>, Vec<Target>) {
        (checks(&body.runs), targets(&body.runs))
    }

    fn markdown(&self, written: &Written<Body>) -> String {
        render(written)
    }

    fn plots(&self, written: &Written<Body>, dir: &Path) -> crate::Result<Vec<String>> {
        crate::pipeline::draw(dir, "straggler.png", |png| straggler_plot::draw(png, &plot_data(&written.body)))
    }
}

impl StragglerBench {
    /// One run; a failure is recorded in the result (the other runs still go ahead).
    async fn one_run(&self, scenario: Option<Scenario>, mode: Mode) -> StragglerRun {
        let spec = self.plan.spec(scenario, mode);
        let dir = run_dir(&self.cmd.out, scenario, mode);
        let at = self.plan.straggler_start(scenario);
        let (run, spikes) = match run_and_write(&spec, &self.cmd.net, &dir, true).await {
            Ok(report) => (measure(&report, spec.flags(), mode, at), migration_spikes(&report, at)),
            Err(e) => {
                (RunResult::failed(spec.flags(), format!("{e:#} (logs in {})", dir.join("logs").display())), Vec::new())
            }
        };
        StragglerRun { scenario, mode, run, spikes }
    }
}

/// `OUT/runs/a-psld`, `OUT/runs/baseline`.
fn run_dir(out: &Path, scenario: Option<Scenario>, mode: Mode) -> PathBuf {
    out.join("runs").join(match scenario {
        Some(s) => format!("{}-{}", s.letter(), mode.name()),
        None => mode.name().to_string(),
    })
}

/// The numbers of one completed run of `flags` (see the module docs); `bench hosts`
/// measures its runs with it too.
pub(crate) fn measure(report: &Report, flags: Vec<String>, mode: Mode, straggler_at: f64) -> RunResult {
    let balance = BalanceNumbers::of(report, mode.window(), straggler_at);
    RunResult { balance: Some(balance), ..RunResult::of(report, flags, &[]) }
}

fn find(runs: &[StragglerRun], scenario: Option<Scenario>, mode: Mode) -> Option<&StragglerRun> {
    runs.iter().find(|r| r.scenario == scenario && r.mode == mode && r.run.error.is_none())
}

/// The static run a scenario compares with (e uses a's when it has none of its own).
fn static_of(runs: &[StragglerRun], s: Scenario) -> Option<&StragglerRun> {
    find(runs, Some(s), Mode::Static)
        .or_else(|| (s == Scenario::ScaleOut).then(|| find(runs, Some(Scenario::Bandwidth), Mode::Static)).flatten())
}

/// The checks that fail the command.
fn checks(runs: &[StragglerRun]) -> Vec<Check> {
    let mut out = Vec::new();
    let failed: Vec<String> = runs
        .iter()
        .filter(|r| r.run.error.is_some())
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
    let psld_rate = |p: &StragglerRun| {
        if p.b().iters_per_s.is_finite() {
            (p.b().iters_per_s, "")
        } else {
            (p.run.iters_per_s, " (whole run: settled too late)")
        }
    };
    out.push(Check {
        what: format!("a bandwidth: psld it/s > {QUICK_MARGIN} x static it/s"),
        measured: match (p, s) {
            (Some(p), Some(s)) => {
                let (rate, how) = psld_rate(p);
                format!("{rate:.2}{how} vs {:.2} it/s ({})", s.b().iters_per_s, ratio(rate, s.b().iters_per_s))
            }
            _ if ran => "a run failed".into(),
            _ => "not run".into(),
        },
        pass: match (p, s) {
            // NaN (no rate at all) fails.
            (Some(p), Some(s)) => Some(psld_rate(p).0 > QUICK_MARGIN * s.b().iters_per_s),
            _ if ran => Some(false),
            _ => None,
        },
    });
    out
}

/// The targets, reported: each scenario's against static and the baseline, then
/// the iteration time around migrations and scale-outs.
fn targets(runs: &[StragglerRun]) -> Vec<Target> {
    let mut out = scenario_targets(runs);
    out.extend(spike_targets(runs));
    out
}

/// Each scenario's psld against its static run and against the uncapped baseline.
fn scenario_targets(runs: &[StragglerRun]) -> Vec<Target> {
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
                    ratio(p.b().iters_per_s, st.b().iters_per_s),
                    p.b().iters_per_s,
                    st.b().iters_per_s
                ),
                _ => "a run failed".into(),
            },
            met: p.zip(st).map(|(p, st)| p.b().iters_per_s >= 1.8 * st.b().iters_per_s),
        });
        out.push(Target {
            what: format!("{}: psld >= 80% of the baseline's it/s", s.label()),
            measured: match (p, baseline) {
                (Some(p), Some(b)) => {
                    format!(
                        "{} ({:.2} vs {:.2} it/s)",
                        percent(p.b().iters_per_s, b.b().iters_per_s),
                        p.b().iters_per_s,
                        b.b().iters_per_s
                    )
                }
                (_, None) => "no baseline run".into(),
                _ => "a run failed".into(),
            },
            met: p.zip(baseline).map(|(p, b)| p.b().iters_per_s >= 0.8 * b.b().iters_per_s),
        });
    }
    out
}

/// The worst iteration around a migration and during a scale-out, over every psld run.
fn spike_targets(runs: &[StragglerRun]) -> Vec<Target> {
    let mut out = Vec::new();
    let psld: Vec<&StragglerRun> = runs.iter().filter(|r| r.mode == Mode::Psld && r.run.error.is_none()).collect();
    let worst = psld
        .iter()
        .filter_map(|r| r.b().migration_spike.as_ref().map(|s| (r, s)))
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
    let all: Vec<(&StragglerRun, &MigrationSpike)> =
        psld.iter().flat_map(|r| r.spikes.iter().map(move |s| (*r, s))).collect();
    let worst = worst_by(&all, |(_, s)| s.ratio);
    let (over, measured) = worst.map_or((0, 0), |(_, over, n)| (over, n));
    out.push(Target {
        what: format!(
            "the p99 iteration around a migration <= {SPIKE_TARGET}x the median before it (every migration, \
             windows: +-{AROUND_PAD_MS:.0} ms around, {BEFORE_MS:.0} ms before)"
        ),
        measured: match worst {
            Some(((r, s), _, _)) => format!(
                "worst {:.2}x ({}, block {} from server {} to {}, {:.1} MB, at {:.1} s: p99 {:.0} ms of {} \
                 iterations vs median {:.0} ms of {}); {over} of {measured} migrations over {SPIKE_TARGET}x",
                s.ratio,
                r.scenario.map_or("-", |s| s.label()),
                s.block,
                s.from,
                s.to,
                s.bytes as f64 / 1e6,
                s.at_s,
                s.p99_ms,
                s.around,
                s.before_median_ms,
                s.before,
            ),
            None => "no migration with iterations before it".into(),
        },
        met: worst.map(|_| over == 0),
    });
    let scale = psld.iter().filter_map(|r| r.b().scale_out_spike.as_ref()).max_by(|a, b| a.ratio.total_cmp(&b.ratio));
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
fn table_order(out: &Body) -> Vec<&StragglerRun> {
    let mode_key = |m: Mode| match m {
        Mode::Baseline => 0,
        Mode::Uncapped => 1,
        Mode::Static => 2,
        Mode::Psld => 3,
    };
    let mut rows: Vec<&StragglerRun> = out.runs.iter().collect();
    rows.sort_by_key(|r| (r.scenario.is_some(), r.scenario, mode_key(r.mode)));
    rows
}

fn render(out: &Written<Body>) -> String {
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
        "p99 around / median before: worst (median, over)",
        "scale-out spike",
        "wall s",
    ];
    let baseline = find(&out.body.runs, None, Mode::Baseline);
    let rows: Vec<Vec<String>> = table_order(&out.body)
        .into_iter()
        .map(|r| {
            let name = r.scenario.map_or("-".to_string(), |s| s.label().to_string());
            if r.run.error.is_some() {
                return vec![name, r.mode.name().into(), "failed (below)".into()];
            }
            let vs_static = match (r.mode, r.scenario) {
                (Mode::Psld, Some(s)) => {
                    static_of(&out.body.runs, s).map_or("-".into(), |st| ratio(r.b().iters_per_s, st.b().iters_per_s))
                }
                _ => "-".into(),
            };
            let vs_baseline = match (r.mode, baseline) {
                (Mode::Baseline, _) | (_, None) => "-".into(),
                (_, Some(b)) => percent(r.b().iters_per_s, b.b().iters_per_s),
            };
            let pair = |(a, b): (f64, f64), d: usize| {
                if r.b().migrations == 0 { "-".into() } else { format!("{} / {}", fixed(a, d), fixed(b, d)) }
            };
            vec![
                name,
                r.mode.name().into(),
                fixed(r.b().iters_per_s, 2),
                vs_static,
                vs_baseline,
                fixed(r.run.iters_per_s, 2),
                fixed(r.b().window_from_s, 1),
                match (r.mode, r.b().settling_s) {
                    (Mode::Psld, None) => "never moved".into(),
                    (_, s) => s.map_or("-".into(), |s| fixed(s, 1)),
                },
                if r.b().failed_migrations > 0 {
                    format!("{} (+{} failed)", r.b().migrations, r.b().failed_migrations)
                } else {
                    r.b().migrations.to_string()
                },
                if r.b().migrations == 0 { "-".into() } else { fixed(r.b().bytes_moved as f64 / 1e6, 1) },
                pair(r.b().freeze_ms, 1),
                pair(r.b().migration_ms, 0),
                r.b().migration_spike.as_ref().map_or("-".into(), |s| format!("{:.2}x", s.ratio)),
                match worst_spike(&r.spikes) {
                    Some((w, over, n)) => {
                        let ratios: Vec<f64> = r.spikes.iter().map(|s| s.ratio).collect();
                        format!(
                            "{:.2}x ({:.2}x, {over}/{n} > {SPIKE_TARGET}x)",
                            w.ratio,
                            median(&ratios).unwrap_or(f64::NAN)
                        )
                    }
                    None => "-".into(),
                },
                r.b().scale_out_spike.as_ref().map_or("-".into(), |s| format!("{:.2}x", s.ratio)),
                fixed(r.run.wall_s, 1),
            ]
        })
        .collect();
    let p = &out.body.plan;
    let mut s = out.heading("bench straggler");
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
            .map_or_else(|| if p.quick { "6".to_string() } else { "10 (d 30)".to_string() }, |n| n.to_string()),
        p.psld_iterations
            .map_or_else(|| if p.quick { "20".to_string() } else { "24 (d 45, e 30)".to_string() }, |n| n.to_string()),
        if p.baseline { ", baseline and uncapped 16" } else { "" },
    ));
    s.push_str(&markdown_table(&headers, &rows));
    s.push_str(&format!(
        "\nit/s: the sum over workers of each worker's iterations per second over the window (from `window \
         from s`, seconds since the start of training, to the end): from the settle for psld, from the \
         straggler's start for static, after the warm-up iteration and without the last one (push only). \
         it/s whole run: every iteration / the longest training time. settling s: from the straggler's \
         start to the end of the last migration of at least 64 KiB or scaling event (probe moves of a \
         smallest block and the `kept` verdict of a scale-out do not count). spike vs median: the longest \
         iteration of any worker overlapping a migration / that worker's median iteration time. p99 around / \
         median before, per migration: the p99 (nearest rank) of every worker's iterations overlapping the \
         migration's span (request to handover) widened by {AROUND_PAD_MS:.0} ms each side / the median of \
         every worker's iterations ending in the {BEFORE_MS:.0} ms before that window (since the straggler's \
         start), each worker's first and last iteration left out; worst over the run (median over its \
         migrations, how many exceed {SPIKE_TARGET}x of those measured). Each run's report.json, summary.md \
         and balance.png are under runs/; every migration's figures are in bench-straggler.json \
         (`spikes`).\n",
    ));
    s.push_str(&checks_and_targets_markdown(&out.checks, &out.targets));
    let failures: Vec<&StragglerRun> = out.body.runs.iter().filter(|r| r.run.error.is_some()).collect();
    if !failures.is_empty() {
        s.push_str("\nFailed runs:\n\n");
        for r in failures {
            s.push_str(&format!(
                "- {} {}: {}\n",
                r.scenario.map_or("-", |s| s.label()),
                r.mode.name(),
                r.run.error.as_deref().unwrap_or("")
            ));
        }
    }
    s
}

fn plot_data(out: &Body) -> straggler_plot::PlotData {
    let baseline = find(&out.runs, None, Mode::Baseline);
    straggler_plot::PlotData {
        subtitle: format!(
            "{} workers, {} servers, {}, bsp; every server capped at {} MB/s",
            out.plan.workers, out.plan.servers, out.plan.model, out.plan.rate_mbps
        ),
        baseline_it_s: baseline.map(|b| b.b().iters_per_s),
        uncapped_it_s: find(&out.runs, None, Mode::Uncapped).map(|b| b.b().iters_per_s),
        baseline_iter_ms: baseline.map(|b| b.b().median_iter_ms),
        scenarios: out
            .plan
            .scenarios
            .iter()
            .map(|s| {
                let run = |m: Mode| {
                    let r = if m == Mode::Static { static_of(&out.runs, *s) } else { find(&out.runs, Some(*s), m) };
                    r.map(|r| straggler_plot::RunSeries {
                        it_s: r.b().iters_per_s,
                        series: r.b().series.clone(),
                        migrations: r.b().migration_marks.clone(),
                        window_from_s: r.b().window_from_s,
                        scaling: r.b().scaling.iter().map(|e| (e.at_s, e.action.clone())).collect(),
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

    fn cmd(args: &[&str]) -> StragglerBenchCmd {
        #[derive(Parser)]
        struct Wrap {
            #[command(flatten)]
            cmd: StragglerBenchCmd,
        }
        Wrap::try_parse_from(std::iter::once("straggler").chain(args.iter().copied())).unwrap().cmd
    }

    #[test]
    fn plans_build_train_jobs() {
        let quick = Plan::new(&cmd(&["--quick"])).unwrap();
        assert_eq!(
            quick.runs(),
            vec![(Some(Scenario::Bandwidth), Mode::Static), (Some(Scenario::Bandwidth), Mode::Psld)]
        );
        let t = quick.spec(Some(Scenario::Bandwidth), Mode::Psld);
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
        let base = full.spec(None, Mode::Baseline);
        assert!(base.job.server_bandwidth.iter().all(|(_, r)| *r == 200.0));
        assert!(base.job.server_interference.is_empty());
        assert!(full.spec(None, Mode::Uncapped).job.server_bandwidth.is_empty());
        let b = full.spec(Some(Scenario::Interference), Mode::Static);
        assert_eq!(b.job.server_interference, vec![(1, 32.0)]);
        assert!(b.job.server_bandwidth.iter().all(|(_, r)| *r == 200.0));
        let c = full.spec(Some(Scenario::Skewed), Mode::Static);
        assert_eq!(c.job.placement.to_string(), "skewed:1");
        let d = full.spec(Some(Scenario::MidRun), Mode::Static);
        assert_eq!((d.job.straggler_at, d.data.iterations), (8.0, Some(30)));
        let e = full.spec(Some(Scenario::ScaleOut), Mode::Psld);
        assert_eq!((e.job.max_servers, e.job.server_bandwidth.len()), (Some(5), 5));
        assert!(Plan::new(&cmd(&["--scenarios", "a", "--psld-iterations", "2"])).is_err());
        assert!("f".parse::<Scenario>().is_err());
    }

    #[test]
    fn migration_spikes_are_the_p99_around_against_the_median_before() {
        use elasticps_report::{BalanceLog, WorkerReport};
        use elasticps_runtime::scheduler::MigrationEvent;
        // Training starts at 1,000,000 ms, the scheduler 1 s earlier. Worker 0: 1 s
        // iterations, except the 7th (6 .. 7.5 s of training): 1.5 s. Worker 1: 1 s ones.
        let t0 = 1_000_000.0;
        let worker = |rank, ms: &[f32]| WorkerReport {
            rank,
            iterations: ms.len() as u64,
            started_unix_ms: t0,
            iter_ms: ms.to_vec(),
            ..WorkerReport::default()
        };
        let mut slow = vec![1000.0f32; 6];
        slow.push(1500.0);
        slow.extend([1000.0; 6]);
        let migration = |at_s, total_ms| MigrationEvent {
            at_s,
            block: 3,
            from: 1,
            to: 2,
            bytes: 1 << 20,
            freeze_ms: 5.0,
            total_ms,
            held: 1,
            error: None,
        };
        let log = BalanceLog {
            mode: "psld".into(),
            started_unix_ms: t0 - 1000.0,
            // Spans 6.8 .. 7.0 s of training, then 1.0 .. 1.2 s (nothing before it).
            migrations: vec![migration(8.0, 200.0), migration(2.2, 200.0)],
            ..BalanceLog::default()
        };
        let report = Report {
            config: serde_json::Value::Null,
            test_accuracy: f64::NAN,
            test_loss: f64::NAN,
            samples_per_sec: 0.0,
            wall_s: 20.0,
            iterations: 13,
            servers: Vec::new(),
            workers: vec![worker(0, &slow), worker(1, &[1000.0; 13])],
            curve: Vec::new(),
            balance: Some(log),
        };
        let s = migration_spikes(&report, 0.0);
        assert_eq!(s.len(), 2);
        // Around: 6.3 .. 7.5 s: worker 0's 6 .. 7.5 s, worker 1's 6 .. 7 and 7 .. 8 s; before:
        // the iterations ending in 3.3 .. 6.3 s but the first ones: 4, 5, 6 s each.
        assert_eq!((s[0].around, s[0].p99_ms, s[0].before, s[0].before_median_ms), (3, 1500.0, 6, 1000.0));
        assert!((s[0].ratio - 1.5).abs() < 1e-9 && (s[0].at_s - 7.0).abs() < 1e-9, "{:?}", s[0]);
        // The second: only the warm-up iterations end before it (left out).
        assert_eq!(s[1].before, 0);
        assert!(s[1].ratio.is_nan());
        let (w, over, n) = worst_spike(&s).unwrap();
        assert_eq!((w.block, over, n), (3, 1, 1));
        // The straggler from 5 s on: only the iterations that start after it count before.
        assert_eq!(migration_spikes(&report, 5.0)[0].before, 2);
        assert_eq!(nearest_rank(&[3.0, 1.0, 2.0], 0.99), 3.0);
        assert_eq!(nearest_rank(&(1..=200).map(f64::from).collect::<Vec<_>>(), 0.99), 198.0);
    }

    #[test]
    fn checks_targets_and_rendering() {
        let ok = |scenario, mode, it_s: f64| {
            let balance = BalanceNumbers { iters_per_s: it_s, ..BalanceNumbers::NONE };
            let run = RunResult { balance: Some(balance), ..RunResult::default() };
            StragglerRun { scenario, mode, run, spikes: Vec::new() }
        };
        let a = Some(Scenario::Bandwidth);
        let mut runs = vec![ok(None, Mode::Baseline, 4.0), ok(a, Mode::Static, 1.5), ok(a, Mode::Psld, 3.5)];
        let c = checks(&runs);
        assert_eq!(c.iter().map(|c| c.pass).collect::<Vec<_>>(), vec![Some(true), Some(true)]);
        let t = targets(&runs);
        assert_eq!(t[0].met, Some(true)); // 2.33x
        assert_eq!(t[1].met, Some(true)); // 87%
        runs[2].run.balance.as_mut().unwrap().iters_per_s = 2.0;
        assert_eq!(checks(&runs)[1].pass, Some(false));
        runs[2].run.balance.as_mut().unwrap().iters_per_s = f64::NAN;
        assert_eq!(checks(&runs)[1].pass, Some(false));
        let failed = RunResult::failed(Vec::new(), "boom".into());
        runs.push(StragglerRun { scenario: Some(Scenario::Skewed), mode: Mode::Psld, run: failed, spikes: Vec::new() });
        let c = checks(&runs);
        assert_eq!(c[0].pass, Some(false));
        assert!(c[0].measured.contains("c psld"), "{}", c[0].measured);
        let out = Written {
            command: "elasticps bench straggler".into(),
            machine: crate::machine::Machine::example(),
            took_s: 1.0,
            checks: c,
            targets: targets(&runs),
            body: Body { plan: Plan::new(&cmd(&[])).unwrap(), runs },
        };
        let md = render(&out);
        assert!(md.contains("| a bandwidth | psld     | -"), "{md}");
        assert!(md.contains("| a bandwidth | static   | 1.50"), "{md}");
        assert!(md.contains("FAIL every run completes") && md.contains("boom"), "{md}");
        let dir = std::env::temp_dir().join(format!("elasticps-bench-straggler-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let png = dir.join("straggler.png");
        straggler_plot::draw(&png, &plot_data(&out.body)).unwrap();
        assert_eq!(&std::fs::read(&png).unwrap()[..8], b"\x89PNG\r\n\x1a\n");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
