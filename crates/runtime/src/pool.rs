//! Recycled payload buffers: large tensor payloads (reads, pushed blocks) come from and
//! return to a small process-wide pool instead of the allocator.

use std::sync::Mutex;

use bytes::Bytes;
use elasticps_wire::Values;

/// Payload buffers of at least this many bytes are recycled; smaller ones are cheap to allocate.
const POOL_MIN_BYTES: usize = 64 * 1024;
/// At most this many buffers wait in the pool (a push of small blocks has many in flight)...
const POOL_MAX_BUFFERS: usize = 64;
/// ...holding at most this many bytes.
const POOL_MAX_BYTES: usize = 64 << 20;

/// Free payload buffers of this process, for [`payload_buffer`].
///
/// Why: a tensor payload used to be a fresh multi-MiB `Vec<f32>` per frame (read buffers,
/// and the client's copy of each pushed block). Allocated and freed on tokio's worker
/// threads, such buffers live in glibc's per-thread arenas, which hand the pages back to
/// the kernel when the top of the heap grows past the trim threshold and fault them in
/// again for the next payload: `elasticps bench transport` measured that at more than the
/// cost of moving the bytes over loopback TCP (4 x 4 MiB blocks: about 10 ms per round).
/// The pool keeps buffers that were in use before, at most [`POOL_MAX_BUFFERS`] of them
/// and [`POOL_MAX_BYTES`] in all: that much memory at most stays with the process.
static POOL: Mutex<Vec<Vec<f32>>> = Mutex::new(Vec::new());

fn pool() -> std::sync::MutexGuard<'static, Vec<Vec<f32>>> {
    POOL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A buffer of `len` f32 values for a payload, recycled when one is free. Its contents
/// are unspecified (zeros, or the values of an earlier payload): the caller overwrites all
/// of it. Wrap it with [`pooled_values`] so it comes back when the payload is dropped.
pub fn payload_buffer(len: usize) -> Vec<f32> {
    if len * 4 >= POOL_MIN_BYTES {
        let reused = {
            let mut free = pool();
            // The smallest free buffer that holds `len` values without reallocating.
            let best = free.iter().enumerate().filter(|(_, v)| v.capacity() >= len).min_by_key(|(_, v)| v.capacity());
            best.map(|(i, _)| i).map(|i| free.swap_remove(i))
        };
        if let Some(mut v) = reused {
            // Truncates, or zero-fills only the part beyond the buffer's current length.
            v.resize(len, 0.0);
            return v;
        }
    }
    vec![0.0; len]
}

/// The payload of `v` (no copy); a large buffer goes back to the pool when the last view
/// of the payload is dropped.
pub fn pooled_values(v: Vec<f32>) -> Values {
    if v.len() * 4 < POOL_MIN_BYTES {
        return Values::from_vec(v);
    }
    Values::from_le_bytes(Bytes::from_owner(Pooled(v))).expect("a Vec<f32> holds whole f32s")
}

/// Copies `s` into a recycled buffer (one memcpy): a pushed block.
pub fn copy_values(s: &[f32]) -> Values {
    let mut v = payload_buffer(s.len());
    v.copy_from_slice(s);
    pooled_values(v)
}

/// A payload buffer that goes back to the pool when dropped.
struct Pooled(Vec<f32>);

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.0);
        let mut free = pool();
        let held: usize = free.iter().map(|b| b.capacity() * 4).sum();
        if free.len() < POOL_MAX_BUFFERS && held + v.capacity() * 4 <= POOL_MAX_BYTES {
            free.push(v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_payload_buffers_are_recycled_with_the_right_length() {
        // Other tests of this binary may share the pool: look for this buffer by address.
        let n = 256 * 1024;
        let values = copy_values(&vec![1.5f32; n]);
        let ptr = values.as_bytes().as_ptr();
        assert_eq!(values.len(), n);
        assert!(values.to_f32s().iter().all(|v| *v == 1.5));
        let view = values.clone();
        drop(values);
        assert!(!pool().iter().any(|b| b.as_ptr() as *const u8 == ptr), "a view is still alive");
        drop(view);
        assert!(pool().iter().any(|b| b.as_ptr() as *const u8 == ptr), "back in the pool");
        // A smaller payload reuses it (truncated), a small one never comes from the pool.
        let again = payload_buffer(n / 2);
        assert_eq!(again.len(), n / 2);
        assert!(payload_buffer(16).len() == 16);
        drop(again);
        assert_eq!(copy_values(&[2.0; 8]).to_vec(), vec![2.0; 8]);
    }
}
