//! The one error type of the node layer.

use elasticps_core::CoreError;
use elasticps_wire::ErrorReply;

/// What a role's state machine can refuse or fail with.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The core refused a request.
    #[error(transparent)]
    Core(#[from] CoreError),
    /// A request that the state machine cannot carry out in its current state.
    #[error("{0}")]
    Refused(String),
    /// A peer answered with an error frame.
    #[error("{peer} answered {:?}: {}", .reply.code, .reply.message)]
    Remote {
        /// The peer, and what it was answering.
        peer: String,
        /// Its error.
        reply: ErrorReply,
    },
    /// A peer broke the conversation (an unexpected message, a wrong length, blocks that
    /// keep moving).
    #[error("protocol error with {peer}: {what}")]
    Protocol {
        /// The peer.
        peer: String,
        /// What happened.
        what: String,
    },
    /// A row block the round sends to was split while it ran (the refreshed layout has
    /// two blocks in its place): the caller plans the row round again from that layout.
    /// The requests the blocks already took are duplicates there, and change nothing.
    #[error("row block {block} was split while the round ran: plan the row round again")]
    Recut {
        /// The block that was split.
        block: u32,
    },
    /// A peer's connection closed (or could not be opened) before it answered.
    #[error("connection closed: {0}")]
    Closed(String),
    /// A wait ran out of time: a request unanswered past its deadline.
    #[error("timed out after {:.1} s: {what}", *.after_us as f64 / 1e6)]
    Timeout {
        /// What waited for what, e.g. "worker 0 waits for server 1 to answer pull(clock
        /// 17) of block 3".
        what: String,
        /// How long, µs.
        after_us: u64,
    },
}

/// Result alias of the node layer.
pub type Result<T, E = NodeError> = std::result::Result<T, E>;
