//! Gradient compression on the worker, as BytePS does it: a gradient tensor is sparsified
//! to k of its entries (the k of largest magnitude, top-k, or k drawn at random, random-k),
//! and what is not sent stays behind as the tensor's residual, added to its next gradient
//! (error feedback), so no gradient mass is ever lost, only delayed.
//!
//! - [`Sparsifier`]: which entries, and how many (`topk:0.01`, `randomk:0.01`).
//! - [`ErrorFeedback`]: one tensor's residual and random stream; [`ErrorFeedback::compress`]
//!   turns a gradient into the [`SparseGrad`] to push.
//!
//! A server applies a [`SparseGrad`] as [`Gradient::Sparse`] (`Block::push_gradient`)
//! without densifying the block.

use std::fmt;
use std::str::FromStr;

use rand::SeedableRng;
use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};

use crate::CoreError;
use crate::block::Gradient;

/// Which entries of a gradient a worker sends, and how many: `ratio` of them, at least
/// one ([`Sparsifier::k`]).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum Sparsifier {
    /// The k entries of largest magnitude (of gradient plus residual); ties go to the
    /// lower index.
    TopK {
        /// The share of entries sent, in (0, 1].
        ratio: f32,
    },
    /// k entries drawn uniformly without replacement from a seeded stream.
    RandomK {
        /// The share of entries sent, in (0, 1].
        ratio: f32,
    },
}

impl Sparsifier {
    /// The share of entries sent.
    pub const fn ratio(self) -> f32 {
        match self {
            Sparsifier::TopK { ratio } | Sparsifier::RandomK { ratio } => ratio,
        }
    }

    /// How many of `len` entries are sent: `ceil(ratio * len)`, at least 1, at most `len`
    /// (0 for an empty tensor). The product is rounded as the decimal ratio written on the
    /// command line would give it: the f32 that holds 0.1 is a little above 0.1, and
    /// `topk:0.1` of 10 entries is 1, not 2 (a relative error of one f32 epsilon is
    /// forgiven before the ceiling).
    pub fn k(self, len: usize) -> usize {
        let exact = f64::from(self.ratio()) * len as f64;
        let forgiven = exact - exact * f64::from(f32::EPSILON);
        (forgiven.ceil() as usize).max(1).min(len)
    }

    /// Checks that the ratio is in (0, 1].
    pub fn validate(self) -> Result<(), CoreError> {
        let ratio = self.ratio();
        if ratio > 0.0 && ratio <= 1.0 {
            Ok(())
        } else {
            Err(CoreError::Parse {
                what: "sparsifier",
                input: self.to_string(),
                why: format!("the ratio must be in (0, 1], not {ratio}"),
            })
        }
    }
}

impl fmt::Display for Sparsifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Sparsifier::TopK { ratio } => write!(f, "topk:{ratio}"),
            Sparsifier::RandomK { ratio } => write!(f, "randomk:{ratio}"),
        }
    }
}

impl FromStr for Sparsifier {
    type Err = CoreError;

    /// `topk:RATIO` or `randomk:RATIO` (case and surrounding spaces ignored), RATIO in
    /// (0, 1]: what `--compress` and Python's `compress=` take.
    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let err = |why: String| CoreError::Parse {
            what: "sparsifier",
            input: input.to_string(),
            why: format!("{why}; expected topk:RATIO or randomk:RATIO with RATIO in (0, 1], e.g. topk:0.01"),
        };
        let lower = input.trim().to_ascii_lowercase();
        let Some((name, ratio)) = lower.split_once(':') else {
            return Err(err("no ratio".into()));
        };
        let ratio: f32 = ratio.trim().parse().map_err(|_| err(format!("{ratio:?} is not a number")))?;
        let s = match name.trim() {
            "topk" => Sparsifier::TopK { ratio },
            "randomk" => Sparsifier::RandomK { ratio },
            other => return Err(err(format!("unknown sparsifier {other:?}"))),
        };
        if !(ratio > 0.0 && ratio <= 1.0) {
            return Err(err(format!("the ratio {ratio} is not in (0, 1]")));
        }
        Ok(s)
    }
}

/// A gradient sparsified to the entries sent: `values[i]` is the entry at `indices[i]`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SparseGrad {
    /// Strictly ascending, each below the tensor's length.
    pub indices: Vec<u32>,
    /// One per index.
    pub values: Vec<f32>,
}

