//! `elasticps launch --nnodes MIN[:MAX] --rdzv HOST:PORT -- CMD`, run on every host of a
//! job (torchrun's shape). Every launch is its host's agent: it joins the job with its
//! slots ([`elasticps_wire::Control::JoinHost`]), starts the servers and workers the
//! scheduler tells it to within those slots, reports their exits, relays their events,
//! and heartbeats. The launch whose host owns the `--rdzv` address also runs the scheduler
//! there, and builds the job's report from the scheduler's event stream (where the agents'
//! relayed events arrive).
//!
//! Every rule of the agent (when to dial, join, start, refuse, report, heartbeat, give up,
//! end) is [`elasticps_node::agent::Agent`]'s; what to start where, and what a lost host
//! means, is the scheduler's (`elasticps_node::scheduler::hosts`). This module is the
//! agent's tokio driver: it reads the flags, dials, writes and reads frames, spawns and
//! watches processes; [`elasticps_runtime::driver::drive`] runs the agent in it and
//! sleeps until the agent's `poll_timeout()`.

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;
use elasticps_node::agent::{Agent, AgentConfig, Effect, Failure, Input, NodeKind, Outcome, Spawn};
use elasticps_node::timing;
use elasticps_runtime::Micros;
use elasticps_runtime::driver::{self, World};
use elasticps_runtime::timer::Timer;
use elasticps_wire::{HostOffer, Message};

use crate::addr;
use crate::args::{JobArgs, NetArgs};
use crate::console::{Bars, Recorder, ScrapeList};
use crate::process::{Cluster, NodeEvent};
use crate::runner::{REAP_TIMEOUT, RunOutcome, Signals, worker_env};
use crate::{LaunchError, Result};

/// The flags of a launch that is one host of a job.
#[derive(Args, Clone, Debug, Default)]
pub struct HostArgs {
    /// Hosts in the job: it starts once MIN joined, and takes up to MAX (a host that
    /// joins later brings slots for new servers and restarted workers).
    #[arg(long, value_name = "MIN[:MAX]", value_parser = parse_nnodes)]
    pub nnodes: Option<(u32, u32)>,
    /// The rendezvous: HOST:PORT of the host that runs the scheduler (the launch on that
    /// host runs it), or `slurm` (the first host of SLURM_JOB_NODELIST, port 29400).
    #[arg(long, env = "ELASTICPS_RDZV", value_name = "HOST:PORT|slurm")]
    pub rdzv: Option<String>,
    /// Servers this host starts when the job starts (hosts may differ: the job's size is
    /// the sum over its first MIN hosts; 0 and 0 make a spare host).
    #[arg(long, default_value_t = 1)]
    pub servers_per_node: u32,
    /// Workers (copies of the command) this host starts when the job starts.
    #[arg(long, default_value_t = 1)]
    pub workers_per_node: u32,
    /// Servers this host may run at most, scale-outs and replacements included
    /// (default: --servers-per-node + 1).
    #[arg(long)]
    pub server_slots: Option<u32>,
    /// Workers this host may run at most, restarted ones included (default:
    /// --workers-per-node + 1).
    #[arg(long)]
    pub worker_slots: Option<u32>,
    /// The address this host's nodes advertise (default: the address of the interface
    /// that routes to the rendezvous).
    #[arg(long, env = "ELASTICPS_ADVERTISE")]
    pub advertise: Option<String>,
    /// Advertise the address of this interface (e.g. `eth0`).
    #[arg(long)]
    pub interface: Option<String>,
    /// This host's name in the job (default: its hostname).
    #[arg(long)]
    pub node_name: Option<String>,
    /// Give up, naming what never came, if the job has not assembled within this many
    /// seconds (hosts and servers: of the start; workers: of the first worker's
    /// registration, so a script's start does not count); also how long a host waits for
    /// the rendezvous.
    #[arg(long, env = "ELASTICPS_JOIN_TIMEOUT", default_value_t = 300)]
    pub join_timeout_s: u64,
    /// Every worker pushes its own gradient and pulls its own values. By default, on a
    /// job across hosts, the workers a host starts with the job (--workers-per-node > 1)
    /// push once per host: one of them sums their gradients and pushes the sum, and hands
    /// the others the values it pulled (docs/MANUAL.md, "One push per host").
    #[arg(long)]
    pub no_host_aggregation: bool,
}

