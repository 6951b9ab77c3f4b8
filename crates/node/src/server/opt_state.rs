//! A worker reads or replaces a block's optimizer state (`GetOptState`, `SetOptState`),
//! or overwrites its values (`SetValues`) (docs/PROTOCOL.md §6.13): what a PyTorch
//! optimizer's `state_dict` and `load_state_dict` carry, and a model's buffers. A tensor's
//! optimizer changes only by the scheduler's `SetOptimizer`, which every server applies.

use elasticps_core::CoreError;
use elasticps_core::block::Block;
use elasticps_core::model::BlockId;
use elasticps_core::optimizer::{OptState, TensorOptimizer};
use elasticps_wire::{Control, ErrorCode, Message};

use super::config::{Refusal, error};
use super::{Action, Phase, Server, Slot, Token, not_taken};

impl Server {
    /// The scheduler's `SetOptimizer` (a worker's, recorded; sent to every server in the
    /// order recorded): applied to every push that arrives after it, and answered
    /// [`Control::OptimizerSet`] (also with no blocks yet: the `Assign` to come carries
    /// the scheduler's record; and when it cannot be applied, which the scheduler's own
    /// check of the same model makes impossible, logged).
    pub(super) fn scheduler_set_optimizer(&mut self, tensor: u32, optimizer: TensorOptimizer, out: &mut Vec<Action>) {
        match self.shard.as_mut().map(|shard| (shard.id, shard.set_optimizer(tensor, optimizer))) {
            Some((server, Ok(()))) => tracing::info!(server, tensor, ?optimizer, "tensor optimizer set"),
            Some((server, Err(e))) => {
                tracing::error!(server, tensor, error = %e, "the scheduler's tensor optimizer not applied")
            }
            None => tracing::debug!(server = self.id, tensor, "tensor optimizer set before the assignment"),
        }
        out.push(Action::ToScheduler { request_id: 0, msg: Control::OptimizerSet { tensor }.into() });
    }

    /// A worker's message about a block's optimizer state or values: its answer.
    pub(super) fn on_tensor(&mut self, rank: u32, control: Control) -> Message {
        match control {
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
