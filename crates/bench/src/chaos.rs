//! `elasticps bench chaos`: failures under load (issue 10, item 6). A job of 4 servers with
//! `--replicas 2` and 4 workers pushing integer gradients, so that the final parameters
//! can be checked exactly; every `--every-s` seconds a random server is killed with
//! SIGKILL and a new one started in its place (as `train --restart-servers` does), and
//! once, halfway, a worker dies and is restarted with its rank.
//!
//! Reported per failure: the detection time (the kill until the scheduler's status shows
//! the server gone, polled every 5 ms), the time until every worker finished an iteration
//! again, and the largest iteration time in the 5 s after it against the median before the
//! first failure. Then the cost of replicas: a 16 MiB push with `--replicas 2` against 1,
//! on the same two servers (the transport benchmark's size). The check that fails the
//! command: every worker ends with exactly the parameters its acknowledged pushes give.
//!
//! The workers are tasks of this process (a worker's death is its connections dropping
//! between two iterations, which is what the servers and the scheduler see of a kill -9);
//! the scheduler and the servers are processes of this binary.

// Sleeps here decide nothing of the job under test: the benchmark paces itself (its workers'
// simulated compute, polls of the scheduler's status and of its own counters, the spike window
// it measures).
#![allow(clippy::disallowed_methods)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use elasticps_core::model::{Init, TensorSpec};
use elasticps_core::placement::PlacementKind;
use elasticps_launch::args::{JobArgs, NetArgs};
use elasticps_launch::process::Cluster;
use elasticps_runtime::client::{Client, ClientOptions};
use elasticps_runtime::session::SchedLink;
use elasticps_wire::{ClusterStatus, Control, Message};
use serde::Serialize;

use crate::BenchError;
use crate::checks::{Check, Target, checks_and_targets_markdown};
use crate::pipeline::{Bench, Written};
use crate::roles;

/// Flags of `elasticps bench chaos`.
#[derive(clap::Args, Debug)]
pub struct ChaosCmd {
    /// A short run for a quick look: 3 server kills 4 s apart, 5 pushes per replica setting.
    #[arg(long)]
    pub quick: bool,
    /// Seconds between two server kills [default: 20; 4 with --quick].
    #[arg(long)]
    pub every_s: Option<f64>,
    /// How long the failures go on, seconds [default: 120; 12 with --quick].
    #[arg(long)]
    pub duration_s: Option<f64>,
    /// Measure only the cost of replicas (a 16 MiB push with `--replicas 2` against 1),
    /// without the failures.
    #[arg(long)]
    pub replicas_only: bool,
    /// Pushes per replica setting in that measure [default: 20; 5 with --quick].
    #[arg(long)]
    pub pushes: Option<u32>,
    /// Seed of the choice of the server to kill.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Write chaos.json and chaos.md here.
    #[arg(long, default_value = "bench-out")]
    pub out: PathBuf,
    /// Cluster settings of the jobs.
    #[command(flatten)]
    pub net: NetArgs,
}

const SERVERS: u32 = 4;
const WORKERS: u32 = 4;
/// Values per tensor (4 tensors, blocks of 64 values: 64 blocks over 4 servers).
const LEN: usize = 1024;
/// A worker's compute time per iteration.
const COMPUTE: Duration = Duration::from_millis(20);
/// How long after a failure an iteration counts towards its spike.
const SPIKE_WINDOW: Duration = Duration::from_secs(5);

/// One failure and what it cost.
#[derive(Clone, Debug, Serialize)]
pub struct Failure {
    /// `server` or `worker`.
    pub kind: String,
    /// The server's id (for a server).
    pub server: Option<u32>,
    /// Seconds since the start of training.
    pub at_s: f64,
    /// The kill until the scheduler showed the server gone, ms (servers only).
    pub detection_ms: Option<f64>,
    /// The kill until every worker finished an iteration again, ms.
    pub recovery_ms: f64,
    /// The longest iteration of any worker within 5 s after the kill, ms.
    pub spike_ms: f64,
    /// That iteration against the median iteration before the first failure.
    pub spike_ratio: f64,
}

