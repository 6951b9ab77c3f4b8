//! Embedding tables from Python: `register_model(tables=...)`'s specs (a table's shape,
//! initializer and sparse optimizer, each from plain Python values), and the arrays of
//! `pull_rows` and `push_rows` checked before anything is sent: ids an int64 vector in
//! the table's range, rows float32 `(len(ids), dim)` and C-contiguous. Anything else is a
//! `TypeError` or `ValueError` that says what is wrong; the worker stays usable.

use elasticps_core::model::{MAX_KEY_RANGES, TableSpec};
use elasticps_core::rows::{Eviction, RowInit, RowLimits, SparseOptimizer};
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
    /// Keyed by any int64 (taken as its u64 bits) rather than `0..rows`.
    pub hashed: bool,
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

/// An int read from `d[key]`, or `default` when it is absent or None.
fn get_u64(d: &Bound<'_, PyDict>, what: &str, key: &str, default: u64) -> PyResult<u64> {
    match d.get_item(key)? {
        Some(v) if !v.is_none() => v
            .extract::<u64>()
            .map_err(|_| PyValueError::new_err(format!("elasticps: {what}: {key} must be an int >= 0, got {v}"))),
        _ => Ok(default),
    }
}

/// A table spec from `tables[name]`: `(rows, dim)` or `(rows, dim, init)`, or a dict:
/// `dim` (required), `rows` (an indexed table) or `keys="hashed"` with `ranges`
/// (default 16), `init`, and the limits `max_rows` (per server), `eviction` ("lru" or
/// "lfu"), `ttl_steps`, `admit_after`.
pub fn parse_table(name: String, spec: &Bound<'_, PyAny>) -> PyResult<TableSpec> {
    if let Ok(d) = spec.cast::<PyDict>() {
        return parse_table_dict(name, d);
    }
    let shape_err = || {
        PyTypeError::new_err(format!(
            "elasticps: tables[{name:?}] must be (rows, dim) or (rows, dim, init), two positive ints and a dict, or a \
             dict with \"dim\""
        ))
    };
    let t = spec.cast::<PyTuple>().map_err(|_| shape_err())?;
    if !(2..=3).contains(&t.len()) {
        return Err(shape_err());
    }
    let rows: i64 = t.get_item(0)?.extract().map_err(|_| shape_err())?;
    let dim: i64 = t.get_item(1)?.extract().map_err(|_| shape_err())?;
    check_shape(&name, rows, dim)?;
    let init = if t.len() == 3 { Some(parse_init(&t.get_item(2)?, &name)?) } else { None };
    let table = TableSpec::new(name, rows as u64, dim as u32);
    Ok(match init {
        Some(init) => table.with_init(init),
        None => table,
    })
}

fn check_shape(name: &str, rows: i64, dim: i64) -> PyResult<()> {
    if rows < 1 || dim < 1 || dim > i64::from(u32::MAX) {
        return Err(PyValueError::new_err(format!(
            "elasticps: table {name:?} has {rows} rows of {dim} values: both must be at least 1"
        )));
    }
    Ok(())
}

/// [`parse_table`]'s dict form.
fn parse_table_dict(name: String, d: &Bound<'_, PyDict>) -> PyResult<TableSpec> {
    let what = format!("tables[{name:?}]");
    const KNOWN: [&str; 9] =
        ["dim", "rows", "keys", "ranges", "init", "max_rows", "eviction", "ttl_steps", "admit_after"];
    for k in d.keys() {
        let k: String =
            k.extract().map_err(|_| PyTypeError::new_err(format!("elasticps: {what}: keys must be str")))?;
        if !KNOWN.contains(&k.as_str()) {
            return Err(PyValueError::new_err(format!("elasticps: {what}: unknown key {k:?} (known: {KNOWN:?})")));
        }
    }
    let dim = get_u64(d, &what, "dim", 0)?;
    let keys: String = match d.get_item("keys")? {
        Some(k) => k.extract().map_err(|_| PyTypeError::new_err(format!("elasticps: {what}: keys must be a str")))?,
        None => "indexed".into(),
    };
    let table = match keys.as_str() {
        "hashed" => {
            if d.contains("rows")? {
                return Err(PyValueError::new_err(format!("elasticps: {what}: a hashed table has no rows")));
            }
            let ranges = get_u64(d, &what, "ranges", 16)?;
            if dim < 1 || dim > u64::from(u32::MAX) || ranges < 1 || ranges > u64::from(MAX_KEY_RANGES) {
                return Err(PyValueError::new_err(format!(
                    "elasticps: {what}: dim {dim} and ranges {ranges}: dim must be at least 1, ranges in \
                     1..={MAX_KEY_RANGES}"
                )));
            }
            TableSpec::hashed(name.clone(), dim as u32, ranges as u32)
        }
        "indexed" => {
            let rows = get_u64(d, &what, "rows", 0)?;
            check_shape(&name, i64::try_from(rows).unwrap_or(0), i64::try_from(dim).unwrap_or(0))?;
            TableSpec::new(name.clone(), rows, dim as u32)
        }
        other => {
            return Err(PyValueError::new_err(format!(
                "elasticps: {what}: keys must be \"indexed\" or \"hashed\", got {other:?}"
            )));
        }
    };
    let eviction = match d.get_item("eviction")? {
        None => Eviction::Lru,
        Some(e) => match e.extract::<String>().ok().as_deref() {
            Some("lru") => Eviction::Lru,
            Some("lfu") => Eviction::Lfu,
            _ => {
                return Err(PyValueError::new_err(format!(
                    "elasticps: {what}: eviction must be \"lru\" or \"lfu\", got {e}"
                )));
            }
        },
    };
    let admit_after = get_u64(d, &what, "admit_after", 0)?;
    let limits = RowLimits {
        max_rows: get_u64(d, &what, "max_rows", 0)?,
        eviction,
        ttl_steps: get_u64(d, &what, "ttl_steps", 0)?,
        admit_after: u32::try_from(admit_after)
            .map_err(|_| PyValueError::new_err(format!("elasticps: {what}: admit_after {admit_after} is too large")))?,
    };
    let table = table.with_limits(limits);
    Ok(match d.get_item("init")? {
        Some(init) if !init.is_none() => {
            let init = parse_init(&init, &name)?;
            table.with_init(init)
        }
        _ => table,
    })
}

/// The ids of a row call: a 1-D int64 numpy array, each in `0..table.rows` (any value
/// for a hashed table, taken as its u64 bits).
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
        if !table.hashed && (id < 0 || id as u64 >= table.rows) {
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
