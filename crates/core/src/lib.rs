//! elasticps-core: the decisions of the parameter server, with no I/O and no clock.
//!
//! The runtime feeds events in (a push arrived, a pull arrived, a worker left) together
//! with the current time, and carries the returned actions out. Nothing here touches a
//! socket, a thread or the system clock, so every policy is testable in microseconds and
//! a simulator can drive the same code.
//!
//! - [`model`]: tensors, tables, blocks and deterministic initial values.
//! - [`placement`]: which server owns which block (`range`, `hash`, `roundrobin`, `bestfit`).
//! - [`optimizer`]: server-side SGD, momentum and Adam, with state that lives with a block.
//! - [`rows`]: embedding tables' rows, created lazily, and the sparse optimizers.
//! - [`sync`]: the synchronization policies and the clock bookkeeping they decide on.
//! - [`adaptive`]: per-server tuning of the staleness bound.
//! - [`load`]: per-server service-rate estimates with a confidence (PSLD's measurements).
//! - [`balance`]: the PSLD balancer: block moves, probes, scale-out trials and scale-in.
//! - [`dtype`]: the wire's value types (f32, bf16, fp16) and their conversions.
//! - [`compress`]: top-k and random-k gradients with error feedback (the worker's side).
//! - [`block`]: the per-block state machine a server runs (values, optimizer, clocks,
//!   held pulls, counters).

pub mod adaptive;
pub mod balance;
pub mod block;
pub mod compress;
pub mod dtype;
pub mod error;
pub mod f32s;
pub mod ids;
pub mod load;
pub mod model;
pub mod optimizer;
pub mod placement;
pub mod rows;
pub mod stats;
pub mod sync;

pub use error::CoreError;