/// What `bench chaos` measured.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ChaosReport {
    /// Each failure in order.
    pub failures: Vec<Failure>,
    /// Median iteration time before the first failure, ms.
    pub median_iteration_ms: f64,
    /// Iterations each worker ran.
    pub iterations: Vec<u32>,
    /// Every worker ended with exactly the parameters of its acknowledged pushes.
    pub exact: bool,
    /// Median 16 MiB push with one copy, ms.
    pub push_16mib_r1_ms: f64,
    /// The same with `--replicas 2`, ms.
    pub push_16mib_r2_ms: f64,
    /// `push_16mib_r2_ms / push_16mib_r1_ms` (target: at most 1.25).
    pub replicas_cost: f64,
}

/// `elasticps bench chaos`, its flags checked.
pub struct ChaosBench {
    cmd: ChaosCmd,
    every: Duration,
    duration: Duration,
}

impl ChaosBench {
    /// The benchmark of `cmd`.
    pub fn new(cmd: ChaosCmd) -> crate::Result<Self> {
        let every = Duration::from_secs_f64(cmd.every_s.unwrap_or(if cmd.quick { 4.0 } else { 20.0 }));
        let duration = Duration::from_secs_f64(cmd.duration_s.unwrap_or(if cmd.quick { 12.0 } else { 120.0 }));
        if every.is_zero() || duration < every {
            return Err(BenchError::Flags("--every-s must be above 0 and at most --duration-s".into()));
        }
        Ok(ChaosBench { cmd, every, duration })
    }
}

impl Bench for ChaosBench {
    const STEM: &'static str = "chaos";
    type Body = ChaosReport;

    fn out(&self) -> Option<&std::path::Path> {
        Some(&self.cmd.out)
    }

    async fn run(&self) -> crate::Result<ChaosReport> {
        let (cmd, every, duration) = (&self.cmd, self.every, self.duration);
        let log_dir = cmd.out.join("chaos-logs");
        cmd.net.install()?;
        let net = &cmd.net;
        println!(
            "chaos: {SERVERS} servers (--replicas 2), {WORKERS} workers; a server killed every {every:?} for {duration:?}"
        );
        let mut report = if cmd.replicas_only {
            ChaosReport { exact: true, ..ChaosReport::default() }
        } else {
            chaos(net, &log_dir, every, duration, cmd.seed).await?
        };
        let pushes = cmd.pushes.unwrap_or(if cmd.quick { 5 } else { 20 }).max(1);
        let r1 = push_16mib(net, &log_dir, 1, pushes).await?;
        let r2 = push_16mib(net, &log_dir, 2, pushes).await?;
        (report.push_16mib_r1_ms, report.push_16mib_r2_ms, report.replicas_cost) = (r1, r2, r2 / r1);
        Ok(report)
    }

    fn verdicts(&self, report: &ChaosReport) -> (Vec<Check>, Vec<Target>) {
        let check = Check {
            what: "every worker ends with exactly the parameters of its acknowledged pushes".into(),
            measured: if report.exact { "exact".into() } else { "a worker's final parameters differ".into() },
            pass: Some(report.exact),
        };
        let target = Target {
            what: "a 16 MiB push with --replicas 2 costs at most 1.25x one with a single copy".into(),
            measured: format!("{:.2}x", report.replicas_cost),
            met: report.replicas_cost.is_finite().then_some(report.replicas_cost <= 1.25),
        };
        (vec![check], vec![target])
    }

    fn markdown(&self, written: &Written<ChaosReport>) -> String {
        markdown(&written.body) + &checks_and_targets_markdown(&written.checks, &written.targets)
    }
}

/// Worker `rank`'s gradient of clock `t` for tensor `k`: small integers, exact in f32.
fn gradient(rank: u32, t: u32, k: usize) -> Vec<f32> {
    (0..LEN).map(|i| ((rank * 7 + t * 3 + k as u32 * 5 + i as u32) % 9) as f32 - 4.0).collect()
}

fn model() -> Vec<TensorSpec> {
    (0..4).map(|k| TensorSpec { name: format!("t{k}"), shape: vec![LEN], init: Init::Zeros }).collect()
}

/// What the workers share with the controller.
#[derive(Default)]
struct Shared {
    /// (rank, clock) of every acknowledged push.
    acked: Mutex<Vec<(u32, u32)>>,
    /// Every iteration's end, per rank: (when, how long it took).
    iterations: Mutex<BTreeMap<u32, Vec<(Instant, Duration)>>>,
    /// Workers stop once their clock reaches this (u32::MAX: go on).
    stop_at: AtomicU32,
    /// A worker told to die (its connections dropped) before its next push, and its rank.
    die: AtomicU32,
}

