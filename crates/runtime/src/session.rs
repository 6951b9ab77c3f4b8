//! A node's connection to the scheduler, carried out over TCP: the tokio driver of
//! [`elasticps_node::session::Session`], which decides everything (heartbeats, when to
//! dial a lost scheduler again and for how long, the reattach, the calls made again and
//! their order). This task only connects, writes what the session says, reads frames
//! and keeps time.
//!
//! One driver task per node owns the connection. The node's code holds a [`SchedLink`]
//! (calls and notifications, from any task) and reads the scheduler's notifications
//! from the [`Notifications`] channel, which closes when the link is over;
//! [`SchedLink::end`] then says why.

use std::collections::{HashMap, VecDeque};
use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use elasticps_node::session::{Action, Event, REATTACH_ID, Session, SessionConfig};
use elasticps_wire::{Codec, Message};
use tokio::sync::{mpsc, oneshot, watch};

use crate::Micros;
use crate::conn::{self, Outbox};
use crate::driver::World;
use crate::error::{Result, RuntimeError};
use crate::timer::Timer;
use elasticps_node::Machine;

/// How long a node retries a lost scheduler by default (`--scheduler-retry-s`).
pub const DEFAULT_SCHEDULER_RETRY: Duration = Duration::from_secs(60);

/// The scheduler's notifications (request id 0), over every connection of the link; the
/// channel closes when the link is over.
pub type Notifications = mpsc::UnboundedReceiver<Message>;

/// Makes the message that introduces the node to a restarted scheduler
/// (`ReattachServer`, `ReattachWorker`) from its state at the time; `None`: the node has
/// nothing to reattach as (the link ends).
pub type Reattach = Box<dyn Fn() -> Option<Message> + Send + Sync>;

/// What the node asks of its driver task.
enum Command {
    Call {
        request_id: u64,
        msg: Message,
        within: Duration,
        what: String,
        reply: oneshot::Sender<Result<Message>>,
    },
    Notify(Message),
    /// Answer once everything sent so far is written to the socket.
    Flush(oneshot::Sender<()>),
}

/// How the link ended: `None` while it lives.
pub type Ended = Option<LinkEnd>;

/// How a link to the scheduler ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinkEnd {
    /// The scheduler ended the job (its `Shutdown`), for this reason.
    Shutdown(String),
    /// The scheduler was lost, or refused this node: why.
    Lost(String),
}

impl LinkEnd {
    /// The reason, either way.
    pub fn reason(&self) -> &str {
        match self {
            LinkEnd::Shutdown(r) | LinkEnd::Lost(r) => r,
        }
    }
}

/// Watches how the link ends ([`SchedLink::end_watch`]), without keeping it alive.
pub type EndWatch = watch::Receiver<Ended>;

/// The node's handle on its link to the scheduler (cheap to clone).
#[derive(Clone)]
pub struct SchedLink {
    cmds: mpsc::UnboundedSender<Command>,
    ended: watch::Receiver<Ended>,
    next_id: Arc<AtomicU64>,
    driver: tokio::task::AbortHandle,
}

impl SchedLink {
    /// Connects to the scheduler at `addr` (one attempt: a first connection that fails
    /// is the caller's error) and starts the driver task. `reattach` makes the message
    /// that introduces the node again after a loss.
    pub async fn connect(
        addr: &str,
        codec: Codec,
        config: SessionConfig,
        reattach: Reattach,
    ) -> Result<(SchedLink, Notifications)> {
        let first = open(addr, codec.clone()).await?;
        let (cmds, cmd_rx) = mpsc::unbounded_channel();
        let (notes_tx, notes) = mpsc::unbounded_channel();
        let (ended_tx, ended) = watch::channel(None);
        let driver = Driver {
            addr: addr.to_string(),
            codec,
            reattach,
            conn: Some(first),
            dialling: None,
            waiters: HashMap::new(),
            notes: notes_tx,
            cmds: cmd_rx,
            ended: ended_tx,
        };
        let task = tokio::spawn(driver.run(Session::new(config)));
        let link = SchedLink { cmds, ended, next_id: Arc::new(AtomicU64::new(1)), driver: task.abort_handle() };
        Ok((link, notes))
    }

