//! One round's plan: phases per server, the requests of each, the moved blocks waiting
//! for a layout refresh, the window and deadlines of its requests ([`Window`]), and what
//! each server cost.

use std::collections::BTreeMap;

use elasticps_core::CoreError;
use elasticps_core::model::BlockSpec;
use elasticps_core::placement::RETIRED;
use elasticps_core::sync::Clock;
use elasticps_wire::{Control, ErrorReply, Kind, Layout, Message};

use super::window::Window;
use super::{Action, Iteration, MAX_LAYOUT_REFRESHES, MOVED_BACKOFF_US, Op, PushOp, RoundEvent, RowsOp, Tag};
use crate::{NodeError, Result};

/// What a server answered a request of the round, as the plan needs it.
#[derive(Clone, Copy, Debug)]
pub enum Answer<'a> {
    /// The server refused the request.
    Error(&'a ErrorReply),
    /// The server no longer owns the block: `owner` does, as of placement `epoch`.
    Moved {
        /// The owner as far as the answering server knows.
        owner: u32,
        /// The placement epoch of that knowledge.
        epoch: u64,
    },
    /// A push acknowledged.
    Acked,
    /// A pull (or push_pull) answered with this many values.
    Pulled {
        /// Values in the reply.
        len: usize,
    },
    /// A row pull answered with this many values (the runtime checks them against the
    /// rows it asked for).
    RowsPulled {
        /// Values in the reply.
        len: usize,
    },
    /// Anything else: a protocol error.
    Other(Kind),
}

impl<'a> Answer<'a> {
    /// The answer a decoded reply gives.
    pub fn of(msg: &'a Message) -> Self {
        match msg {
            Message::Error(reply) => Answer::Error(reply),
            Message::Control(Control::Moved { owner, epoch, .. }) => Answer::Moved { owner: *owner, epoch: *epoch },
            Message::PushAck { .. } => Answer::Acked,
            Message::PullReply { values, .. } => Answer::Pulled { len: values.len() },
            Message::PullRowsReply { values, .. } => Answer::RowsPulled { len: values.len() },
            other => Answer::Other(other.kind()),
        }
    }

    fn describe(&self) -> String {
        match self {
            Answer::Error(_) => "Error".into(),
            Answer::Moved { .. } => "Moved".into(),
            Answer::Acked => "PushAck".into(),
            Answer::Pulled { len } => format!("PullReply of {len} values"),
            Answer::RowsPulled { len } => format!("PullRowsReply of {len} values"),
            Answer::Other(kind) => format!("{kind:?}"),
        }
    }
}

/// A block still to do: push it (if the round pushes), pull it (if it pulls).
#[derive(Clone, Copy, Debug)]
struct Todo {
    block: BlockSpec,
    push: bool,
    pull: bool,
}

/// Where one request stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    /// Planned, waiting for room in its server's window: not sent yet.
    Queued,
    /// Sent, no reply yet.
    Waiting,
    /// A push_pull whose server acknowledged its push on its own (`PushAck`) and holds its
    /// pull: it waits for its `PullReply` (its deadline stays) but no longer counts in its
    /// server's window.
    Held,
    /// Not sent: a block only pulled, in a push phase; pulled once the phase ends.
    Carried,
    /// Push acknowledged.
    Acked,
    /// Pull answered.
    Pulled,
    /// A push_pull answered: the push applied, the pull answered.
    Fused,
    /// The server no longer owns the block (resent after a layout refresh).
    Moved,
    /// The server no longer owns the block and named its owner, a server of the layout,
    /// at a newer epoch than the round knew the block's: resent there at once.
    Redirected,
    /// The server's connection closed before it answered: resent, like a moved block,
    /// to the owner a refreshed layout names (a resent push is a duplicate if it was
    /// applied, and the clock state drops it).
    Lost,
}

#[derive(Clone, Copy, Debug)]
struct Request {
    todo: Todo,
    phase: u32,
    outcome: Outcome,
    /// Its push was acknowledged on its own (a held push_pull): a resend only pulls.
    pushed: bool,
}

/// One server's pushes (or, if none, pulls) in flight at once: requests
/// `first..first + len` of the round.
#[derive(Clone, Copy, Debug)]
struct Phase {
    owner: u32,
    push: bool,
    first: u32,
    len: u32,
    pending: u32,
    started_us: u64,
}

/// Where the chase of moved blocks stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Chase {
    /// Nothing asked of the scheduler.
    Idle,
    /// [`Action::RefreshLayout`] given, waiting for [`RoundEvent::Layout`].
    Refreshing,
    /// The layout had the epoch the round had: the resend waits until `until_us`
    /// ([`Round::poll_timeout`], then [`RoundEvent::Timeout`]).
    Waiting { until_us: u64 },
}

