//! A multi-layer perceptron with hand-written forward and backward passes on ndarray.
//!
//! `sizes = [d0, d1, ..., dL]` gives `L` fully connected layers; every layer but the last
//! is followed by a ReLU, and the last layer's outputs are logits for a softmax
//! cross-entropy loss. The default is `784-256-128-10` (about 235k parameters).
//!
//! # Tensor layout
//!
//! The parameters are `2 L` flat, row-major f32 tensors, in this order:
//!
//! | index      | name            | shape             | init                                   |
//! |------------|-----------------|-------------------|----------------------------------------|
//! | `2 l`      | `fc{l+1}.weight` | `[d_l, d_{l+1}]` (in, out) | uniform `±sqrt(6 / d_l)` (He) for hidden layers, `±sqrt(6 / (d_l + d_{l+1}))` (Glorot) for the output layer |
//! | `2 l + 1`  | `fc{l+1}.bias`   | `[d_{l+1}]`       | zeros                                  |
//!
//! Weights are `[in, out]` (the transpose of PyTorch's `nn.Linear.weight`): element
//! `i * out + j` connects input `i` to output `j`, and a layer computes
//! `z = x · W + b` for a batch `x` of shape `[batch, in]`. Gradients use the same layout.
//! Parameters are viewed in place as ndarray matrices, never copied, and the products
//! run on `matrixmultiply`'s GEMM.

use std::fmt;
use std::str::FromStr;

use elasticps_core::model::{Init, Partition, TensorSpec};
use ndarray::linalg::general_mat_mul;
use ndarray::{Array2, ArrayView1, ArrayView2, ArrayViewMut1, ArrayViewMut2, Axis, Zip, s};

use crate::TrainError;
use crate::dataset::Dataset;

/// Rows per forward pass in [`Mlp::evaluate`].
const EVAL_CHUNK: usize = 1024;

/// A fully connected ReLU network with a softmax cross-entropy head.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Mlp {
    /// Layer widths from input to output, at least two entries, all non-zero; the last is
    /// the number of classes.
    pub sizes: Vec<usize>,
}

impl Default for Mlp {
    /// `784-256-128-10`, for 28 x 28 images in 10 classes.
    fn default() -> Self {
        Self { sizes: vec![784, 256, 128, 10] }
    }
}

/// Mean loss and accuracy of a model on a dataset.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Evaluation {
    /// Mean softmax cross-entropy.
    pub loss: f32,
    /// Fraction of examples whose highest logit is the label, in `[0, 1]`.
    pub accuracy: f32,
}

impl fmt::Display for Evaluation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "loss {:.4}, accuracy {:.2}%", self.loss, self.accuracy * 100.0)
    }
}

impl Mlp {
    /// An MLP with these layer widths (input first, classes last).
    pub fn new(sizes: Vec<usize>) -> Result<Self, TrainError> {
        if sizes.len() < 2 {
            return Err(TrainError::InvalidModel(format!(
                "{sizes:?} has fewer than two layer widths; give the input width, any hidden widths and the class count, e.g. 784-256-128-10"
            )));
        }
        if sizes.contains(&0) {
            return Err(TrainError::InvalidModel(format!(
                "{sizes:?} has a layer of width 0; every width must be at least 1"
            )));
        }
        Ok(Self { sizes })
    }

    /// Number of fully connected layers (`sizes.len() - 1`).
    pub fn layers(&self) -> usize {
        self.sizes.len().saturating_sub(1)
    }

    /// Number of classes (the last width).
    pub fn classes(&self) -> usize {
        self.sizes.last().copied().unwrap_or(0)
    }

    /// The parameter tensors in order `fc1.weight`, `fc1.bias`, `fc2.weight`, ... (see the
    /// module docs for shapes and initialisation).
    pub fn tensor_specs(&self) -> Vec<TensorSpec> {
        let last = self.layers().saturating_sub(1);
        (0..self.layers())
            .flat_map(|l| {
                let (fan_in, fan_out) = (self.sizes[l], self.sizes[l + 1]);
                let bound =
                    if l < last { (6.0 / fan_in as f32).sqrt() } else { (6.0 / (fan_in + fan_out) as f32).sqrt() };
                [
                    TensorSpec {
                        name: format!("fc{}.weight", l + 1),
                        shape: vec![fan_in, fan_out],
                        init: Init::Uniform { low: -bound, high: bound },
                    },
                    TensorSpec { name: format!("fc{}.bias", l + 1), shape: vec![fan_out], init: Init::Zeros },
                ]
            })
            .collect()
    }

