//! What names a block, and the stable hash that seeds values from names: the leaves that
//! the model ([`crate::model`]) and the row store ([`crate::rows`]) both build on.

/// Dense index of a block, unique within one model.
pub type BlockId = u32;

/// FNV-1a hash (stable across runs and platforms, unlike `DefaultHasher`).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}
