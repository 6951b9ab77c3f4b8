//! Replicas (`--replicas R`, docs/PROTOCOL.md "Replication and failover"), both ends.
//!
//! Primary-forwarding: workers send every request to a block's primary (its owner), which
//! forwards a push to each backup as a data frame of the bytes it received
//! ([`Message::Forward`]: no copy of the gradient) *before* it applies it, so the backups
//! apply it while the primary does; the reply that acknowledges the push (its `PushAck`,
//! or a push_pull's pull reply) waits at a [`Gate`] until every backup answered. So an acknowledged push is on every live copy,
//! and a worker that resends an unacknowledged one after a failover finds it dropped as a
//! duplicate by the promoted copy's clock state, or applied there for the first time.
//!
//! A backup that cannot be reached (or a new one) is *stale*: the primary sends it the
//! whole state ([`Control::ReplicaSnapshot`]) instead, at once or after
//! [`RESYNC_EVERY_US`]; the gates of the pushes it missed wait for that snapshot. A
//! backup that leaves the placement (the scheduler's [`Control::Replicas`]) releases the
//! gates that wait for it. A snapshot is the block's state *before* the push being
//! forwarded (the primary forwards first), so that push follows its snapshot on the link. Backups start stale: their first copy is the primary's
//! snapshot, so a job resumed from a checkpoint needs nothing more.

use std::collections::{BTreeMap, BTreeSet};

use elasticps_core::CoreError;
use elasticps_core::block::{Answer, Block, BlockState, LoggedPush};
use elasticps_core::model::BlockId;
use elasticps_core::placement::{Placement, ServerId};
use elasticps_core::sync::Clock;
use elasticps_wire::{CheckpointPlan, Control, ErrorCode, Message, RowIds, ServerAddr, Values};

use super::request::{Op, Request};
use super::{Action, Call, ConnId, Exit, Owned, Phase, Refusal, Server, Slot, Token, error, not_taken};

/// How long a primary waits before it sends a fresh snapshot to a backup whose last
/// forward or snapshot failed, µs.
pub const RESYNC_EVERY_US: u64 = 200_000;

/// A data request whose reply waits for the backups: the calls it waits for and the
/// replies held back until then.
#[derive(Debug, Default)]
struct Gate {
    block: BlockId,
    waiting: BTreeSet<u64>,
    stashed: Vec<Message>,
}

/// A backup the primary must send a whole snapshot to.
#[derive(Debug, Default)]
struct Stale {
    /// Not before this time (the server's clock, µs).
    retry_at_us: u64,
    /// The snapshot in flight, if one is.
    in_flight: Option<u64>,
    /// (gate, the failed call it waited for): released by the next snapshot.
    gates: Vec<((ConnId, u64), u64)>,
}

/// A backup copy of a block held here. (Held copies are the rule: not boxed.)
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
enum Copy {
    /// The copy, up to date with the pushes forwarded so far, and its state when it last
    /// reached a checkpoint clock (written if it is promoted: its old primary may have
    /// died before it wrote that checkpoint).
    Held(HeldCopy),
    /// No snapshot yet: the forwarded pushes wait, with where their `Ok` goes.
    Awaiting(Vec<(ConnId, u64, Fwd)>),
}

/// A forwarded push (or init), as a backup applies it: the worker's gradient as the
/// primary received it (shared bytes, no copy).
#[derive(Debug, Clone)]
pub(super) struct Fwd {
    /// The worker that pushed it.
    pub worker: u32,
    /// Its clock (0 for an init).
    pub clock: Clock,
    /// An init (initial values) rather than a gradient.
    pub init: bool,
    /// The gradient or the initial values.
    pub values: Values,
    /// A row push's rows (`values` then holds their gradients); `None` for a dense push.
    /// A row push goes to the backups as `Replicate` (postcard), not `Forward`.
    pub rows: Option<RowIds>,
}

