//! [`Message`]: a frame's typed meaning, and the payload rules of every kind.

use bytes::Bytes;

use crate::control::Control;
use crate::error::{ErrorReply, WireError};
use elasticps_core::dtype::Dtype;

use crate::header::{FORWARD_PREFIX, Flags, FrameHeader, Kind};
use crate::values::{RowIds, Values};

/// Bytes before the row ids of a PushRows payload: the row count (u32) and the values
/// per row (u32), little-endian.
pub const PUSH_ROWS_PREFIX: usize = 8;

/// One typed message: what a frame (header + payload) means.
///
/// | kind      | block, clock | payload |
/// |-----------|--------------|---------|
/// | Control   | 0, 0         | postcard [`Control`] |
/// | Push      | set          | f32 little-endian, `len % 4 == 0` |
/// | PushAck   | set          | empty |
/// | Pull      | set          | empty |
/// | PullReply | set          | f32 little-endian, `len % 4 == 0` |
/// | Error     | 0, 0         | postcard [`ErrorReply`] |
/// | Init      | block, 0     | f32 little-endian, `len % 4 == 0` |
/// | PushPull  | set          | f32 little-endian, `len % 4 == 0` |
/// | Forward   | set          | worker u32, init u32 (0/1), then f32 little-endian |
/// | PullRows  | set          | row ids, u64 little-endian, `len % 8 == 0` |
/// | PullRowsReply | set      | f32 little-endian, the rows in the order asked |
/// | PushRows  | set          | count u32, dim u32, count u64 ids, count x dim f32 |
#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    /// A control-plane message.
    Control(Control),
    /// Worker -> server: the gradient of `block` computed at iteration `clock`.
    Push {
        /// Block id.
        block: u32,
        /// The worker's iteration.
        clock: u32,
        /// The gradient.
        values: Values,
    },
    /// Server -> worker: the push of `block` at `clock` was applied (or was a duplicate).
    PushAck {
        /// Block id.
        block: u32,
        /// The pushed clock.
        clock: u32,
    },
    /// Worker -> server: the values of `block` for iteration `clock`; the server's sync
    /// policy may hold the reply (DESIGN.md §3).
    Pull {
        /// Block id.
        block: u32,
        /// The worker's iteration.
        clock: u32,
        /// The dtype the reply's values travel in (flags bits 2-3).
        reply: Dtype,
    },
    /// Server -> worker: the values of `block` answering a pull at `clock`.
    PullReply {
        /// Block id.
        block: u32,
        /// The clock of the pull this answers.
        clock: u32,
        /// The block's values.
        values: Values,
    },
    /// A refusal; the sender usually closes the connection after it.
    Error(ErrorReply),
    /// Worker -> server: the initial values of `block` (the first worker's parameters,
    /// broadcast through the servers), before any push. Answered `PushAck` with clock 0.
    Init {
        /// Block id.
        block: u32,
        /// The values.
        values: Values,
    },
    /// Worker -> server: the gradient of `block` computed at iteration `clock` and the
    /// pull of `clock + 1`, in one round trip. Answered by the `PullReply` of `clock + 1`
    /// (which also acknowledges the push; the sync policy may hold it, as a `Pull`'s),
    /// `Moved`, or an `Error` (docs/PROTOCOL.md §6.4).
    PushPull {
        /// Block id.
        block: u32,
        /// The clock of the gradient (the pull is of `clock + 1`).
        clock: u32,
        /// The gradient.
        values: Values,
        /// The dtype the reply's values travel in (flags bits 2-3).
        reply: Dtype,
    },
    /// Primary -> backup server: a push (`init` false) or an init (`init` true, `clock`
    /// 0) of `block` that worker `worker` sent the primary, forwarded as it came: the
    /// gradient is the bytes the primary received, not a copy. Answered `Ok` once the
    /// backup's copy applied it (a duplicate too) (docs/PROTOCOL.md §12).
    Forward {
        /// Block id.
        block: u32,
        /// The push's clock (0 for an init).
        clock: u32,
        /// The worker that sent the push to the primary.
        worker: u32,
        /// An init (the block's initial values) rather than a gradient.
        init: bool,
        /// The gradient (or initial values).
        values: Values,
    },
    /// Worker -> server: rows `ids` (global row ids of the block's table, each in the
    /// block's range; repeats allowed) of row block `block` for iteration `clock`. The
    /// sync policy may hold it as a `Pull`. Answered `PullRowsReply`, `Moved` or an
    /// `Error` (docs/PROTOCOL.md §6.12).
    PullRows {
        /// Block id (a row block).
        block: u32,
        /// The worker's iteration.
        clock: u32,
        /// The rows asked for.
        ids: RowIds,
        /// The dtype the reply's values travel in (flags bits 2-3).
        reply: Dtype,
    },
    /// Server -> worker: the rows a `PullRows` asked for, in the order asked
    /// (`ids.len() x dim` values).
    PullRowsReply {
        /// Block id.
        block: u32,
        /// The clock of the pull this answers.
        clock: u32,
        /// The rows, one after the other.
        values: Values,
    },
    /// Worker -> server: the gradient of rows `ids` of row block `block` at clock `clock`
    /// (`grads` is `ids.len() x dim`; a row named twice gets the sum). An empty push (no
    /// id) still counts for the clock: a worker pushes to every block of a table on every
    /// clock. Answered `PushAck`, `Moved` or an `Error`.
    PushRows {
        /// Block id (a row block).
        block: u32,
        /// The worker's iteration.
        clock: u32,
        /// Values per row (the table's dim; any value when `ids` is empty).
        dim: u32,
        /// The rows.
        ids: RowIds,
        /// Their gradients, row after row.
        grads: Values,
    },
}

