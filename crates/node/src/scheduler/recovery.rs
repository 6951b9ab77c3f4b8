//! The scheduler's recoverable state and its recovery after a restart (`--state-dir`).
//!
//! [`Scheduler::saved_state`] is what the runtime writes (atomically) whenever
//! [`Scheduler::state_version`] changes; [`Scheduler::recover`] rebuilds a scheduler from
//! it. No I/O here.
//!
//! A recovered scheduler knows the job (membership, model, placement and epoch, the
//! history, the last checkpoint) but no connection: it waits for the known servers
//! ([`Control::ReattachServer`]) and workers ([`Control::ReattachWorker`]) to come back,
//! for at most [`RECOVER_WAIT_US`]. Once every server is back, the placement is checked
//! against what the servers hold (the servers win), the layout is answered again and
//! training goes on. A server that does not come back ends the job; a worker that does not
//! is removed from every quorum, as a lost worker is.

use std::collections::{BTreeMap, BTreeSet};
use std::hash::{Hash, Hasher};

use elasticps_core::model::{BlockId, Partition};
use elasticps_core::placement::{Placement, ServerId};
use elasticps_wire::{CheckpointEntry, Control, ErrorCode, HeldBlock, PeerRole};
use serde::{Deserialize, Serialize};

use super::elastic::Order;
use super::{Action, BalanceLog, Caller, ConnId, JobConfig, Node, Role, Scheduler};

/// The saved state's format version.
pub const STATE_VERSION: u32 = 2;

/// How long a recovered scheduler waits for the known servers and workers to reattach, µs.
pub const RECOVER_WAIT_US: u64 = 60_000_000;

/// A job that ends right after a restart still waits this long (from the restart) for
/// workers that had finished before it: one whose `WorkerDone` was acknowledged by nobody
/// (the `Ok` died with the old scheduler) reattaches within its redial backoff (at most
/// 2 s) to hear it, µs.
pub const FINISHED_GRACE_US: u64 = 5_000_000;

/// How long a restarted scheduler that could not recover its saved state stays up to say
/// why, µs: every node redialling it (its backoff is at most 2 s) hears the reason,
/// where it would otherwise redial a closed port for its whole retry window.
pub const UNRECOVERABLE_WAIT_US: u64 = 10_000_000;

/// A restarted scheduler that could not recover: why, and until when it says so.
#[derive(Debug)]
pub(super) struct Unrecoverable {
    why: String,
    /// Set at the first event (the machine's first `now`).
    pub(super) until_us: Option<u64>,
}

/// The scheduler's recoverable state (serialized as JSON by the runtime).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SavedState {
    /// [`STATE_VERSION`].
    pub version: u32,
    /// Servers and workers the job was started with (checked against the restarted
    /// scheduler's flags).
    pub job_servers: u32,
    /// See `job_servers`.
    pub job_workers: u32,
    /// Every server that registered, by id: its data address.
    pub servers: Vec<String>,
    /// Each server's state in the balancer (`serving`, `joining`, `draining`, `gone`).
    pub server_states: Vec<(ServerId, String)>,
    /// Workers that registered (ranks `0..workers`).
    pub workers: u32,
    /// Ranks that finished (or were removed).
    pub finished_workers: BTreeSet<u32>,
    /// Ranks lost before they finished, with why.
    pub failed_workers: BTreeMap<u32, String>,
    /// The first clock of each worker that rejoined.
    pub rejoin_clocks: BTreeMap<u32, u32>,
    /// The model, once defined (tensors, blocks, tensor optimizers).
    pub partition: Option<Partition>,
    /// The placement and its epoch, once placed.
    pub placement: Option<Placement>,
    /// Every server held its blocks once (training had started).
    pub layout_ready: bool,
    /// The migration in flight: (block, from, to, epoch).
    pub migration: Option<(u32, ServerId, ServerId, u64)>,
    /// Migrations done.
    pub migrations: u32,
    /// Migrations and scaling events (the load timeline is not kept).
    pub balance: BalanceLog,
    /// The latest complete checkpoint.
    pub last_checkpoint: Option<u32>,
    /// Checkpoints under way: clock -> blocks written so far.
    pub checkpoints: BTreeMap<u32, Vec<CheckpointEntry>>,
    /// The job's id in its nodes' credentials: a restarted scheduler checks the
    /// credentials of the nodes that reattach with it.
    #[serde(default)]
    pub job: u64,
    /// The split asked of a row block's owner and not reported yet: (block, at, owner,
    /// epoch). Saved before the owner is asked: its `SplitDone` (a notification) dies with
    /// the scheduler, and the recovered one learns the split from the halves the owner
    /// holds when it reattaches.
    #[serde(default)]
    pub split: Option<(u32, u64, ServerId, u64)>,
}

/// A recovered scheduler waiting for its nodes.
#[derive(Debug)]
pub(super) struct Recovering {
    /// Servers not back yet.
    servers: BTreeSet<ServerId>,
    /// Workers not back yet (neither finished nor failed before the restart).
    workers: BTreeSet<u32>,
    /// What the servers that came back hold.
    held: BTreeMap<ServerId, Vec<HeldBlock>>,
    /// Workers that had finished before the restart and have not said `WorkerDone` again
    /// (it may not have been acknowledged: such a worker reattaches and makes it again).
    finished: BTreeSet<u32>,
    /// Its first timeout, µs (the clock of a restarted scheduler may start anywhere): the
    /// waits count from there.
    since_us: Option<u64>,
    /// The job ended (every worker done) before every server was back: how, told to the
    /// servers once they are.
    finish: Option<(bool, String)>,
    /// The split in flight at the restart ([`SavedState::split`]).
    split: Option<(u32, u64, ServerId, u64)>,
}

