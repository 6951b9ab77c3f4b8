//! `elasticps.Worker`: the numpy-level client, and `Handle`, what an asynchronous call
//! returns.

use std::collections::HashMap;
use std::mem::ManuallyDrop;

use elasticps_core::compress::Sparsifier;
use elasticps_core::dtype::Dtype;
use elasticps_core::model::{Init, TensorSpec};
use elasticps_core::optimizer::{OptState, OptimizerKind, TensorOptimizer};
use elasticps_core::sync::Clock;
use elasticps_runtime::client::ClientOptions;
use elasticps_runtime::metrics::{MetricsEndpoint, WorkerMetrics};
use numpy::PyArray1;
use pyo3::exceptions::{PyKeyError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use tokio::sync::{mpsc, oneshot};

use crate::actor::{self, Cmd};
use crate::arrays::{self, Checked, Dst, Keep, Src};
use crate::cancel::{self, Ticket};
use crate::rows::{self, Table};
use crate::runtime::{self, Interrupted, wait, wait_call};
use crate::stats::RunStats;
use crate::{ElasticpsError, events};

/// A worker of a running job: connects to the scheduler, then pushes gradients and pulls
/// parameters of the model it registered.
#[pyclass(module = "elasticps._native")]
pub struct Worker {
    rank: u32,
    size: u32,
    /// The job's first clock: 0, or the clock of the checkpoint it resumed from.
    start_clock: Clock,
    /// The process that connected (a forked child must not use the client).
    pid: u32,
    /// Forgotten, not dropped, in a forked child (dropping it could wake a runtime
    /// thread that does not exist there).
    tx: ManuallyDrop<mpsc::UnboundedSender<Cmd>>,
    /// The model's tensors, once registered: name -> (index, length).
    tensors: HashMap<String, (usize, usize)>,
    names: Vec<String>,
    /// The model's embedding tables, once registered: name -> index, rows, dim.
    tables: HashMap<String, Table>,
    table_names: Vec<String>,
    /// register_model succeeded.
    registered: bool,
    finished: bool,
    /// Where the worker's Prometheus metrics are served, if they are.
    metrics_addr: Option<String>,
}

impl Drop for Worker {
    fn drop(&mut self) {
        if !runtime::forked_from(self.pid) {
            // SAFETY: dropped once, here; never used again.
            unsafe { ManuallyDrop::drop(&mut self.tx) };
        }
    }
}

/// What an asynchronous push or pull returns: `wait()` blocks until it is done.
#[pyclass(module = "elasticps._native")]
pub struct Handle {
    rx: Option<oneshot::Receiver<Result<(), String>>>,
    /// The outcome, once `done()` or an interrupted `wait()` saw it.
    outcome: Option<Result<(), String>>,
    /// Cancels the operation when a `wait()` is interrupted.
    ticket: Ticket,
    what: String,
    pid: u32,
}

impl Handle {
    fn new(rx: oneshot::Receiver<Result<(), String>>, ticket: Ticket, what: String, pid: u32) -> Self {
        Self { rx: Some(rx), outcome: None, ticket, what, pid }
    }
}

#[pymethods]
impl Handle {
    /// Waits until the operation is done; raises its error if it failed. A second call
    /// returns (or raises the same error) at once. Interrupted (Ctrl-C), it cancels the operation and waits until
    /// the client has let go of the array before `KeyboardInterrupt` is raised; a later
    /// `wait()` then raises `ElasticpsError` unless the operation had completed.
    fn wait(&mut self, py: Python<'_>) -> PyResult<()> {
        runtime::check_not_forked(self.pid)?;
        if let Some(outcome) = &self.outcome {
            return outcome.clone().map_err(ElasticpsError::new_err);
        }
        let Some(rx) = self.rx.take() else { return Ok(()) };
        match runtime::wait_borrowing(py, rx, &self.ticket)? {
            Ok(got) => {
                let r = runtime::replied(&self.what, got);
                if let Err(e) = &r {
                    self.outcome = Some(Err(e.value(py).to_string()));
                }
                r
            }
            Err(Interrupted { error, reply }) => {
                self.outcome = Some(match reply {
                    Some(Ok(())) => Ok(()),
                    _ => Err(cancel::interrupted(&self.what)),
                });
                Err(error)
            }
        }
    }

    /// True once the operation has finished (successfully or not); never blocks.
    fn done(&mut self) -> bool {
        let Some(rx) = &mut self.rx else { return true };
        match rx.try_recv() {
            Ok(outcome) => {
                self.outcome = Some(outcome);
                self.rx = None;
                true
            }
            Err(oneshot::error::TryRecvError::Empty) => false,
            Err(oneshot::error::TryRecvError::Closed) => true,
        }
    }

    fn __repr__(&self) -> String {
        format!("<elasticps.Handle {}>", self.what)
    }
}

/// A push's gradients as the actor takes them (tensor, borrowed values; an empty one for
/// no gradient), with the arrays checked (to refuse aliasing with what the call writes).
type Grads<'py> = (Vec<(usize, Src)>, Vec<Checked<'py>>);

