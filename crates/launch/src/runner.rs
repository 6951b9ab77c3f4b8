//! The local job runner that `elasticps train` and `elasticps launch` share: it starts the
//! scheduler and the servers, then the workers (this binary's `worker` role, or the
//! user's own command with the environment of the launch contract), draws one progress
//! bar per worker, collects the event streams into a [`RunOutcome`], and stops every
//! process when one fails, when the user presses Ctrl-C (or sends SIGTERM or SIGHUP), or
//! when the job does not end within [`JobSpec::end_timeout`] after the last worker exited.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use tokio::signal::unix::{Signal, SignalKind, signal};

use elasticps_node::timing;
use elasticps_report::CurvePoint;
use elasticps_runtime::events::Event;

use crate::args::{DataArgs, JobArgs, NetArgs};
use crate::process::{Cluster, NodeEvent};
use crate::{LaunchError, Result};

// What a run produced and its report live below the I/O crates, in `elasticps-run` (the
// sim fills the same `RunOutcome`); re-exported here for the launcher's callers.
pub use elasticps_run::outcome::{Restart, RunOutcome, ServerExit};
pub use elasticps_run::report::{assemble_report, job_config_json, print_cluster_summary};

/// How long the scheduler and the servers may take, by default, to end the job once every
/// worker has exited (the scheduler ends it when every worker called `finish`).
pub const JOB_END_TIMEOUT: Duration = Duration::from_secs(45);
/// How long the scheduler may take to report its address.
const SCHEDULER_START_TIMEOUT: Duration = Duration::from_secs(20);
/// Keys of a `log` event that the runner reads itself; every other key is kept in the
/// curve point's `metrics`.
const READ_KEYS: [&str; 4] = ["loss", "accuracy", "test_accuracy", "total"];

/// How the workers of a local job are started.
#[derive(Clone, Debug)]
pub enum Workers<'a> {
    /// This binary's `worker` role with these data flags.
    Role(&'a DataArgs),
    /// The user's command (`argv`), with `env` added to the environment of the contract
    /// (scheduler address, secret, frame limit, number of workers, local rank, events fd).
    Command {
        /// Program and arguments.
        argv: &'a [String],
        /// Further variables (e.g. `ELASTICPS_REQUEST_TIMEOUT`).
        env: Vec<(String, String)>,
    },
}

/// One local job.
#[derive(Clone, Debug)]
pub struct JobSpec<'a> {
    /// The scheduler's job flags.
    pub job: &'a JobArgs,
    /// Transport settings of every node.
    pub net: &'a NetArgs,
    /// The report directory: the nodes' logs go into its `logs/` (a temporary directory
    /// otherwise, removed if the job succeeds).
    pub report: Option<&'a Path>,
    /// Do not draw progress bars.
    pub quiet: bool,
    /// More flags for each server (`{i}` is replaced by the server's index).
    pub extra_server_args: &'a [String],
    /// The workers.
    pub workers: Workers<'a>,
    /// How long the scheduler and the servers may take to end the job once every worker
    /// has exited.
    pub end_timeout: Duration,
    /// Every node serves Prometheus metrics on a free port; print where to scrape them.
    pub metrics: bool,
    /// Restart a worker that dies with its rank, at most this many times in all.
    pub restart_workers: u32,
    /// With replicas: start a new server when one dies, at most this many times in all.
    pub restart_servers: u32,
}

