//! Synchronization policies and the clock bookkeeping they decide on (DESIGN.md §3).
//!
//! Worker loop, iteration t = 0, 1, 2, ...: `pull(t)`, compute, `push(t)`. For one block
//! a server tracks, per worker, how many clocks that worker has pushed. `done` is the
//! smallest clock that some worker has not pushed yet (every clock below `done` is
//! complete); `fast` is the highest clock pushed by anyone. Pushes are never held; a
//! pull may be, and [`SyncPolicy::on_pull`] is the one place that says when:
//!
//! | policy | hold `pull(t)` while | released when |
//! |---|---|---|
//! | `bsp` | `done < t` | `done >= t` |
//! | `asp` | never | — |
//! | `ssp:s` | `done < t - s` | `done >= t - s` |
//! | `lazy:s` | `done < t - s`, or other pulls for clock t are already buffered | `done >= t`, all pulls for t together |
//! | `pssp:s:p` | the worker is the fastest (`t - 1 == fast`), `done < t - s`, and a coin with probability p says pause | `done >= t - s` |
//! | `dpssp:s` | as `pssp`, with p = 1 / (1 + e^(s - k)), k = t - 1 - done | `done >= t - s` |
//! | `adaptive` | as `ssp:s`, with s tuned per server by [`crate::adaptive::Adaptive`] | `done >= t - s` |

use std::fmt;
use std::str::FromStr;

use rand::Rng;
use serde::{Deserialize, Serialize};

use crate::CoreError;

/// Logical iteration number of a worker.
pub type Clock = u32;

/// When a server answers a pull.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum SyncPolicy {
    /// Bulk synchronous: `pull(t)` waits until every worker pushed clock `t - 1`.
    Bsp,
    /// Asynchronous: never waits.
    Asp,
    /// Stale synchronous with staleness `s`: `pull(t)` waits while `done < t - s`.
    Ssp(u32),
    /// FluentPS lazy execution: a pull that SSP would hold is buffered until a full
    /// catch-up (`done >= t`), and later pulls of the same clock join it, so all of them
    /// are released together and the next ~s iterations run without waiting.
    Lazy(u32),
    /// FluentPS probabilistic pause: only the fastest worker is ever held, and only
    /// with probability `p` when it is more than `s` clocks ahead of `done`.
    Pssp {
        /// Staleness bound.
        s: u32,
        /// Probability of pausing the fastest worker, in [0, 1].
        p: f64,
    },
    /// As `Pssp`, with the probability growing with the lead k = t - 1 - done:
    /// p = 1 / (1 + e^(s - k)).
    Dpssp(u32),
    /// SSP whose staleness each server tunes within `[min, max]` from the delays it
    /// observes ([`crate::adaptive::Adaptive`]).
    Adaptive {
        /// Smallest staleness.
        min: u32,
        /// Largest staleness.
        max: u32,
    },
}

/// What a server knows about a block when `pull(clock)` arrives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PullView {
    /// The clock of the pull.
    pub clock: Clock,
    /// The block's `done` clock.
    pub done: Clock,
    /// The highest clock pushed by anyone, if any.
    pub fast: Option<Clock>,
    /// True if pulls of the same clock are already held (buffered) on this block.
    pub same_clock_held: bool,
}

/// A policy's decision about one pull.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Answer now.
    Answer,
    /// Hold until the block's `done` reaches `until`.
    Hold {
        /// The `done` clock that releases the pull.
        until: Clock,
    },
}

impl SyncPolicy {
    /// The staleness bound every answered pull respects (`done >= t - s`): 0 for BSP,
    /// s for SSP and lazy; `None` where no bound is guaranteed (ASP, and PSSP, whose
    /// pauses are probabilistic and only apply to the fastest worker). `Adaptive` has
    /// no fixed bound: resolve it first ([`SyncPolicy::resolve`]).
    pub fn staleness(self) -> Option<u32> {
        match self {
            SyncPolicy::Bsp => Some(0),
            SyncPolicy::Ssp(s) | SyncPolicy::Lazy(s) => Some(s),
            SyncPolicy::Asp | SyncPolicy::Pssp { .. } | SyncPolicy::Dpssp(_) | SyncPolicy::Adaptive { .. } => None,
        }
    }

