//! A data request for one block, as the server serves it: what it touches (the whole
//! block of a tensor, or rows of a row block), what it does (push, pull, push_pull,
//! init), and who sent it. The six data messages of the wire are these two axes; the
//! server's data path ([`data`](super)) is written once over them.

use elasticps_core::model::BlockId;
use elasticps_core::sync::Clock;
use elasticps_wire::{Dtype, Message, RowIds, Values};

/// The part of a block a request touches.
#[derive(Clone, Debug)]
pub enum What {
    /// The whole block (a slice of a dense tensor).
    Tensor,
    /// Rows of a row block.
    Rows {
        /// The rows.
        ids: RowIds,
        /// Values per row, as a push says (a pull says none: 0).
        dim: u32,
    },
}

/// What a request does to the part it touches.
#[derive(Clone, Debug)]
pub enum Op {
    /// A gradient of clock `clock` (empty: the clock counts, nothing is applied).
    Push {
        /// The clock.
        clock: Clock,
        /// The gradient (of the rows, one row after the other, for rows).
        values: Values,
    },
    /// The values at clock `clock` (held by the sync policy until it may be answered).
    Pull {
        /// The clock.
        clock: Clock,
    },
    /// A gradient of clock `clock` and the pull of `clock + 1`, answered by that pull's
    /// reply. Parked whole while the block is frozen (nothing applied: a `Moved` for it
    /// means the push was not applied here). Once the push is applied, the pull may be held
    /// like any other; a handover answers it `Moved`, and the push travels with the block,
    /// so the resent request's push is a duplicate the new owner drops.
    PushPull {
        /// The gradient's clock.
        clock: Clock,
        /// The gradient.
        values: Values,
    },
    /// The block's initial values (the first worker's parameters), before any push.
    Init {
        /// The values.
        values: Values,
    },
}

/// A data request for one block: [`What`] it touches and the [`Op`] on it.
#[derive(Clone, Debug)]
pub struct Request {
    /// The whole block, or rows.
    pub what: What,
    /// Push, pull, push_pull or init.
    pub op: Op,
}

/// Who sent a data request: a worker, and whether it rejoined (a restarted worker taken
/// back into the quorums: it may go on past its next clock on a block, and the clocks
/// between are skipped).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sender {
    /// The worker's rank (`u32::MAX` for a connection that proved no rank).
    pub rank: u32,
    /// Whether it rejoined.
    pub rejoined: bool,
}

impl Request {
    /// A pull of the whole block at `clock` (a held pull taken out of its block and
    /// served again).
    pub fn pull(clock: Clock) -> Self {
        Self { what: What::Tensor, op: Op::Pull { clock } }
    }

    /// The data request `msg` is, with its block and the dtype its answer's values are
    /// asked in (f32 for a request answered without values); any other message back as
    /// it came.
    #[allow(clippy::result_large_err)] // the message as it came, moved once, never stored
    pub fn of(msg: Message) -> Result<(BlockId, Dtype, Self), Message> {
        let f32 = Dtype::F32;
        let (block, reply, what, op) = match msg {
            Message::Push { block, clock, values } => (block, f32, What::Tensor, Op::Push { clock, values }),
            Message::Pull { block, clock, reply } => (block, reply, What::Tensor, Op::Pull { clock }),
            Message::PushPull { block, clock, values, reply } => {
                (block, reply, What::Tensor, Op::PushPull { clock, values })
            }
            Message::Init { block, values } => (block, f32, What::Tensor, Op::Init { values }),
            Message::PullRows { block, clock, ids, reply } => {
                (block, reply, What::Rows { ids, dim: 0 }, Op::Pull { clock })
            }
            Message::PushRows { block, clock, dim, ids, grads } => {
                (block, f32, What::Rows { ids, dim }, Op::Push { clock, values: grads })
            }
            other => return Err(other),
        };
        Ok((block, reply, Self { what, op }))
    }

    /// The clock it pushes (a push's, a push_pull's), if it pushes one.
    pub fn pushed(&self) -> Option<Clock> {
        match &self.op {
            Op::Push { clock, .. } | Op::PushPull { clock, .. } => Some(*clock),
            Op::Pull { .. } | Op::Init { .. } => None,
        }
    }

    /// The clock it pulls: a pull's, or the next of a push_pull's push (none at the last
    /// clock).
    pub fn pulled(&self) -> Option<Clock> {
        match &self.op {
            Op::Pull { clock } => Some(*clock),
            Op::PushPull { clock, .. } => clock.checked_add(1),
            Op::Push { .. } | Op::Init { .. } => None,
        }
    }

    /// The rows it touches, if it touches rows.
    pub fn rows(&self) -> Option<&RowIds> {
        match &self.what {
            What::Rows { ids, .. } => Some(ids),
            What::Tensor => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every data message of the wire is one request, on its own block; the clocks it
    /// pushes and pulls are the ones the server bounds and parks by.
    #[test]
    fn data_messages_map_to_one_request_each() {
        let v = || Values::from_vec(vec![1.0]);
        let ids = || RowIds::from_vec(vec![3]);
        let cases = [
            (Message::Push { block: 1, clock: 4, values: v() }, Some(4), None),
            (Message::Pull { block: 1, clock: 4, reply: Dtype::Bf16 }, None, Some(4)),
            (Message::PushPull { block: 1, clock: 4, values: v(), reply: Dtype::Bf16 }, Some(4), Some(5)),
            (Message::PushPull { block: 1, clock: u32::MAX, values: v(), reply: Dtype::Bf16 }, Some(u32::MAX), None),
            (Message::Init { block: 1, values: v() }, None, None),
            (Message::PullRows { block: 1, clock: 4, ids: ids(), reply: Dtype::Bf16 }, None, Some(4)),
            (Message::PushRows { block: 1, clock: 4, dim: 1, ids: ids(), grads: v() }, Some(4), None),
        ];
        for (msg, pushed, pulled) in cases {
            let rows = matches!(msg, Message::PullRows { .. } | Message::PushRows { .. });
            let asks = matches!(msg, Message::Pull { .. } | Message::PushPull { .. } | Message::PullRows { .. });
            let (block, reply, r) = Request::of(msg).expect("a data request");
            assert_eq!((block, r.pushed(), r.pulled(), r.rows().is_some()), (1, pushed, pulled, rows));
            assert_eq!(reply, if asks { Dtype::Bf16 } else { Dtype::F32 }, "the reply's dtype is the request's");
        }
        assert!(Request::of(Message::PushAck { block: 1, clock: 0 }).is_err(), "a reply is no request");
    }
}
