//! A worker reads or replaces a block's optimizer state (`GetOptState`, `SetOptState`),
//! or overwrites its values (`SetValues`) (docs/PROTOCOL.md §6.13): what a PyTorch
//! optimizer's `state_dict` and `load_state_dict` carry, and a model's buffers.

use elasticps_core::CoreError;
use elasticps_core::block::Block;
use elasticps_core::model::BlockId;
use elasticps_core::optimizer::OptState;
use elasticps_wire::{Control, ErrorCode, Message};

use super::config::{Refusal, error};
use super::{Phase, Server, Slot, Token, not_taken};

impl Server {
    /// A worker's message about a tensor's optimizer or a block's optimizer state or
    /// values: its answer.
    pub(super) fn on_tensor(&mut self, rank: u32, control: Control) -> Message {
        match control {
            Control::SetOptimizer { tensor, optimizer } => {
                let Some(shard) = self.shard.as_mut() else { return Refusal::NotReady.reply(0) };
                match shard.set_optimizer(tensor, optimizer) {
                    Ok(()) => {
                        tracing::info!(server = shard.id, rank, tensor, ?optimizer, "tensor optimizer set");
                        Control::Ok.into()
                    }
                    Err(e) => error(ErrorCode::BadRequest, e.to_string()),
                }
            }
            Control::GetOptState { block } => self.opt_state_request(rank, block, None),
            Control::SetOptState { block, state } => self.opt_state_request(rank, block, Some(state)),
            Control::SetValues { block, values } => self.set_values_request(rank, block, &values),
            other => not_taken(&other.into()),
        }
    }

    /// The answer to `GetOptState` (`set` None) or `SetOptState` of `block` from worker
    /// `rank`: the state, `Ok`, `Moved` (not served here), or an error naming why.
    pub(super) fn opt_state_request(&mut self, rank: u32, block: BlockId, set: Option<OptState>) -> Message {
        match set {
            None => self.read_block(block, |b| {
                b.opt_state().map(|state| Control::OptState { block, state: state.clone() }.into())
            }),
            Some(state) => self.change_block(rank, block, "optimizer state", |b| b.set_opt_state(state)),
        }
    }

    /// The answer to `SetValues` of `block` from worker `rank`.
    pub(super) fn set_values_request(&mut self, rank: u32, block: BlockId, values: &[f32]) -> Message {
        self.change_block(rank, block, "values", |b| b.set_values(values))
    }

    /// `read`'s answer from `block`, or why not (`Moved` when it is not served here).
    fn read_block(&self, block: BlockId, read: impl FnOnce(&Block<Token>) -> Result<Message, CoreError>) -> Message {
        let Some(shard) = self.shard.as_ref() else { return Refusal::NotReady.reply(block) };
        match self.slots.get(&block) {
            Some(Slot::Owned(o)) => read(&o.block).unwrap_or_else(|e| error(ErrorCode::BadRequest, e.to_string())),
            Some(Slot::Gone { .. }) | None => shard.refusal(block).reply(block),
        }
    }

    /// Applies `change` (of the block's `what`) to `block` and answers `Ok`, or why not:
    /// `Moved` when it is not served here, `NotReady` while it migrates (try again: a
    /// change after the snapshot would not reach the new owner), `BadRequest` for a block
    /// with backups (they would keep the old state, and a promotion bring it back) or a
    /// change the block refuses.
    fn change_block(
        &mut self,
        rank: u32,
        block: BlockId,
        what: &str,
        change: impl FnOnce(&mut Block<Token>) -> Result<(), CoreError>,
    ) -> Message {
        let Some(shard) = self.shard.as_ref() else { return Refusal::NotReady.reply(block) };
        let o = match self.slots.get_mut(&block) {
            Some(Slot::Owned(o)) => o,
            Some(Slot::Gone { .. }) | None => return shard.refusal(block).reply(block),
        };
        let refused = if !matches!(o.phase, Phase::Serving) {
            Some((ErrorCode::NotReady, "it is migrating: try again".to_string()))
        } else if !shard.placement.backups_of(block).is_empty() {
            Some((ErrorCode::BadRequest, "it has backups (--replicas), which would keep the old one".to_string()))
        } else {
            change(&mut o.block).err().map(|e| (ErrorCode::BadRequest, e.to_string()))
        };
        match refused {
            None => {
                tracing::debug!(server = shard.id, rank, block, what, "block changed by a worker");
                Control::Ok.into()
            }
            Some((code, why)) => {
                let refused = format!("the {what} of block {block}: not replaced, {why}");
                tracing::warn!(server = shard.id, rank, block, %refused, "block change refused");
                error(code, refused)
            }
        }
    }
}
