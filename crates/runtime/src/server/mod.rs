//! The server role: owns blocks, applies pushes, answers pulls under its sync policy,
//! and hands blocks over to other servers while it keeps serving.
//!
//! One task per worker connection reads frames and drives the block state machines of
//! the core ([`elasticps_core::block::Block`]) directly, one short lock per block, so
//! pushes and pulls of different blocks proceed in parallel. A held pull keeps the
//! outbox of its connection as its token: whichever push releases it sends the answer.
//!
//! - [`shard`]: the owned blocks, how a request reaches one, load counters.
//! - [`migrate`]: live migration of one block, old owner and new owner.
//!
//! Every interval the server reports its load to the scheduler; an injected straggler
//! ([`crate::shaping::Shaper`]) slows its sockets and its CPU as the assignment says.

mod migrate;
mod shard;

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use elasticps_core::adaptive::Adaptive;
use elasticps_core::sync::SyncPolicy;
use elasticps_wire::{Codec, Control, ErrorCode, Message, ServerStats};
use tokio::net::{TcpListener, TcpStream};

use crate::conn;
use crate::error::{Result, RuntimeError};
use crate::metrics::ServerMetrics;
use crate::peer::Peer;
use crate::shaping::Shaper;
use crate::{HEARTBEAT_EVERY, Micros, STATS_INTERVAL, timeout};
use migrate::MigrateOrder;
use shard::{Refusal, ReplyTo, Request, Shard, State, error, lock};

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
    /// Expose this server's counters here (served by a [`crate::metrics::MetricsEndpoint`]).
    pub metrics: Option<Arc<ServerMetrics>>,
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
    let state = Arc::new(State {
        codec: opts.codec.clone(),
        clock: Micros::new(),
        shard: RwLock::new(None),
        trace,
        shaper: Shaper::new(),
        load: Default::default(),
        connections: AtomicU64::new(0),
        last_request_us: AtomicU64::new(0),
        migrations_in: AtomicU64::new(0),
        migrations_out: AtomicU64::new(0),
    });

    let (sched, mut notes) = Peer::connect(&opts.scheduler, opts.codec.clone(), "scheduler").await?;
    let welcome = sched
        .call(Control::RegisterServer { data_addr: data_addr.clone() }.into(), crate::CALL_TIMEOUT, || {
            "the scheduler to accept this server".into()
        })
        .await?;
    let id = match welcome {
        Message::Control(Control::Welcome { node_id, .. }) => node_id,
        other => return Err(RuntimeError::unexpected("scheduler", "Welcome", &other)),
    };
    tracing::info!(server = id, addr = %data_addr, "server registered");
    if let Some(m) = &opts.metrics {
        m.attach(id, state.clone());
    }

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
    Ok(state.stats(id))
}

