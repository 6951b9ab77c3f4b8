//! Checkpoints: when a block's state goes to disk (the pushes of the clocks before the
//! checkpoint's, exactly), and what the scheduler learns once it is written.

use elasticps_core::model::BlockId;
use elasticps_core::sync::Clock;
use elasticps_wire::{CheckpointEntry, CheckpointPlan, Control};

use super::{Action, Server, Slot};

/// The first checkpoint clock after `done` (a push of that clock or later waits for the
/// block to reach it), if the job checkpoints.
pub(super) fn next_checkpoint(plan: Option<&CheckpointPlan>, done: Clock) -> Option<Clock> {
    let every = plan?.every;
    if every == 0 {
        return None;
    }
    (done / every).checked_add(1)?.checked_mul(every)
}

impl Server {
    /// After a push or a removal took `block` from clock `before` on: if it just reached a
    /// checkpoint clock, its state goes to disk and the pushes parked for it are served.
    pub(super) fn checkpoint_if_due(&mut self, now_us: u64, block: BlockId, before: Clock, out: &mut Vec<Action>) {
        let Some(plan) = &self.checkpoint else { return };
        let Some(Slot::Owned(o)) = self.slots.get_mut(&block) else { return };
        let done = o.block.done();
        if done == before || next_checkpoint(Some(plan), before) != Some(done) {
            return;
        }
        debug_assert!(done > before, "a block's done clock never goes back");
        out.push(Action::Checkpoint { dir: plan.dir.clone(), clock: done, state: o.block.state() });
        self.checkpoint_writes += 1;
        let parked = std::mem::take(&mut o.checkpoint_parked);
        self.serve_parked(now_us, parked, out);
    }

    /// A block of checkpoint `clock` is on disk (or not): tell the scheduler.
    pub(super) fn checkpoint_written(
        &mut self,
        clock: Clock,
        block: BlockId,
        result: Result<CheckpointEntry, String>,
        out: &mut Vec<Action>,
    ) {
        self.checkpoint_writes = self.checkpoint_writes.saturating_sub(1);
        match result {
            Ok(entry) => out.push(Action::ToScheduler {
                request_id: 0,
                msg: Control::CheckpointWritten { clock, blocks: vec![entry] }.into(),
            }),
            Err(error) => {
                tracing::warn!(server = self.id, clock, block, %error, "checkpoint block not written; that checkpoint stays incomplete")
            }
        }
    }
}
