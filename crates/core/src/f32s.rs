//! Serde for `Vec<f32>` as one byte string (little-endian f32s), not element by element:
//! postcard then writes a length and copies the bytes, so a 4 MiB block state encodes and
//! decodes at memory speed. Formats without byte strings (JSON) get a sequence of numbers.

use serde::de::{self, SeqAccess, Visitor};
use serde::{Deserializer, Serializer};

/// Serializes `v` as a byte string of little-endian f32s.
pub fn serialize<S: Serializer>(v: &[f32], s: S) -> Result<S::Ok, S::Error> {
    if cfg!(target_endian = "little") {
        // The values' own bytes: no temporary, no per-element loop.
        return s.serialize_bytes(bytemuck::cast_slice(v));
    }
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
        if cfg!(target_endian = "little") {
            // One copy of the bytes into an aligned buffer.
            let mut out = vec![0f32; b.len() / 4];
            bytemuck::cast_slice_mut::<f32, u8>(&mut out).copy_from_slice(b);
            return Ok(out);
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

#[cfg(test)]
mod tests {
    #[derive(serde::Serialize, serde::Deserialize, PartialEq, Debug)]
    struct Holder(#[serde(with = "super")] Vec<f32>);

    #[test]
    fn postcard_carries_the_values_as_one_little_endian_byte_string() {
        let v = Holder(vec![1.5, -0.0, f32::MAX, 3.25e-20, f32::NAN.copysign(1.0)]);
        let bytes = postcard::to_allocvec(&v).unwrap();
        // A length (20 as a varint), then each value's little-endian bytes.
        let mut expected = vec![20u8];
        for x in &v.0 {
            expected.extend_from_slice(&x.to_le_bytes());
        }
        assert_eq!(bytes, expected);
        let back: Holder = postcard::from_bytes(&bytes).unwrap();
        assert_eq!(
            back.0.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            v.0.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        // A byte string that is not whole f32s is refused.
        assert!(postcard::from_bytes::<Holder>(&[3, 0, 0, 0]).is_err());
    }
}