    /// Total number of parameters.
    pub fn num_params(&self) -> usize {
        self.tensor_specs().iter().map(TensorSpec::len).sum()
    }

    /// Initial parameters, identical to what parameter servers initialise from
    /// [`Mlp::tensor_specs`] with the same `seed` (via `Partition::init_values`), so local
    /// reference runs start where distributed runs start.
    ///
    /// # Panics
    /// If the MLP is invalid (see [`Mlp::new`]).
    pub fn init_params(&self, seed: u64) -> Vec<Vec<f32>> {
        let partition =
            Partition::new(self.tensor_specs(), usize::MAX).unwrap_or_else(|e| panic!("invalid MLP {self}: {e}"));
        assert_eq!(partition.blocks.len(), partition.tensors.len(), "one block per tensor");
        (0..partition.blocks.len()).map(|b| partition.init_values(b as u32, seed).expect("block exists")).collect()
    }

    /// Checks that `params` has one slice per tensor of the right length.
    pub fn check_params(&self, params: &[&[f32]]) -> Result<(), TrainError> {
        let specs = self.tensor_specs();
        if specs.is_empty() {
            return Err(TrainError::InvalidModel(format!("{self} has no layer; give at least two widths")));
        }
        if params.len() != specs.len() {
            return Err(TrainError::InvalidModel(format!(
                "{self} has {} tensors but {} parameter slices were given",
                specs.len(),
                params.len()
            )));
        }
        for (spec, p) in specs.iter().zip(params) {
            if p.len() != spec.len() {
                return Err(TrainError::InvalidModel(format!(
                    "tensor {} {:?} needs {} values but got {}",
                    spec.name,
                    spec.shape,
                    spec.len(),
                    p.len()
                )));
            }
        }
        Ok(())
    }

