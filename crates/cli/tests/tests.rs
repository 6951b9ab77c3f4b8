//! Integration tests of the elasticps binary: real processes over real TCP.

mod common;
mod bad_input;
mod launcher;
mod semantics;
