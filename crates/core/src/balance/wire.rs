//! Rule 5c, **compress a bandwidth-bound straggler** (opt-in: `--balance-compress bf16`,
//! [`super::BalanceParams::compress`]). Lowering a straggling server's traffic by sending
//! its blocks in a narrower dtype is cheaper than moving them: nothing migrates, and the
//! server keeps its f32 master values (it widens what arrives, rounds what it answers).
//!
//! - **The model sees wire bytes.** A block's load is its bytes on the wire: its f32 size
//!   times its layout dtype's width over 4 ([`wire_sizes`]; [`super::View::wire`]), and a
//!   server's rate is measured in wire bytes (the payload bytes of its frames over their
//!   time), so `T_j = wire bytes / rate_j` halves when a bandwidth-bound server's blocks
//!   travel in bf16, and stays put when its CPU is the limit (its measured rate halves
//!   with its bytes).
//! - **Only what bytes cost.** A server's time per interval is the longer of its frames'
//!   time on the link and its handling time ([`super::View::fixed_share`], the handling
//!   time over that longer time: 1 when the CPU or the fixed cost per request is the
//!   limit). Compression shortens only the link's part: the predicted time after is
//!   `max(T_j' , fixed_share_j * T_j)` with `T_j'` the service time of the narrower
//!   bytes. A server without a measured share is not compressed, nor one whose share is
//!   above [`MAX_FIXED_SHARE`].
//! - **The decision** ([`compress_plan`], pure): the worst lasting straggler whose blocks
//!   are not all narrow yet, not held off, gets every one of its blocks set to the dtype
//!   when that lowers the max service time by `min_gain` and [`super::MIN_ITER_GAIN`] of
//!   the iteration time, and by at least as much as the migration round rule 5 would make
//!   (or rule 5 has none). Post-condition ([`compressed`]): every block named is owned by
//!   the server and wider than the dtype, named once, and the max is not worse.
//! - **Judged like the others** (rule 2): measured over windows before and after, kept or
//!   reverted (the blocks back to f32); a revert doubles the cool-down and holds that
//!   server's compression off for [`super::REVERT_HOLDOFF_US`], doubling.

use std::collections::{BTreeMap, BTreeSet};

use super::loads::{EPS, Loads};
use super::{Balancer, Decision, MIN_ITER_GAIN, Proposal, Round};
use crate::dtype::Dtype;
use crate::model::BlockId;
use crate::placement::{Placement, ServerId};

/// A server whose handling time is more than this share of its measured time is bound by
/// its CPU or its per-request cost, not its link: compressing its traffic saves little.
pub const MAX_FIXED_SHARE: f64 = 0.5;

/// The wire dtype of `block` in `wire` (f32 past its end).
pub fn dtype_of(wire: &[Dtype], block: BlockId) -> Dtype {
    wire.get(block as usize).copied().unwrap_or_default()
}

/// Each block's bytes on the wire: `sizes` (f32 bytes) times its dtype's width over 4.
pub fn wire_sizes(sizes: &[u64], wire: &[Dtype]) -> Vec<u64> {
    sizes.iter().enumerate().map(|(b, &s)| s / 4 * dtype_of(wire, b as BlockId).width() as u64 + s % 4).collect()
}

/// A server's blocks to send in a narrower dtype, with the model's prediction.
#[derive(Clone, Debug, PartialEq)]
pub struct Compression {
    /// The straggler.
    pub server: ServerId,
    /// Its blocks wider than the dtype, in id order.
    pub blocks: Vec<BlockId>,
    /// The dtype they are to travel in.
    pub dtype: Dtype,
    /// Max service time over the servers before and predicted after, s.
    pub max_before: f64,
    /// Predicted max service time after.
    pub max_after: f64,
    /// The server's service time before and predicted after, s.
    pub t_before: f64,
    /// Its predicted service time after.
    pub t_after: f64,
}

