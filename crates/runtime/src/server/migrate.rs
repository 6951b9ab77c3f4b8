//! Live migration of one block, both ends (docs/PROTOCOL.md, "Migration").
//!
//! Old owner: snapshot while serving (pushes applied from then on are logged), send the
//! snapshot, freeze the block (requests are parked), send the logged pushes, report to
//! the scheduler, and once it has updated the placement answer the parked requests and
//! held pulls `Moved`. New owner: keep the snapshot, build the block from it and the
//! replayed pushes (the clock state drops duplicates), serve it. Only one block is
//! frozen, for the time of one delta and one scheduler round trip.

use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use elasticps_core::block::{Block, BlockState, LoggedPush};
use elasticps_core::model::BlockId;
use elasticps_core::placement::ServerId;
use elasticps_wire::{Control, ErrorCode, Message, MigrationReport};

use super::shard::{Parked, Refusal, SlotState, State, error, lock, write};
use crate::error::{Result, RuntimeError};
use crate::peer::Peer;

/// How long each step of a migration may take.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(30);

/// What the scheduler asked: move `block` to `to` at `to_addr`, the placement then at `epoch`.
#[derive(Clone, Debug)]
pub(super) struct MigrateOrder {
    pub block: BlockId,
    pub to: ServerId,
    pub to_addr: String,
    pub epoch: u64,
}

/// Old owner: runs one migration to its end and reports it to the scheduler. Never
/// loses a request: on failure the block is unfrozen and the parked requests served here.
pub(super) async fn migrate_out(state: Arc<State>, id: ServerId, order: MigrateOrder, sched: Peer) {
    let started = Instant::now();
    let MigrateOrder { block, to, epoch, .. } = order.clone();
    let mut report =
        MigrationReport { block, from: id, to, epoch, bytes: 0, freeze_us: 0, total_us: 0, held: 0, error: None };
    let snapshot = match start(&state, block) {
        Ok(s) => s,
        Err(e) => {
            // Not started (not owned here, or already migrating): nothing to undo, and a
            // migration of this block that runs must not be touched.
            tracing::warn!(server = id, block, to, error = %e, "migration refused");
            report.error = Some(e.to_string());
            let _ = sched.notify(Control::MigrateDone(report).into());
            return;
        }
    };
    match hand_over(&state, &order, snapshot, &mut report).await {
        Ok(frozen_at) => {
            report.total_us = started.elapsed().as_micros() as u64;
            report.freeze_us = frozen_at.elapsed().as_micros() as u64;
            let done = sched
                .call(Control::MigrateDone(report.clone()).into(), STEP_TIMEOUT, || {
                    format!("server {id} waits for the scheduler to record block {block} on server {to}")
                })
                .await;
            match &done {
                Err(RuntimeError::Remote { reply, .. }) => {
                    // The scheduler does not know this migration (it wrote it off): its
                    // placement still says this server. Keep serving the block here.
                    tracing::warn!(server = id, block, error = %reply.message, "the scheduler refused a migration");
                    abandon(&state, block);
                    return;
                }
                // The new owner serves the block; the scheduler is gone or stuck, and the
                // job ends with it. Answering Moved is still right.
                Err(e) => tracing::warn!(server = id, block, error = %e, "the scheduler did not confirm a migration"),
                Ok(_) => {}
            }
            finish_handover(&state, block, to, epoch);
            tracing::info!(
                server = id,
                block,
                to,
                bytes = report.bytes,
                freeze_ms = report.freeze_us as f64 / 1e3,
                total_ms = report.total_us as f64 / 1e3,
                held = report.held,
                "block migrated"
            );
        }
        Err(e) => {
            tracing::warn!(server = id, block, to, error = %e, "migration failed; the block stays here");
            abandon(&state, block);
            report.total_us = started.elapsed().as_micros() as u64;
            report.error = Some(e.to_string());
            let _ = sched.notify(Control::MigrateDone(report).into());
        }
    }
}

