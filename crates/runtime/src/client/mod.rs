//! The worker client: the API a user's training loop calls.
//!
//! ```text
//! let mut client = Client::connect(ClientOptions::new("127.0.0.1:7000")).await?;
//! client.register_model(tensors).await?;          // waits until every server holds its blocks
//! for t in 0..iterations {
//!     client.pull(t, &mut params).await?;          // one request per block, all in flight at once
//!     let grads = compute(&params);
//!     client.push(t, &grads).await?;
//! }
//! client.finish().await?;
//! ```
//!
//! A server that no longer owns a block answers `Moved`, naming the new owner; the client
//! resends only the moved blocks, there at once when it knows that server, else after
//! refreshing the layout from the scheduler (the plan decides which).
//!
//! Which servers to connect to, what to say first, what a round sends where and when (its
//! window per server, its deadlines), what it resends, and how a call outside a round
//! follows `Moved` and waits out `NotReady`, is the client machine of
//! [`elasticps_node::worker::Client`]. This module holds the user's API; `round.rs` is
//! the machine's world in [`crate::driver::drive`] (it carries the machine's effects
//! out), `frames.rs` the bytes of requests and replies, `server_conn.rs` one server's
//! connection, `group.rs` one push per host (a host group's leader sums its members'
//! gradients before the round and hands them its pulled values after it).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use elasticps_core::compress::Sparsifier;
use elasticps_core::model::{TableSpec, TensorSpec};
use elasticps_core::optimizer::TensorOptimizer;
use elasticps_core::sync::Clock;
use elasticps_node::ConnId;
use elasticps_node::timing::REQUEST_TIMEOUT_US;
use elasticps_node::worker::{self, PushOp, RowsOp, Worker};
use elasticps_wire::{Codec, Control, Credential, Dtype, Layout, Message};

use crate::error::{Result, RuntimeError};
use crate::metrics::WorkerMetrics;

mod compress;
mod frames;
mod group;
mod opt_state;
mod round;
mod rows;
mod server_conn;
use crate::session::{DEFAULT_SCHEDULER_RETRY, EndWatch, Notifications, SchedLink};
use crate::{CALL_TIMEOUT, Micros, STATS_INTERVAL};
use elasticps_node::session::SessionConfig;
pub use group::{GroupOptions, vars as group_vars};
use server_conn::ServerConn;

/// Requests of a round in flight to one server, by default ([`ClientOptions::window`]):
/// [`elasticps_node::timing::DEFAULT_WINDOW`].
pub use elasticps_node::timing::DEFAULT_WINDOW;

/// How a worker connects.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// The scheduler's address.
    pub scheduler: String,
    /// Frame codec (cluster secret, maximum payload).
    pub codec: Codec,
    /// How long one push or pull may wait for its server (a held pull waits for the
    /// slowest worker, so this is generous).
    pub request_timeout: Duration,
    /// Count iterations and waits here (served by a [`crate::metrics::MetricsEndpoint`]).
    pub metrics: Option<Arc<WorkerMetrics>>,
    /// The window: at most this many requests of a round in flight to one server (at
    /// least 1); the round holds the others back and sends them as replies come back.
    pub window: usize,
    /// Send a block pushed at clock t and pulled at t + 1 in the same round (a
    /// [`Client::push_pull`]) as one `PushPull` request, answered by the pull's reply:
    /// one round trip instead of two. On by default; off, the push and then, once its
    /// server acknowledged the round's pushes, the pull (to compare).
    pub fuse: bool,
    /// Rejoin as this rank (a worker restarted after it was lost) instead of registering
    /// as a new one: the scheduler welcomes it once every server took it back, and
    /// [`Client::start_clock`] says the clock it goes on from.
    pub rank: Option<u32>,
    /// How long to retry a lost scheduler connection (a scheduler restarted with
    /// `--state-dir`) before the job is given up; zero: never.
    pub scheduler_retry: Duration,
    /// The dtype every tensor's pushes and pull replies travel in (`--wire-dtype`),
    /// unless [`Client::set_wire_dtype`] chose another for it. Servers keep f32 values;
    /// initial values always travel as f32.
    pub wire_dtype: Dtype,
    /// Compress every tensor's gradient (`topk:0.01`, `randomk:0.01`) with error
    /// feedback: what is not sent joins the tensor's next gradient (`compress.rs`).
    /// `None` (the default): gradients are pushed whole.
    pub compress: Option<Sparsifier>,
    /// This worker's host group (one push per host: the leader, local rank 0, pushes the
    /// sum of the group's gradients; [`GroupOptions::from_env`], set by `elasticps
    /// launch` on a job across hosts). `None` (the default): it pushes its own.
    pub group: Option<GroupOptions>,
}

