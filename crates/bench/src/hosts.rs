//! `elasticps bench hosts`: static placement vs PSLD on a job that spans hosts for real.
//!
//! A test bed of 5 "hosts" (network namespaces on a bridge, `scripts/testnet`, needs root):
//!
//! - host 1 (`P1`) is the rendezvous: its launch runs the scheduler and the 2 workers;
//! - hosts 2, 3 and 4 run one server each; host 2 is the one a row disturbs;
//! - host 5 (`P5`) is a spare: it joins after the job started, so it starts nothing, and
//!   brings 2 server slots for a scale-out.
//!
//! One invocation runs several rows on the same bed, one condition each ([`Condition`]):
//!
//! - **a cap** per rate of `--caps-mbit` (default 50 and 400; `--quick`: 100 only): host
//!   2's link capped with `tc tbf` in both directions; the row first measures the raw TCP
//!   rate over the capped link, each direction (`bench tcp-sink` on host 1, `bench
//!   tcp-rate` on host 2: plain sockets, no framing);
//! - **a busy neighbour** (full form; `--neighbour false` leaves it out, `--neighbour` adds
//!   it to `--quick`): no cap; a busy loop (`sh -c 'while :; do :; done'`, one process,
//!   pinned nowhere: the hosts share the machine's cores anyway) runs on host 2 for both
//!   runs of the row, started and stopped by PID by the benchmark, so the noise of a shared
//!   cluster is there and there is no straggler to find.
//!
//! Each row runs the job with `--balance static`, then with `--balance psld --max-servers
//! 4` (psld may scale out onto the spare). Both jobs: the same model (`synthetic:resnet56`
//! by default), bsp, sgd, bestfit placement, 4 MiB blocks; in a capped row the psld run has
//! more iterations (it needs time to detect and settle; the numbers are rates), in the
//! neighbour row both runs have the same number, so their whole runs compare.
//!
//! Every job's five launches start through `testnet exec`, each once the one before joined
//! (so the spare joins after the job started and takes no first node); every wait has a
//! timeout that names what it waits for. The bed is torn down at the end, on error and on
//! Ctrl-C or SIGTERM (`Bed`'s `Drop`: every process it started, the neighbour included,
//! and every process left in its namespaces, is stopped by PID, then `testnet down`).
//!
//! The numbers per job, from the rendezvous launch's `report.json`: samples/s over the whole
//! run (the report's own), and the rate after the balancer settled (psld) or after every
//! worker's first iteration (static), as `bench straggler` measures it
//! (`crate::straggler::measure`); psld's migrations (and how many moved a block back to a
//! server it had been on), its judged decisions (`balance.decisions`: kept or reverted,
//! predicted and measured gain) and its scaling events; which host each server ran on (the
//! scheduler's `server joined ... addr=` lines), so a scale-out server on the spare shows.
//! The link bound of a capped row: static placement leaves about a third of the model on
//! the capped server, which both workers push and pull across its link every iteration.
//!
//! Checks (fail the command): every run completes; in every capped row the cap is in effect
//! (raw TCP at most 1.2 x the cap); full form: psld >= [`FULL_RATIO`] x static samples/s
//! (after settling) in the [`CHECKED_CAP_MBIT`] mbit row; `--quick`: psld >= [`QUICK_NOISE`]
//! x static in its capped row (not slower beyond noise). The targets
//! ([`CAP_TARGETS`], [`NEIGHBOUR_RATIO`] with at most [`NEIGHBOUR_MIGRATIONS`] migrations,
//! a scale-out onto the spare) are reported, met or missed.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use elasticps_core::stats::ratio;
use elasticps_report::table::{fixed, markdown_table};
use elasticps_report::{BalanceLog, Report};
use serde::Serialize;
use tokio::process::{Child, Command};

use crate::checks::{Check, Target, checks_and_targets_markdown};
use crate::error::Context as _;
use crate::job::{RunResult, TrainSpec};
use crate::pipeline::{Bench, Written};
use crate::straggler::{Mode, measure};
use crate::{BenchError, Result};
use elasticps_core::balance::BalanceMode;
use elasticps_core::optimizer::OptimizerKind;
use elasticps_core::placement::PlacementKind;
use elasticps_launch::args::{DataArgs, JobArgs};
use elasticps_train::ModelKind;

/// `--quick`: psld must reach this share of static's samples/s (a run-to-run swing of the
/// capped link; psld cannot beat the link bound here, see the module docs).
pub const QUICK_NOISE: f64 = 0.8;
/// The full form's check: psld / static samples/s (after settling) in the
/// [`CHECKED_CAP_MBIT`] row.
pub const FULL_RATIO: f64 = 2.0;
/// The capped row the full form's check applies to, mbit/s (skipped without one).
pub const CHECKED_CAP_MBIT: u32 = 50;
/// The targets per cap: (mbit/s, psld / static samples/s after settling).
pub const CAP_TARGETS: [(u32, f64); 2] = [(50, 2.0), (400, 1.5)];
/// The target with the busy neighbour and no cap: psld / static samples/s (whole
/// runs of the same length: the cost of every move counts)...
pub const NEIGHBOUR_RATIO: f64 = 0.97;
/// ... with at most this many migrations.
pub const NEIGHBOUR_MIGRATIONS: usize = 3;
/// The rendezvous port on host 1.
const RDZV_PORT: u16 = 29400;
/// Hosts of the bed.
const HOSTS: usize = 5;
/// The bed host (0-based) a row disturbs: capped, or the busy neighbour's.
const DISTURBED: usize = 1;
/// The busy neighbour's command.
const BUSY_LOOP: [&str; 3] = ["sh", "-c", "while :; do :; done"];

/// `elasticps bench hosts`.
#[derive(Args, Clone, Debug)]
pub struct HostsBenchCmd {
    /// The short form (about 15 s in a debug build): one row, host 2 capped at 100 mbit,
    /// fewer iterations; checks psld >= 0.8 x static instead of 2.0 x.
    #[arg(long)]
    pub quick: bool,
    /// Write bench-hosts.json, bench-hosts.md and every run's reports and logs here.
    #[arg(long, default_value = "target/bench-hosts")]
    pub out: PathBuf,
    /// Caps of host 2's link, mbit/s each way, one row each [default: 50,400; quick: 100].
    #[arg(long, alias = "cap-mbit", value_delimiter = ',', num_args = 1..)]
    pub caps_mbit: Option<Vec<u32>>,
    /// The busy-neighbour row (no cap, a busy loop on host 2) [default: full form yes,
    /// quick no; `--neighbour` alone: yes].
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub neighbour: Option<bool>,
    /// Iterations per worker of every static run [default: per cap 40 x cap/50 within 40..200,
    /// neighbour 400; quick: 16, neighbour 40].
    #[arg(long)]
    pub static_iterations: Option<u32>,
    /// Iterations per worker of every psld run [default: capped 900, neighbour 400; quick: 40].
    #[arg(long)]
    pub psld_iterations: Option<u32>,
    /// The workers' model.
    #[arg(long, default_value = "synthetic:resnet56")]
    pub model: String,
    /// The workers' compute time per iteration, ms.
    #[arg(long, default_value_t = 20.0)]
    pub compute_ms: f64,
    /// Seconds of each raw TCP direction.
    #[arg(long, default_value_t = 3.0)]
    pub tcp_secs: f64,
    /// The bed's prefix (namespaces PREFIX1..PREFIX5; at most 6 characters).
    #[arg(long, default_value = "ebh")]
    pub prefix: String,
    /// The test bed script [default: scripts/testnet here, or beside the executable's repository].
    #[arg(long)]
    pub testnet: Option<PathBuf>,
}

/// `elasticps bench tcp-rate` (hidden): the raw TCP client of `bench hosts`, run inside a
/// bed host; prints one JSON line `{"direction", "bytes", "secs", "mbit_per_s"}`.
#[derive(Args, Clone, Debug)]
pub struct TcpRateCmd {
    /// The `bench tcp-sink` to measure against.
    #[arg(long)]
    pub to: String,
    /// `up`: this host sends (its egress); `down`: the sink sends (its ingress).
    #[arg(long, value_enum)]
    pub direction: Direction,
    /// How long to stream, seconds.
    #[arg(long, default_value_t = 3.0)]
    pub secs: f64,
}

/// A direction of the capped link, seen from the capped host.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// The capped host sends.
    Up,
    /// The capped host receives.
    Down,
}

