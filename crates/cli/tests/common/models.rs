//! The models and gradients of the process tests: small tensors and integer gradients, so
//! that every sum is exact in f32 (in any order) and a lost or doubled update shows in the
//! final values.

use elasticps_core::model::{Init, TensorSpec};

/// Zero-initialised vectors, one `(name, len)` each.
pub fn zeros(tensors: &[(&str, usize)]) -> Vec<TensorSpec> {
    tensors
        .iter()
        .map(|(name, len)| TensorSpec { name: (*name).into(), shape: vec![*len], init: Init::Zeros })
        .collect()
}

/// Tensor `a` of `len` values and tensor `b` of 3, from zeros.
pub fn a_and_b(len: usize) -> Vec<TensorSpec> {
    zeros(&[("a", len), ("b", 3)])
}

/// Element `i` of worker `rank`'s gradient at clock `t`.
pub type Formula = fn(u32, u32, usize) -> f32;

/// Worker `rank`'s gradient at clock `t` for every tensor of `model`, element by element
/// by `f`.
pub fn gradients(model: &[TensorSpec], f: Formula, rank: u32, t: u32) -> Vec<Vec<f32>> {
    model.iter().map(|s| (0..s.len()).map(|i| f(rank, t, i)).collect()).collect()
}

/// SGD with lr 1 from zeros, every push of `workers` workers at clocks `0..clocks` applied
/// once: minus the sum of their gradients, for a tensor of `len` values.
pub fn sgd_from_zeros(f: Formula, workers: u32, clocks: u32, len: usize) -> Vec<f32> {
    let mut v = vec![0.0f32; len];
    for rank in 0..workers {
        for t in 0..clocks {
            for (i, x) in v.iter_mut().enumerate() {
                *x -= f(rank, t, i);
            }
        }
    }
    v
}
