//! The simulated model: a real network's tensors at a reduced scale.
//!
//! The sim carries tensor sizes, not tensor bytes. Every tensor of the nominal model
//! (say ResNet-50's 161 tensors, 25.6 M values) is shrunk by `scale` (one value stands
//! for `scale` nominal values) and so is the block size, so the partition keeps the
//! nominal model's blocks, and every decision that compares sizes (placement, the
//! balancer's service times) sees them in the same proportions. The links charge each
//! message its nominal bytes ([`nominal_bytes`]).

use elasticps_core::model::{Partition, TensorSpec};
use elasticps_wire::Message;

use crate::{Result, SimError};

/// A nominal model shrunk for the sim.
#[derive(Clone, Debug)]
pub struct ScaledModel {
    /// The tensors the simulated workers define (each `ceil(len / scale)` values).
    pub tensors: Vec<TensorSpec>,
    /// The block size the scheduler cuts them with (`block_bytes / scale`, at least one value).
    pub block_bytes: usize,
    /// How many nominal values one simulated value stands for.
    pub scale: u64,
    /// The nominal model's number of values.
    pub nominal_values: u64,
    /// The nominal model's number of blocks (the scaled partition has the same, up to rounding).
    pub nominal_blocks: usize,
}

impl ScaledModel {
    /// Shrinks `tensors` (cut into blocks of `block_bytes`) by `scale`.
    pub fn new(tensors: &[TensorSpec], block_bytes: usize, scale: u64) -> Result<Self> {
        if scale == 0 {
            return Err(SimError::Usage("--scale must be at least 1".into()));
        }
        let nominal = Partition::new(tensors.to_vec(), block_bytes)?;
        let per_value = 4 * scale as usize;
        let block_bytes = (block_bytes / per_value).max(1) * 4;
        let shrink = |t: &TensorSpec| TensorSpec {
            name: t.name.clone(),
            shape: vec![t.len().div_ceil(scale as usize).max(1)],
            init: t.init,
        };
        Ok(Self {
            tensors: tensors.iter().map(shrink).collect(),
            block_bytes,
            scale,
            nominal_values: tensors.iter().map(|t| t.len() as u64).sum(),
            nominal_blocks: nominal.blocks.len(),
        })
    }

    /// The bytes a message stands for on the wire: its header, plus its values at the
    /// nominal scale (a push, a pull reply, a migrating block's snapshot and log).
    pub fn nominal_bytes(&self, msg: &Message) -> u64 {
        const HEADER: u64 = elasticps_wire::HEADER_LEN as u64;
        HEADER + values_of(msg) * 4 * self.scale
    }
}

/// How many f32 values a message carries.
fn values_of(msg: &Message) -> u64 {
    use elasticps_wire::Control;
    match msg {
        Message::Push { values, .. } | Message::PullReply { values, .. } | Message::Init { values, .. } => {
            values.len() as u64
        }
        Message::Control(Control::BlockSnapshot { state, .. }) => state.state_len() as u64,
        Message::Control(Control::BlockDelta { pushes, .. }) => pushes.iter().map(|p| p.grad.len() as u64).sum(),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use elasticps_train::synthetic::Profile;

    #[test]
    fn resnet50_keeps_its_blocks_at_scale() {
        let tensors = Profile::ResNet50.tensors();
        let m = ScaledModel::new(&tensors, 4 << 20, 4096).unwrap();
        let scaled = Partition::new(m.tensors.clone(), m.block_bytes).unwrap();
        assert_eq!(m.tensors.len(), 161);
        let (n, s) = (m.nominal_blocks as f64, scaled.blocks.len() as f64);
        assert!((s - n).abs() / n < 0.05, "nominal {n} blocks, scaled {s}");
        let values: usize = m.tensors.iter().map(TensorSpec::len).sum();
        assert!(values < 8_000, "{values} simulated values");
    }

    #[test]
    fn a_push_costs_its_nominal_bytes() {
        let m = ScaledModel::new(&Profile::ResNet50.tensors(), 4 << 20, 1000).unwrap();
        let push = Message::Push { block: 0, clock: 0, values: elasticps_wire::Values::from_vec(vec![0.0; 10]) };
        assert_eq!(m.nominal_bytes(&push), elasticps_wire::HEADER_LEN as u64 + 40_000);
        assert_eq!(m.nominal_bytes(&elasticps_wire::Control::Heartbeat.into()), elasticps_wire::HEADER_LEN as u64);
    }
}
