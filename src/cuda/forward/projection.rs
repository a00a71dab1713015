//! The dense projections of a pass: a layer's first projection (plain, or with the previous MoE
//! combine and the input norm made in its GEMV), and `y = W · x` for any number of rows, each by
//! the kernel that suits the rows (cuBLAS, the tensor-core GEMM, or decode GEMVs).

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use half::bf16;

use super::fp8;
use super::residual::{Output, Parts, ResidualStream};
use super::{Kernels, Scratch};
use crate::config::ModelConfig;
use crate::cuda::dense;
use crate::cuda::gemm::{L2Ahead, MAX_TOKENS};
use crate::cuda::gemm_prefill::GemmKernels;
use crate::cuda::weights::DeviceMatrices;
use crate::cuda::Result;

/// A layer's first projection (in_proj or q‖k‖v) of `t` rows into `s.proj`: of `s.xn`, or with
/// `combine` of the previous layer's MoE combine and this layer's input norm made in the GEMV
/// (forward/residual.rs); `ahead` is what it pulls into L2.
pub(super) fn first_projection(
    c: &ModelConfig,
    k: &mut Kernels,
    w: &DeviceMatrices,
    s: &mut Scratch,
    t: usize,
    combine: Option<(&mut ResidualStream, &CudaSlice<f32>)>,
    ahead: L2Ahead,
) -> Result<()> {
    match combine {
        Some((stream, norm)) => {
            k.gemv.then_prefetch(ahead);
            let (eps, slots) = (c.rms_norm_eps, c.num_experts_per_tok + 1);
            stream.gemv(
                k,
                w,
                s,
                t,
                Parts::Experts,
                norm,
                eps,
                false,
                Output::Proj,
                slots,
            )
        }
        None => {
            let x = s.xn.slice(..t * c.hidden_size);
            gemv_rows(k, w, &x, &mut s.proj.slice_mut(..t * w.rows), t, ahead)
        }
    }
}

/// `y = W · x` for `t` rows: an FP8 checkpoint's matrix in its FP8 form for long passes
/// with `LILY_FP8_DENSE=1` (forward/fp8.rs); cuBLAS on the kept bf16 copy of the matrix (the
/// mixers' projections and the routers, dense.rs) for more rows than one GEMV launch takes, and
/// on dequantised weights for long chunks; else GEMV row chunks in one launch for up to a few dozen
/// rows (matrices of ≤ 4,096 rows), our tensor-core GEMM for more than 8, or GEMVs of as many tokens
/// per launch as fit in shared memory (≤ 8).
///
/// Why cuBLAS from 9 rows: at 16–64 rows our 4-bit GEMM streams in_proj at ≈ 0.5 TB/s (49 tiles of
/// 256 weight rows) and the row chunks read out_proj once per 8 rows, while cuBLAS reads the bf16
/// copy (4× the bytes) at ≈ 2.5–3 TB/s: in the 64-row step in_proj 28 → 19 µs, q‖k‖v 29 → 20,
/// o_proj 19 → 8 (bench/NOTES.md v1.63). At 8 rows and fewer the 4-bit GEMV is faster.
pub(super) fn gemv_rows(
    k: &mut Kernels,
    w: &DeviceMatrices,
    x: &CudaView<bf16>,
    y: &mut CudaViewMut<bf16>,
    t: usize,
    ahead: L2Ahead,
) -> Result<()> {
    let (rows, cols) = (w.rows, w.cols);
    // An FP8 checkpoint's long passes with LILY_FP8_DENSE=1: the matrix as it ships, on FP8.
    if fp8_dense(k, w, t) {
        if let (Some(path), Some(w8)) = (&mut k.fp8, &w.fp8) {
            return path.gemm(w8, x, y, t);
        }
    }
    let view = w.view();
    if cublas(k, w, t) {
        return k
            .dense
            .gemm(&view, &x.slice(..t * cols), &mut y.slice_mut(..t * rows));
    }
    if k.gemv.chunks_rows(t, &view) {
        return k
            .gemv
            .gemv_row_chunks(&view, &x.slice(..t * cols), &mut y.slice_mut(..t * rows));
    }
    if t > MAX_TOKENS && GemmKernels::supports(&view) {
        return k
            .gemm
            .gemm(&view, &x.slice(..t * cols), &mut y.slice_mut(..t * rows));
    }
    let per_launch = k.gemv.max_tokens(&view);
    let mut done = 0;
    while done < t {
        let n = per_launch.min(t - done);
        let xs = x.slice(done * cols..(done + n) * cols);
        let mut ys = y.slice_mut(done * rows..(done + n) * rows);
        if done + n == t {
            k.gemv.then_prefetch(ahead);
        }
        k.gemv.gemv(&view, &xs, &mut ys)?;
        done += n;
    }
    Ok(())
}

/// The router's logits of `t` rows of `x` into `y` (room for `t` rows at any pitch below), rows
/// a returned pitch apart: cuBLAS's aligned output as it is where long passes take cuBLAS (257
/// rows padded to 264: no copy into packed rows, dense.rs), else packed rows of `w.rows`.
pub(super) fn router_logits(
    k: &mut Kernels,
    w: &DeviceMatrices,
    x: &CudaView<bf16>,
    y: &mut CudaViewMut<bf16>,
    t: usize,
) -> Result<usize> {
    if cublas(k, w, t) {
        let pitch = dense::padded_rows(w.rows);
        return k.dense.gemm_pitched(
            &w.view(),
            &x.slice(..t * w.cols),
            &mut y.slice_mut(..t * pitch),
        );
    }
    gemv_rows(
        k,
        w,
        x,
        &mut y.slice_mut(..t * w.rows),
        t,
        L2Ahead::default(),
    )?;
    Ok(w.rows)
}

/// Whether `gemv_rows` multiplies `w` for `t` rows in its FP8 form (an FP8 checkpoint's long
/// passes with LILY_FP8_DENSE=1).
fn fp8_dense(k: &Kernels, w: &DeviceMatrices, t: usize) -> bool {
    t >= fp8::FROM_ROWS && w.fp8.is_some() && k.fp8.as_ref().is_some_and(|p| p.dense)
}

/// Whether `gemv_rows` multiplies `w` for `t` rows through cuBLAS (dense.rs): long chunks, or
/// passes of `cublas_from_rows` rows or more where a bf16 copy of `w` is kept (passes that short
/// are captured in decode graphs, where nothing may be dequantised into scratch).
fn cublas(k: &Kernels, w: &DeviceMatrices, t: usize) -> bool {
    let view = w.view();
    !fp8_dense(k, w, t)
        && GemmKernels::supports(&view)
        && (t >= dense::MIN_TOKENS || (t >= k.cublas_from_rows && k.dense.keeps(&view)))
}
