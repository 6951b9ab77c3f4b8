//! The data path: a [`Request`] from a [`Sender`] reaches its block. Refused (no block,
//! a reply too large, a pull past its bounds), parked (the block frozen or arrived, a push
//! past the next checkpoint), forwarded to the backups first, or applied: the push, then
//! the pull, each written once for the whole block and for rows.

use std::sync::Arc;

use elasticps_core::CoreError;
use elasticps_core::block::{Answer, Block, ShardConfig};
use elasticps_core::model::BlockId;
use elasticps_core::sync::Clock;
use elasticps_wire::{ErrorCode, Message, Values};
use rand::SeedableRng;
use rand::rngs::StdRng;

use super::checkpoint::next_checkpoint;
use super::replica::{self, Fwd};
use super::request::{Op, Request, Sender, What};
use super::{Action, Owned, Parked, Phase, Refusal, Server, Shard, Slot, Token, error};

impl Server {
    /// A data request: answered now (the reply returned), later (a held pull: `None`,
    /// the answer comes from a push), or parked while its block is frozen.
    ///
    /// A push to a block with backups is forwarded to them, then applied here in the same
    /// step: the forwards come first among the actions, and leave once the step returns
    /// (after the apply). Its reply waits for both.
    pub(super) fn serve(
        &mut self,
        now_us: u64,
        rank: u32,
        to: Token,
        request: Request,
        out: &mut Vec<Action>,
    ) -> Option<Message> {
        let block = to.block;
        self.last_request_us = now_us;
        let Some(shard) = self.shard.as_ref() else { return Some(Refusal::NotReady.reply(block)) };
        let o = match self.slots.get_mut(&block) {
            Some(Slot::Owned(o)) => o,
            Some(Slot::Gone { .. }) | None => return Some(shard.refusal(block).reply(block)),
        };
        if let Some(refused) = reply_too_large(&o.block, &request, self.max_payload) {
            if self.refusal_log.admit(now_us) {
                tracing::warn!(server = shard.id, rank, block, %refused, "row pull refused");
            }
            return Some(error(ErrorCode::BadRequest, refused));
        }
        if let Phase::Frozen { parked, .. } | Phase::Arrived { parked, .. } = &mut o.phase {
            parked.push(Parked { rank, to, request });
            return None;
        }
        let from = Sender { rank, rejoined: self.added_workers.contains(&rank) };
        self.skip_to_push(now_us, from, block, &request, out);
        let Some(shard) = self.shard.as_ref() else { return Some(Refusal::NotReady.reply(block)) };
        let Some(Slot::Owned(o)) = self.slots.get_mut(&block) else { return None };
        let done = o.block.done();
        if let Some(refused) = self.request_bound(to.conn, block, &request, done) {
            if self.refusal_log.admit(now_us) {
                tracing::warn!(server = shard.id, rank, block, %refused, "request refused");
            }
            return Some(error(ErrorCode::BadRequest, refused));
        }
        let Some(Slot::Owned(o)) = self.slots.get_mut(&block) else { return None };
        if request
            .pushed()
            .is_some_and(|clock| next_checkpoint(self.checkpoint.as_ref(), done).is_some_and(|c| clock >= c))
        {
            o.checkpoint_parked.push(Parked { rank, to, request });
            return None;
        }
        self.counters.requests += 1;
        // Forwarded only if this server takes it too (a duplicate too: a backup that
        // missed it gets it): a refused push is refused here alone.
        let forward = if shard.placement.backups_of(block).is_empty() { None } else { forwarded(o, from, &request) };
        if let Some(f) = forward {
            self.forward(now_us, to, f, out);
        }
        self.apply_request(now_us, from, to, request, done, out)
    }

    /// A worker that rejoined may go on past its next clock on a block: the clocks between
    /// are skipped before anything waits on them (its push must not park for a checkpoint
    /// of a clock only the skip completes). A push of rows skips as it is applied.
    fn skip_to_push(&mut self, now_us: u64, from: Sender, block: BlockId, request: &Request, out: &mut Vec<Action>) {
        let (Some(shard), Some(clock)) = (self.shard.as_ref(), request.pushed()) else { return };
        if !from.rejoined || !matches!(request.what, What::Tensor) {
            return;
        }
        let Some(Slot::Owned(o)) = self.slots.get_mut(&block) else { return };
        let before = o.block.done();
        let answers = o.block.skip_to(&shard.config_for(o.block.spec()), from.rank, clock, now_us);
        if o.block.done() != before {
            self.answer_pulls(answers, out);
            self.checkpoint_if_due(now_us, block, before, out);
        }
    }

