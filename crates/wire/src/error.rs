//! Everything a decoder can refuse ([`WireError`]) and the codes a node sends back
//! ([`ErrorCode`]) before it closes a connection.

use std::fmt;

use serde::{Deserialize, Serialize};

use elasticps_core::dtype::Dtype;

use crate::header::Kind;

/// Why a frame or message was refused.
///
/// Every variant is a protocol violation by the peer (or a local attempt to send a
/// frame that breaks a limit): the receiver answers with an `Error` frame carrying
/// [`WireError::code`] if it can, then closes that one connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The first four bytes are not `EPS1`: not an elasticps peer at all.
    #[error("bad magic {got:02x?}: not an elasticps frame (expected \"EPS1\")")]
    BadMagic {
        /// The four bytes that arrived.
        got: [u8; 4],
    },
    /// A protocol version this node does not speak.
    #[error("unsupported protocol version {got} (this node speaks version {})", crate::VERSION)]
    BadVersion {
        /// The version byte that arrived.
        got: u8,
    },
    /// A frame kind outside 1..=6.
    #[error("unknown frame kind {got}")]
    UnknownKind {
        /// The kind byte that arrived.
        got: u8,
    },
    /// Flags a frame of its kind cannot carry: a reserved bit, dtype code 3, a reply
    /// dtype on a frame that asks for no values, a sparse bit on a frame that is not a
    /// gradient (docs/PROTOCOL.md §3).
    #[error(
        "flags {got:#06x} are not valid for this kind of frame (bits 0-1: the values' dtype, 2-3: the reply's, 4: sparse)"
    )]
    BadFlags {
        /// The flags that arrived.
        got: u16,
    },
    /// A payload longer than the receiver's (or, when encoding, the sender's) limit.
    #[error("payload of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// The payload length (u64: an encoder may be handed more than 4 GiB).
        len: u64,
        /// The limit.
        max: u32,
    },
    /// The header checksum does not match: wrong cluster secret or a corrupt header.
    #[error("header checksum mismatch: wrong cluster secret or corrupt header")]
    BadChecksum,
    /// A payload that does not fit its kind (wrong length, trailing bytes, ...).
    #[error("bad {kind} payload: {why}")]
    BadPayload {
        /// The frame kind.
        kind: Kind,
        /// What is wrong with it.
        why: String,
    },
    /// A byte buffer whose length is not a multiple of its dtype's width cannot hold
    /// values of that dtype.
    #[error("{len} bytes are not a whole number of {dtype} values")]
    NotF32 {
        /// The buffer length in bytes.
        len: usize,
        /// The dtype the frame's flags announce.
        dtype: Dtype,
    },
    /// A sparse payload whose count, positions and values do not add up.
    #[error("bad sparse payload: {why}")]
    BadSparse {
        /// What is wrong.
        why: String,
    },
    /// A Control or Error payload that postcard could not decode (or encode).
    #[error("postcard: {0}")]
    Postcard(String),
    /// A new connection did not start with the handshake (`frame`: it sent a frame, as a
    /// node of an older version or a client that skips it would).
    #[error("{}", if *frame { "the peer sent a frame before the handshake".to_string() } else { format!("the peer did not start with the handshake (first bytes {got:02x?}): not an elasticps node") })]
    NoHandshake {
        /// The four bytes that arrived.
        got: [u8; 4],
        /// Whether they were a frame's magic.
        frame: bool,
    },
    /// The handshake's proof does not hold: the two ends hold different cluster secrets
    /// (`refused_by_peer`: the peer refused this node's proof).
    #[error("{}", if *refused_by_peer { "the peer refused the handshake: its cluster secret differs from this node's (--secret)" } else { "the peer failed the handshake: it does not hold this node's cluster secret (--secret)" })]
    Unauthenticated {
        /// Whether the peer refused this side (else this side refused the peer).
        refused_by_peer: bool,
    },
    /// A handshake message that makes no sense.
    #[error("bad handshake: {0}")]
    BadHandshake(String),
    /// A credential that does not hold: not made with this cluster's secret, or of
    /// another job ([`crate::credential`]).
    #[error("bad credential: {0}")]
    BadCredential(String),
    /// A frame refused from its header because the connection has not said who it is yet
    /// (no `Hello` taken by a server, no registration with the scheduler): until then a
    /// connection may send only control frames of at most `max` payload bytes
    /// (docs/PROTOCOL.md §2, check 8).
    #[error("{}", if *kind == Kind::Control || *kind == Kind::Error {
        format!("a {kind:?} frame of {len} bytes before this connection said who it is (a server's Hello, a registration with the scheduler): at most {max} bytes until then")
    } else {
        format!("a {kind:?} frame before this connection said who it is (a server's Hello, a registration with the scheduler): only control frames until then")
    })]
    Unidentified {
        /// The frame's kind.
        kind: Kind,
        /// Its payload length.
        len: u32,
        /// The most a control frame may carry until then.
        max: u32,
    },
}

