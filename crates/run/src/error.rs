//! The one error type of the run crate.

/// What the flags of a run can be refused with.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// A flag, or a combination of flags, is refused (before anything starts).
    #[error("{0}")]
    Flags(String),
}

/// Result alias of the run crate.
pub type Result<T, E = RunError> = std::result::Result<T, E>;

/// Returns a [`RunError::Flags`] unless `cond` holds.
macro_rules! ensure_flags {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err($crate::RunError::Flags(format!($($msg)+)));
        }
    };
}
pub(crate) use ensure_flags;