impl Worker {
    /// Connects to the scheduler with `opts`, joins the job and asks its first clock; with
    /// `metrics_listen`, serves the worker's Prometheus metrics there (`/metrics`) while
    /// it runs.
    pub fn connect(py: Python<'_>, mut opts: ClientOptions, metrics_listen: Option<String>) -> PyResult<Self> {
        let rt = runtime::runtime()?;
        let mut endpoint = None;
        if let Some(listen) = metrics_listen {
            let metrics = WorkerMetrics::new();
            let bound = py.detach(|| rt.block_on(MetricsEndpoint::bind(&listen, metrics.clone())));
            endpoint =
                Some(bound.map_err(|e| ElasticpsError::new_err(format!("elasticps: ELASTICPS_METRICS_LISTEN: {e}")))?);
            opts.metrics = Some(metrics);
        }
        let metrics_addr = endpoint.as_ref().map(|e| e.addr().to_string());
        let (tx, rx) = mpsc::unbounded_channel();
        let (ready, joined) = oneshot::channel();
        let scheduler = opts.scheduler.clone();
        rt.spawn(actor::run(opts, endpoint, ready, rx));
        let actor::Joined { rank, size, start_clock } =
            wait(py, &format!("joining the job of the scheduler at {scheduler}"), joined)?;
        events::joined(rank);
        if let Some(addr) = &metrics_addr {
            events::metrics(rank, addr);
        }
        Ok(Worker {
            metrics_addr,
            rank,
            size,
            start_clock,
            pid: std::process::id(),
            tx: ManuallyDrop::new(tx),
            tensors: HashMap::new(),
            names: Vec::new(),
            tables: HashMap::new(),
            table_names: Vec::new(),
            registered: false,
            finished: false,
        })
    }

    /// Sends a command; the reply comes on the returned receiver.
    fn send<T>(&self, make: impl FnOnce(actor::Reply<T>) -> Cmd) -> PyResult<oneshot::Receiver<Result<T, String>>> {
        runtime::check_not_forked(self.pid)?;
        if self.finished {
            return Err(ElasticpsError::new_err(format!("elasticps: worker {} has finished", self.rank)));
        }
        let (done, rx) = oneshot::channel();
        self.tx
            .send(make(done))
            .map_err(|_| ElasticpsError::new_err(format!("elasticps: worker {}'s client has stopped", self.rank)))?;
        Ok(rx)
    }

    /// The index and length of tensor `name`.
    fn tensor(&self, name: &str) -> PyResult<(usize, usize)> {
        if !self.registered {
            return Err(ElasticpsError::new_err("elasticps: call register_model first"));
        }
        self.tensors.get(name).copied().ok_or_else(|| {
            let table = if self.tables.contains_key(name) {
                " (it is a table: use pull_rows and push_rows)".to_string()
            } else {
                String::new()
            };
            PyKeyError::new_err(format!("elasticps: the model has no tensor {name:?}{table} (it has {:?})", self.names))
        })
    }

    /// Table `name`: its index, rows and dim; `ValueError` for a name that is not one.
    fn table(&self, name: &str) -> PyResult<Table> {
        if !self.registered {
            return Err(ElasticpsError::new_err("elasticps: call register_model first"));
        }
        self.tables.get(name).copied().ok_or_else(|| {
            let tensor =
                if self.tensors.contains_key(name) { " (it is a dense tensor: use pull and push)" } else { "" };
            PyValueError::new_err(format!(
                "elasticps: the model has no table {name:?}{tensor} (its tables: {:?})",
                self.table_names
            ))
        })
    }

