//! Embedding tables from Python: `register_model(tables=...)`'s specs (a table's shape,
//! initializer and sparse optimizer, each from plain Python values), and the arrays of
//! `pull_rows` and `push_rows` checked before anything is sent: ids an int64 vector in
//! the table's range, rows float32 `(len(ids), dim)` and C-contiguous. Anything else is a
//! `TypeError` or `ValueError` that says what is wrong; the worker stays usable.

use elasticps_core::model::TableSpec;
use elasticps_core::rows::{RowInit, SparseOptimizer};
use numpy::{PyArrayDyn, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

/// A registered table as Python calls see it: its index, rows and dim.
#[derive(Clone, Copy, Debug)]
pub struct Table {
    /// Its index among the model's tables.
    pub index: u32,
    /// Rows (ids `0..rows`).
    pub rows: u64,
    /// Values per row.
    pub dim: usize,
}

/// A float read from `d[key]`, or `default` when it is absent (`None`: required).
fn get_f64(d: &Bound<'_, PyDict>, what: &str, key: &str, default: Option<f64>) -> PyResult<f64> {
    match d.get_item(key)? {
        Some(v) => {
            v.extract::<f64>().map_err(|_| PyTypeError::new_err(format!("elasticps: {what}: {key} must be a number")))
        }
        None => default.ok_or_else(|| PyValueError::new_err(format!("elasticps: {what} needs {key:?}"))),
    }
}

/// The `kind` of a spec dict.
fn kind(d: &Bound<'_, PyDict>, what: &str) -> PyResult<String> {
    match d.get_item("kind")? {
        Some(k) => k.extract().map_err(|_| PyTypeError::new_err(format!("elasticps: {what}: kind must be a str"))),
        None => Err(PyValueError::new_err(format!("elasticps: {what} needs \"kind\""))),
    }
}

/// A table's sparse optimizer from a dict: `kind` "sgd", "adagrad" (`lr_decay`, `eps`,
/// `initial_accumulator_value`), "sparse_adam" or "lazy_adam" (`betas`, `eps`); `lr`
/// required, the rest torch's defaults.
pub fn parse_sparse_optimizer(spec: &Bound<'_, PyAny>, name: &str) -> PyResult<SparseOptimizer> {
    let what = format!("the optimizer of table {name:?}");
    let d = spec.cast::<PyDict>().map_err(|_| PyTypeError::new_err(format!("elasticps: {what} must be a dict")))?;
    let lr = get_f64(d, &what, "lr", None)?;
    let betas = || -> PyResult<(f64, f64)> {
        match d.get_item("betas")? {
            Some(b) => {
                let t = b
                    .cast::<PyTuple>()
                    .map_err(|_| PyTypeError::new_err(format!("elasticps: {what}: betas must be a tuple")))?;
                t.extract().map_err(|_| PyTypeError::new_err(format!("elasticps: {what}: betas must be two numbers")))
            }
            None => Ok((0.9, 0.999)),
        }
    };
    let o = match kind(d, &what)?.as_str() {
        "sgd" => SparseOptimizer::Sgd { lr },
        "adagrad" => SparseOptimizer::Adagrad {
            lr,
            lr_decay: get_f64(d, &what, "lr_decay", Some(0.0))?,
            eps: get_f64(d, &what, "eps", Some(1e-10))?,
            initial_accumulator_value: get_f64(d, &what, "initial_accumulator_value", Some(0.0))?,
        },
        "sparse_adam" => {
            let (beta1, beta2) = betas()?;
            SparseOptimizer::SparseAdam { lr, beta1, beta2, eps: get_f64(d, &what, "eps", Some(1e-8))? }
        }
        "lazy_adam" => {
            let (beta1, beta2) = betas()?;
            SparseOptimizer::LazyAdam { lr, beta1, beta2, eps: get_f64(d, &what, "eps", Some(1e-8))? }
        }
        other => {
            return Err(PyValueError::new_err(format!(
                "elasticps: {what}: unknown kind {other:?} (table optimizers: sgd, adagrad, sparse_adam, lazy_adam)"
            )));
        }
    };
    o.validate().map_err(|e| PyValueError::new_err(format!("elasticps: {what}: {e}")))?;
    Ok(o)
}

/// A table's initializer from a dict: `kind` "normal" (`mean` 0, `std` 1), "uniform"
/// (`low`, `high`) or "constant" (`value`).
fn parse_init(spec: &Bound<'_, PyAny>, name: &str) -> PyResult<RowInit> {
    let what = format!("the initializer of table {name:?}");
    let d = spec.cast::<PyDict>().map_err(|_| PyTypeError::new_err(format!("elasticps: {what} must be a dict")))?;
    let init = match kind(d, &what)?.as_str() {
        "normal" => RowInit::Normal {
            mean: get_f64(d, &what, "mean", Some(0.0))? as f32,
            std: get_f64(d, &what, "std", Some(1.0))? as f32,
        },
        "uniform" => RowInit::Uniform {
            low: get_f64(d, &what, "low", None)? as f32,
            high: get_f64(d, &what, "high", None)? as f32,
        },
        "constant" => RowInit::Constant(get_f64(d, &what, "value", None)? as f32),
        other => {
            return Err(PyValueError::new_err(format!(
                "elasticps: {what}: unknown kind {other:?} (initializers: normal, uniform, constant)"
            )));
        }
    };
    init.validate().map_err(|e| PyValueError::new_err(format!("elasticps: {what}: {e}")))?;
    Ok(init)
}

/// A table spec from `tables[name]`: `(rows, dim)` or `(rows, dim, init)`.
pub fn parse_table(name: String, spec: &Bound<'_, PyAny>) -> PyResult<TableSpec> {
    let shape_err = || {
        PyTypeError::new_err(format!(
            "elasticps: tables[{name:?}] must be (rows, dim) or (rows, dim, init), two positive ints and a dict"
        ))
    };
    let t = spec.cast::<PyTuple>().map_err(|_| shape_err())?;
    if !(2..=3).contains(&t.len()) {
        return Err(shape_err());
    }
    let rows: i64 = t.get_item(0)?.extract().map_err(|_| shape_err())?;
    let dim: i64 = t.get_item(1)?.extract().map_err(|_| shape_err())?;
    if rows < 1 || dim < 1 || dim > i64::from(u32::MAX) {
        return Err(PyValueError::new_err(format!(
            "elasticps: table {name:?} has {rows} rows of {dim} values: both must be at least 1"
        )));
    }
    let init = if t.len() == 3 { Some(parse_init(&t.get_item(2)?, &name)?) } else { None };
    let table = TableSpec::new(name, rows as u64, dim as u32);
    Ok(match init {
        Some(init) => table.with_init(init),
        None => table,
    })
}

/// The ids of a row call: a 1-D int64 numpy array, each in `0..table.rows`.
pub fn ids(obj: &Bound<'_, PyAny>, name: &str, table: Table) -> PyResult<Vec<u64>> {
    let arr = obj.cast::<PyUntypedArray>().map_err(|_| {
        PyTypeError::new_err(format!("elasticps: ids of table {name:?} must be a numpy array of int64"))
    })?;
    let typed = obj.cast::<PyArrayDyn<i64>>().map_err(|_| {
        PyTypeError::new_err(format!("elasticps: ids of table {name:?} must be int64, got {}", arr.dtype()))
    })?;
    if arr.ndim() != 1 {
        return Err(PyValueError::new_err(format!(
            "elasticps: ids of table {name:?} must be 1-dimensional, got shape {:?}",
            arr.shape()
        )));
    }
    let ro = typed.readonly();
    let view = ro.as_array();
    let mut out = Vec::with_capacity(view.len());
    for &id in view.iter() {
        if id < 0 || id as u64 >= table.rows {
            return Err(PyValueError::new_err(format!(
                "elasticps: id {id} is out of range: table {name:?} has {} rows",
                table.rows
            )));
        }
        out.push(id as u64);
    }
    Ok(out)
}

/// Checks that `obj` is a float32, C-contiguous array of shape `(n, table.dim)`
/// (`label`: what the call calls it); `writes`: it must also be writeable.
fn check_rows<'py>(
    obj: &Bound<'py, PyAny>,
    label: &str,
    name: &str,
    n: usize,
    table: Table,
    writes: bool,
) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
    let arr = obj.cast::<PyUntypedArray>().map_err(|_| {
        PyTypeError::new_err(format!("elasticps: {label} of table {name:?} must be a float32 numpy array"))
    })?;
    let typed = obj.cast::<PyArrayDyn<f32>>().map_err(|_| {
        PyTypeError::new_err(format!("elasticps: {label} of table {name:?} must be float32, got {}", arr.dtype()))
    })?;
    if arr.shape() != [n, table.dim] {
        return Err(PyValueError::new_err(format!(
            "elasticps: {label} of table {name:?} must have shape ({n}, {}) (len(ids), dim), got {:?}",
            table.dim,
            arr.shape()
        )));
    }
    if !arr.is_c_contiguous() {
        return Err(PyValueError::new_err(format!("elasticps: {label} of table {name:?} must be C-contiguous")));
    }
    if writes && typed.try_readwrite().is_err() {
        return Err(PyValueError::new_err(format!("elasticps: {label} of table {name:?} is read-only")));
    }
    Ok(typed.clone())
}