impl Fwd {
    /// Applies this push to `block` (a row push if the block is a row block), as the
    /// primary did: the held pulls it releases, or why it does not fit.
    fn push_into(
        &self,
        block: &mut Block<Token>,
        config: &elasticps_core::block::ShardConfig,
        rejoined: bool,
        now_us: u64,
    ) -> Result<Vec<Answer<Token>>, CoreError> {
        let grad = self.values.gradient();
        if block.spec().is_rows() {
            let ids = self.rows.as_ref().map(RowIds::to_vec).unwrap_or_default();
            let push = if rejoined { Block::push_rows_rejoined } else { Block::push_rows };
            push(block, config, self.worker, self.clock, &ids, grad.gradient().payload(), now_us)
        } else {
            let push = if rejoined { Block::push_gradient_rejoined } else { Block::push_gradient };
            push(block, config, self.worker, self.clock, grad.gradient(), now_us)
        }
    }

    /// The message that carries it to a backup of `block`.
    fn message(&self, block: BlockId) -> Message {
        let Fwd { worker, clock, init, values, rows } = self.clone();
        match rows {
            Some(ids) => {
                let push = LoggedPush { worker, clock, grad: values.to_f32s().into_owned(), rows: ids.to_vec() };
                Control::Replicate { block, init: false, push }.into()
            }
            None => Message::Forward { block, clock, worker, init, values },
        }
    }
}

/// A backup's copy of a block, and its state when it last reached a checkpoint clock.
#[derive(Debug)]
struct HeldCopy {
    block: Block<Token>,
    checkpoint: Option<(Clock, BlockState)>,
}

impl HeldCopy {
    /// Applies a forwarded push (or init) as the primary did, and keeps the copy's state
    /// if it just reached a checkpoint clock of `plan`; the answer for the primary.
    fn apply(
        &mut self,
        shard: &super::Shard,
        rejoined: &[u32],
        plan: Option<&CheckpointPlan>,
        push: &Fwd,
        now_us: u64,
    ) -> Message {
        let copy = &mut self.block;
        if push.init {
            // A second init (a duplicate) finds the block trained or equal: nothing to do.
            let _ = copy.set_initial(&push.values.to_f32s());
            return Control::Ok.into();
        }
        let before = copy.done();
        let config = shard.config_for(copy.spec());
        if let Err(e) = push.push_into(copy, &config, rejoined.contains(&push.worker), now_us) {
            return error(ErrorCode::BadRequest, e.to_string());
        }
        if let Some(c) = super::checkpoint::next_checkpoint(plan, before).filter(|c| *c == copy.done()) {
            self.checkpoint = Some((c, copy.state()));
        }
        Control::Ok.into()
    }
}

/// Both ends of replication on one server.
#[derive(Debug, Default)]
pub(super) struct Replication {
    /// The backup copies held here.
    copies: BTreeMap<BlockId, Copy>,
    /// Data addresses of the other servers (from `Replicas`).
    peers: BTreeMap<ServerId, String>,
    gates: BTreeMap<(ConnId, u64), Gate>,
    /// Which gates wait for a call.
    call_gates: BTreeMap<u64, Vec<(ConnId, u64)>>,
    stale: BTreeMap<(BlockId, ServerId), Stale>,
}

impl Replication {
    /// When the next resync of a stale backup is due (none in flight), if any.
    pub(super) fn next_resync_us(&self) -> Option<u64> {
        self.stale.values().filter(|s| s.in_flight.is_none()).map(|s| s.retry_at_us).min()
    }

    /// Whether `(conn, request_id)`'s reply waits for backups.
    fn gated(&self, key: (ConnId, u64)) -> bool {
        self.gates.get(&key).is_some_and(|g| !g.waiting.is_empty())
    }

    /// Call `call` is over (answered, or its backup left): the gates it held that wait
    /// for nothing else give their replies.
    fn release(&mut self, call: u64, out: &mut Vec<Action>) {
        for key in self.call_gates.remove(&call).unwrap_or_default() {
            self.release_gate(key, call, out);
        }
    }