    fn weight<'a>(&self, params: &[&'a [f32]], l: usize) -> ArrayView2<'a, f32> {
        ArrayView2::from_shape((self.sizes[l], self.sizes[l + 1]), params[2 * l]).expect("checked by check_params")
    }

    fn bias<'a>(params: &[&'a [f32]], l: usize) -> ArrayView1<'a, f32> {
        ArrayView1::from(params[2 * l + 1])
    }

    /// Forward pass: the output of every layer (post-ReLU for hidden layers, logits last).
    fn forward(&self, params: &[&[f32]], x: ArrayView2<f32>) -> Vec<Array2<f32>> {
        let layers = self.layers();
        let mut acts: Vec<Array2<f32>> = Vec::with_capacity(layers);
        for l in 0..layers {
            let w = self.weight(params, l);
            let mut z = match acts.last() {
                None => x.dot(&w),
                Some(a) => a.dot(&w),
            };
            z += &Self::bias(params, l);
            if l + 1 < layers {
                z.mapv_inplace(|v| v.max(0.0));
            }
            acts.push(z);
        }
        acts
    }

    fn check_batch(&self, params: &[&[f32]], x: &ArrayView2<f32>, y: &[u8]) {
        if let Err(e) = self.check_params(params) {
            panic!("{e}");
        }
        assert!(x.nrows() > 0, "empty batch: give at least one example");
        assert_eq!(x.ncols(), self.sizes[0], "inputs have {} features but {self} expects {}", x.ncols(), self.sizes[0]);
        assert_eq!(y.len(), x.nrows(), "{} labels for {} examples", y.len(), x.nrows());
        if let Some(&bad) = y.iter().find(|&&l| usize::from(l) >= self.classes()) {
            panic!("label {bad} is not a class of {self} (0..{})", self.classes());
        }
    }

    /// Mean softmax cross-entropy of the batch `(x, y)` and its gradient with respect to
    /// every tensor, flat in the layout of `params` (see [`Mlp::tensor_specs`]).
    ///
    /// # Panics
    /// If `params` does not fit the model ([`Mlp::check_params`]), the batch is empty,
    /// `x` has the wrong width, `y` the wrong length, or a label is not a class.
    pub fn loss_and_grad(&self, params: &[&[f32]], x: ArrayView2<f32>, y: &[u8]) -> (f32, Vec<Vec<f32>>) {
        let mut grads = vec![Vec::new(); 2 * self.layers()];
        let loss = self.loss_and_grad_into(params, x, y, &mut grads);
        (loss, grads)
    }

    /// Like [`Mlp::loss_and_grad`], but writes the gradients into `grads` (one `Vec` per
    /// tensor, resized as needed), so a training loop can reuse its buffers.
    ///
    /// # Panics
    /// As [`Mlp::loss_and_grad`], and if `grads.len()` is not the number of tensors.
    pub fn loss_and_grad_into(&self, params: &[&[f32]], x: ArrayView2<f32>, y: &[u8], grads: &mut [Vec<f32>]) -> f32 {
        self.check_batch(params, &x, y);
        let layers = self.layers();
        assert_eq!(grads.len(), 2 * layers, "grads needs one Vec per tensor");
        let mut acts = self.forward(params, x);
        let mut dz = acts.pop().expect("at least one layer");
        let batch = x.nrows();
        let (loss_sum, _) = softmax_xent(&mut dz, y, Some(1.0 / batch as f32));
        for l in (0..layers).rev() {
            let (fan_in, fan_out) = (self.sizes[l], self.sizes[l + 1]);
            let input = if l == 0 { x.view() } else { acts[l - 1].view() };
            let gw = &mut grads[2 * l];
            gw.resize(fan_in * fan_out, 0.0);
            let mut gw = ArrayViewMut2::from_shape((fan_in, fan_out), &mut gw[..]).expect("sized above");
            general_mat_mul(1.0, &input.t(), &dz, 0.0, &mut gw);
            let gb = &mut grads[2 * l + 1];
            gb.resize(fan_out, 0.0);
            ArrayViewMut1::from(&mut gb[..]).assign(&dz.sum_axis(Axis(0)));
            if l > 0 {
                let mut da = dz.dot(&self.weight(params, l).t());
                Zip::from(&mut da).and(&acts[l - 1]).for_each(|d, &a| {
                    if a <= 0.0 {
                        *d = 0.0;
                    }
                });
                dz = da;
            }
        }
        (loss_sum / batch as f64) as f32
    }

    /// Mean loss and accuracy on `data`, in batches of 1024 examples.
    ///
    /// # Panics
    /// As [`Mlp::loss_and_grad`] (an empty dataset gives loss and accuracy 0 instead).
    pub fn evaluate(&self, params: &[&[f32]], data: &Dataset) -> Evaluation {
        if data.is_empty() {
            return Evaluation { loss: 0.0, accuracy: 0.0 };
        }
        let (mut loss_sum, mut correct) = (0.0f64, 0usize);
        for start in (0..data.len()).step_by(EVAL_CHUNK) {
            let end = (start + EVAL_CHUNK).min(data.len());
            let x = data.images.slice(s![start..end, ..]);
            let y = &data.labels[start..end];
            self.check_batch(params, &x, y);
            let mut logits = self.forward(params, x).pop().expect("at least one layer");
            let (l, c) = softmax_xent(&mut logits, y, None);
            loss_sum += l;
            correct += c;
        }
        let n = data.len() as f64;
        Evaluation { loss: (loss_sum / n) as f32, accuracy: (correct as f64 / n) as f32 }
    }
}

/// Summed cross-entropy and number of correct argmax predictions of `logits` for labels
/// `y`. With `Some(scale)`, overwrites `logits` by `scale * (softmax - onehot(y))`, the
/// gradient of `scale * summed loss` with respect to the logits.
fn softmax_xent(logits: &mut Array2<f32>, y: &[u8], grad_scale: Option<f32>) -> (f64, usize) {
    let (mut loss, mut correct) = (0.0f64, 0usize);
    for (mut row, &label) in logits.outer_iter_mut().zip(y) {
        let label = usize::from(label);
        let (mut argmax, mut max) = (0, f32::NEG_INFINITY);
        for (j, &v) in row.iter().enumerate() {
            if v > max {
                (argmax, max) = (j, v);
            }
        }
        let sum_exp: f32 = row.iter().map(|&v| (v - max).exp()).sum();
        let log_sum_exp = max + sum_exp.ln();
        loss += f64::from(log_sum_exp - row[label]);
        correct += usize::from(argmax == label);
        if let Some(scale) = grad_scale {
            row.mapv_inplace(|v| (v - log_sum_exp).exp() * scale);
            row[label] -= scale;
        }
    }
    (loss, correct)
}

