//! A worker's call to one server outside a round (`GetOptState`, `SetOptState`,
//! `SetValues` to a block's owner): where it goes, what its answer means (`Moved`: after
//! a layout refresh, to the new owner, at most [`MAX_MOVES`] times; `NotReady`, a
//! migrating block: again after [`BLOCK_BUSY_RETRY_US`], for at most
//! [`CALL_TIMEOUT_US`]), and its deadline.

use elasticps_wire::{Control, ErrorCode, Layout, Message};

use crate::NodeError;
use crate::timing::{BLOCK_BUSY_RETRY_US, CALL_TIMEOUT_US};

/// Layout refreshes one call follows (`Moved`) before it hands the `Moved` back.
pub const MAX_MOVES: u32 = 8;

/// Whom a call asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// The owner of this block in the current layout.
    Block(u32),
    /// This server.
    Server(u32),
}

/// Where a call stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stage {
    /// Sent as `request_id` at `sent_us` to `server`, no answer yet.
    Sent { request_id: u64, server: u32, sent_us: u64 },
    /// The owner moved: waits for the refreshed layout.
    Refreshing,
    /// The block is migrating: asked again at `at_us`.
    Again { at_us: u64 },
}

/// What an answer means for the call ([`Call::answer`]).
#[derive(Debug)]
pub(super) enum Step {
    /// Refresh the layout, then send it again.
    Refresh,
    /// Wait until [`Call::poll_timeout`], then send it again.
    Wait,
    /// The call's answer.
    Done(Message),
    /// The call failed.
    Failed(NodeError),
}

/// One call in progress.
#[derive(Debug)]
pub(super) struct Call {
    pub(super) target: Target,
    pub(super) msg: Control,
    started_us: u64,
    moves: u32,
    pub(super) stage: Stage,
}

impl Call {
    /// A call of `msg` to `target`, started at `now_us` (not sent yet).
    pub(super) fn new(target: Target, msg: Control, now_us: u64) -> Self {
        Self { target, msg, started_us: now_us, moves: 0, stage: Stage::Refreshing }
    }

    /// The server `layout` says the call goes to, or why there is none.
    pub(super) fn server(&self, layout: &Layout) -> Result<u32, NodeError> {
        let server = match self.target {
            Target::Server(s) => s,
            Target::Block(b) => layout.placement.owner(b).ok_or_else(|| NodeError::Protocol {
                peer: "scheduler".into(),
                what: format!("the layout places block {b} on no server"),
            })?,
        };
        if !layout.servers.iter().any(|s| s.id == server) {
            return Err(NodeError::Protocol {
                peer: "scheduler".into(),
                what: format!("layout names server {server}, which it does not list"),
            });
        }
        Ok(server)
    }

    /// The request id the call's answer comes with, while one is awaited.
    pub(super) fn awaits(&self) -> Option<(u64, u32)> {
        match self.stage {
            Stage::Sent { request_id, server, .. } => Some((request_id, server)),
            _ => None,
        }
    }

    /// What the server's answer `msg` means at `now_us`.
    pub(super) fn answer(&mut self, now_us: u64, msg: &Message) -> Step {
        let server = self.awaits().map_or(0, |(_, s)| s);
        match msg {
            Message::Control(Control::Moved { .. }) if self.moves < MAX_MOVES => {
                self.moves += 1;
                self.stage = Stage::Refreshing;
                Step::Refresh
            }
            Message::Error(reply)
                if reply.code == ErrorCode::NotReady && now_us < self.started_us.saturating_add(CALL_TIMEOUT_US) =>
            {
                tracing::debug!(server, what = self.msg.name(), why = %reply.message, "block busy; asking again");
                self.stage = Stage::Again { at_us: now_us + BLOCK_BUSY_RETRY_US };
                Step::Wait
            }
            Message::Error(reply) => {
                Step::Failed(NodeError::Remote { peer: format!("server {server}"), reply: reply.clone() })
            }
            other => Step::Done(other.clone()),
        }
    }

    /// When the call wants a timeout: its next attempt, or its answer's deadline.
    pub(super) fn poll_timeout(&self) -> Option<u64> {
        match self.stage {
            Stage::Sent { sent_us, .. } => Some(sent_us.saturating_add(CALL_TIMEOUT_US)),
            Stage::Again { at_us } => Some(at_us),
            Stage::Refreshing => None,
        }
    }

    /// The timeout came at `now_us`: `Ok(true)` to send the call again, `Ok(false)` to
    /// wait on, or the timeout's error.
    pub(super) fn timeout(&self, now_us: u64) -> Result<bool, NodeError> {
        match self.stage {
            Stage::Again { at_us } => Ok(at_us <= now_us),
            Stage::Sent { server, sent_us, .. } if sent_us.saturating_add(CALL_TIMEOUT_US) <= now_us => {
                Err(NodeError::Timeout { what: self.describe(server), after_us: CALL_TIMEOUT_US })
            }
            _ => Ok(false),
        }
    }

    /// "server 2 to answer GetOptState of block 7".
    pub(super) fn describe(&self, server: u32) -> String {
        match self.target {
            Target::Block(b) => format!("server {server} to answer {} of block {b}", self.msg.name()),
            Target::Server(_) => format!("server {server} to answer {}", self.msg.name()),
        }
    }
}
