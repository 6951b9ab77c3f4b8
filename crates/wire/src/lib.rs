//! elasticps-wire
