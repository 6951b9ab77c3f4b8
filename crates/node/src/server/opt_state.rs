//! A worker reads or replaces a block's optimizer state (`GetOptState`, `SetOptState`;
//! docs/PROTOCOL.md §6.13): what a PyTorch optimizer's `state_dict` and `load_state_dict`
//! carry.

use elasticps_core::model::BlockId;
use elasticps_core::optimizer::OptState;
use elasticps_wire::{Control, ErrorCode, Message};

use super::config::{Refusal, error};
use super::{Phase, Server, Slot};

impl Server {
    /// The answer to `GetOptState` (`set` None) or `SetOptState` of `block` from worker
    /// `rank`: the state, `Ok`, `Moved` (not served here), or an error naming why (a
    /// row block, wrong lengths, a migration or replicas in the way of a change).
    pub(super) fn opt_state_request(&mut self, rank: u32, block: BlockId, set: Option<OptState>) -> Message {
        let Some(shard) = self.shard.as_ref() else { return Refusal::NotReady.reply(block) };
        let o = match self.slots.get_mut(&block) {
            Some(Slot::Owned(o)) => o,
            Some(Slot::Gone { .. }) | None => return shard.refusal(block).reply(block),
        };
        let Some(state) = set else {
            return match o.block.opt_state() {
                Ok(state) => Control::OptState { block, state: state.clone() }.into(),
                Err(e) => error(ErrorCode::BadRequest, e.to_string()),
            };
        };
        // A change must reach every copy: refused while the block moves or has backups
        // (a backup would keep the old state and a promotion would bring it back).
        let busy = if !matches!(o.phase, Phase::Serving) {
            Some("it is migrating: try again")
        } else if !shard.placement.backups_of(block).is_empty() {
            Some("it has backups (--replicas): the optimizer state of a replicated job cannot be replaced")
        } else {
            None
        };
        if let Some(why) = busy {
            let refused = format!("the optimizer state of block {block} was not replaced: {why}");
            tracing::warn!(server = shard.id, rank, block, %refused, "optimizer state refused");
            return error(ErrorCode::BadRequest, refused);
        }
        match o.block.set_opt_state(state) {
            Ok(()) => {
                tracing::debug!(server = shard.id, rank, block, "optimizer state replaced");
                Control::Ok.into()
            }
            Err(e) => error(ErrorCode::BadRequest, e.to_string()),
        }
    }
}
