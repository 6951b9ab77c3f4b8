//! The one error type of the node layer.

use elasticps_core::CoreError;

/// What a role's state machine can refuse or fail with.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The core refused a request.
    #[error(transparent)]
    Core(#[from] CoreError),
    /// A request that the state machine cannot carry out in its current state.
    #[error("{0}")]
    Refused(String),
}

/// Result alias of the node layer.
pub type Result<T, E = NodeError> = std::result::Result<T, E>;