impl ClientOptions {
    /// Defaults: no secret, 64 MiB frames, 5-minute request timeout, fused push_pull.
    pub fn new(scheduler: impl Into<String>) -> Self {
        Self {
            scheduler: scheduler.into(),
            codec: Codec::new(b"", elasticps_wire::DEFAULT_MAX_PAYLOAD),
            request_timeout: Duration::from_micros(REQUEST_TIMEOUT_US),
            metrics: None,
            window: DEFAULT_WINDOW,
            fuse: true,
            rank: None,
            scheduler_retry: DEFAULT_SCHEDULER_RETRY,
            wire_dtype: Dtype::F32,
            compress: None,
            group: None,
        }
    }
}

/// Time a worker spent waiting on each server during the last `pull` or `push`.
#[derive(Clone, Debug, Default)]
pub struct Waits {
    /// `per_server[s]`: time from sending the first request to server `s` until its
    /// last reply arrived.
    pub per_server: Vec<Duration>,
}

/// A connected worker.
pub struct Client {
    rank: u32,
    /// The credential of this worker's `Welcome`: said in the `Hello` of every server
    /// connection.
    credential: Credential,
    num_workers: u32,
    opts: ClientOptions,
    sched: SchedLink,
    /// The connections to the servers the machine dialled, read and written by the
    /// driver loop itself (`round.rs`).
    servers: HashMap<ConnId, ServerConn>,
    /// What the scheduler's connection said about the end of the job (see [`Ending`]).
    ending: tokio::sync::watch::Receiver<Ending>,
    waits: Waits,
    /// The client machine: connections, layout, `Hello`, calls, the round and its plan.
    machine: worker::Client,
    /// The time handed to the machine.
    clock: Micros,
    /// The dtype of each tensor on the wire, where it is not [`ClientOptions::wire_dtype`].
    wire: HashMap<u32, Dtype>,
    /// Gradient compression with its residuals ([`ClientOptions::compress`],
    /// [`Client::set_sparsifier`]).
    compression: compress::Compression,
    /// This worker's part in its host group, once its first round started it.
    group: Option<group::Group>,
}

impl Client {
    /// Registers with the scheduler and learns this worker's rank.
    pub async fn connect(opts: ClientOptions) -> Result<Client> {
        // The reattach names the rank and credential of the Welcome, known once it came.
        let me: Arc<std::sync::OnceLock<(u32, Credential)>> = Arc::default();
        let reattach = {
            let me = me.clone();
            Box::new(move || {
                let (rank, credential) = me.get()?.clone();
                Some(Control::ReattachWorker { rank, credential }.into())
            })
        };
        let config = SessionConfig { retry_us: micros(opts.scheduler_retry), heartbeats: true };
        let (sched, notes) = SchedLink::connect(&opts.scheduler, opts.codec.clone(), config, reattach).await?;
        let (hello, what) = match opts.rank {
            None => (Control::RegisterWorker, "the scheduler to accept this worker".to_string()),
            Some(rank) => {
                (Control::RejoinWorker { rank }, format!("the scheduler to take worker {rank} back (every server)"))
            }
        };
        let (rank, num_workers, credential) = match sched.call(hello.into(), CALL_TIMEOUT, || what).await? {
            Message::Control(Control::Welcome { node_id, num_workers, credential, .. }) => {
                (node_id, num_workers, credential)
            }
            other => return Err(RuntimeError::unexpected("scheduler", "Welcome", &other)),
        };
        let _ = me.set((rank, credential.clone()));
        let (tell, ending) = tokio::sync::watch::channel(Ending::default());
        tokio::spawn(watch_ending(notes, sched.end_watch(), tell));
        tracing::info!(rank, num_workers, "worker registered");
        if let Some(m) = &opts.metrics {
            m.registered_as(rank);
        }
        let clock = Micros::new();
        let worker = Worker::new(rank, micros(opts.request_timeout), micros(STATS_INTERVAL), clock.now())
            .with_fusion(opts.fuse)
            .with_window(opts.window);
        Ok(Client {
            rank,
            compression: compress::Compression::new(opts.compress, rank),
            machine: worker::Client::new(worker, credential.clone()),
            credential,
            num_workers,
            opts,
            sched,
            servers: HashMap::new(),
            ending,
            waits: Waits::default(),
            clock,
            wire: HashMap::new(),
            group: None,
        })
    }

