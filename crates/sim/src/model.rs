//! The simulated model: a real network's tensors at a reduced scale.
//!
//! The sim carries tensor sizes, not tensor bytes. Every tensor of the nominal model
//! (say ResNet-50's 161 tensors, 25.6 M values) is shrunk by about `scale` (one value
//! stands for `scale` nominal values) and so is the block size, keeping exactly the
//! nominal model's blocks: block `b` of the scaled partition is block `b` of the real one.
//! Every decision that compares sizes (placement, the balancer's service times) sees them
//! in about the same proportions, and the links charge each message the nominal bytes of
//! the block it carries ([`ScaledModel::nominal_bytes`]).

use elasticps_core::model::{Partition, TensorSpec};
use elasticps_wire::{Control, HEADER_LEN, Message};

use crate::{Result, SimError};

/// A nominal model shrunk for the sim.
#[derive(Clone, Debug)]
pub struct ScaledModel {
    /// The tensors the simulated workers define.
    pub tensors: Vec<TensorSpec>,
    /// The block size the scheduler cuts them with.
    pub block_bytes: usize,
    /// About how many nominal values one simulated value stands for.
    pub scale: u64,
    /// The nominal model's number of values.
    pub nominal_values: u64,
    /// Per block id: (nominal values, simulated values).
    blocks: Vec<(u64, u64)>,
}

impl ScaledModel {
    /// Shrinks `tensors` (cut into blocks of `block_bytes`) by `scale`, block for block.
    pub fn new(tensors: &[TensorSpec], block_bytes: usize, scale: u64) -> Result<Self> {
        if scale == 0 {
            return Err(SimError::Usage("--scale must be at least 1".into()));
        }
        let nominal = Partition::new(tensors.to_vec(), block_bytes)?;
        let per_block = (block_bytes / 4 / scale as usize).max(1);
        let shrunk: Vec<TensorSpec> = tensors
            .iter()
            .enumerate()
            .map(|(t, spec)| {
                // As many blocks as the nominal tensor has: (k - 1) * per_block < len <= k * per_block.
                let k = nominal.blocks.iter().filter(|b| b.tensor as usize == t).count().max(1);
                let len = (spec.len() as f64 / scale as f64).round() as usize;
                let len = len.clamp((k - 1) * per_block + 1, k * per_block);
                TensorSpec { name: spec.name.clone(), shape: vec![len], init: spec.init }
            })
            .collect();
        let scaled = Partition::new(shrunk.clone(), per_block * 4)?;
        let same = scaled.blocks.len() == nominal.blocks.len()
            && scaled.blocks.iter().zip(&nominal.blocks).all(|(a, b)| a.tensor == b.tensor);
        if !same {
            return Err(SimError::Usage(format!(
                "the model cannot be scaled by {scale} block for block ({} blocks nominal, {} scaled): pick another --scale",
                nominal.blocks.len(),
                scaled.blocks.len()
            )));
        }
        Ok(Self {
            tensors: shrunk,
            block_bytes: per_block * 4,
            scale,
            nominal_values: tensors.iter().map(|t| t.len() as u64).sum(),
            blocks: nominal.blocks.iter().zip(&scaled.blocks).map(|(n, s)| (n.len as u64, s.len as u64)).collect(),
        })
    }

    /// The number of blocks (the same nominal and scaled).
    pub fn blocks(&self) -> usize {
        self.blocks.len()
    }

    /// The bytes a message stands for on the wire: its header, plus the values it carries at
    /// their block's nominal size (a push or a fused push_pull, a pull reply, a migrating block's
    /// state and log), each value in its payload's dtype (2 bytes in bf16, 4 in f32).
    pub fn nominal_bytes(&self, msg: &Message) -> u64 {
        let nominal = |block: u32, values: u64| match self.blocks.get(block as usize) {
            Some((n, s)) if *s > 0 => values * n / s,
            _ => values * self.scale,
        };
        HEADER_LEN as u64
            + match msg {
                Message::Push { block, values, .. }
                | Message::PushPull { block, values, .. }
                | Message::PullReply { block, values, .. }
                | Message::Init { block, values } => {
                    values.dtype().width() as u64 * nominal(*block, values.len() as u64)
                }
                Message::Control(Control::BlockSnapshot { state, .. }) => {
                    4 * nominal(state.spec.id, state.state_len() as u64)
                }
                Message::Control(Control::BlockDelta { block, pushes, .. }) => {
                    4 * nominal(*block, pushes.iter().map(|p| p.grad.len() as u64).sum())
                }
                _ => 0,
            }
    }

    /// Bytes at the nominal scale of `bytes` simulated bytes (a server's parameters, a
    /// migration's transfer).
    pub fn nominal(&self, bytes: u64) -> u64 {
        bytes * self.scale
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
        let nominal = Partition::new(tensors.clone(), 4 << 20).unwrap();
        assert_eq!(m.tensors.len(), 161);
        assert_eq!(scaled.blocks.len(), nominal.blocks.len());
        assert_eq!(m.blocks(), nominal.blocks.len());
        let values: usize = m.tensors.iter().map(TensorSpec::len).sum();
        assert!(values < 8_000, "{values} simulated values");
    }

    #[test]
    fn a_push_costs_its_blocks_nominal_bytes() {
        let tensors = Profile::ResNet50.tensors();
        let nominal = Partition::new(tensors.clone(), 4 << 20).unwrap();
        let m = ScaledModel::new(&tensors, 4 << 20, 1000).unwrap();
        let scaled = Partition::new(m.tensors.clone(), m.block_bytes).unwrap();
        for b in [0, 1, nominal.blocks.len() - 1] {
            let values = elasticps_wire::Values::from_vec(vec![0.0; scaled.blocks[b].len]);
            let push = Message::Push { block: b as u32, clock: 0, values: values.clone() };
            assert_eq!(m.nominal_bytes(&push), HEADER_LEN as u64 + nominal.blocks[b].bytes() as u64, "block {b}");
            // A fused push_pull carries the same gradient: the links are charged for it too.
            let push_pull = Message::PushPull {
                block: b as u32,
                clock: 0,
                values: values.clone(),
                reply: elasticps_wire::Dtype::F32,
            };
            assert_eq!(m.nominal_bytes(&push_pull), m.nominal_bytes(&push), "push_pull of block {b}");
            let reply = Message::PullReply { block: b as u32, clock: 1, values };
            assert_eq!(m.nominal_bytes(&reply), m.nominal_bytes(&push), "pull reply of block {b}");
        }
        assert_eq!(m.nominal_bytes(&Control::Heartbeat.into()), HEADER_LEN as u64);
    }
}