/// One raw TCP measurement.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct TcpRate {
    /// Which way.
    pub direction: Direction,
    /// Bytes that arrived.
    pub bytes: u64,
    /// From the first write to the last byte counted, s.
    pub secs: f64,
    /// `bytes * 8 / secs / 1e6`.
    pub mbit_per_s: f64,
}

/// `elasticps bench tcp-rate`.
pub async fn tcp_rate(cmd: TcpRateCmd) -> Result<()> {
    let time = Duration::try_from_secs_f64(cmd.secs).map_err(|_| BenchError::Flags("--secs: not a duration".into()))?;
    let start = Arc::new(tokio::sync::Barrier::new(1));
    let lane = match cmd.direction {
        // Bounded by time: the total is more than any link here moves in that time.
        Direction::Up => crate::sink::stream_in(cmd.to.clone(), u64::MAX / 2, time, start).await?,
        Direction::Down => crate::sink::stream_out(cmd.to.clone(), 1 << 40, time, start).await?,
    };
    let secs = (lane.end - lane.start).as_secs_f64();
    let rate =
        TcpRate { direction: cmd.direction, bytes: lane.bytes, secs, mbit_per_s: lane.bytes as f64 * 8.0 / secs / 1e6 };
    println!("{}", serde_json::to_string(&rate)?);
    Ok(())
}

/// What a row of the benchmark does to host 2.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Condition {
    /// Its link capped at this many mbit/s each way.
    Cap(u32),
    /// No cap; a busy loop runs there for both runs of the row.
    Neighbour,
}

impl Condition {
    /// The row's directory under `runs/`.
    fn label(self) -> String {
        match self {
            Condition::Cap(mbit) => format!("cap{mbit}"),
            Condition::Neighbour => "neighbour".into(),
        }
    }

    /// The row's name in the tables.
    fn describe(self) -> String {
        match self {
            Condition::Cap(mbit) => format!("{mbit} Mbit/s cap"),
            Condition::Neighbour => "busy neighbour, no cap".into(),
        }
    }

    /// The psld / static target of a capped row, if it has one.
    fn target(self) -> Option<f64> {
        match self {
            Condition::Cap(mbit) => CAP_TARGETS.iter().find(|(m, _)| *m == mbit).map(|(_, r)| *r),
            Condition::Neighbour => Some(NEIGHBOUR_RATIO),
        }
    }
}

/// One row of the plan: a condition and the iterations of its two runs.
#[derive(Clone, Copy, Debug, Serialize)]
struct RowPlan {
    condition: Condition,
    static_iterations: u32,
    psld_iterations: u32,
}

impl RowPlan {
    fn iterations(&self, mode: Mode) -> u32 {
        if mode == Mode::Psld { self.psld_iterations } else { self.static_iterations }
    }
}

/// What is run, resolved from the flags.
#[derive(Clone, Debug, Serialize)]
struct Plan {
    quick: bool,
    rows: Vec<RowPlan>,
    model: String,
    compute_ms: f64,
    batch_size: u32,
    tcp_secs: f64,
    prefix: String,
    /// The workers' model, typed.
    #[serde(skip)]
    model_kind: ModelKind,
}

impl Plan {
    fn new(cmd: &HostsBenchCmd) -> Result<Self> {
        let quick = cmd.quick;
        let caps = cmd.caps_mbit.clone().unwrap_or_else(|| if quick { vec![100] } else { vec![50, 400] });
        crate::error::ensure_flags!(caps.iter().all(|c| *c >= 1), "--caps-mbit: every cap must be at least 1");
        let mut distinct = caps.clone();
        distinct.sort_unstable();
        distinct.dedup();
        crate::error::ensure_flags!(distinct.len() == caps.len(), "--caps-mbit: a cap is given twice");
        let mut rows: Vec<RowPlan> = caps
            .iter()
            .map(|&c| RowPlan {
                condition: Condition::Cap(c),
                static_iterations: cmd.static_iterations.unwrap_or(if quick {
                    16
                } else {
                    (40u32.saturating_mul(c) / 50).clamp(40, 200)
                }),
                psld_iterations: cmd.psld_iterations.unwrap_or(if quick { 40 } else { 900 }),
            })
            .collect();
        if cmd.neighbour.unwrap_or(!quick) {
            let n = if quick { 40 } else { 400 };
            rows.push(RowPlan {
                condition: Condition::Neighbour,
                static_iterations: cmd.static_iterations.unwrap_or(n),
                psld_iterations: cmd.psld_iterations.unwrap_or(n),
            });
        }
        let plan = Plan {
            quick,
            rows,
            model: cmd.model.clone(),
            compute_ms: cmd.compute_ms,
            batch_size: 32,
            tcp_secs: cmd.tcp_secs,
            prefix: cmd.prefix.clone(),
            model_kind: cmd.model.parse().map_err(|e: elasticps_train::TrainError| BenchError::Flags(e.to_string()))?,
        };
        crate::error::ensure_flags!(!plan.rows.is_empty(), "nothing to run: no cap and no neighbour");
        crate::error::ensure_flags!(
            plan.rows.iter().all(|r| r.static_iterations >= 4 && r.psld_iterations >= 4),
            "a run needs at least 4 iterations per worker"
        );
        crate::error::ensure_flags!(plan.tcp_secs > 0.2 && plan.tcp_secs <= 60.0, "--tcp-secs must be in (0.2, 60]");
        crate::error::ensure_flags!(
            plan.prefix.len() <= 6
                && plan.prefix.starts_with(|c: char| c.is_ascii_lowercase())
                && plan.prefix.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit()),
            "--prefix must be 1-6 lowercase letters/digits starting with a letter"
        );
        Ok(plan)
    }

    /// The job of `mode` with `iterations` per worker: the same on every host (the launch
    /// sets the servers and workers from each host's slots; the scheduler takes the
    /// rendezvous host's).
    fn spec(&self, mode: Mode, iterations: u32) -> TrainSpec {
        let job = JobArgs {
            optimizer: OptimizerKind::Sgd,
            lr: 0.01,
            placement: PlacementKind::BestFit,
            balance: if mode == Mode::Psld { BalanceMode::Psld } else { BalanceMode::Static },
            max_servers: (mode == Mode::Psld).then_some(4),
            ..JobArgs::default()
        };
        let data = DataArgs {
            model: self.model_kind,
            compute_ms: self.compute_ms,
            iterations: Some(iterations),
            batch_size: self.batch_size as usize,
            request_timeout_s: 60,
            ..DataArgs::default()
        };
        TrainSpec { job, data }
    }

    /// How long a whole job may take: a generous bound on the capped link's time (two
    /// models each way per iteration at half the cap; an uncapped row counts as 1000 mbit)
    /// plus startup.
    fn job_timeout(row: &RowPlan, mode: Mode, model_mb: f64) -> Duration {
        let mbit = match row.condition {
            Condition::Cap(mbit) => f64::from(mbit),
            Condition::Neighbour => 1000.0,
        };
        let per_iter = 2.0 * 2.0 * model_mb * 8.0 / mbit + 0.2;
        Duration::from_secs_f64(60.0 + f64::from(row.iterations(mode)) * per_iter)
    }
}

/// A bed host.
#[derive(Clone, Debug, Serialize)]
pub struct BedHost {
    /// Namespace name, e.g. `ebh2`.
    pub name: String,
    /// Its address.
    pub ip: String,
    /// Its role in the benchmark.
    pub role: &'static str,
}

/// The test bed, and every process started in it: torn down on drop.
struct Bed {
    testnet: PathBuf,
    prefix: String,
    hosts: Vec<BedHost>,
    pids: Arc<Mutex<Vec<u32>>>,
}

