//! Framed I/O over a TCP connection: the only place that reads and writes frames.
//!
//! Reading takes the 32-byte header first, validates it (so an oversized length is
//! refused before a byte of payload is read), then reads a tensor payload straight into
//! an aligned `Vec<f32>`: no intermediate buffer, no per-element decoding. Large payload
//! buffers are recycled through a small process-wide pool ([`crate::pool`]). Writing goes
//! through one task per connection that encodes, batches small frames in a buffer and
//! writes large payloads directly from their shared `Bytes`.
//!
//! A connection split with a [`Shaper`] ([`split_shaped`]) passes every frame through
//! the server's bandwidth buckets: after reading it, and before writing it.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use elasticps_wire::{Codec, FrameHeader, HEADER_LEN, Kind, Message, WireError};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::mpsc;

use crate::error::{Result, RuntimeError};
use crate::pool;
use crate::shaping::Shaper;

/// A frame to send: request id and message.
pub type Outgoing = (u64, Message);

/// Sender side of a connection's writer task.
pub type Outbox = mpsc::UnboundedSender<Outgoing>;

const BUF: usize = 256 * 1024;

/// Reads frames from one connection.
pub struct FrameReader {
    inner: BufReader<OwnedReadHalf>,
    codec: Codec,
    peer: String,
    request_id: u64,
    shaper: Option<Arc<Shaper>>,
}

impl FrameReader {
    /// Name of the peer, for errors and logs.
    pub fn peer(&self) -> &str {
        &self.peer
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

    /// The next frame, or `None` when the peer closed the connection between frames.
    pub async fn next(&mut self) -> Result<Option<(FrameHeader, Message)>> {
        self.request_id = 0;
        let mut head = [0u8; HEADER_LEN];
        // A clean end of stream is only allowed before the first header byte.
        let first = self.inner.read(&mut head[..1]).await.map_err(|e| self.io_err(e))?;
        if first == 0 {
            return Ok(None);
        }
        self.inner.read_exact(&mut head[1..]).await.map_err(|e| self.io_err(e))?;
        let header = match self.codec.decode_header(&head) {
            Ok(h) => h,
            Err(source) => {
                if !matches!(source, WireError::BadMagic { .. } | WireError::BadVersion { .. } | WireError::BadChecksum)
                {
                    self.request_id = u64::from_le_bytes(head[8..16].try_into().unwrap_or_default());
                }
                return Err(self.wire_err(source));
            }
        };
        self.request_id = header.request_id;
        let len = header.payload_len as usize;
        let payload = if matches!(header.kind, Kind::Push | Kind::PullReply) && len.is_multiple_of(4) {
            let mut v = pool::payload_buffer(len / 4);
            self.inner.read_exact(bytemuck::cast_slice_mut(&mut v)).await.map_err(|e| self.io_err(e))?;
            pool::pooled_values(v).into_bytes()
        } else {
            let mut b = BytesMut::zeroed(len);
            self.inner.read_exact(&mut b).await.map_err(|e| self.io_err(e))?;
            b.freeze()
        };
        if let Some(shaper) = &self.shaper {
            shaper.take_in(HEADER_LEN + len).await;
        }
        let msg = Message::decode(&header, payload).map_err(|source| self.wire_err(source))?;
        Ok(Some((header, msg)))
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

/// Splits a connected stream into a frame reader and the outbox of a new writer task.
/// The writer task ends when every outbox clone is dropped or the socket fails.
pub fn split(stream: TcpStream, codec: Codec, peer: String) -> (FrameReader, Outbox) {
    split_shaped(stream, codec, peer, None)
}

/// [`split`], with every frame read or written passing through `shaper`'s bandwidth
/// buckets (a server's injected bandwidth cap). `None` costs nothing.
pub fn split_shaped(
    stream: TcpStream,
    codec: Codec,
    peer: String,
    shaper: Option<Arc<Shaper>>,
) -> (FrameReader, Outbox) {
    let _ = stream.set_nodelay(true);
    let (r, w) = stream.into_split();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(write_loop(BufWriter::with_capacity(BUF, w), codec.clone(), rx, peer.clone(), shaper.clone()));
    (FrameReader { inner: BufReader::with_capacity(BUF, r), codec, peer, request_id: 0, shaper }, tx)
}

/// Connects to `addr` and splits the stream, with a timeout naming what is connected.
pub async fn connect(addr: &str, codec: Codec, peer: String) -> Result<(FrameReader, Outbox)> {
    let stream = dial(addr, &codec, &peer).await?;
    Ok(split(stream, codec, peer))
}

/// A TCP connection to `addr` that passed the handshake ([`crate::handshake::dial`]).
pub async fn dial(addr: &str, codec: &Codec, peer: &str) -> Result<TcpStream> {
    let what = format!("connecting to {peer} at {addr}");
    let mut stream = crate::timeout(crate::CONNECT_TIMEOUT, what.clone(), async {
        TcpStream::connect(addr).await.map_err(|e| RuntimeError::io(what.clone(), e))
    })
    .await?;
    crate::handshake::dial(&mut stream, codec.secret(), &format!("{peer} at {addr}")).await?;
    Ok(stream)
}

async fn write_loop(
    mut w: BufWriter<OwnedWriteHalf>,
    codec: Codec,
    mut rx: mpsc::UnboundedReceiver<Outgoing>,
    peer: String,
    shaper: Option<Arc<Shaper>>,
) {
    while let Some(first) = rx.recv().await {
        let mut next = Some(first);
        while let Some((id, msg)) = next {
            if let Err(e) = write_one(&mut w, &codec, id, &msg, shaper.as_deref()).await {
                tracing::debug!(peer = %peer, error = %e, "writer stops");
                return;
            }
            next = rx.try_recv().ok();
        }
        if let Err(e) = w.flush().await {
            tracing::debug!(peer = %peer, error = %e, "writer stops");
            return;
        }
    }
    let _ = w.shutdown().await;
}

async fn write_one(
    w: &mut BufWriter<OwnedWriteHalf>,
    codec: &Codec,
    id: u64,
    msg: &Message,
    shaper: Option<&Shaper>,
) -> std::io::Result<()> {
    let (head, payload): ([u8; HEADER_LEN], Bytes) =
        codec.encode(id, msg).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    if let Some(shaper) = shaper {
        let wait = shaper.reserve_out(HEADER_LEN + payload.len());
        if !wait.is_zero() {
            // The frames batched so far were already paid for: send them before waiting.
            w.flush().await?;
            shaper.wait(wait).await;
        }
    }
    w.write_all(&head).await?;
    w.write_all(&payload).await
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
