//! `bench sync`'s transient scenario: stragglers that come and go (the SSP literature's),
//! each policy against its own ceiling.
//!
//! Every worker, at every iteration, is slow by D ms with probability p
//! (`--worker-jitter p:D`, no persistent straggler). Per worker count (8 and 16 by default)
//! and policy, one real job (scheduler, 2 servers, the workers as processes, as in the rest
//! of `bench sync`) measures iterations/s, and one replay on the simulator gives that
//! policy's *ceiling*:
//!
//! - the replay is `elasticps sim` on the same flags: the real scheduler and servers'
//!   state machines, so the hold rule is the real one, over the same draws (compute time
//!   and delays come from [`elasticps_train::Delays`], which the real workers use too);
//! - its links and servers cost nothing ([`ZERO_COST_MBPS`]) except a link latency set so
//!   that one round costs the run's measured communication time ([`unheld_comm_ms`]),
//!   found by two calibration replays (the latency's cost per round is linear);
//! - the communication time of the run is that of the rounds nobody holds: per iteration,
//!   the round of the worker that pushed last (whatever the policy, its pull is answered
//!   without waiting for anyone), the median over iterations.
//!
//! measured / ceiling then says how much the processes lose to everything the replay leaves
//! out: CPU contention (2 cores for 8 to 16 workers and 2 servers), rounds that cost more
//! than the median, the client's and the server's scheduling.
//!
//! Delayed pulls are counted as the papers count them, per pull request (one worker's pull
//! of one clock from one server): a server counts held pulls per block, so the requests are
//! estimated as each server's held block pulls over its blocks; the table also gives the
//! share of pulls held, which does not depend on the unit.
//!
//! The scenario also replays the hold rules at the reference constants
//! (compute 10 ms, 3 ms of communication, 6 workers, p = 0.1, D = 80 ms), on the simulator
//! alone ([`reference`]).

use std::path::Path;
use std::time::Instant;

use elasticps_core::placement::PlacementKind;
use elasticps_core::stats::{median, ratio};
use elasticps_launch::args::{DataArgs, JobArgs, NetArgs};
use elasticps_report::WorkerReport;
use elasticps_report::table::markdown_table;
use elasticps_sim::{SimArgs, SimCmd};
use elasticps_train::{Jitter, ModelKind, Profile};
use serde::Serialize;

use crate::checks::{Check, Target};
use crate::error::Context as _;
use crate::job::{RunResult, TrainSpec, fastest, in_rounds, measure, policy, sim_defaults};
use crate::machine::CpuSample;

/// A bandwidth and a server speed, MB/s, at which the simulated transfers and pushes cost
/// nothing measurable (a 3.4 MB push takes 3.4 ns).
pub const ZERO_COST_MBPS: f64 = 1e9;
/// The policies of the full scenario, in table order.
pub const POLICIES: &[&str] = &["bsp", "asp", "ssp:3", "ssp:6", "lazy:3", "pssp:3:0.5", "dpssp:3"];
/// The policies of `--quick`: what its check needs.
pub const QUICK_POLICIES: &[&str] = &["bsp", "ssp:3", "pssp:3:0.5"];
/// The calibration latency, µs (large next to what a round costs without latency).
const CALIBRATION_US: f64 = 10_000.0;
/// ssp:3 and pssp:3:0.5 must beat bsp by this factor in the quick form (p 0.2, D 150 ms;
/// docs/BENCHMARKS.md, "Sync under transient stragglers", has the runs it was chosen from:
/// 1.25x to 1.58x).
pub const QUICK_MARGIN: f64 = 1.15;
/// ... and in the full form (p 0.1, D 80 ms), where the 2-core CPU leaves the hold rule
/// only 1.2x to 1.3x (the ceilings): they must not be slower than bsp.
pub const FULL_MARGIN: f64 = 1.0;

