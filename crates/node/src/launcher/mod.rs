//! The local job runner (`elasticps train`, `elasticps launch` on one host) as a state
//! machine without I/O, on the [`crate::Machine`] contract. Its rules, in one place:
//!
//! - **The scheduler first.** It is started at once, and must report its address within
//!   [`SCHEDULER_START_TIMEOUT_US`], else the job fails naming the wait
//!   ([`Failure::SchedulerSilent`]; the driver adds its log). A scheduler that exits before
//!   it listens fails the job ([`Failure::NodeFailed`]).
//! - **Then the servers 0..n, then the workers 0..m**, one spawn at a time. A server that
//!   cannot start fails the job; a worker that cannot start stops every node started so far.
//! - **A worker's rank** is learned from its events ([`Input::RankNamed`]).
//! - **A worker that dies** (exits unsuccessfully) with a known rank is restarted with that
//!   rank while `restart_workers` restarts are left ([`Effect::WorkerRestarted`]).
//! - **A server that dies** in a job with replicas (`replicas > 1`): its blocks fail over
//!   to their backups, and a new server (the next spawn index) takes its place while
//!   `restart_servers` restarts are left ([`Effect::ServerLost`]).
//! - **Any other failure** fails the job: every node is stopped ([`Failure::NodeFailed`]).
//! - **The end wait.** Once the last worker exited (successfully), the job must end within
//!   `end_timeout_us`, else it fails naming what still runs ([`Failure::EndTimeout`]).
//! - **The end.** When every node exited, the job is done ([`Effect::Done`]); a signal
//!   (SIGINT, SIGTERM, SIGHUP) stops every node ([`Failure::Stopped`]).
//!
//! Inputs are what happened ([`Input`]); outputs a closed set of [`Effect`]s. Every effect
//! with an outcome comes back: [`Effect::Spawn`] as [`Input::Spawned`] or
//! [`Input::SpawnFailed`], then [`Input::Exited`].

mod exits;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;

use crate::timing::SCHEDULER_START_TIMEOUT_US;

/// A process the driver started for the launcher: its number in the driver's spawn order.
pub type NodeId = usize;

/// What a local job is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LauncherConfig {
    /// Servers started at first (indices `0..servers`).
    pub servers: u32,
    /// Workers started at first (indices `0..workers`).
    pub workers: u32,
    /// Copies of each block (`--replicas`): above 1, a lost server's blocks fail over.
    pub replicas: u32,
    /// Restarts of dead workers left, in all (`--restart-workers`).
    pub restart_workers: u32,
    /// Servers started in place of dead ones, at most (`--restart-servers`).
    pub restart_servers: u32,
    /// How long the job may take to end once the last worker exited, µs.
    pub end_timeout_us: u64,
}

/// What a [`Spawn`] starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeKind {
    /// The scheduler.
    Scheduler,
    /// Server `index` (the spawn index: `{i}` of its extra flags).
    Server {
        /// Its spawn index.
        index: u32,
    },
    /// Worker `index` (the command's local rank), restarted as `rank` if given.
    Worker {
        /// Its spawn index.
        index: u32,
        /// The rank it restarts as, if any.
        rank: Option<u32>,
    },
}

/// A node to start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Spawn {
    /// Its name in logs and messages: `server 2`, `worker 1 (restarted as rank 1)`.
    pub label: String,
    /// What to start.
    pub node: NodeKind,
}

