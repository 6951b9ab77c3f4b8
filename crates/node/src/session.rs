//! A node's link to the scheduler, as a state machine without I/O: the one place that
//! decides when to heartbeat, when a lost scheduler is dialled again (backoff 100 ms
//! doubling to 2 s, [`crate::timing`]), for how long, how the node introduces itself again
//! (a reattach), and which calls are made again on the new connection, in which order.
//!
//! Every role drives one: the runtime's server and worker client over TCP
//! (`elasticps_runtime::session`), the host agent inside its machine
//! ([`crate::agent`], from [`Session::dialling`]), the harness's roles over simulated links. It follows
//! the time contract of every node machine ([`crate`] docs): [`Session::handle`] takes an
//! event with the time and returns actions; [`Session::poll_timeout`] says when it next
//! wants [`Event::Timeout`].
//!
//! ```text
//!             Welcome seen                 Lost (welcomed, retry > 0)
//!   Open ───────────────────► Open ──────────────────────────────► Backoff
//!     │   (heartbeats start)   ▲                                  │  ▲
//!     │ Lost (not welcomed,    │ Welcome to the reattach          │  │ Lost (the dial
//!     │ or no retry)           │ (calls made again, in order)     │  │  failed)
//!     ▼                        │                         Timeout  ▼  │
//!   Over ◄──── window over ─── Dialling ◄─────────────────────── (Dial)
//! ```
//!
//! A call (request id > 0) is kept until it is answered, and made again, in the order it
//! was first made (by request id), on the connection of a reattach: a `MigrateDone`
//! whose `Ok` died with the old scheduler is answered by the new one. A notification
//! (request id 0: a heartbeat, a load report) is dropped while the link is down: a later
//! one says more. After the scheduler's `Shutdown`, a closed connection is the end of
//! the link, not a loss.

use std::collections::BTreeMap;

use elasticps_wire::{Control, Message};

use crate::timing::{FIRST_BACKOFF_US, HEARTBEAT_EVERY_US, next_backoff_us};

/// The request id of the reattach message on a new connection (`ReattachServer`,
/// `ReattachWorker`); the roles' own calls never use it.
pub const REATTACH_ID: u64 = u64::MAX;

/// How a session behaves.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SessionConfig {
    /// How long a lost scheduler is dialled again, µs (`--scheduler-retry-s`); zero: a
    /// lost scheduler ends the link.
    pub retry_us: u64,
    /// Send a heartbeat every [`HEARTBEAT_EVERY_US`] once the scheduler welcomed the node.
    pub heartbeats: bool,
}

/// What happened on the link.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // one event at a time, never stored
pub enum Event<'a> {
    /// The node sends `msg` to the scheduler: a call (`request_id` > 0, kept until it is
    /// answered) or a notification (0).
    Send {
        /// The call's id, or 0.
        request_id: u64,
        /// The message.
        msg: Message,
    },
    /// A frame from the scheduler: the answer to `request_id`, or a notification (0).
    /// The driver hands the message on to the role itself.
    Received {
        /// The request it answers (0: a notification; [`REATTACH_ID`]: the reattach).
        request_id: u64,
        /// The message.
        msg: &'a Message,
    },
    /// The node makes a call that fails unanswered after `within_us`
    /// ([`Action::Expired`]): [`Event::Send`] with a deadline.
    Call {
        /// The call's id (> 0).
        request_id: u64,
        /// The message.
        msg: Message,
        /// How long the node waits for its answer, µs.
        within_us: u64,
    },
    /// The scheduler's connection closed, or a dial asked for by [`Action::Dial`] did not
    /// connect.
    Lost,
    /// The deadline of [`Session::poll_timeout`] came.
    Timeout,
}

