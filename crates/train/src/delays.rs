//! What an iteration of a worker costs besides its gradient: the synthetic model's compute
//! time, a persistent straggler's delay (`--worker-delay`) and a transient straggler's
//! (`--worker-jitter`). The real worker (`elasticps worker`) and the simulated one
//! (`elasticps sim`) both draw from [`Delays`], so one seed gives both the same draws, and
//! a benchmark can replay a real run's delays on the simulator.
//!
//! - Compute: `compute_ms x (0.9 + 0.2 u)`, u uniform, from a generator seeded with
//!   `seed + rank`, one draw per iteration.
//! - `--worker-delay`: a normal delay clipped at 0, from a generator seeded with
//!   `seed ^ 0x5EED ^ rank`, one draw per iteration of the listed ranks.
//! - `--worker-jitter P:MS` ([`Jitter`]): every rank, at every iteration, is slow by MS
//!   with probability P. The draw of `(rank, iteration)` is a pure function of the seed,
//!   the rank and the iteration ([`Jitter::delay_ms`]): it depends on no generator's
//!   state and on no timing, so a replay draws exactly the same delays.
//!
//! ```
//! use elasticps_train::delays::{Delays, Jitter};
//!
//! let jitter: Jitter = "0.1:80".parse()?;
//! let slow = (0..1000).filter(|t| jitter.delay_ms(7, 3, *t) > 0.0).count();
//! assert!((60..140).contains(&slow), "{slow} of 1000 iterations slow");
//! let mut a = Delays::new(7, 3, 20.0, None, Some(jitter))?;
//! let mut b = Delays::new(7, 3, 20.0, None, Some(jitter))?;
//! assert_eq!(a.next(0), b.next(0));
//! # Ok::<(), elasticps_train::TrainError>(())
//! ```

use std::fmt;
use std::str::FromStr;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal};

use crate::TrainError;

/// Mixed into the seed of the transient draws, so that they are independent of every other
/// stream drawn from the same seed.
const JITTER_SALT: u64 = 0x6A17_7E25_D1A7_5EED;

/// `--worker-jitter P:MS`: at every iteration, every worker is independently slow by `ms`
/// milliseconds with probability `p` (the SSP literature's transient straggler).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Jitter {
    /// Probability that one worker is slow at one iteration, in [0, 1].
    pub p: f64,
    /// How slow, ms (>= 0).
    pub ms: f64,
}

impl Jitter {
    /// The delay of `rank` at `iteration`, ms: `ms` or 0. A pure function of `seed`,
    /// `rank` and `iteration`.
    pub fn delay_ms(&self, seed: u64, rank: u32, iteration: u32) -> f64 {
        if unit(seed, rank, iteration) < self.p { self.ms } else { 0.0 }
    }

    /// The expected delay of one worker per iteration, ms (`p x ms`): what a policy that
    /// never waits pays.
    pub fn mean_ms(&self) -> f64 {
        self.p * self.ms
    }

    /// The expected largest delay of `workers` workers per iteration, ms
    /// (`ms x (1 - (1 - p)^workers)`): what bsp pays.
    pub fn expected_max_ms(&self, workers: u32) -> f64 {
        self.ms * (1.0 - (1.0 - self.p).powi(workers as i32))
    }
}

/// A uniform number in [0, 1) from `(seed, rank, iteration)` alone (two rounds of
/// splitmix64's finalizer).
fn unit(seed: u64, rank: u32, iteration: u32) -> f64 {
    let key = (u64::from(rank) << 32) | u64::from(iteration);
    let h = mix(mix(seed ^ JITTER_SALT) ^ key);
    (h >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// splitmix64's finalizer (Steele, Lea, Flood 2014): a bijection that spreads every input
/// bit over every output bit.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl FromStr for Jitter {
    type Err = TrainError;

    fn from_str(s: &str) -> Result<Self, TrainError> {
        let bad = |why: &str| TrainError::InvalidJitter(format!("{s:?}: {why}"));
        let (p, ms) = s.split_once(':').ok_or_else(|| bad("two fields separated by ':'"))?;
        let p: f64 = p.trim().parse().map_err(|_| bad("P is not a number"))?;
        let ms: f64 = ms.trim().parse().map_err(|_| bad("MS is not a number"))?;
        if !(0.0..=1.0).contains(&p) {
            return Err(bad("P must be a probability, from 0 to 1"));
        }
        if !(ms.is_finite() && ms >= 0.0) {
            return Err(bad("MS must be a finite number of milliseconds >= 0"));
        }
        Ok(Jitter { p, ms })
    }
}

impl fmt::Display for Jitter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.p, self.ms)
    }
}

/// One iteration's draws of one worker.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Draw {
    /// Compute time of the synthetic model, ms (`compute_ms x (0.9 + 0.2 u)`).
    pub compute_ms: f64,
    /// The straggler delays after the compute, ms: `--worker-delay`'s plus
    /// `--worker-jitter`'s.
    pub delay_ms: f64,
}

/// The draws of one worker, iteration after iteration ([`Delays::next`] once per
/// iteration, in order).
#[derive(Clone, Debug)]
pub struct Delays {
    seed: u64,
    rank: u32,
    compute_ms: f64,
    compute: StdRng,
    persistent: Option<(Normal<f64>, StdRng)>,
    jitter: Option<Jitter>,
}

