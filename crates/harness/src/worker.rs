//! The worker's driver: a training loop on the worker's client machine
//! ([`Client`]: its connections, layout, `Hello`, the round with its window and deadlines).
//!
//! It does what the `elasticps worker` loop does over the runtime's `Client`: register,
//! define the model, pull clock 0, then per iteration compute (a modelled time) and push
//! the gradients of clock t while pulling clock t + 1, fused into one push_pull per block
//! if [`TrainingLoop::fuse`] (the last iteration of workers other than rank 0 only
//! pushes), tell the scheduler it is done. Its link to the scheduler is a
//! [`session::Session`] (heartbeats, redial, reattach, calls made again). Every rule of
//! the worker's connections is the client machine's: this driver only dials and writes
//! on simulated links what it is told, hands back frames, closes and timeouts, and wakes
//! the machine at its `poll_timeout`, as the runtime's driver does on sockets. The
//! gradients are a function of (rank, clock, block) chosen by the run, so a test knows
//! the exact final parameters. With a [`TableTraining`], each iteration's tensor round is
//! followed by a row round that pushes gradient rows to an embedding table (every block
//! of it, as the client's `push_rows`), planned again when a block of the table is split
//! under it.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use elasticps_core::model::{BlockId, TableSpec, TensorSpec};
use elasticps_core::optimizer::TensorOptimizer;
use elasticps_core::sync::Clock;
use elasticps_wire::{Control, Credential, Message, Values};

use crate::cluster::{Outbox, Role};
use crate::link::SchedLink;
use crate::net::{LostWhy, NodeId};
use elasticps_node::session::{self, REATTACH_ID};
use elasticps_node::worker::{Client, ClientEvent, Effect, Finished, Op, PushOp, RowsOp, Worker};
use elasticps_node::{ConnId, Machine};

pub use elasticps_node::timing::WORKER_STATS_US;

/// Timer tokens.
const SESSION: u64 = 0;
const COMPUTE_DONE: u64 = 1;
const WAKE: u64 = 2;

