//! Hosts and their slots, for a job that spans hosts (`elasticps launch --nnodes MIN:MAX
//! --rdzv HOST:PORT` on every host): which hosts are in the job, which server and worker
//! runs where, where a new one starts, and when a host is lost. No I/O: the scheduler feeds
//! it what its host agents sent and the time, and carries out the [`Start`]s it returns.
//!
//! The rules, in one place:
//!
//! - **Rendezvous.** The job starts once `min_hosts` hosts joined. Its size is what they
//!   offer to start (`--servers-per-node`, `--workers-per-node`, which may differ from host
//!   to host: a host of servers only, a spare with none): it needs at least one server and
//!   one worker. A host may join later, up to `max_hosts`, and brings slots for scale-out
//!   and restarts (it starts nothing of its own).
//! - **Where a node runs.** A server registers with the address it advertises and a worker
//!   dials from its host's address: a node belongs to the host of that address.
//! - **Placement** ([`pick_host`]): a host with a free slot of the kind, never the avoided
//!   host (the straggler's, for a scale-out) while another has room; then the most free
//!   slots; then the earliest joined.
//! - **A lost host.** Its agent's connection closed, or no message from it for
//!   [`HOST_HEARTBEAT_TIMEOUT_US`]. Its nodes are lost with it; its workers restart with
//!   their ranks on hosts with room (`--restart-workers`), its servers are replaced
//!   (`--restart-servers`), each within the job's budget.

use std::collections::BTreeMap;
use std::net::IpAddr;

use elasticps_wire::{Control, ErrorCode, ErrorReply, HostOffer, Message, NodeRole};

use super::{Action, Scheduler};
use crate::ConnId;

/// A host is lost after this long without a message from its agent, µs (the agent sends a
/// heartbeat every 500 ms).
pub const HOST_HEARTBEAT_TIMEOUT_US: u64 = 2_000_000;

/// A host's id: its place in the join order, from 0.
pub type HostId = u32;
/// A slot's id, unique in the job: one node started on one host.
pub type SlotId = u32;

/// The job's hosts as `--nnodes MIN:MAX` and the restart budgets set them.
#[derive(Clone, Debug, PartialEq)]
pub struct HostsConfig {
    /// Hosts the job waits for before it starts.
    pub min_hosts: u32,
    /// Hosts the job takes at most.
    pub max_hosts: u32,
    /// Workers restarted with their rank, at most, in all (`--restart-workers`).
    pub restart_workers: u32,
    /// Servers started in place of lost ones, at most, in all (`--restart-servers`).
    pub restart_servers: u32,
}

/// Start one node: send [`elasticps_wire::Control::StartNode`] to the host's agent.
#[derive(Clone, Debug, PartialEq)]
pub struct Start {
    /// The agent's connection.
    pub conn: ConnId,
    /// The host.
    pub host: HostId,
    /// The slot.
    pub slot: SlotId,
    /// What to start.
    pub role: NodeRole,
}

/// A host that left the job, and what ran on it.
#[derive(Clone, Debug, PartialEq)]
pub struct LostHost {
    /// The host.
    pub host: HostId,
    /// Its agent's connection (to close).
    pub conn: ConnId,
    /// Its name and address, for messages: `eps3 (10.90.0.13)`.
    pub label: String,
    /// Why: its agent's connection closed, or its heartbeats stopped.
    pub why: String,
    /// Servers (ids) that ran on it.
    pub servers: Vec<u32>,
    /// Workers (ranks) that ran on it.
    pub ranks: Vec<u32>,
    /// Servers started on it that had not registered yet.
    pub unnamed_servers: u32,
    /// Workers started on it that had not registered yet.
    pub unnamed_workers: u32,
}

/// What [`Hosts::replace`] starts in place of a lost host's nodes, and what it cannot.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Replacements {
    /// The nodes to start.
    pub starts: Vec<Start>,
    /// The nodes not started again, in words.
    pub missed: Vec<String>,
    /// True if a node that had not registered yet is among them: the job lacks it.
    pub unnamed_missed: bool,
}

#[derive(Debug)]
struct Host {
    conn: ConnId,
    offer: HostOffer,
    last_seen_us: u64,
    lost: bool,
}

impl Host {
    fn label(&self) -> String {
        format!("{} ({})", self.offer.name, self.offer.addr)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Server,
    Worker,
}

#[derive(Debug)]
struct Slot {
    host: HostId,
    kind: Kind,
    running: bool,
    /// The server id or the rank, once the node registered (or the rank it restarts as).
    node: Option<u32>,
}

/// How much room a host has, for [`pick_host`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Room {
    /// The host.
    pub host: HostId,
    /// Slots of the kind still free.
    pub free: u32,
}

/// Where to start a node: among hosts with a free slot, not `avoid` while another has
/// room, then the most free slots, then the lowest id. `None` if no host has room.
pub fn pick_host(rooms: &[Room], avoid: Option<HostId>) -> Option<HostId> {
    rooms
        .iter()
        .filter(|r| r.free > 0)
        .min_by_key(|r| (Some(r.host) == avoid, std::cmp::Reverse(r.free), r.host))
        .map(|r| r.host)
}

