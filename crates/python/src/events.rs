//! The lines a Python worker writes for `elasticps launch`: `elasticps.log(**metrics)`,
//! where it serves metrics, and, at `finish()`, the run's numbers. They are the
//! launcher's event stream ([`elasticps_runtime::events`]), written to the descriptor
//! `ELASTICPS_EVENTS_FD` names; nothing without it.

use std::collections::BTreeMap;
use std::sync::Mutex;

use elasticps_runtime::events::{Emitter, Event, WorkerReport};

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
    let iterations = s.iterations();
    let per_iter = |ms: f64| if iterations > 0 { ms / iterations as f64 } else { f64::NAN };
    let mean = if s.iter_ms.is_empty() {
        f64::NAN
    } else {
        s.iter_ms.iter().map(|x| f64::from(*x)).sum::<f64>() / s.iter_ms.len() as f64
    };
    let p99 = {
        let mut v = s.iter_ms.clone();
        v.sort_by(f32::total_cmp);
        v.get(((v.len() as f64 * 0.99).ceil() as usize).saturating_sub(1)).map_or(f64::NAN, |x| f64::from(*x))
    };
    let comm_ms = s.comm.as_secs_f64() * 1e3;
    emit(&Event::WorkerDone(WorkerReport {
        rank: s.rank,
        iterations,
        samples: last.get("samples").map_or(0, |v| *v as u64),
        wait_ms: comm_ms,
        final_loss: last.get("loss").copied().unwrap_or(f64::NAN),
        train_s: s.iter_ms.iter().map(|x| f64::from(*x)).sum::<f64>() / 1e3,
        iter_ms_mean: mean,
        iter_ms_p99: p99,
        comm_ms_per_iter: per_iter(comm_ms),
        wait_ms_by_server: s.wait_by_server.iter().map(|d| d.as_secs_f64() * 1e3).collect(),
        started_unix_ms: s.started_unix_ms,
        iter_ms: s.iter_ms.clone(),
    }));
}
