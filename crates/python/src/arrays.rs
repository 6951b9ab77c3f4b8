//! Borrowing numpy buffers without copying them: float32, C-contiguous, the right size;
//! anything else a `TypeError` or `ValueError` that says what is wrong.
//!
//! A call checks all its arrays first ([`Checked`]), then refuses any two whose memory
//! overlaps while the call writes one of them ([`refuse_aliasing`]): the client would
//! otherwise hold a `&mut [f32]` and another reference over the same bytes. Only then
//! are they borrowed ([`Checked::source`], [`Checked::destination`]).

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
    /// No gradient (a parameter unused in this step): an empty push, which the servers
    /// count for the clock and apply nothing of (PROTOCOL.md §4).
    pub fn none() -> Self {
        Src { ptr: std::ptr::NonNull::dangling().as_ptr(), len: 0 }
    }

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

/// An array checked for one use in a call (read, or written), not borrowed yet.
pub struct Checked<'py> {
    array: Bound<'py, PyArrayDyn<f32>>,
    /// How the call's arguments name it, for errors: `out["w"]`, `grad`.
    label: String,
    /// The call writes into it.
    writes: bool,
}

impl<'py> Checked<'py> {
    /// Checks `obj` (tensor `name`, `label` in the call's arguments) for reading: a
    /// float32 C-contiguous array of `len` values.
    pub fn read(obj: &Bound<'py, PyAny>, name: &str, label: String, len: usize) -> PyResult<Self> {
        Ok(Self { array: checked(obj, name, len, false)?, label, writes: false })
    }

    /// Checks `obj` for writing (and maybe reading too): a writeable float32 C-contiguous
    /// array of `len` values.
    pub fn write(obj: &Bound<'py, PyAny>, name: &str, label: String, len: usize) -> PyResult<Self> {
        Ok(Self { array: checked(obj, name, len, true)?, label, writes: true })
    }

    /// A copy of the array's values (C-contiguous: checked).
    pub fn to_vec(&self) -> PyResult<Vec<f32>> {
        Ok(self.array.try_readonly()?.as_slice()?.to_vec())
    }

    /// The bytes the array's buffer covers (C-contiguous: `nbytes` from its first value).
    fn bytes(&self) -> std::ops::Range<usize> {
        let start = self.array.data() as usize;
        start..start + self.array.len() * std::mem::size_of::<f32>()
    }

    /// Borrows the array for reading, kept alive by `keep`.
    pub fn source(&self, keep: &mut Keep) -> Src {
        keep.push(self.array.clone().into_any().unbind());
        Src { ptr: self.array.data() as *const f32, len: self.array.len() }
    }

    /// Borrows the array for writing, kept alive by `keep` (checked with [`Checked::write`]).
    pub fn destination(&self, keep: &mut Keep) -> Dst {
        debug_assert!(self.writes, "a destination is checked writeable");
        keep.push(self.array.clone().into_any().unbind());
        Dst { ptr: self.array.data(), len: self.array.len() }
    }
}

/// Refuses, with a `ValueError` naming both, two arrays of `call`'s arguments whose
/// memory overlaps (the same array twice, or two views of one) when the call writes at
/// least one of them. Two arrays that are only read may share memory.
pub fn refuse_aliasing(call: &str, uses: &[&Checked<'_>]) -> PyResult<()> {
    let mut spans: Vec<(std::ops::Range<usize>, usize)> =
        uses.iter().enumerate().map(|(i, u)| (u.bytes(), i)).filter(|(r, _)| !r.is_empty()).collect();
    spans.sort_by_key(|(r, i)| (r.start, *i));
    // Sweep by start: of the spans seen so far, the one reaching furthest, and the
    // written one reaching furthest. A span overlaps an earlier one if and only if the
    // furthest reaches past its start; one that is only read conflicts only with a
    // written one.
    let mut furthest: Option<(usize, usize)> = None;
    let mut furthest_written: Option<(usize, usize)> = None;
    for (r, i) in spans {
        let against = if uses[i].writes { furthest } else { furthest_written };
        if let Some((end, j)) = against
            && end > r.start
        {
            // In the order of the call's arguments.
            let (a, b) = (uses[i.min(j)], uses[i.max(j)]);
            let written: Vec<&str> = [a, b].iter().filter(|u| u.writes).map(|u| u.label.as_str()).collect();
            let what = if a.array.is(&b.array) { "are the same array" } else { "share memory (views of one array)" };
            return Err(PyValueError::new_err(format!(
                "elasticps: {call}: {} and {} {what}, and {call} writes into {}: pass separate arrays (np.copy(a))",
                a.label,
                b.label,
                written.join(" and ")
            )));
        }
        if furthest.is_none_or(|(end, _)| r.end > end) {
            furthest = Some((r.end, i));
        }
        if uses[i].writes && furthest_written.is_none_or(|(end, _)| r.end > end) {
            furthest_written = Some((r.end, i));
        }
    }
    Ok(())
}

/// Checks and borrows `obj` for reading, alone in its call (`push_async`).
pub fn source(obj: &Bound<'_, PyAny>, name: &str, len: usize, keep: &mut Keep) -> PyResult<Src> {
    Ok(Checked::read(obj, name, String::new(), len)?.source(keep))
}

/// Checks and borrows `obj` for writing, alone in its call (`pull_async`).
pub fn destination(obj: &Bound<'_, PyAny>, name: &str, len: usize, keep: &mut Keep) -> PyResult<Dst> {
    Ok(Checked::write(obj, name, String::new(), len)?.destination(keep))
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
