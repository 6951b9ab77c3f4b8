//! Server-side optimizers. Their state lives with the block it belongs to and moves
//! with it.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::CoreError;

/// Which update rule a server applies to a gradient.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum OptimizerKind {
    /// `w -= lr * g`.
    Sgd,
    /// Heavy-ball momentum: `v = beta * v + g; w -= lr * v`.
    Momentum {
        /// Momentum coefficient, typically 0.9.
        beta: f32,
    },
    /// Adam (Kingma & Ba) with bias correction, computed as PyTorch's `torch.optim.Adam`.
    Adam {
        /// First-moment decay, typically 0.9.
        beta1: f32,
        /// Second-moment decay, typically 0.999.
        beta2: f32,
        /// Denominator guard, typically 1e-8.
        eps: f32,
    },
    /// AdamW (Loshchilov & Hutter): Adam with decoupled weight decay, computed as
    /// PyTorch's `torch.optim.AdamW`: the weights shrink by `1 - lr * weight_decay` before
    /// the Adam step, and the decay never enters the moments. (Appended last: the variant
    /// index is part of the wire format.)
    AdamW {
        /// First-moment decay, typically 0.9.
        beta1: f32,
        /// Second-moment decay, typically 0.999.
        beta2: f32,
        /// Denominator guard, typically 1e-8.
        eps: f32,
    },
}

impl fmt::Display for OptimizerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OptimizerKind::Sgd => f.write_str("sgd"),
            OptimizerKind::Momentum { beta } if *beta == 0.9 => f.write_str("momentum"),
            OptimizerKind::Momentum { beta } => write!(f, "momentum:{beta}"),
            OptimizerKind::Adam { .. } => f.write_str("adam"),
            OptimizerKind::AdamW { .. } => f.write_str("adamw"),
        }
    }
}

impl FromStr for OptimizerKind {
    type Err = CoreError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let err = |why: &str| CoreError::Parse {
            what: "optimizer",
            input: input.to_string(),
            why: format!("{why}; expected sgd, momentum, momentum:BETA, adam or adamw"),
        };
        match input.trim().to_ascii_lowercase().as_str() {
            "sgd" => Ok(OptimizerKind::Sgd),
            "momentum" => Ok(OptimizerKind::Momentum { beta: 0.9 }),
            "adam" => Ok(OptimizerKind::Adam { beta1: 0.9, beta2: 0.999, eps: 1e-8 }),
            "adamw" => Ok(OptimizerKind::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8 }),
            other => match other.split_once(':') {
                Some(("momentum", b)) => match b.parse::<f32>() {
                    Ok(beta) if (0.0..1.0).contains(&beta) => Ok(OptimizerKind::Momentum { beta }),
                    _ => Err(err("beta must be in [0, 1)")),
                },
                _ => Err(err("unknown optimizer")),
            },
        }
    }
}

/// How a server turns pushes into parameter updates.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimizerConfig {
    /// The update rule.
    pub kind: OptimizerKind,
    /// Learning rate.
    pub lr: f32,
    /// `false`: apply every push as it arrives (ps-lite style). `true`: sum the pushes of
    /// one clock from every worker, then take one step with their mean (exact BSP, like
    /// BytePS summation followed by one update).
    pub aggregate: bool,
    /// Weight decay; 0 for none. For every rule but AdamW an L2 penalty added to the
    /// gradient before the step (`g + weight_decay * w`, as PyTorch's `weight_decay`);
    /// for AdamW decoupled (`w * (1 - lr * weight_decay)` before the step).
    pub weight_decay: f32,
}

impl OptimizerConfig {
    /// Applies one step of this rule to `w` with gradient `grad` ([`step`]).
    pub fn step(&self, w: &mut [f32], state: &mut OptState, grad: &[f32]) {
        step(self.kind, self.lr, self.weight_decay, w, state, grad);
    }

    /// Whether a sparse gradient steps only the elements it names: plain SGD without
    /// weight decay (and a finite learning rate, so that `lr * 0.0` is 0). Every other
    /// rule moves every element even where the gradient is zero (momentum and Adam's
    /// moments decay, weight decay shrinks every weight).
    pub fn steps_sparse(&self) -> bool {
        self.kind == OptimizerKind::Sgd && self.weight_decay == 0.0 && self.lr.is_finite()
    }

