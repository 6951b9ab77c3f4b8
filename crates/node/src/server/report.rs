//! What the server reports: its final stats, the metrics snapshot, and the load reports
//! the scheduler's balancer reads.

use std::collections::BTreeMap;

use elasticps_core::placement::ServerId;
use elasticps_wire::{RowBlockLoad, ServerLoad, ServerStats};

use super::counters::Sum;
use super::{Server, ServerSnapshot, Shard, Slot, staleness_bound};

impl Server {
    /// The server's counters (final report), under its registered id.
    pub fn stats(&self) -> ServerStats {
        self.stats_as(self.id.unwrap_or(u32::MAX))
    }

    /// The counters as the metrics show them.
    pub fn metrics_snapshot(&self) -> ServerSnapshot {
        let c = self.sum();
        let (server_id, sync, staleness_bound) = match &self.shard {
            Some(s) => (Some(s.id), Some(s.config.sync), staleness_bound(s.config.sync, s.staleness())),
            None => (None, None, 0),
        };
        ServerSnapshot {
            server_id,
            sync,
            staleness_bound,
            blocks: c.blocks,
            bytes: c.bytes,
            totals: c.totals,
            hold: c.hold.buckets().to_vec(),
            migrations_in: self.counters.migrations_in,
            migrations_out: self.counters.migrations_out,
        }
    }

    /// The load since the last call (counters reset), over `interval_us`.
    pub fn take_load(&mut self, interval_us: u64) -> ServerLoad {
        let (mut blocks, mut bytes) = (0, 0);
        let mut row_blocks = Vec::new();
        let mut rows_seen = BTreeMap::new();
        for (id, slot) in &self.slots {
            if let Slot::Owned(o) = slot {
                blocks += 1;
                bytes += o.block.spec().bytes() as u64;
                if o.block.spec().is_rows() {
                    let now = *o.block.stats();
                    // A block that arrived again since counts from zero.
                    let before = self.counters.rows_seen.get(id).filter(|b| b.pushes <= now.pushes).copied();
                    let before = before.unwrap_or_default();
                    let load = RowBlockLoad {
                        block: *id,
                        pushes: now.pushes - before.pushes,
                        pulls: now.pulls.saturating_sub(before.pulls),
                        rows: now.rows.saturating_sub(before.rows),
                        bytes_in: now.bytes_in.saturating_sub(before.bytes_in),
                        bytes_out: now.bytes_out.saturating_sub(before.bytes_out),
                        split_at: o.block.split_hint().unwrap_or(0),
                    };
                    if load.pushes + load.pulls > 0 {
                        row_blocks.push(load);
                    }
                    rows_seen.insert(*id, now);
                }
            }
        }
        let c = &mut self.counters;
        c.rows_seen = rows_seen;
        // Spins of the injected interference on several threads overlap: the busy time an
        // interval can hold back is at most the interval.
        let rx = c.capacity.take(c.busy_us.min(interval_us));
        ServerLoad {
            server_id: self.id.unwrap_or(u32::MAX),
            interval_us,
            bytes_in: std::mem::take(&mut c.bytes_in),
            bytes_out: std::mem::take(&mut c.bytes_out),
            requests: std::mem::take(&mut c.requests),
            busy_us: std::mem::take(&mut c.busy_us),
            shaped_us: std::mem::take(&mut c.shaped_us),
            blocks,
            bytes,
            rx_bps: rx.map_or(0.0, |m| m.bps),
            rx_frames: rx.map_or(0, |m| m.frames),
            row_blocks,
        }
    }

    pub(super) fn stats_as(&self, id: ServerId) -> ServerStats {
        let Sum { blocks, bytes, totals, hold } = self.sum();
        let sync = self.shard.as_ref().map_or_else(String::new, Shard::policy_name);
        ServerStats { server_id: id, sync, blocks, bytes, totals, hold_p99_us: hold.quantile(0.99) }
    }

    /// The counters summed over the owned blocks and the blocks that left.
    pub(super) fn sum(&self) -> Sum {
        let mut c = Sum::default();
        if self.shard.is_none() {
            return c;
        }
        for slot in self.slots.values() {
            if let Slot::Owned(o) = slot {
                c.totals.merge(o.block.stats());
                c.hold.merge(o.block.hold_histogram());
                c.blocks += 1;
                c.bytes += o.block.spec().bytes() as u64;
            }
        }
        c.totals.merge(&self.counters.departed);
        c.hold.merge(&self.counters.departed_hold);
        c
    }
}
