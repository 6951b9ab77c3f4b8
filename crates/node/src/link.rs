//! A server's links to the other servers, as a state machine without I/O on the
//! [`crate::Machine`] contract: the calls the server machine makes to another server
//! (migration steps, pushes forwarded to a backup, a backup's snapshot,
//! [`crate::server::Action::ToServer`]) carried to it in the order they were made, and
//! their answers (or why there is none) handed back. The tokio driver
//! (`elasticps-runtime`'s server) and the harness's simulated server both carry out its
//! effects; neither holds a rule of its own. Its rules, in one place:
//!
//! - **One connection per data address.** The first call to an address dials it
//!   ([`Effect::Dial`]); calls made meanwhile wait in its queue, in order.
//! - **Hello first.** A new connection says who this server is (`Hello` with its
//!   credential) before any call: the receiver takes migration steps and copies from a
//!   proven server only. The `Hello` is not waited for (the receiver reads the connection
//!   in order); a refused one marks the connection, and the next call closes it and dials
//!   again (a peer not registered yet refuses it).
//! - **A failed dial fails every call queued behind it**, at once rather than one dial
//!   each; the next call dials again. A server not registered yet (no credential) fails
//!   its calls without dialling.
//! - **A lost connection fails its calls in flight**; calls still queued dial again.
//! - **Bounds.** At most [`MAX_QUEUED`] calls wait for a link (one more fails at once) and
//!   at most [`MAX_IN_FLIGHT`] wait for their answers on it (the next is sent once one is
//!   answered).
//! - **No deadline here.** The server machine gives every call its deadline and fails it
//!   there ([`crate::server::STEP_TIMEOUT_US`]), ignoring a later answer.

use std::collections::{BTreeSet, HashMap, VecDeque};

use elasticps_wire::{Control, Credential, Message};

use crate::ConnId;

/// At most this many calls wait for a link to take them (behind a dial, or while
/// [`MAX_IN_FLIGHT`] answers are awaited); one more fails at once.
pub const MAX_QUEUED: usize = 4_096;
/// At most this many calls of one link wait for their answers; the link sends the next
/// once one is answered (or its connection fails).
pub const MAX_IN_FLIGHT: usize = 16_384;

/// What a message on a link is: the connection's `Hello`, or the server machine's call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tag {
    /// The `Hello` that opens a connection.
    Hello,
    /// The server machine's call.
    Call(u64),
}

/// What happened.
#[derive(Debug)]
pub enum Input<'a> {
    /// The server machine calls `server` at `addr` (its `ToServer`); `credential` is the
    /// server's own, for the `Hello` of a new connection (`None`: not registered yet).
    Send {
        /// The server machine's call id.
        call: u64,
        /// The server called.
        server: u32,
        /// Its data address.
        addr: &'a str,
        /// The message.
        msg: Message,
        /// This server's credential.
        credential: Option<&'a Credential>,
    },
    /// The dial of [`Effect::Dial`] connected, as `conn`.
    Dialled {
        /// The address dialled.
        addr: &'a str,
        /// The new connection.
        conn: ConnId,
    },
    /// The dial of [`Effect::Dial`] failed.
    DialFailed {
        /// The address dialled.
        addr: &'a str,
        /// Why.
        why: String,
    },
    /// The answer to a message sent on `conn`.
    Answered {
        /// The connection.
        conn: ConnId,
        /// What it answers.
        tag: Tag,
        /// The answer.
        msg: Message,
    },
    /// Connection `conn` closed or failed (a send on it included).
    Lost {
        /// The connection.
        conn: ConnId,
        /// Why.
        why: String,
    },
}

/// An effect for the driver.
#[derive(Clone, Debug, PartialEq)]
pub enum Effect {
    /// Connect to `addr`; answer with [`Input::Dialled`] or [`Input::DialFailed`].
    Dial {
        /// The data address.
        addr: String,
    },
    /// Send `msg` on `conn`; its answer comes back as [`Input::Answered`] with `tag`, a
    /// failed send as [`Input::Lost`].
    Send {
        /// The connection.
        conn: ConnId,
        /// What it is.
        tag: Tag,
        /// The message.
        msg: Message,
    },
    /// Close `conn` (no input follows: its calls in flight were failed already).
    Close {
        /// The connection.
        conn: ConnId,
    },
    /// Hand the server machine the answer to `call` (its `Event::FromServer`).
    Answered {
        /// The call.
        call: u64,
        /// The answer, or why there is none.
        reply: Result<Message, String>,
    },
}