/// The job's first nodes, once its hosts joined: where they start, and the job's size.
#[derive(Clone, Debug, PartialEq)]
pub struct Rendezvous {
    /// The nodes to start.
    pub starts: Vec<Start>,
    /// Servers in the job.
    pub servers: u32,
    /// Workers in the job.
    pub workers: u32,
}

/// The hosts of a job and their slots.
#[derive(Debug)]
pub struct Hosts {
    config: HostsConfig,
    hosts: Vec<Host>,
    slots: BTreeMap<SlotId, Slot>,
    started: bool,
    worker_restarts_left: u32,
    server_restarts_left: u32,
}

impl Hosts {
    /// The hosts of a job: its size is known once `config.min_hosts` joined.
    pub fn new(config: HostsConfig) -> Self {
        Self {
            worker_restarts_left: config.restart_workers,
            server_restarts_left: config.restart_servers,
            config,
            hosts: Vec::new(),
            slots: BTreeMap::new(),
            started: false,
        }
    }

    /// True if `conn` is a host agent's connection (lost or not).
    pub fn is_agent(&self, conn: ConnId) -> bool {
        self.hosts.iter().any(|h| h.conn == conn)
    }

    /// The connections of the agents still in the job.
    pub fn agents(&self) -> Vec<ConnId> {
        self.live().map(|(_, h)| h.conn).collect()
    }

    fn live(&self) -> impl Iterator<Item = (HostId, &Host)> {
        self.hosts.iter().enumerate().filter(|(_, h)| !h.lost).map(|(i, h)| (i as HostId, h))
    }

    /// A host's agent asks to join: its id, or why it may not.
    pub fn join(&mut self, conn: ConnId, offer: HostOffer, now_us: u64) -> Result<HostId, String> {
        let ip: IpAddr = offer
            .addr
            .parse()
            .map_err(|_| format!("host {} offered {:?}, which is not an IP address", offer.name, offer.addr))?;
        if ip.is_unspecified() {
            return Err(format!(
                "host {} offered the unspecified address {ip}: pass --advertise with an address the other hosts can \
                 reach, or --interface NAME",
                offer.name
            ));
        }
        let live = self.live().count() as u32;
        if live >= self.config.max_hosts {
            return Err(format!("the job already has its {} hosts (--nnodes ..:{})", live, self.config.max_hosts));
        }
        if let Some((_, h)) = self.live().find(|(_, h)| h.offer.addr == offer.addr) {
            return Err(format!("host {} ({}) is already in the job as {}", offer.name, offer.addr, h.label()));
        }
        if let Some((_, h)) =
            self.live().find(|(_, h)| h.offer.addr.parse::<IpAddr>().is_ok_and(|a| a.is_loopback()) != ip.is_loopback())
        {
            return Err(format!(
                "host {} offered {ip} but host {} is in the job: loopback and other addresses cannot mix; pass \
                 --advertise with an address every host can reach, or --interface NAME",
                offer.name,
                h.label()
            ));
        }
        let id = self.hosts.len() as HostId;
        tracing::info!(host = id, name = %offer.name, addr = %offer.addr, servers = offer.servers, workers = offer.workers, "host joined");
        self.hosts.push(Host { conn, offer, last_seen_us: now_us, lost: false });
        Ok(id)
    }

    /// A message from `conn`'s agent arrived at `now_us`.
    pub fn heard(&mut self, conn: ConnId, now_us: u64) {
        if let Some(h) = self.hosts.iter_mut().find(|h| h.conn == conn && !h.lost) {
            h.last_seen_us = h.last_seen_us.max(now_us);
        }
    }

    /// The job's first nodes and its size, once enough hosts joined that offer a server
    /// and a worker (and only once).
    pub fn initial(&mut self) -> Option<Rendezvous> {
        let live: Vec<HostId> = self.live().map(|(i, _)| i).collect();
        let (servers, workers) = self.offered();
        if self.started || (live.len() as u32) < self.config.min_hosts || servers == 0 || workers == 0 {
            return None;
        }
        self.started = true;
        let mut starts = Vec::new();
        for host in live {
            let offer = &self.hosts[host as usize].offer;
            let (ns, nw) = (offer.servers, offer.workers);
            for _ in 0..ns {
                starts.push(self.open(host, Kind::Server, None));
            }
            for _ in 0..nw {
                starts.push(self.open(host, Kind::Worker, None));
            }
        }
        tracing::info!(hosts = self.hosts.len(), servers, workers, "the job's hosts joined: its nodes start");
        self.check();
        Some(Rendezvous { starts, servers, workers })
    }

    /// What the live hosts offer to start: (servers, workers).
    fn offered(&self) -> (u32, u32) {
        self.live().fold((0, 0), |(s, w), (_, h)| (s + h.offer.servers, w + h.offer.workers))
    }

    fn open(&mut self, host: HostId, kind: Kind, node: Option<u32>) -> Start {
        let slot = self.slots.keys().next_back().map_or(0, |s| s + 1);
        self.slots.insert(slot, Slot { host, kind, running: true, node });
        let role = match kind {
            Kind::Server => NodeRole::Server,
            Kind::Worker => NodeRole::Worker { rank: node },
        };
        Start { conn: self.hosts[host as usize].conn, host, slot, role }
    }