/// What the driver does.
#[derive(Clone, Debug, PartialEq)]
#[allow(clippy::large_enum_variant)] // one at a time, never stored
pub enum Action {
    /// Write `msg` with `request_id` on the scheduler's connection.
    Send {
        /// The call's id, or 0.
        request_id: u64,
        /// The message.
        msg: Message,
    },
    /// Open a new connection to the scheduler and introduce the node on it (its
    /// `ReattachServer` or `ReattachWorker`, which the driver makes from the role's
    /// state) with request id [`REATTACH_ID`]. A connection that cannot be made is
    /// [`Event::Lost`].
    Dial {
        /// 1 for the first attempt after a loss.
        attempt: u32,
    },
    /// The call `request_id` ([`Event::Call`]) was not answered within `after_us`: it
    /// fails, and is not made again.
    Expired {
        /// The call.
        request_id: u64,
        /// How long it waited, µs.
        after_us: u64,
    },
    /// The link is over: `None` after the scheduler's `Shutdown`, else why. The node
    /// sends nothing more; calls still unanswered fail.
    Over {
        /// Why, unless the scheduler ended the job.
        reason: Option<String>,
    },
}

/// Where the link is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// A connection is up.
    Open,
    /// Lost since `since_us`: the next dial at `at_us`; `delay_us` is the wait after it,
    /// if it fails.
    Backoff { since_us: u64, at_us: u64, delay_us: u64, attempt: u32 },
    /// A dial is under way; it waits for the `Welcome` to its reattach.
    Dialling { since_us: u64, delay_us: u64, attempt: u32 },
    /// Nothing more.
    Over,
}

/// A node's link to the scheduler (see the module docs).
#[derive(Debug)]
pub struct Session {
    config: SessionConfig,
    state: State,
    /// Calls not answered yet, by request id (the order they were made in).
    unanswered: BTreeMap<u64, Message>,
    /// The calls made with a deadline ([`Event::Call`]): when each expires, and after how
    /// long (µs). A node has a few calls at a time: scanned, not indexed.
    deadlines: BTreeMap<u64, (u64, u64)>,
    /// The scheduler accepted this node (a `Welcome` came): a loss is redialled from now.
    welcomed: bool,
    /// The scheduler said `Shutdown`, with this reason.
    shutdown: Option<String>,
    /// The next heartbeat, once welcomed (with heartbeats on).
    next_heartbeat_us: Option<u64>,
    /// How long the first connection is dialled, µs, for a session made by
    /// [`Session::dialling`] (until its first welcome; then `config.retry_us`).
    first_window_us: u64,
}

impl Session {
    /// A session whose first connection is up (the driver dialled it, and sends the
    /// registration through [`Event::Send`]).
    pub fn new(config: SessionConfig) -> Self {
        Self {
            config,
            state: State::Open,
            unanswered: BTreeMap::new(),
            deadlines: BTreeMap::new(),
            welcomed: false,
            shutdown: None,
            next_heartbeat_us: None,
            first_window_us: config.retry_us,
        }
    }

    /// A session with no connection yet (a host agent's): it asks for a dial at once,
    /// then after each failure with the backoff, for at most `within_us` from `now_us`.
    /// The driver introduces the node on each connection with request id
    /// [`REATTACH_ID`] (the agent's `JoinHost`); its welcome opens the link. A loss after
    /// that follows `config.retry_us`.
    pub fn dialling(config: SessionConfig, now_us: u64, within_us: u64) -> Self {
        let state = State::Backoff { since_us: now_us, at_us: now_us, delay_us: FIRST_BACKOFF_US, attempt: 1 };
        Self { state, first_window_us: within_us, ..Self::new(config) }
    }

    /// True once the link is over.
    pub fn is_over(&self) -> bool {
        self.state == State::Over
    }

    /// True while a connection is up (not lost, not redialling).
    pub fn is_open(&self) -> bool {
        self.state == State::Open
    }

