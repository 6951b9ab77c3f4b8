//! `elasticps export` at a server (docs/PROTOCOL.md §6.14): one page of a block it owns,
//! for serving. A row block answers its rows pushed since the asker's `since` (the
//! block's `steps` of the previous export), in ascending id order, a bounded page at a
//! time; a dense block answers its whole values. A block not served here is answered
//! `Moved` (to no server once it was split: the layout has its halves); one migrating is
//! answered `NotReady` (its copy at the new owner would not know it was exported, so a
//! later eviction there could go unreported).

use elasticps_core::CoreError;
use elasticps_core::model::BlockId;
use elasticps_wire::{Control, ErrorCode, Message};

use super::config::{Refusal, error};
use super::{Phase, Server, Slot};

/// At most this many rows in one `ExportedBlock` reply.
pub const EXPORT_PAGE_ROWS: usize = 65_536;
/// At most about this many bytes of ids and values in one `ExportedBlock` reply (fewer
/// rows per page for wide rows; at least one row).
pub const EXPORT_PAGE_BYTES: usize = 8 << 20;

/// Rows per page for rows of `dim` values, with replies of at most `max_payload` bytes:
/// within [`EXPORT_PAGE_ROWS`] and [`EXPORT_PAGE_BYTES`] (half the payload limit if that
/// is smaller, leaving room for the first page's deleted keys), at least 1.
pub fn page_rows(dim: u32, max_payload: u64) -> usize {
    let row_bytes = 8 + 4 * u64::from(dim.max(1));
    let budget = (EXPORT_PAGE_BYTES as u64).min(max_payload / 2);
    usize::try_from(budget / row_bytes).unwrap_or(usize::MAX).clamp(1, EXPORT_PAGE_ROWS)
}

impl Server {
    /// The answer to `ExportBlock` of `block`: a page, `Moved`, `NotReady` (no assignment
    /// yet, or the block migrates: try again) or `BadRequest` (a `since` older than the
    /// evictions the block remembers, a dense block too large for one reply).
    pub(super) fn export_request(&mut self, block: BlockId, since: Option<u64>, after: Option<u64>) -> Message {
        let max_payload = self.max_payload;
        let Some(shard) = self.shard.as_ref() else { return Refusal::NotReady.reply(block) };
        let o = match self.slots.get_mut(&block) {
            Some(Slot::Owned(o)) => o,
            Some(Slot::Gone { .. }) | None => return shard.refusal(block).reply(block),
        };
        if !matches!(o.phase, Phase::Serving) {
            return error(ErrorCode::NotReady, format!("block {block} is migrating: export it again once it moved"));
        }
        let spec = *o.block.spec();
        let Some((_, _, dim)) = spec.row_range() else {
            let values = o.block.values();
            if (values.len() as u64).saturating_mul(4) > max_payload {
                let message = format!(
                    "dense block {block} holds {} bytes, more than one reply may carry ({max_payload}): raise \
                     --max-frame-mib",
                    values.len() * 4
                );
                return error(ErrorCode::BadRequest, message);
            }
            let values = values.as_ref().clone();
            return Control::ExportedBlock { block, steps: 0, ids: Vec::new(), values, deleted: Vec::new(), more: false }
                .into();
        };
        match o.block.export_rows(since, after, page_rows(dim, max_payload)) {
            Ok(page) => {
                if after.is_none() {
                    tracing::debug!(server = shard.id, block, ?since, steps = page.steps, rows = page.ids.len(), deleted = page.deleted.len(), more = page.more, "block exported");
                }
                Control::ExportedBlock {
                    block,
                    steps: page.steps,
                    ids: page.ids,
                    values: page.values,
                    deleted: page.deleted,
                    more: page.more,
                }
                .into()
            }
            Err(e @ CoreError::ExportTooOld { .. }) => {
                tracing::warn!(server = shard.id, block, ?since, error = %e, "export refused");
                error(ErrorCode::BadRequest, format!("block {block}: {e}"))
            }
            Err(e) => error(ErrorCode::BadRequest, format!("block {block}: {e}")),
        }
    }
}
