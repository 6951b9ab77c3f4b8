//! After `Shutdown`: the wait for running migrations and checkpoint writes, a drained
//! server's linger, and the exit.

use super::{Action, Exit, LINGER_QUIET_US, Owned, Phase, SHUTDOWN_WAIT_US, Server, Slot};

/// After `Shutdown`: when it came, and why.
#[derive(Clone, Debug)]
pub(super) struct Stopping {
    pub(super) reason: String,
    pub(super) since_us: u64,
    pub(super) lingering: bool,
    /// When try_exit looks again (the end of the wait for migrations or checkpoint
    /// writes, or of a drained server's linger).
    pub(super) recheck_us: Option<u64>,
}

impl Server {
    /// After `Shutdown`: [`Server::try_exit`] looks again at `at_us`
    /// ([`Server::poll_timeout`]).
    pub(super) fn recheck_at(&mut self, at_us: u64) {
        if let Some(s) = self.stopping.as_mut() {
            s.recheck_us = Some(at_us);
        }
    }

    /// After `Shutdown`: leaves once the migrations out ended (or waited too long) and,
    /// for a drained server, once workers stopped using it: a worker whose layout is older
    /// than the drain still sends it requests, which must get `Moved`, not a closed
    /// socket. It lingers until every data connection is closed (workers drop a server
    /// that left their layout) or no request came for [`LINGER_QUIET_US`].
    pub(super) fn try_exit(&mut self, now_us: u64, out: &mut Vec<Action>) {
        if let Some(s) = self.stopping.as_mut() {
            s.recheck_us = None;
        }
        let Some(stopping) = self.stopping.as_ref() else { return };
        let migrating = self
            .slots
            .values()
            .filter(|s| matches!(s, Slot::Owned(Owned { phase: Phase::Copying { .. } | Phase::Frozen { .. }, .. })))
            .count();
        let wait_end = stopping.since_us + SHUTDOWN_WAIT_US;
        if migrating > 0 {
            if now_us < wait_end {
                return self.recheck_at(wait_end);
            }
            tracing::warn!(server = self.id, pending = migrating, "migrations still running at shutdown");
        }
        if self.checkpoint_writes > 0 && now_us < wait_end {
            // The last checkpoint's blocks are on their way to disk.
            return self.recheck_at(wait_end);
        }
        let drained = self.shard.is_some() && self.slots.values().all(|s| matches!(s, Slot::Gone { .. }));
        if drained {
            let open = self.conns.len();
            let quiet_us = now_us.saturating_sub(self.last_request_us);
            if open > 0 && quiet_us <= LINGER_QUIET_US {
                if let Some(s) = self.stopping.as_mut() {
                    s.lingering = true;
                }
                return self.recheck_at(self.last_request_us + LINGER_QUIET_US + 1);
            }
            tracing::info!(server = self.id, open, quiet_s = quiet_us as f64 / 1e6, "drained server leaves");
        }
        let reason = self.stopping.as_ref().map(|s| s.reason.clone()).unwrap_or_default();
        self.exit(Exit::Shutdown { reason }, out);
    }

    pub(super) fn exit(&mut self, exit: Exit, out: &mut Vec<Action>) {
        self.exited = true;
        out.push(Action::Exit(exit));
    }
}
