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
}