    fn release_gate(&mut self, key: (ConnId, u64), call: u64, out: &mut Vec<Action>) {
        let Some(g) = self.gates.get_mut(&key) else { return };
        g.waiting.remove(&call);
        if g.waiting.is_empty()
            && let Some(g) = self.gates.remove(&key)
        {
            for msg in g.stashed {
                out.push(Action::Reply { conn: key.0, request_id: key.1, msg });
            }
        }
    }

    /// The backup copies here, for RemoveWorker / AddWorker (a copy's quorum follows the
    /// primary's).
    pub(super) fn copies_mut(&mut self) -> impl Iterator<Item = &mut Block<Token>> {
        self.copies.values_mut().filter_map(|c| match c {
            Copy::Held(h) => Some(&mut h.block),
            Copy::Awaiting(_) => None,
        })
    }

    /// The backup copy of `block` held here, if it arrived.
    pub(super) fn copy(&self, block: BlockId) -> Option<&Block<Token>> {
        match self.copies.get(&block) {
            Some(Copy::Held(h)) => Some(&h.block),
            _ => None,
        }
    }
}

impl Server {
    /// A new assignment: the blocks this server backs up start awaiting their primary's
    /// snapshot, and the backups of its own blocks are stale (sent a snapshot once their
    /// addresses are known).
    pub(super) fn assign_copies(&mut self, placement: &Placement, me: ServerId) {
        let r = &mut self.replication;
        *r = Replication { peers: std::mem::take(&mut r.peers), ..Replication::default() };
        for b in placement.backups_on(me) {
            r.copies.insert(b, Copy::Awaiting(Vec::new()));
        }
        for b in placement.blocks_of(me) {
            for backup in placement.backups_of(b) {
                r.stale.insert((b, *backup), Stale::default());
            }
        }
    }

    /// Primary: a push (or init) of `block` for the request `to`, about to be applied
    /// here (not yet): forward it to every backup as the bytes received; the request's
    /// reply waits for them. A stale backup gets the block's state first (which does not
    /// hold this push yet) and the push behind it: the link to a server is FIFO, so the
    /// push is applied to the new copy. (A snapshot taken before the push and sent alone
    /// would acknowledge a push the backup never got: the race a forward before the
    /// apply opens.) A backup whose address is unknown waits for its next snapshot,
    /// taken after this push was applied.
    pub(super) fn forward(&mut self, now_us: u64, to: Token, push: Fwd, out: &mut Vec<Action>) {
        let Some(shard) = &self.shard else { return };
        let block = to.block;
        let me = shard.id;
        let backups: Vec<ServerId> = shard.placement.backups_of(block).iter().copied().filter(|s| *s != me).collect();
        let key = (to.conn, to.request_id);
        for backup in backups {
            let addr = self.replication.peers.get(&backup).cloned();
            let idle_stale = matches!(self.replication.stale.get(&(block, backup)), Some(s) if s.in_flight.is_none());
            let call = match addr {
                Some(addr) if !idle_stale || self.resync(now_us, block, backup, out).is_some() => {
                    let call = self.call(now_us, Call::Replicate { block, backup });
                    out.push(Action::ToServer { call, server: backup, addr, msg: push.message(block) });
                    Some(call)
                }
                _ => None,
            };
            let r = &mut self.replication;
            let gate = r.gates.entry(key).or_insert_with(|| Gate { block, ..Gate::default() });
            match call {
                Some(call) => {
                    gate.waiting.insert(call);
                    r.call_gates.entry(call).or_default().push(key);
                }
                None => {
                    // Not sent (no address yet): the backup's next snapshot releases it.
                    let placeholder = self.next_call;
                    self.next_call += 1;
                    gate.waiting.insert(placeholder);
                    r.stale.entry((block, backup)).or_default().gates.push((key, placeholder));
                }
            }
        }
    }

