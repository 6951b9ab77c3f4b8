//! The fixed 32-byte frame header: its byte layout ([`RawHeader`], a zerocopy struct) and
//! its typed form ([`FrameHeader`]).
//!
//! | off | size | field       | rule |
//! |----:|-----:|-------------|------|
//! | 0   | 4    | magic       | `b"EPS1"` |
//! | 4   | 1    | version     | [`VERSION`] |
//! | 5   | 1    | kind        | [`Kind`] as u8 |
//! | 6   | 2    | flags       | [`Flags`]: the values' dtype, the reply's dtype, sparse |
//! | 8   | 8    | request_id  | chosen by the requester, echoed in the reply |
//! | 16  | 4    | block       | block id (0 for Control/Error) |
//! | 20  | 4    | clock       | iteration clock (0 for Control/Error) |
//! | 24  | 4    | payload_len | bytes after the header |
//! | 28  | 4    | checksum    | CRC-32 (IEEE) of bytes 0..28 followed by the cluster secret |
//!
//! All integers are little-endian.

use std::fmt;

use elasticps_core::dtype::Dtype;
use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// Length of the frame header in bytes.
pub const HEADER_LEN: usize = 32;
/// The protocol version this crate speaks (header byte 4).
pub const VERSION: u8 = 5;
/// The four magic bytes that open every frame: `EPS1`.
pub const MAGIC: [u8; 4] = *b"EPS1";
/// Default limit on `payload_len`: 64 MiB.
pub const DEFAULT_MAX_PAYLOAD: u32 = 64 << 20;
/// Bytes before the gradient in a Forward payload: the worker's rank (u32) and the init
/// flag (u32, 0 or 1), little-endian.
pub const FORWARD_PREFIX: usize = 8;
/// Byte offset of the checksum field; the checksum covers the bytes before it.
pub const CHECKSUM_OFFSET: usize = 28;

/// What a frame carries (header byte 5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Kind {
    /// A postcard-encoded [`Control`](crate::Control) message.
    Control = 1,
    /// Worker -> server: a gradient for `block` at `clock`, f32 little-endian payload.
    Push = 2,
    /// Server -> worker: the push with this request id was applied; empty payload.
    PushAck = 3,
    /// Worker -> server: the values of `block` for iteration `clock`; empty payload.
    Pull = 4,
    /// Server -> worker: the values of `block`, f32 little-endian payload.
    PullReply = 5,
    /// A postcard-encoded [`ErrorReply`](crate::ErrorReply).
    Error = 6,
    /// Worker -> server: the initial values of `block` (the first worker's parameters),
    /// f32 little-endian payload; answered `PushAck`.
    Init = 7,
    /// Worker -> server: the gradient of `block` at `clock` and the pull of `clock + 1`
    /// in one request, f32 little-endian payload; answered `PullReply` of `clock + 1`.
    PushPull = 8,
    /// Primary -> backup server: a push (or init) of `block` at `clock` forwarded as it
    /// was received: an 8-byte prefix (the worker's rank, the init flag) then the f32
    /// little-endian gradient; answered `Ok` (docs/PROTOCOL.md §12).
    Forward = 9,
    /// Worker -> server: rows of the row block `block` for iteration `clock`; payload the
    /// row ids, u64 little-endian (global row ids of the table). Answered
    /// `PullRowsReply` (the sync policy may hold it, as a `Pull`'s).
    PullRows = 10,
    /// Server -> worker: the rows a `PullRows` asked for, in the order asked, `ids x dim`
    /// f32 little-endian.
    PullRowsReply = 11,
    /// Worker -> server: the gradient of some rows of the row block `block` at `clock`:
    /// `count` u32, `dim` u32, `count` u64 row ids, then `count x dim` f32, all
    /// little-endian; an empty one (count 0) still counts for the clock. Answered
    /// `PushAck`.
    PushRows = 12,
}