    fn rooms(&self, kind: Kind) -> Vec<Room> {
        self.live()
            .map(|(id, h)| {
                let cap = match kind {
                    Kind::Server => h.offer.server_slots,
                    Kind::Worker => h.offer.worker_slots,
                };
                let used = self.slots.values().filter(|s| s.host == id && s.kind == kind && s.running).count() as u32;
                Room { host: id, free: cap.saturating_sub(used) }
            })
            .collect()
    }

    /// The host server `id` runs on, if known.
    pub fn host_of_server(&self, id: u32) -> Option<HostId> {
        self.slots.values().find(|s| s.kind == Kind::Server && s.node == Some(id)).map(|s| s.host)
    }

    /// A host's name and address, for messages.
    pub fn label(&self, host: HostId) -> String {
        self.hosts.get(host as usize).map_or_else(|| format!("host {host}"), Host::label)
    }

    /// Starts one more server (a scale-out), not on `avoid`'s host while another has room.
    pub fn start_server(&mut self, avoid: Option<u32>) -> Result<Start, String> {
        let avoid = avoid.and_then(|id| self.host_of_server(id));
        let host = pick_host(&self.rooms(Kind::Server), avoid).ok_or_else(|| self.no_room(Kind::Server))?;
        let start = self.open(host, Kind::Server, None);
        self.check();
        Ok(start)
    }

    fn start_worker(&mut self, rank: Option<u32>) -> Result<Start, String> {
        let host = pick_host(&self.rooms(Kind::Worker), None).ok_or_else(|| self.no_room(Kind::Worker))?;
        let start = self.open(host, Kind::Worker, rank);
        self.check();
        Ok(start)
    }

    fn no_room(&self, kind: Kind) -> String {
        let live: Vec<String> = self.live().map(|(_, h)| h.label()).collect();
        let what = if kind == Kind::Server { "server" } else { "worker" };
        format!("no host has a free {what} slot (hosts: {}; a host that joins brings slots)", live.join(", "))
    }

    /// Server `id` registered, serving on `addr` (`IP:PORT`), from `peer` (the IP its
    /// connection came from): the host of that address runs it. Returns the host.
    pub fn server_registered(&mut self, id: u32, addr: &str, peer: Option<&str>) -> Option<HostId> {
        let ip = addr.rsplit_once(':').map(|(h, _)| h.trim_matches(['[', ']']));
        self.registered(Kind::Server, id, ip).or_else(|| self.registered(Kind::Server, id, peer))
    }

    /// Worker `rank` registered (or rejoined) from `peer`. Returns the host.
    pub fn worker_registered(&mut self, rank: u32, peer: Option<&str>) -> Option<HostId> {
        self.registered(Kind::Worker, rank, peer)
    }

    fn registered(&mut self, kind: Kind, node: u32, ip: Option<&str>) -> Option<HostId> {
        let ip = ip?;
        let host = self.live().find(|(_, h)| h.offer.addr == ip).map(|(i, _)| i)?;
        // The slot started for this rank (a restart), else the oldest one not yet named.
        let fits = |s: &Slot| s.host == host && s.kind == kind && s.running;
        let key = self
            .slots
            .iter()
            .find(|(_, s)| fits(s) && s.node == Some(node))
            .or_else(|| self.slots.iter().find(|(_, s)| fits(s) && s.node.is_none()))
            .map(|(k, _)| *k);
        if let Some(s) = key.and_then(|k| self.slots.get_mut(&k)) {
            s.node = Some(node);
        }
        Some(host)
    }

    /// The agent on `conn` reports that the node of `slot` exited (`ok`: status 0); its
    /// rank, if the agent knows it. Returns the node to start in its place, if any: a
    /// failed worker restarts with its rank, a failed server is replaced, within the
    /// budgets.
    pub fn exited(&mut self, conn: ConnId, slot: SlotId, ok: bool, rank: Option<u32>) -> Option<Start> {
        let host = self.hosts.iter().position(|h| h.conn == conn)? as HostId;
        let s = self.slots.get_mut(&slot).filter(|s| s.host == host && s.running)?;
        s.running = false;
        let (kind, node) = (s.kind, s.node.or(rank));
        if ok {
            return None;
        }
        let start = match kind {
            Kind::Worker => self.restart_worker(Some(node?)),
            Kind::Server => self.replace_server(),
        };
        start.map_err(|e| tracing::warn!(error = %e, "a node exited and cannot be started again")).ok().flatten()
    }

    /// Starts a worker again, with its rank if it had registered, within the budget.
    fn restart_worker(&mut self, rank: Option<u32>) -> Result<Option<Start>, String> {
        if self.worker_restarts_left == 0 {
            return Ok(None);
        }
        let start = self.start_worker(rank)?;
        self.worker_restarts_left -= 1;
        tracing::info!(?rank, host = %self.label(start.host), left = self.worker_restarts_left, "worker restarts");
        Ok(Some(start))
    }

    fn replace_server(&mut self) -> Result<Option<Start>, String> {
        if self.server_restarts_left == 0 {
            return Ok(None);
        }
        let start = self.start_server(None)?;
        self.server_restarts_left -= 1;
        tracing::info!(host = %self.label(start.host), left = self.server_restarts_left, "a server starts in place of a lost one");
        Ok(Some(start))
    }

