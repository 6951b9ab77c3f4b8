//! The scheduler role: one task runs the scheduler's state machine
//! ([`elasticps_node::scheduler::Scheduler`]) in [`crate::driver::drive`], its timer at
//! the machine's `poll_timeout`; one task per connection reads frames and forwards them
//! as events, and a manifest write's outcome comes back the same way.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Duration;

use elasticps_wire::{Codec, Message};
use tokio::net::TcpListener;
use tokio::sync::{Notify, mpsc};

pub use elasticps_node::scheduler::{
    Action, BalanceLog, BalanceMode, ConnId, DecisionRecord, Event, JobConfig, LoadSample, MigrationEvent, ScaleEvent,
    Scheduler, ServerPoint,
};

use crate::Micros;
use crate::accept::{self, Accepted, Acceptor};
use crate::conn::{self, Outbox};
use crate::driver::World;
use crate::error::{Result, RuntimeError};
use crate::metrics::SchedulerMetrics;
use crate::timer::Timer;
use elasticps_node::Machine;

pub mod state;

/// One connection as the actor sees it: where to send, and how to close it. The reader
/// task holds a clone of the outbox too, so dropping ours alone does not close anything:
/// `close` makes the reader task stop, which drops the last outbox, and the writer task
/// then delivers what is queued and closes the socket.
#[derive(Clone)]
struct Handle {
    out: Outbox,
    close: Arc<Notify>,
    /// Set once the machine says the connection registered: its reader then takes frames
    /// of any kind and size (before, only control frames up to
    /// [`conn::UNREGISTERED_MAX_PAYLOAD`]).
    identified: conn::Identified,
}

/// How to start a scheduler.
#[derive(Clone, Debug)]
pub struct SchedulerOptions {
    /// Listen address (`127.0.0.1:0` picks a free port).
    pub listen: String,
    /// The job.
    pub job: JobConfig,
    /// Frame codec (cluster secret, maximum payload).
    pub codec: Codec,
    /// How long a started frame or handshake may stall before its peer is dropped
    /// ([`crate::conn::FRAME_STALL_TIMEOUT`] by default).
    pub frame_timeout: Duration,
    /// Give up if the cluster is not complete and the model placed within this time.
    pub join_timeout: Duration,
    /// Set these from the membership state on every timeout (served by a
    /// [`crate::metrics::MetricsEndpoint`]).
    pub metrics: Option<Arc<SchedulerMetrics>>,
    /// Keep the recoverable state here (`--state-dir`); a scheduler started with a
    /// directory that holds one recovers it ([`state`]).
    pub state_dir: Option<std::path::PathBuf>,
    /// A job that spans hosts (`--nnodes`): host agents join and start its nodes.
    pub hosts: Option<HostsConfig>,
    /// Where the event lines that host agents relay go (the scheduler's event stream).
    pub relay: Option<crate::events::Emitter>,
}

pub use elasticps_node::scheduler::hosts::HostsConfig;

/// Starts servers for the scheduler when it scales out: a local process launcher (the
/// one `elasticps train` uses), later Kubernetes. Stopping needs no launcher: the
/// scheduler tells a drained server to shut down and it exits.
pub trait Launcher: Send {
    /// Starts one server that registers with the scheduler at `scheduler_addr`.
    fn start_server(&mut self, scheduler_addr: &str) -> std::result::Result<(), String>;
}

/// How a job ended.
#[derive(Clone, Debug)]
pub struct JobEnd {
    /// Why it ended.
    pub reason: String,
    /// Migrations, scaling events and the load timeline.
    pub balance: BalanceLog,
}

/// Runs the scheduler until the job ends. `on_bound` receives the bound address before
/// any node can connect. Returns the reason the job ended, or an error if it failed.
pub async fn run(opts: SchedulerOptions, on_bound: impl FnOnce(SocketAddr)) -> Result<String> {
    run_with(opts, None, on_bound).await.map(|end| end.reason)
}