impl Scheduler {
    /// `ReattachServer`, `ReattachWorker`: a node of the job before the scheduler's
    /// restart comes back with its credential.
    pub(super) fn on_reattach(&mut self, call: Caller, control: Control, out: &mut Vec<Action>) {
        let (conn, request_id) = (call.conn, call.request_id);
        match (control, call.role) {
            (Control::ReattachServer { server_id, credential, data_addr, blocks }, None) => {
                if let Err((code, message)) = self.check_credential(&credential, PeerRole::Server, server_id) {
                    call.refuse(out, code, message);
                    out.push(Action::Close(conn));
                } else if let Err(message) = self.reattach_server(conn, request_id, server_id, data_addr, blocks, out) {
                    call.refuse(out, ErrorCode::BadRequest, message);
                    out.push(Action::Close(conn));
                }
            }
            (Control::ReattachWorker { rank, credential }, None) => {
                if let Err((code, message)) = self.check_credential(&credential, PeerRole::Worker, rank) {
                    call.refuse(out, code, message);
                    out.push(Action::Close(conn));
                } else if let Err(message) = self.reattach_worker(conn, request_id, rank, out) {
                    call.refuse(out, ErrorCode::BadRequest, message);
                    out.push(Action::Close(conn));
                }
            }
            (other, _) => call.refuse_now(out, other),
        }
    }

    /// The state to save. Cheap enough to call when [`Scheduler::state_version`] changed.
    pub fn saved_state(&self) -> SavedState {
        let (server_states, migration, migrations, balance) = self.elastic.saved();
        SavedState {
            version: STATE_VERSION,
            job_servers: self.config.servers,
            job_workers: self.config.workers,
            servers: self.servers.iter().map(|(_, a)| a.clone()).collect(),
            server_states,
            workers: self.workers.len() as u32,
            finished_workers: self.finished_workers.clone(),
            failed_workers: self.failed_workers.clone(),
            rejoin_clocks: self.rejoin_clocks.clone(),
            partition: self.partition.clone(),
            placement: self.placement.clone(),
            layout_ready: self.layout_ready || self.recovering.is_some(),
            migration,
            migrations,
            balance,
            last_checkpoint: self.complete_checkpoint,
            checkpoints: self.checkpoints.iter().map(|(c, b)| (*c, b.values().cloned().collect())).collect(),
            job: self.job,
            split: self.elastic.split_in_flight(),
        }
    }

    /// A digest of the saved state that changes whenever it does: the state is written
    /// only when this changed since its last write ([`Persisted`]).
    pub fn state_version(&self) -> u64 {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.servers.iter().for_each(|(_, a)| a.hash(&mut h));
        self.workers.len().hash(&mut h);
        self.finished_workers.hash(&mut h);
        self.failed_workers.hash(&mut h);
        self.rejoin_clocks.hash(&mut h);
        self.placement.as_ref().map(|p| (p.epoch, &p.owners)).hash(&mut h);
        self.layout_ready.hash(&mut h);
        self.recovering.is_some().hash(&mut h);
        self.complete_checkpoint.hash(&mut h);
        for (c, b) in &self.checkpoints {
            (c, b.len()).hash(&mut h);
        }
        if let Some(p) = &self.partition {
            (p.tensors.len(), p.blocks.len()).hash(&mut h);
            format!("{:?}", p.optimizers).hash(&mut h);
        }
        let (states, migration, migrations, log) = self.elastic.saved();
        (states, migration, migrations, log.migrations.len(), log.scaling.len()).hash(&mut h);
        self.elastic.split_in_flight().hash(&mut h);
        h.finish()
    }

    /// A scheduler rebuilt from `saved` for `config` (the restarted scheduler's flags),
    /// waiting for the known servers and workers to reattach. Fails if the state is of
    /// another format or another job.
    pub fn recover(config: JobConfig, saved: SavedState, heartbeat_timeout_us: u64) -> Result<Self, String> {
        if !saved.layout_ready {
            return Err("the scheduler stopped before training started (not every server held its blocks): start \
                        the job again"
                .into());
        }
        if saved.version != STATE_VERSION {
            return Err(format!("saved state of version {}, this scheduler reads {STATE_VERSION}", saved.version));
        }
        if saved.job_servers != config.servers || saved.job_workers != config.workers {
            return Err(format!(
                "the saved state is of a job of {} servers and {} workers, this scheduler was started for {} and {}",
                saved.job_servers, saved.job_workers, config.servers, config.workers
            ));
        }
        let mut s = Scheduler::new(config, heartbeat_timeout_us);
        s.servers = saved.servers.into_iter().map(|a| (0, a)).collect();
        s.workers = vec![0; saved.workers as usize];
        s.finished_workers = saved.finished_workers;
        s.failed_workers = saved.failed_workers;
        s.rejoin_clocks = saved.rejoin_clocks;
        s.job = saved.job;
        let split = saved.split;
        if let Some(p) = &saved.partition {
            s.elastic.model_placed(p.blocks.iter().map(|b| b.bytes() as u64).collect());
        }
        s.partition = saved.partition;
        s.placement = saved.placement;
        s.last_checkpoint = saved.last_checkpoint.or(s.last_checkpoint);
        s.complete_checkpoint = saved.last_checkpoint.or(s.complete_checkpoint);
        s.checkpoints =
            saved.checkpoints.into_iter().map(|(c, b)| (c, b.into_iter().map(|e| (e.block, e)).collect())).collect();
        s.elastic.restore(&saved.server_states, saved.migration, saved.migrations, saved.balance, 0);
        // The balancer shares a server's link among the workers still running.
        for rank in &s.finished_workers {
            s.elastic.worker_left(*rank);
        }
        s.assigned = (0..s.servers.len() as u32).collect();
        let removed = s.elastic.removed();
        let servers: BTreeSet<ServerId> = (0..s.servers.len() as u32).filter(|id| !removed.contains(id)).collect();
        let workers: BTreeSet<u32> = (0..saved.workers)
            .filter(|r| !s.finished_workers.contains(r) && !s.failed_workers.contains_key(r))
            .collect();
        tracing::info!(
            ?servers,
            ?workers,
            epoch = s.placement.as_ref().map(|p| p.epoch),
            "scheduler recovers its state"
        );
        s.layout_ready = false;
        let finished = s.finished_workers.iter().copied().filter(|r| !s.failed_workers.contains_key(r)).collect();
        s.recovering =
            Some(Recovering { servers, workers, finished, held: BTreeMap::new(), since_us: None, finish: None, split });
        Ok(s)
    }

