//! Framed I/O over a connection (plain TCP or TLS, [`crate::tls::Stream`]): the only place
//! that reads and writes frames.
//!
//! Reading takes the 32-byte header first, validates it (so an oversized length is
//! refused before a byte of payload is read), then reads a tensor payload straight into
//! an aligned `Vec<f32>`: no intermediate buffer, no per-element decoding. Large payload
//! buffers are recycled through a small process-wide pool ([`crate::pool`]). A reader that
//! knows where a payload goes (a worker's pull reply: its tensor) reads the header alone,
//! cancel-safely among other events ([`FrameReader::poll_header`]), then the payload into
//! its own buffer ([`FrameReader::payload_into`]).
//!
//! Writing has two paths into one socket, serialised by the connection's [`Writer`]:
//!
//! - the [`Outbox`]: a channel to one writer task per connection, for callers that cannot
//!   wait (a reply produced for another connection, a heartbeat). The task batches small
//!   frames into one write and writes header and large payload with one vectored write;
//! - direct writes ([`Writer::write_frame`], [`Outbox::send_all_now`]): the caller's own task
//!   writes header and payload with one vectored write (`writev`), from a borrowed payload
//!   (a worker's gradient slice: no copy of tensor bytes, no hop to another task).
//!
//! A direct write that is cancelled half-way (its future dropped) leaves a partial frame on
//! the wire: the connection is then marked broken, every later write fails, and it is shut
//! down, so the peer sees a closed connection rather than a desynchronised stream.
//!
//! A connection split with a [`Shaper`] ([`split_shaped`]) passes every frame through
//! the server's bandwidth buckets: after reading it, and before writing it.

use std::io::IoSlice;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};

use bytes::{Bytes, BytesMut};
use elasticps_wire::{Codec, Flags, FrameHeader, HEADER_LEN, Kind, Message, WireError};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use crate::error::{Result, RuntimeError};
use crate::shaping::Shaper;
use crate::tls::{ReadHalf, Stream, WriteHalf};
use crate::{partial, pool};

/// A frame to send: request id and message.
pub type Outgoing = (u64, Message);

/// Read buffer of a connection, and the most the writer task batches into one write.
const BUF: usize = 256 * 1024;
/// Payloads up to this size are copied into the writer task's batch; larger ones are
/// written from their own memory (vectored write).
const COPY_MAX: usize = 16 * 1024;

/// The most payload a frame may carry on a server's data connection before its `Hello`
/// was taken (and then only a control frame): the largest legitimate one is a `Hello`
/// with its credential, under 200 bytes (docs/PROTOCOL.md §2, check 8).
pub const PRE_HELLO_MAX_PAYLOAD: u32 = 64 << 10;

/// The most payload a frame may carry on a scheduler's connection before it registered
/// (and then only a control frame): the largest legitimate one is a restarted scheduler's
/// `ReattachServer`, whose list of held blocks takes about 6 bytes a block, so this
/// leaves room for some 170,000 blocks (docs/PROTOCOL.md §2, check 8).
pub const UNREGISTERED_MAX_PAYLOAD: u32 = 1 << 20;

/// Whether a connection's peer said who it is (a server took its `Hello`, the scheduler
/// its registration); shared by the driver, which learns it from its machine, and the
/// connection's [`FrameReader`], which until then takes only small control frames
/// ([`FrameReader::restrict_until`]). Cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct Identified(Arc<AtomicBool>);

impl Identified {
    /// The peer said who it is: its frames are no longer restricted.
    pub fn set(&self) {
        self.0.store(true, Ordering::Release);
    }

