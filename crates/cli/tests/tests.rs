//! Integration tests of the elasticps binary: real processes over real TCP.

mod bad_input;
mod common;
mod launcher;
mod migration;
mod semantics;