/// What happened.
#[derive(Debug)]
pub enum Input {
    /// A node reported the address it listens on (the scheduler, before the job starts).
    Listening {
        /// The node.
        node: NodeId,
        /// Its address.
        addr: String,
    },
    /// The node of [`Effect::Spawn`] started as `node`.
    Spawned {
        /// What was started.
        spawn: Spawn,
        /// The process.
        node: NodeId,
    },
    /// The node of [`Effect::Spawn`] could not start (the driver keeps why).
    SpawnFailed {
        /// What could not start.
        spawn: Spawn,
    },
    /// A node's event named the rank it works as.
    RankNamed {
        /// The process.
        node: NodeId,
        /// Its rank.
        rank: u32,
    },
    /// A node exited.
    Exited {
        /// The process.
        node: NodeId,
        /// Status 0.
        ok: bool,
        /// How it ended, in words (`exit status: 1`).
        status: String,
    },
    /// The user stopped the job (Ctrl-C, SIGTERM, SIGHUP): what to call it.
    Signal(&'static str),
    /// The deadline of [`Launcher::poll_timeout`] came.
    Timeout,
}

/// What the driver does.
#[derive(Clone, Debug, PartialEq)]
pub enum Effect {
    /// Start a node (comes back as [`Input::Spawned`] or [`Input::SpawnFailed`]).
    Spawn(Spawn),
    /// The scheduler listens at `addr`: the nodes started next dial it.
    Listening {
        /// The scheduler's address.
        addr: String,
    },
    /// A line for the operator.
    Say {
        /// The line.
        line: String,
        /// On stderr, else stdout.
        error: bool,
    },
    /// A dead worker was restarted with its rank (a record of the run).
    WorkerRestarted {
        /// Its rank.
        rank: u32,
        /// When it died, µs.
        at_us: u64,
        /// How it ended.
        status: String,
    },
    /// A server of a job with replicas died (a record of the run).
    ServerLost {
        /// Its spawn index.
        index: u32,
        /// When, µs.
        at_us: u64,
        /// How it ended.
        status: String,
        /// A new server was started in its place.
        replaced: bool,
    },
    /// Stop every node: the job failed.
    Fail(Failure),
    /// Every node exited: the job is over.
    Done,
}

/// How a job fails.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The scheduler `node` did not report its address in time; `why` says so (the driver
    /// adds the tail of its log).
    SchedulerSilent {
        /// The scheduler's process.
        node: NodeId,
        /// What was waited for, how long.
        why: String,
    },
    /// The node of the last [`Effect::Spawn`] could not start: the driver's error, then
    /// `then` (what the launcher did about it), if any.
    SpawnFailed {
        /// What followed.
        then: Option<&'static str>,
    },
    /// Node `node` exited (unsuccessfully, or too early): the driver names it with its
    /// log, then `then`, if any.
    NodeFailed {
        /// The process.
        node: NodeId,
        /// What followed.
        then: Option<&'static str>,
    },
    /// The job did not end within the end wait after the last worker exited; `why` names
    /// the nodes still running.
    EndTimeout {
        /// What ran too long.
        why: String,
    },
    /// A signal stopped the job: what to call it.
    Stopped(&'static str),
}

/// Where the job is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Nothing started yet: the scheduler is started at the first timeout.
    Idle,
    /// The scheduler is starting; it must listen by `by_us` (once it spawned).
    Starting {
        /// The deadline of its address.
        by_us: Option<u64>,
    },
    /// The scheduler listens; servers and workers are started and watched.
    Running,
    /// Done or failed: nothing more.
    Over,
}

/// A local job's runner (see the module docs).
#[derive(Debug)]
pub struct Launcher {
    config: LauncherConfig,
    phase: Phase,
    /// The scheduler's process, once it started.
    scheduler: Option<NodeId>,
    /// Every node running: its label.
    running: BTreeMap<NodeId, String>,
    /// Server node -> spawn index.
    servers: BTreeMap<NodeId, u32>,
    /// Worker node -> (spawn index, rank once an event named it).
    workers: BTreeMap<NodeId, (u32, Option<u32>)>,
    /// A spawn not answered yet.
    spawning: bool,
    /// The spawn index of the next server started in a dead one's place.
    next_server: u32,
    server_restarts_left: u32,
    worker_restarts_left: u32,
    /// The end of the end wait, once the last worker exited.
    end_by_us: Option<u64>,
}

impl Launcher {
    /// A launcher: it wants its timeout at once, to start the scheduler.
    pub fn new(config: LauncherConfig) -> Self {
        Self {
            phase: Phase::Idle,
            scheduler: None,
            running: BTreeMap::new(),
            servers: BTreeMap::new(),
            workers: BTreeMap::new(),
            spawning: false,
            next_server: config.servers,
            server_restarts_left: config.restart_servers,
            worker_restarts_left: config.restart_workers,
            end_by_us: None,
            config,
        }
    }

    /// True once the launcher said [`Effect::Done`] or [`Effect::Fail`].
    pub fn is_over(&self) -> bool {
        self.phase == Phase::Over
    }

    /// When the launcher next wants [`Input::Timeout`] (absolute µs): at once to start,
    /// then the scheduler's deadline to listen, then the end wait.
    pub fn poll_timeout(&self) -> Option<u64> {
        match self.phase {
            Phase::Idle => Some(0),
            Phase::Starting { by_us } => by_us,
            Phase::Running => self.end_by_us,
            Phase::Over => None,
        }
    }

    /// One input at `now_us`; the effects are appended to `out`.
    pub fn handle_into(&mut self, now_us: u64, input: Input, out: &mut Vec<Effect>) {
        if self.phase == Phase::Over {
            return;
        }
        match input {
            Input::Listening { node, addr } => self.listening(node, addr, out),
            Input::Spawned { spawn, node } => self.spawned(now_us, spawn, node, out),
            Input::SpawnFailed { spawn } => self.spawn_failed(spawn, out),
            Input::RankNamed { node, rank } => {
                if let Some((_, r)) = self.workers.get_mut(&node) {
                    *r = Some(rank);
                }
            }
            Input::Exited { node, ok, status } => self.exited(now_us, node, ok, status, out),
            Input::Signal(how) => {
                tracing::info!(how, "a signal stops the job");
                self.fail(Failure::Stopped(how), out);
            }
            Input::Timeout => self.timeout(now_us, out),
        }
    }

    /// [`Launcher::handle_into`] into a new vector.
    pub fn handle(&mut self, now_us: u64, input: Input) -> Vec<Effect> {
        let mut out = Vec::new();
        self.handle_into(now_us, input, &mut out);
        out
    }

