//! What every rule reads: the bytes and rates of the servers under consideration
//! ([`Loads`]), the rank rule every move obeys ([`Loads::ranks_above`]), the greedy best
//! fit that [`super::rebalance`] and [`super::fill`] share, and the post-conditions every
//! plan of moves must meet ([`moved`], [`each_ranks_above`]).

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet};

use super::Move;
use crate::model::BlockId;
use crate::placement::{Placement, ServerId};
use crate::stats::median;

/// Moves ruled out for a while after a verdict undid a round (rule 2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Tabu {
    /// No block moves off this server: moving load off it did not pay (it was not the
    /// bottleneck the model took it for).
    From(ServerId),
    /// No block moves onto this server: a probe onto it slowed the job.
    Onto(ServerId),
    /// No block moves off this server onto one of unknown rate: such a move did not pay
    /// (its destination was slower than the median it was taken at, or the source was
    /// not the bottleneck; moves onto servers the model knows may still pay).
    FromOntoUnknown(ServerId),
    /// No block moves off the first server onto the second.
    Pair(ServerId, ServerId),
}

/// Relative tolerance of "strictly lower" comparisons of service times.
pub(super) const EPS: f64 = 1e-9;

/// Standard errors between a rate's pessimistic and optimistic ends in the rank rule
/// (the loads' `with_spread`): two rates closer than this are not told apart.
pub const RANK_Z: f64 = 3.0;

/// Largest relative spread [`Loads::with_spread`] gives a rate: a server known this
/// badly is taken at a tenth of its rate when it would receive.
pub(super) const MAX_SPREAD: f64 = 0.9;

/// Estimated seconds per iteration of each server in `servers`: sum of the bytes of its
/// blocks / its rate. A server without an estimate gets the median rate of the others
/// (optimistic; if none has one, 1.0 — then everything is relative). Blocks owned by a
/// server not in `servers` are not counted; `sizes[block]` missing counts as 0 bytes.
pub fn service_times(
    placement: &Placement,
    sizes: &[u64],
    servers: &[ServerId],
    rates: &BTreeMap<ServerId, f64>,
) -> BTreeMap<ServerId, f64> {
    Loads::new(placement, sizes, servers, rates).times()
}

/// Bytes and rates of the servers under consideration, by index into sorted ids.
#[derive(Clone, Debug)]
pub(super) struct Loads {
    /// The servers, sorted, without duplicates.
    pub(super) ids: Vec<ServerId>,
    /// Rate of each (bytes/s; a server without an estimate gets the median of the others).
    pub(super) rate: Vec<f64>,
    /// The rate, pessimistic: lowered by the estimate's relative standard error
    /// ([`Loads::with_spread`]); `rate` itself without one.
    pub(super) lo: Vec<f64>,
    /// The rate, optimistic: raised by the relative standard error.
    pub(super) hi: Vec<f64>,
    /// Bytes each owns.
    pub(super) bytes: Vec<u64>,
    /// Moves no rule makes now (rule 2).
    tabu: BTreeSet<Tabu>,
    /// Servers whose rate is unknown (no estimate: they run at the median rate).
    unknown: BTreeSet<ServerId>,
}

impl Loads {
    /// The loads of `servers` under `placement`.
    pub(super) fn new(
        placement: &Placement,
        sizes: &[u64],
        servers: &[ServerId],
        rates: &BTreeMap<ServerId, f64>,
    ) -> Self {
        let mut ids = servers.to_vec();
        ids.sort_unstable();
        ids.dedup();
        let valid = |s: &ServerId| rates.get(s).copied().filter(|r| r.is_finite() && *r > 0.0);
        let known: Vec<f64> = ids.iter().filter_map(valid).collect();
        let fallback = median(&known).unwrap_or(1.0);
        let rate: Vec<f64> = ids.iter().map(|s| valid(s).unwrap_or(fallback)).collect();
        let mut bytes = vec![0u64; ids.len()];
        for (block, owner) in placement.owners.iter().enumerate() {
            if let Ok(i) = ids.binary_search(owner) {
                bytes[i] = bytes[i].saturating_add(sizes.get(block).copied().unwrap_or(0));
            }
        }
        let unknown = ids.iter().copied().filter(|s| valid(s).is_none()).collect();
        Self { ids, lo: rate.clone(), hi: rate.clone(), rate, bytes, tabu: BTreeSet::new(), unknown }
    }

    /// The same loads with moves that no rule may make now (rule 2).
    pub(super) fn with_tabu(mut self, tabu: BTreeSet<Tabu>) -> Self {
        self.tabu = tabu;
        self
    }

