//! The blocks a server owns and how a push or pull reaches one of them.
//!
//! Each block sits in a [`Slot`]: its state machine ([`Block`]) plus what a migration
//! needs: a `frozen` flag (while the last delta goes to the new owner, requests for the
//! block are parked instead of served), the parked requests, and where the block went
//! once it is gone (requests that raced with the handover are answered `Moved`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use elasticps_core::CoreError;
use elasticps_core::block::{Answer, Block, BlockState, BlockStats, ShardConfig};
use elasticps_core::model::{BlockId, BlockSpec, Partition};
use elasticps_core::optimizer::TensorOptimizer;
use elasticps_core::placement::{Placement, ServerId};
use elasticps_core::stats::Histogram;
use elasticps_core::sync::{Clock, SyncPolicy};
use elasticps_wire::{Assignment, Control, ErrorCode, ErrorReply, Message, ServerLoad, ServerStats, Values};
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::conn::Outbox;
use crate::metrics::{ServerSnapshot, ServerSource, staleness_bound};
use crate::shaping::Shaper;

/// Where an answer goes: the connection's outbox and the request id.
#[derive(Clone, Debug)]
pub(super) struct ReplyTo {
    pub out: Outbox,
    pub request_id: u64,
    pub block: BlockId,
}

/// A request that arrived while its block was frozen for a handover.
#[derive(Debug)]
pub(super) struct Parked {
    pub rank: u32,
    pub to: ReplyTo,
    pub request: Request,
}

/// A data request for one block.
#[derive(Debug)]
pub(super) enum Request {
    Push {
        clock: Clock,
        values: Values,
    },
    Pull {
        clock: Clock,
    },
    /// The block's initial values (the first worker's parameters), before any push.
    Init {
        values: Values,
    },
}

/// One owned block and its migration state.
pub(super) struct SlotState {
    pub block: Block<ReplyTo>,
    /// The placement epoch at which the block arrived here (0: initial assignment).
    pub epoch: u64,
    /// A migration of this block is under way (one at a time).
    pub migrating: bool,
    pub frozen: bool,
    pub parked: Vec<Parked>,
    /// Set at the handover: (new owner, epoch).
    pub gone: Option<(ServerId, u64)>,
}

impl SlotState {
    /// A block served here, not migrating.
    pub fn new(block: Block<ReplyTo>) -> Self {
        Self { block, epoch: 0, migrating: false, frozen: false, parked: Vec::new(), gone: None }
    }
}

pub(super) type Slot = Mutex<SlotState>;

/// The blocks this server owns, with the job's configuration.
pub(super) struct Shard {
    pub id: ServerId,
    /// As assigned; `sync` may be `Adaptive`.
    pub config: ShardConfig,
    /// The staleness an `Adaptive` policy currently uses.
    pub staleness: AtomicU32,
    pub partition: Partition,
    /// As this server knows it: exact for its own blocks and the ones it gave away.
    pub placement: RwLock<Placement>,
    /// The job's seed (initial values, coins).
    pub seed: u64,
    pub blocks: RwLock<HashMap<BlockId, Arc<Slot>>>,
    /// Snapshots of blocks on their way here: block -> (epoch, state).
    pub incoming: Mutex<HashMap<BlockId, (u64, BlockState)>>,
    /// Counters of blocks that left this server.
    pub departed: Mutex<(BlockStats, Histogram)>,
    /// Workers removed from every quorum: a block arriving later leaves them out too.
    pub removed_workers: Mutex<Vec<u32>>,
    /// Each tensor's own optimizer, if it has one (set with the model, changed by
    /// `SetOptimizer`); the job's otherwise.
    pub tensor_optimizers: RwLock<Vec<Option<TensorOptimizer>>>,
}