/// Where a link's connection is.
#[derive(Debug, PartialEq)]
enum State {
    /// No connection: the next call dials.
    Idle,
    /// A dial is under way.
    Dialling,
    /// Connected; `refused` once the peer refused its `Hello`.
    Open { conn: ConnId, refused: bool },
}

/// The link to one data address.
#[derive(Debug)]
struct Peer {
    server: u32,
    state: State,
    /// The credential its next connection says `Hello` with.
    credential: Option<Credential>,
    /// Calls not sent yet, in the order made.
    queue: VecDeque<(u64, Message)>,
    /// Calls sent on the open connection, not answered yet.
    in_flight: BTreeSet<u64>,
}

/// A server's links to the other servers (see the module).
#[derive(Debug, Default)]
pub struct Links {
    peers: HashMap<String, Peer>,
    /// The open connections' addresses.
    conns: HashMap<ConnId, String>,
}

impl Links {
    /// No links yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether `conn` is one of the links' connections (its frames are answers for
    /// [`Input::Answered`]).
    pub fn owns(&self, conn: ConnId) -> bool {
        self.conns.contains_key(&conn)
    }

    fn send(
        &mut self,
        call: u64,
        server: u32,
        addr: &str,
        msg: Message,
        credential: Option<&Credential>,
    ) -> Vec<Effect> {
        let mut out = Vec::new();
        let peer = self.peers.entry(addr.to_string()).or_insert_with(|| Peer {
            server,
            state: State::Idle,
            credential: None,
            queue: VecDeque::new(),
            in_flight: BTreeSet::new(),
        });
        peer.server = server;
        if peer.credential.is_none() {
            peer.credential = credential.cloned();
        }
        if peer.queue.len() >= MAX_QUEUED {
            tracing::warn!(server, addr, call, queued = MAX_QUEUED, "a link to a server is full");
            let e = format!(
                "the link to server {server} at {addr} holds {MAX_QUEUED} messages: {} not sent",
                kind_of(&msg)
            );
            out.push(Effect::Answered { call, reply: Err(e) });
            return out;
        }
        peer.queue.push_back((call, msg));
        if let State::Open { conn, refused: true } = peer.state {
            // The peer refused this connection's Hello: a new one says it anew.
            out.push(Effect::Close { conn });
            self.lose(conn, "the peer refused this server's Hello", &mut out);
        }
        self.pump(addr, &mut out);
        out
    }

    /// Moves link `addr` on: dials it when idle with calls queued, or sends its queued
    /// calls on its open connection within [`MAX_IN_FLIGHT`].
    fn pump(&mut self, addr: &str, out: &mut Vec<Effect>) {
        let Some(peer) = self.peers.get_mut(addr) else { return };
        match peer.state {
            State::Idle if !peer.queue.is_empty() => {
                if peer.credential.is_none() {
                    let why = "this server is not registered yet".to_string();
                    fail_queued(peer, &why, out);
                    return;
                }
                peer.state = State::Dialling;
                out.push(Effect::Dial { addr: addr.to_string() });
            }
            State::Open { conn, .. } => {
                while peer.in_flight.len() < MAX_IN_FLIGHT
                    && let Some((call, msg)) = peer.queue.pop_front()
                {
                    peer.in_flight.insert(call);
                    out.push(Effect::Send { conn, tag: Tag::Call(call), msg });
                }
            }
            State::Idle | State::Dialling => {}
        }
    }

    /// Connection `conn` is gone (`why`): its calls in flight fail; its link is idle, and
    /// dials again for calls still queued.
    fn lose(&mut self, conn: ConnId, why: &str, out: &mut Vec<Effect>) {
        let Some(addr) = self.conns.remove(&conn) else { return };
        let Some(peer) = self.peers.get_mut(&addr) else { return };
        if matches!(peer.state, State::Open { conn: c, .. } if c == conn) {
            peer.state = State::Idle;
        }
        let server = peer.server;
        for call in std::mem::take(&mut peer.in_flight) {
            let e = format!("the connection to server {server} at {addr} was lost before it answered: {why}");
            out.push(Effect::Answered { call, reply: Err(e) });
        }
    }
}

/// Every call queued on `peer` fails with `why`.
fn fail_queued(peer: &mut Peer, why: &str, out: &mut Vec<Effect>) {
    for (call, _) in peer.queue.drain(..) {
        out.push(Effect::Answered { call, reply: Err(why.to_string()) });
    }
}