    /// This worker's rank, `0..num_workers`.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The credential the scheduler issued this worker (what it says in the `Hello` of
    /// its server connections).
    pub fn credential(&self) -> &Credential {
        &self.credential
    }

    /// True if this worker rejoined the job with its rank ([`ClientOptions::rank`]): the
    /// others are past their start, so it sets no initial values and waits in no barrier
    /// of theirs.
    pub fn rejoined(&self) -> bool {
        self.opts.rank.is_some()
    }

    /// Number of workers in the job.
    pub fn num_workers(&self) -> u32 {
        self.num_workers
    }

    /// The model's layout (tensors, blocks, owners), once registered.
    pub fn layout(&self) -> Option<&Layout> {
        self.machine.layout().map(|l| &**l)
    }

    /// Time waited per server in the last pull or push.
    pub fn last_waits(&self) -> &Waits {
        &self.waits
    }

    /// Defines the model (the first worker's definition wins; others must be equal) and
    /// waits until every server holds its blocks. Returns the tensors, in order.
    pub async fn register_model(&mut self, tensors: Vec<TensorSpec>) -> Result<&[TensorSpec]> {
        self.register_model_with(tensors, Vec::new()).await
    }

    /// As [`Client::register_model`], with each tensor's own optimizer (`optimizers` empty,
    /// or one entry per tensor; `None`: the job's `--optimizer` and `--lr`).
    pub async fn register_model_with(
        &mut self,
        tensors: Vec<TensorSpec>,
        optimizers: Vec<Option<TensorOptimizer>>,
    ) -> Result<&[TensorSpec]> {
        self.register_model_with_tables(tensors, optimizers, Vec::new()).await
    }

    /// As [`Client::register_model_with`], with embedding tables (their rows pulled and
    /// pushed by id: [`Client::pull_rows`], [`Client::push_rows`]). The tables' names are
    /// unique among the tensors' and theirs.
    pub async fn register_model_with_tables(
        &mut self,
        tensors: Vec<TensorSpec>,
        optimizers: Vec<Option<TensorOptimizer>>,
        tables: Vec<TableSpec>,
    ) -> Result<&[TensorSpec]> {
        let reply = self
            .call_scheduler(Control::DefineModel { tensors, optimizers, tables }.into(), CALL_TIMEOUT, || {
                "the scheduler to place the model (every server must join and load its blocks)".into()
            })
            .await?;
        self.install_layout(reply).await?;
        self.compression.reset();
        Ok(self.layout().map(|l| &l.partition.tensors[..]).unwrap_or_default())
    }

    /// The clock this job starts at: 0, or the clock of the checkpoint it resumed from
    /// (`--resume`). A worker then pulls that clock first, goes on from it, and sets no
    /// initial values (the blocks hold the checkpoint's).
    pub async fn start_clock(&mut self) -> Result<Clock> {
        match self
            .call_scheduler(Control::GetStartClock.into(), CALL_TIMEOUT, || {
                "the scheduler to say the job's first clock".into()
            })
            .await?
        {
            Message::Control(Control::StartClock { clock }) => Ok(clock),
            other => Err(RuntimeError::unexpected("scheduler", "StartClock", &other)),
        }
    }

