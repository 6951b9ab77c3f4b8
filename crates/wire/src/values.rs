//! [`Values`]: a tensor payload (f32, bf16 or fp16, dense or sparse) held as
//! little-endian bytes and shared without copying.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use bytes::Bytes;

use elasticps_core::block::Gradient;
use elasticps_core::dtype::Dtype;

use crate::WireError;

#[cfg(target_endian = "big")]
compile_error!(
    "elasticps-wire reinterprets f32 slices as their little-endian wire bytes without conversion; \
     big-endian targets are not supported"
);

/// A tensor payload (Push, PullReply, Init, PushPull, Forward, PullRowsReply, PushRows'
/// gradients): values of one [`Dtype`] as little-endian bytes in a [`Bytes`], so cloning
/// it, sending it and slicing it never copy them; and, for a sparse gradient (a top-k
/// push), the u32 positions in the block that the values are for.
///
/// Built from f32s it is f32 ([`Values::from_vec`] and friends: no conversion, no copy);
/// [`Values::encoded`] and [`Values::sparse`] convert. Readers get f32s whatever the
/// dtype ([`Values::to_f32s`], [`Values::copy_into`]): servers keep f32 master values.
///
/// Equality compares dtype and bytes, so NaN payloads compare equal to themselves bit for bit.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct Values {
    /// The payload as on the wire: the values; or, sparse, the count, the positions and
    /// the values.
    bytes: Bytes,
    dtype: Dtype,
    /// Where the values start in `bytes`: 0 for a dense payload, after the count and the
    /// positions (at least 4) for a sparse one.
    values_at: u32,
}

/// Owner of a `Vec<f32>` that `Bytes::from_owner` can view as bytes.
struct VecOwner(Vec<f32>);

impl AsRef<[u8]> for VecOwner {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

/// Owner of a shared (copy-on-write) `Vec<f32>`.
struct SharedOwner(Arc<Vec<f32>>);

impl AsRef<[u8]> for SharedOwner {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(self.0.as_slice())
    }
}

impl Values {
    /// Takes ownership of `v` without copying: the bytes point into the vector's buffer.
    pub fn from_vec(v: Vec<f32>) -> Self {
        Values::f32_bytes(Bytes::from_owner(VecOwner(v)))
    }

    /// Shares `v` without copying: the bytes point into the vector's buffer and keep the
    /// `Arc` alive. (A server answers pulls from copy-on-write `Arc<Vec<f32>>` blocks.)
    pub fn from_shared(v: Arc<Vec<f32>>) -> Self {
        Values::f32_bytes(Bytes::from_owner(SharedOwner(v)))
    }

    /// Copies `s` (one memcpy).
    pub fn from_slice(s: &[f32]) -> Self {
        Values::f32_bytes(Bytes::copy_from_slice(bytemuck::cast_slice(s)))
    }

    /// `s` converted to `dtype` (f32: one memcpy).
    pub fn encoded(s: &[f32], dtype: Dtype) -> Self {
        match dtype {
            Dtype::F32 => Values::from_slice(s),
            _ => Values { bytes: Bytes::from(dtype.encode(s)), dtype, values_at: 0 },
        }
    }

    /// A sparse payload: `values[i]` (converted to `dtype`) is for position `indices[i]`
    /// of the block. Whether the positions are ascending and in the block is the
    /// receiver's check (`elasticps_core`'s sparse gradient).
    ///
    /// # Panics
    ///
    /// If `indices` and `values` differ in length (a caller's bug, not input).
    pub fn sparse(indices: &[u32], values: &[f32], dtype: Dtype) -> Self {
        assert_eq!(indices.len(), values.len(), "Values::sparse: one position per value");
        let n = u32::try_from(indices.len()).expect("Values::sparse: at most u32::MAX positions");
        let mut bytes = Vec::with_capacity(4 + indices.len() * (4 + dtype.width()));
        bytes.extend_from_slice(&n.to_le_bytes());
        bytes.extend_from_slice(bytemuck::cast_slice(indices));
        dtype.encode_into(values, &mut bytes);
        Values { values_at: 4 + 4 * n, bytes: bytes.into(), dtype }
    }

