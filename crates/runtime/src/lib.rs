//! elasticps-runtime: the tokio drivers that move bytes and time in and out of the core.
//!
//! - [`accept`]: a node's listener, with a bound on open connections.
//! - [`checkpoint`]: checkpoint files (every block at one clock) and their manifest.
//! - [`durable`]: atomic file writes (temporary file, fsync, rename, directory fsync).
//! - [`handshake`]: the HMAC-SHA256 challenge-response that opens every connection.
//! - [`tls`]: optional mutual TLS 1.3 (rustls) under the handshake, and the stream that
//!   is either plain TCP or TLS.
//! - [`conn`]: framed I/O on a connection (read header, then payload straight into
//!   an aligned `Vec<f32>`; one writer task per connection).
//! - [`pool`]: recycled buffers for large tensor payloads.
//! - [`peer`]: request/response multiplexing for the asking side of a connection.
//! - [`reattach`]: reconnecting to a restarted scheduler (backoff, reattach, retried calls).
//! - [`scheduler`]: the scheduler's connections and ticker around its state machine
//!   ([`elasticps_node::scheduler::Scheduler`]).
//! - [`server`]: owns blocks and drives the core's per-block state machines.
//! - [`shaping`]: server straggler injection for experiments (a bandwidth cap on a
//!   server's sockets, CPU interference), as in PSLD.
//! - [`events`]: the JSON lines nodes write for a launcher (progress, logged metrics,
//!   final reports), to stdout or to the launcher's pipe.
//! - [`tally`]: a worker's iteration and communication times, for its final report.
//! - [`client`]: the worker library a user's training loop calls: `pull(t)`, `push(t)`.
//! - [`metrics`]: Prometheus metrics of every role and the endpoint serving them.
//!
//! Every wait has a timeout whose error says what was waited for.

use std::future::Future;
use std::time::{Duration, Instant};

pub mod accept;
pub mod checkpoint;
pub mod client;
pub mod conn;
pub mod durable;
pub mod error;
pub mod events;
pub mod handshake;
pub mod metrics;
pub mod peer;
pub mod pool;
pub mod reattach;
pub mod scheduler;
pub mod server;
pub mod shaping;
pub mod tally;
pub mod tls;

pub use error::{Result, RuntimeError};

/// How often nodes send a heartbeat to the scheduler.
pub const HEARTBEAT_EVERY: Duration = Duration::from_millis(500);
/// How long the scheduler waits without hearing from a node before declaring it dead.
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(10);
/// [`HEARTBEAT_TIMEOUT`] in a job with replicas (`--replicas 2` or more), where a silent
/// server's blocks fail over to their backups: a server that stops answering (hung, or
/// cut off) is detected within 2 s. (A killed one is detected at once: its connection
/// closes.) Without replicas a false alarm would end the job, so the wait is longer.
pub const FAILOVER_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(2);
/// How often servers evaluate their load and adaptive policies.
pub const STATS_INTERVAL: Duration = Duration::from_secs(1);
/// How long a TCP connect may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a control request (register, layout) may take to be answered.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(120);

/// Microseconds since this value was made: the time the runtime hands to the core.
#[derive(Clone, Copy, Debug)]
pub struct Micros(Instant);

impl Micros {
    /// Starts counting now.
    pub fn new() -> Self {
        Self(Instant::now())
    }

    /// Microseconds elapsed.
    pub fn now(&self) -> u64 {
        self.0.elapsed().as_micros() as u64
    }
}

impl Default for Micros {
    fn default() -> Self {
        Self::new()
    }
}

/// Runs `fut` for at most `after`; the error names `what` was waited for.
pub async fn timeout<T>(after: Duration, what: impl Into<String>, fut: impl Future<Output = Result<T>>) -> Result<T> {
    match tokio::time::timeout(after, fut).await {
        Ok(r) => r,
        Err(_) => Err(RuntimeError::Timeout { what: what.into(), after }),
    }
}
