//! The process-wide tokio runtime (started once, never dropped), the fork guard, and the
//! one way Python waits for it: with the GIL released, waking every 100 ms to let Ctrl-C
//! through.

use std::sync::OnceLock;
use std::time::Duration;

use pyo3::prelude::*;
use tokio::sync::oneshot;

use crate::ElasticpsError;

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
/// exception) interrupts the wait, leaving the operation to finish in the background.
pub fn wait<T: Send>(py: Python<'_>, what: &str, rx: oneshot::Receiver<Result<T, String>>) -> PyResult<T> {
    let rt = runtime()?;
    let mut rx = rx;
    loop {
        let got = py.detach(|| rt.block_on(async { tokio::time::timeout(SIGNAL_CHECK, &mut rx).await }));
        match got {
            Ok(Ok(result)) => return result.map_err(ElasticpsError::new_err),
            Ok(Err(_)) => {
                return Err(ElasticpsError::new_err(format!(
                    "elasticps: the client stopped while {what} (it was finished, or failed before)"
                )));
            }
            Err(_) => py.check_signals()?,
        }
    }
}