impl SparseGrad {
    /// As a push's gradient ([`Gradient::Sparse`]).
    pub fn as_gradient(&self) -> Gradient<'_> {
        Gradient::Sparse { indices: &self.indices, values: &self.values }
    }

    /// The part of it in elements `offset..offset + len` (a block of its tensor), indices
    /// rebased to the block's first element. A block none of whose elements was picked
    /// gets index 0 with value 0.0: the zero gradient, so the block still takes the step
    /// the dense gradient would give it (momentum and Adam move at a zero gradient; a
    /// sparse gradient without an index is refused, [`Gradient::check`]). Binary search:
    /// O(log n + what it takes).
    pub fn block(&self, offset: usize, len: usize) -> SparseGrad {
        let start = self.indices.partition_point(|i| (*i as usize) < offset);
        let end = self.indices.partition_point(|i| (*i as usize) < offset + len);
        if start == end {
            return SparseGrad { indices: vec![0], values: vec![0.0] };
        }
        SparseGrad {
            indices: self.indices[start..end].iter().map(|i| i - offset as u32).collect(),
            values: self.values[start..end].to_vec(),
        }
    }

    /// The dense gradient it stands for: zeros but at its indices.
    pub fn densify(&self, len: usize) -> Vec<f32> {
        let mut dense = vec![0.0; len];
        for (i, v) in self.indices.iter().zip(&self.values) {
            dense[*i as usize] = *v;
        }
        dense
    }
}

/// One tensor's error feedback: the residual (what was not sent yet, sized on the first
/// gradient) and, for random-k, its random stream.
///
/// Non-finite values are sent, not kept: top-k ranks NaN above infinity above every finite
/// magnitude, so a NaN or infinite entry of the residual leaves at the next
/// [`compress`](ErrorFeedback::compress) (the lower indices first when more than k are
/// non-finite), and random-k sends it when its index is drawn (each step with probability
/// k/len). A sent entry's residual is set to 0, so a NaN never stays behind once sent.
#[derive(Clone, Debug)]
pub struct ErrorFeedback {
    sparsifier: Sparsifier,
    residual: Vec<f32>,
    rng: StdRng,
    /// Top-k's selection keys, kept between steps (one allocation per tensor).
    keys: Vec<u64>,
}

impl ErrorFeedback {
    /// Error feedback for one tensor, drawing random-k's indices from `seed` (give each
    /// tensor and worker its own).
    pub fn new(sparsifier: Sparsifier, seed: u64) -> Self {
        Self { sparsifier, residual: Vec::new(), rng: StdRng::seed_from_u64(seed), keys: Vec::new() }
    }

    /// The sparsifier it applies.
    pub fn sparsifier(&self) -> Sparsifier {
        self.sparsifier
    }

    /// What was not sent yet (empty before the first gradient).
    pub fn residual(&self) -> &[f32] {
        &self.residual
    }

    /// Forgets the residual (a new model, a reloaded checkpoint); the random stream goes on.
    pub fn reset(&mut self) {
        self.residual.clear();
        self.keys = Vec::new();
    }

    /// Adds `grad` to the residual, takes k entries out of it ([`Sparsifier::k`]) and
    /// returns them to send, indices ascending; the residual at them becomes 0.
    ///
    /// # Panics
    ///
    /// If `grad` is not as long as the first gradient since [`new`](Self::new) or
    /// [`reset`](Self::reset) (one `ErrorFeedback` per tensor), or longer than `u32::MAX`
    /// entries (indices are u32).
    pub fn compress(&mut self, grad: &[f32]) -> SparseGrad {
        assert!(u32::try_from(grad.len()).is_ok(), "a tensor of {} entries cannot be sparsified", grad.len());
        if self.residual.is_empty() {
            self.residual.resize(grad.len(), 0.0);
        }
        assert_eq!(self.residual.len(), grad.len(), "one ErrorFeedback per tensor: its gradient changed length");
        for (r, g) in self.residual.iter_mut().zip(grad) {
            *r += g;
        }
        let len = grad.len();
        let k = self.sparsifier.k(len);
        let indices = match self.sparsifier {
            _ if k == len => (0..len as u32).collect(),
            Sparsifier::TopK { .. } => top_k(&self.residual, k, &mut self.keys),
            Sparsifier::RandomK { .. } => {
                let mut picked: Vec<u32> =
                    rand::seq::index::sample(&mut self.rng, len, k).into_iter().map(|i| i as u32).collect();
                picked.sort_unstable();
                picked
            }
        };
        let values = indices.iter().map(|i| std::mem::take(&mut self.residual[*i as usize])).collect();
        debug_assert_eq!(indices.len(), k);
        debug_assert!(indices.windows(2).all(|w| w[0] < w[1]), "indices not strictly ascending");
        SparseGrad { indices, values }
    }
}

