//! The worker's adapter: a training loop on the real round plan ([`Worker`], [`Round`]).
//!
//! It does what the runtime's `Client` and the `elasticps worker` loop do: register,
//! define the model, connect to the servers of the layout (Hello), pull clock 0, then per
//! iteration compute (a modelled time) and push the gradients of clock t while pulling
//! clock t + 1, fused into one push_pull per block if [`TrainingLoop::fuse`] (the last
//! iteration of workers other than rank 0 only pushes), tell the
//! scheduler it is done. Its link to the scheduler is a [`Session`] (heartbeats, redial,
//! reattach, calls made again), as the runtime's client's. `Moved` blocks are chased through
//! layout refreshes by the plan, which also keeps the window ([`TrainingLoop::window`])
//! and the requests' deadlines: this adapter writes every send it is given and wakes the
//! round at its `poll_timeout`, as the runtime's round loop does. The gradients are a
//! function of (rank, clock, block) chosen by the run, so a test knows the exact final
//! parameters. With a [`TableTraining`], each iteration's tensor round is followed by a
//! row round that pushes gradient rows to an embedding table (every block of it, as the
//! client's `push_rows`), planned again when a block of the table is split under it.

use std::collections::BTreeMap;

use elasticps_core::model::{BlockId, TableSpec, TensorSpec};
use elasticps_core::sync::Clock;
use elasticps_wire::{Control, Credential, Layout, Message, Values};

use crate::cluster::{Outbox, Role};
use crate::link::SchedLink;
use crate::net::{LostWhy, NodeId};
use elasticps_node::ConnId;
use elasticps_node::NodeError;
use elasticps_node::session::{self, REATTACH_ID};
use elasticps_node::worker::{self, Action, HelloAnswer, Op, PushOp, Round, RoundEvent, RowsOp, Worker};

pub use elasticps_node::timing::WORKER_STATS_US;

/// Timer tokens.
const SESSION: u64 = 0;
const COMPUTE_DONE: u64 = 1;
const WAKE: u64 = 2;
/// Say Hello again to server `id`: this plus `id`.
const HELLO_AGAIN: u64 = 1 << 32;

/// Request ids on the scheduler's connection (the plan's tags are >= 2^32).
const REGISTER: u64 = 1;
const DEFINE: u64 = 2;
const DONE: u64 = 3;
const START: u64 = 4;
const FIRST_LAYOUT_CALL: u64 = 16;
/// Request id of Hello on a server's connection.
const HELLO: u64 = 1;

/// What the simulated training loop does.
pub struct TrainingLoop {
    /// The model every worker defines.
    pub tensors: Vec<TensorSpec>,
    /// Iterations per worker.
    pub iterations: u32,
    /// Compute time of `(rank, iteration)`, µs (stragglers included).
    pub compute_us: Box<dyn FnMut(u32, u32) -> u64>,
    /// Every value of the gradient of `(rank, clock, block)`.
    pub grad: fn(u32, Clock, BlockId) -> f32,
    /// How long one request may wait (the runtime's `--request-timeout`).
    pub timeout_us: u64,
    /// Send each block's push and next pull as one push_pull (the client's default).
    pub fuse: bool,
    /// Requests of a round in flight to one server at most (the client's `window`,
    /// [`elasticps_node::timing::DEFAULT_WINDOW`] by default).
    pub window: usize,
    /// Push a gradient of exactly 0 as no gradient (an empty payload,
    /// `elasticps_core::block::Gradient::None`): SGD ends with the same values, and the
    /// run exercises pushes without a gradient through migrations, replicas and
    /// checkpoints.
    pub zero_as_no_gradient: bool,
    /// An embedding table trained beside the tensors, if any.
    pub table: Option<TableTraining>,
}

/// An embedding table a [`TrainingLoop`] trains: after the tensor round of clock t, a row
/// round pushes, to every block of the table, the gradient rows of `ids(rank, t)` (sorted,
/// no duplicates) that fall in its range, every value of row `r` being `grad(rank, t, r)`.
/// A test knows the exact final rows.
#[derive(Clone, Debug)]
pub struct TableTraining {
    /// The table (the model's only one).
    pub spec: TableSpec,
    /// The rows a worker's step touches.
    pub ids: fn(u32, Clock) -> Vec<u64>,
    /// Every value of the gradient of `(rank, clock, row)`.
    pub grad: fn(u32, Clock, u64) -> f32,
}