/// [`run`] with a launcher to start servers when the job scales out; returns the
/// balancing history too.
pub async fn run_with(
    opts: SchedulerOptions,
    launcher: Option<Box<dyn Launcher>>,
    on_bound: impl FnOnce(SocketAddr),
) -> Result<JobEnd> {
    let listener = TcpListener::bind(&opts.listen)
        .await
        .map_err(|e| RuntimeError::io(format!("binding the scheduler's listen address {}", opts.listen), e))?;
    let bound = listener.local_addr().map_err(|e| RuntimeError::io("reading the bound address", e))?;
    on_bound(bound);
    let (events_tx, events) = mpsc::unbounded_channel::<(Event, Option<Handle>)>();
    let accept = tokio::spawn(accept_loop(listener, opts.codec.clone(), opts.frame_timeout, events_tx.clone()));
    let (mut driver, mut machine) = Driver::open(&opts, launcher, bound, events_tx, events)?;
    let mut timer = Timer::new(Micros::new());
    let outcome = match crate::driver::drive(&mut machine, &mut driver, &mut timer, VecDeque::new()).await {
        Ok((ok, reason)) => {
            tracing::info!(ok, %reason, "job over");
            if let Some(d) = &driver.saved {
                d.remove();
            }
            if ok {
                Ok(JobEnd { reason, balance: machine.balance_log().clone() })
            } else {
                Err(RuntimeError::Shutdown(reason))
            }
        }
        Err(e) => Err(e),
    };
    accept.abort();
    driver.close().await;
    outcome
}

/// The scheduler's world: the connections, the state directory, the launcher. It decides
/// nothing: every event goes to the machine, and every action comes out as I/O.
struct Driver<'a> {
    opts: &'a SchedulerOptions,
    saved: Option<state::StateDir>,
    launcher: Option<Box<dyn Launcher>>,
    bound: SocketAddr,
    conns: HashMap<ConnId, Handle>,
    /// Every connection's events, and the outcomes of the manifest writes.
    events: mpsc::UnboundedReceiver<(Event, Option<Handle>)>,
    /// Where a manifest write's outcome goes.
    outcomes: mpsc::UnboundedSender<(Event, Option<Handle>)>,
}

