//! Cancelling a command that borrows the caller's arrays, so that an interrupted wait
//! (Ctrl-C) never returns to Python while the client still reads or writes them.
//!
//! A [`Ticket`] goes with the command. Python, interrupted, calls [`Ticket::cancel`]: a
//! command still queued is marked so and will never run (Python may return at once); a
//! command running is asked to stop, and Python waits for its reply, which the actor sends
//! only once the round's future, and with it every borrow of the arrays, is dropped.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use tokio::sync::Notify;

/// Queued: the actor has not taken the command yet.
const QUEUED: u8 = 0;
/// Running: the actor took it; only the actor's reply tells that it ended.
const RUNNING: u8 = 1;
/// Cancelled while queued: the actor never runs it.
const CANCELLED: u8 = 2;

/// Shared between Python's wait and the actor running the command (cheap to clone).
#[derive(Clone, Debug, Default)]
pub struct Ticket(Arc<Inner>);

#[derive(Debug, Default)]
struct Inner {
    state: AtomicU8,
    /// Notified when Python asks a running command to stop (a permit is kept if the
    /// actor is not waiting yet).
    stop: Notify,
}

/// What [`Ticket::cancel`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cancelled {
    /// The command never ran and never will: its arrays were not touched.
    BeforeStart,
    /// The command is running and was asked to stop: wait for its reply.
    Running,
}

impl Ticket {
    /// A ticket for a command about to be queued.
    pub fn new() -> Self {
        Self::default()
    }

    /// The actor takes the command: true if it may run it, false if Python cancelled it
    /// while it was queued (the actor then replies without touching its arrays).
    pub fn start(&self) -> bool {
        self.0.state.compare_exchange(QUEUED, RUNNING, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }

    /// Resolves once Python asked the running command to stop.
    pub async fn stopped(&self) {
        self.0.stop.notified().await;
    }

    /// Python was interrupted: cancels the command if it is still queued, else asks it
    /// to stop.
    pub fn cancel(&self) -> Cancelled {
        match self.0.state.compare_exchange(QUEUED, CANCELLED, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) | Err(CANCELLED) => Cancelled::BeforeStart,
            Err(_) => {
                self.0.stop.notify_one();
                Cancelled::Running
            }
        }
    }
}

/// Resolves once Python asked any of `tickets` to stop (never, for none).
pub async fn any_stopped(tickets: &[Ticket]) {
    if tickets.is_empty() {
        return std::future::pending().await;
    }
    futures::future::select_all(tickets.iter().map(|t| Box::pin(t.stopped()))).await;
}

/// The error a command stopped by Ctrl-C replies with (seen by a later `Handle.wait()`,
/// or by the other pushes of a batch it shared).
pub fn interrupted(what: &str) -> String {
    format!("elasticps: {what} was interrupted (KeyboardInterrupt) and cancelled before it ended")
}