    /// The calls not answered yet, in the order they were made.
    pub fn unanswered(&self) -> impl Iterator<Item = (u64, &Message)> + '_ {
        self.unanswered.iter().map(|(id, msg)| (*id, msg))
    }

    /// When the session next wants [`Event::Timeout`] (absolute µs): the next heartbeat,
    /// the next dial, the end of the retry window, or a call's deadline.
    pub fn poll_timeout(&self) -> Option<u64> {
        let link = match self.state {
            State::Open => self.next_heartbeat_us,
            State::Backoff { since_us, at_us, .. } => Some(at_us.min(self.window_end(since_us))),
            State::Dialling { since_us, .. } => Some(self.window_end(since_us)),
            State::Over => return None,
        };
        let call = self.deadlines.values().map(|(at, _)| *at).min();
        link.into_iter().chain(call).min()
    }

    /// One event at `now_us`; the actions are appended to `out`.
    pub fn handle_into(&mut self, now_us: u64, event: Event<'_>, out: &mut Vec<Action>) {
        if self.state == State::Over {
            return;
        }
        match event {
            Event::Send { request_id, msg } => {
                if request_id != 0 {
                    self.unanswered.insert(request_id, msg.clone());
                }
                if self.state == State::Open {
                    out.push(Action::Send { request_id, msg });
                }
            }
            Event::Call { request_id, msg, within_us } => {
                self.deadlines.insert(request_id, (now_us.saturating_add(within_us), within_us));
                self.handle_into(now_us, Event::Send { request_id, msg }, out);
            }
            Event::Received { request_id: REATTACH_ID, msg } => self.on_reattach(now_us, msg, out),
            Event::Received { request_id, msg } => {
                self.unanswered.remove(&request_id);
                self.deadlines.remove(&request_id);
                match msg {
                    msg if is_welcome(msg) && !self.welcomed => {
                        self.welcomed = true;
                        if self.config.heartbeats {
                            self.next_heartbeat_us = Some(now_us);
                            self.heartbeat(now_us, out);
                        }
                    }
                    Message::Control(Control::Shutdown { reason }) if request_id == 0 => {
                        self.shutdown = Some(reason.clone());
                    }
                    _ => {}
                }
            }
            Event::Lost => self.on_lost(now_us, out),
            Event::Timeout => self.on_timeout(now_us, out),
        }
    }

    /// The reason of the scheduler's `Shutdown`, once it came: a link over with no reason
    /// ([`Action::Over`]) ended with it.
    pub fn shutdown_reason(&self) -> Option<&str> {
        self.shutdown.as_deref()
    }

    /// [`Session::handle_into`] into a new vector.
    pub fn handle(&mut self, now_us: u64, event: Event<'_>) -> Vec<Action> {
        let mut out = Vec::new();
        self.handle_into(now_us, event, &mut out);
        out
    }

    /// The end of the retry window of a loss at `since_us`.
    fn window_end(&self, since_us: u64) -> u64 {
        let window = if self.welcomed { self.config.retry_us } else { self.first_window_us };
        since_us.saturating_add(window)
    }

    fn over(&mut self, reason: Option<String>, out: &mut Vec<Action>) {
        self.state = State::Over;
        self.next_heartbeat_us = None;
        self.deadlines.clear();
        out.push(Action::Over { reason });
    }

    fn heartbeat(&mut self, now_us: u64, out: &mut Vec<Action>) {
        if let Some(at) = self.next_heartbeat_us
            && now_us >= at
        {
            self.next_heartbeat_us = Some(now_us + HEARTBEAT_EVERY_US);
            out.push(Action::Send { request_id: 0, msg: Control::Heartbeat.into() });
        }
    }

    fn on_reattach(&mut self, now_us: u64, msg: &Message, out: &mut Vec<Action>) {
        let State::Dialling { attempt, .. } = self.state else {
            // The answer to a reattach given up on (the connection is gone since).
            return;
        };
        if !is_welcome(msg) {
            let why = match msg {
                Message::Error(e) => e.message.clone(),
                other => format!("{:?}", other.kind()),
            };
            return self.over(Some(format!("the restarted scheduler refused this node: {why}")), out);
        }
        if self.welcomed {
            tracing::info!(attempt, calls = self.unanswered.len(), "reattached to the restarted scheduler");
        } else {
            tracing::info!(attempt, "welcomed by the scheduler on its first connection");
        }
        self.state = State::Open;
        self.welcomed = true;
        // Calls in flight when the scheduler was lost are made again, in the order made.
        for (request_id, msg) in &self.unanswered {
            tracing::info!(request_id, "a scheduler call made again after the reattach");
            out.push(Action::Send { request_id: *request_id, msg: msg.clone() });
        }
        if self.config.heartbeats {
            self.next_heartbeat_us = Some(now_us);
            self.heartbeat(now_us, out);
        }
    }

    fn on_lost(&mut self, now_us: u64, out: &mut Vec<Action>) {
        match self.state {
            State::Open if self.shutdown.is_some() => self.over(None, out),
            State::Open if !self.welcomed => {
                self.over(Some("the scheduler closed the connection before it accepted this node".into()), out)
            }
            State::Open if self.config.retry_us == 0 => {
                self.over(Some("the scheduler's connection was lost".into()), out)
            }
            State::Open => {
                tracing::warn!(window_s = self.config.retry_us as f64 / 1e6, "scheduler connection lost; reattaching");
                self.next_heartbeat_us = None;
                self.state = State::Backoff {
                    since_us: now_us,
                    at_us: now_us + FIRST_BACKOFF_US,
                    delay_us: next_backoff_us(FIRST_BACKOFF_US),
                    attempt: 1,
                };
            }
            State::Dialling { since_us, delay_us, attempt } => {
                let left_s = self.window_end(since_us).saturating_sub(now_us) as f64 / 1e6;
                tracing::warn!(attempt, next_in_ms = delay_us / 1000, left_s, "scheduler unreachable; retrying");
                self.state = State::Backoff {
                    since_us,
                    at_us: now_us + delay_us,
                    delay_us: next_backoff_us(delay_us),
                    attempt: attempt + 1,
                };
            }
            State::Backoff { .. } | State::Over => {}
        }
    }

    fn on_timeout(&mut self, now_us: u64, out: &mut Vec<Action>) {
        let expired: Vec<(u64, u64)> =
            self.deadlines.iter().filter(|(_, (at, _))| *at <= now_us).map(|(id, (_, after))| (*id, *after)).collect();
        for (request_id, after_us) in expired {
            tracing::debug!(request_id, after_ms = after_us / 1000, "a scheduler call expired unanswered");
            self.deadlines.remove(&request_id);
            self.unanswered.remove(&request_id);
            out.push(Action::Expired { request_id, after_us });
        }
        match self.state {
            State::Open => self.heartbeat(now_us, out),
            State::Backoff { since_us, .. } | State::Dialling { since_us, .. }
                if now_us >= self.window_end(since_us) =>
            {
                let secs = (self.window_end(since_us) - since_us) as f64 / 1e6;
                self.over(Some(format!("the scheduler did not come back within {secs:.0} s")), out);
            }
            State::Backoff { since_us, at_us, delay_us, attempt } if now_us >= at_us => {
                self.state = State::Dialling { since_us, delay_us, attempt };
                out.push(Action::Dial { attempt });
            }
            State::Backoff { .. } | State::Dialling { .. } | State::Over => {}
        }
    }
}

