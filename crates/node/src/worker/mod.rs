//! The worker's round as a plan that a runtime carries out: which blocks to push and
//! pull on which server, a block's pull sent once its server acknowledged its push, what
//! to resend after `Moved`, how many requests may be in flight to one server (the
//! window) and how long each may wait (the request timeout), and what the round cost per
//! server (the balancer's measurements). No I/O, no clock, no tensor bytes: every call
//! carries `now_us`, and the runtime copies a block's values into a request on
//! [`Action::Send`] and out of a `PullReply` itself.
//!
//! The time contract of every role: [`Round::handle`] takes the time and an event and
//! returns actions; [`Round::poll_timeout`] says when to hand it [`RoundEvent::Timeout`].
//!
//! ```text
//! let (mut round, actions) = worker.start(now_us, &layout, Some((PushOp::Grad(t), &pushed)), Some((t + 1, &pulled)))?;
//! carry out actions            // Send { tag, server, block, op } (write it, no question asked) | RefreshLayout
//! while !round.is_done() {
//!     sleep until round.poll_timeout(), or until:
//!     reply arrives for tag    -> round.handle(now_us, RoundEvent::Reply { tag, msg: &msg })?  -> more actions
//!     a connection closes      -> round.handle(now_us, RoundEvent::ServerLost { server })?     -> more actions
//!     layout refreshed         -> round.handle(now_us, RoundEvent::Layout(&layout))?          -> more actions
//!     poll_timeout reached     -> round.handle(now_us, RoundEvent::Timeout)?                  -> more actions, or the timeout's error
//! }
//! let report = worker.finish(now_us, round);  // the WorkerLoad to send, when one is due
//! ```
//!
//! The window: a round emits a [`Action::Send`] only while fewer than
//! [`Worker::with_window`] requests of it are in flight to that server, counted apart for
//! the requests that carry a push and those that only pull; the others wait in the round,
//! in the order planned, and go out as answers come back (a runtime writes every send it
//! is given). A push_pull whose pull the server holds is acknowledged on its own (a
//! `PushAck`, then its `PullReply` under the same id: [`Op::ends_with`]) and leaves the
//! window then, so a held pull never takes the room of a push that other workers' held
//! pulls wait for (the deadlock of issue 33, see `window.rs`). Each request sent must be
//! answered within the request timeout, a held one too; [`Round::poll_timeout`] is the
//! oldest one's deadline.
//!
//! Per server, a round is a push phase (all pushes of that server's blocks in flight at
//! once) and then, once that server acknowledged them all, a pull phase for those blocks
//! that are also pulled. With fusion on (the default, [`Worker::with_fusion`]), a block
//! that a round pushes at clock t and pulls at t + 1 goes in the push phase as one
//! [`Op::PushPull`], whose `PullReply` settles both: no pull phase for it. A block whose
//! server answered `Moved` is resent, with what was still to do for it, at once to the
//! owner the `Moved` names when that answer is newer than what the worker knows of the
//! block (its epoch above the layout's and the block's last hint) and the layout lists
//! that server: the owner is kept as a hint for the next rounds, until a layout of that
//! epoch comes. Otherwise (a server the worker cannot reach yet, an answer not newer) it
//! is resent after a layout refresh ([`Action::RefreshLayout`]); when the refreshed layout
//! has the same epoch (the server answered before the scheduler published the move) the
//! plan first waits a little (its [`Round::poll_timeout`]).
//!
//! - [`Client`]: the worker's client as one machine (`client.rs`): its connections to the
//!   servers (dial, `Hello`, stale ones dropped), the layout it installs, the round below
//!   run inside it, and the calls outside a round with their retries ([`Target`],
//!   `call.rs`). The runtime's client and the harness's worker only drive it.
//! - [`group`]: one push per host: the leader of a host's workers sums their gradients.
//! - [`Round`]: one round's plan (`round.rs`), with its window and deadlines (`window.rs`).
//! - [`LoadReport`]: iterations and per-server costs, reported every stats interval.
//! - [`hello_answer`], [`replan_rows`]: the connection rules every driver of a worker
//!   follows (`NotReady` to `Hello`, a row round planned again after a split).

