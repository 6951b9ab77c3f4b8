//! The JSON lines roles print (`--events`) or write to the launcher's pipe
//! (`ELASTICPS_EVENTS_FD`); `elasticps train` and `elasticps launch` read them. The format
//! lives in the runtime crate ([`elasticps_runtime::events`]) so the Python package writes
//! exactly the same lines.

pub use elasticps_runtime::events::{Emitter, Event};
