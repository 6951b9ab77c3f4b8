//! Request/response over one connection, for the side that asks: worker -> server,
//! node -> scheduler. Any number of requests are in flight at once; replies are matched
//! by request id. Request id 0 is reserved for notifications (messages that answer no
//! request, such as `Shutdown` or `Assign` from the scheduler); they are handed to the
//! owner through a channel.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use elasticps_wire::{Codec, Message};
use tokio::sync::{mpsc, oneshot};

use crate::conn::{self, FrameReader, Outbox};
use crate::error::{Result, RuntimeError};

/// Requests waiting for their reply; `None` once the connection is gone (a request sent
/// then fails at once instead of waiting for a reply that cannot come).
type Pending = Arc<Mutex<Option<HashMap<u64, oneshot::Sender<Message>>>>>;

/// The asking side of one connection.
#[derive(Clone)]
pub struct Peer {
    name: Arc<str>,
    out: Outbox,
    pending: Pending,
    next_id: Arc<AtomicU64>,
}

/// Notifications (request id 0) that arrived on a peer's connection. The channel closes
/// when the connection does.
pub type Notifications = mpsc::UnboundedReceiver<Message>;

impl Peer {
    /// Connects to `addr`; `name` names the peer in errors ("server 2").
    pub async fn connect(addr: &str, codec: Codec, name: &str) -> Result<(Peer, Notifications)> {
        let (reader, out) = conn::connect(addr, codec, name.to_string()).await?;
        Ok(Self::start(reader, out, name))
    }

    /// Connects to `addr` with this node's bandwidth shaper on the connection (a server
    /// streaming a migrating block is as slow as its NIC).
    pub async fn connect_shaped(
        addr: &str,
        codec: Codec,
        name: &str,
        shaper: Option<Arc<crate::shaping::Shaper>>,
    ) -> Result<(Peer, Notifications)> {
        let stream = conn::dial(addr, &codec, name).await?;
        let (reader, out) = conn::split_shaped(stream, codec, name.to_string(), shaper);
        Ok(Self::start(reader, out, name))
    }

    /// Wraps an already split connection.
    pub fn start(reader: FrameReader, out: Outbox, name: &str) -> (Peer, Notifications) {
        let pending: Pending = Arc::new(Mutex::new(Some(HashMap::new())));
        let (ntx, nrx) = mpsc::unbounded_channel();
        tokio::spawn(read_loop(reader, pending.clone(), ntx));
        let peer = Peer { name: name.into(), out, pending, next_id: Arc::new(AtomicU64::new(1)) };
        (peer, nrx)
    }

    /// The peer's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether the connection is closed (its reader ended: every call in flight failed).
    pub fn is_closed(&self) -> bool {
        self.pending.lock().unwrap_or_else(|e| e.into_inner()).is_none()
    }

    /// Sends a notification (request id 0); nothing answers it.
    pub fn notify(&self, msg: Message) -> Result<()> {
        self.out.send((0, msg)).map_err(|_| RuntimeError::Closed(self.name.to_string()))
    }

    /// Sends `msg` as a request (through the writer task) and returns the receiver of
    /// its reply.
    pub fn send_request(&self, msg: Message) -> Result<oneshot::Receiver<Message>> {
        let (id, rx) = self.expect_reply()?;
        if self.out.send((id, msg)).is_err() {
            self.forget(id);
            return Err(RuntimeError::Closed(self.name.to_string()));
        }
        Ok(rx)
    }

    /// A fresh request id and the receiver of its reply.
    fn expect_reply(&self) -> Result<(u64, oneshot::Receiver<Message>)> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        match self.pending.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            Some(waiting) => waiting.insert(id, tx),
            None => return Err(RuntimeError::Closed(self.name.to_string())),
        };
        Ok((id, rx))
    }

    /// Stops waiting for the reply to `id` (its request was not sent).
    fn forget(&self, id: u64) {
        if let Some(waiting) = self.pending.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            waiting.remove(&id);
        }
    }
}

async fn read_loop(mut reader: FrameReader, pending: Pending, notes: mpsc::UnboundedSender<Message>) {
    loop {
        match reader.next().await {
            Ok(Some((header, msg))) => {
                if header.request_id == 0 {
                    let _ = notes.send(msg);
                    continue;
                }
                let waiter = pending
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .as_mut()
                    .and_then(|w| w.remove(&header.request_id));
                match waiter {
                    Some(tx) => {
                        let _ = tx.send(msg);
                    }
                    None => tracing::warn!(peer = reader.peer(), id = header.request_id, "reply to no request"),
                }
            }
            Ok(None) => break,
            Err(e) => {
                tracing::warn!(peer = reader.peer(), error = %e, "connection failed");
                break;
            }
        }
    }
    // Dropping the waiters makes every call in flight fail with `Closed`.
    *pending.lock().unwrap_or_else(|e| e.into_inner()) = None;
}
