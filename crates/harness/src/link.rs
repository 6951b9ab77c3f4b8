//! A simulated node's link to the scheduler: the node layer's
//! [`Session`] carried out on the simulated network, as
//! `elasticps_runtime::session::SchedLink` carries it out over TCP. The server's and the
//! worker's adapters each own one.

use elasticps_node::ConnId;
use elasticps_node::session::{Action, Event, REATTACH_ID, Session, SessionConfig};
use elasticps_wire::Message;

use crate::cluster::Outbox;
use crate::wake::Wake;

/// The link, its connection and the timer of its deadline.
#[derive(Debug)]
pub struct SchedLink {
    session: Session,
    conn: Option<ConnId>,
    wake: Wake,
    /// The adapter's timer token for the session's deadline.
    token: u64,
}

impl SchedLink {
    /// A link that redials a lost scheduler for `retry_us` (0: never), with heartbeats;
    /// its timers carry `token`.
    pub fn new(retry_us: u64, token: u64) -> Self {
        let config = SessionConfig { retry_us, heartbeats: true };
        Self { session: Session::new(config), conn: None, wake: Wake::default(), token }
    }

    /// Opens the first connection to the scheduler.
    pub fn connect(&mut self, out: &mut Outbox<'_>) -> ConnId {
        let conn = out.connect(out.scheduler());
        self.conn = Some(conn);
        conn
    }

    /// The scheduler's connection, while there is one.
    pub fn conn(&self) -> Option<ConnId> {
        self.conn
    }

    /// Whether `conn` is the scheduler's connection.
    pub fn is(&self, conn: ConnId) -> bool {
        self.conn == Some(conn)
    }

    /// Hands the session `event` (a lost connection is forgotten first) and carries out
    /// its sends and dials; `hello` makes the reattach message from the node's state.
    /// `Some(reason)` when the link ended (`None` inside: after the scheduler's
    /// `Shutdown`).
    pub fn handle(
        &mut self,
        out: &mut Outbox<'_>,
        event: Event<'_>,
        hello: impl Fn() -> Option<Message>,
    ) -> Option<Option<String>> {
        if matches!(event, Event::Lost) {
            self.conn = None;
        }
        if matches!(event, Event::Timeout) {
            self.wake.fired(out);
        }
        let mut actions = std::collections::VecDeque::from(self.session.handle(out.now_us(), event));
        while let Some(action) = actions.pop_front() {
            match action {
                Action::Send { request_id, msg } => {
                    if let Some(conn) = self.conn {
                        out.send(conn, request_id, msg);
                    }
                }
                Action::Dial { .. } => {
                    let conn = out.connect(out.scheduler());
                    self.conn = Some(conn);
                    if !hello().is_some_and(|msg| out.send(conn, REATTACH_ID, msg)) {
                        self.conn = None;
                        actions.extend(self.session.handle(out.now_us(), Event::Lost));
                    }
                }
                Action::Over { reason } => {
                    self.conn = None;
                    return Some(reason);
                }
                // The roles here make their calls with `Send`: their machines keep the
                // deadlines (a server's registration, a worker's layout).
                Action::Expired { .. } => {}
            }
        }
        self.wake.arm(out, self.session.poll_timeout(), self.token);
        None
    }
}
