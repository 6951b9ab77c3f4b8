//! `elasticps bench hosts`: static placement vs PSLD on a job that spans hosts for real.
//!
//! A test bed of 5 "hosts" (network namespaces on a bridge, `scripts/testnet`, needs root):
//!
//! - host 1 (`P1`) is the rendezvous: its launch runs the scheduler and the 2 workers;
//! - hosts 2, 3 and 4 run one server each; host 2's link is capped with `tc tbf` in both
//!   directions (`--cap-mbit`);
//! - host 5 (`P5`) is a spare: it joins after the job started, so it starts nothing, and
//!   brings 2 server slots for a scale-out.
//!
//! One invocation measures, side by side: (1) the raw TCP rate over the capped link, each
//! direction (`bench tcp-sink` on host 1, `bench tcp-rate` on host 2: plain sockets, no
//! framing), (2) the job with `--balance static`, (3) the job with `--balance psld
//! --max-servers 3` (psld may scale out onto the spare). Both jobs: the same model
//! (`synthetic:resnet56` by default), bsp, sgd, bestfit placement, 4 MiB blocks; the psld run
//! has more iterations (it needs time to detect and settle; the numbers are rates).
//!
//! Every job's five launches start through `testnet exec`, each once the one before joined
//! (so the spare joins after the job started and takes no first node); every wait has a
//! timeout that names what it waits for. The bed is torn down at the end, on error and on
//! Ctrl-C or SIGTERM ([`Bed`]'s `Drop`: every process it started, and every process left in
//! its namespaces, is stopped by PID, then `testnet down`).
//!
//! The numbers per job, from the rendezvous launch's `report.json`: samples/s over the whole
//! run (the report's own), and the rate after the balancer settled (psld) or after every
//! worker's first iteration (static), as `bench straggler` measures it
//! ([`crate::straggler::measure`]); psld's migrations and scaling events; which host each
//! server ran on (the scheduler's `server joined ... addr=` lines), so a scale-out server on
//! the spare shows. The link bound: static placement leaves about a third of the model on
//! the capped server, which both workers push and pull across its link every iteration.
//!
//! Checks (fail the command): every run completes; the cap is in effect (raw TCP at most
//! 1.2 x the cap); full form: psld >= 2.0 x static samples/s (after settling); `--quick`:
//! psld >= [`QUICK_NOISE`] x static (not slower beyond noise).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use elasticps_core::stats::ratio;
use elasticps_report::Report;
use elasticps_report::table::{fixed, markdown_table};
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
/// The full form's check: psld / static samples/s.
pub const FULL_RATIO: f64 = 2.0;
/// The rendezvous port on host 1.
const RDZV_PORT: u16 = 29400;
/// Hosts of the bed.
const HOSTS: usize = 5;

