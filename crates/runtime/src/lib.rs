//! elasticps-runtime: the tokio drivers that move bytes and time in and out of the core.
//!
//! - [`accept`]: a node's listener, with a bound on open connections.
//! - [`checkpoint`]: checkpoint files (every block at one clock) and their manifest.
//! - [`durable`]: atomic file writes (temporary file, fsync, rename, directory fsync).
//! - [`handshake`]: the HMAC-SHA256 challenge-response that opens every connection.
//! - [`tls`]: optional mutual TLS 1.3 (rustls) under the handshake, and the stream that
//!   is either plain TCP or TLS.
//! - [`driver`]: the one event loop every machine runs in ([`driver::drive`]), each in its [`driver::World`].
//! - [`conn`]: framed I/O on a connection (read header, then payload straight into
//!   an aligned `Vec<f32>`; one writer task per connection).
//! - [`pool`]: recycled buffers for large tensor payloads.
//! - [`partial`]: the node's budget for the memory of partial frames.
//! - [`peer`]: request/response multiplexing for the asking side of a connection.
//! - [`session`]: a node's connection to the scheduler, carried out as
//!   [`elasticps_node::session::Session`] decides (heartbeats, redial, reattach, calls made again).
//! - [`scheduler`]: the scheduler's connections and ticker around its state machine
//!   ([`elasticps_node::scheduler::Scheduler`]).
//! - [`server`]: owns blocks and drives the core's per-block state machines.
//! - [`shaping`]: server straggler injection for experiments (a bandwidth cap on a
//!   server's sockets, CPU interference), as in PSLD.
//! - [`events`]: the JSON lines nodes write for a launcher (progress, logged metrics,
//!   final reports), to stdout or to the launcher's pipe.
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
pub mod driver;
pub mod durable;
pub mod error;
pub mod events;
pub mod handshake;
pub mod metrics;
pub mod partial;
pub mod peer;
pub mod pool;
pub mod scheduler;
pub mod server;
pub mod session;
pub mod shaping;
pub mod timer;
pub mod tls;

pub use error::{Result, RuntimeError};

/// How long the scheduler waits without hearing from a node before declaring it dead
/// ([`elasticps_node::timing::HEARTBEAT_TIMEOUT_US`]).
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_micros(timing::HEARTBEAT_TIMEOUT_US);
/// [`HEARTBEAT_TIMEOUT`] in a job with replicas
/// ([`elasticps_node::timing::FAILOVER_HEARTBEAT_TIMEOUT_US`]).
pub const FAILOVER_HEARTBEAT_TIMEOUT: Duration = Duration::from_micros(timing::FAILOVER_HEARTBEAT_TIMEOUT_US);
/// How often workers report their load ([`elasticps_node::timing::WORKER_STATS_US`]).
pub const STATS_INTERVAL: Duration = Duration::from_micros(timing::WORKER_STATS_US);

use elasticps_node::timing;
/// How long a TCP connect may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_micros(timing::CONNECT_TIMEOUT_US);
/// How long a control request (register, layout) may take to be answered.
pub const CALL_TIMEOUT: Duration = Duration::from_micros(timing::CALL_TIMEOUT_US);

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

#[cfg(test)]
mod tests {
    use elasticps_harness::ClusterConfig;

    use super::*;

    fn job(replicas: u32) -> elasticps_node::scheduler::JobConfig {
        use elasticps_core::block::ShardConfig;
        use elasticps_core::optimizer::{OptimizerConfig, OptimizerKind};
        let optimizer = OptimizerConfig { kind: OptimizerKind::Sgd, lr: 1.0, aggregate: false, weight_decay: 0.0 };
        elasticps_node::scheduler::JobConfig {
            servers: 3,
            workers: 2,
            block_bytes: 16,
            placement: elasticps_core::placement::PlacementKind::Range,
            shard: ShardConfig { sync: elasticps_core::sync::SyncPolicy::Bsp, optimizer, workers: 2 },
            server_sync: Vec::new(),
            seed: 1,
            inject: Vec::new(),
            balance: Default::default(),
            balance_compress: None,
            max_servers: 3,
            min_servers: 3,
            checkpoint: None,
            rejoin_wait_us: 0,
            replicas,
        }
    }

    /// The runtime and the harness time their links with the same constants
    /// ([`elasticps_node::timing`]): a literal typed again on either side fails here.
    #[test]
    fn the_runtime_and_the_harness_use_the_same_timing_constants() {
        let us = |d: Duration| d.as_micros() as u64;
        assert_eq!(us(HEARTBEAT_TIMEOUT), timing::HEARTBEAT_TIMEOUT_US);
        assert_eq!(us(FAILOVER_HEARTBEAT_TIMEOUT), timing::FAILOVER_HEARTBEAT_TIMEOUT_US);
        assert_eq!(us(STATS_INTERVAL), timing::WORKER_STATS_US);
        assert_eq!(us(CALL_TIMEOUT), timing::CALL_TIMEOUT_US);
        assert_eq!(us(CONNECT_TIMEOUT), timing::CONNECT_TIMEOUT_US);
        assert_eq!(us(conn::FRAME_STALL_TIMEOUT), timing::FRAME_STALL_TIMEOUT_US);
        assert_eq!(elasticps_harness::worker::WORKER_STATS_US, us(STATS_INTERVAL));
        for replicas in [1, 2, 3] {
            let c = ClusterConfig::new(job(replicas));
            let runtime = if replicas > 1 { FAILOVER_HEARTBEAT_TIMEOUT } else { HEARTBEAT_TIMEOUT };
            assert_eq!(c.heartbeat_timeout_us, us(runtime), "replicas {replicas}");
        }
    }
}