/// What the scenario runs, resolved from `bench sync`'s flags.
#[derive(Clone, Debug, Serialize)]
pub struct TransientPlan {
    /// Worker counts (a job per count and policy).
    pub workers: Vec<u32>,
    /// Servers per job.
    pub servers: u32,
    /// Policies, in table order.
    pub policies: Vec<String>,
    /// Iterations per worker.
    pub iterations: u32,
    /// Rounds: every policy runs once per round (forward, then backward); the table shows
    /// its fastest.
    pub rounds: u32,
    /// Compute time per iteration, ms.
    pub compute_ms: f64,
    /// The transient delay, `P:MS`.
    pub jitter: String,
    /// The same, typed.
    #[serde(skip)]
    pub jitter_spec: Jitter,
    /// p of the jitter.
    pub p: f64,
    /// D of the jitter, ms.
    pub delay_ms: f64,
    /// ssp:3 and pssp:3:0.5 must beat bsp by this factor ([`QUICK_MARGIN`], [`FULL_MARGIN`]).
    pub margin: f64,
}

impl TransientPlan {
    /// The plan; `None` when `iterations` is 0 or no worker count is given (no scenario).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        workers: Vec<u32>,
        servers: u32,
        policies: Vec<String>,
        iterations: u32,
        rounds: u32,
        compute_ms: f64,
        jitter: Jitter,
        margin: f64,
    ) -> crate::Result<Option<Self>> {
        if iterations == 0 || workers.is_empty() {
            return Ok(None);
        }
        crate::error::ensure_flags!(workers.iter().all(|w| *w > 0), "--transient-workers must be at least 1 each");
        crate::error::ensure_flags!(!policies.is_empty(), "--transient-policies: nothing to compare");
        crate::error::ensure_flags!(
            compute_ms.is_finite() && compute_ms >= 0.0,
            "--transient-compute-ms must be non-negative"
        );
        Ok(Some(Self {
            workers,
            servers,
            policies,
            iterations,
            rounds,
            compute_ms,
            jitter: jitter.to_string(),
            jitter_spec: jitter,
            p: jitter.p,
            delay_ms: jitter.ms,
            margin,
        }))
    }

    /// The train job of one run (the replay's is this job on a simulated machine).
    pub fn spec(&self, workers: u32, sync: &str, iterations: u32) -> crate::Result<TrainSpec> {
        let job = JobArgs {
            servers: self.servers,
            workers,
            sync: policy(sync)?,
            placement: PlacementKind::Range,
            ..JobArgs::default()
        };
        let data = DataArgs {
            model: ModelKind::Synthetic(Profile::ResNet56),
            worker_jitter: Some(self.jitter_spec),
            compute_ms: self.compute_ms,
            iterations: Some(iterations),
            ..DataArgs::default()
        };
        Ok(TrainSpec { job, data })
    }

    /// Every job, in order: (workers, policy, round); odd rounds go backwards.
    pub fn runs(&self) -> Vec<(u32, String, u32)> {
        let rounds = in_rounds(&self.policies, self.rounds);
        self.workers.iter().flat_map(|&w| rounds.iter().map(move |(p, r)| (w, p.clone(), *r))).collect()
    }
}

/// A policy's ceiling: the replay of its hold rule.
#[derive(Clone, Debug, Serialize)]
pub struct Ceiling {
    /// The replayed job's flags (on a machine of [`ZERO_COST_MBPS`] links and servers and
    /// a link latency of `latency_us`).
    pub flags: Vec<String>,
    /// The link latency that makes a round cost the measured communication time, µs.
    pub latency_us: f64,
    /// What a round nobody holds cost in the replay, ms (the calibration's check).
    pub comm_ms: f64,
    /// Every worker's iterations / the longest worker's training time (virtual).
    pub iters_per_s: f64,
    /// Pulls held (per block).
    pub pulls_held: u64,
    /// Pull requests held, estimated per server as held block pulls / blocks.
    pub requests_held: f64,
    /// Pulls answered (per block).
    pub pulls: u64,
}