    /// An operator tool's link (`elasticps status`, `scale`): one connection, no
    /// heartbeats, no redial (a lost scheduler ends it); its calls have the session's
    /// deadlines like every node's.
    pub async fn operator(addr: &str, codec: Codec) -> Result<(SchedLink, Notifications)> {
        let config = SessionConfig { retry_us: 0, heartbeats: false };
        SchedLink::connect(addr, codec, config, Box::new(|| None)).await
    }

    /// Sends a notification (dropped while the scheduler is being dialled again: a later
    /// one says more). Fails once the link is over.
    pub fn notify(&self, msg: Message) -> Result<()> {
        if self.is_over() {
            return Err(RuntimeError::Closed("scheduler".into()));
        }
        self.cmds.send(Command::Notify(msg)).map_err(|_| RuntimeError::Closed("scheduler".into()))
    }

    /// A call, answered by the scheduler's reply as it is (an `Error` reply included),
    /// within `timeout` (the session machine's deadline: `Timeout`, saying `what`). A call
    /// unanswered when the scheduler is lost is made again after the reattach; it fails
    /// (`Closed`) when the link is over.
    pub async fn request(&self, msg: Message, timeout: Duration, what: impl FnOnce() -> String) -> Result<Message> {
        let request_id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (reply, rx) = oneshot::channel();
        let call = Command::Call { request_id, msg, within: timeout, what: what(), reply };
        self.cmds.send(call).map_err(|_| RuntimeError::Closed("scheduler".into()))?;
        // The session's deadline answers it if the scheduler does not ([`Action::Expired`]).
        rx.await.unwrap_or_else(|_| Err(RuntimeError::Closed("scheduler".into())))
    }

    /// [`SchedLink::request`], with an `Error` reply as [`RuntimeError::Remote`].
    pub async fn call(&self, msg: Message, timeout: Duration, what: impl FnOnce() -> String) -> Result<Message> {
        match self.request(msg, timeout, what).await? {
            Message::Error(reply) => Err(RuntimeError::Remote { peer: "scheduler".into(), reply }),
            other => Ok(other),
        }
    }

    /// Waits, at most `within`, until everything sent on the link so far is written to
    /// its socket: a node's last notifications (a server's `CheckpointWritten`) are not
    /// lost when its process exits right after. False if they were not in time.
    pub async fn flushed(&self, within: Duration) -> bool {
        let (tx, rx) = oneshot::channel();
        if self.cmds.send(Command::Flush(tx)).is_err() {
            return false;
        }
        matches!(tokio::time::timeout(within, rx).await, Ok(Ok(())))
    }

    /// True once the link is over.
    pub fn is_over(&self) -> bool {
        self.ended.borrow().is_some()
    }

    /// How the link ended: `None` while it lives. Set before the link's waiting calls
    /// fail, so a call that failed `Closed` finds here why.
    pub fn end(&self) -> Ended {
        self.ended.borrow().clone()
    }

    /// Watches how the link ends; unlike a clone of the link, it does not keep the link
    /// alive (the link ends when every [`SchedLink`] is dropped).
    pub fn end_watch(&self) -> EndWatch {
        self.ended.clone()
    }

    /// Stops the link (the node is done): its connection closes.
    pub fn close(&self) {
        self.driver.abort();
    }
}

/// A connection to the scheduler: its writer, and its frames as a reader task reads them
/// (the channel closes with the connection).
pub type Conn = (Outbox, mpsc::UnboundedReceiver<(u64, Message)>);

