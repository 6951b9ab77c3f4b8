//! The bytes of the worker's requests and replies: a round's requests written from the
//! caller's slices (a push's values with no copy), the replies read (a pull's values
//! straight into the caller's tensor, a row pull's rows where they were asked for), and
//! the other frames decoded for the client machine. A closed connection is handed back
//! to the machine ([`ClientEvent::Closed`]).

use std::collections::HashMap;

use bytes::Bytes;
use elasticps_core::compress::SparseGrad;
use elasticps_core::model::{BlockId, BlockSpec};
use elasticps_core::sync::Clock;
use elasticps_node::ConnId;
use elasticps_node::Machine;
use elasticps_node::worker::{self, Answer, ClientEvent, Effect, Op, Tag};
use elasticps_wire::{Dtype, Flags, FrameHeader, Kind, Message, Values};

use super::Ending;
use super::rows::{RowPayloads, RowSink};
use super::server_conn::{Sent, ServerConn, WriteJob};
use crate::Micros;
use crate::error::{Result, RuntimeError};

/// Where a round's sent values come from: the caller's gradient slices (a tensor round),
/// or each block's row payload (a row round).
#[derive(Clone, Copy)]
pub(super) enum Source<'g> {
    Tensors(&'g Tensors<'g>),
    Rows(&'g RowPayloads),
}

/// A tensor round's gradients and how each tensor travels: f32 straight from the
/// caller's slice, or converted once per push into `coded`, or compressed (top-k,
/// random-k: each block's part as a sparse payload in `sparse`).
#[derive(Default)]
pub(super) struct Tensors<'g> {
    /// The caller's gradients, one entry per tensor (or none: a round without pushes).
    grads: &'g [Option<&'g [f32]>],
    /// The wire dtype of each tensor (its pushes, and the replies its pulls ask for).
    dtypes: Vec<Dtype>,
    /// A pushed tensor's gradient in its dtype, where that is not f32 and it is dense.
    coded: Vec<Option<Vec<u8>>>,
    /// The sparse payload of each block of a compressed tensor (wire bytes: count,
    /// positions, values in the block's dtype).
    sparse: HashMap<BlockId, Bytes>,
    /// The blocks the layout sends in a dtype narrower than their tensor's (the balancer's
    /// `--balance-compress`), with that dtype ([`Tensors::new`]).
    narrow: HashMap<BlockId, Dtype>,
    /// Each such block's dense gradient in its dtype, built once per round.
    narrow_coded: HashMap<BlockId, Vec<u8>>,
}

