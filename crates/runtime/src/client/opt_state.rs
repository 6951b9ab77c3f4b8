//! A tensor's optimizer state on the servers (`GetOptState`, `SetOptState`), and its
//! values overwritten (`SetValues`) (docs/PROTOCOL.md §6.13): what a PyTorch optimizer's
//! `state_dict` and `load_state_dict` carry, and a model's buffers. Outside a round: one
//! call per block of the tensor.

use elasticps_core::model::BlockSpec;
use elasticps_core::optimizer::OptState;
use elasticps_node::worker::Target;
use elasticps_wire::{Control, Message};

use super::Client;
use crate::error::{Result, RuntimeError};

impl Client {
    /// The optimizer state of tensor `tensor` (its index in the model): its steps, and its
    /// momentum or first moment (`m`) and second moment (`v`) over the whole tensor, each
    /// empty when the tensor's optimizer keeps none or took no step yet.
    pub async fn opt_state(&mut self, tensor: u32) -> Result<OptState> {
        let blocks = self.tensor_blocks(tensor)?;
        let mut parts = Vec::with_capacity(blocks.len());
        for b in &blocks {
            match self.block_call(b.id, Control::GetOptState { block: b.id }).await? {
                Message::Control(Control::OptState { state, .. }) => parts.push(state),
                other => {
                    return Err(RuntimeError::unexpected(&format!("the owner of block {}", b.id), "OptState", &other));
                }
            }
        }
        join(tensor, &blocks, parts)
    }

    /// Replaces the optimizer state of tensor `tensor` on its servers (`m` and `v` empty or
    /// as long as the tensor).
    pub async fn set_opt_state(&mut self, tensor: u32, state: &OptState) -> Result<()> {
        let blocks = self.tensor_blocks(tensor)?;
        let len: usize = blocks.iter().map(|b| b.len).sum();
        for (what, got) in [("m", state.m.len()), ("v", state.v.len())] {
            if got != 0 && got != len {
                return Err(RuntimeError::Usage(format!(
                    "the optimizer state {what} of tensor {tensor} has {got} values, the tensor {len}"
                )));
            }
        }
        self.change_blocks(&blocks, |b| {
            let slice = |v: &Vec<f32>| if v.is_empty() { Vec::new() } else { v[b.offset..b.offset + b.len].to_vec() };
            let part = OptState { steps: state.steps, m: slice(&state.m), v: slice(&state.v) };
            Control::SetOptState { block: b.id, state: part }
        })
        .await
    }

    /// Overwrites the values of tensor `tensor` on its servers (a model's buffers: call it
    /// before the push of the clock whose pulls must see them).
    pub async fn set_values(&mut self, tensor: u32, values: &[f32]) -> Result<()> {
        let blocks = self.tensor_blocks(tensor)?;
        let len: usize = blocks.iter().map(|b| b.len).sum();
        if values.len() != len {
            return Err(RuntimeError::Usage(format!(
                "set_values of tensor {tensor} has {} values, the tensor {len}",
                values.len()
            )));
        }
        self.change_blocks(&blocks, |b| Control::SetValues {
            block: b.id,
            values: values[b.offset..b.offset + b.len].to_vec(),
        })
        .await
    }

    /// Sends each block's change (`change(block)`) to its owner, one after the other; each
    /// must be answered `Ok`.
    async fn change_blocks(&mut self, blocks: &[BlockSpec], change: impl Fn(&BlockSpec) -> Control) -> Result<()> {
        for b in blocks {
            match self.block_call(b.id, change(b)).await? {
                Message::Control(Control::Ok) => {}
                other => return Err(RuntimeError::unexpected(&format!("the owner of block {}", b.id), "Ok", &other)),
            }
        }
        Ok(())
    }

    /// The dense blocks of tensor `tensor`, in offset order.
    fn tensor_blocks(&self, tensor: u32) -> Result<Vec<BlockSpec>> {
        let layout = self.current_layout()?;
        let partition = &layout.partition;
        if tensor as usize >= partition.tensors.len() {
            return Err(RuntimeError::Usage(format!(
                "the model has no tensor {tensor} (it has {})",
                partition.tensors.len()
            )));
        }
        let mut blocks: Vec<BlockSpec> =
            partition.blocks.iter().filter(|b| b.tensor == tensor && !b.is_rows()).copied().collect();
        blocks.sort_by_key(|b| b.offset);
        Ok(blocks)
    }

    /// Sends `msg` about `block` to its owner and returns the reply: the machine follows
    /// `Moved` with a layout refresh and waits out a migration (`NotReady`)
    /// ([`elasticps_node::worker::Target`]).
    async fn block_call(&mut self, block: u32, msg: Control) -> Result<Message> {
        self.server_call(Target::Block(block), msg).await
    }
}

/// One tensor's state from its blocks' (`blocks` in offset order): the blocks must agree
/// on the steps; a block without moments gets zeros where another has them.
fn join(tensor: u32, blocks: &[BlockSpec], parts: Vec<OptState>) -> Result<OptState> {
    let steps = parts.first().map_or(0, |p| p.steps);
    if let Some(p) = parts.iter().find(|p| p.steps != steps) {
        return Err(RuntimeError::Usage(format!(
            "the blocks of tensor {tensor} took different numbers of optimizer steps ({steps} and {}): ask \
             between steps, when every push of the clock was applied",
            p.steps
        )));
    }
    let concat = |pick: fn(&OptState) -> &Vec<f32>| -> Vec<f32> {
        if parts.iter().all(|p| pick(p).is_empty()) {
            return Vec::new();
        }
        let mut out = Vec::with_capacity(blocks.iter().map(|b| b.len).sum());
        for (b, p) in blocks.iter().zip(&parts) {
            let v = pick(p);
            if v.is_empty() { out.resize(out.len() + b.len, 0.0) } else { out.extend_from_slice(v) }
        }
        out
    };
    Ok(OptState { steps, m: concat(|p| &p.m), v: concat(|p| &p.v) })
}