/// The indices of the `k` entries of `r` of largest magnitude (NaN above infinity above
/// every finite value; ties to the lower index), ascending. `keys` is scratch.
///
/// One linear selection over `len` u64 keys, each the complement of the magnitude's bits
/// (for a sign-cleared f32 the bits order as the values, NaN last) above the index, so
/// the smallest keys are the largest magnitudes, lower index first.
fn top_k(r: &[f32], k: usize, keys: &mut Vec<u64>) -> Vec<u32> {
    debug_assert!(0 < k && k < r.len());
    keys.clear();
    keys.extend(r.iter().enumerate().map(|(i, x)| (u64::from(!(x.to_bits() & 0x7fff_ffff)) << 32) | i as u64));
    keys.select_nth_unstable(k - 1);
    let mut picked: Vec<u32> = keys[..k].iter().map(|key| *key as u32).collect();
    picked.sort_unstable();
    picked
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn k_is_the_ceiling_of_the_decimal_ratio_at_least_one_at_most_all() {
        let top = |ratio| Sparsifier::TopK { ratio };
        assert_eq!(top(0.1).k(10), 1, "0.1 as f32 is above 0.1: the ceiling forgives it");
        assert_eq!(top(0.3).k(10), 3);
        assert_eq!(top(0.01).k(1_000_000), 10_000);
        assert_eq!(top(0.01).k(1_000_001), 10_001);
        assert_eq!(top(0.25).k(9), 3);
        assert_eq!(top(1e-9).k(1000), 1);
        assert_eq!(top(1.0).k(7), 7);
        assert_eq!(top(0.5).k(1), 1);
        assert_eq!(top(0.5).k(0), 0);
    }

    #[test]
    fn the_spelling_parses_and_bad_input_is_refused_with_the_accepted_forms() {
        assert_eq!("topk:0.01".parse(), Ok(Sparsifier::TopK { ratio: 0.01 }));
        assert_eq!(" RandomK:1 ".parse(), Ok(Sparsifier::RandomK { ratio: 1.0 }));
        assert_eq!(Sparsifier::TopK { ratio: 0.01 }.to_string(), "topk:0.01");
        let back: Sparsifier = Sparsifier::RandomK { ratio: 0.5 }.to_string().parse().unwrap();
        assert_eq!(back, Sparsifier::RandomK { ratio: 0.5 });
        for bad in ["topk", "topk:0", "topk:-0.5", "topk:1.5", "topk:nan", "topk:abc", "bottomk:0.1", ""] {
            let e = bad.parse::<Sparsifier>().unwrap_err();
            assert!(matches!(&e, CoreError::Parse { what: "sparsifier", .. }), "{bad}: {e}");
            assert!(e.to_string().contains("topk:RATIO or randomk:RATIO"), "{e}");
        }
        assert!(Sparsifier::TopK { ratio: 0.0 }.validate().is_err());
        assert!(Sparsifier::RandomK { ratio: f32::NAN }.validate().is_err());
        assert!(Sparsifier::RandomK { ratio: 1.0 }.validate().is_ok());
        let s = Sparsifier::TopK { ratio: 0.25 };
        assert_eq!(postcard::from_bytes::<Sparsifier>(&postcard::to_allocvec(&s).unwrap()), Ok(s));
    }

    #[test]
    fn top_k_sends_the_largest_magnitudes_and_keeps_the_rest() {
        let mut ef = ErrorFeedback::new(Sparsifier::TopK { ratio: 0.3 }, 0);
        let g = [0.5, -4.0, 1.0, 3.0, -0.25, 2.0, 0.0, -1.5, 0.75, 0.1];
        let sent = ef.compress(&g);
        assert_eq!(sent, SparseGrad { indices: vec![1, 3, 5], values: vec![-4.0, 3.0, 2.0] });
        assert_eq!(ef.residual(), &[0.5, 0.0, 1.0, 0.0, -0.25, 0.0, 0.0, -1.5, 0.75, 0.1]);
        // The residual joins the next gradient: -1.5 + -1 = -2.5 and 1 + 1 = 2 lead now.
        let sent = ef.compress(&[0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, -1.0, 0.0, 0.0]);
        assert_eq!(sent.indices, vec![2, 7, 8]);
        assert_eq!(sent.values, vec![2.0, -2.5, 0.75]);
        // Ties go to the lower index.
        let mut ef = ErrorFeedback::new(Sparsifier::TopK { ratio: 0.5 }, 0);
        assert_eq!(ef.compress(&[1.0, -1.0, 1.0, 1.0]).indices, vec![0, 1]);
    }

    #[test]
    fn non_finite_entries_are_sent_first_and_never_stay_in_the_residual() {
        let mut ef = ErrorFeedback::new(Sparsifier::TopK { ratio: 0.25 }, 0);
        let g = [1e30, f32::NAN, -3.0, f32::NEG_INFINITY, 5.0, 0.0, 1.0, 2.0];
        let sent = ef.compress(&g);
        assert_eq!(sent.indices, vec![1, 3], "NaN and -inf rank above every finite magnitude");
        assert!(sent.values[0].is_nan() && sent.values[1] == f32::NEG_INFINITY);
        assert!(ef.residual().iter().all(|r| r.is_finite()), "{:?}", ef.residual());
        assert_eq!(ef.compress(&[0.0; 8]).indices, vec![0, 4]);
    }

    #[test]
    fn random_k_is_determined_by_its_seed_and_spreads_over_every_index() {
        let run = |seed| {
            let mut ef = ErrorFeedback::new(Sparsifier::RandomK { ratio: 0.1 }, seed);
            (0..20).map(|_| ef.compress(&[1.0; 100]).indices).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7), "the same seed draws the same indices");
        assert_ne!(run(7), run(8), "another seed draws others");
        // 400 steps of 10 out of 100: each index is drawn 40 times on average.
        let mut ef = ErrorFeedback::new(Sparsifier::RandomK { ratio: 0.1 }, 3);
        let mut drawn = [0u32; 100];
        for _ in 0..400 {
            for i in ef.compress(&[0.0; 100]).indices {
                drawn[i as usize] += 1;
            }
        }
        let (min, max) = (drawn.iter().min().unwrap(), drawn.iter().max().unwrap());
        assert!(*min >= 15 && *max <= 70, "draws per index from {min} to {max}: {drawn:?}");
    }

    #[test]
    fn reset_forgets_the_residual_and_takes_a_new_length() {
        let mut ef = ErrorFeedback::new(Sparsifier::TopK { ratio: 0.5 }, 0);
        ef.compress(&[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(ef.residual(), &[1.0, 2.0, 0.0, 0.0]);
        ef.reset();
        assert!(ef.residual().is_empty());
        assert_eq!(ef.compress(&[1.0, 2.0]).indices, vec![1]);
        let mut empty = ErrorFeedback::new(Sparsifier::RandomK { ratio: 0.5 }, 0);
        assert_eq!(empty.compress(&[]), SparseGrad::default(), "an empty tensor sends nothing");
    }

    #[test]
    fn a_block_s_part_is_rebased_and_a_block_without_a_pick_gets_the_zero_gradient() {
        let g = SparseGrad { indices: vec![1, 4, 5, 9], values: vec![1.0, 2.0, 3.0, 4.0] };
        assert_eq!(g.block(0, 4), SparseGrad { indices: vec![1], values: vec![1.0] });
        assert_eq!(g.block(4, 4), SparseGrad { indices: vec![0, 1], values: vec![2.0, 3.0] });
        assert_eq!(g.block(8, 2), SparseGrad { indices: vec![1], values: vec![4.0] });
        assert_eq!(g.block(6, 2), SparseGrad { indices: vec![0], values: vec![0.0] });
        // The parts of blocks that cut the tensor densify to the tensor's dense gradient.
        let parts: Vec<f32> = [(0, 4), (4, 4), (8, 2)].iter().flat_map(|(o, l)| g.block(*o, *l).densify(*l)).collect();
        assert_eq!(parts, g.densify(10));
        for (o, l) in [(0, 4), (4, 4), (6, 2), (8, 2)] {
            assert_eq!(g.block(o, l).as_gradient().check(0, l), Ok(()));
        }
    }

    fn any_sparsifier() -> impl Strategy<Value = Sparsifier> {
        prop_oneof![
            (0.01f32..=1.0).prop_map(|ratio| Sparsifier::TopK { ratio }),
            (0.01f32..=1.0).prop_map(|ratio| Sparsifier::RandomK { ratio }),
        ]
    }

    proptest! {
        /// Over any sequence of gradients (small integers, so every sum is exact), for
        /// every entry: what was sent plus the residual is the sum of the gradients, and
        /// every step sends exactly k strictly ascending indices in range.
        #[test]
        fn error_feedback_loses_no_gradient_mass(
            sparsifier in any_sparsifier(),
            seed in any::<u64>(),
            len in 1usize..40,
            steps in proptest::collection::vec(proptest::collection::vec(-8i8..=8, 40), 1..12),
        ) {
            let mut ef = ErrorFeedback::new(sparsifier, seed);
            let mut pushed = vec![0f32; len];
            let mut sent = vec![0f32; len];
            for step in &steps {
                let g: Vec<f32> = step[..len].iter().map(|x| f32::from(*x)).collect();
                let s = ef.compress(&g);
                prop_assert_eq!(s.indices.len(), sparsifier.k(len));
                prop_assert_eq!(s.values.len(), s.indices.len());
                prop_assert!(s.indices.windows(2).all(|w| w[0] < w[1]), "{:?}", s.indices);
                prop_assert!(s.indices.iter().all(|i| (*i as usize) < len));
                for (i, v) in s.indices.iter().zip(&s.values) {
                    sent[*i as usize] += v;
                }
                for (p, g) in pushed.iter_mut().zip(&g) {
                    *p += g;
                }
                for i in 0..len {
                    prop_assert_eq!(sent[i] + ef.residual()[i], pushed[i], "entry {}", i);
                }
            }
        }
    }
}