impl<'g> Tensors<'g> {
    /// `grads` (one entry per tensor, or none) to travel in `dtypes` (one per tensor of
    /// the model), the tensors in `sparse` (`sparse[t]`, from the error feedback) as each
    /// of their `blocks`' part, and each block in its layout dtype (`wire[block]`, f32
    /// past its end: the balancer's `--balance-compress`) where that is narrower than its
    /// tensor's, both ways: each payload is built here, once.
    pub(super) fn new(
        grads: &'g [Option<&'g [f32]>],
        dtypes: Vec<Dtype>,
        sparse: &[Option<SparseGrad>],
        blocks: &[BlockSpec],
        wire: &[Dtype],
    ) -> Self {
        let dtype = |t: usize| dtypes.get(t).copied().unwrap_or_default();
        let compressed = |t: usize| sparse.get(t).and_then(Option::as_ref);
        // Nothing to look at while no block is narrowed (the common case: a hot path).
        let narrow: HashMap<BlockId, Dtype> = match wire.is_empty() {
            true => HashMap::new(),
            false => blocks
                .iter()
                .filter_map(|b| {
                    let d = *wire.get(b.id as usize)?;
                    (d.width() < dtype(b.tensor as usize).width()).then_some((b.id, d))
                })
                .collect(),
        };
        let coded = grads
            .iter()
            .enumerate()
            .map(|(t, g)| match g {
                Some(g) if dtype(t) != Dtype::F32 && compressed(t).is_none() => Some(dtype(t).encode(g)),
                _ => None,
            })
            .collect();
        let mut tensors =
            Tensors { grads, dtypes, coded, sparse: HashMap::new(), narrow, narrow_coded: HashMap::new() };
        for b in blocks {
            if let Some(part) = compressed(b.tensor as usize).map(|s| s.block(b.offset, b.len)) {
                let payload = Values::sparse(&part.indices, &part.values, tensors.block_dtype(b)).wire_bytes();
                tensors.sparse.insert(b.id, payload);
            } else if let Some(&d) = tensors.narrow.get(&b.id)
                && let Some(Some(g)) = grads.get(b.tensor as usize)
                && !g.is_empty()
                && b.offset + b.len <= g.len()
            {
                tensors.narrow_coded.insert(b.id, d.encode(&g[b.offset..b.offset + b.len]));
            }
        }
        tensors
    }

    /// The dtype tensor `t` travels in.
    fn dtype(&self, t: u32) -> Dtype {
        self.dtypes.get(t as usize).copied().unwrap_or_default()
    }

    /// The dtype block `b` travels in, both ways: the layout's for it where that is
    /// narrower than its tensor's, else its tensor's.
    fn block_dtype(&self, b: &BlockSpec) -> Dtype {
        self.narrow.get(&b.id).copied().unwrap_or_else(|| self.dtype(b.tensor))
    }

    /// The bytes block `b` pushes: its range of its tensor's gradient, in the tensor's
    /// dtype (empty for a tensor without a gradient this step).
    fn block_bytes(&self, b: &BlockSpec) -> Result<(&[u8], Flags)> {
        let t = b.tensor as usize;
        let dense = |bytes, dtype| Ok((bytes, Flags { dtype, ..Flags::default() }));
        if let Some(sparse) = self.sparse.get(&b.id) {
            return Ok((&sparse[..], Flags { dtype: self.block_dtype(b), sparse: true, ..Flags::default() }));
        }
        if let Some(coded) = self.narrow_coded.get(&b.id) {
            return dense(&coded[..], self.block_dtype(b));
        }
        match (self.grads.get(t), self.coded.get(t)) {
            (Some(Some([])), _) => dense(&[][..], Dtype::F32),
            (Some(Some(grad)), Some(Some(coded))) if b.offset + b.len <= grad.len() => {
                let w = self.dtype(b.tensor).width();
                dense(&coded[b.offset * w..(b.offset + b.len) * w], self.dtype(b.tensor))
            }
            _ => dense(bytemuck::cast_slice(self.f32_block(b)?), Dtype::F32),
        }
    }

    /// Block `b`'s range of its tensor's values as the caller gave them (f32).
    fn f32_block(&self, b: &BlockSpec) -> Result<&[f32]> {
        match self.grads.get(b.tensor as usize) {
            Some(Some(v)) if b.offset + b.len <= v.len() => Ok(&v[b.offset..b.offset + b.len]),
            _ => Err(RuntimeError::Usage(format!("no values of tensor {} for block {}", b.tensor, b.id))),
        }
    }
}

/// Where a round's pulled values go: the caller's tensors at the pull's clock, or the
/// rows' places (a row pull; `None` for a row push), or nowhere (a call).
pub(super) enum Sink<'s, 'a, 'b, 'r> {
    Tensors(&'s mut Option<(Clock, &'a mut [Option<&'b mut [f32]>])>),
    Rows(Option<&'s mut RowSink<'r>>),
    None,
}

/// What a run reads, writes and tells the machine about besides its own writes: the
/// client's server connections and the scheduler's word on the job's end, borrowed from
/// the [`Client`] beside its machine.
pub(super) struct Links<'c> {
    /// This worker's rank, for logs.
    pub(super) rank: u32,
    /// The connections to the servers the machine dialled.
    pub(super) servers: &'c mut HashMap<ConnId, ServerConn>,
    /// What the scheduler's connection said about the end of the job.
    pub(super) ending: &'c mut tokio::sync::watch::Receiver<Ending>,
    /// The time handed to the machine.
    pub(super) clock: Micros,
}

impl Links<'_> {
    /// Hands the machine `event` now; its effects join `out`.
    pub(super) fn feed(&self, machine: &mut worker::Client, event: ClientEvent<'_>, out: &mut Vec<Effect>) {
        machine.handle(self.clock.now(), event, out);
    }

    /// Whether the scheduler said the job ends (closed server connections are expected).
    pub(super) fn shutting_down(&self) -> bool {
        self.ending.borrow().reason.is_some()
    }

    /// The scheduler's latest failover notice, once, handed to the machine.
    pub(super) fn failover(&mut self, machine: &mut worker::Client, out: &mut Vec<Effect>) {
        let Some(notice) = self.ending.borrow_and_update().failover.clone() else { return };
        tracing::info!(rank = self.rank, "a server failed over: requests to it go to the promoted owners");
        self.feed(machine, ClientEvent::Failover(&notice), out);
    }
}

