//! Checkpoint files: every block's state at one clock, and a manifest that makes the
//! checkpoint complete.
//!
//! ```text
//! DIR/ckpt-0000000040/block-000003.bin   postcard(BlockState), written by its server
//! DIR/ckpt-0000000040/MANIFEST.json      {"version":2,"clock":40,"blocks":[{block,file,len,crc32}]}
//! ```
//!
//! Every file is written to a temporary name, fsynced, renamed into place, and its
//! directory fsynced, so that a crash leaves either the old file or the new one. A
//! checkpoint without a manifest is incomplete and never read; [`latest`] takes the
//! newest checkpoint whose manifest parses and whose every file has the length and
//! CRC-32 the manifest lists. Once a manifest is written, [`prune`] keeps the newest
//! [`KEEP`] complete checkpoints (and anything newer still being written).

use std::fs;
use std::path::{Path, PathBuf};

use elasticps_core::block::BlockState;
use elasticps_core::sync::Clock;
use elasticps_wire::{CheckpointEntry, Restore};
use serde::{Deserialize, Serialize};

use crate::durable::write_atomic;
use crate::error::{Result, RuntimeError};

/// Complete checkpoints kept in a directory.
pub const KEEP: usize = 2;
/// The manifest's format version.
const VERSION: u32 = 2;
const MANIFEST: &str = "MANIFEST.json";

/// `MANIFEST.json`; its entries are the wire's, field for field.
#[derive(Serialize, Deserialize)]
struct Manifest {
    version: u32,
    clock: Clock,
    blocks: Vec<CheckpointEntry>,
}

fn err(path: &Path, what: impl Into<String>) -> RuntimeError {
    RuntimeError::Checkpoint { path: path.display().to_string(), what: what.into() }
}

fn io(path: &Path, doing: &str) -> impl FnOnce(std::io::Error) -> RuntimeError {
    let context = format!("{doing} {}", path.display());
    move |e| RuntimeError::io(context, e)
}

/// The directory of checkpoint `clock`, relative to the checkpoint directory.
fn clock_dir(clock: Clock) -> String {
    format!("ckpt-{clock:010}")
}

/// Writes one block's state at checkpoint `clock` under `dir`; returns its manifest entry.
pub fn write_block(dir: &Path, clock: Clock, state: &BlockState) -> Result<CheckpointEntry> {
    let file = format!("{}/block-{:06}.bin", clock_dir(clock), state.spec.id);
    let path = dir.join(&file);
    let bytes = postcard::to_allocvec(state).map_err(|e| err(&path, format!("cannot encode the block: {e}")))?;
    write_atomic(&path, &bytes)?;
    Ok(CheckpointEntry { block: state.spec.id, file, len: bytes.len() as u64, crc32: crc32fast::hash(&bytes) })
}

/// Writes the manifest of checkpoint `clock` (which makes it complete), then prunes.
pub fn write_manifest(dir: &Path, clock: Clock, blocks: &[CheckpointEntry]) -> Result<PathBuf> {
    let manifest = Manifest { version: VERSION, clock, blocks: blocks.to_vec() };
    let path = dir.join(clock_dir(clock)).join(MANIFEST);
    let bytes = serde_json::to_vec_pretty(&manifest).map_err(|e| err(&path, e.to_string()))?;
    write_atomic(&path, &bytes)?;
    prune(dir)?;
    Ok(path)
}

/// The clocks of the checkpoint directories under `dir`, newest first.
fn clocks(dir: &Path) -> Result<Vec<Clock>> {
    let mut clocks: Vec<Clock> = fs::read_dir(dir)
        .map_err(io(dir, "listing"))?
        .filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("ckpt-")?.parse().ok())
        .collect();
    clocks.sort_unstable_by(|a, b| b.cmp(a));
    Ok(clocks)
}

/// Removes all but the newest [`KEEP`] complete checkpoints (older incomplete ones too).
pub fn prune(dir: &Path) -> Result<()> {
    let mut complete = 0;
    for clock in clocks(dir)? {
        let sub = dir.join(clock_dir(clock));
        if complete >= KEEP {
            fs::remove_dir_all(&sub).map_err(io(&sub, "removing"))?;
        } else if sub.join(MANIFEST).exists() {
            complete += 1;
        }
    }
    Ok(())
}

/// Reads and checks the manifest of checkpoint `clock`.
fn manifest(dir: &Path, clock: Clock) -> Result<Restore> {
    let path = dir.join(clock_dir(clock)).join(MANIFEST);
    let bytes = fs::read(&path).map_err(io(&path, "reading"))?;
    let m: Manifest = serde_json::from_slice(&bytes).map_err(|e| err(&path, format!("not a manifest: {e}")))?;
    if m.version != VERSION || m.clock != clock {
        return Err(err(
            &path,
            format!("version {} clock {}, expected version {VERSION} clock {clock}", m.version, m.clock),
        ));
    }
    for e in &m.blocks {
        read_checked(dir, e)?;
    }
    Ok(Restore { clock, blocks: m.blocks })
}