    /// A restarted scheduler whose saved state could not be recovered (`why`): for
    /// `UNRECOVERABLE_WAIT_US` it answers every call with `ShuttingDown` naming `why`
    /// and closes the connection (a node's session ends with it), then ends the job,
    /// failed, with `why`. Its saved state is left as it is, for the operator.
    pub fn unrecoverable(config: JobConfig, why: String, heartbeat_timeout_us: u64) -> Self {
        let mut s = Self::new(config, heartbeat_timeout_us);
        tracing::error!(%why, "the scheduler could not recover; it says so to every node for a while, then exits");
        s.unrecoverable = Some(Unrecoverable { why, until_us: None });
        s
    }

    /// [`Scheduler::unrecoverable`]'s rules.
    pub(super) fn refuse_unrecoverable(&mut self, event: super::Event, out: &mut Vec<Action>) {
        let now_us = self.now_us;
        let Some(u) = self.unrecoverable.as_mut() else { return };
        let until_us = *u.until_us.get_or_insert(now_us + UNRECOVERABLE_WAIT_US);
        match event {
            super::Event::Received { conn, request_id, .. } => {
                let message = format!("the scheduler could not recover the job: {}", u.why);
                let reply = elasticps_wire::ErrorReply { code: ErrorCode::ShuttingDown, message };
                out.push(Action::Send { conn, request_id, msg: elasticps_wire::Message::Error(reply) });
                out.push(Action::Close(conn));
            }
            super::Event::Timeout if now_us >= until_us => {
                out.push(Action::Finish {
                    ok: false,
                    reason: format!("the scheduler could not recover the job: {}", u.why),
                });
                self.over = true;
            }
            _ => {}
        }
    }

    /// True while a recovered scheduler waits for its servers.
    pub fn recovering(&self) -> bool {
        self.recovering.as_ref().is_some_and(|r| !r.servers.is_empty())
    }

    /// What a recovered scheduler waits for, in words.
    pub(super) fn recovery_wait(&self) -> Option<String> {
        let r = self.recovering.as_ref()?;
        if r.servers.is_empty() && r.workers.is_empty() {
            return None;
        }
        Some(format!("restarted scheduler waits for servers {:?} and workers {:?} to reattach", r.servers, r.workers))
    }

    /// `ReattachServer` on connection `conn`.
    pub(super) fn reattach_server(
        &mut self,
        conn: ConnId,
        request_id: u64,
        server_id: ServerId,
        data_addr: String,
        blocks: Vec<HeldBlock>,
        out: &mut Vec<Action>,
    ) -> Result<(), String> {
        if self.servers.get(server_id as usize).is_none() {
            return Err(format!("server {server_id} is not a server of this job (it has {})", self.servers.len()));
        }
        if self.elastic.removed().contains(&server_id) {
            // Drained and stopped before the restart, but its `Shutdown` (and maybe the
            // `Ok` of its last handover) died with the old scheduler: welcome it, so that
            // its handover completes, and stop it again.
            tracing::info!(server = server_id, "a drained server reattached; it is told to stop");
            self.servers[server_id as usize] = (conn, data_addr);
            self.nodes.insert(conn, Node { role: Role::Server(server_id), last_seen_us: self.now_us });
            out.push(Action::Send { conn, request_id, msg: self.welcome(PeerRole::Server, server_id) });
            let msg = Control::Shutdown { reason: "drained: scaled in".into() }.into();
            out.push(Action::Send { conn, request_id: 0, msg });
            return Ok(());
        }
        let waited = self.recovering.as_mut().is_some_and(|r| r.servers.remove(&server_id));
        if !waited {
            return Err(format!("server {server_id} is not expected to reattach now"));
        }
        tracing::info!(server = server_id, addr = %data_addr, blocks = blocks.len(), "server reattached");
        if let Some(r) = self.recovering.as_mut() {
            r.held.insert(server_id, blocks);
        }
        self.servers[server_id as usize] = (conn, data_addr);
        self.nodes.insert(conn, Node { role: Role::Server(server_id), last_seen_us: self.now_us });
        out.push(Action::Send { conn, request_id, msg: self.welcome(PeerRole::Server, server_id) });
        if self.recovering.as_ref().is_some_and(|r| r.servers.is_empty()) {
            self.reconcile(out);
            self.release_deferred_sets(out);
        }
        Ok(())
    }

    /// `ReattachWorker` on connection `conn`.
    pub(super) fn reattach_worker(
        &mut self,
        conn: ConnId,
        request_id: u64,
        rank: u32,
        out: &mut Vec<Action>,
    ) -> Result<(), String> {
        if rank as usize >= self.workers.len() {
            return Err(format!("worker {rank} is not a worker of this job (it has {})", self.workers.len()));
        }
        if let Some(why) = self.failed_workers.get(&rank) {
            return Err(format!(
                "worker {rank} was removed from every quorum before the scheduler restarted ({why}): restart it with \
                 its rank to rejoin"
            ));
        }
        if self.nodes.values().any(|n| n.role == Role::Worker(rank)) {
            return Err(format!("worker {rank} is already attached"));
        }
        if let Some(r) = self.recovering.as_mut() {
            r.workers.remove(&rank);
        }
        tracing::info!(rank, "worker reattached");
        self.workers[rank as usize] = conn;
        self.nodes.insert(conn, Node { role: Role::Worker(rank), last_seen_us: self.now_us });
        out.push(Action::Send { conn, request_id, msg: self.welcome(PeerRole::Worker, rank) });
        self.end_recovery_if_complete();
        self.end_deferred(out);
        Ok(())
    }

