//! The workers in every block's quorum: one removed (finished or lost), one taken back
//! (restarted).

use elasticps_core::sync::Clock;
use elasticps_wire::Control;

use super::{Action, Server, Slot};

impl Server {
    pub(super) fn remove_worker(&mut self, now_us: u64, rank: u32, out: &mut Vec<Action>) {
        let Some(shard) = self.shard.as_ref() else { return };
        tracing::info!(server = shard.id, rank, "worker removed from every quorum");
        self.removed_workers.push(rank);
        self.added_workers.retain(|r| *r != rank);
        let mut answers = Vec::new();
        let mut before = Vec::new();
        for (id, slot) in self.slots.iter_mut() {
            if let Slot::Owned(o) = slot {
                let config = shard.config_for(o.block.spec());
                before.push((*id, o.block.done()));
                let (released, dropped) = o.block.remove_worker(&config, rank, now_us);
                answers.extend(released);
                // The removed worker's own held pulls: nobody waits for them.
                dropped.iter().for_each(|t| self.held.let_go(t));
            }
        }
        for copy in self.replication.copies_mut() {
            let config = shard.config_for(copy.spec());
            copy.remove_worker(&config, rank, now_us);
        }
        self.answer_pulls(answers, out);
        for (block, done) in before {
            self.checkpoint_if_due(now_us, block, done, out);
        }
    }

    /// A removed worker restarted: every block here takes it back into its quorum (and a
    /// block arriving later too); the scheduler learns the largest of the blocks' next
    /// clocks for it (the worker goes on from the largest over every server, so each
    /// clock of its new life reaches every block or none).
    pub(super) fn add_worker(&mut self, rank: u32, out: &mut Vec<Action>) {
        self.removed_workers.retain(|r| *r != rank);
        if !self.added_workers.contains(&rank) {
            self.added_workers.push(rank);
        }
        let mut clock: Option<Clock> = None;
        for slot in self.slots.values_mut() {
            if let Slot::Owned(o) = slot
                && let Some(next) = o.block.add_worker(rank)
            {
                clock = clock.max(Some(next));
            }
        }
        let clock = clock.unwrap_or(u32::MAX);
        for copy in self.replication.copies_mut() {
            copy.add_worker(rank);
        }
        tracing::info!(server = self.id, rank, clock, "worker taken back into every quorum");
        out.push(Action::ToScheduler { request_id: 0, msg: Control::WorkerAdded { rank, clock }.into() });
    }
}
