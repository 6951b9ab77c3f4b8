//! The host agent (`elasticps launch --nnodes MIN[:MAX] --rdzv HOST:PORT`, one per host)
//! as a state machine without I/O, on the [`crate::Machine`] contract. Its rules, in one
//! place:
//!
//! - **Join.** It dials the rendezvous at once, then with the backoff of every link
//!   (100 ms doubling to 2 s, [`crate::timing`]) for at most `--join-timeout-s`, saying
//!   every 5 s what it waits for; on each connection it sends `JoinHost` with its offer,
//!   which the scheduler answers within [`JOIN_CALL_TIMEOUT_US`] (`HostWelcome`, or an
//!   `Error` that ends the launch). The link is a [`Session`] made by
//!   [`Session::dialling`]: the dial, the backoff and the heartbeats are its rules.
//! - **Start nodes within its slots.** A `StartNode` starts a node only in a slot that
//!   runs nothing here, and only while fewer nodes of its kind run than the host offered
//!   slots for (`slots`). Beyond its slots the order is refused with the reply a node
//!   that could not start gets (`NodeExited { ok: false }` naming why): the scheduler frees
//!   the slot and may start the node elsewhere. A slot that already runs a node here keeps
//!   it: the duplicate order is logged and answered with nothing, since `NodeExited` would
//!   say the running node is gone.
//! - **Report exits, relay events.** Each node's exit goes to the scheduler as
//!   `NodeExited` (slot, status, rank), each event line (but its metrics address) as
//!   `HostEvent`.
//! - **Heartbeat** every [`crate::timing::HEARTBEAT_EVERY_US`] from the `HostWelcome` on.
//! - **A lost scheduler.** Before the job ended, it ends the launch of a host that does not
//!   run the scheduler (its nodes are stopped); the rendezvous host waits for its scheduler
//!   process to exit, which ends it.
//! - **The end.** After the scheduler's `Shutdown`, the agent waits for its nodes to exit,
//!   then closes its connection (the scheduler stops waiting for it) and is done; nodes
//!   still running after `end_timeout_us` fail the launch, naming them.
//!
//! Inputs are what happened ([`Input`]); outputs a closed set of [`Effect`]s. Every effect
//! with an outcome comes back: [`Effect::Dial`] as [`Input::Dialled`] or
//! [`Input::DialFailed`], [`Effect::Spawn`] as [`Input::Spawned`] or
//! [`Input::SpawnFailed`], then [`Input::Exited`].

mod slots;
#[cfg(test)]
mod tests;

use elasticps_wire::{Control, HostOffer, Message, NodeRole};

pub use slots::Refusal;

use crate::events::Event;
use crate::scheduler::WAIT_REPORT_EVERY_US;
use crate::session::{self, REATTACH_ID, Session, SessionConfig};
use crate::timing::JOIN_CALL_TIMEOUT_US;
use slots::{Local, Slots};

/// A process the driver started for the agent: its number in the driver's spawn order.
pub type NodeId = usize;

/// What a host agent is.
#[derive(Clone, Debug, PartialEq)]
pub struct AgentConfig {
    /// The host's name, for messages.
    pub name: String,
    /// The rendezvous address, for messages.
    pub rdzv: String,
    /// What the host offers (its slots bound what it starts).
    pub offer: HostOffer,
    /// True on the rendezvous host, whose launch runs the scheduler: the scheduler
    /// process's exit ends the launch, and a lost connection to it does not.
    pub leads: bool,
    /// How long the rendezvous is dialled, µs (`--join-timeout-s`).
    pub join_timeout_us: u64,
    /// How long the nodes may take to exit once the job is over, µs.
    pub end_timeout_us: u64,
    /// One push per host ([`crate::worker::group`]): the workers this host starts when
    /// the job starts form a group, if they are more than one. The launch says it for a
    /// job across hosts unless `--no-host-aggregation`; never on one host.
    pub host_groups: bool,
}

