//! elasticps-node: the roles of a job as state machines without I/O. Every rule of the
//! system (who may send what, sync, migration and failover steps, the worker's round, its
//! window and deadlines, heartbeats, retries and backoff, every timeout) lives here.
//!
//! **One time contract for every machine**, quinn-proto's: `handle(now_us, event)`
//! returns actions (send this, reply to that, start a server, the job is over) and
//! `poll_timeout()` says when the machine next wants `Event::Timeout`. There is no fixed
//! tick and no clock of its own: the tokio runtime (`elasticps-runtime`) feeds real
//! sockets and real time in and sleeps until `poll_timeout()`; the deterministic harness
//! (`elasticps-harness`) feeds simulated ones, so a race seen between real processes is
//! replayed on the same machines from a seed.
//!
//! - [`scheduler`]: membership, the model's layout, barriers, replicas, checkpoints, the
//!   balancer's migrations and scaling, hosts, recovery after a restart, the end of the
//!   job; one module per family of messages behind a thin dispatch.
//! - [`server`]: block slots (serving, copying, frozen, gone), pushes and pulls under
//!   the sync policy, live migration of a block (both ends), replication, load reports.
//! - [`worker`]: the worker's client (its connections, layout, `Hello`, calls and their
//!   retries) and the round inside it as a plan (which blocks to push and pull where,
//!   what to resend after `Moved`), its window per server and its requests' deadlines,
//!   and its load report.
//! - [`session`]: every node's link to the scheduler: heartbeats, the redial of a lost
//!   scheduler with backoff, the reattach, the calls made again (in the order made).
//! - [`agent`]: the host agent of a job across hosts (`elasticps launch --rdzv`): its
//!   join, the nodes it starts within its slots, their exits and events, its heartbeat,
//!   a lost scheduler, the end wait.
//! - [`link`]: a server's links to the other servers: one connection per address, its
//!   `Hello` first, calls in order, a failed dial or a lost connection failing its calls,
//!   the bounds on what a silent peer can hold.
//! - [`launcher`]: the local job runner (`elasticps train`, `elasticps launch` on one
//!   host): the scheduler first and its start deadline, then the servers and workers,
//!   dead workers restarted with their ranks, dead servers failed over and replaced, the
//!   end wait after the last worker, a signal.
//! - [`authz`]: who may send what to whom (docs/PROTOCOL.md §7.1), checked by the
//!   scheduler and the servers before a message changes anything.
//! - [`machine`]: the [`Machine`] trait every role above is written on.
//! - [`timing`]: every timing constant (heartbeats, failure timeouts, backoff, the
//!   window, request and periodic deadlines), defined once for the runtime and the
//!   harness alike.

pub mod agent;
pub mod authz;
pub mod error;
pub mod events;
pub mod launcher;
pub mod link;
pub mod machine;
pub mod scheduler;
pub mod server;
pub mod session;
pub mod throttle;
pub mod timing;
pub mod worker;

pub use error::{NodeError, Result};
pub use machine::Machine;

/// Identifies one connection as a node sees it (one TCP connection in the runtime, one
/// simulated link in the harness).
pub type ConnId = u64;