    /// Whether a recovered scheduler still waits for servers or workers to reattach.
    pub(super) fn recovery_waits(&self) -> bool {
        self.recovering.as_ref().is_some_and(|r| !r.servers.is_empty() || !r.workers.is_empty())
    }

    /// The next deadline of a recovered scheduler, µs: its first timeout (the waits count
    /// from there) at once, then the end of [`FINISHED_GRACE_US`], then of
    /// [`RECOVER_WAIT_US`].
    pub(super) fn recovery_deadline_us(&self) -> Option<u64> {
        let r = self.recovering.as_ref()?;
        let Some(since) = r.since_us else { return Some(self.now_us) };
        let grace = since.saturating_add(FINISHED_GRACE_US);
        Some(if self.now_us < grace { grace } else { since.saturating_add(RECOVER_WAIT_US) })
    }

    /// Time passed while recovering: past [`RECOVER_WAIT_US`], a missing server ends the
    /// job and a missing worker is removed from every quorum.
    pub(super) fn recovery_timeout(&mut self, out: &mut Vec<Action>) {
        let now_us = self.now_us;
        let Some(r) = self.recovering.as_mut() else { return };
        let since_us = *r.since_us.get_or_insert(now_us);
        self.end_deferred(out);
        self.end_recovery_if_complete();
        let Some(r) = self.recovering.as_mut() else { return };
        if now_us < since_us.saturating_add(RECOVER_WAIT_US) {
            return;
        }
        let secs = RECOVER_WAIT_US as f64 / 1e6;
        if !r.servers.is_empty() {
            let missing = r.servers.clone();
            let reason = format!(
                "servers {missing:?} did not reattach within {secs:.0} s of the scheduler's restart: the job cannot go on"
            );
            self.recovering = None;
            self.finish(false, reason, out);
            return;
        }
        let missing: Vec<u32> = r.workers.iter().copied().collect();
        self.recovering = None;
        for rank in missing {
            let why = format!("did not reattach within {secs:.0} s of the scheduler's restart");
            tracing::error!(rank, %why, "worker lost before it finished; removing it from every quorum");
            self.failed_workers.insert(rank, why);
            self.worker_left(rank, out);
        }
    }

    /// The job ends while servers are still to reattach, or soon after the restart while
    /// workers that finished before it may still come for their `WorkerDone`'s answer: the
    /// end waits for them (so that they hear it), at most [`FINISHED_GRACE_US`] for the
    /// workers and [`RECOVER_WAIT_US`] for the servers. Returns true if deferred.
    pub(super) fn defer_finish(&mut self, ok: bool, reason: &str) -> bool {
        if !self.recovering.as_ref().is_some_and(|r| self.end_must_wait(r)) {
            return false;
        }
        let Some(r) = self.recovering.as_mut() else { return false };
        tracing::info!(servers = ?r.servers, finished = ?r.finished, %reason, "the job is over; it ends once the nodes reattached");
        r.finish.get_or_insert((ok, reason.to_string()));
        true
    }

    /// A worker that had finished before the restart said `WorkerDone` again (answered): the
    /// job's end need not wait for it.
    pub(super) fn done_again(&mut self, rank: u32, out: &mut Vec<Action>) {
        if self.recovering.as_mut().is_some_and(|r| r.finished.remove(&rank)) {
            self.end_deferred(out);
        }
    }

    /// The end waits for the servers still to reattach, and, for [`FINISHED_GRACE_US`],
    /// for the workers: those that finished before the restart (for their `WorkerDone`'s
    /// answer) and those still redialling (a recovery that fails: they hear why).
    fn end_must_wait(&self, r: &Recovering) -> bool {
        let in_grace = r.since_us.is_none_or(|since| self.now_us < since.saturating_add(FINISHED_GRACE_US));
        !r.servers.is_empty() || ((!r.finished.is_empty() || !r.workers.is_empty()) && in_grace)
    }

    /// Ends the job whose end was deferred ([`Scheduler::defer_finish`]) once it need not
    /// wait any more.
    fn end_deferred(&mut self, out: &mut Vec<Action>) {
        let Some(r) = self.recovering.as_ref() else { return };
        if r.finish.is_none() || self.end_must_wait(r) {
            return;
        }
        if let Some((ok, reason)) = self.recovering.take().and_then(|r| r.finish) {
            self.finish(ok, reason, out);
        }
    }

    /// True if `report` is a successful move the placement already records (its
    /// `MigrateDone` was made again after a restart, the first one's `Ok` lost with the old
    /// scheduler): answered `Ok` again, so that the old owner hands the block over.
    pub(super) fn move_recorded(&self, report: &elasticps_wire::MigrationReport) -> bool {
        report.error.is_none()
            && self
                .placement
                .as_ref()
                .is_some_and(|p| p.owner(report.block) == Some(report.to) && p.epoch >= report.epoch)
    }

    fn end_recovery_if_complete(&mut self) {
        let now_us = self.now_us;
        let complete = |r: &Recovering| {
            let graced = r.since_us.is_some_and(|since| now_us >= since.saturating_add(FINISHED_GRACE_US));
            r.servers.is_empty() && r.workers.is_empty() && r.finish.is_none() && (r.finished.is_empty() || graced)
        };
        if self.recovering.as_ref().is_some_and(complete) {
            tracing::info!("every server and worker reattached: recovery complete");
            self.recovering = None;
        }
    }

