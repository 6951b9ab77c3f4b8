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

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use elasticps_core::model::{BlockSpec, TensorSpec};
use elasticps_core::optimizer::TensorOptimizer;
use elasticps_core::sync::Clock;
use elasticps_wire::{Codec, Control, Layout, Message, ServerSample, Values, WorkerLoad};
use futures::StreamExt;
use futures::stream::FuturesUnordered;

use crate::error::{Result, RuntimeError};
use crate::metrics::WorkerMetrics;
use crate::peer::Peer;
use crate::{CALL_TIMEOUT, HEARTBEAT_EVERY};

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
}

impl ClientOptions {
    /// Defaults: no secret, 64 MiB frames, 5-minute request timeout.
    pub fn new(scheduler: impl Into<String>) -> Self {
        Self {
            scheduler: scheduler.into(),
            codec: Codec::new(b"", elasticps_wire::DEFAULT_MAX_PAYLOAD),
            request_timeout: Duration::from_secs(300),
            metrics: None,
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
    num_workers: u32,
    opts: ClientOptions,
    sched: Peer,
    /// Shared so that a round can hold it while it mutates the client (cheap clone).
    layout: Option<Arc<Layout>>,
    servers: HashMap<u32, Peer>,
    shutdown: Arc<Mutex<Option<String>>>,
    heartbeat: tokio::task::JoinHandle<()>,
    waits: Waits,
    load: LoadReport,
}

/// What this worker reports to the scheduler every stats interval: its iterations and
/// what each server cost it (the balancer's measurements).
#[derive(Debug)]
struct LoadReport {
    since: Instant,
    /// When the last push of a new clock started, and that clock.
    last_push: Option<(Instant, Clock)>,
    report: WorkerLoad,
    metrics: Option<Arc<WorkerMetrics>>,
}

impl LoadReport {
    fn new(rank: u32, metrics: Option<Arc<WorkerMetrics>>) -> Self {
        if let Some(m) = &metrics {
            m.registered_as(rank);
        }
        Self { since: Instant::now(), last_push: None, report: WorkerLoad { rank, ..Default::default() }, metrics }
    }

    /// A round pushing `clock` starts: the time since the first push of the previous clock
    /// is one iteration (a client that pushes tensor by tensor pushes one clock many times).
    fn iteration(&mut self, clock: Clock) {
        if self.last_push.is_some_and(|(_, c)| c == clock) {
            return;
        }
        let now = Instant::now();
        let last = self.last_push.replace((now, clock)).map(|(t, _)| t);
        if let Some(last) = last {
            self.report.iterations += 1;
            self.report.iter_us += now.duration_since(last).as_micros() as u64;
        }
        self.report.clock = clock;
        if let Some(m) = &self.metrics {
            m.iteration(clock, last.map(|l| now.duration_since(l)));
        }
    }

    fn sample(&mut self, server: u32) -> &mut ServerSample {
        let per = &mut self.report.per_server;
        let i = match per.iter().position(|p| p.server == server) {
            Some(i) => i,
            None => {
                per.push(ServerSample { server, ..Default::default() });
                per.len() - 1
            }
        };
        &mut per[i]
    }

    /// A push phase measures the server's service time.
    fn phase(&mut self, done: &PhaseDone) {
        if done.push_bytes > 0 {
            let p = self.sample(done.owner);
            p.push_bytes += done.push_bytes;
            p.push_us += done.push_time.as_micros() as u64;
        }
    }

    /// At the end of a round: how long it waited for this server.
    fn waited(&mut self, server: u32, waited: Duration) {
        let p = self.sample(server);
        p.rounds += 1;
        p.wait_us += waited.as_micros() as u64;
        if let Some(m) = &self.metrics {
            m.waited(server, waited);
        }
    }

    /// The report, if an interval has passed (then a fresh one starts).
    fn due(&mut self) -> Option<WorkerLoad> {
        if self.since.elapsed() < crate::STATS_INTERVAL {
            return None;
        }
        self.since = Instant::now();
        let fresh = WorkerLoad { rank: self.report.rank, clock: self.report.clock, ..Default::default() };
        Some(std::mem::replace(&mut self.report, fresh))
    }
}

impl Client {
    /// Registers with the scheduler and learns this worker's rank.
    pub async fn connect(opts: ClientOptions) -> Result<Client> {
        let (sched, mut notes) = Peer::connect(&opts.scheduler, opts.codec.clone(), "scheduler").await?;
        let (rank, num_workers) = match sched
            .call(Control::RegisterWorker.into(), CALL_TIMEOUT, || "the scheduler to accept this worker".into())
            .await?
        {
            Message::Control(Control::Welcome { node_id, num_workers, .. }) => (node_id, num_workers),
            other => return Err(RuntimeError::unexpected("scheduler", "Welcome", &other)),
        };
        let shutdown = Arc::new(Mutex::new(None));
        let flag = shutdown.clone();
        tokio::spawn(async move {
            while let Some(msg) = notes.recv().await {
                if let Message::Control(Control::Shutdown { reason }) = msg {
                    tracing::info!(%reason, "scheduler ends the job");
                    *flag.lock().unwrap_or_else(|e| e.into_inner()) = Some(reason);
                }
            }
        });
        let hb = sched.clone();
        let heartbeat = tokio::spawn(async move {
            let mut tick = tokio::time::interval(HEARTBEAT_EVERY);
            while hb.notify(Control::Heartbeat.into()).is_ok() {
                tick.tick().await;
            }
        });
        tracing::info!(rank, num_workers, "worker registered");
        let load = LoadReport::new(rank, opts.metrics.clone());
        Ok(Client {
            rank,
            num_workers,
            opts,
            sched,
            layout: None,
            servers: HashMap::new(),
            shutdown,
            heartbeat,
            waits: Waits::default(),
            load,
        })
    }

    /// This worker's rank, `0..num_workers`.
    pub fn rank(&self) -> u32 {
        self.rank
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
            .sched
            .call(Control::DefineModel { tensors, optimizers }.into(), CALL_TIMEOUT, || {
                "the scheduler to place the model (every server must join and load its blocks)".into()
            })
            .await?;
        self.install_layout(reply).await?;
        Ok(self.layout.as_ref().map(|l| &l.partition.tensors[..]).unwrap_or_default())
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
            .sched
            .call(Control::Barrier.into(), self.opts.request_timeout, || {
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
        match self.sched.call(msg.clone(), CALL_TIMEOUT, || what("the scheduler")).await? {
            Message::Control(Control::Ok) => {}
            other => return Err(RuntimeError::unexpected("scheduler", "Ok", &other)),
        }
        for s in &layout.servers {
            let name = format!("server {}", s.id);
            match self.peer(s.id)?.call(msg.clone(), CALL_TIMEOUT, || what(&name)).await? {
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
    /// `clock + 1`, overlapping the two: the pull of a server's blocks is sent as soon as
    /// that server acknowledged their pushes, without waiting for the other servers.
    /// [`Client::last_waits`] then tells how long each server took.
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
    /// in both is pulled once its push was acknowledged. Both lists are empty or have one
    /// entry per tensor. This is what a client that pushes each gradient as soon as it
    /// is ready (PyTorch's backward hooks) calls, one tensor or a few at a time.
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
            .sched
            .call(Control::WorkerDone { rank: self.rank }.into(), CALL_TIMEOUT, || {
                "the scheduler to acknowledge WorkerDone".into()
            })
            .await;
        self.heartbeat.abort();
        reply.map(|_| ())
    }

    /// One round trip with every server at once: for each block, the push (if any),
    /// then, once the block's server acknowledged all of this round's pushes, the pull
    /// (if any). Each server's push phase and pull phase are separate futures, so a
    /// block whose server answered `Moved` is resent (after a layout refresh) at once, not
    /// after pulls that the sync policy holds elsewhere: those may wait for exactly that
    /// push from another worker.
    async fn round(
        &mut self,
        push: Option<(PushOp, &[Option<&[f32]>])>,
        mut pull: Option<(Clock, &mut [Option<&mut [f32]>])>,
    ) -> Result<()> {
        let mut layout = self.current_layout()?;
        let pull_clock = pull.as_ref().map(|(c, _)| *c);
        let started = Instant::now();
        if let Some((PushOp::Grad(clock), _)) = push {
            self.load.iteration(clock);
        }
        let rank = self.rank;
        let timeout = self.opts.request_timeout;
        let ctx = |owner| RoundCtx { rank, owner, timeout };
        let mut phases = FuturesUnordered::new();
        let pushes = |t: u32| push.is_some_and(|(_, g)| g.get(t as usize).is_some_and(Option::is_some));
        let pulls = |t: u32| pull.as_ref().is_some_and(|(_, p)| p.get(t as usize).is_some_and(Option::is_some));
        let todo: Vec<Todo> = layout
            .partition
            .blocks
            .iter()
            .map(|b| (*b, pushes(b.tensor), pulls(b.tensor)))
            .filter(|(_, push, pull)| *push || *pull)
            .collect();
        for (owner, items) in by_owner(&layout, todo)? {
            phases.push(phase(ctx(owner), self.peer(owner)?, items, push, pull_clock));
        }
        let mut waits: HashMap<u32, Duration> = HashMap::new();
        let mut refreshes = 0;
        while let Some(done) = phases.next().await {
            let done = done.map_err(|e| self.explain(e))?;
            waits.insert(done.owner, started.elapsed());
            self.load.phase(&done);
            if let Some((_, params)) = pull.as_mut() {
                for (b, values) in done.pulled {
                    if let Some(Some(p)) = params.get_mut(b.tensor as usize) {
                        values.copy_into(&mut p[b.offset..b.offset + b.len]);
                    }
                }
            }
            if !done.to_pull.is_empty() {
                let items: Vec<Todo> = done.to_pull.into_iter().map(|b| (b, false, true)).collect();
                if refreshes == 0 {
                    phases.push(phase(ctx(done.owner), self.peer(done.owner)?, items, push, pull_clock));
                } else {
                    // A refresh meanwhile may have moved them, or dropped their server.
                    for (owner, items) in by_owner(&layout, items)? {
                        phases.push(phase(ctx(owner), self.peer(owner)?, items, push, pull_clock));
                    }
                }
            }
            if done.moved.is_empty() {
                continue;
            }
            refreshes += 1;
            if refreshes > MAX_LAYOUT_REFRESHES || started.elapsed() > self.opts.request_timeout {
                return Err(RuntimeError::Protocol {
                    peer: "servers".into(),
                    what: format!(
                        "blocks kept moving through {refreshes} layout refreshes in {:.1} s",
                        started.elapsed().as_secs_f64()
                    ),
                });
            }
            tracing::debug!(blocks = done.moved.len(), refreshes, "blocks moved; refreshing the layout");
            let epoch = layout.placement.epoch;
            let reply = self
                .sched
                .call(Control::GetLayout.into(), CALL_TIMEOUT, || "the scheduler to send the layout".into())
                .await?;
            self.install_layout(reply).await?;
            layout = self.current_layout()?;
            if layout.placement.epoch == epoch {
                // A server answered Moved before the scheduler published the move: give
                // the scheduler a moment.
                tokio::time::sleep(Duration::from_millis(5 * u64::from(refreshes.min(20)))).await;
            }
            for (owner, items) in by_owner(&layout, done.moved)? {
                phases.push(phase(ctx(owner), self.peer(owner)?, items, push, pull_clock));
            }
        }
        let n = waits.keys().max().map_or(0, |m| *m as usize + 1).max(layout.servers.len());
        let mut per_server = vec![Duration::ZERO; n];
        for (s, w) in waits {
            per_server[s as usize] = w;
            self.load.waited(s, w);
        }
        self.waits = Waits { per_server };
        if let Some(report) = self.load.due() {
            let _ = self.sched.notify(Control::WorkerLoad(report).into());
        }
        Ok(())
    }

    /// The connection to server `owner`.
    fn peer(&self, owner: u32) -> Result<Peer> {
        self.servers.get(&owner).cloned().ok_or_else(|| RuntimeError::Protocol {
            peer: "scheduler".into(),
            what: format!("layout names server {owner}, which it does not list"),
        })
    }

    async fn install_layout(&mut self, reply: Message) -> Result<()> {
        let layout = match reply {
            Message::Control(Control::Layout(l)) => l,
            other => return Err(RuntimeError::unexpected("scheduler", "Layout", &other)),
        };
        for s in &layout.servers {
            if self.servers.contains_key(&s.id) {
                continue;
            }
            let name = format!("server {}", s.id);
            let (peer, _notes) = Peer::connect(&s.addr, self.opts.codec.clone(), &name).await?;
            match peer
                .call(Control::Hello { rank: self.rank }.into(), CALL_TIMEOUT, || format!("{name} to accept Hello"))
                .await?
            {
                Message::Control(Control::Ok) => {}
                other => return Err(RuntimeError::unexpected(&name, "Ok", &other)),
            }
            self.servers.insert(s.id, peer);
        }
        // Servers that left the job (scaled in): drop their connections.
        self.servers.retain(|id, _| layout.servers.iter().any(|s| s.id == *id));
        self.layout = Some(Arc::new(layout));
        Ok(())
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
        match (&e, self.shutdown.lock().unwrap_or_else(|e| e.into_inner()).clone()) {
            (RuntimeError::Closed(_), Some(reason)) => RuntimeError::Shutdown(reason),
            _ => e,
        }
    }
}

/// How many times one round refreshes the layout to chase moved blocks.
const MAX_LAYOUT_REFRESHES: u32 = 64;

/// Who waits on whom, for one server's part of a round.
#[derive(Clone, Copy)]
struct RoundCtx {
    rank: u32,
    owner: u32,
    timeout: Duration,
}

/// A block still to do in a round: (block, still to push, still to pull).
type Todo = (BlockSpec, bool, bool);

/// What the push half of a round sends.
#[derive(Clone, Copy, Debug)]
enum PushOp {
    /// Gradients of this clock.
    Grad(Clock),
    /// Initial values ([`Client::init_values`]).
    Init,
}

impl PushOp {
    /// The verb and clock that errors and timeouts name.
    fn verb_clock(self) -> (&'static str, Clock) {
        match self {
            PushOp::Grad(clock) => ("push", clock),
            PushOp::Init => ("init", 0),
        }
    }
}

/// What one phase (pushes, or pulls) with one server produced.
struct PhaseDone {
    owner: u32,
    /// From the first push sent to the last acknowledgement (push phases).
    push_time: Duration,
    /// Payload bytes pushed and acknowledged.
    push_bytes: u64,
    /// Blocks whose pushes were acknowledged and which are to be pulled now.
    to_pull: Vec<BlockSpec>,
    pulled: Vec<(BlockSpec, Values)>,
    /// Blocks this server no longer owns, with what is still to do for them.
    moved: Vec<Todo>,
}

/// Groups blocks by their owner in `layout`.
fn by_owner(layout: &Layout, items: Vec<Todo>) -> Result<HashMap<u32, Vec<Todo>>> {
    let mut by: HashMap<u32, Vec<_>> = HashMap::new();
    for item in items {
        let owner = layout.placement.owner(item.0.id).ok_or(elasticps_core::CoreError::UnknownBlock(item.0.id))?;
        by.entry(owner).or_default().push(item);
    }
    Ok(by)
}

/// One phase with one server: the pushes of `items` that have one (all in flight at
/// once), or, if none has, their pulls. Blocks pushed and to be pulled come back in
/// `to_pull`, for a pull phase once this one ends.
async fn phase(
    ctx: RoundCtx,
    peer: Peer,
    items: Vec<Todo>,
    push: Option<(PushOp, &[Option<&[f32]>])>,
    pull_clock: Option<Clock>,
) -> Result<PhaseDone> {
    let mut out = PhaseDone {
        owner: ctx.owner,
        push_time: Duration::ZERO,
        push_bytes: 0,
        to_pull: Vec::new(),
        pulled: Vec::new(),
        moved: Vec::new(),
    };
    match push {
        Some((op, grads)) if items.iter().any(|(_, do_push, _)| *do_push) => {
            let pushing = Instant::now();
            let mut acks = Vec::new();
            for (b, do_push, do_pull) in items {
                let Some(Some(grad)) = grads.get(b.tensor as usize).filter(|_| do_push) else {
                    out.to_pull.extend(do_pull.then_some(b));
                    continue;
                };
                let values = crate::pool::copy_values(&grad[b.offset..b.offset + b.len]);
                let msg = match op {
                    PushOp::Grad(clock) => Message::Push { block: b.id, clock, values },
                    PushOp::Init => Message::Init { block: b.id, values },
                };
                acks.push((b, do_pull, peer.send_request(msg)?));
            }
            let (verb, clock) = op.verb_clock();
            for (b, do_pull, rx) in acks {
                match await_reply(&ctx, verb, clock, &b, rx).await? {
                    Message::PushAck { .. } => {
                        out.push_bytes += b.len as u64 * 4;
                        if do_pull {
                            out.to_pull.push(b);
                        }
                    }
                    Message::Control(Control::Moved { .. }) => out.moved.push((b, true, do_pull)),
                    other => return Err(bad_reply(&ctx, "PushAck", &other)),
                }
            }
            out.push_time = pushing.elapsed();
        }
        _ => {
            let Some(clock) = pull_clock else { return Ok(out) };
            let mut replies = Vec::new();
            for (b, _, do_pull) in items {
                if do_pull {
                    replies.push((b, peer.send_request(Message::Pull { block: b.id, clock })?));
                }
            }
            for (b, rx) in replies {
                match await_reply(&ctx, "pull", clock, &b, rx).await? {
                    Message::PullReply { values, .. } if values.len() == b.len => out.pulled.push((b, values)),
                    Message::Control(Control::Moved { .. }) => out.moved.push((b, false, true)),
                    other => return Err(bad_reply(&ctx, &format!("PullReply of {} values", b.len), &other)),
                }
            }
        }
    }
    Ok(out)
}

/// Waits for the reply to one request, at most the request timeout.
async fn await_reply(
    ctx: &RoundCtx,
    verb: &str,
    clock: Clock,
    b: &BlockSpec,
    rx: tokio::sync::oneshot::Receiver<Message>,
) -> Result<Message> {
    match tokio::time::timeout(ctx.timeout, rx).await {
        Ok(Ok(Message::Error(reply))) => Err(RuntimeError::Remote {
            peer: format!(
                "server {} (answering {verb}(clock {clock}) of block {} from worker {})",
                ctx.owner, b.id, ctx.rank
            ),
            reply,
        }),
        Ok(Ok(reply)) => Ok(reply),
        Ok(Err(_)) => Err(RuntimeError::Closed(format!(
            "server {} (before answering {verb}(clock {clock}) of block {} from worker {})",
            ctx.owner, b.id, ctx.rank
        ))),
        Err(_) => Err(RuntimeError::Timeout {
            what: format!(
                "worker {} waits for server {} to answer {verb}(clock {clock}) of block {}",
                ctx.rank, ctx.owner, b.id
            ),
            after: ctx.timeout,
        }),
    }
}

fn bad_reply(ctx: &RoundCtx, wanted: &str, got: &Message) -> RuntimeError {
    RuntimeError::unexpected(&format!("server {}", ctx.owner), wanted, got)
}