impl Bed {
    /// `testnet up 5 --prefix P`.
    fn up(testnet: &Path, prefix: &str) -> Result<Bed> {
        let out = std::process::Command::new(testnet)
            .args(["up", &HOSTS.to_string(), "--prefix", prefix])
            .output()
            .with_context(|| format!("running {} up", testnet.display()))?;
        // From here on, a half-made bed is torn down too.
        let mut bed =
            Bed { testnet: testnet.to_path_buf(), prefix: prefix.into(), hosts: Vec::new(), pids: Default::default() };
        crate::error::ensure_measured!(
            out.status.success(),
            "testnet up {HOSTS} --prefix {prefix} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
        let roles = ["rendezvous, workers", "server, capped or busy neighbour", "server", "server", "spare"];
        for (i, line) in String::from_utf8_lossy(&out.stdout).lines().enumerate() {
            let mut words = line.split_whitespace();
            if let (Some(name), Some(ip)) = (words.next(), words.next()) {
                bed.hosts.push(BedHost {
                    name: name.into(),
                    ip: ip.into(),
                    role: roles.get(i).copied().unwrap_or("?"),
                });
            }
        }
        crate::error::ensure_measured!(
            bed.hosts.len() == HOSTS,
            "testnet up printed {} hosts, not {HOSTS}: {}",
            bed.hosts.len(),
            String::from_utf8_lossy(&out.stdout).trim()
        );
        Ok(bed)
    }

    /// A `testnet` subcommand that must succeed.
    fn testnet(&self, args: &[&str]) -> Result<()> {
        let out = std::process::Command::new(&self.testnet).args(args).output()?;
        crate::error::ensure_measured!(
            out.status.success(),
            "testnet {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(())
    }

    /// Starts `argv` on bed host `host` (0-based) through `testnet exec` (its PID is the
    /// command's own), stdout and stderr into `log`; the process is remembered for the teardown.
    fn spawn(&self, host: usize, argv: &[String], log: &Path, secret: &str) -> Result<Child> {
        let file = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let mut cmd = Command::new(&self.testnet);
        cmd.arg("exec").arg(&self.hosts[host].name).arg("--").args(argv);
        // Only the benchmark's settings reach the job, not the shell's ELASTICPS_*.
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("ELASTICPS_") {
                cmd.env_remove(&k);
            }
        }
        cmd.env("ELASTICPS_SECRET", secret);
        cmd.stdin(Stdio::null()).stdout(file.try_clone()?).stderr(file);
        let child = cmd.spawn().with_context(|| format!("starting {} on {}", argv.join(" "), self.hosts[host].name))?;
        if let Some(pid) = child.id() {
            self.pids.lock().unwrap_or_else(|e| e.into_inner()).push(pid);
        }
        Ok(child)
    }

    /// PIDs of every process in the bed's namespaces.
    fn netns_pids(&self) -> Vec<u32> {
        let mut pids = Vec::new();
        for h in &self.hosts {
            if let Ok(out) = std::process::Command::new("ip").args(["netns", "pids", &h.name]).output() {
                pids.extend(
                    String::from_utf8_lossy(&out.stdout).split_whitespace().filter_map(|p| p.parse::<u32>().ok()),
                );
            }
        }
        pids.retain(|p| *p != std::process::id());
        pids
    }

    /// Stops every process it started and every process in its namespaces: SIGTERM (a
    /// launch stops its nodes), up to 5 s, then SIGKILL.
    fn stop_all(&self) {
        let started: Vec<u32> = self.pids.lock().unwrap_or_else(|e| e.into_inner()).drain(..).collect();
        let alive = |pid: u32| {
            // A zombie (exited, not yet reaped) counts as gone.
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| s.rsplit_once(')').map(|(_, rest)| !rest.trim_start().starts_with('Z')))
                .unwrap_or(false)
        };
        let signal = |sig: &str, pids: &[u32]| {
            if !pids.is_empty() {
                let _ = std::process::Command::new("kill")
                    .arg("-s")
                    .arg(sig)
                    .args(pids.iter().map(u32::to_string))
                    .stderr(Stdio::null())
                    .status();
            }
        };
        let live = |extra: &[u32]| {
            let mut all: Vec<u32> = started.iter().chain(extra).copied().filter(|p| alive(*p)).collect();
            all.sort_unstable();
            all.dedup();
            all
        };
        let first = live(&self.netns_pids());
        signal("TERM", &first);
        let until = Instant::now() + Duration::from_secs(5);
        while Instant::now() < until && !live(&self.netns_pids()).is_empty() {
            std::thread::sleep(Duration::from_millis(100));
        }
        let left = live(&self.netns_pids());
        if !left.is_empty() {
            eprintln!("bench hosts: killing {} processes left in the bed: {left:?}", left.len());
            signal("KILL", &left);
        }
    }
}

impl Drop for Bed {
    fn drop(&mut self) {
        self.stop_all();
        let down = std::process::Command::new(&self.testnet).args(["down", "--prefix", &self.prefix]).output();
        match down {
            Ok(o) if o.status.success() => {}
            Ok(o) => eprintln!(
                "bench hosts: testnet down --prefix {} failed: {}",
                self.prefix,
                String::from_utf8_lossy(&o.stderr).trim()
            ),
            Err(e) => eprintln!("bench hosts: testnet down --prefix {} failed: {e}", self.prefix),
        }
    }
}

/// Which host ran a server.
#[derive(Clone, Debug, Serialize)]
pub struct ServerHost {
    /// The server id.
    pub server: u32,
    /// Its advertised address.
    pub addr: String,
    /// The bed host of that address.
    pub host: String,
    /// One of the job's first servers (`false`: a scale-out or a replacement).
    pub initial: bool,
}

/// One judged decision of the balancer, as report.json's `balance.decisions` has it.
pub use elasticps_runtime::scheduler::DecisionRecord as Judged;

/// The decisions of a report.json, `[]` when it has none (an older scheduler's report);
/// a field a record lacks reads as its default.
pub(crate) fn judged(report: &serde_json::Value) -> Vec<Judged> {
    report
        .get("balance")
        .and_then(|b| b.get("decisions"))
        .and_then(|d| serde_json::from_value(d.clone()).ok())
        .unwrap_or_default()
}

/// One job's results.
#[derive(Clone, Debug, Serialize)]
pub struct HostsRun {
    /// How it balanced.
    pub mode: Mode,
    /// Iterations per worker.
    pub iterations: u32,
    /// The job's flags (the launch takes its job's, the workers its data's).
    pub flags: Vec<String>,
    /// Why it failed (`None`: it completed).
    pub error: Option<String>,
    /// The report's samples/s (whole run).
    pub samples_per_sec: f64,
    /// Samples/s after the settle (psld) or the warm-up iteration (static); the whole run's
    /// when the balancer moved so late that no window is left ([`Self::settled_too_late`]).
    pub settled_samples_per_sec: f64,
    /// The balancer moved in the last iterations, so no window was left after its settle:
    /// [`Self::settled_samples_per_sec`] is the whole run's, which counts the unbalanced start
    /// against psld (a comparison on it only gets harder).
    pub settled_too_late: bool,
    /// The bytes of the model, from the report's servers.
    pub model_bytes: u64,
    /// Which host each server ran on.
    pub servers: Vec<ServerHost>,
    /// Successful migrations that moved a block back to a server it had been on before
    /// (a reverted round, or a bounce).
    pub moved_back: usize,
    /// The balancer's judged decisions.
    pub decisions: Vec<Judged>,
    /// The straggler benchmark's numbers of the run (window, migrations, scaling...).
    pub run: Option<RunResult>,
}

impl HostsRun {
    /// Decisions kept and reverted.
    fn verdicts(&self) -> (usize, usize) {
        let kept = self.decisions.iter().filter(|d| d.verdict == "kept").count();
        let reverted = self.decisions.iter().filter(|d| d.verdict == "reverted").count();
        (kept, reverted)
    }

    /// Successful migrations.
    fn migrations(&self) -> usize {
        self.run.as_ref().map_or(0, |x| x.balance().migrations)
    }

    /// Its scaling events, `action server at s; ...`, or `none`.
    fn scaling(&self) -> String {
        let Some(x) = self.run.as_ref() else { return "-".into() };
        if x.balance().scaling.is_empty() {
            return "none".into();
        }
        x.balance()
            .scaling
            .iter()
            .map(|e| format!("{} {} at {:.1} s", e.action, e.server.map_or("-".into(), |v| v.to_string()), e.at_s))
            .collect::<Vec<_>>()
            .join("; ")
    }
}

/// What the busy neighbour took while it ran.
#[derive(Clone, Debug, Serialize)]
pub struct NeighbourLoad {
    /// Its PID.
    pub pid: Option<u32>,
    /// How long it ran, s.
    pub wall_s: f64,
    /// Its CPU time over the machine's (all cores), from /proc (`None`: not readable).
    pub machine_share: Option<f64>,
    /// Cores it kept busy on average.
    pub cores: Option<f64>,
    /// What went wrong with it (`None`: it ran throughout and was stopped).
    pub error: Option<String>,
}

/// One row: a condition, its raw link, its two runs.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// What host 2 had.
    pub condition: Condition,
    /// The raw TCP rate over the capped link (none without a cap).
    pub tcp: Vec<TcpRate>,
    /// Why measuring it failed.
    pub tcp_error: Option<String>,
    /// The busy neighbour of the row.
    pub neighbour: Option<NeighbourLoad>,
    /// Static, then psld.
    pub runs: Vec<HostsRun>,
}