impl HostArgs {
    /// True if this launch is one host of a job that spans hosts.
    pub fn spans_hosts(&self) -> bool {
        self.rdzv.is_some() || self.nnodes.is_some()
    }

    /// True if this host's workers push once per host: a job that may span more than one
    /// host, without `--no-host-aggregation`.
    pub fn host_groups(&self) -> bool {
        !self.no_host_aggregation && self.nnodes.map_or(self.rdzv.is_some(), |(_, max)| max > 1)
    }
}

/// Parses `--nnodes MIN[:MAX]`.
pub fn parse_nnodes(s: &str) -> std::result::Result<(u32, u32), String> {
    let number = |v: &str| v.trim().parse::<u32>().map_err(|_| format!("--nnodes {s}: {v:?} is not a number of hosts"));
    let (min, max) = match s.split_once(':') {
        Some((a, b)) => (number(a)?, number(b)?),
        None => (number(s)?, number(s)?),
    };
    if min == 0 || max < min {
        return Err(format!("--nnodes {s}: MIN must be at least 1 and MAX at least MIN"));
    }
    Ok((min, max))
}

/// One host's launch.
#[derive(Clone, Debug)]
pub struct HostSpec<'a> {
    /// The host flags.
    pub hosts: &'a HostArgs,
    /// The job flags (its servers and workers are what the first MIN hosts offer).
    pub job: &'a JobArgs,
    /// Transport settings.
    pub net: &'a NetArgs,
    /// The report directory (its `logs/` holds this host's node logs).
    pub report: Option<&'a Path>,
    /// No progress bars.
    pub quiet: bool,
    /// The worker command.
    pub command: &'a [String],
    /// More variables for the worker command.
    pub env: Vec<(String, String)>,
    /// How long this host's nodes may take to exit once the job is over.
    pub end_timeout: Duration,
    /// Lost workers restarted with their ranks, at most (the scheduler decides where).
    pub restart_workers: u32,
    /// Servers started in place of lost ones, at most.
    pub restart_servers: u32,
}

/// How one host's launch ended.
#[derive(Debug)]
pub enum HostOutcome {
    /// The rendezvous host: the job's outcome, for its report.
    Job(Box<RunOutcome>),
    /// Another host: the scheduler ended the job for this reason.
    Left(String),
}

/// The job's size and the rendezvous, from the flags (and Slurm's environment).
struct Rendezvous {
    addr: SocketAddr,
    min: u32,
    max: u32,
}

fn rendezvous(h: &HostArgs) -> Result<Rendezvous> {
    let (host, nnodes) = match h.rdzv.as_deref() {
        Some("slurm") => {
            let (host, n) = addr::slurm_rendezvous(|k| std::env::var(k).ok())?;
            (host, h.nnodes.unwrap_or((n, n)))
        }
        Some(r) => (
            r.to_string(),
            h.nnodes.ok_or_else(|| LaunchError::Flags("--rdzv needs --nnodes MIN[:MAX] (how many hosts)".into()))?,
        ),
        None => {
            return Err(LaunchError::Flags(
                "--nnodes needs --rdzv HOST:PORT (the address of the host that runs the scheduler) or --rdzv slurm"
                    .into(),
            ));
        }
    };
    let addr = addr::resolve(&host, addr::DEFAULT_RDZV_PORT, "--rdzv")?;
    Ok(Rendezvous { addr, min: nnodes.0, max: nnodes.1 })
}

/// This host's name: `--node-name`, else its hostname.
fn host_name(h: &HostArgs, ip: IpAddr) -> String {
    if let Some(n) = &h.node_name {
        return n.clone();
    }
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let name = if ok {
        String::from_utf8_lossy(buf.split(|b| *b == 0).next().unwrap_or(&[])).into_owned()
    } else {
        String::new()
    };
    if name.is_empty() { ip.to_string() } else { name }
}