    /// Sets the initial values of every tensor (the first worker's parameters, so that
    /// every worker starts from them: a broadcast through the servers). Only before any
    /// push; follow it with [`Client::barrier`] so that no worker pulls earlier.
    pub async fn init_values<T: AsRef<[f32]>>(&mut self, values: &[T]) -> Result<()> {
        self.check_shapes("init", values.iter().map(|v| Some(v.as_ref().len())))?;
        let values: Vec<Option<&[f32]>> = values.iter().map(|v| Some(v.as_ref())).collect();
        self.round(Some((PushOp::Init, &values)), None).await
    }

    /// Waits until every worker still in the job has called `barrier` (ps-lite's
    /// `Barrier`, `torch.distributed.barrier`).
    pub async fn barrier(&mut self) -> Result<()> {
        match self
            .call_scheduler(Control::Barrier.into(), self.opts.request_timeout, || {
                format!("worker {} waits in a barrier for every other worker", self.rank)
            })
            .await?
        {
            Message::Control(Control::Ok) => Ok(()),
            other => Err(RuntimeError::unexpected("scheduler", "Ok", &other)),
        }
    }

    /// Gives tensor `tensor` (its index in the model) a new optimizer, e.g. the learning
    /// rate of a schedule's next step: the scheduler records it (for servers that join
    /// later, and the layout), sends it on to every server and answers once every live
    /// server applied it; every push sent after this returns uses it.
    pub async fn set_optimizer(&mut self, tensor: u32, optimizer: TensorOptimizer) -> Result<()> {
        let msg = Message::from(Control::SetOptimizer { tensor, optimizer });
        let what = || format!("every server to take the optimizer of tensor {tensor} (through the scheduler)");
        match self.call_scheduler(msg, CALL_TIMEOUT, what).await? {
            Message::Control(Control::Ok) => Ok(()),
            other => Err(RuntimeError::unexpected("scheduler", "Ok", &other)),
        }
    }

    /// Tensor `tensor`'s pushes and pull replies travel in `dtype` from now on (Horovod's
    /// `compression=`, per tensor); the job's [`ClientOptions::wire_dtype`] otherwise.
    pub fn set_wire_dtype(&mut self, tensor: u32, dtype: Dtype) {
        self.wire.insert(tensor, dtype);
    }

    /// Tensor `tensor`'s gradients are compressed by `sparsifier` (top-k, random-k, with
    /// error feedback) from now on; `None`: pushed whole. The job's
    /// [`ClientOptions::compress`] otherwise.
    pub fn set_sparsifier(&mut self, tensor: u32, sparsifier: Option<Sparsifier>) {
        self.compression.set(tensor as usize, sparsifier);
    }

    /// The dtype tensor `tensor` travels in.
    pub fn wire_dtype(&self, tensor: u32) -> Dtype {
        self.wire.get(&tensor).copied().unwrap_or(self.opts.wire_dtype)
    }

    /// Fresh zeroed buffers shaped like the model's tensors, for [`Client::pull`].
    pub fn zeros(&self) -> Vec<Vec<f32>> {
        self.layout().map_or_else(Vec::new, |l| l.partition.tensors.iter().map(|t| vec![0.0; t.len()]).collect())
    }

    /// Pulls every tensor at clock `clock` into `params` (shaped like [`Client::zeros`]).
    /// The server holds the pull as its sync policy says.
    pub async fn pull<P: AsMut<[f32]>>(&mut self, clock: Clock, params: &mut [P]) -> Result<()> {
        let mut params: Vec<Option<&mut [f32]>> = params.iter_mut().map(|p| Some(p.as_mut())).collect();
        self.check_shapes("pull", params.iter().map(|p| p.as_ref().map(|p| p.len())))?;
        self.round(None, Some((clock, &mut params))).await
    }

