//! A worker's connection to one server, written and read by the task of the worker's own
//! driver loop (`round.rs`, in [`crate::driver::drive`]): no reader task and no channel between the socket and the
//! round, and a pull reply goes from the socket straight into the caller's tensor
//! ([`crate::conn::FrameReader::payload_into`]).
//!
//! Which connections exist, what is said on them first (`Hello`) and when one is dropped
//! is the client machine's ([`elasticps_node::worker::Client`]); this only holds the
//! socket, the round's requests in flight on it (where their replies go), and its writes.

use std::collections::HashMap;
use std::sync::Arc;
use std::task::{Context, Poll};

use elasticps_wire::{Codec, FrameHeader, HEADER_LEN, Message};
use futures::future::{AbortHandle, AbortRegistration, Abortable};

use crate::conn::{self, FrameReader, Outbox, Writer};
use crate::error::Result;
use elasticps_core::model::BlockSpec;
use elasticps_node::ConnId;
use elasticps_node::worker::{Op, Tag};

/// One server's connection, and the round's requests in flight on it.
pub(super) struct ServerConn {
    /// "server N", for errors.
    pub(super) name: String,
    pub(super) reader: FrameReader,
    out: Outbox,
    /// The round's requests in flight, by tag (their request id).
    pub(super) pending: HashMap<Tag, Sent>,
    /// This connection's writes in flight, aborted when it is dropped.
    writes: Vec<AbortHandle>,
}

impl ServerConn {
    /// Opens a connection to server `server` at `addr` (no `Hello`: the machine says it).
    pub(super) async fn connect(server: u32, addr: &str, codec: Codec) -> Result<Self> {
        let name = format!("server {server}");
        let (reader, out) = conn::connect(addr, codec, name.clone()).await?;
        Ok(ServerConn { name, reader, out, pending: HashMap::new(), writes: Vec::new() })
    }

    /// Forgets the writes of earlier runs (a run ends once its writes did, or drops them
    /// when it fails): only the new run's are aborted with the connection.
    pub(super) fn start_run(&mut self) {
        self.writes.clear();
    }

    /// Writes `msg` as request `id`, now.
    pub(super) async fn send(&self, id: u64, msg: Message) -> Result<()> {
        self.out.send_all_now(vec![(id, msg)]).await
    }

    /// A write of `frames` on connection `conn`, for the loop to drive among its other
    /// events; it is aborted if the connection is dropped first.
    pub(super) fn write<'g>(&mut self, conn: ConnId, frames: Vec<([u8; HEADER_LEN], &'g [u8])>) -> WriteJob<'g> {
        let (handle, abort) = AbortHandle::new_pair();
        self.writes.push(handle);
        WriteJob { conn, writer: self.out.writer().clone(), frames, abort }
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

/// A write the loop drives ([`ServerConn::write`]).
pub(super) struct WriteJob<'g> {
    conn: ConnId,
    writer: Arc<Writer>,
    frames: Vec<([u8; HEADER_LEN], &'g [u8])>,
    abort: AbortRegistration,
}

/// How a [`WriteJob`] ended: its connection, and the write's result (`None`: aborted,
/// its connection is gone).
pub(super) type Written = (ConnId, Option<Result<()>>);

/// Carries out a write (one vectored write of every frame, from the caller's slices).
pub(super) async fn run_write(job: WriteJob<'_>) -> Written {
    let WriteJob { conn, writer, frames, abort } = job;
    let result = Abortable::new(writer.write_frames(&frames), abort).await.ok();
    (conn, result)
}

/// Polls every connection for its next frame header, starting at the `start`-th (so that
/// a busy server does not keep the others waiting): the first that has one, with its
/// connection, or the error (or `None`: closed) of one that failed.
pub(super) fn poll_any_header(
    servers: &mut HashMap<ConnId, ServerConn>,
    start: usize,
    cx: &mut Context<'_>,
) -> Poll<(ConnId, Result<Option<FrameHeader>>)> {
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