impl Kind {
    /// Every kind, in wire order.
    pub const ALL: [Kind; 12] = [
        Kind::Control,
        Kind::Push,
        Kind::PushAck,
        Kind::Pull,
        Kind::PullReply,
        Kind::Error,
        Kind::Init,
        Kind::PushPull,
        Kind::Forward,
        Kind::PullRows,
        Kind::PullRowsReply,
        Kind::PushRows,
    ];

    /// The kind with this wire value, if any.
    pub fn from_u8(v: u8) -> Option<Kind> {
        match v {
            1 => Some(Kind::Control),
            2 => Some(Kind::Push),
            3 => Some(Kind::PushAck),
            4 => Some(Kind::Pull),
            5 => Some(Kind::PullReply),
            6 => Some(Kind::Error),
            7 => Some(Kind::Init),
            8 => Some(Kind::PushPull),
            9 => Some(Kind::Forward),
            10 => Some(Kind::PullRows),
            11 => Some(Kind::PullRowsReply),
            12 => Some(Kind::PushRows),
            _ => None,
        }
    }

    /// True for the kinds whose payload is a run of little-endian f32 (Push, PullReply,
    /// Init, PushPull, PullRowsReply).
    pub fn carries_f32(self) -> bool {
        matches!(self, Kind::Push | Kind::PullReply | Kind::Init | Kind::PushPull | Kind::PullRowsReply)
    }

    /// True for the kinds whose payload is whole 4-byte words (the f32 kinds; Forward: its
    /// 8-byte prefix, then f32 values; PullRows: u64 ids; PushRows: its 8-byte prefix, u64
    /// ids, f32 values), so a reader may read it into an aligned `Vec<f32>` and keep the
    /// values aligned.
    pub fn carries_words(self) -> bool {
        self.carries_f32() || matches!(self, Kind::Forward | Kind::PullRows | Kind::PushRows)
    }

    /// True for the kinds whose payload must be empty (PushAck, Pull).
    pub fn is_empty_payload(self) -> bool {
        matches!(self, Kind::PushAck | Kind::Pull)
    }

    /// True for the kinds whose payload is postcard (Control, Error).
    pub fn is_postcard(self) -> bool {
        matches!(self, Kind::Control | Kind::Error)
    }
}

impl From<Kind> for u8 {
    fn from(k: Kind) -> u8 {
        k as u8
    }
}

impl TryFrom<u8> for Kind {
    type Error = crate::WireError;

    fn try_from(v: u8) -> Result<Self, crate::WireError> {
        Kind::from_u8(v).ok_or(crate::WireError::UnknownKind { got: v })
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::Control => "Control",
            Kind::Push => "Push",
            Kind::PushAck => "PushAck",
            Kind::Pull => "Pull",
            Kind::PullReply => "PullReply",
            Kind::Error => "Error",
            Kind::Init => "Init",
            Kind::PushPull => "PushPull",
            Kind::Forward => "Forward",
            Kind::PullRows => "PullRows",
            Kind::PullRowsReply => "PullRowsReply",
            Kind::PushRows => "PushRows",
        })
    }
}

/// A frame's flags (header bytes 6-7, little-endian u16):
///
/// | bits | field | on |
/// |------|-------|----|
/// | 0-1  | `dtype`: the payload values' [`Dtype`] code (0 f32, 1 bf16, 2 fp16) | Push, PullReply, Init, PushPull, Forward, PullRowsReply, PushRows |
/// | 2-3  | `reply`: the dtype the reply's values should travel in | Pull, PushPull, PullRows |
/// | 4    | `sparse`: the payload is a sparse gradient (count, positions, values) | Push, PushPull, Forward |
/// | 5-15 | reserved, 0 | |
///
/// A field a kind does not carry must be 0 (f32, not sparse).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Flags {
    /// The dtype of the payload's values.
    pub dtype: Dtype,
    /// The dtype the requester wants the reply's values in.
    pub reply: Dtype,
    /// The payload is a sparse gradient.
    pub sparse: bool,
}