impl Delays {
    /// The draws of `rank` from `seed` (the data seed): `compute_ms` of compute,
    /// `persistent = Some((mean_ms, sd_ms))` if `--worker-delay` names this rank, and the
    /// transient `jitter` of every rank.
    pub fn new(
        seed: u64,
        rank: u32,
        compute_ms: f64,
        persistent: Option<(f64, f64)>,
        jitter: Option<Jitter>,
    ) -> Result<Self, TrainError> {
        let persistent = match persistent {
            Some((mean, sd)) => {
                let normal = Normal::new(mean, sd).map_err(|e| TrainError::InvalidDelay {
                    mean_ms: mean,
                    sd_ms: sd,
                    reason: e.to_string(),
                })?;
                Some((normal, StdRng::seed_from_u64(seed ^ 0x5EED ^ u64::from(rank))))
            }
            None => None,
        };
        Ok(Self {
            seed,
            rank,
            compute_ms: compute_ms.max(0.0),
            compute: StdRng::seed_from_u64(seed.wrapping_add(u64::from(rank))),
            persistent,
            jitter,
        })
    }

    /// The draws of `iteration` (call once per iteration, in order: the compute and
    /// `--worker-delay` draws come from generators; the transient one does not).
    pub fn next(&mut self, iteration: u32) -> Draw {
        let compute_ms = self.compute_ms * (0.9 + 0.2 * self.compute.random::<f64>());
        let mut delay_ms = match self.persistent.as_mut() {
            Some((normal, rng)) => normal.sample(rng).max(0.0),
            None => 0.0,
        };
        if let Some(j) = &self.jitter {
            delay_ms += j.delay_ms(self.seed, self.rank, iteration);
        }
        Draw { compute_ms, delay_ms }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_refuses_with_the_reason() {
        assert_eq!("0.1:80".parse::<Jitter>().unwrap(), Jitter { p: 0.1, ms: 80.0 });
        assert_eq!("1:0".parse::<Jitter>().unwrap(), Jitter { p: 1.0, ms: 0.0 });
        let j: Jitter = "0.25:12.5".parse().unwrap();
        assert_eq!(j.to_string().parse::<Jitter>().unwrap(), j);
        for (bad, why) in [
            ("0.1", "two fields"),
            ("x:80", "P is not a number"),
            ("0.1:y", "MS is not a number"),
            ("1.5:80", "probability"),
            ("-0.1:80", "probability"),
            ("NaN:80", "probability"),
            ("0.1:-5", "milliseconds"),
            ("0.1:inf", "milliseconds"),
        ] {
            let e = bad.parse::<Jitter>().unwrap_err().to_string();
            assert!(e.contains(why) && e.contains("P:MS"), "{bad}: {e}");
        }
    }

    #[test]
    fn draws_are_pure_seeded_and_at_the_rate_asked() {
        let j = Jitter { p: 0.1, ms: 80.0 };
        // The same (seed, rank, iteration): the same draw, whatever was drawn before.
        let first: Vec<f64> = (0..50).map(|t| j.delay_ms(7, 2, t)).collect();
        let again: Vec<f64> = (0..50).rev().map(|t| j.delay_ms(7, 2, t)).rev().collect();
        assert_eq!(first, again);
        // Another seed or rank draws otherwise.
        let n = 4000;
        let slow = |seed, rank| (0..n).filter(|t| j.delay_ms(seed, rank, *t) > 0.0).collect::<Vec<_>>();
        assert_ne!(slow(7, 2), slow(8, 2));
        assert_ne!(slow(7, 2), slow(7, 3));
        // About p of the iterations (binomial sd = 19 of 4000), independently per rank: both
        // ranks slow at about p^2 of them.
        for rank in 0..8 {
            let k = slow(7, rank).len();
            assert!((320..480).contains(&k), "rank {rank}: {k} of {n} slow");
        }
        let (a, b) = (slow(7, 0), slow(7, 1));
        let both = a.iter().filter(|t| b.contains(t)).count();
        assert!((15..70).contains(&both), "{both} of {n} slow on both ranks (expected about 40)");
        // The edges: p = 0 never, p = 1 always.
        assert!((0..1000).all(|t| Jitter { p: 0.0, ms: 5.0 }.delay_ms(1, 0, t) == 0.0));
        assert!((0..1000).all(|t| Jitter { p: 1.0, ms: 5.0 }.delay_ms(1, 0, t) == 5.0));
        assert!((j.expected_max_ms(6) - 80.0 * (1.0 - 0.9f64.powi(6))).abs() < 1e-9);
        assert!((j.mean_ms() - 8.0).abs() < 1e-12);
    }

    #[test]
    fn delays_add_up_and_replay() {
        let j = Jitter { p: 0.3, ms: 40.0 };
        let mut with = Delays::new(7, 1, 20.0, Some((50.0, 10.0)), Some(j)).unwrap();
        let mut persistent = Delays::new(7, 1, 20.0, Some((50.0, 10.0)), None).unwrap();
        let mut plain = Delays::new(7, 1, 20.0, None, None).unwrap();
        for t in 0..200 {
            let (a, b, c) = (with.next(t), persistent.next(t), plain.next(t));
            // The streams are separate: adding one changes no other's draws.
            assert_eq!(a.compute_ms, c.compute_ms);
            assert!((18.0..22.0).contains(&c.compute_ms), "{c:?}");
            assert_eq!(c.delay_ms, 0.0);
            assert_eq!(a.delay_ms, b.delay_ms + j.delay_ms(7, 1, t));
        }
        assert!(Delays::new(7, 1, 20.0, Some((50.0, f64::NAN)), None).is_err());
    }
}