impl Links<'_> {
    /// Connection `conn` failed (`why`): dropped, and handed to the machine as closed.
    /// After the scheduler's `Shutdown` a lost request is the job's end instead.
    pub(super) fn closed(
        &mut self,
        machine: &mut worker::Client,
        conn: ConnId,
        why: RuntimeError,
        out: &mut Vec<Effect>,
    ) -> Result<()> {
        let Some(c) = self.servers.remove(&conn) else { return Ok(()) };
        if c.pending.is_empty() {
            // Nothing was lost (a server that left the job closes its connections).
            tracing::debug!(rank = self.rank, peer = %c.name, error = %why, "idle server connection closed");
        } else if self.shutting_down() {
            return Err(super::explain(self.ending, RuntimeError::Closed(c.name.clone())));
        } else {
            tracing::warn!(rank = self.rank, peer = %c.name, error = %why, "server connection lost; resending after a layout refresh");
        }
        self.feed(machine, ClientEvent::Closed { conn }, out);
        Ok(())
    }

    /// A frame's header came on `conn`: reads its payload (a pull's values straight into
    /// the caller's tensor) and hands the answer, or the decoded frame, to the machine.
    pub(super) async fn on_header(
        &mut self,
        machine: &mut worker::Client,
        conn: ConnId,
        header: FrameHeader,
        sink: &mut Sink<'_, '_, '_, '_>,
        out: &mut Vec<Effect>,
    ) -> Result<()> {
        let Some(c) = self.servers.get_mut(&conn) else { return Ok(()) };
        // The request stays pending until its payload is read: a run dropped half-way
        // through the read leaves the connection mid-frame, and the machine closes the
        // connections an unfinished round waits on.
        let Some(&sent) = c.pending.get(&header.request_id) else {
            // A Hello's or a call's answer, or a reply no round waits for: decoded.
            return match c.reader.payload(&header).await {
                Ok(msg) => {
                    self.feed(machine, ClientEvent::Frame { conn, request_id: header.request_id, msg: &msg }, out);
                    Ok(())
                }
                Err(e) => self.closed(machine, conn, e, out),
            };
        };
        let tag = header.request_id;
        let b = sent.block;
        if let Sink::Rows(rows) = sink {
            return self.on_rows_header(machine, conn, header, sent, rows.as_deref_mut(), out).await;
        }
        // Where a pull reply of the expected length goes: the block's range of its tensor.
        let dtype = header.flags.dtype;
        let dest = match (header.kind, sink) {
            (Kind::PullReply, Sink::Tensors(Some((_, params))))
                if sent.op.is_pull()
                    && !header.flags.sparse
                    && header.payload_len as usize == b.len * dtype.width() =>
            {
                params
                    .get_mut(b.tensor as usize)
                    .and_then(Option::as_mut)
                    .and_then(|p| p.get_mut(b.offset..b.offset + b.len))
            }
            _ => None,
        };
        let read = match dest {
            Some(dest) if dtype == Dtype::F32 => {
                c.reader.payload_into(&header, bytemuck::cast_slice_mut(dest)).await.map(|()| {
                    #[cfg(target_endian = "big")]
                    for v in dest.iter_mut() {
                        *v = f32::from_bits(u32::from_le(v.to_bits()));
                    }
                    None
                })
            }
            // A reduced dtype: read, then widened into the tensor.
            Some(dest) => {
                let mut bytes = vec![0u8; header.payload_len as usize];
                c.reader.payload_into(&header, &mut bytes).await.map(|()| {
                    dtype.decode_into(&bytes, dest);
                    None
                })
            }
            None => c.reader.payload(&header).await.map(Some),
        };
        let msg = match read {
            Ok(msg) => {
                // A held push_pull's PushAck: its PullReply follows under the same id.
                if sent.op.ends_with(header.kind) {
                    c.pending.remove(&tag);
                }
                msg
            }
            // Unanswered after all: the connection is lost, with this request on it.
            Err(e) => return self.closed(machine, conn, e, out),
        };
        let answer = match &msg {
            Some(msg) => Answer::of(msg),
            None => Answer::Pulled { len: b.len },
        };
        self.feed(machine, ClientEvent::Answer { tag, answer }, out);
        Ok(())
    }

    /// A reply of a row round's request came on `conn`: reads it, puts a
    /// `PullRowsReply`'s rows where they were asked for (its length must be the rows the
    /// request asked times the dim), and hands the answer to the machine.
    async fn on_rows_header(
        &mut self,
        machine: &mut worker::Client,
        conn: ConnId,
        header: FrameHeader,
        sent: Sent,
        rows: Option<&mut RowSink<'_>>,
        out: &mut Vec<Effect>,
    ) -> Result<()> {
        let Some(c) = self.servers.get_mut(&conn) else { return Ok(()) };
        let msg = match c.reader.payload(&header).await {
            Ok(msg) => {
                c.pending.remove(&header.request_id);
                msg
            }
            Err(e) => return self.closed(machine, conn, e, out),
        };
        let b = sent.block;
        if let (Message::PullRowsReply { values, .. }, Op::PullRows(_)) = (&msg, sent.op) {
            let want = rows.as_ref().and_then(|r| r.expected_len(b.id));
            if want != Some(values.len()) {
                return Err(RuntimeError::Protocol {
                    peer: format!("server {}", sent.server),
                    what: format!(
                        "answered pull_rows of block {} with {} values, {} were asked for",
                        b.id,
                        values.len(),
                        want.unwrap_or(0)
                    ),
                });
            }
            if let Some(rows) = rows {
                rows.scatter(b.id, &values.to_vec());
            }
        }
        self.feed(machine, ClientEvent::Answer { tag: header.request_id, answer: Answer::of(&msg) }, out);
        Ok(())
    }

    /// Starts the writes of a batch of requests, one vectored write per connection (into
    /// `jobs`): a push, push_pull or init straight from the caller's gradient slice (no
    /// copy of the values), a pull as its header, a row request with its block's payload.
    /// A connection that is gone is handed to the machine as closed.
    pub(super) fn start_writes<'g>(
        &mut self,
        machine: &mut worker::Client,
        batch: Vec<(ConnId, Tag, Sent)>,
        source: Source<'g>,
        jobs: &mut Vec<WriteJob<'g>>,
        out: &mut Vec<Effect>,
    ) -> Result<()> {
        let mut conns: Vec<ConnId> = batch.iter().map(|(c, ..)| *c).collect();
        conns.sort_unstable();
        conns.dedup();
        for conn in conns {
            let Some(c) = self.servers.get_mut(&conn) else {
                self.feed(machine, ClientEvent::Closed { conn }, out);
                continue;
            };
            let mut frames = Vec::new();
            for &(_, tag, sent) in batch.iter().filter(|(c, ..)| *c == conn) {
                let (kind, clock, bytes, flags) = request_bytes(source, sent)?;
                frames.push((c.writer().tensor_header(kind, tag, sent.block.id, clock, bytes.len(), flags)?, bytes));
                c.pending.insert(tag, sent);
            }
            jobs.push(c.write(conn, frames));
        }
        Ok(())
    }
}