/// True if `msg` accepts the node: a `Welcome` (a server, a worker) or a `HostWelcome`
/// (a host agent).
fn is_welcome(msg: &Message) -> bool {
    matches!(msg, Message::Control(Control::Welcome { .. } | Control::HostWelcome { .. }))
}

/// The servers among `connected` that a notification of the scheduler says are lost:
/// after a failover it sends every worker `Replicas`, which lists the servers still in the
/// job. A worker treats each one it is connected to and that is not listed as a closed
/// connection (what it did not answer goes to the owner named by a refreshed layout): the
/// lost server's host may be silent, and no close would ever come.
pub fn servers_lost(msg: &Message, connected: impl IntoIterator<Item = u32>) -> Vec<u32> {
    let Message::Control(Control::Replicas { servers, .. }) = msg else { return Vec::new() };
    connected.into_iter().filter(|id| !servers.iter().any(|s| s.id == *id)).collect()
}

#[cfg(test)]
mod tests {
    use elasticps_wire::{Credential, ErrorCode, ErrorReply, PeerRole};

    use super::*;

    const RETRY: u64 = 10_000_000;

    fn welcome() -> Message {
        let credential = Credential::issue(b"", 0, PeerRole::Worker, 0);
        Control::Welcome { node_id: 0, num_workers: 1, num_servers: 1, credential }.into()
    }

