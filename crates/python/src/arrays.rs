//! Borrowing numpy buffers without copying them: float32, C-contiguous, the right size;
//! anything else a `TypeError` or `ValueError` that says what is wrong.

use numpy::{PyArrayDyn, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

/// A borrowed buffer of f32 values, read on the client's threads while the Python object
/// that owns it is kept alive (see [`Keep`]).
#[derive(Clone, Copy, Debug)]
pub struct Src {
    ptr: *const f32,
    len: usize,
}

/// A borrowed writable buffer of f32 values (a pull writes into it).
#[derive(Clone, Copy, Debug)]
pub struct Dst {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: the pointers stay valid while the command that carries them runs: the command
// also carries a reference to each array (`Keep`), dropped only after the command ended.
// Python code must not write a gradient or read a pulled array before its handle was
// waited for (documented on every asynchronous call).
unsafe impl Send for Src {}
// SAFETY: as for `Src`.
unsafe impl Send for Dst {}
// SAFETY: a shared reference only copies the pointer out (both are `Copy`).
unsafe impl Sync for Src {}
// SAFETY: as for `Src`.
unsafe impl Sync for Dst {}

impl Src {
    /// The values.
    ///
    /// # Safety
    /// The array this came from is alive and not resized (its `Keep` is held).
    pub unsafe fn as_slice<'a>(self) -> &'a [f32] {
        // SAFETY: by the caller's contract.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Dst {
    /// The values, to write.
    ///
    /// # Safety
    /// As [`Src::as_slice`], and nothing else reads or writes the array meanwhile.
    pub unsafe fn as_mut_slice<'a>(self) -> &'a mut [f32] {
        // SAFETY: by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// References that keep the borrowed arrays alive until a command has ended.
pub type Keep = Vec<Py<PyAny>>;

/// Checks that `obj` is a float32 C-contiguous numpy array of `len` values (`writable`:
/// and writeable) and returns it typed.
fn checked<'py>(
    obj: &Bound<'py, PyAny>,
    name: &str,
    len: usize,
    writable: bool,
) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
    let Ok(untyped) = obj.cast::<PyUntypedArray>() else {
        let ty = obj.get_type().name().map_or_else(|_| "?".to_string(), |n| n.to_string());
        return Err(PyTypeError::new_err(format!(
            "elasticps: tensor {name:?} must be a float32 C-contiguous numpy array, got a {ty} (for a torch \
             tensor, pass t.detach().numpy())"
        )));
    };
    let dtype = untyped.dtype();
    let c_contiguous = untyped.is_c_contiguous();
    let Ok(array) = obj.cast::<PyArrayDyn<f32>>() else {
        return Err(PyTypeError::new_err(format!(
            "elasticps: tensor {name:?} must be a float32 C-contiguous numpy array, got dtype {dtype}{} (convert \
             with np.ascontiguousarray(a, dtype=np.float32))",
            if c_contiguous { "" } else { ", not C-contiguous" }
        )));
    };
    if !c_contiguous {
        return Err(PyTypeError::new_err(format!(
            "elasticps: tensor {name:?} must be a float32 C-contiguous numpy array, got a non-contiguous view \
             (copy it with np.ascontiguousarray(a))"
        )));
    }
    if writable && array.try_readwrite().is_err() {
        return Err(PyValueError::new_err(format!("elasticps: tensor {name:?} is read-only: a pull writes into it")));
    }
    if array.len() != len {
        return Err(PyValueError::new_err(format!(
            "elasticps: tensor {name:?} holds {} values (shape {:?}), the model's holds {len}",
            array.len(),
            array.shape()
        )));
    }
    Ok(array.clone())
}

/// Borrows `obj` for reading: a float32 C-contiguous array of `len` values.
pub fn source(obj: &Bound<'_, PyAny>, name: &str, len: usize, keep: &mut Keep) -> PyResult<Src> {
    let array = checked(obj, name, len, false)?;
    let ptr = array.data() as *const f32;
    keep.push(array.into_any().unbind());
    Ok(Src { ptr, len })
}

/// Borrows `obj` for writing: a writeable float32 C-contiguous array of `len` values.
pub fn destination(obj: &Bound<'_, PyAny>, name: &str, len: usize, keep: &mut Keep) -> PyResult<Dst> {
    let array = checked(obj, name, len, true)?;
    let ptr = array.data();
    keep.push(array.into_any().unbind());
    Ok(Dst { ptr, len })
}

/// The shape of a float32 C-contiguous array (for defining the model).
pub fn shape(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<usize>> {
    let untyped = obj.cast::<PyUntypedArray>().map_err(|_| {
        PyTypeError::new_err(format!("elasticps: tensor {name:?} must be a float32 C-contiguous numpy array"))
    })?;
    let len = untyped.len();
    checked(obj, name, len, false)?;
    Ok(untyped.shape().to_vec())
}