    /// Whether [`Identified::set`] was called.
    pub fn is_set(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// How long a frame that began may go without a byte before its peer is dropped.
pub const FRAME_STALL_TIMEOUT: std::time::Duration =
    std::time::Duration::from_micros(elasticps_node::timing::FRAME_STALL_TIMEOUT_US);

/// Reads frames from one connection.
pub struct FrameReader {
    inner: BufReader<ReadHalf>,
    codec: Codec,
    peer: String,
    request_id: u64,
    shaper: Option<Arc<Shaper>>,
    stall_timeout: std::time::Duration,
    /// The next frame's header, as far as it was read ([`FrameReader::poll_header`] is
    /// cancel-safe).
    head: [u8; HEADER_LEN],
    head_filled: usize,
    /// How long the last payload [`FrameReader::payload`] read took, ns.
    last_payload_ns: u64,
    /// Until the peer is identified, the most payload a (control) frame may carry.
    unidentified: Option<(Identified, u32)>,
}

impl FrameReader {
    /// How long the last frame's payload took to come in (from the end of its header to
    /// its last byte, with the bandwidth cap's wait), ns: a server's measure of its link
    /// (`elasticps_node::server::Server::arrived`).
    pub fn last_payload_ns(&self) -> u64 {
        self.last_payload_ns
    }

    /// Name of the peer, for errors and logs.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// How long a started frame may go without a byte ([`FRAME_STALL_TIMEOUT`] unless set).
    pub fn set_stall_timeout(&mut self, after: std::time::Duration) {
        self.stall_timeout = after;
    }

    /// Until `identified` is set, this reader refuses from its header, before a byte of
    /// payload is read, any frame but a control (or error) frame of at most `max_payload`
    /// bytes ([`PRE_HELLO_MAX_PAYLOAD`] on a server, [`UNREGISTERED_MAX_PAYLOAD`] on the
    /// scheduler): a peer that has not said who it is cannot make the node reserve a data
    /// frame's buffer.
    pub fn restrict_until(&mut self, identified: Identified, max_payload: u32) {
        self.unidentified = Some((identified, max_payload));
    }

    /// Renames the peer once it said who it is.
    pub fn set_peer(&mut self, peer: String) {
        self.peer = peer;
    }

    /// The request id to put on the `Error` frame that refuses the frame [`FrameReader::next`]
    /// failed on: that frame's own if its header was readable (magic, version and checksum
    /// held), else 0 (docs/PROTOCOL.md §7).
    pub fn refused_request_id(&self) -> u64 {
        self.request_id
    }

    /// True if bytes of a next frame are already read from the socket: [`FrameReader::next`]
    /// will not wait for the peer to send its start.
    pub fn has_buffered(&self) -> bool {
        self.head_filled > 0 || !self.inner.buffer().is_empty()
    }

    /// The next frame, or `None` when the peer closed the connection between frames.
    /// Waits without limit for a frame to begin; once one began, a peer that stalls is
    /// dropped ([`FrameReader::set_stall_timeout`]).
    pub async fn next(&mut self) -> Result<Option<(FrameHeader, Message)>> {
        let Some(header) = self.header().await? else {
            return Ok(None);
        };
        let msg = self.payload(&header).await?;
        Ok(Some((header, msg)))
    }

    /// The next frame's header, or `None` when the peer closed the connection between
    /// frames; its payload is to be read next, with [`FrameReader::payload`] or
    /// [`FrameReader::payload_into`]. Stall rules as [`FrameReader::next`].
    pub async fn header(&mut self) -> Result<Option<FrameHeader>> {
        self.request_id = 0;
        // A clean end of stream is only allowed before the first header byte.
        if !std::future::poll_fn(|cx| self.poll_head(cx, 1)).await.map_err(|e| self.io_err(e))? {
            return Ok(None);
        }
        let stall = self.stall_timeout;
        match tokio::time::timeout(stall, std::future::poll_fn(|cx| self.poll_head(cx, HEADER_LEN))).await {
            Ok(Ok(true)) => self.take_header().map(Some),
            Ok(Ok(false)) => Err(self.io_err(std::io::ErrorKind::UnexpectedEof.into())),
            Ok(Err(e)) => Err(self.io_err(e)),
            Err(_) => Err(RuntimeError::Timeout {
                what: format!(
                    "{} to send the rest of a frame header ({} of {HEADER_LEN} bytes came)",
                    self.peer, self.head_filled
                ),
                after: stall,
            }),
        }
    }

    /// Polls for the next frame's header, without a stall limit (the caller bounds the
    /// wait): `Ready(Ok(None))` when the peer closed the connection between frames.
    /// Cancel-safe: the bytes of a header read so far stay in the reader, so this can be
    /// polled among other events and dropped between polls.
    pub fn poll_header(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<FrameHeader>>> {
        self.request_id = 0;
        match ready!(self.poll_head(cx, HEADER_LEN)) {
            Ok(true) => Poll::Ready(self.take_header().map(Some)),
            Ok(false) if self.head_filled == 0 => Poll::Ready(Ok(None)),
            Ok(false) => Poll::Ready(Err(self.io_err(std::io::ErrorKind::UnexpectedEof.into()))),
            Err(e) => Poll::Ready(Err(self.io_err(e))),
        }
    }

    /// The payload of the frame whose header [`FrameReader::header`] returned, decoded: a
    /// tensor payload is read straight into a pooled aligned buffer.
    pub async fn payload(&mut self, header: &FrameHeader) -> Result<Message> {
        let started = std::time::Instant::now();
        let len = header.payload_len as usize;
        // The buffer counts against the node's budget for partial frames until its last
        // byte came (crate::partial): a frame that would pass it evicts the ones that
        // went longest without a byte. A payload already whole in the read buffer (most
        // small frames) is copied out at once, without waiting for a byte: it holds no
        // reservation.
        let waits = len > self.inner.buffer().len();
        let reservation = waits.then(|| partial::reserve(len as u64));
        let payload = if header.kind.carries_words() && len.is_multiple_of(4) {
            let mut v = pool::payload_buffer(len / 4);
            self.read_rest_of(bytemuck::cast_slice_mut(&mut v), reservation.as_ref()).await?;
            pool::pooled_values(v).into_bytes()
        } else {
            let mut b = BytesMut::zeroed(len);
            self.read_rest_of(&mut b, reservation.as_ref()).await?;
            b.freeze()
        };
        drop(reservation);
        self.shaped_in(len).await;
        self.last_payload_ns = started.elapsed().as_nanos() as u64;
        Message::decode(header, payload).map_err(|source| self.wire_err(source))
    }

    /// The payload of the frame whose header [`FrameReader::header`] returned, read
    /// straight into `dest` (a worker's tensor: no buffer, no copy), which must be exactly
    /// as long as the payload.
    pub async fn payload_into(&mut self, header: &FrameHeader, dest: &mut [u8]) -> Result<()> {
        if dest.len() != header.payload_len as usize {
            return Err(RuntimeError::Protocol {
                peer: self.peer.clone(),
                what: format!("a {:?} of {} bytes where {} were expected", header.kind, header.payload_len, dest.len()),
            });
        }
        self.read_rest(dest).await?;
        self.shaped_in(dest.len()).await;
        Ok(())
    }

    /// Pays a frame read into the inbound bucket of a shaped connection.
    async fn shaped_in(&self, payload_len: usize) {
        if let Some(shaper) = &self.shaper {
            shaper.take_in(HEADER_LEN + payload_len).await;
        }
    }

    /// Reads header bytes until at least `want` of them are in (`Ok(true)`), or the
    /// stream ended (`Ok(false)`).
    fn poll_head(&mut self, cx: &mut Context<'_>, want: usize) -> Poll<std::io::Result<bool>> {
        while self.head_filled < want {
            let mut buf = ReadBuf::new(&mut self.head[self.head_filled..]);
            ready!(std::pin::Pin::new(&mut self.inner).poll_read(cx, &mut buf))?;
            let n = buf.filled().len();
            if n == 0 {
                return Poll::Ready(Ok(false));
            }
            self.head_filled += n;
        }
        Poll::Ready(Ok(true))
    }

    /// Decodes the header read in full, and makes room for the next one.
    fn take_header(&mut self) -> Result<FrameHeader> {
        self.head_filled = 0;
        self.request_id = 0;
        let head = self.head;
        match self.codec.decode_header(&head) {
            Ok(h) => {
                self.request_id = h.request_id;
                if let Some((identified, max)) = &self.unidentified
                    && !identified.is_set()
                    && (!matches!(h.kind, Kind::Control | Kind::Error) || h.payload_len > *max)
                {
                    let source = WireError::Unidentified { kind: h.kind, len: h.payload_len, max: *max };
                    return Err(self.wire_err(source));
                }
                Ok(h)
            }
            Err(source) => {
                if !matches!(source, WireError::BadMagic { .. } | WireError::BadVersion { .. } | WireError::BadChecksum)
                {
                    self.request_id = u64::from_le_bytes(head[8..16].try_into().unwrap_or_default());
                }
                Err(self.wire_err(source))
            }
        }
    }

    /// Fills `buf` with the rest of a frame that began: a peer that sends no byte of it for
    /// the stall timeout ([`FrameReader::set_stall_timeout`]) is dropped (a stalled frame
    /// must not hold a connection, its task and its buffer forever).
    async fn read_rest(&mut self, buf: &mut [u8]) -> Result<()> {
        self.read_rest_of(buf, None).await
    }

    /// [`FrameReader::read_rest`] of a payload that holds `reservation` in the node's
    /// budget for partial frames: every read marks progress, and an eviction (a frame
    /// that needed the room) drops the peer.
    async fn read_rest_of(&mut self, buf: &mut [u8], reservation: Option<&partial::Reservation>) -> Result<()> {
        let mut filled = 0;
        while filled < buf.len() {
            let read = tokio::time::timeout(self.stall_timeout, self.inner.read(&mut buf[filled..]));
            let read = match reservation {
                None => read.await,
                Some(r) => tokio::select! {
                    biased;
                    () = r.evicted() => {
                        let max_mib = partial::max_partial_bytes() >> 20;
                        return Err(RuntimeError::Dropped {
                            peer: self.peer.clone(),
                            why: format!(
                                "its partial frame ({filled} of {} payload bytes came) was the one that went longest \
                                 without a byte when the node's partial frames filled their budget of {max_mib} MiB \
                                 (--max-partial-mib)",
                                buf.len()
                            ),
                        });
                    }
                    read = read => read,
                },
            };
            let n = match read {
                Ok(Ok(0)) => return Err(self.io_err(std::io::ErrorKind::UnexpectedEof.into())),
                Ok(Ok(n)) => n,
                Ok(Err(e)) => return Err(self.io_err(e)),
                Err(_) => {
                    return Err(RuntimeError::Timeout {
                        what: format!(
                            "{} to send the rest of a frame ({filled} of {} more bytes came)",
                            self.peer,
                            buf.len()
                        ),
                        after: self.stall_timeout,
                    });
                }
            };
            filled += n;
            if let Some(r) = reservation {
                r.progressed();
            }
        }
        Ok(())
    }

    fn io_err(&self, e: std::io::Error) -> RuntimeError {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            RuntimeError::Closed(format!("{} (in the middle of a frame)", self.peer))
        } else {
            RuntimeError::io(format!("reading from {}", self.peer), e)
        }
    }

    fn wire_err(&self, source: elasticps_wire::WireError) -> RuntimeError {
        RuntimeError::Wire { peer: self.peer.clone(), source }
    }
}

/// How long a process waits, at its end, for its last frames to be written (a peer that
/// reads nothing can hold a socket full: the wait is bounded, and says so).
pub const LAST_WRITES_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Waits, at most [`LAST_WRITES_TIMEOUT`], until every frame queued so far on `writers`
/// is written into its socket: a process's last frames are not lost when it exits right
/// after. Logs `who` and what was not written in time, and returns false then.
pub async fn flush_last_writes(writers: &[Arc<Writer>], who: &str) -> bool {
    let flushed = futures::future::join_all(writers.iter().map(|w| w.flushed()));
    let in_time = tokio::time::timeout(LAST_WRITES_TIMEOUT, flushed).await.is_ok();
    if !in_time {
        tracing::warn!(
            who,
            connections = writers.len(),
            timeout_s = LAST_WRITES_TIMEOUT.as_secs(),
            "exiting before the last frames were written"
        );
    }
    in_time
}

/// Sender side of a connection's writer task (cheap to clone); every clone shares the
/// connection's [`Writer`]. The writer task ends when every clone is dropped (or the
/// socket fails), and then shuts the socket down.
#[derive(Clone)]
pub struct Outbox {
    tx: mpsc::UnboundedSender<Outgoing>,
    writer: Arc<Writer>,
}

impl Outbox {
    /// Queues a frame for the writer task; fails once the task ended.
    pub fn send(&self, item: Outgoing) -> std::result::Result<(), WriterGone> {
        self.writer.queued.fetch_add(1, Ordering::AcqRel);
        self.tx.send(item).map_err(|_| {
            self.writer.queued.fetch_sub(1, Ordering::AcqRel);
            WriterGone
        })
    }

    /// Writes frames from this task, now, back to back with one vectored write (no hop to
    /// the writer task: the replies to a burst of requests), unless frames queued earlier
    /// are not written yet: then they are queued behind them, so frames leave in the order
    /// they were sent (and so is a burst with a Forward in it).
    pub async fn send_all_now(&self, frames: Vec<Outgoing>) -> Result<()> {
        // A Forward is three parts (header, prefix, values), which the writer task writes
        // without joining them.
        if self.writer.queued.load(Ordering::Acquire) > 0
            || frames.iter().any(|(_, m)| matches!(m, Message::Forward { .. }))
        {
            for frame in frames {
                self.send(frame).map_err(|_| RuntimeError::Closed(self.writer.peer.clone()))?;
            }
            return Ok(());
        }
        let mut encoded = Vec::with_capacity(frames.len());
        for (id, msg) in &frames {
            encoded.push(self.writer.encode(*id, msg)?);
        }
        let borrowed: Vec<([u8; HEADER_LEN], &[u8])> = encoded.iter().map(|(h, p)| (*h, &p[..])).collect();
        self.writer.write_frames(&borrowed).await
    }

    /// The connection's writer, for direct writes of borrowed payloads.
    pub fn writer(&self) -> &Arc<Writer> {
        &self.writer
    }
}

/// [`Outbox::send`] failed: the connection's writer task ended (the socket failed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriterGone;

/// The write half of one connection, shared by its writer task and direct writers: one
/// frame at a time goes into the socket (an async mutex), each with one vectored write.
pub struct Writer {
    sock: tokio::sync::Mutex<WriteHalf>,
    codec: Codec,
    peer: String,
    shaper: Option<Arc<Shaper>>,
    /// Frames in the outbox channel that the writer task has not written yet.
    queued: AtomicUsize,
    /// A direct write was cancelled half-way: the stream holds a partial frame.
    broken: AtomicBool,
    /// The socket takes vectored writes.
    vectored: bool,
    /// Batches the writer task wrote, and whether it ended: what [`Writer::flushed`] waits on.
    progress: tokio::sync::watch::Sender<(u64, bool)>,
}

impl Writer {
    /// Waits until every frame queued so far is written and flushed into the socket, or
    /// the writer task ended (the socket failed): the outcome a driver waits for before
    /// it exits after its last answers.
    pub async fn flushed(&self) {
        let mut progress = self.progress.subscribe();
        while self.queued.load(Ordering::Acquire) > 0 && !progress.borrow_and_update().1 {
            if progress.changed().await.is_err() {
                return;
            }
        }
    }

    /// The codec of the connection (to encode headers for [`Writer::write_frame`]).
    pub fn codec(&self) -> &Codec {
        &self.codec
    }

    /// Name of the peer, for errors and logs.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Whether the stream takes vectored writes (plain TCP and TLS both do): a header and
    /// its payload leave in one call, from their own memory.
    pub fn is_vectored(&self) -> bool {
        self.vectored
    }

    /// The frame of `msg`, checked against the payload limit.
    fn encode(&self, request_id: u64, msg: &Message) -> Result<([u8; HEADER_LEN], Bytes)> {
        self.codec.encode(request_id, msg).map_err(|source| RuntimeError::Wire { peer: self.peer.clone(), source })
    }

    /// The header of a tensor frame (`kind` Push, PushPull, Init or PullReply) of `payload_len`
    /// bytes, checked against the payload limit.
    pub fn tensor_header(
        &self,
        kind: Kind,
        request_id: u64,
        block: u32,
        clock: u32,
        payload_len: usize,
        flags: Flags,
    ) -> Result<[u8; HEADER_LEN]> {
        let max = self.codec.max_payload();
        let len = u32::try_from(payload_len).ok().filter(|l| *l <= max).ok_or_else(|| RuntimeError::Wire {
            peer: self.peer.clone(),
            source: WireError::TooLarge { len: payload_len as u64, max },
        })?;
        Ok(self.codec.encode_header(&FrameHeader { kind, request_id, block, clock, payload_len: len, flags }))
    }

    /// Writes one frame, header then payload, with vectored writes from this task and
    /// from the caller's memory (no copy). Waits for the socket (and for the writer task
    /// or another direct writer to finish its frame). If this future is dropped before it
    /// finished, the connection is broken for good (see the module doc).
    pub async fn write_frame(&self, head: &[u8; HEADER_LEN], payload: &[u8]) -> Result<()> {
        self.write_frames(&[(*head, payload)]).await
    }

    /// Writes frames (header, payload) back to back, as [`Writer::write_frame`] does one:
    /// one vectored write for all of them as far as the socket takes it.
    pub async fn write_frames(&self, frames: &[([u8; HEADER_LEN], &[u8])]) -> Result<()> {
        let mut sock = self.sock.lock().await;
        if self.broken.load(Ordering::Acquire) {
            let _ = sock.shutdown().await;
            return Err(RuntimeError::Closed(format!("{} (a cancelled write broke the connection)", self.peer)));
        }
        if let Some(shaper) = &self.shaper {
            let bytes: usize = frames.iter().map(|(_, p)| HEADER_LEN + p.len()).sum();
            shaper.take_out(bytes).await;
        }
        let mut parts: Vec<IoSlice<'_>> = frames.iter().flat_map(|(h, p)| [IoSlice::new(h), IoSlice::new(p)]).collect();
        let guard = BreakOnDrop(&self.broken);
        let mut result = Ok(());
        // At most IOV_MAX (1024) slices per call.
        for chunk in parts.chunks_mut(1024) {
            result = write_all_vectored(&mut sock, chunk).await;
            if result.is_err() {
                break;
            }
        }
        if result.is_ok() {
            // TLS may hold the last record when the socket was full (plain TCP: no-op).
            result = sock.flush().await;
        }
        std::mem::forget(guard);
        result.map_err(|e| RuntimeError::io(format!("writing to {}", self.peer), e))
    }
}

/// Marks a connection broken when a write is dropped half-way.
struct BreakOnDrop<'a>(&'a AtomicBool);

impl Drop for BreakOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Writes every byte of `parts` (vectored writes; `write_vectored` may take part of them).
async fn write_all_vectored(w: &mut WriteHalf, parts: &mut [IoSlice<'_>]) -> std::io::Result<()> {
    let mut parts = parts;
    while !parts.is_empty() {
        let n = w.write_vectored(parts).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut parts, n);
    }
    Ok(())
}

/// Splits a connected stream (a [`TcpStream`] or a [`Stream`]) into a frame reader and the
/// outbox of a new writer task. The writer task ends when every outbox clone is dropped or
/// the socket fails.
pub fn split(stream: impl Into<Stream>, codec: Codec, peer: String) -> (FrameReader, Outbox) {
    split_shaped(stream, codec, peer, None)
}

/// [`split`], with every frame read or written passing through `shaper`'s bandwidth
/// buckets (a server's injected bandwidth cap). `None` costs nothing.
pub fn split_shaped(
    stream: impl Into<Stream>,
    codec: Codec,
    peer: String,
    shaper: Option<Arc<Shaper>>,
) -> (FrameReader, Outbox) {
    let stream = stream.into();
    let _ = stream.tcp().set_nodelay(true);
    let (r, w) = stream.into_split();
    let (tx, rx) = mpsc::unbounded_channel();
    let vectored = w.is_write_vectored();
    let writer = Arc::new(Writer {
        vectored,
        sock: tokio::sync::Mutex::new(w),
        codec: codec.clone(),
        peer: peer.clone(),
        shaper: shaper.clone(),
        queued: AtomicUsize::new(0),
        broken: AtomicBool::new(false),
        progress: tokio::sync::watch::Sender::new((0, false)),
    });
    let task = writer.clone();
    tokio::spawn(async move {
        write_loop(task.clone(), rx).await;
        task.progress.send_modify(|p| p.1 = true);
    });
    let reader = FrameReader {
        inner: BufReader::with_capacity(BUF, r),
        codec,
        peer,
        request_id: 0,
        shaper,
        stall_timeout: FRAME_STALL_TIMEOUT,
        head: [0; HEADER_LEN],
        head_filled: 0,
        last_payload_ns: 0,
        unidentified: None,
    };
    (reader, Outbox { tx, writer })
}

/// Connects to `addr` and splits the stream, with a timeout naming what is connected.
pub async fn connect(addr: &str, codec: Codec, peer: String) -> Result<(FrameReader, Outbox)> {
    let stream = dial(addr, &codec, &peer).await?;
    Ok(split(stream, codec, peer))
}

/// A connection to `addr` that passed the handshake ([`crate::handshake::dial`]): TLS if
/// this process [`crate::tls::install`]ed TLS settings, with the handshake inside it.
pub async fn dial(addr: &str, codec: &Codec, peer: &str) -> Result<Stream> {
    dial_with(addr, codec, peer, crate::tls::installed().as_deref()).await
}

/// [`dial`] with these TLS settings (`None`: plain TCP) instead of the installed ones.
pub async fn dial_with(addr: &str, codec: &Codec, peer: &str, tls: Option<&crate::tls::TlsConfig>) -> Result<Stream> {
    let what = format!("connecting to {peer} at {addr}");
    let tcp = crate::timeout(crate::CONNECT_TIMEOUT, what.clone(), async {
        TcpStream::connect(addr).await.map_err(|e| RuntimeError::io(what.clone(), e))
    })
    .await?;
    let named = format!("{peer} at {addr}");
    let mut stream = match tls {
        Some(tls) => tls.connect(tcp, addr, &named, crate::handshake::HANDSHAKE_TIMEOUT).await?,
        None => Stream::Plain(tcp),
    };
    crate::handshake::dial_with(&mut stream, codec.key(), codec.secret(), &named).await?;
    Ok(stream)
}

/// The writer task: takes the socket for each burst of queued frames, batches small
/// frames into one write and writes a large payload from its own memory.
async fn write_loop(writer: Arc<Writer>, mut rx: mpsc::UnboundedReceiver<Outgoing>) {
    let mut batch: Vec<u8> = Vec::with_capacity(BUF);
    while let Some(first) = rx.recv().await {
        let mut sock = writer.sock.lock().await;
        if writer.broken.load(Ordering::Acquire) {
            break;
        }
        let mut next = Some(first);
        let mut taken = 0;
        let mut result = Ok(());
        while let Some((id, msg)) = next {
            taken += 1;
            result = write_queued(&writer, &mut sock, &mut batch, id, &msg).await;
            if result.is_err() {
                break;
            }
            next = rx.try_recv().ok();
        }
        if result.is_ok() && !batch.is_empty() {
            result = sock.write_all(&batch).await;
        }
        if result.is_ok() {
            // TLS may hold the last record when the socket was full (plain TCP: no-op).
            result = sock.flush().await;
        }
        batch.clear();
        writer.queued.fetch_sub(taken, Ordering::AcqRel);
        writer.progress.send_modify(|p| p.0 = p.0.wrapping_add(1));
        if let Err(e) = result {
            tracing::debug!(peer = %writer.peer, error = %e, "writer stops");
            return;
        }
    }
    let _ = writer.sock.lock().await.shutdown().await;
}

/// One queued frame into the batch, or (with the batch) into the socket.
async fn write_queued(
    writer: &Writer,
    sock: &mut WriteHalf,
    batch: &mut Vec<u8>,
    id: u64,
    msg: &Message,
) -> std::io::Result<()> {
    // A Forward's prefix is written apart from its values: the bytes it forwards are not
    // copied (nor is any other tensor payload).
    let (head, prefix, payload) = match writer.codec.encode_parts(id, msg) {
        Ok(frame) => frame,
        Err(e) => {
            // A frame this side cannot encode (too large) is dropped; the request times out.
            tracing::warn!(peer = %writer.peer, error = %e, "frame not sent");
            return Ok(());
        }
    };
    let prefix: &[u8] = prefix.as_ref().map_or(&[], |p| &p[..]);
    if let Some(shaper) = &writer.shaper {
        let wait = shaper.reserve_out(HEADER_LEN + prefix.len() + payload.len());
        if !wait.is_zero() {
            // The frames batched so far were already paid for: send them before waiting.
            sock.write_all(batch).await?;
            batch.clear();
            shaper.wait(wait).await;
        }
    }
    if payload.len() <= COPY_MAX && batch.len() + HEADER_LEN + prefix.len() + payload.len() <= BUF {
        batch.extend_from_slice(&head);
        batch.extend_from_slice(prefix);
        batch.extend_from_slice(&payload);
        return Ok(());
    }
    let mut parts = [IoSlice::new(batch), IoSlice::new(&head), IoSlice::new(prefix), IoSlice::new(&payload)];
    write_all_vectored(sock, &mut parts).await?;
    batch.clear();
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use elasticps_wire::{Injection, Values};
    use tokio::net::TcpListener;

    use super::*;

    async fn pair(a: Option<Arc<Shaper>>) -> ((FrameReader, Outbox), (FrameReader, Outbox)) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (dialed, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let codec = Codec::new(b"", 64 << 20);
        let a = split_shaped(accepted.unwrap().0, codec.clone(), "a".into(), a);
        (a, split(dialed.unwrap(), codec, "b".into()))
    }

    fn push(len: usize) -> Message {
        Message::Push { block: 0, clock: 0, values: Values::from_vec(vec![1.0; len]) }
    }

    #[tokio::test]
    async fn a_shaped_side_reads_and_writes_at_its_cap() {
        let shaper = Shaper::new();
        shaper.configure(&Injection { bandwidth_bps: 1_000_000, interference: 0.0, at_us: 0 });
        let ((mut a_in, a_out), (mut b_in, b_out)) = pair(Some(shaper.clone())).await;
        // 4 frames of 100 KB: 400 KB at 1 MB/s, less the 64 KiB burst.
        let expected = Duration::from_millis(400) - Duration::from_nanos(64 * 1024 * 1000);
        let bound = expected + Duration::from_millis(500);

        let t = Instant::now();
        for _ in 0..4 {
            b_out.send((1, push(25_000))).unwrap();
        }
        for _ in 0..4 {
            let (_, msg) = a_in.next().await.unwrap().unwrap();
            assert!(matches!(msg, Message::Push { values, .. } if values.len() == 25_000));
        }
        let took = t.elapsed();
        assert!(took >= expected && took < bound, "reading took {took:?}");

        let t = Instant::now();
        for _ in 0..4 {
            a_out.send((1, push(25_000))).unwrap();
        }
        for _ in 0..4 {
            b_in.next().await.unwrap().unwrap();
        }
        let took = t.elapsed();
        assert!(took >= expected && took < bound, "writing took {took:?}");
        assert!(shaper.take_shaped_us() >= 2 * expected.as_micros() as u64 - 10_000);
    }

    /// Issue 33: a driver that exits after its last answers waits for them to be written
    /// (`flushed`), not for a fixed time.
    #[tokio::test]
    async fn flushed_returns_once_every_queued_frame_is_written() {
        let shaper = Shaper::new();
        shaper.configure(&Injection { bandwidth_bps: 1_000_000, interference: 0.0, at_us: 0 });
        let ((_a_in, a_out), (mut b_in, _b_out)) = pair(Some(shaper)).await;
        for _ in 0..4 {
            a_out.send((1, push(25_000))).unwrap();
        }
        let reader = tokio::spawn(async move {
            for _ in 0..4 {
                b_in.next().await.unwrap().unwrap();
            }
        });
        let t = Instant::now();
        tokio::time::timeout(Duration::from_secs(10), a_out.writer().flushed()).await.expect("the 4 frames written");
        // 400 KB at 1 MB/s, less the 64 KiB burst: the frames were still queued at first.
        assert!(t.elapsed() >= Duration::from_millis(250), "flushed after {:?}", t.elapsed());
        assert_eq!(a_out.writer().queued.load(Ordering::Acquire), 0);
        tokio::time::timeout(Duration::from_secs(10), reader).await.expect("the peer reads the 4 frames").unwrap();
    }

    #[tokio::test]
    async fn direct_writes_from_borrowed_slices_and_queued_frames_arrive_whole() {
        let ((mut a_in, _a_out), (_b_in, b_out)) = pair(None).await;
        let big: Vec<f32> = (0..300_000).map(|i| i as f32).collect();
        let small = [1.5f32; 3];
        let w = b_out.writer();
        let frames = [
            (
                w.tensor_header(Kind::Push, 7, 1, 2, big.len() * 4, Flags::default()).unwrap(),
                bytemuck::cast_slice::<f32, u8>(&big),
            ),
            (w.tensor_header(Kind::Pull, 8, 3, 4, 0, Default::default()).unwrap(), &[][..]),
            (
                w.tensor_header(Kind::Init, 9, 5, 0, 12, Default::default()).unwrap(),
                bytemuck::cast_slice::<f32, u8>(&small),
            ),
        ];
        w.write_frames(&frames).await.unwrap();
        b_out.send((10, push(4))).unwrap();
        b_out
            .send_all_now(vec![(11, Message::Pull { block: 6, clock: 1, reply: elasticps_wire::Dtype::F32 })])
            .await
            .unwrap();
        let mut got = Vec::new();
        for _ in 0..5 {
            let (h, msg) = tokio::time::timeout(Duration::from_secs(10), a_in.next())
                .await
                .expect("waiting for 5 frames")
                .unwrap()
                .unwrap();
            got.push((h.request_id, msg));
        }
        assert!(matches!(&got[0], (7, Message::Push { block: 1, clock: 2, values }) if values.to_vec() == big));
        assert_eq!(got[1], (8, Message::Pull { block: 3, clock: 4, reply: elasticps_wire::Dtype::F32 }));
        assert!(matches!(&got[2], (9, Message::Init { block: 5, values }) if values.to_vec() == small));
        // The queued frame leaves before the direct one written after it.
        assert_eq!(got[3].0, 10);
        assert_eq!(got[4], (11, Message::Pull { block: 6, clock: 1, reply: elasticps_wire::Dtype::F32 }));
    }

    #[tokio::test]
    async fn a_header_survives_cancelled_polls_and_its_payload_lands_in_the_callers_buffer() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (raw, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let mut raw = raw.unwrap();
        let codec = Codec::new(b"", 64 << 20);
        let (mut reader, _out) = split(accepted.unwrap().0, codec.clone(), "a".into());
        let values = [1.5f32, -2.0, 3.25];
        let payload: &[u8] = bytemuck::cast_slice(&values);
        let head = codec.encode_header(&FrameHeader {
            kind: Kind::PullReply,
            request_id: 7,
            block: 2,
            clock: 5,
            payload_len: payload.len() as u32,
            flags: elasticps_wire::Flags::default(),
        });
        // Half a header, then a poll that another event cancels: nothing read is lost.
        raw.write_all(&head[..HEADER_LEN / 2]).await.unwrap();
        let cut =
            tokio::time::timeout(Duration::from_millis(50), std::future::poll_fn(|cx| reader.poll_header(cx))).await;
        assert!(cut.is_err(), "half a header is no header");
        raw.write_all(&head[HEADER_LEN / 2..]).await.unwrap();
        raw.write_all(payload).await.unwrap();
        let header = tokio::time::timeout(Duration::from_secs(10), std::future::poll_fn(|cx| reader.poll_header(cx)))
            .await
            .expect("the whole header was written")
            .unwrap()
            .expect("the connection is open");
        assert_eq!((header.kind, header.request_id, header.block, header.clock), (Kind::PullReply, 7, 2, 5));
        // A buffer of the wrong length is refused before a byte is read into it.
        let err = reader.payload_into(&header, &mut [0u8; 8]).await.unwrap_err();
        assert!(matches!(err, RuntimeError::Protocol { .. }), "{err:?}");
        let mut into = [0f32; 3];
        reader.payload_into(&header, bytemuck::cast_slice_mut(&mut into)).await.unwrap();
        assert_eq!(into, values);
        // The peer closes between frames: a clean end.
        drop(raw);
        let end = tokio::time::timeout(Duration::from_secs(10), std::future::poll_fn(|cx| reader.poll_header(cx)))
            .await
            .expect("the close is seen");
        assert!(matches!(end, Ok(None)), "{end:?}");
    }

    #[tokio::test]
    async fn a_cancelled_direct_write_breaks_the_connection() {
        let ((_a_in, _a_out), (_b_in, b_out)) = pair(None).await;
        // Far more than the socket buffers hold, and nobody reads: the write cannot finish.
        let huge = vec![0u8; 64 << 20];
        let w = b_out.writer();
        let head = w.tensor_header(Kind::Push, 1, 0, 0, huge.len(), Flags::default()).unwrap();
        let cut = tokio::time::timeout(Duration::from_millis(200), w.write_frame(&head, &huge)).await;
        assert!(cut.is_err(), "the write should still be blocked");
        let again = w.write_frame(&w.tensor_header(Kind::Pull, 2, 0, 0, 0, Default::default()).unwrap(), &[]).await;
        assert!(matches!(again, Err(RuntimeError::Closed(_))), "{again:?}");
    }

    #[tokio::test]
    async fn a_frame_over_the_limit_is_refused_before_writing() {
        let ((_a_in, _a_out), (_b_in, b_out)) = pair(None).await;
        let err = b_out.writer().tensor_header(Kind::Push, 1, 0, 0, (64 << 20) + 4, Flags::default()).unwrap_err();
        assert!(matches!(err, RuntimeError::Wire { source: WireError::TooLarge { .. }, .. }), "{err:?}");
    }

    #[tokio::test]
    async fn an_unshaped_connection_does_not_wait() {
        let ((mut a_in, _a_out), (_b_in, b_out)) = pair(None).await;
        let t = Instant::now();
        for _ in 0..4 {
            b_out.send((1, push(250_000))).unwrap();
        }
        for _ in 0..4 {
            a_in.next().await.unwrap().unwrap();
        }
        assert!(t.elapsed() < Duration::from_millis(300), "{:?}", t.elapsed());
    }
}
