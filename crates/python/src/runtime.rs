//! The process-wide tokio runtime (started once, never dropped), the fork guard, and the
//! ways Python waits for it: with the GIL released, waking every 100 ms to let Ctrl-C
//! through; a command that borrows arrays is cancelled and waited out before the
//! interrupt reaches Python.

use std::sync::OnceLock;
use std::time::Duration;

use pyo3::prelude::*;
use tokio::sync::oneshot;

use crate::ElasticpsError;
use crate::cancel::{Cancelled, Ticket};

/// The runtime and the pid of the process that started it.
static RUNTIME: OnceLock<(tokio::runtime::Runtime, u32)> = OnceLock::new();

/// How often a blocked call wakes to check for Ctrl-C.
const SIGNAL_CHECK: Duration = Duration::from_millis(100);

/// The runtime, started on first use; refused in a forked child.
pub fn runtime() -> PyResult<&'static tokio::runtime::Runtime> {
    if RUNTIME.get().is_none() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("elasticps")
            .enable_all()
            .build()
            .map_err(|e| ElasticpsError::new_err(format!("elasticps: cannot start the async runtime: {e}")))?;
        // Another thread may have won the race: its runtime is as good.
        let _ = RUNTIME.set((rt, std::process::id()));
    }
    let (rt, pid) = RUNTIME.get().ok_or_else(|| ElasticpsError::new_err("elasticps: the async runtime is gone"))?;
    check_not_forked(*pid)?;
    Ok(rt)
}

/// True if this process is not the one that started the client (pid `owner`).
pub fn forked_from(owner: u32) -> bool {
    std::process::id() != owner
}

/// The error for a forked child (a PyTorch DataLoader worker, say) that touches the client:
/// tokio's threads and the client's connections do not survive `fork`.
pub fn check_not_forked(owner: u32) -> PyResult<()> {
    if forked_from(owner) {
        return Err(ElasticpsError::new_err(format!(
            "elasticps: this process (pid {}) was forked from pid {owner}, which started the elasticps client; \
             a forked child (a DataLoader worker, say) cannot use it, because its threads and connections do not \
             survive fork. Use the client in the main process only (DataLoader workers need not touch it), or \
             start children with multiprocessing's 'spawn' method",
            std::process::id()
        )));
    }
    Ok(())
}

/// Waits for `rx` with the GIL released; `KeyboardInterrupt` (or any pending signal's
/// exception) interrupts the wait, leaving the operation to finish in the background. For
/// commands that borrow no arrays (joining, barrier, set_optimizer, finish); those that
/// do wait with [`wait_borrowing`].
pub fn wait<T: Send>(py: Python<'_>, what: &str, rx: oneshot::Receiver<Result<T, String>>) -> PyResult<T> {
    let rt = runtime()?;
    let mut rx = rx;
    loop {
        if let Some(got) = wake(py, rt, &mut rx) {
            return replied(what, got);
        }
        py.check_signals()?;
    }
}

/// A command's reply as a wait gets it: `None` when the client stopped without replying.
pub type Reply<T> = Option<Result<T, String>>;

/// How a [`wait_borrowing`] was interrupted: the signal's exception, and the command's
/// reply (`None`: it was cancelled before it started, or the client stopped).
pub struct Interrupted<T> {
    /// What the signal handler raised (`KeyboardInterrupt`).
    pub error: PyErr,
    /// The reply the command sent once it stopped.
    pub reply: Reply<T>,
}

/// Waits for `rx`, the reply to a command that reads or writes the caller's arrays, as
/// [`wait`] does; but a signal's exception does not return at once: the command is
/// cancelled ([`Ticket::cancel`]) and, if it had started, waited for until it ended, so
/// that nothing touches the arrays once Python has them back. `Ok(None)`: the client
/// stopped without replying.
pub fn wait_borrowing<T: Send>(
    py: Python<'_>,
    rx: oneshot::Receiver<Result<T, String>>,
    ticket: &Ticket,
) -> PyResult<Result<Reply<T>, Interrupted<T>>> {
    let rt = runtime()?;
    let mut rx = rx;
    loop {
        if let Some(got) = wake(py, rt, &mut rx) {
            return Ok(Ok(got));
        }
        if let Err(error) = py.check_signals() {
            let reply = match ticket.cancel() {
                Cancelled::BeforeStart => None,
                // The actor replies once the round's future is dropped: no timeout here,
                // since returning earlier would hand Python arrays the client still uses.
                // Stopping takes one poll of the actor's task.
                Cancelled::Running => py.detach(|| rt.block_on(&mut rx)).ok(),
            };
            return Ok(Err(Interrupted { error, reply }));
        }
    }
}

/// [`wait_borrowing`] for a blocking call: its reply, or the signal's exception.
pub fn wait_call<T: Send>(
    py: Python<'_>,
    what: &str,
    rx: oneshot::Receiver<Result<T, String>>,
    ticket: &Ticket,
) -> PyResult<T> {
    match wait_borrowing(py, rx, ticket)? {
        Ok(got) => replied(what, got),
        Err(Interrupted { error, .. }) => Err(error),
    }
}

/// Waits at most [`SIGNAL_CHECK`] for `rx` with the GIL released: `Some` once it
/// resolved (`None` inside: the sender is gone).
fn wake<T: Send>(
    py: Python<'_>,
    rt: &tokio::runtime::Runtime,
    rx: &mut oneshot::Receiver<Result<T, String>>,
) -> Option<Option<Result<T, String>>> {
    let got = py.detach(|| rt.block_on(async { tokio::time::timeout(SIGNAL_CHECK, &mut *rx).await }));
    got.ok().map(Result::ok)
}

/// A command's reply as Python sees it (`None`: the client stopped without replying).
pub fn replied<T>(what: &str, got: Option<Result<T, String>>) -> PyResult<T> {
    match got {
        Some(result) => result.map_err(ElasticpsError::new_err),
        None => Err(ElasticpsError::new_err(format!(
            "elasticps: the client stopped while {what} (it was finished, or failed before)"
        ))),
    }
}
