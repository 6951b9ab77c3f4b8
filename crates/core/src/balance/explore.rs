//! Rule 9, **explore**: a server measured slower than the median whose estimate is
//! uncertain (low confidence, stale, or too few bytes to say much) gets the smallest
//! block of the server with the largest service time, so that fresh samples come in, if
//! the source stays measurable (keeps [`FEW_BYTES`] of the mean); probes of one server
//! back off. A server with no estimate is not probed: it runs at the median rate, so the
//! rules may load it, and their verdict measures it. A probe is judged like any round
//! (rule 2): it predicts no gain, and one that slowed iterations is undone. A probe is
//! the one move exempt from the rank rule ([`Loads::ranks_above`]): it goes where the
//! model has no trustworthy rank, to get one. Post-condition ([`probed`]): one move of a
//! non-empty block, from its owner, onto the uncertain server.

use super::loads::{Loads, moved, size_of};
use super::{
    Balancer, FEW_BYTES, MIN_CONFIDENCE, Move, PROBE_INTERVAL_US, PROBE_MAX_INTERVAL_US, Probe, Proposal, STALE_US,
    View,
};
use crate::placement::{Placement, ServerId};

impl Balancer {
    /// Rule 9: a small move onto an uncertain server.
    pub(super) fn probe(&mut self, view: &View, loads: &Loads) -> Option<Proposal> {
        let now = view.now_us;
        let n = loads.ids.len();
        let total: u64 = loads.bytes.iter().sum();
        let mean_bytes = total as f64 / n as f64;
        let median_rate = crate::stats::median(&loads.rate).unwrap_or(0.0);
        // A server is pushed to once an iteration: in a slow job, samples are that far apart.
        let stale_us = self.baseline(now).span_us(STALE_US);
        let uncertain: Vec<bool> = (0..n)
            .map(|i| {
                let owns = loads.bytes[i];
                view.load.estimate(loads.ids[i], now).is_some_and(|e| {
                    e.bps < median_rate
                        && ((owns as f64) < FEW_BYTES * mean_bytes
                            || e.confidence < MIN_CONFIDENCE
                            || (owns > 0 && e.age_us > stale_us))
                })
            })
            .collect();
        // Reset the backoff of servers that are clearly in use again.
        self.probes.retain(|id, _| {
            loads.index(*id).is_some_and(|i| uncertain[i] || (loads.bytes[i] as f64) < 0.5 * mean_bytes)
        });
        for i in (0..n).filter(|&i| uncertain[i]) {
            let id = loads.ids[i];
            let probe = self.probes.get(&id).copied();
            if probe.is_some_and(|p| now < p.next_us) {
                continue;
            }
            let Some(src) = loads.argmax(Some(i)).filter(|&s| loads.bytes[s] > 0) else { continue };
            let from = loads.ids[src];
            let Some(block) = view
                .placement
                .blocks_of(from)
                .filter(|&b| size_of(view.sizes, b) > 0)
                .min_by_key(|&b| (size_of(view.sizes, b), b))
            else {
                continue;
            };
            // The source must stay measurable: a probe that leaves it with too few bytes
            // makes it the next uncertain server, and two servers would probe each other
            // with one block for ever (found by the no-straggler proptest).
            if ((loads.bytes[src] - size_of(view.sizes, block)) as f64) < FEW_BYTES * mean_bytes {
                continue;
            }
            let interval = probe.map_or(PROBE_INTERVAL_US, |p| p.interval_us);
            self.probes.insert(
                id,
                Probe {
                    next_us: now.saturating_add(interval),
                    interval_us: interval.saturating_mul(2).min(PROBE_MAX_INTERVAL_US),
                },
            );
            let moves = vec![Move { block, from, to: id }];
            debug_assert_eq!(probed(view.placement, view.sizes, &moves, id), Ok(()), "probe: {moves:?}");
            let max = loads.max_time();
            return Some(Proposal {
                probe: true,
                max_before: max,
                max_after: max,
                moves,
                why: format!(
                    "probe server {id}: uncertain estimate, {} bytes; block {block} ({} bytes) from server {from}",
                    loads.bytes[i],
                    size_of(view.sizes, block)
                ),
            });
        }
        None
    }
}

/// The post-condition of a probe: a single move of a block that carries bytes, from its
/// owner to `probed_server` (see [`moved`]).
pub(super) fn probed(
    placement: &Placement,
    sizes: &[u64],
    moves: &[Move],
    probed_server: ServerId,
) -> Result<(), String> {
    let [m] = moves else { return Err(format!("a probe is one move, not {}", moves.len())) };
    if size_of(sizes, m.block) == 0 {
        return Err(format!("block {} carries no bytes: it would tell nothing", m.block));
    }
    moved(placement, moves, &[probed_server]).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_post_condition_wants_one_real_move_onto_the_probed_server() {
        let p = Placement::new(1, vec![0, 0, 1]);
        let sizes = [10, 0, 10];
        let one = |block, from, to| vec![Move { block, from, to }];
        assert_eq!(probed(&p, &sizes, &one(0, 0, 2), 2), Ok(()));
        assert!(probed(&p, &sizes, &one(1, 0, 2), 2).unwrap_err().contains("no bytes"));
        assert!(probed(&p, &sizes, &one(0, 0, 1), 2).is_err(), "onto another server");
        assert!(probed(&p, &sizes, &one(2, 0, 2), 2).is_err(), "from a server that does not own it");
        assert!(probed(&p, &sizes, &[], 2).is_err());
    }
}
