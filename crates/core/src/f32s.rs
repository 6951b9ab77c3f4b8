//! Serde for `Vec<f32>` as one byte string (little-endian f32s), not element by element:
//! postcard then writes a length and copies the bytes, so a 4 MiB block state encodes and
//! decodes at memory speed. Formats without byte strings (JSON) get a sequence of numbers.

use serde::de::{self, SeqAccess, Visitor};
use serde::{Deserializer, Serializer};

/// Serializes `v` as a byte string of little-endian f32s.
pub fn serialize<S: Serializer>(v: &[f32], s: S) -> Result<S::Ok, S::Error> {
    let mut bytes = Vec::with_capacity(v.len() * 4);
    for x in v {
        bytes.extend_from_slice(&x.to_le_bytes());
    }
    s.serialize_bytes(&bytes)
}

/// Deserializes what [`serialize`] wrote (or a sequence of numbers).
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<f32>, D::Error> {
    d.deserialize_bytes(F32s)
}

struct F32s;

impl<'de> Visitor<'de> for F32s {
    type Value = Vec<f32>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a byte string of little-endian f32s")
    }

    fn visit_bytes<E: de::Error>(self, b: &[u8]) -> Result<Vec<f32>, E> {
        if !b.len().is_multiple_of(4) {
            return Err(E::invalid_length(b.len(), &"a multiple of 4 bytes"));
        }
        Ok(b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<f32>, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 20));
        while let Some(x) = seq.next_element()? {
            out.push(x);
        }
        Ok(out)
    }
}
