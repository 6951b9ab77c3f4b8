//! [`Values`]: an f32 tensor payload held as little-endian bytes and shared without
//! copying.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use bytes::Bytes;

use crate::WireError;

#[cfg(target_endian = "big")]
compile_error!(
    "elasticps-wire reinterprets f32 slices as their little-endian wire bytes without conversion; \
     big-endian targets are not supported"
);

/// An f32 tensor payload (Push, PullReply, Init and PushPull frames): little-endian bytes in a [`Bytes`],
/// so cloning it, sending it and slicing it never copy the values.
///
/// Equality compares bytes, so NaN payloads compare equal to themselves bit for bit.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct Values(Bytes);

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
        Values(Bytes::from_owner(VecOwner(v)))
    }

    /// Shares `v` without copying: the bytes point into the vector's buffer and keep the
    /// `Arc` alive. (A server answers pulls from copy-on-write `Arc<Vec<f32>>` blocks.)
    pub fn from_shared(v: Arc<Vec<f32>>) -> Self {
        Values(Bytes::from_owner(SharedOwner(v)))
    }

    /// Copies `s` (one memcpy).
    pub fn from_slice(s: &[f32]) -> Self {
        Values(Bytes::copy_from_slice(bytemuck::cast_slice(s)))
    }

    /// Wraps little-endian f32 bytes without copying; [`WireError::NotF32`] unless
    /// `b.len()` is a multiple of 4. The bytes need not be 4-aligned.
    pub fn from_le_bytes(b: Bytes) -> Result<Self, WireError> {
        if !b.len().is_multiple_of(4) {
            return Err(WireError::NotF32 { len: b.len() });
        }
        Ok(Values(b))
    }

    /// Number of f32 values.
    pub fn len(&self) -> usize {
        self.0.len() / 4
    }

    /// True if there is no value.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The little-endian bytes (`4 * len()` of them).
    pub fn as_bytes(&self) -> &Bytes {
        &self.0
    }

    /// The little-endian bytes, by value.
    pub fn into_bytes(self) -> Bytes {
        self.0
    }

    /// The values as a slice: borrowed when the bytes are 4-aligned (always, for values
    /// built from a `Vec<f32>`), copied otherwise (e.g. a payload split out of a read
    /// buffer at an odd offset).
    pub fn to_f32s(&self) -> Cow<'_, [f32]> {
        match bytemuck::try_cast_slice::<u8, f32>(&self.0) {
            Ok(s) => Cow::Borrowed(s),
            Err(_) => {
                let mut v = vec![0.0f32; self.len()];
                self.copy_into(&mut v);
                Cow::Owned(v)
            }
        }
    }

    /// The values in a new vector (one memcpy).
    pub fn to_vec(&self) -> Vec<f32> {
        self.to_f32s().into_owned()
    }

    /// Copies the values into `dst` with one memcpy, whatever the alignment of the bytes.
    ///
    /// # Panics
    ///
    /// If `dst.len() != self.len()`. Callers check the length first (a push of the
    /// wrong length is a `BadRequest`, not a crash).
    pub fn copy_into(&self, dst: &mut [f32]) {
        assert_eq!(dst.len(), self.len(), "Values::copy_into: destination length differs");
        bytemuck::cast_slice_mut::<f32, u8>(dst).copy_from_slice(&self.0);
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
        let head: Vec<f32> =
            self.0.chunks_exact(4).take(SHOWN).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        write!(f, "Values(len={}, {head:?}", self.len())?;
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
        assert_eq!(Values::from_le_bytes(Bytes::from_static(&[0; 7])), Err(WireError::NotF32 { len: 7 }));
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
        assert!(s.starts_with("Values(len=10, [1.0"), "{s}");
    }
}
