//! Registration and the blocks assigned: the scheduler's `Welcome`, an `Assign` (its
//! blocks built from the model, or read from the checkpoint the job resumes from).

use std::collections::BTreeMap;

use elasticps_core::block::{Block, BlockState};
use elasticps_core::model::BlockId;
use elasticps_wire::{Assignment, CheckpointEntry, CheckpointPlan, Control, Message};

use super::{Action, Exit, Owned, Server, Shard, Slot};

impl Server {
    pub(super) fn welcome(&mut self, msg: Message, out: &mut Vec<Action>) {
        self.register_deadline_us = None;
        match msg {
            Message::Control(Control::Welcome { node_id, credential, .. }) => {
                self.id = Some(node_id);
                self.credential = Some(credential);
                tracing::info!(server = node_id, addr = %self.data_addr, "server registered");
            }
            Message::Error(e) => {
                self.exit(Exit::Failed { reason: format!("scheduler answered {:?}: {}", e.code, e.message) }, out)
            }
            other => self.exit(
                Exit::Failed {
                    reason: format!("protocol error with scheduler: expected Welcome, got {:?}", other.kind()),
                },
                out,
            ),
        }
    }

    pub(super) fn assign(&mut self, now_us: u64, a: Assignment, out: &mut Vec<Action>) {
        if let Some(CheckpointPlan { dir, resume: Some(r), .. }) = &self.checkpoint {
            // The blocks come from the checkpoint: read them first.
            let mine: Vec<BlockId> = a.placement.blocks_of(a.server_id).collect();
            let blocks: Vec<CheckpointEntry> = r.blocks.iter().filter(|e| mine.contains(&e.block)).cloned().collect();
            if let Some(b) = mine.iter().find(|b| !blocks.iter().any(|e| e.block == **b)) {
                let reason = format!(
                    "the checkpoint of clock {} in {dir} has no block {b}: resume with the same model and \
                     --block-bytes",
                    r.clock
                );
                return self.exit(Exit::Failed { reason }, out);
            }
            out.push(Action::Restore { dir: dir.clone(), blocks });
            self.restoring = Some(a);
            return;
        }
        let mut slots = BTreeMap::new();
        let built: Result<(), elasticps_core::CoreError> = (|| {
            for b in a.placement.blocks_of(a.server_id) {
                let spec = *a.partition.block(b)?;
                let block = match a.partition.row_rule(b, a.seed)? {
                    Some(rule) => Block::new_rows(spec, rule, &a.config)?,
                    None => Block::new(spec, a.partition.init_values(b, a.seed)?, &a.config)?,
                };
                slots.insert(b, Slot::Owned(Owned::serving(block, 0)));
            }
            Ok(())
        })();
        match built {
            Ok(()) => self.take_assignment(now_us, a, slots, out),
            Err(e) => self.exit(Exit::Failed { reason: e.to_string() }, out),
        }
    }

    /// The blocks of the checkpoint the job resumes from, read for the assignment waiting.
    pub(super) fn restored(&mut self, now_us: u64, states: Result<Vec<BlockState>, String>, out: &mut Vec<Action>) {
        let Some(a) = self.restoring.take() else { return };
        let clock = self.checkpoint.as_ref().and_then(|p| p.resume.as_ref()).map_or(0, |r| r.clock);
        let shard = Shard::new(&a);
        let built: Result<BTreeMap<BlockId, Slot>, String> = states.and_then(|states| {
            let mut slots = BTreeMap::new();
            for state in states {
                let id = state.spec.id;
                let spec = a.partition.block(id).map_err(|e| e.to_string())?;
                if *spec != state.spec {
                    return Err(format!(
                        "block {id} of the checkpoint is {:?}, the model's is {:?}: resume with the same model and \
                         --block-bytes",
                        state.spec, spec
                    ));
                }
                if state.clocks.done() != clock {
                    return Err(format!(
                        "block {id} of the checkpoint is at clock {}, not {clock}",
                        state.clocks.done()
                    ));
                }
                let config = shard.config_for(spec);
                let block = Block::from_state(state, &[], &config).map_err(|e| {
                    format!("block {id} of the checkpoint does not fit this job ({e}): resume with the same workers")
                })?;
                slots.insert(id, Slot::Owned(Owned::serving(block, 0)));
            }
            Ok(slots)
        });
        match built {
            Ok(slots) => {
                tracing::info!(
                    server = a.server_id,
                    clock,
                    blocks = slots.len(),
                    "blocks restored from the checkpoint"
                );
                self.take_assignment(now_us, a, slots, out)
            }
            Err(e) => self.exit(Exit::Failed { reason: format!("cannot resume from the checkpoint: {e}") }, out),
        }
    }

    /// Serves `slots`, the blocks of assignment `a`.
    pub(super) fn take_assignment(
        &mut self,
        now_us: u64,
        a: Assignment,
        slots: BTreeMap<BlockId, Slot>,
        out: &mut Vec<Action>,
    ) {
        let shard = Shard::new(&a);
        if a.inject.bandwidth_bps > 0 || a.inject.interference > 1.0 {
            tracing::info!(
                server = a.server_id,
                bandwidth_bps = a.inject.bandwidth_bps,
                interference = a.inject.interference,
                after_s = a.inject.at_us as f64 / 1e6,
                "straggler injection"
            );
        }
        let copies = a.placement.backups_on(a.server_id).count();
        tracing::info!(server = a.server_id, blocks = slots.len(), copies, sync = %shard.config.sync, "blocks assigned");
        self.assign_copies(&a.placement, a.server_id);
        self.shard = Some(shard);
        self.slots = slots;
        self.incoming.clear();
        self.removed_workers.clear();
        self.added_workers.clear();
        self.counters.departed = Default::default();
        self.counters.departed_hold = Default::default();
        self.counters.departed_rows = Default::default();
        self.last_report_us = now_us;
        let server_id = self.id.unwrap_or(a.server_id);
        out.push(Action::ToScheduler { request_id: 0, msg: Control::AssignDone { server_id }.into() });
    }
}
