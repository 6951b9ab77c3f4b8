//! Per-server tuning of the staleness bound (`--sync adaptive[:MIN:MAX]`).
//!
//! FluentPS lets each server adjust its own synchronization from what it observes. The
//! rule here, evaluated once per interval (the server's stats interval, 1 s) over the
//! pulls answered in that interval:
//!
//! - more than [`LOOSEN_ABOVE`] of them were held: synchronization is costing waiting
//!   time, so s grows by 1 (up to MAX);
//! - fewer than [`TIGHTEN_BELOW`] were held: workers are in step and a tighter bound is
//!   free, so s shrinks by 1 (down to MIN) for fresher parameters;
//! - in between, or with fewer than [`MIN_PULLS`] pulls to judge from: no change.
//!
//! The gap between the two thresholds is the hysteresis that keeps s from flapping.

use crate::block::BlockStats;

/// Fraction of held pulls above which s grows.
pub const LOOSEN_ABOVE: f64 = 0.10;
/// Fraction of held pulls below which s shrinks.
pub const TIGHTEN_BELOW: f64 = 0.02;
/// Fewest answered pulls in an interval to decide on.
pub const MIN_PULLS: u64 = 20;

/// The staleness controller of one server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Adaptive {
    min: u32,
    max: u32,
    s: u32,
    last_pulls: u64,
    last_held: u64,
}

impl Adaptive {
    /// A controller for s in `[min, max]`, starting at `min`.
    pub fn new(min: u32, max: u32) -> Self {
        Self { min, max: max.max(min), s: min, last_pulls: 0, last_held: 0 }
    }

    /// The current staleness bound.
    pub fn staleness(&self) -> u32 {
        self.s
    }

    /// Feeds the server's cumulative counters at the end of an interval; returns the
    /// staleness to use next.
    pub fn observe(&mut self, totals: &BlockStats) -> u32 {
        let pulls = totals.pulls.saturating_sub(self.last_pulls);
        let held = totals.pulls_held.saturating_sub(self.last_held);
        if pulls < MIN_PULLS {
            return self.s;
        }
        self.last_pulls = totals.pulls;
        self.last_held = totals.pulls_held;
        let frac = held as f64 / pulls as f64;
        if frac > LOOSEN_ABOVE && self.s < self.max {
            self.s += 1;
        } else if frac < TIGHTEN_BELOW && self.s > self.min {
            self.s -= 1;
        }
        self.s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(pulls: u64, held: u64) -> BlockStats {
        BlockStats { pulls, pulls_held: held, ..BlockStats::default() }
    }

    #[test]
    fn loosens_under_waiting_tightens_when_idle_and_holds_in_between() {
        let mut a = Adaptive::new(1, 3);
        assert_eq!(a.staleness(), 1);
        assert_eq!(a.observe(&stats(100, 50)), 2); // 50% held
        assert_eq!(a.observe(&stats(200, 100)), 3);
        assert_eq!(a.observe(&stats(300, 150)), 3); // capped at max
        assert_eq!(a.observe(&stats(400, 155)), 3); // 5%: in the hysteresis band
        assert_eq!(a.observe(&stats(500, 155)), 2); // 0%: tighten
        assert_eq!(a.observe(&stats(600, 155)), 1);
        assert_eq!(a.observe(&stats(700, 155)), 1); // floored at min
    }

    #[test]
    fn does_not_judge_from_too_few_pulls_but_keeps_counting() {
        let mut a = Adaptive::new(0, 4);
        assert_eq!(a.observe(&stats(10, 10)), 0);
        // The 10 earlier pulls count in the next judgement: 30 pulls, 20 held.
        assert_eq!(a.observe(&stats(30, 20)), 1);
    }
}