    fn f32_bytes(bytes: Bytes) -> Self {
        Values { bytes, dtype: Dtype::F32, values_at: 0 }
    }

    /// Wraps little-endian f32 bytes without copying; [`WireError::NotF32`] unless
    /// `b.len()` is a multiple of 4. The bytes need not be 4-aligned.
    pub fn from_le_bytes(b: Bytes) -> Result<Self, WireError> {
        Values::from_wire(b, Dtype::F32)
    }

    /// Wraps little-endian values of `dtype` without copying; [`WireError::NotF32`]
    /// (naming the dtype) unless `b.len()` is a multiple of its width.
    pub fn from_wire(b: Bytes, dtype: Dtype) -> Result<Self, WireError> {
        if !b.len().is_multiple_of(dtype.width()) {
            return Err(WireError::NotF32 { len: b.len(), dtype });
        }
        Ok(Values { bytes: b, dtype, values_at: 0 })
    }

    /// Reads a sparse payload: a u32 count n, n u32 positions, then n values of `dtype`,
    /// all little-endian (docs/PROTOCOL.md §3.1).
    pub fn from_sparse_wire(b: Bytes, dtype: Dtype) -> Result<Self, WireError> {
        let bad = |why: String| WireError::BadSparse { why };
        let Some(head) = b.first_chunk::<4>() else {
            return Err(bad(format!("{} bytes hold no count", b.len())));
        };
        let n = u32::from_le_bytes(*head) as u64;
        let want = 4 + n * 4 + n * dtype.width() as u64;
        if want != b.len() as u64 {
            return Err(bad(format!(
                "{n} {dtype} values and their positions take {want} bytes, the payload has {}",
                b.len()
            )));
        }
        Ok(Values { values_at: 4 + n as u32 * 4, bytes: b, dtype })
    }

    /// The dtype the values travel in.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Number of values carried (for a sparse payload, how many positions it names).
    pub fn len(&self) -> usize {
        self.as_bytes().len() / self.dtype.width()
    }

    /// True if there is no value.
    pub fn is_empty(&self) -> bool {
        self.as_bytes().is_empty()
    }

    /// True for a sparse payload ([`Values::sparse`]).
    pub fn is_sparse(&self) -> bool {
        self.values_at > 0
    }

    /// A sparse payload's positions (a copy; `None` for a dense one).
    pub fn indices(&self) -> Option<Vec<u32>> {
        self.is_sparse().then(|| {
            self.bytes[4..self.values_at as usize]
                .chunks_exact(4)
                .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
                .collect()
        })
    }

    /// The values' little-endian bytes, in their dtype (a sparse payload's values only).
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[self.values_at as usize..]
    }

    /// The values' bytes, by value (no copy).
    pub fn into_bytes(self) -> Bytes {
        self.bytes.slice(self.values_at as usize..)
    }

    /// The payload as it is written (no copy): the values; or, sparse, the count, the
    /// positions and the values.
    pub fn wire_bytes(&self) -> Bytes {
        self.bytes.clone()
    }

    /// Bytes of [`Values::wire_bytes`].
    pub fn wire_len(&self) -> usize {
        self.bytes.len()
    }

    /// The values as f32s: borrowed when they are f32 and 4-aligned (always, for values
    /// built from a `Vec<f32>`), converted or copied otherwise.
    pub fn to_f32s(&self) -> Cow<'_, [f32]> {
        if self.dtype == Dtype::F32
            && let Ok(s) = bytemuck::try_cast_slice::<u8, f32>(self.as_bytes())
        {
            return Cow::Borrowed(s);
        }
        let mut v = vec![0.0f32; self.len()];
        self.copy_into(&mut v);
        Cow::Owned(v)
    }

    /// The values in a new vector, as f32s.
    pub fn to_vec(&self) -> Vec<f32> {
        self.to_f32s().into_owned()
    }

    /// Copies the values into `dst` as f32s (f32: one memcpy, whatever the alignment of
    /// the bytes; bf16, fp16: converted).
    ///
    /// # Panics
    ///
    /// If `dst.len() != self.len()`. Callers check the length first (a push of the
    /// wrong length is a `BadRequest`, not a crash).
    pub fn copy_into(&self, dst: &mut [f32]) {
        assert_eq!(dst.len(), self.len(), "Values::copy_into: destination length differs");
        self.dtype.decode_into(self.as_bytes(), dst);
    }
}