impl<'a> Driver<'a> {
    /// The scheduler's world and its machine: recovered from `--state-dir` when it holds
    /// a saved state, new otherwise.
    fn open(
        opts: &'a SchedulerOptions,
        launcher: Option<Box<dyn Launcher>>,
        bound: SocketAddr,
        outcomes: mpsc::UnboundedSender<(Event, Option<Handle>)>,
        events: mpsc::UnboundedReceiver<(Event, Option<Handle>)>,
    ) -> Result<(Self, Scheduler)> {
        let origin =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64() * 1e3);
        let mut saved = opts.state_dir.as_deref().map(state::StateDir::new);
        let heartbeat_us = elasticps_node::timing::heartbeat_timeout_us(opts.job.replicas);
        let path = saved.as_ref().map_or_else(String::new, |d| d.path().display().to_string());
        let recovered = match saved.as_ref().map(state::StateDir::load).transpose() {
            Ok(Some(Some(s))) => Some(
                Scheduler::recover(opts.job.clone(), s, heartbeat_us)
                    .map_err(|what| RuntimeError::State { path: path.clone(), what }.to_string()),
            ),
            Ok(_) => None,
            Err(e) => Some(Err(e.to_string())),
        };
        let base = match recovered {
            Some(Ok(recovered)) => {
                tracing::info!(state = %path, "scheduler restarted from its saved state");
                recovered
            }
            Some(Err(why)) => {
                // The nodes redialling hear why; the state stays on disk as it is.
                saved = None;
                Scheduler::unrecoverable(opts.job.clone(), why, heartbeat_us)
            }
            None => Scheduler::new(opts.job.clone(), heartbeat_us),
        };
        let base = match opts.hosts.clone() {
            Some(h) => base.with_hosts(h),
            None => base,
        };
        let job = {
            use rand::{RngCore, SeedableRng};
            rand::rngs::StdRng::from_os_rng().next_u64()
        };
        let machine = base
            .with_launcher(launcher.is_some())
            .with_clock_origin(origin)
            .with_credentials(opts.codec.secret(), job)
            .with_join_timeout(u64::try_from(opts.join_timeout.as_micros()).unwrap_or(u64::MAX));
        if let Some(d) = saved.as_mut() {
            d.loaded(&machine);
        }
        let driver = Self { opts, saved, launcher, bound, conns: HashMap::new(), events, outcomes };
        Ok((driver, machine))
    }

    /// One action as I/O; `Finish` is returned, not carried out.
    fn act(&mut self, action: Action) -> Option<(bool, String)> {
        match action {
            Action::Send { conn, request_id, msg } => {
                if let Some(h) = self.conns.get(&conn) {
                    let _ = h.out.send((request_id, msg));
                }
            }
            Action::Close(conn) => {
                if let Some(h) = self.conns.remove(&conn) {
                    h.close.notify_one();
                }
            }
            Action::StartServer => match self.launcher.as_mut() {
                Some(l) => {
                    if let Err(e) = l.start_server(&self.bound.to_string()) {
                        tracing::error!(error = %e, "could not start a server");
                    }
                }
                None => tracing::warn!("a server was to be started, but this scheduler has no launcher"),
            },
            Action::Relay(line) => match &self.opts.relay {
                Some(relay) => relay.emit_line(&line),
                None => tracing::debug!(%line, "a relayed event with nowhere to go"),
            },
            Action::Waiting(what) => {
                if let Some(relay) = &self.opts.relay {
                    relay.emit(&crate::events::Event::Waiting { what });
                }
            }
            Action::WriteManifest { dir, clock, blocks } => {
                // Small, but a disk write: off the driver's task; its outcome comes back.
                let outcomes = self.outcomes.clone();
                tokio::task::spawn_blocking(move || {
                    let error = match crate::checkpoint::write_manifest(std::path::Path::new(&dir), clock, &blocks) {
                        Ok(path) => {
                            tracing::info!(clock, manifest = %path.display(), "checkpoint manifest written");
                            None
                        }
                        Err(e) => Some(e.to_string()),
                    };
                    let _ = outcomes.send((Event::ManifestWritten { clock, error }, None));
                });
            }
            Action::Finish { ok, reason } => return Some((ok, reason)),
        }
        None
    }

    /// Waits, bounded, for the last answers (the `Shutdown` messages) to be in the
    /// sockets before the process exits: each connection's writer says when everything
    /// queued is flushed. (The machine waited for the manifest writes.)
    async fn close(mut self) {
        let writers: Vec<_> = self.conns.drain().map(|(_, h)| h.out.writer().clone()).collect();
        crate::conn::flush_last_writes(&writers, "scheduler").await;
    }
}

/// What woke the scheduler's driver: a connection's event (with its handle, when it
/// opens) or a manifest's outcome.
type Woken = (Event, Option<Handle>);