impl std::fmt::Debug for TrainingLoop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrainingLoop")
            .field("tensors", &self.tensors.len())
            .field("iterations", &self.iterations)
            .field("fuse", &self.fuse)
            .field("window", &self.window)
            .finish()
    }
}

/// Where the worker is in its run.
#[derive(Clone, Debug, PartialEq)]
pub enum Stage {
    /// Waiting for Welcome.
    Registering,
    /// Waiting for the layout (every server holds its blocks).
    Defining,
    /// Pulling clock 0.
    Starting,
    /// Computing iteration t.
    Computing(u32),
    /// In the round of iteration t.
    Communicating(u32),
    /// In the row round of iteration t (after its tensor round).
    PushingRows(u32),
    /// Waiting for the scheduler to acknowledge WorkerDone.
    Finishing,
    /// Done.
    Done,
    /// Stopped by an error (the job then removes it from every quorum).
    Failed(String),
}

/// What the worker measured of its run.
#[derive(Clone, Debug, Default)]
pub struct WorkerRecord {
    /// When training started (clock 0 pulled), µs.
    pub started_us: u64,
    /// When each iteration ended, µs.
    pub iteration_ends_us: Vec<u64>,
    /// Time spent in rounds after compute, µs per iteration.
    pub comm_us: Vec<u64>,
    /// Total time waited per server id, µs.
    pub wait_us_by_server: Vec<u64>,
    /// Pull replies accepted (each block of each pull exactly once).
    pub pulls_answered: u64,
    /// Pushes acknowledged (by a `PushAck`, or by the `PullReply` of a push_pull).
    pub pushes_acked: u64,
    /// Layout refreshes over the run.
    pub refreshes: u64,
    /// Row rounds planned again because a block of the table was split under them.
    pub recuts: u64,
}

/// A server connection whose `Hello` is not accepted yet.
#[derive(Debug)]
struct Hello {
    first_us: u64,
    held: Vec<(u64, Message)>,
}

/// A simulated worker process.
pub struct WorkerRole {
    work: TrainingLoop,
    stage: Stage,
    rank: Option<u32>,
    /// The credential of its `Welcome`: said in `Hello` and when it reattaches.
    credential: Option<Credential>,
    /// Restarted: rejoin as this rank instead of registering.
    rejoin: Option<u32>,
    /// The first clock (0; a rejoined worker's is the scheduler's answer).
    start: Clock,
    plan: Option<Worker>,
    layout: Option<Layout>,
    servers: BTreeMap<u32, ConnId>,
    /// Servers whose `Hello` is not accepted yet: when it was first said, and the requests
    /// for them held back until then (the runtime's client connects before it writes).
    hellos: BTreeMap<u32, Hello>,
    /// Row rounds of the current call planned again after a split ([`worker::replan_rows`]).
    row_recuts: u32,
    /// The round's wake-up timer is set for this time (a later `poll_timeout` is set when
    /// it fires).
    armed: Option<u64>,
    /// Some server left the layout while requests to it were in flight: close its
    /// connection once they are answered (at the end of the round).
    departed: bool,
    round: Option<Round>,
    all: Vec<bool>,
    next_call: u64,
    round_started_us: u64,
    record: WorkerRecord,
    /// The last gradient sent per block (its value and the shared buffer): a push of the
    /// same value reuses it instead of filling a new one.
    grads: Vec<Option<(f32, Values)>>,
    /// The link to the scheduler (heartbeats, redial, reattach, calls made again).
    link: SchedLink,
}

impl std::fmt::Debug for WorkerRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerRole").field("rank", &self.rank).field("stage", &self.stage).finish()
    }
}

impl WorkerRole {
    /// A worker that will run `work`.
    pub fn new(work: TrainingLoop) -> Self {
        let all = vec![true; work.tensors.len()];
        Self {
            work,
            stage: Stage::Registering,
            rank: None,
            credential: None,
            rejoin: None,
            start: 0,
            plan: None,
            layout: None,
            servers: BTreeMap::new(),
            hellos: BTreeMap::new(),
            row_recuts: 0,
            armed: None,
            departed: false,
            round: None,
            all,
            next_call: FIRST_LAYOUT_CALL,
            round_started_us: 0,
            record: WorkerRecord::default(),
            grads: Vec::new(),
            link: SchedLink::new(0, SESSION),
        }
    }

