//! Integration tests of elasticps-runtime, one module per subject.

mod compression;
mod protocol_bounds;