/// One job of the scenario, measured, with its ceiling.
#[derive(Clone, Debug, Serialize)]
pub struct TransientRun {
    /// Workers of the job.
    pub workers: u32,
    /// The policy.
    pub policy: String,
    /// The round (every policy runs once per round).
    pub round: u32,
    /// True for the run the table shows: the fastest round of its worker count and policy.
    pub chosen: bool,
    /// What the real processes measured.
    pub run: RunResult,
    /// Pull requests held, estimated per server as held block pulls / blocks.
    pub requests_held: f64,
    /// The communication time of a round nobody holds, ms ([`unheld_comm_ms`]).
    pub comm_ms: Option<f64>,
    /// The replay; `None` if the run's communication time could not be measured.
    pub ceiling: Option<Ceiling>,
    /// Where the CPU went during the job, if /proc could tell.
    pub cpu: Option<CpuUse>,
}

/// The CPU time of one job, from /proc/stat and /proc/self/stat (in USER_HZ = 100 ticks
/// per second): how many of the machine's cores its processes kept busy, and others'.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct CpuUse {
    /// CPU time of the job's processes (the scheduler, the servers, the workers), per
    /// iteration of one worker, ms.
    pub job_ms_per_iteration: f64,
    /// The job's processes' CPU time / the job's wall time: cores kept busy.
    pub job_cores: f64,
    /// Cores that other processes kept busy meanwhile.
    pub others_cores: f64,
    /// Cores left idle meanwhile.
    pub idle_cores: f64,
}

impl CpuUse {
    fn between(a: CpuSample, b: CpuSample, wall_s: f64, iterations: u64) -> Option<Self> {
        const USER_HZ: f64 = 100.0;
        let total = b.total.checked_sub(a.total).filter(|t| *t > 0)? as f64;
        let own = b.own.saturating_sub(a.own) as f64;
        let busy = b.busy.saturating_sub(a.busy) as f64;
        let cores = std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64);
        Some(CpuUse {
            job_ms_per_iteration: own / USER_HZ * 1e3 / iterations.max(1) as f64,
            job_cores: own / USER_HZ / wall_s.max(1e-9),
            others_cores: a.others(b)? * cores,
            idle_cores: (1.0 - busy / total).max(0.0) * cores,
        })
    }
}

impl TransientRun {
    /// measured / ceiling iterations/s.
    pub fn of_ceiling(&self) -> Option<f64> {
        self.ceiling.as_ref().map(|c| self.run.iters_per_s / c.iters_per_s)
    }
}

/// The hold rules at the reference constants, on the simulator alone.
#[derive(Clone, Debug, Serialize)]
pub struct ReferenceRow {
    /// The policy.
    pub policy: String,
    /// Iterations/s of the replay.
    pub iters_per_s: f64,
    /// Share of pulls held.
    pub held_share: f64,
}

/// Everything the scenario produced.
#[derive(Clone, Debug, Serialize)]
pub struct TransientOutput {
    /// The plan.
    pub plan: TransientPlan,
    /// Every job.
    pub runs: Vec<TransientRun>,
    /// The reference replay.
    pub reference: Vec<ReferenceRow>,
    /// Wall seconds of the scenario.
    pub took_s: f64,
}