/// Connects to the scheduler at `addr` and starts the task that reads the connection's
/// frames (every node's session, and the host agent's driver).
pub async fn open(addr: &str, codec: Codec) -> Result<Conn> {
    let (mut reader, out) = conn::connect(addr, codec, "scheduler".into()).await?;
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            match reader.next().await {
                Ok(Some((header, msg))) => {
                    if tx.send((header.request_id, msg)).is_err() {
                        return;
                    }
                }
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!(peer = reader.peer(), error = %e, "scheduler connection failed");
                    return;
                }
            }
        }
    });
    Ok((out, rx))
}

/// Closes a connection [`open`] made once everything sent on it is written (bounded by
/// [`conn::LAST_WRITES_TIMEOUT`]): the last frames of a process that exits right after
/// (a host agent's relayed events and its nodes' exits) are not lost.
pub async fn close(conn: Conn) {
    let (out, _frames) = conn;
    conn::flush_last_writes(&[out.writer().clone()], "scheduler connection").await;
}

/// The session's world: its connection, a dial under way, and the node's calls.
struct Driver {
    addr: String,
    codec: Codec,
    reattach: Reattach,
    conn: Option<Conn>,
    /// A dial under way ([`Action::Dial`]).
    dialling: Option<std::pin::Pin<Box<dyn std::future::Future<Output = Result<Conn>> + Send>>>,
    /// The node's calls waiting for their answers, by request id, with what they wait for.
    waiters: HashMap<u64, (oneshot::Sender<Result<Message>>, String)>,
    notes: mpsc::UnboundedSender<Message>,
    cmds: mpsc::UnboundedReceiver<Command>,
    ended: watch::Sender<Ended>,
}

/// What woke the session's driver.
enum Woken {
    /// The node asked something (`None`: every handle on the link is gone).
    Command(Option<Command>),
    /// A frame from the scheduler (`None`: the connection closed).
    Frame(Option<(u64, Message)>),
    /// The dial's outcome.
    Dialled(Result<Conn>),
}

impl Driver {
    async fn run(mut self, mut session: Session) {
        let mut timer = Timer::new(Micros::new());
        crate::driver::drive(&mut session, &mut self, &mut timer, VecDeque::new()).await
    }
}

impl World<Session> for Driver {
    type Woken = Woken;
    type End = ();

    async fn wait(&mut self) -> Woken {
        tokio::select! {
            cmd = self.cmds.recv() => Woken::Command(cmd),
            frame = async { self.conn.as_mut().expect("guarded").1.recv().await }, if self.conn.is_some() => {
                Woken::Frame(frame)
            }
            dialled = async { self.dialling.as_mut().expect("guarded").await }, if self.dialling.is_some() => {
                Woken::Dialled(dialled)
            }
        }
    }

    async fn feed(
        &mut self,
        session: &mut Session,
        now: u64,
        woken: Option<Woken>,
        out: &mut Vec<Action>,
    ) -> ControlFlow<()> {
        let event = match woken {
            None => Event::Timeout,
            // Every handle on the link is gone: the node is done with it.
            Some(Woken::Command(None)) => return ControlFlow::Break(()),
            Some(Woken::Command(Some(Command::Call { request_id, msg, within, what, reply }))) => {
                self.waiters.insert(request_id, (reply, what));
                Event::Call { request_id, msg, within_us: u64::try_from(within.as_micros()).unwrap_or(u64::MAX) }
            }
            Some(Woken::Command(Some(Command::Notify(msg)))) => Event::Send { request_id: 0, msg },
            Some(Woken::Command(Some(Command::Flush(done)))) => {
                // Off the loop: the writer task says when its queue is written.
                if let Some((out, _)) = &self.conn {
                    let writer = out.writer().clone();
                    tokio::spawn(async move {
                        writer.flushed().await;
                        let _ = done.send(());
                    });
                }
                return ControlFlow::Continue(());
            }
            Some(Woken::Frame(Some((request_id, msg)))) => {
                Machine::handle(session, now, Event::Received { request_id, msg: &msg }, out);
                match request_id {
                    0 => {
                        let _ = self.notes.send(msg);
                    }
                    REATTACH_ID => {}
                    id => {
                        if let Some((w, _)) = self.waiters.remove(&id) {
                            let _ = w.send(Ok(msg));
                        }
                    }
                }
                return ControlFlow::Continue(());
            }
            Some(Woken::Frame(None)) => {
                self.conn = None;
                Event::Lost
            }
            Some(Woken::Dialled(dialled)) => {
                self.dialling = None;
                match dialled.map(|conn| ((self.reattach)(), conn)) {
                    Ok((Some(hello), conn)) => {
                        let _ = conn.0.send((REATTACH_ID, hello));
                        self.conn = Some(conn);
                        return ControlFlow::Continue(());
                    }
                    Ok((None, _)) => Event::Lost,
                    Err(e) => {
                        tracing::debug!(addr = %self.addr, error = %e, "dialling the scheduler failed");
                        Event::Lost
                    }
                }
            }
        };
        Machine::handle(session, now, event, out);
        ControlFlow::Continue(())
    }

