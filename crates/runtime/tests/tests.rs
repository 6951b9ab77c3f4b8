//! Integration tests of elasticps-runtime, one module per subject.

mod compression;
mod host_groups;
mod protocol_bounds;
mod testkit;