/// Runs the scenario: every job, its ceiling, and the reference replay.
pub async fn run(plan: &TransientPlan, net: &NetArgs, out: &Path) -> crate::Result<TransientOutput> {
    let started = Instant::now();
    let all = plan.runs();
    let mut runs = Vec::new();
    for (i, (workers, policy, round)) in all.iter().enumerate() {
        eprint!("bench sync: transient [{}/{}] {workers} workers {policy} ... ", i + 1, all.len());
        let t = Instant::now();
        let spec = plan.spec(*workers, policy, plan.iterations)?;
        let dir = out.join("runs").join(format!("transient-w{workers}-{}-r{round}", policy.replace(':', "_")));
        let before = CpuSample::now();
        let wall = Instant::now();
        let run = measure(&spec, net, &dir, &[])
            .await
            .with_context(|| format!("transient, {workers} workers under {policy}"))?;
        let iterations = run.workers.iter().map(|w| w.iterations).sum();
        let cpu = before
            .zip(CpuSample::now())
            .and_then(|(a, b)| CpuUse::between(a, b, wall.elapsed().as_secs_f64(), iterations));
        let comm_ms = unheld_comm_ms(&run.workers, &spec.data);
        let ceiling = match comm_ms {
            Some(c) => Some(ceiling(plan, *workers, policy, c)?),
            None => None,
        };
        let r = TransientRun {
            workers: *workers,
            policy: policy.clone(),
            round: *round,
            chosen: false,
            requests_held: requests_held_real(&run),
            comm_ms,
            ceiling,
            cpu,
            run,
        };
        eprintln!(
            "{:.1} s: {:.1} it/s, ceiling {}, comm {} ms, {:.0} delayed pull requests, job cores {}",
            t.elapsed().as_secs_f64(),
            r.run.iters_per_s,
            r.ceiling.as_ref().map_or("-".into(), |c| format!("{:.1}", c.iters_per_s)),
            r.comm_ms.map_or("-".into(), |c| format!("{c:.1}")),
            r.requests_held,
            r.cpu.map_or("-".into(), |c| format!("{:.2} (others {:.2})", c.job_cores, c.others_cores)),
        );
        runs.push(r);
    }
    choose(&mut runs);
    let reference = reference(&plan.policies)?;
    Ok(TransientOutput { plan: plan.clone(), runs, reference, took_s: started.elapsed().as_secs_f64() })
}

/// Marks, per worker count and policy, its fastest round as the one the table shows.
fn choose(runs: &mut [TransientRun]) {
    let chosen = fastest(runs, |r| (r.workers, r.policy.clone()), |r| r.run.iters_per_s);
    runs.iter_mut().zip(chosen).for_each(|(r, c)| r.chosen = c);
}

/// The communication time of a round nobody holds, ms: per iteration (but the last, where
/// most workers only push), the round of the worker whose push came last, which under
/// every policy is answered without waiting for another worker; the median over
/// iterations. A worker's iteration k starts where k - 1 ended (`started_unix_ms` plus the
/// durations before it), computes and sleeps its draws (`data`'s [`elasticps_train::Delays`],
/// as the worker drew them), then communicates for the rest of `iter_ms[k]`.
pub fn unheld_comm_ms(workers: &[WorkerReport], data: &DataArgs) -> Option<f64> {
    let n = workers.iter().map(|w| w.iter_ms.len()).min()?;
    // Per worker, per iteration: (when it pushed, how long it communicated), ms.
    let mut per_worker = Vec::with_capacity(workers.len());
    for w in workers {
        let mut draws = data.delays(w.rank).ok()?;
        let mut start = w.started_unix_ms;
        let mut its = Vec::with_capacity(n);
        for (k, ms) in w.iter_ms.iter().take(n).enumerate() {
            let d = draws.next(k as u32);
            let busy = d.compute_ms + d.delay_ms;
            its.push((start + busy, (f64::from(*ms) - busy).max(0.0)));
            start += f64::from(*ms);
        }
        per_worker.push(its);
    }
    let last: Vec<f64> = (0..n.saturating_sub(1))
        .filter_map(|k| per_worker.iter().map(|its| its[k]).max_by(|a, b| a.0.total_cmp(&b.0)).map(|(_, comm)| comm))
        .collect();
    median(&last)
}

/// The replay of a job: on links and servers that cost nothing, with a link latency of
/// `latency_us` (to 0.1 µs).
fn sim_cmd(
    plan: &TransientPlan,
    workers: u32,
    policy: &str,
    iterations: u32,
    latency_us: f64,
) -> crate::Result<SimCmd> {
    let sim = SimArgs {
        latency_us: (latency_us * 10.0).round() / 10.0,
        link_mbps: ZERO_COST_MBPS,
        apply_mbps: ZERO_COST_MBPS,
        sim_seed: 1,
        ..sim_defaults()
    };
    Ok(plan.spec(workers, policy, iterations)?.sim_cmd(sim))
}

