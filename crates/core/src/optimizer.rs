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
    /// Adam (Kingma & Ba) with bias correction.
    Adam {
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
        }
    }
}

impl FromStr for OptimizerKind {
    type Err = CoreError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let err = |why: &str| CoreError::Parse {
            what: "optimizer",
            input: input.to_string(),
            why: format!("{why}; expected sgd, momentum, momentum:BETA or adam"),
        };
        match input.trim().to_ascii_lowercase().as_str() {
            "sgd" => Ok(OptimizerKind::Sgd),
            "momentum" => Ok(OptimizerKind::Momentum { beta: 0.9 }),
            "adam" => Ok(OptimizerKind::Adam { beta1: 0.9, beta2: 0.999, eps: 1e-8 }),
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

/// Applies one optimizer step with gradient `grad` (already scaled) to `w`.
pub fn step(kind: OptimizerKind, lr: f32, w: &mut [f32], state: &mut OptState, grad: &[f32]) {
    debug_assert_eq!(w.len(), grad.len());
    state.steps = state.steps.saturating_add(1);
    match kind {
        OptimizerKind::Sgd => {
            for (w, g) in w.iter_mut().zip(grad) {
                *w -= lr * g;
            }
        }
        OptimizerKind::Momentum { beta } => {
            state.m.resize(w.len(), 0.0);
            for ((w, g), m) in w.iter_mut().zip(grad).zip(state.m.iter_mut()) {
                *m = beta * *m + g;
                *w -= lr * *m;
            }
        }
        OptimizerKind::Adam { beta1, beta2, eps } => {
            state.m.resize(w.len(), 0.0);
            state.v.resize(w.len(), 0.0);
            let t = state.steps as i32;
            let c1 = 1.0 - beta1.powi(t);
            let c2 = 1.0 - beta2.powi(t);
            let step = lr * c2.sqrt() / c1;
            for (((w, g), m), v) in w.iter_mut().zip(grad).zip(state.m.iter_mut()).zip(state.v.iter_mut()) {
                *m = beta1 * *m + (1.0 - beta1) * g;
                *v = beta2 * *v + (1.0 - beta2) * g * g;
                *w -= step * *m / (v.sqrt() + eps);
            }
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
        for s in ["sgd", "momentum", "adam"] {
            assert_eq!(s.parse::<OptimizerKind>().unwrap().to_string(), s);
        }
    }

    #[test]
    fn sgd_and_momentum_steps_are_exact() {
        let mut w = vec![1.0, 2.0];
        let mut st = OptState::default();
        step(OptimizerKind::Sgd, 0.5, &mut w, &mut st, &[2.0, -2.0]);
        assert_eq!(w, vec![0.0, 3.0]);
        let mut w = vec![0.0];
        let mut st = OptState::default();
        let k = OptimizerKind::Momentum { beta: 0.5 };
        step(k, 1.0, &mut w, &mut st, &[1.0]);
        step(k, 1.0, &mut w, &mut st, &[1.0]);
        assert_eq!(w, vec![-2.5]); // v = 1, then 1.5
    }

    #[test]
    fn adam_first_step_moves_by_lr_against_the_gradient_sign() {
        let mut w = vec![0.0, 0.0];
        let mut st = OptState::default();
        step(OptimizerKind::Adam { beta1: 0.9, beta2: 0.999, eps: 1e-8 }, 0.1, &mut w, &mut st, &[3.0, -0.01]);
        assert!((w[0] + 0.1).abs() < 1e-4 && (w[1] - 0.1).abs() < 1e-4, "{w:?}");
    }
}
