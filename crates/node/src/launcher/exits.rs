//! What the launcher does when a node exits (see the module docs of [`super`]): a dead
//! worker restarted with its rank, a dead server's blocks failed over (and the server
//! replaced), any other failure the job's; the end wait armed at the last worker's exit.

use super::{Effect, Failure, Launcher, NodeId, NodeKind, Phase, Spawn};

/// What a failure the launcher cannot absorb did next.
pub(super) const JOB_FAILED: &str = "the job failed; every other node was stopped";

impl Launcher {
    /// Node `node` exited at `now_us`, `ok` or not, with `status`.
    pub(super) fn exited(&mut self, now_us: u64, node: NodeId, ok: bool, status: String, out: &mut Vec<Effect>) {
        let Some(label) = self.running.remove(&node) else {
            tracing::debug!(node, "an unknown node exited");
            return;
        };
        tracing::info!(node, %label, ok, %status, "a node exited");
        if self.phase != Phase::Running {
            // The scheduler exited before it listened.
            return self.fail(Failure::NodeFailed { node, then: None }, out);
        }
        if !ok {
            return self.died(now_us, node, &label, status, out);
        }
        self.servers.remove(&node);
        if self.workers.remove(&node).is_some() && self.workers.is_empty() {
            tracing::info!(end_timeout_us = self.config.end_timeout_us, "the last worker exited: the end wait starts");
            self.end_by_us = Some(now_us + self.config.end_timeout_us);
        }
        self.done_if_all_exited(out);
    }

    /// Node `node` (`label`) exited unsuccessfully.
    fn died(&mut self, now_us: u64, node: NodeId, label: &str, status: String, out: &mut Vec<Effect>) {
        let rank = self.workers.get(&node).and_then(|(_, r)| *r);
        if self.worker_restarts_left > 0
            && let (Some(rank), Some((index, _))) = (rank, self.workers.remove(&node))
        {
            self.worker_restarts_left -= 1;
            let left = self.worker_restarts_left;
            tracing::info!(rank, restarts_left = left, "a dead worker is restarted with its rank");
            let line = format!("[{label}] exited with {status}; restarting it as rank {rank} ({left} restarts left)");
            out.push(Effect::Say { line, error: true });
            out.push(Effect::WorkerRestarted { rank, at_us: now_us, status });
            return self.spawn(Spawn::named(NodeKind::Worker { index, rank: Some(rank) }), out);
        }
        if self.config.replicas > 1
            && let Some(index) = self.servers.remove(&node)
        {
            return self.server_lost(now_us, index, label, status, out);
        }
        self.fail(Failure::NodeFailed { node, then: Some(JOB_FAILED) }, out);
    }

    /// Server `index` (`label`) died in a job with replicas: its blocks fail over to their
    /// backups, and a new server takes its place while restarts are left.
    fn server_lost(&mut self, now_us: u64, index: u32, label: &str, status: String, out: &mut Vec<Effect>) {
        let replaced = self.server_restarts_left > 0;
        let line = if replaced {
            self.server_restarts_left -= 1;
            format!(
                "[{label}] exited with {status}; its blocks fail over to their backups; starting server {} in its \
                 place ({} restarts left)",
                self.next_server, self.server_restarts_left
            )
        } else {
            format!("[{label}] exited with {status}; its blocks fail over to their backups")
        };
        tracing::info!(index, replaced, restarts_left = self.server_restarts_left, "a server of a replicated job died");
        out.push(Effect::Say { line, error: true });
        out.push(Effect::ServerLost { index, at_us: now_us, status, replaced });
        if replaced {
            let next = NodeKind::Server { index: self.next_server };
            self.next_server += 1;
            return self.spawn(Spawn::named(next), out);
        }
        self.done_if_all_exited(out);
    }

    /// The job is done once every node exited (and no spawn is out).
    fn done_if_all_exited(&mut self, out: &mut Vec<Effect>) {
        if self.running.is_empty() && !self.spawning {
            self.done(out);
        }
    }
}