/// One replay: iterations/s, what a round nobody holds cost, the pull counters.
fn replay(cmd: &SimCmd) -> crate::Result<(f64, f64, u64, f64, u64)> {
    let out = elasticps_sim::simulate(cmd)?;
    let workers: Vec<WorkerReport> = out.run.workers.values().cloned().collect();
    let comm = unheld_comm_ms(&workers, &cmd.data).unwrap_or(f64::NAN);
    let held: u64 = out.run.servers.values().map(|s| s.totals.pulls_held).sum();
    let requests: f64 = out.run.servers.values().map(|s| s.totals.pulls_held as f64 / f64::from(s.blocks.max(1))).sum();
    let pulls: u64 = out.run.servers.values().map(|s| s.totals.pulls).sum();
    Ok((out.iterations_per_s, comm, held, requests, pulls))
}

/// The latency at which a round of `workers` workers costs `comm_ms` in the replay, µs:
/// from two calibration replays under asp (nobody waits), at no latency and at
/// [`CALIBRATION_US`], since a round's cost is linear in the latency when nothing else
/// costs anything.
fn latency_for(plan: &TransientPlan, workers: u32, comm_ms: f64) -> crate::Result<f64> {
    let iterations = plan.iterations.min(10);
    let (_, at_zero, ..) = replay(&sim_cmd(plan, workers, "asp", iterations, 0.0)?)?;
    let (_, at_cal, ..) = replay(&sim_cmd(plan, workers, "asp", iterations, CALIBRATION_US)?)?;
    let per_us = (at_cal - at_zero) / CALIBRATION_US;
    crate::error::ensure_measured!(
        per_us.is_finite() && per_us > 0.0,
        "the replay's round does not grow with the link latency ({at_zero} ms at 0, {at_cal} ms at {CALIBRATION_US} µs)"
    );
    Ok(((comm_ms - at_zero) / per_us).max(0.0))
}

/// The ceiling of `policy` with `workers` workers, a round costing `comm_ms`.
fn ceiling(plan: &TransientPlan, workers: u32, policy: &str, comm_ms: f64) -> crate::Result<Ceiling> {
    let latency_us = latency_for(plan, workers, comm_ms)?;
    let cmd = sim_cmd(plan, workers, policy, plan.iterations, latency_us)?;
    let (iters_per_s, comm, pulls_held, requests_held, pulls) = replay(&cmd)?;
    let flags = TrainSpec { job: cmd.job, data: cmd.data }.flags();
    Ok(Ceiling { flags, latency_us, comm_ms: comm, iters_per_s, pulls_held, requests_held, pulls })
}

/// Held pull requests of a real run: per server, held block pulls / blocks.
fn requests_held_real(run: &RunResult) -> f64 {
    run.servers.iter().map(|s| s.pulls_held as f64 / f64::from(s.blocks.max(1))).sum()
}

/// The reference constants: compute 10 ms, 3 ms of communication, 6 workers,
/// p = 0.1, D = 80 ms.
fn reference_plan(policies: &[String]) -> TransientPlan {
    TransientPlan {
        workers: vec![6],
        servers: 2,
        policies: policies.to_vec(),
        iterations: 300,
        rounds: 1,
        compute_ms: 10.0,
        jitter: "0.1:80".into(),
        jitter_spec: Jitter { p: 0.1, ms: 80.0 },
        p: 0.1,
        delay_ms: 80.0,
        margin: FULL_MARGIN,
    }
}

/// The hold rules at the reference constants, on the simulator.
fn reference(policies: &[String]) -> crate::Result<Vec<ReferenceRow>> {
    let plan = reference_plan(policies);
    let latency_us = latency_for(&plan, 6, 3.0)?;
    let mut rows = Vec::new();
    for p in policies {
        let (iters_per_s, _, held, _, pulls) = replay(&sim_cmd(&plan, 6, p, plan.iterations, latency_us)?)?;
        rows.push(ReferenceRow { policy: p.clone(), iters_per_s, held_share: held as f64 / pulls.max(1) as f64 });
    }
    Ok(rows)
}

