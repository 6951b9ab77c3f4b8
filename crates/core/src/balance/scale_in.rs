//! Rule 7, **scale in**: a server that owns nothing, or has been idle for [`IDLE_US`], is
//! [`drain`]ed and stopped if the others absorb its load without raising the max service
//! time by more than [`SCALE_IN_MAX_RAISE`]. Post-condition of the drain (`drained`):
//! the drained server owns nothing, every block went to one of the others, none was lost.

use std::collections::BTreeMap;

use super::loads::{EPS, Loads, moved, size_of};
use super::{Balancer, Decision, IDLE_US, Move, Round, SCALE_IN_MAX_RAISE};
use crate::model::BlockId;
use crate::placement::{Placement, ServerId};

/// Every block of `server` moved to the others, best fit (largest block first into the
/// server whose resulting service time is smallest; ties: lower block id, lower server
/// id). `server` may or may not be in `servers`; empty if there is no other server.
pub fn drain(
    placement: &Placement,
    sizes: &[u64],
    server: ServerId,
    servers: &[ServerId],
    rates: &BTreeMap<ServerId, f64>,
) -> Vec<Move> {
    let others: Vec<ServerId> = servers.iter().copied().filter(|&s| s != server).collect();
    let mut loads = Loads::new(placement, sizes, &others, rates);
    if loads.ids.is_empty() {
        return Vec::new();
    }
    let mut blocks: Vec<(u64, BlockId)> = placement.blocks_of(server).map(|b| (size_of(sizes, b), b)).collect();
    blocks.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let moves: Vec<Move> = blocks
        .into_iter()
        .map(|(size, block)| {
            let to = (0..loads.ids.len())
                .min_by(|&a, &b| loads.time_with(a, size).total_cmp(&loads.time_with(b, size)).then(a.cmp(&b)))
                .unwrap_or(0);
            loads.bytes[to] += size;
            Move { block, from: server, to: loads.ids[to] }
        })
        .collect();
    debug_assert_eq!(drained(placement, server, &others, &moves), Ok(()), "drain of server {server}: {moves:?}");
    moves
}

impl Balancer {
    /// Rule 7: an idle server whose load the others absorb is drained and stopped.
    /// Candidates from the smallest service time, ties to the highest id (the newest).
    pub(super) fn scale_in(&self, round: &Round) -> Option<Decision> {
        let Round { view, servers, rates, loads, .. } = *round;
        let now = view.now_us;
        let n = loads.ids.len();
        if n <= (self.params.min_servers.max(1)) as usize {
            return None;
        }
        let max = loads.max_time();
        let mut candidates: Vec<usize> = (0..n)
            .filter(|&i| {
                loads.bytes[i] == 0
                    || self.idle_since.get(&loads.ids[i]).is_some_and(|&t| now >= t.saturating_add(IDLE_US))
            })
            .collect();
        candidates.sort_by(|&a, &b| loads.time(a).total_cmp(&loads.time(b)).then(b.cmp(&a)));
        for i in candidates {
            let id = loads.ids[i];
            let moves = drain(view.placement, view.sizes, id, servers, rates);
            let others: Vec<ServerId> = servers.iter().copied().filter(|&s| s != id).collect();
            // drain() moves only blocks of `id` onto the others: the plan is always valid.
            let Ok(after) = moved(view.placement, &moves, &others) else { continue };
            let max_after = Loads::new(&after, view.sizes, &others, rates).max_time();
            if max_after <= max * (1.0 + SCALE_IN_MAX_RAISE) + EPS * max {
                let raise = if max > 0.0 { (max_after - max) / max * 100.0 } else { 0.0 };
                return Some(Decision::ScaleIn {
                    server: id,
                    why: format!(
                        "server {id} idle ({} bytes, {:.1} ms of {:.1} ms); draining it changes the max by {raise:+.1}%",
                        loads.bytes[i],
                        loads.time(i) * 1e3,
                        max * 1e3
                    ),
                });
            }
        }
        None
    }
}

/// The post-condition of [`drain`]: a valid plan onto `others` (see [`moved`]) after which
/// `server` owns nothing (unless there is no other server, and then there is no move).
pub(super) fn drained(
    placement: &Placement,
    server: ServerId,
    others: &[ServerId],
    moves: &[Move],
) -> Result<(), String> {
    let after = moved(placement, moves, others)?;
    let left = after.blocks_of(server).count();
    if left > 0 && !others.is_empty() {
        return Err(format!("drained server {server} still owns {left} blocks"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_post_condition_wants_the_drained_server_empty() {
        let p = Placement::new(1, vec![0, 1, 1, 2]);
        let rates: BTreeMap<ServerId, f64> = [(0, 100.0), (1, 100.0), (2, 100.0)].into_iter().collect();
        let moves = drain(&p, &[10, 10, 10, 10], 1, &[0, 1, 2], &rates);
        assert_eq!(moves.len(), 2);
        assert_eq!(drained(&p, 1, &[0, 2], &moves), Ok(()));
        assert!(drained(&p, 1, &[0, 2], &moves[..1]).unwrap_err().contains("still owns 1"));
        let onto_itself = [Move { block: 1, from: 1, to: 1 }];
        assert!(drained(&p, 1, &[0, 2], &onto_itself).is_err());
        assert_eq!(drained(&p, 1, &[], &[]), Ok(()), "no other server: nothing to move");
    }
}
