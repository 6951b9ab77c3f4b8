//! `elasticps launch --nnodes MIN[:MAX] --rdzv HOST:PORT -- CMD`, run on every host of a
//! job (torchrun's shape). Every launch is its host's agent: it joins the job with its
//! slots ([`Control::JoinHost`]), starts the servers and workers the scheduler tells it to
//! ([`Control::StartNode`]), reports their exits, relays their events, and sends a
//! heartbeat every 500 ms. The launch whose host owns the `--rdzv` address also runs the
//! scheduler there, and builds the job's report from the scheduler's event stream (where
//! the agents' relayed events arrive).
//!
//! What to start where, and what a lost host means, is decided by the scheduler
//! (`elasticps_node::scheduler::hosts`); this module only moves processes and messages.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::{Duration, Instant};

use clap::Args;
use elasticps_runtime::events::Event;
use elasticps_runtime::peer::Peer;
use elasticps_wire::{Control, HostOffer, Message, NodeRole};

use crate::addr;
use crate::args::{JobArgs, NetArgs};
use crate::process::{Cluster, NodeEvent};
use crate::runner::{
    Bars, REAP_TIMEOUT, RESTART_REJOIN_WAIT_S, Recorder, RunOutcome, ScrapeList, Signals, sleep_until, worker_env,
};
use crate::{LaunchError, Result};
use elasticps_node::timing;

/// How often an agent tells the scheduler it is alive (the scheduler loses a host after
/// 2 s of silence): every node's heartbeat period.
const AGENT_HEARTBEAT: Duration = Duration::from_micros(timing::HEARTBEAT_EVERY_US);
/// How often a launch that waits for the scheduler says so.
const WAIT_REPORT_EVERY: Duration = Duration::from_secs(5);
/// How long the scheduler may take to answer `JoinHost`.
const JOIN_CALL_TIMEOUT: Duration = Duration::from_secs(30);

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
}

impl HostArgs {
    /// True if this launch is one host of a job that spans hosts.
    pub fn spans_hosts(&self) -> bool {
        self.rdzv.is_some() || self.nnodes.is_some()
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

/// A node this host runs.
struct Local {
    slot: u32,
    rank: Option<u32>,
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

/// [`run_host`], this host's nodes' logs in `log_dir`.
async fn run_host_in(spec: &HostSpec<'_>, log_dir: &Path) -> Result<HostOutcome> {
    let h = spec.hosts;
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
            "--restart-servers needs --replicas 2 or more (without a backup, a lost server's blocks are gone)".into(),
        ));
    }
    let mut signals = Signals::new()?;
    let mut cluster = Cluster::new(log_dir)?;
    let secret = spec.net.role_env();
    let started = Instant::now();
    let join_timeout = Duration::from_secs(h.join_timeout_s);

    let scheduler = if leads {
        let mut args = vec!["scheduler".to_string(), "--listen".into(), rdzv.addr.to_string(), "--launcher".into()];
        args.extend(["none".into(), "--nnodes".into(), format!("{}:{}", rdzv.min, rdzv.max)]);
        args.extend(["--restart-workers".into(), spec.restart_workers.to_string()]);
        args.extend(["--restart-servers".into(), spec.restart_servers.to_string()]);
        args.extend(["--join-timeout-s".into(), h.join_timeout_s.to_string(), "--log-dir".into()]);
        args.push(log_dir.display().to_string());
        args.extend(job.to_flags());
        if spec.restart_workers > 0 && job.rejoin_wait_s == 0.0 {
            args.extend(["--rejoin-wait-s".into(), RESTART_REJOIN_WAIT_S.to_string()]);
        }
        args.extend(spec.net.to_flags());
        let mut scrape = ScrapeList::new(false, 0);
        if let Err(e) = crate::runner::start_scheduler(&mut cluster, &args, &secret, &mut signals, &mut scrape).await {
            cluster.stop(REAP_TIMEOUT).await;
            return Err(e);
        }
        println!("host {name} ({ip}) runs the scheduler at {}", rdzv.addr);
        Some(0)
    } else {
        None
    };