async fn control_loop(id: u32, state: &Arc<State>, sched: &Peer, notes: &mut crate::peer::Notifications) -> Result<()> {
    let mut waiting = tokio::time::interval(Duration::from_secs(10));
    waiting.tick().await;
    let mut interval = tokio::time::interval(STATS_INTERVAL);
    let mut last_report = Instant::now();
    let mut adaptive: Option<Adaptive> = None;
    let mut migrations = tokio::task::JoinSet::new();
    loop {
        let msg = tokio::select! {
            msg = notes.recv() => msg,
            _ = interval.tick() => {
                while migrations.try_join_next().is_some() {} // reap finished migrations
                if let (Some(shard), Some(a)) = (state.current(), adaptive.as_mut()) {
                    let before = a.staleness();
                    let s = a.observe(&state.stats(id).totals);
                    shard.staleness.store(s, Ordering::Relaxed);
                    if s != before {
                        tracing::info!(server = id, from = before, to = s, "adaptive staleness changed");
                    }
                }
                if state.current().is_some() {
                    let load = state.take_load(id, last_report.elapsed().as_micros() as u64);
                    last_report = Instant::now();
                    sched.notify(Control::ServerLoad(load).into())?;
                }
                continue;
            }
            _ = waiting.tick() => {
                match state.current() {
                    None => tracing::info!(server = id, "server waits for the scheduler to assign blocks (a worker must define the model and every server must join)"),
                    Some(shard) => log_long_holds(id, &shard, state.clock.now()),
                }
                continue;
            }
        };
        match msg {
            None => return Err(RuntimeError::Closed("scheduler".into())),
            Some(Message::Control(Control::Assign(a))) => {
                state.shaper.configure(&a.inject);
                if a.inject.bandwidth_bps > 0 || a.inject.interference > 1.0 {
                    tracing::info!(
                        server = id,
                        bandwidth_bps = a.inject.bandwidth_bps,
                        interference = a.inject.interference,
                        after_s = a.inject.at_us as f64 / 1e6,
                        "straggler injection"
                    );
                }
                let shard = Shard::new(a)?;
                let blocks = shard.slots().len();
                tracing::info!(server = id, blocks, sync = %shard.config.sync, "blocks assigned");
                if let SyncPolicy::Adaptive { min, max } = shard.config.sync {
                    adaptive = Some(Adaptive::new(min, max));
                }
                *shard::write(&state.shard) = Some(Arc::new(shard));
                last_report = Instant::now();
                sched.notify(Control::AssignDone { server_id: id }.into())?;
            }
            Some(Message::Control(Control::Migrate { block, to, to_addr, epoch })) => {
                let order = MigrateOrder { block, to, to_addr, epoch };
                migrations.spawn(migrate::migrate_out(state.clone(), id, order, sched.clone()));
            }
            Some(Message::Control(Control::RemoveWorker { rank })) => {
                if let Some(shard) = state.current() {
                    tracing::info!(server = id, rank, "worker removed from every quorum");
                    // Held across the slots, so that a block arriving meanwhile
                    // (migrate::take_delta) sees either the removal or the slot list.
                    let mut removed = shard::lock(&shard.removed_workers);
                    removed.push(rank);
                    for (_, slot) in shard.slots() {
                        let mut s = lock(&slot);
                        let config = shard.config_for(s.block.spec());
                        let answers = s.block.remove_worker(&config, rank, state.clock.now());
                        drop(s);
                        state.send_answers(answers);
                    }
                    drop(removed);
                }
            }
            Some(Message::Control(Control::Shutdown { reason })) => {
                tracing::info!(server = id, %reason, "server shuts down");
                // A drained server is stopped right after its last handover was recorded:
                // finish handing over (answer Moved) and let the writers deliver that.
                let pending = migrations.len();
                let finish = async { while migrations.join_next().await.is_some() {} };
                if tokio::time::timeout(2 * migrate::STEP_TIMEOUT, finish).await.is_err() {
                    tracing::warn!(server = id, pending, "migrations still running at shutdown");
                }
                if state.current().is_some_and(|s| s.slots().is_empty()) {
                    linger(id, state).await;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                return Ok(());
            }
            Some(other) => tracing::warn!(server = id, kind = ?other.kind(), "unexpected message from the scheduler"),
        }
    }
}

/// A drained server stops only once workers stopped using it: a worker whose layout is
/// older than the drain still sends it requests, which must get `Moved`, not a closed
/// socket. It lingers until every data connection is closed (workers drop a server that
/// left their layout) or no request came for [`LINGER_QUIET`].
async fn linger(id: u32, state: &State) {
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        tick.tick().await;
        let open = state.connections.load(Ordering::Relaxed);
        let quiet_us = state.clock.now().saturating_sub(state.last_request_us.load(Ordering::Relaxed));
        if open == 0 || quiet_us > LINGER_QUIET.as_micros() as u64 {
            tracing::info!(server = id, open, quiet_s = quiet_us as f64 / 1e6, "drained server leaves");
            return;
        }
    }
}

