//! The local job runner that `elasticps train` and `elasticps launch` share: it starts the
//! scheduler and the servers, then the workers (this binary's `worker` role, or the
//! user's own command with the environment of the launch contract), draws one progress
//! bar per worker, collects the event streams into a [`RunOutcome`], and stops every
//! process when one fails, when the user presses Ctrl-C (or sends SIGTERM or SIGHUP), or
//! when the job does not end within [`JobSpec::end_timeout`] after the last worker exited.
//!
//! Every rule of it (the start order and the scheduler's start deadline, restarts,
//! failover, the end wait, a signal) is [`elasticps_node::launcher::Launcher`]'s; this
//! module is its tokio world ([`elasticps_runtime::driver::drive`] runs it and sleeps
//! until the launcher's `poll_timeout()`): it spawns, watches, prints and records.

use std::collections::{BTreeMap, VecDeque};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::Duration;

use tokio::signal::unix::{Signal, SignalKind, signal};

use elasticps_node::launcher::{Effect, Failure, Input, Launcher, LauncherConfig, NodeKind, Spawn};
use elasticps_node::timing;
use elasticps_runtime::Micros;
use elasticps_runtime::driver::{self, World};
use elasticps_runtime::events::Event;
use elasticps_runtime::timer::Timer;

use crate::args::{DataArgs, JobArgs, NetArgs};
use crate::console::{Bars, Recorder, ScrapeList};
use crate::process::{Cluster, NodeEvent};
use crate::{LaunchError, Result};

// What a run produced and its report live below the I/O crates, in `elasticps-run` (the
// sim fills the same `RunOutcome`); re-exported here for the launcher's callers.
pub use elasticps_run::outcome::{Restart, RunOutcome, ServerExit};
pub use elasticps_run::report::{assemble_report, job_config_json, print_cluster_summary};

/// How long the scheduler and the servers may take, by default, to end the job once every
/// worker has exited (the scheduler ends it when every worker called `finish`).
pub const JOB_END_TIMEOUT: Duration = Duration::from_micros(timing::JOB_END_TIMEOUT_US);

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

/// [`run_job`], the nodes' logs in `log_dir`: [`Launcher`] decides, [`Local`] does the I/O.
async fn run_job_in(spec: &JobSpec<'_>, log_dir: &Path) -> Result<RunOutcome> {
    check_spec(spec)?;
    let mut signals = Signals::new()?;
    let mut cluster = Cluster::new(log_dir)?;
    let metrics_flags: Vec<String> =
        if spec.metrics { vec!["--metrics-listen".into(), "127.0.0.1:0".into()] } else { Vec::new() };
    let scrape = ScrapeList::new(spec.metrics, 1 + spec.job.servers as usize + spec.job.workers as usize);
    let args = scheduler_args(spec, log_dir, &metrics_flags);
    let config = LauncherConfig {
        servers: spec.job.servers,
        workers: spec.job.workers,
        replicas: spec.job.replicas,
        restart_workers: spec.restart_workers,
        restart_servers: spec.restart_servers,
        end_timeout_us: u64::try_from(spec.end_timeout.as_micros()).unwrap_or(u64::MAX),
    };
    let bars = Bars::new(spec.quiet);
    let env = spec.net.role_env();
    let world = Local::new(Some((spec, metrics_flags)), &mut cluster, &mut signals, &bars, args, &env, scrape);
    match drive_launcher(config, world).await {
        Ok(Ended::Over(out)) => Ok(*out),
        Ok(Ended::Listening(_)) => Err(LaunchError::NodeFailed("the job ended once its scheduler listened".into())),
        Err(e) => {
            cluster.stop(REAP_TIMEOUT).await;
            Err(e)
        }
    }
}

