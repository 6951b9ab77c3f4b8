//! The lines a Python worker writes for `elasticps launch`: `elasticps.log(**metrics)` and,
//! at `finish()`, the run's numbers, as JSON lines on the file descriptor the launcher
//! names in `ELASTICPS_EVENTS_FD` (nothing without it). The format is the launcher's
//! event stream (docs/PROTOCOL.md, "Launcher events").

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Mutex;

use crate::stats::RunStats;

/// The launcher's event pipe, opened once.
static SINK: Mutex<Option<Option<std::fs::File>>> = Mutex::new(None);

/// The last metrics logged (loss, samples) for the final report.
static LAST: Mutex<BTreeMap<String, f64>> = Mutex::new(BTreeMap::new());

/// Writes one event line, if the launcher asked for events.
fn emit(line: &serde_json::Value) {
    let mut sink = SINK.lock().unwrap_or_else(|e| e.into_inner());
    let file = sink.get_or_insert_with(open_sink);
    if let Some(f) = file {
        let mut text = line.to_string();
        text.push('\n');
        // One write per line, so lines from several threads never interleave.
        let _ = f.write_all(text.as_bytes());
    }
}

fn open_sink() -> Option<std::fs::File> {
    let fd: i32 = std::env::var("ELASTICPS_EVENTS_FD").ok()?.trim().parse().ok()?;
    // A duplicate, so that closing ours never closes the launcher's descriptor number
    // that the script may also use.
    // SAFETY: dup(2) on a descriptor number; -1 on failure.
    let dup = unsafe { libc::dup(fd) };
    if dup < 0 {
        tracing::warn!(fd, "ELASTICPS_EVENTS_FD is not an open file descriptor; no events");
        return None;
    }
    // SAFETY: `dup` is a fresh descriptor that this File alone owns.
    Some(unsafe { std::os::fd::FromRawFd::from_raw_fd(dup) })
}

/// Where this worker serves its Prometheus metrics.
pub fn metrics(rank: u32, addr: &str) {
    emit(&serde_json::json!({ "event": "metrics", "node": format!("worker {rank}"), "addr": addr }));
}

/// `elasticps.log(**metrics)`.
pub fn log(rank: u32, step: u64, metrics: BTreeMap<String, f64>) {
    {
        let mut last = LAST.lock().unwrap_or_else(|e| e.into_inner());
        last.extend(metrics.iter().map(|(k, v)| (k.clone(), *v)));
    }
    emit(&serde_json::json!({ "event": "log", "rank": rank, "step": step, "metrics": metrics }));
}

/// The run's numbers, at `finish()`.
pub fn worker_done(s: &RunStats) {
    let last = LAST.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let iterations = s.iterations();
    let mean =
        |v: &[f32]| if v.is_empty() { f64::NAN } else { v.iter().map(|x| f64::from(*x)).sum::<f64>() / v.len() as f64 };
    let p99 = {
        let mut v = s.iter_ms.clone();
        v.sort_by(f32::total_cmp);
        v.get(((v.len() as f64 * 0.99).ceil() as usize).saturating_sub(1)).map_or(f64::NAN, |x| f64::from(*x))
    };
    let comm_ms = s.comm.as_secs_f64() * 1e3;
    let train_s = s.iter_ms.iter().map(|x| f64::from(*x)).sum::<f64>() / 1e3;
    emit(&serde_json::json!({
        "event": "worker_done",
        "rank": s.rank,
        "iterations": iterations,
        "samples": last.get("samples").copied().unwrap_or(0.0) as u64,
        "wait_ms": comm_ms,
        "final_loss": last.get("loss").copied().unwrap_or(f64::NAN),
        "train_s": train_s,
        "iter_ms_mean": mean(&s.iter_ms),
        "iter_ms_p99": p99,
        "comm_ms_per_iter": if iterations > 0 { comm_ms / iterations as f64 } else { f64::NAN },
        "wait_ms_by_server": s.wait_by_server.iter().map(|d| d.as_secs_f64() * 1e3).collect::<Vec<_>>(),
        "started_unix_ms": s.started_unix_ms,
        "iter_ms": s.iter_ms,
    }));
}