/// A worker's rank and its final parameters (`None`: it was told to die).
type WorkerEnd = (u32, Option<Vec<Vec<f32>>>);

/// One worker's run from its first clock until `stop_at`; returns its final parameters
/// (the values at `stop_at`), or `None` if it was told to die.
async fn worker(addr: String, rank: Option<u32>, shared: Arc<Shared>) -> crate::Result<WorkerEnd> {
    let mut opts = ClientOptions::new(addr);
    opts.rank = rank;
    let mut c = Client::connect(opts).await?;
    c.register_model(model()).await?;
    let rank = c.rank();
    let start = c.start_clock().await?;
    let mut params = c.zeros();
    c.pull(start, &mut params).await?;
    let mut t = start;
    loop {
        if t >= shared.stop_at.load(Ordering::SeqCst) {
            break;
        }
        if shared.die.compare_exchange(rank, u32::MAX, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
            // Dropped between two iterations: no push of this worker is in flight.
            return Ok((rank, None));
        }
        let began = Instant::now();
        tokio::time::sleep(COMPUTE).await;
        let grads: Vec<Vec<f32>> = (0..4).map(|k| gradient(rank, t, k)).collect();
        c.push_pull(t, &grads, &mut params)
            .await
            .map_err(|e| BenchError::Failed(format!("worker {rank}, clock {t}: {e}")))?;
        shared.acked.lock().unwrap_or_else(|e| e.into_inner()).push((rank, t));
        let now = Instant::now();
        shared.iterations.lock().unwrap_or_else(|e| e.into_inner()).entry(rank).or_default().push((now, now - began));
        t += 1;
    }
    c.barrier().await?;
    c.pull(t, &mut params).await?;
    c.finish().await?;
    Ok((rank, Some(params)))
}

/// The chaos run itself.
async fn chaos(
    net: &NetArgs,
    log_dir: &std::path::Path,
    every: Duration,
    duration: Duration,
    seed: u64,
) -> crate::Result<ChaosReport> {
    let job = JobArgs { rejoin_wait_s: 60.0, ..job_args(SERVERS, 2, 256) };
    let mut cluster = Cluster::new(log_dir)?;
    let addr = roles::scheduler(&mut cluster, &job, net, "chaos scheduler", &[]).await?;
    let mut servers = Servers { scheduler: addr.clone(), net, spawned: 0, by_node: BTreeMap::new() };
    for _ in 0..SERVERS {
        servers.spawn(&mut cluster)?;
    }
    let mut status = StatusPoller { addr: addr.clone(), codec: net.codec(), peer: None };

    let shared =
        Arc::new(Shared { stop_at: AtomicU32::new(u32::MAX), die: AtomicU32::new(u32::MAX), ..Default::default() });
    let mut tasks: Vec<tokio::task::JoinHandle<crate::Result<WorkerEnd>>> =
        (0..WORKERS).map(|_| tokio::spawn(worker(addr.clone(), None, shared.clone()))).collect();
    wait_for_first_iterations(&shared, &mut cluster).await?;
    let t0 = Instant::now();
    let mut failures = Vec::new();
    let mut rng = seed;
    let kills = (duration.as_secs_f64() / every.as_secs_f64()).floor() as u32;
    for k in 0..kills {
        sleep_draining(&mut cluster, every).await;
        if k == kills / 2 {
            // The worker's death, halfway: rank WORKERS - 1, restarted with its rank.
            let at = Instant::now();
            shared.die.store(WORKERS - 1, Ordering::SeqCst);
            let died = poll(Duration::from_secs(30), || shared.die.load(Ordering::SeqCst) == u32::MAX).await;
            if !died {
                return Err(BenchError::Failed("the worker told to die did not within 30 s".into()));
            }
            tasks.push(tokio::spawn(worker(addr.clone(), Some(WORKERS - 1), shared.clone())));
            failures.push(measure(&shared, "worker", None, at, None).await);
        }
        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let f = kill_a_server(&mut cluster, &mut servers, &mut status, &shared, rng >> 33).await?;
        println!(
            "  {:>5.1} s: {} {} killed: detected in {:.0} ms, every worker iterates again after {:.0} ms, spike {:.0} ms ({:.1}x)",
            f.at_s,
            f.kind,
            f.server.unwrap_or_default(),
            f.detection_ms.unwrap_or(0.0),
            f.recovery_ms,
            f.spike_ms,
            f.spike_ratio
        );
        failures.push(f);
    }
    // The end: every worker stops at the same clock, a few after the latest.
    let latest = shared.acked.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|(_, t)| *t).max().unwrap_or(0);
    shared.stop_at.store(latest + 5, Ordering::SeqCst);
    let finals = join_workers(tasks, &mut cluster).await?;
    cluster.stop(Duration::from_secs(10)).await;

    let acked = shared.acked.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let expected = expected_values(&acked);
    let exact = finals.len() == WORKERS as usize && finals.values().all(|p| *p == expected);
    let iterations = (0..WORKERS).map(|r| acked.iter().filter(|(rank, _)| *rank == r).count() as u32).collect();
    let median_iteration_ms = median_before(&shared, t0).as_secs_f64() * 1e3;
    Ok(ChaosReport {
        failures,
        median_iteration_ms,
        iterations,
        exact,
        push_16mib_r1_ms: 0.0,
        push_16mib_r2_ms: 0.0,
        replicas_cost: 0.0,
    })
}

