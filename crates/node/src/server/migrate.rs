//! Live migration of one block, both ends (docs/PROTOCOL.md, "Migration").
//!
//! Old owner: snapshot while serving (pushes applied from then on are logged), send the
//! snapshot, freeze the block (requests are parked), send the logged pushes (or a fresh
//! snapshot when the log outweighs the state), report to the scheduler, and once it has
//! updated the placement answer the parked requests and held pulls `Moved`. Every step
//! is a call with the deadline of every call ([`super::STEP_TIMEOUT_US`]); a failed or
//! overdue step abandons the migration and serves the parked requests here. New owner: keep the snapshot, build the
//! block from it and the replayed pushes (the clock state drops duplicates), serve it.

use elasticps_core::block::{Block, BlockState, LoggedPush};
use elasticps_core::model::BlockId;
use elasticps_core::placement::ServerId;
use elasticps_wire::{Control, ErrorCode, Message, MigrationReport};

use super::{
    Action, Call, FrozenStep, Outgoing, Owned, Parked, Phase, Refusal, Request, Server, Slot, error, not_taken,
};

/// The snapshot of a block on its way here (a migration's step 2), until its delta.
#[derive(Debug)]
pub(super) struct Incoming {
    /// The server that sent it: the delta must come from it too.
    from: ServerId,
    /// The placement epoch the block is to have here.
    epoch: u64,
    /// The block's state.
    state: BlockState,
}

impl Server {
    /// New owner: a step of a migration from server `from` (a snapshot, or the delta).
    pub(super) fn on_migration(
        &mut self,
        now_us: u64,
        from: ServerId,
        control: Control,
        out: &mut Vec<Action>,
    ) -> Message {
        match control {
            Control::BlockSnapshot { epoch, state } => self.take_snapshot(from, epoch, state),
            Control::BlockDelta { block, epoch, pushes } => self.take_delta(now_us, from, block, epoch, &pushes, out),
            other => not_taken(&other.into()),
        }
    }

    /// The scheduler asked to move `block` to `to`: snapshot it and send the snapshot.
    pub(super) fn migrate_out(
        &mut self,
        now_us: u64,
        block: BlockId,
        to: ServerId,
        to_addr: String,
        epoch: u64,
        out: &mut Vec<Action>,
    ) {
        let from = self.id.unwrap_or(u32::MAX);
        let mut report =
            MigrationReport { block, from, to, epoch, bytes: 0, freeze_us: 0, total_us: 0, held: 0, error: None };
        let refused = match (&self.shard, self.slots.get(&block)) {
            (None, _) => Some("no blocks assigned yet".to_string()),
            (Some(_), None) => Some(format!("block {block} is not owned here")),
            (Some(_), Some(Slot::Owned(Owned { phase: Phase::Serving, .. }))) => None,
            (Some(_), Some(_)) => Some(format!("block {block} is already migrating")),
        };
        if let Some(e) = refused {
            // Not started (not owned here, or already migrating): nothing to undo, and a
            // migration of this block that runs must not be touched.
            tracing::warn!(server = from, block, to, error = %e, "migration refused");
            report.error = Some(e);
            out.push(Action::ToScheduler { request_id: 0, msg: Control::MigrateDone(report).into() });
            return;
        }
        let call = self.call(now_us, Call::Migration(block));
        let Some(Slot::Owned(o)) = self.slots.get_mut(&block) else { return };
        let state = o.block.snapshot();
        report.bytes += state.state_len() as u64 * 4;
        let migration = Outgoing { to, to_addr: to_addr.clone(), epoch, call, started_us: now_us, report };
        o.phase = Phase::Copying { out: migration };
        out.push(Action::ToServer {
            call,
            server: to,
            addr: to_addr,
            msg: Control::BlockSnapshot { epoch, state }.into(),
        });
    }