    /// The concrete policy to decide with: `Adaptive` becomes `Ssp(s)` with the
    /// server's current `s`; every other policy is itself.
    pub fn resolve(self, adaptive_s: u32) -> SyncPolicy {
        match self {
            SyncPolicy::Adaptive { min, max } => SyncPolicy::Ssp(adaptive_s.clamp(min, max)),
            other => other,
        }
    }

    /// True if answering `pull(t)` while `done` breaks this policy's staleness bound.
    /// This is the invariant every test checks: no pull at clock t is answered while
    /// `done < t - s`.
    pub fn violates_bound(self, t: Clock, done: Clock) -> bool {
        self.staleness().is_some_and(|s| behind(t, done, s))
    }

    /// Decides about a pull that just arrived. `rng` is drawn from only when a
    /// probabilistic policy must toss its coin.
    pub fn on_pull(self, v: &PullView, rng: &mut impl Rng) -> Verdict {
        let t = v.clock;
        let hold_ssp = |s: u32| if behind(t, v.done, s) { Verdict::Hold { until: t - s } } else { Verdict::Answer };
        match self {
            SyncPolicy::Asp => Verdict::Answer,
            SyncPolicy::Bsp => hold_ssp(0),
            SyncPolicy::Ssp(s) => hold_ssp(s),
            // Unresolved adaptive: the tightest bound is the safe one.
            SyncPolicy::Adaptive { min, .. } => hold_ssp(min),
            SyncPolicy::Lazy(s) => {
                if behind(t, v.done, s) || (v.same_clock_held && v.done < t) {
                    Verdict::Hold { until: t }
                } else {
                    Verdict::Answer
                }
            }
            SyncPolicy::Pssp { s, p } => pause_fastest(v, s, |_| p, rng),
            SyncPolicy::Dpssp(s) => pause_fastest(v, s, |lead| 1.0 / (1.0 + (f64::from(s) - lead as f64).exp()), rng),
        }
    }
}

/// `done < t - s`, without underflow.
fn behind(t: Clock, done: Clock, s: u32) -> bool {
    u64::from(done) + u64::from(s) < u64::from(t)
}

/// PSSP: hold the fastest worker (`t - 1 == fast`) when `done < t - s`, with the
/// probability `p(lead)` where lead = t - 1 - done.
fn pause_fastest(v: &PullView, s: u32, p: impl Fn(u64) -> f64, rng: &mut impl Rng) -> Verdict {
    let t = v.clock;
    let fastest = t >= 1 && v.fast == Some(t - 1);
    if !fastest || !behind(t, v.done, s) {
        return Verdict::Answer;
    }
    let lead = u64::from(t - 1 - v.done);
    if rng.random::<f64>() < p(lead) { Verdict::Hold { until: t - s } } else { Verdict::Answer }
}

impl fmt::Display for SyncPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SyncPolicy::Bsp => f.write_str("bsp"),
            SyncPolicy::Asp => f.write_str("asp"),
            SyncPolicy::Ssp(s) => write!(f, "ssp:{s}"),
            SyncPolicy::Lazy(s) => write!(f, "lazy:{s}"),
            SyncPolicy::Pssp { s, p } => write!(f, "pssp:{s}:{p}"),
            SyncPolicy::Dpssp(s) => write!(f, "dpssp:{s}"),
            SyncPolicy::Adaptive { min, max } if (*min, *max) == DEFAULT_ADAPTIVE => f.write_str("adaptive"),
            SyncPolicy::Adaptive { min, max } => write!(f, "adaptive:{min}:{max}"),
        }
    }
}

/// The staleness range of plain `adaptive`.
pub const DEFAULT_ADAPTIVE: (u32, u32) = (0, 8);