    let rdzv_s = rdzv.addr.to_string();
    let peer = match dial(&rdzv_s, spec, &name, join_timeout, &mut signals).await {
        Ok(p) => p,
        Err(e) => {
            cluster.stop(REAP_TIMEOUT).await;
            return Err(e);
        }
    };
    let (peer, mut notes) = peer;
    let offer = HostOffer {
        name: name.clone(),
        addr: ip.to_string(),
        servers: h.servers_per_node,
        workers: h.workers_per_node,
        server_slots: h.server_slots.unwrap_or(h.servers_per_node + 1),
        worker_slots: h.worker_slots.unwrap_or(h.workers_per_node + 1),
    };
    let joined = peer
        .call(Control::JoinHost(offer).into(), JOIN_CALL_TIMEOUT, || {
            format!("host {name} waits for the scheduler at {rdzv_s} to answer its JoinHost")
        })
        .await;
    let host_id = match joined {
        Ok(Message::Control(Control::HostWelcome { host })) => host,
        Ok(other) => {
            cluster.stop(REAP_TIMEOUT).await;
            return Err(LaunchError::Flags(format!(
                "the scheduler at {rdzv_s} answered JoinHost with {:?}",
                other.kind()
            )));
        }
        Err(cause) => {
            cluster.stop(REAP_TIMEOUT).await;
            return Err(LaunchError::Scheduler {
                what: format!("host {name} ({ip}) could not join the job at {rdzv_s}"),
                cause,
            });
        }
    };
    println!("host {name} ({ip}) joined the job at {rdzv_s} as host {host_id}");

    let bars = Bars::new(spec.quiet);
    let mut rec = Recorder::new(&bars);
    let mut locals: BTreeMap<usize, Local> = BTreeMap::new();
    let mut workers_started = 0u32;
    let mut peer = Some(peer);
    let mut notes_open = true;
    let mut over: Option<String> = None;
    let mut end_by: Option<tokio::time::Instant> = None;
    let mut heartbeat = tokio::time::interval(AGENT_HEARTBEAT);
    let fail = |cluster: &mut Cluster, bars: &Bars, e: LaunchError| {
        bars.clear();
        cluster.kill_all();
        Err(e)
    };
    loop {
        tokio::select! {
            note = notes.recv(), if notes_open => match note {
                Some(Message::Control(Control::StartNode { slot, role, workers })) => {
                    let spawned = match role {
                        NodeRole::Server => {
                            let mut args = vec!["server".to_string(), "--scheduler".into(), rdzv_s.clone()];
                            args.extend(["--listen".into(), SocketAddr::new(ip, 0).to_string()]);
                            args.extend(spec.net.to_flags());
                            cluster.spawn(&format!("server slot {slot}"), &args, &secret)
                        }
                        NodeRole::Worker { rank } => {
                            let sized = JobArgs { workers, ..job.clone() };
                            let mut env = worker_env(&sized, spec.net, &rdzv_s, workers_started);
                            workers_started += 1;
                            if let Some(r) = rank {
                                env.push(("ELASTICPS_RANK".into(), r.to_string()));
                            }
                            env.extend(spec.env.iter().cloned());
                            let label = match rank {
                                Some(r) => format!("worker slot {slot} (rank {r})"),
                                None => format!("worker slot {slot}"),
                            };
                            cluster.spawn_command(&label, spec.command, &env)
                        }
                    };
                    match spawned {
                        Ok(node) => {
                            let rank = match role { NodeRole::Worker { rank } => rank, NodeRole::Server => None };
                            locals.insert(node, Local { slot, rank });
                        }
                        Err(e) => {
                            bars.println(true, &format!("host {name}: cannot start slot {slot}: {e}"));
                            if let Some(p) = &peer {
                                let _ = p.notify(Control::NodeExited { slot, ok: false, status: e.to_string(), rank: None }.into());
                            }
                        }
                    }
                }
                Some(Message::Control(Control::Shutdown { reason })) => {
                    tracing::info!(%reason, "the scheduler ended the job");
                    over = Some(reason);
                    end_by = Some(tokio::time::Instant::now() + spec.end_timeout);
                    if locals.is_empty() {
                        peer = None;
                        if scheduler.is_none() {
                            break;
                        }
                    }
                }
                Some(other) => tracing::debug!(kind = ?other.kind(), "agent ignores a notification"),
                None => {
                    notes_open = false;
                    if over.is_none() && scheduler.is_none() {
                        return fail(&mut cluster, &bars, LaunchError::NodeFailed(format!(
                            "host {name} lost the scheduler at {rdzv_s}: its connection closed before the job ended \
                             (the rendezvous host or its launch is gone); this host's nodes were stopped"
                        )));
                    }
                }
            },
            ev = cluster.next() => {
                let t_s = started.elapsed().as_secs_f64();
                match ev {
                    None => break,
                    Some(NodeEvent::Line { node, event }) if Some(node) == scheduler => {
                        rec.event(t_s, event);
                    }
                    Some(NodeEvent::Line { node, event }) => {
                        if let (Some(l), Some(r)) = (locals.get_mut(&node), rank_of(&event)) {
                            l.rank = Some(r);
                        }
                        if matches!(event, Event::Metrics { .. } | Event::Listening { .. }) {
                            continue;
                        }
                        if let Ok(line) = serde_json::to_string(&event) {
                            relay(&peer, line);
                        }
                        if scheduler.is_none() {
                            // The rendezvous host records the job's events as they come
                            // back from the scheduler; here, this host's bars.
                            rec.event(t_s, event);
                        }
                    }
                    Some(NodeEvent::Output { node, line, stderr }) => {
                        bars.println(stderr, &format!("[{name} {}] {line}", cluster.name(node)));
                    }
                    Some(NodeEvent::Exited { node, status }) if Some(node) == scheduler => {
                        if !status.success() {
                            let e = cluster.failure(node, status);
                            return fail(&mut cluster, &bars, e.then("the job failed; every node of this host was stopped"));
                        }
                        bars.clear();
                        cluster.stop(REAP_TIMEOUT).await;
                        let mut out = rec.out;
                        out.wall = started.elapsed();
                        return Ok(HostOutcome::Job(Box::new(out)));
                    }
                    Some(NodeEvent::Exited { node, status }) => {
                        let Some(l) = locals.remove(&node) else { continue };
                        if !status.success() && over.is_none() {
                            bars.println(true, &format!("[{name} {}] exited with {status}", cluster.name(node)));
                        }
                        if let Some(p) = &peer {
                            let msg = Control::NodeExited { slot: l.slot, ok: status.success(), status: status.to_string(), rank: l.rank };
                            let _ = p.notify(msg.into());
                        }
                        if over.is_some() && locals.is_empty() {
                            // Closes the agent's connection: the scheduler stops waiting for it.
                            peer = None;
                            if scheduler.is_none() {
                                break;
                            }
                        }
                    }
                }
            },
            _ = heartbeat.tick() => {
                if let Some(p) = &peer {
                    let _ = p.notify(Control::Heartbeat.into());
                }
            }
            how = signals.recv() => {
                bars.clear();
                cluster.stop(REAP_TIMEOUT).await;
                return Err(LaunchError::Stopped(how));
            }
            _ = sleep_until(end_by) => {
                let left = cluster.running().join(", ");
                let e = LaunchError::Timeout(format!(
                    "the job is over ({}), but these nodes of host {name} did not exit within {:.0} s: {left}",
                    over.as_deref().unwrap_or("?"),
                    spec.end_timeout.as_secs_f64()
                ));
                return fail(&mut cluster, &bars, e);
            }
        }
    }
    bars.clear();
    cluster.stop(REAP_TIMEOUT).await;
    Ok(HostOutcome::Left(over.unwrap_or_else(|| "the scheduler closed the connection".into())))
}

