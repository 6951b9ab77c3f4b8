//! [`Dtype`]: how values travel on the wire (f32, bf16 or fp16), and the conversions
//! between them. Servers keep f32 master values and optimizer state whatever a push or a
//! pull reply carries; a reduced-precision payload is converted at its edges only.
//!
//! f32 -> bf16 and f32 -> fp16 round to nearest, ties to even (the `half` crate's
//! conversions, as torch's `.to(torch.bfloat16)`); a NaN stays a NaN, an infinity an
//! infinity, and an f32 beyond fp16's range becomes an infinity of its sign. The way back
//! is exact.

use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};
use serde::{Deserialize, Serialize};

use crate::CoreError;

/// The element type of a tensor payload on the wire.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Dtype {
    /// IEEE binary32, 4 bytes: exact.
    #[default]
    F32,
    /// bfloat16, 2 bytes: f32's range, 8 bits of precision.
    Bf16,
    /// IEEE binary16, 2 bytes: 11 bits of precision, magnitudes up to 65,504.
    F16,
}

impl Dtype {
    /// Every dtype, in wire-code order.
    pub const ALL: [Dtype; 3] = [Dtype::F32, Dtype::Bf16, Dtype::F16];

    /// Bytes per value.
    pub const fn width(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
        }
    }

    /// Its code in a frame header's flags (docs/PROTOCOL.md §3): 0, 1, 2.
    pub const fn code(self) -> u16 {
        match self {
            Dtype::F32 => 0,
            Dtype::Bf16 => 1,
            Dtype::F16 => 2,
        }
    }

    /// The dtype of a code, if any.
    pub const fn from_code(code: u16) -> Option<Dtype> {
        match code {
            0 => Some(Dtype::F32),
            1 => Some(Dtype::Bf16),
            2 => Some(Dtype::F16),
            _ => None,
        }
    }

    /// Its name as the command line and Python spell it: `f32`, `bf16`, `fp16`.
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "fp16",
        }
    }

    /// `values` in this dtype, appended to `out` as little-endian bytes.
    pub fn encode_into(self, values: &[f32], out: &mut Vec<u8>) {
        match self {
            Dtype::F32 => out.extend_from_slice(bytemuck::cast_slice(values)),
            Dtype::Bf16 => out.extend(values.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes())),
            Dtype::F16 => out.extend(values.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes())),
        }
    }

    /// `values` in this dtype, as little-endian bytes.
    pub fn encode(self, values: &[f32]) -> Vec<u8> {
        let mut out = Vec::with_capacity(values.len() * self.width());
        self.encode_into(values, &mut out);
        out
    }

    /// Reads `bytes` (little-endian values of this dtype, any alignment) into `dst`.
    ///
    /// # Panics
    ///
    /// If `bytes.len() != dst.len() * self.width()`; callers check lengths first.
    pub fn decode_into(self, bytes: &[u8], dst: &mut [f32]) {
        assert_eq!(bytes.len(), dst.len() * self.width(), "Dtype::decode_into: length differs");
        match self {
            Dtype::F32 => bytemuck::cast_slice_mut::<f32, u8>(dst).copy_from_slice(bytes),
            Dtype::Bf16 => {
                for (d, b) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
                    *d = bf16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            Dtype::F16 => {
                for (d, b) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
                    *d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
        }
    }

    /// `v` as it arrives after a trip through this dtype.
    pub fn round(self, v: f32) -> f32 {
        match self {
            Dtype::F32 => v,
            Dtype::Bf16 => bf16::from_f32(v).to_f32(),
            Dtype::F16 => f16::from_f32(v).to_f32(),
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Dtype {
    type Err = CoreError;

    /// `f32` (or `fp32`, `float32`), `bf16` (`bfloat16`), `fp16` (`f16`, `float16`, `half`).
    fn from_str(s: &str) -> Result<Self, CoreError> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" | "float" => Ok(Dtype::F32),
            "bf16" | "bfloat16" => Ok(Dtype::Bf16),
            "fp16" | "f16" | "float16" | "half" => Ok(Dtype::F16),
            _ => Err(CoreError::BadDtype(s.to_owned())),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// The distance between `x` and the next bf16 away from zero: one bf16 ulp at `x`.
    fn bf16_ulp(x: f32) -> f32 {
        let b = bf16::from_f32(x.abs());
        (bf16::from_bits(b.to_bits() + 1).to_f32() - b.to_f32()).abs()
    }

    proptest! {
        /// bf16 round-trips within one ulp of bf16 (half of one, in fact: it rounds to
        /// nearest), keeps the sign, and goes back to f32 exactly.
        #[test]
        fn bf16_round_trips_within_one_bf16_ulp(bits in any::<u32>()) {
            let x = f32::from_bits(bits);
            let bytes = Dtype::Bf16.encode(&[x]);
            prop_assert_eq!(bytes.len(), 2);
            let mut back = [0.0f32];
            Dtype::Bf16.decode_into(&bytes, &mut back);
            let y = back[0];
            if x.is_nan() {
                prop_assert!(y.is_nan());
            } else if x.is_infinite() || x.abs() > bf16::MAX.to_f32() + bf16_ulp(bf16::MAX.to_f32()) / 2.0 {
                prop_assert_eq!(y, f32::INFINITY.copysign(x));
            } else {
                prop_assert!((y - x).abs() <= bf16_ulp(x) / 2.0, "{x} -> {y}: more than half a bf16 ulp");
                prop_assert_eq!(y.is_sign_negative(), x.is_sign_negative());
                // A bf16 value survives a second trip unchanged.
                prop_assert_eq!(Dtype::Bf16.round(y).to_bits(), y.to_bits());
            }
        }

        /// fp16 within half an fp16 ulp in its normal range; every dtype decodes what it
        /// encoded, for whole slices at any offset.
        #[test]
        fn every_dtype_decodes_what_it_encoded(values in proptest::collection::vec(-60_000.0f32..60_000.0, 0..64), skew in 0usize..2) {
            for dtype in Dtype::ALL {
                let mut bytes = vec![0u8; skew];
                dtype.encode_into(&values, &mut bytes);
                let mut back = vec![0.0f32; values.len()];
                dtype.decode_into(&bytes[skew..], &mut back);
                for (x, y) in values.iter().zip(&back) {
                    prop_assert_eq!(y.to_bits(), dtype.round(*x).to_bits());
                    let tol = match dtype {
                        Dtype::F32 => 0.0,
                        Dtype::Bf16 => x.abs() / 256.0,
                        Dtype::F16 => (x.abs() / 2048.0).max(f16::MIN_POSITIVE_SUBNORMAL.to_f32()),
                    };
                    prop_assert!((y - x).abs() <= tol, "{dtype}: {x} -> {y}");
                }
            }
        }
    }

    #[test]
    fn rounds_to_nearest_even_and_keeps_specials() {
        // 1 + 2^-8 is halfway between two bf16s (1 and 1 + 2^-7): ties go to even (1).
        assert_eq!(Dtype::Bf16.round(1.0 + 1.0 / 256.0), 1.0);
        assert_eq!(Dtype::Bf16.round(1.0 + 3.0 / 256.0), 1.0 + 4.0 / 256.0);
        assert!(Dtype::Bf16.round(f32::NAN).is_nan());
        assert_eq!(Dtype::F16.round(1e6), f32::INFINITY);
        assert_eq!(Dtype::F16.round(-1e6), f32::NEG_INFINITY);
        assert_eq!(Dtype::Bf16.round(-0.0).to_bits(), (-0.0f32).to_bits());
    }

    #[test]
    fn names_codes_and_widths() {
        for d in Dtype::ALL {
            assert_eq!(Dtype::from_code(d.code()), Some(d));
            assert_eq!(d.name().parse::<Dtype>().unwrap(), d);
        }
        assert_eq!(Dtype::from_code(3), None);
        assert_eq!("BFloat16".parse::<Dtype>().unwrap(), Dtype::Bf16);
        assert!(matches!("int8".parse::<Dtype>(), Err(CoreError::BadDtype(s)) if s == "int8"));
        assert_eq!((Dtype::F32.width(), Dtype::Bf16.width(), Dtype::F16.width()), (4, 2, 2));
    }
}