    /// Pushes the gradient of every tensor for clock `clock`; an empty gradient pushes
    /// none for its tensor (a parameter unused in this step: every block of it gets a push
    /// without a gradient, PROTOCOL.md §4).
    pub async fn push<G: AsRef<[f32]>>(&mut self, clock: Clock, grads: &[G]) -> Result<()> {
        self.check_shapes("push", grads.iter().map(|g| pushed_len(Some(g.as_ref()))))?;
        let grads: Vec<Option<&[f32]>> = grads.iter().map(|g| Some(g.as_ref())).collect();
        self.round(Some((PushOp::Grad(clock), &grads)), None).await
    }

    /// Pushes the gradients of clock `clock` and pulls the parameters of clock
    /// `clock + 1`: each block as one `PushPull` request, whose reply (the pull's, which
    /// the sync policy may hold) acknowledges the push too ([`ClientOptions::fuse`]; without
    /// it, the pull of a server's blocks is sent as soon as that server acknowledged their
    /// pushes, without waiting for the other servers). [`Client::last_waits`] then tells
    /// how long each server took.
    pub async fn push_pull<G: AsRef<[f32]>, P: AsMut<[f32]>>(
        &mut self,
        clock: Clock,
        grads: &[G],
        params: &mut [P],
    ) -> Result<()> {
        let next = clock.checked_add(1).ok_or_else(|| RuntimeError::Usage("clock overflow".into()))?;
        let grads: Vec<Option<&[f32]>> = grads.iter().map(|g| Some(g.as_ref())).collect();
        let mut params: Vec<Option<&mut [f32]>> = params.iter_mut().map(|p| Some(p.as_mut())).collect();
        self.check_shapes("push", grads.iter().map(|g| pushed_len(*g)))?;
        self.check_shapes("pull", params.iter().map(|p| p.as_ref().map(|p| p.len())))?;
        self.round(Some((PushOp::Grad(clock), &grads)), Some((next, &mut params))).await
    }

    /// A round over some of the tensors: `grads[t]` (if `Some`) is pushed at `push_clock`,
    /// `params[t]` (if `Some`) pulled at `pull_clock`, each as long as tensor `t`; a tensor
    /// in both is pulled once its push was acknowledged, or, if `pull_clock` is
    /// `push_clock + 1` and [`ClientOptions::fuse`] is on, with its push in one request.
    /// Both lists are empty or have one entry per tensor; an empty gradient pushes none
    /// for its tensor ([`Client::push`]). This is what a client that pushes each gradient
    /// as soon as it is ready (PyTorch's backward hooks) calls, one tensor or a few at a
    /// time.
    pub async fn round_tensors(
        &mut self,
        push: Option<(Clock, &[Option<&[f32]>])>,
        pull: Option<(Clock, &mut [Option<&mut [f32]>])>,
    ) -> Result<()> {
        if let Some((_, grads)) = push {
            self.check_shapes("push", grads.iter().map(|g| pushed_len(*g)))?;
        }
        if let Some((_, params)) = &pull {
            self.check_shapes("pull", params.iter().map(|p| p.as_ref().map(|p| p.len())))?;
        }
        self.round(push.map(|(c, g)| (PushOp::Grad(c), g)), pull).await
    }

    /// The model's table `name`: its index (what [`Client::pull_rows`] and
    /// [`Client::push_rows`] take) and spec.
    pub fn table(&self, name: &str) -> Option<(u32, &TableSpec)> {
        self.layout()?.partition.table(name)
    }

    /// Pulls rows `ids` of table `table` (its index) at clock `clock` into `out`, row after
    /// row in the order asked (`ids.len() x dim` values; an id asked twice gets its row
    /// twice). One `PullRows` per block holding some of the ids, all servers at once; each
    /// server holds it as its sync policy says, as a pull. An id past the table's rows or
    /// an `out` of the wrong length is refused ([`RuntimeError::Usage`]) before anything
    /// is sent.
    pub async fn pull_rows(&mut self, clock: Clock, table: u32, ids: &[u64], out: &mut [f32]) -> Result<()> {
        self.rows_call(clock, table, RowCall::Pull { ids, out }).await
    }

