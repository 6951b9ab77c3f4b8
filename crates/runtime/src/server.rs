//! The server role: owns blocks, applies pushes, answers pulls under its sync policy.
//!
//! One task per worker connection reads frames and drives the block state machines of
//! the core ([`elasticps_core::block::Block`]) directly, one short lock per block, so
//! pushes and pulls of different blocks proceed in parallel. A held pull keeps the
//! outbox of its connection as its token: whichever push releases it sends the answer.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use elasticps_core::adaptive::Adaptive;
use elasticps_core::block::{Answer, Block, BlockStats, ShardConfig};
use elasticps_core::model::{BlockId, Partition};
use elasticps_core::placement::Placement;
use elasticps_core::stats::Histogram;
use elasticps_core::sync::SyncPolicy;
use elasticps_wire::{Codec, Control, ErrorCode, ErrorReply, Message, ServerStats, Values};
use rand::SeedableRng;
use rand::rngs::StdRng;
use tokio::net::{TcpListener, TcpStream};

use crate::conn::{self, Outbox};
use crate::error::{Result, RuntimeError};
use crate::peer::Peer;
use crate::{HEARTBEAT_EVERY, Micros, STATS_INTERVAL, timeout};

/// How to start a server.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// The scheduler's address.
    pub scheduler: String,
    /// Where to listen for workers (`127.0.0.1:0` picks a free port).
    pub listen: String,
    /// The address workers should dial, if not the bound one (e.g. behind NAT or when
    /// listening on 0.0.0.0).
    pub advertise: Option<String>,
    /// Frame codec (cluster secret, maximum payload).
    pub codec: Codec,
    /// Write one JSON line per answered pull (block, worker, clock, done, held_us) here.
    pub trace: Option<PathBuf>,
}

/// Where an answer goes: the connection's outbox and the request id.
#[derive(Clone, Debug)]
struct ReplyTo {
    out: Outbox,
    request_id: u64,
    block: BlockId,
}

/// The blocks this server owns, with the job's configuration.
struct Shard {
    id: u32,
    /// As assigned; `sync` may be `Adaptive`.
    config: ShardConfig,
    /// The staleness an `Adaptive` policy currently uses.
    staleness: AtomicU32,
    partition: Partition,
    placement: Placement,
    /// The job's seed (initial values, coins).
    seed: u64,
    blocks: HashMap<BlockId, Mutex<Block<ReplyTo>>>,
}

impl Shard {
    /// The configuration to decide with now (an adaptive policy resolved to its current s).
    fn effective(&self) -> ShardConfig {
        ShardConfig { sync: self.config.sync.resolve(self.staleness.load(Ordering::Relaxed)), ..self.config }
    }

    /// The policy as reported: `adaptive:0:8 (s=3)` for an adaptive one.
    fn policy_name(&self) -> String {
        match self.config.sync {
            SyncPolicy::Adaptive { .. } => {
                format!("{} (s={})", self.config.sync, self.staleness.load(Ordering::Relaxed))
            }
            other => other.to_string(),
        }
    }
}

struct State {
    codec: Codec,
    clock: Micros,
    shard: RwLock<Option<Arc<Shard>>>,
    trace: Option<Mutex<std::io::BufWriter<std::fs::File>>>,
}