impl crate::Machine for Links {
    type Input<'a> = Input<'a>;
    type Output = Effect;

    fn handle(&mut self, _now_us: u64, input: Input<'_>, out: &mut Vec<Effect>) {
        match input {
            Input::Send { call, server, addr, msg, credential } => {
                out.extend(self.send(call, server, addr, msg, credential))
            }
            Input::Dialled { addr, conn } => {
                let Some(peer) = self.peers.get_mut(addr).filter(|p| p.state == State::Dialling) else {
                    // Not asked for (any more): not used.
                    out.push(Effect::Close { conn });
                    return;
                };
                peer.state = State::Open { conn, refused: false };
                self.conns.insert(conn, addr.to_string());
                if let Some(credential) = peer.credential.clone() {
                    out.push(Effect::Send { conn, tag: Tag::Hello, msg: Control::Hello { credential }.into() });
                }
                self.pump(addr, out);
            }
            Input::DialFailed { addr, why } => {
                let Some(peer) = self.peers.get_mut(addr) else { return };
                tracing::debug!(server = peer.server, addr, error = %why, queued = peer.queue.len(), "a link to a server could not connect");
                if peer.state == State::Dialling {
                    peer.state = State::Idle;
                }
                fail_queued(peer, &why, out);
            }
            Input::Answered { conn, tag: Tag::Hello, msg } => {
                if matches!(msg, Message::Control(Control::Ok)) {
                    return;
                }
                let Some(addr) = self.conns.get(&conn) else { return };
                let Some(peer) = self.peers.get_mut(addr) else { return };
                tracing::warn!(server = peer.server, addr, answer = ?msg.kind(), "a server refused this server's hello");
                if let State::Open { conn: c, refused } = &mut peer.state
                    && *c == conn
                {
                    *refused = true;
                }
            }
            Input::Answered { conn, tag: Tag::Call(call), msg } => {
                let Some(addr) = self.conns.get(&conn).cloned() else { return };
                let Some(peer) = self.peers.get_mut(&addr) else { return };
                if !peer.in_flight.remove(&call) {
                    return;
                }
                out.push(Effect::Answered { call, reply: Ok(msg) });
                self.pump(&addr, out);
            }
            Input::Lost { conn, why } => {
                let addr = self.conns.get(&conn).cloned();
                self.lose(conn, &why, out);
                if let Some(addr) = addr {
                    self.pump(&addr, out);
                }
            }
        }
    }

    fn poll_timeout(&self) -> Option<u64> {
        None
    }
}

/// The message's name, for errors.
fn kind_of(msg: &Message) -> &'static str {
    match msg {
        Message::Control(Control::BlockSnapshot { .. }) => "BlockSnapshot",
        Message::Control(Control::BlockDelta { .. }) => "BlockDelta",
        Message::Control(Control::Replicate { .. }) => "Replicate",
        Message::Forward { .. } => "Forward",
        Message::Control(Control::ReplicaSnapshot(_)) => "ReplicaSnapshot",
        _ => "a server's request",
    }
}

#[cfg(test)]
mod tests {
    use elasticps_wire::{ErrorCode, ErrorReply, PeerRole};

    use super::*;
    use crate::Machine;

    fn cred() -> Credential {
        Credential::issue(b"s", 1, PeerRole::Server, 0)
    }

    fn send(l: &mut Links, call: u64, addr: &str, credential: Option<&Credential>) -> Vec<Effect> {
        let mut out = Vec::new();
        l.handle(0, Input::Send { call, server: 2, addr, msg: Control::Ok.into(), credential }, &mut out);
        out
    }

    fn feed(l: &mut Links, input: Input<'_>) -> Vec<Effect> {
        let mut out = Vec::new();
        l.handle(0, input, &mut out);
        out
    }

    fn calls_sent(effects: &[Effect]) -> Vec<u64> {
        effects
            .iter()
            .filter_map(|e| if let Effect::Send { tag: Tag::Call(c), .. } = e { Some(*c) } else { None })
            .collect()
    }

    fn failed(effects: &[Effect]) -> Vec<u64> {
        effects
            .iter()
            .filter_map(|e| if let Effect::Answered { call, reply: Err(_) } = e { Some(*call) } else { None })
            .collect()
    }

