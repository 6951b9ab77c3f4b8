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
//! A server that no longer owns a block answers `Moved`; the client then refreshes the
//! layout from the scheduler and resends only the moved blocks.
//!
//! What a round sends where, and what it resends, is the plan of
//! [`elasticps_node::worker`]; this file carries it out: connections, tensor bytes in and
//! out of messages, timeouts, the layout refresh.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use elasticps_core::model::{BlockSpec, TensorSpec};
use elasticps_core::optimizer::TensorOptimizer;
use elasticps_core::sync::Clock;
use elasticps_node::NodeError;
use elasticps_node::worker::{Action, Answer, Op, PushOp, Round, Tag, Worker};
use elasticps_wire::{Codec, Control, Credential, FrameHeader, Kind, Layout, Message};
use futures::StreamExt;
use futures::stream::FuturesUnordered;

use crate::error::{Result, RuntimeError};
use crate::metrics::WorkerMetrics;

mod server_conn;
use crate::session::{DEFAULT_SCHEDULER_RETRY, EndWatch, Notifications, SchedLink};
use crate::{CALL_TIMEOUT, Micros, STATS_INTERVAL};
use elasticps_node::session::SessionConfig;
use server_conn::{ServerConn, WriteJob, Written};

/// Requests of a round in flight to one server, by default ([`ClientOptions::window`]).
pub const DEFAULT_WINDOW: usize = 32;

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
    /// least 1); the others are sent as replies come back.
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
}

