//! The server role's I/O around its state machine ([`elasticps_node::server::Server`]):
//! the data listener and one reader task per connection turning frames into events, the
//! scheduler's connection, a ticker, one ordered link to each other server for
//! migration steps and replication (`links`), the straggler shaper, the `--trace` writer and the metrics source.
//!
//! The state machine sits behind one mutex; each event is one short `step` under it,
//! and the actions it returns are carried out after the lock is released. An injected
//! straggler ([`crate::shaping::Shaper`]) slows the server's sockets and, after a data
//! request, spins `FACTOR - 1` times the time its `step` took.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::io::Write;
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use elasticps_node::Machine;
use elasticps_node::server::{Action, Event, Exit, Server};
use elasticps_node::session::SessionConfig;
use elasticps_wire::{Codec, Control, Credential, KeyId, Message, ServerStats};
use tokio::net::TcpListener;
use tokio::sync::Notify;

use crate::accept::{self, Acceptor};
use crate::conn;
use crate::driver::World;
use crate::error::{Result, RuntimeError};
use crate::metrics::{ServerMetrics, ServerSnapshot, ServerSource};
use crate::session::{LinkEnd, Reattach, SchedLink};
use crate::shaping::Shaper;
use crate::timer::Timer;
use crate::{CALL_TIMEOUT, Micros, timeout};

mod links;
mod replies;

pub use elasticps_node::server::MAX_CLOCK_LEAD;

use links::Links;
use replies::Replies;

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
    /// How long a started frame or handshake may stall before its peer is dropped
    /// ([`crate::conn::FRAME_STALL_TIMEOUT`] by default).
    pub frame_timeout: Duration,
    /// Write one JSON line per answered pull (block, worker, clock, done, held_us) here.
    pub trace: Option<PathBuf>,
    /// Expose this server's counters here (served by a [`crate::metrics::MetricsEndpoint`]).
    pub metrics: Option<Arc<ServerMetrics>>,
    /// How long to retry a lost scheduler connection (a scheduler restarted with
    /// `--state-dir`: the server reattaches with its id and blocks); zero: never.
    pub scheduler_retry: Duration,
    /// Refuse pulls more than this many clocks past their block's `done`
    /// (`--max-clock-lead`, [`elasticps_node::server::MAX_CLOCK_LEAD`] by default).
    pub max_clock_lead: u32,
}

/// Everything the tasks of one server share.
struct Io {
    server: Mutex<Server>,
    clock: Micros,
    codec: Codec,
    frame_timeout: Duration,
    shaper: Arc<Shaper>,
    /// The link to the scheduler ([`crate::session`]: heartbeats, reattach, calls made
    /// again are the node layer's session).
    sched: SchedLink,
    /// When the main loop wakes the state machine ([`Server::poll_timeout`], µs);
    /// a step on another task that moves it earlier says so through `rearm`.
    wake_us: AtomicU64,
    rearm: Notify,
    /// The open data connections' replies, in the order the machine emitted them.
    replies: Replies,
    next_conn: AtomicU64,
    /// Connections to other servers, by data address.
    links: Links,
    trace: Option<Mutex<std::io::BufWriter<std::fs::File>>>,
    exit: Mutex<Option<Exit>>,
    exited: Notify,
}

/// The metrics read the state machine's counters at scrape time.
struct Source(Arc<Io>);

impl ServerSource for Source {
    fn snapshot(&self) -> ServerSnapshot {
        lock(&self.0.server).metrics_snapshot()
    }
}

/// `--advertise` with the bound port where it names none (`10.0.0.2` or `10.0.0.2:0`
/// advertise `10.0.0.2:PORT`).
fn with_port(advertise: &str, port: u16) -> String {
    if let Ok(ip) = advertise.trim_matches(['[', ']']).parse::<std::net::IpAddr>() {
        return std::net::SocketAddr::new(ip, port).to_string();
    }
    match advertise.rsplit_once(':') {
        Some((host, "0")) => format!("{host}:{port}"),
        Some((_, p)) if p.parse::<u16>().is_ok() => advertise.to_string(),
        _ => format!("{advertise}:{port}"),
    }
}