impl Shard {
    /// Builds the blocks of an assignment with their initial values.
    pub fn new(a: Assignment) -> crate::Result<Shard> {
        let mut blocks = HashMap::new();
        for b in a.placement.blocks_of(a.server_id) {
            let spec = *a.partition.block(b)?;
            let values = a.partition.init_values(b, a.seed)?;
            let block = Block::new(spec, values, &a.config)?;
            blocks.insert(b, Arc::new(Mutex::new(SlotState::new(block))));
        }
        let staleness = match a.config.sync {
            SyncPolicy::Adaptive { min, .. } => min,
            _ => 0,
        };
        Ok(Shard {
            tensor_optimizers: RwLock::new(a.partition.optimizers.clone()),
            id: a.server_id,
            config: a.config,
            staleness: AtomicU32::new(staleness),
            partition: a.partition,
            placement: RwLock::new(a.placement),
            seed: a.seed,
            blocks: RwLock::new(blocks),
            incoming: Mutex::new(HashMap::new()),
            departed: Mutex::new(Default::default()),
            removed_workers: Mutex::new(Vec::new()),
        })
    }

    /// The configuration to decide with now (an adaptive policy resolved to its current s).
    pub fn effective(&self) -> ShardConfig {
        ShardConfig { sync: self.config.sync.resolve(self.staleness.load(Ordering::Relaxed)), ..self.config }
    }

    /// The configuration to decide with now for one block: [`Shard::effective`] with the
    /// optimizer of the block's tensor, if it has its own.
    pub fn config_for(&self, spec: &BlockSpec) -> ShardConfig {
        let mut config = self.effective();
        if let Some(Some(t)) = read(&self.tensor_optimizers).get(spec.tensor as usize) {
            config.optimizer = config.optimizer.with(t);
        }
        config
    }

    /// Gives tensor `tensor` its own optimizer (every later push of its blocks uses it).
    pub fn set_optimizer(&self, tensor: u32, optimizer: TensorOptimizer) -> Result<(), CoreError> {
        let tensors = self.partition.tensors.len();
        if tensor as usize >= tensors {
            return Err(CoreError::InvalidModel(format!(
                "tensor {tensor} does not exist: the model has {tensors} tensors"
            )));
        }
        optimizer.validate()?;
        let mut all = write(&self.tensor_optimizers);
        all.resize(tensors, None);
        all[tensor as usize] = Some(optimizer);
        Ok(())
    }

    /// The policy as reported: `adaptive:0:8 (s=3)` for an adaptive one.
    pub fn policy_name(&self) -> String {
        match self.config.sync {
            SyncPolicy::Adaptive { .. } => {
                format!("{} (s={})", self.config.sync, self.staleness.load(Ordering::Relaxed))
            }
            other => other.to_string(),
        }
    }

    /// The slot of an owned block.
    pub fn slot(&self, block: BlockId) -> Option<Arc<Slot>> {
        read(&self.blocks).get(&block).cloned()
    }

    /// Every owned slot (a snapshot of the map: blocks may come and go meanwhile).
    pub fn slots(&self) -> Vec<(BlockId, Arc<Slot>)> {
        read(&self.blocks).iter().map(|(b, s)| (*b, s.clone())).collect()
    }

    /// Why a block that is not here cannot be served.
    fn refusal(&self, block: BlockId) -> Refusal {
        let placement = read(&self.placement);
        match placement.owner(block) {
            Some(owner) => Refusal::Moved { owner, epoch: placement.epoch },
            None => Refusal::Unknown { blocks: self.partition.blocks.len() },
        }
    }

    /// Records in this server's placement that `block` is now owned by `owner` at `epoch`.
    pub fn set_owner(&self, block: BlockId, owner: ServerId, epoch: u64) {
        if let Err(e) = write(&self.placement).apply(block, owner, epoch) {
            tracing::warn!(server = self.id, block, owner, epoch, error = %e, "owner change of an unknown block");
        }
    }
}

/// Why a request cannot be served here.
pub(super) enum Refusal {
    /// No assignment yet.
    NotReady,
    /// Another server owns the block.
    Moved { owner: ServerId, epoch: u64 },
    /// The model has no such block.
    Unknown { blocks: usize },
}