impl Flags {
    const SPARSE: u16 = 1 << 4;

    /// The u16 on the wire.
    pub fn bits(self) -> u16 {
        self.dtype.code() | (self.reply.code() << 2) | if self.sparse { Flags::SPARSE } else { 0 }
    }

    /// The flags of a `kind` frame, checked: [`WireError::BadFlags`](crate::WireError::BadFlags)
    /// for a reserved bit, an unknown dtype code, or a field the kind does not carry.
    pub fn parse(kind: Kind, bits: u16) -> Result<Flags, crate::WireError> {
        let bad = crate::WireError::BadFlags { got: bits };
        let dtype = Dtype::from_code(bits & 3).ok_or(bad.clone())?;
        let reply = Dtype::from_code((bits >> 2) & 3).ok_or(bad.clone())?;
        let sparse = bits & Flags::SPARSE != 0;
        let carries_values = kind.carries_f32() || matches!(kind, Kind::Forward | Kind::PushRows);
        let asks_values = matches!(kind, Kind::Pull | Kind::PushPull | Kind::PullRows);
        let gradient = matches!(kind, Kind::Push | Kind::PushPull | Kind::Forward);
        if bits >> 5 != 0
            || (dtype != Dtype::F32 && !carries_values)
            || (reply != Dtype::F32 && !asks_values)
            || (sparse && !gradient)
        {
            return Err(bad);
        }
        Ok(Flags { dtype, reply, sparse })
    }
}

/// A validated frame header: the fields a receiver acts on.
///
/// Magic, version and checksum are not kept: [`Codec`](crate::Codec) writes and checks
/// them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FrameHeader {
    /// What the payload is.
    pub kind: Kind,
    /// Chosen by the requester, echoed in the reply.
    pub request_id: u64,
    /// Block id (0 for Control and Error frames).
    pub block: u32,
    /// Iteration clock (0 for Control and Error frames).
    pub clock: u32,
    /// Number of payload bytes that follow the header.
    pub payload_len: u32,
    /// The payload's dtype, the reply's dtype, sparse.
    pub flags: Flags,
}

impl FrameHeader {
    /// Number of f32 values the payload holds (meaningful for the f32 kinds, whose
    /// `payload_len` [`Codec::decode_header`](crate::Codec::decode_header) has checked to
    /// be a multiple of 4), so a reader can allocate a `Vec<f32>` of that length and read
    /// the payload straight into it.
    pub fn f32_len(&self) -> usize {
        self.payload_len as usize / 4
    }
}

/// The exact byte layout of the header, little-endian, without padding
/// (`size_of::<RawHeader>() == HEADER_LEN`), read and written with zerocopy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct RawHeader {
    /// `b"EPS1"`.
    pub magic: [u8; 4],
    /// Protocol version.
    pub version: u8,
    /// Frame kind as u8.
    pub kind: u8,
    /// [`Flags::bits`].
    pub flags: U16,
    /// Request id.
    pub request_id: U64,
    /// Block id.
    pub block: U32,
    /// Iteration clock.
    pub clock: U32,
    /// Payload length in bytes.
    pub payload_len: U32,
    /// CRC-32 of bytes `0..28` followed by the cluster secret.
    pub checksum: U32,
}

const _: () = assert!(size_of::<RawHeader>() == HEADER_LEN);
const _: () = assert!(std::mem::offset_of!(RawHeader, checksum) == CHECKSUM_OFFSET);

/// CRC-32 (IEEE, as `crc32fast`, zlib and most `crc32` functions compute it) of the first
/// 28 header bytes followed by `secret`.
pub fn checksum(header: &[u8; HEADER_LEN], secret: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&header[..CHECKSUM_OFFSET]);
    h.update(secret);
    h.finalize()
}
