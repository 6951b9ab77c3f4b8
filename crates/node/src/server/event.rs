//! What happens at the server ([`Event`]) and what the runtime must do
//! ([`Action`]), the trace of an answered pull, and why a server stops.

use elasticps_core::block::BlockState;
use elasticps_core::model::BlockId;
use elasticps_core::placement::ServerId;
use elasticps_core::sync::Clock;
use elasticps_wire::{CheckpointEntry, KeyId, Message};

use crate::ConnId;

/// Something that happened at the server.
#[derive(Debug)]
pub enum Event {
    /// A data connection opened (optional: a frame from an unknown connection opens it,
    /// as one of the cluster key).
    Opened {
        /// The connection.
        conn: ConnId,
        /// The key its handshake proved (a worker-key connection can only be a worker).
        key: KeyId,
    },
    /// A frame from a data connection (a worker after Hello, or a server streaming a block).
    Received {
        /// The connection.
        conn: ConnId,
        /// The frame's request id.
        request_id: u64,
        /// The message.
        msg: Message,
    },
    /// A data connection closed.
    Closed {
        /// The connection.
        conn: ConnId,
    },
    /// A message from the scheduler: a notification (request id 0) or the answer to a
    /// call ([`Action::ToScheduler`] with that request id).
    FromScheduler {
        /// 0, or the request id of the call answered.
        request_id: u64,
        /// The message.
        msg: Message,
    },
    /// The answer of another server to a call this server sent ([`Action::ToServer`]),
    /// or why the link has none (the connection failed). A call nothing answers is
    /// failed by the server itself at its deadline ([`super::STEP_TIMEOUT_US`]); an
    /// answer that comes after is ignored.
    FromServer {
        /// The call ([`Action::ToServer`]) answered.
        call: u64,
        /// The answer, or why there is none.
        reply: Result<Message, String>,
    },
    /// The deadline of [`Server::poll_timeout`](super::Server::poll_timeout) came (load
    /// reports, adaptive staleness, the deadlines of calls, replica resyncs, long holds,
    /// a drained server's linger).
    Timeout,
    /// The runtime wrote a block of a checkpoint ([`Action::Checkpoint`]): its entry for
    /// the manifest, or why it could not.
    CheckpointWritten {
        /// The checkpoint's clock.
        clock: Clock,
        /// The block.
        block: BlockId,
        /// The file written, or the error.
        result: Result<CheckpointEntry, String>,
    },
    /// The runtime read the blocks of the checkpoint the job resumes from
    /// ([`Action::Restore`]), or why it could not.
    Restored(Result<Vec<BlockState>, String>),
}

/// What the runtime must do.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Send `msg` on data connection `conn`, answering `request_id`.
    Reply {
        /// The connection.
        conn: ConnId,
        /// The request answered.
        request_id: u64,
        /// The answer.
        msg: Message,
    },
    /// Send `msg` to the scheduler. Request id 0: a notification; otherwise a call whose
    /// answer comes back as [`Event::FromScheduler`] with this request id (a call that
    /// fails needs no event: the server's own deadline covers it).
    ToScheduler {
        /// 0, or the call's id.
        request_id: u64,
        /// The message.
        msg: Message,
    },
    /// A call to another server (a migration step, a push forwarded to a backup, a
    /// backup's snapshot), answered by [`Event::FromServer`] with `call`. The driver need
    /// not time it out: the server fails it at its deadline.
    ToServer {
        /// The call's id.
        call: u64,
        /// The server.
        server: ServerId,
        /// Its data address.
        addr: String,
        /// The step.
        msg: Message,
    },
    /// An answered pull, for the runtime's `--trace` file (only if enabled with
    /// [`Server::with_trace`](super::Server::with_trace)).
    Trace(PullTrace),
    /// Write `state`, block `state.spec.id` at checkpoint `clock`, into the checkpoint
    /// directory (durably: fsync before the answer), then answer with
    /// [`Event::CheckpointWritten`].
    Checkpoint {
        /// The directory.
        dir: String,
        /// The checkpoint's clock.
        clock: Clock,
        /// The block's state: exactly the pushes of the clocks before `clock`.
        state: BlockState,
    },
    /// Read (and check against their checksums) these blocks of the checkpoint in `dir`,
    /// then answer with [`Event::Restored`].
    Restore {
        /// The directory.
        dir: String,
        /// The blocks assigned here.
        blocks: Vec<CheckpointEntry>,
    },
    /// Close data connection `conn` once the replies already handed out are written (a
    /// `Hello` whose credential does not hold).
    Close {
        /// The connection.
        conn: ConnId,
    },
    /// Stop.
    Exit(Exit),
}

/// One answered pull, as the `--trace` file records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PullTrace {
    /// The block.
    pub block: BlockId,
    /// The worker that pulled.
    pub worker: u32,
    /// The pull's clock.
    pub clock: u32,
    /// The block's `done` clock when it was answered.
    pub done: u32,
    /// How long it was held, if it was.
    pub held_us: Option<u64>,
}

impl PullTrace {
    /// The trace line (JSON, no newline): `{"block":..,"worker":..,"clock":..,"done":..,"held_us":..}`.
    pub fn json(&self) -> String {
        format!(
            r#"{{"block":{},"worker":{},"clock":{},"done":{},"held_us":{}}}"#,
            self.block,
            self.worker,
            self.clock,
            self.done,
            self.held_us.map_or("null".to_string(), |u| u.to_string())
        )
    }
}

/// Why a server stops.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Exit {
    /// The scheduler shut the job down (a drained server lingered first).
    Shutdown {
        /// The scheduler's reason.
        reason: String,
    },
    /// The server cannot take part: registration refused or timed out, or an assignment
    /// that cannot be built.
    Failed {
        /// What went wrong.
        reason: String,
    },
}