    /// Checks every array of `arrays` (the call's argument `arg`: a dict name -> ndarray)
    /// for reading or (`writes`) writing, without borrowing it yet.
    fn check_dict<'py>(
        &self,
        arrays: &Bound<'py, PyDict>,
        arg: &str,
        writes: bool,
    ) -> PyResult<Vec<(usize, Checked<'py>)>> {
        let mut out = Vec::with_capacity(arrays.len());
        for (k, v) in arrays.iter() {
            let name: String = k.extract().map_err(|_| PyTypeError::new_err("elasticps: tensor names must be str"))?;
            let (t, len) = self.tensor(&name)?;
            let label = format!("{arg}[{name:?}]");
            let checked =
                if writes { Checked::write(&v, &name, label, len)? } else { Checked::read(&v, &name, label, len)? };
            out.push((t, checked));
        }
        Ok(out)
    }

    /// Checks the arrays of a push's dict (name -> array, or `None` for no gradient) and
    /// borrows them for reading, kept alive by `keep`; also returns the arrays checked.
    fn check_grads<'py>(&self, grads: &Bound<'py, PyDict>, keep: &mut Keep) -> PyResult<Grads<'py>> {
        let mut src = Vec::with_capacity(grads.len());
        let mut read = Vec::with_capacity(grads.len());
        for (k, v) in grads.iter() {
            let name: String = k.extract().map_err(|_| PyTypeError::new_err("elasticps: tensor names must be str"))?;
            let (t, len) = self.tensor(&name)?;
            if v.is_none() {
                src.push((t, Src::none()));
                continue;
            }
            let checked = Checked::read(&v, &name, format!("grads[{name:?}]"), len)?;
            src.push((t, checked.source(keep)));
            read.push(checked);
        }
        Ok((src, read))
    }

    /// Checks and copies a row push's arrays and queues it.
    fn start_push_rows(
        &self,
        clock: Clock,
        name: &str,
        ids: &Bound<'_, PyAny>,
        grads: &Bound<'_, PyAny>,
    ) -> PyResult<(oneshot::Receiver<Result<(), String>>, Ticket)> {
        let table = self.table(name)?;
        let (ids, grads) = if grads.is_none() {
            // No gradient for the table this step (torch's `grad is None`).
            if !ids.is_none() {
                return Err(PyValueError::new_err(format!(
                    "elasticps: push_rows of {name:?} without grads (None: the table got no gradient) takes ids=None"
                )));
            }
            (Vec::new(), None)
        } else {
            let ids = rows::ids(ids, name, table)?;
            let grads = rows::grads(grads, name, ids.len(), table)?;
            (ids, Some(grads))
        };
        let ticket = Ticket::new();
        let rx =
            self.send(|done| Cmd::PushRows { clock, table: table.index, ids, grads, ticket: ticket.clone(), done })?;
        Ok((rx, ticket))
    }

    /// Queues a round; its reply comes on the receiver, and the ticket cancels it.
    fn round(
        &self,
        push: Option<(Clock, Vec<(usize, Src)>)>,
        pull: Option<(Clock, Vec<(usize, Dst)>)>,
        keep: Keep,
    ) -> PyResult<(oneshot::Receiver<Result<(), String>>, Ticket)> {
        let ticket = Ticket::new();
        let rx = self.send(|done| Cmd::Round { push, pull, keep, ticket: ticket.clone(), done })?;
        Ok((rx, ticket))
    }
}

#[pymethods]
impl Worker {
    /// This worker's rank, `0..size`.
    #[getter]
    fn rank(&self) -> u32 {
        self.rank
    }

    /// Number of workers in the job.
    #[getter]
    fn size(&self) -> u32 {
        self.size
    }

    /// The job's first clock: 0, or the clock of the checkpoint the job resumed from
    /// (`--resume DIR`). A resumed worker goes on from it: `register_model` fills the
    /// arrays with the parameters of this clock, and the first push is of this clock
    /// (`for t in range(w.start_clock, steps)`).
    #[getter]
    fn start_clock(&self) -> Clock {
        self.start_clock
    }

    /// `host:port` of this worker's Prometheus metrics (`ELASTICPS_METRICS_LISTEN`), or None.
    #[getter]
    fn metrics_addr(&self) -> Option<String> {
        self.metrics_addr.clone()
    }