/// What happened.
#[derive(Debug)]
pub enum Input<'a> {
    /// The connection [`Effect::Dial`] asked for is up.
    Dialled,
    /// The dial did not connect.
    DialFailed {
        /// Why.
        why: String,
    },
    /// The scheduler's connection closed.
    Lost {
        /// Why.
        why: String,
    },
    /// A frame from the scheduler.
    Frame {
        /// The request it answers, or 0.
        request_id: u64,
        /// The message.
        msg: &'a Message,
    },
    /// The node of [`Effect::Spawn`] started as `node`.
    Spawned {
        /// The slot.
        slot: u32,
        /// The process.
        node: NodeId,
    },
    /// The node of [`Effect::Spawn`] could not start.
    SpawnFailed {
        /// The slot.
        slot: u32,
        /// Why.
        why: String,
    },
    /// A node printed an event.
    Line {
        /// The process.
        node: NodeId,
        /// The event.
        event: Event,
    },
    /// A node exited.
    Exited {
        /// The process.
        node: NodeId,
        /// Status 0.
        ok: bool,
        /// How it ended, in words.
        status: String,
    },
    /// The rendezvous host's scheduler process exited.
    SchedulerExited {
        /// Status 0.
        ok: bool,
    },
    /// The deadline of [`Agent::poll_timeout`] came.
    Timeout,
}

/// A node to start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Spawn {
    /// The scheduler's slot (comes back in [`Input::Spawned`] or [`Input::SpawnFailed`]).
    pub slot: u32,
    /// Its name in logs: `server slot 3`, `worker slot 4 (rank 1)`.
    pub label: String,
    /// What to start.
    pub node: NodeKind,
}

/// What a [`Spawn`] starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeKind {
    /// A server.
    Server,
    /// A copy of the worker command.
    Worker {
        /// The rank it restarts as, if any.
        rank: Option<u32>,
        /// The job's workers.
        workers: u32,
        /// The workers this host started before it (the command's local rank).
        local: u32,
        /// Its seat in the host group, if it has one: the first workers a host starts
        /// that are not restarts, as many as it starts with the job, form its group (with
        /// [`AgentConfig::host_groups`] and more than one of them); a restarted worker
        /// pushes alone.
        group: Option<GroupSeat>,
    },
}

/// A worker's seat in its host's group ([`crate::worker::group`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupSeat {
    /// Its rank in the group: 0 leads.
    pub rank: u32,
    /// Workers in the group.
    pub size: u32,
}

/// What the driver does.
#[derive(Clone, Debug)]
pub enum Effect {
    /// Open a connection to the rendezvous (comes back as [`Input::Dialled`] or
    /// [`Input::DialFailed`]); a connection still open is dropped.
    Dial,
    /// Write `msg` with `request_id` on the scheduler's connection.
    Send {
        /// The request id (0: a notification).
        request_id: u64,
        /// The message.
        msg: Message,
    },
    /// Close the scheduler's connection.
    Close,
    /// Start a node.
    Spawn(Spawn),
    /// One of this host's events, for its progress bars (a host that does not run the
    /// scheduler; the rendezvous host shows the scheduler's stream).
    Show(Event),
    /// A line for the operator.
    Say {
        /// The line.
        line: String,
        /// On stderr (a failure), else stdout.
        error: bool,
    },
    /// The launch is over: stop every node and end with `outcome`.
    Exit(Outcome),
}

/// How a host's launch ends.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// The rendezvous host: its scheduler exited with status 0 (the job's report is
    /// made from its event stream).
    JobOver,
    /// Another host: the job ended for this reason and every node exited.
    Left(String),
    /// The launch failed.
    Failed {
        /// How.
        failure: Failure,
        /// What happened, in words.
        why: String,
    },
}

/// How a launch fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The rendezvous did not answer within `--join-timeout-s`.
    Unreachable,
    /// The scheduler refused the host.
    Refused,
    /// The scheduler did not answer `JoinHost` within [`JOIN_CALL_TIMEOUT_US`].
    JoinTimeout,
    /// The scheduler's connection closed before the job ended.
    SchedulerLost,
    /// The rendezvous host's scheduler process failed.
    SchedulerFailed,
    /// Nodes still ran `end_timeout_us` after the job ended.
    EndTimeout,
}

/// Where the agent is.
#[derive(Clone, Debug, PartialEq)]
enum Phase {
    /// Not in the job yet.
    Joining {
        /// The `JoinHost` on the current connection is due to be answered by then.
        answer_by_us: Option<u64>,
        /// Why the last dial failed.
        last_error: Option<String>,
        /// When to say next what it waits for.
        next_say_us: u64,
    },
    /// In the job (the scheduler welcomed it).
    Joined,
    /// Done: it said [`Effect::Exit`].
    Done,
}

