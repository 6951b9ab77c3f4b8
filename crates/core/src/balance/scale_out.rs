//! Rule 6, **scale out**, and its trial (rule 2): when even an unbudgeted rebalance
//! cannot bring the max service time near the target, ask for a server; once it joined,
//! [`fill`] it; after the trial, keep it or revert. Post-condition of the fill
//! (`filled`): every move goes onto the new server, from its owner, and the max service
//! time is not worse.

use std::collections::BTreeMap;

use super::loads::{EPS, Loads, greedy, moved, size_of};
use super::verdict::{Verdict, Window};
use super::{
    BalanceParams, Balancer, Baseline, Decision, MIN_ITER_GAIN, Move, Phase, Round, TRIAL_SETTLE_US, View, rebalance,
};
use crate::placement::{Placement, ServerId};
use crate::stats::median;

/// Give `new_server` (already in `servers`, owning nothing) about the average load:
/// best-fit descending, taking blocks from the heaviest (largest service time) servers,
/// while that lowers max_j T_j. This is [`rebalance`] with `new_server` as the only
/// destination and no budget.
pub fn fill(
    placement: &Placement,
    sizes: &[u64],
    new_server: ServerId,
    servers: &[ServerId],
    rates: &BTreeMap<ServerId, f64>,
) -> Vec<Move> {
    let mut all = servers.to_vec();
    all.push(new_server);
    let mut loads = Loads::new(placement, sizes, &all, rates);
    let Some(dst) = loads.index(new_server) else { return Vec::new() };
    let mut owned = loads.owned_blocks(placement, sizes);
    let moves = greedy(&mut loads, &mut owned, Some(dst), u64::MAX, usize::MAX);
    debug_assert_eq!(filled(placement, sizes, new_server, &all, rates, &moves), Ok(()), "fill: {moves:?}");
    moves
}

impl Balancer {
    /// Rule 6: rebalancing cannot reach the target `total bytes / (n * median rate)`, so
    /// ask for one more server (and remember the baseline of its trial).
    pub(super) fn scale_out(&mut self, round: &Round) -> Option<Decision> {
        let Round { view, servers, rates, loads, .. } = *round;
        let now = view.now_us;
        let n = loads.ids.len();
        if n < self.params.max_servers as usize && now >= self.scale_out_after_us {
            let total: u64 = loads.bytes.iter().sum();
            let unlimited = BalanceParams { budget_bytes: u64::MAX, ..self.params };
            let best = rebalance(view.placement, view.sizes, servers, rates, &unlimited).max_after;
            let median_rate = median(&loads.rate).unwrap_or(1.0);
            let target = total as f64 / (n as f64 * median_rate);
            // What one more server at the median rate would save: the max service time now
            // against the one after its fill. Not worth a server (nor a trial whose noise
            // decides) below MIN_ITER_GAIN of the iteration time: blocks too coarse for the
            // fill to lower the max gain nothing.
            let gain_s = (loads.max_time() - filled_max(view, servers, rates, median_rate)).max(0.0);
            let iteration = self.mean_us(&self.baseline);
            if iteration.is_some_and(|it| gain_s * 1e6 < MIN_ITER_GAIN * it) {
                return None;
            }
            if best > (1.0 + self.params.threshold) * target {
                let mut baseline = self.baseline(now);
                baseline.predicted_gain = iteration.map_or(0.0, |it| gain_s * 1e6 / it);
                self.phase = Phase::AwaitJoin { asked_us: now, baseline, predicted: best };
                return Some(Decision::ScaleOut {
                    why: format!(
                        "max service time {:.1} ms at best with {n} servers, target {:.1} ms",
                        best * 1e3,
                        target * 1e3
                    ),
                });
            }
        }
        None
    }

    /// The step after `joined`: give the new server its load (`Phase::Filling` fields).
    pub(super) fn filling(
        &mut self,
        view: &View,
        servers: &[ServerId],
        rates: &BTreeMap<ServerId, f64>,
        (server, joined_us, baseline, predicted): (ServerId, u64, Baseline, f64),
    ) -> Option<Decision> {
        let now = view.now_us;
        if servers.binary_search(&server).is_err() {
            if now.saturating_sub(joined_us) > self.params.join_timeout_us {
                self.phase = Phase::Steady;
                self.revert_holdoff(now);
            }
            return None;
        }
        let moves = fill(view.placement, view.sizes, server, servers, rates);
        if moves.is_empty() {
            self.phase = Phase::Steady;
            self.revert_holdoff(now);
            return Some(Decision::ScaleIn {
                server,
                why: format!("scale-out reverted: nothing to give server {server}"),
            });
        }
        let bytes: u64 = moves.iter().map(|m| size_of(view.sizes, m.block)).sum();
        let window = Window::starting(now.saturating_add(TRIAL_SETTLE_US));
        self.phase = Phase::Trial { server, baseline, predicted, window };
        Some(Decision::Migrate {
            why: format!("fill new server {server}: {} blocks, {bytes} bytes", moves.len()),
            moves,
        })
    }

