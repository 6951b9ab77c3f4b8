//! The worker's gradient compression ([`super::ClientOptions::compress`],
//! [`super::Client::set_sparsifier`]): each compressed tensor's gradient goes through that
//! tensor's error feedback ([`ErrorFeedback`]) and comes out as the [`SparseGrad`] to
//! push (each block its part, as a sparse payload: `frames.rs`), its residual kept here
//! for the tensor's next gradient.

use std::collections::HashMap;

use elasticps_core::compress::{ErrorFeedback, SparseGrad, Sparsifier};

/// One worker's error feedback, one per compressed tensor, created on the tensor's first
/// gradient.
#[derive(Debug)]
pub(super) struct Compression {
    /// The job's sparsifier (`--compress`), for the tensors not set apart.
    default: Option<Sparsifier>,
    /// Tensors whose sparsifier was chosen for them (`None`: pushed whole).
    chosen: HashMap<usize, Option<Sparsifier>>,
    rank: u32,
    feedback: Vec<Option<ErrorFeedback>>,
}

impl Compression {
    /// Compression by `sparsifier` (none: only the tensors [`Compression::set`] chooses)
    /// for worker `rank` (random-k's seed is the rank's and the tensor's: workers draw
    /// different indices).
    pub(super) fn new(sparsifier: Option<Sparsifier>, rank: u32) -> Self {
        Self { default: sparsifier, chosen: HashMap::new(), rank, feedback: Vec::new() }
    }

    /// Tensor `tensor` is compressed by `sparsifier` from now on (`None`: pushed whole);
    /// a changed sparsifier starts from an empty residual.
    pub(super) fn set(&mut self, tensor: usize, sparsifier: Option<Sparsifier>) {
        if self.sparsifier(tensor) != sparsifier
            && let Some(f) = self.feedback.get_mut(tensor)
        {
            *f = None;
        }
        self.chosen.insert(tensor, sparsifier);
    }

    /// The sparsifier of tensor `tensor`, if it is compressed.
    pub(super) fn sparsifier(&self, tensor: usize) -> Option<Sparsifier> {
        self.chosen.get(&tensor).copied().unwrap_or(self.default)
    }

    /// Forgets every residual (a model registered anew).
    pub(super) fn reset(&mut self) {
        self.feedback.clear();
    }

    /// The residual of tensor `tensor` (empty before its first gradient).
    #[cfg(test)]
    pub(super) fn residual(&self, tensor: usize) -> &[f32] {
        self.feedback.get(tensor).and_then(Option::as_ref).map_or(&[], ErrorFeedback::residual)
    }

    /// A round's gradients (`grads[t]`: tensor `t`'s, `None` where the round pushes none
    /// of it) through their tensors' error feedback. A tensor not in the round, or pushed
    /// without a gradient (empty), is `None`: its residual waits for its next gradient.
    /// The caller must push what this returns: a gradient compressed and then not pushed
    /// (a round given up) loses what was taken out of its residual.
    pub(super) fn compress(&mut self, grads: &[Option<&[f32]>]) -> Vec<Option<SparseGrad>> {
        if self.feedback.len() < grads.len() {
            self.feedback.resize_with(grads.len(), || None);
        }
        let rank = self.rank;
        let sparsifiers: Vec<Option<Sparsifier>> = (0..grads.len()).map(|t| self.sparsifier(t)).collect();
        grads
            .iter()
            .zip(&mut self.feedback)
            .zip(sparsifiers)
            .enumerate()
            .map(|(t, ((grad, feedback), sparsifier))| {
                let (grad, sparsifier) = (grad.filter(|g| !g.is_empty())?, sparsifier?);
                let feedback = feedback.get_or_insert_with(|| ErrorFeedback::new(sparsifier, seed(rank, t)));
                Some(feedback.compress(grad))
            })
            .collect()
    }
}

/// Random-k's seed of worker `rank`'s tensor `tensor`.
fn seed(rank: u32, tensor: usize) -> u64 {
    (u64::from(rank) << 32 | tensor as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_tensor_keeps_its_own_residual_and_a_tensor_without_a_gradient_keeps_it() {
        let mut c = Compression::new(Some(Sparsifier::TopK { ratio: 0.5 }), 3);
        let out = c.compress(&[Some(&[1.0, -4.0, 2.0, 0.5][..]), None, Some(&[3.0, 1.0][..])]);
        assert_eq!(out[0], Some(SparseGrad { indices: vec![1, 2], values: vec![-4.0, 2.0] }));
        assert_eq!(out[1], None);
        assert_eq!(out[2], Some(SparseGrad { indices: vec![0], values: vec![3.0] }));
        assert_eq!((c.residual(0), c.residual(2)), (&[1.0, 0.0, 0.0, 0.5][..], &[0.0, 1.0][..]));
        // Tensor 0 pushed without a gradient, tensor 2 not in the round: both keep theirs.
        let out = c.compress(&[Some(&[][..]), Some(&[1.0][..])]);
        assert_eq!(out, vec![None, Some(SparseGrad { indices: vec![0], values: vec![1.0] })]);
        assert_eq!((c.residual(0), c.residual(2)), (&[1.0, 0.0, 0.0, 0.5][..], &[0.0, 1.0][..]));
        // The residual joins the next gradient.
        let out = c.compress(&[Some(&[0.0, 0.0, 0.0, 1.0][..])]);
        assert_eq!(out[0], Some(SparseGrad { indices: vec![0, 3], values: vec![1.0, 1.5] }));
        c.reset();
        assert!(c.residual(0).is_empty());
    }

    #[test]
    fn a_tensor_set_apart_follows_its_own_sparsifier() {
        let mut c = Compression::new(None, 0);
        let g = [1.0, -4.0, 2.0, 0.5];
        assert_eq!(c.compress(&[Some(&g[..]), Some(&g[..])]), vec![None, None], "nothing compressed by default");
        c.set(1, Some(Sparsifier::TopK { ratio: 0.25 }));
        let out = c.compress(&[Some(&g[..]), Some(&g[..])]);
        assert_eq!(out, vec![None, Some(SparseGrad { indices: vec![1], values: vec![-4.0] })]);
        // A new sparsifier starts from an empty residual; none pushes whole again.
        c.set(1, Some(Sparsifier::TopK { ratio: 0.5 }));
        assert!(c.residual(1).is_empty());
        c.set(1, None);
        assert_eq!(c.compress(&[None, Some(&g[..])]), vec![None, None]);
    }

    #[test]
    fn workers_and_tensors_draw_different_random_indices() {
        let draw = |rank| {
            let mut c = Compression::new(Some(Sparsifier::RandomK { ratio: 0.1 }), rank);
            let g = vec![1.0; 100];
            c.compress(&[Some(&g[..]), Some(&g[..])]).into_iter().map(|s| s.unwrap().indices).collect::<Vec<_>>()
        };
        let (a, b) = (draw(0), draw(1));
        assert_ne!(a[0], a[1], "two tensors of one worker");
        assert_ne!(a[0], b[0], "one tensor of two workers");
        assert_eq!(a, draw(0), "the same worker draws the same");
    }
}
