//! Integration tests of the elasticps binary: real processes over real TCP.

// Tests may sleep to pace their workers or let a process get somewhere; the ban of
// clippy.toml (a wait is a machine's poll_timeout) is for the code they test.
#![allow(clippy::disallowed_methods)]

mod bad_input;
mod balance_report;
mod checkpoint;
mod common;
mod conn_bounds;
mod failover;
mod launch_cmd;
mod launcher;
mod metrics;
mod migration;
mod scheduler_bounds;
mod scheduler_restart;
mod semantics;
mod server_bounds;
mod trust;