/// **The decision** for `server`: its blocks wider than `dtype`, and the service times
/// predicted if they travelled in `dtype`. `sizes` are wire bytes ([`wire_sizes`] of the
/// current dtypes), `fixed_share` the share of the server's time that bytes do not cost
/// (see the module doc). `None` if it has no such block, or its share is unknown or above
/// [`MAX_FIXED_SHARE`] (its CPU, not its link, is the limit).
pub fn compress_plan(
    placement: &Placement,
    sizes: &[u64],
    servers: &[ServerId],
    rates: &BTreeMap<ServerId, f64>,
    (wire, dtype): (&[Dtype], Dtype),
    fixed_share: &BTreeMap<ServerId, f64>,
    server: ServerId,
) -> Option<Compression> {
    let share = fixed_share.get(&server).copied().filter(|s| s.is_finite())?.clamp(0.0, 1.0);
    if share > MAX_FIXED_SHARE {
        return None;
    }
    let loads = Loads::new(placement, sizes, servers, rates);
    let i = loads.index(server)?;
    let blocks: Vec<BlockId> = placement
        .blocks_of(server)
        .filter(|&b| dtype_of(wire, b).width() > dtype.width() && sizes.get(b as usize).is_some_and(|&s| s > 0))
        .collect();
    if blocks.is_empty() {
        return None;
    }
    let saved: u64 = blocks
        .iter()
        .map(|&b| {
            let now = sizes[b as usize];
            now - now / dtype_of(wire, b).width() as u64 * dtype.width() as u64
        })
        .sum();
    let t_before = loads.time(i);
    let narrow = (loads.bytes[i] - saved) as f64 / loads.rate[i];
    let t_after = narrow.max(share * t_before);
    let others = (0..loads.ids.len()).filter(|&k| k != i).map(|k| loads.time(k)).fold(0.0, f64::max);
    let plan = Compression {
        server,
        blocks,
        dtype,
        max_before: loads.max_time(),
        max_after: others.max(t_after),
        t_before,
        t_after,
    };
    debug_assert_eq!(compressed(placement, wire, &plan), Ok(()), "compress: {plan:?}");
    Some(plan)
}

/// The post-condition of [`compress_plan`]: every block named is owned by the server and
/// wider than the dtype, each once, and the predicted max is not above the max before.
pub fn compressed(placement: &Placement, wire: &[Dtype], plan: &Compression) -> Result<(), String> {
    let mut seen = BTreeSet::new();
    for &b in &plan.blocks {
        if !seen.insert(b) {
            return Err(format!("block {b} named twice"));
        }
        if placement.owner(b) != Some(plan.server) {
            return Err(format!("block {b} is not server {}'s", plan.server));
        }
        if dtype_of(wire, b).width() <= plan.dtype.width() {
            return Err(format!("block {b} already travels in {}", dtype_of(wire, b).name()));
        }
    }
    if plan.max_after > plan.max_before * (1.0 + EPS) || plan.t_after > plan.t_before * (1.0 + EPS) {
        return Err(format!("max service time rose from {} to {}", plan.max_before, plan.max_after));
    }
    Ok(())
}

impl Balancer {
    /// Rule 5c: compress the worst lasting straggler's blocks when the flag allows it and
    /// that does at least as well as `round_plan`, the migration round of rule 5 (if any).
    pub(super) fn compress(&self, round: &Round, round_plan: Option<&Proposal>) -> Option<Compression> {
        let dtype = self.params.compress?;
        let Round { view, servers, rates, loads, straggling } = *round;
        let now = view.now_us;
        let least = self.baseline(now).span_us(super::STRAGGLE_MIN_US);
        let mut candidates: Vec<(f64, ServerId)> = straggling
            .iter()
            .filter(|id| self.straggling_since.get(id).is_some_and(|&t| now >= t.saturating_add(least)))
            .filter(|id| self.compress_after_us.get(id).is_none_or(|h| now >= h.0))
            .filter_map(|&id| loads.index(id).map(|i| (loads.time(i), id)))
            .collect();
        candidates.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let iteration = self.mean_us(&self.baseline);
        for (_, id) in candidates {
            let Some(c) =
                compress_plan(view.placement, view.sizes, servers, rates, (view.wire, dtype), view.fixed_share, id)
            else {
                continue;
            };
            let gain = c.max_before - c.max_after;
            if c.max_before <= 0.0 || gain / c.max_before < self.params.min_gain {
                continue;
            }
            if iteration.is_some_and(|it| gain * 1e6 < MIN_ITER_GAIN * it) {
                continue;
            }
            // A migration round that does better is made instead (rule 5).
            if round_plan.is_some_and(|p| p.max_after < c.max_after * (1.0 - EPS)) {
                continue;
            }
            return Some(c);
        }
        None
    }