/// Runs `world` under a new [`Launcher`] of `config` until it ends; the bars are left
/// where they are.
async fn drive_launcher(config: LauncherConfig, mut world: Local<'_, '_>) -> Result<Ended> {
    let mut launcher = Launcher::new(config);
    let mut timer = Timer::new(world.clock);
    let end = driver::drive(&mut launcher, &mut world, &mut timer, VecDeque::new()).await;
    world.bars.clear();
    end
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

/// How a [`Local`] run ends well.
enum Ended {
    /// A world without a job: its scheduler listens at this address.
    Listening(String),
    /// Every node exited: the job's outcome.
    Over(Box<RunOutcome>),
}

/// What woke the [`Local`] world (its timer aside: [`driver::drive`] waits for that).
enum Woken {
    Node(Option<NodeEvent>),
    Signal(&'static str),
}

/// The world of a local job's [`Launcher`], run by [`driver::drive`]: it starts and
/// watches the processes, prints, draws the bars and records the events; every rule is
/// the launcher's.
struct Local<'w, 'a> {
    /// The job and its nodes' metrics flags; `None`: the scheduler alone is started, and
    /// the run ends once it listens (the rendezvous host of a launch across hosts).
    job: Option<(&'w JobSpec<'a>, Vec<String>)>,
    cluster: &'w mut Cluster,
    signals: &'w mut Signals,
    bars: &'w Bars,
    rec: Recorder<'w>,
    scrape: ScrapeList,
    /// The scheduler's command line.
    args: Vec<String>,
    /// The roles' environment (the secret).
    env: &'w [(&'static str, &'a str)],
    /// Where the scheduler listens, once it does.
    addr: String,
    /// How each node that exited ended.
    statuses: BTreeMap<usize, ExitStatus>,
    /// Why the last spawn failed.
    spawn_error: Option<LaunchError>,
    /// The launcher's clock (zero: the start of the job).
    clock: Micros,
}

impl<'w, 'a> Local<'w, 'a> {
    fn new(
        job: Option<(&'w JobSpec<'a>, Vec<String>)>,
        cluster: &'w mut Cluster,
        signals: &'w mut Signals,
        bars: &'w Bars,
        args: Vec<String>,
        env: &'w [(&'static str, &'a str)],
        scrape: ScrapeList,
    ) -> Self {
        let rec = Recorder::new(bars);
        let (addr, statuses, spawn_error, clock) = (String::new(), BTreeMap::new(), None, Micros::new());
        Self { job, cluster, signals, bars, rec, scrape, args, env, addr, statuses, spawn_error, clock }
    }
}

impl World<Launcher> for Local<'_, '_> {
    type Woken = Woken;
    type End = Result<Ended>;

    /// Waits for the next node event or signal.
    async fn wait(&mut self) -> Woken {
        tokio::select! {
            ev = self.cluster.next() => Woken::Node(ev),
            how = self.signals.recv() => Woken::Signal(how),
        }
    }

    /// Hands the launcher what happened (`None`: its timeout).
    async fn feed(
        &mut self,
        launcher: &mut Launcher,
        now: u64,
        woken: Option<Woken>,
        out: &mut Vec<Effect>,
    ) -> ControlFlow<Result<Ended>> {
        let input = match woken {
            None => Input::Timeout,
            Some(Woken::Signal(how)) => Input::Signal(how),
            // The cluster holds a sender: this never comes while it is alive.
            Some(Woken::Node(None)) => {
                return ControlFlow::Break(Err(LaunchError::NodeFailed("the launch lost track of its nodes".into())));
            }
            Some(Woken::Node(Some(ev))) => match self.node_event(now, ev) {
                Some(input) => input,
                None => return ControlFlow::Continue(()),
            },
        };
        launcher.handle_into(now, input, out);
        ControlFlow::Continue(())
    }

    /// Carries out one effect; a spawn's outcome goes back to the launcher.
    async fn carry_out(
        &mut self,
        launcher: &mut Launcher,
        now: u64,
        effect: Effect,
        queue: &mut VecDeque<Effect>,
    ) -> ControlFlow<Result<Ended>> {
        match effect {
            Effect::Spawn(spawn) => {
                let input = match self.spawn(&spawn) {
                    Ok(node) => Input::Spawned { spawn, node },
                    Err(e) => {
                        self.spawn_error = Some(e);
                        Input::SpawnFailed { spawn }
                    }
                };
                driver::feed_back(launcher, now, input, queue);
            }
            Effect::Listening { addr } if self.job.is_none() => return ControlFlow::Break(Ok(Ended::Listening(addr))),
            Effect::Listening { addr } => self.addr = addr,
            Effect::Say { line, error } => self.bars.println(error, &line),
            Effect::WorkerRestarted { rank, at_us, status } => {
                self.rec.out.restarts.push(Restart { rank, t_s: at_us as f64 / 1e6, status });
            }
            Effect::ServerLost { index, at_us, status, replaced } => {
                self.rec.out.server_exits.push(ServerExit { index, t_s: at_us as f64 / 1e6, status, replaced });
            }
            Effect::Fail(failure) => return ControlFlow::Break(Err(self.failure(failure))),
            Effect::Done => {
                let mut out = std::mem::take(&mut self.rec.out);
                out.wall = Duration::from_micros(now);
                return ControlFlow::Break(Ok(Ended::Over(Box::new(out))));
            }
        }
        ControlFlow::Continue(())
    }
}

impl Local<'_, '_> {
    /// What a node's event is to the launcher, if anything; lines are printed, metrics
    /// addresses listed, events recorded.
    fn node_event(&mut self, now: u64, ev: NodeEvent) -> Option<Input> {
        match ev {
            NodeEvent::Exited { node, status } => {
                self.statuses.insert(node, status);
                Some(Input::Exited { node, ok: status.success(), status: status.to_string() })
            }
            NodeEvent::Output { node, line, stderr } => {
                self.bars.println(stderr, &format!("[{}] {line}", self.cluster.name(node)));
                None
            }
            NodeEvent::Line { event: Event::Metrics { node, addr }, .. } => {
                self.scrape.add(node, addr);
                None
            }
            NodeEvent::Line { node, event: Event::Listening { addr } } => Some(Input::Listening { node, addr }),
            NodeEvent::Line { node, event } => {
                self.rec.event(now as f64 / 1e6, event).map(|rank| Input::RankNamed { node, rank })
            }
        }
    }

    /// The launch's error for the launcher's `failure`, with the logs it names.
    fn failure(&mut self, failure: Failure) -> LaunchError {
        let then = |e: LaunchError, then: Option<&'static str>| match then {
            Some(what) => e.then(what),
            None => e,
        };
        match failure {
            Failure::SchedulerSilent { node, why } => {
                LaunchError::Timeout(format!("{why}\n{}", self.cluster.log_tail(node, 12)))
            }
            Failure::SpawnFailed { then: what } => {
                let e = self.spawn_error.take();
                then(e.unwrap_or_else(|| LaunchError::NodeFailed("a node could not start".into())), what)
            }
            Failure::NodeFailed { node, then: what } => {
                let e = match self.statuses.get(&node) {
                    Some(status) => self.cluster.failure(node, *status),
                    None => LaunchError::NodeFailed(format!("{} failed", self.cluster.name(node))),
                };
                then(e, what)
            }
            Failure::EndTimeout { why } => LaunchError::Timeout(why),
            Failure::Stopped(how) => LaunchError::Stopped(how),
        }
    }

    /// Starts the node of `spawn`; returns its node.
    fn spawn(&mut self, spawn: &Spawn) -> Result<usize> {
        let (label, env) = (&spawn.label, self.env);
        let Some((spec, metrics_flags)) = &self.job else {
            return match spawn.node {
                NodeKind::Scheduler => self.cluster.spawn(label, &self.args, env),
                _ => {
                    Err(LaunchError::NodeFailed(format!("{label}: a launch without a job starts its scheduler alone")))
                }
            };
        };
        match spawn.node {
            NodeKind::Scheduler => self.cluster.spawn(label, &self.args, env),
            NodeKind::Server { index } => {
                let args = server_args(spec, &self.addr, metrics_flags, index);
                self.cluster.spawn(label, &args, env)
            }
            NodeKind::Worker { index, rank } => match &spec.workers {
                Workers::Role(data) => {
                    let mut args = vec!["worker".to_string(), "--scheduler".into(), self.addr.clone()];
                    args.extend(data.to_flags());
                    args.extend(spec.net.to_flags());
                    args.extend(metrics_flags.iter().cloned());
                    if let Some(r) = rank {
                        args.extend(["--rank".into(), r.to_string()]);
                    }
                    self.cluster.spawn(label, &args, env)
                }
                Workers::Command { argv, env: extra } => {
                    let mut env = worker_env(spec.job, spec.net, &self.addr, index);
                    if spec.metrics {
                        env.push(("ELASTICPS_METRICS_LISTEN".into(), "127.0.0.1:0".into()));
                    }
                    if let Some(r) = rank {
                        env.push(("ELASTICPS_RANK".into(), r.to_string()));
                    }
                    env.extend(extra.iter().cloned());
                    self.cluster.spawn_command(label, argv, &env)
                }
            },
        }
    }
}

/// Server `i`'s command line (this binary's `server` role) in a job whose scheduler
/// listens at `addr`.
fn server_args(spec: &JobSpec<'_>, addr: &str, metrics_flags: &[String], i: u32) -> Vec<String> {
    let mut args = vec!["server".to_string(), "--scheduler".into(), addr.to_string(), "--listen".into()];
    args.push("127.0.0.1:0".into());
    args.extend(spec.net.to_flags());
    args.extend(metrics_flags.iter().cloned());
    args.extend(spec.extra_server_args.iter().map(|a| a.replace("{i}", &i.to_string())));
    args
}

/// Starts `elasticps ARGS` (a scheduler) as node "scheduler" and waits for the address it
/// listens on: a [`Launcher`] without servers or workers, its run ended once the
/// scheduler listens (its start deadline and a signal are the launcher's rules).
pub(crate) async fn start_scheduler(
    cluster: &mut Cluster,
    args: &[String],
    env: &[(&'static str, &str)],
    signals: &mut Signals,
    scrape: ScrapeList,
) -> Result<String> {
    let bars = Bars::new(true);
    let config = LauncherConfig {
        servers: 0,
        workers: 0,
        replicas: 1,
        restart_workers: 0,
        restart_servers: 0,
        end_timeout_us: 0,
    };
    let world = Local::new(None, cluster, signals, &bars, args.to_vec(), env, scrape);
    match drive_launcher(config, world).await? {
        Ended::Listening(addr) => Ok(addr),
        Ended::Over(_) => Err(LaunchError::NodeFailed("the scheduler exited before it reported its address".into())),
    }
}