/// Relays a node's event line to the scheduler.
fn relay(peer: &Option<Peer>, line: String) {
    if let Some(p) = peer {
        let _ = p.notify(Control::HostEvent { line }.into());
    }
}

/// The rank an event names, if any.
fn rank_of(event: &Event) -> Option<u32> {
    match event {
        Event::Progress { rank, .. } | Event::Eval { rank, .. } | Event::Log { rank, .. } => Some(*rank),
        Event::WorkerDone(w) => Some(w.rank),
        _ => None,
    }
}

/// Dials the rendezvous until it answers, with backoff (100 ms doubling to 2 s), saying
/// every 5 s what it waits for, for at most `within`.
async fn dial(
    rdzv: &str,
    spec: &HostSpec<'_>,
    name: &str,
    within: Duration,
    signals: &mut Signals,
) -> Result<(Peer, elasticps_runtime::peer::Notifications)> {
    let start = Instant::now();
    let mut backoff = timing::FIRST_BACKOFF_US;
    let mut said = Instant::now();
    loop {
        let err = match Peer::connect(rdzv, spec.net.codec(), "scheduler").await {
            Ok(p) => return Ok(p),
            Err(e) => e,
        };
        if start.elapsed() >= within {
            return Err(LaunchError::Timeout(format!(
                "host {name} could not reach the scheduler at {rdzv} within {} s ({err}): is `elasticps launch` \
                 running on the rendezvous host, with the same --rdzv, and is the port open?",
                within.as_secs()
            )));
        }
        if said.elapsed() >= WAIT_REPORT_EVERY {
            said = Instant::now();
            println!("host {name} waits for the scheduler at {rdzv} ({err})");
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_micros(backoff)) => {}
            how = signals.recv() => return Err(LaunchError::Stopped(how)),
        }
        backoff = timing::next_backoff_us(backoff);
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