/// The environment of a user's worker command, spawn index `local_rank`, in a job whose
/// scheduler listens at `scheduler` (the contract with the Python package).
pub fn worker_env(job: &JobArgs, net: &NetArgs, scheduler: &str, local_rank: u32) -> Vec<(String, String)> {
    // A user's script holds the worker secret alone when there is one: it can be a worker
    // and nothing else (a compromised script cannot become a server).
    // (The launcher's own environment may hold ELASTICPS_SECRET: it is emptied then.)
    let secret = if net.worker_secret().is_some() { String::new() } else { net.secret.clone() };
    let mut env: Vec<(String, String)> = [
        ("ELASTICPS_SCHEDULER", scheduler.to_string()),
        ("ELASTICPS_SECRET", secret),
        ("ELASTICPS_MAX_FRAME_MIB", net.max_frame_mib.to_string()),
        ("ELASTICPS_WORKERS", job.workers.to_string()),
        ("ELASTICPS_LOCAL_RANK", local_rank.to_string()),
        (elasticps_runtime::events::EVENTS_FD_VAR, crate::process::EVENTS_FD.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    if let Some(ws) = net.worker_secret() {
        env.push(("ELASTICPS_WORKER_SECRET".into(), ws.to_string()));
    }
    env.extend(net.tls_env());
    env
}

/// SIGINT, SIGTERM and SIGHUP, listened to for the whole run: each stops every node
/// (a worker command's own children included) before the launcher exits.
pub(crate) struct Signals {
    int: Signal,
    term: Signal,
    hup: Signal,
}

impl Signals {
    pub(crate) fn new() -> Result<Self> {
        let listen = |kind| signal(kind).map_err(|e| LaunchError::io("cannot listen for signals", e));
        Ok(Self {
            int: listen(SignalKind::interrupt())?,
            term: listen(SignalKind::terminate())?,
            hup: listen(SignalKind::hangup())?,
        })
    }

    /// Waits for either signal; returns what to call it.
    pub(crate) async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.int.recv() => "interrupted",
            _ = self.term.recv() => "terminated",
            _ = self.hup.recv() => "hung up",
        }
    }
}

/// How long a failed or interrupted job waits for the processes it killed to be reaped
/// ([`timing::REAP_TIMEOUT_US`]).
pub(crate) const REAP_TIMEOUT: Duration = Duration::from_micros(timing::REAP_TIMEOUT_US);

/// Where a job's nodes write their logs: the report's `logs/`, kept; or, without a report,
/// `$TMPDIR/elasticps-PID/`, which a job that succeeds removes and a failed one keeps,
/// its error saying where.
pub(crate) struct LogDir {
    path: PathBuf,
    temporary: bool,
}

impl LogDir {
    /// The log directory of a job whose report goes to `report`, if any.
    pub(crate) fn new(report: Option<&Path>) -> Self {
        match report {
            Some(dir) => Self { path: dir.join("logs"), temporary: false },
            None => {
                Self { path: std::env::temp_dir().join(format!("elasticps-{}", std::process::id())), temporary: true }
            }
        }
    }

    /// Its path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// The job is over with `result`: a temporary directory is removed if it succeeded,
    /// and named in the error if it failed after a node started.
    pub(crate) fn close<T>(self, result: Result<T>) -> Result<T> {
        if !self.temporary || !self.path.exists() {
            return result;
        }
        match result {
            Ok(v) => {
                if let Err(e) = std::fs::remove_dir_all(&self.path) {
                    tracing::warn!(dir = %self.path.display(), error = %e, "cannot remove the job's logs");
                }
                Ok(v)
            }
            Err(cause) => Err(LaunchError::LogsKept { cause: Box::new(cause), dir: self.path }),
        }
    }
}

/// Runs one job on a local cluster and collects its events.
pub async fn run_job(spec: &JobSpec<'_>) -> Result<RunOutcome> {
    let logs = LogDir::new(spec.report);
    let result = run_job_in(spec, logs.path()).await;
    logs.close(result)
}

/// [`run_job`], the nodes' logs in `log_dir`.
async fn run_job_in(spec: &JobSpec<'_>, log_dir: &Path) -> Result<RunOutcome> {
    check_spec(spec)?;
    let mut signals = Signals::new()?;
    let mut cluster = Cluster::new(log_dir)?;
    let started = Instant::now();
    let metrics_flags: Vec<String> =
        if spec.metrics { vec!["--metrics-listen".into(), "127.0.0.1:0".into()] } else { Vec::new() };
    let mut scrape = ScrapeList::new(spec.metrics, 1 + spec.job.servers as usize + spec.job.workers as usize);
    let env = spec.net.role_env();
    let args = scheduler_args(spec, log_dir, &metrics_flags);
    let addr = match start_scheduler(&mut cluster, &args, &env, &mut signals, &mut scrape).await {
        Ok(addr) => addr,
        Err(e) => {
            cluster.stop(REAP_TIMEOUT).await;
            return Err(e);
        }
    };
    let mut nodes = Nodes::new(spec, addr, env, metrics_flags);
    nodes.start(&mut cluster).await?;
    let mut watch = Watch { spec, cluster: &mut cluster, signals: &mut signals, scrape: &mut scrape, nodes, started };
    watch.run().await
}