    /// The agent's connection `conn` closed: its host is lost (if it was one).
    pub fn connection_lost(&mut self, conn: ConnId, why: &str) -> Option<LostHost> {
        let host = self.live().find(|(_, h)| h.conn == conn).map(|(i, _)| i)?;
        Some(self.lose(host, format!("its agent's connection closed ({why})")))
    }

    /// When the live host heard from least recently is lost if it stays silent, µs.
    pub fn next_expiry_us(&self) -> Option<u64> {
        self.live().map(|(_, h)| h.last_seen_us.saturating_add(HOST_HEARTBEAT_TIMEOUT_US).saturating_add(1)).min()
    }

    /// Whether the rendezvous still waits ([`Hosts::waiting_for`] says what for).
    pub fn waiting(&self) -> bool {
        !self.started
    }

    /// Hosts silent for longer than [`HOST_HEARTBEAT_TIMEOUT_US`] at `now_us` are lost.
    pub fn lose_silent(&mut self, now_us: u64) -> Vec<LostHost> {
        let silent: Vec<HostId> = self
            .live()
            .filter(|(_, h)| now_us.saturating_sub(h.last_seen_us) > HOST_HEARTBEAT_TIMEOUT_US)
            .map(|(i, _)| i)
            .collect();
        let secs = HOST_HEARTBEAT_TIMEOUT_US as f64 / 1e6;
        silent.into_iter().map(|h| self.lose(h, format!("no heartbeat from its agent for {secs:.0} s"))).collect()
    }

    fn lose(&mut self, host: HostId, why: String) -> LostHost {
        self.hosts[host as usize].lost = true;
        let (mut servers, mut ranks, mut unnamed_servers, mut unnamed_workers) = (Vec::new(), Vec::new(), 0, 0);
        for s in self.slots.values_mut().filter(|s| s.host == host && s.running) {
            s.running = false;
            match (s.kind, s.node) {
                (Kind::Server, Some(id)) => servers.push(id),
                (Kind::Worker, Some(rank)) => ranks.push(rank),
                (Kind::Server, None) => unnamed_servers += 1,
                (Kind::Worker, None) => unnamed_workers += 1,
            }
        }
        let label = self.label(host);
        tracing::warn!(host = %label, %why, ?servers, ?ranks, unnamed_servers, unnamed_workers, "host lost");
        let conn = self.hosts[host as usize].conn;
        LostHost { host, conn, label, why, servers, ranks, unnamed_servers, unnamed_workers }
    }

    /// What to start in place of a lost host's nodes: its workers with their ranks (and
    /// those that had not registered yet, with none), and servers in place of its servers,
    /// on hosts with room and within the budgets. The nodes that cannot be started again
    /// are named in the returned messages.
    pub fn replace(&mut self, lost: &LostHost) -> Replacements {
        let mut r = Replacements::default();
        let unnamed = (0..lost.unnamed_workers).map(|_| None);
        for rank in lost.ranks.iter().copied().map(Some).chain(unnamed) {
            let name = rank.map_or_else(|| "a worker that had not registered".to_string(), |r| format!("worker {r}"));
            let why = match self.restart_worker(rank) {
                Ok(Some(s)) => {
                    r.starts.push(s);
                    continue;
                }
                Ok(None) => "no restarts left (--restart-workers)".to_string(),
                Err(e) => e,
            };
            r.unnamed_missed |= rank.is_none();
            r.missed.push(format!("{name}: {why}"));
        }
        let unnamed = (0..lost.unnamed_servers).map(|_| None);
        for id in lost.servers.iter().copied().map(Some).chain(unnamed) {
            let name = id.map_or_else(|| "a server that had not registered".to_string(), |i| format!("server {i}"));
            let why = match self.replace_server() {
                Ok(Some(s)) => {
                    r.starts.push(s);
                    continue;
                }
                Ok(None) if id.is_some() => continue,
                Ok(None) => "no restarts left (--restart-servers)".to_string(),
                Err(e) => e,
            };
            r.unnamed_missed |= id.is_none();
            r.missed.push(format!("a server in place of {name}: {why}"));
        }
        r
    }

    /// What the rendezvous waits for, in words, or `None` once the job's nodes started.
    pub fn waiting_for(&self) -> Option<String> {
        if self.started {
            return None;
        }
        let live: Vec<String> = self.live().map(|(_, h)| h.label()).collect();
        let (s, w) = self.offered();
        let names = if live.is_empty() { "none yet".to_string() } else { live.join(", ") };
        let short = if s == 0 || w == 0 { " (a job needs at least one server and one worker)" } else { "" };
        Some(format!(
            "scheduler waits for hosts: {} of at least {} joined ({names}); they offer {s} servers and {w} workers{short}",
            live.len(),
            self.config.min_hosts,
        ))
    }

    /// No host runs more nodes of a kind than it has slots for.
    fn check(&self) {
        for kind in [Kind::Server, Kind::Worker] {
            for (id, h) in self.live() {
                let used = self.slots.values().filter(|s| s.host == id && s.kind == kind && s.running).count() as u32;
                let cap = match kind {
                    Kind::Server => h.offer.server_slots.max(h.offer.servers),
                    Kind::Worker => h.offer.worker_slots.max(h.offer.workers),
                };
                debug_assert!(used <= cap, "host {id} runs {used} {kind:?} nodes in {cap} slots");
            }
        }
    }
}

