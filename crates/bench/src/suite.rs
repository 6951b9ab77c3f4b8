//! `elasticps bench sim --suite`: the balancer on seeded random simulated jobs (issue 32,
//! item 3).
//!
//! DESIGN §4: psld must never make a job slower than static placement, and a suite of
//! seeded random jobs checks it. Each scenario is drawn from one u64 seed
//! ([`Scenario::draw`], a seeded [`StdRng`]): a synthetic model (every
//! [`Profile`]), 3 to 1,000 servers (most of them small or medium clusters, so the suite's
//! wall time stays reasonable), 2 to min(4 x servers, 1,000) workers, blocks of 64 KiB,
//! 1 MiB or 4 MiB, a compute time, bsp or ssp:1..=4, and stragglers: none, one, or several
//! servers, each capped at 5-50% of the sim's link (`--server-bandwidth`) or slowed 2-10x
//! on its CPU (`--server-interference`), from the start, from mid-run (`--straggler-at`),
//! or for a while only (`--straggler-for`); and noisy links (`--jitter-us`) or not.
//!
//! Each scenario is simulated ([`elasticps_sim::simulate`], the jobs of `bench sim`) as
//! `--balance static`; as `--balance psld` with `--min-servers` the servers and
//! `--max-servers` 0 to 2 more; and, when it has a straggler, as the same job with no
//! straggler under static placement (the ceiling). Throughput is `bench sim`'s it/s
//! ([`SimRun::iters_per_s`](crate::sim::SimRun::iters_per_s)): every worker's iterations /
//! the longest worker's training time, in virtual time, so a job is as fast as its
//! slowest worker, and a run that slows one worker down counts.
//!
//! The checks (fail the command, naming the seeds): every run ends; psld >=
//! [`PSLD_FLOOR`] x static on every scenario; without a straggler, at most
//! [`HEALTHY_MAX_MIGRATIONS`] migrations; the median of psld / ceiling over the scenarios
//! with a straggler >= [`CEILING_MEDIAN`] (checked in the full form, with at least
//! [`CEILING_MIN_SCENARIOS`] such scenarios; otherwise reported as a target, see
//! [`CEILING_MIN_SCENARIOS`]).
//!
//! `--quick` runs [`QUICK_SEEDS`] (cheap scenarios chosen to cover every dimension) and
//! every seed of `crates/bench/suite-regressions.txt` ([`REGRESSIONS`]); the full form runs
//! `--seeds` seeds (default [`DEFAULT_SEEDS`]) from `--seed-start`. It writes
//! `bench-suite.json` (every scenario, run and flag) and `bench-suite.md` (the table, the
//! summary, the checks) into `--out`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use elasticps_core::balance::BalanceMode;
use elasticps_core::model::Partition;
use elasticps_core::placement::{Placement, PlacementKind, ServerId};
use elasticps_core::stats::median;
use elasticps_core::sync::SyncPolicy;
use elasticps_launch::args::JobArgs;
use elasticps_report::Report;
use elasticps_report::analytics::{mean_rate as worker_rate, second_half_rate};
use elasticps_report::table::{fixed, markdown_table};
use elasticps_sim::SimArgs;
use elasticps_train::synthetic::Profile;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::checks::{Check, Target};
use crate::error::{Context as _, ensure_flags, ensure_measured};
use crate::hosts::judged;
use crate::job::{TrainSpec, sim_defaults};
use crate::pipeline::{Bench, Written};
use crate::sim::{SimBenchCmd, job_spec, machine_flags};
use crate::{BenchError, Result};

/// The check on every scenario: psld's iterations/s >= this x static's (DESIGN §4: psld
/// must never make a job slower than static placement; 3% is the noise allowed).
pub const PSLD_FLOOR: f64 = 0.97;
/// The check over the scenarios with a straggler: the median of psld's iterations/s over
/// the ceiling's (the same job with no straggler, static) >= this.
pub const CEILING_MEDIAN: f64 = 0.85;
/// The median of psld / ceiling is checked only in the full form and over at least this
/// many scenarios with a straggler; otherwise it is reported as a target. `--quick` runs
/// too few, and its regression seeds are failures by selection, so their median is not
/// the suite's.
pub const CEILING_MIN_SCENARIOS: usize = 10;
/// The check without a straggler: psld makes at most this many migrations (a healthy job
/// is left alone).
pub const HEALTHY_MAX_MIGRATIONS: usize = 2;
/// Scenarios of the full form (`--seeds`' default).
pub const DEFAULT_SEEDS: u64 = 200;
/// The seeds of `--quick`: cheap scenarios (together about 20 s of a release build, 30 s
/// of a debug one, on 2 cores) that cover every model, no, one and several stragglers,
/// link and CPU stragglers, a straggler that appears and one that passes, noisy links,
/// bsp and ssp:1..=4, the three block sizes, 3 to 231 servers, 2 to 88 workers, and
/// scale-out allowed or not (picked from seeds 1..=400 by coverage per cost).
pub const QUICK_SEEDS: &[u64] = &[6, 9, 12, 17, 21, 33, 41, 44, 75, 94, 97, 106, 186, 249, 326, 351];
/// The regression list: one seed a line with a `#` comment saying what failed
/// (`crates/bench/suite-regressions.txt`, compiled in); `--quick` runs them all.
pub const REGRESSIONS: &str = include_str!("../suite-regressions.txt");

/// The block sizes a scenario draws from.
pub const BLOCK_SIZES: [usize; 3] = [64 << 10, 1 << 20, 4 << 20];
/// The workers' compute times (ms per iteration) a scenario draws from.
pub const COMPUTE_MS: [f64; 4] = [10.0, 20.0, 50.0, 100.0];
/// The link jitters (µs, the most a message is delayed) of the noisy scenarios.
pub const JITTERS_US: [u64; 3] = [100, 500, 2000];
/// Servers: from this many...
pub const MIN_SERVERS: u32 = 3;
/// ... to this many.
pub const MAX_SERVERS: u32 = 1000;
/// The most workers a scenario has.
pub const MAX_WORKERS: u32 = 1000;
/// Iterations are chosen so that the job with no straggler would run about this many
/// virtual seconds (long enough for the balancer's rounds, cool-downs and trials)...
pub const TARGET_VIRTUAL_S: f64 = 20.0;
/// ... with at least this many iterations ...
pub const MIN_ITERATIONS: u32 = 20;
/// ... at most this many ...
pub const MAX_ITERATIONS: u32 = 400;
/// ... and at most this cost ([`Layout::cost`] per iteration: worker-block rounds, weighed
/// by blocks per server) unless that leaves fewer than [`MIN_ITERATIONS`]; a scenario whose
/// [`MIN_ITERATIONS`] would cost more takes the next larger block size. 2 M is 1-5 s of
/// wall time per run in a release build.
pub const MAX_COST: u64 = 2_000_000;
/// A simulated server holding more blocks than this makes each request dearer to
/// simulate, about in proportion (measured: VGG-16 in 64 KiB blocks costs 35 µs of wall
/// time per worker-block round on 3 servers, 2,800 blocks each, and 3 µs on 19).
pub const CHEAP_BLOCKS_PER_SERVER: u64 = 100;
/// A simulated job that has not ended after this many virtual seconds failed.
const TIME_LIMIT_S: f64 = 3600.0;
/// Requests give up after this many (virtual) seconds: a 5% straggler's queue is long.
const REQUEST_TIMEOUT_S: u64 = 600;

/// How a straggler is slow.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Slowdown {
    /// Its link capped at this share of the sim's link (`--server-bandwidth`).
    Link {
        /// 0.05..=0.5.
        share: f64,
    },
    /// Its CPU this many times slower (`--server-interference`).
    Cpu {
        /// 2..=10.
        factor: f32,
    },
}

