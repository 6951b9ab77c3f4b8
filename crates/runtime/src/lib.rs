//! elasticps-runtime
