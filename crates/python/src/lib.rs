//! The native half of the `elasticps` Python package (`elasticps._native`): the Rust
//! worker client ([`elasticps_runtime::client::Client`]) behind a numpy API.
//!
//! - `worker`: `Worker` (register_model, pull, push, push_pull, the asynchronous forms,
//!   set_optimizer, optimizer_state, set_optimizer_state, set_values, barrier, finish) and
//!   `Handle`.
//! - `actor`: the task that owns the client on the runtime and batches pushes queued
//!   back to back.
//! - `arrays`: borrowing numpy buffers without a copy (float32, C-contiguous only).
//! - `runtime`: one process-wide tokio runtime, the fork guard, waiting with the GIL
//!   released and Ctrl-C let through.
//! - `cancel`: a command that borrows arrays is cancelled on Ctrl-C and waited out, so
//!   that Python never gets an array back while the client still uses it.
//! - `events`, `stats`: what a worker reports to `elasticps launch`.
//!
//! The Python side (`python/elasticps/`) adds the process's default worker and
//! `elasticps.torch.DistributedOptimizer`.

mod actor;
mod arrays;
mod cancel;
mod cli;
mod events;
mod rows;
mod runtime;
mod stats;
mod worker;

use std::collections::BTreeMap;
use std::sync::Once;
use std::time::Duration;

use elasticps_runtime::client::ClientOptions;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

pyo3::create_exception!(
    _native,
    ElasticpsError,
    PyRuntimeError,
    "An elasticps operation failed; the message names the server, block and clock involved."
);

/// Reads `ELASTICPS_<NAME>` as a number, or `default`.
fn env_number<T: std::str::FromStr>(name: &str, default: T) -> PyResult<T> {
    match std::env::var(name) {
        Ok(v) => {
            v.trim().parse().map_err(|_| PyValueError::new_err(format!("elasticps: {name}={v:?} is not a number")))
        }
        Err(_) => Ok(default),
    }
}

/// Connects to the scheduler (`scheduler`, else `ELASTICPS_SCHEDULER`, else
/// 127.0.0.1:7000) with the transport settings of the roles' environment variables
/// (`ELASTICPS_SECRET`, or `ELASTICPS_WORKER_SECRET` alone for a worker that holds only the
/// worker secret, `ELASTICPS_MAX_FRAME_MIB`, `ELASTICPS_REQUEST_TIMEOUT`, `ELASTICPS_WIRE_DTYPE`
/// (f32, bf16, fp16: the job's dtype on the wire), `ELASTICPS_COMPRESS` (`topk:0.01`,
/// `randomk:0.01`: the job's gradient compression), and TLS from
/// `ELASTICPS_TLS_CERT`, `ELASTICPS_TLS_KEY`, `ELASTICPS_TLS_CA`), joins the
/// job and returns the worker. `ELASTICPS_METRICS_LISTEN=HOST:PORT` serves its Prometheus
/// metrics there. `ELASTICPS_RANK=R` (the launcher's `--restart-workers` sets it) rejoins
/// the job as rank R, a worker restarted after it was lost: its `start_clock` is where the
/// job is. `ELASTICPS_HOST_GROUP`, `ELASTICPS_HOST_GROUP_SIZE` and `ELASTICPS_HOST_GROUP_RANK`
/// (set by `elasticps launch` on a job across hosts) put it in its host's group: one push
/// per host.
#[pyfunction]
#[pyo3(signature = (scheduler=None))]
fn connect(py: Python<'_>, scheduler: Option<String>) -> PyResult<worker::Worker> {
    static LOGS: Once = Once::new();
    LOGS.call_once(|| {
        let filter = std::env::var("ELASTICPS_LOG").unwrap_or_else(|_| "warn".into());
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .try_init();
    });
    let scheduler =
        scheduler.or_else(|| std::env::var("ELASTICPS_SCHEDULER").ok()).unwrap_or_else(|| "127.0.0.1:7000".into());
    let secret = std::env::var("ELASTICPS_SECRET").unwrap_or_default();
    let max_frame_mib: u32 = env_number("ELASTICPS_MAX_FRAME_MIB", 64)?;
    let request_timeout_s: u64 = env_number("ELASTICPS_REQUEST_TIMEOUT", 300)?;
    install_tls()?;
    let mut opts = ClientOptions::new(scheduler);
    let worker_secret = std::env::var("ELASTICPS_WORKER_SECRET").ok();
    let max_payload = max_frame_mib.saturating_mul(1 << 20);
    opts.codec =
        elasticps_wire::Codec::for_worker(secret.as_bytes(), worker_secret.as_deref().map(str::as_bytes), max_payload);
    opts.request_timeout = Duration::from_secs(request_timeout_s.max(1));
    if let Some(dtype) = env_parsed("ELASTICPS_WIRE_DTYPE")? {
        opts.wire_dtype = dtype;
    }
    opts.compress = env_parsed("ELASTICPS_COMPRESS")?;
    // Set by `elasticps launch` on a job across hosts: one push per host.
    opts.group = elasticps_runtime::client::GroupOptions::from_env()
        .map_err(|e| PyValueError::new_err(format!("elasticps: {e}")))?;
    // Set by the launcher's --restart-workers: rejoin as this rank.
    opts.rank = match std::env::var("ELASTICPS_RANK") {
        Ok(v) => Some(
            v.trim()
                .parse()
                .map_err(|_| PyValueError::new_err(format!("elasticps: ELASTICPS_RANK={v:?} is not a rank")))?,
        ),
        Err(_) => None,
    };
    let metrics_listen = std::env::var("ELASTICPS_METRICS_LISTEN").ok().filter(|s| !s.is_empty());
    worker::Worker::connect(py, opts, metrics_listen)
}

