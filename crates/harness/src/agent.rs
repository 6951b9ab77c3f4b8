//! The host agent's adapter: the real [`Agent`] state machine (`elasticps launch` on one
//! host) on the simulated network, as `elasticps_launch::hosts` drives it over TCP and
//! processes.
//!
//! It carries out the agent's effects and nothing else: a dial opens a connection to the
//! scheduler (up at once: [`Input::Dialled`]), a send and a close go on it, a spawn asks
//! the cluster's owner for a node on this host ([`Outbox::spawn`], answered with
//! [`AgentRole::input`] and [`Input::Spawned`]), and an exit ends the agent. The owner
//! hands it its nodes' exits ([`Input::Exited`]), as the launch reaps its processes. The
//! rules (which slot starts what, what is reported, when the agent is done) are the
//! agent's.

use std::collections::VecDeque;

use elasticps_node::ConnId;
use elasticps_node::agent::{Agent, AgentConfig, Effect, Input, Outcome};
use elasticps_wire::Message;

use crate::cluster::{Outbox, Role};
use crate::net::LostWhy;
use crate::wake::Wake;

/// The timer token of the agent's deadline.
const TIMEOUT: u64 = 0;

/// A simulated host agent.
#[derive(Debug)]
pub struct AgentRole {
    agent: Agent,
    /// The scheduler's connection, while there is one.
    conn: Option<ConnId>,
    wake: Wake,
    /// How the agent ended, once it did.
    outcome: Option<Outcome>,
}

impl AgentRole {
    /// The agent of a host described by `config`, started at `now_us`.
    pub fn new(config: AgentConfig, now_us: u64) -> Self {
        Self { agent: Agent::new(config, now_us), conn: None, wake: Wake::default(), outcome: None }
    }

    /// The state machine.
    pub fn agent(&self) -> &Agent {
        &self.agent
    }

    /// How the agent ended, once it said [`Effect::Exit`].
    pub fn outcome(&self) -> Option<&Outcome> {
        self.outcome.as_ref()
    }

    /// Hands the agent one input now and carries out its effects (the outcomes of a
    /// dial come straight back).
    pub fn input(&mut self, out: &mut Outbox<'_>, input: Input<'_>) {
        let mut inputs = VecDeque::new();
        let mut effects = self.agent.handle(out.now_us(), input);
        loop {
            for effect in effects.drain(..) {
                self.carry_out(out, effect, &mut inputs);
            }
            match inputs.pop_front() {
                Some(next) => effects = self.agent.handle(out.now_us(), next),
                None => break,
            }
        }
        self.wake.arm(out, self.agent.poll_timeout(), TIMEOUT);
    }

    fn carry_out(&mut self, out: &mut Outbox<'_>, effect: Effect, inputs: &mut VecDeque<Input<'static>>) {
        match effect {
            Effect::Dial => {
                if let Some(old) = self.conn.take() {
                    out.close(old);
                }
                self.conn = Some(out.connect(out.scheduler()));
                inputs.push_back(Input::Dialled);
            }
            Effect::Send { request_id, msg } => {
                if let Some(conn) = self.conn {
                    out.send(conn, request_id, msg);
                }
            }
            Effect::Close => {
                if let Some(conn) = self.conn.take() {
                    out.close(conn);
                }
            }
            Effect::Spawn(spawn) => out.spawn(spawn),
            Effect::Show(event) => tracing::trace!(?event, "simulated host shows an event"),
            Effect::Say { line, error } => tracing::debug!(error, %line, "simulated host says"),
            Effect::Exit(outcome) => {
                tracing::debug!(?outcome, "simulated host agent done");
                if let Some(conn) = self.conn.take() {
                    out.close(conn);
                }
                self.outcome = Some(outcome);
            }
        }
    }
}

impl Role for AgentRole {
    fn on_start(&mut self, out: &mut Outbox<'_>) {
        self.wake.arm(out, self.agent.poll_timeout(), TIMEOUT);
    }

    fn on_message(&mut self, out: &mut Outbox<'_>, conn: ConnId, request_id: u64, msg: Message) {
        if self.conn == Some(conn) {
            self.input(out, Input::Frame { request_id, msg: &msg });
        }
    }

    fn on_lost(&mut self, out: &mut Outbox<'_>, conn: ConnId, why: LostWhy) {
        if self.conn == Some(conn) && why != LostWhy::ClosedHere {
            self.conn = None;
            self.input(out, Input::Lost { why: why.as_str().to_string() });
        }
    }

    fn on_timer(&mut self, out: &mut Outbox<'_>, token: u64) {
        if token != TIMEOUT {
            return;
        }
        self.wake.fired(out);
        match self.agent.poll_timeout() {
            Some(at) if at <= out.now_us() => self.input(out, Input::Timeout),
            next => self.wake.arm(out, next, TIMEOUT),
        }
    }

    fn exit_status(&self) -> Option<(bool, String)> {
        match self.outcome.as_ref()? {
            Outcome::Failed { why, .. } => Some((false, why.clone())),
            _ => Some((true, "exit status 0".into())),
        }
    }
}