    /// Sends the whole state of `block` to stale `backup`; its waiting gates move to that
    /// call. `None` if the block is not served here or the backup's address is unknown.
    fn resync(&mut self, now_us: u64, block: BlockId, backup: ServerId, out: &mut Vec<Action>) -> Option<u64> {
        let addr = self.replication.peers.get(&backup)?.clone();
        let state = match self.slots.get(&block) {
            Some(Slot::Owned(o)) if matches!(o.phase, Phase::Serving | Phase::Copying { .. }) => o.block.state(),
            _ => return None,
        };
        let call = self.call(now_us, Call::ReplicaSync { block, backup });
        let r = &mut self.replication;
        let s = r.stale.entry((block, backup)).or_default();
        s.in_flight = Some(call);
        s.retry_at_us = now_us + RESYNC_EVERY_US;
        for (key, old) in std::mem::take(&mut s.gates) {
            if let Some(g) = r.gates.get_mut(&key) {
                g.waiting.remove(&old);
                g.waiting.insert(call);
                r.call_gates.entry(call).or_default().push(key);
            }
        }
        tracing::debug!(server = self.id, block, backup, "sending a block's state to its backup");
        out.push(Action::ToServer { call, server: backup, addr, msg: Control::ReplicaSnapshot(state).into() });
        Some(call)
    }

    /// A backup answered a forward or a snapshot (or the runtime says it cannot).
    pub(super) fn replica_answered(
        &mut self,
        now_us: u64,
        call: u64,
        what: Call,
        reply: Result<Message, String>,
        out: &mut Vec<Action>,
    ) {
        let failure = match reply {
            Ok(Message::Control(Control::Ok)) => None,
            Ok(Message::Error(e)) => Some(format!("{:?}: {}", e.code, e.message)),
            Ok(other) => Some(format!("expected Ok, got {:?}", other.kind())),
            Err(e) => Some(e),
        };
        let (Call::Replicate { block, backup } | Call::ReplicaSync { block, backup }) = what else { return };
        let still_backup = self.shard.as_ref().is_some_and(|s| s.placement.backups_of(block).contains(&backup));
        match failure {
            Some(e) if still_backup => self.replica_failed(call, what, e, now_us),
            _ => {
                self.replication.release(call, out);
                if matches!(what, Call::ReplicaSync { .. })
                    && let Some(s) = self.replication.stale.remove(&(block, backup))
                    && !s.gates.is_empty()
                {
                    // Pushes whose forward failed behind this snapshot: one more.
                    let s = Stale { in_flight: None, retry_at_us: now_us, gates: s.gates };
                    self.replication.stale.insert((block, backup), s);
                    if still_backup {
                        self.resync(now_us, block, backup, out);
                    } else {
                        self.backup_left(block, backup, out);
                    }
                }
            }
        }
    }

    /// Call `call` to a backup failed: the backup is stale, and the gates that waited for
    /// the call wait for its next snapshot.
    fn replica_failed(&mut self, call: u64, what: Call, e: String, now_us: u64) {
        let (Call::Replicate { block, backup } | Call::ReplicaSync { block, backup }) = what else { return };
        tracing::warn!(server = self.id, block, backup, error = %e, "a backup did not take an update; it gets the block's state again");
        let r = &mut self.replication;
        let gates = r.call_gates.remove(&call).unwrap_or_default();
        let s = r.stale.entry((block, backup)).or_default();
        if s.in_flight == Some(call) {
            s.in_flight = None;
        }
        s.retry_at_us = now_us + RESYNC_EVERY_US;
        s.gates.extend(gates.into_iter().map(|key| (key, call)));
    }

    /// `block` became this server's by migration: its backups get its whole state (a
    /// backup placed while it moved may have none, and the old owner stopped sending).
    pub(super) fn take_over_backups(&mut self, now_us: u64, block: BlockId, out: &mut Vec<Action>) {
        let Some(shard) = &self.shard else { return };
        for backup in shard.placement.backups_of(block).iter().filter(|s| **s != shard.id) {
            self.replication.stale.entry((block, *backup)).or_default();
        }
        self.resync_due(now_us, out);
    }