impl World<Scheduler> for Driver<'_> {
    type Woken = Woken;
    type End = Result<(bool, String)>;

    async fn wait(&mut self) -> Woken {
        match self.events.recv().await {
            Some(woken) => woken,
            // Never: this driver holds a sender itself (for the manifests' outcomes).
            None => std::future::pending().await,
        }
    }

    /// The event to the machine, then its state saved (on disk before any node hears of
    /// the change: the effects are carried out after this).
    async fn feed(
        &mut self,
        machine: &mut Scheduler,
        now: u64,
        woken: Option<Woken>,
        out: &mut Vec<Action>,
    ) -> ControlFlow<Self::End> {
        let mut heard = None;
        let event = match woken {
            None => Event::Timeout,
            Some((event, handle)) => {
                if let Event::Received { conn, .. } = &event {
                    heard = Some(*conn);
                }
                match (&event, handle) {
                    (Event::Connected { conn, .. }, Some(h)) => {
                        self.conns.insert(*conn, h);
                    }
                    (Event::Lost { conn, .. }, _) => {
                        self.conns.remove(conn);
                    }
                    _ => {}
                }
                event
            }
        };
        let timeout = matches!(event, Event::Timeout);
        Machine::handle(machine, now, event, out);
        // Before the answers go out: a node that registered may send its next frame (a
        // large `DefineModel`, say) as soon as it hears its `Welcome`.
        if let Some(conn) = heard
            && let Some(h) = self.conns.get(&conn)
            && !h.identified.is_set()
            && machine.is_registered(conn)
        {
            h.identified.set();
        }
        if let Some(d) = self.saved.as_mut() {
            match d.save_if_changed(machine) {
                Ok(true) => tracing::debug!(state = %d.path().display(), "scheduler state saved"),
                Ok(false) => {}
                Err(e) => tracing::error!(error = %e, "scheduler state not saved"),
            }
        }
        if let Some(m) = self.opts.metrics.as_ref().filter(|_| timeout) {
            m.update(&machine.status(), machine.balance_log());
        }
        ControlFlow::Continue(())
    }

    /// One action as I/O; at `Finish`, the actions decided with it are carried out too,
    /// then the run ends.
    async fn carry_out(
        &mut self,
        _machine: &mut Scheduler,
        _now: u64,
        action: Action,
        queue: &mut VecDeque<Action>,
    ) -> ControlFlow<Self::End> {
        let Some(end) = self.act(action) else { return ControlFlow::Continue(()) };
        for rest in queue.drain(..) {
            self.act(rest);
        }
        ControlFlow::Break(Ok(end))
    }
}

async fn accept_loop(
    listener: TcpListener,
    codec: Codec,
    stall: Duration,
    events: mpsc::UnboundedSender<(Event, Option<Handle>)>,
) {
    let acceptor = Acceptor::new(listener, accept::max_connections());
    let mut next: ConnId = 1;
    loop {
        let accepted: Accepted = acceptor.next().await;
        let addr = accepted.addr;
        let conn = next;
        next += 1;
        let (codec, events) = (codec.clone(), events.clone());
        tokio::spawn(async move {
            let peer = addr.to_string();
            let Some(accept::Admitted { stream, key, permit: _permit }) = accepted.authenticate(&codec, stall).await
            else {
                return;
            };
            let (mut reader, out) = conn::split(stream, codec.for_key(key), peer);
            reader.set_stall_timeout(stall);
            let identified = conn::Identified::default();
            reader.restrict_until(identified.clone(), conn::UNREGISTERED_MAX_PAYLOAD);
            let close = Arc::new(Notify::new());
            // The handle goes with `Connected`: the machine may answer or close a
            // connection that never sends a frame (PROTOCOL.md §8).
            let connected = Event::Connected { conn, peer: addr.ip().to_canonical().to_string(), key };
            if events.send((connected, Some(Handle { out: out.clone(), close: close.clone(), identified }))).is_err() {
                return;
            }
            let why = loop {
                let next = tokio::select! {
                    biased;
                    _ = close.notified() => break "closed by the scheduler".to_string(),
                    next = reader.next() => next,
                };
                match next {
                    Ok(Some((header, msg))) => {
                        let event = Event::Received { conn, request_id: header.request_id, msg };
                        if events.send((event, None)).is_err() {
                            return;
                        }
                    }
                    Ok(None) => break "closed the connection".to_string(),
                    Err(e) => {
                        tracing::warn!(peer = %addr, error = %e, "closing connection");
                        if let RuntimeError::Wire { source, .. } = &e {
                            let reply = elasticps_wire::ErrorReply { code: source.code(), message: source.to_string() };
                            let _ = out.send((reader.refused_request_id(), Message::Error(reply)));
                        }
                        break e.to_string();
                    }
                }
            };
            let _ = events.send((Event::Lost { conn, why }, None));
        });
    }
}