    /// Calls made while the link dials are sent after its Hello, in the order made.
    #[test]
    fn calls_wait_for_the_dial_and_leave_after_the_hello_in_order() {
        let (mut l, c) = (Links::new(), cred());
        assert_eq!(send(&mut l, 1, "a:1", Some(&c)), [Effect::Dial { addr: "a:1".into() }]);
        assert!(send(&mut l, 2, "a:1", Some(&c)).is_empty(), "one dial per address");
        let out = feed(&mut l, Input::Dialled { addr: "a:1", conn: 7 });
        assert!(matches!(&out[0], Effect::Send { conn: 7, tag: Tag::Hello, .. }), "{out:?}");
        assert_eq!(calls_sent(&out), [1, 2]);
        assert_eq!(calls_sent(&send(&mut l, 3, "a:1", Some(&c))), [3], "the open connection takes it at once");
        let out = feed(&mut l, Input::Answered { conn: 7, tag: Tag::Call(2), msg: Control::Ok.into() });
        assert_eq!(out, [Effect::Answered { call: 2, reply: Ok(Control::Ok.into()) }]);
    }

    /// A failed dial fails every call queued behind it; the next call dials again.
    #[test]
    fn a_failed_dial_fails_the_queue_and_the_next_call_dials_again() {
        let (mut l, c) = (Links::new(), cred());
        send(&mut l, 1, "a:1", Some(&c));
        send(&mut l, 2, "a:1", Some(&c));
        assert_eq!(failed(&feed(&mut l, Input::DialFailed { addr: "a:1", why: "refused".into() })), [1, 2]);
        assert_eq!(send(&mut l, 3, "a:1", Some(&c)), [Effect::Dial { addr: "a:1".into() }]);
        assert_eq!(failed(&send(&mut Links::new(), 4, "b:1", None)), [4], "no credential: no dial");
    }

    /// A lost connection fails its calls in flight, and the link dials again.
    #[test]
    fn a_lost_connection_fails_its_calls_in_flight_and_dials_again_for_the_next() {
        let (mut l, c) = (Links::new(), cred());
        send(&mut l, 1, "a:1", Some(&c));
        feed(&mut l, Input::Dialled { addr: "a:1", conn: 7 });
        assert_eq!(failed(&feed(&mut l, Input::Lost { conn: 7, why: "reset".into() })), [1]);
        assert!(!l.owns(7));
        assert_eq!(send(&mut l, 2, "a:1", Some(&c)), [Effect::Dial { addr: "a:1".into() }]);
        assert!(feed(&mut l, Input::Answered { conn: 7, tag: Tag::Call(1), msg: Control::Ok.into() }).is_empty());
    }

    /// A refused Hello: the next call closes the connection and dials again.
    #[test]
    fn a_refused_hello_makes_the_next_call_dial_again() {
        let (mut l, c) = (Links::new(), cred());
        send(&mut l, 1, "a:1", Some(&c));
        feed(&mut l, Input::Dialled { addr: "a:1", conn: 7 });
        let refusal = Message::Error(ErrorReply { code: ErrorCode::Forbidden, message: "who?".into() });
        assert!(feed(&mut l, Input::Answered { conn: 7, tag: Tag::Hello, msg: refusal }).is_empty());
        let out = send(&mut l, 2, "a:1", Some(&c));
        assert_eq!(out[0], Effect::Close { conn: 7 });
        assert_eq!(failed(&out), [1], "the refused connection's call fails");
        assert_eq!(out.last(), Some(&Effect::Dial { addr: "a:1".into() }));
        assert_eq!(calls_sent(&feed(&mut l, Input::Dialled { addr: "a:1", conn: 8 })), [2]);
    }

    /// The bounds: beyond MAX_IN_FLIGHT calls wait; beyond MAX_QUEUED they fail at once.
    #[test]
    fn a_peer_that_answers_nothing_holds_at_most_the_bounds() {
        let (mut l, c) = (Links::new(), cred());
        send(&mut l, 0, "a:1", Some(&c));
        feed(&mut l, Input::Dialled { addr: "a:1", conn: 7 });
        let total = (MAX_IN_FLIGHT + MAX_QUEUED) as u64;
        for call in 1..total {
            assert!(failed(&send(&mut l, call, "a:1", Some(&c))).is_empty(), "call {call}");
        }
        assert_eq!(failed(&send(&mut l, total, "a:1", Some(&c))), [total]);
        let out = feed(&mut l, Input::Answered { conn: 7, tag: Tag::Call(0), msg: Control::Ok.into() });
        assert_eq!(calls_sent(&out), [MAX_IN_FLIGHT as u64], "an answer lets the next queued call go");
    }
}