/// The run the table shows for `workers` and `policy`.
fn find<'a>(out: &'a TransientOutput, workers: u32, policy: &str) -> Option<&'a TransientRun> {
    out.runs.iter().find(|r| r.workers == workers && r.policy == policy && r.chosen)
}

/// The checks of the scenario (they fail the command): at the smallest worker count,
/// ssp:3 and pssp:3:0.5 beat bsp by the plan's margin, and asp delays no pull.
pub fn checks(out: &TransientOutput) -> Vec<Check> {
    let Some(&w) = out.plan.workers.iter().min() else { return Vec::new() };
    let mut checks = Vec::new();
    let it_s = |p: &str| find(out, w, p).map(|r| r.run.iters_per_s);
    let margin = out.plan.margin;
    for p in ["ssp:3", "pssp:3:0.5"] {
        checks.push(Check::compare(
            format!("transient, {w} workers: iterations/s of {p} > {margin} x bsp"),
            (it_s(p), it_s("bsp")),
            |a, b| format!("{a:.1} vs {b:.1} ({})", ratio(a, b)),
            |a, b| a > margin * b,
        ));
    }
    let asp = find(out, w, "asp").map(|r| r.run.pulls_held);
    checks.push(Check {
        what: format!("transient, {w} workers: asp delays no pull"),
        measured: asp.map_or("not run".into(), |h| h.to_string()),
        pass: asp.map(|h| h == 0),
    });
    checks
}

/// The targets for the scenario (reported).
pub fn targets(out: &TransientOutput) -> Vec<Target> {
    let mut targets = Vec::new();
    let shown: Vec<&TransientRun> = out.runs.iter().filter(|r| r.chosen).collect();
    let short: Vec<String> = shown
        .iter()
        .filter(|r| r.of_ceiling().is_some_and(|f| f < 0.85))
        .map(|r| format!("{} at {} workers {:.0}%", r.policy, r.workers, r.of_ceiling().unwrap_or(0.0) * 100.0))
        .collect();
    let lowest = shown.iter().filter_map(|r| r.of_ceiling().map(|f| (f, r))).min_by(|a, b| a.0.total_cmp(&b.0));
    targets.push(Target {
        what: "transient: every policy reaches at least 85% of its own ceiling".into(),
        measured: match lowest {
            Some((f, r)) if short.is_empty() => {
                format!("lowest {:.0}% ({} at {} workers)", f * 100.0, r.policy, r.workers)
            }
            Some(_) => format!("below: {}", short.join(", ")),
            None => "not run".into(),
        },
        met: lowest.map(|_| short.is_empty()),
    });
    if out.plan.workers.contains(&8) {
        for p in ["ssp:3", "pssp:3:0.5"] {
            let (a, b) = (find(out, 8, p), find(out, 8, "bsp"));
            let ceiling = |r: &TransientRun| r.ceiling.as_ref().map(|c| c.iters_per_s);
            targets.push(Target {
                what: format!("transient, 8 workers: {p} runs at least 1.7x the iterations/s of bsp"),
                measured: match (a, b) {
                    (Some(a), Some(b)) => format!(
                        "{} ({:.1} vs {:.1} it/s; the ceilings' ratio {})",
                        ratio(a.run.iters_per_s, b.run.iters_per_s),
                        a.run.iters_per_s,
                        b.run.iters_per_s,
                        match (ceiling(a), ceiling(b)) {
                            (Some(x), Some(y)) => ratio(x, y),
                            _ => "-".into(),
                        }
                    ),
                    _ => "not run".into(),
                },
                met: a.zip(b).map(|(a, b)| a.run.iters_per_s >= 1.7 * b.run.iters_per_s),
            });
        }
    }
    targets
}