mod call;
mod client;
mod conn;
pub mod group;
mod load;
mod round;
mod window;

use std::collections::BTreeMap;

use elasticps_core::model::BlockSpec;
use elasticps_core::sync::Clock;
use elasticps_wire::{Kind, Layout, Message, WorkerLoad};

pub use call::{MAX_MOVES, Target};
pub use client::{Client, Effect, Event as ClientEvent, Finished, HELLO_ID};
pub use conn::{HelloAnswer, MAX_RECUTS, hello_answer, replan_rows};
pub use load::{Iteration, LoadReport};
pub use round::{Answer, Round};

use crate::Result;
pub use crate::timing::DEFAULT_WINDOW;

/// How many times one round refreshes the layout to chase moved blocks.
pub const MAX_LAYOUT_REFRESHES: u32 = 64;

/// The back-off step after a refresh that found the same epoch: the `n`-th refresh of a
/// round waits `n` (at most 20) times this long.
pub const MOVED_BACKOFF_US: u64 = 5_000;

/// Names one request of a round, unique per worker: the round's sequence number in the
/// high 32 bits, the request's index in the round in the low 32. A runtime may use it as
/// the wire request id; it feeds the reply back with it.
pub type Tag = u64;

/// What the push half of a round sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PushOp {
    /// Gradients of this clock.
    Grad(Clock),
    /// Initial values (the first worker's parameters, before any push).
    Init,
}

/// What one request asks of a server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// `Push { block, clock, values }`: the block's slice of the gradient.
    Push(Clock),
    /// `Init { block, values }`: the block's slice of the initial values.
    Init,
    /// `Pull { block, clock }`: the block's values, copied into the caller's tensor.
    Pull(Clock),
    /// `PushPull { block, clock, values }`: the block's slice of the gradient of `clock`
    /// and the pull of `clock + 1`, whose `PullReply` values go into the pulled tensor.
    PushPull(Clock),
    /// `PushRows { block, clock, dim, ids, grads }`: the gradient rows of a row block's
    /// range (none: an empty push, which still counts for the clock).
    PushRows(Clock),
    /// `PullRows { block, clock, ids }`: the rows of a row block's range that the caller
    /// asked for, answered `PullRowsReply`.
    PullRows(Clock),
}

impl Op {
    /// The verb and clock that errors and timeouts name: `push(clock 3)`, `init(clock 0)`,
    /// `pull(clock 4)`, `push_pull(clock 3)` (the push's clock), `push_rows(clock 3)`,
    /// `pull_rows(clock 4)`.
    pub fn verb_clock(self) -> (&'static str, Clock) {
        match self {
            Op::Push(clock) => ("push", clock),
            Op::Init => ("init", 0),
            Op::Pull(clock) => ("pull", clock),
            Op::PushPull(clock) => ("push_pull", clock),
            Op::PushRows(clock) => ("push_rows", clock),
            Op::PullRows(clock) => ("pull_rows", clock),
        }
    }

    /// True for a push, an init or a row push (answered `PushAck`).
    pub fn is_push(self) -> bool {
        matches!(self, Op::Push(_) | Op::Init | Op::PushRows(_))
    }

    /// True for the requests that carry values (a push, an init, a push_pull, a row push).
    pub fn carries_values(self) -> bool {
        !matches!(self, Op::Pull(_) | Op::PullRows(_))
    }

    /// True for the requests answered by a `PullReply` (a pull, a push_pull) or a
    /// `PullRowsReply` (a row pull).
    pub fn is_pull(self) -> bool {
        matches!(self, Op::Pull(_) | Op::PushPull(_) | Op::PullRows(_))
    }

    /// True if a reply of `kind` ends request `op` (no other reply comes under its id).
    /// False only for a push_pull's `PushAck`: the server acknowledged its push on its own
    /// and holds its pull, whose `PullReply` (or `Moved`, or `Error`) follows under the
    /// same id; the round no longer counts it in the window meanwhile.
    pub fn ends_with(self, kind: Kind) -> bool {
        !(matches!(self, Op::PushPull(_)) && kind == Kind::PushAck)
    }