impl Row {
    /// The completed run of `mode`.
    fn find(&self, mode: Mode) -> Option<&HostsRun> {
        self.runs.iter().find(|r| r.mode == mode && r.error.is_none())
    }

    /// The rates psld and static are compared on: after settling in a capped row (the
    /// balancer's result), whole runs in the neighbour row (the cost of every move counts).
    fn compared(&self, r: &HostsRun) -> f64 {
        match self.condition {
            Condition::Cap(_) => r.settled_samples_per_sec,
            Condition::Neighbour => r.samples_per_sec,
        }
    }

    /// psld's and static's compared rates, when both completed.
    fn pair(&self) -> Option<(f64, f64)> {
        Some((self.compared(self.find(Mode::Psld)?), self.compared(self.find(Mode::Static)?)))
    }

    /// `psld vs static (ratio); whole runs ... ` for the checks and targets.
    fn versus(&self) -> String {
        match (self.find(Mode::Psld), self.find(Mode::Static)) {
            (Some(p), Some(s)) => format!(
                "{:.1}{} vs {:.1} samples/s after settling ({}); whole runs {:.1} vs {:.1} ({})",
                p.settled_samples_per_sec,
                if p.settled_too_late { " (whole run: settled too late)" } else { "" },
                s.settled_samples_per_sec,
                ratio(p.settled_samples_per_sec, s.settled_samples_per_sec),
                p.samples_per_sec,
                s.samples_per_sec,
                ratio(p.samples_per_sec, s.samples_per_sec)
            ),
            _ => "a run failed".into(),
        }
    }
}

/// What the bed measured (the body of bench-hosts.json).
#[derive(Clone, Debug, Serialize)]
pub struct Body {
    plan: Plan,
    bed: Vec<BedHost>,
    rows: Vec<Row>,
}

/// Finds the testnet script: the flag, `scripts/testnet` here, or in the repository the
/// executable was built in (`REPO/target/PROFILE/elasticps`).
fn testnet_script(cmd: &HostsBenchCmd) -> Result<PathBuf> {
    if let Some(p) = &cmd.testnet {
        return Ok(p.clone());
    }
    let mut candidates = vec![PathBuf::from("scripts/testnet")];
    if let Ok(exe) = std::env::current_exe() {
        candidates.extend(exe.ancestors().skip(1).take(4).map(|d| d.join("scripts/testnet")));
    }
    candidates.into_iter().find(|p| p.is_file()).ok_or_else(|| {
        BenchError::Flags("cannot find scripts/testnet (run from the repository, or pass --testnet PATH)".into())
    })
}

/// `elasticps bench hosts`, its plan resolved and the test bed found.
pub struct HostsBench {
    cmd: HostsBenchCmd,
    plan: Plan,
    testnet: PathBuf,
}

impl HostsBench {
    /// The plan of `cmd`; fails without root or without the test bed script.
    pub fn new(cmd: HostsBenchCmd) -> Result<Self> {
        let plan = Plan::new(&cmd)?;
        crate::error::ensure_flags!(
            std::fs::read_to_string("/proc/self/status")
                .map(|s| s.lines().any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(2) == Some("0")))
                .unwrap_or(false),
            "bench hosts needs root (network namespaces and tc)"
        );
        Ok(HostsBench { testnet: testnet_script(&cmd)?, plan, cmd })
    }
}

impl Bench for HostsBench {
    const STEM: &'static str = "bench-hosts";
    const RUNS_DIR: bool = true;
    type Body = Body;

    fn out(&self) -> Option<&Path> {
        Some(&self.cmd.out)
    }

    async fn run(&self) -> Result<Body> {
        let plan = &self.plan;
        let exe = std::env::current_exe()?.display().to_string();
        eprintln!("bench hosts: test bed {}1..{}{HOSTS} via {}", plan.prefix, plan.prefix, self.testnet.display());
        let bed = Bed::up(&self.testnet, &plan.prefix)?;
        // Ctrl-C or SIGTERM: the body stops where it is (a running neighbour is stopped as
        // it is dropped), and the bed is torn down below.
        let body = measure_all(&bed, plan, &self.cmd.out, &exe);
        let result = tokio::select! {
            r = body => r,
            how = stop_signal() => Err(BenchError::Failed(format!("stopped by {how}: the test bed is torn down"))),
        };
        let hosts = bed.hosts.clone();
        drop(bed);
        Ok(Body { plan: plan.clone(), bed: hosts, rows: result? })
    }

    fn verdicts(&self, body: &Body) -> (Vec<Check>, Vec<Target>) {
        (checks(&body.plan, &body.rows), targets(&body.rows))
    }

    fn markdown(&self, written: &Written<Body>) -> String {
        render(written)
    }
}

/// SIGINT or SIGTERM.
async fn stop_signal() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    match (signal(SignalKind::interrupt()), signal(SignalKind::terminate())) {
        (Ok(mut int), Ok(mut term)) => tokio::select! {
            _ = int.recv() => "SIGINT",
            _ = term.recv() => "SIGTERM",
        },
        _ => std::future::pending().await,
    }
}

/// Runs every row of the plan on the bed.
async fn measure_all(bed: &Bed, plan: &Plan, out: &Path, exe: &str) -> Result<Vec<Row>> {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let secret = format!("bench-hosts-{}-{nanos}", std::process::id());
    let runs_dir = out.join("runs");
    let _ = std::fs::remove_dir_all(&runs_dir);
    std::fs::create_dir_all(&runs_dir)?;
    let mut rows = Vec::new();
    for row in &plan.rows {
        rows.push(measure_row(bed, plan, row, &runs_dir, exe, &secret).await?);
    }
    Ok(rows)
}

/// One row: caps host 2 and measures the raw link (or uncaps it and starts the busy
/// neighbour), runs static then psld, stops the neighbour.
async fn measure_row(bed: &Bed, plan: &Plan, row: &RowPlan, runs_dir: &Path, exe: &str, secret: &str) -> Result<Row> {
    let dir = runs_dir.join(row.condition.label());
    std::fs::create_dir_all(&dir)?;
    let host = bed.hosts[DISTURBED].name.clone();
    let mut out = Row { condition: row.condition, tcp: Vec::new(), tcp_error: None, neighbour: None, runs: Vec::new() };
    let mut neighbour = match row.condition {
        Condition::Cap(mbit) => {
            bed.testnet(&["cap", &host, &mbit.to_string()])?;
            eprint!("bench hosts: raw TCP over the {mbit} mbit link ... ");
            match raw_tcp(bed, plan, &dir, exe, secret).await {
                Ok(t) => {
                    let s: Vec<String> = t.iter().map(|r| format!("{:?} {:.1}", r.direction, r.mbit_per_s)).collect();
                    eprintln!("{} Mbit/s", s.join(", "));
                    out.tcp = t;
                }
                Err(e) => {
                    eprintln!("FAILED: {e}");
                    out.tcp_error = Some(e.to_string());
                }
            }
            None
        }
        Condition::Neighbour => {
            bed.testnet(&["uncap", &host])?;
            let n = Neighbour::start(bed, &dir.join("neighbour.log"), secret)?;
            eprintln!("bench hosts: busy neighbour on {host}: pid {}", n.pid.map_or("?".into(), |p| p.to_string()));
            Some(n)
        }
    };
    for mode in [Mode::Static, Mode::Psld] {
        eprint!(
            "bench hosts: {}, {} ({} iterations per worker) ... ",
            row.condition.describe(),
            mode.name(),
            row.iterations(mode)
        );
        let t = Instant::now();
        let r = one_job(bed, plan, row, &dir, exe, secret, mode).await;
        match &r.error {
            None => {
                let (kept, reverted) = r.verdicts();
                eprintln!(
                    "{:.1} s: {:.1} samples/s ({:.1} after settling), {} migrations, {kept} kept and {reverted} \
                     reverted decisions, {} scaling events",
                    t.elapsed().as_secs_f64(),
                    r.samples_per_sec,
                    r.settled_samples_per_sec,
                    r.migrations(),
                    r.run.as_ref().map_or(0, |x| x.balance().scaling.len())
                )
            }
            Some(e) => eprintln!("FAILED after {:.1} s: {e}", t.elapsed().as_secs_f64()),
        }
        out.runs.push(r);
    }
    if let Some(n) = neighbour.take() {
        let load = n.stop().await;
        eprintln!(
            "bench hosts: busy neighbour stopped after {:.1} s, {} cores busy{}",
            load.wall_s,
            load.cores.map_or("?".into(), |c| format!("{c:.2}")),
            load.error.as_deref().map_or(String::new(), |e| format!(" ({e})"))
        );
        out.neighbour = Some(load);
    }
    Ok(out)
}