/// Runs this host's part of the job until the scheduler ends it.
pub async fn run_host(spec: &HostSpec<'_>) -> Result<HostOutcome> {
    let logs = crate::runner::LogDir::new(spec.report);
    let result = run_host_in(spec, logs.path()).await;
    logs.close(result)
}

/// What the flags say about this host, checked before anything starts.
struct Host {
    rdzv: Rendezvous,
    /// The address this host's nodes advertise.
    ip: IpAddr,
    /// This host runs the scheduler.
    leads: bool,
    name: String,
    /// The job's flags, sized by the first MIN hosts' offers.
    job: JobArgs,
}

impl Host {
    fn new(spec: &HostSpec<'_>) -> Result<Self> {
        let h = spec.hosts;
        if spec.net.secret.is_empty() {
            // Across hosts the rendezvous listens on the network: with the empty secret,
            // anyone who reaches it could join the job, or speak as any of its nodes.
            return Err(LaunchError::Flags(
                "a job across hosts needs a cluster secret: set ELASTICPS_SECRET (or --secret) to the same value on \
                 every host, e.g. `export ELASTICPS_SECRET=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n')`"
                    .into(),
            ));
        }
        let rdzv = rendezvous(h)?;
        let ip = addr::advertise_ip(rdzv.addr, h.advertise.as_deref(), h.interface.as_deref())?;
        // On one machine, hosts on loopback addresses (127.0.0.1, 127.0.0.2) lead only if
        // they advertise the rendezvous address itself.
        let leads = rdzv.addr.ip() == ip || (!rdzv.addr.ip().is_loopback() && addr::is_local(rdzv.addr.ip()));
        let name = host_name(h, ip);
        // The scheduler learns the job's size from the hosts' offers once MIN joined; its
        // flags carry a size that passes their checks until then.
        let mut job = spec.job.clone();
        job.servers = (rdzv.min * h.servers_per_node)
            .min(job.max_servers.unwrap_or(u32::MAX))
            .max(job.min_servers.unwrap_or(1))
            .max(1);
        job.workers = (rdzv.min * h.workers_per_node).max(1);
        job.job_config()?;
        spec.net.tls()?;
        crate::process::check_program(spec.command)?;
        if spec.restart_servers > 0 && job.replicas < 2 {
            return Err(LaunchError::Flags(
                "--restart-servers needs --replicas 2 or more (without a backup, a lost server's blocks are gone)"
                    .into(),
            ));
        }
        Ok(Self { rdzv, ip, leads, name, job })
    }

    /// The flags of the scheduler the rendezvous host runs.
    fn scheduler_args(&self, spec: &HostSpec<'_>, log_dir: &Path) -> Vec<String> {
        let h = spec.hosts;
        let (rdzv, job) = (&self.rdzv, &self.job);
        let mut args = vec!["scheduler".to_string(), "--listen".into(), rdzv.addr.to_string(), "--launcher".into()];
        args.extend(["none".into(), "--nnodes".into(), format!("{}:{}", rdzv.min, rdzv.max)]);
        args.extend(["--restart-workers".into(), spec.restart_workers.to_string()]);
        args.extend(["--restart-servers".into(), spec.restart_servers.to_string()]);
        args.extend(["--join-timeout-s".into(), h.join_timeout_s.to_string(), "--log-dir".into()]);
        args.push(log_dir.display().to_string());
        args.extend(job.to_flags());
        if spec.restart_workers > 0 && job.rejoin_wait_s == 0.0 {
            args.extend(["--rejoin-wait-s".into(), (timing::RESTART_REJOIN_WAIT_US / 1_000_000).to_string()]);
        }
        args.extend(spec.net.to_flags());
        args
    }

    /// The agent's settings: its offer, from the flags.
    fn agent(&self, spec: &HostSpec<'_>) -> AgentConfig {
        let h = spec.hosts;
        let offer = HostOffer {
            name: self.name.clone(),
            addr: self.ip.to_string(),
            servers: h.servers_per_node,
            workers: h.workers_per_node,
            server_slots: h.server_slots.unwrap_or(h.servers_per_node + 1),
            worker_slots: h.worker_slots.unwrap_or(h.workers_per_node + 1),
        };
        AgentConfig {
            name: self.name.clone(),
            rdzv: self.rdzv.addr.to_string(),
            offer,
            leads: self.leads,
            join_timeout_us: h.join_timeout_s.saturating_mul(1_000_000),
            end_timeout_us: spec.end_timeout.as_micros() as u64,
            host_groups: h.host_groups(),
        }
    }
}