impl Refusal {
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
pub(super) fn error(code: ErrorCode, message: impl Into<String>) -> Message {
    Message::Error(ErrorReply { code, message: message.into() })
}

/// The server's state shared by its tasks.
pub(super) struct State {
    pub codec: elasticps_wire::Codec,
    pub clock: crate::Micros,
    pub shard: RwLock<Option<Arc<Shard>>>,
    pub trace: Option<Mutex<std::io::BufWriter<std::fs::File>>>,
    pub shaper: Arc<Shaper>,
    pub load: LoadCounters,
    /// Open data connections (workers and migrating servers).
    pub connections: AtomicU64,
    /// When the last data request arrived (the server's clock, µs).
    pub last_request_us: AtomicU64,
    /// Blocks that arrived by migration.
    pub migrations_in: AtomicU64,
    /// Blocks handed over to another server.
    pub migrations_out: AtomicU64,
}

/// Counters over a server's blocks (see [`State::stats`]).
#[derive(Default)]
struct Counters {
    blocks: u32,
    bytes: u64,
    totals: BlockStats,
    hold: Histogram,
}

impl ServerSource for State {
    fn snapshot(&self) -> ServerSnapshot {
        self.metrics_snapshot()
    }
}

/// Load counters since the last report.
#[derive(Default)]
pub(super) struct LoadCounters {
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    pub requests: AtomicU64,
    pub busy_us: AtomicU64,
}

impl State {
    pub fn current(&self) -> Option<Arc<Shard>> {
        read(&self.shard).clone()
    }

    /// Handles a data request: answers it now (returns the reply), later (held pull:
    /// `None`, the answer comes from a push), or parks it while its block is frozen.
    pub fn handle(&self, rank: u32, to: ReplyTo, request: Request) -> Option<Message> {
        let block = to.block;
        let now = self.clock.now();
        self.last_request_us.store(now, Ordering::Relaxed);
        let Some(shard) = self.current() else { return Some(Refusal::NotReady.reply(block)) };
        let Some(slot) = shard.slot(block) else { return Some(shard.refusal(block).reply(block)) };
        let mut s = lock(&slot);
        if let Some((owner, epoch)) = s.gone {
            return Some(Refusal::Moved { owner, epoch }.reply(block));
        }
        if s.frozen {
            s.parked.push(Parked { rank, to, request });
            return None;
        }
        self.load.requests.fetch_add(1, Ordering::Relaxed);
        let reply = match request {
            Request::Push { clock, values } => {
                self.load.bytes_in.fetch_add(values.as_bytes().len() as u64, Ordering::Relaxed);
                // Only a push needs the tensor's own optimizer.
                let config = shard.config_for(s.block.spec());
                match s.block.push(&config, rank, clock, &values.to_f32s(), now) {
                    Ok(answers) => {
                        drop(s);
                        self.send_answers(answers);
                        Some(Message::PushAck { block, clock })
                    }
                    Err(e) => Some(error(ErrorCode::BadRequest, e.to_string())),
                }
            }
            Request::Init { values } if s.migrating => {
                drop(values);
                Some(error(
                    ErrorCode::NotReady,
                    format!("block {block} is migrating: initial values must be set before training starts"),
                ))
            }
            Request::Init { values } => match s.block.set_initial(&values.to_f32s()) {
                Ok(()) => Some(Message::PushAck { block, clock: 0 }),
                Err(e) => Some(error(ErrorCode::BadRequest, e.to_string())),
            },
            Request::Pull { clock } => {
                // One coin per pull request, not per block: every block (on every server) of
                // worker `rank`'s pull(clock) draws the same value, so a probabilistic policy
                // pauses the whole pull or none of it.
                let mut coin = StdRng::seed_from_u64(pull_coin_seed(shard.seed, rank, clock));
                match s.block.pull(&shard.effective(), to, rank, clock, now, &mut coin) {
                    Ok(answer) => {
                        drop(s);
                        self.send_answers(answer.into_iter().collect());
                        None
                    }
                    Err(e) => Some(error(ErrorCode::BadRequest, e.to_string())),
                }
            }
        };
        let spent_us = self.clock.now().saturating_sub(now);
        self.load.busy_us.fetch_add(spent_us, Ordering::Relaxed);
        self.shaper.interfere(std::time::Duration::from_micros(spent_us));
        reply
    }