    /// True if moving a block from `from` onto `to` is ruled out now.
    pub(super) fn is_tabu(&self, from: ServerId, to: ServerId) -> bool {
        self.tabu.contains(&Tabu::From(from))
            || self.tabu.contains(&Tabu::Onto(to))
            || self.tabu.contains(&Tabu::Pair(from, to))
            || (self.tabu.contains(&Tabu::FromOntoUnknown(from)) && self.unknown.contains(&to))
    }

    /// The same loads with each rate's uncertainty: `rse[server]`, the relative standard
    /// error of its estimate, widens the rate to `rate * (1 -+ RANK_Z * rse)` (the spread
    /// clamped to `[0, MAX_SPREAD]`) for [`Loads::ranks_above`]. A server without an entry (no
    /// estimate: it runs at the median, see [`service_times`]) keeps its point rate.
    pub(super) fn with_spread(mut self, rse: &BTreeMap<ServerId, f64>) -> Self {
        for (i, id) in self.ids.iter().enumerate() {
            if let Some(&e) = rse.get(id).filter(|e| e.is_finite()) {
                let e = (RANK_Z * e).clamp(0.0, MAX_SPREAD);
                self.lo[i] = self.rate[i] * (1.0 - e);
                self.hi[i] = self.rate[i] * (1.0 + e);
            }
        }
        self
    }

    /// **The rank rule** (no thrash): the model ranks server `dst` above server `src` for a
    /// block of `size` bytes when `dst`, holding that block too, would finish its
    /// iteration before `src` does now, even with `dst`'s rate at the pessimistic end of
    /// its estimate and `src`'s at the optimistic end. No rule moves a block onto a server
    /// ranked at or below its source (only a drain, which must empty a leaving server,
    /// does); a move that noise alone could justify is not made.
    pub(super) fn ranks_above(&self, src: usize, dst: usize, size: u64) -> bool {
        let to = self.bytes[dst].saturating_add(size) as f64 / self.lo[dst];
        let from = self.bytes[src] as f64 / self.hi[src];
        to < from * (1.0 - EPS)
    }

    /// Index of `server`, if it is under consideration.
    pub(super) fn index(&self, server: ServerId) -> Option<usize> {
        self.ids.binary_search(&server).ok()
    }

    /// Service time of server `i`, s per iteration.
    pub(super) fn time(&self, i: usize) -> f64 {
        self.bytes[i] as f64 / self.rate[i]
    }

    /// Service time of server `i` with `extra` more bytes.
    pub(super) fn time_with(&self, i: usize, extra: u64) -> f64 {
        self.bytes[i].saturating_add(extra) as f64 / self.rate[i]
    }

    /// The largest service time (0 for no server).
    pub(super) fn max_time(&self) -> f64 {
        (0..self.ids.len()).map(|i| self.time(i)).fold(0.0, f64::max)
    }

    /// The server with the largest service time (ties: lowest id), except `skip`.
    pub(super) fn argmax(&self, skip: Option<usize>) -> Option<usize> {
        (0..self.ids.len())
            .filter(|&i| Some(i) != skip)
            .min_by(|&a, &b| self.time(b).total_cmp(&self.time(a)).then(a.cmp(&b)))
    }

    /// Service time of every server, by id.
    pub(super) fn times(&self) -> BTreeMap<ServerId, f64> {
        self.ids.iter().enumerate().map(|(i, &id)| (id, self.time(i))).collect()
    }

    /// Per server: the blocks it owns, grouped by size.
    pub(super) fn owned_blocks(&self, placement: &Placement, sizes: &[u64]) -> Vec<BTreeMap<u64, BTreeSet<BlockId>>> {
        let mut owned = vec![BTreeMap::<u64, BTreeSet<BlockId>>::new(); self.ids.len()];
        for (block, owner) in placement.owners.iter().enumerate() {
            if let Some(i) = self.index(*owner) {
                owned[i].entry(size_of(sizes, block as BlockId)).or_default().insert(block as BlockId);
            }
        }
        owned
    }
}

