//! [`Codec`]: header encode/decode with the cluster secret and the payload limit, and a
//! buffer-based frame decoder that keeps "incomplete" apart from "invalid".

use std::fmt;
use std::sync::Arc;

use bytes::{Buf, Bytes, BytesMut};
use zerocopy::little_endian::{U16, U32, U64};

use crate::error::WireError;
use crate::handshake::KeyId;
use crate::header::{
    CHECKSUM_OFFSET, DEFAULT_MAX_PAYLOAD, FORWARD_PREFIX, Flags, FrameHeader, HEADER_LEN, Kind, MAGIC, RawHeader,
    VERSION, checksum,
};
use crate::message::{Message, check_payload_len};

/// Encodes and validates frames for one cluster: holds the cluster secret (mixed into
/// every header checksum) and the payload limit. Cheap to clone (the secret is shared).
///
/// The checksum keeps out corrupt headers and frames of other clusters (a different
/// secret); it is not what authenticates a peer (CRC-32 is linear): the connection
/// handshake ([`crate::handshake`], HMAC-SHA256 keyed with the same secret) does that.
#[derive(Clone)]
pub struct Codec {
    secret: Arc<[u8]>,
    /// The key `secret` is (a dialer says it in the handshake).
    key: KeyId,
    /// An acceptor's worker secret (`--worker-secret`), if it takes workers that hold it.
    worker_secret: Option<Arc<[u8]>>,
    max_payload: u32,
}

impl Default for Codec {
    /// Empty secret, [`DEFAULT_MAX_PAYLOAD`].
    fn default() -> Self {
        Codec::new(&[], DEFAULT_MAX_PAYLOAD)
    }
}

impl fmt::Debug for Codec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print the secret.
        f.debug_struct("Codec")
            .field("secret_len", &self.secret.len())
            .field("key", &self.key)
            .field("worker_secret", &self.worker_secret.is_some())
            .field("max_payload", &self.max_payload)
            .finish()
    }
}

impl Codec {
    /// A codec with this cluster secret (may be empty) and payload limit in bytes.
    pub fn new(secret: &[u8], max_payload: u32) -> Self {
        Codec { secret: Arc::from(secret), key: KeyId::Cluster, worker_secret: None, max_payload }
    }

    /// A worker's codec that holds the worker secret (`--worker-secret`) instead of the
    /// cluster secret: it dials with [`KeyId::Worker`].
    pub fn for_worker_secret(worker_secret: &[u8], max_payload: u32) -> Self {
        Codec { key: KeyId::Worker, ..Codec::new(worker_secret, max_payload) }
    }

    /// The codec a worker dials with: the worker secret's when it holds one (not empty)
    /// and no cluster secret, else the cluster secret's.
    pub fn for_worker(secret: &[u8], worker_secret: Option<&[u8]>, max_payload: u32) -> Self {
        match worker_secret {
            Some(ws) if secret.is_empty() && !ws.is_empty() => Codec::for_worker_secret(ws, max_payload),
            _ => Codec::new(secret, max_payload),
        }
    }

    /// An acceptor's codec that also takes dialers of the worker secret.
    pub fn with_worker_secret(mut self, worker_secret: Option<&[u8]>) -> Self {
        self.worker_secret = worker_secret.map(Arc::from);
        self
    }

    /// The secret this codec dials with and checks frames with (the key of the handshake).
    pub fn secret(&self) -> &[u8] {
        &self.secret
    }

    /// Which key [`Codec::secret`] is.
    pub fn key(&self) -> KeyId {
        self.key
    }

    /// An acceptor's worker secret, if it has one.
    pub fn worker_secret(&self) -> Option<&[u8]> {
        self.worker_secret.as_deref()
    }

    /// The codec of one accepted connection whose dialer proved `key`: its frames are
    /// checked with that key's secret.
    pub fn for_key(&self, key: KeyId) -> Self {
        match (key, &self.worker_secret) {
            (KeyId::Worker, Some(ws)) => {
                Codec { secret: ws.clone(), key, worker_secret: None, max_payload: self.max_payload }
            }
            _ => Codec { worker_secret: None, ..self.clone() },
        }
    }

    /// The payload limit in bytes.
    pub fn max_payload(&self) -> u32 {
        self.max_payload
    }

    /// The 32 header bytes of `h`: magic, version, its flags, and the checksum over the
    /// rest with this codec's secret. Does not check the payload limit ([`Codec::encode`]
    /// does).
    pub fn encode_header(&self, h: &FrameHeader) -> [u8; HEADER_LEN] {
        let raw = RawHeader {
            magic: MAGIC,
            version: VERSION,
            kind: h.kind as u8,
            flags: U16::new(h.flags.bits()),
            request_id: U64::new(h.request_id),
            block: U32::new(h.block),
            clock: U32::new(h.clock),
            payload_len: U32::new(h.payload_len),
            checksum: U32::new(0),
        };
        let mut out: [u8; HEADER_LEN] = zerocopy::transmute!(raw);
        let sum = checksum(&out, &self.secret);
        out[CHECKSUM_OFFSET..].copy_from_slice(&sum.to_le_bytes());
        out
    }