    /// The data request's effect on its block (owned and not frozen: [`Server::serve`]
    /// checked), and its reply if it has one now. `done` is the block's before.
    ///
    /// A push_pull's push is applied exactly as a push (a duplicate is dropped by the
    /// clock state), then the pull of the next clock exactly as a pull: answered now or
    /// held, with the same coin. Its `PullReply` (under the request's id) acknowledges the
    /// push; a held pull's push is acknowledged at once on its own (`PushAck` under the
    /// same id, the `PullReply` later), so that the worker's window never fills with held
    /// pulls while its other pushes wait (issue 33).
    fn apply_request(
        &mut self,
        now_us: u64,
        from: Sender,
        to: Token,
        request: Request,
        done: Clock,
        out: &mut Vec<Action>,
    ) -> Option<Message> {
        let block = to.block;
        let Some(shard) = self.shard.as_ref() else { return Some(Refusal::NotReady.reply(block)) };
        let Some(Slot::Owned(o)) = self.slots.get_mut(&block) else { return Some(shard.refusal(block).reply(block)) };
        let Request { what, op } = request;
        let mut answers = Vec::new();
        let mut held = false;
        let reply = match op {
            Op::Init { .. } if matches!(o.phase, Phase::Copying { .. }) => Some(error(
                ErrorCode::NotReady,
                format!("block {block} is migrating: initial values must be set before training starts"),
            )),
            Op::Init { values } => match o.block.set_initial(&values.to_f32s()) {
                Ok(()) => Some(Message::PushAck { block, clock: 0 }),
                Err(e) => Some(error(ErrorCode::BadRequest, e.to_string())),
            },
            Op::Push { clock, values } => {
                self.counters.bytes_in += push_bytes(&what, &values);
                // Only a push needs the tensor's own optimizer.
                let config = shard.config_for(o.block.spec());
                match push(&mut o.block, &config, from, &what, clock, &values, now_us) {
                    Ok(released) => {
                        answers = released;
                        Some(Message::PushAck { block, clock })
                    }
                    Err(e) => Some(error(ErrorCode::BadRequest, e.to_string())),
                }
            }
            Op::Pull { clock } => {
                // A rejoined worker's pull says where it goes on from on this block: it
                // pushes no clock before it (a pull of rows, only from a row block).
                if from.rejoined && (matches!(what, What::Tensor) || o.block.spec().is_rows()) {
                    answers = o.block.skip_to(&shard.config_for(o.block.spec()), from.rank, clock, now_us);
                }
                match pull(&mut o.block, shard, from.rank, to, &what, clock, now_us) {
                    Ok(answer) => {
                        held = answer.is_none();
                        answers.extend(answer);
                        None
                    }
                    Err(e) => Some(error(ErrorCode::BadRequest, e.to_string())),
                }
            }
            Op::PushPull { clock, values } => {
                let Some(next) = clock.checked_add(1) else {
                    return Some(error(ErrorCode::BadRequest, format!("push_pull of block {block} at the last clock")));
                };
                self.counters.bytes_in += push_bytes(&what, &values);
                let config = shard.config_for(o.block.spec());
                answers = match push(&mut o.block, &config, from, &what, clock, &values, now_us) {
                    Ok(released) => released,
                    Err(e) => return Some(error(ErrorCode::BadRequest, e.to_string())),
                };
                match pull(&mut o.block, shard, from.rank, to, &what, next, now_us) {
                    Ok(Some(answer)) => {
                        answers.push(answer);
                        None
                    }
                    Ok(None) => {
                        held = true;
                        Some(Message::PushAck { block, clock })
                    }
                    Err(e) => Some(error(ErrorCode::BadRequest, e.to_string())),
                }
            }
        };
        if held {
            self.held_pull(to);
        }
        self.answer_pulls(answers, out);
        self.checkpoint_if_due(now_us, block, done, out);
        reply
    }
}

