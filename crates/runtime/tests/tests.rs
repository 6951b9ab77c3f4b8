//! Integration tests of elasticps-runtime, one module per subject.

mod protocol_bounds;