/// One slow server.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Straggler {
    /// The server.
    pub server: ServerId,
    /// How it is slow.
    pub slowdown: Slowdown,
}

/// When the stragglers are slow (all of a scenario's together).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Timing {
    /// From the start to the end.
    Start,
    /// From `at_s` after the servers get their blocks to the end (`--straggler-at`).
    Appears {
        /// Seconds (virtual).
        at_s: f64,
    },
    /// From `at_s` for `for_s` seconds (`--straggler-at`, `--straggler-for`).
    Passes {
        /// Seconds (virtual).
        at_s: f64,
        /// Seconds (virtual).
        for_s: f64,
    },
}

/// One seeded random job.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Scenario {
    /// The seed it was drawn from (also the sim's `--sim-seed`).
    pub seed: u64,
    /// The synthetic model.
    #[serde(serialize_with = "profile_name")]
    pub profile: Profile,
    /// Servers at the start.
    pub servers: u32,
    /// Servers psld may add (`--max-servers` = servers + this).
    pub extra_servers: u32,
    /// Workers.
    pub workers: u32,
    /// `--block-bytes`.
    pub block_bytes: usize,
    /// The sync policy.
    pub sync: SyncPolicy,
    /// `--compute-ms`.
    pub compute_ms: f64,
    /// `--jitter-us` (0: quiet links).
    pub jitter_us: u64,
    /// The slow servers (drawn among those the initial placement gives blocks).
    pub stragglers: Vec<Straggler>,
    /// When they are slow.
    pub timing: Timing,
    /// Iterations per worker.
    pub iterations: u32,
    /// The estimate the iterations were chosen from: seconds per iteration with no
    /// straggler.
    pub est_iter_s: f64,
}

fn profile_name<S: serde::Serializer>(p: &Profile, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(p.as_str())
}

/// The three runs of a scenario.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RunKind {
    /// The stragglers, `--balance static`.
    Static,
    /// The stragglers, `--balance psld`, scale-out up to [`Scenario::extra_servers`].
    Psld,
    /// No straggler, static: what psld could reach at best (only with a straggler).
    Ceiling,
}

/// A log-uniform integer in `lo..=hi`.
fn log_uniform(rng: &mut StdRng, lo: u32, hi: u32) -> u32 {
    let (a, b) = (f64::from(lo).ln(), (f64::from(hi) + 1.0).ln());
    (rng.random_range(a..b).exp().floor() as u32).clamp(lo, hi)
}

/// `x` rounded to `decimals` decimals.
fn round_to(x: f64, decimals: i32) -> f64 {
    let k = 10f64.powi(decimals);
    (x * k).round() / k
}

impl Scenario {
    /// The scenario of `seed`: one seed, one scenario (module docs for the dimensions).
    pub fn draw(seed: u64) -> Result<Self> {
        let mut rng = StdRng::seed_from_u64(seed);
        let profile = Profile::ALL[rng.random_range(0..Profile::ALL.len())];
        // Mostly small and medium clusters: they cost the suite little wall time.
        let servers = match rng.random_range(0..100) {
            0..55 => log_uniform(&mut rng, MIN_SERVERS, 16),
            55..90 => log_uniform(&mut rng, 17, 120),
            _ => log_uniform(&mut rng, 121, MAX_SERVERS),
        };
        let workers = log_uniform(&mut rng, 2, (4 * servers).min(MAX_WORKERS));
        let block_bytes = match rng.random_range(0..20) {
            0..6 => BLOCK_SIZES[0],
            6..12 => BLOCK_SIZES[1],
            _ => BLOCK_SIZES[2],
        };
        let compute_ms = COMPUTE_MS[rng.random_range(0..COMPUTE_MS.len())];
        let sync = if rng.random_bool(0.5) { SyncPolicy::Bsp } else { SyncPolicy::Ssp(rng.random_range(1..=4)) };
        let jitter_us = if rng.random_bool(0.35) { JITTERS_US[rng.random_range(0..JITTERS_US.len())] } else { 0 };
        let extra_servers = rng.random_range(0..=2);

        // A job whose shortest run would cost more than the budget takes the next larger
        // block size (a big model in 64 KiB blocks is drawn with few workers, many servers).
        let mut block_bytes = block_bytes;
        let mut layout = Layout::new(profile, block_bytes, servers)?;
        while layout.cost(workers) * u64::from(MIN_ITERATIONS) > MAX_COST
            && let Some(larger) = BLOCK_SIZES.iter().copied().find(|b| *b > block_bytes)
        {
            block_bytes = larger;
            layout = Layout::new(profile, block_bytes, servers)?;
        }
        let loaded: Vec<ServerId> = (0..servers).filter(|s| layout.held[*s as usize] > 0).collect();
        let est_iter_s = estimate_iter_s(profile, workers, &layout.held, compute_ms);
        let by_time = (TARGET_VIRTUAL_S / est_iter_s).round() as u64;
        let by_cost = MAX_COST / layout.cost(workers).max(1);
        let iterations = by_time.min(by_cost).min(u64::from(MAX_ITERATIONS)).max(u64::from(MIN_ITERATIONS)) as u32;
        let duration_s = f64::from(iterations) * est_iter_s;

        let count = match rng.random_range(0..20) {
            0..6 => 0,
            6..13 => 1,
            _ => rng.random_range(2..=(servers / 4).clamp(2, 8)),
        };
        let count = (count as usize).min(loaded.len());
        let picked = rand::seq::index::sample(&mut rng, loaded.len(), count);
        let mut stragglers: Vec<Straggler> = picked
            .iter()
            .map(|i| {
                let slowdown = if rng.random_bool(0.75) {
                    Slowdown::Link { share: round_to(rng.random_range(0.05..=0.5), 2) }
                } else {
                    Slowdown::Cpu { factor: round_to(rng.random_range(2.0..=10.0), 1) as f32 }
                };
                Straggler { server: loaded[i], slowdown }
            })
            .collect();
        stragglers.sort_by_key(|s| s.server);
        let at = |rng: &mut StdRng, from: f64, to: f64| round_to(rng.random_range(from..to) * duration_s, 1).max(0.1);
        let timing = match (count, rng.random_range(0..20)) {
            (0, _) | (_, 0..12) => Timing::Start,
            (_, 12..17) => Timing::Appears { at_s: at(&mut rng, 0.15, 0.5) },
            _ => Timing::Passes { at_s: at(&mut rng, 0.1, 0.3), for_s: at(&mut rng, 0.2, 0.4) },
        };
        Ok(Scenario {
            seed,
            profile,
            servers,
            extra_servers,
            workers,
            block_bytes,
            sync,
            compute_ms,
            jitter_us,
            stragglers,
            timing,
            iterations,
            est_iter_s,
        })
    }

    /// Whether the scenario has a straggler (then its ceiling is run).
    pub fn straggled(&self) -> bool {
        !self.stragglers.is_empty()
    }

    /// The runs of the scenario, in order.
    pub fn runs(&self) -> Vec<RunKind> {
        let mut runs = vec![RunKind::Static, RunKind::Psld];
        if self.straggled() {
            runs.push(RunKind::Ceiling);
        }
        runs
    }