/// Runs a server until the scheduler shuts the job down; returns its final counters.
pub async fn run(opts: ServerOptions) -> Result<ServerStats> {
    let listener = TcpListener::bind(&opts.listen)
        .await
        .map_err(|e| RuntimeError::io(format!("binding the server's listen address {}", opts.listen), e))?;
    let bound = listener.local_addr().map_err(|e| RuntimeError::io("reading the bound address", e))?;
    let data_addr = opts.advertise.clone().unwrap_or_else(|| bound.to_string());
    let trace = match &opts.trace {
        Some(path) => Some(Mutex::new(std::io::BufWriter::new(
            std::fs::File::create(path)
                .map_err(|e| RuntimeError::io(format!("creating trace {}", path.display()), e))?,
        ))),
        None => None,
    };
    let state = Arc::new(State { codec: opts.codec.clone(), clock: Micros::new(), shard: RwLock::new(None), trace });

    let (sched, mut notes) = Peer::connect(&opts.scheduler, opts.codec.clone(), "scheduler").await?;
    let welcome = sched
        .call(Control::RegisterServer { data_addr: data_addr.clone() }.into(), crate::CALL_TIMEOUT, || {
            "the scheduler to accept this server".into()
        })
        .await?;
    let id = match welcome {
        Message::Control(Control::Welcome { node_id, .. }) => node_id,
        other => return Err(unexpected("scheduler", "Welcome", &other)),
    };
    tracing::info!(server = id, addr = %data_addr, "server registered");

    let accept = tokio::spawn(accept_loop(listener, state.clone()));
    let heartbeat = {
        let sched = sched.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(HEARTBEAT_EVERY);
            while sched.notify(Control::Heartbeat.into()).is_ok() {
                tick.tick().await;
            }
        })
    };

    let result = control_loop(id, &state, &sched, &mut notes).await;
    accept.abort();
    heartbeat.abort();
    if let Some(t) = &state.trace {
        let _ = t.lock().unwrap_or_else(|e| e.into_inner()).flush();
    }
    result?;
    Ok(stats(id, &state))
}

async fn control_loop(id: u32, state: &Arc<State>, sched: &Peer, notes: &mut crate::peer::Notifications) -> Result<()> {
    let mut waiting = tokio::time::interval(Duration::from_secs(10));
    waiting.tick().await;
    let mut interval = tokio::time::interval(STATS_INTERVAL);
    let mut adaptive: Option<Adaptive> = None;
    loop {
        let msg = tokio::select! {
            msg = notes.recv() => msg,
            _ = interval.tick() => {
                if let (Some(shard), Some(a)) = (current(state), adaptive.as_mut()) {
                    let before = a.staleness();
                    let s = a.observe(&stats(id, state).totals);
                    shard.staleness.store(s, Ordering::Relaxed);
                    if s != before {
                        tracing::info!(server = id, from = before, to = s, "adaptive staleness changed");
                    }
                }
                continue;
            }
            _ = waiting.tick() => {
                match current(state) {
                    None => tracing::info!(server = id, "server waits for the scheduler to assign blocks (a worker must define the model and every server must join)"),
                    Some(shard) => log_long_holds(id, &shard, state.clock.now()),
                }
                continue;
            }
        };
        match msg {
            None => return Err(RuntimeError::Closed("scheduler".into())),
            Some(Message::Control(Control::Assign(a))) => {
                let shard = build_shard(a)?;
                tracing::info!(server = id, blocks = shard.blocks.len(), sync = %shard.config.sync, "blocks assigned");
                if let SyncPolicy::Adaptive { min, max } = shard.config.sync {
                    adaptive = Some(Adaptive::new(min, max));
                }
                *state.shard.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(shard));
                sched.notify(Control::AssignDone { server_id: id }.into())?;
            }
            Some(Message::Control(Control::RemoveWorker { rank })) => {
                if let Some(shard) = current(state) {
                    tracing::info!(server = id, rank, "worker removed from every quorum");
                    let config = shard.effective();
                    for b in shard.blocks.values() {
                        let answers = lock(b).remove_worker(&config, rank, state.clock.now());
                        send_answers(state, answers);
                    }
                }
            }
            Some(Message::Control(Control::Shutdown { reason })) => {
                tracing::info!(server = id, %reason, "server shuts down");
                return Ok(());
            }
            Some(other) => tracing::warn!(server = id, kind = ?other.kind(), "unexpected message from the scheduler"),
        }
    }
}

/// Says, for a pull held for more than 5 s, what it waits for: a held pull is the one
/// wait on a server that no timeout ends (the worker's request timeout does).
fn log_long_holds(id: u32, shard: &Shard, now_us: u64) {
    let longest = shard
        .blocks
        .iter()
        .filter_map(|(b, block)| lock(block).waiting(now_us).map(|w| (*b, w)))
        .max_by_key(|(_, w)| w.held_us);
    if let Some((block, w)) = longest.filter(|(_, w)| w.held_us > 5_000_000) {
        tracing::warn!(
            server = id,
            block,
            held_s = w.held_us / 1_000_000,
            "pull({}) of worker {} waits for worker {} to push clock {}",
            w.clock,
            w.worker,
            w.slowest,
            w.next_clock
        );
    }
}