/// Refuses a wrong job flag, before any process starts.
fn check_spec(spec: &JobSpec<'_>) -> Result<()> {
    spec.job.job_config()?;
    spec.net.tls()?;
    if let Workers::Command { argv, .. } = &spec.workers {
        crate::process::check_program(argv)?;
    }
    if spec.restart_servers > 0 && spec.job.replicas < 2 {
        return Err(LaunchError::Flags(
            "--restart-servers needs --replicas 2 or more (without a backup, a lost server's blocks are gone)".into(),
        ));
    }
    Ok(())
}

/// The scheduler's command line: its role, a free port, the logs, the job and the transport.
fn scheduler_args(spec: &JobSpec<'_>, log_dir: &Path, metrics_flags: &[String]) -> Vec<String> {
    let mut args = vec!["scheduler".to_string(), "--listen".into(), "127.0.0.1:0".into(), "--log-dir".into()];
    args.push(log_dir.display().to_string());
    args.extend(spec.job.to_flags());
    if spec.restart_workers > 0 && spec.job.rejoin_wait_s == 0.0 {
        // A worker being restarted may come back after the others finished.
        args.extend(["--rejoin-wait-s".into(), (timing::RESTART_REJOIN_WAIT_US / 1_000_000).to_string()]);
    }
    args.extend(spec.net.to_flags());
    args.extend(metrics_flags.iter().cloned());
    args
}

/// The servers and workers of a local job whose scheduler listens at `addr`: how each is
/// started (and restarted), and which node is which.
struct Nodes<'s, 'a> {
    spec: &'s JobSpec<'a>,
    addr: String,
    env: Vec<(&'static str, &'a str)>,
    metrics_flags: Vec<String>,
    /// Server node -> spawn index.
    servers: BTreeMap<usize, u32>,
    /// Worker node -> (spawn index, rank once an event named it).
    workers: BTreeMap<usize, (u32, Option<u32>)>,
    /// The spawn index of the next server started in a lost one's place.
    next_server: u32,
    server_restarts_left: u32,
    worker_restarts_left: u32,
}

/// What became of a node that exited, for the runner's loop.
enum Exit {
    /// A worker was restarted with its rank.
    Restarted,
    /// The node is gone; `last_worker` if it was the last worker running.
    Gone {
        /// Every worker has now exited.
        last_worker: bool,
    },
}

impl<'s, 'a> Nodes<'s, 'a> {
    fn new(spec: &'s JobSpec<'a>, addr: String, env: Vec<(&'static str, &'a str)>, metrics_flags: Vec<String>) -> Self {
        Self {
            spec,
            addr,
            env,
            metrics_flags,
            servers: BTreeMap::new(),
            workers: BTreeMap::new(),
            next_server: spec.job.servers,
            server_restarts_left: spec.restart_servers,
            worker_restarts_left: spec.restart_workers,
        }
    }

    /// Starts the job's servers, then its workers (a worker that cannot start stops every
    /// node started so far).
    async fn start(&mut self, cluster: &mut Cluster) -> Result<()> {
        for i in 0..self.spec.job.servers {
            let node = self.spawn_server(cluster, i)?;
            self.servers.insert(node, i);
        }
        for i in 0..self.spec.job.workers {
            match self.spawn_worker(cluster, i, None) {
                Ok(node) => self.workers.insert(node, (i, None)),
                Err(e) => {
                    cluster.stop(REAP_TIMEOUT).await;
                    return Err(e.then("every node started so far was stopped"));
                }
            };
        }
        Ok(())
    }