/// The busy neighbour of a row: a busy loop on host 2, stopped by PID by [`Neighbour::stop`]
/// or, on an error or a signal, when dropped (and by the bed's teardown, which knows its PID).
struct Neighbour {
    child: Child,
    pid: Option<u32>,
    started: Instant,
    /// Its own and the machine's CPU ticks at the start.
    ticks: Option<(u64, u64)>,
}

impl Neighbour {
    fn start(bed: &Bed, log: &Path, secret: &str) -> Result<Neighbour> {
        let argv: Vec<String> = BUSY_LOOP.map(String::from).to_vec();
        let child = bed.spawn(DISTURBED, &argv, log, secret)?;
        let pid = child.id();
        Ok(Neighbour { child, pid, started: Instant::now(), ticks: pid.and_then(Self::ticks) })
    }

    /// utime + stime of `pid`, and the machine's total ticks (all cores).
    fn ticks(pid: u32) -> Option<(u64, u64)> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // After "pid (comm)": state is the first field, utime and stime the 12th and 13th.
        let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        let own = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
        Some((own, crate::machine::CpuSample::now()?.total))
    }

    /// Stops it (SIGKILL, reaped within 5 s) and says what it took.
    async fn stop(mut self) -> NeighbourLoad {
        let wall_s = self.started.elapsed().as_secs_f64();
        let mut error = match self.child.try_wait() {
            Ok(Some(status)) => Some(format!("it exited early with {status}")),
            Ok(None) => None,
            Err(e) => Some(format!("cannot wait for it: {e}")),
        };
        let end = self.pid.and_then(Self::ticks);
        let share = match (self.ticks, end) {
            (Some((own0, all0)), Some((own1, all1))) if all1 > all0 => {
                Some(own1.saturating_sub(own0) as f64 / (all1 - all0) as f64)
            }
            _ => None,
        };
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        if error.is_none() {
            let _ = self.child.start_kill();
            if let Err(e) = wait_for(&mut self.child, Duration::from_secs(5), "the busy neighbour").await {
                error = Some(e.to_string());
            }
        }
        NeighbourLoad { pid: self.pid, wall_s, machine_share: share, cores: share.map(|s| s * cores), error }
    }
}

impl Drop for Neighbour {
    fn drop(&mut self) {
        // Stopped already (a no-op then), or dropped on an error or a signal.
        let _ = self.child.start_kill();
    }
}

/// Waits for `child` at most `within`, naming `what` when it does not end.
async fn wait_for(child: &mut Child, within: Duration, what: &str) -> Result<std::process::ExitStatus> {
    match tokio::time::timeout(within, child.wait()).await {
        Ok(status) => Ok(status.with_context(|| format!("waiting for {what}"))?),
        Err(_) => Err(BenchError::Failed(format!("{what} did not end within {:.0} s", within.as_secs_f64()))),
    }
}

