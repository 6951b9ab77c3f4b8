//! A whole job on the harness: the real scheduler, servers and workers, from birth to the
//! end of the job. What the proptests and `elasticps sim` run.
//!
//! [`SimJob::new`] adds `job.servers` servers and `job.workers` workers, each a real state
//! machine behind its adapter ([`ServerRole`], [`WorkerRole`]); [`SimJob::run`] runs the
//! cluster to the end of the job, starting a server whenever the scheduler asks for one
//! (scale-out), and lets the `Shutdown` messages land. Test drivers (an operator sending
//! `Scale` requests, say) plug in as [`JobRole::Driver`].
//!
//! [`SimJob::across_hosts`] runs a job across simulated hosts instead, as `elasticps
//! launch --nnodes MIN:MAX --rdzv` does: one host agent per host ([`AgentRole`], the real
//! [`elasticps_node::agent::Agent`]), each on its own IP address, and the scheduler's host
//! rules decide what starts where. The job only carries out the agents' spawns (a server
//! or a worker on that host) and hands each agent its nodes' exits.

use std::collections::BTreeMap;
use std::rc::Rc;

use elasticps_node::agent::{AgentConfig, Input, NodeKind as Spawned, Spawn};
use elasticps_node::scheduler::hosts::HostsConfig;
use elasticps_wire::{HostOffer, Message};

use crate::agent::AgentRole;
use crate::cluster::{Cluster, ClusterConfig, Outbox, Role, Stop};
use crate::net::{LinkSpec, LostWhy, NodeId, NodeKind, Weigh};
use crate::server::{ServerModel, ServerRole};
use crate::worker::{TrainingLoop, WorkerRole};
use elasticps_node::ConnId;

/// One node of a simulated job. (Roles sit in the cluster's table once each and never
/// move, so the variants' sizes do not matter.)
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub enum JobRole {
    /// A server.
    Server(ServerRole),
    /// A worker running its training loop.
    Worker(WorkerRole),
    /// A test driver (an operator, a fault injector).
    Driver(Box<dyn Role>),
    /// A host's agent (a job across hosts).
    Agent(AgentRole),
}

impl std::fmt::Debug for dyn Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("driver")
    }
}

impl Role for JobRole {
    fn on_start(&mut self, out: &mut Outbox<'_>) {
        match self {
            JobRole::Server(r) => r.on_start(out),
            JobRole::Worker(r) => r.on_start(out),
            JobRole::Driver(r) => r.on_start(out),
            JobRole::Agent(r) => r.on_start(out),
        }
    }

    fn on_message(&mut self, out: &mut Outbox<'_>, conn: ConnId, request_id: u64, msg: Message) {
        match self {
            JobRole::Server(r) => r.on_message(out, conn, request_id, msg),
            JobRole::Worker(r) => r.on_message(out, conn, request_id, msg),
            JobRole::Driver(r) => r.on_message(out, conn, request_id, msg),
            JobRole::Agent(r) => r.on_message(out, conn, request_id, msg),
        }
    }

    fn on_lost(&mut self, out: &mut Outbox<'_>, conn: ConnId, why: LostWhy) {
        match self {
            JobRole::Server(r) => r.on_lost(out, conn, why),
            JobRole::Worker(r) => r.on_lost(out, conn, why),
            JobRole::Driver(r) => r.on_lost(out, conn, why),
            JobRole::Agent(r) => r.on_lost(out, conn, why),
        }
    }

    fn on_timer(&mut self, out: &mut Outbox<'_>, token: u64) {
        match self {
            JobRole::Server(r) => r.on_timer(out, token),
            JobRole::Worker(r) => r.on_timer(out, token),
            JobRole::Driver(r) => r.on_timer(out, token),
            JobRole::Agent(r) => r.on_timer(out, token),
        }
    }

    fn exit_status(&self) -> Option<(bool, String)> {
        match self {
            JobRole::Server(r) => r.exit_status(),
            JobRole::Worker(r) => r.exit_status(),
            JobRole::Driver(r) => r.exit_status(),
            JobRole::Agent(r) => r.exit_status(),
        }
    }
}

/// How a simulated job is set up beyond its [`ClusterConfig`].
#[derive(Clone)]
pub struct JobSetup {
    /// The cluster (job, seed, jitter, heartbeat timeout).
    pub cluster: ClusterConfig,
    /// Every server's link (a `--server-bandwidth` cap comes with its assignment).
    pub server_link: LinkSpec,
    /// Every worker's link.
    pub worker_link: LinkSpec,
    /// The servers' CPU model and checks.
    pub server_model: ServerModel,
    /// What a message weighs.
    pub weigh: Weigh,
    /// How long servers and workers redial a lost scheduler and reattach (µs; 0: they
    /// stop, as they did before the scheduler could restart).
    pub scheduler_retry_us: u64,
}