/// A host agent (see the module docs).
#[derive(Debug)]
pub struct Agent {
    config: AgentConfig,
    session: Session,
    phase: Phase,
    slots: Slots,
    /// Workers started so far that were not restarts (the next one's seat in the host
    /// group).
    fresh_started: u32,
    /// Workers started so far (the next one's local rank).
    workers_started: u32,
    /// The scheduler's `Shutdown` reason, once the job is over.
    over: Option<String>,
    /// The end of the wait for the nodes, after the `Shutdown`.
    end_by_us: Option<u64>,
}

impl Agent {
    /// An agent at `now_us`: it wants its timeout at once, to dial the rendezvous.
    pub fn new(config: AgentConfig, now_us: u64) -> Self {
        let mut config = config;
        // The offer says what the host runs at most: at least what it starts itself.
        let slots = Slots::new(&config.offer);
        config.offer.server_slots = config.offer.server_slots.max(config.offer.servers);
        config.offer.worker_slots = config.offer.worker_slots.max(config.offer.workers);
        let link = SessionConfig { retry_us: 0, heartbeats: true };
        Self {
            session: Session::dialling(link, now_us, config.join_timeout_us),
            phase: Phase::Joining { answer_by_us: None, last_error: None, next_say_us: now_us + WAIT_REPORT_EVERY_US },
            slots,
            workers_started: 0,
            fresh_started: 0,
            over: None,
            end_by_us: None,
            config,
        }
    }

    /// True once the agent said [`Effect::Exit`].
    pub fn is_done(&self) -> bool {
        self.phase == Phase::Done
    }

    /// When the agent next wants [`Input::Timeout`] (absolute µs): a dial, a heartbeat,
    /// the deadline of its `JoinHost`, its next "waits for" line, the end of its wait for
    /// its nodes.
    pub fn poll_timeout(&self) -> Option<u64> {
        let deadlines = match &self.phase {
            Phase::Done => return None,
            // Once connected, the `JoinHost` has its own deadline, whatever the dial's.
            Phase::Joining { answer_by_us: Some(by), .. } => [Some(*by), None],
            Phase::Joining { answer_by_us: None, next_say_us, .. } => [self.session.poll_timeout(), Some(*next_say_us)],
            Phase::Joined => [self.session.poll_timeout(), None],
        };
        deadlines.into_iter().chain([self.end_by_us]).flatten().min()
    }

    /// True while a `JoinHost` is out on a connection, unanswered.
    fn awaits_answer(&self) -> bool {
        matches!(self.phase, Phase::Joining { answer_by_us: Some(_), .. })
    }

    /// One input at `now_us`; the effects are appended to `out`.
    pub fn handle_into(&mut self, now_us: u64, input: Input<'_>, out: &mut Vec<Effect>) {
        if self.phase == Phase::Done {
            return;
        }
        match input {
            Input::Dialled => self.dialled(now_us, out),
            Input::DialFailed { why } => {
                if let Phase::Joining { last_error, .. } = &mut self.phase {
                    *last_error = Some(why);
                }
                self.link(now_us, session::Event::Lost, out);
            }
            Input::Lost { why } => self.lost(now_us, why, out),
            Input::Frame { request_id: REATTACH_ID, msg } => self.answered(now_us, msg, out),
            Input::Frame { request_id, msg } => self.frame(now_us, request_id, msg, out),
            Input::Spawned { slot, node } => self.slots.spawned(slot, node),
            Input::SpawnFailed { slot, why } => self.spawn_failed(now_us, slot, why, out),
            Input::Line { node, event } => self.line(now_us, node, event, out),
            Input::Exited { node, ok, status } => self.exited(now_us, node, ok, status, out),
            Input::SchedulerExited { ok } => self.scheduler_exited(ok, out),
            Input::Timeout => self.timeout(now_us, out),
        }
    }

    /// [`Agent::handle_into`] into a new vector.
    pub fn handle(&mut self, now_us: u64, input: Input<'_>) -> Vec<Effect> {
        let mut out = Vec::new();
        self.handle_into(now_us, input, &mut out);
        out
    }

