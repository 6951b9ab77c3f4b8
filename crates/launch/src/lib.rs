//! The local launch of an elasticps job, shared by the `elasticps` binary (`train`,
//! `launch`, the roles) and the benchmarks (`elasticps-bench`, which run many train jobs):
//!
//! - [`args`]: the job's flags, shared by the roles (each with an `ELASTICPS_*` variable).
//! - [`console`]: the progress bars, the events recorded into a run's outcome, the
//!   metrics scrape list.
//! - [`process`]: a local cluster of processes (spawn, supervise, kill), and the
//!   scheduler's [`process::ServerLauncher`].
//! - [`runner`]: one local job: the nodes, progress bars, events into a
//!   [`runner::RunOutcome`].
//! - [`train`]: the `elasticps train` job: its flags, its run, its report.
//!
//! The nodes are this process's own executable run as a role (`elasticps scheduler`,
//! `elasticps server`, `elasticps worker`): the crate is meant to be linked into the
//! `elasticps` binary.

pub mod addr;
pub mod args;
pub mod console;
mod error;
pub mod hosts;
pub mod process;
pub mod runner;
pub mod train;

pub use error::{LaunchError, Result};
