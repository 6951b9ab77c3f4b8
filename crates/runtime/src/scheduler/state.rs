//! The scheduler's saved state on disk (`--state-dir DIR`): `DIR/scheduler-state.json`,
//! the node layer's [`SavedState`] as JSON, rewritten atomically
//! ([`crate::durable::write_atomic`]) before the actions of a step that changed it are
//! carried out, so that nothing a node was told is missing from it.

use std::path::{Path, PathBuf};

use elasticps_node::scheduler::{Persisted, SavedState, Scheduler};

use crate::error::{Result, RuntimeError};

/// The file under the state directory.
pub const STATE_FILE: &str = "scheduler-state.json";

/// A state directory and what of the state is there (`None`: nothing yet).
#[derive(Debug)]
pub struct StateDir {
    path: PathBuf,
    persisted: Option<Persisted>,
}

impl StateDir {
    /// The state file of directory `dir`.
    pub fn new(dir: &Path) -> Self {
        Self { path: dir.join(STATE_FILE), persisted: None }
    }

    /// The state file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The saved state, if the directory has one (`None`: a fresh job).
    pub fn load(&self) -> Result<Option<SavedState>> {
        let bytes = match std::fs::read(&self.path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(RuntimeError::io(format!("reading {}", self.path.display()), e)),
        };
        serde_json::from_slice(&bytes).map(Some).map_err(|e| RuntimeError::State {
            path: self.path.display().to_string(),
            what: format!("not a saved scheduler state: {e}"),
        })
    }

    /// Marks `scheduler`'s state as on disk already (the state just loaded).
    pub fn loaded(&mut self, scheduler: &Scheduler) {
        self.persisted = Some(Persisted::of(scheduler));
    }

    /// Writes `scheduler`'s state if it changed since the last write ([`Persisted::due`]);
    /// returns whether it wrote.
    pub fn save_if_changed(&mut self, scheduler: &Scheduler) -> Result<bool> {
        let (version, state) = match &self.persisted {
            Some(p) => match p.due(scheduler) {
                Some(due) => due,
                None => return Ok(false),
            },
            None => (scheduler.state_version(), scheduler.saved_state()),
        };
        let bytes = serde_json::to_vec(&state).map_err(|e| RuntimeError::State {
            path: self.path.display().to_string(),
            what: format!("cannot encode the state: {e}"),
        })?;
        crate::durable::write_atomic(&self.path, &bytes)?;
        self.persisted.get_or_insert(Persisted::of(scheduler)).written(version);
        Ok(true)
    }

    /// Removes the state file (the job ended: a later scheduler with this directory starts
    /// a fresh job).
    pub fn remove(&self) {
        if let Err(e) = std::fs::remove_file(&self.path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(path = %self.path.display(), error = %e, "scheduler state not removed");
        }
    }
}