    /// Every server is back: check the placement against what they hold (they win), finish
    /// or keep the migration that was in flight, then serve the layout again.
    /// The split in flight at the restart: if its owner holds a half, it split (its
    /// `SplitDone` was lost with the scheduler): recorded as that `SplitDone` would have.
    /// Otherwise it did not, and the block is still one.
    fn recover_split(&mut self, held: &BTreeMap<ServerId, Vec<HeldBlock>>, out: &mut Vec<Action>) {
        let Some((block, at, owner, epoch)) = self.recovering.as_mut().and_then(|r| r.split.take()) else { return };
        let (Some(partition), Some(placement)) = (self.partition.as_ref(), self.placement.as_ref()) else { return };
        let Ok((_, _, halves)) = elasticps_core::placement::split_row_block(partition, placement, block, at, epoch)
        else {
            return;
        };
        if held.get(&owner).is_some_and(|h| h.iter().any(|b| halves.contains(&b.block))) {
            tracing::info!(
                block,
                at,
                owner,
                epoch,
                "the split in flight at the restart was done by its owner: recorded"
            );
            self.record_split(owner, (block, at, epoch), out);
        } else {
            tracing::warn!(block, at, owner, epoch, "the split in flight at the restart was not done");
        }
    }

    fn reconcile(&mut self, out: &mut Vec<Action>) {
        let held = self.recovering.as_mut().map(|r| std::mem::take(&mut r.held)).unwrap_or_default();
        self.recover_split(&held, out);
        let Some(mut placement) = self.placement.take() else {
            self.recovering = None;
            self.finish(false, "the saved state has no placement".into(), out);
            return;
        };
        // The migration in flight: the new owner holding the block as arrived means the
        // old owner handed it over (its record of the move was lost): record it.
        let mut orders: Vec<Order> = Vec::new();
        let mut settled = None;
        if let Some((block, from, to, epoch)) = self.elastic.in_flight() {
            let arrived =
                held.get(&to).is_some_and(|h| h.iter().any(|b| b.block == block && b.arrived && b.epoch == epoch));
            let served_by_from = held.get(&from).is_some_and(|h| h.iter().any(|b| b.block == block && !b.arrived));
            if arrived {
                tracing::info!(
                    block,
                    from,
                    to,
                    epoch,
                    "the migration in flight at the restart had reached its new owner: recorded"
                );
                orders.extend(self.elastic.recovered_migration(&mut placement, self.now_us));
                settled = Some(block);
            } else if !served_by_from {
                tracing::warn!(block, from, to, epoch, "the migration in flight at the restart is on neither server");
            }
        }
        // Who holds each block, as the servers say: served (or being handed over), or
        // arrived by a migration and waiting for the scheduler's word.
        let mut holders: BTreeMap<BlockId, Vec<(ServerId, u64, bool)>> = BTreeMap::new();
        for (server, blocks) in &held {
            for b in blocks {
                holders.entry(b.block).or_default().push((*server, b.epoch, b.arrived));
            }
        }
        let mut changed = false;
        for block in 0..placement.owners.len() as u32 {
            let recorded = placement.owners[block as usize];
            if recorded == elasticps_core::placement::RETIRED {
                continue; // a row block split in two: its halves are checked as blocks
            }
            let here = holders.get(&block).map_or(&[][..], Vec::as_slice);
            if here.iter().any(|(s, _, _)| *s == recorded) {
                continue; // the placement's owner holds it (an arrived copy is settled below)
            }
            // The servers win: the placement names a server that does not hold the block.
            let Some((owner, epoch, _)) =
                here.iter().filter(|(_, _, arrived)| !arrived).max_by_key(|(_, e, _)| *e).copied()
            else {
                let reason = format!(
                    "after the scheduler's restart no server serves block {block} (the placement says server {recorded})"
                );
                self.placement = Some(placement);
                // The end waits for the workers still to reattach (a grace), so that they
                // hear this reason rather than find no scheduler ([`Scheduler::defer_finish`]).
                self.finish(false, reason, out);
                return;
            };
            tracing::warn!(
                block,
                placement = recorded,
                server = owner,
                epoch,
                "the saved placement disagrees with the servers: the server's view wins"
            );
            placement.owners[block as usize] = owner;
            changed = true;
        }
        if changed {
            placement.epoch = placement.epoch.saturating_add(1);
        }
        // Blocks that arrived by migration and wait for the scheduler's word.
        for (server, blocks) in &held {
            for b in blocks.iter().filter(|b| b.arrived) {
                let under_way = self
                    .elastic
                    .in_flight()
                    .is_some_and(|(blk, _, to, e)| blk == b.block && to == *server && e == b.epoch);
                if under_way || settled == Some(b.block) {
                    continue; // its MigrateDone will settle it, or the recorded move just did
                }
                let owner = placement.owner(b.block).unwrap_or(*server);
                let msg = Control::Settled { block: b.block, epoch: b.epoch, owner }.into();
                out.push(Action::Send { conn: self.servers[*server as usize].0, request_id: 0, msg });
            }
        }
        self.placement = Some(placement);
        self.carry_out(orders, out);
        tracing::info!(
            epoch = self.placement.as_ref().map(|p| p.epoch),
            "every server reattached: the layout is served again"
        );
        self.layout_ready = true;
        self.answer_layout_waiters(out);
        self.end_recovery_if_complete();
        self.end_deferred(out);
    }
}

/// The [`Control::ReattachServer`] a server sends to a restarted scheduler: its id, its
/// data address, and every block it holds (served, or arrived by a migration not settled
/// yet), each with its epoch. `None` before the server registered.
pub fn reattach_message(server: &crate::server::Server, data_addr: &str) -> Option<Control> {
    use crate::server::{Phase, Slot};
    let server_id = server.id()?;
    let credential = server.credential()?.clone();
    let blocks = server
        .owned()
        .into_iter()
        .filter_map(|block| match server.slot(block) {
            Some(Slot::Owned(o)) => {
                Some(HeldBlock { block, epoch: o.epoch, arrived: matches!(o.phase, Phase::Arrived { .. }) })
            }
            _ => None,
        })
        .collect();
    Some(Control::ReattachServer { server_id, credential, data_addr: data_addr.to_string(), blocks })
}