    /// A compression becomes a decision under judgement (rule 2).
    pub(super) fn propose_compress(&mut self, view: &super::View, c: Compression) -> Decision {
        let why = format!(
            "compress server {} to {}: {} blocks, its service time {:.1} ms -> {:.1} ms, max {:.1} ms -> {:.1} ms",
            c.server,
            c.dtype.name(),
            c.blocks.len(),
            c.t_before * 1e3,
            c.t_after * 1e3,
            c.max_before * 1e3,
            c.max_after * 1e3
        );
        let p = Proposal { moves: Vec::new(), why, max_before: c.max_before, max_after: c.max_after, probe: false };
        let why = self.propose_with(view, p, Some((c.server, c.blocks.clone())));
        Decision::Wire { blocks: c.blocks, dtype: c.dtype, why }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rates(pairs: &[(ServerId, f64)]) -> BTreeMap<ServerId, f64> {
        pairs.iter().copied().collect()
    }

    #[test]
    fn wire_sizes_halve_the_bf16_blocks_only() {
        assert_eq!(wire_sizes(&[400, 400, 6], &[Dtype::F32, Dtype::Bf16]), vec![400, 200, 6]);
        assert_eq!(wire_sizes(&[400], &[]), vec![400]);
        assert_eq!(dtype_of(&[Dtype::Bf16], 3), Dtype::F32);
    }

    #[test]
    fn a_bandwidth_bound_straggler_is_compressed_a_cpu_bound_one_is_not() {
        // Server 1 is 4x slower on its link: 400 bytes at 100 B/s = 4 s; the others 1 s.
        let p = Placement::new(1, vec![0, 1, 2]);
        let sizes = [400, 400, 400];
        let r = rates(&[(0, 400.0), (1, 100.0), (2, 400.0)]);
        let low: BTreeMap<ServerId, f64> = [(1, 0.1)].into_iter().collect();
        let c = compress_plan(&p, &sizes, &[0, 1, 2], &r, (&[], Dtype::Bf16), &low, 1).expect("bandwidth-bound");
        assert_eq!(c.blocks, vec![1]);
        assert!((c.t_before - 4.0).abs() < 1e-9 && (c.t_after - 2.0).abs() < 1e-9, "{c:?}");
        assert!((c.max_after - 2.0).abs() < 1e-9);
        // Its handling time is 90% of its time: compressing saves 10% at most.
        let cpu: BTreeMap<ServerId, f64> = [(1, 0.9)].into_iter().collect();
        assert_eq!(compress_plan(&p, &sizes, &[0, 1, 2], &r, (&[], Dtype::Bf16), &cpu, 1), None);
        // Unknown share: not compressed.
        assert_eq!(compress_plan(&p, &sizes, &[0, 1, 2], &r, (&[], Dtype::Bf16), &BTreeMap::new(), 1), None);
        // A share below the bound caps the gain: 40% of 4 s is left whatever the bytes.
        let some: BTreeMap<ServerId, f64> = [(1, 0.4)].into_iter().collect();
        let c = compress_plan(&p, &sizes, &[0, 1, 2], &r, (&[], Dtype::Bf16), &some, 1).unwrap();
        assert!((c.t_after - 2.0).abs() < 1e-9, "max(2 s, 0.4 x 4 s): {c:?}");
        // Already bf16: nothing left to compress.
        let wire = [Dtype::F32, Dtype::Bf16];
        let halved = wire_sizes(&sizes, &wire);
        assert_eq!(compress_plan(&p, &halved, &[0, 1, 2], &r, (&wire, Dtype::Bf16), &low, 1), None);
    }

    #[test]
    fn the_post_condition_wants_owned_wider_blocks_and_no_worse_max() {
        let p = Placement::new(1, vec![0, 1]);
        let ok = Compression {
            server: 1,
            blocks: vec![1],
            dtype: Dtype::Bf16,
            max_before: 2.0,
            max_after: 1.0,
            t_before: 2.0,
            t_after: 1.0,
        };
        assert_eq!(compressed(&p, &[], &ok), Ok(()));
        assert!(compressed(&p, &[], &Compression { blocks: vec![0], ..ok.clone() }).unwrap_err().contains("not"));
        assert!(compressed(&p, &[], &Compression { blocks: vec![1, 1], ..ok.clone() }).unwrap_err().contains("twice"));
        assert!(compressed(&p, &[Dtype::F32, Dtype::Bf16], &ok).unwrap_err().contains("already"));
        assert!(compressed(&p, &[], &Compression { max_after: 3.0, ..ok }).unwrap_err().contains("rose"));
    }
}