/// The frame kind, clock, payload and flags of request `sent`, its values from `source`.
fn request_bytes<'g>(source: Source<'g>, sent: Sent) -> Result<(Kind, Clock, &'g [u8], Flags)> {
    let b = sent.block;
    let tensors = |what: &str| match source {
        Source::Tensors(t) => Ok(t),
        Source::Rows(_) => Err(RuntimeError::Usage(format!("a {what} of block {} in a row round", b.id))),
    };
    let pushed = |what: &str| -> Result<(&'g [u8], Flags)> { tensors(what)?.block_bytes(&b) };
    let reply = |what: &str| -> Result<Dtype> { Ok(tensors(what)?.block_dtype(&b)) };
    let row_payload = || match source {
        Source::Rows(p) => p
            .by_block
            .get(&b.id)
            .map(Vec::as_slice)
            .ok_or_else(|| RuntimeError::Usage(format!("no rows of table {} for block {}", b.tensor, b.id))),
        Source::Tensors(_) => Err(RuntimeError::Usage(format!("a row request of block {} in a tensor round", b.id))),
    };
    let f32s = Flags::default();
    Ok(match sent.op {
        Op::Push(clock) => {
            let (bytes, flags) = pushed("push")?;
            (Kind::Push, clock, bytes, flags)
        }
        // Initial values travel exact.
        Op::Init => (Kind::Init, 0, bytemuck::cast_slice(tensors("init")?.f32_block(&b)?), f32s),
        Op::Pull(clock) => (Kind::Pull, clock, &[][..], Flags { reply: reply("pull")?, ..f32s }),
        Op::PushPull(clock) => {
            let (bytes, flags) = pushed("push_pull")?;
            (Kind::PushPull, clock, bytes, Flags { reply: reply("push_pull")?, ..flags })
        }
        // No gradient for the table this clock: an empty Push.
        Op::PushRows(clock) => match row_payload()? {
            [] => (Kind::Push, clock, &[][..], f32s),
            rows => (Kind::PushRows, clock, rows, f32s),
        },
        Op::PullRows(clock) => (Kind::PullRows, clock, row_payload()?, f32s),
    })
}