impl Message {
    /// The frame kind that carries this message.
    pub fn kind(&self) -> Kind {
        match self {
            Message::Control(_) => Kind::Control,
            Message::Push { .. } => Kind::Push,
            Message::PushAck { .. } => Kind::PushAck,
            Message::Pull { .. } => Kind::Pull,
            Message::PullReply { .. } => Kind::PullReply,
            Message::Error(_) => Kind::Error,
            Message::Init { .. } => Kind::Init,
            Message::PushPull { .. } => Kind::PushPull,
            Message::Forward { .. } => Kind::Forward,
            Message::PullRows { .. } => Kind::PullRows,
            Message::PullRowsReply { .. } => Kind::PullRowsReply,
            Message::PushRows { .. } => Kind::PushRows,
        }
    }

    /// True for the requests a worker sends about one block's data (Push, Pull, Init,
    /// PushPull, PullRows, PushRows): what a server counts as data-plane work.
    pub fn is_data_request(&self) -> bool {
        matches!(
            self,
            Message::Push { .. }
                | Message::Pull { .. }
                | Message::Init { .. }
                | Message::PushPull { .. }
                | Message::PullRows { .. }
                | Message::PushRows { .. }
        )
    }

    /// The `(block, clock)` header fields of this message: `(0, 0)` for Control and Error.
    pub fn block_clock(&self) -> (u32, u32) {
        match self {
            Message::Control(_) | Message::Error(_) => (0, 0),
            Message::Push { block, clock, .. }
            | Message::PushAck { block, clock }
            | Message::Pull { block, clock, .. }
            | Message::PullReply { block, clock, .. }
            | Message::PushPull { block, clock, .. }
            | Message::Forward { block, clock, .. }
            | Message::PullRows { block, clock, .. }
            | Message::PullRowsReply { block, clock, .. }
            | Message::PushRows { block, clock, .. } => (*block, *clock),
            Message::Init { block, .. } => (*block, 0),
        }
    }

    /// The header flags of this message: its values' dtype and sparseness, the dtype its
    /// reply is asked in.
    pub fn flags(&self) -> Flags {
        let mut f = Flags::default();
        match self {
            Message::Push { values, .. }
            | Message::PullReply { values, .. }
            | Message::Init { values, .. }
            | Message::Forward { values, .. }
            | Message::PullRowsReply { values, .. }
            | Message::PushRows { grads: values, .. } => {
                f.dtype = values.dtype();
                f.sparse = values.is_sparse();
            }
            Message::PushPull { values, reply, .. } => {
                f.dtype = values.dtype();
                f.sparse = values.is_sparse();
                f.reply = *reply;
            }
            Message::Pull { reply, .. } | Message::PullRows { reply, .. } => f.reply = *reply,
            Message::Control(_) | Message::Error(_) | Message::PushAck { .. } => {}
        }
        f
    }

    /// The payload bytes of this message: the shared f32 bytes for Push, PullReply, Init
    /// and PushPull (no copy), empty for PushAck and Pull, postcard for Control and Error.
    ///
    /// Does not check any size limit; [`Codec::encode`](crate::Codec::encode) does. A
    /// Forward's payload is its prefix and its values in one buffer (a copy); the data
    /// path writes them apart ([`Message::payload_parts`]).
    pub fn encode_payload(&self) -> Result<Bytes, WireError> {
        let (prefix, payload) = self.payload_parts()?;
        Ok(joined(prefix, payload))
    }