    /// Hands the link one event and carries out what it says.
    fn link(&mut self, now_us: u64, event: session::Event<'_>, out: &mut Vec<Effect>) {
        let mut actions = Vec::new();
        self.session.handle_into(now_us, event, &mut actions);
        for action in actions {
            match action {
                session::Action::Send { request_id, msg } => out.push(Effect::Send { request_id, msg }),
                session::Action::Dial { attempt } => {
                    tracing::debug!(attempt, rdzv = %self.config.rdzv, "dialling the rendezvous");
                    out.push(Effect::Dial);
                }
                session::Action::Over { reason } => self.link_over(now_us, reason, out),
                // The agent makes no call with a deadline.
                session::Action::Expired { .. } => {}
            }
        }
    }

    /// A notification to the scheduler (dropped while the link is down).
    fn notify(&mut self, now_us: u64, msg: Control, out: &mut Vec<Effect>) {
        self.link(now_us, session::Event::Send { request_id: 0, msg: msg.into() }, out);
    }

    fn exit(&mut self, outcome: Outcome, out: &mut Vec<Effect>) {
        match &outcome {
            Outcome::Failed { failure, why } => tracing::warn!(?failure, %why, "host agent failed"),
            other => tracing::info!(outcome = ?other, "host agent done"),
        }
        self.phase = Phase::Done;
        out.push(Effect::Exit(outcome));
    }

    fn fail(&mut self, failure: Failure, why: String, out: &mut Vec<Effect>) {
        self.exit(Outcome::Failed { failure, why }, out);
    }

    /// `host X (10.0.0.1)`.
    fn host(&self) -> String {
        format!("host {} ({})", self.config.name, self.config.offer.addr)
    }

    fn dialled(&mut self, now_us: u64, out: &mut Vec<Effect>) {
        let Phase::Joining { answer_by_us, .. } = &mut self.phase else { return };
        *answer_by_us = Some(now_us + JOIN_CALL_TIMEOUT_US);
        let msg = Control::JoinHost(self.config.offer.clone()).into();
        out.push(Effect::Send { request_id: REATTACH_ID, msg });
    }

    /// The answer to `JoinHost`.
    fn answered(&mut self, now_us: u64, msg: &Message, out: &mut Vec<Effect>) {
        if !matches!(self.phase, Phase::Joining { .. }) {
            return;
        }
        let Message::Control(Control::HostWelcome { host }) = msg else {
            let said = match msg {
                Message::Error(e) => format!("{:?}: {}", e.code, e.message),
                other => format!("{:?}", other.kind()),
            };
            let why = format!(
                "{} could not join the job at {}: the scheduler answered {said}",
                self.host(),
                self.config.rdzv
            );
            return self.fail(Failure::Refused, why, out);
        };
        self.phase = Phase::Joined;
        let line = format!("{} joined the job at {} as host {host}", self.host(), self.config.rdzv);
        tracing::info!(host, rdzv = %self.config.rdzv, "host joined the job");
        out.push(Effect::Say { line, error: false });
        self.link(now_us, session::Event::Received { request_id: REATTACH_ID, msg }, out);
    }

    fn lost(&mut self, now_us: u64, why: String, out: &mut Vec<Effect>) {
        if let Phase::Joining { answer_by_us, last_error, .. } = &mut self.phase {
            *answer_by_us = None;
            *last_error = Some(why);
        } else {
            tracing::info!(%why, "the scheduler's connection closed");
        }
        self.link(now_us, session::Event::Lost, out);
    }

    /// The link is over: the dial window ended, the connection closed, or the agent
    /// closed it at the end.
    fn link_over(&mut self, now_us: u64, reason: Option<String>, out: &mut Vec<Effect>) {
        match (&self.phase, reason) {
            (Phase::Joining { last_error, .. }, _) => {
                let err = last_error.as_deref().unwrap_or("no answer");
                let why = format!(
                    "host {} could not reach the scheduler at {} within {} s ({err}): is `elasticps launch` running on \
                     the rendezvous host, with the same --rdzv, and is the port open?",
                    self.config.name,
                    self.config.rdzv,
                    self.config.join_timeout_us / 1_000_000
                );
                self.fail(Failure::Unreachable, why, out);
            }
            (Phase::Joined, Some(reason)) if self.over.is_none() && !self.config.leads => {
                let why = format!(
                    "host {} lost the scheduler at {}: its connection closed before the job ended ({reason}; the \
                     rendezvous host or its launch is gone); this host's nodes were stopped",
                    self.config.name, self.config.rdzv
                );
                self.fail(Failure::SchedulerLost, why, out);
            }
            (Phase::Joined, reason) => {
                tracing::info!(?reason, "the link to the scheduler is over");
                self.end_if_done(now_us, out);
            }
            (Phase::Done, _) => {}
        }
    }