/// [`run_host`], this host's nodes' logs in `log_dir`.
async fn run_host_in(spec: &HostSpec<'_>, log_dir: &Path) -> Result<HostOutcome> {
    let host = Host::new(spec)?;
    let mut signals = Signals::new()?;
    let mut cluster = Cluster::new(log_dir)?;
    let secret = spec.net.role_env();
    let scheduler = if host.leads {
        let args = host.scheduler_args(spec, log_dir);
        let scrape = ScrapeList::new(false, 0);
        if let Err(e) = crate::runner::start_scheduler(&mut cluster, &args, &secret, &mut signals, scrape).await {
            cluster.stop(REAP_TIMEOUT).await;
            return Err(e);
        }
        println!("host {} ({}) runs the scheduler at {}", host.name, host.ip, host.rdzv.addr);
        Some(0)
    } else {
        None
    };
    let bars = Bars::new(spec.quiet);
    let clock = Micros::new();
    let config = host.agent(spec);
    let group_dir = if config.host_groups && config.offer.workers > 1 { Some(GroupDir::new()?) } else { None };
    let mut agent = Agent::new(config, 0);
    let mut world = Driver {
        spec,
        host: &host,
        cluster,
        scheduler,
        scheduler_status: None,
        link: None,
        dialling: None,
        signals: &mut signals,
        bars: &bars,
        rec: Recorder::new(&bars),
        clock,
        group_dir: group_dir.as_ref().map(|d| d.0.clone()),
    };
    let result = driver::drive(&mut agent, &mut world, &mut Timer::new(clock), VecDeque::new()).await;
    bars.clear();
    world.cluster.stop(REAP_TIMEOUT).await;
    result
}

/// The scheduler's connection ([`elasticps_runtime::session::open`]).
type Link = elasticps_runtime::session::Conn;

/// What woke the driver (its timer aside: [`driver::drive`] waits for that).
enum Woken {
    Frame(u64, Message),
    Closed,
    Dialled(elasticps_runtime::Result<Link>),
    Node(Option<NodeEvent>),
    Signal(&'static str),
}

/// The world of this host's [`Agent`], run by [`driver::drive`]: it moves frames and
/// processes, and carries out what the agent says.
struct Driver<'a> {
    spec: &'a HostSpec<'a>,
    host: &'a Host,
    cluster: Cluster,
    /// The scheduler process (the rendezvous host), and how it exited.
    scheduler: Option<usize>,
    scheduler_status: Option<std::process::ExitStatus>,
    link: Option<Link>,
    dialling: Option<std::pin::Pin<Box<dyn std::future::Future<Output = elasticps_runtime::Result<Link>> + Send>>>,
    signals: &'a mut Signals,
    bars: &'a Bars,
    rec: Recorder<'a>,
    /// The agent's clock.
    clock: Micros,
    /// The directory of this host's group of workers, if they push once per host.
    group_dir: Option<PathBuf>,
}

/// A host group's private directory (`ELASTICPS_HOST_GROUP`): made for the launch
/// (mode 0700), removed with it.
struct GroupDir(PathBuf);

impl GroupDir {
    fn new() -> Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        let dir = std::env::temp_dir().join(format!("elasticps-host-group-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(|e| LaunchError::io(format!("cannot make the host group's directory {}", dir.display()), e))?;
        Ok(GroupDir(dir))
    }
}

impl Drop for GroupDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl World<Agent> for Driver<'_> {
    type Woken = Woken;
    type End = Result<HostOutcome>;

