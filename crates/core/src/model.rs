//! The model as the parameter server sees it: named dense f32 tensors, cut into blocks.
//!
//! A block is the unit of placement, synchronization state, load accounting and
//! migration. Blocks are numbered densely from 0 in tensor order, so a block id is also
//! an index into [`Partition::blocks`].

use rand::{Rng, SeedableRng, rngs::StdRng};
use serde::{Deserialize, Serialize};

use crate::CoreError;
use crate::optimizer::TensorOptimizer;

/// Dense index of a block, unique within one model.
pub type BlockId = u32;

/// How a tensor's initial values are drawn on the server that owns it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum Init {
    /// All zeros (biases).
    Zeros,
    /// Uniform in `[low, high)`.
    Uniform {
        /// Inclusive lower bound.
        low: f32,
        /// Exclusive upper bound.
        high: f32,
    },
    /// A constant value in every element (tests use it to make outcomes exact).
    Constant(f32),
}

/// One named dense tensor of the model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorSpec {
    /// Unique name, e.g. `fc1.weight`.
    pub name: String,
    /// Shape; the tensor holds the product of its dimensions f32 values.
    pub shape: Vec<usize>,
    /// How the server initialises it.
    pub init: Init,
}

impl TensorSpec {
    /// Number of f32 elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// True if the tensor holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A contiguous slice `[offset, offset + len)` of one tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockSpec {
    /// Dense block id.
    pub id: BlockId,
    /// Index of the tensor in the model's tensor list.
    pub tensor: u32,
    /// First element of the tensor held by this block.
    pub offset: usize,
    /// Number of f32 elements.
    pub len: usize,
}

impl BlockSpec {
    /// Size in bytes of the block's values.
    pub fn bytes(&self) -> usize {
        self.len * 4
    }
}

/// A model cut into blocks of at most `block_bytes`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Partition {
    /// The tensors, in the order the user registered them.
    pub tensors: Vec<TensorSpec>,
    /// The blocks, `blocks[i].id == i`, in tensor order.
    pub blocks: Vec<BlockSpec>,
    /// Each tensor's own optimizer (`optimizers[t]`), or none: then the job's. Empty when
    /// no tensor has one.
    pub optimizers: Vec<Option<TensorOptimizer>>,
}

impl Partition {
    /// Cuts `tensors` into blocks of at most `block_bytes` bytes (at least one f32).
    pub fn new(tensors: Vec<TensorSpec>, block_bytes: usize) -> Result<Self, CoreError> {
        if tensors.is_empty() {
            return Err(CoreError::InvalidModel("the model has no tensor".into()));
        }
        let max_len = (block_bytes / 4).max(1);
        let mut blocks = Vec::new();
        for (t, spec) in tensors.iter().enumerate() {
            if spec.is_empty() {
                return Err(CoreError::InvalidModel(format!("tensor {:?} is empty", spec.name)));
            }
            if tensors[..t].iter().any(|o| o.name == spec.name) {
                return Err(CoreError::InvalidModel(format!("tensor name {:?} is used twice", spec.name)));
            }
            let mut offset = 0;
            while offset < spec.len() {
                let len = max_len.min(spec.len() - offset);
                let id = BlockId::try_from(blocks.len())
                    .map_err(|_| CoreError::InvalidModel("more than 2^32 blocks".into()))?;
                blocks.push(BlockSpec { id, tensor: t as u32, offset, len });
                offset += len;
            }
        }
        Ok(Self { tensors, blocks, optimizers: Vec::new() })
    }

    /// This partition with per-tensor optimizers: `optimizers` is empty or has one entry
    /// per tensor, each valid.
    pub fn with_optimizers(mut self, optimizers: Vec<Option<TensorOptimizer>>) -> Result<Self, CoreError> {
        if !optimizers.is_empty() && optimizers.len() != self.tensors.len() {
            return Err(CoreError::InvalidModel(format!(
                "{} optimizers for {} tensors",
                optimizers.len(),
                self.tensors.len()
            )));
        }
        for o in optimizers.iter().flatten() {
            o.validate()?;
        }
        self.optimizers = optimizers;
        Ok(self)
    }

    /// The optimizer of tensor `tensor`, if it has its own.
    pub fn optimizer(&self, tensor: u32) -> Option<&TensorOptimizer> {
        self.optimizers.get(tensor as usize).and_then(Option::as_ref)
    }

