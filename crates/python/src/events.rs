//! The lines a Python worker writes for `elasticps launch`: `elasticps.log(**metrics)`,
//! where it serves metrics, and, at `finish()`, the run's numbers. They are the
//! launcher's event stream ([`elasticps_runtime::events`]), written to the descriptor
//! `ELASTICPS_EVENTS_FD` names; nothing without it.

use std::collections::BTreeMap;
use std::sync::Mutex;

use elasticps_runtime::events::{Emitter, Event};

use crate::stats::RunStats;

/// The launcher's event pipe, opened on first use.
static SINK: Mutex<Option<Emitter>> = Mutex::new(None);

/// The last value of each metric logged (loss, samples), for the final report.
static LAST: Mutex<BTreeMap<String, f64>> = Mutex::new(BTreeMap::new());

fn emit(event: &Event) {
    let mut sink = SINK.lock().unwrap_or_else(|e| e.into_inner());
    let emitter = sink.get_or_insert_with(|| {
        Emitter::from_env(false).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "no launcher events");
            Emitter::new(false)
        })
    });
    emitter.emit(event);
}

/// This worker joined the job as `rank` (the launcher restarts it with that rank).
pub fn joined(rank: u32) {
    emit(&Event::Joined { rank });
}

/// Where this worker serves its Prometheus metrics.
pub fn metrics(rank: u32, addr: &str) {
    emit(&Event::Metrics { node: format!("worker {rank}"), addr: addr.to_string() });
}

/// `elasticps.log(**metrics)`.
pub fn log(rank: u32, step: u64, metrics: BTreeMap<String, f64>) {
    LAST.lock().unwrap_or_else(|e| e.into_inner()).extend(metrics.iter().map(|(k, v)| (k.clone(), *v)));
    emit(&Event::Log { rank, step, metrics });
}

/// The run's numbers, at `finish()`.
pub fn worker_done(s: &RunStats) {
    let last = LAST.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let samples = last.get("samples").map_or(0, |v| *v as u64);
    let loss = last.get("loss").copied().unwrap_or(f64::NAN);
    emit(&Event::WorkerDone(s.tally.report(s.rank, samples, loss, s.tally.train_s())));
}