impl WireError {
    /// The code to send back in an `Error` frame before closing the connection.
    pub fn code(&self) -> ErrorCode {
        match self {
            WireError::BadMagic { .. } => ErrorCode::Malformed,
            WireError::BadVersion { .. } => ErrorCode::BadVersion,
            WireError::UnknownKind { .. } => ErrorCode::UnknownKind,
            WireError::BadFlags { .. } => ErrorCode::Malformed,
            WireError::TooLarge { .. } => ErrorCode::TooLarge,
            WireError::BadChecksum => ErrorCode::BadChecksum,
            WireError::BadPayload { .. }
            | WireError::NotF32 { .. }
            | WireError::BadSparse { .. }
            | WireError::Postcard(_) => ErrorCode::Malformed,
            WireError::NoHandshake { .. } | WireError::BadHandshake(_) => ErrorCode::Malformed,
            WireError::Unauthenticated { .. } | WireError::BadCredential(_) => ErrorCode::Unauthenticated,
            WireError::Unidentified { kind: Kind::Control | Kind::Error, .. } => ErrorCode::TooLarge,
            WireError::Unidentified { .. } => ErrorCode::Forbidden,
        }
    }

    /// The `Error` message body to send back: [`WireError::code`] and this error's text.
    pub fn to_reply(&self) -> ErrorReply {
        ErrorReply { code: self.code(), message: self.to_string() }
    }
}

impl From<postcard::Error> for WireError {
    fn from(e: postcard::Error) -> Self {
        WireError::Postcard(e.to_string())
    }
}

/// Machine-readable reason carried by an `Error` frame.
///
/// postcard encodes it as its variant index (a one-byte varint): the order of the
/// variants is part of the protocol; new codes are only ever appended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ErrorCode {
    /// 0: a frame or payload that does not parse (bad magic, flags, payload).
    Malformed,
    /// 1: a protocol version the receiver does not speak.
    BadVersion,
    /// 2: a frame kind the receiver does not know.
    UnknownKind,
    /// 3: a payload above the receiver's limit.
    TooLarge,
    /// 4: wrong cluster secret or corrupt header.
    BadChecksum,
    /// 5: a push or pull for a block the model does not have.
    UnknownBlock,
    /// 6: a well-formed message that makes no sense here (wrong length, wrong
    /// conversation step, clock gap, ...).
    BadRequest,
    /// 7: the receiver cannot answer yet (no model defined, blocks not assigned).
    NotReady,
    /// 8: the receiver is shutting down.
    ShuttingDown,
    /// 9: a bug or resource failure on the receiver's side.
    Internal,
    /// 10: the peer did not prove it holds the cluster secret, or presented a credential
    /// that does not hold.
    Unauthenticated,
    /// 11: the connection's proven identity may not send this message (docs/PROTOCOL.md
    /// §7.1, who may send what); nothing changed.
    Forbidden,
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ErrorCode::Malformed => "malformed",
            ErrorCode::BadVersion => "bad version",
            ErrorCode::UnknownKind => "unknown kind",
            ErrorCode::TooLarge => "too large",
            ErrorCode::BadChecksum => "bad checksum",
            ErrorCode::UnknownBlock => "unknown block",
            ErrorCode::BadRequest => "bad request",
            ErrorCode::NotReady => "not ready",
            ErrorCode::ShuttingDown => "shutting down",
            ErrorCode::Internal => "internal",
            ErrorCode::Unauthenticated => "unauthenticated",
            ErrorCode::Forbidden => "forbidden",
        })
    }
}

/// Body of an `Error` frame (postcard: code index, then the message as a string).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorReply {
    /// What went wrong, for programs.
    pub code: ErrorCode,
    /// What went wrong, for people.
    pub message: String,
}

impl ErrorReply {
    /// An error reply with this code and message.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self { code, message: message.into() }
    }
}

impl fmt::Display for ErrorReply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

impl std::error::Error for ErrorReply {}