impl Scheduler {
    /// A message from a host agent, or one that asks to become one.
    pub(super) fn on_agent_message(&mut self, conn: ConnId, request_id: u64, control: Control, out: &mut Vec<Action>) {
        let Some(hosts) = self.hosts.as_mut() else { return };
        hosts.heard(conn, self.now_us);
        match control {
            Control::Heartbeat => {}
            Control::HostEvent { line } => out.push(Action::Relay(line)),
            Control::NodeExited { slot, ok, status, rank } => {
                tracing::info!(slot, ok, %status, ?rank, "a host's node exited");
                if let Some(start) = hosts.exited(conn, slot, ok, rank) {
                    out.push(start_node(start, self.config.workers));
                }
            }
            other => {
                let message = format!("a host agent sent {}, which the scheduler does not take from it", other.name());
                tracing::warn!(conn, %message, "refused");
                out.push(Action::Send {
                    conn,
                    request_id,
                    msg: Message::Error(ErrorReply { code: ErrorCode::BadRequest, message }),
                });
            }
        }
    }

    /// A host agent asks to join the job.
    pub(super) fn join_host(
        &mut self,
        conn: ConnId,
        request_id: u64,
        offer: elasticps_wire::HostOffer,
        out: &mut Vec<Action>,
    ) {
        let refuse = |out: &mut Vec<Action>, message: String| {
            tracing::warn!(conn, %message, "host refused");
            out.push(Action::Send {
                conn,
                request_id,
                msg: Message::Error(ErrorReply { code: ErrorCode::BadRequest, message }),
            });
            out.push(Action::Close(conn));
        };
        let Some(hosts) = self.hosts.as_mut() else {
            return refuse(out, "this scheduler runs a job on its own host: start it with `elasticps launch --nnodes MIN:MAX --rdzv HOST:PORT` for hosts to join".into());
        };
        match hosts.join(conn, offer, self.now_us) {
            Ok(host) => {
                out.push(Action::Send { conn, request_id, msg: Control::HostWelcome { host }.into() });
                if let Some(r) = hosts.initial() {
                    self.resize(r.servers, r.workers);
                    out.extend(r.starts.into_iter().map(|s| start_node(s, r.workers)));
                }
            }
            Err(message) => refuse(out, message),
        }
    }

    /// The job's size, once its hosts joined (before any node registered): the flags'
    /// bounds on scaling widen to include it.
    pub(super) fn resize(&mut self, servers: u32, workers: u32) {
        let c = &mut self.config;
        (c.servers, c.workers, c.shard.workers) = (servers, workers, workers);
        c.max_servers = c.max_servers.max(servers);
        c.min_servers = c.min_servers.min(servers);
        self.elastic.set_bounds(c.min_servers, c.max_servers);
    }

    /// A host left the job: its servers and workers are lost with it (servers fail over
    /// with replicas), and what can be started again elsewhere is.
    pub(super) fn host_lost(&mut self, mut lost: LostHost, out: &mut Vec<Action>) {
        let why = format!("host {} lost: {}", lost.label, lost.why);
        self.elastic.event(
            self.now_us,
            "host-lost",
            None,
            format!("{}; servers {:?}, workers {:?}", why, lost.servers, lost.ranks),
        );
        let mut conns: Vec<ConnId> = Vec::new();
        for id in &lost.servers {
            conns.extend(self.servers.get(*id as usize).map(|(c, _)| *c).filter(|c| self.nodes.contains_key(c)));
        }
        for rank in &lost.ranks {
            conns.extend(self.workers.get(*rank as usize).copied().filter(|c| self.nodes.contains_key(c)));
        }
        for conn in conns {
            self.on_lost(conn, &why, out);
            out.push(Action::Close(conn));
        }
        if self.over {
            return;
        }
        // A worker whose `WorkerDone` was taken is done, though its process had not exited.
        lost.ranks.retain(|r| !self.finished_workers.contains(r) || self.failed_workers.contains_key(r));
        let Some(hosts) = self.hosts.as_mut() else { return };
        let r = hosts.replace(&lost);
        out.extend(r.starts.into_iter().map(|s| start_node(s, self.config.workers)));
        for m in &r.missed {
            tracing::warn!(host = %lost.label, "not started again: {m}");
        }
        if hosts.agents().is_empty() {
            self.finish(false, format!("{why}; no host is left in the job"), out);
        } else if r.unnamed_missed && !self.layout_ready {
            // The job waits for nodes that will never register.
            let missed = r.missed.join("; ");
            self.finish(
                false,
                format!("{why}: its nodes that had not registered are gone before training started: {missed}"),
                out,
            );
        }
    }
}