    /// The new owner answered a step (or the runtime says it cannot).
    pub(super) fn step_answered(
        &mut self,
        now_us: u64,
        call: u64,
        reply: Result<Message, String>,
        out: &mut Vec<Action>,
    ) {
        let block = match self.end_call(call) {
            Some(Call::Migration(block)) => block,
            Some(what @ (Call::Replicate { .. } | Call::ReplicaSync { .. })) => {
                return self.replica_answered(now_us, call, what, reply, out);
            }
            _ => {
                tracing::debug!(call, "an answer to no migration step");
                return;
            }
        };
        let Some(Slot::Owned(o)) = self.slots.get_mut(&block) else { return };
        let (to, step) = match &o.phase {
            Phase::Copying { out: m } if m.call == call => (m.to, "BlockSnapshot"),
            Phase::Frozen { out: m, step: FrozenStep::Snapshot, .. } if m.call == call => (m.to, "BlockSnapshot"),
            Phase::Frozen { out: m, step: FrozenStep::Delta, .. } if m.call == call => (m.to, "BlockDelta"),
            _ => return,
        };
        let failure = match reply {
            Ok(Message::Control(Control::Ok)) => None,
            Ok(Message::Error(e)) => Some(format!("server {to} answered {:?}: {}", e.code, e.message)),
            Ok(other) => {
                Some(format!("protocol error with server {to}: expected Ok to {step}: got {:?}", other.kind()))
            }
            Err(e) => Some(e),
        };
        if let Some(e) = failure {
            return self.fail(now_us, block, e, out);
        }
        let next = self.call(now_us, Call::Migration(block));
        let Some(Slot::Owned(o)) = self.slots.get_mut(&block) else { return };
        match std::mem::replace(&mut o.phase, Phase::Serving) {
            Phase::Copying { out: mut m } => {
                // Freeze: from now on requests are parked.
                m.report.held = o.block.held() as u32;
                let pushes = o.block.take_log();
                // Many pushes arrived while the snapshot travelled (a slow server): the state
                // as it is now is smaller than the log, and bounded by the frame size.
                let logged: usize = pushes.iter().map(|p| p.grad.len()).sum();
                let (step, msg) = if logged > o.block.state_len() {
                    let state = o.block.snapshot();
                    o.block.take_log();
                    m.report.bytes += state.state_len() as u64 * 4;
                    (FrozenStep::Snapshot, Control::BlockSnapshot { epoch: m.epoch, state })
                } else {
                    m.report.bytes += pushes.iter().map(|p| p.grad.len() as u64 * 4).sum::<u64>();
                    (FrozenStep::Delta, Control::BlockDelta { block, epoch: m.epoch, pushes })
                };
                m.call = next;
                let to_send = Action::ToServer { call: next, server: m.to, addr: m.to_addr.clone(), msg: msg.into() };
                let parked = std::mem::take(&mut o.checkpoint_parked);
                o.phase = Phase::Frozen { out: m, parked, since_us: now_us, step };
                out.push(to_send);
            }
            Phase::Frozen { out: mut m, parked, since_us, step: FrozenStep::Snapshot } => {
                m.call = next;
                let msg = Control::BlockDelta { block, epoch: m.epoch, pushes: Vec::new() };
                out.push(Action::ToServer { call: next, server: m.to, addr: m.to_addr.clone(), msg: msg.into() });
                o.phase = Phase::Frozen { out: m, parked, since_us, step: FrozenStep::Delta };
            }
            Phase::Frozen { out: mut m, parked, since_us, step: _ } => {
                // The new owner serves the block: the scheduler records the move.
                m.report.total_us = now_us.saturating_sub(m.started_us);
                m.report.freeze_us = now_us.saturating_sub(since_us);
                m.call = next;
                out.push(Action::ToScheduler { request_id: next, msg: Control::MigrateDone(m.report.clone()).into() });
                o.phase = Phase::Frozen { out: m, parked, since_us, step: FrozenStep::Recording };
            }
            // Not migrating out: an answer to no step of ours (the call matched above).
            other @ (Phase::Serving | Phase::Arrived { .. }) => o.phase = other,
        }
        if self.stopping.is_some() {
            // The scheduler already shut the job down: it will not record this move.
            self.shutdown_handovers(out);
        }
    }

    /// The scheduler answered `MigrateDone`.
    pub(super) fn recorded(&mut self, now_us: u64, block: BlockId, call: u64, msg: Message, out: &mut Vec<Action>) {
        let Some(Slot::Owned(Owned { phase: Phase::Frozen { out: m, step: FrozenStep::Recording, .. }, .. })) =
            self.slots.get(&block)
        else {
            return;
        };
        if m.call != call {
            return;
        }
        let (to, epoch) = (m.to, m.epoch);
        if let Message::Error(e) = msg {
            // The scheduler does not know this migration (it wrote it off): its placement
            // still says this server. Keep serving the block here.
            tracing::warn!(server = self.id, block, error = %e.message, "the scheduler refused a migration");
            return self.abandon(now_us, block, out);
        }
        self.finish_handover(block, to, epoch, out);
    }

