//! The one error type of the bench crate. Each message carries its cause's (the causes
//! are not chained as `source`s), so `{e}` reads the whole story.

use elasticps_launch::LaunchError;
use elasticps_report::ReportError;
use elasticps_runtime::RuntimeError;

/// Everything a benchmark can fail with.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A flag, or a combination of flags, is refused.
    #[error("{0}")]
    Flags(String),
    /// A file or socket operation failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// A value could not be written as JSON.
    #[error("serializing to JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// Starting or running a local job failed.
    #[error(transparent)]
    Launch(#[from] LaunchError),
    /// Writing a report or drawing a plot failed.
    #[error(transparent)]
    Report(#[from] ReportError),
    /// A job setting is refused by the core.
    #[error(transparent)]
    Core(#[from] elasticps_core::CoreError),
    /// A simulated job failed or was refused.
    #[error(transparent)]
    Sim(#[from] elasticps_sim::SimError),
    /// The parameter server's client failed.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// A task of the benchmark panicked or was cancelled.
    #[error("{0}")]
    Task(#[from] tokio::task::JoinError),
    /// A bounded wait ran out.
    #[error("{0}")]
    Elapsed(#[from] tokio::time::error::Elapsed),
    /// A measurement went wrong, or a check failed.
    #[error("{0}")]
    Failed(String),
    /// What was being done when `cause` happened.
    #[error("{what}: {cause}")]
    During {
        /// What was being done, e.g. "resnet56 under bsp".
        what: String,
        /// What went wrong.
        cause: Box<BenchError>,
    },
}

/// Result alias of the bench crate.
pub type Result<T, E = BenchError> = std::result::Result<T, E>;

/// Names what was being done when an error happened (`anyhow::Context`'s shape, with the
/// crate's own error).
pub(crate) trait Context<T> {
    /// The error, as the cause of `what` failing.
    fn context(self, what: impl Into<String>) -> Result<T>;
    /// As [`Context::context`], with the description built only on failure.
    fn with_context<S: Into<String>>(self, what: impl FnOnce() -> S) -> Result<T>;
}

impl<T, E: Into<BenchError>> Context<T> for std::result::Result<T, E> {
    fn context(self, what: impl Into<String>) -> Result<T> {
        self.map_err(|e| BenchError::During { what: what.into(), cause: Box::new(e.into()) })
    }

    fn with_context<S: Into<String>>(self, what: impl FnOnce() -> S) -> Result<T> {
        self.map_err(|e| BenchError::During { what: what().into(), cause: Box::new(e.into()) })
    }
}

/// Returns a [`BenchError::Flags`] unless `cond` holds.
macro_rules! ensure_flags {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err($crate::BenchError::Flags(format!($($msg)+)));
        }
    };
}
pub(crate) use ensure_flags;

/// Returns a [`BenchError::Failed`] unless `cond` holds.
macro_rules! ensure_measured {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err($crate::BenchError::Failed(format!($($msg)+)));
        }
    };
}
pub(crate) use ensure_measured;