/// Environment variable `name` parsed (a wire dtype, a sparsifier), if set and not empty;
/// a `ValueError` naming it if it does not parse.
fn env_parsed<T: std::str::FromStr<Err = elasticps_core::CoreError>>(name: &str) -> PyResult<Option<T>> {
    match std::env::var(name) {
        Ok(v) if !v.is_empty() => {
            v.parse().map(Some).map_err(|e| PyValueError::new_err(format!("elasticps: {name}={v:?}: {e}")))
        }
        _ => Ok(None),
    }
}

/// TLS from `ELASTICPS_TLS_CERT`, `ELASTICPS_TLS_KEY` and `ELASTICPS_TLS_CA` (set by
/// `elasticps launch --tls-*`): all three or none.
fn install_tls() -> PyResult<()> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(std::path::PathBuf::from);
    let tls = match (var("ELASTICPS_TLS_CERT"), var("ELASTICPS_TLS_KEY"), var("ELASTICPS_TLS_CA")) {
        (None, None, None) => None,
        (Some(c), Some(k), Some(a)) => Some(std::sync::Arc::new(
            elasticps_runtime::tls::TlsConfig::from_files(&c, &k, &a)
                .map_err(|e| PyValueError::new_err(format!("elasticps: {e}")))?,
        )),
        _ => {
            return Err(PyValueError::new_err(
                "elasticps: TLS needs ELASTICPS_TLS_CERT, ELASTICPS_TLS_KEY and ELASTICPS_TLS_CA together",
            ));
        }
    };
    elasticps_runtime::tls::install(tls);
    Ok(())
}

/// Writes a `log` event (`elasticps.log(**metrics)`) for the launcher.
#[pyfunction]
fn log_event(rank: u32, step: u64, metrics: &Bound<'_, PyDict>) -> PyResult<()> {
    let mut m = BTreeMap::new();
    for (k, v) in metrics.iter() {
        let key: String = k.extract()?;
        let value: f64 = v.extract().map_err(|_| {
            PyValueError::new_err(format!(
                "elasticps.log: {key} must be a number, got {}",
                v.get_type().name().map_or_else(|_| "?".into(), |n| n.to_string())
            ))
        })?;
        m.insert(key, value);
    }
    events::log(rank, step, m);
    Ok(())
}

/// The module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(connect, m)?)?;
    m.add_function(wrap_pyfunction!(log_event, m)?)?;
    m.add_function(wrap_pyfunction!(cli::cli_main, m)?)?;
    m.add_class::<worker::Worker>()?;
    m.add_class::<worker::Handle>()?;
    m.add("ElasticpsError", m.py().get_type::<ElasticpsError>())?;
    Ok(())
}