    fn timeout(&mut self, now_us: u64, out: &mut Vec<Effect>) {
        match self.phase {
            Phase::Idle => {
                self.phase = Phase::Starting { by_us: None };
                self.spawn(Spawn::named(NodeKind::Scheduler), out);
            }
            Phase::Starting { by_us: Some(by) } if now_us >= by => {
                let Some(node) = self.scheduler else { return };
                let why = format!(
                    "the scheduler did not report its address within {} s",
                    SCHEDULER_START_TIMEOUT_US / 1_000_000
                );
                tracing::warn!(timeout_us = SCHEDULER_START_TIMEOUT_US, "the scheduler did not report its address");
                self.fail(Failure::SchedulerSilent { node, why }, out);
            }
            Phase::Running if self.end_by_us.is_some_and(|by| now_us >= by) => {
                let left: Vec<&str> = self.running.values().map(String::as_str).collect();
                let why = format!(
                    "every worker exited, but the job did not end within {:.0} s (still running: {}); a worker that \
                     exits without finishing leaves the scheduler waiting for it",
                    self.config.end_timeout_us as f64 / 1e6,
                    left.join(", ")
                );
                tracing::warn!(running = ?left, "the job did not end in time after the last worker exited");
                self.fail(Failure::EndTimeout { why }, out);
            }
            _ => {}
        }
    }

    /// The scheduler listens: the servers are started, then the workers.
    fn listening(&mut self, node: NodeId, addr: String, out: &mut Vec<Effect>) {
        if !matches!(self.phase, Phase::Starting { .. }) || self.scheduler != Some(node) {
            return;
        }
        tracing::info!(%addr, "the scheduler listens");
        self.phase = Phase::Running;
        out.push(Effect::Listening { addr });
        self.start_next(None, out);
    }

    /// Starts the first node after `after` (a node of the job's start), if any is left.
    fn start_next(&mut self, after: Option<NodeKind>, out: &mut Vec<Effect>) {
        let (servers, workers) = (self.config.servers, self.config.workers);
        let next = match after {
            None if servers > 0 => NodeKind::Server { index: 0 },
            None => NodeKind::Worker { index: 0, rank: None },
            Some(NodeKind::Server { index }) if index + 1 < servers => NodeKind::Server { index: index + 1 },
            Some(NodeKind::Server { index }) if index + 1 == servers => NodeKind::Worker { index: 0, rank: None },
            Some(NodeKind::Worker { index, rank: None }) => NodeKind::Worker { index: index + 1, rank: None },
            Some(_) => return,
        };
        if !matches!(next, NodeKind::Worker { index, .. } if index >= workers) {
            self.spawn(Spawn::named(next), out);
        }
    }

    fn spawn(&mut self, spawn: Spawn, out: &mut Vec<Effect>) {
        self.spawning = true;
        out.push(Effect::Spawn(spawn));
    }

    fn spawned(&mut self, now_us: u64, spawn: Spawn, node: NodeId, out: &mut Vec<Effect>) {
        self.spawning = false;
        tracing::debug!(node, label = %spawn.label, "a node started");
        self.running.insert(node, spawn.label);
        match spawn.node {
            NodeKind::Scheduler => {
                self.scheduler = Some(node);
                self.phase = Phase::Starting { by_us: Some(now_us + SCHEDULER_START_TIMEOUT_US) };
            }
            NodeKind::Server { index } => {
                self.servers.insert(node, index);
                self.start_next(Some(spawn.node), out);
            }
            NodeKind::Worker { index, rank } => {
                self.workers.insert(node, (index, rank));
                self.start_next(Some(spawn.node), out);
            }
        }
    }

    fn spawn_failed(&mut self, spawn: Spawn, out: &mut Vec<Effect>) {
        self.spawning = false;
        tracing::warn!(label = %spawn.label, "a node could not start");
        let then = match spawn.node {
            NodeKind::Scheduler => None,
            NodeKind::Server { index } if index < self.config.servers => None,
            NodeKind::Server { .. } => Some("no server could be started in its place; every node was stopped"),
            NodeKind::Worker { rank: None, .. } => Some("every node started so far was stopped"),
            NodeKind::Worker { rank: Some(_), .. } => {
                Some("the worker could not be restarted; every other node was stopped")
            }
        };
        self.fail(Failure::SpawnFailed { then }, out);
    }

    fn fail(&mut self, failure: Failure, out: &mut Vec<Effect>) {
        tracing::warn!(?failure, "the job failed");
        self.phase = Phase::Over;
        out.push(Effect::Fail(failure));
    }

    fn done(&mut self, out: &mut Vec<Effect>) {
        tracing::info!("every node exited: the job is over");
        self.phase = Phase::Over;
        out.push(Effect::Done);
    }
}

impl Spawn {
    /// `node`'s spawn, named: `scheduler`, `server 2`, `worker 1`, `worker 1 (restarted as
    /// rank 3)`.
    pub fn named(node: NodeKind) -> Self {
        let label = match node {
            NodeKind::Scheduler => "scheduler".into(),
            NodeKind::Server { index } => format!("server {index}"),
            NodeKind::Worker { index, rank: None } => format!("worker {index}"),
            NodeKind::Worker { index, rank: Some(r) } => format!("worker {index} (restarted as rank {r})"),
        };
        Self { label, node }
    }
}