impl FromStr for SyncPolicy {
    type Err = CoreError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let err = |why: &str| CoreError::Parse {
            what: "sync policy",
            input: input.to_string(),
            why: format!(
                "{why}; expected bsp, asp, ssp:S, lazy:S, pssp:S:P, dpssp:S, adaptive or adaptive:MIN:MAX \
                 (S a non-negative integer, P a probability in [0, 1])"
            ),
        };
        let lower = input.trim().to_ascii_lowercase();
        let parts: Vec<&str> = lower.split(':').collect();
        let int = |s: &str| s.parse::<u32>().map_err(|_| err("bad staleness"));
        match parts[..] {
            ["bsp"] => Ok(SyncPolicy::Bsp),
            ["asp"] => Ok(SyncPolicy::Asp),
            ["ssp", s] => Ok(SyncPolicy::Ssp(int(s)?)),
            ["lazy", s] => Ok(SyncPolicy::Lazy(int(s)?)),
            ["dpssp", s] => Ok(SyncPolicy::Dpssp(int(s)?)),
            ["pssp", s, p] => match p.parse::<f64>() {
                Ok(p) if (0.0..=1.0).contains(&p) => Ok(SyncPolicy::Pssp { s: int(s)?, p }),
                _ => Err(err("bad probability")),
            },
            ["adaptive"] => Ok(SyncPolicy::Adaptive { min: DEFAULT_ADAPTIVE.0, max: DEFAULT_ADAPTIVE.1 }),
            ["adaptive", min, max] => {
                let (min, max) = (int(min)?, int(max)?);
                if min > max {
                    return Err(err("MIN is larger than MAX"));
                }
                Ok(SyncPolicy::Adaptive { min, max })
            }
            _ => Err(err("unknown policy")),
        }
    }
}

/// Per-block clock state: how many clocks each worker has pushed.
///
/// `done`, `fast` and `lead` are called on every push and pull, so they are cached:
/// the minimum over the active workers with the number of active workers at it, the
/// maximum over the active workers, and the maximum over everyone. A push moves the
/// minimum only when the last worker at it pushes, and a removal rescans; so a push
/// costs O(1) amortised, not O(workers). The serde form is the plain state (`pushed`,
/// `active`); the caches are rebuilt when a snapshot is decoded.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(from = "ClocksForm")]
pub struct Clocks {
    pushed: Vec<Clock>,
    active: Vec<bool>,
    /// Smallest `pushed` over the active workers (`Clock::MAX` with none).
    lo: Clock,
    /// How many active workers have pushed exactly `lo` clocks.
    at_lo: u32,
    /// Largest `pushed` over the active workers (0 with none).
    hi_active: Clock,
    /// Largest `pushed` over every worker, removed ones included.
    hi: Clock,
}

/// The serialized form of [`Clocks`]: its state without the caches.
#[derive(Deserialize)]
#[serde(rename = "Clocks")]
struct ClocksForm {
    pushed: Vec<Clock>,
    active: Vec<bool>,
}

/// [`ClocksForm`] borrowed, to serialize without a copy.
#[derive(Serialize)]
#[serde(rename = "Clocks")]
struct ClocksRef<'a> {
    pushed: &'a [Clock],
    active: &'a [bool],
}

impl From<ClocksForm> for Clocks {
    fn from(f: ClocksForm) -> Self {
        let mut c = Clocks { pushed: f.pushed, active: f.active, lo: Clock::MAX, at_lo: 0, hi_active: 0, hi: 0 };
        c.rescan();
        c
    }
}

impl Serialize for Clocks {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        ClocksRef { pushed: &self.pushed, active: &self.active }.serialize(s)
    }
}

impl Clocks {
    /// Fresh state for `workers` workers, none of whom has pushed.
    pub fn new(workers: u32) -> Self {
        ClocksForm { pushed: vec![0; workers as usize], active: vec![true; workers as usize] }.into()
    }

    /// Recomputes the caches from `pushed` and `active` (O(workers)). A malformed
    /// snapshot (lengths differ) is cached over the workers both lists cover;
    /// [`Clocks::is_consistent`] refuses it anyway.
    fn rescan(&mut self) {
        let (mut lo, mut at_lo, mut hi_active) = (Clock::MAX, 0u32, 0);
        for (p, _) in self.pushed.iter().zip(&self.active).filter(|(_, a)| **a) {
            match (*p).cmp(&lo) {
                std::cmp::Ordering::Less => (lo, at_lo) = (*p, 1),
                std::cmp::Ordering::Equal => at_lo += 1,
                std::cmp::Ordering::Greater => {}
            }
            hi_active = hi_active.max(*p);
        }
        self.lo = lo;
        self.at_lo = at_lo;
        self.hi_active = hi_active;
        self.hi = self.pushed.iter().copied().max().unwrap_or(0);
    }