    /// A lost scheduler is redialled for `us`: the worker reattaches (`ReattachWorker`)
    /// and makes its unanswered calls again, as the runtime's client does ([`Session`]).
    /// Its data traffic goes on meanwhile.
    pub fn with_scheduler_retry(mut self, us: u64) -> Self {
        self.link = SchedLink::new(us, SESSION);
        self
    }

    /// An event of the scheduler's link ([`SchedLink`]); a link that ends without a
    /// `Shutdown` fails the worker.
    fn session(&mut self, out: &mut Outbox<'_>, event: session::Event<'_>) {
        let me = self.rank.zip(self.credential.clone());
        let hello = || me.clone().map(|(rank, credential)| Control::ReattachWorker { rank, credential }.into());
        if let Some(Some(why)) = self.link.handle(out, event, hello) {
            self.fail(out, why);
        }
    }

    /// A worker restarted after it was lost: it rejoins as `rank` and goes on from the
    /// clock the scheduler gives it.
    pub fn rejoining(work: TrainingLoop, rank: u32) -> Self {
        Self { rejoin: Some(rank), ..Self::new(work) }
    }

    /// The clock it started at (0, or where it rejoined).
    pub fn start_clock(&self) -> Clock {
        self.start
    }

    /// Its rank, once registered.
    pub fn rank(&self) -> Option<u32> {
        self.rank
    }

    /// Where it is.
    pub fn stage(&self) -> &Stage {
        &self.stage
    }

    /// What it measured.
    pub fn record(&self) -> &WorkerRecord {
        &self.record
    }

    /// Stops with `why`: closes every connection, as a process that exits does.
    fn fail(&mut self, out: &mut Outbox<'_>, why: String) {
        if matches!(self.stage, Stage::Done | Stage::Failed(_)) {
            return;
        }
        tracing::debug!(rank = ?self.rank, %why, "simulated worker fails");
        self.stage = Stage::Failed(why);
        for conn in self.link.conn().into_iter().chain(std::mem::take(&mut self.servers).into_values()) {
            out.close(conn);
        }
    }

    fn call_scheduler(&mut self, out: &mut Outbox<'_>, request_id: u64, msg: Message) {
        self.session(out, session::Event::Send { request_id, msg });
    }

    /// Connects to the layout's new servers and drops the ones that left it.
    fn install(&mut self, out: &mut Outbox<'_>, layout: Layout) {
        let Some(credential) = self.credential.clone() else { return };
        for s in &layout.servers {
            if self.servers.contains_key(&s.id) {
                continue;
            }
            let Some(node) = NodeId::from_addr(&s.addr) else { continue };
            let conn = out.connect(node);
            out.send(conn, HELLO, Control::Hello { credential: credential.clone() }.into());
            self.servers.insert(s.id, conn);
            self.hellos.insert(s.id, Hello { first_us: out.now_us(), held: Vec::new() });
        }
        self.layout = Some(layout);
        self.drop_departed(out);
    }

    /// Closes the connections of servers that left the layout, but not while requests
    /// to them are in flight: as the runtime's client, whose dropped connection still
    /// reads the answers (a drained server answers its parked requests `Moved`).
    fn drop_departed(&mut self, out: &mut Outbox<'_>) {
        let Some(layout) = self.layout.as_ref() else { return };
        let round = self.round.as_ref();
        let gone: Vec<(u32, ConnId)> = self
            .servers
            .iter()
            .filter(|(id, _)| !layout.servers.iter().any(|s| s.id == **id))
            .map(|(id, conn)| (*id, *conn))
            .collect();
        self.departed = false;
        for (id, conn) in gone {
            if round.is_some_and(|r| r.in_flight_to(id) > 0) {
                self.departed = true;
                continue;
            }
            self.servers.remove(&id);
            self.hellos.remove(&id);
            out.close(conn);
        }
    }

    /// Starts the row round of the current stage ([`TableTraining`]).
    fn start_rows(&mut self, out: &mut Outbox<'_>) {
        let (Some(plan), Some(layout), Stage::PushingRows(t)) = (self.plan.as_mut(), self.layout.as_ref(), &self.stage)
        else {
            return;
        };
        match plan.start_rows(out.now_us(), layout, 0, RowsOp::Push(*t), &|_| true) {
            Ok((round, actions)) => {
                self.round = Some(round);
                self.on_round_result(out, Ok(actions));
            }
            Err(e) => self.fail(out, e.to_string()),
        }
    }

