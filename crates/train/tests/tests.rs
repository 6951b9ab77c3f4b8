//! Integration tests of elasticps-train (one binary, modules inside).

mod full_datasets;
mod local_training;
