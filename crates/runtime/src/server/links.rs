//! Links to other servers: one task and one connection per data address, carrying the
//! state machine's messages to that server (migration steps, forwarded pushes, backup
//! snapshots) in the order it decided them, and its answers back as events.
//!
//! Order matters for replication: a backup that gets a block's state and then a push
//! forwarded after it must apply them in that order. The messages are handed to the link
//! under the state machine's lock ([`super::Io`]'s `decide`), the link writes them in
//! that order on one connection, and the backup reads one connection in order. A
//! connection is shaped like the server's other sockets (a server streaming a block is
//! as slow as its NIC); a failed one is dropped and the next message dials again.
//!
//! A link times nothing out: the state machine gives every call its deadline and fails
//! it there ([`elasticps_node::server::STEP_TIMEOUT_US`]), ignoring an answer that comes
//! later. The dial keeps its socket timeouts (connect, handshake). What a stuck link can
//! hold is bounded: [`MAX_QUEUED`] messages waiting for it (one more is failed at once)
//! and [`MAX_IN_FLIGHT`] answers waited for (it takes no more messages until one comes).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use elasticps_node::server::Event;
use elasticps_wire::{Control, Message};
use tokio::sync::{Semaphore, mpsc};

use super::{Io, lock};
use crate::error::RuntimeError;
use crate::peer::Peer;

/// At most this many messages wait for a link to take them (behind a dial, or while
/// [`MAX_IN_FLIGHT`] answers are awaited); one more fails at once.
pub(super) const MAX_QUEUED: usize = 4_096;
/// At most this many messages of one link wait for their answers; the link takes the
/// next message once one is answered (or its connection fails).
pub(super) const MAX_IN_FLIGHT: usize = 16_384;

/// One message for another server: the state machine's call id, the server, the message.
type Outgoing = (u64, u32, Message);

/// The links of one server, by data address.
#[derive(Default)]
pub(super) struct Links {
    links: Mutex<HashMap<String, mpsc::Sender<Outgoing>>>,
}

impl Links {
    /// Queues `msg` (call `call`) for server `server` at `addr`, starting its link if
    /// there is none. Never blocks: the link's task writes it. A link holding
    /// [`MAX_QUEUED`] messages already fails this one (its event comes from a task of
    /// its own: the caller holds the state machine's lock).
    pub(super) fn send(&self, io: &Arc<Io>, call: u64, server: u32, addr: &str, msg: Message) {
        let mut links = lock(&self.links);
        let mut item = (call, server, msg);
        if let Some(tx) = links.get(addr) {
            match tx.try_send(item) {
                Ok(()) => return,
                Err(mpsc::error::TrySendError::Full((call, server, msg))) => {
                    let e = format!(
                        "the link to server {server} at {addr} holds {MAX_QUEUED} messages: {} not sent",
                        kind_of(&msg)
                    );
                    tracing::warn!(server, addr, call, queued = MAX_QUEUED, "a link to a server is full");
                    let io = io.clone();
                    tokio::spawn(async move { io.step(Event::FromServer { call, reply: Err(e) }, false) });
                    return;
                }
                // The link's task ended (it never does while the process runs): start again.
                Err(mpsc::error::TrySendError::Closed(back)) => item = back,
            }
        }
        let (tx, rx) = mpsc::channel(MAX_QUEUED);
        let _ = tx.try_send(item);
        links.insert(addr.to_string(), tx);
        tokio::spawn(run(io.clone(), addr.to_string(), rx));
    }
}

/// The link to `addr`: writes each message in turn (dialing when there is no open
/// connection) and hands each answer, or why there is none, to the state machine.
async fn run(io: Arc<Io>, addr: String, mut rx: mpsc::Receiver<Outgoing>) {
    // The connection, and whether its `Hello` was refused (then the next message dials
    // again and says `Hello` anew: a peer not registered yet refuses it).
    let mut peer: Option<(Peer, Arc<AtomicBool>)> = None;
    let in_flight = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    while let Some((call, server, msg)) = rx.recv().await {
        let name = format!("server {server}");
        if peer.as_ref().is_none_or(|(p, refused)| p.is_closed() || refused.load(Ordering::Relaxed)) {
            match open(&io, &addr, &name).await {
                Ok(p) => peer = Some(p),
                Err(e) => {
                    peer = None;
                    fail_queued(&io, &mut rx, call, &e);
                    continue;
                }
            }
        }
        let Some((p, _)) = &peer else { continue };
        // Bounded: a peer that answers nothing stops this link here, not its memory.
        let Ok(permit) = in_flight.clone().acquire_owned().await else { return };
        let what = kind_of(&msg);
        match p.send_request(msg) {
            Err(e) => {
                peer = None;
                io.step(Event::FromServer { call, reply: Err(e.to_string()) }, false);
            }
            Ok(answer) => {
                let io = io.clone();
                tokio::spawn(async move {
                    let reply = answer
                        .await
                        .map_err(|_| RuntimeError::Closed(format!("{name} (before answering {what})")).to_string());
                    drop(permit);
                    io.step(Event::FromServer { call, reply }, false);
                });
            }
        }
    }
}

/// The dial to `addr` failed with `e` for call `call`: it fails, and so does every
/// message queued behind it (the next one dials again), at once rather than one dial
/// each.
fn fail_queued(io: &Arc<Io>, rx: &mut mpsc::Receiver<Outgoing>, call: u64, e: &str) {
    tracing::debug!(error = %e, queued = rx.len(), "a link to a server could not connect");
    io.step(Event::FromServer { call, reply: Err(e.to_string()) }, false);
    while let Ok((call, _, _)) = rx.try_recv() {
        io.step(Event::FromServer { call, reply: Err(e.to_string()) }, false);
    }
}

/// A new connection to `addr` (the dial's own socket timeouts bound it) that says who
/// this server is (`Hello` with its credential): the receiver takes migration steps and
/// copies from a proven server only. The `Hello` is not waited for: the receiver reads
/// the connection in order, so it takes the `Hello` before the messages behind it, and
/// a refused one shows in their answers; the returned flag is set then, and the link
/// dials again for its next message.
async fn open(io: &Arc<Io>, addr: &str, name: &str) -> Result<(Peer, Arc<AtomicBool>), String> {
    let credential = lock(&io.server).credential().cloned();
    let Some(credential) = credential else { return Err("this server is not registered yet".into()) };
    let (p, _notes) =
        Peer::connect_shaped(addr, io.codec.clone(), name, Some(io.shaper.clone())).await.map_err(|e| e.to_string())?;
    let hello = p.send_request(Control::Hello { credential }.into()).map_err(|e| e.to_string())?;
    let (name, addr) = (name.to_string(), addr.to_string());
    let refused = Arc::new(AtomicBool::new(false));
    let flag = refused.clone();
    // Lives as long as the connection at most: its answer, or the connection's end.
    tokio::spawn(async move {
        match hello.await {
            Ok(Message::Control(Control::Ok)) | Err(_) => {}
            Ok(other) => {
                tracing::warn!(peer = %name, addr, answer = ?other.kind(), "a server refused this server's hello");
                flag.store(true, Ordering::Relaxed);
            }
        }
    });
    Ok((p, refused))
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