/// A gradient payload read as f32s ([`Values::gradient`]): the values and, for a sparse
/// one, their positions; [`Decoded::gradient`] is what a block applies.
#[derive(Debug)]
pub struct Decoded<'a> {
    values: Cow<'a, [f32]>,
    indices: Option<Vec<u32>>,
}

impl Decoded<'_> {
    /// The gradient: sparse, dense, or none (an empty dense payload).
    pub fn gradient(&self) -> Gradient<'_> {
        match &self.indices {
            Some(indices) => Gradient::Sparse { indices, values: &self.values },
            None => Gradient::from_payload(&self.values),
        }
    }
}

impl Values {
    /// The payload read as a gradient (f32s, converted from its dtype where need be).
    pub fn gradient(&self) -> Decoded<'_> {
        Decoded { values: self.to_f32s(), indices: self.indices() }
    }
}

impl From<Vec<f32>> for Values {
    fn from(v: Vec<f32>) -> Self {
        Values::from_vec(v)
    }
}

impl From<Arc<Vec<f32>>> for Values {
    fn from(v: Arc<Vec<f32>>) -> Self {
        Values::from_shared(v)
    }
}

impl From<&[f32]> for Values {
    fn from(s: &[f32]) -> Self {
        Values::from_slice(s)
    }
}

/// Row ids of a row request (PullRows, PushRows): u64 little-endian bytes in a [`Bytes`],
/// shared without copying like [`Values`].
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct RowIds(Bytes);

/// Owner of a `Vec<u64>` that `Bytes::from_owner` can view as bytes.
struct IdsOwner(Vec<u64>);

impl AsRef<[u8]> for IdsOwner {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

impl RowIds {
    /// Takes ownership of `ids` without copying.
    pub fn from_vec(ids: Vec<u64>) -> Self {
        RowIds(Bytes::from_owner(IdsOwner(ids)))
    }

    /// Copies `ids` (one memcpy).
    pub fn from_slice(ids: &[u64]) -> Self {
        RowIds(Bytes::copy_from_slice(bytemuck::cast_slice(ids)))
    }

    /// Wraps little-endian u64 bytes without copying (they need not be 8-aligned);
    /// `None` unless `b.len()` is a multiple of 8.
    pub fn from_le_bytes(b: Bytes) -> Option<Self> {
        b.len().is_multiple_of(8).then_some(RowIds(b))
    }

    /// Number of ids.
    pub fn len(&self) -> usize {
        self.0.len() / 8
    }

    /// True if there is no id.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The id at `i` (panics past the end, like a slice).
    pub fn get(&self, i: usize) -> u64 {
        let b = &self.0[i * 8..i * 8 + 8];
        u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
    }

    /// The ids in order.
    pub fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.0.chunks_exact(8).map(|b| u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
    }

    /// The ids as a vector (a copy).
    pub fn to_vec(&self) -> Vec<u64> {
        self.iter().collect()
    }