/// The message that tells a host's agent to start a node of a job of `workers` workers.
pub(super) fn start_node(start: Start, workers: u32) -> Action {
    let msg = Control::StartNode { slot: start.slot, role: start.role, workers }.into();
    Action::Send { conn: start.conn, request_id: 0, msg }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offer(name: &str, addr: &str, servers: u32, workers: u32) -> HostOffer {
        HostOffer {
            name: name.into(),
            addr: addr.into(),
            servers,
            workers,
            server_slots: servers + 1,
            worker_slots: workers + 1,
        }
    }

    fn config(min: u32, max: u32) -> HostsConfig {
        HostsConfig { min_hosts: min, max_hosts: max, restart_workers: 1, restart_servers: 1 }
    }

    #[test]
    fn the_job_starts_once_enough_hosts_offer_enough_nodes() {
        let mut h = Hosts::new(config(2, 3));
        h.join(1, offer("a", "10.0.0.1", 0, 2), 0).unwrap();
        assert!(h.initial().is_none());
        let wait = h.waiting_for().unwrap();
        assert!(
            wait.contains("1 of at least 2 joined (a (10.0.0.1))") && wait.contains("0 servers and 2 workers"),
            "{wait}"
        );
        h.join(2, offer("b", "10.0.0.2", 1, 0), 0).unwrap();
        let r = h.initial().unwrap();
        assert_eq!((r.servers, r.workers), (1, 2), "a host of workers and a host of servers");
        let on = |conn, role| r.starts.iter().filter(|s| s.conn == conn && s.role == role).count();
        let worker = NodeRole::Worker { rank: None };
        assert_eq!((on(1, NodeRole::Server), on(1, worker), on(2, NodeRole::Server), on(2, worker)), (0, 2, 1, 0));
        assert!(h.initial().is_none(), "started once");
        assert_eq!(h.waiting_for(), None);
    }

    #[test]
    fn a_host_is_refused_with_what_to_pass() {
        let mut h = Hosts::new(config(1, 2));
        let e = h.join(1, offer("a", "0.0.0.0", 1, 1), 0).unwrap_err();
        assert!(e.contains("--advertise"), "{e}");
        h.join(1, offer("a", "10.0.0.1", 1, 1), 0).unwrap();
        assert!(h.join(2, offer("a2", "10.0.0.1", 1, 1), 0).unwrap_err().contains("already in the job"));
        let e = h.join(2, offer("b", "127.0.0.1", 1, 1), 0).unwrap_err();
        assert!(e.contains("loopback") && e.contains("--interface"), "{e}");
        h.join(2, offer("b", "10.0.0.2", 1, 1), 0).unwrap();
        assert!(h.join(3, offer("c", "10.0.0.3", 1, 1), 0).unwrap_err().contains("its 2 hosts"));
    }

    #[test]
    fn pick_host_avoids_the_straggler_while_another_has_room() {
        let rooms = [Room { host: 0, free: 3 }, Room { host: 1, free: 1 }, Room { host: 2, free: 0 }];
        assert_eq!(pick_host(&rooms, None), Some(0));
        assert_eq!(pick_host(&rooms, Some(0)), Some(1));
        assert_eq!(pick_host(&rooms[..1], Some(0)), Some(0), "the straggler's host when no other has room");
        assert_eq!(pick_host(&rooms[2..], None), None);
    }

    #[test]
    fn a_scale_out_goes_to_a_spare_host_not_the_stragglers() {
        let mut h = Hosts::new(config(2, 3));
        h.join(1, offer("a", "10.0.0.1", 1, 1), 0).unwrap();
        h.join(2, offer("b", "10.0.0.2", 1, 1), 0).unwrap();
        h.join(3, HostOffer { server_slots: 2, worker_slots: 0, ..offer("spare", "10.0.0.3", 0, 0) }, 0).unwrap();
        h.initial();
        assert_eq!(h.server_registered(0, "10.0.0.1:7100", None), Some(0));
        assert_eq!(h.server_registered(1, "10.0.0.2:7100", None), Some(1));
        let s = h.start_server(Some(0)).unwrap();
        assert_eq!((s.host, s.role), (2, NodeRole::Server));
        h.server_registered(2, "10.0.0.3:7100", None);
        h.start_server(Some(2)).unwrap();
        let s = h.start_server(Some(2)).unwrap();
        assert_ne!(s.host, 2, "spare is full after two");
    }

    #[test]
    fn a_lost_host_restarts_its_workers_elsewhere_with_their_ranks_within_the_budget() {
        let mut h = Hosts::new(config(2, 2));
        h.join(1, offer("a", "10.0.0.1", 1, 1), 0).unwrap();
        h.join(2, offer("b", "10.0.0.2", 1, 1), 0).unwrap();
        h.initial();
        h.server_registered(0, "10.0.0.1:1", None);
        h.server_registered(1, "10.0.0.2:1", None);
        h.worker_registered(0, Some("10.0.0.1"));
        h.worker_registered(1, Some("10.0.0.2"));
        h.heard(1, 1_500_000);
        let lost = h.lose_silent(2_100_000);
        assert_eq!(lost.len(), 1);
        assert_eq!((lost[0].host, &lost[0].servers, &lost[0].ranks), (1, &vec![1], &vec![1]));
        assert!(lost[0].why.contains("no heartbeat"), "{}", lost[0].why);
        let r = h.replace(&lost[0]);
        assert_eq!(r.starts.len(), 2, "{r:?}");
        assert!(r.starts.iter().all(|s| s.host == 0));
        assert!(r.starts.iter().any(|s| s.role == NodeRole::Worker { rank: Some(1) }));
        // The budgets are spent: a second failure is not restarted.
        assert_eq!(h.exited(1, 0, false, Some(0)), None);
        assert!(h.connection_lost(1, "eof").is_some());
        assert!(h.agents().is_empty());
    }

    /// Found by the harness's host proptest (issue 33): a host lost after its agent
    /// started its nodes but before they registered took a worker the job waits for; it
    /// was never started again (it had no rank), and the job hung.
    #[test]
    fn a_host_lost_before_its_nodes_registered_has_them_started_again_elsewhere() {
        let mut h = Hosts::new(config(3, 3));
        h.join(1, offer("a", "10.0.0.1", 1, 1), 0).unwrap();
        h.join(2, offer("b", "10.0.0.2", 1, 1), 0).unwrap();
        h.join(3, HostOffer { servers: 0, workers: 0, ..offer("spare", "10.0.0.3", 0, 0) }, 0).unwrap();
        h.initial();
        h.server_registered(0, "10.0.0.1:1", None);
        h.worker_registered(0, Some("10.0.0.1"));
        let lost = h.connection_lost(2, "eof").unwrap();
        assert_eq!((lost.unnamed_servers, lost.unnamed_workers, lost.ranks.len()), (1, 1, 0));
        let r = h.replace(&lost);
        let roles: Vec<_> = r.starts.iter().map(|s| s.role).collect();
        assert_eq!(roles, [NodeRole::Worker { rank: None }, NodeRole::Server], "{r:?}");
        assert!(r.starts.iter().all(|s| s.host != 1), "not on the lost host: {r:?}");
        assert!(!r.unnamed_missed);
        // No restarts left: what is missed is said, and that the job lacks it.
        let lost = h.connection_lost(1, "eof").unwrap();
        assert_eq!((lost.unnamed_servers, lost.unnamed_workers), (1, 1), "the restarted ones had not registered");
        let r = h.replace(&lost);
        assert!(r.starts.is_empty() && r.unnamed_missed, "{r:?}");
        let said = |what: &str| r.missed.iter().any(|m| m.contains("had not registered") && m.contains(what));
        assert!(said("--restart-workers") && said("--restart-servers"), "{r:?}");
    }
}