    /// The train job of `run`.
    pub fn spec(&self, run: RunKind) -> TrainSpec {
        let mut spec = job_spec(self.workers, self.servers, self.profile, self.iterations);
        let link = sim_defaults().link_mbps;
        let slow = run != RunKind::Ceiling;
        let injected = |f: &dyn Fn(&Straggler) -> Option<(u32, f64)>| -> Vec<(u32, f64)> {
            if slow { self.stragglers.iter().filter_map(f).collect() } else { Vec::new() }
        };
        let server_bandwidth = injected(&|s| match s.slowdown {
            Slowdown::Link { share } => Some((s.server, round_to(share * link, 3))),
            Slowdown::Cpu { .. } => None,
        });
        let server_interference = injected(&|s| match s.slowdown {
            Slowdown::Cpu { factor } => Some((s.server, f64::from(factor))),
            Slowdown::Link { .. } => None,
        })
        .into_iter()
        .map(|(s, f)| (s, f as f32))
        .collect();
        let straggler_at = match self.timing {
            Timing::Appears { at_s } | Timing::Passes { at_s, .. } if slow => at_s,
            _ => 0.0,
        };
        let psld = run == RunKind::Psld;
        spec.job = JobArgs {
            block_bytes: self.block_bytes,
            sync: self.sync,
            balance: if psld { BalanceMode::Psld } else { BalanceMode::Static },
            max_servers: psld.then_some(self.servers + self.extra_servers),
            min_servers: psld.then_some(self.servers),
            server_bandwidth,
            server_interference,
            straggler_at,
            ..spec.job
        };
        spec.data.compute_ms = self.compute_ms;
        spec.data.request_timeout_s = REQUEST_TIMEOUT_S;
        spec
    }

    /// The simulated machine of `run`.
    pub fn machine(&self, run: RunKind) -> SimArgs {
        let straggler_for_s = match self.timing {
            Timing::Passes { for_s, .. } if run != RunKind::Ceiling => Some(for_s),
            _ => None,
        };
        SimArgs {
            sim_seed: self.seed,
            jitter_us: self.jitter_us,
            straggler_for_s,
            time_limit_s: TIME_LIMIT_S,
            ..sim_defaults()
        }
    }

    /// The `elasticps sim` flags of `run`.
    pub fn flags(&self, run: RunKind) -> Vec<String> {
        let mut flags = self.spec(run).flags();
        flags.extend(machine_flags(&self.machine(run)));
        flags
    }

    /// What a simulation of one run costs, about ([`Layout::cost`] x iterations).
    pub fn cost(&self) -> Result<u64> {
        Ok(Layout::new(self.profile, self.block_bytes, self.servers)?.cost(self.workers) * u64::from(self.iterations))
    }

    /// The stragglers in a table cell: `-`, `#4 link 12%`, or `3: link 8-40%, cpu x5.0`;
    /// with when, if not from the start.
    pub fn stragglers_cell(&self) -> String {
        let mut s = match self.stragglers.as_slice() {
            [] => return "-".into(),
            [one] => match one.slowdown {
                Slowdown::Link { share } => format!("#{} link {:.0}%", one.server, share * 100.0),
                Slowdown::Cpu { factor } => format!("#{} cpu x{factor:.1}", one.server),
            },
            many => {
                let shares: Vec<f64> = many
                    .iter()
                    .filter_map(|s| match s.slowdown {
                        Slowdown::Link { share } => Some(share * 100.0),
                        Slowdown::Cpu { .. } => None,
                    })
                    .collect();
                let factors: Vec<f64> = many
                    .iter()
                    .filter_map(|s| match s.slowdown {
                        Slowdown::Cpu { factor } => Some(f64::from(factor)),
                        Slowdown::Link { .. } => None,
                    })
                    .collect();
                let range = |v: &[f64], f: &dyn Fn(f64) -> String| {
                    let (lo, hi) = v.iter().fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(*x), b.max(*x)));
                    if lo == hi { f(lo) } else { format!("{}-{}", f(lo), f(hi)) }
                };
                let mut parts = Vec::new();
                if !shares.is_empty() {
                    parts.push(format!("link {}%", range(&shares, &|x| format!("{x:.0}"))));
                }
                if !factors.is_empty() {
                    parts.push(format!("cpu {}", range(&factors, &|x| format!("x{x:.1}"))));
                }
                format!("{}: {}", many.len(), parts.join(", "))
            }
        };
        match self.timing {
            Timing::Start => {}
            Timing::Appears { at_s } => s.push_str(&format!(" from {at_s:.1} s")),
            Timing::Passes { at_s, for_s } => s.push_str(&format!(" {at_s:.1}-{:.1} s", at_s + for_s)),
        }
        s
    }
}

/// The model's blocks placed on the servers at the start (best fit, as the sim's
/// scheduler places the scaled model's blocks).
#[derive(Clone, Debug)]
pub struct Layout {
    /// Blocks of the model.
    pub blocks: u64,
    /// Bytes each server holds (nominal).
    pub held: Vec<u64>,
}

impl Layout {
    /// `profile` cut into blocks of `block_bytes`, placed on `servers` servers.
    pub fn new(profile: Profile, block_bytes: usize, servers: u32) -> Result<Self> {
        let partition = Partition::new(profile.tensors(), block_bytes)?;
        let placement = Placement::initial(PlacementKind::BestFit, &partition, servers)?;
        let mut held = vec![0u64; servers as usize];
        for b in &partition.blocks {
            if let Some(owner) = placement.owner(b.id) {
                held[owner as usize] += b.bytes() as u64;
            }
        }
        Ok(Layout { blocks: partition.blocks.len() as u64, held })
    }

    /// What simulating one iteration of `workers` workers costs, about: worker-block
    /// rounds, times the blocks per loaded server over [`CHEAP_BLOCKS_PER_SERVER`] when
    /// that is above 1.
    pub fn cost(&self, workers: u32) -> u64 {
        let loaded = self.held.iter().filter(|b| **b > 0).count().max(1) as u64;
        u64::from(workers) * self.blocks * (self.blocks.div_ceil(loaded) / CHEAP_BLOCKS_PER_SERVER).max(1)
    }
}

/// Seconds per iteration of the job with no straggler, estimated: the compute time plus
/// the longer of a worker's round (the model over its link) and the busiest server's
/// (every worker's share of its bytes over its link or its CPU, whichever is slower).
fn estimate_iter_s(profile: Profile, workers: u32, held: &[u64], compute_ms: f64) -> f64 {
    let m = sim_defaults();
    let model_bytes = profile.num_params() as f64 * 4.0;
    let busiest = held.iter().copied().max().unwrap_or(0) as f64;
    let worker_s = model_bytes / (m.link_mbps * 1e6);
    let server_s = f64::from(workers) * busiest / (m.link_mbps.min(m.apply_mbps) * 1e6);
    compute_ms / 1e3 + worker_s.max(server_s) + 4.0 * m.latency_us / 1e6
}

/// The seeds of the regression list ([`REGRESSIONS`]): the first word of every line that
/// is not blank or a comment.
pub fn regression_seeds(text: &str) -> Result<Vec<u64>> {
    let mut seeds = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (seed, comment) = line.split_once('#').unwrap_or((line, ""));
        let seed = seed.trim().parse::<u64>().map_err(|e| {
            BenchError::Flags(format!("suite-regressions.txt line {}: {:?} is not a seed: {e}", n + 1, seed.trim()))
        })?;
        ensure_flags!(
            !comment.trim().is_empty(),
            "suite-regressions.txt line {}: seed {seed} needs a `#` comment saying what failed",
            n + 1
        );
        seeds.push(seed);
    }
    Ok(seeds)
}

/// The balancer's judged decisions in a run's report: the count of `balance.decisions`,
/// and of those kept and reverted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Verdicts {
    /// Decisions in the report.
    pub decisions: usize,
    /// Judged kept.
    pub kept: usize,
    /// Judged reverted (undone).
    pub reverted: usize,
}

