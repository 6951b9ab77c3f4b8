//! The end of the job: it ends once every worker left (well if none was lost, else after
//! waiting for lost ones to rejoin), or when it cannot go on. Every node and host agent
//! is told; a job with checkpoints then waits for its servers' last checkpoint writes and
//! its manifests, and a job across hosts for its agents to relay their nodes' last
//! events (a server's counters, for the report) and leave.

use std::collections::BTreeSet;

use elasticps_wire::{Control, ErrorCode, ErrorReply, Message};

use super::{Action, ConnId, Event, Role, Scheduler, hosts};

/// How long a job with checkpoints waits after `Shutdown` for its servers to finish their
/// checkpoint writes and leave, µs.
pub const CLOSING_WAIT_US: u64 = 30_000_000;

/// How long a job across hosts (without checkpoints) waits after `Shutdown` for its
/// agents to relay their nodes' last events and leave, µs.
pub const AGENTS_WAIT_US: u64 = 10_000_000;

/// The end of a job that waits after `Shutdown`: how it ended, and who is not gone yet.
#[derive(Debug)]
pub(super) struct Closing {
    ok: bool,
    reason: String,
    pub(super) until_us: u64,
    /// Servers whose last checkpoint writes are awaited (a job with checkpoints).
    servers: BTreeSet<ConnId>,
    /// Host agents still relaying their nodes' last events.
    agents: BTreeSet<ConnId>,
}

impl Scheduler {
    /// Ends the job once every worker left: well if none was lost, else (after waiting
    /// `rejoin_wait_us` for lost ones to rejoin) without them.
    pub(super) fn maybe_end(&mut self, out: &mut Vec<Action>) {
        if self.finished_workers.len() as u32 == self.config.workers && self.rejoining.is_empty() {
            let waited = self.awaiting_rejoin_since.map(|since| self.now_us.saturating_sub(since));
            if self.failed_workers.is_empty() {
                self.finish(true, "every worker finished".into(), out);
            } else if self.config.rejoin_wait_us > 0 && waited.is_none_or(|w| w < self.config.rejoin_wait_us) {
                if waited.is_none() {
                    let lost: Vec<&u32> = self.failed_workers.keys().collect();
                    tracing::info!(
                        ?lost,
                        wait_s = self.config.rejoin_wait_us as f64 / 1e6,
                        "every other worker is done; the job waits for lost workers to rejoin"
                    );
                    self.awaiting_rejoin_since = Some(self.now_us);
                }
            } else {
                let failed: Vec<String> =
                    self.failed_workers.iter().map(|(r, why)| format!("worker {r} ({why})")).collect();
                let reason = format!("the job ended without {}", failed.join(", "));
                self.finish(false, reason, out);
            }
        }
    }

    pub(super) fn finish(&mut self, ok: bool, reason: String, out: &mut Vec<Action>) {
        if self.defer_finish(ok, &reason) {
            return;
        }
        // Workers still waiting for the layout learn why there will be none.
        for (conn, request_id) in std::mem::take(&mut self.waiting_for_layout) {
            let reply = ErrorReply { code: ErrorCode::ShuttingDown, message: reason.clone() };
            out.push(Action::Send { conn, request_id, msg: Message::Error(reply) });
        }
        if self.closing.is_some() {
            return;
        }
        let agents = self.hosts.as_ref().map(hosts::Hosts::agents).unwrap_or_default();
        for conn in self.nodes.keys().chain(&agents) {
            out.push(Action::Send {
                conn: *conn,
                request_id: 0,
                msg: Control::Shutdown { reason: reason.clone() }.into(),
            });
        }
        // A checkpoint of the last clocks may still be on its way to disk: its manifest is
        // written once the servers report it, so wait for them to leave and for every
        // manifest ordered to be written.
        let servers: BTreeSet<ConnId> = match self.config.checkpoint {
            Some(_) => self.nodes.iter().filter(|(_, n)| matches!(n.role, Role::Server(_))).map(|(c, _)| *c).collect(),
            None => BTreeSet::new(),
        };
        let agents: BTreeSet<ConnId> = agents.into_iter().collect();
        let checkpoints = !servers.is_empty() || !self.manifests_pending.is_empty();
        if checkpoints || !agents.is_empty() {
            tracing::info!(
                servers = servers.len(),
                agents = agents.len(),
                "the job is over; waiting for the last checkpoint writes and the hosts' last events"
            );
            let until_us = self.now_us + if checkpoints { CLOSING_WAIT_US } else { AGENTS_WAIT_US };
            self.closing = Some(Closing { ok, reason, until_us, servers, agents });
            return;
        }
        out.push(Action::Finish { ok, reason });
        self.over = true;
    }

    /// After `Shutdown`, in a job with checkpoints or across hosts: only checkpoint
    /// reports, manifests written, the agents' last events and servers and agents leaving
    /// count, until every server and agent left and every manifest is written, or the
    /// wait is over.
    pub(super) fn step_closing(&mut self, event: Event, out: &mut Vec<Action>) {
        match event {
            Event::Received { conn, msg: Message::Control(Control::CheckpointWritten { clock, blocks }), .. }
                if self.nodes.contains_key(&conn) =>
            {
                self.checkpoint_written(clock, blocks, out)
            }
            Event::Received { conn, msg: Message::Control(Control::HostEvent { line }), .. }
                if self.closing.as_ref().is_some_and(|c| c.agents.contains(&conn)) =>
            {
                out.push(Action::Relay(line))
            }
            Event::Received { conn, request_id, .. } if request_id != 0 => {
                // A call after the end (an operator's request, say) learns that it is over.
                let reason = self.closing.as_ref().map_or_else(String::new, |c| c.reason.clone());
                let reply = ErrorReply { code: ErrorCode::ShuttingDown, message: format!("the job is over: {reason}") };
                out.push(Action::Send { conn, request_id, msg: Message::Error(reply) });
            }
            Event::Received { .. } | Event::Connected { .. } => {}
            Event::Lost { conn, .. } => {
                self.nodes.remove(&conn);
                if let Some(c) = self.closing.as_mut() {
                    c.servers.remove(&conn);
                    c.agents.remove(&conn);
                }
            }
            Event::Timeout => {}
            Event::ManifestWritten { clock, error } => self.manifest_written(clock, error),
        }
        let pending = &self.manifests_pending;
        if let Some(c) = self.closing.take_if(|c| {
            (c.servers.is_empty() && c.agents.is_empty() && pending.is_empty()) || self.now_us >= c.until_us
        }) {
            if !c.servers.is_empty() {
                tracing::warn!(servers = c.servers.len(), "servers still running after the checkpoint wait");
            }
            if !c.agents.is_empty() {
                tracing::warn!(
                    agents = c.agents.len(),
                    "host agents still connected after the wait for their last events"
                );
            }
            if !pending.is_empty() {
                tracing::warn!(clocks = ?pending, "checkpoint manifests still being written after the wait");
            }
            out.push(Action::Finish { ok: c.ok, reason: c.reason });
            self.over = true;
        }
    }
}