    /// Starts server `i` (this binary's `server` role); returns its node.
    fn spawn_server(&self, cluster: &mut Cluster, i: u32) -> Result<usize> {
        let spec = self.spec;
        let mut args = vec![
            "server".to_string(),
            "--scheduler".into(),
            self.addr.clone(),
            "--listen".into(),
            "127.0.0.1:0".into(),
        ];
        args.extend(spec.net.to_flags());
        args.extend(self.metrics_flags.iter().cloned());
        args.extend(spec.extra_server_args.iter().map(|a| a.replace("{i}", &i.to_string())));
        cluster.spawn(&format!("server {i}"), &args, &self.env)
    }

    /// Starts worker `i`, restarted as `rank` if given; returns its node.
    fn spawn_worker(&self, cluster: &mut Cluster, i: u32, rank: Option<u32>) -> Result<usize> {
        let spec = self.spec;
        let name = match rank {
            None => format!("worker {i}"),
            Some(r) => format!("worker {i} (restarted as rank {r})"),
        };
        match &spec.workers {
            Workers::Role(data) => {
                let mut args = vec!["worker".to_string(), "--scheduler".into(), self.addr.clone()];
                args.extend(data.to_flags());
                args.extend(spec.net.to_flags());
                args.extend(self.metrics_flags.iter().cloned());
                if let Some(r) = rank {
                    args.extend(["--rank".into(), r.to_string()]);
                }
                cluster.spawn(&name, &args, &self.env)
            }
            Workers::Command { argv, env: extra } => {
                let mut env = worker_env(spec.job, spec.net, &self.addr, i);
                if spec.metrics {
                    env.push(("ELASTICPS_METRICS_LISTEN".into(), "127.0.0.1:0".into()));
                }
                if let Some(r) = rank {
                    env.push(("ELASTICPS_RANK".into(), r.to_string()));
                }
                env.extend(extra.iter().cloned());
                cluster.spawn_command(&name, argv, &env)
            }
        }
    }

    /// Node `node` exited with `status`, `t_s` seconds into the run: a dead worker is
    /// restarted with its rank (`--restart-workers`), a dead server's blocks fail over
    /// (`--replicas`, replaced with `--restart-servers`), any other failure fails the job.
    /// An error is the job's: the caller stops every node.
    fn exited(
        &mut self,
        cluster: &mut Cluster,
        bars: &Bars,
        out: &mut RunOutcome,
        node: usize,
        status: ExitStatus,
        t_s: f64,
    ) -> Result<Exit> {
        let rank = self.workers.get(&node).and_then(|(_, r)| *r);
        if !status.success()
            && self.worker_restarts_left > 0
            && let (Some(rank), Some((i, _))) = (rank, self.workers.remove(&node))
        {
            self.worker_restarts_left -= 1;
            let line = format!(
                "[{}] exited with {status}; restarting it as rank {rank} ({} restarts left)",
                cluster.name(node),
                self.worker_restarts_left
            );
            bars.println(true, &line);
            out.restarts.push(Restart { rank, t_s, status: status.to_string() });
            let again = self
                .spawn_worker(cluster, i, Some(rank))
                .map_err(|e| e.then("the worker could not be restarted; every other node was stopped"))?;
            self.workers.insert(again, (i, Some(rank)));
            return Ok(Exit::Restarted);
        }
        if !status.success()
            && self.spec.job.replicas > 1
            && let Some(index) = self.servers.remove(&node)
        {
            let replaced = self.server_lost(cluster, bars, node, status)?;
            out.server_exits.push(ServerExit { index, t_s, status: status.to_string(), replaced });
            return Ok(Exit::Gone { last_worker: false });
        }
        if !status.success() {
            return Err(cluster.failure(node, status).then("the job failed; every other node was stopped"));
        }
        Ok(Exit::Gone { last_worker: self.workers.remove(&node).is_some() && self.workers.is_empty() })
    }