/// The greedy of [`rebalance`] and [`fill`]: moves off the max server, onto servers the
/// model ranks above it ([`Loads::ranks_above`]; with point rates that is a move that
/// lowers `max(T_from, T_to)` below the current `T_from`), the move with the smallest
/// pair max first; `only_to` restricts the destination; at most `max_moves` moves.
pub(super) fn greedy(
    loads: &mut Loads,
    owned: &mut [BTreeMap<u64, BTreeSet<BlockId>>],
    only_to: Option<usize>,
    budget: u64,
    max_moves: usize,
) -> Vec<Move> {
    let mut moves = Vec::new();
    let mut used = 0u64;
    let n = loads.ids.len();
    // (pair max, T_to, block, destination, size)
    type Candidate = (f64, f64, BlockId, usize, u64);
    let better = |a: &Candidate, b: &Candidate| {
        a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)).then(a.2.cmp(&b.2)).then(a.3.cmp(&b.3)) == Ordering::Less
    };
    while let Some(src) = loads.argmax(None) {
        if moves.len() >= max_moves {
            break;
        }
        let t_src = loads.time(src);
        if t_src <= 0.0 || Some(src) == only_to {
            break;
        }
        let remaining = budget - used;
        if remaining == 0 {
            break;
        }
        let mut best: Option<Candidate> = None;
        for (&size, set) in owned[src].range(1..=remaining) {
            let Some(&block) = set.first() else { continue };
            let t_from = (loads.bytes[src] - size) as f64 / loads.rate[src];
            for dst in (0..n).filter(|&d| d != src && only_to.is_none_or(|o| o == d)) {
                if !loads.ranks_above(src, dst, size) || loads.is_tabu(loads.ids[src], loads.ids[dst]) {
                    continue;
                }
                let t_to = loads.time_with(dst, size);
                let pair = t_from.max(t_to);
                let candidate = (pair, t_to, block, dst, size);
                if best.is_none_or(|b| better(&candidate, &b)) {
                    best = Some(candidate);
                }
            }
        }
        let Some((_, _, block, dst, size)) = best else { break };
        if let Some(set) = owned[src].get_mut(&size) {
            set.remove(&block);
            if set.is_empty() {
                owned[src].remove(&size);
            }
        }
        loads.bytes[src] -= size;
        loads.bytes[dst] += size;
        used += size;
        moves.push(Move { block, from: loads.ids[src], to: loads.ids[dst] });
    }
    moves
}

/// The post-condition of the rank rule: replayed in order from `loads` (the loads before
/// the plan), each move goes onto a server the model ranks above its source at that
/// point ([`Loads::ranks_above`]).
pub(super) fn each_ranks_above(loads: &Loads, sizes: &[u64], moves: &[Move]) -> Result<(), String> {
    let mut now = loads.clone();
    for m in moves {
        let (Some(src), Some(dst)) = (now.index(m.from), now.index(m.to)) else {
            return Err(format!("{m:?}: a server outside the loads"));
        };
        let size = size_of(sizes, m.block);
        if !now.ranks_above(src, dst, size) {
            return Err(format!(
                "{m:?}: server {} with the block ({:.6} s at its pessimistic rate) does not finish before \
                 server {} ({:.6} s at its optimistic rate)",
                m.to,
                now.bytes[dst].saturating_add(size) as f64 / now.lo[dst],
                m.from,
                now.bytes[src] as f64 / now.hi[src]
            ));
        }
        now.bytes[src] = now.bytes[src].saturating_sub(size);
        now.bytes[dst] = now.bytes[dst].saturating_add(size);
    }
    Ok(())
}

/// Bytes of `block` (0 if `sizes` does not have it).
pub(super) fn size_of(sizes: &[u64], block: BlockId) -> u64 {
    sizes.get(block as usize).copied().unwrap_or(0)
}

/// The post-condition every plan meets (checked after each phase in debug builds): each
/// block moves at most once, from its owner, to another server of `to`; the placement
/// after the moves changes exactly the moved blocks (no block lost, none moved by
/// accident). Returns that placement.
pub(super) fn moved(placement: &Placement, moves: &[Move], to: &[ServerId]) -> Result<Placement, String> {
    let mut after = placement.clone();
    let mut seen = BTreeSet::new();
    let epoch = placement.epoch.saturating_add(1);
    for m in moves {
        if !seen.insert(m.block) {
            return Err(format!("block {} moves twice", m.block));
        }
        if placement.owner(m.block) != Some(m.from) {
            return Err(format!("{m:?}: server {} does not own block {}", m.from, m.block));
        }
        if m.to == m.from || !to.contains(&m.to) {
            return Err(format!("{m:?}: not a destination of this phase ({to:?})"));
        }
        after.apply(m.block, m.to, epoch).map_err(|e| e.to_string())?;
    }
    let changed = (0..placement.owners.len()).filter(|&b| placement.owners[b] != after.owners[b]).count();
    if changed != moves.len() {
        return Err(format!("{changed} owners changed for {} moves", moves.len()));
    }
    Ok(after)
}
