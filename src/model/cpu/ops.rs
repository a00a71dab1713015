//! The elementary operations of the forward pass, in f32, as plainly as MODEL.md writes them.
//! These are also the references the CUDA kernels are tested against.

use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;

use crate::model::weights::Matrix;

/// Round activations to bf16 where a bf16 engine keeps them (`lily agree
/// --reference-bf16-activations`): every matmul's output, every norm's output, the gated mixer
/// outputs, the SwiGLU activations, the rotated keys and queries, the residual stream after each
/// add — the points where the CUDA backend (and transformers in bf16) store a bf16 tensor. Off in
/// the reference, which keeps f32; `lily agree` turns it on for its reference side only, to
/// measure how far bf16 activations alone move a model from the f32 reference.
pub static ACTIVATIONS_BF16: AtomicBool = AtomicBool::new(false);

/// Rounds `v` to bf16 when [`ACTIVATIONS_BF16`] asks for it.
pub fn round_activations(v: &mut [f32]) {
    if ACTIVATIONS_BF16.load(Ordering::Relaxed) {
        for x in v {
            *x = half::bf16::from_f32(*x).to_f32();
        }
    }
}

/// `y[t] = W · x[t]` for `t` tokens: `x` is `[t, cols]`, the result `[t, rows]`.
/// Rows are decoded (dequantised) once and used for every token; work is split across threads
/// by blocks of rows.
pub fn matmul(w: &Matrix, x: &[f32], tokens: usize) -> Vec<f32> {
    let (rows, cols) = (w.rows, w.cols);
    assert_eq!(x.len(), tokens * cols, "matmul input shape");
    const BLOCK: usize = 16;
    // A block's rows are dequantised once, then each token's x (read once per block, kept in L1
    // while the block's rows stream from L2) is dotted with all of them.
    let block = |b: usize| {
        let r0 = b * BLOCK;
        let n = BLOCK.min(rows - r0);
        let mut block_rows = vec![0f32; n * cols];
        for (i, row) in block_rows.chunks_exact_mut(cols).enumerate() {
            w.row_into(r0 + i, row);
        }
        let mut out = vec![0f32; n * tokens];
        dots(&block_rows, x, cols, &mut out);
        out
    };
    // Small products cost less than handing them to other threads.
    let n_blocks = rows.div_ceil(BLOCK);
    let blocks: Vec<Vec<f32>> = if rows * cols * tokens < 1 << 18 {
        (0..n_blocks).map(block).collect()
    } else {
        (0..n_blocks).into_par_iter().map(block).collect()
    };
    let mut y = vec![0f32; tokens * rows];
    for (b, out) in blocks.iter().enumerate() {
        let r0 = b * BLOCK;
        let n = out.len() / tokens.max(1);
        for i in 0..n {
            for t in 0..tokens {
                y[t * rows + r0 + i] = out[i * tokens + t];
            }
        }
    }
    round_activations(&mut y);
    y
}

/// `out[i · tokens + t] = dot(row i, x[t])` for a block of dequantised `rows` and every row of
/// `x` (`cols` each; each token's x stays in L1 while the block's rows stream from L2). In AVX2
/// where the CPU has it: the same additions in the same order, so the same bits, eight lanes to a
/// register instead of four — 11 % less CPU time for the reference at a 4K prompt (register-blocked
/// 2 rows × 2 tokens and 1 row × 4 tokens variants measured 47 % and 27 % slower: not here).
fn dots(rows: &[f32], x: &[f32], cols: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return unsafe { dots_avx2(rows, x, cols, out) };
    }
    dots_any(rows, x, cols, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dots_avx2(rows: &[f32], x: &[f32], cols: usize, out: &mut [f32]) {
    dots_any(rows, x, cols, out)
}

#[inline(always)]
fn dots_any(rows: &[f32], x: &[f32], cols: usize, out: &mut [f32]) {
    let tokens = x.len() / cols;
    for (t, xt) in x.chunks_exact(cols).enumerate() {
        for (i, row) in rows.chunks_exact(cols).enumerate() {
            out[i * tokens + t] = dot(row, xt);
        }
    }
}

/// Dot product in 8 lanes (lane j sums the products at j, j + 8, ...), then the lanes in order.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot: lengths");
    let n8 = a.len() / 8 * 8;
    let mut acc = [0f32; 8];
    dot_lanes(&a[..n8], &b[..n8], &mut acc);
    let mut s: f32 = acc.iter().sum();
    for (x, y) in a[n8..].iter().zip(&b[n8..]) {
        s += x * y;
    }
    s
}

#[inline(always)]
fn dot_lanes(a: &[f32], b: &[f32], acc: &mut [f32; 8]) {
    for (ca, cb) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for j in 0..8 {
            acc[j] += ca[j] * cb[j];
        }
    }
}

/// RMSNorm with an effective multiplier: `x · rsqrt(mean(x²) + eps) · w`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32 + eps).sqrt();
    for ((o, v), w) in out.iter_mut().zip(x).zip(w) {
        *o = v * inv * w;
    }
    round_activations(out);
}

/// RMSNorm applied to each row of `x` (`[rows, w.len()]`).
pub fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    out.chunks_mut(w.len())
        .zip(x.chunks(w.len()))
        .for_each(|(o, x)| rms_norm(x, w, eps, o));
    out
}

/// L2 normalisation with the epsilon added to the sum of squares (MODEL.md §3.6.3).
pub fn l2_normalize(x: &mut [f32], eps: f32) {
    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() + eps).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `log(1 + e^x)`, stable for large |x| (PyTorch switches to `x` above 20).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// In-place softmax.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    x.iter_mut().for_each(|v| *v /= sum);
}

/// cos and sin of the rotary angles for one position: `[rotary_dim / 2]` each.
pub fn rope_angles(pos: usize, rotary_dim: usize, theta: f64) -> (Vec<f32>, Vec<f32>) {
    let half = rotary_dim / 2;
    (0..half)
        .map(|i| {
            let inv_freq = (1.0 / theta.powf(2.0 * i as f64 / rotary_dim as f64)) as f32;
            let ang = pos as f32 * inv_freq;
            (ang.cos(), ang.sin())
        })
        .unzip()
}

/// Rotate-half RoPE on the first `2 · cos.len()` dims of one head: pairs `(j, j + half)`.
pub fn apply_rope(head: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    for j in 0..half {
        let (a, b) = (head[j], head[j + half]);
        head[j] = a * cos[j] - b * sin[j];
        head[j + half] = b * cos[j] + a * sin[j];
    }
}

/// Indices of the `k` largest values, largest first; ties go to the lower index.
pub fn top_k(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}