    async fn carry_out(
        &mut self,
        session: &mut Session,
        _now: u64,
        action: Action,
        _queue: &mut VecDeque<Action>,
    ) -> ControlFlow<()> {
        match action {
            Action::Send { request_id, msg } => {
                if let Some((out, _)) = &self.conn {
                    let _ = out.send((request_id, msg));
                }
            }
            Action::Dial { attempt } => {
                tracing::info!(attempt, addr = %self.addr, "dialling the scheduler again");
                self.conn = None;
                let (addr, codec) = (self.addr.clone(), self.codec.clone());
                self.dialling = Some(Box::pin(async move { open(&addr, codec).await }));
            }
            Action::Expired { request_id, after_us } => {
                if let Some((w, what)) = self.waiters.remove(&request_id) {
                    let _ = w.send(Err(RuntimeError::Timeout { what, after: Duration::from_micros(after_us) }));
                }
            }
            Action::Over { reason } => {
                // The waiting calls fail (`Closed`), the notifications channel closes.
                let end = match reason {
                    Some(why) => LinkEnd::Lost(why),
                    None => LinkEnd::Shutdown(session.shutdown_reason().unwrap_or("the job ended").to_string()),
                };
                let _ = self.ended.send(Some(end));
                return ControlFlow::Break(());
            }
        }
        ControlFlow::Continue(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use elasticps_wire::{Control, Credential, PeerRole};

    use super::*;

    /// A call the scheduler never answers fails at the session machine's deadline, saying
    /// what it waited for; the link stays up for the next call.
    #[tokio::test]
    async fn a_call_left_unanswered_fails_at_its_deadline_saying_what_it_waited_for() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let codec = Codec::new(b"", elasticps_wire::DEFAULT_MAX_PAYLOAD);
        let c2 = codec.clone();
        // Answers every call but the first (a scheduler that lost it).
        let scheduler = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            crate::handshake::accept(&mut stream, b"", "worker", Duration::from_secs(5)).await.unwrap();
            let (mut reader, out) = conn::split(stream, c2, "worker".into());
            let mut first = true;
            while let Ok(Some((header, _))) = reader.next().await {
                if !std::mem::take(&mut first) {
                    out.send((header.request_id, Control::Ok.into())).unwrap();
                }
            }
        });
        let config = SessionConfig { retry_us: 0, heartbeats: false };
        let (link, _notes) = SchedLink::connect(&addr, codec, config, Box::new(|| None)).await.unwrap();
        let started = Instant::now();
        let call = link.call(Control::Barrier.into(), Duration::from_millis(300), || "the barrier".into());
        let lost = tokio::time::timeout(Duration::from_secs(10), call).await.expect("the call failed within 10 s");
        assert!(
            matches!(&lost, Err(RuntimeError::Timeout { what, after }) if what == "the barrier" && after.as_millis() == 300),
            "{lost:?}"
        );
        assert!(started.elapsed() < Duration::from_secs(5), "bounded by the deadline");
        let next = link.call(Control::Barrier.into(), Duration::from_secs(5), || "the second barrier".into()).await;
        assert!(matches!(next, Ok(Message::Control(Control::Ok))), "{next:?}");
        link.close();
        scheduler.abort();
    }

    /// What was sent on a connection before [`close`] is written, even by a process whose
    /// runtime ends right after (a host agent's last `HostEvent`s): a one-thread runtime
    /// runs the connection's writer task only while `close` waits for it.
    #[test]
    fn a_closed_connection_writes_what_was_sent_on_it_before_it_ends() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let codec = Codec::new(b"", elasticps_wire::DEFAULT_MAX_PAYLOAD);
        let c2 = codec.clone();
        // The scheduler: counts the frames it reads until the connection closes.
        let scheduler = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async move {
                listener.set_nonblocking(true).unwrap();
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                let (mut stream, _) = listener.accept().await.unwrap();
                crate::handshake::accept(&mut stream, b"", "agent", Duration::from_secs(5)).await.unwrap();
                let (mut reader, _out) = conn::split(stream, c2, "agent".into());
                let mut frames = 0;
                while let Ok(Some(_)) = tokio::time::timeout(Duration::from_secs(10), reader.next()).await.unwrap() {
                    frames += 1;
                }
                frames
            })
        });
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let conn = open(&addr, codec).await.unwrap();
            for _ in 0..3 {
                conn.0.send((0, Control::HostEvent { line: "{}".into() }.into())).unwrap();
            }
            close(conn).await;
        });
        drop(rt);
        assert_eq!(scheduler.join().unwrap(), 3, "every frame sent before the close arrived");
    }

    /// A scheduler that accepts one connection, answers its first call with `Welcome`,
    /// then closes it and never comes back: the link redials until its window ends.
    #[tokio::test]
    async fn a_scheduler_that_does_not_come_back_within_the_window_is_given_up_saying_so() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let codec = Codec::new(b"", elasticps_wire::DEFAULT_MAX_PAYLOAD);
        let c2 = codec.clone();
        let scheduler = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            crate::handshake::accept(&mut stream, b"", "worker", Duration::from_secs(5)).await.unwrap();
            let (mut reader, out) = conn::split(stream, c2, "worker".into());
            let (header, _) = reader.next().await.unwrap().unwrap();
            let credential = Credential::issue(b"", 0, PeerRole::Worker, 0);
            let welcome = Control::Welcome { node_id: 0, num_workers: 1, num_servers: 1, credential };
            out.send_all_now(vec![(header.request_id, welcome.into())]).await.unwrap();
            // Closing the listener too: every redial is refused.
        });
        let config = SessionConfig { retry_us: 700_000, heartbeats: true };
        let attempts = Arc::new(AtomicU64::new(0));
        let a2 = attempts.clone();
        let reattach: Reattach = Box::new(move || {
            a2.fetch_add(1, Ordering::Relaxed);
            Some(Control::ReattachWorker { rank: 0, credential: Credential::issue(b"", 0, PeerRole::Worker, 0) }.into())
        });
        let (link, mut notes) = SchedLink::connect(&addr, codec, config, reattach).await.unwrap();
        let reply = link.call(Control::RegisterWorker.into(), Duration::from_secs(5), || "welcome".into()).await;
        assert!(matches!(reply, Ok(Message::Control(Control::Welcome { .. }))), "{reply:?}");
        scheduler.await.unwrap();
        let started = Instant::now();
        assert!(
            tokio::time::timeout(Duration::from_secs(5), notes.recv()).await.unwrap().is_none(),
            "closed at the end"
        );
        assert_eq!(link.end(), Some(LinkEnd::Lost("the scheduler did not come back within 1 s".into())));
        assert!(started.elapsed() < Duration::from_secs(5), "bounded by the window");
        // The dials that connected nowhere made no reattach message.
        assert_eq!(attempts.load(Ordering::Relaxed), 0);
        let late = link.call(Control::Barrier.into(), Duration::from_secs(1), || "barrier".into()).await;
        assert!(matches!(late, Err(RuntimeError::Closed(_))), "{late:?}");
    }
}