/// The verdicts of `balance.decisions` in `report` (a report.json, read leniently as
/// `bench hosts` reads it: `judged`), if it has that list.
pub fn read_verdicts(report: &serde_json::Value) -> Option<Verdicts> {
    report.get("balance")?.get("decisions")?;
    let decisions = judged(report);
    let said = |word: &str| decisions.iter().filter(|d| d.verdict.eq_ignore_ascii_case(word)).count();
    Some(Verdicts { decisions: decisions.len(), kept: said("kept"), reverted: said("reverted") })
}

/// What one run measured.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Measured {
    /// Every worker's iterations / the longest worker's training time (virtual): the
    /// throughput the suite compares.
    pub iters_per_s: f64,
    /// The sum over workers of 1 / mean iteration time (virtual).
    pub worker_rate: f64,
    /// The same over each worker's second half.
    pub second_half_rate: f64,
    /// Migrations the balancer started (failed ones too).
    pub migrations: usize,
    /// Of those, the ones that failed.
    pub failed_migrations: usize,
    /// Bytes the migrations moved (nominal).
    pub moved_bytes: u64,
    /// Servers the balancer asked for (`scale-out` events).
    pub scale_outs: usize,
    /// Servers it drained (`scale-in` events).
    pub scale_ins: usize,
    /// Its judged decisions, if the report has them.
    pub verdicts: Option<Verdicts>,
    /// Virtual seconds of the job.
    pub virtual_s: f64,
    /// Wall seconds of the simulation.
    pub wall_s: f64,
    /// Events the harness handled.
    pub events: u64,
}

impl Measured {
    /// The numbers of a simulated run's report.
    fn of(report: &Report, iters_per_s: f64, virtual_s: f64, wall_s: f64, events: u64) -> Self {
        let balance = report.balance.as_ref();
        let scaling = |action: &str| balance.map_or(0, |b| b.scaling.iter().filter(|e| e.action == action).count());
        let verdicts = serde_json::to_value(report).ok().and_then(|v| read_verdicts(&v));
        Measured {
            iters_per_s,
            worker_rate: worker_rate(report),
            second_half_rate: second_half_rate(report),
            migrations: balance.map_or(0, |b| b.migrations.len()),
            failed_migrations: balance.map_or(0, |b| b.migrations.iter().filter(|m| m.error.is_some()).count()),
            moved_bytes: balance.map_or(0, |b| b.migrations.iter().map(|m| m.bytes).sum()),
            scale_outs: scaling("scale-out"),
            scale_ins: scaling("scale-in"),
            verdicts,
            virtual_s,
            wall_s,
            events,
        }
    }
}

/// One run of a scenario.
#[derive(Clone, Debug, Serialize)]
pub struct RunOutcome {
    /// Which.
    pub run: RunKind,
    /// The `elasticps sim` flags that reproduce it.
    pub flags: Vec<String>,
    /// What it measured (`None`: it failed).
    pub measured: Option<Measured>,
    /// Why it failed.
    pub error: Option<String>,
}

/// Simulates `run` of `scenario` (blocking: one long computation).
fn simulate(scenario: &Scenario, run: RunKind) -> RunOutcome {
    let cmd = scenario.spec(run).sim_cmd(scenario.machine(run));
    let flags = scenario.flags(run);
    match elasticps_sim::simulate(&cmd) {
        Ok(out) => {
            let report = elasticps_sim::report(&cmd, &out);
            let m = Measured::of(&report, out.iterations_per_s, out.virtual_s, out.wall_s, out.events);
            RunOutcome { run, flags, measured: Some(m), error: None }
        }
        Err(e) => {
            tracing::warn!(seed = scenario.seed, ?run, "suite run failed: {e}");
            RunOutcome { run, flags, measured: None, error: Some(e.to_string()) }
        }
    }
}

/// One scenario and its runs.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// The scenario.
    pub scenario: Scenario,
    /// Its runs, in [`Scenario::runs`] order.
    pub runs: Vec<RunOutcome>,
    /// Wall seconds of its runs.
    pub wall_s: f64,
}

impl Row {
    /// The measurement of `run`, if it was made and ended.
    pub fn measured(&self, run: RunKind) -> Option<&Measured> {
        self.runs.iter().find(|r| r.run == run).and_then(|r| r.measured.as_ref())
    }

    /// psld's iterations/s over static's.
    pub fn psld_static(&self) -> Option<f64> {
        let (p, s) = (self.measured(RunKind::Psld)?, self.measured(RunKind::Static)?);
        (s.iters_per_s > 0.0).then(|| p.iters_per_s / s.iters_per_s)
    }

    /// psld's iterations/s over the ceiling's.
    pub fn psld_ceiling(&self) -> Option<f64> {
        let (p, c) = (self.measured(RunKind::Psld)?, self.measured(RunKind::Ceiling)?);
        (c.iters_per_s > 0.0).then(|| p.iters_per_s / c.iters_per_s)
    }

    /// Whether a run failed.
    pub fn failed(&self) -> bool {
        self.runs.iter().any(|r| r.error.is_some())
    }
}

/// Runs `scenario`'s runs in order.
pub fn run_scenario(scenario: Scenario) -> Row {
    let t = Instant::now();
    let runs = scenario.runs().into_iter().map(|run| simulate(&scenario, run)).collect();
    Row { scenario, runs, wall_s: t.elapsed().as_secs_f64() }
}

/// The suite's numbers over its rows.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Summary {
    /// Scenarios run.
    pub scenarios: usize,
    /// Seeds with a failed run.
    pub failed: Vec<u64>,
    /// The worst psld / static and its seed.
    pub worst_psld_static: Option<(f64, u64)>,
    /// The median psld / static.
    pub median_psld_static: Option<f64>,
    /// Seeds below [`PSLD_FLOOR`], with their ratio, worst first.
    pub below_floor: Vec<(u64, f64)>,
    /// Scenarios with a straggler (and all three runs measured).
    pub straggled: usize,
    /// The median psld / ceiling over them.
    pub median_psld_ceiling: Option<f64>,
    /// The worst psld / ceiling and its seed.
    pub worst_psld_ceiling: Option<(f64, u64)>,
    /// Scenarios with no straggler (and a psld run measured).
    pub healthy: usize,
    /// The most migrations psld made in one of them, and its seed.
    pub max_healthy_migrations: Option<(usize, u64)>,
    /// Seeds over [`HEALTHY_MAX_MIGRATIONS`], with their migrations.
    pub over_healthy: Vec<(u64, usize)>,
}

/// The summary of `rows`.
pub fn summarize(rows: &[Row]) -> Summary {
    let seed = |r: &Row| r.scenario.seed;
    let ratios: Vec<(u64, f64)> = rows.iter().filter_map(|r| Some((seed(r), r.psld_static()?))).collect();
    let worst = |v: &[(u64, f64)]| v.iter().min_by(|a, b| a.1.total_cmp(&b.1)).map(|(s, x)| (*x, *s));
    let mut below_floor: Vec<(u64, f64)> = ratios.iter().copied().filter(|(_, x)| *x < PSLD_FLOOR).collect();
    below_floor.sort_by(|a, b| a.1.total_cmp(&b.1));
    let ceilings: Vec<(u64, f64)> =
        rows.iter().filter(|r| r.scenario.straggled()).filter_map(|r| Some((seed(r), r.psld_ceiling()?))).collect();
    let healthy: Vec<(u64, usize)> = rows
        .iter()
        .filter(|r| !r.scenario.straggled())
        .filter_map(|r| Some((seed(r), r.measured(RunKind::Psld)?.migrations)))
        .collect();
    Summary {
        scenarios: rows.len(),
        failed: rows.iter().filter(|r| r.failed()).map(seed).collect(),
        worst_psld_static: worst(&ratios),
        median_psld_static: median(&ratios.iter().map(|r| r.1).collect::<Vec<_>>()),
        below_floor,
        straggled: ceilings.len(),
        median_psld_ceiling: median(&ceilings.iter().map(|r| r.1).collect::<Vec<_>>()),
        worst_psld_ceiling: worst(&ceilings),
        healthy: healthy.len(),
        max_healthy_migrations: healthy.iter().max_by_key(|(s, m)| (*m, std::cmp::Reverse(*s))).map(|(s, m)| (*m, *s)),
        over_healthy: healthy.iter().copied().filter(|(_, m)| *m > HEALTHY_MAX_MIGRATIONS).collect(),
    }
}

