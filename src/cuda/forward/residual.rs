//! Decode passes of few rows fold each residual add and norm into the GEMV that reads its result
//! ([`GemvKernels::gemv_residual`]): the add + norm after the mixer into the router's GEMV, the
//! MoE combine + the next layer's input norm into that layer's first projection. Two kernels per
//! layer fewer; the same bits as the separate norm kernel (both run norm.cuh). The residual stream
//! then alternates between `s.h` and `s.h2`, since a fused GEMV's other blocks still read the
//! rows its first block rewrites.

use half::bf16;

use super::{Kernels, Scratch};
use crate::cuda::gemm::{GemvKernels, ResidualInput};
use crate::cuda::model::{CudaModel, DeviceMixer};
use crate::cuda::weights::DeviceMatrices;
use crate::cuda::{CudaSlice, CudaViewMut, Result};

/// What is added to the residual stream.
#[derive(Clone, Copy)]
pub(super) enum Parts {
    /// The mixer's output, `s.r`.
    Mixer,
    /// Each expert slot's output `s.routed`, weighted by `s.expert_weights` (the MoE combine).
    Experts,
}

/// Where the residual stream is: `s.h`, or `s.h2` after an odd number of fused adds.
#[derive(Clone, Copy, Default)]
pub(super) struct ResidualStream {
    in_second: bool,
}

impl ResidualStream {
    /// Whether the stream is in `s.h2` now (else `s.h`).
    pub(super) fn in_second(&self) -> bool {
        self.in_second
    }

    /// `y = w · norm(h + parts)` for the first `t` rows, the sums moving to the other buffer;
    /// with `write_xn` the normalised rows also go to `s.xn` (for the experts). `y` is the first
    /// `t · w.rows` values of `s.proj` or `s.router`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemv(
        &mut self,
        k: &Kernels,
        w: &DeviceMatrices,
        s: &mut Scratch,
        t: usize,
        parts: Parts,
        norm: &CudaSlice<f32>,
        eps: f32,
        write_xn: bool,
        into: Output,
        slots: usize,
    ) -> Result<()> {
        let n = t * w.cols;
        let (h, mut h_out) = if self.in_second {
            (s.h2.slice(..n), s.h.slice_mut(..n))
        } else {
            (s.h.slice(..n), s.h2.slice_mut(..n))
        };
        let input = match parts {
            Parts::Mixer => ResidualInput {
                h,
                parts: s.r.slice(..n),
                weights: None,
                norm_w: norm.as_view(),
                eps,
            },
            Parts::Experts => ResidualInput {
                h,
                parts: s.routed.slice(..n * slots),
                weights: Some(s.expert_weights.slice(..t * slots)),
                norm_w: norm.as_view(),
                eps,
            },
        };
        let mut xn = s.xn.slice_mut(..n);
        let x_out: Option<&mut CudaViewMut<bf16>> = if write_xn { Some(&mut xn) } else { None };
        let mut y = match into {
            Output::Proj => s.proj.slice_mut(..t * w.rows),
            Output::Router => s.router.slice_mut(..t * w.rows),
        };
        k.gemv
            .gemv_residual(&w.view(), &input, &mut h_out, x_out, &mut y)?;
        self.in_second = !self.in_second;
        Ok(())
    }
}

/// Where a fused GEMV writes.
#[derive(Clone, Copy)]
pub(super) enum Output {
    Proj,
    Router,
}

/// The most decode rows the fused path takes: every fused GEMV (each layer's router and first
/// projection) must fit its rows in one launch; 0 turns the fused path off.
pub(super) fn fused_rows(gemv: &GemvKernels, model: &CudaModel) -> usize {
    model
        .layers
        .iter()
        .flat_map(|l| {
            let first = match &l.mixer {
                DeviceMixer::DeltaNet { in_proj, .. } => in_proj,
                DeviceMixer::Attention { qkv, .. } => qkv,
            };
            [first, &l.moe.router]
        })
        .map(|w| gemv.max_tokens_residual(&w.view()))
        .min()
        .unwrap_or(0)
}