impl ClientOptions {
    /// Defaults: no secret, 64 MiB frames, 5-minute request timeout, fused push_pull.
    pub fn new(scheduler: impl Into<String>) -> Self {
        Self {
            scheduler: scheduler.into(),
            codec: Codec::new(b"", elasticps_wire::DEFAULT_MAX_PAYLOAD),
            request_timeout: Duration::from_secs(300),
            metrics: None,
            window: DEFAULT_WINDOW,
            fuse: true,
            rank: None,
            scheduler_retry: DEFAULT_SCHEDULER_RETRY,
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
    /// Shared so that a round can hold it while it mutates the client (cheap clone).
    layout: Option<Arc<Layout>>,
    /// The connections to the servers, read and written by the rounds themselves.
    servers: HashMap<u32, ServerConn>,
    /// The next request id (unique over every server connection; also their serials).
    next_request: u64,
    /// What the scheduler's connection said about the end of the job (see [`Ending`]).
    ending: tokio::sync::watch::Receiver<Ending>,
    waits: Waits,
    /// The rounds' plans and the load report (the balancer's measurements).
    worker: Worker,
    /// The time handed to the plan.
    clock: Micros,
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
        let worker =
            Worker::new(rank, micros(opts.request_timeout), micros(STATS_INTERVAL), clock.now()).with_fusion(opts.fuse);
        Ok(Client {
            rank,
            credential,
            num_workers,
            opts,
            sched,
            layout: None,
            servers: HashMap::new(),
            next_request: 1,
            ending,
            waits: Waits::default(),
            worker,
            clock,
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
        self.layout.as_deref()
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
        let reply = self
            .call_scheduler(Control::DefineModel { tensors, optimizers }.into(), CALL_TIMEOUT, || {
                "the scheduler to place the model (every server must join and load its blocks)".into()
            })
            .await?;
        self.install_layout(reply, false).await?;
        Ok(self.layout.as_ref().map(|l| &l.partition.tensors[..]).unwrap_or_default())
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
    /// rate of a schedule's next step: recorded by the scheduler (for servers that join
    /// later), then by every server, before this returns; every push sent after it uses it.
    pub async fn set_optimizer(&mut self, tensor: u32, optimizer: TensorOptimizer) -> Result<()> {
        let layout = self.current_layout()?;
        let msg = Message::from(Control::SetOptimizer { tensor, optimizer });
        let what = |peer: &str| format!("{peer} to take the optimizer of tensor {tensor}");
        match self.call_scheduler(msg.clone(), CALL_TIMEOUT, || what("the scheduler")).await? {
            Message::Control(Control::Ok) => {}
            other => return Err(RuntimeError::unexpected("scheduler", "Ok", &other)),
        }
        for s in &layout.servers {
            let name = format!("server {}", s.id);
            let id = self.next_request;
            self.next_request += 1;
            let conn = self.conn(s.id)?.ok_or_else(|| RuntimeError::Closed(name.clone()))?;
            match conn.call(id, msg.clone(), CALL_TIMEOUT, || what(&name)).await? {
                Message::Control(Control::Ok) => {}
                Message::Error(reply) => return Err(RuntimeError::Remote { peer: name, reply }),
                other => return Err(RuntimeError::unexpected(&name, "Ok", &other)),
            }
        }
        Ok(())
    }

    /// Fresh zeroed buffers shaped like the model's tensors, for [`Client::pull`].
    pub fn zeros(&self) -> Vec<Vec<f32>> {
        self.layout.as_ref().map_or_else(Vec::new, |l| l.partition.tensors.iter().map(|t| vec![0.0; t.len()]).collect())
    }

    /// Pulls every tensor at clock `clock` into `params` (shaped like [`Client::zeros`]).
    /// The server holds the pull as its sync policy says.
    pub async fn pull<P: AsMut<[f32]>>(&mut self, clock: Clock, params: &mut [P]) -> Result<()> {
        let mut params: Vec<Option<&mut [f32]>> = params.iter_mut().map(|p| Some(p.as_mut())).collect();
        self.check_shapes("pull", params.iter().map(|p| p.as_ref().map(|p| p.len())))?;
        self.round(None, Some((clock, &mut params))).await
    }

    /// Pushes the gradient of every tensor for clock `clock`.
    pub async fn push<G: AsRef<[f32]>>(&mut self, clock: Clock, grads: &[G]) -> Result<()> {
        self.check_shapes("push", grads.iter().map(|g| Some(g.as_ref().len())))?;
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
        self.check_shapes("push", grads.iter().map(|g| g.map(<[f32]>::len)))?;
        self.check_shapes("pull", params.iter().map(|p| p.as_ref().map(|p| p.len())))?;
        self.round(Some((PushOp::Grad(clock), &grads)), Some((next, &mut params))).await
    }

    /// A round over some of the tensors: `grads[t]` (if `Some`) is pushed at `push_clock`,
    /// `params[t]` (if `Some`) pulled at `pull_clock`, each as long as tensor `t`; a tensor
    /// in both is pulled once its push was acknowledged, or, if `pull_clock` is
    /// `push_clock + 1` and [`ClientOptions::fuse`] is on, with its push in one request.
    /// Both lists are empty or have one entry per tensor. This is what a client that
    /// pushes each gradient as soon as it is ready (PyTorch's backward hooks) calls, one
    /// tensor or a few at a time.
    pub async fn round_tensors(
        &mut self,
        push: Option<(Clock, &[Option<&[f32]>])>,
        pull: Option<(Clock, &mut [Option<&mut [f32]>])>,
    ) -> Result<()> {
        if let Some((_, grads)) = push {
            self.check_shapes("push", grads.iter().map(|g| g.map(<[f32]>::len)))?;
        }
        if let Some((_, params)) = &pull {
            self.check_shapes("pull", params.iter().map(|p| p.as_ref().map(|p| p.len())))?;
        }
        self.round(push.map(|(c, g)| (PushOp::Grad(c), g)), pull).await
    }

    /// Tells the scheduler this worker is done. Servers stop waiting for it.
    pub async fn finish(self) -> Result<()> {
        let reply = self
            .call_scheduler(Control::WorkerDone { rank: self.rank }.into(), CALL_TIMEOUT, || {
                "the scheduler to acknowledge WorkerDone".into()
            })
            .await;
        self.sched.close();
        reply.map(|_| ())
    }

    /// One round trip with every server at once: for each block, the push (if any),
    /// then, once the block's server acknowledged all of this round's pushes, the pull
    /// (if any), or both in one push_pull ([`ClientOptions::fuse`]); a block whose server
    /// answered `Moved` is resent after a layout refresh.
    /// The plan ([`Round`]) decides; this task writes its requests and reads the replies
    /// itself, all servers at once (a pull reply straight into `pull`'s tensor).
    async fn round(
        &mut self,
        push: Option<(PushOp, &[Option<&[f32]>])>,
        mut pull: Option<(Clock, &mut [Option<&mut [f32]>])>,
    ) -> Result<()> {
        let layout = self.current_layout()?;
        // A round that failed half-way left requests on some connections: their late
        // replies must not be taken for this round's, so those connections start afresh.
        self.servers.retain(|_, c| {
            c.start_round();
            c.is_idle()
        });
        let push_mask: Vec<bool> = push.map_or_else(Vec::new, |(_, g)| g.iter().map(Option::is_some).collect());
        let pull_mask: Vec<bool> =
            pull.as_ref().map_or_else(Vec::new, |(_, p)| p.iter().map(Option::is_some).collect());
        let (mut plan, actions) = self
            .worker
            .start(
                self.clock.now(),
                &layout,
                push.map(|(op, _)| (op, &push_mask[..])),
                pull.as_ref().map(|(clock, _)| (*clock, &pull_mask[..])),
            )
            .map_err(from_node)?;
        if let (Some(m), Some(it)) = (&self.opts.metrics, plan.iteration()) {
            m.iteration(it.clock, it.since_last_us.map(Duration::from_micros));
        }
        let grads = push.map_or(&[][..], |(_, g)| g);
        let mut writes = FuturesUnordered::new();
        let mut todo = VecDeque::from(actions);
        let mut state = InRound::default();
        // One timer for the whole round, moved to the next deadline or wake-up as needed.
        let sleep = tokio::time::sleep(self.opts.request_timeout);
        tokio::pin!(sleep);
        loop {
            while let Some(action) = todo.pop_front() {
                let more = match action {
                    Action::Send { tag, server, block, op } => {
                        // This send and every send right behind it: one write per server.
                        let mut batch: Vec<(u64, Sent)> = Vec::new();
                        let mut next = Some(Action::Send { tag, server, block, op });
                        while let Some(Action::Send { tag, server, block, op }) = next {
                            let sent = Sent { server, block, op };
                            let window = state.in_flight.entry(server).or_insert(0);
                            if *window >= self.opts.window.max(1) {
                                state.deferred.entry(server).or_default().push_back(Action::Send {
                                    tag,
                                    server,
                                    block,
                                    op,
                                });
                            } else {
                                *window += 1;
                                batch.push((tag, sent));
                            }
                            next = match todo.front() {
                                Some(Action::Send { .. }) => todo.pop_front(),
                                _ => None,
                            };
                        }
                        let (jobs, lost) = self.start_writes(batch, grads, &mut state.deadlines)?;
                        writes.extend(jobs.into_iter().map(server_conn::run_write));
                        let mut more = Vec::new();
                        for (server, tag) in lost {
                            more.extend(self.lost(server, &[tag], &mut plan, &mut state)?);
                        }
                        Ok(more)
                    }
                    Action::RefreshLayout => {
                        let reply = self
                            .call_scheduler(Control::GetLayout.into(), CALL_TIMEOUT, || {
                                "the scheduler to send the layout".into()
                            })
                            .await?;
                        self.install_layout(reply, true).await?;
                        plan.on_layout(self.clock.now(), &*self.current_layout()?)
                    }
                    Action::Wait { until_us } => {
                        state.wake = Some(state.wake.map_or(until_us, |w| w.min(until_us)));
                        Ok(Vec::new())
                    }
                };
                todo.extend(more.map_err(from_node)?);
            }
            if plan.is_done() && writes.is_empty() {
                break;
            }
            // The oldest request still unanswered sets the timeout.
            while let Some(&(_, server, id)) = state.deadlines.front() {
                if self.servers.get(&server).is_some_and(|c| c.pending.contains_key(&id)) {
                    break;
                }
                state.deadlines.pop_front();
            }
            if state.deadlines.is_empty() && writes.is_empty() && state.wake.is_none() && !plan.is_done() {
                return Err(stalled(&plan));
            }
            let now = self.clock.now();
            let wake_at =
                state.wake.map(|us| tokio::time::Instant::now() + Duration::from_micros(us.saturating_sub(now)));
            let timer = match (wake_at, state.deadlines.front()) {
                (Some(w), Some(&(d, ..))) => w.min(d),
                (Some(w), None) => w,
                (None, Some(&(d, ..))) => d,
                (None, None) => tokio::time::Instant::now() + self.opts.request_timeout,
            };
            if sleep.deadline() != timer {
                sleep.as_mut().reset(timer);
            }
            state.turn = state.turn.wrapping_add(1);
            let turn = state.turn;
            let event = tokio::select! {
                Some(written) = writes.next(), if !writes.is_empty() => Event::Wrote(written),
                (server, got) = std::future::poll_fn(|cx| server_conn::poll_any_header(&mut self.servers, turn, cx)) => {
                    Event::Header(server, got)
                }
                () = &mut sleep => Event::Timer,
            };
            let more = match event {
                Event::Wrote((_, _, None | Some(Ok(())))) => Vec::new(),
                Event::Wrote((server, serial, Some(Err(e)))) => {
                    if self.servers.get(&server).is_none_or(|c| c.serial != serial) {
                        continue;
                    }
                    self.drop_server(server, e, &mut plan, &mut state)?
                }
                Event::Header(server, Ok(Some(header))) => {
                    self.on_header(server, header, &mut plan, &mut pull, &mut state).await?
                }
                Event::Header(server, Ok(None)) => {
                    let closed = RuntimeError::Closed(format!("server {server}"));
                    self.drop_server(server, closed, &mut plan, &mut state)?
                }
                Event::Header(server, Err(e)) => self.drop_server(server, e, &mut plan, &mut state)?,
                Event::Timer => {
                    let now = self.clock.now();
                    if let Some(&(at, server, id)) = state.deadlines.front()
                        && tokio::time::Instant::now() >= at
                    {
                        return Err(self.timed_out(server, id));
                    }
                    match state.wake {
                        Some(until) if now >= until => {
                            state.wake = None;
                            plan.on_wake(now).map_err(from_node)?
                        }
                        _ => Vec::new(),
                    }
                }
            };
            todo.extend(more);
        }
        self.waits = Waits { per_server: plan.waits_per_server_us().into_iter().map(Duration::from_micros).collect() };
        if let Some(m) = &self.opts.metrics {
            for (server, waited) in plan.waited() {
                m.waited(server, Duration::from_micros(waited));
            }
        }
        if let Some(report) = self.worker.finish(self.clock.now(), plan) {
            let _ = self.sched.notify(Control::WorkerLoad(report).into());
        }
        Ok(())
    }

    /// A reply's header came from `server`: reads its payload (a pull's values straight
    /// into the caller's tensor) and hands the answer to the plan.
    async fn on_header(
        &mut self,
        server: u32,
        header: FrameHeader,
        plan: &mut Round,
        pull: &mut Option<(Clock, &mut [Option<&mut [f32]>])>,
        state: &mut InRound,
    ) -> Result<Vec<Action>> {
        let Some(conn) = self.servers.get_mut(&server) else {
            return Ok(Vec::new());
        };
        // The request stays pending until its payload is read: a round dropped half-way
        // through the read (a cancelled call) leaves the connection mid-frame, and a
        // pending request is what makes the next round drop it (`is_idle`).
        let Some(&(tag, sent)) = conn.pending.get(&header.request_id) else {
            // A notification, or the reply to a request no round waits for: read, dropped.
            return match conn.reader.payload(&header).await {
                Ok(msg) => {
                    tracing::warn!(peer = %conn.name, id = header.request_id, kind = ?msg.kind(), "reply to no request");
                    Ok(Vec::new())
                }
                Err(e) => self.drop_server(server, e, plan, state),
            };
        };
        // Where a pull reply of the expected length goes: the block's range of its tensor.
        let b = sent.block;
        let dest = match (header.kind, pull.as_mut()) {
            (Kind::PullReply, Some((_, params))) if sent.op.is_pull() && header.payload_len as usize == b.len * 4 => {
                params
                    .get_mut(b.tensor as usize)
                    .and_then(Option::as_mut)
                    .and_then(|p| p.get_mut(b.offset..b.offset + b.len))
            }
            _ => None,
        };
        let read = match dest {
            Some(dest) => conn.reader.payload_into(&header, bytemuck::cast_slice_mut(dest)).await.map(|()| {
                #[cfg(target_endian = "big")]
                for v in dest.iter_mut() {
                    *v = f32::from_bits(u32::from_le(v.to_bits()));
                }
                None
            }),
            None => conn.reader.payload(&header).await.map(Some),
        };
        let msg = match read {
            Ok(msg) => {
                conn.pending.remove(&header.request_id);
                msg
            }
            // Unanswered after all: the connection is lost, with this request on it.
            Err(e) => return self.drop_server(server, e, plan, state),
        };
        let mut more = Vec::new();
        if let Some(window) = state.in_flight.get_mut(&server) {
            *window = window.saturating_sub(1);
        }
        if let Some(next) = state.deferred.get_mut(&server).and_then(VecDeque::pop_front) {
            more.push(next);
        }
        let answer = match &msg {
            Some(msg) => Answer::of(msg),
            None => Answer::Pulled { len: b.len },
        };
        more.extend(plan.on_answer(self.clock.now(), tag, answer).map_err(from_node)?);
        Ok(more)
    }

    /// Starts the writes of a round's requests, one vectored write per server: a push,
    /// push_pull or init straight from the caller's gradient slice (no copy of the values),
    /// a pull as its header. Each request waits for its reply from now on, at most
    /// `request_timeout` (its deadline joins `deadlines`).
    /// Returns the writes, and (server, tag) of the requests whose server has no
    /// connection (lost, or unreachable at the last layout: for [`Client::lost`]).
    fn start_writes<'g>(
        &mut self,
        batch: Vec<(u64, Sent)>,
        grads: &[Option<&'g [f32]>],
        deadlines: &mut VecDeque<(tokio::time::Instant, u32, u64)>,
    ) -> Result<Started<'g>> {
        let mut jobs = Vec::new();
        let mut lost = Vec::new();
        let mut servers: Vec<u32> = batch.iter().map(|(_, s)| s.server).collect();
        servers.sort_unstable();
        servers.dedup();
        let deadline = tokio::time::Instant::now() + self.opts.request_timeout;
        for server in servers {
            let mine = batch.iter().filter(|(_, s)| s.server == server);
            if self.conn(server)?.is_none() {
                lost.extend(mine.map(|(tag, _)| (server, *tag)));
                continue;
            }
            let mut frames = Vec::new();
            for &(tag, sent) in mine {
                let b = sent.block;
                let values = || match grads.get(b.tensor as usize) {
                    Some(Some(grad)) if b.offset + b.len <= grad.len() => Ok(&grad[b.offset..b.offset + b.len]),
                    _ => {
                        Err(RuntimeError::Usage(format!("no values of tensor {} to push to block {}", b.tensor, b.id)))
                    }
                };
                let (kind, clock, values) = match sent.op {
                    Op::Push(clock) => (Kind::Push, clock, values()?),
                    Op::Init => (Kind::Init, 0, values()?),
                    Op::Pull(clock) => (Kind::Pull, clock, &[][..]),
                    Op::PushPull(clock) => (Kind::PushPull, clock, values()?),
                };
                let id = self.next_request;
                self.next_request += 1;
                let Some(conn) = self.servers.get_mut(&server) else { break };
                let bytes: &'g [u8] = bytemuck::cast_slice(values);
                frames.push((conn.writer().tensor_header(kind, id, b.id, clock, bytes.len())?, bytes));
                conn.pending.insert(id, (tag, sent));
                deadlines.push_back((deadline, server, id));
            }
            if let Some(conn) = self.servers.get_mut(&server) {
                jobs.push(conn.write(server, frames));
            }
        }
        Ok((jobs, lost))
    }

    /// The connection to server `owner`, if open (`None`: lost, or unreachable at the last
    /// layout), or the error for a layout that does not list it.
    fn conn(&mut self, owner: u32) -> Result<Option<&mut ServerConn>> {
        let listed = self.layout.as_ref().is_some_and(|l| l.servers.iter().any(|s| s.id == owner));
        match self.servers.get_mut(&owner) {
            Some(c) => Ok(Some(c)),
            None if listed => Ok(None),
            None => Err(RuntimeError::Protocol {
                peer: "scheduler".into(),
                what: format!("layout names server {owner}, which it does not list"),
            }),
        }
    }

    /// The connection to `server` failed (`why`): it is dropped (the next layout naming
    /// the server connects again), and the requests it left unanswered, with the sends
    /// waiting for room in its window, are resent to the owner a refreshed layout names.
    /// After the scheduler's `Shutdown` a lost request is the job's end instead.
    fn drop_server(
        &mut self,
        server: u32,
        why: RuntimeError,
        plan: &mut Round,
        state: &mut InRound,
    ) -> Result<Vec<Action>> {
        let Some(conn) = self.servers.remove(&server) else {
            return Ok(Vec::new());
        };
        if conn.pending.is_empty() {
            // Nothing was lost (a server that left the job closes its connections).
            tracing::debug!(rank = self.rank, server, error = %why, "idle server connection closed");
            return Ok(Vec::new());
        }
        if self.shutting_down() {
            return Err(self.explain(RuntimeError::Closed(format!("server {server}"))));
        }
        tracing::warn!(rank = self.rank, server, error = %why, "server connection lost; resending after a layout refresh");
        let tags: Vec<Tag> = conn.pending.values().map(|(tag, _)| *tag).collect();
        self.lost(server, &tags, plan, state)
    }

    /// Requests `tags` to `server` went unanswered (its connection closed, or was never
    /// opened): frees their window (the sends waiting for room there are lost too) and lets
    /// the plan resend them to the owner a refreshed layout names.
    fn lost(&mut self, server: u32, tags: &[Tag], plan: &mut Round, state: &mut InRound) -> Result<Vec<Action>> {
        if let Some(window) = state.in_flight.get_mut(&server) {
            *window = window.saturating_sub(tags.len());
        }
        let mut more = Vec::new();
        for &tag in tags {
            more.extend(plan.on_lost(self.clock.now(), tag).map_err(from_node)?);
        }
        for waiting in state.deferred.remove(&server).unwrap_or_default() {
            if let Action::Send { tag, .. } = waiting {
                more.extend(plan.on_lost(self.clock.now(), tag).map_err(from_node)?);
            }
        }
        Ok(more)
    }

    /// The error of request `id` to `server`, unanswered for `request_timeout`.
    fn timed_out(&self, server: u32, id: u64) -> RuntimeError {
        let what = match self.servers.get(&server).and_then(|c| c.pending.get(&id)) {
            Some((_, sent)) => {
                let (verb, clock) = sent.op.verb_clock();
                format!(
                    "worker {} waits for server {server} to answer {verb}(clock {clock}) of block {}",
                    self.rank, sent.block.id
                )
            }
            None => format!("worker {} waits for server {server} to answer a request", self.rank),
        };
        RuntimeError::Timeout { what, after: self.opts.request_timeout }
    }

    /// Connects to the layout's new servers (Hello) and drops those that left it. During a
    /// round (`in_round`) a server that cannot be reached is left out: the requests the plan
    /// sends it come back lost, and the plan refreshes the layout again.
    async fn install_layout(&mut self, reply: Message, in_round: bool) -> Result<()> {
        let layout = match reply {
            Message::Control(Control::Layout(l)) => l,
            other => return Err(RuntimeError::unexpected("scheduler", "Layout", &other)),
        };
        for s in &layout.servers {
            if self.servers.contains_key(&s.id) {
                continue;
            }
            let (serial, hello_id) = (self.next_request, self.next_request + 1);
            self.next_request += 2;
            match ServerConn::connect(s, self.opts.codec.clone(), &self.credential, serial, hello_id).await {
                Ok(conn) => {
                    self.servers.insert(s.id, conn);
                }
                Err(e @ (RuntimeError::Closed(_) | RuntimeError::Io { .. })) if in_round => {
                    tracing::warn!(rank = self.rank, server = s.id, addr = %s.addr, error = %e, "server unreachable");
                }
                Err(e) => return Err(e),
            }
        }
        // Servers that left the job (scaled in): drop their connections, once no request
        // waits there (its reply, or the connection's close, is still to be read).
        self.servers.retain(|id, c| !c.is_idle() || layout.servers.iter().any(|s| s.id == *id));
        self.layout = Some(Arc::new(layout));
        Ok(())
    }

    /// Whether the scheduler said the job ends (closed server connections are expected).
    fn shutting_down(&self) -> bool {
        self.ending.borrow().reason.is_some()
    }

    /// A call to the scheduler. When its connection closed, the error is the job's end as
    /// the scheduler explained it: its `Shutdown` may still be on its way to the task that
    /// reads notifications, so this waits (briefly) until that task read everything.
    async fn call_scheduler(&self, msg: Message, timeout: Duration, what: impl FnOnce() -> String) -> Result<Message> {
        match self.sched.call(msg, timeout, what).await {
            Err(e @ RuntimeError::Closed(_)) => {
                let mut ending = self.ending.clone();
                let _ = tokio::time::timeout(NOTES_DRAIN, ending.wait_for(|e| e.closed)).await;
                Err(self.explain(e))
            }
            other => other,
        }
    }

    /// The layout, or the error for a client that has not registered the model.
    fn current_layout(&self) -> Result<Arc<Layout>> {
        self.layout.clone().ok_or_else(|| RuntimeError::Usage("register_model first".into()))
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

    /// A lost server connection is explained by the scheduler's shutdown, if there was one.
    fn explain(&self, e: RuntimeError) -> RuntimeError {
        match (&e, self.ending.borrow().reason.clone()) {
            (RuntimeError::Closed(_), Some(reason)) => RuntimeError::Shutdown(reason),
            _ => e,
        }
    }
}

/// What the scheduler's connection said about the end of the job.
#[derive(Debug, Clone, Default)]
struct Ending {
    /// The reason of the scheduler's `Shutdown`, once it came.
    reason: Option<String>,
    /// The connection closed and every notification before it was read.
    closed: bool,
}

/// Reads the scheduler's notifications into `tell`: its `Shutdown`, then the link's end.
async fn watch_ending(mut notes: Notifications, end: EndWatch, tell: tokio::sync::watch::Sender<Ending>) {
    while let Some(msg) = notes.recv().await {
        if let Message::Control(Control::Shutdown { reason }) = msg {
            tracing::info!(%reason, "scheduler ends the job");
            tell.send_modify(|e| e.reason = Some(reason));
        }
    }
    // Every notification the scheduler sent before the link ended has been read.
    let why = end.borrow().clone().flatten();
    tell.send_modify(|e| {
        if e.reason.is_none() {
            e.reason = why;
        }
        e.closed = true;
    });
}

/// How long a failed scheduler call waits for the notifications read before the close.
const NOTES_DRAIN: Duration = Duration::from_secs(1);

/// A duration in the plan's microseconds.
fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// What a round waits on besides its plan: the window per server, the sends waiting for
/// room in it, the requests' deadlines in the order they were sent (one `request_timeout`
/// each), when the plan wants to be woken, and whose turn it is to be read first.
#[derive(Default)]
struct InRound {
    in_flight: HashMap<u32, usize>,
    deferred: HashMap<u32, VecDeque<Action>>,
    deadlines: VecDeque<(tokio::time::Instant, u32, u64)>,
    wake: Option<u64>,
    turn: usize,
}

/// What [`Client::start_writes`] started: the writes, and (server, tag) of the requests
/// that found no connection.
type Started<'g> = (Vec<WriteJob<'g>>, Vec<(u32, Tag)>);

/// What a round's wait ended with.
enum Event {
    /// A write finished (or failed).
    Wrote(Written),
    /// A server's next frame header came (or its connection failed or closed: `None`).
    Header(u32, Result<Option<FrameHeader>>),
    /// A deadline or the plan's wake-up time.
    Timer,
}

/// One request in flight: who waits on whom for what.
#[derive(Clone, Copy)]
struct Sent {
    server: u32,
    block: BlockSpec,
    op: Op,
}

/// The plan's refusals and failures, as the runtime's errors (with the same messages).
fn from_node(e: NodeError) -> RuntimeError {
    match e {
        NodeError::Core(e) => RuntimeError::Core(e),
        NodeError::Remote { peer, reply } => RuntimeError::Remote { peer, reply },
        NodeError::Protocol { peer, what } => RuntimeError::Protocol { peer, what },
        NodeError::Refused(what) => RuntimeError::Protocol { peer: "servers".into(), what },
    }
}

/// A round that waits for replies with none in flight (a bug in the plan, not a hang).
fn stalled(plan: &Round) -> RuntimeError {
    RuntimeError::Protocol {
        peer: "servers".into(),
        what: format!("the round waits with no request in flight ({} refreshes)", plan.refreshes()),
    }
}
