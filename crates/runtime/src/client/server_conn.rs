//! A worker's connection to one server, written and read by the task of the worker's own
//! round: no reader task and no channel between the socket and the round, and a pull
//! reply goes from the socket straight into the caller's tensor
//! ([`crate::conn::FrameReader::payload_into`]).
//!
//! Nothing reads the connection between rounds: a server only answers requests, and a
//! connection that closed meanwhile is found by the next round, which resends what it
//! left unanswered (the plan's `on_lost`).

use std::collections::HashMap;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use elasticps_wire::{Codec, Control, Credential, FrameHeader, HEADER_LEN, Message, ServerAddr};
use futures::future::{AbortHandle, AbortRegistration, Abortable};

use crate::conn::{self, FrameReader, Outbox, Writer};
use crate::error::{Result, RuntimeError};
use elasticps_core::model::BlockSpec;
use elasticps_node::worker::{self, HelloAnswer, Op, Tag};

/// One server's connection, and the requests of the round in flight on it.
pub(super) struct ServerConn {
    /// "server N", for errors.
    pub(super) name: String,
    /// Tells this connection from a later one to the same server (a write that ends after
    /// its connection was dropped is ignored).
    pub(super) serial: u64,
    pub(super) reader: FrameReader,
    out: Outbox,
    /// Requests in flight, by request id (unique in the client, not only here).
    pub(super) pending: HashMap<u64, (Tag, Sent)>,
    /// This connection's writes in flight, aborted when it is dropped.
    writes: Vec<AbortHandle>,
}

impl ServerConn {
    /// Connects to server `s`, which must accept this worker's `Hello` (request id
    /// `hello_id`).
    pub(super) async fn connect(
        s: &ServerAddr,
        codec: Codec,
        credential: &Credential,
        serial: u64,
        hello_id: u64,
    ) -> Result<Self> {
        let name = format!("server {}", s.id);
        let (reader, out) = conn::connect(&s.addr, codec, name.clone()).await?;
        let mut conn = ServerConn { name, serial, reader, out, pending: HashMap::new(), writes: Vec::new() };
        // What the answer means is the node layer's rule (`NotReady`: say Hello again).
        let started = std::time::Instant::now();
        loop {
            let hello = Control::Hello { credential: credential.clone() }.into();
            let what = format!("{} to accept Hello", conn.name);
            let reply = match conn.call(hello_id, hello, crate::CALL_TIMEOUT, || what).await {
                Ok(reply) => reply,
                Err(RuntimeError::Remote { reply, .. }) => Message::Error(reply),
                Err(e) => return Err(e),
            };
            match worker::hello_answer(s.id, &reply, started.elapsed().as_micros() as u64) {
                HelloAnswer::Accepted => return Ok(conn),
                HelloAnswer::Again { after_us } => tokio::time::sleep(Duration::from_micros(after_us)).await,
                HelloAnswer::Refused(e) => return Err(RuntimeError::from(e)),
            }
        }
    }

    /// True if no request of an earlier round waits for its reply here (a round that
    /// failed half-way leaves some: their late replies would be taken for this round's).
    pub(super) fn is_idle(&self) -> bool {
        self.pending.is_empty()
    }

    /// Forgets the writes of earlier rounds (a round ends once its writes did, or drops
    /// them when it fails): only the new round's are aborted with the connection.
    pub(super) fn start_round(&mut self) {
        self.writes.clear();
    }

    /// Sends `msg` as request `id` and reads this connection until its reply, at most
    /// `timeout` (`what` names the wait); outside a round only. An `Error` frame comes
    /// back as [`RuntimeError::Remote`].
    pub(super) async fn call(
        &mut self,
        id: u64,
        msg: Message,
        timeout: Duration,
        what: impl FnOnce() -> String,
    ) -> Result<Message> {
        let name = self.name.clone();
        let exchange = async {
            self.out.send_all_now(vec![(id, msg)]).await?;
            loop {
                let Some((header, reply)) = self.reader.next().await? else {
                    return Err(RuntimeError::Closed(name.clone()));
                };
                if header.request_id == id {
                    return Ok(reply);
                }
                tracing::warn!(peer = %name, id = header.request_id, "reply to no request");
            }
        };
        match tokio::time::timeout(timeout, exchange).await {
            Ok(Ok(Message::Error(reply))) => Err(RuntimeError::Remote { peer: self.name.clone(), reply }),
            Ok(reply) => reply,
            Err(_) => Err(RuntimeError::Timeout { what: what(), after: timeout }),
        }
    }

    /// A write of `frames` on this connection, for the round to drive among its other
    /// events; it is aborted if the connection is dropped first.
    pub(super) fn write<'g>(&mut self, server: u32, frames: Vec<([u8; HEADER_LEN], &'g [u8])>) -> WriteJob<'g> {
        let (handle, abort) = AbortHandle::new_pair();
        self.writes.push(handle);
        WriteJob { server, serial: self.serial, writer: self.out.writer().clone(), frames, abort }
    }

    /// The connection's writer (to encode headers).
    pub(super) fn writer(&self) -> &Arc<Writer> {
        self.out.writer()
    }
}

impl Drop for ServerConn {
    fn drop(&mut self) {
        for w in &self.writes {
            w.abort();
        }
    }
}

/// A write the round drives ([`ServerConn::write`]).
pub(super) struct WriteJob<'g> {
    server: u32,
    serial: u64,
    writer: Arc<Writer>,
    frames: Vec<([u8; HEADER_LEN], &'g [u8])>,
    abort: AbortRegistration,
}

/// How a [`WriteJob`] ended: its server, its connection's serial, and the write's result
/// (`None`: aborted, its connection is gone).
pub(super) type Written = (u32, u64, Option<Result<()>>);

/// Carries out a write (one vectored write of every frame, from the caller's slices).
pub(super) async fn run_write(job: WriteJob<'_>) -> Written {
    let WriteJob { server, serial, writer, frames, abort } = job;
    let result = Abortable::new(writer.write_frames(&frames), abort).await.ok();
    (server, serial, result)
}

/// Polls every connection for its next frame header, starting at the `start`-th (so that
/// a busy server does not keep the others waiting): the first that has one, with its
/// server's id, or the error (or `None`: closed) of one that failed.
pub(super) fn poll_any_header(
    servers: &mut HashMap<u32, ServerConn>,
    start: usize,
    cx: &mut Context<'_>,
) -> Poll<(u32, Result<Option<FrameHeader>>)> {
    let start = if servers.is_empty() { 0 } else { start % servers.len() };
    for from_start in [true, false] {
        for (i, (id, conn)) in servers.iter_mut().enumerate() {
            if (i >= start) != from_start {
                continue;
            }
            if let Poll::Ready(got) = conn.reader.poll_header(cx) {
                return Poll::Ready((*id, got));
            }
        }
    }
    Poll::Pending
}

/// One request in flight: who waits on whom for what.
#[derive(Clone, Copy)]
pub(super) struct Sent {
    /// The server asked.
    pub(super) server: u32,
    /// The block asked for.
    pub(super) block: BlockSpec,
    /// What was asked.
    pub(super) op: Op,
}