/// The plan of one round (see [the module](super)); made by
/// [`Worker::start`](super::Worker::start).
#[derive(Debug)]
pub struct Round {
    seq: u32,
    rank: u32,
    timeout_us: u64,
    /// A block pushed and pulled goes as one push_pull (fusion on, and the pull is of the
    /// clock after the push's).
    fuse: bool,
    /// A row round: its pushes are `PushRows`, its pulls `PullRows` ([`RowsOp`]).
    rows: bool,
    push: Option<PushOp>,
    pull: Option<Clock>,
    started_us: u64,
    iteration: Option<Iteration>,
    /// The current layout's owner of each block (with the hints applied), its epoch, and
    /// the servers it lists (ids).
    owners: Vec<u32>,
    epoch: u64,
    servers: usize,
    server_ids: Vec<u32>,
    /// Owners that `Moved` answers named at a newer epoch than the layout's: block ->
    /// (owner, epoch). They outlive the round ([`super::Worker`] keeps them) until a layout
    /// of that epoch or later comes.
    pub(super) hints: BTreeMap<u32, (u32, u64)>,
    /// Requests resent at once to the owner a `Moved` named, this round.
    redirects: u32,
    requests: Vec<Request>,
    phases: Vec<Phase>,
    open_phases: u32,
    /// Requests planned and not answered (sent, or queued in the window).
    pending: usize,
    /// The requests in flight per server, those waiting for room, and their deadlines.
    window: Window,
    chase: Chase,
    /// Moved blocks to resend after the refresh under way.
    moved: Vec<Todo>,
    /// Blocks answered `Moved` while a refresh was under way: they wait for the next one
    /// (the one under way may predate their move).
    moved_next: Vec<Todo>,
    /// The requests of one lost connection are being settled, and the refresh of the
    /// first is for them all: they join `moved`.
    joining: bool,
    refreshes: u32,
    /// Servers whose connection closed with requests of this round in flight.
    lost: Vec<u32>,
    /// Scratch for grouping blocks by owner.
    grouped: Vec<(u32, Todo)>,
    scratch: Vec<Todo>,
    /// Per server id: from the round's start to the end of its last phase.
    waits: Vec<Option<u64>>,
    /// Per server id: bytes pushed and acknowledged, and push phase time (for a phase
    /// with push_pulls, until their pulls were answered).
    push_load: Vec<(u64, u64)>,
}

impl Default for Round {
    fn default() -> Self {
        Self {
            seq: 0,
            rank: 0,
            timeout_us: 0,
            fuse: false,
            rows: false,
            push: None,
            pull: None,
            started_us: 0,
            iteration: None,
            owners: Vec::new(),
            epoch: 0,
            servers: 0,
            server_ids: Vec::new(),
            hints: BTreeMap::new(),
            redirects: 0,
            requests: Vec::new(),
            phases: Vec::new(),
            open_phases: 0,
            pending: 0,
            window: Window::default(),
            chase: Chase::Idle,
            moved: Vec::new(),
            moved_next: Vec::new(),
            joining: false,
            refreshes: 0,
            lost: Vec::new(),
            grouped: Vec::new(),
            scratch: Vec::new(),
            waits: Vec::new(),
            push_load: Vec::new(),
        }
    }
}