impl std::fmt::Debug for JobSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobSetup").field("cluster", &self.cluster).field("server_model", &self.server_model).finish()
    }
}

impl JobSetup {
    /// Default links, no CPU model, frames weighed as they are.
    pub fn new(cluster: ClusterConfig) -> Self {
        Self {
            cluster,
            server_link: LinkSpec::default(),
            worker_link: LinkSpec::default(),
            server_model: ServerModel::default(),
            weigh: Rc::new(crate::net::frame_bytes),
            scheduler_retry_us: 0,
        }
    }
}

/// How a simulated job ended.
#[derive(Clone, Debug, PartialEq)]
pub struct JobEnd {
    /// True if every worker finished (the scheduler's verdict).
    pub ok: bool,
    /// The scheduler's reason, or why the run stopped without one.
    pub reason: String,
    /// Virtual time at the end, µs.
    pub at_us: u64,
}

/// One simulated host of a job across hosts: what it starts at the rendezvous and what
/// it offers (its agent's [`HostOffer`], `--servers-per-node`, `--worker-slots`, ...).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostSpec {
    /// Servers it starts at the rendezvous.
    pub servers: u32,
    /// Workers it starts at the rendezvous.
    pub workers: u32,
    /// Servers it runs at most.
    pub server_slots: u32,
    /// Workers it runs at most.
    pub worker_slots: u32,
}

impl HostSpec {
    /// The IP address of the `i`-th simulated host: `10.0.<i / 200>.<i % 200 + 1>`.
    pub fn ip(i: usize) -> String {
        format!("10.0.{}.{}", i / 200, i % 200 + 1)
    }
}

/// The agents of a job across hosts, and what they started.
struct Hosted {
    /// Every host's agent, in host order.
    agents: Vec<NodeId>,
    /// The agent that started each node.
    started_by: BTreeMap<NodeId, NodeId>,
    /// What a worker runs, by its rank (restarted) or its spawn order (first start).
    training: Box<dyn FnMut(u32) -> TrainingLoop>,
}

/// A job on the harness.
pub struct SimJob {
    cluster: Cluster<JobRole>,
    setup: JobSetup,
    servers: Vec<NodeId>,
    workers: Vec<NodeId>,
    hosted: Option<Hosted>,
}

impl std::fmt::Debug for SimJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let agents = self.hosted.as_ref().map(|h| h.agents.clone());
        f.debug_struct("SimJob").field("cluster", &self.cluster).field("agents", &agents).finish()
    }
}

impl SimJob {
    /// The scheduler, `job.servers` servers and `job.workers` workers; worker `i` runs
    /// `training(i)` (its rank comes from the scheduler, in the order they register).
    pub fn new(setup: JobSetup, mut training: impl FnMut(u32) -> TrainingLoop) -> Self {
        let mut cluster = Cluster::new(ClusterConfig { can_launch: true, ..setup.cluster.clone() });
        let weigh = setup.weigh.clone();
        cluster.network_mut().set_size_hook(move |m| weigh(m));
        let mut job = Self { cluster, setup, servers: Vec::new(), workers: Vec::new(), hosted: None };
        for _ in 0..job.setup.cluster.job.servers {
            job.add_server();
        }
        for i in 0..job.setup.cluster.job.workers {
            let role = JobRole::Worker(WorkerRole::new(training(i)).with_scheduler_retry(job.setup.scheduler_retry_us));
            let node = job.cluster.add(NodeKind::Worker(i), job.setup.worker_link, role);
            job.workers.push(node);
        }
        job
    }

