//! Splitting a hot row block in place (docs/PROTOCOL.md, `SplitBlock`; DESIGN.md §4).
//!
//! The owner cuts the block's state in two at a row ([`BlockState::split_rows`](elasticps_core::block::BlockState::split_rows): each half
//! keeps its rows with their optimizer state and the whole clock state, so a push the
//! block took is a duplicate on either half), serves the halves under the model's next
//! two ids, and answers every request for the old id (and the pulls it held) `Moved` to
//! no server at the split's epoch: the worker refreshes its layout and sends the row
//! round again to the halves. It reports with `SplitDone`; every other server learns of
//! the recorded split from the scheduler and follows it in its model and placement. All
//! or nothing: a refused split changes nothing.

use elasticps_core::block::Block;
use elasticps_core::model::BlockId;
use elasticps_core::placement::{RETIRED, split_row_block};
use elasticps_wire::Control;

use super::{Action, Owned, Parked, Phase, Request, Server, Slot};

impl Server {
    /// `SplitBlock` from the scheduler: not `recorded`, split the block if it is served
    /// here and report either way; `recorded`, follow the split another server did.
    pub(super) fn split_block(
        &mut self,
        now_us: u64,
        (block, at, epoch): (BlockId, u64, u64),
        recorded: bool,
        out: &mut Vec<Action>,
    ) {
        if recorded {
            return self.follow_split(block, at, epoch);
        }
        let error = match self.slots.get(&block) {
            Some(Slot::Owned(_)) => self.split_here(now_us, block, at, epoch, out).err(),
            Some(Slot::Gone { owner: RETIRED, .. }) => Some(format!("block {block} was split here already")),
            _ => Some(format!("block {block} is not served here")),
        };
        if let Some(e) = &error {
            tracing::warn!(server = self.id, block, at, error = %e, "split refused");
        }
        out.push(Action::ToScheduler { request_id: 0, msg: Control::SplitDone { block, at, epoch, error }.into() });
    }

    /// The scheduler recorded the split of `block` at `at` on its owner: this server's
    /// model and placement follow (once; a block split already is left as it is).
    fn follow_split(&mut self, block: BlockId, at: u64, epoch: u64) {
        let Some(shard) = self.shard.as_mut() else { return };
        if shard.partition.block(block).is_ok_and(|b| b.is_retired()) {
            return;
        }
        match split_row_block(&shard.partition, &shard.placement, block, at, epoch) {
            Ok((partition, placement, halves)) => {
                tracing::debug!(server = shard.id, block, at, epoch, ?halves, "a row block split elsewhere");
                shard.partition = partition;
                shard.placement = placement;
            }
            Err(e) => tracing::warn!(server = shard.id, block, at, epoch, error = %e, "a recorded split not followed"),
        }
    }

    /// The owner's split of `block` at row `at`; why not, if it cannot (nothing changed).
    fn split_here(
        &mut self,
        now_us: u64,
        block: BlockId,
        at: u64,
        epoch: u64,
        out: &mut Vec<Action>,
    ) -> Result<(), String> {
        let Some(shard) = self.shard.as_ref() else { return Err("no blocks assigned yet".into()) };
        let Some(Slot::Owned(o)) = self.slots.get(&block) else {
            return Err(format!("block {block} is not served here"));
        };
        if !matches!(o.phase, Phase::Serving) {
            return Err(format!("block {block} is migrating"));
        }
        if !o.checkpoint_parked.is_empty() {
            return Err(format!("pushes to block {block} wait for a checkpoint"));
        }
        if !shard.placement.backups_of(block).is_empty() {
            return Err(format!("block {block} has backups: a replicated block is not split"));
        }
        let (partition, placement, [left, right]) =
            split_row_block(&shard.partition, &shard.placement, block, at, epoch).map_err(|e| e.to_string())?;
        let (ls, rs) =
            (*partition.block(left).map_err(|e| e.to_string())?, *partition.block(right).map_err(|e| e.to_string())?);
        let (lc, rc) = (shard.config_for(&ls), shard.config_for(&rs));
        let halves = o
            .block
            .state()
            .split_rows(ls, rs)
            .and_then(|(l, r)| Ok((Block::from_state(l, &[], &lc)?, Block::from_state(r, &[], &rc)?)));
        let (l, r) = halves.map_err(|e| e.to_string())?;
        // Nothing can fail from here on.
        let Some(Slot::Owned(mut old)) = self.slots.insert(block, Slot::Gone { owner: RETIRED, epoch }) else {
            return Ok(());
        };
        self.slots.insert(left, Slot::Owned(Owned::new(l, epoch, Phase::Serving)));
        self.slots.insert(right, Slot::Owned(Owned::new(r, epoch, Phase::Serving)));
        self.counters.rows_seen.remove(&block);
        // The halves count from zero: what the block did stays counted here.
        if let Some(r) = old.block.rows() {
            super::counters::add_rows(&mut self.counters.departed_rows, &r.counters());
        }
        if let Some(shard) = self.shard.as_mut() {
            shard.partition = partition;
            shard.placement = placement;
        }
        let held: Vec<Parked> = old
            .block
            .take_held()
            .into_iter()
            .map(|(to, rank, clock)| {
                self.held.let_go(&to);
                Parked { rank, to, request: Request::pull(clock) }
            })
            .collect();
        tracing::info!(server = self.id, block, at, epoch, left, right, held = held.len(), "row block split");
        // The pulls it held are answered `Moved` to no server: their workers pull again
        // from the halves.
        self.serve_parked(now_us, held, out);
        Ok(())
    }
}