/// `elasticps bench hosts`.
#[derive(Args, Clone, Debug)]
pub struct HostsBenchCmd {
    /// The short form (under 2 minutes in a debug build): fewer iterations, a 100 mbit cap;
    /// checks psld >= 0.8 x static instead of 2.0 x.
    #[arg(long)]
    pub quick: bool,
    /// Write bench-hosts.json, bench-hosts.md and every run's reports and logs here.
    #[arg(long, default_value = "target/bench-hosts")]
    pub out: PathBuf,
    /// Cap of host 2's link, mbit/s each way [default: 50; quick: 100].
    #[arg(long)]
    pub cap_mbit: Option<u32>,
    /// Iterations per worker of the static run [default: 40; quick: 16].
    #[arg(long)]
    pub static_iterations: Option<u32>,
    /// Iterations per worker of the psld run [default: 120; quick: 40].
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
    /// The bed's prefix (namespaces PREFIX1..PREFIX3; at most 6 characters).
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

/// What is run, resolved from the flags.
#[derive(Clone, Debug, Serialize)]
struct Plan {
    quick: bool,
    cap_mbit: u32,
    model: String,
    compute_ms: f64,
    batch_size: u32,
    static_iterations: u32,
    psld_iterations: u32,
    tcp_secs: f64,
    prefix: String,
    /// The workers' model, typed.
    #[serde(skip)]
    model_kind: ModelKind,
}

impl Plan {
    fn new(cmd: &HostsBenchCmd) -> Result<Self> {
        let (cap, st, ps) = if cmd.quick { (100, 16, 40) } else { (50, 40, 900) };
        let plan = Plan {
            quick: cmd.quick,
            cap_mbit: cmd.cap_mbit.unwrap_or(cap),
            model: cmd.model.clone(),
            compute_ms: cmd.compute_ms,
            batch_size: 32,
            static_iterations: cmd.static_iterations.unwrap_or(st),
            psld_iterations: cmd.psld_iterations.unwrap_or(ps),
            tcp_secs: cmd.tcp_secs,
            prefix: cmd.prefix.clone(),
            model_kind: cmd.model.parse().map_err(|e: elasticps_train::TrainError| BenchError::Flags(e.to_string()))?,
        };
        crate::error::ensure_flags!(plan.cap_mbit >= 1, "--cap-mbit must be at least 1");
        crate::error::ensure_flags!(
            plan.static_iterations >= 4 && plan.psld_iterations >= 4,
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

    /// The job of `mode`: the same on every host (the launch sets the servers and workers
    /// from each host's slots; the scheduler takes the rendezvous host's).
    fn spec(&self, mode: Mode) -> TrainSpec {
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
            iterations: Some(self.iterations(mode)),
            batch_size: self.batch_size as usize,
            request_timeout_s: 60,
            ..DataArgs::default()
        };
        TrainSpec { job, data }
    }

    fn iterations(&self, mode: Mode) -> u32 {
        if mode == Mode::Psld { self.psld_iterations } else { self.static_iterations }
    }

    /// How long a whole job may take: a generous bound on the capped link's time (two
    /// models each way per iteration at half the cap) plus startup.
    fn job_timeout(&self, mode: Mode, model_mb: f64) -> Duration {
        let per_iter = 2.0 * 2.0 * model_mb * 8.0 / f64::from(self.cap_mbit) + 0.2;
        Duration::from_secs_f64(60.0 + f64::from(self.iterations(mode)) * per_iter)
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
    /// `testnet up 3 --prefix P`.
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
        let roles = ["rendezvous", "capped", "spare"];
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

/// One job's results.
#[derive(Clone, Debug, Serialize)]
pub struct HostsRun {
    /// How it balanced.
    pub mode: Mode,
    /// The job's flags (the launch takes its job's, the workers its data's).
    pub flags: Vec<String>,
    /// Why it failed (`None`: it completed).
    pub error: Option<String>,
    /// The report's samples/s (whole run).
    pub samples_per_sec: f64,
    /// Samples/s after the settle (psld) or the warm-up iteration (static).
    pub settled_samples_per_sec: f64,
    /// The bytes of the model, from the report's servers.
    pub model_bytes: u64,
    /// Which host each server ran on.
    pub servers: Vec<ServerHost>,
    /// The straggler benchmark's numbers of the run (window, migrations, scaling...).
    pub run: Option<RunResult>,
}

/// What the bed measured (the body of bench-hosts.json).
#[derive(Clone, Debug, Serialize)]
pub struct Body {
    plan: Plan,
    bed: Vec<BedHost>,
    tcp: Vec<TcpRate>,
    tcp_error: Option<String>,
    runs: Vec<HostsRun>,
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
        // Ctrl-C or SIGTERM: the body stops where it is, and the bed is torn down below.
        let body = measure_all(&bed, plan, &self.cmd.out, &exe);
        let result = tokio::select! {
            r = body => r,
            how = stop_signal() => Err(BenchError::Failed(format!("stopped by {how}: the test bed is torn down"))),
        };
        drop(bed);
        let (tcp, tcp_error, runs, bed) = result?;
        Ok(Body { plan: plan.clone(), bed, tcp, tcp_error, runs })
    }

    fn verdicts(&self, body: &Body) -> (Vec<Check>, Vec<Target>) {
        (checks(&body.plan, &body.tcp, &body.runs), targets(&body.runs))
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

type Measured = (Vec<TcpRate>, Option<String>, Vec<HostsRun>, Vec<BedHost>);

/// Caps host 2, measures the raw link, runs static then psld.
async fn measure_all(bed: &Bed, plan: &Plan, out: &Path, exe: &str) -> Result<Measured> {
    bed.testnet(&["cap", &bed.hosts[1].name, &plan.cap_mbit.to_string()])?;
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let secret = format!("bench-hosts-{}-{nanos}", std::process::id());
    let runs_dir = out.join("runs");
    let _ = std::fs::remove_dir_all(&runs_dir);
    std::fs::create_dir_all(&runs_dir)?;

    eprint!("bench hosts: raw TCP over the {} mbit link ... ", plan.cap_mbit);
    let (tcp, tcp_error) = match raw_tcp(bed, plan, &runs_dir, exe, &secret).await {
        Ok(t) => {
            let s: Vec<String> = t.iter().map(|r| format!("{:?} {:.1}", r.direction, r.mbit_per_s)).collect();
            eprintln!("{} Mbit/s", s.join(", "));
            (t, None)
        }
        Err(e) => {
            eprintln!("FAILED: {e}");
            (Vec::new(), Some(e.to_string()))
        }
    };
    let mut runs = Vec::new();
    for mode in [Mode::Static, Mode::Psld] {
        eprint!("bench hosts: {} ({} iterations per worker) ... ", mode.name(), plan.iterations(mode));
        let t = Instant::now();
        let r = one_job(bed, plan, &runs_dir, exe, &secret, mode).await;
        match &r.error {
            None => eprintln!(
                "{:.1} s: {:.1} samples/s ({:.1} after settling), {} migrations, {} scaling events",
                t.elapsed().as_secs_f64(),
                r.samples_per_sec,
                r.settled_samples_per_sec,
                r.run.as_ref().map_or(0, |x| x.balance().migrations),
                r.run.as_ref().map_or(0, |x| x.balance().scaling.len())
            ),
            Some(e) => eprintln!("FAILED after {:.1} s: {e}", t.elapsed().as_secs_f64()),
        }
        runs.push(r);
    }
    Ok((tcp, tcp_error, runs, bed.hosts.clone()))
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

/// One job on the bed: three launches, the report of the rendezvous one.
async fn one_job(bed: &Bed, plan: &Plan, runs_dir: &Path, exe: &str, secret: &str, mode: Mode) -> HostsRun {
    let spec = plan.spec(mode);
    let dir = runs_dir.join(mode.name());
    let mut run = HostsRun {
        mode,
        flags: spec.flags(),
        error: None,
        samples_per_sec: f64::NAN,
        settled_samples_per_sec: f64::NAN,
        model_bytes: 0,
        servers: Vec::new(),
        run: None,
    };
    match job(bed, &spec, &dir, exe, secret, plan.job_timeout(mode, 4.0)).await {
        Ok(report) => {
            run.samples_per_sec = report.samples_per_sec;
            run.model_bytes = report.servers.iter().map(|s| s.bytes).sum();
            run.servers = server_hosts(&dir.join("h1/logs/scheduler.log"), &bed.hosts);
            let r = measure(&report, spec.flags(), mode, 0.0);
            run.settled_samples_per_sec = r.balance().iters_per_s * f64::from(plan.batch_size);
            run.run = Some(r);
        }
        Err(e) => run.error = Some(format!("{e} (logs under {})", dir.display())),
    }
    run
}

/// Runs `spec` on the bed: a launch per host, each given `spec`'s flags (its job's to the
/// launch, its data's to the workers); the whole job within `within` (a model of up to 4 MB:
/// the bound is generous).
async fn job(bed: &Bed, spec: &TrainSpec, dir: &Path, exe: &str, secret: &str, within: Duration) -> Result<Report> {
    std::fs::create_dir_all(dir)?;
    let rdzv = format!("{}:{RDZV_PORT}", bed.hosts[0].ip);
    let launch = |host: usize, layout: &[&str]| -> Vec<String> {
        let name = format!("h{}", host + 1);
        let mut a: Vec<String> = [exe, "launch", "--quiet", "--nnodes", "4:5", "--rdzv", &rdzv, "--node-name", &name]
            .map(String::from)
            .to_vec();
        a.extend(layout.iter().map(|s| s.to_string()));
        a.extend(["--report".to_string(), dir.join(&name).display().to_string()]);
        a.extend(spec.job.to_flags());
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
    // A failed start stops what was started (the bed's teardown would too, at the end).
    let stop = |children: &mut Vec<(Child, String)>| {
        for (c, _) in children.iter_mut() {
            if let Some(pid) = c.id() {
                let _ = std::process::Command::new("kill").args(["-s", "TERM", &pid.to_string()]).status();
            }
        }
    };
    if let Err(e) = started {
        stop(&mut children);
        for (c, what) in children.iter_mut() {
            let _ = wait_for(c, Duration::from_secs(10), what).await;
        }
        return Err(e);
    }
    let deadline = Instant::now() + within;
    let mut failures = Vec::new();
    for (i, (c, what)) in children.iter_mut().enumerate() {
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(5));
        match wait_for(c, left, what).await {
            Ok(s) if s.success() => {}
            Ok(s) => failures.push(format!("{what} exited with {s}; {}", tail(&logs[i]))),
            Err(e) => {
                failures.push(format!("{e}; {}", tail(&logs[i])));
                if let Some(pid) = c.id() {
                    let _ = std::process::Command::new("kill").args(["-s", "TERM", &pid.to_string()]).status();
                }
            }
        }
    }
    if !failures.is_empty() {
        stop(&mut children);
        return Err(BenchError::Failed(failures.join("; ")));
    }
    let path = dir.join("h1/report.json");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
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

fn find(runs: &[HostsRun], mode: Mode) -> Option<&HostsRun> {
    runs.iter().find(|r| r.mode == mode && r.error.is_none())
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

fn checks(plan: &Plan, tcp: &[TcpRate], runs: &[HostsRun]) -> Vec<Check> {
    let failed: Vec<&str> = runs.iter().filter(|r| r.error.is_some()).map(|r| r.mode.name()).collect();
    let mut out = vec![Check {
        what: "every run completes".into(),
        measured: if failed.is_empty() {
            format!("{} runs", runs.len())
        } else {
            format!("failed: {}", failed.join(", "))
        },
        pass: Some(failed.is_empty() && runs.len() == 2),
    }];
    out.push(Check {
        what: format!("the cap is in effect: raw TCP over host 2's link <= 1.2 x {} mbit", plan.cap_mbit),
        measured: match raw_mbit(tcp) {
            Some(_) => tcp
                .iter()
                .map(|t| format!("{:?} {:.1} Mbit/s", t.direction, t.mbit_per_s))
                .collect::<Vec<_>>()
                .join(", "),
            None => "not measured".into(),
        },
        pass: Some(
            tcp.len() == 2 && tcp.iter().all(|t| t.mbit_per_s > 0.0 && t.mbit_per_s <= 1.2 * f64::from(plan.cap_mbit)),
        ),
    });
    let (need, what) = if plan.quick {
        (QUICK_NOISE, format!("quick: psld samples/s >= {QUICK_NOISE} x static (not slower beyond noise)"))
    } else {
        (FULL_RATIO, format!("psld samples/s >= {FULL_RATIO} x static"))
    };
    let (p, s) = (find(runs, Mode::Psld), find(runs, Mode::Static));
    out.push(Check {
        what: format!("{what}, after settling"),
        measured: match (p, s) {
            (Some(p), Some(s)) => format!(
                "{:.1} vs {:.1} ({}); whole runs {:.1} vs {:.1} ({})",
                p.settled_samples_per_sec,
                s.settled_samples_per_sec,
                ratio(p.settled_samples_per_sec, s.settled_samples_per_sec),
                p.samples_per_sec,
                s.samples_per_sec,
                ratio(p.samples_per_sec, s.samples_per_sec)
            ),
            _ => "a run failed".into(),
        },
        pass: Some(
            matches!((p, s), (Some(p), Some(s)) if p.settled_samples_per_sec >= need * s.settled_samples_per_sec),
        ),
    });
    out
}

fn targets(runs: &[HostsRun]) -> Vec<Target> {
    let p = find(runs, Mode::Psld);
    let spare_out = p.map(|p| p.servers.iter().filter(|s| !s.initial && s.host.ends_with('5')).count());
    let scale_outs =
        p.and_then(|p| p.run.as_ref()).map(|r| r.balance().scaling.iter().filter(|e| e.action == "scale-out").count());
    vec![Target {
        what: "psld scales out onto the spare host (host 5)".into(),
        measured: match (spare_out, scale_outs) {
            (Some(n), Some(k)) => format!("{k} scale-out events; {n} servers started on host 5"),
            _ => "the psld run failed".into(),
        },
        met: spare_out.map(|n| n > 0),
    }]
}

fn render(out: &Written<Body>) -> String {
    let mut s = String::new();
    let p = &out.body.plan;
    s.push_str(&format!(
        "\n`bench hosts`{}: 5 namespace hosts (host 1 rendezvous: the 2 workers; hosts 2-4: a server each, host 2's \
         link capped at {} mbit each way; host 5: spare, 2 server slots), {}, {} ms compute, bsp, sgd, bestfit, 4 MiB \
         blocks; static {} and psld (--max-servers 4) {} iterations per worker.\n\n",
        if p.quick { " --quick" } else { "" },
        p.cap_mbit,
        p.model,
        p.compute_ms,
        p.static_iterations,
        p.psld_iterations
    ));
    s.push_str(&out.machine.markdown(out.took_s).replacen(", loopback;", ", namespace hosts on a bridge;", 1));
    s.push('\n');
    let raw = raw_mbit(&out.body.tcp);
    let tcp_cell = if out.body.tcp.is_empty() {
        format!("failed: {}", out.body.tcp_error.as_deref().unwrap_or("?"))
    } else {
        out.body.tcp.iter().map(|t| format!("{:?} {:.1}", t.direction, t.mbit_per_s)).collect::<Vec<_>>().join(" / ")
    };
    let st = find(&out.body.runs, Mode::Static);
    let headers = [
        "mode",
        "samples/s",
        "samples/s after settling",
        "vs static",
        "link bound samples/s",
        "raw TCP Mbit/s (capped link)",
        "window from s",
        "migrations",
        "MB moved",
        "scaling events",
        "servers (host)",
        "wall s",
    ];
    let rows: Vec<Vec<String>> = out
        .body
        .runs
        .iter()
        .map(|r| {
            if r.error.is_some() {
                return vec![r.mode.name().into(), "failed (below)".into()];
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
            let scaling = x.map_or("-".into(), |x| {
                if x.balance().scaling.is_empty() {
                    "none".into()
                } else {
                    x.balance()
                        .scaling
                        .iter()
                        .map(|e| {
                            format!(
                                "{} {} at {:.1} s",
                                e.action,
                                e.server.map_or("-".into(), |v| v.to_string()),
                                e.at_s
                            )
                        })
                        .collect::<Vec<_>>()
                        .join("; ")
                }
            });
            let servers = r
                .servers
                .iter()
                .map(|h| format!("{} {}{}", h.server, h.host, if h.initial { "" } else { " (new)" }))
                .collect::<Vec<_>>()
                .join(", ");
            vec![
                r.mode.name().into(),
                fixed(r.samples_per_sec, 1),
                fixed(r.settled_samples_per_sec, 1),
                vs,
                link_bound(p, &out.body.tcp, r.model_bytes).map_or("-".into(), |b| fixed(b, 1)),
                tcp_cell.clone(),
                x.map_or("-".into(), |x| fixed(x.balance().window_from_s, 1)),
                x.map_or("-".into(), |x| x.balance().migrations.to_string()),
                x.map_or("-".into(), |x| {
                    if x.balance().migrations == 0 {
                        "-".into()
                    } else {
                        fixed(x.balance().bytes_moved as f64 / 1e6, 1)
                    }
                }),
                scaling,
                servers,
                x.map_or("-".into(), |x| fixed(x.wall_s, 1)),
            ]
        })
        .collect();
    s.push_str(&markdown_table(&headers, &rows));
    if let Some(raw) = raw {
        s.push_str(&format!(
            "\nRaw TCP over the capped link: {raw:.1} Mbit/s (the slower direction); the link bound is static's: that \
             rate / (2 workers x a third of the model's bytes) iterations per second, of 2 x {} samples (bestfit \
             leaves about a third of the model on the capped server).\n",
            p.batch_size
        ));
    }
    for r in out.body.runs.iter().filter(|r| r.error.is_some()) {
        s.push_str(&format!("\n{} failed: {}\n", r.mode.name(), r.error.as_deref().unwrap_or("")));
    }
    s.push_str(&checks_and_targets_markdown(&out.checks, &out.targets));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn the_link_bound_is_a_third_of_the_model_per_worker_and_iteration() {
        let plan = Plan::new(&HostsBenchCmd {
            quick: true,
            out: "x".into(),
            cap_mbit: None,
            static_iterations: None,
            psld_iterations: None,
            model: "synthetic:resnet56".into(),
            compute_ms: 20.0,
            tcp_secs: 3.0,
            prefix: "ebh".into(),
            testnet: None,
        })
        .unwrap();
        assert_eq!((plan.cap_mbit, plan.static_iterations, plan.psld_iterations), (100, 16, 40));
        let tcp = [
            TcpRate { direction: Direction::Up, bytes: 0, secs: 1.0, mbit_per_s: 80.0 },
            TcpRate { direction: Direction::Down, bytes: 0, secs: 1.0, mbit_per_s: 100.0 },
        ];
        // 80 Mbit/s = 10 MB/s; a 6 MB model, 2 MB of it on the capped server: 2 workers move
        // 4 MB across the link per iteration, 2.5 iterations/s of 2 workers x 32 samples.
        assert_eq!(link_bound(&plan, &tcp, 6_000_000), Some(160.0));
    }
}