    /// A job across `hosts` simulated hosts, as `launch --rdzv` runs it: the scheduler with
    /// the host rules of `config`, and one agent per host (host `i` at [`HostSpec::ip`]),
    /// which join it. Nothing else starts until the scheduler tells the agents to: the
    /// job's size comes from the hosts' offers. A worker runs `training(i)`, `i` its spawn
    /// order, or its rank when it restarts.
    pub fn across_hosts(
        setup: JobSetup,
        config: HostsConfig,
        hosts: &[HostSpec],
        training: impl FnMut(u32) -> TrainingLoop + 'static,
    ) -> Self {
        let cluster_config = ClusterConfig { can_launch: false, hosts: Some(config), ..setup.cluster.clone() };
        let mut cluster = Cluster::new(cluster_config);
        let weigh = setup.weigh.clone();
        cluster.network_mut().set_size_hook(move |m| weigh(m));
        let hosted = Hosted { agents: Vec::new(), started_by: BTreeMap::new(), training: Box::new(training) };
        let mut job = Self { cluster, setup, servers: Vec::new(), workers: Vec::new(), hosted: Some(hosted) };
        let rdzv = job.cluster.scheduler_node().addr();
        for (i, h) in hosts.iter().enumerate() {
            let (name, ip) = (format!("host{i}"), HostSpec::ip(i));
            let offer = HostOffer {
                name: name.clone(),
                addr: ip.clone(),
                servers: h.servers,
                workers: h.workers,
                server_slots: h.server_slots,
                worker_slots: h.worker_slots,
            };
            let config = AgentConfig {
                name,
                rdzv: rdzv.clone(),
                offer,
                leads: false,
                join_timeout_us: 60_000_000,
                end_timeout_us: 30_000_000,
                // The harness runs no host group (one push per host): its workers push alone.
                host_groups: false,
            };
            let role = JobRole::Agent(AgentRole::new(config, job.cluster.network().now_us()));
            let agent = job.cluster.add_on(Some(&ip), NodeKind::Other(i as u32), LinkSpec::default(), role);
            if let Some(h) = job.hosted.as_mut() {
                h.agents.push(agent);
            }
        }
        job
    }

    /// Adds a server (a scale-out, or a replacement).
    pub fn add_server(&mut self) -> NodeId {
        self.add_server_on(None)
    }

    /// [`SimJob::add_server`] on the simulated host of IP address `ip`, if any.
    fn add_server_on(&mut self, ip: Option<&str>) -> NodeId {
        let i = self.servers.len() as u32;
        let role = JobRole::Server(
            ServerRole::new(self.setup.server_model, self.setup.weigh.clone())
                .with_scheduler_retry(self.setup.scheduler_retry_us),
        );
        let node = self.cluster.add_on(ip, NodeKind::Server(i), self.setup.server_link, role);
        self.servers.push(node);
        node
    }

    /// Adds a worker on the simulated host of IP address `ip`, if any: a new one, or one
    /// restarted that rejoins as `rank`.
    fn add_worker_on(&mut self, ip: Option<&str>, work: TrainingLoop, rank: Option<u32>) -> NodeId {
        let role = match rank {
            Some(rank) => WorkerRole::rejoining(work, rank),
            None => WorkerRole::new(work),
        };
        let role = JobRole::Worker(role.with_scheduler_retry(self.setup.scheduler_retry_us));
        let i = rank.unwrap_or(self.workers.len() as u32);
        let node = self.cluster.add_on(ip, NodeKind::Worker(i), self.setup.worker_link, role);
        self.workers.push(node);
        node
    }

    /// Every host's agent (a job across hosts), in host order.
    pub fn agents(&self) -> impl Iterator<Item = (NodeId, &AgentRole)> {
        let agents = self.hosted.as_ref().map_or(&[][..], |h| &h.agents[..]);
        agents.iter().filter_map(|n| match self.cluster.role(*n) {
            Some(JobRole::Agent(a)) => Some((*n, a)),
            _ => None,
        })
    }

    /// The agent that started `node` (a job across hosts).
    pub fn started_by(&self, node: NodeId) -> Option<NodeId> {
        self.hosted.as_ref()?.started_by.get(&node).copied()
    }

    /// A whole host lost at once, as a kill of everything in its network namespace: its
    /// agent and every node it started crash; with `peers_notice` their connections
    /// reset (the peers learn it now), else their peers only notice the silence.
    pub fn lose_host(&mut self, agent: NodeId, peers_notice: bool) {
        let nodes: Vec<NodeId> = self
            .hosted
            .as_ref()
            .map(|h| h.started_by.iter().filter(|(_, a)| **a == agent).map(|(n, _)| *n).collect())
            .unwrap_or_default();
        self.cluster.crash(agent, peers_notice);
        for node in nodes {
            if self.cluster.network().is_alive(node) {
                self.cluster.crash(node, peers_notice);
            }
        }
    }

