//! Framed I/O over a TCP connection: the only place that reads and writes frames.
//!
//! Reading takes the 32-byte header first, validates it (so an oversized length is
//! refused before a byte of payload is read), then reads a tensor payload straight into
//! an aligned `Vec<f32>`: no intermediate buffer, no per-element decoding. Large payload
//! buffers are recycled through a small process-wide pool ([`payload_buffer`]). Writing goes
//! through one task per connection that encodes, batches small frames in a buffer and
//! writes large payloads directly from their shared `Bytes`.

use std::net::SocketAddr;
use std::sync::Mutex;

use bytes::{Bytes, BytesMut};
use elasticps_wire::{Codec, FrameHeader, HEADER_LEN, Kind, Message, Values, WireError};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::mpsc;

use crate::error::{Result, RuntimeError};

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
            let mut v = payload_buffer(len / 4);
            self.inner.read_exact(bytemuck::cast_slice_mut(&mut v)).await.map_err(|e| self.io_err(e))?;
            pooled_values(v).into_bytes()
        } else {
            let mut b = BytesMut::zeroed(len);
            self.inner.read_exact(&mut b).await.map_err(|e| self.io_err(e))?;
            b.freeze()
        };
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
    let _ = stream.set_nodelay(true);
    let (r, w) = stream.into_split();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(write_loop(BufWriter::with_capacity(BUF, w), codec.clone(), rx, peer.clone()));
    (FrameReader { inner: BufReader::with_capacity(BUF, r), codec, peer, request_id: 0 }, tx)
}

/// Connects to `addr` and splits the stream, with a timeout naming what is connected.
pub async fn connect(addr: &str, codec: Codec, peer: String) -> Result<(FrameReader, Outbox)> {
    let stream = crate::timeout(crate::CONNECT_TIMEOUT, format!("connecting to {peer} at {addr}"), async {
        TcpStream::connect(addr).await.map_err(|e| RuntimeError::io(format!("connecting to {peer} at {addr}"), e))
    })
    .await?;
    Ok(split(stream, codec, peer))
}

async fn write_loop(
    mut w: BufWriter<OwnedWriteHalf>,
    codec: Codec,
    mut rx: mpsc::UnboundedReceiver<Outgoing>,
    peer: String,
) {
    while let Some(first) = rx.recv().await {
        let mut next = Some(first);
        while let Some((id, msg)) = next {
            if let Err(e) = write_one(&mut w, &codec, id, &msg).await {
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

async fn write_one(w: &mut BufWriter<OwnedWriteHalf>, codec: &Codec, id: u64, msg: &Message) -> std::io::Result<()> {
    let (head, payload): ([u8; HEADER_LEN], Bytes) =
        codec.encode(id, msg).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    w.write_all(&head).await?;
    w.write_all(&payload).await
}

/// A human name for a socket address, for logs.
pub fn addr_name(addr: Option<SocketAddr>) -> String {
    addr.map_or_else(|| "unknown peer".to_string(), |a| a.to_string())
}

/// Payload buffers of at least this many bytes are recycled; smaller ones are cheap to allocate.
const POOL_MIN_BYTES: usize = 64 * 1024;
/// At most this many buffers wait in the pool (a push of small blocks has many in flight)...
const POOL_MAX_BUFFERS: usize = 64;
/// ...holding at most this many bytes.
const POOL_MAX_BYTES: usize = 64 << 20;

/// Free payload buffers of this process, for [`payload_buffer`].
///
/// Why: a tensor payload used to be a fresh multi-MiB `Vec<f32>` per frame (read buffers,
/// and the client's copy of each pushed block). Allocated and freed on tokio's worker
/// threads, such buffers live in glibc's per-thread arenas, which hand the pages back to
/// the kernel when the top of the heap grows past the trim threshold and fault them in
/// again for the next payload: `elasticps bench transport` measured that at more than the
/// cost of moving the bytes over loopback TCP (4 x 4 MiB blocks: about 10 ms per round).
/// The pool keeps at most the buffers that were in use at once (bounded by
/// [`POOL_MAX_BUFFERS`] and [`POOL_MAX_BYTES`]), so peak memory does not grow.
static POOL: Mutex<Vec<Vec<f32>>> = Mutex::new(Vec::new());

fn pool() -> std::sync::MutexGuard<'static, Vec<Vec<f32>>> {
    POOL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A buffer of `len` f32 values for a payload, recycled when one is free. Its contents
/// are unspecified (zeros, or the values of an earlier payload): the caller overwrites all
/// of it. Wrap it with [`pooled_values`] so it comes back when the payload is dropped.
pub fn payload_buffer(len: usize) -> Vec<f32> {
    if len * 4 >= POOL_MIN_BYTES {
        let reused = {
            let mut free = pool();
            // The smallest free buffer that holds `len` values without reallocating.
            let best = free.iter().enumerate().filter(|(_, v)| v.capacity() >= len).min_by_key(|(_, v)| v.capacity());
            best.map(|(i, _)| i).map(|i| free.swap_remove(i))
        };
        if let Some(mut v) = reused {
            // Truncates, or zero-fills only the part beyond the buffer's current length.
            v.resize(len, 0.0);
            return v;
        }
    }
    vec![0.0; len]
}

/// The payload of `v` (no copy); a large buffer goes back to the pool when the last view
/// of the payload is dropped.
pub fn pooled_values(v: Vec<f32>) -> Values {
    if v.len() * 4 < POOL_MIN_BYTES {
        return Values::from_vec(v);
    }
    Values::from_le_bytes(Bytes::from_owner(Pooled(v))).expect("a Vec<f32> holds whole f32s")
}

/// Copies `s` into a recycled buffer (one memcpy): a pushed block.
pub fn copy_values(s: &[f32]) -> Values {
    let mut v = payload_buffer(s.len());
    v.copy_from_slice(s);
    pooled_values(v)
}

/// A payload buffer that goes back to the pool when dropped.
struct Pooled(Vec<f32>);

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.0);
        let mut free = pool();
        let held: usize = free.iter().map(|b| b.capacity() * 4).sum();
        if free.len() < POOL_MAX_BUFFERS && held + v.capacity() * 4 <= POOL_MAX_BYTES {
            free.push(v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_payload_buffers_are_recycled_with_the_right_length() {
        // Other tests of this binary may share the pool: look for this buffer by address.
        let n = 256 * 1024;
        let values = copy_values(&vec![1.5f32; n]);
        let ptr = values.as_bytes().as_ptr();
        assert_eq!(values.len(), n);
        assert!(values.to_f32s().iter().all(|v| *v == 1.5));
        let view = values.clone();
        drop(values);
        assert!(!pool().iter().any(|b| b.as_ptr() as *const u8 == ptr), "a view is still alive");
        drop(view);
        assert!(pool().iter().any(|b| b.as_ptr() as *const u8 == ptr), "back in the pool");
        // A smaller payload reuses it (truncated), a small one never comes from the pool.
        let again = payload_buffer(n / 2);
        assert_eq!(again.len(), n / 2);
        assert!(payload_buffer(16).len() == 16);
        drop(again);
        assert_eq!(copy_values(&[2.0; 8]).to_vec(), vec![2.0; 8]);
    }
}