    fn call(id: u64) -> Message {
        Control::WorkerDone { rank: id as u32 }.into()
    }

    /// A session that registered (call 1 answered by `Welcome`) at time 0.
    fn welcomed(config: SessionConfig) -> Session {
        let mut s = Session::new(config);
        assert_eq!(s.handle(0, Event::Send { request_id: 1, msg: Control::RegisterWorker.into() }).len(), 1);
        s.handle(0, Event::Received { request_id: 1, msg: &welcome() });
        s
    }

    /// A call made with a deadline fails at it, answered or not made again after; one
    /// answered in time never expires; a loss and reattach between do not move it.
    #[test]
    fn a_call_unanswered_within_its_deadline_expires_once_and_is_not_made_again() {
        let config = SessionConfig { retry_us: RETRY, heartbeats: false };
        let within = 10 * FIRST_BACKOFF_US;
        let mut s = welcomed(config);
        let a = s.handle(10, Event::Call { request_id: 2, msg: call(2), within_us: within });
        assert_eq!(sends(&a), [2]);
        s.handle(10, Event::Call { request_id: 3, msg: call(3), within_us: 1 });
        s.handle(10, Event::Received { request_id: 3, msg: &Control::Ok.into() });
        assert_eq!(s.poll_timeout(), Some(10 + within), "the open call's deadline");
        // Lost and reattached before the deadline: made again, its deadline unchanged.
        s.handle(1_000, Event::Lost);
        let dial = s.poll_timeout().unwrap();
        assert!(dial < 10 + within);
        assert_eq!(s.handle(dial, Event::Timeout), [Action::Dial { attempt: 1 }]);
        let a = s.handle(dial, Event::Received { request_id: REATTACH_ID, msg: &welcome() });
        assert_eq!(sends(&a), [2], "made again after the reattach");
        assert_eq!(s.poll_timeout(), Some(10 + within));
        assert!(s.handle(9 + within, Event::Timeout).is_empty(), "not before its deadline");
        let a = s.handle(10 + within, Event::Timeout);
        assert_eq!(a, [Action::Expired { request_id: 2, after_us: within }]);
        assert_eq!(s.unanswered().count(), 0, "forgotten");
        let t = 11 + within;
        s.handle(t, Event::Lost);
        let dial = s.poll_timeout().unwrap();
        s.handle(dial, Event::Timeout);
        let a = s.handle(dial, Event::Received { request_id: REATTACH_ID, msg: &welcome() });
        assert!(sends(&a).is_empty(), "an expired call is not made again: {a:?}");
        assert_eq!(s.poll_timeout(), None, "nothing left to wake for");
    }

    fn sends(actions: &[Action]) -> Vec<u64> {
        actions
            .iter()
            .filter_map(|a| if let Action::Send { request_id, .. } = a { Some(*request_id) } else { None })
            .collect()
    }