    /// Gives tensor `tensor` its own optimizer (a learning-rate change, say).
    pub fn set_optimizer(&mut self, tensor: u32, optimizer: TensorOptimizer) -> Result<(), CoreError> {
        if tensor as usize >= self.tensors.len() {
            return Err(CoreError::InvalidModel(format!(
                "tensor {tensor} does not exist: the model has {} tensors",
                self.tensors.len()
            )));
        }
        optimizer.validate()?;
        self.optimizers.resize(self.tensors.len(), None);
        self.optimizers[tensor as usize] = Some(optimizer);
        Ok(())
    }

    /// Total number of f32 values in the model.
    pub fn total_len(&self) -> usize {
        self.tensors.iter().map(TensorSpec::len).sum()
    }

    /// The block with this id, or an error naming it.
    pub fn block(&self, id: BlockId) -> Result<&BlockSpec, CoreError> {
        self.blocks.get(id as usize).ok_or(CoreError::UnknownBlock(id))
    }

    /// Deterministic initial values of one block: depends only on `seed`, the tensor's
    /// name and init, and the element index, never on how the tensor is cut.
    pub fn init_values(&self, id: BlockId, seed: u64) -> Result<Vec<f32>, CoreError> {
        let block = *self.block(id)?;
        let spec = &self.tensors[block.tensor as usize];
        Ok(match spec.init {
            Init::Zeros => vec![0.0; block.len],
            Init::Constant(c) => vec![c; block.len],
            Init::Uniform { low, high } => {
                // One RNG stream per chunk of 1024 elements, keyed by the tensor name, so
                // any cut at a chunk boundary or not gives the same values.
                const CHUNK: usize = 1024;
                let key = seed ^ fnv1a(spec.name.as_bytes());
                let mut out = Vec::with_capacity(block.len);
                let end = block.offset + block.len;
                let mut i = block.offset;
                while i < end {
                    let chunk = i / CHUNK;
                    let mut rng =
                        StdRng::seed_from_u64(key.wrapping_add((chunk as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)));
                    let chunk_start = chunk * CHUNK;
                    for _ in chunk_start..i {
                        let _: f32 = rng.random();
                    }
                    let chunk_end = ((chunk + 1) * CHUNK).min(end);
                    for _ in i..chunk_end {
                        out.push(low + (high - low) * rng.random::<f32>());
                    }
                    i = chunk_end;
                }
                out
            }
        })
    }
}

/// FNV-1a hash (stable across runs and platforms, unlike `DefaultHasher`).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(name: &str, len: usize, init: Init) -> TensorSpec {
        TensorSpec { name: name.into(), shape: vec![len], init }
    }

    #[test]
    fn cuts_tensors_into_blocks_of_at_most_block_bytes() {
        let p = Partition::new(vec![tensor("a", 10, Init::Zeros), tensor("b", 3, Init::Zeros)], 16).unwrap();
        let lens: Vec<_> = p.blocks.iter().map(|b| (b.tensor, b.offset, b.len)).collect();
        assert_eq!(lens, vec![(0, 0, 4), (0, 4, 4), (0, 8, 2), (1, 0, 3)]);
        assert!(p.blocks.iter().enumerate().all(|(i, b)| b.id as usize == i));
        assert_eq!(p.total_len(), 13);
    }

    #[test]
    fn rejects_empty_and_duplicate_tensors() {
        assert!(Partition::new(vec![], 16).is_err());
        assert!(Partition::new(vec![tensor("a", 0, Init::Zeros)], 16).is_err());
        assert!(Partition::new(vec![tensor("a", 1, Init::Zeros), tensor("a", 1, Init::Zeros)], 16).is_err());
    }

    #[test]
    fn initial_values_do_not_depend_on_the_cut() {
        let t = vec![tensor("w", 5000, Init::Uniform { low: -1.0, high: 1.0 })];
        let whole = Partition::new(t.clone(), 1 << 20).unwrap();
        let cut = Partition::new(t, 4 * 700).unwrap();
        let a = whole.init_values(0, 7).unwrap();
        let b: Vec<f32> = cut.blocks.iter().flat_map(|b| cut.init_values(b.id, 7).unwrap()).collect();
        assert_eq!(a, b);
        assert!(a.iter().all(|v| (-1.0..1.0).contains(v)));
        assert_ne!(a, whole.init_values(0, 8).unwrap());
    }
}