/// The chaos run's servers: started here with addresses chosen here, so that status
/// rows map to processes.
struct Servers<'a> {
    scheduler: String,
    net: &'a NetArgs,
    spawned: usize,
    /// Server process (cluster node) -> its data address.
    by_node: BTreeMap<usize, String>,
}

impl Servers<'_> {
    /// Starts one more server.
    fn spawn(&mut self, cluster: &mut Cluster) -> crate::Result<()> {
        let listen = free_addr()?;
        let name = format!("chaos server {}", self.spawned);
        self.spawned += 1;
        let node = roles::server(cluster, &self.scheduler, &listen, self.net, &name, &[])?;
        self.by_node.insert(node, listen);
        Ok(())
    }
}

/// Training runs: waits (at most 60 s) for every worker's first 10 iterations.
async fn wait_for_first_iterations(shared: &Shared, cluster: &mut Cluster) -> crate::Result<()> {
    let started = Instant::now();
    while shared.iterations.lock().unwrap_or_else(|e| e.into_inner()).values().filter(|v| v.len() >= 10).count()
        < WORKERS as usize
    {
        if started.elapsed() > Duration::from_secs(60) {
            return Err(BenchError::Failed("the workers did not run 10 iterations within 60 s".into()));
        }
        drain(cluster);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

/// Kills the live server that `pick` chooses among the serving ones (by its status row),
/// starts a fresh one, and measures the failure once the scheduler saw it gone.
async fn kill_a_server(
    cluster: &mut Cluster,
    servers: &mut Servers<'_>,
    status: &mut StatusPoller,
    shared: &Shared,
    pick: u64,
) -> crate::Result<Failure> {
    let st = status.get().await?;
    let live: Vec<(u32, String)> =
        st.servers.iter().filter(|s| s.state == "serving").map(|s| (s.id, s.addr.clone())).collect();
    let Some((id, victim_addr)) = live.get(pick as usize % live.len().max(1)).cloned() else {
        return Err(BenchError::Failed("no server is serving".into()));
    };
    let Some((&node, _)) = servers.by_node.iter().find(|(_, a)| **a == victim_addr) else {
        return Err(BenchError::Failed(format!("server {id} at {victim_addr} is not one this bench started")));
    };
    let at = Instant::now();
    cluster.kill(node);
    servers.by_node.remove(&node);
    servers.spawn(cluster)?;
    let mut detected = None;
    while detected.is_none() && at.elapsed() < Duration::from_secs(30) {
        let st = status.get().await?;
        if st.servers.iter().any(|s| s.id == id && s.state == "gone") {
            detected = Some(at.elapsed());
        }
        drain(cluster);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let detected = detected.ok_or_else(|| BenchError::Failed(format!("server {id}'s loss not seen in 30 s")))?;
    Ok(measure(shared, "server", Some(id), at, Some(detected)).await)
}

/// Waits (at most 120 s) for every worker task; the final values of those that ran to
/// the end, by rank.
async fn join_workers(
    tasks: Vec<tokio::task::JoinHandle<crate::Result<WorkerEnd>>>,
    cluster: &mut Cluster,
) -> crate::Result<BTreeMap<u32, Vec<Vec<f32>>>> {
    let mut finals = BTreeMap::new();
    for t in tasks {
        let joined = tokio::select! {
            r = tokio::time::timeout(Duration::from_secs(120), t) => r,
            () = sleep_draining(cluster, Duration::from_secs(120)) => {
                return Err(BenchError::Failed("the workers did not finish".into()));
            }
        };
        if let (rank, Some(params)) = joined??? {
            finals.insert(rank, params);
        }
    }
    Ok(finals)
}

/// What every tensor must hold after exactly the acknowledged pushes (SGD with lr 1 from
/// zero: minus the sum of their gradients).
fn expected_values(acked: &[(u32, u32)]) -> Vec<Vec<f32>> {
    (0..4)
        .map(|k| {
            let mut v = vec![0.0f32; LEN];
            for (rank, t) in acked {
                for (x, g) in v.iter_mut().zip(gradient(*rank, *t, k)) {
                    *x -= g;
                }
            }
            v
        })
        .collect()
}

/// The cost of a failure at `at`: when every worker iterated again, and the longest
/// iteration in the [`SPIKE_WINDOW`] after it (measured once that window is over).
async fn measure(shared: &Shared, kind: &str, server: Option<u32>, at: Instant, detected: Option<Duration>) -> Failure {
    let deadline = at + SPIKE_WINDOW;
    tokio::time::sleep_until(deadline.into()).await;
    let its = shared.iterations.lock().unwrap_or_else(|e| e.into_inner());
    let first = its.values().filter_map(|v| v.iter().find(|(end, _)| *end > at).map(|(end, _)| *end - at)).max();
    let spike = its
        .values()
        .flat_map(|v| v.iter().filter(|(end, _)| *end > at && *end <= deadline).map(|(_, d)| *d))
        .max()
        .unwrap_or_default();
    let start = its.values().flat_map(|v| v.first().map(|(e, _)| *e)).min().unwrap_or(at);
    drop(its);
    let median = median_before(shared, at);
    Failure {
        kind: kind.into(),
        server,
        at_s: at.duration_since(start).as_secs_f64(),
        detection_ms: detected.map(|d| d.as_secs_f64() * 1e3),
        recovery_ms: first.unwrap_or(SPIKE_WINDOW).as_secs_f64() * 1e3,
        spike_ms: spike.as_secs_f64() * 1e3,
        spike_ratio: spike.as_secs_f64() / median.as_secs_f64().max(1e-9),
    }
}

/// The median iteration time of every worker before `until`.
fn median_before(shared: &Shared, until: Instant) -> Duration {
    let its = shared.iterations.lock().unwrap_or_else(|e| e.into_inner());
    let mut d: Vec<Duration> =
        its.values().flat_map(|v| v.iter().filter(|(e, _)| *e < until).map(|(_, d)| *d)).collect();
    d.sort_unstable();
    d.get(d.len() / 2).copied().unwrap_or_default()
}

/// The median of `pushes` pushes of one 16 MiB tensor (one block) from one worker to a
/// job of two servers with `replicas` copies.
async fn push_16mib(net: &NetArgs, log_dir: &std::path::Path, replicas: u32, pushes: u32) -> crate::Result<f64> {
    const VALUES: usize = 4 << 20;
    let mut job = job_args(2, replicas, VALUES * 4);
    job.workers = 1;
    job.sync = "asp".parse()?;
    let mut cluster = Cluster::new(log_dir)?;
    let addr = roles::scheduler(&mut cluster, &job, net, &format!("replicas {replicas} scheduler"), &[]).await?;
    for i in 0..2 {
        roles::server(&mut cluster, &addr, "127.0.0.1:0", net, &format!("replicas {replicas} server {i}"), &[])?;
    }
    let measured = async {
        let mut c = Client::connect(ClientOptions::new(addr)).await?;
        c.register_model(vec![TensorSpec { name: "w".into(), shape: vec![VALUES], init: Init::Zeros }]).await?;
        let grad = vec![vec![1.0f32; VALUES]];
        let mut times = Vec::new();
        for t in 0..pushes + 1 {
            let began = Instant::now();
            c.push(t, &grad).await?;
            if t > 0 {
                times.push(began.elapsed()); // the first push warms the connections up
            }
        }
        c.finish().await?;
        times.sort_unstable();
        Ok::<_, BenchError>(times[times.len() / 2].as_secs_f64() * 1e3)
    };
    let ms = tokio::time::timeout(Duration::from_secs(120), measured).await??;
    cluster.stop(Duration::from_secs(10)).await;
    println!("  16 MiB push, --replicas {replicas}: {ms:.1} ms (median of {pushes})");
    Ok(ms)
}

/// The job: SGD with lr 1 from zeros under bsp, with `replicas` copies.
fn job_args(servers: u32, replicas: u32, block_bytes: usize) -> JobArgs {
    JobArgs {
        servers,
        workers: WORKERS,
        sync: elasticps_core::sync::SyncPolicy::Bsp,
        optimizer: elasticps_core::optimizer::OptimizerKind::Sgd,
        lr: 1.0,
        placement: PlacementKind::Range,
        block_bytes,
        seed: 1,
        replicas,
        ..JobArgs::default()
    }
}

/// Asks the scheduler for its status on a connection that did not register: the
/// scheduler closes such a connection after a while (docs/DESIGN.md §11, bounds), and a
/// poll can meet it closed, so a failed call dials again once.
struct StatusPoller {
    addr: String,
    codec: elasticps_wire::Codec,
    peer: Option<SchedLink>,
}

impl StatusPoller {
    async fn get(&mut self) -> crate::Result<ClusterStatus> {
        let mut last = None;
        for _ in 0..2 {
            let peer = match self.peer.take() {
                Some(p) => p,
                None => SchedLink::operator(&self.addr, self.codec.clone()).await?.0,
            };
            let call =
                peer.call(Control::GetStatus.into(), Duration::from_secs(10), || "the scheduler's status".into());
            match call.await {
                Ok(Message::Control(Control::Status(s))) => {
                    self.peer = Some(peer);
                    return Ok(s);
                }
                Ok(other) => {
                    return Err(BenchError::Failed(format!(
                        "the scheduler answered GetStatus with {:?}",
                        other.kind()
                    )));
                }
                // Closed (or timed out): dial again.
                Err(e) => last = Some(e),
            }
        }
        Err(last.map_or_else(|| BenchError::Failed("no status".into()), Into::into))
    }
}

/// Reads the cluster's events that are waiting (exits of killed servers among them).
fn drain(cluster: &mut Cluster) {
    while let Some(Some(_)) = cluster.try_next() {}
}

async fn sleep_draining(cluster: &mut Cluster, d: Duration) {
    let until = tokio::time::Instant::now() + d;
    while tokio::time::Instant::now() < until {
        drain(cluster);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn poll(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let until = Instant::now() + timeout;
    while Instant::now() < until {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    f()
}

/// A loopback address whose port was free a moment ago.
fn free_addr() -> crate::Result<String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.to_string())
}

/// The report as Markdown.
fn markdown(r: &ChaosReport) -> String {
    let mut md = String::from(
        "| failure | at (s) | detection (ms) | every worker iterates again (ms) | largest iteration (ms) | vs median |\n|---|---:|---:|---:|---:|---:|\n",
    );
    for f in &r.failures {
        let what = match f.server {
            Some(id) => format!("server {id} (kill -9)"),
            None => "worker 3 (restarted)".to_string(),
        };
        md += &format!(
            "| {what} | {:.1} | {} | {:.0} | {:.0} | {:.1}x |\n",
            f.at_s,
            f.detection_ms.map_or("-".to_string(), |d| format!("{d:.0}")),
            f.recovery_ms,
            f.spike_ms,
            f.spike_ratio
        );
    }
    md += &format!(
        "\nmedian iteration before the first failure: {:.1} ms; iterations per worker: {:?}; final parameters exact: {}\n",
        r.median_iteration_ms,
        r.iterations,
        if r.exact { "yes" } else { "NO" }
    );
    md += &format!(
        "16 MiB push: {:.1} ms with --replicas 1, {:.1} ms with --replicas 2: {:.2}x (target: at most 1.25x{})\n",
        r.push_16mib_r1_ms,
        r.push_16mib_r2_ms,
        r.replicas_cost,
        if r.replicas_cost <= 1.25 { ", met" } else { ", missed" }
    );
    md
}
