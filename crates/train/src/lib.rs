//! elasticps-train
