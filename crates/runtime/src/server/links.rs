//! Links to other servers: the node layer's [`link::Links`] machine carried out over
//! TCP. Its rules (one connection per data address, `Hello` first, calls in order, a
//! failed dial or a lost connection failing its calls, the bounds) are the machine's;
//! this driver dials, writes, and hands answers and losses back to it, and the machine's
//! answers to the server's state machine ([`Event::FromServer`]).
//!
//! Order matters for replication: a backup that gets a block's state and then a push
//! forwarded after it must apply them in that order. The messages are handed to the links
//! under the server machine's lock ([`super::Io`]'s `decide`), the machine's sends are
//! written in its order under the links' lock, and the backup reads one connection in
//! order. A connection is shaped like the server's other sockets (a server streaming a
//! block is as slow as its NIC). The dial keeps its socket timeouts (connect, handshake);
//! a call's deadline is the server machine's.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use elasticps_node::link::{self, Effect, Input};
use elasticps_node::server::Event;
use elasticps_node::{ConnId, Machine};
use elasticps_wire::{Credential, Message};

use super::{Io, lock};
use crate::peer::Peer;

/// Answers for the server machine: (its call, the answer or why there is none).
type Answers = Vec<(u64, Result<Message, String>)>;

/// The links of one server.
#[derive(Default)]
pub(super) struct Links {
    inner: Mutex<Inner>,
}

/// The machine and the connections it opened.
#[derive(Default)]
struct Inner {
    machine: link::Links,
    peers: HashMap<ConnId, Peer>,
    next_conn: ConnId,
}

impl Links {
    /// The server machine calls `server` at `addr` (`call`), this server's credential
    /// being `credential`. Never blocks. The caller holds the server machine's lock: an
    /// answer decided at once (a full link, no credential) is stepped on a task of its own.
    pub(super) fn send(
        &self,
        io: &Arc<Io>,
        call: u64,
        server: u32,
        addr: &str,
        msg: Message,
        credential: Option<&Credential>,
    ) {
        let answers = self.feed(io, Input::Send { call, server, addr, msg, credential });
        if !answers.is_empty() {
            let io = io.clone();
            tokio::spawn(async move { step_all(&io, answers) });
        }
    }

    /// Hands the machine `input` and carries out its effects in order, under the links'
    /// lock; returns its answers for the server machine (to step with no lock held).
    fn feed(&self, io: &Arc<Io>, input: Input<'_>) -> Answers {
        let mut inner = lock(&self.inner);
        let mut queue = VecDeque::new();
        let mut effects = Vec::new();
        inner.machine.handle(0, input, &mut effects);
        queue.extend(effects);
        let mut answers = Vec::new();
        while let Some(effect) = queue.pop_front() {
            match effect {
                Effect::Dial { addr } => {
                    tokio::spawn(dial(io.clone(), addr));
                }
                Effect::Send { conn, tag, msg } => match inner.peers.get(&conn).map(|p| p.send_request(msg)) {
                    Some(Ok(answer)) => {
                        let io = io.clone();
                        tokio::spawn(async move {
                            let input = match answer.await {
                                Ok(msg) => Input::Answered { conn, tag, msg },
                                Err(_) => Input::Lost { conn, why: "the connection closed".into() },
                            };
                            let answers = io.links.feed(&io, input);
                            step_all(&io, answers);
                        });
                    }
                    _ => {
                        inner.peers.remove(&conn);
                        let mut more = Vec::new();
                        let why = "the connection is closed".to_string();
                        inner.machine.handle(0, Input::Lost { conn, why }, &mut more);
                        queue.extend(more);
                    }
                },
                Effect::Close { conn } => {
                    inner.peers.remove(&conn);
                }
                Effect::Answered { call, reply } => answers.push((call, reply)),
            }
        }
        answers
    }
}

/// Steps the server machine with each answer, in order.
fn step_all(io: &Arc<Io>, answers: Answers) {
    for (call, reply) in answers {
        io.step(Event::FromServer { call, reply }, false);
    }
}

/// Dials `addr` for the links' machine ([`Effect::Dial`]): a new connection, shaped, is
/// handed to it as dialled, and its close as lost.
async fn dial(io: Arc<Io>, addr: String) {
    let name = format!("the server at {addr}");
    let answers = match Peer::connect_shaped(&addr, io.codec.clone(), &name, Some(io.shaper.clone())).await {
        Ok((peer, mut notes)) => {
            let conn = {
                let mut inner = lock(&io.links.inner);
                inner.next_conn += 1;
                let conn = inner.next_conn;
                inner.peers.insert(conn, peer);
                conn
            };
            // The notifications channel closes with the connection: the machine learns
            // of a close even with nothing in flight.
            let watcher = io.clone();
            tokio::spawn(async move {
                while notes.recv().await.is_some() {}
                let answers = watcher.links.feed(&watcher, Input::Lost { conn, why: "the connection closed".into() });
                step_all(&watcher, answers);
            });
            io.links.feed(&io, Input::Dialled { addr: &addr, conn })
        }
        Err(e) => io.links.feed(&io, Input::DialFailed { addr: &addr, why: e.to_string() }),
    };
    step_all(&io, answers);
}
