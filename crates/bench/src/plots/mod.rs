//! The benchmarks' figures, drawn in the house style of `elasticps-report`
//! ([`elasticps_report::plot`]).
//!
//! - [`sim`]: `sim.png` of `bench sim`.
//! - [`sync`]: `sync.png` of `bench sync`.
//! - [`straggler`]: `straggler.png` of `bench straggler`.

pub mod sim;
pub mod straggler;
pub mod sync;