    /// Pushes the gradient rows `grads` (`ids.len() x dim`, row after row) of rows `ids`
    /// of table `table` at clock `clock`: one `PushRows` to every block of the table, with
    /// the rows of its range, or none (an empty push still counts the clock there, so the
    /// sync policy keeps its meaning per block). A row named twice is summed by its
    /// server. Call it once per table and clock, with no ids for a table the step did not
    /// touch.
    pub async fn push_rows(&mut self, clock: Clock, table: u32, ids: &[u64], grads: &[f32]) -> Result<()> {
        self.rows_call(clock, table, RowCall::Push { ids, grads }).await
    }

    /// Pushes "no gradient" for table `table` at clock `clock` (the table was not used in
    /// the step: PyTorch's `grad is None`): every block of the table counts the clock and
    /// takes no optimizer step, where [`Client::push_rows`] with no id is a step that
    /// touched no row.
    pub async fn push_rows_none(&mut self, clock: Clock, table: u32) -> Result<()> {
        self.rows_call(clock, table, RowCall::NoGradient).await
    }

    /// One row operation of table `table` at `clock`, planned from the current model and,
    /// when a block of the table was split while it ran, planned and sent again from the
    /// refreshed one (the blocks that took it answer duplicates), as often as the machine
    /// allows ([`elasticps_node::worker::replan_rows`]).
    async fn rows_call(&mut self, clock: Clock, table: u32, mut call: RowCall<'_>) -> Result<()> {
        loop {
            let layout = self.current_layout()?;
            let done = match &mut call {
                RowCall::Pull { ids, out } => {
                    let (payloads, mut sink) = rows::pull_plan(&layout.partition, table, ids, out)?;
                    if payloads.by_block.is_empty() {
                        return Ok(());
                    }
                    self.rows_round(table, RowsOp::Pull(clock), &payloads, Some(&mut sink)).await
                }
                RowCall::Push { ids, grads } => {
                    let payloads = rows::push_plan(&layout.partition, table, ids, grads)?;
                    self.rows_round(table, RowsOp::Push(clock), &payloads, None).await
                }
                RowCall::NoGradient => {
                    let payloads = rows::no_gradient_plan(&layout.partition, table)?;
                    self.rows_round(table, RowsOp::Push(clock), &payloads, None).await
                }
            };
            if done? {
                return Ok(());
            }
            tracing::debug!(rank = self.rank, table, "row round again");
        }
    }

    /// Tells the scheduler this worker is done. Servers stop waiting for it.
    pub async fn finish(mut self) -> Result<()> {
        self.end_group().await;
        let reply = self
            .call_scheduler(Control::WorkerDone { rank: self.rank }.into(), CALL_TIMEOUT, || {
                "the scheduler to acknowledge WorkerDone".into()
            })
            .await;
        self.sched.close();
        reply.map(|_| ())
    }

    /// A call to the scheduler ([`call_scheduler`]).
    async fn call_scheduler(&self, msg: Message, timeout: Duration, what: impl FnOnce() -> String) -> Result<Message> {
        call_scheduler(&self.sched, msg, timeout, what).await
    }

    /// The layout, or the error for a client that has not registered the model.
    fn current_layout(&self) -> Result<Arc<Layout>> {
        self.machine.layout().cloned().ok_or_else(|| RuntimeError::Usage("register_model first".into()))
    }

    /// Checks (without allocating: this is on every push and pull) that `lens` has one
    /// entry per tensor of the model and that each given length (`None`: the tensor is not
    /// in this round) is that tensor's.
    fn check_shapes(&self, what: &str, lens: impl ExactSizeIterator<Item = Option<usize>>) -> Result<()> {
        let layout = self.current_layout()?;
        let tensors = &layout.partition.tensors;
        if lens.len() != tensors.len() {
            return Err(RuntimeError::Usage(format!(
                "{what} lists {} tensors, the model has {}",
                lens.len(),
                tensors.len()
            )));
        }
        for (t, len) in tensors.iter().zip(lens) {
            if let Some(len) = len.filter(|l| *l != t.len()) {
                return Err(RuntimeError::Usage(format!(
                    "{what}: tensor {:?} holds {} values, {len} were given",
                    t.name,
                    t.len()
                )));
            }
        }
        Ok(())
    }
}