    /// Server node `node` died in a job with replicas: its blocks fail over to their
    /// backups, and a new server takes its place while restarts are left; returns whether
    /// one did.
    fn server_lost(&mut self, cluster: &mut Cluster, bars: &Bars, node: usize, status: ExitStatus) -> Result<bool> {
        let replaced = self.server_restarts_left > 0;
        let line = if replaced {
            self.server_restarts_left -= 1;
            format!(
                "[{}] exited with {status}; its blocks fail over to their backups; starting server {} in its place \
                 ({} restarts left)",
                cluster.name(node),
                self.next_server,
                self.server_restarts_left
            )
        } else {
            format!("[{}] exited with {status}; its blocks fail over to their backups", cluster.name(node))
        };
        bars.println(true, &line);
        if replaced {
            let again = self
                .spawn_server(cluster, self.next_server)
                .map_err(|e| e.then("no server could be started in its place; every node was stopped"))?;
            self.servers.insert(again, self.next_server);
            self.next_server += 1;
        }
        Ok(replaced)
    }
}

/// A started job, watched to its end: its nodes' events, the user's signals, and the
/// deadline for the job to end once every worker exited.
struct Watch<'c, 's, 'a> {
    spec: &'s JobSpec<'a>,
    cluster: &'c mut Cluster,
    signals: &'c mut Signals,
    scrape: &'c mut ScrapeList,
    nodes: Nodes<'s, 'a>,
    started: Instant,
}

impl Watch<'_, '_, '_> {
    /// Records every event until every node exited; stops every node when one fails, on a
    /// signal, or when the job does not end within [`JobSpec::end_timeout`] after the last
    /// worker exited.
    async fn run(&mut self) -> Result<RunOutcome> {
        let bars = Bars::new(self.spec.quiet);
        let mut rec = Recorder::new(&bars);
        let mut end_by = None;
        loop {
            let next = tokio::select! {
                ev = self.cluster.next() => ev,
                how = self.signals.recv() => {
                    bars.clear();
                    self.cluster.stop(REAP_TIMEOUT).await;
                    return Err(LaunchError::Stopped(how));
                }
                _ = sleep_until(end_by) => {
                    bars.clear();
                    let left = self.cluster.running().join(", ");
                    self.cluster.stop(REAP_TIMEOUT).await;
                    return Err(LaunchError::Timeout(format!(
                        "every worker exited, but the job did not end within {:.0} s (still running: {left}); a \
                         worker that exits without finishing leaves the scheduler waiting for it",
                        self.spec.end_timeout.as_secs_f64()
                    )));
                }
            };
            let t_s = self.started.elapsed().as_secs_f64();
            match next {
                None => break,
                Some(NodeEvent::Exited { node, status }) => {
                    match self.nodes.exited(self.cluster, &bars, &mut rec.out, node, status, t_s) {
                        Ok(Exit::Restarted) => continue,
                        Ok(Exit::Gone { last_worker }) => {
                            if last_worker {
                                end_by = Some(tokio::time::Instant::now() + self.spec.end_timeout);
                            }
                        }
                        Err(e) => {
                            bars.clear();
                            self.cluster.stop(REAP_TIMEOUT).await;
                            return Err(e);
                        }
                    }
                    if self.cluster.all_exited() {
                        break;
                    }
                }
                Some(NodeEvent::Output { node, line, stderr }) => {
                    bars.println(stderr, &format!("[{}] {line}", self.cluster.name(node)));
                }
                Some(NodeEvent::Line { event: Event::Metrics { node, addr }, .. }) => self.scrape.add(node, addr),
                Some(NodeEvent::Line { node, event }) => {
                    if let Some(rank) = rec.event(t_s, event)
                        && let Some((_, r)) = self.nodes.workers.get_mut(&node)
                    {
                        *r = Some(rank);
                    }
                }
            }
        }
        bars.clear();
        let mut out = rec.out;
        out.wall = self.started.elapsed();
        Ok(out)
    }
}

