//! A whole job on the harness: the real scheduler, servers and workers, from birth to the
//! end of the job. What the proptests and `elasticps sim` run.
//!
//! [`SimJob::new`] adds `job.servers` servers and `job.workers` workers, each a real state
//! machine behind its adapter ([`ServerRole`], [`WorkerRole`]); [`SimJob::run`] runs the
//! cluster to the end of the job, starting a server whenever the scheduler asks for one
//! (scale-out), and lets the `Shutdown` messages land. Test drivers (an operator sending
//! `Scale` requests, say) plug in as [`JobRole::Driver`].

use std::rc::Rc;

use elasticps_wire::Message;

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
        }
    }

    fn on_message(&mut self, out: &mut Outbox<'_>, conn: ConnId, request_id: u64, msg: Message) {
        match self {
            JobRole::Server(r) => r.on_message(out, conn, request_id, msg),
            JobRole::Worker(r) => r.on_message(out, conn, request_id, msg),
            JobRole::Driver(r) => r.on_message(out, conn, request_id, msg),
        }
    }

    fn on_lost(&mut self, out: &mut Outbox<'_>, conn: ConnId, why: LostWhy) {
        match self {
            JobRole::Server(r) => r.on_lost(out, conn, why),
            JobRole::Worker(r) => r.on_lost(out, conn, why),
            JobRole::Driver(r) => r.on_lost(out, conn, why),
        }
    }

    fn on_timer(&mut self, out: &mut Outbox<'_>, token: u64) {
        match self {
            JobRole::Server(r) => r.on_timer(out, token),
            JobRole::Worker(r) => r.on_timer(out, token),
            JobRole::Driver(r) => r.on_timer(out, token),
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

/// A job on the harness.
#[derive(Debug)]
pub struct SimJob {
    cluster: Cluster<JobRole>,
    setup: JobSetup,
    servers: Vec<NodeId>,
    workers: Vec<NodeId>,
}

impl SimJob {
    /// The scheduler, `job.servers` servers and `job.workers` workers; worker `i` runs
    /// `training(i)` (its rank comes from the scheduler, in the order they register).
    pub fn new(setup: JobSetup, mut training: impl FnMut(u32) -> TrainingLoop) -> Self {
        let mut cluster = Cluster::new(ClusterConfig { can_launch: true, ..setup.cluster.clone() });
        let weigh = setup.weigh.clone();
        cluster.network_mut().set_size_hook(move |m| weigh(m));
        let mut job = Self { cluster, setup, servers: Vec::new(), workers: Vec::new() };
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

    /// Adds a server (a scale-out, or a replacement).
    pub fn add_server(&mut self) -> NodeId {
        let i = self.servers.len() as u32;
        let role = JobRole::Server(
            ServerRole::new(self.setup.server_model, self.setup.weigh.clone())
                .with_scheduler_retry(self.setup.scheduler_retry_us),
        );
        let node = self.cluster.add(NodeKind::Server(i), self.setup.server_link, role);
        self.servers.push(node);
        node
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
        loop {
            let before = self.cluster.events();
            let stop = self.cluster.run(until_us, budget);
            budget = budget.saturating_sub(self.cluster.events() - before);
            match stop {
                Stop::StartServer => {
                    self.add_server();
                }
                Stop::Finished { ok, reason } => {
                    let at_us = self.cluster.network().now_us();
                    // Let the Shutdown messages land (servers exit, drained ones linger).
                    let settle = at_us.saturating_add(1_000_000);
                    self.cluster.run(settle, budget);
                    return Some(JobEnd { ok, reason, at_us });
                }
                Stop::Until | Stop::Events | Stop::Idle => return None,
            }
        }
    }
}