    fn frame(&mut self, now_us: u64, request_id: u64, msg: &Message, out: &mut Vec<Effect>) {
        self.link(now_us, session::Event::Received { request_id, msg }, out);
        match msg {
            Message::Control(Control::StartNode { slot, role, workers }) if request_id == 0 => {
                self.start(now_us, *slot, *role, *workers, out)
            }
            Message::Control(Control::Shutdown { reason }) if request_id == 0 => {
                tracing::info!(%reason, "the scheduler ended the job");
                if self.over.is_none() {
                    self.over = Some(reason.clone());
                    self.end_by_us = Some(now_us + self.config.end_timeout_us);
                }
                self.end_if_done(now_us, out);
            }
            other => tracing::debug!(request_id, kind = ?other.kind(), "agent ignores a frame"),
        }
    }

    /// The scheduler orders a node started in `slot`.
    fn start(&mut self, now_us: u64, slot: u32, role: NodeRole, workers: u32, out: &mut Vec<Effect>) {
        let refusal = match &self.over {
            Some(reason) => Some(Refusal::Over(format!("the job is over ({reason})"))),
            None => self.slots.admit(slot, role).err(),
        };
        match refusal {
            None => {
                let node = match role {
                    NodeRole::Server => NodeKind::Server,
                    NodeRole::Worker { rank } => {
                        self.workers_started += 1;
                        let local = self.workers_started - 1;
                        let size = self.config.offer.workers;
                        let mut group = None;
                        if rank.is_none() {
                            self.fresh_started += 1;
                            let seat = GroupSeat { rank: self.fresh_started - 1, size };
                            group = (self.config.host_groups && size > 1 && seat.rank < size).then_some(seat);
                        }
                        NodeKind::Worker { rank, workers, local, group }
                    }
                };
                out.push(Effect::Spawn(Spawn { slot, label: slots::label(slot, role), node }));
            }
            Some(refusal) => self.refuse(now_us, slot, role, refusal, out),
        }
    }

    fn refuse(&mut self, now_us: u64, slot: u32, role: NodeRole, refusal: Refusal, out: &mut Vec<Effect>) {
        let (Refusal::Running(why) | Refusal::Full(why) | Refusal::Over(why)) = &refusal;
        let line = format!("host {} refuses to start {}: {why}", self.config.name, slots::label(slot, role));
        tracing::warn!(slot, ?role, %why, "a StartNode refused");
        out.push(Effect::Say { line: line.clone(), error: true });
        if let Refusal::Full(_) = refusal {
            let rank = match role {
                NodeRole::Worker { rank } => rank,
                NodeRole::Server => None,
            };
            self.notify(now_us, Control::NodeExited { slot, ok: false, status: line, rank }, out);
        }
    }

    fn spawn_failed(&mut self, now_us: u64, slot: u32, why: String, out: &mut Vec<Effect>) {
        let rank = self.slots.failed(slot).and_then(|l| l.rank);
        tracing::warn!(slot, %why, "a node could not start");
        out.push(Effect::Say {
            line: format!("host {}: cannot start slot {slot}: {why}", self.config.name),
            error: true,
        });
        self.notify(now_us, Control::NodeExited { slot, ok: false, status: why, rank }, out);
        self.end_if_done(now_us, out);
    }

    /// A node's event: relayed to the scheduler (but where its metrics are served), shown
    /// here unless this host shows the scheduler's stream.
    fn line(&mut self, now_us: u64, node: NodeId, event: Event, out: &mut Vec<Effect>) {
        if let (Some(l), Some(r)) = (self.slots.get_mut(node), rank_of(&event)) {
            l.rank = Some(r);
        }
        if matches!(event, Event::Metrics { .. } | Event::Listening { .. }) {
            return;
        }
        match serde_json::to_string(&event) {
            Ok(line) => self.notify(now_us, Control::HostEvent { line }, out),
            Err(e) => tracing::warn!(error = %e, "an event cannot be written as JSON"),
        }
        if !self.config.leads {
            out.push(Effect::Show(event));
        }
    }