/// Step 1: marks the block as migrating and takes its snapshot (logging starts).
fn start(state: &State, block: BlockId) -> Result<(Arc<super::shard::Slot>, BlockState)> {
    let shard = state.current().ok_or_else(|| RuntimeError::Usage("no blocks assigned yet".into()))?;
    let slot = shard.slot(block).ok_or_else(|| RuntimeError::Usage(format!("block {block} is not owned here")))?;
    let snapshot = {
        let mut s = lock(&slot);
        if s.gone.is_some() || s.migrating {
            return Err(RuntimeError::Usage(format!("block {block} is already migrating")));
        }
        s.migrating = true;
        s.block.snapshot()
    };
    Ok((slot, snapshot))
}

/// Steps 2-3: stream, freeze, delta. Returns when the block was frozen.
async fn hand_over(
    state: &State,
    order: &MigrateOrder,
    (slot, snapshot): (Arc<super::shard::Slot>, BlockState),
    report: &mut MigrationReport,
) -> Result<Instant> {
    let MigrateOrder { block, to, ref to_addr, epoch } = *order;
    report.bytes += snapshot.state_len() as u64 * 4;
    let name = format!("server {to}");
    let (peer, _notes) = Peer::connect_shaped(to_addr, state.codec.clone(), &name, Some(state.shaper.clone())).await?;
    let ok = |reply: Message, what: &str| match reply {
        Message::Control(Control::Ok) => Ok(()),
        other => Err(RuntimeError::Protocol { peer: name.clone(), what: format!("{what}: got {:?}", other.kind()) }),
    };
    let reply = peer
        .call(Control::BlockSnapshot { epoch, state: snapshot }.into(), STEP_TIMEOUT, || {
            format!("server {to} to take the snapshot of block {block}")
        })
        .await?;
    ok(reply, "expected Ok to BlockSnapshot")?;
    let (frozen_at, mut pushes, resend) = {
        let mut s = lock(&slot);
        s.frozen = true;
        report.held = s.block.held() as u32;
        let pushes = s.block.take_log();
        // Many pushes arrived while the snapshot travelled (a slow server): the state as
        // it is now is smaller than the log, and bounded by the frame size.
        let logged: usize = pushes.iter().map(|p| p.grad.len()).sum();
        let fresh = (logged > s.block.state_len()).then(|| {
            let state = s.block.snapshot();
            s.block.take_log();
            state
        });
        (Instant::now(), pushes, fresh)
    };
    if let Some(state) = resend {
        pushes.clear();
        report.bytes += state.state_len() as u64 * 4;
        let reply = peer
            .call(Control::BlockSnapshot { epoch, state }.into(), STEP_TIMEOUT, || {
                format!("server {to} to take the frozen state of block {block}")
            })
            .await?;
        ok(reply, "expected Ok to BlockSnapshot")?;
    }
    report.bytes += pushes.iter().map(|p| p.grad.len() as u64 * 4).sum::<u64>();
    let reply = peer
        .call(Control::BlockDelta { block, epoch, pushes }.into(), STEP_TIMEOUT, || {
            format!("server {to} to take the last updates of block {block}")
        })
        .await?;
    ok(reply, "expected Ok to BlockDelta")?;
    Ok(frozen_at)
}

/// Step 4, after the scheduler recorded the move: answer everything parked or held with
/// `Moved` and forget the block (its counters stay with this server).
fn finish_handover(state: &State, block: BlockId, to: ServerId, epoch: u64) {
    let Some(shard) = state.current() else { return };
    shard.set_owner(block, to, epoch);
    let Some(slot) = write(&shard.blocks).remove(&block) else { return };
    state.migrations_out.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let (parked, held) = {
        let mut s = lock(&slot);
        s.gone = Some((to, epoch));
        let mut departed = lock(&shard.departed);
        departed.0.merge(s.block.stats());
        departed.1.merge(s.block.hold_histogram());
        (std::mem::take(&mut s.parked), s.block.take_held())
    };
    let moved = Control::Moved { block, owner: to, epoch };
    for p in parked {
        let _ = p.to.out.send((p.to.request_id, moved.clone().into()));
    }
    for (to_reply, _, _) in held {
        let _ = to_reply.out.send((to_reply.request_id, moved.clone().into()));
    }
}