    /// The payload as written: the bytes before the values (a Forward's or PushRows'
    /// 8-byte prefix; `None` for every other kind), then the payload bytes proper (the
    /// values' own shared bytes for the f32 kinds, Forward and PullRows: no copy; a
    /// PushRows' ids and gradients joined in one buffer). A PushRows whose gradients are
    /// not `ids x dim` values is refused.
    pub fn payload_parts(&self) -> Result<(Option<[u8; FORWARD_PREFIX]>, Bytes), WireError> {
        Ok(match self {
            Message::Forward { worker, init, values, .. } => {
                let mut prefix = [0u8; FORWARD_PREFIX];
                prefix[..4].copy_from_slice(&worker.to_le_bytes());
                prefix[4..].copy_from_slice(&u32::from(*init).to_le_bytes());
                (Some(prefix), values.wire_bytes())
            }
            Message::Control(c) => (None, Bytes::from(postcard::to_allocvec(c)?)),
            Message::Error(e) => (None, Bytes::from(postcard::to_allocvec(e)?)),
            Message::Push { values, .. }
            | Message::PullReply { values, .. }
            | Message::Init { values, .. }
            | Message::PushPull { values, .. }
            | Message::PullRowsReply { values, .. } => (None, values.wire_bytes()),
            Message::PullRows { ids, .. } => (None, ids.as_bytes().clone()),
            Message::PushRows { dim, ids, grads, .. } => {
                let count = u32::try_from(ids.len()).map_err(|_| WireError::BadPayload {
                    kind: Kind::PushRows,
                    why: format!("{} row ids do not fit a u32 count", ids.len()),
                })?;
                let want = ids.len() as u64 * u64::from(*dim);
                if (count > 0 || !grads.is_empty()) && grads.len() as u64 != want {
                    return Err(WireError::BadPayload {
                        kind: Kind::PushRows,
                        why: format!("{count} rows of {dim} values need {want} gradient values, not {}", grads.len()),
                    });
                }
                let mut prefix = [0u8; PUSH_ROWS_PREFIX];
                prefix[..4].copy_from_slice(&count.to_le_bytes());
                prefix[4..].copy_from_slice(&dim.to_le_bytes());
                // The ids and the gradients in one buffer (a copy of both).
                let body = [&ids.as_bytes()[..], grads.as_bytes()].concat();
                (Some(prefix), Bytes::from(body))
            }
            Message::PushAck { .. } | Message::Pull { .. } => (None, Bytes::new()),
        })
    }

    /// Decodes the payload of a frame whose header `h` was validated by
    /// [`Codec::decode_header`](crate::Codec::decode_header).
    ///
    /// `payload.len()` must equal `h.payload_len`. f32 payloads are wrapped, not copied
    /// (read them into a `Vec<f32>` and pass `Values::from_vec(v).into_bytes()` to keep
    /// them aligned). Postcard payloads must be consumed exactly: trailing bytes are an
    /// error. The block and clock of Control and Error frames are ignored.
    pub fn decode(h: &FrameHeader, payload: Bytes) -> Result<Message, WireError> {
        let kind = h.kind;
        let bad = |why: String| WireError::BadPayload { kind, why };
        if payload.len() != h.payload_len as usize {
            return Err(bad(format!(
                "the header announces {} payload bytes, {} were given",
                h.payload_len,
                payload.len()
            )));
        }
        check_payload_len(kind, h.flags, h.payload_len)?;
        let (block, clock, reply) = (h.block, h.clock, h.flags.reply);
        let values = |b: Bytes| {
            if h.flags.sparse {
                Values::from_sparse_wire(b, h.flags.dtype)
            } else {
                Values::from_wire(b, h.flags.dtype)
            }
        };
        Ok(match kind {
            Kind::Control => Message::Control(decode_postcard(kind, &payload)?),
            Kind::Error => Message::Error(decode_postcard(kind, &payload)?),
            Kind::Push => Message::Push { block, clock, values: values(payload)? },
            Kind::PullReply => Message::PullReply { block, clock, values: values(payload)? },
            Kind::PushAck => Message::PushAck { block, clock },
            Kind::Pull => Message::Pull { block, clock, reply },
            Kind::Init if clock != 0 => return Err(bad(format!("an Init frame carries clock 0, not {clock}"))),
            Kind::Init => Message::Init { block, values: values(payload)? },
            Kind::PushPull => Message::PushPull { block, clock, values: values(payload)?, reply },
            Kind::Forward => {
                let word = |i: usize| u32::from_le_bytes([payload[i], payload[i + 1], payload[i + 2], payload[i + 3]]);
                let (worker, flag) = (word(0), word(4));
                let init = match flag {
                    0 => false,
                    1 => true,
                    other => return Err(bad(format!("a Forward's init flag is 0 or 1, not {other}"))),
                };
                if init && clock != 0 {
                    return Err(bad(format!("a forwarded Init carries clock 0, not {clock}")));
                }
                let values = values(payload.slice(FORWARD_PREFIX..))?;
                Message::Forward { block, clock, worker, init, values }
            }
            Kind::PullRows => {
                let ids = RowIds::from_le_bytes(payload)
                    .ok_or_else(|| bad(format!("{} bytes are not whole u64 row ids", h.payload_len)))?;
                Message::PullRows { block, clock, ids, reply }
            }
            Kind::PullRowsReply => Message::PullRowsReply { block, clock, values: values(payload)? },
            Kind::PushRows => {
                let word = |i: usize| u32::from_le_bytes([payload[i], payload[i + 1], payload[i + 2], payload[i + 3]]);
                let (count, dim) = (word(0), word(4));
                let id_bytes = u64::from(count) * 8;
                let width = h.flags.dtype.width() as u128;
                // u128: count x dim x 4 overflows u64 for the largest u32s.
                let want =
                    PUSH_ROWS_PREFIX as u128 + u128::from(id_bytes) + u128::from(count) * u128::from(dim) * width;
                if want != payload.len() as u128 {
                    return Err(bad(format!(
                        "{count} rows of {dim} values take {want} bytes with the prefix, the frame has {}",
                        payload.len()
                    )));
                }
                let split = PUSH_ROWS_PREFIX + id_bytes as usize;
                let ids = RowIds::from_le_bytes(payload.slice(PUSH_ROWS_PREFIX..split))
                    .ok_or_else(|| bad("row ids are not whole u64".into()))?;
                let grads = values(payload.slice(split..))?;
                Message::PushRows { block, clock, dim, ids, grads }
            }
        })
    }
}