    /// True if the state is well formed (one pushed clock and one flag per worker): a
    /// snapshot from the network is checked with this before use.
    pub fn is_consistent(&self) -> bool {
        self.pushed.len() == self.active.len()
    }

    /// Number of workers this block expects pushes from (including removed ones).
    pub fn workers(&self) -> u32 {
        self.pushed.len() as u32
    }

    /// How many clocks `worker` has pushed (the next clock it will push).
    pub fn pushed(&self, worker: u32) -> Option<Clock> {
        self.pushed.get(worker as usize).copied()
    }

    /// The smallest clock not yet pushed by every active worker. With no active worker
    /// left, nothing can hold: `Clock::MAX`. O(1).
    pub fn done(&self) -> Clock {
        self.lo
    }

    /// The highest clock pushed by anyone, or `None` before the first push. O(1).
    pub fn fast(&self) -> Option<Clock> {
        self.hi.checked_sub(1)
    }

    /// The active worker that has pushed the fewest clocks (the one `done` waits for);
    /// the lowest rank among equals. O(workers): for logs.
    pub fn slowest(&self) -> Option<u32> {
        self.pushed
            .iter()
            .zip(&self.active)
            .enumerate()
            .filter(|(_, (_, a))| **a)
            .min_by_key(|(_, (p, _))| **p)
            .map(|(w, _)| w as u32)
    }

    /// The lead of the fastest active worker over the slowest, in clocks. O(1).
    pub fn lead(&self) -> u32 {
        self.hi_active.saturating_sub(self.lo)
    }

    /// What [`Clocks::record`] would say about `worker` pushing `clock`, without
    /// recording it: `Ok(false)` for a duplicate, `Ok(true)` for the next clock, the
    /// error for a gap or an unknown worker. `rejoined`: as after
    /// [`Clocks::skip_to`]`(worker, clock)` (a rejoined worker may skip clocks).
    pub fn check(&self, block: u32, worker: u32, clock: Clock, rejoined: bool) -> Result<bool, CoreError> {
        let slot = *self.pushed.get(worker as usize).ok_or(CoreError::UnknownWorker(worker))?;
        let slot = if rejoined { slot.max(clock) } else { slot };
        if clock < slot {
            return Ok(false);
        }
        if clock > slot || clock == Clock::MAX {
            return Err(CoreError::ClockGap { block, worker, expected: slot, got: clock });
        }
        Ok(true)
    }

    /// Records that `worker` pushed clock `clock`. Returns `Ok(false)` for a duplicate
    /// (already pushed: drop it), `Ok(true)` for the next clock, an error for a gap.
    pub fn record(&mut self, block: u32, worker: u32, clock: Clock) -> Result<bool, CoreError> {
        if !self.check(block, worker, clock, false)? {
            return Ok(false);
        }
        let w = worker as usize;
        let slot = self.pushed.get_mut(w).ok_or(CoreError::UnknownWorker(worker))?;
        // `check` passed: the clock is the slot's, below the last one (u32::MAX cannot be
        // pushed: nothing could follow it).
        let (before, after) = (*slot, slot.saturating_add(1));
        *slot = after;
        self.hi = self.hi.max(after);
        if self.active.get(w).copied().unwrap_or(false) {
            self.hi_active = self.hi_active.max(after);
            if before == self.lo {
                self.at_lo -= 1;
                if self.at_lo == 0 {
                    self.rescan();
                }
            }
        }
        Ok(true)
    }

    /// Takes a worker out of the quorum (it died or left): `done` stops waiting for it.
    pub fn remove_worker(&mut self, worker: u32) {
        if let Some(a) = self.active.get_mut(worker as usize)
            && *a
        {
            *a = false;
            self.rescan();
        }
    }