    /// `block` was handed over to `owner` at `epoch` (a migration): this server no longer
    /// forwards its pushes. A request whose reply still waits for a backup is answered
    /// `Moved`, once (a held push_pull's stashed `PushAck` and its pull's answer are one
    /// request): the push went along with the block, and the worker's resend reaches the
    /// new owner, which drops it as a duplicate but forwards it to the backups (so a backup
    /// that missed it gets it) and acknowledges it once they have it. Returns the requests
    /// answered, which the caller does not answer again (a held pull among them).
    pub(super) fn handed_over(
        &mut self,
        block: BlockId,
        owner: ServerId,
        epoch: u64,
        out: &mut Vec<Action>,
    ) -> Vec<(ConnId, u64)> {
        let r = &mut self.replication;
        r.stale.retain(|(b, _), _| *b != block);
        let keys: Vec<(ConnId, u64)> = r.gates.iter().filter(|(_, g)| g.block == block).map(|(k, _)| *k).collect();
        let mut answered = Vec::new();
        for key in keys {
            if let Some(g) = r.gates.remove(&key)
                && !g.stashed.is_empty()
            {
                let moved = Control::Moved { block, owner, epoch };
                out.push(Action::Reply { conn: key.0, request_id: key.1, msg: moved.into() });
                answered.push(key);
            }
        }
        answered
    }

    /// On tick: stale backups whose retry time came get a snapshot.
    pub(super) fn resync_due(&mut self, now_us: u64, out: &mut Vec<Action>) {
        let due: Vec<(BlockId, ServerId)> = self
            .replication
            .stale
            .iter()
            .filter(|(_, s)| s.in_flight.is_none() && s.retry_at_us <= now_us)
            .map(|(k, _)| *k)
            .collect();
        for (block, backup) in due {
            if self.resync(now_us, block, backup, out).is_none()
                && let Some(s) = self.replication.stale.get_mut(&(block, backup))
            {
                s.retry_at_us = now_us + RESYNC_EVERY_US;
            }
        }
    }

    /// Holds back, until the backups answered, the replies in `out[from..]` to requests
    /// whose push they have not acknowledged yet.
    pub(super) fn gate_replies(&mut self, from: usize, out: &mut Vec<Action>) {
        if self.replication.gates.is_empty() || from >= out.len() {
            return;
        }
        let tail = out.split_off(from);
        for action in tail {
            match action {
                Action::Reply { conn, request_id, msg } if self.replication.gated((conn, request_id)) => {
                    if let Some(g) = self.replication.gates.get_mut(&(conn, request_id)) {
                        g.stashed.push(msg);
                    }
                }
                other => out.push(other),
            }
        }
    }

    /// Backup: a message of a block's primary (a forwarded push or init, or the block's
    /// whole state); answered `None` while the push waits for the block's state.
    pub(super) fn on_replica(
        &mut self,
        now_us: u64,
        from: (ConnId, u64),
        msg: Message,
        out: &mut Vec<Action>,
    ) -> Option<Message> {
        match msg {
            Message::Control(Control::Replicate { block, init, push }) => {
                let rows = Some(RowIds::from_vec(push.rows));
                let fwd =
                    Fwd { worker: push.worker, clock: push.clock, init, values: Values::from_vec(push.grad), rows };
                self.take_replicated(now_us, from, block, fwd, out)
            }
            Message::Forward { block, clock, worker, init, values } => {
                let fwd = Fwd { worker, clock, init, values, rows: None };
                self.take_replicated(now_us, from, block, fwd, out)
            }
            Message::Control(Control::ReplicaSnapshot(state)) => Some(self.take_replica_snapshot(now_us, state, out)),
            other => Some(not_taken(&other)),
        }
    }