    #[test]
    fn heartbeats_start_at_the_welcome_and_come_every_period() {
        let mut s = welcomed(SessionConfig { retry_us: 0, heartbeats: true });
        assert_eq!(s.poll_timeout(), Some(HEARTBEAT_EVERY_US), "one went out at the welcome");
        assert!(s.handle(HEARTBEAT_EVERY_US - 1, Event::Timeout).is_empty());
        let a = s.handle(HEARTBEAT_EVERY_US, Event::Timeout);
        assert_eq!(a, [Action::Send { request_id: 0, msg: Control::Heartbeat.into() }]);
        assert_eq!(s.poll_timeout(), Some(2 * HEARTBEAT_EVERY_US));
        // Without heartbeats an open link has nothing to wake for.
        assert_eq!(welcomed(SessionConfig { retry_us: 0, heartbeats: false }).poll_timeout(), None);
    }

    #[test]
    fn a_loss_is_redialled_with_a_doubling_backoff_until_the_window_ends() {
        let mut s = welcomed(SessionConfig { retry_us: 1_000_000, heartbeats: false });
        assert!(s.handle(0, Event::Lost).is_empty());
        let mut dials = Vec::new();
        // Every dial fails at once; bounded: the window ends the loop.
        for _ in 0..20 {
            let Some(at) = s.poll_timeout() else { break };
            for a in s.handle(at, Event::Timeout) {
                match a {
                    Action::Dial { attempt } => {
                        dials.push((at, attempt));
                        assert!(s.handle(at, Event::Lost).is_empty());
                    }
                    Action::Over { reason } => {
                        assert_eq!(reason.as_deref(), Some("the scheduler did not come back within 1 s"));
                        assert_eq!(at, 1_000_000, "the window ends it, on time");
                    }
                    other => panic!("{other:?}"),
                }
            }
        }
        assert!(s.is_over());
        // 100, 200, 400 ms after each failure: at 0.1, 0.3, 0.7 s.
        assert_eq!(dials, [(100_000, 1), (300_000, 2), (700_000, 3)]);
    }

    #[test]
    fn the_reattach_makes_the_unanswered_calls_again_in_the_order_made() {
        let mut s = welcomed(SessionConfig { retry_us: RETRY, heartbeats: true });
        for id in [7, 3, 5] {
            assert_eq!(sends(&s.handle(1, Event::Send { request_id: id, msg: call(id) })), [id]);
        }
        s.handle(2, Event::Received { request_id: 5, msg: &Control::Ok.into() });
        s.handle(3, Event::Lost);
        // While the link is down: a call is kept, a notification dropped, nothing sent.
        assert!(s.handle(4, Event::Send { request_id: 9, msg: call(9) }).is_empty());
        assert!(s.handle(4, Event::Send { request_id: 0, msg: Control::Heartbeat.into() }).is_empty());
        assert_eq!(s.handle(3 + FIRST_BACKOFF_US, Event::Timeout), [Action::Dial { attempt: 1 }]);
        let a = s.handle(3 + FIRST_BACKOFF_US + 10, Event::Received { request_id: REATTACH_ID, msg: &welcome() });
        assert_eq!(sends(&a), [3, 7, 9, 0], "made again by id, then a heartbeat");
        assert!(s.is_open());
    }

    #[test]
    fn a_refused_reattach_ends_the_link_saying_why() {
        let mut s = welcomed(SessionConfig { retry_us: RETRY, heartbeats: false });
        s.handle(0, Event::Lost);
        assert_eq!(s.handle(FIRST_BACKOFF_US, Event::Timeout), [Action::Dial { attempt: 1 }]);
        let refusal = Message::Error(ErrorReply { code: ErrorCode::Unauthenticated, message: "other job".into() });
        let a = s.handle(FIRST_BACKOFF_US, Event::Received { request_id: REATTACH_ID, msg: &refusal });
        assert_eq!(a, [Action::Over { reason: Some("the restarted scheduler refused this node: other job".into()) }]);
        assert!(s.handle(FIRST_BACKOFF_US, Event::Send { request_id: 4, msg: call(4) }).is_empty(), "over");
    }

