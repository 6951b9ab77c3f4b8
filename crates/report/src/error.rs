//! The one error type of the report crate. Each message carries its cause's (the
//! causes are not chained as `source`s), so `{e}` reads the whole story.

use std::path::PathBuf;

/// Everything writing a report or drawing a plot can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// A file or directory operation failed.
    #[error("{what} {}: {cause}", .path.display())]
    Io {
        /// What was being done ("writing", "creating report directory", ...).
        what: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        cause: std::io::Error,
    },
    /// A value could not be written as JSON.
    #[error("serializing to JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// No font could be loaded for the plots' text.
    #[error("no font for the plots: {0}")]
    Font(String),
    /// The plotting library failed.
    #[error("plotting failed: {0}")]
    Plot(String),
    /// Drawing one plot file (or one part of it) failed.
    #[error("drawing {what}: {cause}")]
    Draw {
        /// The file or panel.
        what: String,
        /// Why.
        cause: Box<ReportError>,
    },
}

impl ReportError {
    /// An I/O error on `path` while doing `what`.
    pub fn io(what: &'static str, path: impl Into<PathBuf>, cause: std::io::Error) -> Self {
        ReportError::Io { what, path: path.into(), cause }
    }

    /// This error, as the cause of drawing `what` failing.
    pub fn drawing(self, what: impl Into<String>) -> Self {
        ReportError::Draw { what: what.into(), cause: Box::new(self) }
    }
}

/// Result alias of the report crate.
pub type Result<T, E = ReportError> = std::result::Result<T, E>;
