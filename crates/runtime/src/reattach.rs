//! Reconnecting to a restarted scheduler (`--state-dir` on the scheduler,
//! `--scheduler-retry-s` on the nodes): dial again with backoff (100 ms doubling to 2 s)
//! for a bounded time, each attempt logged, and introduce the node again
//! (`ReattachServer`, `ReattachWorker`). Data traffic does not go through the scheduler
//! and keeps flowing meanwhile; only calls to the scheduler wait.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use elasticps_wire::{Codec, Control, Credential, Message};
use tokio::sync::watch;

use crate::CALL_TIMEOUT;
use crate::error::{Result, RuntimeError};
use crate::peer::{Notifications, Peer};

/// How long a node retries a lost scheduler by default (`--scheduler-retry-s`).
pub const DEFAULT_SCHEDULER_RETRY: Duration = Duration::from_secs(60);
/// The first retry's delay; each next one doubles, up to [`MAX_BACKOFF`]
/// ([`elasticps_node::timing::next_backoff_us`]).
pub const FIRST_BACKOFF: Duration = Duration::from_micros(elasticps_node::timing::FIRST_BACKOFF_US);
/// The longest delay between two retries.
pub const MAX_BACKOFF: Duration = Duration::from_micros(elasticps_node::timing::MAX_BACKOFF_US);

/// Dials the scheduler at `addr` again until it answers `hello()` (built afresh for each
/// attempt) with `Welcome`, for at most `window`. A refusal (an `Error` reply) is final.
pub async fn redial(
    addr: &str,
    codec: &Codec,
    hello: impl Fn() -> Option<Message>,
    window: Duration,
) -> Result<(Peer, Notifications)> {
    let started = Instant::now();
    let mut delay = FIRST_BACKOFF;
    let mut attempt = 0u32;
    loop {
        let left = window.saturating_sub(started.elapsed());
        if left.is_zero() {
            return Err(RuntimeError::Timeout {
                what: format!("the scheduler at {addr} to come back after its connection was lost"),
                after: window,
            });
        }
        tokio::time::sleep(delay.min(left)).await;
        attempt += 1;
        let Some(msg) = hello() else {
            return Err(RuntimeError::Usage("lost the scheduler before it accepted this node".into()));
        };
        let tried = match Peer::connect(addr, codec.clone(), "scheduler").await {
            Ok((peer, notes)) => {
                let what = || "the restarted scheduler to accept this node again".to_string();
                match peer.call(msg, CALL_TIMEOUT.min(left.max(Duration::from_secs(1))), what).await {
                    Ok(Message::Control(Control::Welcome { .. })) => return Ok((peer, notes)),
                    Ok(other) => return Err(RuntimeError::unexpected("scheduler", "Welcome", &other)),
                    Err(e @ RuntimeError::Remote { .. }) => return Err(e),
                    Err(e) => e,
                }
            }
            Err(e) => e,
        };
        delay = Duration::from_micros(elasticps_node::timing::next_backoff_us(delay.as_micros() as u64));
        tracing::warn!(
            attempt,
            addr,
            error = %tried,
            next_in_ms = delay.as_millis() as u64,
            left_s = window.saturating_sub(started.elapsed()).as_secs_f64(),
            "scheduler unreachable; retrying"
        );
    }
}

/// Where and how a [`SchedLink`] redials.
#[derive(Clone, Debug)]
pub struct Redial {
    /// The scheduler's address.
    pub addr: String,
    /// The frame codec.
    pub codec: Codec,
    /// The worker's rank (its `ReattachWorker`).
    pub rank: u32,
    /// Its credential (the restarted scheduler checks it).
    pub credential: Credential,
    /// How long to retry ([`redial`]); zero: no reconnect.
    pub window: Duration,
}

/// A worker's connection to the scheduler that survives a scheduler restart: a
/// supervisor task reads its notifications and, when it closes without a `Shutdown`,
/// redials ([`redial`], `ReattachWorker`) and swaps the new connection in.
#[derive(Clone)]
pub struct SchedLink {
    current: Arc<Mutex<Peer>>,
    /// Bumped at every new connection; `None`: the supervisor gave up.
    generation: watch::Receiver<Option<u64>>,
    /// The supervisor task (stopped by [`SchedLink::close`]).
    supervisor: tokio::task::AbortHandle,
}