/// What of a scheduler's state is on disk: the one rule of when to save it, which both
/// drivers follow. Before a step's actions are carried out, [`Persisted::due`] gives the
/// state to write if it changed since the last write; the driver writes it and reports
/// the outcome with [`Persisted::written`] (a failed write is reported by not calling it,
/// so the next step tries again).
#[derive(Clone, Copy, Debug)]
pub struct Persisted {
    written: u64,
}

impl Persisted {
    /// `scheduler`'s state as it is now is on disk (just loaded, or just written).
    pub fn of(scheduler: &Scheduler) -> Self {
        Self { written: scheduler.state_version() }
    }

    /// The state to write, with its version, if it changed since the last write.
    pub fn due(&self, scheduler: &Scheduler) -> Option<(u64, SavedState)> {
        let version = scheduler.state_version();
        (version != self.written).then(|| (version, scheduler.saved_state()))
    }

    /// The state of `version` ([`Persisted::due`]) is on disk.
    pub fn written(&mut self, version: u64) {
        self.written = version;
    }
}

#[cfg(test)]
mod tests {
    use elasticps_core::model::{Init, TensorSpec};
    use elasticps_wire::{Message, MigrationReport, ScaleRequest};

    use super::*;
    use crate::scheduler::testkit::{self, recv, sent_to};

    /// The credential a scheduler with the empty secret issues in job 0.
    fn cred(role: PeerRole, id: u32) -> elasticps_wire::Credential {
        elasticps_wire::Credential::issue(b"", 0, role, id)
    }
    use crate::scheduler::Event;

    /// A scheduler that could not recover answers every node's reattach with why (its
    /// session ends with the reason, not after its whole retry window), closes the
    /// connection, and ends the job, failed, once its wait is over.
    #[test]
    fn an_unrecoverable_scheduler_tells_every_node_why_then_ends_the_job() {
        let mut m = Scheduler::unrecoverable(config(), "state.json: not JSON".into(), 10_000_000);
        assert!(m.handle(5, Event::Timeout).is_empty(), "its first event starts the wait");
        assert_eq!(m.poll_timeout(), Some(5 + UNRECOVERABLE_WAIT_US));
        let reattach = Control::ReattachServer {
            server_id: 0,
            credential: cred(PeerRole::Server, 0),
            data_addr: "s0".into(),
            blocks: Vec::new(),
        };
        m.handle(6, Event::Connected { conn: 3, peer: "10.0.0.2".into(), key: elasticps_wire::KeyId::Cluster });
        let a = m.handle(7, Event::Received { conn: 3, request_id: 9, msg: reattach.into() });
        let [Action::Send { conn: 3, request_id: 9, msg: Message::Error(e) }, Action::Close(3)] = &a[..] else {
            panic!("the reattach refused and the connection closed: {a:?}")
        };
        assert_eq!(e.code, ErrorCode::ShuttingDown);
        assert!(e.message.contains("state.json: not JSON"), "{}", e.message);
        assert!(m.handle(4 + UNRECOVERABLE_WAIT_US, Event::Timeout).is_empty(), "not before its wait is over");
        let a = m.handle(5 + UNRECOVERABLE_WAIT_US, Event::Timeout);
        assert!(
            matches!(&a[..], [Action::Finish { ok: false, reason }] if reason.contains("not JSON")),
            "the job ends, failed, saying why: {a:?}"
        );
        assert_eq!(m.poll_timeout(), None);
    }

    /// The shared job with plain bsp on both servers and a learning rate of 1.
    fn config() -> JobConfig {
        let mut c = testkit::config();
        c.server_sync.clear();
        c.shard.optimizer.lr = 1.0;
        c
    }

    /// Workers on connections 1, 2; servers on 10, 11; 4 blocks of 4 values (range: 0, 1
    /// on server 0; 2, 3 on server 1).
    fn running() -> Scheduler {
        let mut m = Scheduler::new(config(), 10_000_000);
        recv(&mut m, 1, 1, Control::RegisterWorker);
        recv(&mut m, 2, 1, Control::RegisterWorker);
        let tensors = vec![TensorSpec { name: "w".into(), shape: vec![16], init: Init::Zeros }];
        recv(&mut m, 1, 2, Control::DefineModel { tensors, optimizers: Vec::new(), tables: Vec::new() });
        recv(&mut m, 10, 1, Control::RegisterServer { data_addr: "s0".into() });
        recv(&mut m, 11, 1, Control::RegisterServer { data_addr: "s1".into() });
        recv(&mut m, 10, 0, Control::AssignDone { server_id: 0 });
        recv(&mut m, 11, 0, Control::AssignDone { server_id: 1 });
        assert_eq!(m.waiting_for(), None);
        m
    }

    fn held(blocks: &[(u32, u64, bool)]) -> Vec<HeldBlock> {
        blocks.iter().map(|&(block, epoch, arrived)| HeldBlock { block, epoch, arrived }).collect()
    }

    /// Server `server_id` reattaches on connection `conn` (request 1) at `addr`, holding
    /// `blocks` (block, epoch, arrived).
    fn reattach_server(
        m: &mut Scheduler,
        conn: ConnId,
        server_id: u32,
        addr: &str,
        blocks: &[(u32, u64, bool)],
    ) -> Vec<Action> {
        recv(
            m,
            conn,
            1,
            Control::ReattachServer {
                server_id,
                credential: cred(PeerRole::Server, server_id),
                data_addr: addr.into(),
                blocks: held(blocks),
            },
        )
    }