    /// Waits for the next frame, dial, node event or signal.
    async fn wait(&mut self) -> Woken {
        tokio::select! {
            frame = async { self.link.as_mut().expect("guarded").1.recv().await }, if self.link.is_some() => {
                frame.map_or(Woken::Closed, |(id, msg)| Woken::Frame(id, msg))
            }
            dialled = async { self.dialling.as_mut().expect("guarded").await }, if self.dialling.is_some() => {
                Woken::Dialled(dialled)
            }
            ev = self.cluster.next() => Woken::Node(ev),
            how = self.signals.recv() => Woken::Signal(how),
        }
    }

    /// Hands the agent what happened (`None`: its timeout).
    async fn feed(
        &mut self,
        agent: &mut Agent,
        now: u64,
        woken: Option<Woken>,
        out: &mut Vec<Effect>,
    ) -> ControlFlow<Result<HostOutcome>> {
        let input = match woken {
            Some(Woken::Frame(request_id, msg)) => {
                agent.handle_into(now, Input::Frame { request_id, msg: &msg }, out);
                return ControlFlow::Continue(());
            }
            Some(Woken::Closed) => {
                self.link = None;
                Input::Lost { why: "the connection closed".into() }
            }
            Some(Woken::Dialled(dialled)) => {
                self.dialling = None;
                match dialled {
                    Ok(link) => {
                        self.link = Some(link);
                        Input::Dialled
                    }
                    Err(e) => Input::DialFailed { why: e.to_string() },
                }
            }
            Some(Woken::Node(Some(ev))) => match self.node_event(ev) {
                Some(input) => input,
                None => return ControlFlow::Continue(()),
            },
            Some(Woken::Node(None)) => {
                return ControlFlow::Break(Err(LaunchError::NodeFailed("the launch lost track of its nodes".into())));
            }
            Some(Woken::Signal(how)) => return ControlFlow::Break(Err(LaunchError::Stopped(how))),
            None => Input::Timeout,
        };
        agent.handle_into(now, input, out);
        ControlFlow::Continue(())
    }

    /// Carries out one effect; the inputs it makes go back to the agent, their effects
    /// onto `queue`. The launch's result, once the agent is done.
    async fn carry_out(
        &mut self,
        agent: &mut Agent,
        _now: u64,
        effect: Effect,
        queue: &mut VecDeque<Effect>,
    ) -> ControlFlow<Result<HostOutcome>> {
        match effect {
            Effect::Dial => {
                self.link = None;
                let (addr, codec) = (self.host.rdzv.addr.to_string(), self.spec.net.codec());
                self.dialling = Some(Box::pin(async move { elasticps_runtime::session::open(&addr, codec).await }));
            }
            Effect::Send { request_id, msg } => {
                if let Some((out, _)) = &self.link {
                    let _ = out.send((request_id, msg));
                }
            }
            // The writer ends once the last frames (a server's counters, the nodes' exits)
            // are written: the connection closes, the scheduler stops waiting for it.
            Effect::Close => {
                if let Some(link) = self.link.take() {
                    elasticps_runtime::session::close(link).await;
                }
            }
            Effect::Spawn(spawn) => {
                let input = match self.spawn(&spawn) {
                    Ok(node) => Input::Spawned { slot: spawn.slot, node },
                    Err(e) => Input::SpawnFailed { slot: spawn.slot, why: e.to_string() },
                };
                driver::feed_back(agent, self.now_us(), input, queue);
            }
            Effect::Show(event) => {
                self.rec.event(self.now_us() as f64 / 1e6, event);
            }
            Effect::Say { line, error } => self.bars.println(error, &line),
            Effect::Exit(outcome) => return ControlFlow::Break(self.outcome(outcome)),
        }
        ControlFlow::Continue(())
    }
}

