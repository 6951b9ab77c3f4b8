//! Durable file writes, shared by checkpoints ([`crate::checkpoint`]) and the scheduler's
//! saved state ([`crate::scheduler::state`]): a crash leaves either the old file or the new
//! one, never a torn one.

use std::fs;
use std::io::Write;
use std::path::Path;

use crate::error::{Result, RuntimeError};

fn io(path: &Path, doing: &str) -> impl FnOnce(std::io::Error) -> RuntimeError {
    let context = format!("{doing} {}", path.display());
    move |e| RuntimeError::io(context, e)
}

/// Writes `bytes` to `path` durably: a temporary file (`path` with the extension `tmp`),
/// fsync, rename into place, fsync of the directory (created if missing).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().ok_or_else(|| {
        RuntimeError::io(format!("writing {}", path.display()), std::io::Error::other("no parent directory"))
    })?;
    fs::create_dir_all(dir).map_err(io(dir, "creating"))?;
    let tmp = path.with_extension("tmp");
    let mut f = fs::File::create(&tmp).map_err(io(&tmp, "creating"))?;
    f.write_all(bytes).map_err(io(&tmp, "writing"))?;
    f.sync_all().map_err(io(&tmp, "syncing"))?;
    drop(f);
    fs::rename(&tmp, path).map_err(io(path, "renaming into"))?;
    fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io(dir, "syncing"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_replaces_the_file_whole_and_leaves_no_temporary() {
        let dir = std::env::temp_dir().join(format!("elasticps-durable-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let path = dir.join("sub").join("state.json");
        write_atomic(&path, b"one").unwrap();
        write_atomic(&path, b"two, longer").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"two, longer");
        assert!(!path.with_extension("tmp").exists());
        fs::remove_dir_all(&dir).unwrap();
    }
}