    /// Backup: a forwarded push (or init) for `block`. Answered `Ok` once applied; one that
    /// arrives before the block's first snapshot waits for it.
    pub(super) fn take_replicated(
        &mut self,
        now_us: u64,
        (conn, request_id): (ConnId, u64),
        block: BlockId,
        push: Fwd,
        out: &mut Vec<Action>,
    ) -> Option<Message> {
        let Some(shard) = &self.shard else { return Some(Refusal::NotReady.reply(block)) };
        if push.worker >= shard.config.workers {
            let message = format!(
                "a forwarded push of block {block} names worker {}, and the job has {} workers",
                push.worker, shard.config.workers
            );
            return Some(error(ErrorCode::BadRequest, message));
        }
        let held = self.slots.get(&block).is_some_and(serves) || self.replication.copies.contains_key(&block);
        if !held && !shard.placement.holds_copy(block, shard.id) {
            let message = format!("server {} holds no copy of block {block} to replicate into", shard.id);
            return Some(error(ErrorCode::UnknownBlock, message));
        }
        if let Some(Slot::Owned(o)) = self.slots.get_mut(&block).filter(|s| serves(s)) {
            // Promoted here while the old primary's forward was on its way: apply it to the
            // block served (a duplicate of the worker's resend is dropped either way).
            let config = shard.config_for(o.block.spec());
            let answers = if push.init {
                let _ = o.block.set_initial(&push.values.to_f32s());
                Vec::new()
            } else {
                push.push_into(&mut o.block, &config, false, now_us).unwrap_or_default()
            };
            self.answer_pulls(answers, out);
            return Some(Control::Ok.into());
        }
        match self.replication.copies.entry(block).or_insert_with(|| Copy::Awaiting(Vec::new())) {
            Copy::Awaiting(waiting) => {
                waiting.push((conn, request_id, push));
                None
            }
            Copy::Held(h) => Some(h.apply(shard, &self.added_workers, self.checkpoint.as_ref(), &push, now_us)),
        }
    }

    /// Backup: the whole state of a block from its primary: the copy is replaced, and the
    /// pushes that waited for it are applied (duplicates dropped) and answered.
    pub(super) fn take_replica_snapshot(&mut self, now_us: u64, state: BlockState, out: &mut Vec<Action>) -> Message {
        let Some(shard) = &self.shard else { return Refusal::NotReady.reply(state.spec.id) };
        let block = state.spec.id;
        if shard.partition.block(block).ok() != Some(&state.spec) {
            return error(ErrorCode::BadRequest, format!("the state of block {block} does not match the model"));
        }
        if self.slots.get(&block).is_some_and(serves) {
            return error(ErrorCode::BadRequest, format!("block {block} is served by this server, not backed up"));
        }
        let config = shard.config_for(&state.spec);
        let mut copy = match Block::from_state(state, &[], &config) {
            Ok(block) => HeldCopy { block, checkpoint: None },
            Err(e) => return error(ErrorCode::BadRequest, format!("block {block} cannot be rebuilt: {e}")),
        };
        for rank in &self.removed_workers {
            copy.block.remove_worker(&config, *rank, now_us);
        }
        for rank in &self.added_workers {
            copy.block.add_worker(*rank);
        }
        let waiting = match self.replication.copies.insert(block, Copy::Awaiting(Vec::new())) {
            Some(Copy::Awaiting(w)) => w,
            _ => Vec::new(),
        };
        for (conn, request_id, push) in waiting {
            let msg = copy.apply(shard, &self.added_workers, self.checkpoint.as_ref(), &push, now_us);
            out.push(Action::Reply { conn, request_id, msg });
        }
        self.replication.copies.insert(block, Copy::Held(copy));
        Control::Ok.into()
    }