/// How long a drained server waits for a request before it leaves anyway.
const LINGER_QUIET: Duration = Duration::from_secs(10);

/// Says, for a pull held for more than 5 s, what it waits for: a held pull is the one
/// wait on a server that no timeout ends (the worker's request timeout does).
fn log_long_holds(id: u32, shard: &Shard, now_us: u64) {
    let longest = shard
        .slots()
        .into_iter()
        .filter_map(|(b, slot)| lock(&slot).block.waiting(now_us).map(|w| (b, w)))
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
/// server down. Workers say Hello first; another server streaming a migrating block sends
/// BlockSnapshot and BlockDelta.
async fn serve_connection(stream: TcpStream, peer: String, state: Arc<State>) {
    let (mut reader, out) = conn::split_shaped(stream, state.codec.clone(), peer.clone(), Some(state.shaper.clone()));
    state.connections.fetch_add(1, Ordering::Relaxed);
    let _open = OnDrop(|| {
        state.connections.fetch_sub(1, Ordering::Relaxed);
    });
    let mut rank: Option<u32> = None;
    let mut introduced = false;
    loop {
        let frame = if introduced {
            reader.next().await
        } else {
            timeout(crate::CALL_TIMEOUT, format!("{peer} to say Hello"), reader.next()).await
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
        let reply = match (msg, rank) {
            (Message::Control(Control::Hello { rank: r }), _) => {
                rank = Some(r);
                introduced = true;
                reader.set_peer(format!("worker {r} ({peer})"));
                Some(Control::Ok.into())
            }
            (Message::Control(Control::GetStats), _) => {
                let sid = state.current().map_or(u32::MAX, |s| s.id);
                Some(Control::Stats(state.stats(sid)).into())
            }
            (Message::Control(Control::BlockSnapshot { epoch, state: snapshot }), _) => {
                introduced = true;
                Some(migrate::take_snapshot(&state, epoch, snapshot))
            }
            (Message::Control(Control::BlockDelta { block, epoch, pushes }), _) => {
                Some(migrate::take_delta(&state, block, epoch, &pushes))
            }
            (Message::Push { block, clock, values }, Some(r)) => {
                state.handle(r, ReplyTo { out: out.clone(), request_id: id, block }, Request::Push { clock, values })
            }
            (Message::Pull { block, clock }, Some(r)) => {
                state.handle(r, ReplyTo { out: out.clone(), request_id: id, block }, Request::Pull { clock })
            }
            (Message::Init { block, values }, Some(r)) => {
                state.handle(r, ReplyTo { out: out.clone(), request_id: id, block }, Request::Init { values })
            }
            (Message::Control(Control::SetOptimizer { tensor, optimizer }), Some(r)) => match state.current() {
                None => Some(Refusal::NotReady.reply(0)),
                Some(shard) => match shard.set_optimizer(tensor, optimizer) {
                    Ok(()) => {
                        tracing::info!(server = shard.id, rank = r, tensor, ?optimizer, "tensor optimizer set");
                        Some(Control::Ok.into())
                    }
                    Err(e) => Some(error(ErrorCode::BadRequest, e.to_string())),
                },
            },
            (other, _) => {
                let what = match rank {
                    None => format!("expected Hello as the first message, got {:?}", other.kind()),
                    Some(_) => format!("a server does not take {:?} messages", other.kind()),
                };
                // Well-formed but out of turn: refuse it and keep the connection (PROTOCOL.md §7).
                tracing::warn!(peer = reader.peer(), %what, "request refused");
                Some(error(ErrorCode::BadRequest, what))
            }
        };
        if let Some(reply) = reply {
            let _ = out.send((id, reply));
        }
    }
}

/// Runs a closure when dropped (a connection count that survives every return path).
struct OnDrop<F: FnMut()>(F);

impl<F: FnMut()> Drop for OnDrop<F> {
    fn drop(&mut self) {
        (self.0)()
    }
}