    /// Applies one step with the sparse gradient `values` at `indices` (strictly
    /// ascending, each below `w.len()`, checked by the caller: `Gradient::check`), exactly
    /// as [`step`] with the dense gradient that is zero elsewhere, bit for bit: where
    /// [`steps_sparse`](Self::steps_sparse), `w[i] -= lr * g` at the indices alone (and
    /// the step counted), O(indices); otherwise the dense step over every element, the
    /// gradient densified a chunk at a time into a buffer on the stack (no copy of the
    /// whole gradient is allocated), O(w.len()).
    pub fn step_sparse(&self, w: &mut [f32], state: &mut OptState, indices: &[u32], values: &[f32]) {
        debug_assert_eq!(indices.len(), values.len());
        debug_assert!(
            indices.windows(2).all(|p| p[0] < p[1]) && indices.last().is_none_or(|i| (*i as usize) < w.len())
        );
        if self.steps_sparse() {
            // `step`'s SGD at a zero gradient is `w -= lr * 0.0`, which leaves `w` as it is.
            state.steps = state.steps.saturating_add(1);
            for (i, g) in indices.iter().zip(values) {
                let w = &mut w[*i as usize];
                *w -= self.lr * g;
            }
        } else {
            step_densified(self.kind, self.lr, self.weight_decay, w, state, indices, values);
        }
    }

    /// This configuration with a tensor's own rule, learning rate and weight decay.
    pub fn with(self, t: &TensorOptimizer) -> Self {
        Self { kind: t.kind, lr: t.lr, weight_decay: t.weight_decay, aggregate: self.aggregate }
    }
}

/// One tensor's own update rule (a PyTorch parameter group's hyperparameters), set when
/// the model is defined and changed with `SetOptimizer`; it overrides the job's
/// `--optimizer` and `--lr` for that tensor.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorOptimizer {
    /// The update rule.
    pub kind: OptimizerKind,
    /// Learning rate.
    pub lr: f32,
    /// Weight decay: an L2 penalty (`g + weight_decay * w`), decoupled for AdamW
    /// ([`OptimizerConfig::weight_decay`]).
    pub weight_decay: f32,
}

impl TensorOptimizer {
    /// Checks that the hyperparameters are usable (finite, in range).
    pub fn validate(&self) -> Result<(), CoreError> {
        let bad = |why: &str| Err(CoreError::InvalidModel(format!("optimizer {self:?}: {why}")));
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return bad("the learning rate must be a finite number >= 0");
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad("weight_decay must be a finite number >= 0");
        }
        match self.kind {
            OptimizerKind::Sgd => Ok(()),
            OptimizerKind::Momentum { beta } if (0.0..1.0).contains(&beta) => Ok(()),
            OptimizerKind::Momentum { .. } => bad("momentum must be in [0, 1)"),
            OptimizerKind::Adam { beta1, beta2, eps } | OptimizerKind::AdamW { beta1, beta2, eps }
                if (0.0..1.0).contains(&beta1) && (0.0..1.0).contains(&beta2) && eps.is_finite() && eps >= 0.0 =>
            {
                Ok(())
            }
            OptimizerKind::Adam { .. } | OptimizerKind::AdamW { .. } => {
                bad("betas must be in [0, 1) and eps a finite number >= 0")
            }
        }
    }
}

/// Optimizer state of one block.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct OptState {
    /// Steps taken so far (Adam's bias correction).
    pub steps: u64,
    /// Momentum buffer or Adam's first moment; empty for SGD.
    #[serde(with = "crate::f32s")]
    pub m: Vec<f32>,
    /// Adam's second moment; empty otherwise.
    #[serde(with = "crate::f32s")]
    pub v: Vec<f32>,
}

/// Applies one optimizer step with gradient `grad` (already scaled) to `w`, with
/// PyTorch's arithmetic (`torch.optim.SGD`, and `Adam`/`AdamW` with `foreach=False`): with
/// weight decay `wd`, `g = grad + wd * w` first (AdamW instead: `w *= f32(1 - lr * wd)`,
/// the product and difference in f64, and `g = grad`); momentum `m = beta * m + g`,
/// `w -= lr * m`; Adam `m += (1 - beta1) * (g - m)`, `v = beta2 * v + (1 - beta2) * g * g`,
/// `w -= (lr / c1) * m / (sqrt(v) / sqrt(c2) + eps)` with the bias corrections
/// `c1 = 1 - beta1^t`, `c2 = 1 - beta2^t` computed in f64 and rounded to f32.
pub fn step(kind: OptimizerKind, lr: f32, wd: f32, w: &mut [f32], state: &mut OptState, grad: &[f32]) {
    debug_assert_eq!(w.len(), grad.len());
    let rule = StepRule::begin(kind, lr, wd, w.len(), state);
    rule.apply(w, &mut state.m, &mut state.v, grad);
}