    /// The step of the migration of `block` in call `call` got no answer within `after`
    /// seconds: a step to the new owner fails as its link failing would (the migration is
    /// abandoned); the scheduler's silence after the new owner took the block is not a
    /// failure (the job ends with a stuck scheduler), and the handover completes.
    pub(super) fn migration_overdue(
        &mut self,
        now_us: u64,
        block: BlockId,
        call: u64,
        after: u64,
        out: &mut Vec<Action>,
    ) {
        let step = match self.slots.get(&block) {
            Some(Slot::Owned(Owned { phase: Phase::Copying { out: m }, .. })) if m.call == call => {
                Some((m.to, m.epoch, None))
            }
            Some(Slot::Owned(Owned { phase: Phase::Frozen { out: m, step, .. }, .. })) if m.call == call => {
                Some((m.to, m.epoch, Some(*step)))
            }
            _ => None,
        };
        let what = match step {
            None => {
                self.end_call(call);
                return;
            }
            Some((to, _, None)) => format!("server {to} did not answer the snapshot of block {block} within {after} s"),
            Some((to, _, Some(FrozenStep::Snapshot))) => {
                format!("server {to} did not answer the frozen state of block {block} within {after} s")
            }
            Some((to, _, Some(FrozenStep::Delta))) => {
                format!("server {to} did not answer the last updates of block {block} within {after} s")
            }
            Some((to, epoch, Some(FrozenStep::Recording))) => {
                // The new owner serves the block; the scheduler is gone or stuck, and the
                // job ends with it. Answering Moved is still right.
                let from = self.id.unwrap_or(u32::MAX);
                tracing::warn!(
                    server = from,
                    block,
                    to,
                    after_s = after,
                    "the scheduler did not confirm a migration in time: the block is handed over"
                );
                self.end_call(call);
                return self.finish_handover(block, to, epoch, out);
            }
        };
        self.step_answered(now_us, call, Err(what), out);
    }

    /// `Shutdown` arrived: the scheduler said its last word (its answer to a
    /// `MigrateDone` would have come before it on the same connection), so a move the
    /// new owner took over is complete. Answering `Moved` is right; waiting for the
    /// step's deadline would only delay the exit.
    pub(super) fn shutdown_handovers(&mut self, out: &mut Vec<Action>) {
        let recording: Vec<(BlockId, ServerId, u64, u64)> = self
            .slots
            .iter()
            .filter_map(|(b, s)| match s {
                Slot::Owned(Owned { phase: Phase::Frozen { out: m, step: FrozenStep::Recording, .. }, .. }) => {
                    Some((*b, m.to, m.epoch, m.call))
                }
                _ => None,
            })
            .collect();
        for (block, to, epoch, call) in recording {
            tracing::warn!(server = self.id, block, to, "the scheduler shut down before it confirmed a migration");
            self.end_call(call);
            self.finish_handover(block, to, epoch, out);
        }
    }

    /// A step failed: the block stays here, the scheduler hears why.
    fn fail(&mut self, now_us: u64, block: BlockId, e: String, out: &mut Vec<Action>) {
        let Some(Slot::Owned(Owned { phase: Phase::Copying { out: m } | Phase::Frozen { out: m, .. }, .. })) =
            self.slots.get(&block)
        else {
            return;
        };
        let mut report = m.report.clone();
        tracing::warn!(server = self.id, block, to = m.to, error = %e, "migration failed; the block stays here");
        report.total_us = now_us.saturating_sub(m.started_us);
        report.error = Some(e);
        self.abandon(now_us, block, out);
        out.push(Action::ToScheduler { request_id: 0, msg: Control::MigrateDone(report).into() });
    }