/// Runs a server until the scheduler shuts the job down; returns its final counters.
pub async fn run(opts: ServerOptions) -> Result<ServerStats> {
    let listener = TcpListener::bind(&opts.listen)
        .await
        .map_err(|e| RuntimeError::io(format!("binding the server's listen address {}", opts.listen), e))?;
    let bound = listener.local_addr().map_err(|e| RuntimeError::io("reading the bound address", e))?;
    let data_addr = opts.advertise.as_deref().map_or_else(|| bound.to_string(), |a| with_port(a, bound.port()));
    let (io, notes) = Io::open(&opts, data_addr).await?;
    let start = lock(&io.server).start(io.clock.now());
    io.apply(start);
    let accept = tokio::spawn(accept_loop(listener, io.clone()));
    let result = drive(&io, notes, opts.metrics.as_ref()).await;
    accept.abort();
    // Its last notifications to the scheduler (a checkpoint's `CheckpointWritten`) are
    // written before the process exits.
    if !io.sched.is_over() && !io.sched.flushed(crate::conn::LAST_WRITES_TIMEOUT).await {
        tracing::warn!("the server exits before its last messages to the scheduler were written");
    }
    io.close().await;
    result?;
    let stats = lock(&io.server).stats();
    Ok(stats)
}

/// The server's main task: the scheduler's messages and the machine's deadlines, until
/// the machine exits (frames from workers and servers are stepped by their readers).
async fn drive(
    io: &Arc<Io>,
    notes: tokio::sync::mpsc::UnboundedReceiver<Message>,
    metrics: Option<&Arc<ServerMetrics>>,
) -> Result<()> {
    let mut world = Main { io: io.clone(), notes, metrics, attached: false, scheduler_open: true };
    let mut timer = Timer::new(io.clock);
    crate::driver::drive(&mut Shared(io.clone()), &mut world, &mut timer, VecDeque::new()).await
}

/// The server's machine as its main task runs it: shared with the connections' reader
/// tasks, which step it too ([`Io::step_on`]), so its effects are carried out under its
/// lock ([`Io::step`]: in the order it decided them) and none comes out to the loop.
struct Shared(Arc<Io>);

impl Machine for Shared {
    type Input<'a> = Event;
    type Output = std::convert::Infallible;

    fn handle(&mut self, _now_us: u64, input: Event, _out: &mut Vec<Self::Output>) {
        self.0.step(input, false);
    }

    /// The machine's deadline, published for the reader tasks: a step on one of them
    /// that moves it earlier wakes the main task ([`Io::decide`]).
    fn poll_timeout(&self) -> Option<u64> {
        // Published under the lock: a step on another task after it sees this deadline,
        // and wakes the main task if it moves it earlier.
        let server = lock(&self.0.server);
        let deadline = server.poll_timeout();
        self.0.wake_us.store(deadline.unwrap_or(u64::MAX), Ordering::Relaxed);
        drop(server);
        deadline
    }
}

/// The main task's world: the scheduler's notifications, and the wake-ups of the other
/// tasks (a deadline moved earlier, the machine's exit).
struct Main<'a> {
    io: Arc<Io>,
    notes: tokio::sync::mpsc::UnboundedReceiver<Message>,
    metrics: Option<&'a Arc<ServerMetrics>>,
    attached: bool,
    scheduler_open: bool,
}

/// What woke the server's main task (rare and short-lived: not boxed).
#[allow(clippy::large_enum_variant)]
enum Woken {
    /// The scheduler's notification (`None`: the link is over).
    Note(Option<Message>),
    /// Another task moved the deadline earlier, or the machine exited.
    Rearm,
}

