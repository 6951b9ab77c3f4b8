//! The replies to a data connection, in the order the state machine emitted them.
//!
//! A connection's reader task writes the replies to its own requests itself (one write
//! answers a burst), while replies that other connections' requests release (a held
//! pull answered by another worker's push) go through the connection's writer task.
//! Left to race, a held push_pull's `PullReply`, released on another task, could leave
//! before the `PushAck` its own step emitted first (seen in real processes: the worker
//! failed its round on the late `PushAck`). So replies are routed under the server's
//! lock, in the order the machine emitted them, and while the reader task holds replies
//! it has not written, every reply to that connection joins them; otherwise a reply
//! goes to the writer task at once.

use std::collections::HashMap;
use std::sync::Mutex;

use elasticps_wire::Message;

use crate::conn::{Outbox, Writer};
use crate::error::Result;

/// A reply: its request id and the message.
pub(super) type Reply = (u64, Message);

/// One data connection's way out.
struct Out {
    outbox: Outbox,
    /// Replies the reader task writes itself at its next flush.
    held: Vec<Reply>,
    /// The reader task is writing a flush: replies emitted meanwhile wait for the next.
    flushing: bool,
}

/// The open data connections' ways out, by connection id.
#[derive(Default)]
pub(super) struct Replies {
    conns: Mutex<HashMap<u64, Out>>,
}

impl Replies {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Out>> {
        self.conns.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Connection `conn` opened, writing through `outbox`.
    pub(super) fn open(&self, conn: u64, outbox: Outbox) {
        self.lock().insert(conn, Out { outbox, held: Vec::new(), flushing: false });
    }

    /// Connection `conn` closed (or the machine closed it): its replies are dropped.
    pub(super) fn close(&self, conn: u64) {
        self.lock().remove(&conn);
    }

    /// The writers of the open connections (to wait for their last frames).
    pub(super) fn writers(&self) -> Vec<std::sync::Arc<Writer>> {
        self.lock().values().map(|o| o.outbox.writer().clone()).collect()
    }

    /// A reply to a request of `conn` emitted on its own reader task's step: held for that
    /// task's next [`Replies::flush`].
    pub(super) fn hold(&self, conn: u64, reply: Reply) {
        if let Some(o) = self.lock().get_mut(&conn) {
            o.held.push(reply);
        }
    }

    /// A reply to `conn` emitted on another task's step: behind the replies its reader
    /// task holds, if any; otherwise to its writer task.
    pub(super) fn send(&self, conn: u64, reply: Reply) {
        let mut conns = self.lock();
        let Some(o) = conns.get_mut(&conn) else { return };
        if o.flushing || !o.held.is_empty() {
            o.held.push(reply);
        } else {
            let _ = o.outbox.send(reply);
        }
    }

    /// Writes the replies held for `conn` from the calling (reader) task, with those that
    /// join them meanwhile, until none is left. With `queue`, they go to the writer task
    /// instead (a capped server's reader must never wait in its outgoing bucket).
    pub(super) async fn flush(&self, conn: u64, queue: bool) -> Result<()> {
        loop {
            let (outbox, batch) = {
                let mut conns = self.lock();
                let Some(o) = conns.get_mut(&conn) else { return Ok(()) };
                let batch = std::mem::take(&mut o.held);
                if queue {
                    for reply in batch {
                        let _ = o.outbox.send(reply);
                    }
                    return Ok(());
                }
                o.flushing = !batch.is_empty();
                if batch.is_empty() {
                    return Ok(());
                }
                (o.outbox.clone(), batch)
            };
            if let Err(e) = outbox.send_all_now(batch).await {
                if let Some(o) = self.lock().get_mut(&conn) {
                    o.flushing = false;
                }
                return Err(e);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use elasticps_wire::{Codec, Kind, Values};
    use tokio::net::{TcpListener, TcpStream};

    use super::*;

    #[tokio::test]
    async fn a_reply_sent_while_the_reader_holds_its_own_leaves_after_them() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (dialed, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let codec = Codec::new(b"", 1 << 20);
        let (_, server_out) = crate::conn::split(accepted.unwrap().0, codec.clone(), "worker".into());
        let (mut worker_in, _worker_out) = crate::conn::split(dialed.unwrap(), codec, "server".into());
        let replies = Replies::default();
        replies.open(1, server_out);
        // The reader task's step acknowledges the push of a push_pull and holds its pull;
        // another task's step releases that pull before the reader task writes.
        replies.hold(1, (7, Message::PushAck { block: 0, clock: 3 }));
        replies.send(1, (7, Message::PullReply { block: 0, clock: 4, values: Values::from_vec(vec![1.0; 4]) }));
        replies.flush(1, false).await.unwrap();
        // With nothing held, a reply goes to the writer task at once.
        replies.send(1, (8, Message::PushAck { block: 0, clock: 4 }));
        let mut got = Vec::new();
        for _ in 0..3 {
            let (header, _) = worker_in.next().await.unwrap().unwrap();
            got.push((header.request_id, header.kind));
        }
        assert_eq!(got, [(7, Kind::PushAck), (7, Kind::PullReply), (8, Kind::PushAck)]);
        replies.close(1);
        assert!(replies.writers().is_empty());
    }
}