    /// The model's tensor names, in order (empty before `register_model`).
    fn tensor_names(&self) -> Vec<String> {
        self.names.clone()
    }

    /// The model's table names, in order (empty before `register_model`).
    fn table_names(&self) -> Vec<String> {
        self.table_names.clone()
    }

    /// Defines the model from `tensors` (a dict name -> float32 ndarray, in order) and
    /// waits until every server holds its blocks. In a fresh job rank 0's values become
    /// every worker's initial parameters; in a resumed job (`start_clock > 0`) the
    /// checkpoint's are, and no values are sent. Either way they are written in place into
    /// each worker's arrays (the parameters of clock `start_clock`).
    /// `optimizers` maps tensor names to server-side optimizers (dicts with `kind`
    /// "sgd", "momentum", "adam" or "adamw", `lr`, and `momentum`, `betas`, `eps`,
    /// `weight_decay`); tensors not named use the job's `--optimizer` and `--lr`.
    /// `tables` declares embedding tables, name -> `(rows, dim)` or `(rows, dim, init)`
    /// (`init` a dict: `kind` "normal" with `mean`, `std`; "uniform" with `low`, `high`;
    /// "constant" with `value`; default N(0, 1), torch.nn.Embedding's): the servers
    /// create a row when it is first used. A table's optimizer is named in `optimizers`
    /// too (`kind` "sgd", "adagrad", "sparse_adam" or "lazy_adam"; default sgd with lr
    /// 0.01). No table values are sent: its rows are read with `pull_rows`.
    #[pyo3(signature = (tensors, optimizers=None, tables=None))]
    fn register_model(
        &mut self,
        py: Python<'_>,
        tensors: &Bound<'_, PyDict>,
        optimizers: Option<&Bound<'_, PyDict>>,
        tables: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<()> {
        if self.registered {
            return Err(ElasticpsError::new_err("elasticps: register_model was already called"));
        }
        let mut table_specs = Vec::new();
        for (k, v) in tables.into_iter().flat_map(|t| t.iter()) {
            let name: String = k.extract().map_err(|_| PyTypeError::new_err("elasticps: table names must be str"))?;
            if tensors.contains(&name)? {
                return Err(PyValueError::new_err(format!("elasticps: {name:?} names both a tensor and a table")));
            }
            table_specs.push(rows::parse_table(name, &v)?);
        }
        if tensors.is_empty() && table_specs.is_empty() {
            return Err(PyValueError::new_err("elasticps: register_model needs at least one tensor or table"));
        }
        let mut specs = Vec::with_capacity(tensors.len());
        let mut checked = Vec::with_capacity(tensors.len());
        for (k, v) in tensors.iter() {
            let name: String = k.extract().map_err(|_| PyTypeError::new_err("elasticps: tensor names must be str"))?;
            let shape = arrays::shape(&v, &name)?;
            let len = shape.iter().product();
            // Every array is written (the parameters of the first clock come back in it).
            checked.push(Checked::write(&v, &name, format!("tensors[{name:?}]"), len)?);
            specs.push(TensorSpec { name, shape, init: Init::Zeros });
        }
        arrays::refuse_aliasing("register_model", &checked.iter().collect::<Vec<_>>())?;
        let mut keep = Keep::new();
        // Rank 0's values are read (and sent) before the pull writes the arrays.
        let init: Vec<Src> = if self.rank == 0 && self.start_clock == 0 {
            checked.iter().map(|c| c.source(&mut keep)).collect()
        } else {
            Vec::new()
        };
        let pull: Vec<Dst> = checked.iter().map(|c| c.destination(&mut keep)).collect();
        let mut opts = Vec::new();
        if let Some(optimizers) = optimizers {
            opts = vec![None; specs.len()];
            for (k, v) in optimizers.iter() {
                let name: String = k.extract()?;
                if let Some(table) = table_specs.iter_mut().find(|t| t.name == name) {
                    table.optimizer = rows::parse_sparse_optimizer(&v, &name)?;
                    continue;
                }
                let t = specs.iter().position(|s| s.name == name).ok_or_else(|| {
                    PyKeyError::new_err(format!(
                        "elasticps: optimizers names {name:?}, which is not a tensor or table of the model"
                    ))
                })?;
                opts[t] = Some(parse_optimizer(&v, &name)?);
            }
        }
        let names: Vec<String> = specs.iter().map(|s| s.name.clone()).collect();
        let lens: Vec<usize> = specs.iter().map(TensorSpec::len).collect();
        let tables: Vec<(String, Table)> = table_specs
            .iter()
            .enumerate()
            .map(|(i, t)| {
                (t.name.clone(), Table { index: i as u32, rows: t.rows, dim: t.dim as usize, hashed: t.is_hashed() })
            })
            .collect();
        let start = self.start_clock;
        let ticket = Ticket::new();
        let rx = self.send(|done| Cmd::Register {
            tensors: specs,
            optimizers: opts,
            tables: table_specs,
            init,
            start,
            pull,
            keep,
            ticket: ticket.clone(),
            done,
        })?;
        wait_call(py, "registering the model", rx, &ticket)?;
        self.tensors = names.iter().cloned().zip(lens).enumerate().map(|(i, (n, l))| (n, (i, l))).collect();
        self.names = names;
        self.table_names = tables.iter().map(|(n, _)| n.clone()).collect();
        self.tables = tables.into_iter().collect();
        self.registered = true;
        Ok(())
    }

    /// Pulls rows `ids` (a 1-D int64 array, each in `0..rows`; repeats allowed) of table
    /// `name` at clock `clock` into `out` (float32, shape `(len(ids), dim)`, C-contiguous),
    /// row after row in the order asked. Each server holds the pull as its sync policy
    /// says. Bad arguments raise `TypeError` or `ValueError` before anything is sent.
    fn pull_rows(
        &self,
        py: Python<'_>,
        clock: Clock,
        name: &str,
        ids: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let table = self.table(name)?;
        let ids = rows::ids(ids, name, table)?;
        let out = rows::out(out, name, ids.len(), table)?;
        let ticket = Ticket::new();
        let rx = self.send(|done| Cmd::PullRows { clock, table: table.index, ids, ticket: ticket.clone(), done })?;
        let got = wait_call(py, &format!("worker {} pulls rows of {name:?} at clock {clock}", self.rank), rx, &ticket)?;
        rows::fill(&out, &got)
    }

    /// Pushes the gradient rows `grads` (float32, `(len(ids), dim)`) of rows `ids` (1-D
    /// int64) of table `name` at clock `clock`; a row named twice gets the sum. Push every
    /// table once per clock, with empty `ids` and `grads` of shape `(0, dim)` for a table
    /// the step used but whose rows here it did not touch (the optimizer still steps, as
    /// torch's does), and `ids=None, grads=None` for a table the step did not use at all
    /// (no step, as torch skips a parameter whose `grad` is None): every row range counts
    /// the clock either way.
    fn push_rows(
        &self,
        py: Python<'_>,
        clock: Clock,
        name: &str,
        ids: &Bound<'_, PyAny>,
        grads: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (rx, ticket) = self.start_push_rows(clock, name, ids, grads)?;
        wait_call(py, &format!("worker {} pushes rows of {name:?} at clock {clock}", self.rank), rx, &ticket)
    }

    /// Starts `push_rows` and returns at once (the arrays are copied first: they may be
    /// changed right away).
    fn push_rows_async(
        &self,
        clock: Clock,
        name: &str,
        ids: &Bound<'_, PyAny>,
        grads: &Bound<'_, PyAny>,
    ) -> PyResult<Handle> {
        let (rx, ticket) = self.start_push_rows(clock, name, ids, grads)?;
        Ok(Handle::new(rx, ticket, format!("push_rows(clock {clock}) of {name:?}"), self.pid))
    }

    /// Pulls the parameters of clock `clock` into the arrays of `out` (a dict name ->
    /// float32 ndarray; every tensor or some), in place. The server may hold the pull as
    /// its sync policy says. Two arrays of `out` that share memory are refused
    /// (`ValueError`).
    fn pull(&self, py: Python<'_>, clock: Clock, out: &Bound<'_, PyDict>) -> PyResult<()> {
        let dst = self.check_dict(out, "out", true)?;
        arrays::refuse_aliasing("pull", &dst.iter().map(|(_, c)| c).collect::<Vec<_>>())?;
        let mut keep = Keep::new();
        let dst = dst.iter().map(|(t, c)| (*t, c.destination(&mut keep))).collect();
        let (rx, ticket) = self.round(None, Some((clock, dst)), keep)?;
        wait_call(py, &format!("worker {} pulls clock {clock}", self.rank), rx, &ticket)
    }

    /// Pushes the gradients of clock `clock` (a dict name -> float32 ndarray, or `None`
    /// for a tensor that got no gradient this step: the servers count the push and apply
    /// nothing).
    fn push(&self, py: Python<'_>, clock: Clock, grads: &Bound<'_, PyDict>) -> PyResult<()> {
        // Only read: arrays that share memory are fine.
        let mut keep = Keep::new();
        let (src, _) = self.check_grads(grads, &mut keep)?;
        let (rx, ticket) = self.round(Some((clock, src)), None, keep)?;
        wait_call(py, &format!("worker {} pushes clock {clock}", self.rank), rx, &ticket)
    }

    /// Pushes the gradients of clock `clock` and pulls the parameters of clock `clock + 1`
    /// into `out`, overlapping the two per server (`grads` as in `push`). An array of
    /// `out` that shares memory with another array of `out` or `grads` is refused
    /// (`ValueError`).
    fn push_pull(
        &self,
        py: Python<'_>,
        clock: Clock,
        grads: &Bound<'_, PyDict>,
        out: &Bound<'_, PyDict>,
    ) -> PyResult<()> {
        let next = clock.checked_add(1).ok_or_else(|| PyValueError::new_err("elasticps: clock overflow"))?;
        let mut keep = Keep::new();
        let (src, read) = self.check_grads(grads, &mut keep)?;
        let dst = self.check_dict(out, "out", true)?;
        arrays::refuse_aliasing("push_pull", &read.iter().chain(dst.iter().map(|(_, c)| c)).collect::<Vec<_>>())?;
        let dst = dst.iter().map(|(t, c)| (*t, c.destination(&mut keep))).collect();
        let (rx, ticket) = self.round(Some((clock, src)), Some((next, dst)), keep)?;
        let what = format!("worker {} pushes clock {clock} and pulls clock {next}", self.rank);
        wait_call(py, &what, rx, &ticket)
    }

    /// Starts pushing the gradient of tensor `name` at clock `clock` and returns at once.
    /// Do not change `grad` before the handle's `wait()` returned. `grad` `None`: the
    /// tensor got no gradient this step (a parameter unused in the forward pass); the
    /// servers count the push for the clock and apply nothing.
    fn push_async(&self, clock: Clock, name: &str, grad: &Bound<'_, PyAny>) -> PyResult<Handle> {
        let (t, len) = self.tensor(name)?;
        let mut keep = Keep::new();
        let src = if grad.is_none() { Src::none() } else { arrays::source(grad, name, len, &mut keep)? };
        let (rx, ticket) = self.round(Some((clock, vec![(t, src)])), None, keep)?;
        Ok(Handle::new(rx, ticket, format!("push(clock {clock}) of {name:?}"), self.pid))
    }

    /// Starts pulling tensor `name` at clock `clock` into `out` and returns at once. Do
    /// not read `out` before the handle's `wait()` returned.
    fn pull_async(&self, clock: Clock, name: &str, out: &Bound<'_, PyAny>) -> PyResult<Handle> {
        let (t, len) = self.tensor(name)?;
        let mut keep = Keep::new();
        let dst = arrays::destination(out, name, len, &mut keep)?;
        let (rx, ticket) = self.round(None, Some((clock, vec![(t, dst)])), keep)?;
        Ok(Handle::new(rx, ticket, format!("pull(clock {clock}) of {name:?}"), self.pid))
    }

    /// Tensor `name`'s gradients and pulled values travel in `dtype` from now on ("f32",
    /// "bf16" or "fp16"), its gradients compressed by `sparsify` ("topk:0.01",
    /// "randomk:0.01", with error feedback; None: pushed whole)
    /// (`DistributedOptimizer(compression=...)`; the job's defaults are
    /// `ELASTICPS_WIRE_DTYPE` and `ELASTICPS_COMPRESS`). The servers keep float32 values
    /// and optimizer state.
    #[pyo3(signature = (name, dtype, sparsify=None))]
    fn set_compression(&self, py: Python<'_>, name: &str, dtype: &str, sparsify: Option<&str>) -> PyResult<()> {
        let (t, _) = self.tensor(name)?;
        let bad = |e: elasticps_core::CoreError| PyValueError::new_err(format!("elasticps: {e}"));
        let dtype: Dtype = dtype.parse().map_err(bad)?;
        let sparsifier = sparsify.map(str::parse::<Sparsifier>).transpose().map_err(bad)?;
        let rx = self.send(|done| Cmd::SetCompression { tensor: t as u32, dtype, sparsifier, done })?;
        wait(py, &format!("setting the compression of {name:?}"), rx)
    }

    /// Gives tensor `name` a new server-side optimizer (a dict as in `register_model`),
    /// e.g. a learning-rate schedule's next value. Every push sent after this returns
    /// uses it.
    fn set_optimizer(&self, py: Python<'_>, name: &str, optimizer: &Bound<'_, PyAny>) -> PyResult<()> {
        let (t, _) = self.tensor(name)?;
        let optimizer = parse_optimizer(optimizer, name)?;
        let rx = self.send(|done| Cmd::SetOptimizer { tensor: t as u32, optimizer, done })?;
        wait(py, &format!("setting the optimizer of {name:?}"), rx)
    }

    /// The server-side optimizer state of tensor `name` (what a PyTorch optimizer's
    /// `state_dict` carries): a dict with `steps` (optimizer steps taken), `m` (the
    /// momentum buffer or Adam's first moment) and `v` (Adam's second moment), each a
    /// float32 array of the tensor's size, or None when the optimizer keeps none or took
    /// no step yet. Ask between steps (after `pull`): under bsp every push of the clocks
    /// before is applied then.
    fn optimizer_state<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyDict>> {
        let (t, _) = self.tensor(name)?;
        let rx = self.send(|done| Cmd::GetOptState { tensor: t as u32, done })?;
        let state: OptState = wait(py, &format!("the servers to send the optimizer state of {name:?}"), rx)?;
        let out = PyDict::new(py);
        out.set_item("steps", state.steps)?;
        let array = |v: Vec<f32>| -> PyResult<Py<PyAny>> {
            Ok(if v.is_empty() { py.None() } else { PyArray1::from_vec(py, v).into_any().unbind() })
        };
        out.set_item("m", array(state.m)?)?;
        out.set_item("v", array(state.v)?)?;
        Ok(out)
    }

    /// Replaces the server-side optimizer state of tensor `name` (a PyTorch optimizer's
    /// `load_state_dict`): `steps` taken, and `m`, `v` as `optimizer_state` returns them
    /// (float32 arrays of the tensor's size, or None for no state). Refused while the
    /// tensor's blocks migrate, and in a job with `--replicas`.
    #[pyo3(signature = (name, steps, m=None, v=None))]
    fn set_optimizer_state(
        &self,
        py: Python<'_>,
        name: &str,
        steps: u64,
        m: Option<&Bound<'_, PyAny>>,
        v: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let (t, len) = self.tensor(name)?;
        let values = |what: &str, a: Option<&Bound<'_, PyAny>>| -> PyResult<Vec<f32>> {
            let Some(a) = a.filter(|a| !a.is_none()) else { return Ok(Vec::new()) };
            let label = format!("{what} of {name:?}");
            let checked = arrays::Checked::read(a, name, label, len)?;
            checked.to_vec()
        };
        let state = OptState { steps, m: values("m", m)?, v: values("v", v)? };
        let rx = self.send(|done| Cmd::SetOptState { tensor: t as u32, state, done })?;
        wait(py, &format!("the servers to take the optimizer state of {name:?}"), rx)
    }