    /// After the scheduler recorded the move: answer everything parked or held with
    /// `Moved` and forget the block (its counters stay with this server).
    fn finish_handover(&mut self, block: BlockId, to: ServerId, epoch: u64, out: &mut Vec<Action>) {
        let Some(shard) = self.shard.as_mut() else { return };
        shard.set_owner(block, to, epoch);
        let Some(Slot::Owned(mut o)) = self.slots.insert(block, Slot::Gone { owner: to, epoch }) else { return };
        let answered = self.handed_over(block, to, epoch, out);
        self.counters.migrations_out += 1;
        self.counters.departed.merge(o.block.stats());
        self.counters.departed_hold.merge(o.block.hold_histogram());
        if let Some(r) = o.block.rows() {
            super::counters::add_rows(&mut self.counters.departed_rows, &r.counters());
        }
        if let Phase::Frozen { out: m, .. } = &o.phase {
            let r = &m.report;
            tracing::info!(
                server = self.id,
                block,
                to,
                bytes = r.bytes,
                freeze_ms = r.freeze_us as f64 / 1e3,
                total_ms = r.total_us as f64 / 1e3,
                held = r.held,
                "block migrated"
            );
        }
        let moved = Control::Moved { block, owner: to, epoch };
        let mut parked = match std::mem::replace(&mut o.phase, Phase::Serving) {
            Phase::Frozen { parked, .. } => parked,
            _ => Vec::new(),
        };
        parked.append(&mut o.checkpoint_parked);
        for p in parked {
            out.push(Action::Reply { conn: p.to.conn, request_id: p.to.request_id, msg: moved.clone().into() });
        }
        for (t, _, _) in o.block.take_held() {
            self.held.let_go(&t);
            // A held push_pull whose gated PushAck became `Moved` is answered already.
            if !answered.contains(&(t.conn, t.request_id)) {
                out.push(Action::Reply { conn: t.conn, request_id: t.request_id, msg: moved.clone().into() });
            }
        }
    }

    /// A failed migration: unfreeze, stop logging, serve what was parked.
    fn abandon(&mut self, now_us: u64, block: BlockId, out: &mut Vec<Action>) {
        let call = match self.slots.get(&block) {
            Some(Slot::Owned(Owned { phase: Phase::Copying { out: m } | Phase::Frozen { out: m, .. }, .. })) => {
                Some(m.call)
            }
            _ => None,
        };
        if let Some(call) = call {
            self.end_call(call);
        }
        let Some(Slot::Owned(o)) = self.slots.get_mut(&block) else { return };
        o.block.take_log();
        let parked = match std::mem::replace(&mut o.phase, Phase::Serving) {
            Phase::Frozen { parked, .. } => parked,
            _ => Vec::new(),
        };
        self.serve_parked(now_us, parked, out);
    }

    pub(super) fn serve_parked(&mut self, now_us: u64, parked: Vec<Parked>, out: &mut Vec<Action>) {
        for Parked { rank, to, request } in parked {
            if let Some(msg) = self.serve(now_us, rank, to, request, out) {
                out.push(Action::Reply { conn: to.conn, request_id: to.request_id, msg });
            }
        }
    }

    /// New owner, step 2: keep the snapshot until the delta arrives.
    pub(super) fn take_snapshot(&mut self, from: ServerId, epoch: u64, snapshot: BlockState) -> Message {
        let Some(shard) = &self.shard else { return Refusal::NotReady.reply(snapshot.spec.id) };
        let block = snapshot.spec.id;
        match shard.partition.block(block) {
            Ok(spec) if *spec == snapshot.spec => {}
            _ => {
                return error(ErrorCode::BadRequest, format!("the snapshot of block {block} does not match the model"));
            }
        }
        if let Some(Slot::Owned(o)) = self.slots.get(&block)
            && o.epoch >= epoch
        {
            return error(ErrorCode::BadRequest, format!("block {block} is already owned by this server"));
        }
        match shard.placement.owner(block) {
            Some(owner) if owner == from && from != shard.id => {}
            owner => {
                let owner = owner.map_or("no server".to_string(), |o| format!("server {o}"));
                let message = format!(
                    "server {from} sent the snapshot of block {block}, whose owner is {owner} by this server's placement"
                );
                return error(ErrorCode::Forbidden, message);
            }
        }
        self.incoming.insert(block, Incoming { from, epoch, state: snapshot });
        Control::Ok.into()
    }