    /// Takes a removed worker back into the quorum (it was restarted with its rank): from
    /// now on `done` waits for it again, from where the quorum is. Its next clock becomes
    /// `done` if it was behind (the clocks the quorum went on without it are not pushed
    /// again: a push of one of them is a duplicate), so `done` never goes back. Returns
    /// the next clock the worker is to push. An active worker is left as it is.
    pub fn add_worker(&mut self, worker: u32) -> Option<Clock> {
        let w = worker as usize;
        if !*self.active.get(w)? {
            let from = if self.lo == Clock::MAX { self.hi } else { self.lo };
            self.pushed[w] = self.pushed[w].max(from);
            self.active[w] = true;
            self.rescan();
        }
        self.pushed(worker)
    }

    /// A worker that rejoined goes on at `clock`, past its next one: the clocks between
    /// are skipped (the quorum went on without them). Nothing changes if it is already
    /// there; `done` never goes back.
    pub fn skip_to(&mut self, worker: u32, clock: Clock) {
        if let Some(p) = self.pushed.get_mut(worker as usize)
            && clock > *p
        {
            *p = clock;
            self.rescan();
        }
    }

    /// Number of workers still in the quorum.
    pub fn active_workers(&self) -> u32 {
        self.active.iter().filter(|a| **a).count() as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_taken_back_goes_on_from_the_quorum_and_done_never_goes_back() {
        let mut c = Clocks::new(3);
        for t in 0..2 {
            c.record(0, 1, t).unwrap();
        }
        c.remove_worker(1);
        for w in [0, 2] {
            for t in 0..5 {
                c.record(0, w, t).unwrap();
            }
        }
        assert_eq!(c.done(), 5);
        assert_eq!(c.add_worker(1), Some(5), "it goes on at the quorum's clock");
        assert_eq!(c.done(), 5);
        assert_eq!(c.record(0, 1, 3), Ok(false), "a clock the quorum went on without is a duplicate");
        assert!(c.record(0, 1, 5).unwrap());
        assert_eq!(c.done(), 5, "workers 0 and 2 have not pushed clock 5");
        assert_eq!(c.add_worker(1), Some(6), "an active worker is left as it is");
        assert_eq!(c.add_worker(9), None);
    }

    #[test]
    fn parses_and_prints_policies() {
        for s in ["bsp", "asp", "ssp:0", "ssp:3", "lazy:3", "pssp:3:0.5", "dpssp:2", "adaptive", "adaptive:1:4"] {
            assert_eq!(s.parse::<SyncPolicy>().unwrap().to_string(), s);
        }
        assert!("ssp".parse::<SyncPolicy>().is_err());
        assert!("ssp:-1".parse::<SyncPolicy>().is_err());
        assert!("lazy:x".parse::<SyncPolicy>().is_err());
        assert!("pssp:3:1.5".parse::<SyncPolicy>().is_err());
        assert!("pssp:3".parse::<SyncPolicy>().is_err());
        assert!("adaptive:5:2".parse::<SyncPolicy>().is_err());
    }

    /// An RNG whose every draw is the same: `Fixed(0)` draws 0.0, `Fixed(u64::MAX)`
    /// draws just under 1.0.
    pub(crate) struct Fixed(pub u64);

    impl rand::RngCore for Fixed {
        fn next_u32(&mut self) -> u32 {
            (self.0 >> 32) as u32
        }
        fn next_u64(&mut self) -> u64 {
            self.0
        }
        fn fill_bytes(&mut self, dst: &mut [u8]) {
            dst.fill(self.0 as u8);
        }
    }

    const LOW: u64 = 0; // the coin always says "pause" (draw 0.0 < p for any p > 0)
    const HIGH: u64 = u64::MAX; // the coin says "pause" only for p = 1

    #[test]
    fn decisions_match_the_table() {
        use Verdict::{Answer, Hold};
        let p = |s: &str| s.parse::<SyncPolicy>().unwrap();
        // (policy, t, done, fast, same clock already held, coin draw, verdict)
        type Row = (&'static str, Clock, Clock, Option<Clock>, bool, u64, Verdict);
        let rows: &[Row] = &[
            ("bsp", 0, 0, None, false, LOW, Answer),
            ("bsp", 1, 0, Some(0), false, LOW, Hold { until: 1 }),
            ("bsp", 1, 1, Some(0), false, LOW, Answer),
            ("asp", 9, 0, Some(8), true, LOW, Answer),
            ("ssp:2", 2, 0, Some(1), false, LOW, Answer),
            ("ssp:2", 3, 0, Some(2), false, LOW, Hold { until: 1 }),
            ("ssp:2", 3, 1, Some(2), false, LOW, Answer),
            // lazy: held like ssp, but released only by a full catch-up...
            ("lazy:2", 3, 0, Some(2), false, LOW, Hold { until: 3 }),
            // ...and a pull of a clock already buffered joins the buffer, even in bound.
            ("lazy:2", 3, 1, Some(2), true, LOW, Hold { until: 3 }),
            ("lazy:2", 3, 1, Some(2), false, LOW, Answer),
            ("lazy:2", 3, 3, Some(2), true, LOW, Answer),
            // pssp pauses only the fastest worker, only out of bound, only if the coin says so.
            ("pssp:1:0.5", 3, 0, Some(2), false, LOW, Hold { until: 2 }),
            ("pssp:1:0.5", 3, 0, Some(2), false, HIGH, Answer),
            ("pssp:1:0.5", 3, 0, Some(4), false, LOW, Answer),
            ("pssp:1:0.5", 2, 1, Some(1), false, LOW, Answer),
            ("pssp:1:1", 3, 0, Some(2), false, HIGH, Hold { until: 2 }),
            ("pssp:1:0", 3, 0, Some(2), false, LOW, Answer),
            // dpssp:2 at lead k = t - 1 - done = 3: p = 1 / (1 + e^-1) = 0.731.
            ("dpssp:2", 4, 0, Some(3), false, LOW, Hold { until: 2 }),
            ("dpssp:2", 4, 0, Some(3), false, (0.70 * (1u64 << 53) as f64) as u64 * 2048, Hold { until: 2 }),
            ("dpssp:2", 4, 0, Some(3), false, (0.76 * (1u64 << 53) as f64) as u64 * 2048, Answer),
            // ...at k = 2 = s it is 1/2; in bound (done >= t - s) it never pauses.
            ("dpssp:2", 3, 0, Some(2), false, LOW, Hold { until: 1 }),
            ("dpssp:2", 3, 0, Some(2), false, (0.51 * (1u64 << 53) as f64) as u64 * 2048, Answer),
            ("dpssp:2", 3, 1, Some(2), false, LOW, Answer),
            // adaptive, unresolved, decides with its tightest bound (ssp:1 here).
            ("adaptive:1:4", 3, 2, Some(2), false, LOW, Answer),
            ("adaptive:1:4", 3, 1, Some(2), false, LOW, Hold { until: 2 }),
        ];
        for (i, (policy, t, done, fast, held, coin, want)) in rows.iter().enumerate() {
            let view = PullView { clock: *t, done: *done, fast: *fast, same_clock_held: *held };
            let got = p(policy).on_pull(&view, &mut Fixed(*coin));
            assert_eq!(got, *want, "row {i}: {policy} pull({t}) with done {done}, fast {fast:?}");
        }
    }

    #[test]
    fn degenerate_policies_agree_with_their_equivalents() {
        let mut rng = Fixed(LOW);
        for t in 0..6u32 {
            for done in 0..6 {
                for fast in [None, Some(0), Some(t.saturating_sub(1)), Some(5)] {
                    let v = PullView { clock: t, done, fast, same_clock_held: false };
                    assert_eq!(SyncPolicy::Ssp(0).on_pull(&v, &mut rng), SyncPolicy::Bsp.on_pull(&v, &mut rng));
                    assert_eq!(SyncPolicy::Pssp { s: 2, p: 0.0 }.on_pull(&v, &mut rng), Verdict::Answer);
                    // pssp:s:1 holds exactly the fastest worker's pulls that ssp:s holds.
                    let fastest = t >= 1 && fast == Some(t - 1);
                    let ssp = SyncPolicy::Ssp(2).on_pull(&v, &mut rng);
                    let pssp = SyncPolicy::Pssp { s: 2, p: 1.0 }.on_pull(&v, &mut Fixed(HIGH));
                    assert_eq!(pssp, if fastest { ssp } else { Verdict::Answer }, "t {t} done {done} fast {fast:?}");
                }
            }
        }
    }

    #[test]
    fn clocks_track_done_fast_duplicates_and_gaps() {
        let mut c = Clocks::new(2);
        assert_eq!((c.done(), c.fast()), (0, None));
        assert_eq!(c.record(0, 0, 0), Ok(true));
        assert_eq!(c.record(0, 0, 1), Ok(true));
        assert_eq!((c.done(), c.fast()), (0, Some(1)));
        assert_eq!(c.record(0, 0, 1), Ok(false));
        assert!(matches!(c.record(0, 1, 1), Err(CoreError::ClockGap { expected: 0, got: 1, .. })));
        assert_eq!(c.record(0, 1, 0), Ok(true));
        assert_eq!(c.done(), 1);
        c.remove_worker(1);
        assert_eq!(c.done(), 2);
        assert!(c.record(0, 7, 0).is_err());
    }
}

#[cfg(test)]
mod proptests {
    use super::*;
    use proptest::prelude::*;

    /// `done`, `fast` and `lead` as plain scans, as they were before the caches.
    fn scanned(c: &Clocks) -> (Clock, Option<Clock>, u32) {
        let active: Vec<Clock> = c.pushed.iter().zip(&c.active).filter(|(_, a)| **a).map(|(p, _)| *p).collect();
        let done = active.iter().copied().min().unwrap_or(Clock::MAX);
        let fast = c.pushed.iter().max().and_then(|p| p.checked_sub(1));
        let (lo, hi) = active.iter().fold((Clock::MAX, 0), |(lo, hi), p| (lo.min(*p), hi.max(*p)));
        (done, fast, hi.saturating_sub(lo))
    }

    #[derive(Clone, Debug)]
    enum Op {
        /// The worker pushes its next clock (or, with `dup`, one it already pushed).
        Push { worker: u32, dup: bool },
        /// The worker leaves the quorum.
        Remove(u32),
        /// The state travels as a snapshot (postcard) and is decoded on the other side.
        Snapshot,
    }

    fn op(workers: u32) -> impl Strategy<Value = Op> {
        prop_oneof![
            8 => (0..workers, any::<bool>()).prop_map(|(worker, dup)| Op::Push { worker, dup: dup && worker % 3 == 0 }),
            1 => (0..workers + 1).prop_map(Op::Remove),
            1 => Just(Op::Snapshot),
        ]
    }

    proptest! {
        #[test]
        fn cached_done_fast_and_lead_equal_a_scan(
            (workers, ops) in (1u32..9).prop_flat_map(|w| (Just(w), proptest::collection::vec(op(w), 0..200)))
        ) {
            let mut c = Clocks::new(workers);
            for op in ops {
                match op {
                    Op::Push { worker, dup } => {
                        let next = c.pushed(worker).unwrap_or(0);
                        let clock = if dup { next.saturating_sub(1) } else { next };
                        c.record(0, worker, clock).unwrap();
                    }
                    Op::Remove(worker) => c.remove_worker(worker),
                    Op::Snapshot => {
                        let bytes = postcard::to_allocvec(&c).unwrap();
                        let back: Clocks = postcard::from_bytes(&bytes).unwrap();
                        prop_assert_eq!(&back, &c);
                        c = back;
                    }
                }
                prop_assert_eq!((c.done(), c.fast(), c.lead()), scanned(&c), "{:?}", c);
            }
        }
    }

    #[test]
    fn the_serde_form_is_the_plain_state_and_an_inconsistent_snapshot_is_caught() {
        let mut c = Clocks::new(2);
        c.record(0, 1, 0).unwrap();
        #[derive(Serialize)]
        struct Plain {
            pushed: Vec<Clock>,
            active: Vec<bool>,
        }
        let plain = postcard::to_allocvec(&Plain { pushed: vec![0, 1], active: vec![true, true] }).unwrap();
        assert_eq!(postcard::to_allocvec(&c).unwrap(), plain);
        let bad = postcard::to_allocvec(&Plain { pushed: vec![3, 1, 2], active: vec![true, false] }).unwrap();
        let back: Clocks = postcard::from_bytes(&bad).unwrap();
        assert!(!back.is_consistent());
        assert_eq!((back.done(), back.fast()), (3, Some(2)));
    }
}