    /// A host agent's spawn: the node starts on its host, and the agent learns it.
    fn spawn(&mut self, agent: NodeId, spawn: Spawn) {
        let Some(hosted) = self.hosted.as_mut() else { return };
        let ip = self.cluster.network().ip(agent).map(str::to_string);
        if !self.cluster.network().is_alive(agent) {
            return; // the host is gone: nothing starts there
        }
        let node = match spawn.node {
            Spawned::Server => self.add_server_on(ip.as_deref()),
            Spawned::Worker { rank, .. } => {
                let work = (hosted.training)(rank.unwrap_or(self.workers.len() as u32));
                self.add_worker_on(ip.as_deref(), work, rank)
            }
        };
        self.cluster.watch_exit(node);
        if let Some(h) = self.hosted.as_mut() {
            h.started_by.insert(node, agent);
        }
        let input = Input::Spawned { slot: spawn.slot, node: node.0 as usize };
        self.tell_agent(agent, input);
    }

    /// A node an agent started exited: its agent learns it (unless it is gone too).
    fn exited(&mut self, node: NodeId, ok: bool, status: String) {
        if let Some(agent) = self.started_by(node) {
            self.tell_agent(agent, Input::Exited { node: node.0 as usize, ok, status });
        }
    }

    fn tell_agent(&mut self, agent: NodeId, input: Input<'_>) {
        self.cluster.with_role(agent, |role, out| {
            if let JobRole::Agent(a) = role {
                a.input(out, input);
            }
        });
    }

    /// Adds a worker restarted after it was lost: it rejoins as `rank` and runs `training`
    /// from the clock the job is at.
    pub fn restart_worker(&mut self, rank: u32, training: TrainingLoop) -> NodeId {
        let role =
            JobRole::Worker(WorkerRole::rejoining(training, rank).with_scheduler_retry(self.setup.scheduler_retry_us));
        let node = self.cluster.add(NodeKind::Worker(rank), self.setup.worker_link, role);
        self.workers.push(node);
        node
    }

    /// Adds a test driver.
    pub fn add_driver(&mut self, role: Box<dyn Role>) -> NodeId {
        let i = self.cluster.network().node_count() as u32;
        self.cluster.add(NodeKind::Other(i), LinkSpec::default(), JobRole::Driver(role))
    }

    /// The cluster (network faults, the scheduler, the roles).
    pub fn cluster(&self) -> &Cluster<JobRole> {
        &self.cluster
    }

    /// The cluster, to inject faults.
    pub fn cluster_mut(&mut self) -> &mut Cluster<JobRole> {
        &mut self.cluster
    }

    /// Every server started so far, in order.
    pub fn servers(&self) -> impl Iterator<Item = (NodeId, &ServerRole)> {
        self.servers.iter().filter_map(|n| match self.cluster.role(*n) {
            Some(JobRole::Server(s)) => Some((*n, s)),
            _ => None,
        })
    }

    /// Every worker, in the order added.
    pub fn workers(&self) -> impl Iterator<Item = (NodeId, &WorkerRole)> {
        self.workers.iter().filter_map(|n| match self.cluster.role(*n) {
            Some(JobRole::Worker(w)) => Some((*n, w)),
            _ => None,
        })
    }

    /// Runs until `until_us` or the end of the job, at most `max_events` deliveries, and
    /// returns how the job ended (if it did). Scale-outs start servers on the way; after the
    /// end, the `Shutdown` messages are delivered before this returns.
    pub fn run(&mut self, until_us: u64, max_events: u64) -> Option<JobEnd> {
        let mut budget = max_events;
        match self.run_serving(until_us, &mut budget) {
            Stop::Finished { ok, reason } => {
                let at_us = self.cluster.network().now_us();
                // Let the Shutdown messages land (servers exit, drained ones linger, agents
                // see their nodes exit and leave).
                let settle = at_us.saturating_add(1_000_000);
                self.run_serving(settle, &mut budget);
                Some(JobEnd { ok, reason, at_us })
            }
            _ => None,
        }
    }

    /// Runs the cluster until `until_us`, out of `budget` deliveries, carrying out what it
    /// asks of its owner (a server for a scale-out, an agent's spawn, an exit for an agent);
    /// returns the first other [`Stop`].
    fn run_serving(&mut self, until_us: u64, budget: &mut u64) -> Stop {
        loop {
            let before = self.cluster.events();
            let stop = self.cluster.run(until_us, *budget);
            *budget = budget.saturating_sub(self.cluster.events() - before);
            match stop {
                Stop::StartServer => {
                    self.add_server();
                }
                Stop::Spawn { agent, spawn } => self.spawn(agent, spawn),
                Stop::Exited { node, ok, status } => self.exited(node, ok, status),
                other => return other,
            }
        }
    }
}