    /// A block of the table was split under the row round: the connections with requests
    /// of it in flight start afresh (their late replies are not the next round's, the
    /// runtime's rule too), and the round is planned again from the refreshed layout (what
    /// blocks already took are duplicates there), as often as
    /// [`worker::replan_rows`] allows.
    fn recut(&mut self, out: &mut Outbox<'_>) {
        self.row_recuts += 1;
        if let Err(e) = worker::replan_rows(0, self.row_recuts) {
            return self.fail(out, e.to_string());
        }
        let Some(round) = self.round.take() else { return };
        let busy: Vec<u32> = self.servers.keys().copied().filter(|id| round.in_flight_to(*id) > 0).collect();
        for id in busy {
            self.hellos.remove(&id);
            if let Some(conn) = self.servers.remove(&id) {
                out.close(conn);
            }
        }
        if let Some(layout) = self.layout.clone() {
            self.install(out, layout);
        }
        self.start_rows(out);
    }

    /// Starts the round of the current stage.
    fn start_round(&mut self, out: &mut Outbox<'_>) {
        let (Some(plan), Some(layout)) = (self.plan.as_mut(), self.layout.as_ref()) else { return };
        let (push, pull) = match self.stage {
            Stage::Starting => (None, Some(self.start)),
            Stage::Communicating(t) => {
                let last_pulls = t + 1 < self.work.iterations || self.rank == Some(0);
                (Some(PushOp::Grad(t)), last_pulls.then_some(t + 1))
            }
            _ => return,
        };
        self.round_started_us = out.now_us();
        let all = &self.all[..];
        match plan.start(out.now_us(), layout, push.map(|p| (p, all)), pull.map(|c| (c, all))) {
            Ok((round, actions)) => {
                self.round = Some(round);
                self.on_round_result(out, Ok(actions));
            }
            Err(e) => self.fail(out, e.to_string()),
        }
    }

    /// Writes the round's sends (a send to a server without a connection, or whose
    /// connection is closed, is handed back as that server lost) and asks for layouts.
    fn carry_out(&mut self, out: &mut Outbox<'_>, actions: Vec<Action>) {
        let rank = self.rank.unwrap_or(0);
        let mut todo = std::collections::VecDeque::from(actions);
        while let Some(action) = todo.pop_front() {
            match action {
                Action::Send { tag, server, block, op } => {
                    let msg = match op {
                        Op::Push(clock) => {
                            let g = (self.work.grad)(rank, clock, block.id);
                            Message::Push { block: block.id, clock, values: self.gradient(block.id, block.len, g) }
                        }
                        Op::Init => Message::Init { block: block.id, values: Values::from_vec(vec![0.0; block.len]) },
                        Op::Pull(clock) => Message::Pull { block: block.id, clock },
                        Op::PushPull(clock) => {
                            let g = (self.work.grad)(rank, clock, block.id);
                            Message::PushPull { block: block.id, clock, values: self.gradient(block.id, block.len, g) }
                        }
                        Op::PushRows(clock) => self.row_push(rank, clock, &block),
                        Op::PullRows(clock) => Message::PullRows { block: block.id, clock, ids: Default::default() },
                    };
                    if let Some(hello) = self.hellos.get_mut(&server) {
                        hello.held.push((tag, msg));
                        continue;
                    }
                    let conn = self.servers.get(&server).copied();
                    if !conn.is_some_and(|conn| out.send(conn, tag, msg)) {
                        // Closed (or never connected): the plan resends after a refresh.
                        let Some(round) = self.round.as_mut() else { return };
                        match round.handle(out.now_us(), RoundEvent::ServerLost { server }) {
                            Ok(more) => todo.extend(more),
                            Err(e) => return self.fail(out, e.to_string()),
                        }
                    }
                }
                Action::RefreshLayout => {
                    self.record.refreshes += 1;
                    let id = self.next_call;
                    self.next_call += 1;
                    self.call_scheduler(out, id, Control::GetLayout.into());
                }
            }
        }
    }