    /// The state through JSON, as the runtime writes and reads it.
    fn through_disk(m: &Scheduler) -> SavedState {
        let json = serde_json::to_string(&m.saved_state()).unwrap();
        serde_json::from_str(&json).unwrap()
    }

    #[test]
    fn the_state_version_changes_with_the_state_and_not_with_heartbeats() {
        let mut m = running();
        let v = m.state_version();
        recv(&mut m, 1, 0, Control::Heartbeat);
        m.handle(100, Event::Timeout);
        assert_eq!(m.state_version(), v, "heartbeats and timeouts change nothing to save");
        recv(&mut m, 1, 3, Control::WorkerDone { rank: 0 });
        assert_ne!(m.state_version(), v, "a finished worker is saved");
        let saved = through_disk(&m);
        assert_eq!(saved, m.saved_state());
        assert_eq!(saved.finished_workers, BTreeSet::from([0]));
        assert_eq!(saved.servers, ["s0", "s1"]);
    }

    #[test]
    fn a_recovered_scheduler_serves_the_layout_once_every_server_reattached_and_workers_go_on() {
        let m = running();
        let mut r = Scheduler::recover(config(), through_disk(&m), 10_000_000).unwrap();
        assert!(r.recovering());
        let waits = r.waiting_for().unwrap();
        assert!(waits.contains("servers {0, 1} and workers {0, 1}"), "{waits}");
        // A worker comes back first and asks for the layout: it waits for the servers.
        let a = recv(&mut r, 21, 1, Control::ReattachWorker { rank: 1, credential: cred(PeerRole::Worker, 1) });
        assert!(matches!(sent_to(&a, 21)[..], [Message::Control(Control::Welcome { node_id: 1, .. })]), "{a:?}");
        assert!(recv(&mut r, 21, 2, Control::GetLayout).is_empty(), "no layout before the servers are back");
        let a = reattach_server(&mut r, 30, 0, "s0", &[(0, 0, false), (1, 0, false)]);
        assert!(matches!(sent_to(&a, 30)[..], [Message::Control(Control::Welcome { node_id: 0, .. })]), "{a:?}");
        let a = reattach_server(&mut r, 31, 1, "s1b", &[(2, 0, false), (3, 0, false)]);
        match &sent_to(&a, 21)[..] {
            [Message::Control(Control::Layout(l))] => {
                assert_eq!(l.placement, *m.placement().unwrap(), "the servers agree with the saved placement");
                assert_eq!(l.servers[1].addr, "s1b", "the address the server gave now");
            }
            other => panic!("{other:?}"),
        }
        assert!(!r.recovering());
        // A server that is not of this job, and a rank twice, are refused.
        let a = recv(
            &mut r,
            40,
            1,
            Control::ReattachServer {
                server_id: 7,
                credential: cred(PeerRole::Server, 7),
                data_addr: "x".into(),
                blocks: Vec::new(),
            },
        );
        assert!(a.contains(&Action::Close(40)), "{a:?}");
        let a = recv(&mut r, 41, 1, Control::ReattachWorker { rank: 1, credential: cred(PeerRole::Worker, 1) });
        assert!(matches!(sent_to(&a, 41)[0], Message::Error(e) if e.message.contains("already attached")), "{a:?}");
        // The other worker comes back; the job ends well once both are done.
        recv(&mut r, 22, 1, Control::ReattachWorker { rank: 0, credential: cred(PeerRole::Worker, 0) });
        recv(&mut r, 21, 5, Control::WorkerDone { rank: 1 });
        let a = recv(&mut r, 22, 5, Control::WorkerDone { rank: 0 });
        assert!(a.iter().any(|x| matches!(x, Action::Finish { ok: true, .. })), "{a:?}");
        assert!(sent_to(&a, 30).iter().any(|x| matches!(x, Message::Control(Control::Shutdown { .. }))));
    }

    #[test]
    fn a_set_optimizer_made_again_after_a_restart_waits_for_every_server_to_reattach() {
        use elasticps_core::optimizer::{OptimizerKind, TensorOptimizer};
        let mut r = Scheduler::recover(config(), through_disk(&running()), 10_000_000).unwrap();
        let slower = TensorOptimizer { kind: OptimizerKind::Sgd, lr: 0.01, weight_decay: 0.0 };
        recv(&mut r, 21, 1, Control::ReattachWorker { rank: 1, credential: cred(PeerRole::Worker, 1) });
        // The worker's call in flight at the restart, made again: held, not refused.
        assert!(recv(&mut r, 21, 2, Control::SetOptimizer { tensor: 0, optimizer: slower }).is_empty());
        reattach_server(&mut r, 30, 0, "s0", &[(0, 0, false), (1, 0, false)]);
        let a = reattach_server(&mut r, 31, 1, "s1", &[(2, 0, false), (3, 0, false)]);
        for server in [30, 31] {
            let sent = sent_to(&a, server);
            assert!(sent.contains(&&Control::SetOptimizer { tensor: 0, optimizer: slower }.into()), "{a:?}");
        }
        recv(&mut r, 30, 0, Control::OptimizerSet { tensor: 0 });
        let a = recv(&mut r, 31, 0, Control::OptimizerSet { tensor: 0 });
        assert_eq!(sent_to(&a, 21), [&Message::from(Control::Ok)]);
        assert_eq!(r.partition().unwrap().optimizer(0), Some(&slower));
    }