    fn exited(&mut self, now_us: u64, node: NodeId, ok: bool, status: String, out: &mut Vec<Effect>) {
        let Some(Local { slot, rank, label, .. }) = self.slots.exited(node) else { return };
        tracing::info!(slot, ok, %status, "a node of this host exited");
        if !ok && self.over.is_none() {
            out.push(Effect::Say { line: format!("[{} {label}] exited with {status}", self.config.name), error: true });
        }
        self.notify(now_us, Control::NodeExited { slot, ok, status, rank }, out);
        self.end_if_done(now_us, out);
    }

    fn scheduler_exited(&mut self, ok: bool, out: &mut Vec<Effect>) {
        if ok {
            self.exit(Outcome::JobOver, out);
        } else {
            self.fail(Failure::SchedulerFailed, "the scheduler failed".into(), out);
        }
    }

    /// Once the job is over and every node of this host exited, the agent closes its
    /// connection (the scheduler stops waiting for it); a host that does not run the
    /// scheduler is then done.
    fn end_if_done(&mut self, now_us: u64, out: &mut Vec<Effect>) {
        let Some(reason) = &self.over else { return };
        if !self.slots.is_empty() || self.phase == Phase::Done {
            return;
        }
        if !self.session.is_over() {
            out.push(Effect::Close);
            // After the `Shutdown`, a closed link is its end, not a loss.
            let mut actions = Vec::new();
            self.session.handle_into(now_us, session::Event::Lost, &mut actions);
        }
        if !self.config.leads {
            let reason = reason.clone();
            self.exit(Outcome::Left(reason), out);
        }
    }

    fn timeout(&mut self, now_us: u64, out: &mut Vec<Effect>) {
        if self.end_by_us.is_some_and(|t| now_us >= t) {
            return self.end_wait_over(out);
        }
        if let Phase::Joining { answer_by_us: Some(by), .. } = self.phase
            && now_us >= by
        {
            let why = format!(
                "{} could not join the job at {}: timed out after {:.0} s waiting for the scheduler to answer its \
                 JoinHost",
                self.host(),
                self.config.rdzv,
                JOIN_CALL_TIMEOUT_US as f64 / 1e6
            );
            return self.fail(Failure::JoinTimeout, why, out);
        }
        if !self.awaits_answer() && self.session.poll_timeout().is_some_and(|t| now_us >= t) {
            self.link(now_us, session::Event::Timeout, out);
        }
        self.say_waiting(now_us, out);
    }

    /// Every [`WAIT_REPORT_EVERY_US`] while it dials, what the agent waits for.
    fn say_waiting(&mut self, now_us: u64, out: &mut Vec<Effect>) {
        let Phase::Joining { answer_by_us: None, last_error, next_say_us } = &mut self.phase else { return };
        if now_us < *next_say_us {
            return;
        }
        *next_say_us = now_us + WAIT_REPORT_EVERY_US;
        if let Some(err) = last_error {
            let line = format!("host {} waits for the scheduler at {} ({err})", self.config.name, self.config.rdzv);
            out.push(Effect::Say { line, error: false });
        }
    }

    /// The job is over and nodes still run after the end wait: the launch fails.
    fn end_wait_over(&mut self, out: &mut Vec<Effect>) {
        let mut left = self.slots.labels();
        if self.config.leads {
            left.push("scheduler".into());
        }
        let why = format!(
            "the job is over ({}), but these nodes of host {} did not exit within {:.0} s: {}",
            self.over.as_deref().unwrap_or("?"),
            self.config.name,
            self.config.end_timeout_us as f64 / 1e6,
            left.join(", ")
        );
        self.fail(Failure::EndTimeout, why, out);
    }
}

impl crate::Machine for Agent {
    type Input<'a> = Input<'a>;
    type Output = Effect;

    fn handle(&mut self, now_us: u64, input: Self::Input<'_>, out: &mut Vec<Self::Output>) {
        self.handle_into(now_us, input, out)
    }

    fn poll_timeout(&self) -> Option<u64> {
        Agent::poll_timeout(self)
    }
}

/// The rank an event names, if any.
fn rank_of(event: &Event) -> Option<u32> {
    match event {
        Event::Joined { rank } | Event::Progress { rank, .. } | Event::Eval { rank, .. } | Event::Log { rank, .. } => {
            Some(*rank)
        }
        Event::WorkerDone(w) => Some(w.rank),
        _ => None,
    }
}
