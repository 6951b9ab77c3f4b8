//! The one error type of the runtime.

use std::time::Duration;

use elasticps_core::CoreError;
use elasticps_wire::{ErrorReply, Message, WireError};

/// Everything a scheduler, server or worker client can fail with.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// A socket operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done, naming the peer.
        context: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A peer sent bytes that are not a valid frame.
    #[error("invalid frame from {peer}: {source}")]
    Wire {
        /// The peer.
        peer: String,
        /// What was wrong.
        #[source]
        source: WireError,
    },
    /// A peer answered with an error frame.
    #[error("{peer} answered {:?}: {}", .reply.code, .reply.message)]
    Remote {
        /// The peer.
        peer: String,
        /// Its error.
        reply: ErrorReply,
    },
    /// A peer closed the connection.
    #[error("{0} closed the connection")]
    Closed(String),
    /// This node dropped a peer to bound what peers can make it hold (the memory of
    /// partial frames, docs/PROTOCOL.md §8).
    #[error("dropped {peer}: {why}")]
    Dropped {
        /// The peer.
        peer: String,
        /// Which bound, and why this peer.
        why: String,
    },
    /// A row block was split while a row round ran: the caller plans it again.
    #[error("row block {block} was split while the round ran")]
    Recut {
        /// The block that was split.
        block: u32,
    },
    /// A wait ran out of time.
    #[error("timed out after {:.1} s: {what}", .after.as_secs_f64())]
    Timeout {
        /// What was waited for, e.g. "server 1 to answer pull(clock 17) of block 3".
        what: String,
        /// How long.
        after: Duration,
    },
    /// A peer broke the conversation (an unexpected message).
    #[error("protocol error with {peer}: {what}")]
    Protocol {
        /// The peer.
        peer: String,
        /// What happened.
        what: String,
    },
    /// The core refused a request.
    #[error(transparent)]
    Core(#[from] CoreError),
    /// The job was shut down by the scheduler.
    /// The node's link to the scheduler ended without a `Shutdown` (lost, not back within
    /// `--scheduler-retry-s`, or its reattach refused).
    #[error("lost the scheduler: {0}")]
    SchedulerLost(String),
    #[error("shut down by the scheduler: {0}")]
    Shutdown(String),
    /// A checkpoint file that cannot be used (missing, corrupt, of another job).
    #[error("checkpoint {path}: {what}")]
    Checkpoint {
        /// The file or directory.
        path: String,
        /// What is wrong with it.
        what: String,
    },
    /// A TLS file that cannot be used (missing, unreadable, not PEM, a key that does not fit).
    #[error("tls {part} file {path}: {what}")]
    TlsSetup {
        /// Which file.
        part: TlsPart,
        /// Its path.
        path: String,
        /// What is wrong with it.
        what: String,
    },
    /// A TLS handshake failed (a certificate from another CA, a peer without TLS).
    #[error("tls handshake with {peer} failed: {what}")]
    Tls {
        /// The peer.
        peer: String,
        /// Why.
        what: String,
    },
    /// Invalid use of the API or options.
    #[error("{0}")]
    Usage(String),
    /// The scheduler's saved state (`--state-dir`) cannot be used.
    #[error("scheduler state {path}: {what}")]
    State {
        /// The file.
        path: String,
        /// What is wrong with it.
        what: String,
    },
}

impl RuntimeError {
    /// An I/O error with context.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        RuntimeError::Io { context: context.into(), source }
    }

    /// `peer` answered with a message of another kind than `wanted`.
    pub fn unexpected(peer: &str, wanted: &str, got: &Message) -> Self {
        RuntimeError::Protocol { peer: peer.into(), what: format!("expected {wanted}, got {:?}", got.kind()) }
    }
}

/// The node layer's refusals and failures, as the runtime's errors (with the same messages).
impl From<elasticps_node::NodeError> for RuntimeError {
    fn from(e: elasticps_node::NodeError) -> Self {
        use elasticps_node::NodeError;
        match e {
            NodeError::Core(e) => RuntimeError::Core(e),
            NodeError::Remote { peer, reply } => RuntimeError::Remote { peer, reply },
            NodeError::Protocol { peer, what } => RuntimeError::Protocol { peer, what },
            NodeError::Refused(what) => RuntimeError::Protocol { peer: "servers".into(), what },
            NodeError::Timeout { what, after_us } => {
                RuntimeError::Timeout { what, after: Duration::from_micros(after_us) }
            }
            NodeError::Recut { block } => RuntimeError::Recut { block },
            NodeError::Closed(peer) => RuntimeError::Closed(peer),
        }
    }
}

/// Result alias of the runtime.
pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;

/// Which of the three PEM files a setup error is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TlsPart {
    /// This node's certificate chain (`--tls-cert`).
    Cert,
    /// This node's private key (`--tls-key`).
    Key,
    /// The cluster's CA certificates (`--tls-ca`).
    Ca,
}

impl std::fmt::Display for TlsPart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TlsPart::Cert => "certificate",
            TlsPart::Key => "private key",
            TlsPart::Ca => "CA certificates",
        })
    }
}