/// A call to the scheduler. When its connection closed, the error is the job's end as the
/// link recorded it before failing the call (the scheduler's `Shutdown` reason, or why it
/// was lost).
async fn call_scheduler(
    sched: &SchedLink,
    msg: Message,
    timeout: Duration,
    what: impl FnOnce() -> String,
) -> Result<Message> {
    match (sched.call(msg, timeout, what).await, sched.end()) {
        (Err(RuntimeError::Closed(_)), Some(end)) => Err(RuntimeError::Shutdown(end.reason().to_string())),
        (result, _) => result,
    }
}

/// A lost server connection is explained by the scheduler's shutdown (`ending`), if there
/// was one.
fn explain(ending: &tokio::sync::watch::Receiver<Ending>, e: RuntimeError) -> RuntimeError {
    match (&e, ending.borrow().reason.clone()) {
        (RuntimeError::Closed(_), Some(reason)) => RuntimeError::Shutdown(reason),
        _ => e,
    }
}

/// What the scheduler's connection said about the end of the job.
#[derive(Debug, Clone, Default)]
struct Ending {
    /// The reason of the scheduler's `Shutdown`, once it came.
    reason: Option<String>,
    /// The scheduler's latest failover notice (`Replicas`): the servers it does not list
    /// are lost ([`elasticps_node::session::servers_lost`]).
    failover: Option<Arc<Message>>,
    /// The latest layout the scheduler sent unasked (the balancer changed the wire dtype
    /// of blocks): installed before the next round if newer (`round.rs`).
    layout: Option<Arc<Layout>>,
}

/// Reads the scheduler's notifications into `tell`: its `Shutdown`, then the link's end.
async fn watch_ending(mut notes: Notifications, end: EndWatch, tell: tokio::sync::watch::Sender<Ending>) {
    while let Some(msg) = notes.recv().await {
        if let Message::Control(Control::Shutdown { reason }) = msg {
            tracing::info!(%reason, "scheduler ends the job");
            tell.send_modify(|e| e.reason = Some(reason));
        } else if let Message::Control(Control::Replicas { .. }) = &msg {
            tracing::info!("a server failed over: requests to it go to the promoted owners");
            tell.send_modify(|e| e.failover = Some(Arc::new(msg)));
        } else if let Message::Control(Control::Layout(layout)) = msg {
            tell.send_modify(|e| e.layout = Some(Arc::new(layout)));
        }
    }
    // Every notification the scheduler sent before the link ended has been read.
    let why = end.borrow().as_ref().map(|end| end.reason().to_string());
    tell.send_modify(|e| {
        if e.reason.is_none() {
            e.reason = why;
        }
    });
}

/// A duration in the plan's microseconds.
/// The length a push's shape check compares with its tensor's: `None` (not checked) for a
/// tensor not in the round and for an empty gradient, which pushes none.
fn pushed_len(grad: Option<&[f32]>) -> Option<usize> {
    grad.map(<[f32]>::len).filter(|len| *len != 0)
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// What [`Client::rows_call`] does with a table's rows.
enum RowCall<'a> {
    /// Pull rows `ids` into `out`.
    Pull { ids: &'a [u64], out: &'a mut [f32] },
    /// Push the gradient rows `grads` of rows `ids`.
    Push { ids: &'a [u64], grads: &'a [f32] },
    /// Push "no gradient".
    NoGradient,
}

#[cfg(test)]
mod tests {
    use elasticps_node::timing;

    use super::*;

    /// A client's defaults are the node layer's: the harness's workers run the same
    /// window and request timeout.
    #[test]
    fn the_client_defaults_are_the_node_layers_constants() {
        let opts = ClientOptions::new("127.0.0.1:1");
        assert_eq!(opts.window, timing::DEFAULT_WINDOW);
        assert_eq!(micros(opts.request_timeout), timing::REQUEST_TIMEOUT_US);
        assert_eq!(Worker::new(0, 1, 1, 0).window(), timing::DEFAULT_WINDOW);
    }
}
