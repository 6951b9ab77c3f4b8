//! elasticps-wire: the elasticps wire protocol as pure functions over bytes, with no I/O.
//!
//! Every node (scheduler, server, worker) speaks length-prefixed binary frames over TCP.
//! The format is specified in `docs/PROTOCOL.md`; this crate is its reference
//! implementation. It does no I/O and has no async runtime, so it is fuzzable and every
//! side (the tokio runtime, tests, a simulator) uses the same code.
//!
//! Two layers, in the style of mini-redis:
//!
//! 1. **Frame** ([`header`], [`frame`]): 32 header bytes ([`RawHeader`], a zerocopy
//!    little-endian struct; typed as [`FrameHeader`]) followed by `payload_len` payload
//!    bytes. [`Codec`] holds the cluster secret (mixed into the header checksum) and the
//!    payload limit. [`Codec::decode_header`] validates a header on its own, before the
//!    payload is read; [`Codec::decode_frame`] takes a whole frame off a `BytesMut`, and
//!    keeps "incomplete" (`Ok(None)`, buffer untouched) apart from "invalid" (`Err`).
//! 2. **Message** ([`message`], [`control`], [`values`]): [`Message::decode`] turns a
//!    validated header and its payload into a typed [`Message`]; [`Codec::encode`] turns a
//!    message into its header bytes and payload [`Bytes`](bytes::Bytes). Tensor payloads
//!    are raw little-endian f32 held in [`Values`], shared without copying from and to
//!    `Vec<f32>` and `Arc<Vec<f32>>`; control messages are postcard-encoded serde enums.
//!
//! The runtime reads a frame like this:
//!
//! ```
//! # use elasticps_wire::*;
//! # fn read_exact(buf: &mut [u8], src: &mut &[u8]) { let (a, b) = src.split_at(buf.len()); buf.copy_from_slice(a); *src = b; }
//! let codec = Codec::new(b"cluster secret", DEFAULT_MAX_PAYLOAD);
//! let (head, payload) = codec
//!     .encode(7, &Message::Push { block: 3, clock: 1, values: Values::from_vec(vec![0.5; 4]) })
//!     .unwrap();
//! let mut socket: &[u8] = &[&head[..], &payload[..]].concat();
//!
//! let mut head = [0u8; HEADER_LEN];
//! read_exact(&mut head, &mut socket);
//! let h = codec.decode_header(&head).unwrap(); // refuses bad/oversized frames here
//! let payload = if h.kind.carries_f32() {
//!     let mut v = vec![0f32; h.f32_len()]; // aligned, read in place
//!     read_exact(bytemuck::cast_slice_mut(&mut v), &mut socket);
//!     Values::from_vec(v).into_bytes()
//! } else {
//!     let mut v = vec![0u8; h.payload_len as usize];
//!     read_exact(&mut v, &mut socket);
//!     v.into()
//! };
//! let msg = Message::decode(&h, payload).unwrap();
//! assert_eq!((h.request_id, msg.kind()), (7, Kind::Push));
//! ```
//!
//! On any [`WireError`] the receiver sends `Message::Error(err.to_reply())` if it can and
//! closes that connection; it keeps serving everyone else.

#![warn(missing_docs)]

pub mod control;
pub mod credential;
pub mod error;
pub mod frame;
pub mod handshake;
pub mod header;
pub mod message;
pub mod values;

pub use control::{
    Assignment, CheckpointEntry, CheckpointPlan, ClusterStatus, Control, HeldBlock, HostOffer, Injection, Layout,
    MigrationReport, NodeRole, Restore, RowBlockLoad, ScaleRequest, ServerAddr, ServerLoad, ServerSample, ServerStats,
    ServerStatus, WorkerLoad, WorkerStatus,
};
pub use credential::{Credential, PeerRole};
/// The dtype of a payload's values (f32, bf16, fp16), defined with its conversions in `elasticps_core`.
pub use elasticps_core::dtype::Dtype;
pub use error::{ErrorCode, ErrorReply, WireError};
pub use frame::Codec;
pub use handshake::KeyId;
pub use header::{
    CHECKSUM_OFFSET, DEFAULT_MAX_PAYLOAD, FORWARD_PREFIX, Flags, FrameHeader, HEADER_LEN, Kind, MAGIC, RawHeader,
    VERSION, checksum,
};
pub use message::{Message, PUSH_ROWS_PREFIX};
pub use values::{Decoded, RowIds, Values};