#[cfg(test)]
mod scheduler_tests {
    use super::super::testkit::*;
    use super::super::{Action, Event, JobConfig, Scheduler, WAIT_REPORT_EVERY_US};
    use super::HostsConfig;
    use elasticps_wire::{Control, KeyId, Message};

    #[test]
    fn a_job_across_hosts_says_every_5_s_which_hosts_it_waits_for() {
        let hosts = HostsConfig { min_hosts: 2, max_hosts: 2, restart_workers: 0, restart_servers: 0 };
        let mut m = Scheduler::new(config(), 2_000_000).with_hosts(hosts);
        join(&mut m, 100, "a", "10.0.0.1", 1, 1);
        let heartbeat = Event::Received { conn: 100, request_id: 0, msg: Control::Heartbeat.into() };
        m.handle(WAIT_REPORT_EVERY_US - 100_000, heartbeat);
        let a = m.handle(WAIT_REPORT_EVERY_US, Event::Timeout);
        let what =
            "scheduler waits for hosts: 1 of at least 2 joined (a (10.0.0.1)); they offer 1 servers and 1 workers";
        assert_eq!(a, [Action::Waiting(what.into())]);
        assert!(m.handle(WAIT_REPORT_EVERY_US + 500_000, Event::Timeout).is_empty(), "once per 5 s");
    }

    /// Servers 0 and 1 (connections 10 and 20, at `data`) and workers 0 and 1 (connections 1
    /// and 2) connect from `ips` (server i and worker i from `ips[i]`) and register; worker
    /// 0 defines the model and both servers take their blocks: the job runs.
    fn register_two_and_two(m: &mut Scheduler, ips: [&str; 2], data: [&str; 2]) {
        for (conn, ip) in [(10, ips[0]), (20, ips[1]), (1, ips[0]), (2, ips[1])] {
            step(m, Event::Connected { conn, peer: ip.into(), key: KeyId::Cluster });
        }
        recv(m, 10, 1, Control::RegisterServer { data_addr: data[0].into() });
        recv(m, 20, 1, Control::RegisterServer { data_addr: data[1].into() });
        recv(m, 1, 1, Control::RegisterWorker);
        recv(m, 2, 1, Control::RegisterWorker);
        recv(m, 1, 2, Control::DefineModel { tensors: model(), optimizers: Vec::new(), tables: Vec::new() });
        recv(m, 10, 0, Control::AssignDone { server_id: 0 });
        recv(m, 20, 0, Control::AssignDone { server_id: 1 });
    }