/// Waits until `log` contains `needle` (a process's output), at most `within`; fails early
/// if `child` exits first.
// The sleep paces the benchmark's poll of a log, no rule of the job under test.
#[allow(clippy::disallowed_methods)]
async fn wait_line(child: &mut Child, log: &Path, needle: &str, within: Duration, what: &str) -> Result<String> {
    let until = Instant::now() + within;
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if let Some(line) = text.lines().find(|l| l.contains(needle)) {
            return Ok(line.to_string());
        }
        if let Some(status) = child.try_wait()? {
            return Err(BenchError::Failed(format!("{what}: it exited with {status} first; {}", tail(log))));
        }
        if Instant::now() >= until {
            return Err(BenchError::Failed(format!(
                "{what}: no `{needle}` within {:.0} s; {}",
                within.as_secs_f64(),
                tail(log)
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The last lines of a log, for an error message.
fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    format!("last lines of {}: {}", log.display(), lines[lines.len().saturating_sub(5)..].join(" | "))
}

/// The raw TCP rate over host 2's link, both ways: a sink on host 1, the client on host 2.
async fn raw_tcp(bed: &Bed, plan: &Plan, dir: &Path, exe: &str, secret: &str) -> Result<Vec<TcpRate>> {
    let listen = format!("{}:0", bed.hosts[0].ip);
    let sink_log = dir.join("tcp-sink.log");
    let argv: Vec<String> = [exe, "bench", "tcp-sink", "--listen", &listen, "--events"].map(String::from).to_vec();
    let mut sink = bed.spawn(0, &argv, &sink_log, secret)?;
    let result = async {
        let line =
            wait_line(&mut sink, &sink_log, "\"listening\"", Duration::from_secs(20), "the tcp sink on host 1").await?;
        let addr = serde_json::from_str::<serde_json::Value>(&line)?["addr"]
            .as_str()
            .map(String::from)
            .ok_or_else(|| BenchError::Failed(format!("the tcp sink's listening line has no addr: {line}")))?;
        let mut rates = Vec::new();
        for (dir_name, d) in [("up", Direction::Up), ("down", Direction::Down)] {
            let log = dir.join(format!("tcp-rate-{dir_name}.log"));
            let secs = plan.tcp_secs.to_string();
            let argv: Vec<String> = [exe, "bench", "tcp-rate", "--to", &addr, "--direction", dir_name, "--secs", &secs]
                .map(String::from)
                .to_vec();
            let mut client = bed.spawn(1, &argv, &log, secret)?;
            let what = format!("the raw TCP client on host 2 ({dir_name})");
            let status = wait_for(&mut client, Duration::from_secs_f64(plan.tcp_secs + 30.0), &what).await?;
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let rate = text.lines().rev().find_map(|l| serde_json::from_str::<TcpRate>(l).ok());
            match rate {
                Some(r) if status.success() && r.direction == d => rates.push(r),
                _ => return Err(BenchError::Failed(format!("{what} failed ({status}); {}", tail(&log)))),
            }
        }
        Ok(rates)
    }
    .await;
    // The sink serves until killed.
    let _ = sink.start_kill();
    let _ = wait_for(&mut sink, Duration::from_secs(5), "the tcp sink").await;
    result
}

/// One job on the bed: five launches, the report of the rendezvous one.
async fn one_job(
    bed: &Bed,
    plan: &Plan,
    row: &RowPlan,
    row_dir: &Path,
    exe: &str,
    secret: &str,
    mode: Mode,
) -> HostsRun {
    let spec = plan.spec(mode, row.iterations(mode));
    let dir = row_dir.join(mode.name());
    let mut run = HostsRun {
        mode,
        iterations: row.iterations(mode),
        flags: spec.flags(),
        error: None,
        samples_per_sec: f64::NAN,
        settled_samples_per_sec: f64::NAN,
        settled_too_late: false,
        model_bytes: 0,
        servers: Vec::new(),
        moved_back: 0,
        decisions: Vec::new(),
        run: None,
    };
    match job(bed, &spec, &dir, exe, secret, Plan::job_timeout(row, mode, 4.0)).await {
        Ok((report, decisions)) => {
            run.samples_per_sec = report.samples_per_sec;
            run.model_bytes = report.servers.iter().map(|s| s.bytes).sum();
            run.servers = server_hosts(&dir.join("h1/logs/scheduler.log"), &bed.hosts);
            run.moved_back = report.balance.as_ref().map_or(0, moved_back);
            run.decisions = decisions;
            let r = measure(&report, spec.flags(), mode, 0.0);
            let settled = r.balance().iters_per_s * f64::from(plan.batch_size);
            run.settled_too_late = !settled.is_finite();
            run.settled_samples_per_sec = if run.settled_too_late { report.samples_per_sec } else { settled };
            run.run = Some(r);
        }
        Err(e) => run.error = Some(format!("{e} (logs under {})", dir.display())),
    }
    run
}

/// Runs `spec` on the bed: a launch per host, each given `spec`'s flags (its job's to the
/// launch, its data's to the workers); the whole job within `within` (a model of up to 4 MB:
/// the bound is generous); the report of the rendezvous launch and its judged decisions.
async fn job(
    bed: &Bed,
    spec: &TrainSpec,
    dir: &Path,
    exe: &str,
    secret: &str,
    within: Duration,
) -> Result<(Report, Vec<Judged>)> {
    std::fs::create_dir_all(dir)?;
    let rdzv = format!("{}:{RDZV_PORT}", bed.hosts[0].ip);
    let launch = |host: usize, layout: &[&str]| -> Vec<String> {
        let name = format!("h{}", host + 1);
        let mut a: Vec<String> = [exe, "launch", "--quiet", "--nnodes", "4:5", "--rdzv", &rdzv, "--node-name", &name]
            .map(String::from)
            .to_vec();
        a.extend(layout.iter().map(|s| s.to_string()));
        // Each worker pushes its own, as when these figures were first measured: the bench
        // compares static and psld under one link's cap, not one push per host.
        a.push("--no-host-aggregation".into());
        a.extend(["--report".to_string(), dir.join(&name).display().to_string()]);
        a.extend(spec.job.to_flags());
        if !spec.job.aggregate {
            // launch aggregates under bsp by default; the bench measures per-push steps.
            a.push("--no-aggregate".into());
        }
        a.extend(
            ["--request-timeout-s", "60", "--end-timeout-s", "30", "--join-timeout-s", "60", "--"].map(String::from),
        );
        a.extend([exe, "worker"].map(String::from));
        a.extend(spec.data.to_flags());
        a
    };
    // Which host runs what (module docs): the workers' host, three hosts of one server
    // each (the first one's link is capped), and the spare, which joins once the job runs.
    let layouts: [(&str, [&str; 8]); HOSTS] = [
        (
            "host 1 (rendezvous, the workers)",
            ["--servers-per-node", "0", "--workers-per-node", "2", "--server-slots", "0", "--worker-slots", "2"],
        ),
        (
            "host 2 (capped)",
            ["--servers-per-node", "1", "--workers-per-node", "0", "--server-slots", "1", "--worker-slots", "0"],
        ),
        (
            "host 3",
            ["--servers-per-node", "1", "--workers-per-node", "0", "--server-slots", "1", "--worker-slots", "0"],
        ),
        (
            "host 4",
            ["--servers-per-node", "1", "--workers-per-node", "0", "--server-slots", "1", "--worker-slots", "0"],
        ),
        (
            "host 5 (spare)",
            ["--servers-per-node", "0", "--workers-per-node", "0", "--server-slots", "2", "--worker-slots", "0"],
        ),
    ];
    let logs: Vec<PathBuf> = (1..=HOSTS).map(|i| dir.join(format!("h{i}.out"))).collect();
    let join = Duration::from_secs(60);
    let mut children: Vec<(Child, String)> = Vec::new();
    let started = async {
        for (i, (what, layout)) in layouts.iter().enumerate() {
            let mut child = bed.spawn(i, &launch(i, layout), &logs[i], secret)?;
            let w =
                wait_line(&mut child, &logs[i], "joined the job", join, &format!("the launch on {what} joining")).await;
            children.push((child, format!("the launch on {what}")));
            w?;
        }
        Ok::<_, BenchError>(String::new())
    }
    .await;
    if let Err(e) = started {
        stop_all(&mut children);
        for (c, what) in children.iter_mut() {
            let _ = wait_for(c, Duration::from_secs(10), what).await;
        }
        return Err(e);
    }
    if let Err(e) = wait_all(&mut children, &logs, within).await {
        stop_all(&mut children);
        return Err(e);
    }
    let path = dir.join("h1/report.json");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let report: Report = serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    Ok((report, judged(&value)))
}

/// Asks every launch to stop (the bed's teardown would end them too, at the end).
fn stop_all(children: &mut [(Child, String)]) {
    children.iter().for_each(|(c, _)| terminate(c));
}

/// Sends SIGTERM to `child` if it still runs.
fn terminate(child: &Child) {
    if let Some(pid) = child.id() {
        let _ = std::process::Command::new("kill").args(["-s", "TERM", &pid.to_string()]).status();
    }
}

/// Waits for every launch to exit within `within` of now (at least 5 s each); an error
/// names each launch that failed or did not exit, with the tail of its log.
async fn wait_all(children: &mut [(Child, String)], logs: &[PathBuf], within: Duration) -> Result<()> {
    let deadline = Instant::now() + within;
    let mut failures = Vec::new();
    for (i, (c, what)) in children.iter_mut().enumerate() {
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(5));
        match wait_for(c, left, what).await {
            Ok(s) if s.success() => {}
            Ok(s) => failures.push(format!("{what} exited with {s}; {}", tail(&logs[i]))),
            Err(e) => {
                failures.push(format!("{e}; {}", tail(&logs[i])));
                terminate(c);
            }
        }
    }
    if failures.is_empty() { Ok(()) } else { Err(BenchError::Failed(failures.join("; "))) }
}

/// The scheduler's `server joined server=N addr=IP:PORT initial=B` lines, with the bed host
/// of each address.
fn server_hosts(log: &Path, hosts: &[BedHost]) -> Vec<ServerHost> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let field = |line: &str, key: &str| -> Option<String> {
        line.split_whitespace().find_map(|w| w.strip_prefix(key)).map(|v| v.trim_matches('"').to_string())
    };
    text.lines()
        .filter(|l| l.contains("server joined"))
        .filter_map(|l| {
            let server = field(l, "server=")?.parse().ok()?;
            let addr = field(l, "addr=")?;
            let ip = addr.rsplit_once(':').map_or(addr.as_str(), |(h, _)| h);
            let host = hosts.iter().find(|h| h.ip == ip).map_or_else(|| "?".to_string(), |h| h.name.clone());
            Some(ServerHost {
                server,
                addr: addr.clone(),
                host,
                initial: field(l, "initial=").as_deref() == Some("true"),
            })
        })
        .collect()
}

/// Successful migrations that moved a block to a server it had been on before.
fn moved_back(log: &BalanceLog) -> usize {
    let mut owners: HashMap<u32, Vec<u32>> = HashMap::new();
    let mut back = 0;
    for m in log.migrations.iter().filter(|m| m.error.is_none()) {
        let had = owners.entry(m.block).or_insert_with(|| vec![m.from]);
        if had.contains(&m.to) {
            back += 1;
        }
        had.push(m.to);
    }
    back
}

/// The slower direction of the raw link, Mbit/s.
fn raw_mbit(tcp: &[TcpRate]) -> Option<f64> {
    tcp.iter().map(|t| t.mbit_per_s).reduce(f64::min)
}

/// The most samples/s static placement can get: the capped server holds about a third of
/// the model (bestfit over three servers), which both workers push and pull across its
/// link every iteration: `raw / (2 x M / 3)` iterations per second, of `2 x batch` samples.
fn link_bound(plan: &Plan, tcp: &[TcpRate], model_bytes: u64) -> Option<f64> {
    let raw = raw_mbit(tcp)?;
    let per_iter = 2.0 * model_bytes as f64 / 3.0;
    (model_bytes > 0).then(|| raw * 1e6 / 8.0 / per_iter * 2.0 * f64::from(plan.batch_size))
}

fn checks(plan: &Plan, rows: &[Row]) -> Vec<Check> {
    let runs = rows.iter().map(|r| r.runs.len()).sum::<usize>();
    let failed: Vec<String> = rows
        .iter()
        .flat_map(|row| {
            row.runs
                .iter()
                .filter(|r| r.error.is_some())
                .map(|r| format!("{} {}", row.condition.describe(), r.mode.name()))
        })
        .collect();
    let mut out = vec![Check {
        what: "every run completes".into(),
        measured: if failed.is_empty() { format!("{runs} runs") } else { format!("failed: {}", failed.join(", ")) },
        pass: Some(failed.is_empty() && runs == 2 * rows.len()),
    }];
    for row in rows {
        let Condition::Cap(mbit) = row.condition else { continue };
        out.push(Check {
            what: format!("the cap is in effect: raw TCP over host 2's link <= 1.2 x {mbit} mbit"),
            measured: match raw_mbit(&row.tcp) {
                Some(_) => row
                    .tcp
                    .iter()
                    .map(|t| format!("{:?} {:.1} Mbit/s", t.direction, t.mbit_per_s))
                    .collect::<Vec<_>>()
                    .join(", "),
                None => "not measured".into(),
            },
            pass: Some(
                row.tcp.len() == 2
                    && row.tcp.iter().all(|t| t.mbit_per_s > 0.0 && t.mbit_per_s <= 1.2 * f64::from(mbit)),
            ),
        });
    }
    // The quick form's check is on its (first) capped row, the full form's on the 50 mbit one.
    let (row, need, what) = if plan.quick {
        let row = rows.iter().find(|r| matches!(r.condition, Condition::Cap(_)));
        let cap = row.map_or("no".into(), |r| r.condition.describe());
        (row, QUICK_NOISE, format!("quick, {cap}: psld samples/s >= {QUICK_NOISE} x static (not slower beyond noise)"))
    } else {
        let row = rows.iter().find(|r| r.condition == Condition::Cap(CHECKED_CAP_MBIT));
        (row, FULL_RATIO, format!("{CHECKED_CAP_MBIT} Mbit/s cap: psld samples/s >= {FULL_RATIO} x static"))
    };
    out.push(Check {
        what: format!("{what}, after settling"),
        measured: row.map_or_else(|| "no such row".into(), Row::versus),
        pass: row.map(|r| matches!(r.pair(), Some((p, s)) if p >= need * s)),
    });
    out
}

fn targets(rows: &[Row]) -> Vec<Target> {
    let mut out = Vec::new();
    for row in rows {
        let Some(need) = row.condition.target() else { continue };
        let target = match row.condition {
            Condition::Cap(mbit) => Target {
                what: format!("{mbit} Mbit/s cap: psld >= {need} x static samples/s after settling"),
                measured: row.versus(),
                met: row.pair().map(|(p, s)| p >= need * s),
            },
            Condition::Neighbour => {
                let p = row.find(Mode::Psld);
                let migrations = p.map(HostsRun::migrations);
                let verdicts = p.map(HostsRun::verdicts);
                Target {
                    what: format!(
                        "busy neighbour, no cap: psld >= {need} x static samples/s (whole runs) with <= \
                         {NEIGHBOUR_MIGRATIONS} migrations"
                    ),
                    measured: match (row.pair(), migrations, verdicts) {
                        (Some((ps, st)), Some(m), Some((kept, reverted))) => format!(
                            "{ps:.1} vs {st:.1} samples/s ({}); {m} migrations; {kept} decisions kept, {reverted} \
                             reverted; after settling {}",
                            ratio(ps, st),
                            row.find(Mode::Psld).zip(row.find(Mode::Static)).map_or("-".into(), |(p, s)| ratio(
                                p.settled_samples_per_sec,
                                s.settled_samples_per_sec
                            ))
                        ),
                        _ => "a run failed".into(),
                    },
                    met: row.pair().zip(migrations).map(|((p, s), m)| p >= need * s && m <= NEIGHBOUR_MIGRATIONS),
                }
            }
        };
        out.push(target);
    }
    let capped: Vec<&Row> = rows.iter().filter(|r| matches!(r.condition, Condition::Cap(_))).collect();
    if !capped.is_empty() {
        let per_row: Vec<(String, Option<(usize, usize)>)> = capped
            .iter()
            .map(|row| {
                let p = row.find(Mode::Psld);
                let spare = p.map(|p| p.servers.iter().filter(|s| !s.initial && s.host.ends_with('5')).count());
                let outs = p
                    .and_then(|p| p.run.as_ref())
                    .map(|r| r.balance().scaling.iter().filter(|e| e.action == "scale-out").count());
                (row.condition.describe(), outs.zip(spare))
            })
            .collect();
        out.push(Target {
            what: "psld scales out onto the spare host (host 5) when a link is capped".into(),
            measured: per_row
                .iter()
                .map(|(what, n)| match n {
                    Some((k, n)) => format!("{what}: {k} scale-out events, {n} servers started on host 5"),
                    None => format!("{what}: the psld run failed"),
                })
                .collect::<Vec<_>>()
                .join("; "),
            met: per_row
                .iter()
                .any(|(_, n)| n.is_some())
                .then(|| per_row.iter().any(|(_, n)| n.is_some_and(|(_, n)| n > 0))),
        });
    }
    out
}

fn render(out: &Written<Body>) -> String {
    let mut s = String::new();
    let p = &out.body.plan;
    let rows_text: Vec<String> = p
        .rows
        .iter()
        .map(|r| {
            format!(
                "{} (static {} and psld {} iterations per worker)",
                r.condition.describe(),
                r.static_iterations,
                r.psld_iterations
            )
        })
        .collect();
    s.push_str(&format!(
        "\n`bench hosts`{}: 5 namespace hosts (host 1 rendezvous: the 2 workers; hosts 2-4: a server each; host 5: \
         spare, 2 server slots), {}, {} ms compute, batch {}, bsp, sgd, bestfit, 4 MiB blocks, psld with \
         --max-servers 4. Rows, each on host 2: {}. A cap is `tc tbf` on host 2's link each way; the busy \
         neighbour is `{}` on host 2 for both runs of its row.\n\n",
        if p.quick { " --quick" } else { "" },
        p.model,
        p.compute_ms,
        p.batch_size,
        rows_text.join("; "),
        BUSY_LOOP.join(" ")
    ));
    s.push_str(&out.machine.markdown(out.took_s).replacen(", loopback;", ", namespace hosts on a bridge;", 1));
    s.push('\n');

    // Side by side: one line per row.
    let headers = [
        "condition",
        "compared on",
        "static samples/s",
        "psld samples/s",
        "psld/static",
        "target",
        "migrations (moved back)",
        "verdicts kept / reverted",
        "scaling events",
    ];
    let lines: Vec<Vec<String>> = out
        .body
        .rows
        .iter()
        .map(|row| {
            let (st, ps) = (row.find(Mode::Static), row.find(Mode::Psld));
            let on = match row.condition {
                Condition::Cap(_) => "after settling",
                Condition::Neighbour => "whole runs",
            };
            let target = match (row.condition.target(), row.pair()) {
                (None, _) => "-".into(),
                (Some(t), None) => format!(">= {t}x: -"),
                (Some(t), Some((p, s))) => {
                    let mut met = p >= t * s;
                    if row.condition == Condition::Neighbour {
                        met &= ps.is_some_and(|r| r.migrations() <= NEIGHBOUR_MIGRATIONS);
                    }
                    format!(">= {t}x: {}", if met { "met" } else { "missed" })
                }
            };
            vec![
                row.condition.describe(),
                on.into(),
                st.map_or("failed".into(), |r| fixed(row.compared(r), 1)),
                ps.map_or("failed".into(), |r| fixed(row.compared(r), 1)),
                row.pair().map_or("-".into(), |(p, s)| ratio(p, s)),
                target,
                ps.map_or("-".into(), |r| format!("{} ({})", r.migrations(), r.moved_back)),
                ps.map_or("-".into(), |r| {
                    let (k, v) = r.verdicts();
                    format!("{k} / {v}")
                }),
                ps.map_or("-".into(), HostsRun::scaling),
            ]
        })
        .collect();
    s.push_str(&markdown_table(&headers, &lines));

    // Every run.
    let headers = [
        "condition",
        "mode",
        "iterations",
        "samples/s",
        "samples/s after settling",
        "vs static",
        "link bound samples/s",
        "raw TCP Mbit/s (capped link)",
        "window from s",
        "migrations",
        "moved back",
        "MB moved",
        "verdicts kept / reverted",
        "scaling events",
        "servers (host)",
        "wall s",
    ];
    let mut lines: Vec<Vec<String>> = Vec::new();
    for row in &out.body.rows {
        let tcp_cell = match row.condition {
            Condition::Neighbour => "no cap".into(),
            Condition::Cap(_) if row.tcp.is_empty() => {
                format!("failed: {}", row.tcp_error.as_deref().unwrap_or("?"))
            }
            Condition::Cap(_) => {
                row.tcp.iter().map(|t| format!("{:?} {:.1}", t.direction, t.mbit_per_s)).collect::<Vec<_>>().join(" / ")
            }
        };
        let st = row.find(Mode::Static);
        for r in &row.runs {
            if r.error.is_some() {
                lines.push(vec![row.condition.describe(), r.mode.name().into(), "failed (below)".into()]);
                continue;
            }
            let x = r.run.as_ref();
            let vs = match (r.mode, st) {
                (Mode::Psld, Some(st)) => format!(
                    "{} ({} whole run)",
                    ratio(r.settled_samples_per_sec, st.settled_samples_per_sec),
                    ratio(r.samples_per_sec, st.samples_per_sec)
                ),
                _ => "-".into(),
            };
            let servers = r
                .servers
                .iter()
                .map(|h| format!("{} {}{}", h.server, h.host, if h.initial { "" } else { " (new)" }))
                .collect::<Vec<_>>()
                .join(", ");
            let (kept, reverted) = r.verdicts();
            lines.push(vec![
                row.condition.describe(),
                r.mode.name().into(),
                r.iterations.to_string(),
                fixed(r.samples_per_sec, 1),
                fixed(r.settled_samples_per_sec, 1),
                vs,
                link_bound(p, &row.tcp, r.model_bytes).map_or("-".into(), |b| fixed(b, 1)),
                tcp_cell.clone(),
                x.map_or("-".into(), |x| fixed(x.balance().window_from_s, 1)),
                r.migrations().to_string(),
                r.moved_back.to_string(),
                x.map_or("-".into(), |x| {
                    if x.balance().migrations == 0 {
                        "-".into()
                    } else {
                        fixed(x.balance().bytes_moved as f64 / 1e6, 1)
                    }
                }),
                if r.mode == Mode::Psld { format!("{kept} / {reverted}") } else { "-".into() },
                r.scaling(),
                servers,
                x.map_or("-".into(), |x| fixed(x.wall_s, 1)),
            ]);
        }
    }
    s.push('\n');
    s.push_str(&markdown_table(&headers, &lines));
    s.push_str(&format!(
        "\nThe link bound is static's: the raw TCP rate over the capped link (the slower direction) / (2 workers x a \
         third of the model's bytes) iterations per second, of 2 x {} samples (bestfit leaves about a third of the \
         model on the capped server). \"Moved back\": migrations that returned a block to a server it had been on \
         (a reverted round, or a bounce).\n",
        p.batch_size
    ));
    for row in &out.body.rows {
        if let Some(n) = &row.neighbour {
            s.push_str(&format!(
                "\nThe busy neighbour (pid {}) ran {:.1} s and kept {} cores busy ({} of the machine){}.\n",
                n.pid.map_or("?".into(), |p| p.to_string()),
                n.wall_s,
                n.cores.map_or("?".into(), |c| format!("{c:.2}")),
                n.machine_share.map_or("?".into(), |m| format!("{:.0}%", 100.0 * m)),
                n.error.as_deref().map_or(String::new(), |e| format!("; {e}"))
            ));
        }
    }
    // The balancer's judged decisions, per psld run.
    for row in &out.body.rows {
        let Some(ps) = row.find(Mode::Psld) else { continue };
        if ps.decisions.is_empty() {
            s.push_str(&format!("\n{}, psld: no judged decisions in its report.\n", row.condition.describe()));
            continue;
        }
        s.push_str(&format!("\n{}, psld's judged decisions:\n\n", row.condition.describe()));
        for d in &ps.decisions {
            s.push_str(&format!(
                "- {:.1} s -> {:.1} s, {} ({} moves): predicted {:+.1}%, measured {:+.1}% ({} -> {} ms): {}\n",
                d.at_s,
                d.judged_s,
                d.what,
                d.moves,
                100.0 * d.predicted_gain,
                100.0 * d.measured_gain,
                d.before_ms.map_or("-".into(), |v| fixed(v, 1)),
                d.after_ms.map_or("-".into(), |v| fixed(v, 1)),
                d.verdict
            ));
        }
    }
    for row in &out.body.rows {
        for r in row.runs.iter().filter(|r| r.error.is_some()) {
            s.push_str(&format!(
                "\n{}, {} failed: {}\n",
                row.condition.describe(),
                r.mode.name(),
                r.error.as_deref().unwrap_or("")
            ));
        }
    }
    s.push_str(&checks_and_targets_markdown(&out.checks, &out.targets));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cmd(quick: bool) -> HostsBenchCmd {
        HostsBenchCmd {
            quick,
            out: "x".into(),
            caps_mbit: None,
            neighbour: None,
            static_iterations: None,
            psld_iterations: None,
            model: "synthetic:resnet56".into(),
            compute_ms: 20.0,
            tcp_secs: 3.0,
            prefix: "ebh".into(),
            testnet: None,
        }
    }

    #[test]
    fn server_hosts_read_the_schedulers_join_lines() {
        let dir = std::env::temp_dir().join(format!("bench-hosts-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("scheduler.log");
        std::fs::write(
            &log,
            "2026-12-02T07:54:22.174159Z  INFO elasticps_node::scheduler: server joined server=0 addr=10.1.0.11:36493 initial=true\n\
             x INFO elasticps_node::scheduler: worker joined rank=0\n\
             y INFO elasticps_node::scheduler: server joined server=2 addr=10.1.0.13:4000 initial=false\n",
        )
        .unwrap();
        let hosts: Vec<BedHost> =
            (1..=3).map(|i| BedHost { name: format!("ebh{i}"), ip: format!("10.1.0.1{i}"), role: "?" }).collect();
        let s = server_hosts(&log, &hosts);
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].server, s[0].host.as_str(), s[0].initial), (0, "ebh1", true));
        assert_eq!((s[1].server, s[1].host.as_str(), s[1].initial), (2, "ebh3", false));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_rows_of_each_form() {
        let quick = Plan::new(&cmd(true)).unwrap();
        let rows: Vec<_> = quick.rows.iter().map(|r| (r.condition, r.static_iterations, r.psld_iterations)).collect();
        assert_eq!(rows, [(Condition::Cap(100), 16, 40)]);
        let full = Plan::new(&cmd(false)).unwrap();
        let rows: Vec<_> = full.rows.iter().map(|r| (r.condition, r.static_iterations, r.psld_iterations)).collect();
        assert_eq!(
            rows,
            [(Condition::Cap(50), 40, 900), (Condition::Cap(400), 200, 900), (Condition::Neighbour, 400, 400)]
        );
        let one =
            Plan::new(&HostsBenchCmd { caps_mbit: Some(vec![70]), neighbour: Some(false), ..cmd(false) }).unwrap();
        assert_eq!(one.rows.len(), 1);
        assert_eq!((one.rows[0].condition, one.rows[0].static_iterations), (Condition::Cap(70), 56));
        assert!(Plan::new(&HostsBenchCmd { caps_mbit: Some(vec![50, 50]), ..cmd(false) }).is_err());
        assert_eq!(Condition::Cap(400).target(), Some(1.5));
        assert_eq!(Condition::Cap(100).target(), None);
    }

    #[test]
    fn the_caps_flag_takes_a_list_and_its_old_name() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            cmd: HostsBenchCmd,
        }
        let caps = |args: &[&str]| Cli::try_parse_from(args).unwrap().cmd.caps_mbit;
        assert_eq!(caps(&["x", "--caps-mbit", "50,400"]), Some(vec![50, 400]));
        assert_eq!(caps(&["x", "--cap-mbit", "100"]), Some(vec![100]));
        let neighbour = |args: &[&str]| Cli::try_parse_from(args).unwrap().cmd.neighbour;
        assert_eq!(neighbour(&["x", "--neighbour"]), Some(true));
        assert_eq!(neighbour(&["x", "--neighbour", "false"]), Some(false));
        assert_eq!(neighbour(&["x"]), None);
    }

    #[test]
    fn decisions_read_leniently_and_moves_back_count() {
        let old: serde_json::Value = serde_json::json!({"balance": {"mode": "psld", "migrations": []}});
        assert!(judged(&old).is_empty());
        let new = serde_json::json!({"balance": {"decisions": [
            {"at_s": 10.0, "what": "migrate", "predicted_gain": 0.4, "measured_gain": 0.5, "verdict": "kept"},
            {"at_s": 20.0, "verdict": "reverted"}
        ]}});
        let d = judged(&new);
        assert_eq!(d.len(), 2);
        assert_eq!((d[0].verdict.as_str(), d[0].moves, d[1].predicted_gain), ("kept", 0, 0.0));
        let m = |block, from, to| elasticps_runtime::scheduler::MigrationEvent {
            at_s: 0.0,
            block,
            from,
            to,
            bytes: 1,
            freeze_ms: 0.0,
            total_ms: 0.0,
            held: 0,
            error: None,
        };
        let log =
            BalanceLog { migrations: vec![m(1, 0, 1), m(2, 0, 2), m(1, 1, 0), m(2, 2, 3)], ..BalanceLog::default() };
        assert_eq!(moved_back(&log), 1);
    }

    #[test]
    fn the_link_bound_is_a_third_of_the_model_per_worker_and_iteration() {
        let plan = Plan::new(&cmd(true)).unwrap();
        let tcp = [
            TcpRate { direction: Direction::Up, bytes: 0, secs: 1.0, mbit_per_s: 80.0 },
            TcpRate { direction: Direction::Down, bytes: 0, secs: 1.0, mbit_per_s: 100.0 },
        ];
        // 80 Mbit/s = 10 MB/s; a 6 MB model, 2 MB of it on the capped server: 2 workers move
        // 4 MB across the link per iteration, 2.5 iterations/s of 2 workers x 32 samples.
        assert_eq!(link_bound(&plan, &tcp, 6_000_000), Some(160.0));
    }
}