    /// True for the requests about a row block's rows (PushRows, PullRows).
    pub fn is_rows(self) -> bool {
        matches!(self, Op::PushRows(_) | Op::PullRows(_))
    }
}

impl From<PushOp> for Op {
    fn from(op: PushOp) -> Self {
        match op {
            PushOp::Grad(clock) => Op::Push(clock),
            PushOp::Init => Op::Init,
        }
    }
}

/// What a row round does with one table ([`Worker::start_rows`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowsOp {
    /// Push the gradient rows of this clock: one `PushRows` to every block of the table,
    /// an empty one where no row was touched, so that each row range counts every
    /// worker's clock and the sync policy keeps its meaning per block.
    Push(Clock),
    /// Pull rows at this clock: one `PullRows` to each block holding a row asked for.
    Pull(Clock),
}

/// What a runtime hands a round ([`Round::handle`]).
#[derive(Clone, Copy, Debug)]
pub enum RoundEvent<'a> {
    /// The reply to request `tag`, decoded.
    Reply {
        /// The request's tag ([`Action::Send`]).
        tag: Tag,
        /// The reply.
        msg: &'a Message,
    },
    /// The reply to request `tag` as a runtime read it without decoding it into a
    /// [`Message`] (a pull reply's values went straight into the caller's tensor).
    Answer {
        /// The request's tag.
        tag: Tag,
        /// What the reply said.
        answer: Answer<'a>,
    },
    /// Request `tag` went unanswered: its connection closed before the reply. It frees
    /// room in its server's window (the next request queued there goes out: a runtime
    /// that knows the whole connection is gone says [`RoundEvent::ServerLost`] instead).
    Lost {
        /// The request's tag.
        tag: Tag,
    },
    /// The connection to `server` closed, or could not be opened (a send to a server the
    /// runtime has no connection to): every request in flight there and every one
    /// waiting for room in its window is lost, once each, and resent after a layout
    /// refresh.
    ServerLost {
        /// The server's id.
        server: u32,
    },
    /// The layout the scheduler sent after [`Action::RefreshLayout`].
    Layout(&'a Layout),
    /// The time [`Round::poll_timeout`] named was reached.
    Timeout,
}

/// What the runtime must do for a round.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Send one request to a server (its window has room: write it) and hand its reply
    /// back with `tag` ([`RoundEvent::Reply`]).
    Send {
        /// Names the request (and its reply).
        tag: Tag,
        /// The server (its id in the layout).
        server: u32,
        /// The block: `tensor[offset..offset + len]` of the push's or pull's tensor.
        block: BlockSpec,
        /// What to send.
        op: Op,
    },
    /// Fetch the layout from the scheduler and hand it back ([`RoundEvent::Layout`]).
    RefreshLayout,
}

/// One worker's side of the job across rounds: its rank, its limits, the sequence of
/// rounds (for unique tags) and its load report.
#[derive(Debug)]
pub struct Worker {
    rank: u32,
    timeout_us: u64,
    /// Requests of a round in flight to one server at most.
    window: usize,
    seq: u32,
    load: LoadReport,
    /// Send a block pushed at t and pulled at t + 1 as one push_pull.
    fuse: bool,
    /// The buffers of the last finished round, reused by the next.
    spare: Option<Round>,
    /// Owners that `Moved` answers named, newer than the layout's (block -> (owner,
    /// epoch)): each round starts with them applied, so that a block moved once is not
    /// answered `Moved` again every round until the next layout refresh.
    hints: BTreeMap<u32, (u32, u64)>,
}

impl Worker {
    /// Worker `rank`; a round fails when a request is unanswered for `timeout_us` (the
    /// request timeout), or when it still chases moved blocks after it; a load report is
    /// due every `stats_interval_us`. Fusion is on, the window [`DEFAULT_WINDOW`].
    pub fn new(rank: u32, timeout_us: u64, stats_interval_us: u64, now_us: u64) -> Self {
        let load = LoadReport::new(rank, stats_interval_us, now_us);
        Self { rank, timeout_us, window: DEFAULT_WINDOW, seq: 0, load, fuse: true, spare: None, hints: BTreeMap::new() }
    }