    #[test]
    fn a_job_across_hosts_starts_its_nodes_there_and_a_lost_host_fails_over_and_restarts_its_worker() {
        let hosts = HostsConfig { min_hosts: 2, max_hosts: 3, restart_workers: 1, restart_servers: 0 };
        let mut m = Scheduler::new(JobConfig { replicas: 2, ..config() }, 2_000_000).with_hosts(hosts);
        let a = join(&mut m, 100, "a", "10.0.0.1", 1, 1);
        assert!(matches!(sent_to(&a, 100)[..], [Message::Control(Control::HostWelcome { host: 0 })]));
        assert!(starts(&a, 100).is_empty(), "one host of two: {a:?}");
        assert!(m.waiting_for().unwrap().contains("1 of at least 2 joined (a (10.0.0.1))"));
        let a = join(&mut m, 200, "b", "10.0.0.2", 1, 1);
        let worker = elasticps_wire::NodeRole::Worker { rank: None };
        assert_eq!(starts(&a, 100), [elasticps_wire::NodeRole::Server, worker]);
        assert_eq!(starts(&a, 200), [elasticps_wire::NodeRole::Server, worker]);
        // The nodes register from their hosts; the job runs.
        register_two_and_two(&mut m, ["10.0.0.1", "10.0.0.2"], ["10.0.0.1:7100", "10.0.0.2:7100"]);
        assert_eq!(m.waiting_for(), None);
        // Host b goes silent: after 2 s it is lost, its server fails over, its worker
        // restarts with its rank on host a.
        for t in 1..=4 {
            m.handle(t * 500_000, Event::Timeout);
            for conn in [100, 10, 1] {
                recv(&mut m, conn, 0, Control::Heartbeat);
            }
        }
        let epoch = m.placement().unwrap().epoch;
        let a = m.handle(2_600_000, Event::Timeout);
        assert_eq!(starts(&a, 100), [elasticps_wire::NodeRole::Worker { rank: Some(1) }], "{a:?}");
        assert!(a.contains(&Action::Close(200)));
        assert!(m.placement().unwrap().epoch > epoch, "server 1's blocks failed over");
        assert!(m.placement().unwrap().owners.iter().all(|o| *o == 0));
        let log = m.balance_log();
        let lost = log.scaling.iter().find(|e| e.action == "host-lost").expect("a host-lost event");
        assert!(lost.reason.contains("b (10.0.0.2)") && lost.reason.contains("no heartbeat"), "{}", lost.reason);
        // The job goes on; at the end every agent is told.
        let a = recv(&mut m, 1, 3, Control::WorkerDone { rank: 0 });
        assert!(starts(&a, 100).is_empty());
    }

    /// Found by the harness's host proptest (issue 33): a host lost after the scheduler
    /// took its worker's `WorkerDone` (the process not exited yet) had that finished rank
    /// started again elsewhere, spending a restart on a worker whose rejoin is refused.
    #[test]
    fn a_host_lost_after_its_worker_finished_does_not_start_it_again() {
        let hosts = HostsConfig { min_hosts: 3, max_hosts: 3, restart_workers: 1, restart_servers: 0 };
        let mut m = Scheduler::new(JobConfig { replicas: 2, ..config() }, 2_000_000).with_hosts(hosts);
        join(&mut m, 100, "a", "10.0.0.1", 1, 1);
        join(&mut m, 200, "b", "10.0.0.2", 1, 1);
        join(&mut m, 300, "spare", "10.0.0.3", 0, 0);
        register_two_and_two(&mut m, ["10.0.0.1", "10.0.0.2"], ["10.0.0.1:7100", "10.0.0.2:7100"]);
        recv(&mut m, 2, 3, Control::WorkerDone { rank: 1 });
        let a = step(&mut m, Event::Lost { conn: 200, why: "the peer crashed".into() });
        let started: Vec<_> = [100, 300].iter().flat_map(|c| starts(&a, *c)).collect();
        assert!(started.is_empty(), "finished rank 1 is not started again: {a:?}");
        assert!(m.placement().unwrap().owners.iter().all(|o| *o == 0), "server 1's blocks failed over");
    }

    /// A job across hosts that is over tells its agents, relays the last events they
    /// send (their servers' counters, for the report) and ends once they left, or after
    /// [`AGENTS_WAIT_US`](crate::scheduler::end::AGENTS_WAIT_US) for one that stays.
    #[test]
    fn a_job_across_hosts_ends_after_its_agents_relayed_their_last_events_and_left() {
        for stays in [false, true] {
            let hosts = HostsConfig { min_hosts: 1, max_hosts: 1, restart_workers: 0, restart_servers: 0 };
            let mut m = Scheduler::new(config(), 2_000_000).with_hosts(hosts);
            join(&mut m, 100, "a", "10.0.0.1", 2, 2);
            register_two_and_two(&mut m, ["10.0.0.1", "10.0.0.1"], ["10.0.0.1:7100", "10.0.0.1:7101"]);
            recv(&mut m, 1, 3, Control::WorkerDone { rank: 0 });
            let a = recv(&mut m, 2, 3, Control::WorkerDone { rank: 1 });
            assert!(
                matches!(sent_to(&a, 100)[..], [Message::Control(Control::Shutdown { .. })]),
                "the agent is told: {a:?}"
            );
            assert!(!a.iter().any(|x| matches!(x, Action::Finish { .. })), "not before the agent left: {a:?}");
            let line = r#"{"event":"server_stats"}"#.to_string();
            let a = recv(&mut m, 100, 0, Control::HostEvent { line: line.clone() });
            assert_eq!(a, [Action::Relay(line)], "its last events are relayed");
            let a = if stays {
                let at = m.poll_timeout().expect("a bounded wait");
                m.handle(at, Event::Timeout)
            } else {
                step(&mut m, Event::Lost { conn: 100, why: "closed".into() })
            };
            assert!(a.iter().any(|x| matches!(x, Action::Finish { ok: true, .. })), "stays {stays}: {a:?}");
        }
    }
}
