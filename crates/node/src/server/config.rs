//! The shard's configuration in one place: the assignment (sync policy, optimizer,
//! worker count), the adaptive policy's controller (the only place its current s
//! lives), each tensor's own optimizer, the model's partition and this server's view
//! of the placement.

use elasticps_core::CoreError;
use elasticps_core::adaptive::Adaptive;
use elasticps_core::block::{BlockStats, ShardConfig};
use elasticps_core::model::{BlockId, BlockSpec, Partition};
use elasticps_core::optimizer::TensorOptimizer;
use elasticps_core::placement::{Placement, RETIRED, ServerId};
use elasticps_core::sync::SyncPolicy;
use elasticps_wire::{Assignment, Control, ErrorCode, ErrorReply, Message};

/// How this server treats its blocks, as the scheduler assigned it.
#[derive(Debug)]
pub struct Shard {
    /// This server's id.
    pub id: ServerId,
    /// As assigned; `sync` may be `Adaptive`.
    pub config: ShardConfig,
    /// The controller of an `Adaptive` policy (its staleness is the one in force).
    pub adaptive: Option<Adaptive>,
    /// The model's blocks.
    pub partition: Partition,
    /// As this server knows it: exact for its own blocks and the ones it gave away.
    pub placement: Placement,
    /// The job's seed (initial values, coins).
    pub seed: u64,
    /// Each tensor's own optimizer, if it has one (set with the model, changed by
    /// `SetOptimizer`); the job's otherwise.
    pub tensor_optimizers: Vec<Option<TensorOptimizer>>,
    /// The servers that owned each block before its owner by [`Shard::placement`], as
    /// this server learned of the changes (a promoted backup's old primary may still
    /// forward the pushes it applied).
    pub former_owners: std::collections::BTreeMap<BlockId, std::collections::BTreeSet<ServerId>>,
}

impl Shard {
    /// The configuration of an assignment (its blocks are built by the server).
    pub fn new(a: &Assignment) -> Self {
        let adaptive = match a.config.sync {
            SyncPolicy::Adaptive { min, max } => Some(Adaptive::new(min, max)),
            _ => None,
        };
        Shard {
            id: a.server_id,
            config: a.config,
            adaptive,
            partition: a.partition.clone(),
            placement: a.placement.clone(),
            seed: a.seed,
            tensor_optimizers: a.partition.optimizers.clone(),
            former_owners: Default::default(),
        }
    }

    /// Whether `server` owned `block` before its owner by this server's placement.
    pub fn owned_before(&self, block: BlockId, server: ServerId) -> bool {
        self.former_owners.get(&block).is_some_and(|f| f.contains(&server))
    }

    /// The staleness an `Adaptive` policy currently uses (0 for other policies).
    pub fn staleness(&self) -> u32 {
        self.adaptive.as_ref().map_or(0, Adaptive::staleness)
    }

    /// Feeds the adaptive controller the server's cumulative counters at the end of an
    /// interval; returns (before, after) if the staleness changed.
    pub fn observe(&mut self, totals: &BlockStats) -> Option<(u32, u32)> {
        let a = self.adaptive.as_mut()?;
        let before = a.staleness();
        let after = a.observe(totals);
        (before != after).then_some((before, after))
    }

    /// The configuration to decide with now (an adaptive policy resolved to its current s).
    pub fn effective(&self) -> ShardConfig {
        ShardConfig { sync: self.config.sync.resolve(self.staleness()), ..self.config }
    }

    /// The configuration to decide with now for one block: [`Shard::effective`] with the
    /// optimizer of the block's tensor, if it has its own.
    pub fn config_for(&self, spec: &BlockSpec) -> ShardConfig {
        let mut config = self.effective();
        if let Some(Some(t)) = self.tensor_optimizers.get(spec.tensor as usize) {
            config.optimizer = config.optimizer.with(t);
        }
        config
    }

    /// Gives tensor `tensor` its own optimizer (every later push of its blocks uses it).
    pub fn set_optimizer(&mut self, tensor: u32, optimizer: TensorOptimizer) -> Result<(), CoreError> {
        let tensors = self.partition.tensors.len();
        if tensor as usize >= tensors {
            return Err(CoreError::InvalidModel(format!(
                "tensor {tensor} does not exist: the model has {tensors} tensors"
            )));
        }
        optimizer.validate()?;
        self.tensor_optimizers.resize(tensors, None);
        self.tensor_optimizers[tensor as usize] = Some(optimizer);
        Ok(())
    }

    /// The policy as reported: `adaptive:0:8 (s=3)` for an adaptive one.
    pub fn policy_name(&self) -> String {
        match self.config.sync {
            SyncPolicy::Adaptive { .. } => format!("{} (s={})", self.config.sync, self.staleness()),
            other => other.to_string(),
        }
    }

    /// Why a block that is not served here cannot be served.
    pub fn refusal(&self, block: BlockId) -> Refusal {
        match self.placement.owner(block) {
            Some(owner) => Refusal::Moved { owner, epoch: self.placement.epoch },
            // A split block: no server holds it; the layout has its halves.
            None if self.partition.block(block).is_ok_and(|b| b.is_retired()) => {
                Refusal::Moved { owner: RETIRED, epoch: self.placement.epoch }
            }
            None => Refusal::Unknown { blocks: self.partition.blocks.len() },
        }
    }

    /// Records in this server's placement that `block` is now owned by `owner` at `epoch`.
    pub fn set_owner(&mut self, block: BlockId, owner: ServerId, epoch: u64) {
        if let Some(before) = self.placement.owner(block).filter(|b| *b != owner) {
            self.former_owners.entry(block).or_default().insert(before);
        }
        if let Err(e) = self.placement.apply(block, owner, epoch) {
            tracing::warn!(server = self.id, block, owner, epoch, error = %e, "owner change of an unknown block");
        }
    }
}

/// Why a request cannot be served here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No assignment yet.
    NotReady,
    /// Another server owns the block.
    Moved {
        /// The owner as this server knows it.
        owner: ServerId,
        /// This server's placement epoch.
        epoch: u64,
    },
    /// The model has no such block.
    Unknown {
        /// How many blocks the model has.
        blocks: usize,
    },
}

impl Refusal {
    /// The reply that refuses a request for `block` (docs/PROTOCOL.md's messages).
    pub fn reply(self, block: BlockId) -> Message {
        match self {
            Refusal::NotReady => error(ErrorCode::NotReady, "this server holds no blocks yet: the model is not placed"),
            Refusal::Moved { owner, epoch } => Control::Moved { block, owner, epoch }.into(),
            Refusal::Unknown { blocks } => {
                error(ErrorCode::UnknownBlock, format!("block {block} does not exist: the model has {blocks} blocks"))
            }
        }
    }
}

/// An `Error` reply.
pub fn error(code: ErrorCode, message: impl Into<String>) -> Message {
    Message::Error(ErrorReply { code, message: message.into() })
}