    /// Sets the timer for the round's `poll_timeout`, unless one is set for earlier (that
    /// one sets the next when it fires).
    fn arm(&mut self, out: &mut Outbox<'_>) {
        let Some(at) = self.round.as_ref().and_then(Round::poll_timeout) else { return };
        if self.armed.is_none_or(|armed| at < armed) {
            self.armed = Some(at);
            out.wake_at(at, WAKE);
        }
    }

    /// Hands the round `event` now and carries out what it returns.
    fn hand(&mut self, out: &mut Outbox<'_>, event: RoundEvent<'_>) {
        let Some(round) = self.round.as_mut() else { return };
        let result = round.handle(out.now_us(), event);
        self.on_round_result(out, result);
    }

    /// The `PushRows` of row block `block` at `clock`: the step's rows in its range
    /// ([`TableTraining`]), or none.
    fn row_push(&self, rank: u32, clock: Clock, block: &elasticps_core::model::BlockSpec) -> Message {
        let (start, end, dim) = block.row_range().unwrap_or((0, 0, 1));
        let (rows, grads): (Vec<u64>, Vec<f32>) = match &self.work.table {
            Some(t) => {
                let rows: Vec<u64> = (t.ids)(rank, clock).into_iter().filter(|r| (start..end).contains(r)).collect();
                let grads = rows.iter().flat_map(|r| std::iter::repeat_n((t.grad)(rank, clock, *r), dim as usize));
                (rows.clone(), grads.collect())
            }
            None => (Vec::new(), Vec::new()),
        };
        Message::PushRows {
            block: block.id,
            clock,
            dim,
            ids: elasticps_wire::RowIds::from_vec(rows),
            grads: Values::from_vec(grads),
        }
    }

    /// A gradient of `len` values `g` for `block` (shared with the last one if equal).
    fn gradient(&mut self, block: u32, len: usize, g: f32) -> Values {
        if self.work.zero_as_no_gradient && g == 0.0 {
            return Values::from_vec(Vec::new());
        }
        let i = block as usize;
        if self.grads.len() <= i {
            self.grads.resize(i + 1, None);
        }
        match &self.grads[i] {
            Some((v, values)) if *v == g && values.len() == len => values.clone(),
            _ => {
                let values = Values::from_vec(vec![g; len]);
                self.grads[i] = Some((g, values.clone()));
                values
            }
        }
    }

    fn on_round_result(&mut self, out: &mut Outbox<'_>, result: elasticps_node::Result<Vec<Action>>) {
        match result {
            Err(NodeError::Recut { block }) if matches!(self.stage, Stage::PushingRows(_)) => {
                tracing::debug!(rank = ?self.rank, block, "row round planned again after a split");
                self.record.recuts += 1;
                self.recut(out);
            }
            Ok(actions) => {
                self.carry_out(out, actions);
                if matches!(self.stage, Stage::Failed(_)) {
                    return;
                }
                self.arm(out);
                self.maybe_round_done(out);
            }
            Err(e) => self.fail(out, e.to_string()),
        }
    }

    fn maybe_round_done(&mut self, out: &mut Outbox<'_>) {
        if !self.round.as_ref().is_some_and(Round::is_done) {
            return;
        }
        let (Some(round), Some(plan)) = (self.round.take(), self.plan.as_mut()) else { return };
        let now = out.now_us();
        for (server, us) in round.waited() {
            let w = &mut self.record.wait_us_by_server;
            if w.len() <= server as usize {
                w.resize(server as usize + 1, 0);
            }
            w[server as usize] += us;
        }
        let report = plan.finish(now, round);
        if self.departed {
            self.drop_departed(out);
        }
        if let Some(report) = report {
            self.call_scheduler(out, 0, Control::WorkerLoad(report).into());
        }
        match self.stage {
            Stage::Starting => {
                self.record.started_us = now;
                if self.start < self.work.iterations {
                    self.compute(out, self.start);
                } else {
                    self.stage = Stage::Finishing;
                    let rank = self.rank.unwrap_or(0);
                    self.call_scheduler(out, DONE, Control::WorkerDone { rank }.into());
                }
            }
            Stage::Communicating(t) if self.work.table.is_some() => {
                self.stage = Stage::PushingRows(t);
                self.row_recuts = 0;
                self.start_rows(out);
            }
            Stage::Communicating(t) | Stage::PushingRows(t) => {
                self.record.comm_us.push(now - self.round_started_us);
                self.record.iteration_ends_us.push(now);
                if t + 1 < self.work.iterations {
                    self.compute(out, t + 1);
                } else {
                    self.stage = Stage::Finishing;
                    let rank = self.rank.unwrap_or(0);
                    self.call_scheduler(out, DONE, Control::WorkerDone { rank }.into());
                }
            }
            _ => {}
        }
    }