/// The newest complete checkpoint under `dir` whose files all check out (a damaged one
/// is skipped with a warning), or an error saying why there is none.
pub fn latest(dir: &Path) -> Result<Restore> {
    let mut skipped = Vec::new();
    for clock in clocks(dir)? {
        if !dir.join(clock_dir(clock)).join(MANIFEST).exists() {
            continue;
        }
        match manifest(dir, clock) {
            Ok(r) => return Ok(r),
            Err(e) => {
                tracing::warn!(clock, error = %e, "checkpoint skipped");
                skipped.push(e.to_string());
            }
        }
    }
    let what = if skipped.is_empty() { "no complete checkpoint (no manifest)".to_string() } else { skipped.join("; ") };
    Err(err(dir, what))
}

/// A block file's bytes, checked against its manifest entry.
fn read_checked(dir: &Path, e: &CheckpointEntry) -> Result<Vec<u8>> {
    if e.file.contains("..") || Path::new(&e.file).is_absolute() {
        return Err(err(dir, format!("block {} names a file outside the directory: {}", e.block, e.file)));
    }
    let path = dir.join(&e.file);
    let bytes = fs::read(&path).map_err(io(&path, "reading"))?;
    if bytes.len() as u64 != e.len || crc32fast::hash(&bytes) != e.crc32 {
        return Err(err(
            &path,
            format!("{} bytes with another checksum than the manifest's ({} bytes)", bytes.len(), e.len),
        ));
    }
    Ok(bytes)
}

/// Reads the blocks `entries` of a checkpoint under `dir`, each checked against its entry.
pub fn read_blocks(dir: &Path, entries: &[CheckpointEntry]) -> Result<Vec<BlockState>> {
    entries
        .iter()
        .map(|e| {
            let bytes = read_checked(dir, e)?;
            let state: BlockState =
                postcard::from_bytes(&bytes).map_err(|x| err(&dir.join(&e.file), format!("not a block: {x}")))?;
            if state.spec.id != e.block {
                return Err(err(&dir.join(&e.file), format!("holds block {}, not {}", state.spec.id, e.block)));
            }
            Ok(state)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use elasticps_core::block::{Block, ShardConfig};
    use elasticps_core::model::BlockSpec;
    use elasticps_core::optimizer::{OptimizerConfig, OptimizerKind};
    use elasticps_core::sync::SyncPolicy;

    use super::*;

    fn state(id: u32, done: u32) -> BlockState {
        let spec = BlockSpec::dense(id, 0, id as usize * 2, 2);
        let opt = OptimizerConfig { kind: OptimizerKind::Sgd, lr: 1.0, aggregate: false, weight_decay: 0.0 };
        let config = ShardConfig { sync: SyncPolicy::Bsp, optimizer: opt, workers: 1 };
        let mut b: Block<()> = Block::new(spec, vec![0.0; 2], &config).unwrap();
        for t in 0..done {
            b.push(&config, 0, t, &[-1.0, -2.0], 0).unwrap();
        }
        b.state()
    }

    fn write(dir: &Path, clock: u32, blocks: u32, manifest: bool) -> Vec<CheckpointEntry> {
        let entries: Vec<_> = (0..blocks).map(|b| write_block(dir, clock, &state(b, clock)).unwrap()).collect();
        if manifest {
            write_manifest(dir, clock, &entries).unwrap();
        }
        entries
    }

    fn tempdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("elasticps-ckpt-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn the_newest_complete_checkpoint_is_read_back_exactly() {
        let dir = tempdir("latest");
        write(&dir, 4, 3, true);
        write(&dir, 8, 3, true);
        write(&dir, 12, 2, false); // still being written: no manifest
        let r = latest(&dir).unwrap();
        assert_eq!(r.clock, 8);
        let states = read_blocks(&dir, &r.blocks).unwrap();
        assert_eq!(states, (0..3).map(|b| state(b, 8)).collect::<Vec<_>>());
        assert_eq!(states[0].values, vec![8.0, 16.0]);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_damaged_checkpoint_is_skipped_for_the_one_before_and_old_ones_are_pruned() {
        let dir = tempdir("damaged");
        write(&dir, 2, 2, true);
        write(&dir, 4, 2, true);
        let e = write(&dir, 6, 2, true);
        assert!(!dir.join(clock_dir(2)).exists(), "only the newest {KEEP} complete checkpoints are kept");
        let mut bytes = fs::read(dir.join(&e[1].file)).unwrap();
        bytes[0] ^= 1;
        fs::write(dir.join(&e[1].file), bytes).unwrap();
        assert_eq!(latest(&dir).unwrap().clock, 4);
        fs::remove_dir_all(dir.join(clock_dir(4))).unwrap();
        let error = latest(&dir).unwrap_err().to_string();
        assert!(error.contains("another checksum than the manifest's"), "{error}");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_empty_directory_says_there_is_no_checkpoint() {
        let dir = tempdir("empty");
        fs::create_dir_all(&dir).unwrap();
        assert!(latest(&dir).unwrap_err().to_string().contains("no complete checkpoint"));
        let missing = latest(&dir.join("nope")).unwrap_err().to_string();
        assert!(missing.contains("listing"), "{missing}");
        fs::remove_dir_all(&dir).unwrap();
    }
}
