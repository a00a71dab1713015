//! The official FP8 release (`Qwen/Qwen3.6-35B-A3B-FP8`, MODEL.md §5.3): linear weights as
//! F8_E4M3 with a `weight_scale_inv` multiplier per 128×128 tile (DeepSeek-V3's convention: the
//! "_inv" is a multiplier, `w = fp8 · scale_inv`); the modules in `modules_to_not_convert`
//! (embeddings, head, routers, norms, ...) stay bf16. The loader keeps the FP8 bytes as they are
//! ([`crate::model::weights::WeightFormat::Fp8`]) and dequantises rows when they are used.

use std::sync::OnceLock;

use serde_json::Value;

use crate::config::ConfigError;

/// The e4m3 ("fn": finite, no infinities) value of byte `b`: 1 sign bit, 4 exponent bits with
/// bias 7, 3 mantissa bits; `S.1111.111` is NaN.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((b >> 3) & 0xF) as i32;
    let mant = (b & 7) as f32;
    if exp == 15 && b & 7 == 7 {
        return f32::NAN;
    }
    // Exact in f32: at most 4 significant bits and exponents within −9..8.
    let magnitude = if exp == 0 {
        mant / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + mant / 8.0) * 2f32.powi(exp - 7)
    };
    sign * magnitude
}

/// The e4m3 byte nearest to `x`, ties to even, saturating at ±448 (NaN stays NaN): what PTX's
/// `cvt.rn.satfinite.e4m3x2.f32` makes, which the GPU's FP8 products use to quantise
/// activations (`quantize_fp8_rows` in gemm_fp8.cu, tested against this).
pub fn e4m3_from_f32(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs() as f64;
    if a >= 448.0 {
        return sign | 0x7E;
    }
    // Below 2⁻⁶ the codes are subnormal: steps of 2⁻⁹, rounding up into the first normal (0x08).
    if a < 2f64.powi(-6) {
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let e = a.log2().floor() as i32; // a ≥ 2⁻⁶: exact for these magnitudes
    let e = if 2f64.powi(e) > a { e - 1 } else { e }; // guard log2 rounding near powers of 2
    let m = ((a / 2f64.powi(e) - 1.0) * 8.0).round_ties_even() as i32; // 0..=8
    let (e, m) = if m == 8 { (e + 1, 0) } else { (e, m) };
    sign | (((e + 7) as u8) << 3 | m as u8).min(0x7E)
}

/// [`e4m3_to_f32`] of every byte, for decoding whole rows.
pub fn e4m3_table() -> &'static [f32; 256] {
    static TABLE: OnceLock<[f32; 256]> = OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|b| e4m3_to_f32(b as u8)))
}

/// The tile size of an FP8 checkpoint's `quantization_config`, `None` when the config does not
/// describe one. Only square tiles and e4m3 are read (what Qwen ships).
pub fn block_size(root: &Value) -> Result<Option<usize>, ConfigError> {
    let Some(q) = root.get("quantization_config") else {
        return Ok(None);
    };
    if q.get("quant_method").and_then(Value::as_str) != Some("fp8") {
        return Ok(None);
    }
    let bad = |field: &str, expected: &str, found: Option<&Value>| ConfigError::Field {
        field: format!("quantization_config.{field}"),
        expected: expected.into(),
        found: found.map_or("nothing (missing)".into(), Value::to_string),
    };
    if let Some(fmt) = q.get("fmt") {
        if fmt.as_str() != Some("e4m3") {
            return Err(bad(
                "fmt",
                "\"e4m3\" (the only FP8 format lily reads)",
                Some(fmt),
            ));
        }
    }
    let sizes = q.get("weight_block_size");
    match sizes.and_then(Value::as_array).map(|a| a.as_slice()) {
        Some([a, b]) if a == b && a.as_u64().is_some_and(|n| n > 0) => {
            Ok(a.as_u64().map(|n| n as usize))
        }
        _ => Err(bad(
            "weight_block_size",
            "two equal positive sizes, e.g. [128, 128]",
            sizes,
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_known_values() {
        // Every byte against the format's definition computed another way.
        for b in 0..=255u8 {
            let v = e4m3_to_f32(b);
            let (e, m) = ((b >> 3) & 15, b & 7);
            if e == 15 && m == 7 {
                assert!(v.is_nan());
                continue;
            }
            let bits = if e == 0 {
                m as f64 * 2f64.powi(-9)
            } else {
                (8 + m) as f64 * 2f64.powi(e as i32 - 10)
            };
            let expect = if b & 0x80 != 0 { -bits } else { bits };
            assert_eq!(v as f64, expect, "byte {b:#x}");
        }
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
    }

    #[test]
    fn e4m3_encoding_round_trips_and_rounds_to_nearest_even() {
        let finite: Vec<u8> = (0..=255u8).filter(|b| b & 0x7F != 0x7F).collect();
        for &b in &finite {
            assert_eq!(e4m3_from_f32(e4m3_to_f32(b)), b, "byte {b:#x}");
        }
        // Between neighbouring codes of one sign: below the midpoint, at it (to the even code), above.
        for w in finite
            .windows(2)
            .filter(|w| w[0] & 0x80 == w[1] & 0x80 && w[0] & 0x7F < w[1] & 0x7F)
        {
            let (lo, hi) = (e4m3_to_f32(w[0]) as f64, e4m3_to_f32(w[1]) as f64);
            let mid = (lo + hi) / 2.0;
            let even = if w[0] % 2 == 0 { w[0] } else { w[1] };
            assert_eq!(
                e4m3_from_f32(mid as f32),
                even,
                "midpoint of {:#x} and {:#x}",
                w[0],
                w[1]
            );
            let below = (mid - (hi - lo) / 8.0) as f32;
            let above = (mid + (hi - lo) / 8.0) as f32;
            assert_eq!(e4m3_from_f32(below), w[0]);
            assert_eq!(e4m3_from_f32(above), w[1]);
        }
        assert_eq!(e4m3_from_f32(460.0), 0x7E, "saturates, never NaN");
        assert_eq!(e4m3_from_f32(-1e30), 0xFE);
        assert_eq!(e4m3_from_f32(f32::INFINITY), 0x7E);
        assert_eq!(
            e4m3_from_f32(2f32.powi(-11)),
            0x00,
            "a quarter step rounds to zero"
        );
        assert_eq!(e4m3_from_f32(-0.0), 0x80);
        assert!(e4m3_to_f32(e4m3_from_f32(f32::NAN)).is_nan());
    }
}
