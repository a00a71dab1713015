//! Weight formats: MLX-compatible affine quantisation (MODEL.md §5.1).
//!
//! A `[rows, cols]` matrix with `bits`-bit codes and group size `g` stores
//! - `weight`: u32 words, `cols · bits / 32` per row; word `w` holds columns `w·(32/bits) ..`, the
//!   first column in the lowest bits;
//! - `scales`, `biases`: `[rows, cols / g]` in the model dtype (bf16);
//!
//! and the value is `scale · q + bias` with unsigned `q`.
//!
//! The quantiser reproduces MLX's CPU quantiser (`mlx/backend/cpu/quantized.cpp`, MLX 0.32) bit for
//! bit, so that `lily quantize` and `mlx_lm.convert -q` write the same bytes. Per group of `g`
//! values, all in f32:
//! - `scale = max((max − min) / (2^bits − 1), 1e-7)`, negated unless `|min| > |max|`;
//! - `edge` = the extreme with the larger magnitude (`max` when they are equal);
//! - `q0 = rint(edge / scale)` (ties to even); if `q0 ≠ 0` then `scale = edge / q0` and
//!   `bias = edge`, else `bias = 0`. This makes `edge` (code 0) and zero (code `|q0|`) exact;
//! - `q = clamp(rint((w − bias) / scale), 0, 2^bits − 1)`, computed with the f32 scale and bias;
//! - only then are scale and bias rounded (to nearest even) to the storage dtype.
//!
//! MLX's Metal and CUDA kernels round ties away from zero instead, so checkpoints quantised on an
//! Apple GPU differ from these in the codes of values that fall exactly half-way (about 0.2 % of
//! bf16 weights, by one or two steps); every such checkpoint still loads and dequantises exactly.

use crate::checkpoint::tensor::DType;

/// Code widths this module packs: those that fill a u32 word exactly, as MLX packs them.
pub const SUPPORTED_BITS: [u32; 3] = [2, 4, 8];

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    #[error("{bits}-bit affine codes are not supported (supported: 2, 4 and 8 bits, packed into u32 words)")]
    Bits { bits: u32 },
    #[error("group size {group_size} is not a positive multiple of {per_word} (the {bits}-bit codes in one u32 word)")]
    GroupSize {
        group_size: usize,
        bits: u32,
        per_word: usize,
    },
    #[error("group size {group_size} does not divide the {cols} columns")]
    Columns { group_size: usize, cols: usize },
}

/// The parameters of affine quantisation: code width and group size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Affine {
    pub bits: u32,
    pub group_size: usize,
}

impl Affine {
    /// Checks that the codes pack into whole u32 words and that every group does too.
    pub fn new(bits: u32, group_size: usize) -> Result<Affine, QuantError> {
        if !SUPPORTED_BITS.contains(&bits) {
            return Err(QuantError::Bits { bits });
        }
        let per_word = (32 / bits) as usize;
        if group_size == 0 || group_size % per_word != 0 {
            return Err(QuantError::GroupSize {
                group_size,
                bits,
                per_word,
            });
        }
        Ok(Affine { bits, group_size })
    }
    /// Whether a matrix with `cols` columns can use these parameters.
    pub fn check_cols(&self, cols: usize) -> Result<(), QuantError> {
        if cols % self.group_size != 0 {
            return Err(QuantError::Columns {
                group_size: self.group_size,
                cols,
            });
        }
        Ok(())
    }
    /// The largest code, `2^bits − 1`.
    pub fn max_code(&self) -> u32 {
        (1 << self.bits) - 1
    }
    /// Codes per u32 word.
    pub fn per_word(&self) -> usize {
        (32 / self.bits) as usize
    }
    /// u32 words per row of `cols` columns.
    pub fn words_per_row(&self, cols: usize) -> usize {
        cols / self.per_word()
    }
    pub fn groups_per_row(&self, cols: usize) -> usize {
        cols / self.group_size
    }
}

/// Quantises one group: writes its codes and returns the f32 `(scale, bias)` the codes were
/// computed with (the stored values are these rounded to the storage dtype).
pub fn quantize_group(values: &[f32], bits: u32, codes: &mut [u8]) -> (f32, f32) {
    debug_assert_eq!(values.len(), codes.len());
    let n_bins = ((1u32 << bits) - 1) as f32;
    let (mut w_min, mut w_max) = (f32::INFINITY, f32::NEG_INFINITY);
    for &v in values {
        w_max = w_max.max(v);
        w_min = w_min.min(v);
    }
    let min_is_edge = w_min.abs() > w_max.abs();
    let mut scale = ((w_max - w_min) / n_bins).max(1e-7);
    if !min_is_edge {
        scale = -scale;
    }
    let edge = if min_is_edge { w_min } else { w_max };
    let q0 = (edge / scale).round_ties_even();
    let mut bias = 0.0;
    if q0 != 0.0 {
        scale = edge / q0;
        bias = edge;
    }
    for (c, &v) in codes.iter_mut().zip(values) {
        *c = ((v - bias) / scale).round_ties_even().clamp(0.0, n_bins) as u8;
    }
    (scale, bias)
}