    /// Validates 32 header bytes, in this order: magic, version, checksum (with this
    /// codec's secret), kind, flags, payload limit, and the payload-length rules of the
    /// kind (f32 kinds: a multiple of 4; PushAck and Pull: 0). Every check needs the header
    /// only, so an oversized or malformed frame is refused before its payload is read.
    ///
    /// After `Ok(h)` a reader may allocate `h.payload_len` bytes (at most the limit), or
    /// `h.f32_len()` f32 values for the f32 kinds, and read the payload into them.
    pub fn decode_header(&self, bytes: &[u8; HEADER_LEN]) -> Result<FrameHeader, WireError> {
        // Infallible: checked at compile time (same size, every bit pattern valid).
        let raw: RawHeader = zerocopy::transmute!(*bytes);
        if raw.magic != MAGIC {
            return Err(WireError::BadMagic { got: raw.magic });
        }
        if raw.version != VERSION {
            return Err(WireError::BadVersion { got: raw.version });
        }
        if raw.checksum.get() != checksum(bytes, &self.secret) {
            return Err(WireError::BadChecksum);
        }
        let kind = Kind::from_u8(raw.kind).ok_or(WireError::UnknownKind { got: raw.kind })?;
        let flags = Flags::parse(kind, raw.flags.get())?;
        let payload_len = raw.payload_len.get();
        if payload_len > self.max_payload {
            return Err(WireError::TooLarge { len: u64::from(payload_len), max: self.max_payload });
        }
        check_payload_len(kind, flags, payload_len)?;
        Ok(FrameHeader {
            kind,
            request_id: raw.request_id.get(),
            block: raw.block.get(),
            clock: raw.clock.get(),
            payload_len,
            flags,
        })
    }

    /// Takes one frame off the front of `buf`.
    ///
    /// - `Ok(None)`: incomplete, more bytes are needed; `buf` is untouched. Once the 32
    ///   header bytes are there, the header is validated first, so an invalid or
    ///   oversized frame is refused without waiting for its payload.
    /// - `Ok(Some((header, payload)))`: the frame is removed from `buf`; `payload` shares
    ///   `buf`'s memory (no copy). Decode it with [`Message::decode`].
    /// - `Err(_)`: the bytes are not a valid frame; the connection cannot be resynchronised
    ///   and should be closed (after an `Error` frame). `buf` is untouched.
    pub fn decode_frame(&self, buf: &mut BytesMut) -> Result<Option<(FrameHeader, Bytes)>, WireError> {
        let Some(head) = buf.first_chunk::<HEADER_LEN>() else {
            return Ok(None);
        };
        let h = self.decode_header(head)?;
        let total = HEADER_LEN + h.payload_len as usize;
        if buf.len() < total {
            return Ok(None);
        }
        buf.advance(HEADER_LEN);
        let payload = buf.split_to(h.payload_len as usize).freeze();
        Ok(Some((h, payload)))
    }

    /// [`Codec::decode_frame`] followed by [`Message::decode`]: the next message in `buf`,
    /// with its request id.
    pub fn decode_message(&self, buf: &mut BytesMut) -> Result<Option<(u64, Message)>, WireError> {
        match self.decode_frame(buf)? {
            None => Ok(None),
            Some((h, payload)) => Ok(Some((h.request_id, Message::decode(&h, payload)?))),
        }
    }

    /// The frame of `msg` as its 32 header bytes and its payload, to be written one after
    /// the other (vectored write; no concatenation). f32 payloads are the message's own
    /// shared bytes, not a copy. [`WireError::TooLarge`] if the payload exceeds this
    /// codec's limit.
    ///
    /// A Forward's (or PushRows') prefix and values are copied into one payload here; the data path uses
    /// [`Codec::encode_parts`] to write them apart.
    pub fn encode(&self, request_id: u64, msg: &Message) -> Result<([u8; HEADER_LEN], Bytes), WireError> {
        let (head, prefix, payload) = self.encode_parts(request_id, msg)?;
        Ok((head, crate::message::joined(prefix, payload)))
    }

    /// The frame of `msg` as its 32 header bytes, the bytes before its values (a
    /// Forward's or PushRows' 8-byte prefix, else `None`) and its values' own bytes (no
    /// copy, except a PushRows' ids and gradients, joined in one buffer), to be
    /// written one after the other. [`WireError::TooLarge`] if the payload exceeds this
    /// codec's limit.
    #[allow(clippy::type_complexity)]
    pub fn encode_parts(
        &self,
        request_id: u64,
        msg: &Message,
    ) -> Result<([u8; HEADER_LEN], Option<[u8; FORWARD_PREFIX]>, Bytes), WireError> {
        let (prefix, payload) = msg.payload_parts()?;
        let len = (payload.len() + prefix.map_or(0, |p| p.len())) as u64;
        if len > u64::from(self.max_payload) {
            return Err(WireError::TooLarge { len, max: self.max_payload });
        }
        let (block, clock) = msg.block_clock();
        let h = FrameHeader { kind: msg.kind(), request_id, block, clock, payload_len: len as u32, flags: msg.flags() };
        Ok((self.encode_header(&h), prefix, payload))
    }

    /// [`Codec::encode`] appended to `buf` (copies the payload; for tests and small
    /// messages — the data path writes header and payload separately).
    pub fn encode_to(&self, request_id: u64, msg: &Message, buf: &mut BytesMut) -> Result<(), WireError> {
        let (head, payload) = self.encode(request_id, msg)?;
        buf.reserve(HEADER_LEN + payload.len());
        buf.extend_from_slice(&head);
        buf.extend_from_slice(&payload);
        Ok(())
    }
}
