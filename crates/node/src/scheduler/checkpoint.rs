//! Checkpoints: the servers report the blocks of a checkpoint they wrote; once every block
//! of a clock is on disk, the scheduler has its manifest written, which makes it complete.

use elasticps_wire::{CheckpointEntry, Control};

use super::{Action, Caller, Role, Scheduler};

impl Scheduler {
    /// `CheckpointWritten`, from a server.
    pub(super) fn on_checkpoint(&mut self, call: Caller, control: Control, out: &mut Vec<Action>) {
        match (control, call.role) {
            (Control::CheckpointWritten { clock, blocks }, Some(Role::Server(_))) => {
                self.checkpoint_written(clock, blocks, out)
            }
            (other, _) => call.refuse_now(out, other),
        }
    }

    /// A server wrote blocks of checkpoint `clock`: once every block is written, the
    /// manifest makes it complete (and older checkpoints still under way are dropped).
    pub(super) fn checkpoint_written(&mut self, clock: u32, blocks: Vec<CheckpointEntry>, out: &mut Vec<Action>) {
        let (Some(plan), Some(partition)) = (&self.config.checkpoint, &self.partition) else { return };
        if self.last_checkpoint.is_some_and(|last| clock <= last) {
            return;
        }
        let written = self.checkpoints.entry(clock).or_default();
        for e in blocks {
            written.entry(e.block).or_insert(e);
        }
        if written.len() < partition.blocks.len() {
            return;
        }
        let blocks: Vec<CheckpointEntry> = self.checkpoints.remove(&clock).unwrap_or_default().into_values().collect();
        self.checkpoints.retain(|c, _| *c > clock);
        self.last_checkpoint = Some(clock);
        self.manifests_pending.insert(clock);
        tracing::info!(clock, blocks = blocks.len(), dir = %plan.dir, "checkpoint written by the servers; its manifest next");
        out.push(Action::WriteManifest { dir: plan.dir.clone(), clock, blocks });
    }

    /// The outcome of a manifest write: the checkpoint is complete, or (the error logged)
    /// it is not and a lost server's message names the one before it.
    pub(super) fn manifest_written(&mut self, clock: u32, error: Option<String>) {
        self.manifests_pending.remove(&clock);
        match error {
            None => {
                tracing::info!(clock, "checkpoint complete");
                self.complete_checkpoint = self.complete_checkpoint.max(Some(clock));
            }
            Some(error) => {
                tracing::error!(clock, %error, "checkpoint manifest not written: the checkpoint is incomplete")
            }
        }
    }
}
