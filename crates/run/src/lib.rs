//! elasticps-run: a run of a job, below the crates that do its I/O: its flags, its
//! outcome, assembling its report. The process launcher (`elasticps-launch`), the
//! simulator (`elasticps-sim`), the roles and the Python client share it; it starts no
//! process and opens no socket.
//!
//! - [`args`]: the job's flags ([`JobArgs`]), a worker's data and schedule
//!   ([`DataArgs`]), how a local run shows itself ([`RunArgs`]).
//! - [`outcome`]: what a run produced ([`RunOutcome`]), real or simulated.
//! - [`report`]: the run's report.json `config`, its [`elasticps_report::Report`], and the
//!   summary lines printed after it.
//! - [`tally`]: a worker's iteration and communication times, for its final report.

pub mod args;
mod error;
pub mod outcome;
pub mod report;
pub mod tally;

pub use args::{DataArgs, JobArgs, RunArgs, StragglerSpec};
pub use error::{Result, RunError};
pub use outcome::{Restart, RunOutcome, ServerExit};
pub use report::{assemble_report, job_config_json, print_cluster_summary};