/// What is run, resolved from the flags.
#[derive(Clone, Debug, Serialize)]
pub struct SuitePlan {
    /// `--quick`.
    pub quick: bool,
    /// The seeds, in order (`--quick`: [`QUICK_SEEDS`], then the regression seeds not
    /// among them).
    pub seeds: Vec<u64>,
    /// The regression seeds (run in `--quick`).
    pub regressions: Vec<u64>,
    /// Scenarios simulated at once (`--jobs`).
    pub jobs: usize,
}

impl SuitePlan {
    /// The plan of `cmd`.
    pub fn new(cmd: &SimBenchCmd) -> Result<Self> {
        let regressions = regression_seeds(REGRESSIONS)?;
        ensure_flags!(cmd.jobs >= 1, "--jobs must be at least 1");
        let seeds = if cmd.quick {
            ensure_flags!(
                cmd.seeds.is_none() && cmd.seed_start.is_none(),
                "--quick runs a fixed list of seeds: drop --seeds and --seed-start"
            );
            let mut seen = BTreeSet::new();
            QUICK_SEEDS.iter().chain(&regressions).copied().filter(|s| seen.insert(*s)).collect()
        } else {
            let start = cmd.seed_start.unwrap_or(1);
            let n = cmd.seeds.unwrap_or(DEFAULT_SEEDS);
            ensure_flags!(n >= 1, "--seeds must be at least 1");
            (start..start.saturating_add(n)).collect()
        };
        Ok(SuitePlan { quick: cmd.quick, seeds, regressions, jobs: cmd.jobs })
    }
}

/// The body of bench-suite.json.
#[derive(Clone, Debug, Serialize)]
pub struct SuiteBody {
    /// What was run.
    pub plan: SuitePlan,
    /// The numbers over the rows.
    pub summary: Summary,
    /// Every scenario, in seed order of the plan.
    pub rows: Vec<Row>,
}

/// `elasticps bench sim --suite`.
pub struct SuiteBench {
    out: PathBuf,
    plan: SuitePlan,
}

impl SuiteBench {
    /// The suite of `cmd` (`--suite` given).
    pub fn new(cmd: SimBenchCmd) -> Result<Self> {
        ensure_flags!(cmd.parts.is_none(), "--suite runs the scenario suite, not the parts: drop --parts");
        let plan = SuitePlan::new(&cmd)?;
        Ok(SuiteBench { out: cmd.out.unwrap_or_else(|| PathBuf::from("reports/bench-suite")), plan })
    }
}

/// Runs every scenario of `seeds`, `jobs` at a time; the rows in the seeds' order.
fn run_all(seeds: &[u64], jobs: usize) -> Result<Vec<Row>> {
    let scenarios: Vec<Scenario> =
        seeds.iter().map(|s| Scenario::draw(*s).with_context(|| format!("drawing seed {s}"))).collect::<Result<_>>()?;
    let total = scenarios.len();
    let next = AtomicUsize::new(0);
    let rows: Mutex<Vec<Option<Row>>> = Mutex::new(vec![None; total]);
    let work = || {
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(s) = scenarios.get(i) else { break };
            eprintln!(
                "bench sim --suite: {}/{total}: seed {}: {} {}x{} ({} iterations) stragglers {} {}",
                i + 1,
                s.seed,
                s.profile,
                s.servers,
                s.workers,
                s.iterations,
                s.stragglers_cell(),
                s.sync
            );
            let row = run_scenario(s.clone());
            eprintln!("  seed {}: {}", s.seed, progress_line(&row));
            if let Ok(mut rows) = rows.lock() {
                rows[i] = Some(row);
            }
        }
    };
    std::thread::scope(|scope| {
        for _ in 1..jobs.min(total) {
            scope.spawn(work);
        }
        work();
    });
    let rows = rows.into_inner().map_err(|_| BenchError::Failed("a suite thread panicked".into()))?;
    let rows: Vec<Row> = rows.into_iter().flatten().collect();
    ensure_measured!(rows.len() == total, "{} of {total} scenarios were run", rows.len());
    Ok(rows)
}

/// A row in one line, for the progress output.
fn progress_line(row: &Row) -> String {
    let it = |run| row.measured(run).map_or("failed".into(), |m| format!("{:.1}", m.iters_per_s));
    format!(
        "static {} it/s, psld {} ({}), ceiling {}, {} migrations, {:.1} s wall",
        it(RunKind::Static),
        it(RunKind::Psld),
        row.psld_static().map_or("-".into(), |x| format!("{x:.3}x")),
        if row.scenario.straggled() { it(RunKind::Ceiling) } else { "-".into() },
        row.measured(RunKind::Psld).map_or(0, |m| m.migrations),
        row.wall_s
    )
}

impl Bench for SuiteBench {
    const STEM: &'static str = "bench-suite";
    type Body = SuiteBody;

    fn out(&self) -> Option<&Path> {
        Some(&self.out)
    }

    async fn run(&self) -> Result<SuiteBody> {
        let (seeds, jobs) = (self.plan.seeds.clone(), self.plan.jobs);
        let rows = tokio::task::spawn_blocking(move || run_all(&seeds, jobs)).await??;
        Ok(SuiteBody { plan: self.plan.clone(), summary: summarize(&rows), rows })
    }

    fn verdicts(&self, body: &SuiteBody) -> (Vec<Check>, Vec<Target>) {
        verdicts(body)
    }

    fn markdown(&self, written: &Written<SuiteBody>) -> String {
        render(written)
    }

    fn failure(&self, checks: &[Check]) -> Result<()> {
        let failed: Vec<String> =
            checks.iter().filter(|c| c.pass == Some(false)).map(|c| format!("{}: {}", c.what, c.measured)).collect();
        ensure_measured!(
            failed.is_empty(),
            "{} of {} checks failed: {}",
            failed.len(),
            checks.len(),
            failed.join("; ")
        );
        Ok(())
    }
}

/// `seeds` as `17 (0.93x), 42 (0.95x)`, at most 20 of them.
fn seed_list<T>(seeds: &[(u64, T)], show: impl Fn(&T) -> String) -> String {
    let mut s: Vec<String> = seeds.iter().take(20).map(|(seed, x)| format!("{seed} ({})", show(x))).collect();
    if seeds.len() > 20 {
        s.push(format!("and {} more", seeds.len() - 20));
    }
    s.join(", ")
}

/// Whether the median of psld / ceiling is checked (else reported): the full form, with
/// at least [`CEILING_MIN_SCENARIOS`] scenarios with a straggler.
fn median_checked(body: &SuiteBody) -> bool {
    !body.plan.quick && body.summary.straggled >= CEILING_MIN_SCENARIOS
}