/// The scenario's Markdown: the plan, the table, the reference replay.
pub fn render(out: &TransientOutput) -> String {
    let p = &out.plan;
    let mut s = String::new();
    s.push_str(&format!(
        "\n### Transient stragglers\n\n{} servers; every worker slow by {} ms with probability {} at every \
         iteration (`--worker-jitter {}`); synthetic:resnet56, {} ms compute, {} iterations per worker, {} \
         rounds (the table shows each policy's fastest); {:.0} s in all. Ceiling: the replay of the policy's \
         hold rule on `elasticps sim` over the same draws, each round costing the run's measured \
         communication time (comm ms) and nothing else.\n\n",
        p.servers, p.delay_ms, p.p, p.jitter, p.compute_ms, p.iterations, p.rounds, out.took_s,
    ));
    let headers = [
        "workers",
        "policy",
        "it/s",
        "it/s by round",
        "vs bsp",
        "ceiling it/s",
        "ceiling vs bsp",
        "measured / ceiling",
        "comm ms",
        "delayed pull requests",
        "share of pulls delayed",
        "ceiling's share delayed",
        "mean hold ms",
        "max lead",
        "job CPU ms / it",
        "cores: job / others / idle",
    ];
    let mut rows = Vec::new();
    for &w in &p.workers {
        let bsp = find(out, w, "bsp");
        for policy in &p.policies {
            let Some(r) = find(out, w, policy) else { continue };
            let by_round: Vec<String> = out
                .runs
                .iter()
                .filter(|x| x.workers == w && x.policy == *policy)
                .map(|x| format!("{:.1}", x.run.iters_per_s))
                .collect();
            let c = r.ceiling.as_ref();
            let bsp_c = bsp.and_then(|b| b.ceiling.as_ref());
            rows.push(vec![
                w.to_string(),
                policy.clone(),
                format!("{:.1}", r.run.iters_per_s),
                by_round.join(" / "),
                bsp.map_or("-".into(), |b| ratio(r.run.iters_per_s, b.run.iters_per_s)),
                c.map_or("-".into(), |c| format!("{:.1}", c.iters_per_s)),
                c.zip(bsp_c).map_or("-".into(), |(c, b)| ratio(c.iters_per_s, b.iters_per_s)),
                r.of_ceiling().map_or("-".into(), |f| format!("{:.0}%", f * 100.0)),
                r.comm_ms.map_or("-".into(), |c| format!("{c:.1}")),
                format!("{:.0}", r.requests_held),
                format!("{:.1}%", 100.0 * r.run.pulls_held as f64 / r.run.pulls.max(1) as f64),
                c.map_or("-".into(), |c| format!("{:.1}%", 100.0 * c.pulls_held as f64 / c.pulls.max(1) as f64)),
                format!("{:.1}", r.run.hold_ms_mean),
                r.run.max_lead.to_string(),
                r.cpu.map_or("-".into(), |c| format!("{:.1}", c.job_ms_per_iteration)),
                r.cpu.map_or("-".into(), |c| {
                    format!("{:.2} / {:.2} / {:.2}", c.job_cores, c.others_cores, c.idle_cores)
                }),
            ]);
        }
    }
    s.push_str(&markdown_table(&headers, &rows));
    s.push_str(
        "\ncomm ms: per iteration, the round of the worker that pushed last (never held), median over \
         iterations. delayed pull requests: per server, held block pulls / its blocks (one request = one \
         worker's pull of one clock from one server, as FluentPS and the SSP papers count them). share of \
         pulls delayed: held / answered block pulls. job CPU ms / it: the CPU time of the job's processes \
         (scheduler, servers, workers) per iteration of one worker; cores: the job's CPU time / its wall \
         time, and the cores other processes used and left idle meanwhile.\n",
    );
    if !out.reference.is_empty() {
        let bsp = out.reference.iter().find(|r| r.policy == "bsp").map(|r| r.iters_per_s);
        s.push_str(
            "\nThe hold rules at the issue's reference constants (compute 10 ms, 3 ms of communication, 6 \
             workers, p = 0.1, D = 80 ms; `elasticps sim`, 300 iterations):\n\n",
        );
        let rows: Vec<Vec<String>> = out
            .reference
            .iter()
            .map(|r| {
                vec![
                    r.policy.clone(),
                    format!("{:.1}", r.iters_per_s),
                    bsp.map_or("-".into(), |b| ratio(r.iters_per_s, b)),
                    format!("{:.1}%", r.held_share * 100.0),
                ]
            })
            .collect();
        s.push_str(&markdown_table(&["policy", "it/s", "vs bsp", "share of pulls delayed"], &rows));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> TransientPlan {
        TransientPlan::new(
            vec![3],
            1,
            vec!["bsp".into(), "asp".into()],
            12,
            2,
            5.0,
            Jitter { p: 0.2, ms: 30.0 },
            FULL_MARGIN,
        )
        .unwrap()
        .unwrap()
    }

    #[test]
    fn plans_parse_into_train_and_sim_commands() {
        let p = plan();
        assert_eq!(p.runs().len(), 4);
        assert_eq!(p.runs()[2].1, "asp");
        let t = p.spec(3, "ssp:3", 12).unwrap();
        assert_eq!(t.data.worker_jitter, Some(Jitter { p: 0.2, ms: 30.0 }));
        assert_eq!((t.job.workers, t.job.sync.to_string()), (3, "ssp:3".to_string()));
        let s = sim_cmd(&p, 3, "bsp", 12, 250.04).unwrap();
        assert_eq!((s.sim.latency_us, s.sim.link_mbps), (250.0, ZERO_COST_MBPS));
        assert!(TransientPlan::new(vec![8], 2, vec![], 0, 1, 1.0, Jitter { p: 0.1, ms: 1.0 }, 1.0).unwrap().is_none());
    }

    #[test]
    fn the_ceiling_replays_the_communication_time_it_is_given() {
        let p = plan();
        // The calibrated latency makes a round nobody holds cost what was measured.
        for comm in [2.0, 9.0] {
            let c = ceiling(&p, 3, "bsp", comm).unwrap();
            assert!((c.comm_ms - comm).abs() < 0.05 * comm, "asked {comm} ms, the replay's round costs {c:?}");
        }
        // bsp's ceiling is below asp's: it pays each iteration's largest delay.
        let (bsp, asp) = (ceiling(&p, 3, "bsp", 2.0).unwrap(), ceiling(&p, 3, "asp", 2.0).unwrap());
        assert!(bsp.iters_per_s < 0.9 * asp.iters_per_s, "{bsp:?} vs {asp:?}");
        assert!(bsp.pulls_held > 0 && asp.pulls_held == 0);
    }

    #[test]
    fn the_unheld_round_is_the_last_pushers() {
        let data = plan().spec(2, "bsp", 4).unwrap().data;
        let mut draws: Vec<_> = (0..2).map(|r| data.delays(r).unwrap()).collect();
        // Two workers that never wait for each other: worker 0 communicates 7 ms per
        // iteration, worker 1 3 ms; worker 1 started a second later, so it always pushes
        // last, and its rounds are the ones measured.
        let (mut d0, mut d1) = (Vec::new(), Vec::new());
        for k in 0..4 {
            let (a, b) = (draws[0].next(k), draws[1].next(k));
            d0.push(a.compute_ms + a.delay_ms + 7.0);
            d1.push(b.compute_ms + b.delay_ms + 3.0);
        }
        let w = |rank, start, iter_ms: &[f64]| WorkerReport {
            rank,
            started_unix_ms: start,
            iter_ms: iter_ms.iter().map(|v| *v as f32).collect(),
            ..Default::default()
        };
        let workers = [w(0, 0.0, &d0), w(1, 1000.0, &d1)];
        let c = unheld_comm_ms(&workers, &data).unwrap();
        assert!((c - 3.0).abs() < 0.01, "{c}");
    }
}