impl World<Shared> for Main<'_> {
    type Woken = Woken;
    type End = Result<()>;

    async fn wait(&mut self) -> Woken {
        tokio::select! {
            note = self.notes.recv(), if self.scheduler_open => Woken::Note(note),
            _ = self.io.rearm.notified() => Woken::Rearm,
            _ = self.io.exited.notified() => Woken::Rearm,
        }
    }

    async fn feed(
        &mut self,
        machine: &mut Shared,
        now: u64,
        woken: Option<Woken>,
        out: &mut Vec<Infallible>,
    ) -> ControlFlow<Result<()>> {
        match woken {
            None => {
                let shaped = self.io.shaper.take_shaped_us();
                lock(&self.io.server).charge(0, shaped);
                machine.handle(now, Event::Timeout, out);
            }
            Some(Woken::Note(Some(msg))) => {
                if let Message::Control(Control::Assign(a)) = &msg {
                    self.io.shaper.configure(&a.inject);
                }
                machine.handle(now, Event::FromScheduler { request_id: 0, msg }, out);
            }
            // The link is over. After `Shutdown` the scheduler may close first; the
            // server still finishes.
            Some(Woken::Note(None)) => match self.io.sched.end() {
                Some(LinkEnd::Lost(why)) => return ControlFlow::Break(Err(RuntimeError::SchedulerLost(why))),
                _ => self.scheduler_open = false,
            },
            Some(Woken::Rearm) => {}
        }
        if !self.attached
            && let (Some(m), Some(id)) = (self.metrics, lock(&self.io.server).id())
        {
            m.attach(id, Arc::new(Source(self.io.clone())));
            self.attached = true;
        }
        ControlFlow::Continue(())
    }

    async fn carry_out(
        &mut self,
        _machine: &mut Shared,
        _now: u64,
        effect: Infallible,
        _queue: &mut VecDeque<Infallible>,
    ) -> ControlFlow<Result<()>> {
        match effect {}
    }

    /// The machine's exit ends the run.
    fn settled(&mut self, _machine: &Shared) -> ControlFlow<Result<()>> {
        match lock(&self.io.exit).take() {
            None => ControlFlow::Continue(()),
            Some(Exit::Shutdown { .. }) => ControlFlow::Break(Ok(())),
            Some(Exit::Failed { reason }) => {
                ControlFlow::Break(Err(RuntimeError::Protocol { peer: "scheduler".into(), what: reason }))
            }
        }
    }
}

impl Io {
    /// The server's shared state, its link to the scheduler open (the scheduler's own
    /// messages come out of the returned channel).
    async fn open(
        opts: &ServerOptions,
        data_addr: String,
    ) -> Result<(Arc<Self>, tokio::sync::mpsc::UnboundedReceiver<Message>)> {
        let trace = match &opts.trace {
            Some(path) => Some(Mutex::new(std::io::BufWriter::new(
                std::fs::File::create(path)
                    .map_err(|e| RuntimeError::io(format!("creating trace {}", path.display()), e))?,
            ))),
            None => None,
        };
        // The reattach introduces the server with its blocks at the time (its state).
        let me: Arc<OnceLock<Weak<Io>>> = Arc::default();
        let reattach: Reattach = {
            let (me, data_addr) = (me.clone(), data_addr.clone());
            Box::new(move || {
                let io = me.get()?.upgrade()?;
                elasticps_node::scheduler::reattach_message(&lock(&io.server), &data_addr).map(Message::from)
            })
        };
        let retry_us = u64::try_from(opts.scheduler_retry.as_micros()).unwrap_or(u64::MAX);
        let config = SessionConfig { retry_us, heartbeats: true };
        let (sched, notes) = SchedLink::connect(&opts.scheduler, opts.codec.clone(), config, reattach).await?;
        let io = Arc::new(Io {
            server: Mutex::new(
                Server::new(data_addr)
                    .with_trace(trace.is_some())
                    .with_secret(opts.codec.secret())
                    .with_max_clock_lead(opts.max_clock_lead)
                    .with_max_payload(opts.codec.max_payload()),
            ),
            clock: Micros::new(),
            codec: opts.codec.clone(),
            frame_timeout: opts.frame_timeout,
            shaper: Shaper::new(),
            sched,
            wake_us: AtomicU64::new(u64::MAX),
            rearm: Notify::new(),
            replies: Replies::default(),
            next_conn: AtomicU64::new(1),
            links: Links::default(),
            trace,
            exit: Mutex::new(None),
            exited: Notify::new(),
        });
        let _ = me.set(Arc::downgrade(&io));
        Ok((io, notes))
    }

    /// Waits, bounded, for the last answers (`Moved`, `Shutdown`) to be in the sockets,
    /// then flushes the trace.
    async fn close(&self) {
        crate::conn::flush_last_writes(&self.replies.writers(), "server").await;
        if let Some(t) = &self.trace {
            let _ = lock(t).flush();
        }
    }

    /// One event through the state machine; a data request's time is charged (and
    /// multiplied by the injected interference) before its answers go out.
    fn step(self: &Arc<Self>, ev: Event, data: bool) {
        let actions = self.decide(ev, data, None);
        self.apply(actions);
    }