impl Driver<'_> {
    fn now_us(&self) -> u64 {
        self.clock.now()
    }

    /// What a node's event is to the agent, if anything.
    fn node_event(&mut self, ev: NodeEvent) -> Option<Input<'static>> {
        match ev {
            NodeEvent::Line { node, event } if Some(node) == self.scheduler => {
                // The rendezvous host records the job's events as they come back from
                // the scheduler (the agents relay theirs there).
                self.rec.event(self.now_us() as f64 / 1e6, event);
                None
            }
            NodeEvent::Line { node, event } => Some(Input::Line { node, event }),
            NodeEvent::Output { node, line, stderr } => {
                self.bars.println(stderr, &format!("[{} {}] {line}", self.host.name, self.cluster.name(node)));
                None
            }
            NodeEvent::Exited { node, status } if Some(node) == self.scheduler => {
                self.scheduler_status = Some(status);
                Some(Input::SchedulerExited { ok: status.success() })
            }
            NodeEvent::Exited { node, status } => {
                Some(Input::Exited { node, ok: status.success(), status: status.to_string() })
            }
        }
    }

    /// Starts the node of `spawn`: a server, or a copy of the worker command.
    fn spawn(&mut self, spawn: &Spawn) -> Result<usize> {
        let rdzv = self.host.rdzv.addr.to_string();
        match spawn.node {
            NodeKind::Server => {
                let mut args = vec!["server".to_string(), "--scheduler".into(), rdzv];
                args.extend(["--listen".into(), SocketAddr::new(self.host.ip, 0).to_string()]);
                args.extend(self.spec.net.to_flags());
                self.cluster.spawn(&spawn.label, &args, &self.spec.net.role_env())
            }
            NodeKind::Worker { rank, workers, local, group } => {
                let sized = JobArgs { workers, ..self.host.job.clone() };
                let mut env = worker_env(&sized, self.spec.net, &rdzv, local);
                if let Some(r) = rank {
                    env.push(("ELASTICPS_RANK".into(), r.to_string()));
                }
                if let (Some(seat), Some(dir)) = (group, &self.group_dir) {
                    use elasticps_runtime::client::group_vars as v;
                    env.push((v::DIR.into(), dir.display().to_string()));
                    env.push((v::SIZE.into(), seat.size.to_string()));
                    env.push((v::RANK.into(), seat.rank.to_string()));
                }
                env.extend(self.spec.env.iter().cloned());
                self.cluster.spawn_command(&spawn.label, self.spec.command, &env)
            }
        }
    }

    /// The launch's result from the agent's outcome.
    fn outcome(&mut self, outcome: Outcome) -> Result<HostOutcome> {
        let why = match outcome {
            Outcome::JobOver => {
                let mut out = std::mem::take(&mut self.rec.out);
                out.wall = Duration::from_micros(self.now_us());
                return Ok(HostOutcome::Job(Box::new(out)));
            }
            Outcome::Left(reason) => return Ok(HostOutcome::Left(reason)),
            Outcome::Failed { failure, why } => (failure, why),
        };
        Err(match why {
            (Failure::Unreachable | Failure::JoinTimeout | Failure::EndTimeout, why) => LaunchError::Timeout(why),
            (Failure::Refused, why) => LaunchError::Flags(why),
            (Failure::SchedulerLost, why) => LaunchError::NodeFailed(why),
            (Failure::SchedulerFailed, why) => match (self.scheduler, self.scheduler_status) {
                (Some(node), Some(status)) => {
                    self.cluster.failure(node, status).then("the job failed; every node of this host was stopped")
                }
                _ => LaunchError::NodeFailed(why),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nnodes_is_min_or_min_max() {
        assert_eq!(parse_nnodes("4"), Ok((4, 4)));
        assert_eq!(parse_nnodes("2:4"), Ok((2, 4)));
        assert!(parse_nnodes("0").is_err());
        assert!(parse_nnodes("3:2").unwrap_err().contains("MAX at least MIN"));
        assert!(parse_nnodes("x").unwrap_err().contains("not a number"));
    }

    #[test]
    fn rdzv_and_nnodes_need_each_other() {
        let h = HostArgs { rdzv: Some("127.0.0.1:29400".into()), ..Default::default() };
        assert!(rendezvous(&h).err().unwrap().to_string().contains("--nnodes"));
        let h = HostArgs { nnodes: Some((2, 2)), ..Default::default() };
        assert!(rendezvous(&h).err().unwrap().to_string().contains("--rdzv"));
        let h = HostArgs { nnodes: Some((2, 2)), rdzv: Some("no-such-host.invalid:1".into()), ..Default::default() };
        assert!(rendezvous(&h).err().unwrap().to_string().contains("cannot resolve"));
    }
}
