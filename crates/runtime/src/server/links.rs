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

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use elasticps_node::server::{Event, STEP_TIMEOUT_US};
use elasticps_wire::{Control, Message};
use tokio::sync::mpsc;

use super::{Io, lock};
use crate::error::RuntimeError;
use crate::peer::Peer;

/// How long another server may take to answer one message.
const STEP_TIMEOUT: Duration = Duration::from_micros(STEP_TIMEOUT_US);

/// One message for another server: the state machine's call id, the server, the message.
type Outgoing = (u64, u32, Message);

/// The links of one server, by data address.
#[derive(Default)]
pub(super) struct Links {
    links: Mutex<HashMap<String, mpsc::UnboundedSender<Outgoing>>>,
}

impl Links {
    /// Queues `msg` (call `call`) for server `server` at `addr`, starting its link if
    /// there is none. Never blocks: the link's task writes it.
    pub(super) fn send(&self, io: &Arc<Io>, call: u64, server: u32, addr: &str, msg: Message) {
        let mut links = lock(&self.links);
        let mut item = (call, server, msg);
        if let Some(tx) = links.get(addr) {
            match tx.send(item) {
                Ok(()) => return,
                // The link's task ended (it never does while the process runs): start again.
                Err(mpsc::error::SendError(back)) => item = back,
            }
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let _ = tx.send(item);
        links.insert(addr.to_string(), tx);
        tokio::spawn(run(io.clone(), addr.to_string(), rx));
    }
}

/// The link to `addr`: writes each message in turn (dialing when there is no open
/// connection) and hands each answer, or why there is none, to the state machine.
async fn run(io: Arc<Io>, addr: String, mut rx: mpsc::UnboundedReceiver<Outgoing>) {
    let mut peer: Option<Peer> = None;
    while let Some((call, server, msg)) = rx.recv().await {
        let name = format!("server {server}");
        let what = kind_of(&msg);
        if peer.is_none() {
            match tokio::time::timeout(
                STEP_TIMEOUT,
                Peer::connect_shaped(&addr, io.codec.clone(), &name, Some(io.shaper.clone())),
            )
            .await
            {
                Ok(Ok((p, _notes))) => match introduce(&io, &p, &name).await {
                    Ok(()) => peer = Some(p),
                    Err(e) => {
                        io.step(Event::FromServer { call, reply: Err(e) }, false);
                        continue;
                    }
                },
                Ok(Err(e)) => {
                    io.step(Event::FromServer { call, reply: Err(e.to_string()) }, false);
                    continue;
                }
                Err(_) => {
                    let e =
                        RuntimeError::Timeout { what: format!("connecting to {name} at {addr}"), after: STEP_TIMEOUT };
                    io.step(Event::FromServer { call, reply: Err(e.to_string()) }, false);
                    continue;
                }
            }
        }
        let Some(p) = &peer else { continue };
        match p.send_request(msg) {
            Err(e) => {
                peer = None;
                io.step(Event::FromServer { call, reply: Err(e.to_string()) }, false);
            }
            Ok(answer) => {
                let io = io.clone();
                tokio::spawn(async move {
                    let reply = match tokio::time::timeout(STEP_TIMEOUT, answer).await {
                        Ok(Ok(reply)) => Ok(reply),
                        Ok(Err(_)) => {
                            Err(RuntimeError::Closed(format!("{name} (before answering {what})")).to_string())
                        }
                        Err(_) => {
                            Err(RuntimeError::Timeout { what: format!("{name} to answer {what}"), after: STEP_TIMEOUT }
                                .to_string())
                        }
                    };
                    io.step(Event::FromServer { call, reply }, false);
                });
            }
        }
    }
}

/// Says who this server is on a new connection to another server (`Hello` with its
/// credential): the receiver takes migration steps and copies from a proven server only.
async fn introduce(io: &Arc<Io>, p: &Peer, name: &str) -> Result<(), String> {
    let credential = lock(&io.server).credential().cloned();
    let Some(credential) = credential else { return Err("this server is not registered yet".into()) };
    let answer = p.send_request(Control::Hello { credential }.into()).map_err(|e| e.to_string())?;
    match tokio::time::timeout(STEP_TIMEOUT, answer).await {
        Ok(Ok(Message::Control(Control::Ok))) => Ok(()),
        Ok(Ok(other)) => Err(format!("{name} refused this server's Hello: {other:?}")),
        Ok(Err(_)) => Err(RuntimeError::Closed(format!("{name} (before answering Hello)")).to_string()),
        Err(_) => {
            Err(RuntimeError::Timeout { what: format!("{name} to answer Hello"), after: STEP_TIMEOUT }.to_string())
        }
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