    /// A server answered `Hello` on `conn`: what it means is the node layer's rule
    /// ([`worker::hello_answer`]); once accepted, the requests held back for it go out.
    fn on_hello_answer(&mut self, out: &mut Outbox<'_>, conn: ConnId, msg: &Message) {
        let Some(id) = self.servers.iter().find(|(_, c)| **c == conn).map(|(id, _)| *id) else { return };
        let Some(hello) = self.hellos.get(&id) else { return };
        match worker::hello_answer(id, msg, out.now_us().saturating_sub(hello.first_us)) {
            HelloAnswer::Accepted => {
                for (tag, msg) in self.hellos.remove(&id).map(|h| h.held).unwrap_or_default() {
                    out.send(conn, tag, msg);
                }
            }
            HelloAnswer::Again { after_us } => out.wake_at(out.now_us() + after_us, HELLO_AGAIN + u64::from(id)),
            HelloAnswer::Refused(e) => self.fail(out, e.to_string()),
        }
    }

    /// Says `Hello` again to server `id`, if it still waits for one.
    fn hello_again(&mut self, out: &mut Outbox<'_>, id: u32) {
        let (Some(conn), Some(credential)) = (self.servers.get(&id), self.credential.clone()) else { return };
        if self.hellos.contains_key(&id) {
            out.send(*conn, HELLO, Control::Hello { credential }.into());
        }
    }

    fn compute(&mut self, out: &mut Outbox<'_>, t: u32) {
        self.stage = Stage::Computing(t);
        let us = (self.work.compute_us)(self.rank.unwrap_or(0), t);
        out.wake_at(out.now_us() + us, COMPUTE_DONE);
    }

    fn on_scheduler_message(&mut self, out: &mut Outbox<'_>, request_id: u64, msg: Message) {
        if let Message::Control(Control::Welcome { credential, .. }) = &msg {
            self.credential = Some(credential.clone());
        }
        self.session(out, session::Event::Received { request_id, msg: &msg });
        if request_id == REATTACH_ID {
            return;
        }
        match (request_id, msg) {
            (REGISTER, Message::Control(Control::Welcome { node_id, .. })) => {
                self.rank = Some(node_id);
                let plan = Worker::new(node_id, self.work.timeout_us, WORKER_STATS_US, out.now_us());
                self.plan = Some(plan.with_fusion(self.work.fuse).with_window(self.work.window));
                self.stage = Stage::Defining;
                let tensors = self.work.tensors.clone();
                let tables = self.work.table.iter().map(|t| t.spec.clone()).collect();
                self.call_scheduler(
                    out,
                    DEFINE,
                    Control::DefineModel { tensors, optimizers: Vec::new(), tables }.into(),
                );
            }
            (DEFINE, Message::Control(Control::Layout(layout))) => {
                self.install(out, layout);
                if self.rejoin.is_some() {
                    // Where the job is: the clock to go on from.
                    self.call_scheduler(out, START, Control::GetStartClock.into());
                } else {
                    self.stage = Stage::Starting;
                    self.start_round(out);
                }
            }
            (START, Message::Control(Control::StartClock { clock })) => {
                self.start = clock;
                self.stage = Stage::Starting;
                self.start_round(out);
            }
            (DONE, _) => {
                self.stage = Stage::Done;
                for conn in std::mem::take(&mut self.servers).into_values() {
                    out.close(conn);
                }
            }
            (0, Message::Control(Control::Shutdown { reason })) => {
                if !matches!(self.stage, Stage::Done | Stage::Finishing) {
                    self.fail(out, format!("shut down by the scheduler: {reason}"));
                }
            }
            (id, Message::Control(Control::Layout(layout))) if id >= FIRST_LAYOUT_CALL => {
                self.install(out, layout);
                let (Some(round), Some(layout)) = (self.round.as_mut(), self.layout.as_ref()) else { return };
                let result = round.handle(out.now_us(), RoundEvent::Layout(layout));
                self.on_round_result(out, result);
            }
            (0, msg) => {
                // A failover: the lost servers are closed connections, whose host may be
                // silent (no close would come).
                for id in session::servers_lost(&msg, self.servers.keys().copied()) {
                    if let Some(conn) = self.servers.remove(&id) {
                        out.close(conn);
                    }
                    // Its Hello is never answered: nothing waits behind it any more.
                    self.hellos.remove(&id);
                    self.hand(out, RoundEvent::ServerLost { server: id });
                }
            }
            (id, other) => self.fail(out, format!("the scheduler answered call {id} with {:?}", other.kind())),
        }
    }
}