/// A push's gradient rows, copied: float32 `(n, dim)`, C-contiguous.
pub fn grads(obj: &Bound<'_, PyAny>, name: &str, n: usize, table: Table) -> PyResult<Vec<f32>> {
    let typed = check_rows(obj, "grads", name, n, table, false)?;
    let ro = typed.readonly();
    Ok(ro.as_slice().map_err(|_| PyValueError::new_err("elasticps: grads must be C-contiguous"))?.to_vec())
}

/// A pull's destination, checked: float32 `(n, dim)`, C-contiguous, writeable.
pub fn out<'py>(obj: &Bound<'py, PyAny>, name: &str, n: usize, table: Table) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
    check_rows(obj, "out", name, n, table, true)
}

/// Copies the pulled rows into `out` (checked by [`out`]).
pub fn fill(out: &Bound<'_, PyArrayDyn<f32>>, rows: &[f32]) -> PyResult<()> {
    let mut rw = out.try_readwrite().map_err(|e| PyValueError::new_err(format!("elasticps: out is borrowed: {e}")))?;
    let dst = rw.as_slice_mut().map_err(|_| PyValueError::new_err("elasticps: out must be C-contiguous"))?;
    if dst.len() != rows.len() {
        return Err(PyValueError::new_err(format!(
            "elasticps: {} rows values for an out of {}",
            rows.len(),
            dst.len()
        )));
    }
    dst.copy_from_slice(rows);
    Ok(())
}