/// Packs codes into u32 words: code `i` of a word sits at bit `bits · i`.
pub fn pack(codes: &[u8], bits: u32, words: &mut [u32]) {
    let per_word = (32 / bits) as usize;
    debug_assert_eq!(codes.len(), words.len() * per_word);
    for (w, chunk) in words.iter_mut().zip(codes.chunks_exact(per_word)) {
        *w = chunk
            .iter()
            .enumerate()
            .fold(0, |acc, (i, &c)| acc | (c as u32) << (bits as usize * i));
    }
}

/// The inverse of [`pack`].
pub fn unpack(words: &[u32], bits: u32, codes: &mut [u8]) {
    let per_word = (32 / bits) as usize;
    let mask = (1u32 << bits) - 1;
    debug_assert_eq!(codes.len(), words.len() * per_word);
    for (chunk, &w) in codes.chunks_exact_mut(per_word).zip(words) {
        for (i, c) in chunk.iter_mut().enumerate() {
            *c = ((w >> (bits as usize * i)) & mask) as u8;
        }
    }
}

/// Quantises one row (a whole number of groups), appending the packed words (little-endian
/// bytes) to `packed` and the scales and biases, in `dtype`, to `scales` and `biases`.
pub fn quantize_row(
    row: &[f32],
    q: Affine,
    dtype: DType,
    packed: &mut Vec<u8>,
    scales: &mut Vec<u8>,
    biases: &mut Vec<u8>,
) {
    debug_assert_eq!(row.len() % q.group_size, 0);
    let mut codes = vec![0u8; q.group_size];
    let mut words = vec![0u32; q.group_size / q.per_word()];
    for group in row.chunks_exact(q.group_size) {
        let (s, b) = quantize_group(group, q.bits, &mut codes);
        pack(&codes, q.bits, &mut words);
        packed.extend(words.iter().flat_map(|w| w.to_le_bytes()));
        encode_scalar(s, dtype, scales);
        encode_scalar(b, dtype, biases);
    }
}

/// A quantised matrix as MLX stores it: packed words and per-group scales and biases, each as
/// little-endian bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quantized {
    pub packed: Vec<u8>,
    pub scales: Vec<u8>,
    pub biases: Vec<u8>,
}

/// Quantises a row-major matrix of `cols` columns, with scales and biases stored in `dtype`.
pub fn quantize(
    values: &[f32],
    cols: usize,
    q: Affine,
    dtype: DType,
) -> Result<Quantized, QuantError> {
    q.check_cols(cols)?;
    let rows = values.len() / cols.max(1);
    let mut out = Quantized {
        packed: Vec::with_capacity(rows * q.words_per_row(cols) * 4),
        scales: Vec::with_capacity(rows * q.groups_per_row(cols) * dtype.size()),
        biases: Vec::with_capacity(rows * q.groups_per_row(cols) * dtype.size()),
    };
    for row in values.chunks_exact(cols) {
        quantize_row(
            row,
            q,
            dtype,
            &mut out.packed,
            &mut out.scales,
            &mut out.biases,
        );
    }
    Ok(out)
}

/// Appends `v` rounded to `dtype` (to nearest even, as MLX and PyTorch cast).
pub fn encode_scalar(v: f32, dtype: DType, out: &mut Vec<u8>) {
    match dtype {
        DType::BF16 => out.extend(half::bf16::from_f32(v).to_le_bytes()),
        DType::F16 => out.extend(half::f16::from_f32(v).to_le_bytes()),
        DType::F32 => out.extend(v.to_le_bytes()),
        other => panic!("scale dtype {other:?} (callers choose a float dtype)"),
    }
}

/// `v` rounded to the float dtype `dtype`, back in f32.
pub fn round_to(v: f32, dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => half::bf16::from_f32(v).to_f32(),
        DType::F16 => half::f16::from_f32(v).to_f32(),
        _ => v,
    }
}

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

/// `s·q + b` for the `N` values of each little-endian word, `32 / N` bits each (element k in
/// bits k·32/N and up).
#[inline]
fn dequantize_words<'a, const N: usize>(
    out: &mut [f32],
    words: impl Iterator<Item = &'a [u8]>,
    s: f32,
    b: f32,
) {
    let bits = 32 / N;
    let mask = (1u32 << bits) - 1;
    for (o, wb) in out.chunks_exact_mut(N).zip(words) {
        let word = u32::from_le_bytes([wb[0], wb[1], wb[2], wb[3]]);
        for (k, v) in o.iter_mut().enumerate() {
            *v = s * ((word >> (bits * k)) & mask) as f32 + b;
        }
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
        // Whole words of 4 or 8 bits (every MLX checkpoint of this model): word by word, the
        // same values as the general path below (which the CPU tests and the GPU's long runs
        // spend most of their time in otherwise).
        let whole = first % per_word == 0 && chunk.len() % per_word == 0;
        let words =
            || packed[first / per_word * 4..(first + chunk.len()) / per_word * 4].chunks_exact(4);
        match bits {
            4 if whole => {
                dequantize_words::<8>(chunk, words(), s, b);
                continue;
            }
            8 if whole => {
                dequantize_words::<4>(chunk, words(), s, b);
                continue;
            }
            _ => {}
        }
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