impl Round {
    /// Resets this (possibly recycled) round for a new one and plans its first phases.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn begin(
        &mut self,
        seq: u32,
        rank: u32,
        timeout_us: u64,
        window: usize,
        fuse: bool,
        now_us: u64,
        layout: &Layout,
        push: Option<(PushOp, &[bool])>,
        pull: Option<(Clock, &[bool])>,
        iteration: Option<Iteration>,
    ) -> Result<Vec<Action>> {
        self.reset(seq, rank, timeout_us, window, now_us, layout, iteration);
        self.rows = false;
        self.push = push.map(|(op, _)| op);
        self.pull = pull.map(|(clock, _)| clock);
        self.fuse = fuse
            && matches!((self.push, self.pull), (Some(PushOp::Grad(t)), Some(next)) if t.checked_add(1) == Some(next));
        let has = |mask: Option<&[bool]>, t: u32| mask.is_some_and(|m| m.get(t as usize).copied().unwrap_or(false));
        let (push_mask, pull_mask) = (push.map(|(_, m)| m), pull.map(|(_, m)| m));
        let mut todo = std::mem::take(&mut self.scratch);
        todo.clear();
        // A row block's `tensor` is its table's index: a tensor round leaves them out.
        todo.extend(
            layout
                .partition
                .blocks
                .iter()
                .filter(|b| !b.is_rows())
                .map(|b| Todo { block: *b, push: has(push_mask, b.tensor), pull: has(pull_mask, b.tensor) })
                .filter(|t| t.push || t.pull),
        );
        self.first_phases(now_us, todo)
    }

    /// Resets this (possibly recycled) round for a row round of one table and plans its
    /// phases (see [`super::Worker::start_rows`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn begin_rows(
        &mut self,
        seq: u32,
        rank: u32,
        timeout_us: u64,
        window: usize,
        now_us: u64,
        layout: &Layout,
        (table, op): (u32, RowsOp),
        wanted: &dyn Fn(&BlockSpec) -> bool,
    ) -> Result<Vec<Action>> {
        self.reset(seq, rank, timeout_us, window, now_us, layout, None);
        self.rows = true;
        self.fuse = false;
        let (push, pull) = match op {
            RowsOp::Push(clock) => (Some(PushOp::Grad(clock)), None),
            RowsOp::Pull(clock) => (None, Some(clock)),
        };
        self.push = push;
        self.pull = pull;
        let mut todo = std::mem::take(&mut self.scratch);
        todo.clear();
        todo.extend(
            layout
                .partition
                .blocks
                .iter()
                .filter(|b| b.is_rows() && !b.is_retired() && b.tensor == table)
                .map(|b| Todo { block: *b, push: push.is_some(), pull: pull.is_some() && wanted(b) })
                .filter(|t| t.push || t.pull),
        );
        self.first_phases(now_us, todo)
    }

    /// Plans the first phases of `todo` (given back as scratch afterwards).
    fn first_phases(&mut self, now_us: u64, mut todo: Vec<Todo>) -> Result<Vec<Action>> {
        let mut out = Vec::new();
        let planned = self.plan(now_us, &mut todo, &mut out);
        self.scratch = todo;
        planned?;
        self.prune();
        Ok(out)
    }

    /// Forgets the last round's requests, phases and chase; takes `layout`'s owners.
    #[allow(clippy::too_many_arguments)]
    fn reset(
        &mut self,
        seq: u32,
        rank: u32,
        timeout_us: u64,
        window: usize,
        now_us: u64,
        layout: &Layout,
        iteration: Option<Iteration>,
    ) {
        self.seq = seq;
        self.rank = rank;
        self.timeout_us = timeout_us;
        self.started_us = now_us;
        self.iteration = iteration;
        self.set_layout(layout);
        self.requests.clear();
        self.phases.clear();
        self.open_phases = 0;
        self.pending = 0;
        self.window.reset(window, timeout_us);
        self.chase = Chase::Idle;
        self.moved.clear();
        self.moved_next.clear();
        self.joining = false;
        self.refreshes = 0;
        self.redirects = 0;
        self.lost.clear();
        self.waits.clear();
        self.push_load.clear();
    }

    /// Hands the round what happened at `now_us` (see [`RoundEvent`]) and returns what the
    /// runtime must do next. An error fails the round with what a user sees: a refusal,
    /// a protocol error, blocks that keep moving, a request unanswered past its deadline.
    pub fn handle(&mut self, now_us: u64, event: RoundEvent<'_>) -> Result<Vec<Action>> {
        let out = match event {
            RoundEvent::Reply { tag, msg } => self.on_answer(now_us, tag, Answer::of(msg)),
            RoundEvent::Answer { tag, answer } => self.on_answer(now_us, tag, answer),
            RoundEvent::Lost { tag } => self.on_lost(now_us, tag),
            RoundEvent::ServerLost { server } => self.on_server_lost(now_us, server),
            RoundEvent::Layout(layout) => self.on_layout(now_us, layout),
            RoundEvent::Timeout => self.on_timeout(now_us),
        };
        self.prune();
        out
    }

    /// When the round must be woken with [`RoundEvent::Timeout`] (absolute µs, the clock
    /// of `now_us`): the earlier of the oldest unanswered request's deadline (its send
    /// time plus the request timeout) and the end of a wait before resending moved
    /// blocks. `None`: nothing to wake for (every request answered, or the round waits
    /// for a layout).
    pub fn poll_timeout(&self) -> Option<u64> {
        let deadline = self.window.oldest().map(|(at, _)| at);
        let wake = match self.chase {
            Chase::Waiting { until_us } => Some(until_us),
            _ => None,
        };
        match (deadline, wake) {
            (Some(d), Some(w)) => Some(d.min(w)),
            (d, w) => d.or(w),
        }
    }

    /// Keeps the window's oldest deadline one of a request still waiting for its answer.
    fn prune(&mut self) {
        let requests = &self.requests;
        self.window
            .prune(|i| requests.get(i as usize).is_some_and(|r| matches!(r.outcome, Outcome::Waiting | Outcome::Held)));
    }

    /// The iteration this round counted (a round pushing a new clock), for metrics.
    pub fn iteration(&self) -> Option<Iteration> {
        self.iteration
    }

    /// True once every request is answered and no moved block is left to resend.
    pub fn is_done(&self) -> bool {
        self.open_phases == 0 && self.chase == Chase::Idle && self.moved.is_empty() && self.moved_next.is_empty()
    }

    /// Requests sent and not answered yet.
    pub fn in_flight(&self) -> usize {
        self.window.in_flight()
    }

    /// Requests sent to `server` and not answered yet (at most the window).
    pub fn in_flight_to(&self, server: u32) -> usize {
        self.window.in_flight_to(server)
    }

    /// Requests planned but held back until their server's window has room.
    pub fn queued(&self) -> usize {
        self.window.queued()
    }

    /// When the round started.
    pub fn started_us(&self) -> u64 {
        self.started_us
    }

    /// Layout refreshes this round asked for so far.
    pub fn refreshes(&self) -> u32 {
        self.refreshes
    }

    /// Requests this round resent at once to the owner a `Moved` named (no refresh).
    pub fn redirects(&self) -> u32 {
        self.redirects
    }

    /// The servers this round waited for, in id order, with how long: from the round's
    /// start until the end of that server's last phase (its last reply).
    pub fn waited(&self) -> impl Iterator<Item = (u32, u64)> + '_ {
        self.waits.iter().enumerate().filter_map(|(s, w)| w.map(|w| (s as u32, w)))
    }

    /// The wait per server id (0 for a server not waited for), covering every server of
    /// the current layout.
    pub fn waits_per_server_us(&self) -> Vec<u64> {
        let n = self.waits.len().max(self.servers);
        (0..n).map(|s| self.waits.get(s).copied().flatten().unwrap_or(0)).collect()
    }

    /// Per server that acknowledged pushes, in id order: (server, payload bytes pushed,
    /// summed time of its push phases from the first push sent to the last
    /// acknowledgement), the balancer's service time measurement.
    ///
    /// A push phase with push_pulls ends with their `PullReply`s, so its time also holds
    /// the replies' transfer and any time the sync policy held the pulls: with fusion the
    /// measured rate (bytes pushed over that time) is a lower bound of the server's push
    /// rate, equal to it when no pull was held and the replies are small against the
    /// pushes' queue. The bytes are the pushes' only, as without fusion.
    pub fn push_load(&self) -> impl Iterator<Item = (u32, u64, u64)> + '_ {
        self.push_load.iter().enumerate().filter(|(_, (b, _))| *b > 0).map(|(s, (b, us))| (s as u32, *b, *us))
    }

    /// The answer to request `tag`. A `PushAck` or `Moved` for a push or init, a
    /// `PullReply` as long as the block or `Moved` for a pull or a push_pull (its
    /// `PullReply` acknowledges the push too); anything else fails the round
    /// with the error a user sees (an `Error` frame as [`NodeError::Remote`], another
    /// message as [`NodeError::Protocol`]). Accepted `PullReply` values are the runtime's
    /// to copy into the pulled tensor. The answer frees room in its server's window.
    fn on_answer(&mut self, now_us: u64, tag: Tag, answer: Answer<'_>) -> Result<Vec<Action>> {
        let Some(index) = self.waiting(tag) else {
            return Err(NodeError::Refused(format!("reply to no request of this round (tag {tag:#x})")));
        };
        let request = self.requests[index];
        let phase = self.phases[request.phase as usize];
        let b = request.todo.block;
        let op = self.op(phase.push, &request.todo);
        let outcome = match (answer, op.is_pull()) {
            (Answer::Error(reply), _) => {
                let (verb, clock) = op.verb_clock();
                return Err(NodeError::Remote {
                    peer: format!(
                        "server {} (answering {verb}(clock {clock}) of block {} from worker {})",
                        phase.owner, b.id, self.rank
                    ),
                    reply: reply.clone(),
                });
            }
            (Answer::Moved { owner, epoch }, _) => {
                if self.follow(b.id, phase.owner, owner, epoch) {
                    Outcome::Redirected
                } else {
                    Outcome::Moved
                }
            }
            (Answer::Acked, false) => Outcome::Acked,
            // The push of a push_pull acknowledged on its own: its pull is held.
            (Answer::Acked, true) if matches!(op, Op::PushPull(_)) && request.outcome == Outcome::Waiting => {
                return Ok(self.hold(now_us, index));
            }
            // A row reply's length is the rows asked for: the runtime checks it.
            (Answer::RowsPulled { .. }, true) if self.rows => Outcome::Pulled,
            (Answer::Pulled { len }, true) if len == b.len && !self.rows => {
                if matches!(op, Op::PushPull(_)) {
                    Outcome::Fused
                } else {
                    Outcome::Pulled
                }
            }
            (other, pull) => {
                let wanted = match (pull, self.rows) {
                    (true, true) => "PullRowsReply".to_string(),
                    (true, false) => format!("PullReply of {} values", b.len),
                    (false, _) => "PushAck".to_string(),
                };
                return Err(NodeError::Protocol {
                    peer: format!("server {}", phase.owner),
                    what: format!("expected {wanted}, got {}", other.describe()),
                });
            }
        };
        self.settle(now_us, index, outcome)
    }

    /// A push_pull's server acknowledged its push and holds its pull: the request leaves
    /// its server's window (the next one queued there goes out) and waits for its
    /// `PullReply` (see [`super::window`]).
    fn hold(&mut self, now_us: u64, index: usize) -> Vec<Action> {
        let r = &mut self.requests[index];
        r.outcome = Outcome::Held;
        r.pushed = true;
        let owner = self.phases[r.phase as usize].owner;
        match self.window.release(now_us, owner, false) {
            Some(next) => vec![self.send(next as usize)],
            None => Vec::new(),
        }
    }

    /// True if request `tag` is a push_pull whose push was acknowledged on its own and
    /// whose pull the server holds (its `PullReply` still to come).
    pub fn is_held(&self, tag: Tag) -> bool {
        self.waiting(tag).is_some_and(|i| self.requests[i].outcome == Outcome::Held)
    }

    /// What request `tag` of this round asks, while it waits for its reply.
    pub fn op_of(&self, tag: Tag) -> Option<Op> {
        let r = &self.requests[self.waiting(tag)?];
        Some(self.op(self.phases[r.phase as usize].push, &r.todo))
    }

    /// The connection to the server of request `tag` closed before it answered (a
    /// drained server that left, a crash, a refused connect): the request is resent to
    /// the owner a refreshed layout names. A tag no longer waiting (answered, or of an
    /// older round) changes nothing. If the layout keeps naming that server, the round
    /// fails once the refreshes run out, naming the server.
    fn on_lost(&mut self, now_us: u64, tag: Tag) -> Result<Vec<Action>> {
        let Some(index) = self.waiting(tag) else { return Ok(Vec::new()) };
        self.lose(now_us, index)
    }

    /// Request `index` (sent or queued) is lost with its server's connection.
    fn lose(&mut self, now_us: u64, index: usize) -> Result<Vec<Action>> {
        let r = self.requests[index];
        let server = self.phases[r.phase as usize].owner;
        if !self.lost.contains(&server) {
            self.lost.push(server);
        }
        tracing::debug!(server, block = r.todo.block.id, "server connection lost; resending after a refresh");
        self.settle(now_us, index, Outcome::Lost)
    }

    /// The connection to `server` closed (or could not be opened): every request in
    /// flight there and every one queued for room in its window is lost, once each, and
    /// resent to the owner a refreshed layout names.
    fn on_server_lost(&mut self, now_us: u64, server: u32) -> Result<Vec<Action>> {
        let queued = self.window.drop_server(server);
        let mut lost: Vec<usize> = self
            .requests
            .iter()
            .enumerate()
            .filter(|(_, r)| {
                matches!(r.outcome, Outcome::Waiting | Outcome::Held) && self.phases[r.phase as usize].owner == server
            })
            .map(|(i, _)| i)
            .collect();
        // The window forgot them: settling them frees no room (a request planned while
        // they settle, to this server again, counts in flight).
        for &index in &lost {
            self.requests[index].outcome = Outcome::Queued;
        }
        lost.extend(queued.into_iter().map(|i| i as usize));
        let mut out = Vec::new();
        // One refresh for all of them, unless one is already under way (it may predate
        // the loss: they wait for the next, as moved blocks do).
        self.joining = self.chase == Chase::Idle;
        let mut result = Ok(());
        for index in lost {
            // Each settles once: a request answered meanwhile is no longer queued or waiting.
            if matches!(self.requests[index].outcome, Outcome::Waiting | Outcome::Held | Outcome::Queued) {
                match self.lose(now_us, index) {
                    Ok(more) => out.extend(more),
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
            }
        }
        self.joining = false;
        result.map(|()| out)
    }

    /// [`RoundEvent::Timeout`]: a request unanswered at its deadline fails the round,
    /// naming what waited for what; the end of a wait resends the moved blocks. Early,
    /// it changes nothing.
    fn on_timeout(&mut self, now_us: u64) -> Result<Vec<Action>> {
        if let Some((at, index)) = self.window.oldest()
            && now_us >= at
        {
            let r = self.requests[index as usize];
            let server = self.phases[r.phase as usize].owner;
            let (verb, clock) = self.op(self.phases[r.phase as usize].push, &r.todo).verb_clock();
            return Err(NodeError::Timeout {
                what: format!(
                    "worker {} waits for server {server} to answer {verb}(clock {clock}) of block {}",
                    self.rank, r.todo.block.id
                ),
                after_us: self.window.timeout_us(),
            });
        }
        let mut out = Vec::new();
        if let Chase::Waiting { until_us } = self.chase
            && now_us >= until_us
        {
            self.resend(now_us, &mut out)?;
        }
        Ok(out)
    }

    /// The tags of this round's requests that `server` has not answered yet (for a
    /// runtime that learns of a lost connection, not of a lost request).
    pub fn waiting_on(&self, server: u32) -> impl Iterator<Item = Tag> + '_ {
        let seq = u64::from(self.seq) << 32;
        self.requests
            .iter()
            .enumerate()
            .filter(move |(_, r)| {
                matches!(r.outcome, Outcome::Waiting | Outcome::Held) && self.phases[r.phase as usize].owner == server
            })
            .map(move |(i, _)| seq | i as u64)
    }

    /// The index of request `tag` if it is of this round and still waiting for its reply.
    fn waiting(&self, tag: Tag) -> Option<usize> {
        let index = (tag & u64::from(u32::MAX)) as usize;
        let r = self.requests.get(index)?;
        (tag >> 32 == u64::from(self.seq) && matches!(r.outcome, Outcome::Waiting | Outcome::Held)).then_some(index)
    }

    /// Request `index` (sent or queued) came out as `outcome`; ends its phase if it was
    /// the last. A sent one frees room in its server's window: the next request queued
    /// there goes out first.
    ///
    /// A moved or lost request is chased at once, not when its phase ends: a fused phase's
    /// other requests may be pulls the sync policy holds until other workers push, and
    /// those workers may wait for this very resend (a deadlock across workers).
    fn settle(&mut self, now_us: u64, index: usize, outcome: Outcome) -> Result<Vec<Action>> {
        let Request { todo, phase, outcome: was, pushed } = self.requests[index];
        self.requests[index].outcome = outcome;
        self.pending -= 1;
        let p = &mut self.phases[phase as usize];
        p.pending -= 1;
        let (owner, phase_over, sent_push) = (p.owner, p.pending == 0, p.push);
        // A resend pushes only what was not acknowledged yet.
        let push_phase = sent_push && !pushed;
        let pulls = !self.op(sent_push, &todo).carries_values();
        let mut out = Vec::new();
        match was {
            Outcome::Waiting => {
                if let Some(next) = self.window.release(now_us, owner, pulls) {
                    out.push(self.send(next as usize));
                }
            }
            Outcome::Queued => {
                self.window.unqueue(owner, pulls, index as u32);
            }
            // A held pull left the window when it was held.
            _ => {}
        }
        if outcome == Outcome::Redirected {
            // The new owner is known: no layout refresh, no wait.
            let todo = if push_phase { todo } else { Todo { push: false, ..todo } };
            tracing::debug!(
                block = todo.block.id,
                owner = self.owners[todo.block.id as usize],
                "block moved; resent to its new owner"
            );
            self.plan(now_us, &mut vec![todo], &mut out)?;
        }
        if matches!(outcome, Outcome::Moved | Outcome::Lost) {
            let todo = if push_phase { todo } else { Todo { push: false, ..todo } };
            if self.chase == Chase::Idle {
                self.moved.push(todo);
                self.refresh(now_us, &mut out)?;
            } else if self.joining && self.chase == Chase::Refreshing {
                self.moved.push(todo);
            } else {
                self.moved_next.push(todo);
            }
        }
        if phase_over {
            self.phase_done(now_us, phase, &mut out)?;
        }
        Ok(out)
    }

    /// The layout the scheduler sent after [`Action::RefreshLayout`]: resends the moved
    /// blocks to their owners in it, or, if its epoch is the one the round had, waits
    /// first (until [`Round::poll_timeout`]). A layout given while no refresh is under way
    /// only replaces the owners.
    fn on_layout(&mut self, now_us: u64, layout: &Layout) -> Result<Vec<Action>> {
        let epoch = self.epoch;
        self.set_layout(layout);
        let mut out = Vec::new();
        if self.chase != Chase::Refreshing {
            return Ok(out);
        }
        if layout.placement.epoch == epoch {
            // A server answered Moved before the scheduler published the move: give the
            // scheduler a moment.
            let until_us = now_us + MOVED_BACKOFF_US * u64::from(self.refreshes.min(20));
            self.chase = Chase::Waiting { until_us };
        } else {
            self.resend(now_us, &mut out)?;
        }
        Ok(out)
    }

    /// Request `index` goes out (its window admitted it): its [`Action::Send`].
    fn send(&mut self, index: usize) -> Action {
        let r = &mut self.requests[index];
        r.outcome = Outcome::Waiting;
        let (todo, phase) = (r.todo, self.phases[r.phase as usize]);
        let op = self.op(phase.push, &todo);
        Action::Send { tag: (u64::from(self.seq) << 32) | index as u64, server: phase.owner, block: todo.block, op }
    }

    fn set_layout(&mut self, layout: &Layout) {
        self.owners.clone_from(&layout.placement.owners);
        self.epoch = layout.placement.epoch;
        self.servers = layout.servers.len();
        self.server_ids.clear();
        self.server_ids.extend(layout.servers.iter().map(|s| s.id));
        // The layout knows the moves of its epoch and before: those hints are done.
        let epoch = self.epoch;
        self.hints.retain(|_, (_, e)| *e > epoch);
        for (block, (owner, _)) in &self.hints {
            if let Some(o) = self.owners.get_mut(*block as usize) {
                *o = *owner;
            }
        }
    }

    /// A `Moved` from `from` for `block` named `owner` at placement `epoch`: if that is
    /// newer than what the round knows of the block (the layout's epoch, or a hint's) and
    /// the layout lists `owner`, the block's owner becomes `owner` (a hint) and the request
    /// goes there at once, without a layout refresh. Each follow needs a strictly newer
    /// epoch, and a round follows at most [`MAX_LAYOUT_REFRESHES`] times: what servers
    /// answer cannot make it chase forever.
    fn follow(&mut self, block: u32, from: u32, owner: u32, epoch: u64) -> bool {
        let known = self.hints.get(&block).map_or(self.epoch, |(_, e)| (*e).max(self.epoch));
        let ok = epoch > known
            && owner != from
            && self.server_ids.contains(&owner)
            && (block as usize) < self.owners.len()
            && self.redirects < MAX_LAYOUT_REFRESHES;
        if ok {
            self.redirects += 1;
            self.hints.insert(block, (owner, epoch));
            self.owners[block as usize] = owner;
        }
        ok
    }

    /// What request `t` sends in a push phase (`push_phase`) or a pull phase.
    fn op(&self, push_phase: bool, t: &Todo) -> Op {
        if self.rows {
            return match (push_phase, self.push, self.pull) {
                (true, Some(PushOp::Grad(clock)), _) => Op::PushRows(clock),
                (_, _, Some(clock)) => Op::PullRows(clock),
                _ => Op::PullRows(0),
            };
        }
        match (push_phase, self.push, self.pull) {
            (true, Some(PushOp::Grad(clock)), _) if self.fuse && t.push && t.pull => Op::PushPull(clock),
            (true, Some(op), _) => op.into(),
            (_, _, Some(clock)) => Op::Pull(clock),
            // A pull phase exists only in a round that pulls.
            _ => Op::Pull(0),
        }
    }

    /// Groups `todo` (emptied) by the current owner and opens one phase per owner, in
    /// owner order, blocks in the order given.
    fn plan(&mut self, now_us: u64, todo: &mut Vec<Todo>, out: &mut Vec<Action>) -> Result<()> {
        let mut grouped = std::mem::take(&mut self.grouped);
        grouped.clear();
        let mut result = Ok(());
        for t in todo.drain(..) {
            match self.owners.get(t.block.id as usize) {
                Some(&RETIRED) => {
                    result = Err(NodeError::Recut { block: t.block.id });
                    break;
                }
                Some(owner) => grouped.push((*owner, t)),
                None => {
                    result = Err(CoreError::UnknownBlock(t.block.id).into());
                    break;
                }
            }
        }
        if result.is_ok() {
            grouped.sort_by_key(|(owner, _)| *owner);
            let mut i = 0;
            while i < grouped.len() {
                let owner = grouped[i].0;
                let end = i + grouped[i..].iter().take_while(|(o, _)| *o == owner).count();
                if let Err(e) = self.open_phase(now_us, owner, &grouped[i..end], out) {
                    result = Err(e);
                    break;
                }
                i = end;
            }
        }
        grouped.clear();
        self.grouped = grouped;
        result
    }

    /// One phase with `owner`: the pushes of `items` that have one (fused with their pulls
    /// if the round fuses), all in flight at once (the others, to pull, wait for the
    /// phase's end), or, if none has, their pulls.
    fn open_phase(&mut self, now_us: u64, owner: u32, items: &[(u32, Todo)], out: &mut Vec<Action>) -> Result<()> {
        let push = self.push.is_some() && items.iter().any(|(_, t)| t.push);
        let phase = self.phases.len() as u32;
        let first = self.requests.len() as u32;
        let mut pending = 0;
        for (_, t) in items {
            let send = if push { t.push } else { t.pull && self.pull.is_some() };
            let carry = push && !t.push && t.pull;
            if !send && !carry {
                continue;
            }
            let index = self.requests.len() as u64;
            if index > u64::from(u32::MAX) {
                return Err(NodeError::Refused("a round of more than 2^32 requests".into()));
            }
            let outcome = if send { Outcome::Queued } else { Outcome::Carried };
            self.requests.push(Request { todo: *t, phase, outcome, pushed: false });
            if send {
                pending += 1;
                self.pending += 1;
            }
        }
        let len = self.requests.len() as u32 - first;
        self.phases.push(Phase { owner, push, first, len, pending, started_us: now_us });
        // Each request goes out now if its server's window has room, or waits in its queue.
        for index in first..first + len {
            let pulls = !self.op(push, &self.requests[index as usize].todo).carries_values();
            if self.requests[index as usize].outcome == Outcome::Queued
                && self.window.admit(now_us, owner, pulls, index)
            {
                out.push(self.send(index as usize));
            }
        }
        self.open_phases += 1;
        if pending == 0 {
            self.phase_done(now_us, phase, out)?;
        }
        Ok(())
    }

    /// A phase got its last reply: record the wait and push cost, and pull what was
    /// pushed (or carried).
    fn phase_done(&mut self, now_us: u64, phase: u32, out: &mut Vec<Action>) -> Result<()> {
        self.open_phases -= 1;
        let p = self.phases[phase as usize];
        let owner = p.owner as usize;
        if self.waits.len() <= owner {
            self.waits.resize(owner + 1, None);
        }
        self.waits[owner] = Some(now_us.saturating_sub(self.started_us));
        let mut to_pull = std::mem::take(&mut self.scratch);
        to_pull.clear();
        let mut push_bytes = 0;
        for r in &self.requests[p.first as usize..(p.first + p.len) as usize] {
            let b = r.todo.block;
            match r.outcome {
                // A row block's `len` is its whole range, not the rows a push carried:
                // row pushes are left out of the push rate (the servers count their rows).
                Outcome::Acked => {
                    if !self.rows {
                        push_bytes += b.len as u64 * 4;
                    }
                    if r.todo.pull {
                        to_pull.push(Todo { block: b, push: false, pull: true });
                    }
                }
                Outcome::Fused => push_bytes += b.len as u64 * 4,
                Outcome::Carried => to_pull.push(Todo { block: b, push: false, pull: true }),
                // Chased when they were answered (`settle`).
                Outcome::Moved
                | Outcome::Redirected
                | Outcome::Lost
                | Outcome::Pulled
                | Outcome::Waiting
                | Outcome::Held
                | Outcome::Queued => {}
            }
        }
        if push_bytes > 0 {
            if self.push_load.len() <= owner {
                self.push_load.resize(owner + 1, (0, 0));
            }
            let l = &mut self.push_load[owner];
            l.0 += push_bytes;
            l.1 += now_us.saturating_sub(p.started_us);
        }
        let planned = self.plan(now_us, &mut to_pull, out);
        self.scratch = to_pull;
        planned
    }

    /// Asks for a layout refresh, unless the round already chased too long.
    fn refresh(&mut self, now_us: u64, out: &mut Vec<Action>) -> Result<()> {
        self.refreshes += 1;
        let elapsed_us = now_us.saturating_sub(self.started_us);
        if self.refreshes > MAX_LAYOUT_REFRESHES || elapsed_us > self.timeout_us {
            let (refreshes, secs) = (self.refreshes, elapsed_us as f64 / 1e6);
            let what = if self.lost.is_empty() {
                format!("blocks kept moving through {refreshes} layout refreshes in {secs:.1} s")
            } else {
                format!(
                    "the connection to server(s) {:?} closed with requests in flight, and the layout still \
                     named them after {refreshes} refreshes in {secs:.1} s",
                    self.lost
                )
            };
            return Err(NodeError::Protocol { peer: "servers".into(), what });
        }
        tracing::debug!(
            blocks = self.moved.len(),
            refreshes = self.refreshes,
            "blocks moved or lost; refreshing the layout"
        );
        self.chase = Chase::Refreshing;
        out.push(Action::RefreshLayout);
        Ok(())
    }

    /// Resends the moved blocks to their current owners; then chases those that moved
    /// while this refresh was under way.
    fn resend(&mut self, now_us: u64, out: &mut Vec<Action>) -> Result<()> {
        self.chase = Chase::Idle;
        let mut moved = std::mem::take(&mut self.moved);
        let planned = self.plan(now_us, &mut moved, out);
        self.moved = moved;
        planned?;
        if !self.moved_next.is_empty() {
            std::mem::swap(&mut self.moved, &mut self.moved_next);
            self.refresh(now_us, out)?;
        }
        Ok(())
    }
}
