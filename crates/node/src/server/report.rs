//! What the server reports: its final stats, the metrics snapshot, and the load reports
//! the scheduler's balancer reads.

use std::collections::BTreeMap;

use elasticps_core::placement::ServerId;
use elasticps_core::rows::RowStore;
use elasticps_wire::{RowBlockLoad, ServerLoad, ServerStats};

use super::counters::{Sum, add_rows};
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
            rows: c.rows,
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
                    let store = o.block.rows();
                    let rows_now = store.map(RowStore::counters).unwrap_or_default();
                    // A block that arrived again since counts from zero.
                    let (before, rows_before) = self
                        .counters
                        .rows_seen
                        .get(id)
                        .filter(|b| b.0.pushes <= now.pushes)
                        .copied()
                        .unwrap_or_default();
                    let load = RowBlockLoad {
                        block: *id,
                        pushes: now.pushes - before.pushes,
                        pulls: now.pulls.saturating_sub(before.pulls),
                        rows: now.rows.saturating_sub(before.rows),
                        bytes_in: now.bytes_in.saturating_sub(before.bytes_in),
                        bytes_out: now.bytes_out.saturating_sub(before.bytes_out),
                        split_at: o.block.split_hint().unwrap_or(0),
                        live_rows: store.map_or(0, |r| r.rows() as u64),
                        row_bytes: store.map_or(0, row_bytes),
                        evicted: rows_now.evicted.saturating_sub(rows_before.evicted),
                        expired: rows_now.expired.saturating_sub(rows_before.expired),
                        refused_grads: rows_now.refused_grads.saturating_sub(rows_before.refused_grads),
                        init_reads: rows_now.init_reads.saturating_sub(rows_before.init_reads),
                    };
                    if load.pushes + load.pulls + load.live_rows > 0 {
                        row_blocks.push(load);
                    }
                    rows_seen.insert(*id, (now, rows_now));
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
        let Sum { blocks, bytes, totals, hold, .. } = self.sum();
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
                if let Some(r) = o.block.rows() {
                    c.rows.live_rows += r.rows() as u64;
                    add_rows(&mut c.rows.counters, &r.counters());
                }
            }
        }
        c.totals.merge(&self.counters.departed);
        c.hold.merge(&self.counters.departed_hold);
        add_rows(&mut c.rows.counters, &self.counters.departed_rows);
        c
    }
}

/// Bytes one live row of `store` holds: its values and its optimizer's state (f32 each).
fn row_bytes(store: &RowStore) -> u64 {
    (store.dim() * (1 + store.rule().optimizer.state_per_value()) * 4) as u64
}