/// Elements per chunk of a sparse gradient densified for a dense step
/// ([`OptimizerConfig::step_sparse`]): 16 KiB of stack.
const SPARSE_CHUNK: usize = 4096;

/// [`step`] with the sparse gradient `values` at `indices` (checked by the caller), for
/// the rules that move every element: densified chunk by chunk into a buffer on the stack,
/// each chunk stepped as [`step`] steps it, so the arithmetic is [`step`]'s, bit for bit.
fn step_densified(
    kind: OptimizerKind,
    lr: f32,
    wd: f32,
    w: &mut [f32],
    state: &mut OptState,
    indices: &[u32],
    values: &[f32],
) {
    let rule = StepRule::begin(kind, lr, wd, w.len(), state);
    let mut buf = [0f32; SPARSE_CHUNK];
    let mut next = 0;
    for (c, w) in w.chunks_mut(SPARSE_CHUNK).enumerate() {
        let (start, len) = (c * SPARSE_CHUNK, w.len());
        let grad = &mut buf[..len];
        grad.fill(0.0);
        while let Some(i) = indices.get(next).map(|i| *i as usize)
            && i < start + len
        {
            grad[i - start] = values[next];
            next += 1;
        }
        rule.apply(w, part(&mut state.m, start, len), part(&mut state.v, start, len), grad);
    }
    debug_assert_eq!(next, indices.len(), "an index past the end");
}

/// `v[start..start + len]`, or `v` itself when empty (state a rule does not keep).
fn part(v: &mut [f32], start: usize, len: usize) -> &mut [f32] {
    if v.is_empty() { v } else { &mut v[start..start + len] }
}

/// One step of a rule, its constants computed once (the step count, Adam's bias
/// corrections), applied to the elements slice by slice ([`StepRule::apply`]): each
/// element's arithmetic depends on that element alone.
struct StepRule {
    kind: OptimizerKind,
    lr: f32,
    wd: f32,
    /// Adam: `lr / c1` and `sqrt(c2)`, rounded to f32.
    adam: (f32, f32),
}

impl StepRule {
    /// Counts the step and sizes the state the rule keeps for `len` elements.
    fn begin(kind: OptimizerKind, lr: f32, wd: f32, len: usize, state: &mut OptState) -> Self {
        state.steps = state.steps.saturating_add(1);
        let mut adam = (0.0, 0.0);
        match kind {
            OptimizerKind::Sgd => {}
            OptimizerKind::Momentum { .. } => state.m.resize(len, 0.0),
            OptimizerKind::Adam { beta1, beta2, .. } | OptimizerKind::AdamW { beta1, beta2, .. } => {
                state.m.resize(len, 0.0);
                state.v.resize(len, 0.0);
                let t = state.steps.min(i32::MAX as u64) as i32;
                let c1 = 1.0 - f64::from(beta1).powi(t);
                let c2 = 1.0 - f64::from(beta2).powi(t);
                adam = ((f64::from(lr) / c1) as f32, c2.sqrt() as f32);
            }
        }
        Self { kind, lr, wd, adam }
    }

    /// The step on elements `w` with their state `m` and `v` (each as long as `w`, or
    /// empty where the rule keeps none) and gradient `grad`.
    fn apply(&self, w: &mut [f32], m: &mut [f32], v: &mut [f32], grad: &[f32]) {
        let (lr, wd) = (self.lr, self.wd);
        let decayed = |w: f32, g: f32| if wd == 0.0 { g } else { g + wd * w };
        match self.kind {
            OptimizerKind::Sgd => {
                for (w, g) in w.iter_mut().zip(grad) {
                    *w -= lr * decayed(*w, *g);
                }
            }
            OptimizerKind::Momentum { beta } => {
                for ((w, g), m) in w.iter_mut().zip(grad).zip(m.iter_mut()) {
                    *m = beta * *m + decayed(*w, *g);
                    *w -= lr * *m;
                }
            }
            OptimizerKind::Adam { beta1, beta2, eps } => self.adam(beta1, beta2, eps, w, m, v, grad, decayed),
            OptimizerKind::AdamW { beta1, beta2, eps } => {
                if wd != 0.0 {
                    // torch: `param.mul_(1 - lr * weight_decay)`, the factor a Python float.
                    let shrink = (1.0 - f64::from(lr) * f64::from(wd)) as f32;
                    w.iter_mut().for_each(|w| *w *= shrink);
                }
                self.adam(beta1, beta2, eps, w, m, v, grad, |_, g| g);
            }
        }
    }

