//! Weight formats: MLX-compatible affine quantisation (MODEL.md §5.1).
//!
//! A `[rows, cols]` matrix with `bits`-bit codes and group size `g` stores
//! - `weight`: u32 words, `cols · bits / 32` per row; word `w` holds columns `w·(32/bits) ..`, the
//!   first column in the lowest bits;
//! - `scales`, `biases`: `[rows, cols / g]` in the model dtype (bf16);
//! and the value is `scale · q + bias` with unsigned `q`.

use crate::checkpoint::tensor::DType;

/// Reads element `i` of a little-endian bf16/f16/f32 array.
#[inline]
pub fn read_scalar(bytes: &[u8], dtype: DType, i: usize) -> f32 {
    match dtype {
        DType::BF16 => {
            f32::from_bits((u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]) as u32) << 16)
        }
        DType::F16 => half::f16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
        DType::F32 => f32::from_le_bytes([
            bytes[4 * i],
            bytes[4 * i + 1],
            bytes[4 * i + 2],
            bytes[4 * i + 3],
        ]),
        other => panic!("scale dtype {other:?} (loaders check dtypes first)"),
    }
}

/// Dequantises one packed row into `out` (`out.len()` = columns).
pub fn dequantize_row(
    packed: &[u8],
    scales: &[u8],
    biases: &[u8],
    scale_dtype: DType,
    bits: u32,
    group_size: usize,
    out: &mut [f32],
) {
    let per_word = 32 / bits as usize;
    let mask = (1u32 << bits) - 1;
    for (gi, chunk) in out.chunks_mut(group_size).enumerate() {
        let s = read_scalar(scales, scale_dtype, gi);
        let b = read_scalar(biases, scale_dtype, gi);
        let first = gi * group_size;
        for (j, o) in chunk.iter_mut().enumerate() {
            let c = first + j;
            let w = c / per_word;
            let word = u32::from_le_bytes([
                packed[4 * w],
                packed[4 * w + 1],
                packed[4 * w + 2],
                packed[4 * w + 3],
            ]);
            let q = (word >> (bits as usize * (c % per_word))) & mask;
            *o = s * q as f32 + b;
        }
    }
}