    #[test]
    fn a_loss_before_the_welcome_without_retry_or_after_shutdown_ends_the_link() {
        let mut s = Session::new(SessionConfig { retry_us: RETRY, heartbeats: true });
        let a = s.handle(0, Event::Lost);
        assert!(matches!(&a[..], [Action::Over { reason: Some(r) }] if r.contains("before it accepted")));

        let mut s = welcomed(SessionConfig { retry_us: 0, heartbeats: true });
        let a = s.handle(0, Event::Lost);
        assert_eq!(a, [Action::Over { reason: Some("the scheduler's connection was lost".into()) }]);

        let mut s = welcomed(SessionConfig { retry_us: RETRY, heartbeats: true });
        s.handle(1, Event::Received { request_id: 0, msg: &Control::Shutdown { reason: "done".into() }.into() });
        assert_eq!(s.handle(2, Event::Lost), [Action::Over { reason: None }]);
    }

    /// What a driver does to the link, in any order (the proptest's alphabet).
    #[derive(Clone, Debug)]
    enum Step {
        /// The node makes a call.
        Call,
        /// The scheduler answers the `k`-th call it received on this connection, if any.
        Answer(usize),
        /// The node sends a notification.
        Note,
        /// The connection is lost (or a dial under way fails to connect).
        Lost,
        /// Time passes (ms); every deadline on the way is handed in at its time.
        Advance(u64),
        /// The scheduler (restarted or not) welcomes the reattach under way.
        Welcome,
        /// The scheduler refuses the reattach under way.
        Refuse,
    }

    fn step() -> impl proptest::strategy::Strategy<Value = Step> {
        use proptest::prelude::*;
        prop_oneof![
            3 => Just(Step::Call),
            3 => (0usize..4).prop_map(Step::Answer),
            1 => Just(Step::Note),
            1 => Just(Step::Lost),
            3 => (0u64..2_500).prop_map(Step::Advance),
            2 => Just(Step::Welcome),
            1 => Just(Step::Refuse),
        ]
    }

