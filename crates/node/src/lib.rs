//! elasticps-node: the three roles of a job as state machines without I/O.
//!
//! Each role takes events (a message that arrived on a connection, a connection that
//! was lost, a tick carrying the time) and returns actions (send this, reply to that,
//! start a server, the job is over), in the style of raft-rs's `RawNode` and
//! quinn-proto beside quinn. Nothing here touches a socket, a thread or the system
//! clock: the tokio runtime (`elasticps-runtime`) feeds real sockets and real time in,
//! and the deterministic harness feeds simulated ones, so a race seen between real
//! processes can be replayed here from a seed.
//!
//! - [`scheduler`]: membership, the model's layout, barriers, the balancer's migrations
//!   and scaling, the end of the job.
//! - [`server`]: block slots (serving, copying, frozen, gone), pushes and pulls under
//!   the sync policy, live migration of a block (both ends), load reports.
//! - [`worker`]: the worker's round as a plan (which blocks to push and pull where, what
//!   to resend after `Moved`), its window per server and its requests' deadlines
//!   (`handle(now, event)` and `poll_timeout()`), and its load report.
//! - [`authz`]: who may send what to whom (docs/PROTOCOL.md §7.1), checked by the
//!   scheduler and the servers before a message changes anything.
//! - [`timing`]: every timing constant of the roles' links (heartbeats, timeouts, ticks,
//!   backoff), defined once for the runtime and the harness alike.
//! - [`harness`]: a deterministic cluster on virtual time: simulated links with latency
//!   and bandwidth, seeded faults, the real scheduler and the roles plugged in.

pub mod authz;
pub mod error;
pub mod harness;
pub mod scheduler;
pub mod server;
pub mod session;
pub mod timing;
pub mod worker;

pub use error::{NodeError, Result};

/// Identifies one connection as a node sees it (one TCP connection in the runtime, one
/// simulated link in the harness).
pub type ConnId = u64;