    /// Adam's moments and update, on the gradient `decayed(w, g)` of each element.
    #[allow(clippy::too_many_arguments)]
    fn adam(
        &self,
        beta1: f32,
        beta2: f32,
        eps: f32,
        w: &mut [f32],
        m: &mut [f32],
        v: &mut [f32],
        grad: &[f32],
        decayed: impl Fn(f32, f32) -> f32,
    ) {
        let (step, c2_sqrt) = self.adam;
        for (((w, g), m), v) in w.iter_mut().zip(grad).zip(m.iter_mut()).zip(v.iter_mut()) {
            let g = decayed(*w, *g);
            *m += (1.0 - beta1) * (g - *m);
            *v = beta2 * *v + (1.0 - beta2) * g * g;
            *w -= step * *m / (v.sqrt() / c2_sqrt + eps);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_optimizers() {
        assert_eq!("sgd".parse::<OptimizerKind>().unwrap(), OptimizerKind::Sgd);
        assert_eq!("momentum".parse::<OptimizerKind>().unwrap(), OptimizerKind::Momentum { beta: 0.9 });
        assert_eq!("momentum:0.5".parse::<OptimizerKind>().unwrap(), OptimizerKind::Momentum { beta: 0.5 });
        assert!("momentum:1.5".parse::<OptimizerKind>().is_err());
        assert!("rmsprop".parse::<OptimizerKind>().is_err());
        assert_eq!(
            "AdamW".parse::<OptimizerKind>().unwrap(),
            OptimizerKind::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8 }
        );
        for s in ["sgd", "momentum", "adam", "adamw"] {
            assert_eq!(s.parse::<OptimizerKind>().unwrap().to_string(), s);
        }
    }

    #[test]
    fn a_sparse_step_over_many_chunks_is_the_dense_step_with_zeros_bit_for_bit() {
        // Three chunks and a part, indices in each (at both ends of a chunk too) and
        // none in the second: a chunk must not keep the previous chunk's gradient.
        let len = 3 * SPARSE_CHUNK + 5;
        let indices: Vec<u32> =
            [0, 7, SPARSE_CHUNK - 1, 2 * SPARSE_CHUNK, 3 * SPARSE_CHUNK + 4].iter().map(|i| *i as u32).collect();
        let values = [0.5, -1.25, 3.0, -0.75, 2.0];
        let mut dense = vec![0.0; len];
        for (i, v) in indices.iter().zip(&values) {
            dense[*i as usize] = *v;
        }
        let kinds = [
            (OptimizerKind::Sgd, 0.0),
            (OptimizerKind::Sgd, 0.1),
            (OptimizerKind::Momentum { beta: 0.9 }, 0.01),
            (OptimizerKind::Adam { beta1: 0.9, beta2: 0.999, eps: 1e-8 }, 0.01),
            (OptimizerKind::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8 }, 0.1),
        ];
        for (kind, weight_decay) in kinds {
            let cfg = OptimizerConfig { kind, lr: 0.1, aggregate: false, weight_decay };
            let init: Vec<f32> = (0..len).map(|i| (i as f32 * 0.01).cos()).collect();
            let (mut a, mut b) = (init.clone(), init);
            let (mut sa, mut sb) = (OptState::default(), OptState::default());
            for _ in 0..3 {
                cfg.step_sparse(&mut a, &mut sa, &indices, &values);
                cfg.step(&mut b, &mut sb, &dense);
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert!(bits(&a) == bits(&b), "{kind} wd={weight_decay}: weights differ");
            assert!(
                (sa.steps, bits(&sa.m), bits(&sa.v)) == (sb.steps, bits(&sb.m), bits(&sb.v)),
                "{kind} wd={weight_decay}: state differs"
            );
        }
    }

    #[test]
    fn sgd_and_momentum_steps_are_exact() {
        let mut w = vec![1.0, 2.0];
        let mut st = OptState::default();
        step(OptimizerKind::Sgd, 0.5, 0.0, &mut w, &mut st, &[2.0, -2.0]);
        assert_eq!(w, vec![0.0, 3.0]);
        let mut w = vec![0.0];
        let mut st = OptState::default();
        let k = OptimizerKind::Momentum { beta: 0.5 };
        step(k, 1.0, 0.0, &mut w, &mut st, &[1.0]);
        step(k, 1.0, 0.0, &mut w, &mut st, &[1.0]);
        assert_eq!(w, vec![-2.5]); // v = 1, then 1.5
    }

    #[test]
    fn adam_first_step_moves_by_lr_against_the_gradient_sign() {
        let mut w = vec![0.0, 0.0];
        let mut st = OptState::default();
        step(OptimizerKind::Adam { beta1: 0.9, beta2: 0.999, eps: 1e-8 }, 0.1, 0.0, &mut w, &mut st, &[3.0, -0.01]);
        assert!((w[0] + 0.1).abs() < 1e-4 && (w[1] - 0.1).abs() < 1e-4, "{w:?}");
    }

    #[test]
    fn weight_decay_adds_the_l2_gradient() {
        let mut w = vec![2.0];
        let mut st = OptState::default();
        step(OptimizerKind::Sgd, 0.5, 0.25, &mut w, &mut st, &[1.0]);
        assert_eq!(w, vec![2.0 - 0.5 * (1.0 + 0.25 * 2.0)]);
    }

    const ADAM: OptimizerKind = OptimizerKind::Adam { beta1: 0.8, beta2: 0.99, eps: 1e-6 };
    const ADAMW: OptimizerKind = OptimizerKind::AdamW { beta1: 0.8, beta2: 0.99, eps: 1e-6 };

    #[test]
    fn adamw_without_weight_decay_is_adam_bit_for_bit() {
        let (mut a, mut b) = (vec![0.5, -1.25, 3.0], vec![0.5, -1.25, 3.0]);
        let (mut sa, mut sb) = (OptState::default(), OptState::default());
        for t in 0..5 {
            let g: Vec<f32> = (0..3).map(|i| ((t * 3 + i) as f32 * 0.7).sin()).collect();
            step(ADAM, 0.01, 0.0, &mut a, &mut sa, &g);
            step(ADAMW, 0.01, 0.0, &mut b, &mut sb, &g);
        }
        assert_eq!(
            (a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), &sa),
            (b.iter().map(|x| x.to_bits()).collect(), &sb)
        );
    }