/// Why a pull of rows from `block` is refused before its rows are gathered: its reply
/// would be larger than `max_payload` bytes.
fn reply_too_large(block: &Block<Token>, request: &Request, max_payload: u64) -> Option<String> {
    let (Op::Pull { .. }, What::Rows { ids, .. }) = (&request.op, &request.what) else { return None };
    let (_, _, dim) = block.spec().row_range()?;
    let (rows, bytes) = (ids.len(), ids.len() as u64 * u64::from(dim) * 4);
    (bytes > max_payload).then(|| {
        format!(
            "a pull of {rows} rows of {dim} values from block {} would be answered with {bytes} bytes, above the \
             frame limit of {max_payload} bytes: pull fewer rows per request",
            block.spec().id
        )
    })
}

/// The push `request` carries, to forward to the block's backups, if this server takes
/// it: a refused push (or init) is refused here alone.
fn forwarded(o: &Owned, from: Sender, request: &Request) -> Option<Fwd> {
    let f = replica::carried(from.rank, request)?;
    let fits = if f.init {
        !matches!(o.phase, Phase::Copying { .. }) && !o.block.spec().is_rows() && f.values.len() == o.block.spec().len
    } else if let What::Rows { ids, dim } = &request.what {
        check_dim(&o.block, *dim, ids.len()).is_ok()
            && o.block.check_push_rows(from.rank, f.clock, &ids.to_vec(), f.values.len(), from.rejoined).is_ok()
    } else {
        o.block.check_gradient(from.rank, f.clock, f.values.gradient().gradient(), from.rejoined).is_ok()
    };
    fits.then_some(f)
}

/// The bytes a push brings: its values (and the ids of its rows).
fn push_bytes(what: &What, values: &Values) -> u64 {
    let ids = match what {
        What::Rows { ids, .. } => ids.as_bytes().len(),
        What::Tensor => 0,
    };
    (ids + values.wire_len()) as u64
}

/// Applies a push of `values` at `clock` to `block` (a rejoined worker's skips the clocks
/// before it first): the held pulls it releases.
fn push(
    block: &mut Block<Token>,
    config: &ShardConfig,
    from: Sender,
    what: &What,
    clock: Clock,
    values: &Values,
    now_us: u64,
) -> Result<Vec<Answer<Token>>, CoreError> {
    match what {
        What::Tensor => {
            let push = if from.rejoined { Block::push_gradient_rejoined } else { Block::push_gradient };
            push(block, config, from.rank, clock, values.gradient().gradient(), now_us)
        }
        What::Rows { ids, dim } => {
            check_dim(block, *dim, ids.len())?;
            let push_rows = if from.rejoined { Block::push_rows_rejoined } else { Block::push_rows };
            push_rows(block, config, from.rank, clock, &ids.to_vec(), &values.to_f32s(), now_us)
        }
    }
}

/// Worker `rank`'s pull of `clock` from `block`: answered now, or held (`None`).
fn pull(
    block: &mut Block<Token>,
    shard: &Shard,
    rank: u32,
    to: Token,
    what: &What,
    clock: Clock,
    now_us: u64,
) -> Result<Option<Answer<Token>>, CoreError> {
    // One coin per pull request, not per block: every block (on every server) of worker
    // `rank`'s pull(clock) draws the same value, so a probabilistic policy pauses the
    // whole pull or none of it.
    let mut coin = StdRng::seed_from_u64(pull_coin_seed(shard.seed, rank, clock));
    match what {
        What::Tensor => block.pull(&shard.effective(), to, rank, clock, now_us, &mut coin),
        What::Rows { ids, .. } => {
            let ids: Arc<[u64]> = ids.iter().collect();
            block.pull_rows(&shard.effective(), to, rank, clock, ids, now_us, &mut coin)
        }
    }
}

/// Why a row push of `count` rows of `dim` values does not fit `block`: not a row block,
/// or another width than its table's (an empty push may say any width).
fn check_dim(block: &Block<Token>, dim: u32, count: usize) -> Result<(), CoreError> {
    let spec = block.spec();
    let Some((_, _, d)) = spec.row_range() else { return Err(CoreError::NotRows(spec.id)) };
    if count > 0 && dim != d {
        return Err(CoreError::WrongDim { block: spec.id, expected: d, got: dim });
    }
    Ok(())
}

/// The seed of the coin of worker `rank`'s pull(clock): the same on every server.
pub fn pull_coin_seed(job_seed: u64, rank: u32, clock: u32) -> u64 {
    let key = (u64::from(rank) << 32) | u64::from(clock);
    (job_seed ^ key.wrapping_mul(0x9E37_79B9_7F4A_7C15)).rotate_left(29)
}