/// Turns the event lines of a job's nodes into its [`RunOutcome`], and moves the progress
/// bars.
pub struct Recorder<'b> {
    /// What the events so far recorded.
    pub out: RunOutcome,
    bars: &'b Bars,
    eval_rank: Option<u32>,
}

impl<'b> Recorder<'b> {
    /// A recorder that draws on `bars`.
    pub fn new(bars: &'b Bars) -> Self {
        Self { out: RunOutcome::default(), bars, eval_rank: None }
    }

    /// Records one event, `t_s` seconds into the run; returns the rank of the worker that
    /// sent it, if it is a worker's progress.
    pub fn event(&mut self, t_s: f64, event: Event) -> Option<u32> {
        let mut named = None;
        match event {
            Event::Progress { rank, iteration, total, loss } => {
                named = Some(rank);
                self.bars.update(rank, iteration.into(), Some(total.into()), Some(f64::from(loss)));
                self.out.curve.push(CurvePoint {
                    t_s,
                    iteration: iteration.into(),
                    rank,
                    loss: Some(loss.into()),
                    test_accuracy: None,
                    metrics: BTreeMap::new(),
                });
            }
            Event::Eval { rank, iteration, accuracy, loss } => {
                if self.eval_rank.is_none_or(|r| rank <= r) {
                    (self.eval_rank, self.out.final_eval) = (Some(rank), Some((accuracy, loss)));
                }
                self.out.curve.push(CurvePoint {
                    t_s,
                    iteration: iteration.into(),
                    rank,
                    loss: None,
                    test_accuracy: Some(accuracy.into()),
                    metrics: BTreeMap::new(),
                });
            }
            Event::Log { rank, step, metrics } => {
                named = Some(rank);
                let loss = metrics.get("loss").copied();
                let total = metrics.get("total").copied().filter(|t| t.is_finite() && *t >= 0.0);
                self.bars.update(rank, step, total.map(|t| t as u64), loss);
                let accuracy = metrics.get("accuracy").or_else(|| metrics.get("test_accuracy")).copied();
                if let Some(acc) = accuracy
                    && self.eval_rank.is_none_or(|r| rank <= r)
                {
                    let test_loss = metrics.get("test_loss").copied().unwrap_or(f64::NAN);
                    (self.eval_rank, self.out.final_eval) = (Some(rank), Some((acc as f32, test_loss as f32)));
                }
                let metrics = metrics.into_iter().filter(|(k, _)| !READ_KEYS.contains(&k.as_str())).collect();
                self.out.curve.push(CurvePoint { t_s, iteration: step, rank, loss, test_accuracy: accuracy, metrics });
            }
            Event::WorkerDone(w) => {
                self.out.workers.insert(w.rank, w);
            }
            Event::ServerStats(s) => {
                self.out.servers.insert(s.server_id, s);
            }
            Event::Balance(log) => self.out.balance = Some(log),
            Event::Listening { .. } => {}
            Event::Waiting { what } => self.bars.println(false, &what),
            Event::Metrics { .. } => {}
        }
        named
    }
}

/// Starts `elasticps ARGS` (a scheduler) as node "scheduler" and waits for the address it
/// listens on.
pub(crate) async fn start_scheduler(
    cluster: &mut Cluster,
    args: &[String],
    env: &[(&str, &str)],
    signals: &mut Signals,
    scrape: &mut ScrapeList,
) -> Result<String> {
    let sched = cluster.spawn("scheduler", args, env)?;
    let deadline = tokio::time::Instant::now() + SCHEDULER_START_TIMEOUT;
    loop {
        let next = tokio::select! {
            ev = tokio::time::timeout_at(deadline, cluster.next()) => ev,
            how = signals.recv() => return Err(LaunchError::Stopped(how)),
        };
        match next {
            Ok(Some(NodeEvent::Line { event: Event::Listening { addr }, .. })) => return Ok(addr),
            Ok(Some(NodeEvent::Line { event: Event::Metrics { node, addr }, .. })) => scrape.add(node, addr),
            Ok(Some(NodeEvent::Exited { node, status })) => return Err(cluster.failure(node, status)),
            Ok(Some(_)) => continue,
            Ok(None) | Err(_) => {
                return Err(LaunchError::Timeout(format!(
                    "the scheduler did not report its address within {} s\n{}",
                    SCHEDULER_START_TIMEOUT.as_secs(),
                    cluster.log_tail(sched, 12)
                )));
            }
        }
    }
}