    /// The state machine's actions for one event (the lock held only for the step).
    /// Messages to other servers are handed to their links, and replies to their
    /// connections ([`Replies`]; those to `on`, the connection whose reader task steps,
    /// held for it to write), before the lock is released: each link and connection
    /// carries them in the order they were decided (a backup's snapshot before the
    /// pushes forwarded after it; a held push_pull's `PushAck` before its `PullReply`).
    fn decide(self: &Arc<Self>, ev: Event, data: bool, on: Option<u64>) -> Vec<Action> {
        let mut server = lock(&self.server);
        let started = Instant::now();
        let mut actions = server.handle(self.clock.now(), ev);
        // A deadline earlier than the main loop sleeps until (a migration step's, a
        // resync's) wakes it. Only control events set those: a data request (the push and
        // pull path) never moves a deadline earlier, so it skips poll_timeout's scan.
        if !data
            && let Some(at) = server.poll_timeout()
            && at < self.wake_us.load(Ordering::Relaxed)
        {
            self.wake_us.store(at, Ordering::Relaxed);
            self.rearm.notify_one();
        }
        self.send_to_servers(&mut actions, server.credential());
        self.route_replies(on, &mut actions);
        if data {
            let spent = started.elapsed();
            server.charge(spent.as_micros() as u64, 0);
            drop(server);
            let spun = self.shaper.interfere(spent);
            if !spun.is_zero() {
                // The injected interference is the request's handling too: the server's
                // capacity (its busy time against its link's) shows it.
                lock(&self.server).charge(spun.as_micros() as u64, 0);
            }
        }
        actions
    }

    /// Hands the replies in `actions` to their connections, in order, and takes them out:
    /// those to `on` are held for its reader task.
    fn route_replies(&self, on: Option<u64>, actions: &mut Vec<Action>) {
        actions.retain_mut(|a| match a {
            Action::Reply { conn, request_id, msg } => {
                let reply = (*request_id, std::mem::replace(msg, Message::Control(Control::Ok)));
                if on == Some(*conn) {
                    self.replies.hold(*conn, reply);
                } else {
                    self.replies.send(*conn, reply);
                }
                false
            }
            _ => true,
        });
    }

    /// Hands the messages to other servers in `actions` to their links, in order, and
    /// takes them out; a new connection says `Hello` with `credential` (this server's).
    fn send_to_servers(self: &Arc<Self>, actions: &mut Vec<Action>, credential: Option<&Credential>) {
        actions.retain_mut(|a| match a {
            Action::ToServer { call, server, addr, msg } => {
                let msg = std::mem::replace(msg, Message::Control(Control::Ok));
                self.links.send(self, *call, *server, addr, msg, credential);
                false
            }
            _ => true,
        });
    }

    /// [`Io::step`] for a frame that arrived on connection `conn`: the replies to `conn`
    /// are held (in order) for its reader task to write itself, with no hop to the
    /// writer task ([`Replies`]); every other action is carried out as usual. True if the
    /// state machine closes `conn` (its reader task writes the replies, then stops).
    fn step_on(self: &Arc<Self>, conn: u64, ev: Event, data: bool) -> bool {
        let mut actions = self.decide(ev, data, Some(conn));
        let mut close = false;
        actions.retain_mut(|a| match a {
            Action::Close { conn: c } if *c == conn => {
                close = true;
                false
            }
            _ => true,
        });
        self.apply(actions);
        close
    }

    fn apply(self: &Arc<Self>, actions: Vec<Action>) {
        for action in actions {
            match action {
                // Routed in `decide`, in the order the state machine emitted them.
                Action::Reply { .. } => {}
                Action::ToScheduler { request_id: 0, msg } => {
                    let _ = self.sched.notify(msg);
                }
                Action::ToScheduler { request_id, msg } => self.call_scheduler(request_id, msg),
                // Sent in `decide`, in the order the state machine emitted them.
                Action::ToServer { .. } => {}
                Action::Trace(t) => {
                    if let Some(trace) = &self.trace {
                        let _ = writeln!(lock(trace), "{}", t.json());
                    }
                }
                Action::Checkpoint { dir, clock, state } => {
                    let io = self.clone();
                    tokio::task::spawn_blocking(move || {
                        let block = state.spec.id;
                        let result = crate::checkpoint::write_block(std::path::Path::new(&dir), clock, &state)
                            .map_err(|e| e.to_string());
                        io.step(Event::CheckpointWritten { clock, block, result }, false);
                    });
                }
                Action::Restore { dir, blocks } => {
                    let io = self.clone();
                    tokio::task::spawn_blocking(move || {
                        let states = crate::checkpoint::read_blocks(std::path::Path::new(&dir), &blocks)
                            .map_err(|e| e.to_string());
                        io.step(Event::Restored(states), false);
                    });
                }
                // Closed by its reader task, which takes it from `step_on`.
                Action::Close { conn } => self.replies.close(conn),
                Action::Exit(exit) => {
                    *lock(&self.exit) = Some(exit);
                    self.exited.notify_one();
                }
            }
        }
    }