    /// New owner, step 3: build the block from the snapshot and the delta, and serve it.
    pub(super) fn take_delta(
        &mut self,
        now_us: u64,
        from: ServerId,
        block: BlockId,
        epoch: u64,
        pushes: &[LoggedPush],
        out: &mut Vec<Action>,
    ) -> Message {
        let Some(shard) = &self.shard else { return Refusal::NotReady.reply(block) };
        // A delta from another server than the snapshot's leaves the snapshot waiting.
        if let Some(i) = self.incoming.get(&block).filter(|i| i.epoch == epoch && i.from != from) {
            let message = format!("the snapshot of block {block} came from server {}, not from server {from}", i.from);
            return error(ErrorCode::Forbidden, message);
        }
        let snapshot = match self.incoming.remove(&block) {
            Some(i) if i.epoch == epoch => i.state,
            _ => return error(ErrorCode::BadRequest, format!("no snapshot of block {block} at epoch {epoch} arrived")),
        };
        let config = shard.config_for(&snapshot.spec);
        // Workers this server removed (RemoveWorker reaches every server, maybe not the
        // old owner first): the block must not wait for them here either. Workers it took
        // back (restarted) count again, and may have gone on past the snapshot's clock.
        // The delta first, then the removals: a finished worker's last push may be in the
        // delta while its RemoveWorker reached this server first (under --aggregate a
        // block that left the worker out first would drop that push).
        let rebuilt = Block::from_state(snapshot, &[], &config).and_then(|mut b| {
            for rank in &self.added_workers {
                b.add_worker(*rank);
            }
            b.replay(&config, pushes, &self.added_workers)?;
            for rank in &self.removed_workers {
                b.remove_worker(&config, *rank, now_us);
            }
            Ok(b)
        });
        let b = match rebuilt {
            Ok(b) => b,
            Err(e) => return error(ErrorCode::BadRequest, format!("block {block} cannot be rebuilt: {e}")),
        };
        let id = shard.id;
        let arrived = Owned::new(b, epoch, Phase::Arrived { parked: Vec::new(), since_us: now_us });
        let stale = self.slots.insert(block, Slot::Owned(arrived));
        tracing::info!(server = id, block, epoch, replayed = pushes.len(), "block arrived; waits to be settled");
        if let Some(Slot::Owned(mut stale)) = stale {
            // A copy from a handover whose acknowledgement was lost: its held pulls (and
            // anything parked) are decided again on the block as it is now.
            if let Phase::Copying { out: m } | Phase::Frozen { out: m, .. } = &stale.phase {
                let call = m.call;
                self.end_call(call);
            }
            let mut again: Vec<Parked> = match std::mem::replace(&mut stale.phase, Phase::Serving) {
                Phase::Frozen { parked, .. } | Phase::Arrived { parked, .. } => parked,
                _ => Vec::new(),
            };
            again.append(&mut stale.checkpoint_parked);
            let held = stale.block.take_held();
            held.iter().for_each(|(to, _, _)| self.held.let_go(to));
            again.extend(held.into_iter().map(|(to, rank, clock)| Parked { rank, to, request: Request::pull(clock) }));
            self.serve_parked(now_us, again, out);
        }
        Control::Ok.into()
    }

    /// New owner, step 4: the scheduler settled the migration of `block` at `epoch`:
    /// `owner` owns it. This server then serves the copy and what was parked, or (the move
    /// failed) drops the copy and answers what was parked `Moved` to the owner.
    pub(super) fn settled(&mut self, now_us: u64, block: BlockId, epoch: u64, owner: ServerId, out: &mut Vec<Action>) {
        let Some(shard) = self.shard.as_mut() else { return };
        let me = shard.id;
        if owner != me && self.incoming.get(&block).is_some_and(|i| i.epoch == epoch) {
            // A snapshot whose delta never came.
            self.incoming.remove(&block);
        }
        let parked = match self.slots.get_mut(&block) {
            Some(Slot::Owned(o)) if o.epoch == epoch && matches!(o.phase, Phase::Arrived { .. }) => {
                match std::mem::replace(&mut o.phase, Phase::Serving) {
                    Phase::Arrived { parked, .. } => parked,
                    _ => Vec::new(),
                }
            }
            Some(Slot::Owned(_)) => return,
            _ => {
                // A migration between other servers: this server's placement names the
                // new owner (it takes the block's snapshot from that owner only).
                shard.set_owner(block, owner, epoch);
                return;
            }
        };
        if owner == me {
            shard.set_owner(block, me, epoch);
            self.counters.migrations_in += 1;
            tracing::info!(server = me, block, epoch, parked = parked.len(), "block settled here");
            self.take_over_backups(now_us, block, out);
        } else {
            self.slots.remove(&block);
            tracing::warn!(
                server = me,
                block,
                epoch,
                owner,
                parked = parked.len(),
                "migration failed; the copy is dropped"
            );
        }
        self.serve_parked(now_us, parked, out);
    }
}