    #[test]
    fn adamw_decay_is_decoupled_from_the_moments() {
        // A zero gradient: the moments stay zero and the weights only shrink, by
        // f32(1 - lr * wd) per step.
        let mut w = vec![2.0, -4.0];
        let mut st = OptState::default();
        step(ADAMW, 0.1, 0.5, &mut w, &mut st, &[0.0, 0.0]);
        step(ADAMW, 0.1, 0.5, &mut w, &mut st, &[0.0, 0.0]);
        let shrink = (1.0 - 0.1f64 * 0.5) as f32;
        assert_eq!(w, vec![2.0 * shrink * shrink, -4.0 * shrink * shrink]);
        assert_eq!((st.steps, &st.m, &st.v), (2, &vec![0.0; 2], &vec![0.0; 2]));

        // With a gradient: the moments are Adam's of the gradient alone (Adam with the same
        // weight decay puts `wd * w` in them), and the step is Adam's on the shrunk weights.
        let (mut w, mut st) = (vec![2.0], OptState::default());
        step(ADAMW, 0.1, 0.5, &mut w, &mut st, &[3.0]);
        assert_eq!(st.m, vec![(1.0 - 0.8f32) * 3.0]);
        let (mut plain, mut ps) = (vec![2.0 * shrink], OptState::default());
        step(ADAM, 0.1, 0.0, &mut plain, &mut ps, &[3.0]);
        assert_eq!((w, st), (plain, ps));
        let (mut l2, mut ls) = (vec![2.0], OptState::default());
        step(ADAM, 0.1, 0.5, &mut l2, &mut ls, &[3.0]);
        assert_eq!(ls.m, vec![(1.0 - 0.8f32) * (3.0 + 0.5 * 2.0)]);
    }

    #[test]
    fn tensor_optimizers_are_validated() {
        let ok = TensorOptimizer { kind: OptimizerKind::Momentum { beta: 0.9 }, lr: 0.1, weight_decay: 0.0 };
        assert!(ok.validate().is_ok());
        assert!(TensorOptimizer { lr: f32::NAN, ..ok }.validate().is_err());
        assert!(TensorOptimizer { kind: OptimizerKind::Momentum { beta: 1.0 }, ..ok }.validate().is_err());
        assert!(TensorOptimizer { weight_decay: -1.0, ..ok }.validate().is_err());
        assert!(TensorOptimizer { kind: ADAMW, weight_decay: 0.01, ..ok }.validate().is_ok());
        let bad_beta = OptimizerKind::AdamW { beta1: 1.0, beta2: 0.999, eps: 1e-8 };
        assert!(TensorOptimizer { kind: bad_beta, ..ok }.validate().is_err());
    }
}