fn build_shard(a: elasticps_wire::Assignment) -> Result<Shard> {
    let mut blocks = HashMap::new();
    for b in a.placement.blocks_of(a.server_id) {
        let spec = *a.partition.block(b)?;
        let values = a.partition.init_values(b, a.seed)?;
        let block = Block::new(spec, values, &a.config)?;
        blocks.insert(b, Mutex::new(block));
    }
    let staleness = match a.config.sync {
        SyncPolicy::Adaptive { min, .. } => min,
        _ => 0,
    };
    Ok(Shard {
        id: a.server_id,
        config: a.config,
        staleness: AtomicU32::new(staleness),
        partition: a.partition,
        placement: a.placement,
        seed: a.seed,
        blocks,
    })
}

fn current(state: &State) -> Option<Arc<Shard>> {
    state.shard.read().unwrap_or_else(|e| e.into_inner()).clone()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn stats(id: u32, state: &State) -> ServerStats {
    let mut totals = BlockStats::default();
    let mut hist = Histogram::default();
    let (mut blocks, mut bytes, mut sync) = (0, 0, String::new());
    if let Some(shard) = current(state) {
        sync = shard.policy_name();
        for b in shard.blocks.values() {
            let b = lock(b);
            totals.merge(b.stats());
            hist.merge(b.hold_histogram());
            blocks += 1;
            bytes += b.spec().bytes() as u64;
        }
    }
    ServerStats { server_id: id, sync, blocks, bytes, totals, hold_p99_us: hist.quantile(0.99) }
}

async fn accept_loop(listener: TcpListener, state: Arc<State>) {
    loop {
        match listener.accept().await {
            Ok((stream, addr)) => {
                tokio::spawn(serve_connection(stream, addr.to_string(), state.clone()));
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Serves one connection until it closes or sends something invalid; never takes the
/// server down.
async fn serve_connection(stream: TcpStream, peer: String, state: Arc<State>) {
    let (mut reader, out) = conn::split(stream, state.codec.clone(), peer.clone());
    let mut rank: Option<u32> = None;
    loop {
        let frame = if rank.is_none() {
            timeout(crate::CALL_TIMEOUT, format!("{peer} to say Hello"), reader.next()).await
        } else {
            reader.next().await
        };
        let (header, msg) = match frame {
            Ok(Some(f)) => f,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(peer = %peer, error = %e, "closing connection");
                if let RuntimeError::Wire { source, .. } = &e {
                    let _ = out.send((reader.refused_request_id(), error(source.code(), source.to_string())));
                }
                return;
            }
        };
        let id = header.request_id;
        match (msg, rank) {
            (Message::Control(Control::Hello { rank: r }), _) => {
                rank = Some(r);
                reader.set_peer(format!("worker {r} ({peer})"));
                let _ = out.send((id, Control::Ok.into()));
            }
            (Message::Control(Control::GetStats), _) => {
                let sid = current(&state).map_or(u32::MAX, |s| s.id);
                let _ = out.send((id, Control::Stats(stats(sid, &state)).into()));
            }
            (Message::Push { block, clock, values }, Some(r)) => {
                let _ = out.send((id, push(&state, r, block, clock, &values)));
            }
            (Message::Pull { block, clock }, Some(r)) => {
                let to = ReplyTo { out: out.clone(), request_id: id, block };
                if let Some(reply) = pull(&state, r, block, clock, to) {
                    let _ = out.send((id, reply));
                }
            }
            (other, _) => {
                let what = match rank {
                    None => format!("expected Hello as the first message, got {:?}", other.kind()),
                    Some(_) => format!("a server does not take {:?} messages", other.kind()),
                };
                // Well-formed but out of turn: refuse it and keep the connection (PROTOCOL.md §7).
                tracing::warn!(peer = reader.peer(), %what, "request refused");
                let _ = out.send((id, error(ErrorCode::BadRequest, what)));
            }
        }
    }
}

fn error(code: ErrorCode, message: impl Into<String>) -> Message {
    Message::Error(ErrorReply { code, message: message.into() })
}

/// Why a request cannot be served here.
enum Refusal {
    /// No assignment yet.
    NotReady,
    /// Another server owns the block.
    Moved { owner: u32, epoch: u64 },
    /// The model has no such block.
    Unknown { blocks: usize },
}

impl Refusal {
    fn reply(self, block: BlockId) -> Message {
        match self {
            Refusal::NotReady => error(ErrorCode::NotReady, "this server holds no blocks yet: the model is not placed"),
            Refusal::Moved { owner, epoch } => Control::Moved { block, owner, epoch }.into(),
            Refusal::Unknown { blocks } => {
                error(ErrorCode::UnknownBlock, format!("block {block} does not exist: the model has {blocks} blocks"))
            }
        }
    }
}

/// Runs `f` on the block's state machine, or says why the block is not here.
fn with_block<R>(
    state: &State,
    block: BlockId,
    f: impl FnOnce(&Shard, &mut Block<ReplyTo>) -> R,
) -> Result<R, Refusal> {
    let shard = current(state).ok_or(Refusal::NotReady)?;
    match (shard.blocks.get(&block), shard.placement.owner(block)) {
        (Some(b), _) => Ok(f(&shard, &mut lock(b))),
        (None, Some(owner)) => Err(Refusal::Moved { owner, epoch: shard.placement.epoch }),
        (None, None) => Err(Refusal::Unknown { blocks: shard.partition.blocks.len() }),
    }
}

fn push(state: &State, rank: u32, block: BlockId, clock: u32, values: &Values) -> Message {
    let now = state.clock.now();
    let result = with_block(state, block, |shard, b| {
        let grad = values.to_f32s();
        b.push(&shard.effective(), rank, clock, &grad, now)
    });
    match result {
        Ok(Ok(answers)) => {
            send_answers(state, answers);
            Message::PushAck { block, clock }
        }
        Ok(Err(e)) => error(ErrorCode::BadRequest, e.to_string()),
        Err(refusal) => refusal.reply(block),
    }
}

fn pull(state: &State, rank: u32, block: BlockId, clock: u32, to: ReplyTo) -> Option<Message> {
    let now = state.clock.now();
    // One coin per pull request, not per block: every block (on every server) of worker
    // `rank`'s pull(clock) draws the same value, so a probabilistic policy pauses the
    // whole pull or none of it.
    let result = with_block(state, block, |shard, b| {
        let mut coin = StdRng::seed_from_u64(pull_coin_seed(shard.seed, rank, clock));
        b.pull(&shard.effective(), to, rank, clock, now, &mut coin)
    });
    match result {
        Ok(Ok(Some(answer))) => {
            send_answers(state, vec![answer]);
            None
        }
        Ok(Ok(None)) => None,
        Ok(Err(e)) => Some(error(ErrorCode::BadRequest, e.to_string())),
        Err(refusal) => Some(refusal.reply(block)),
    }
}

/// The seed of the coin of worker `rank`'s pull(clock): the same on every server.
fn pull_coin_seed(job_seed: u64, rank: u32, clock: u32) -> u64 {
    let key = (u64::from(rank) << 32) | u64::from(clock);
    (job_seed ^ key.wrapping_mul(0x9E37_79B9_7F4A_7C15)).rotate_left(29)
}

fn send_answers(state: &State, answers: Vec<Answer<ReplyTo>>) {
    for a in answers {
        if let Some(trace) = &state.trace {
            let mut t = lock(trace);
            let _ = writeln!(
                t,
                r#"{{"block":{},"worker":{},"clock":{},"done":{},"held_us":{}}}"#,
                a.token.block,
                a.worker,
                a.clock,
                a.done,
                a.held_us.map_or("null".to_string(), |u| u.to_string())
            );
        }
        let msg = Message::PullReply { block: a.token.block, clock: a.clock, values: Values::from_shared(a.values) };
        let _ = a.token.out.send((a.token.request_id, msg));
    }
}

fn unexpected(peer: &str, wanted: &str, got: &Message) -> RuntimeError {
    RuntimeError::Protocol { peer: peer.into(), what: format!("expected {wanted}, got {:?}", got.kind()) }
}