    /// Overwrites the values of tensor `name` on the servers with `values` (a float32
    /// array of the tensor's size), leaving its optimizer and clock state alone: one
    /// worker's buffers (BatchNorm's running statistics) that every worker pulls. Call it
    /// before the push of the clock whose pulls must see the values (under bsp every
    /// pull of the next clock then does). Refused in a job with `--replicas`.
    fn set_values(&self, py: Python<'_>, name: &str, values: &Bound<'_, PyAny>) -> PyResult<()> {
        let (t, len) = self.tensor(name)?;
        let values = arrays::Checked::read(values, name, format!("values of {name:?}"), len)?.to_vec()?;
        let rx = self.send(|done| Cmd::SetValues { tensor: t as u32, values, done })?;
        wait(py, &format!("the servers to take the values of {name:?}"), rx)
    }

    /// Waits until every worker still in the job called `barrier`.
    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        let rx = self.send(|done| Cmd::Barrier { done })?;
        wait(py, &format!("worker {} waits in a barrier", self.rank), rx)
    }

    /// Tells the scheduler this worker is done (servers stop waiting for it) and reports
    /// the run to the launcher. Later calls do nothing.
    fn finish(&mut self, py: Python<'_>) -> PyResult<()> {
        if self.finished {
            return Ok(());
        }
        let rx = self.send(|done| Cmd::Finish { done })?;
        self.finished = true;
        let stats: RunStats = wait(py, &format!("worker {} finishes", self.rank), rx)?;
        events::worker_done(&stats);
        Ok(())
    }

    /// Leaves the job unfinished, as a failed worker: no `WorkerDone`, so the scheduler
    /// counts this worker lost (and `--restart-workers` starts it again) rather than done.
    /// `elasticps` calls it at interpreter exit when an exception ended the script. Later
    /// calls, and `finish` after it, do nothing.
    fn abandon(&mut self) -> PyResult<()> {
        runtime::check_not_forked(self.pid)?;
        if !std::mem::replace(&mut self.finished, true) {
            let _ = self.tx.send(Cmd::Abandon);
        }
        Ok(())
    }

    fn __repr__(&self) -> String {
        let resumed =
            if self.start_clock > 0 { format!(", resumed at clock {}", self.start_clock) } else { String::new() };
        let tables =
            if self.table_names.is_empty() { String::new() } else { format!(", {} tables", self.table_names.len()) };
        format!("<elasticps.Worker rank {} of {}, {} tensors{tables}{resumed}>", self.rank, self.size, self.names.len())
    }
}

