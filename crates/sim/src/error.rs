//! The one error type of the sim.

/// What a simulation can fail with.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A flag or combination of flags the sim cannot run.
    #[error("{0}")]
    Usage(String),
    /// The model or a policy was refused by the core.
    #[error(transparent)]
    Core(#[from] elasticps_core::CoreError),
    /// The job's flags were refused.
    #[error(transparent)]
    Run(#[from] elasticps_run::RunError),
    /// The simulated job did not end as a job must: it failed, or stalled.
    #[error("the simulated job {0}")]
    Job(String),
    /// The report could not be written.
    #[error(transparent)]
    Report(#[from] elasticps_report::ReportError),
}

/// Result alias of the sim.
pub type Result<T, E = SimError> = std::result::Result<T, E>;