    /// At most `window` (at least 1) requests of a round in flight to one server; the
    /// round holds the others back and sends them as answers come back.
    pub fn with_window(mut self, window: usize) -> Self {
        self.window = window.max(1);
        self
    }

    /// The window ([`Worker::with_window`]).
    pub fn window(&self) -> usize {
        self.window
    }

    /// Says whether a block that a round pushes at clock t and pulls at t + 1 goes as one
    /// [`Op::PushPull`] (on, the default) or as a push and, once acknowledged, a pull.
    pub fn with_fusion(mut self, on: bool) -> Self {
        self.fuse = on;
        self
    }

    /// Whether rounds fuse push and pull ([`Worker::with_fusion`]).
    pub fn fuses(&self) -> bool {
        self.fuse
    }

    /// This worker's rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The load report being collected.
    pub fn load(&self) -> &LoadReport {
        &self.load
    }

    /// Starts a round over `layout`: `push` (if any) sends `op` for every block of each
    /// tensor `t` with `pushed[t]`, `pull` (if any) pulls at its clock every block of each
    /// tensor with `pulled[t]` (a mask shorter than the model leaves the rest out). A round
    /// pushing a gradient counts an iteration ([`Round::iteration`]). Returns the round and
    /// its first requests; a round with nothing to do is done at once.
    pub fn start(
        &mut self,
        now_us: u64,
        layout: &Layout,
        push: Option<(PushOp, &[bool])>,
        pull: Option<(Clock, &[bool])>,
    ) -> Result<(Round, Vec<Action>)> {
        self.seq = self.seq.wrapping_add(1);
        let iteration = match push {
            Some((PushOp::Grad(clock), _)) => self.load.iteration(now_us, clock),
            _ => None,
        };
        let mut round = self.spare.take().unwrap_or_default();
        round.hints = std::mem::take(&mut self.hints);
        let actions = round.begin(
            self.seq,
            self.rank,
            self.timeout_us,
            self.window,
            self.fuse,
            now_us,
            layout,
            push,
            pull,
            iteration,
        )?;
        Ok((round, actions))
    }

    /// Starts a row round over `layout` for table `table` (its index among the model's
    /// tables): [`RowsOp::Push`] sends to every block of the table, [`RowsOp::Pull`] to the
    /// blocks `wanted` says hold rows asked for. The runtime puts into each request the
    /// ids (and gradient rows) of its block's range, and reads the rows out of each
    /// `PullRowsReply`; the plan follows `Moved`, windows and deadlines as for tensors.
    /// A row round counts no iteration (the dense push of the same clock does). An
    /// unknown table is refused.
    pub fn start_rows(
        &mut self,
        now_us: u64,
        layout: &Layout,
        table: u32,
        op: RowsOp,
        wanted: &dyn Fn(&BlockSpec) -> bool,
    ) -> Result<(Round, Vec<Action>)> {
        if table as usize >= layout.partition.tables.len() {
            return Err(crate::NodeError::Refused(format!(
                "table {table}: the model has {} tables",
                layout.partition.tables.len()
            )));
        }
        self.seq = self.seq.wrapping_add(1);
        let mut round = self.spare.take().unwrap_or_default();
        round.hints = std::mem::take(&mut self.hints);
        let actions =
            round.begin_rows(self.seq, self.rank, self.timeout_us, self.window, now_us, layout, (table, op), wanted)?;
        Ok((round, actions))
    }

    /// Ends a finished round: records its waits and push costs in the load report and
    /// returns the report to send to the scheduler when one is due (a fresh one starts).
    pub fn finish(&mut self, now_us: u64, mut round: Round) -> Option<WorkerLoad> {
        self.load.record(&round);
        self.hints = std::mem::take(&mut round.hints);
        self.spare = Some(round);
        self.load.due(now_us)
    }
}

#[cfg(test)]
mod tests;