    /// `Replicas` from the scheduler: who holds which copy now. This server serves the
    /// blocks it was promoted for, drops the copies it no longer backs up, sends its
    /// state to each new backup of its blocks, and stops waiting for backups that left.
    pub(super) fn replicas_changed(
        &mut self,
        now_us: u64,
        placement: Placement,
        servers: Vec<ServerAddr>,
        out: &mut Vec<Action>,
    ) {
        let Some(shard) = self.shard.as_mut() else { return };
        let me = shard.id;
        self.replication.peers = servers.into_iter().filter(|s| s.id != me).map(|s| (s.id, s.addr)).collect();
        let old = std::mem::replace(&mut shard.placement.backups, placement.backups.clone());
        let mut incomplete = None;
        for (b, owner) in placement.owners.iter().enumerate() {
            let b = b as BlockId;
            let owned_here = matches!(self.slots.get(&b), Some(Slot::Owned(_)));
            if *owner == me && !owned_here {
                match self.replication.copies.remove(&b) {
                    Some(Copy::Held(HeldCopy { block, checkpoint })) => {
                        tracing::info!(
                            server = me,
                            block = b,
                            epoch = placement.epoch,
                            "backup promoted: this server serves the block"
                        );
                        if let (Some((clock, state)), Some(plan)) = (checkpoint, &self.checkpoint) {
                            // The checkpoint its old primary may not have written.
                            out.push(Action::Checkpoint { dir: plan.dir.clone(), clock, state });
                            self.checkpoint_writes += 1;
                        }
                        self.slots.insert(b, Slot::Owned(Owned::serving(block, placement.epoch)));
                        // The other backups may miss pushes the old primary applied.
                        for backup in placement.backups_of(b) {
                            self.replication.stale.entry((b, *backup)).or_default();
                        }
                    }
                    _ => incomplete = Some(b),
                }
                shard.set_owner(b, me, placement.epoch);
            } else if owned_here {
                // Moved here by a migration: the block arrived whole, the copy is stale.
                self.replication.copies.remove(&b);
            } else {
                shard.set_owner(b, *owner, placement.epoch);
                if !placement.backups_of(b).contains(&me) {
                    self.replication.copies.remove(&b);
                } else {
                    self.replication.copies.entry(b).or_insert_with(|| Copy::Awaiting(Vec::new()));
                }
            }
        }
        if let Some(b) = incomplete {
            let reason = format!(
                "block {b} was promoted to this server, but its copy here is incomplete (its primary's state never \
                 arrived): the block is lost"
            );
            return self.exit(Exit::Failed { reason }, out);
        }
        // New backups of the blocks served here get the state; backups that left release
        // what waits for them.
        let owned: Vec<BlockId> = self.owned();
        for b in owned {
            let before: &[ServerId] = old.get(b as usize).map_or(&[], Vec::as_slice);
            let now: Vec<ServerId> = placement.backups_of(b).to_vec();
            for backup in now.iter().filter(|s| !before.contains(s)) {
                self.replication.stale.entry((b, *backup)).or_default();
            }
            for gone in before.iter().filter(|s| !now.contains(s)) {
                self.backup_left(b, *gone, out);
            }
        }
        let gone: Vec<(BlockId, ServerId)> =
            self.replication.stale.keys().filter(|(b, s)| !placement.backups_of(*b).contains(s)).copied().collect();
        for (b, s) in gone {
            self.backup_left(b, s, out);
        }
        self.resync_due(now_us, out);
    }

    /// `backup` no longer holds a copy of `block`: nothing waits for it any more.
    fn backup_left(&mut self, block: BlockId, backup: ServerId, out: &mut Vec<Action>) {
        let calls: Vec<u64> = self
            .calls
            .iter()
            .filter(|(_, p)| {
                matches!(p.what, Call::Replicate { block: b, backup: s } | Call::ReplicaSync { block: b, backup: s }
                    if b == block && s == backup)
            })
            .map(|(id, _)| *id)
            .collect();
        for call in calls {
            self.end_call(call);
            self.replication.release(call, out);
        }
        if let Some(s) = self.replication.stale.remove(&(block, backup)) {
            for (key, call) in s.gates {
                self.replication.release_gate(key, call, out);
            }
        }
    }
}

/// Whether a slot serves its block here: owned and not frozen for a handover (a block
/// handed over becomes a backup copy as soon as its new owner sends its state, which may
/// come before the scheduler's word that the move is recorded).
fn serves(slot: &Slot) -> bool {
    matches!(slot, Slot::Owned(o) if !matches!(o.phase, Phase::Frozen { .. }))
}

/// The push a request carries, as a backup replays it (`None` for a pull): the bytes
/// received, shared (no copy).
pub(super) fn carried(rank: u32, request: &Request) -> Option<Fwd> {
    let (init, clock, values) = match &request.op {
        Op::Push { clock, values } | Op::PushPull { clock, values } => (false, *clock, values),
        Op::Init { values } => (true, 0, values),
        Op::Pull { .. } => return None,
    };
    Some(Fwd { worker: rank, clock, init, values: values.clone(), rows: request.rows().cloned() })
}