/// A failed migration: unfreeze, stop logging, serve what was parked.
fn abandon(state: &State, block: BlockId) {
    let Some(slot) = state.current().and_then(|s| s.slot(block)) else { return };
    let parked = {
        let mut s = lock(&slot);
        s.frozen = false;
        s.migrating = false;
        s.block.take_log();
        std::mem::take(&mut s.parked)
    };
    for Parked { rank, to, request } in parked {
        let out = to.out.clone();
        let id = to.request_id;
        if let Some(reply) = state.handle(rank, to, request) {
            let _ = out.send((id, reply));
        }
    }
}

/// New owner, step 2: keep the snapshot until the delta arrives.
pub(super) fn take_snapshot(state: &State, epoch: u64, snapshot: BlockState) -> Message {
    let Some(shard) = state.current() else { return Refusal::NotReady.reply(snapshot.spec.id) };
    let block = snapshot.spec.id;
    match shard.partition.block(block) {
        Ok(spec) if *spec == snapshot.spec => {}
        _ => return error(ErrorCode::BadRequest, format!("the snapshot of block {block} does not match the model")),
    }
    if let Some(slot) = shard.slot(block)
        && lock(&slot).epoch >= epoch
    {
        return error(ErrorCode::BadRequest, format!("block {block} is already owned by this server"));
    }
    lock(&shard.incoming).insert(block, (epoch, snapshot));
    Control::Ok.into()
}

/// New owner, step 3: build the block from the snapshot and the delta, and serve it.
pub(super) fn take_delta(state: &State, block: BlockId, epoch: u64, pushes: &[LoggedPush]) -> Message {
    let Some(shard) = state.current() else { return Refusal::NotReady.reply(block) };
    let snapshot = match lock(&shard.incoming).remove(&block) {
        Some((e, s)) if e == epoch => s,
        _ => return error(ErrorCode::BadRequest, format!("no snapshot of block {block} at epoch {epoch} arrived")),
    };
    let config = shard.config_for(&snapshot.spec);
    match Block::from_state(snapshot, pushes, &config) {
        Ok(mut b) => {
            // Workers this server removed (RemoveWorker reaches every server, maybe not the
            // old owner first): the block must not wait for them here either. The lock is
            // held until the block is in the map (the RemoveWorker handler holds it too).
            let removed = lock(&shard.removed_workers);
            for rank in removed.iter() {
                b.remove_worker(&config, *rank, state.clock.now());
            }
            let slot = SlotState { epoch, ..SlotState::new(b) };
            let stale = write(&shard.blocks).insert(block, Arc::new(Mutex::new(slot)));
            drop(removed);
            if let Some(stale) = stale {
                // A copy from a handover whose acknowledgement was lost: its held pulls
                // are decided again on the block as it is now.
                let held = {
                    let mut s = lock(&stale);
                    s.gone = Some((shard.id, epoch));
                    s.block.take_held()
                };
                for (to, rank, clock) in held {
                    let (out, id) = (to.out.clone(), to.request_id);
                    if let Some(reply) = state.handle(rank, to, super::shard::Request::Pull { clock }) {
                        let _ = out.send((id, reply));
                    }
                }
            }
            shard.set_owner(block, shard.id, epoch);
            state.migrations_in.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::info!(server = shard.id, block, epoch, replayed = pushes.len(), "block arrived");
            Control::Ok.into()
        }
        Err(e) => error(ErrorCode::BadRequest, format!("block {block} cannot be rebuilt: {e}")),
    }
}