    /// A call to the scheduler, its answer handed to the state machine. The session
    /// makes it again after a reattach; one that fails needs no event: the state
    /// machine's deadline covers it.
    fn call_scheduler(self: &Arc<Self>, request_id: u64, msg: Message) {
        let io = self.clone();
        tokio::spawn(async move {
            match io.sched.request(msg, CALL_TIMEOUT, || format!("the scheduler to answer call {request_id}")).await {
                Ok(msg) => io.step(Event::FromScheduler { request_id, msg }, false),
                Err(e) => tracing::warn!(request_id, error = %e, "a scheduler call failed"),
            }
        });
    }
}

async fn accept_loop(listener: TcpListener, io: Arc<Io>) {
    let acceptor = Acceptor::new(listener, accept::max_connections());
    loop {
        let a = acceptor.next().await;
        let io = io.clone();
        tokio::spawn(async move {
            let peer = a.addr.to_string();
            if let Some(admitted) = a.authenticate(&io.codec, io.frame_timeout).await {
                serve_connection(admitted.stream, admitted.key, peer, io).await;
                drop(admitted.permit);
            }
        });
    }
}

/// Reads one connection's frames into the state machine until it closes or sends
/// something invalid; never takes the server down. Until the peer says Hello (or streams
/// a block) each frame must come within [`CALL_TIMEOUT`].
async fn serve_connection(stream: crate::tls::Stream, key: KeyId, peer: String, io: Arc<Io>) {
    let conn = io.next_conn.fetch_add(1, Ordering::Relaxed);
    let (mut reader, out) = conn::split_shaped(stream, io.codec.for_key(key), peer.clone(), Some(io.shaper.clone()));
    reader.set_stall_timeout(io.frame_timeout);
    // Until its Hello is taken, a connection may send small control frames alone: a data
    // frame, or a larger one, is refused from its header (PROTOCOL.md §2, check 8).
    let identified = conn::Identified::default();
    reader.restrict_until(identified.clone(), conn::PRE_HELLO_MAX_PAYLOAD);
    io.replies.open(conn, out.clone());
    io.step(Event::Opened { conn, key }, false);
    let mut introduced = false;
    loop {
        let frame = if introduced {
            reader.next().await
        } else {
            timeout(CALL_TIMEOUT, format!("{peer} to say Hello"), reader.next()).await
        };
        let (header, msg) = match frame {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) => {
                let _ = io.replies.flush(conn, false).await;
                tracing::warn!(peer = %peer, error = %e, "closing connection");
                if let RuntimeError::Wire { source, .. } = &e {
                    let reply = elasticps_wire::ErrorReply { code: source.code(), message: source.to_string() };
                    let _ = out.send((reader.refused_request_id(), Message::Error(reply)));
                }
                break;
            }
        };
        let hello = match &msg {
            Message::Control(Control::Hello { credential }) => Some(format!("{credential} ({peer})")),
            _ => None,
        };
        let data = msg.is_data_request();
        if data && header.payload_len > 0 {
            lock(&io.server).arrived(u64::from(header.payload_len), reader.last_payload_ns());
        }
        let close = io.step_on(conn, Event::Received { conn, request_id: header.request_id, msg }, data);
        if close {
            // A credential that does not hold: the refusal goes out, then the connection closes.
            let _ = io.replies.flush(conn, false).await;
            tracing::warn!(peer = %peer, "connection closed: its Hello was refused");
            break;
        }
        if let Some(name) = hello
            && lock(&io.server).introduced(conn)
        {
            reader.set_peer(name);
        }
        // Replies wait while more requests are already read (a burst of a round's
        // blocks): one write answers them all. A capped server hands them to the writer
        // task instead, so that waiting in the outgoing bucket never stops this task from
        // reading (the two directions of a NIC are shaped, and overlap, independently).
        if io.shaper.caps_bandwidth() {
            let _ = io.replies.flush(conn, true).await;
        } else if !reader.has_buffered()
            && let Err(e) = io.replies.flush(conn, false).await
        {
            tracing::debug!(peer = %peer, error = %e, "replies not written");
        }
        if !introduced && lock(&io.server).introduced(conn) {
            introduced = true;
            identified.set();
        }
    }
    io.replies.close(conn);
    io.step(Event::Closed { conn }, false);
}

/// Locks, ignoring poisoning (the state machine never panics on input; a panicked
/// holder left its state as consistent as any `step` does).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