    /// The trial of a scale-out (rule 2): kept if the mean iteration time improved by
    /// `keep_gain`, a stall counting its elapsed time ([`Window`]); without iteration
    /// times, if the max service time fell that much below the prediction it was asked
    /// with. Returns the verdict and the decision it implies.
    pub(super) fn trial(
        &mut self,
        view: &View,
        servers: &[ServerId],
        loads: &Loads,
        server: ServerId,
    ) -> Vec<Decision> {
        let now = view.now_us;
        let Phase::Trial { baseline, predicted, window, .. } = &mut self.phase else { return Vec::new() };
        if servers.binary_search(&server).is_err() {
            // It left (failed or removed by someone else): the trial is void.
            self.phase = Phase::Steady;
            return Vec::new();
        }
        window.push(now, view.iterations, view.iter_us);
        if now < window.start_us().saturating_add(baseline.span_us(self.params.trial_us)) {
            return Vec::new();
        }
        let after = window.mean_us().filter(|_| self.iterating);
        let (gain, before_ms, after_ms, basis) = match (baseline.mean_us, after) {
            (Some(before), Some(after)) => (
                (before - after) / before,
                Some(before / 1e3),
                Some(after / 1e3),
                format!("mean iteration {:.1} ms -> {:.1} ms", before / 1e3, after / 1e3),
            ),
            _ => {
                let after = loads.max_time();
                let gain = if *predicted > 0.0 { (*predicted - after) / *predicted } else { 0.0 };
                (
                    gain,
                    None,
                    None,
                    format!("predicted max service time {:.1} ms -> {:.1} ms", *predicted * 1e3, after * 1e3),
                )
            }
        };
        let kept = gain >= self.params.keep_gain;
        let verdict = Verdict {
            decided_us: baseline.decided_us,
            judged_us: now,
            what: format!("scale-out: server {server}"),
            moves: 0,
            predicted_gain: baseline.predicted_gain,
            measured_gain: gain,
            before_ms,
            after_ms,
            kept,
        };
        self.phase = Phase::Steady;
        let action = if kept {
            self.reverts = 0;
            Decision::Keep { server, why: format!("scale-out kept: {basis} ({:+.1}%)", -gain * 100.0) }
        } else {
            self.revert_holdoff(now);
            Decision::ScaleIn { server, why: format!("scale-out reverted: {basis} ({:+.1}%)", -gain * 100.0) }
        };
        self.quiet_since = Some(now);
        vec![Decision::Judged(verdict), action]
    }
}

/// The max service time after [`fill`] of one more server running at `rate`.
fn filled_max(view: &View, servers: &[ServerId], rates: &BTreeMap<ServerId, f64>, rate: f64) -> f64 {
    let new = servers.iter().copied().max().map_or(0, |m| m.saturating_add(1));
    let mut rates = rates.clone();
    rates.insert(new, rate);
    let moves = fill(view.placement, view.sizes, new, servers, &rates);
    let mut after = view.placement.clone();
    for m in &moves {
        // `fill` moves blocks from their owners (its post-condition): this cannot fail.
        let _ = after.apply(m.block, m.to, after.epoch);
    }
    let mut all = servers.to_vec();
    all.push(new);
    Loads::new(&after, view.sizes, &all, &rates).max_time()
}

/// The post-condition of [`fill`]: every move goes from its owner onto `new_server` (see
/// [`moved`]), and the max service time over `servers` (the new one among them) is not
/// above the max before.
pub(super) fn filled(
    placement: &Placement,
    sizes: &[u64],
    new_server: ServerId,
    servers: &[ServerId],
    rates: &BTreeMap<ServerId, f64>,
    moves: &[Move],
) -> Result<(), String> {
    let after = moved(placement, moves, &[new_server])?;
    let before = Loads::new(placement, sizes, servers, rates).max_time();
    let after = Loads::new(&after, sizes, servers, rates).max_time();
    if after > before * (1.0 + EPS) {
        return Err(format!("filling server {new_server} raised the max service time from {before} to {after}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_post_condition_wants_moves_onto_the_new_server_that_do_not_raise_the_max() {
        let p = Placement::new(1, vec![0, 0, 0, 1]);
        let sizes = [100, 100, 100, 100];
        let rates: BTreeMap<ServerId, f64> = [(0, 100.0), (1, 100.0), (2, 100.0)].into_iter().collect();
        let moves = fill(&p, &sizes, 2, &[0, 1], &rates);
        assert!(!moves.is_empty());
        assert_eq!(filled(&p, &sizes, 2, &[0, 1, 2], &rates, &moves), Ok(()));
        let elsewhere = [Move { block: 0, from: 0, to: 1 }];
        assert!(filled(&p, &sizes, 2, &[0, 1, 2], &rates, &elsewhere).is_err());
        // Two blocks onto a new server ten times slower: 20 s where the max was 3 s.
        let slow: BTreeMap<ServerId, f64> = [(0, 100.0), (1, 100.0), (2, 10.0)].into_iter().collect();
        let all = [Move { block: 0, from: 0, to: 2 }, Move { block: 1, from: 0, to: 2 }];
        assert!(filled(&p, &sizes, 2, &[0, 1, 2], &slow, &all).unwrap_err().contains("raised"));
    }
}