    /// The little-endian bytes (`8 * len()` of them).
    pub fn as_bytes(&self) -> &Bytes {
        &self.0
    }
}

impl From<Vec<u64>> for RowIds {
    fn from(v: Vec<u64>) -> Self {
        RowIds::from_vec(v)
    }
}

impl fmt::Debug for RowIds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let head: Vec<u64> = self.iter().take(8).collect();
        write!(f, "RowIds(len={}, {head:?}", self.len())?;
        if self.len() > 8 {
            f.write_str(" ...")?;
        }
        f.write_str(")")
    }
}

impl fmt::Debug for Values {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SHOWN: usize = 8;
        let n = self.len().min(SHOWN);
        let mut head = vec![0.0f32; n];
        self.dtype.decode_into(&self.as_bytes()[..n * self.dtype.width()], &mut head);
        let sparse = if self.is_sparse() { " sparse" } else { "" };
        write!(f, "Values(len={}, {}{sparse}, {head:?}", self.len(), self.dtype)?;
        if self.len() > SHOWN {
            f.write_str("...")?;
        }
        f.write_str(")")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_vec_and_from_shared_do_not_copy() {
        let v = vec![1.0f32, 2.0, 3.0];
        let ptr = v.as_ptr() as *const u8;
        let values = Values::from_vec(v);
        assert_eq!(values.as_bytes().as_ptr(), ptr);
        assert_eq!(values.len(), 3);
        assert_eq!(values.to_f32s().as_ptr() as *const u8, ptr, "aligned: borrowed, not copied");

        let shared = Arc::new(vec![4.0f32; 1000]);
        let ptr = shared.as_ptr() as *const u8;
        let values = Values::from_shared(shared.clone());
        assert_eq!(values.as_bytes().as_ptr(), ptr);
        assert_eq!(Arc::strong_count(&shared), 2, "the Bytes keeps the Arc alive");
        let clone = values.clone();
        assert_eq!(clone.as_bytes().as_ptr(), ptr);
        drop(values);
        drop(clone);
        assert_eq!(Arc::strong_count(&shared), 1, "dropping the Bytes releases the Arc");
    }

    #[test]
    fn unaligned_bytes_still_read_right() {
        let want = [1.5f32, -2.25, f32::MAX, f32::from_bits(0x7fc0_0001)];
        // A 4-aligned buffer (it is a Vec<f32>) with the values written one byte in, so the
        // slice below starts at an address that is certainly not 4-aligned.
        let mut backing = vec![0.0f32; 5];
        bytemuck::cast_slice_mut::<f32, u8>(&mut backing)[1..17].copy_from_slice(bytemuck::cast_slice(&want));
        let odd = Values::from_vec(backing).into_bytes().slice(1..17);
        assert!(bytemuck::try_cast_slice::<u8, f32>(&odd).is_err(), "the test needs misaligned bytes");
        let values = Values::from_le_bytes(odd).unwrap();
        let got = values.to_f32s();
        assert!(matches!(got, Cow::Owned(_)));
        let bits = |s: &[f32]| s.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want));
        let mut dst = [0.0f32; 4];
        values.copy_into(&mut dst);
        assert_eq!(bits(&dst), bits(&want));
        assert_eq!(bits(&values.to_vec()), bits(&want));
    }

    #[test]
    fn rejects_lengths_that_are_not_whole_f32s() {
        assert_eq!(
            Values::from_le_bytes(Bytes::from_static(&[0; 7])),
            Err(WireError::NotF32 { len: 7, dtype: Dtype::F32 })
        );
        assert!(Values::from_le_bytes(Bytes::new()).unwrap().is_empty());
    }

    #[test]
    #[should_panic(expected = "destination length differs")]
    fn copy_into_panics_on_length_mismatch() {
        Values::from_slice(&[1.0, 2.0]).copy_into(&mut [0.0; 3]);
    }

    #[test]
    fn debug_shows_length_and_head() {
        let s = format!("{:?}", Values::from_slice(&[1.0; 10]));
        assert!(s.starts_with("Values(len=10, f32, [1.0"), "{s}");
    }
}
