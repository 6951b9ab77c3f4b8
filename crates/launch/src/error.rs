//! The one error type of the launch crate. Each message carries its cause's (the causes
//! are not chained as `source`s), so `{e}` reads the whole story.

use elasticps_report::ReportError;

/// Everything starting, supervising or reporting a local job can fail with.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// A flag, or a combination of flags, is refused (before any process starts).
    #[error("{0}")]
    Flags(String),
    /// A file, pipe, signal or process operation failed.
    #[error("{what}: {cause}")]
    Io {
        /// What was being done, naming the file or the node.
        what: String,
        /// The I/O error.
        cause: std::io::Error,
    },
    /// A node exited with a failure: its name, how it ended, the tail of its log.
    #[error("{0}")]
    NodeFailed(String),
    /// A signal (Ctrl-C, SIGTERM, SIGHUP) stopped the job.
    #[error("{0}: every node was stopped")]
    Stopped(&'static str),
    /// A wait ran out of time; the message says what was waited for.
    #[error("{0}")]
    Timeout(String),
    /// The job ran but did not produce what its report needs.
    #[error("{0}")]
    Incomplete(String),
    /// What the launcher did after `cause` (e.g. stopped every other node).
    #[error("{what}: {cause}")]
    Then {
        /// What followed.
        what: &'static str,
        /// The error that came first.
        cause: Box<LaunchError>,
    },
    /// A job without a report directory failed: its nodes' logs are kept in `dir`.
    #[error("{cause}\nevery node's log is kept in {}", dir.display())]
    LogsKept {
        /// Why the job failed.
        cause: Box<LaunchError>,
        /// The temporary log directory, `$TMPDIR/elasticps-PID`.
        dir: std::path::PathBuf,
    },
    /// Writing the report failed.
    #[error(transparent)]
    Report(#[from] ReportError),
    /// The host agent's connection to the scheduler failed.
    #[error("{what}: {cause}")]
    Scheduler {
        /// What the agent was doing.
        what: String,
        /// The runtime's error.
        cause: elasticps_runtime::RuntimeError,
    },
}

impl LaunchError {
    /// An I/O error while doing `what`.
    pub fn io(what: impl Into<String>, cause: std::io::Error) -> Self {
        LaunchError::Io { what: what.into(), cause }
    }

    /// This error, followed by `what` the launcher did about it.
    pub fn then(self, what: &'static str) -> Self {
        LaunchError::Then { what, cause: Box::new(self) }
    }
}

/// A job flag `elasticps-run` refused is a refused flag here too.
impl From<elasticps_run::RunError> for LaunchError {
    fn from(e: elasticps_run::RunError) -> Self {
        match e {
            elasticps_run::RunError::Flags(why) => LaunchError::Flags(why),
        }
    }
}

/// Result alias of the launch crate.
pub type Result<T, E = LaunchError> = std::result::Result<T, E>;

/// Returns a [`LaunchError::Flags`] unless `cond` holds.
macro_rules! ensure_flags {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err($crate::LaunchError::Flags(format!($($msg)+)));
        }
    };
}
pub(crate) use ensure_flags;