fn verdicts(body: &SuiteBody) -> (Vec<Check>, Vec<Target>) {
    let s = &body.summary;
    let mut checks = vec![
        Check {
            what: "every simulated run ended (no failure, no stall)".into(),
            measured: if s.failed.is_empty() {
                format!("{} scenarios", s.scenarios)
            } else {
                format!("failed: seeds {}", s.failed.iter().map(u64::to_string).collect::<Vec<_>>().join(", "))
            },
            pass: Some(s.failed.is_empty()),
        },
        Check {
            what: format!("psld >= {PSLD_FLOOR:.2}x static on every scenario"),
            measured: match (s.worst_psld_static, s.below_floor.is_empty()) {
                (None, _) => "not run".into(),
                (Some((x, seed)), true) => format!("worst {x:.3}x (seed {seed})"),
                (Some(_), false) => format!("below: seeds {}", seed_list(&s.below_floor, |x| format!("{x:.3}x"))),
            },
            pass: s.worst_psld_static.map(|_| s.below_floor.is_empty()),
        },
        Check {
            what: format!("without a straggler, psld makes <= {HEALTHY_MAX_MIGRATIONS} migrations"),
            measured: match (s.max_healthy_migrations, s.over_healthy.is_empty()) {
                (None, _) => "no scenario without a straggler".into(),
                (Some((m, seed)), true) => format!("max {m} (seed {seed}) over {} scenarios", s.healthy),
                (Some(_), false) => {
                    format!("over: seeds {}", seed_list(&s.over_healthy, |m| format!("{m} migrations")))
                }
            },
            pass: s.max_healthy_migrations.map(|_| s.over_healthy.is_empty()),
        },
    ];
    let what = format!(
        "median psld / ceiling over the scenarios with a straggler >= {CEILING_MEDIAN:.2} ({} scenarios)",
        s.straggled
    );
    let measured = match (s.median_psld_ceiling, s.worst_psld_ceiling) {
        (Some(m), Some((w, seed))) => format!("{m:.3} (worst {w:.3}, seed {seed})"),
        _ => "no scenario with a straggler".into(),
    };
    let holds = s.median_psld_ceiling.map(|m| m >= CEILING_MEDIAN);
    let mut targets = Vec::new();
    if median_checked(body) {
        checks.push(Check { what, measured, pass: holds });
    } else {
        targets.push(Target {
            what: format!(
                "{what}; reported, not checked: {}",
                if body.plan.quick {
                    "--quick's scenarios are chosen for cost and include the regression seeds".to_string()
                } else {
                    format!("fewer than {CEILING_MIN_SCENARIOS} scenarios with a straggler")
                }
            ),
            measured,
            met: holds,
        });
    }
    (checks, targets)
}

/// `1.0 MiB`, `64 KiB`.
fn block_size(bytes: usize) -> String {
    if bytes >= 1 << 20 { format!("{} MiB", bytes >> 20) } else { format!("{} KiB", bytes >> 10) }
}

/// The summary lines (also the end of the Markdown).
pub fn summary_lines(s: &Summary) -> Vec<String> {
    let or_dash = |x: Option<String>| x.unwrap_or_else(|| "-".into());
    vec![
        format!(
            "worst psld / static: {} (median {}, {} scenarios; {} below {PSLD_FLOOR:.2})",
            or_dash(s.worst_psld_static.map(|(x, seed)| format!("{x:.3}x, seed {seed}"))),
            or_dash(s.median_psld_static.map(|x| format!("{x:.3}x"))),
            s.scenarios,
            s.below_floor.len()
        ),
        format!(
            "median psld / ceiling over the {} scenarios with a straggler: {} (worst {})",
            s.straggled,
            or_dash(s.median_psld_ceiling.map(|x| format!("{x:.3}"))),
            or_dash(s.worst_psld_ceiling.map(|(x, seed)| format!("{x:.3}, seed {seed}")))
        ),
        format!(
            "max migrations over the {} scenarios without a straggler: {}",
            s.healthy,
            or_dash(s.max_healthy_migrations.map(|(m, seed)| format!("{m}, seed {seed}")))
        ),
    ]
}

