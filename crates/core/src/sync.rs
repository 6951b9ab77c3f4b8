//! Synchronization policies and the clock bookkeeping they decide on (DESIGN.md §3).
//!
//! Worker loop, iteration t = 0, 1, 2, ...: `pull(t)`, compute, `push(t)`. For one block
//! a server tracks, per worker, how many clocks that worker has pushed. `done` is the
//! smallest clock that some worker has not pushed yet (every clock below `done` is
//! complete); `fast` is the highest clock pushed by anyone. Pushes are never held; a
//! pull may be, and [`SyncPolicy::holds`] is the one place that says when.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::CoreError;

/// Logical iteration number of a worker.
pub type Clock = u32;

/// When a server answers a pull.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SyncPolicy {
    /// Bulk synchronous: `pull(t)` waits until every worker pushed clock `t - 1`.
    Bsp,
    /// Asynchronous: never waits.
    Asp,
    /// Stale synchronous with staleness `s`: `pull(t)` waits while `done < t - s`.
    Ssp(u32),
}

impl SyncPolicy {
    /// The staleness bound: 0 for BSP, `None` (unbounded) for ASP.
    pub fn staleness(self) -> Option<u32> {
        match self {
            SyncPolicy::Bsp => Some(0),
            SyncPolicy::Asp => None,
            SyncPolicy::Ssp(s) => Some(s),
        }
    }

    /// True if a `pull(t)` must be held while the block's `done` clock is `done`.
    ///
    /// This is the invariant every test checks: no `pull(t)` is answered while
    /// `done < t - s`.
    pub fn holds(self, t: Clock, done: Clock) -> bool {
        match self.staleness() {
            None => false,
            Some(s) => u64::from(done) + u64::from(s) < u64::from(t),
        }
    }
}

impl fmt::Display for SyncPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SyncPolicy::Bsp => f.write_str("bsp"),
            SyncPolicy::Asp => f.write_str("asp"),
            SyncPolicy::Ssp(s) => write!(f, "ssp:{s}"),
        }
    }
}

impl FromStr for SyncPolicy {
    type Err = CoreError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let err = |why: &str| CoreError::Parse {
            what: "sync policy",
            input: input.to_string(),
            why: format!("{why}; expected bsp, asp or ssp:S (S a non-negative integer)"),
        };
        match input.trim().to_ascii_lowercase().as_str() {
            "bsp" => Ok(SyncPolicy::Bsp),
            "asp" => Ok(SyncPolicy::Asp),
            other => match other.split_once(':') {
                Some(("ssp", s)) => s
                    .parse()
                    .map(SyncPolicy::Ssp)
                    .map_err(|_| err("bad staleness")),
                _ => Err(err("unknown policy")),
            },
        }
    }
}

/// Per-block clock state: how many clocks each worker has pushed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Clocks {
    pushed: Vec<Clock>,
    active: Vec<bool>,
}

impl Clocks {
    /// Fresh state for `workers` workers, none of whom has pushed.
    pub fn new(workers: u32) -> Self {
        Self {
            pushed: vec![0; workers as usize],
            active: vec![true; workers as usize],
        }
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
    /// left, nothing can hold: `Clock::MAX`.
    pub fn done(&self) -> Clock {
        self.pushed
            .iter()
            .zip(&self.active)
            .filter(|(_, a)| **a)
            .map(|(p, _)| *p)
            .min()
            .unwrap_or(Clock::MAX)
    }

    /// The highest clock pushed by anyone, or `None` before the first push.
    pub fn fast(&self) -> Option<Clock> {
        self.pushed.iter().max().and_then(|p| p.checked_sub(1))
    }

    /// Records that `worker` pushed clock `clock`. Returns `Ok(false)` for a duplicate
    /// (already pushed: drop it), `Ok(true)` for the next clock, an error for a gap.
    pub fn record(&mut self, block: u32, worker: u32, clock: Clock) -> Result<bool, CoreError> {
        let slot = self
            .pushed
            .get_mut(worker as usize)
            .ok_or(CoreError::UnknownWorker(worker))?;
        if clock < *slot {
            return Ok(false);
        }
        if clock > *slot {
            return Err(CoreError::ClockGap {
                block,
                worker,
                expected: *slot,
                got: clock,
            });
        }
        *slot += 1;
        Ok(true)
    }

    /// Takes a worker out of the quorum (it died or left): `done` stops waiting for it.
    pub fn remove_worker(&mut self, worker: u32) {
        if let Some(a) = self.active.get_mut(worker as usize) {
            *a = false;
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
    fn parses_and_prints_policies() {
        for s in ["bsp", "asp", "ssp:0", "ssp:3"] {
            assert_eq!(s.parse::<SyncPolicy>().unwrap().to_string(), s);
        }
        assert!("ssp".parse::<SyncPolicy>().is_err());
        assert!("ssp:-1".parse::<SyncPolicy>().is_err());
        assert!("lazy:x".parse::<SyncPolicy>().is_err());
    }

    #[test]
    fn hold_rules_match_the_table() {
        // bsp holds pull(t) while done < t
        assert!(SyncPolicy::Bsp.holds(1, 0));
        assert!(!SyncPolicy::Bsp.holds(1, 1));
        assert!(!SyncPolicy::Bsp.holds(0, 0));
        // ssp:2 holds pull(t) while done < t - 2
        assert!(!SyncPolicy::Ssp(2).holds(2, 0));
        assert!(SyncPolicy::Ssp(2).holds(3, 0));
        assert!(!SyncPolicy::Ssp(2).holds(3, 1));
        // ssp:0 is bsp, asp never holds
        for t in 0..5 {
            for d in 0..5 {
                assert_eq!(SyncPolicy::Ssp(0).holds(t, d), SyncPolicy::Bsp.holds(t, d));
                assert!(!SyncPolicy::Asp.holds(t, d));
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
        assert!(matches!(
            c.record(0, 1, 1),
            Err(CoreError::ClockGap {
                expected: 0,
                got: 1,
                ..
            })
        ));
        assert_eq!(c.record(0, 1, 0), Ok(true));
        assert_eq!(c.done(), 1);
        c.remove_worker(1);
        assert_eq!(c.done(), 2);
        assert!(c.record(0, 7, 0).is_err());
    }
}