impl From<Control> for Message {
    fn from(c: Control) -> Self {
        Message::Control(c)
    }
}

impl From<ErrorReply> for Message {
    fn from(e: ErrorReply) -> Self {
        Message::Error(e)
    }
}

/// The payload-length rules that can be checked from the header alone: values are whole
/// values of the flags' dtype (4 or 2 bytes; a sparse payload is checked when decoded),
/// Forward and PushRows carry their 8-byte prefix first, PullRows whole u64 ids, PushAck
/// and Pull nothing.
pub(crate) fn check_payload_len(kind: Kind, flags: Flags, len: u32) -> Result<(), WireError> {
    let width = flags.dtype.width() as u32;
    let bad = |why: String| Err(WireError::BadPayload { kind, why });
    if kind == Kind::PushRows && (len < PUSH_ROWS_PREFIX as u32 || !len.is_multiple_of(width)) {
        return bad(format!("{len} bytes are not the {PUSH_ROWS_PREFIX}-byte prefix and whole {} values", flags.dtype));
    }
    if kind == Kind::PullRows && !len.is_multiple_of(8) {
        return bad(format!("{len} bytes are not whole u64 row ids"));
    }
    if kind == Kind::Forward && (len < FORWARD_PREFIX as u32 || (!flags.sparse && !len.is_multiple_of(width))) {
        return bad(format!("{len} bytes are not the {FORWARD_PREFIX}-byte prefix and whole {} values", flags.dtype));
    }
    if kind.carries_f32() && !flags.sparse && !len.is_multiple_of(width) {
        return bad(format!("{len} bytes are not a whole number of {} values", flags.dtype));
    }
    if kind.is_empty_payload() && len != 0 {
        return bad(format!("must be empty, has {len} bytes"));
    }
    Ok(())
}

fn decode_postcard<T: serde::de::DeserializeOwned>(kind: Kind, payload: &[u8]) -> Result<T, WireError> {
    let (value, rest) =
        postcard::take_from_bytes::<T>(payload).map_err(|e| WireError::Postcard(format!("{kind} payload: {e}")))?;
    if !rest.is_empty() {
        return Err(WireError::BadPayload { kind, why: format!("{} trailing bytes after the message", rest.len()) });
    }
    Ok(value)
}

/// A payload's parts ([`Message::payload_parts`]) in one buffer: the payload itself
/// without a prefix, else a copy of the prefix and the payload.
pub(crate) fn joined(prefix: Option<[u8; FORWARD_PREFIX]>, payload: Bytes) -> Bytes {
    match prefix {
        None => payload,
        Some(prefix) => [&prefix[..], &payload[..]].concat().into(),
    }
}