fn render(out: &Written<SuiteBody>) -> String {
    let body = &out.body;
    let mut s = out.heading("bench sim --suite");
    s.push_str(&format!(
        "{} seeded random simulated jobs{}: every synthetic model, {MIN_SERVERS} to {MAX_SERVERS} servers, blocks of \
         64 KiB to 4 MiB, bsp or ssp, no, one or several stragglers (a link capped at 5-50% of the sim's, or a CPU \
         2-10x slower; from the start, from mid-run, or for a while), quiet or noisy links. Each runs static, psld \
         (`--min-servers` the servers, `--max-servers` 0-2 more) and, with a straggler, the same job with no \
         straggler, static (the ceiling). it/s: every worker's iterations / the longest worker's training time \
         (virtual). Every run's `elasticps sim` flags are in bench-suite.json; one scenario again: `elasticps bench \
         sim --suite --seeds 1 --seed-start SEED`.\n\n",
        body.rows.len(),
        if body.plan.quick {
            format!(" (`--quick`: seeds {:?} and the regression seeds {:?})", QUICK_SEEDS, body.plan.regressions)
        } else {
            String::new()
        }
    ));
    let headers = [
        "seed",
        "model",
        "servers x workers",
        "block",
        "stragglers",
        "sync",
        "jitter us",
        "iters",
        "static it/s",
        "psld it/s",
        "psld/static",
        "psld/ceiling",
        "migrations",
        "scale out/in",
        "kept/reverted",
        "wall s",
    ];
    let rows: Vec<Vec<String>> = body
        .rows
        .iter()
        .map(|r| {
            let sc = &r.scenario;
            let it = |run| r.measured(run).map_or("failed".into(), |m| fixed(m.iters_per_s, 2));
            let psld = r.measured(RunKind::Psld);
            vec![
                sc.seed.to_string(),
                sc.profile.to_string(),
                format!(
                    "{}{} x {}",
                    sc.servers,
                    if sc.extra_servers > 0 { format!("(+{})", sc.extra_servers) } else { String::new() },
                    sc.workers
                ),
                block_size(sc.block_bytes),
                sc.stragglers_cell(),
                sc.sync.to_string(),
                sc.jitter_us.to_string(),
                sc.iterations.to_string(),
                it(RunKind::Static),
                it(RunKind::Psld),
                r.psld_static().map_or("-".into(), |x| format!("{x:.3}{}", if x < PSLD_FLOOR { " !" } else { "" })),
                r.psld_ceiling().map_or("-".into(), |x| format!("{x:.3}")),
                psld.map_or("-".into(), |m| m.migrations.to_string()),
                psld.map_or("-".into(), |m| format!("{}/{}", m.scale_outs, m.scale_ins)),
                psld.and_then(|m| m.verdicts).map_or("-".into(), |v| format!("{}/{}", v.kept, v.reverted)),
                format!("{:.1}", r.wall_s),
            ]
        })
        .collect();
    s.push_str(&markdown_table(&headers, &rows));
    s.push_str(&format!(
        "\n`!`: below {PSLD_FLOOR:.2}. servers (+N): psld may add N servers. kept/reverted: the verdicts of psld's \
         decisions (`balance.decisions` of its report; `-` when the report has none).\n\n"
    ));
    for line in summary_lines(&body.summary) {
        s.push_str(&format!("- {line}\n"));
    }
    s.push_str(&crate::checks::checks_and_targets_markdown(&out.checks, &out.targets));
    s
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[test]
    fn a_seed_is_one_scenario_and_flags_it_can_run() {
        for seed in [1, 2, 77, 1_000_003] {
            let a = Scenario::draw(seed).unwrap();
            assert_eq!(a, Scenario::draw(seed).unwrap(), "seed {seed}");
            for run in a.runs() {
                let cmd = a.spec(run).sim_cmd(a.machine(run));
                cmd.validate().unwrap();
                assert_eq!(cmd.sim.sim_seed, seed);
                assert_eq!(cmd.job.balance == BalanceMode::Psld, run == RunKind::Psld);
                let slow = !cmd.job.server_bandwidth.is_empty() || !cmd.job.server_interference.is_empty();
                assert_eq!(slow, a.straggled() && run != RunKind::Ceiling, "seed {seed} {run:?}");
            }
        }
        assert_ne!(Scenario::draw(1).unwrap(), Scenario::draw(2).unwrap());
    }

    #[test]
    fn every_dimension_is_drawn_across_a_few_hundred_seeds() {
        let scenarios: Vec<Scenario> = (1..=300).map(|s| Scenario::draw(s).unwrap()).collect();
        let count = |f: &dyn Fn(&Scenario) -> bool| scenarios.iter().filter(|s| f(s)).count();
        for p in Profile::ALL {
            assert!(count(&|s| s.profile == p) >= 40, "{p}");
        }
        for b in BLOCK_SIZES {
            assert!(count(&|s| s.block_bytes == b) >= 30, "{b}");
        }
        for c in COMPUTE_MS {
            assert!(count(&|s| s.compute_ms == c) >= 30, "{c} ms");
        }
        // Sizes: small, medium and large clusters, the ends of the range.
        assert!(scenarios.iter().all(|s| (MIN_SERVERS..=MAX_SERVERS).contains(&s.servers)));
        assert!(count(&|s| s.servers <= 16) >= 120);
        assert!(count(&|s| (17..=120).contains(&s.servers)) >= 70);
        assert!(count(&|s| s.servers > 120) >= 15);
        assert!(count(&|s| s.servers == MIN_SERVERS) >= 5);
        assert!(count(&|s| s.servers >= 500) >= 3);
        assert!(scenarios.iter().all(|s| s.workers >= 2 && s.workers <= (4 * s.servers).min(MAX_WORKERS)));
        assert!(count(&|s| s.workers >= 200) >= 5);
        // Stragglers: none, one, several; link and CPU; from the start, appearing, passing.
        assert!(count(&|s| s.stragglers.is_empty()) >= 60);
        assert!(count(&|s| s.stragglers.len() == 1) >= 70);
        assert!(count(&|s| s.stragglers.len() >= 2) >= 70);
        let shares: Vec<f64> = scenarios
            .iter()
            .flat_map(|s| &s.stragglers)
            .filter_map(|t| match t.slowdown {
                Slowdown::Link { share } => Some(share),
                Slowdown::Cpu { .. } => None,
            })
            .collect();
        assert!(shares.iter().all(|x| (0.05..=0.5).contains(x)) && shares.len() >= 150);
        assert!(shares.iter().any(|x| *x < 0.1) && shares.iter().any(|x| *x > 0.4));
        let cpu = |s: &Scenario| s.stragglers.iter().any(|t| matches!(t.slowdown, Slowdown::Cpu { .. }));
        assert!(count(&cpu) >= 30);
        assert!(count(&|s| matches!(s.timing, Timing::Start) && s.straggled()) >= 80);
        assert!(count(&|s| matches!(s.timing, Timing::Appears { .. })) >= 25);
        assert!(count(&|s| matches!(s.timing, Timing::Passes { .. })) >= 15);
        assert!(scenarios.iter().all(|s| s.straggled() || s.timing == Timing::Start));
        // Stragglers are distinct servers of the job.
        for s in &scenarios {
            let ids: BTreeSet<u32> = s.stragglers.iter().map(|t| t.server).collect();
            assert_eq!(ids.len(), s.stragglers.len());
            assert!(ids.iter().all(|i| *i < s.servers));
        }
        // Sync: bsp and ssp:1..=4; noise; scale-out allowed or not.
        let mut sync: BTreeMap<String, usize> = BTreeMap::new();
        for s in &scenarios {
            *sync.entry(s.sync.to_string()).or_default() += 1;
        }
        assert_eq!(sync.keys().cloned().collect::<Vec<_>>(), ["bsp", "ssp:1", "ssp:2", "ssp:3", "ssp:4"]);
        assert!(sync["bsp"] >= 100 && sync.values().all(|n| *n >= 20), "{sync:?}");
        assert!(count(&|s| s.jitter_us == 0) >= 150);
        for j in JITTERS_US {
            assert!(count(&|s| s.jitter_us == j) >= 15, "{j} us");
        }
        for e in 0..=2 {
            assert!(count(&|s| s.extra_servers == e) >= 60, "+{e}");
        }
        assert!(scenarios.iter().all(|s| (MIN_ITERATIONS..=MAX_ITERATIONS).contains(&s.iterations)));
        assert!(count(&|s| s.iterations == MIN_ITERATIONS) >= 5 && count(&|s| s.iterations > 100) >= 20);
    }

    #[test]
    fn the_runs_carry_the_stragglers_their_timing_and_the_noise() {
        let s = Scenario {
            seed: 9,
            profile: Profile::ResNet50,
            servers: 10,
            extra_servers: 2,
            workers: 20,
            block_bytes: 1 << 20,
            sync: SyncPolicy::Ssp(2),
            compute_ms: 50.0,
            jitter_us: 500,
            stragglers: vec![
                Straggler { server: 3, slowdown: Slowdown::Link { share: 0.1 } },
                Straggler { server: 7, slowdown: Slowdown::Cpu { factor: 4.5 } },
            ],
            timing: Timing::Passes { at_s: 2.5, for_s: 4.0 },
            iterations: 30,
            est_iter_s: 0.1,
        };
        assert_eq!(s.runs(), [RunKind::Static, RunKind::Psld, RunKind::Ceiling]);
        let psld = s.spec(RunKind::Psld);
        assert_eq!(psld.job.server_bandwidth, vec![(3, 125.0)]);
        assert_eq!(psld.job.server_interference, vec![(7, 4.5)]);
        assert_eq!((psld.job.straggler_at, psld.job.max_servers, psld.job.min_servers), (2.5, Some(12), Some(10)));
        assert_eq!((psld.job.block_bytes, psld.data.compute_ms, psld.data.iterations), (1 << 20, 50.0, Some(30)));
        let stat = s.spec(RunKind::Static);
        assert_eq!((stat.job.balance, stat.job.max_servers), (BalanceMode::Static, None));
        let ceiling = s.spec(RunKind::Ceiling);
        assert!(ceiling.job.server_bandwidth.is_empty() && ceiling.job.server_interference.is_empty());
        assert_eq!((ceiling.job.straggler_at, ceiling.job.balance), (0.0, BalanceMode::Static));
        assert_eq!(s.machine(RunKind::Psld).straggler_for_s, Some(4.0));
        assert_eq!(s.machine(RunKind::Ceiling).straggler_for_s, None);
        assert_eq!(s.machine(RunKind::Ceiling).jitter_us, 500);
        let flags = s.flags(RunKind::Psld).join(" ");
        for f in ["--jitter-us 500", "--straggler-for 4", "--sim-seed 9", "--sync ssp:2", "--balance psld"] {
            assert!(flags.contains(f), "{f} in {flags}");
        }
        assert_eq!(s.stragglers_cell(), "2: link 10%, cpu x4.5 2.5-6.5 s");
        let one =
            Scenario { stragglers: s.stragglers[..1].to_vec(), timing: Timing::Appears { at_s: 3.0 }, ..s.clone() };
        assert_eq!(one.stragglers_cell(), "#3 link 10% from 3.0 s");
        let none = Scenario { stragglers: Vec::new(), timing: Timing::Start, ..s };
        assert_eq!((none.stragglers_cell(), none.runs().len()), ("-".to_string(), 2));
    }

    #[test]
    fn the_regression_list_parses_and_every_seed_says_what_failed() {
        regression_seeds(REGRESSIONS).unwrap();
        assert_eq!(regression_seeds("# header\n\n17 # psld 0.91x static\n 4 #x\n").unwrap(), [17, 4]);
        assert!(regression_seeds("17\n").is_err());
        assert!(regression_seeds("x # y\n").is_err());
    }

    #[test]
    fn verdicts_are_read_leniently() {
        let v = |j: serde_json::Value| read_verdicts(&j);
        assert_eq!(v(serde_json::json!({"balance": {"migrations": []}})), None);
        assert_eq!(v(serde_json::json!({"balance": null})), None);
        let d = serde_json::json!({"balance": {"decisions": [
            {"verdict": "kept", "what": "migrate 3 blocks", "predicted_gain": 0.2},
            {"verdict": "reverted", "measured_gain": -0.1},
            {"verdict": "kept", "a field of a later scheduler": 1},
            {"what": "not judged yet"}
        ]}});
        assert_eq!(v(d), Some(Verdicts { decisions: 4, kept: 2, reverted: 1 }));
        assert_eq!(v(serde_json::json!({"balance": {"decisions": []}})), Some(Verdicts::default()));
    }

    fn measured(it_s: f64, migrations: usize) -> Option<Measured> {
        Some(Measured { iters_per_s: it_s, migrations, ..Measured::default() })
    }

    fn row(seed: u64, straggled: bool, s: f64, p: f64, c: f64, migrations: usize) -> Row {
        let mut scenario = Scenario::draw(seed).unwrap();
        if straggled && scenario.stragglers.is_empty() {
            scenario.stragglers = vec![Straggler { server: 0, slowdown: Slowdown::Link { share: 0.1 } }];
        } else if !straggled {
            scenario.stragglers.clear();
            scenario.timing = Timing::Start;
        }
        let run = |run, m| RunOutcome { run, flags: Vec::new(), measured: m, error: None };
        let mut runs = vec![run(RunKind::Static, measured(s, 0)), run(RunKind::Psld, measured(p, migrations))];
        if straggled {
            runs.push(run(RunKind::Ceiling, measured(c, 0)));
        }
        Row { scenario, runs, wall_s: 1.0 }
    }

    #[test]
    fn summarizes_checks_names_the_seeds_and_renders() {
        let mut rows = vec![
            row(1, true, 10.0, 20.0, 21.0, 5),
            row(2, true, 10.0, 9.0, 20.0, 1),
            row(3, false, 10.0, 9.9, 0.0, 3),
            row(4, false, 10.0, 10.0, 0.0, 0),
        ];
        rows[3].runs[0].measured = None;
        rows[3].runs[0].error = Some("stalled".into());
        let s = summarize(&rows);
        assert_eq!(s.failed, [4]);
        assert_eq!(s.worst_psld_static, Some((0.9, 2)));
        assert_eq!(s.below_floor, [(2, 0.9)]);
        assert_eq!((s.straggled, s.healthy), (2, 2));
        assert!((s.median_psld_ceiling.unwrap() - (20.0 / 21.0 + 0.45) / 2.0).abs() < 1e-12);
        assert_eq!(s.worst_psld_ceiling, Some((0.45, 2)));
        assert_eq!((s.max_healthy_migrations, s.over_healthy.clone()), (Some((3, 3)), vec![(3, 3)]));
        let plan = SuitePlan { quick: true, seeds: vec![1, 2, 3, 4], regressions: vec![2], jobs: 1 };
        let body = SuiteBody { plan, summary: s, rows };
        let (checks, targets) = verdicts(&body);
        assert_eq!(checks.iter().map(|c| c.pass).collect::<Vec<_>>(), [Some(false), Some(false), Some(false)]);
        assert!(checks[0].measured.contains("seeds 4"), "{:?}", checks[0]);
        assert!(checks[1].measured.contains("seeds 2 (0.900x)"), "{:?}", checks[1]);
        assert!(checks[2].measured.contains("seeds 3 (3 migrations)"), "{:?}", checks[2]);
        // --quick reports the median, never checks it.
        assert_eq!((targets.len(), targets[0].met), (1, Some(false)));
        let bench = SuiteBench { out: PathBuf::new(), plan: body.plan.clone() };
        let e = bench.failure(&checks).unwrap_err().to_string();
        assert!(e.starts_with("3 of 3 checks failed") && e.contains("seeds 2 (0.900x)"), "{e}");
        assert!(bench.failure(&checks[..0]).is_ok());
        let out = Written {
            command: "elasticps bench sim --suite --quick".into(),
            machine: crate::machine::Machine::example(),
            took_s: 1.0,
            checks,
            targets,
            body,
        };
        let md = render(&out);
        let cell = |line: &str, i: usize| line.split('|').nth(i).unwrap_or("").trim().to_string();
        assert!(md.lines().any(|l| cell(l, 1) == "2" && cell(l, 11) == "0.900 !"), "{md}");
        assert!(md.lines().any(|l| cell(l, 1) == "4" && cell(l, 9) == "failed"), "{md}");
        assert!(md.contains("- worst psld / static: 0.900x, seed 2"), "{md}");
        assert!(md.contains("max migrations over the 2 scenarios without a straggler: 3, seed 3"), "{md}");
        assert!(md.contains("FAIL psld >= 0.97x static on every scenario"), "{md}");
    }

    #[test]
    fn quick_runs_the_fixed_seeds_and_the_regressions_once_each() {
        use clap::Parser;
        #[derive(Parser)]
        struct Wrap {
            #[command(flatten)]
            cmd: SimBenchCmd,
        }
        let cmd =
            |args: &[&str]| Wrap::try_parse_from(std::iter::once("sim").chain(args.iter().copied())).map(|w| w.cmd);
        let quick = SuitePlan::new(&cmd(&["--suite", "--quick"]).unwrap()).unwrap();
        assert_eq!(&quick.seeds[..QUICK_SEEDS.len()], QUICK_SEEDS);
        let all: BTreeSet<u64> = QUICK_SEEDS.iter().chain(&quick.regressions).copied().collect();
        assert_eq!(quick.seeds.len(), all.len());
        let full = SuitePlan::new(&cmd(&["--suite"]).unwrap()).unwrap();
        assert_eq!(full.seeds, (1..=DEFAULT_SEEDS).collect::<Vec<_>>());
        let some = SuitePlan::new(&cmd(&["--suite", "--seeds", "3", "--seed-start", "40"]).unwrap()).unwrap();
        assert_eq!((some.seeds, some.jobs), (vec![40, 41, 42], 1));
        assert!(SuitePlan::new(&cmd(&["--suite", "--quick", "--seeds", "3"]).unwrap()).is_err());
        assert!(cmd(&["--seeds", "3"]).is_err(), "--seeds needs --suite");
        assert!(SuiteBench::new(cmd(&["--suite", "--parts", "scale"]).unwrap()).is_err());
        assert_eq!(SuiteBench::new(cmd(&["--suite"]).unwrap()).unwrap().out, PathBuf::from("reports/bench-suite"));
    }

    /// The quick seeds' cost (`cargo test -p elasticps-bench -- --ignored --nocapture
    /// suite_costs`): what picking them looked at.
    #[test]
    #[ignore]
    fn suite_costs() {
        let mut total = 0;
        for seed in 1..=400 {
            let s = Scenario::draw(seed).unwrap();
            let cost = s.cost().unwrap() * s.runs().len() as u64;
            total += cost;
            println!(
                "{seed:4} {:9} {:4}(+{}) x {:4} {:>7} {:28} {:6} j{:<5} c{:<4} it {:3} est {:.3} s  cost {:.2} M",
                s.profile.to_string(),
                s.servers,
                s.extra_servers,
                s.workers,
                block_size(s.block_bytes),
                s.stragglers_cell(),
                s.sync.to_string(),
                s.jitter_us,
                s.compute_ms,
                s.iterations,
                s.est_iter_s,
                cost as f64 / 1e6
            );
        }
        println!("total {:.1} M worker-block rounds", total as f64 / 1e6);
    }
}
