//! An FP8 checkpoint's prefill: passes of at least [`FROM_ROWS`] rows run the experts on the FP8
//! tensor cores (gemm_fp8.rs) from their FP8 form ([`DeviceMatrices::fp8`]), the activations
//! quantised per token and 128 columns first. Attention's projections and GDN's out_proj keep an
//! FP8 form too but run on cuBLAS over their dequantised copy unless `LILY_FP8_DENSE=1` (measured
//! faster). Shorter passes (decode) read the matrices' affine Q8 conversion as any other model's.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use half::bf16;

use crate::cuda::gemm_fp8::{Fp8GemmKernels, Fp8Rows, BLOCK};
use crate::cuda::model::{CudaModel, DeviceMixer};
use crate::cuda::moe::ExpertGroups;
use crate::cuda::weights::{DeviceFp8, DeviceMatrices};
use crate::cuda::{CudaDevice, Result};

/// Passes of at least this many rows take the FP8 products: more than a batched decode step's 64,
/// which keeps the GEMV paths on the Q8 conversion (gathered expert slots, row chunks). Measured
/// faster than the Q8 conversion at every prompt length tried, from 72 tokens (+18 %) to 1,024
/// (+55 %) (bench/NOTES.md v1.46), so there is no later threshold.
pub(super) const FROM_ROWS: usize = 65;
/// The FP8 products' tile height: what the experts' groups are built for.
pub(super) const TILE_ROWS: usize = 128;

/// The FP8 products and the quantised activations of one pass.
pub(super) struct Fp8Path {
    kernels: Fp8GemmKernels,
    /// e4m3 `[rows][width]` and its scales per 128 columns.
    xq: CudaSlice<u8>,
    xs: CudaSlice<f32>,
    /// Whether dense projections take the FP8 products too (`LILY_FP8_DENSE=1`). Off: they take
    /// cuBLAS on their dequantised copy, as the Q8 conversion does — measured faster (H200, 4K
    /// prompt: 54.8K tok/s against 53.1K; bench/NOTES.md v1.45); the experts stay on FP8.
    pub(super) dense: bool,
}

impl Fp8Path {
    /// For passes of up to `rows` rows of at most `width` values (a multiple of 128).
    pub(super) fn new(dev: &CudaDevice, rows: usize, width: usize) -> Result<Self> {
        let width = width.next_multiple_of(BLOCK);
        let s = dev.stream();
        Ok(Fp8Path {
            kernels: Fp8GemmKernels::load(dev)?,
            xq: super::alloc(s, rows * width)?,
            xs: super::alloc(s, rows * width / BLOCK)?,
            dense: std::env::var("LILY_FP8_DENSE").is_ok_and(|v| v == "1"),
        })
    }

    /// The widest input of the model's matrices that keep an FP8 form; `None` if none does.
    pub(super) fn widest(model: &CudaModel) -> Option<usize> {
        let matrices = model.layers.iter().flat_map(|l| {
            let mixer: [&DeviceMatrices; 2] = match &l.mixer {
                DeviceMixer::DeltaNet {
                    in_proj, out_proj, ..
                } => [in_proj, out_proj],
                DeviceMixer::Attention { qkv, o_proj, .. } => [qkv, o_proj],
            };
            mixer.into_iter().chain([&l.moe.gate_up, &l.moe.down])
        });
        matrices.filter(|m| m.fp8.is_some()).map(|m| m.cols).max()
    }

    /// `y = x · Wᵀ` for the `t` rows of `x` (`[t][w.cols]`), on W's FP8 form.
    pub(super) fn gemm(
        &mut self,
        w: &DeviceFp8,
        x: &CudaView<bf16>,
        y: &mut CudaViewMut<bf16>,
        t: usize,
    ) -> Result<()> {
        let Fp8Path {
            kernels, xq, xs, ..
        } = self;
        let rows = quantize(kernels, xq, xs, &x.slice(..t * w.cols), w.cols)?;
        kernels.gemm(&w.view(), &rows, &mut y.slice_mut(..t * w.rows))
    }

    /// The experts of a pass (`xn` `[t][hidden]`), grouped by `groups` (built for [`TILE_ROWS`]):
    /// gate‖up and SwiGLU into `act` (`[pairs][I]`, sorted order), quantised, then down into
    /// `routed` (`[pairs][hidden]`), as the grouped GEMMs do.
    pub(super) fn experts(
        &mut self,
        gate_up: &DeviceFp8,
        down: &DeviceFp8,
        xn: &CudaView<bf16>,
        groups: &ExpertGroups,
        act: &mut CudaSlice<bf16>,
        routed: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        let (hidden, inter, pairs) = (gate_up.cols, down.cols, groups.pairs());
        let Fp8Path {
            kernels, xq, xs, ..
        } = self;
        {
            let x = quantize(kernels, xq, xs, xn, hidden)?;
            kernels.experts_gate_up(
                &gate_up.view(),
                &x,
                groups,
                &mut act.slice_mut(..pairs * inter),
            )?;
        }
        let a = quantize(kernels, xq, xs, &act.slice(..pairs * inter), inter)?;
        kernels.experts_down(&down.view(), &a, groups, routed)
    }
}

/// `x` (`[rows][cols]`) quantised into `xq` and `xs`, and those as the products' input.
fn quantize<'a>(
    kernels: &Fp8GemmKernels,
    xq: &'a mut CudaSlice<u8>,
    xs: &'a mut CudaSlice<f32>,
    x: &CudaView<bf16>,
    cols: usize,
) -> Result<Fp8Rows<'a>> {
    let n = x.len();
    kernels.quantize_rows(
        x,
        cols,
        &mut xq.slice_mut(..n),
        &mut xs.slice_mut(..n / BLOCK),
    )?;
    Ok(Fp8Rows {
        data: xq.slice(..n),
        scales: xs.slice(..n / BLOCK),
        rows: n / cols.max(1),
        cols,
    })
}
