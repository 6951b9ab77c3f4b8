//! Integration tests of the elasticps binary: real processes over real TCP.

mod bad_input;
mod balance_report;
mod checkpoint;
mod common;
mod failover;
mod launch_cmd;
mod launcher;
mod metrics;
mod migration;
mod scheduler_restart;
mod semantics;
mod trust;