impl SchedLink {
    /// Wraps the first connection. `on_note` sees every notification; `on_end` is called
    /// once when the link is over (`Shutdown` read and the connection closed, or the
    /// scheduler did not come back within `window`: then with why). `window` zero: no
    /// reconnect.
    pub fn start(
        (peer, mut notes): (Peer, Notifications),
        Redial { addr, codec, rank, credential, window }: Redial,
        mut on_note: impl FnMut(Message) -> bool + Send + 'static,
        on_end: impl FnOnce(Option<String>) + Send + 'static,
    ) -> SchedLink {
        let current = Arc::new(Mutex::new(peer));
        let (tx, generation) = watch::channel(Some(0));
        let cur = current.clone();
        let task = tokio::spawn(async move {
            let current = cur;
            let mut seq = 0;
            let mut shutdown = false;
            loop {
                while let Some(msg) = notes.recv().await {
                    shutdown |= on_note(msg);
                }
                if shutdown || window.is_zero() {
                    let _ = tx.send(None);
                    on_end(None);
                    return;
                }
                tracing::warn!(rank, addr = %addr, window_s = window.as_secs_f64(), "scheduler connection lost; reattaching");
                let hello = || Some(Control::ReattachWorker { rank, credential: credential.clone() }.into());
                match redial(&addr, &codec, hello, window).await {
                    Ok((peer, n)) => {
                        tracing::info!(rank, "worker reattached to the restarted scheduler");
                        *current.lock().unwrap_or_else(|e| e.into_inner()) = peer;
                        notes = n;
                        seq += 1;
                        let _ = tx.send(Some(seq));
                    }
                    Err(e) => {
                        let _ = tx.send(None);
                        on_end(Some(format!("the scheduler was lost and did not come back: {e}")));
                        return;
                    }
                }
            }
        });
        SchedLink { current, generation, supervisor: task.abort_handle() }
    }

    /// Stops redialling (the worker is done): the connection closes once every clone of
    /// this link is dropped.
    pub fn close(&self) {
        self.supervisor.abort();
    }

    /// The current connection and its generation (`None`: the link is over).
    fn current(&self) -> Option<(u64, Peer)> {
        let seq = (*self.generation.borrow())?;
        Some((seq, self.current.lock().unwrap_or_else(|e| e.into_inner()).clone()))
    }

    /// Sends a notification on the current connection (lost while reconnecting).
    pub fn notify(&self, msg: Message) -> Result<()> {
        match self.current() {
            Some((_, p)) => p.notify(msg),
            None => Err(RuntimeError::Closed("scheduler".into())),
        }
    }

    /// True once the link is over (no reconnect will come).
    pub fn is_over(&self) -> bool {
        self.generation.borrow().is_none()
    }

    /// A call; on a connection that closes under it, the call is made again on the next
    /// connection (after a restart of the scheduler), unless the link is over: then the
    /// `Closed` error comes back.
    pub async fn call(&self, msg: Message, timeout: Duration, what: impl FnOnce() -> String) -> Result<Message> {
        let what = what();
        loop {
            let Some((seq, peer)) = self.current() else {
                return Err(RuntimeError::Closed("scheduler".into()));
            };
            match peer.call(msg.clone(), timeout, || what.clone()).await {
                Err(RuntimeError::Closed(name)) => {
                    let mut g = self.generation.clone();
                    // Wait for the supervisor's verdict: a new connection, or the end.
                    let _ = g.wait_for(|x| x.is_none_or(|n| n > seq)).await;
                    if g.borrow().is_none() {
                        return Err(RuntimeError::Closed(name));
                    }
                    tracing::info!(call = %what, "retrying a scheduler call after the reattach");
                }
                other => return other,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_scheduler_that_does_not_come_back_within_the_window_is_given_up_saying_so() {
        // A port that was free a moment ago: nothing listens there.
        let addr = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
        let codec = Codec::new(b"", elasticps_wire::DEFAULT_MAX_PAYLOAD);
        let attempts = std::sync::atomic::AtomicU32::new(0);
        let hello = || {
            attempts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Some(
                Control::ReattachWorker {
                    rank: 0,
                    credential: Credential::issue(b"", 0, elasticps_wire::PeerRole::Worker, 0),
                }
                .into(),
            )
        };
        let started = Instant::now();
        let Err(e) = redial(&addr, &codec, hello, Duration::from_millis(700)).await else {
            panic!("nothing listens at {addr}");
        };
        assert!(e.to_string().contains(&format!("the scheduler at {addr} to come back")), "{e}");
        assert!(started.elapsed() < Duration::from_secs(5), "bounded by the window");
        // 100, 200, 400 ms: the backoff doubles.
        let n = attempts.load(std::sync::atomic::Ordering::Relaxed);
        assert!((2..=4).contains(&n), "{n} attempts in 700 ms");
    }
}