    /// Runs `steps` against a session and checks, at every action, the rules a
    /// restarted scheduler and a lost connection at any point must not break.
    fn check_link(retry_us: u64, steps: &[Step]) -> Result<(), String> {
        let mut s = welcomed(SessionConfig { retry_us, heartbeats: true });
        let mut now = 0u64;
        let mut next_id = 2u64;
        // The calls made and not answered, and the ones the current connection carried.
        let mut open_calls = std::collections::BTreeSet::new();
        let mut on_conn: Vec<u64> = Vec::new();
        let mut connected = true;
        let mut dialling = false;
        // The loss (or failed dial) the next dial follows, and the delay expected then.
        let mut lost_at: Option<u64> = None;
        let mut delay = FIRST_BACKOFF_US;
        let mut last_heartbeat = Some(0u64);
        let mut over = false;
        let at = |now: u64, a: Vec<Action>| a.into_iter().map(|a| (now, a)).collect::<Vec<_>>();
        for step in steps {
            let mut acts = Vec::new();
            match step {
                Step::Call => {
                    open_calls.insert(next_id);
                    acts = at(now, s.handle(now, Event::Send { request_id: next_id, msg: call(next_id) }));
                    next_id += 1;
                }
                Step::Answer(k) if connected && !dialling => {
                    let Some(&id) = on_conn.iter().filter(|id| open_calls.contains(id)).nth(*k) else { continue };
                    open_calls.remove(&id);
                    acts = at(now, s.handle(now, Event::Received { request_id: id, msg: &Control::Ok.into() }));
                }
                Step::Note => {
                    acts = at(now, s.handle(now, Event::Send { request_id: 0, msg: Control::Heartbeat.into() }))
                }
                Step::Lost if connected || dialling => {
                    (connected, dialling) = (false, false);
                    on_conn.clear();
                    if lost_at.is_none() {
                        delay = FIRST_BACKOFF_US;
                    }
                    lost_at = Some(now);
                    last_heartbeat = None;
                    acts = at(now, s.handle(now, Event::Lost));
                }
                Step::Advance(ms) => {
                    let until = now + ms * 1000;
                    for _ in 0..1_000 {
                        match s.poll_timeout() {
                            Some(due) if due <= until => {
                                if due < now {
                                    return Err(format!("a deadline in the past: {due} at {now}"));
                                }
                                now = due;
                                let a = s.handle(now, Event::Timeout);
                                if s.poll_timeout().is_some_and(|next| next <= now) {
                                    return Err(format!("poll_timeout spins at {now}"));
                                }
                                acts.extend(at(now, a));
                            }
                            _ => break,
                        }
                    }
                    now = until.max(now);
                }
                Step::Welcome if dialling => {
                    dialling = false;
                    connected = true;
                    lost_at = None;
                    acts = at(now, s.handle(now, Event::Received { request_id: REATTACH_ID, msg: &welcome() }));
                    let replayed: Vec<u64> = sends(&acts.iter().map(|(_, a)| a.clone()).collect::<Vec<_>>())
                        .into_iter()
                        .filter(|id| *id != 0)
                        .collect();
                    let want: Vec<u64> = open_calls.iter().copied().collect();
                    if replayed != want {
                        return Err(format!("the reattach made {replayed:?} again, the unanswered calls are {want:?}"));
                    }
                }
                Step::Refuse if dialling => {
                    let no = Message::Error(ErrorReply { code: ErrorCode::Unauthenticated, message: "no".into() });
                    acts = at(now, s.handle(now, Event::Received { request_id: REATTACH_ID, msg: &no }));
                    if !matches!(&acts[..], [(_, Action::Over { reason: Some(_) })]) {
                        return Err(format!("a refused reattach gave {acts:?}"));
                    }
                }
                _ => continue,
            }
            for (now, a) in &acts {
                let now = *now;
                if over {
                    return Err(format!("{a:?} after the link was over"));
                }
                match a {
                    Action::Send { request_id: 0, msg } => {
                        if !connected || dialling {
                            return Err(format!("a notification sent with no connection at {now}"));
                        }
                        if matches!(msg, Message::Control(Control::Heartbeat)) && !matches!(step, Step::Note) {
                            if let Some(last) = last_heartbeat
                                && now != last + HEARTBEAT_EVERY_US
                            {
                                return Err(format!("a heartbeat at {now}, the last at {last}"));
                            }
                            last_heartbeat = Some(now);
                        }
                    }
                    Action::Send { request_id, .. } => {
                        if !connected || dialling {
                            return Err(format!("call {request_id} sent with no connection at {now}"));
                        }
                        if on_conn.contains(request_id) {
                            return Err(format!("call {request_id} sent twice on one connection"));
                        }
                        on_conn.push(*request_id);
                    }
                    Action::Dial { .. } => {
                        let since = lost_at.ok_or("a dial with nothing lost")?;
                        if now != since + delay {
                            return Err(format!(
                                "a dial at {now}, {} us after the loss; the backoff says {delay}",
                                now - since
                            ));
                        }
                        delay = next_backoff_us(delay);
                        dialling = true;
                    }
                    Action::Over { .. } => over = true,
                    Action::Expired { request_id, .. } => {
                        return Err(format!("call {request_id} expired: none has a deadline"));
                    }
                }
            }
            if over {
                return Ok(());
            }
        }
        Ok(())
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config { cases: 2_000, ..Default::default() })]

        /// A scheduler lost (or restarted) and a connection dropped at any point, calls made
        /// and answered in any order: no call is sent without a connection or twice on one,
        /// every unanswered call is made again after the reattach in the order made, dials
        /// follow the backoff exactly, heartbeats come every period, nothing spins.
        #[test]
        fn the_link_keeps_its_rules_under_any_schedule(
            retry_s in 0u64..8,
            steps in proptest::collection::vec(step(), 1..80),
        ) {
            if let Err(e) = check_link(retry_s * 1_000_000, &steps) {
                return Err(proptest::test_runner::TestCaseError::fail(e));
            }
        }
    }
}