impl Role for WorkerRole {
    fn on_start(&mut self, out: &mut Outbox<'_>) {
        self.link.connect(out);
        let hello = match self.rejoin {
            None => Control::RegisterWorker,
            Some(rank) => Control::RejoinWorker { rank },
        };
        self.call_scheduler(out, REGISTER, hello.into());
    }

    fn on_message(&mut self, out: &mut Outbox<'_>, conn: ConnId, request_id: u64, msg: Message) {
        if matches!(self.stage, Stage::Done | Stage::Failed(_)) {
            return;
        }
        if self.link.is(conn) {
            return self.on_scheduler_message(out, request_id, msg);
        }
        if !self.servers.values().any(|c| *c == conn) {
            // A connection this worker closed (a lost or departed server): what was still
            // on its way is never read, as a runtime's dropped connection's.
            return;
        }
        if request_id == HELLO {
            return self.on_hello_answer(out, conn, &msg);
        }
        let Some(round) = self.round.as_mut() else {
            return self.fail(out, format!("a reply ({:?}) arrived outside a round", msg.kind()));
        };
        match &msg {
            Message::PushAck { .. } => self.record.pushes_acked += 1,
            Message::PullReply { .. } => {
                // A push_pull's reply acknowledges its push too, unless its push was
                // acknowledged on its own (its pull held).
                if matches!(round.op_of(request_id), Some(Op::PushPull(_))) && !round.is_held(request_id) {
                    self.record.pushes_acked += 1;
                }
                self.record.pulls_answered += 1;
            }
            _ => {}
        }
        self.hand(out, RoundEvent::Reply { tag: request_id, msg: &msg });
    }

    fn on_lost(&mut self, out: &mut Outbox<'_>, conn: ConnId, why: LostWhy) {
        if matches!(self.stage, Stage::Done | Stage::Failed(_)) || why == LostWhy::ClosedHere {
            // ClosedHere: a connection this worker closed itself (a server that left its
            // layout); nothing is asked of it any more.
            return;
        }
        if self.link.is(conn) {
            // Redialled if the session says so (a restarted scheduler), else the end.
            tracing::debug!(rank = ?self.rank, ?why, "simulated worker lost the scheduler");
            return self.session(out, session::Event::Lost);
        }
        let Some(id) = self.servers.iter().find(|(_, c)| **c == conn).map(|(id, _)| *id) else { return };
        // A server that left (a drained server after its linger, or one this worker's
        // stale layout still named): what it did not answer goes, after a layout refresh,
        // to the owner named then; a later layout naming it connects again.
        self.servers.remove(&id);
        self.hellos.remove(&id);
        self.hand(out, RoundEvent::ServerLost { server: id });
    }

    fn on_timer(&mut self, out: &mut Outbox<'_>, token: u64) {
        if matches!(self.stage, Stage::Done | Stage::Failed(_)) {
            return;
        }
        match token {
            SESSION => self.session(out, session::Event::Timeout),
            COMPUTE_DONE => {
                if let Stage::Computing(t) = self.stage {
                    self.stage = Stage::Communicating(t);
                    self.start_round(out);
                }
            }
            WAKE => {
                if self.armed.is_some_and(|at| at <= out.now_us()) {
                    self.armed = None;
                }
                match self.round.as_ref().and_then(Round::poll_timeout) {
                    Some(at) if at <= out.now_us() => self.hand(out, RoundEvent::Timeout),
                    _ => self.arm(out),
                }
            }
            again if again >= HELLO_AGAIN => self.hello_again(out, (again - HELLO_AGAIN) as u32),
            _ => {}
        }
    }
}