    /// Sends the pull answers the core released (and traces them).
    pub fn send_answers(&self, answers: Vec<Answer<ReplyTo>>) {
        for a in answers {
            if let Some(trace) = &self.trace {
                use std::io::Write;
                let mut t = lock(trace);
                let _ = writeln!(
                    t,
                    r#"{{"block":{},"worker":{},"clock":{},"done":{},"held_us":{}}}"#,
                    a.token.block,
                    a.worker,
                    a.clock,
                    a.done,
                    a.held_us.map_or("null".to_string(), |u| u.to_string())
                );
            }
            self.load.bytes_out.fetch_add(a.values.len() as u64 * 4, Ordering::Relaxed);
            let msg =
                Message::PullReply { block: a.token.block, clock: a.clock, values: Values::from_shared(a.values) };
            let _ = a.token.out.send((a.token.request_id, msg));
        }
    }

    /// The server's counters (final report and `GetStats`).
    pub fn stats(&self, id: ServerId) -> ServerStats {
        let (shard, c) = self.counters();
        let sync = shard.map_or_else(String::new, |s| s.policy_name());
        let Counters { blocks, bytes, totals, hold } = c;
        ServerStats { server_id: id, sync, blocks, bytes, totals, hold_p99_us: hold.quantile(0.99) }
    }

    /// The counters summed over the owned blocks and the blocks that left.
    fn counters(&self) -> (Option<Arc<Shard>>, Counters) {
        let mut c = Counters::default();
        let Some(shard) = self.current() else { return (None, c) };
        for (_, slot) in shard.slots() {
            let s = lock(&slot);
            if s.gone.is_some() {
                continue;
            }
            c.totals.merge(s.block.stats());
            c.hold.merge(s.block.hold_histogram());
            c.blocks += 1;
            c.bytes += s.block.spec().bytes() as u64;
        }
        let departed = lock(&shard.departed);
        c.totals.merge(&departed.0);
        c.hold.merge(&departed.1);
        drop(departed);
        (Some(shard), c)
    }

    /// The counters as the metrics show them.
    pub fn metrics_snapshot(&self) -> ServerSnapshot {
        let (shard, c) = self.counters();
        let (server_id, sync, staleness_bound) = match &shard {
            Some(s) => {
                let bound = staleness_bound(s.config.sync, s.staleness.load(Ordering::Relaxed));
                (Some(s.id), Some(s.config.sync), bound)
            }
            None => (None, None, 0),
        };
        ServerSnapshot {
            server_id,
            sync,
            staleness_bound,
            blocks: c.blocks,
            bytes: c.bytes,
            totals: c.totals,
            hold: c.hold.buckets().to_vec(),
            migrations_in: self.migrations_in.load(Ordering::Relaxed),
            migrations_out: self.migrations_out.load(Ordering::Relaxed),
        }
    }

    /// The load since the last call (counters reset), for the scheduler.
    pub fn take_load(&self, id: ServerId, interval_us: u64) -> ServerLoad {
        let (mut blocks, mut bytes) = (0, 0);
        if let Some(shard) = self.current() {
            for (_, slot) in shard.slots() {
                blocks += 1;
                bytes += lock(&slot).block.spec().bytes() as u64;
            }
        }
        ServerLoad {
            server_id: id,
            interval_us,
            bytes_in: self.load.bytes_in.swap(0, Ordering::Relaxed),
            bytes_out: self.load.bytes_out.swap(0, Ordering::Relaxed),
            requests: self.load.requests.swap(0, Ordering::Relaxed),
            busy_us: self.load.busy_us.swap(0, Ordering::Relaxed),
            shaped_us: self.shaper.take_shaped_us(),
            blocks,
            bytes,
        }
    }
}

/// The seed of the coin of worker `rank`'s pull(clock): the same on every server.
fn pull_coin_seed(job_seed: u64, rank: u32, clock: u32) -> u64 {
    let key = (u64::from(rank) << 32) | u64::from(clock);
    (job_seed ^ key.wrapping_mul(0x9E37_79B9_7F4A_7C15)).rotate_left(29)
}

/// Locks, ignoring poisoning (a panicked holder left consistent data: every mutation of
/// a block completes or returns an error before touching state).
pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub(super) fn read<T>(m: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(|e| e.into_inner())
}

pub(super) fn write<T>(m: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(|e| e.into_inner())
}