/// A server-side optimizer from a dict: `kind` ("sgd", "momentum", "adam", "adamw"),
/// `lr`, and `momentum`, `betas`, `eps`, `weight_decay` (decoupled for "adamw").
fn parse_optimizer(spec: &Bound<'_, PyAny>, name: &str) -> PyResult<TensorOptimizer> {
    let d = spec
        .cast::<PyDict>()
        .map_err(|_| PyTypeError::new_err(format!("elasticps: the optimizer of {name:?} must be a dict")))?;
    let get_f32 =
        |key: &str, default: Option<f32>| -> PyResult<f32> {
            match d.get_item(key)? {
                Some(v) => v.extract::<f64>().map(|x| x as f32).map_err(|_| {
                    PyTypeError::new_err(format!("elasticps: optimizer of {name:?}: {key} must be a number"))
                }),
                None => default
                    .ok_or_else(|| PyValueError::new_err(format!("elasticps: optimizer of {name:?} needs {key:?}"))),
            }
        };
    let kind: String = match d.get_item("kind")? {
        Some(k) => k.extract()?,
        None => return Err(PyValueError::new_err(format!("elasticps: optimizer of {name:?} needs \"kind\""))),
    };
    let lr = get_f32("lr", None)?;
    let weight_decay = get_f32("weight_decay", Some(0.0))?;
    let kind = match kind.as_str() {
        "sgd" => OptimizerKind::Sgd,
        "momentum" => OptimizerKind::Momentum { beta: get_f32("momentum", Some(0.9))? },
        "adam" | "adamw" => {
            let (beta1, beta2) = match d.get_item("betas")? {
                Some(b) => {
                    let t = b.cast::<PyTuple>().map_err(|_| {
                        PyTypeError::new_err(format!("elasticps: optimizer of {name:?}: betas must be a tuple"))
                    })?;
                    let (b1, b2): (f64, f64) = t.extract()?;
                    (b1 as f32, b2 as f32)
                }
                None => (0.9, 0.999),
            };
            let eps = get_f32("eps", Some(1e-8))?;
            if kind == "adamw" {
                OptimizerKind::AdamW { beta1, beta2, eps }
            } else {
                OptimizerKind::Adam { beta1, beta2, eps }
            }
        }
        other => {
            return Err(PyValueError::new_err(format!(
                "elasticps: optimizer of {name:?}: unknown kind {other:?} (server optimizers: sgd, momentum, adam, adamw)"
            )));
        }
    };
    let o = TensorOptimizer { kind, lr, weight_decay };
    o.validate().map_err(|e| PyValueError::new_err(format!("elasticps: optimizer of {name:?}: {e}")))?;
    Ok(o)
}