/// Plain SGD: `params[t][i] -= lr * grads[t][i]`, for local training and reference runs.
///
/// # Panics
/// If the tensor counts or lengths differ.
pub fn sgd_step(params: &mut [Vec<f32>], grads: &[Vec<f32>], lr: f32) {
    assert_eq!(params.len(), grads.len(), "{} parameter tensors but {} gradients", params.len(), grads.len());
    for (p, g) in params.iter_mut().zip(grads) {
        assert_eq!(p.len(), g.len(), "a tensor of {} values got a gradient of {}", p.len(), g.len());
        for (p, g) in p.iter_mut().zip(g) {
            *p -= lr * g;
        }
    }
}

/// Borrows owned tensors as the `&[&[f32]]` that [`Mlp::loss_and_grad`] takes.
pub fn as_slices(params: &[Vec<f32>]) -> Vec<&[f32]> {
    params.iter().map(Vec::as_slice).collect()
}

impl fmt::Display for Mlp {
    /// Widths joined by `-`, e.g. `784-256-128-10`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, s) in self.sizes.iter().enumerate() {
            if i > 0 {
                f.write_str("-")?;
            }
            write!(f, "{s}")?;
        }
        Ok(())
    }
}

impl FromStr for Mlp {
    type Err = TrainError;

    /// Parses widths joined by `-`, e.g. `784-256-128-10`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let sizes = s
            .split('-')
            .map(|w| {
                w.trim().parse::<usize>().map_err(|_| {
                    TrainError::InvalidModel(format!(
                        "{s:?}: {w:?} is not a layer width; write widths joined by '-', e.g. 784-256-128-10"
                    ))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Self::new(sizes)
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    fn random_params(mlp: &Mlp, rng: &mut StdRng) -> Vec<Vec<f32>> {
        mlp.tensor_specs().iter().map(|s| (0..s.len()).map(|_| rng.random_range(-1.0..1.0)).collect()).collect()
    }

    fn grad_check(sizes: &[usize], seed: u64) {
        let mlp = Mlp::new(sizes.to_vec()).unwrap();
        let mut rng = StdRng::seed_from_u64(seed);
        let params = random_params(&mlp, &mut rng);
        let batch = 7;
        let x = Array2::from_shape_fn((batch, sizes[0]), |_| rng.random_range(-1.0f32..1.0));
        let y: Vec<u8> = (0..batch).map(|_| rng.random_range(0..mlp.classes()) as u8).collect();
        let (_, grads) = mlp.loss_and_grad(&as_slices(&params), x.view(), &y);

        let eps = 1e-2f32;
        let (mut diff2, mut norm2) = (0.0f64, 0.0f64);
        for t in 0..params.len() {
            for i in 0..params[t].len() {
                let loss_at = |delta: f32| {
                    let mut p = params.clone();
                    p[t][i] += delta;
                    f64::from(mlp.loss_and_grad(&as_slices(&p), x.view(), &y).0)
                };
                let numeric = (loss_at(eps) - loss_at(-eps)) / (2.0 * f64::from(eps));
                let analytic = f64::from(grads[t][i]);
                diff2 += (numeric - analytic).powi(2);
                norm2 += numeric.powi(2).max(analytic.powi(2));
                assert!(
                    (numeric - analytic).abs() < 2e-2,
                    "tensor {t} elem {i}: numeric {numeric} vs analytic {analytic}"
                );
            }
        }
        let rel = (diff2 / norm2).sqrt();
        assert!(rel < 1e-2, "relative gradient error {rel}");
    }

    #[test]
    fn gradients_match_finite_differences() {
        grad_check(&[5, 4, 3], 1);
        grad_check(&[5, 6, 4, 3], 2);
        grad_check(&[4, 3], 3);
    }

    #[test]
    fn tensor_specs_follow_the_documented_layout() {
        let specs = Mlp::default().tensor_specs();
        let names: Vec<_> = specs.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"]);
        assert_eq!(specs[0].shape, [784, 256]);
        assert_eq!(specs[5].shape, [10]);
        assert_eq!(specs[1].init, Init::Zeros);
        let he = (6.0f32 / 784.0).sqrt();
        assert_eq!(specs[0].init, Init::Uniform { low: -he, high: he });
        let glorot = (6.0f32 / 138.0).sqrt();
        assert_eq!(specs[4].init, Init::Uniform { low: -glorot, high: glorot });
        assert_eq!(Mlp::default().num_params(), 784 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10);
    }

    #[test]
    fn init_params_are_deterministic_and_bounded() {
        let mlp = Mlp::new(vec![20, 8, 3]).unwrap();
        let a = mlp.init_params(5);
        assert_eq!(a, mlp.init_params(5));
        assert_ne!(a, mlp.init_params(6));
        assert_eq!(a.iter().map(Vec::len).collect::<Vec<_>>(), [160, 8, 24, 3]);
        let he = (6.0f32 / 20.0).sqrt();
        assert!(a[0].iter().all(|v| v.abs() <= he) && a[1].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn parses_and_prints() {
        let m: Mlp = "784-256-128-10".parse().unwrap();
        assert_eq!(m, Mlp::default());
        assert_eq!(m.to_string(), "784-256-128-10");
        assert!("784".parse::<Mlp>().unwrap_err().to_string().contains("fewer than two"));
        assert!("784-x-10".parse::<Mlp>().unwrap_err().to_string().contains("\"x\""));
        assert!("784-0-10".parse::<Mlp>().is_err());
    }

    #[test]
    fn check_params_names_the_bad_tensor() {
        let mlp = Mlp::new(vec![3, 2]).unwrap();
        let err = mlp.check_params(&[&[0.0; 6], &[0.0; 3]]).unwrap_err().to_string();
        assert!(err.contains("fc1.bias") && err.contains("needs 2"), "{err}");
        assert!(mlp.check_params(&[&[0.0; 6]]).is_err());
    }

    #[test]
    fn evaluate_matches_loss_and_counts_correct() {
        // 2 inputs -> 2 classes, identity weights: predicts the larger input.
        let mlp = Mlp::new(vec![2, 2]).unwrap();
        let params = [vec![1.0, 0.0, 0.0, 1.0], vec![0.0, 0.0]];
        let data = Dataset {
            images: ndarray::arr2(&[[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.3, 0.3]]),
            labels: vec![0, 1, 1, 0],
        };
        let e = mlp.evaluate(&as_slices(&params), &data);
        // Rows 0 and 1 right, row 2 wrong, row 3 a tie that goes to the first class (right).
        assert_eq!(e.accuracy, 0.75);
        let (loss, _) = mlp.loss_and_grad(&as_slices(&params), data.images.view(), &data.labels);
        assert!((e.loss - loss).abs() < 1e-6);
        let p = 1.0 / (1.0 + (-1.0f32).exp());
        let expected = (-(p.ln()) * 2.0 - (1.0 - p).ln() + 2.0f32.ln()) / 4.0;
        assert!((loss - expected).abs() < 1e-6, "{loss} vs {expected}");
    }

    #[test]
    fn sgd_step_moves_against_the_gradient() {
        let mut p = vec![vec![1.0, 2.0], vec![3.0]];
        sgd_step(&mut p, &[vec![1.0, -1.0], vec![0.5]], 0.1);
        assert_eq!(p, vec![vec![0.9, 2.1], vec![2.95]]);
    }

    #[test]
    fn a_few_steps_reduce_the_loss() {
        let mlp = Mlp::new(vec![6, 8, 3]).unwrap();
        let mut rng = StdRng::seed_from_u64(9);
        let x = Array2::from_shape_fn((30, 6), |_| rng.random_range(0.0f32..1.0));
        let y: Vec<u8> = x
            .outer_iter()
            .map(|r| {
                if r[0] > r[1] {
                    0
                } else if r[2] > 0.5 {
                    1
                } else {
                    2
                }
            })
            .collect();
        let mut params = mlp.init_params(1);
        let mut grads = vec![Vec::new(); 4];
        let first = mlp.loss_and_grad_into(&as_slices(&params), x.view(), &y, &mut grads);
        let mut last = first;
        for _ in 0..200 {
            sgd_step(&mut params, &grads, 0.5);
            last = mlp.loss_and_grad_into(&as_slices(&params), x.view(), &y, &mut grads);
        }
        assert!(last < first * 0.5, "loss {first} -> {last}");
    }

    #[test]
    #[should_panic(expected = "label 3 is not a class")]
    fn out_of_range_label_panics_clearly() {
        let mlp = Mlp::new(vec![2, 3]).unwrap();
        let params = mlp.init_params(0);
        let _ = mlp.loss_and_grad(&as_slices(&params), ndarray::arr2(&[[0.0, 0.0]]).view(), &[3]);
    }
}