/// Sleeps until `at`, or forever if there is no deadline.
// Allowed, not yet a machine's: the local launcher's end wait (`--end-timeout` after the
// last worker exited) is a rule with a time that no node machine holds yet (issue 33).
#[allow(clippy::disallowed_methods)]
pub(crate) async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// One progress bar per worker rank, and the lines printed above them.
pub struct Bars {
    multi: MultiProgress,
    bars: std::cell::RefCell<BTreeMap<u32, ProgressBar>>,
}

impl Bars {
    /// Bars on stderr, or none at all if `quiet`.
    pub fn new(quiet: bool) -> Self {
        let target = if quiet { ProgressDrawTarget::hidden() } else { ProgressDrawTarget::stderr() };
        Self { multi: MultiProgress::with_draw_target(target), bars: Default::default() }
    }

    /// Moves rank `rank`'s bar to `position` (of `total`, if known), showing `loss`.
    pub fn update(&self, rank: u32, position: u64, total: Option<u64>, loss: Option<f64>) {
        let mut bars = self.bars.borrow_mut();
        let bar = bars.entry(rank).or_insert_with(|| {
            let b = self.multi.add(ProgressBar::new(total.unwrap_or(0)));
            b.set_style(
                ProgressStyle::with_template(
                    "worker {prefix:>2} [{bar:30.cyan/blue}] {pos:>6}/{len} it  {per_sec:>10}  loss {msg}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            b.set_prefix(rank.to_string());
            b
        });
        if let Some(total) = total {
            bar.set_length(total);
        }
        bar.set_position(position);
        if let Some(loss) = loss {
            bar.set_message(format!("{loss:.4}"));
        }
    }

    /// Prints `line` on stdout (or stderr) above the bars, without garbling them.
    pub fn println(&self, stderr: bool, line: &str) {
        self.multi.suspend(|| {
            use std::io::Write;
            if stderr {
                let _ = writeln!(std::io::stderr().lock(), "{line}");
            } else {
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "{line}");
                let _ = out.flush();
            }
        });
    }

    /// Leaves every bar where it is.
    pub fn clear(&self) {
        for b in self.bars.borrow().values() {
            b.finish();
        }
    }
}

/// Where to scrape each node (`--metrics`): printed once every node started reports its
/// address, then one line per node that joins later (a server the scheduler launched).
pub(crate) struct ScrapeList {
    enabled: bool,
    expected: usize,
    nodes: Vec<(String, String)>,
    printed: bool,
}

impl ScrapeList {
    pub(crate) fn new(enabled: bool, expected: usize) -> Self {
        Self { enabled, expected, nodes: Vec::new(), printed: false }
    }

    fn add(&mut self, node: String, addr: String) {
        if !self.enabled {
            return;
        }
        let url = format!("http://{addr}/metrics");
        if self.printed {
            println!("metrics: {node} {url}");
            return;
        }
        self.nodes.push((node, url));
        if self.nodes.len() >= self.expected {
            // scheduler first, then servers and workers by id.
            let key = |n: &str| {
                let (role, id) = n.split_once(' ').unwrap_or((n, ""));
                let order = match role {
                    "scheduler" => 0,
                    "server" => 1,
                    _ => 2,
                };
                (order, id.parse::<u32>().unwrap_or(0))
            };
            self.nodes.sort_by_key(|(n, _)| key(n));
            let list: Vec<String> = self.nodes.iter().map(|(n, u)| format!("{n} {u}")).collect();
            println!("metrics: {}", list.join(", "));
            self.printed = true;
        }
    }
}