/// Request ids on the scheduler's connection (the plan's tags are >= 2^32).
const REGISTER: u64 = 1;
const DEFINE: u64 = 2;
const DONE: u64 = 3;
const START: u64 = 4;
const SET_OPTIMIZER: u64 = 5;
const FIRST_LAYOUT_CALL: u64 = 16;

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
    /// `SetOptimizer` calls the scheduler answered `Ok` (every live server applied them).
    pub optimizers_set: u64,
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
    /// The client machine: connections, layout, `Hello`, the round ([`Client`]).
    client: Option<Client>,
    /// The client's connections and the simulated links carrying them, both ways.
    links: BTreeMap<ConnId, ConnId>,
    by_link: HashMap<ConnId, ConnId>,
    /// The wake-up timer is set for this time (a later `poll_timeout` is set when it
    /// fires).
    armed: Option<u64>,
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
            client: None,
            links: BTreeMap::new(),
            by_link: HashMap::new(),
            armed: None,
            all,
            next_call: FIRST_LAYOUT_CALL,
            round_started_us: 0,
            record: WorkerRecord::default(),
            grads: Vec::new(),
            link: SchedLink::new(0, SESSION),
        }
    }

    /// A lost scheduler is redialled for `us`: the worker reattaches (`ReattachWorker`)
    /// and makes its unanswered calls again, as every node's [`session::Session`] does.
    /// Its data traffic goes on meanwhile.
    pub fn with_scheduler_retry(mut self, us: u64) -> Self {
        self.link = SchedLink::new(us, SESSION);
        self
    }

    /// Sends `SetOptimizer` of `tensor` to the scheduler (alone; it sends it on to every
    /// server); its `Ok` counts in [`WorkerRecord::optimizers_set`], an error fails the
    /// worker.
    pub fn set_optimizer(&mut self, out: &mut Outbox<'_>, tensor: u32, optimizer: TensorOptimizer) {
        self.call_scheduler(out, SET_OPTIMIZER, Control::SetOptimizer { tensor, optimizer }.into());
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
        tracing::warn!(rank = ?self.rank, %why, "simulated worker fails");
        self.stage = Stage::Failed(why);
        self.by_link.clear();
        for conn in self.link.conn().into_iter().chain(std::mem::take(&mut self.links).into_values()) {
            out.close(conn);
        }
    }

    fn call_scheduler(&mut self, out: &mut Outbox<'_>, request_id: u64, msg: Message) {
        self.session(out, session::Event::Send { request_id, msg });
    }

    /// Hands the client `event` now and carries out what it asks.
    fn drive(&mut self, out: &mut Outbox<'_>, event: ClientEvent<'_>) {
        let Some(client) = self.client.as_mut() else { return };
        let mut effects = Vec::new();
        client.handle(out.now_us(), event, &mut effects);
        self.carry_out(out, effects);
    }

    /// Carries out the client's effects: dials and writes on simulated links (a write on
    /// a closed link is that connection closed), asks the scheduler for layouts, and
    /// moves the training loop on when a round ends.
    fn carry_out(&mut self, out: &mut Outbox<'_>, effects: Vec<Effect>) {
        let mut todo = VecDeque::from(effects);
        while let Some(effect) = todo.pop_front() {
            if matches!(self.stage, Stage::Done | Stage::Failed(_)) {
                return;
            }
            let mut closed = None;
            match effect {
                Effect::Dial { conn, addr, .. } => match NodeId::from_addr(&addr) {
                    Some(node) => {
                        let link = out.connect(node);
                        self.links.insert(conn, link);
                        self.by_link.insert(link, conn);
                        let Some(client) = self.client.as_mut() else { return };
                        let mut more = Vec::new();
                        client.handle(out.now_us(), ClientEvent::Dialled { conn }, &mut more);
                        todo.extend(more);
                    }
                    None => closed = Some(conn),
                },
                Effect::Send { conn, request_id, msg } => {
                    if !self.links.get(&conn).is_some_and(|l| out.send(*l, request_id, msg)) {
                        closed = Some(conn);
                    }
                }
                Effect::Request { conn, tag, block, op, .. } => {
                    let msg = self.message(&block, op);
                    if !self.links.get(&conn).is_some_and(|l| out.send(*l, tag, msg)) {
                        closed = Some(conn);
                    }
                }
                Effect::Close { conn } => {
                    if let Some(link) = self.links.remove(&conn) {
                        self.by_link.remove(&link);
                        out.close(link);
                    }
                }
                Effect::RefreshLayout => {
                    self.record.refreshes += 1;
                    let id = self.next_call;
                    self.next_call += 1;
                    self.call_scheduler(out, id, Control::GetLayout.into());
                }
                Effect::RoundDone(finished) => self.round_done(out, finished),
                Effect::Replan { .. } => {
                    self.record.recuts += 1;
                    self.start_rows(out);
                }
                Effect::Answered(_) => {}
                Effect::Failed(e) => self.fail(out, e.to_string()),
            }
            if let Some(conn) = closed {
                if let Some(link) = self.links.remove(&conn) {
                    self.by_link.remove(&link);
                }
                let Some(client) = self.client.as_mut() else { return };
                let mut more = Vec::new();
                client.handle(out.now_us(), ClientEvent::Closed { conn }, &mut more);
                todo.extend(more);
            }
        }
        self.arm(out);
    }

    /// The message of a round's request: `op` of `block`, with this worker's gradient, in
    /// the block's wire dtype as the layout names it (f32 unless the balancer narrowed it).
    fn message(&mut self, block: &elasticps_core::model::BlockSpec, op: Op) -> Message {
        let rank = self.rank.unwrap_or(0);
        let dtype = self
            .client
            .as_ref()
            .and_then(Client::layout)
            .map_or_else(Default::default, |l| elasticps_core::balance::wire::dtype_of(&l.wire, block.id));
        let narrow = |values: Values| match dtype {
            elasticps_wire::Dtype::F32 => values,
            d => Values::encoded(&values.to_f32s(), d),
        };
        match op {
            Op::Push(clock) => {
                let g = (self.work.grad)(rank, clock, block.id);
                Message::Push { block: block.id, clock, values: narrow(self.gradient(block.id, block.len, g)) }
            }
            Op::Init => Message::Init { block: block.id, values: Values::from_vec(vec![0.0; block.len]) },
            Op::Pull(clock) => Message::Pull { block: block.id, clock, reply: dtype },
            Op::PushPull(clock) => {
                let g = (self.work.grad)(rank, clock, block.id);
                Message::PushPull {
                    block: block.id,
                    clock,
                    values: narrow(self.gradient(block.id, block.len, g)),
                    reply: dtype,
                }
            }
            Op::PushRows(clock) => self.row_push(rank, clock, block),
            Op::PullRows(clock) => {
                Message::PullRows { block: block.id, clock, ids: Default::default(), reply: elasticps_wire::Dtype::F32 }
            }
        }
    }

    /// Starts the row round of the current stage ([`TableTraining`]).
    fn start_rows(&mut self, out: &mut Outbox<'_>) {
        let (Some(client), Stage::PushingRows(t)) = (self.client.as_mut(), &self.stage) else { return };
        let mut effects = Vec::new();
        match client.start_rows(out.now_us(), 0, RowsOp::Push(*t), &|_| true, &mut effects) {
            Ok(()) => self.carry_out(out, effects),
            Err(e) => self.fail(out, e.to_string()),
        }
    }

    /// Starts the round of the current stage.
    fn start_round(&mut self, out: &mut Outbox<'_>) {
        let (push, pull) = match self.stage {
            Stage::Starting => (None, Some(self.start)),
            Stage::Communicating(t) => {
                let last_pulls = t + 1 < self.work.iterations || self.rank == Some(0);
                (Some(PushOp::Grad(t)), last_pulls.then_some(t + 1))
            }
            _ => return,
        };
        let Some(client) = self.client.as_mut() else { return };
        self.round_started_us = out.now_us();
        let all = &self.all[..];
        let mut effects = Vec::new();
        match client.start(out.now_us(), push.map(|p| (p, all)), pull.map(|c| (c, all)), &mut effects) {
            Ok(_) => self.carry_out(out, effects),
            Err(e) => self.fail(out, e.to_string()),
        }
    }

    /// Sets the timer for the client's `poll_timeout`, unless one is set for earlier (that
    /// one sets the next when it fires).
    fn arm(&mut self, out: &mut Outbox<'_>) {
        let Some(at) = self.client.as_ref().and_then(Machine::poll_timeout) else { return };
        if self.armed.is_none_or(|armed| at < armed) {
            self.armed = Some(at);
            out.wake_at(at, WAKE);
        }
    }

    /// The `PushRows` of row block `block` at `clock`: the step's rows in its range
    /// ([`TableTraining`]), or none.
    fn row_push(&self, rank: u32, clock: Clock, block: &elasticps_core::model::BlockSpec) -> Message {
        let dim = block.row_range().map_or(1, |(_, _, d)| d);
        let (rows, grads): (Vec<u64>, Vec<f32>) = match &self.work.table {
            Some(t) => {
                let rows: Vec<u64> = (t.ids)(rank, clock).into_iter().filter(|r| block.holds(*r)).collect();
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

    /// A round ended: its waits recorded, its load report sent, the training loop on.
    fn round_done(&mut self, out: &mut Outbox<'_>, finished: Finished) {
        let now = out.now_us();
        for (server, us) in finished.waited {
            let w = &mut self.record.wait_us_by_server;
            if w.len() <= server as usize {
                w.resize(server as usize + 1, 0);
            }
            w[server as usize] += us;
        }
        if let Some(report) = finished.report {
            self.call_scheduler(out, 0, Control::WorkerLoad(report).into());
        }
        match self.stage {
            Stage::Starting => {
                self.record.started_us = now;
                if self.start < self.work.iterations {
                    self.compute(out, self.start);
                } else {
                    self.finish(out);
                }
            }
            Stage::Communicating(t) if self.work.table.is_some() => {
                self.stage = Stage::PushingRows(t);
                self.start_rows(out);
            }
            Stage::Communicating(t) | Stage::PushingRows(t) => {
                self.record.comm_us.push(now - self.round_started_us);
                self.record.iteration_ends_us.push(now);
                if t + 1 < self.work.iterations {
                    self.compute(out, t + 1);
                } else {
                    self.finish(out);
                }
            }
            _ => {}
        }
    }

    /// Tells the scheduler this worker is done.
    fn finish(&mut self, out: &mut Outbox<'_>) {
        self.stage = Stage::Finishing;
        let rank = self.rank.unwrap_or(0);
        self.call_scheduler(out, DONE, Control::WorkerDone { rank }.into());
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
            (REGISTER, Message::Control(Control::Welcome { node_id, credential, .. })) => {
                self.rank = Some(node_id);
                let plan = Worker::new(node_id, self.work.timeout_us, WORKER_STATS_US, out.now_us());
                let plan = plan.with_fusion(self.work.fuse).with_window(self.work.window);
                self.client = Some(Client::new(plan, credential));
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
                self.drive(out, ClientEvent::Layout(Arc::new(layout)));
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
            (SET_OPTIMIZER, Message::Control(Control::Ok)) => self.record.optimizers_set += 1,
            (DONE, _) => {
                self.stage = Stage::Done;
                self.by_link.clear();
                for link in std::mem::take(&mut self.links).into_values() {
                    out.close(link);
                }
            }
            (0, Message::Control(Control::Shutdown { reason })) => {
                if !matches!(self.stage, Stage::Done | Stage::Finishing) {
                    self.fail(out, format!("shut down by the scheduler: {reason}"));
                }
            }
            (id, Message::Control(Control::Layout(layout))) if id >= FIRST_LAYOUT_CALL => {
                self.drive(out, ClientEvent::Layout(Arc::new(layout)));
            }
            // The balancer changed the wire dtype of blocks (--balance-compress): a newer
            // layout, sent unasked.
            (0, Message::Control(Control::Layout(layout))) => {
                self.drive(out, ClientEvent::LayoutPushed(Arc::new(layout)));
            }
            // A failover: the lost servers are closed connections, whose host may be
            // silent (no close would come).
            (0, msg) => self.drive(out, ClientEvent::Failover(&msg)),
            (id, other) => self.fail(out, format!("the scheduler answered call {id} with {:?}", other.kind())),
        }
    }
}

impl Role for WorkerRole {
    fn exit_status(&self) -> Option<(bool, String)> {
        match &self.stage {
            Stage::Done => Some((true, "exit status 0".into())),
            Stage::Failed(why) => Some((false, format!("exit status 1: {why}"))),
            _ => None,
        }
    }

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
        let Some(&conn) = self.by_link.get(&conn) else {
            // A connection this worker closed (a lost or departed server): what was still
            // on its way is never read, as a runtime's dropped connection's.
            return;
        };
        if let Some(round) = self.client.as_ref().and_then(Client::round) {
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
        }
        self.drive(out, ClientEvent::Frame { conn, request_id, msg: &msg });
    }

    fn on_lost(&mut self, out: &mut Outbox<'_>, conn: ConnId, why: LostWhy) {
        if matches!(self.stage, Stage::Done | Stage::Failed(_)) || why == LostWhy::ClosedHere {
            // ClosedHere: a connection this worker closed itself; nothing is asked of it.
            return;
        }
        if self.link.is(conn) {
            // Redialled if the session says so (a restarted scheduler), else the end.
            tracing::debug!(rank = ?self.rank, ?why, "simulated worker lost the scheduler");
            return self.session(out, session::Event::Lost);
        }
        let Some(conn) = self.by_link.remove(&conn) else { return };
        self.links.remove(&conn);
        self.drive(out, ClientEvent::Closed { conn });
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
                match self.client.as_ref().and_then(Machine::poll_timeout) {
                    Some(at) if at <= out.now_us() => self.drive(out, ClientEvent::Timeout),
                    _ => self.arm(out),
                }
            }
            _ => {}
        }
    }
}
