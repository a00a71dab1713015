//! GGML's block formats, as GGUF files store tensors (MODEL.md §5.2): the type numbers, block
//! sizes and the dequantisation of the formats lily reads.
//!
//! Blocks run along a row (ggml's `ne[0]`, the input dimension), so a row of `cols` values is
//! `cols / block_values` whole blocks. Dequantisation does its f32 arithmetic in the order gguf-py
//! (`gguf.quants`) does, so both give the same bits (tools/check_gguf.py compares them):
//! `(d · sc) · q − (dmin · m)`, never fused.

use half::f16;

/// The ggml tensor types lily reads, with their numbers in the GGUF header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
}

/// The types a GGUF tensor may have for lily to read it, for error messages.
pub const SUPPORTED: &str = "F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K";

/// Values per K-quant super-block.
const QK_K: usize = 256;

impl GgmlType {
    /// The type with ggml number `n`, or the name of the unsupported type (for the error).
    pub fn from_number(n: u32) -> Result<GgmlType, String> {
        Ok(match n {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            30 => GgmlType::BF16,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            other => return Err(unsupported_name(other)),
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::BF16 => "BF16",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q5K => "Q5_K",
            GgmlType::Q6K => "Q6_K",
        }
    }

    /// Values per block.
    pub fn block_values(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q8_0 => 32,
            GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q8_0 => 34,
            GgmlType::Q4K => 144,
            GgmlType::Q5K => 176,
            GgmlType::Q6K => 210,
        }
    }

    /// Bytes of a row of `cols` values (`cols` a multiple of the block size).
    pub fn row_bytes(self, cols: usize) -> usize {
        cols / self.block_values() * self.block_bytes()
    }

    /// Whether this is one of the block-quantised types (not a plain float type).
    pub fn is_quantized(self) -> bool {
        self.block_values() > 1
    }
}

/// The name ggml gives type number `n`, for "unsupported" errors.
fn unsupported_name(n: u32) -> String {
    let name = match n {
        2 => "Q4_0",
        3 => "Q4_1",
        6 => "Q5_0",
        7 => "Q5_1",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => return format!("ggml type {n} (unknown)"),
    };
    format!("{name} (ggml type {n})")
}

/// Dequantises one row of blocks of type `t` into `out` (`out.len()` values).
pub fn dequantize_row(t: GgmlType, bytes: &[u8], out: &mut [f32]) {
    debug_assert_eq!(bytes.len(), t.row_bytes(out.len()));
    let blocks = bytes.chunks_exact(t.block_bytes());
    let outs = out.chunks_exact_mut(t.block_values());
    match t {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            }
        }
        GgmlType::Q8_0 => blocks.zip(outs).for_each(|(b, o)| q8_0(b, o)),
        GgmlType::Q4K => blocks.zip(outs).for_each(|(b, o)| q4_k(b, o)),
        GgmlType::Q5K => blocks.zip(outs).for_each(|(b, o)| q5_k(b, o)),
        GgmlType::Q6K => blocks.zip(outs).for_each(|(b, o)| q6_k(b, o)),
    }
}

fn half_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// `{f16 d; i8 q[32]}`: `q · d`.
fn q8_0(b: &[u8], out: &mut [f32]) {
    let d = half_at(b, 0);
    for (o, &q) in out.iter_mut().zip(&b[2..34]) {
        *o = q as i8 as f32 * d;
    }
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K / Q5_K block's 12 scale bytes.
fn scale_min_k4(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// `{f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}`: 8 sub-blocks of 32 with 4-bit codes; byte
/// `l` of 32-byte chunk `c` holds sub-block `2c` (low nibble) and `2c + 1` (high nibble).
fn q4_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
    let (scales, qs) = (&b[4..16], &b[16..144]);
    for (j, sub) in out.chunks_exact_mut(32).enumerate() {
        let (sc, m) = scale_min_k4(scales, j);
        let (dl, ml) = (d * sc as f32, dmin * m as f32);
        let chunk = &qs[32 * (j / 2)..32 * (j / 2) + 32];
        let shift = 4 * (j % 2);
        for (o, &q) in sub.iter_mut().zip(chunk) {
            *o = dl * ((q >> shift) & 0xF) as f32 - ml;
        }
    }
}

/// `{f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}`: Q4_K's layout plus a fifth bit,
/// bit `j` of `qh[l]` for value `l` of sub-block `j`.
fn q5_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    for (j, sub) in out.chunks_exact_mut(32).enumerate() {
        let (sc, m) = scale_min_k4(scales, j);
        let (dl, ml) = (d * sc as f32, dmin * m as f32);
        let chunk = &qs[32 * (j / 2)..32 * (j / 2) + 32];
        let shift = 4 * (j % 2);
        for (l, o) in sub.iter_mut().enumerate() {
            let q = ((chunk[l] >> shift) & 0xF) | (((qh[l] >> j) & 1) << 4);
            *o = dl * q as f32 - ml;
        }
    }
}

/// `{u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}`: 16 sub-blocks of 16 with signed 6-bit codes
/// (`q − 32`). In each half `h` of 128 values, value `t` takes its low 4 bits from
/// `ql[64h + t mod 64]` (low nibble for t < 64, high nibble after) and its high 2 bits from
/// `qh[32h + t mod 32]` at bit `2·(t / 32)`.
fn q6_k(b: &[u8], out: &mut [f32]) {
    let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = half_at(b, 208);
    for (p, o) in out.iter_mut().enumerate() {
        let (h, t) = (p / 128, p % 128);
        let low = (ql[64 * h + t % 64] >> (4 * (t / 64))) & 0xF;
        let high = (qh[32 * h + t % 32] >> (2 * (t / 32))) & 3;
        let q = (low | (high << 4)) as i8 - 32;
        *o = (d * scales[p / 16] as i8 as f32) * q as f32;
    }
}