    #[test]
    fn the_servers_view_wins_and_a_migration_that_reached_its_new_owner_is_recorded() {
        let mut m = running();
        // Block 1 moves from server 0 to server 1 (epoch 2); the scheduler dies before
        // MigrateDone reached it.
        let a = recv(&mut m, 50, 1, Control::Scale(ScaleRequest::MoveBlock { block: 1, to: 1 }));
        assert!(
            a.iter().any(|x| matches!(
                x,
                Action::Send { conn: 10, msg: Message::Control(Control::Migrate { block: 1, epoch: 2, .. }), .. }
            )),
            "{a:?}"
        );
        let mut r = Scheduler::recover(config(), through_disk(&m), 10_000_000).unwrap();
        // Server 1 holds block 1 as arrived at epoch 2; server 0 handed it over. And the
        // servers say block 3 is on server 0 (the saved placement says server 1).
        reattach_server(&mut r, 30, 0, "s0", &[(0, 0, false), (3, 1, false)]);
        let a = reattach_server(&mut r, 31, 1, "s1", &[(1, 2, true), (2, 0, false)]);
        assert!(
            sent_to(&a, 31)
                .iter()
                .any(|x| matches!(x, Message::Control(Control::Settled { block: 1, epoch: 2, owner: 1 }))),
            "the new owner serves the block: {a:?}"
        );
        let p = r.placement().unwrap();
        assert_eq!(p.owners, [0, 1, 1, 0]);
        assert_eq!(p.epoch, 3, "the recorded move (2) and the servers' correction (3)");
        assert_eq!(r.balance_log().migrations.len(), 1);
        // The old owner makes its MigrateDone again on its new connection: the move is
        // recorded, so it is answered Ok (and the old owner hands the block over).
        let report = MigrationReport {
            block: 1,
            from: 0,
            to: 1,
            epoch: 2,
            bytes: 16,
            freeze_us: 1,
            total_us: 2,
            held: 0,
            error: None,
        };
        let a = recv(&mut r, 30, 9, Control::MigrateDone(report.clone()));
        assert!(matches!(sent_to(&a, 30)[0], Message::Control(Control::Ok)), "{a:?}");
        let back = MigrationReport { to: 0, block: 2, ..report };
        let a = recv(&mut r, 31, 9, Control::MigrateDone(back));
        assert!(matches!(sent_to(&a, 31)[0], Message::Error(_)), "a move it never ordered: {a:?}");
    }

    #[test]
    fn past_the_wait_a_missing_worker_is_removed_and_a_missing_server_ends_the_job() {
        let m = running();
        let mut r = Scheduler::recover(config(), through_disk(&m), 2 * RECOVER_WAIT_US).unwrap();
        reattach_server(&mut r, 30, 0, "s0", &[(0, 0, false), (1, 0, false)]);
        reattach_server(&mut r, 31, 1, "s1", &[(2, 0, false), (3, 0, false)]);
        recv(&mut r, 21, 1, Control::ReattachWorker { rank: 0, credential: cred(PeerRole::Worker, 0) });
        assert!(r.handle(1_000, Event::Timeout).is_empty(), "the wait counts from the first timeout");
        assert!(r.handle(RECOVER_WAIT_US, Event::Timeout).is_empty());
        let a = r.handle(RECOVER_WAIT_US + 1_000, Event::Timeout);
        assert!(
            sent_to(&a, 30).iter().any(|x| matches!(x, Message::Control(Control::RemoveWorker { rank: 1 }))),
            "{a:?}"
        );
        assert_eq!(r.waiting_for(), None);

        let mut r = Scheduler::recover(config(), through_disk(&m), 2 * RECOVER_WAIT_US).unwrap();
        reattach_server(&mut r, 30, 0, "s0", &[(0, 0, false), (1, 0, false)]);
        r.handle(0, Event::Timeout);
        let a = r.handle(RECOVER_WAIT_US, Event::Timeout);
        let ended = a.iter().find_map(|x| match x {
            Action::Finish { ok: false, reason } => Some(reason.clone()),
            _ => None,
        });
        assert!(ended.is_some_and(|r| r.contains("servers {1} did not reattach within 60 s")), "{a:?}");
    }

    /// Issue 33: a recovery that fails (no server serves a block) does not end the job
    /// before the workers still redialling came back: a worker that reattaches within the
    /// grace hears the reason (`Shutdown`), instead of finding no scheduler for its whole
    /// retry window and reporting that the scheduler did not come back.
    #[test]
    fn a_failed_recovery_tells_its_reason_to_the_workers_that_reattach_within_the_grace() {
        let m = running();
        let mut r = Scheduler::recover(config(), through_disk(&m), 10_000_000).unwrap();
        r.handle(0, Event::Timeout);
        reattach_server(&mut r, 30, 0, "s0", &[(0, 0, false), (1, 0, false)]);
        // Server 1 lost block 3.
        let a = reattach_server(&mut r, 31, 1, "s1", &[(2, 0, false)]);
        assert!(!a.iter().any(|x| matches!(x, Action::Finish { .. })), "the end waits for the workers: {a:?}");
        let a = recv(&mut r, 21, 1, Control::ReattachWorker { rank: 0, credential: cred(PeerRole::Worker, 0) });
        assert!(matches!(sent_to(&a, 21)[..], [Message::Control(Control::Welcome { .. })]), "{a:?}");
        let a = r.handle(FINISHED_GRACE_US, Event::Timeout);
        let told = |conn| {
            sent_to(&a, conn).iter().any(|x| {
                matches!(x, Message::Control(Control::Shutdown { reason }) if reason.contains("no server serves block 3"))
            })
        };
        assert!(told(21) && told(30), "the worker and the servers hear why: {a:?}");
        assert!(a.iter().any(|x| matches!(x, Action::Finish { ok: false, .. })), "{a:?}");
    }

    #[test]
    fn a_state_of_another_job_or_from_before_training_is_refused() {
        let m = running();
        let other = JobConfig { workers: 3, ..config() };
        let e = Scheduler::recover(other, through_disk(&m), 1).unwrap_err();
        assert!(e.contains("2 servers and 2 workers"), "{e}");
        let fresh = Scheduler::new(config(), 1);
        let e = Scheduler::recover(config(), fresh.saved_state(), 1).unwrap_err();
        assert!(e.contains("before training started"), "{e}");
    }
}
