//! Normalisation and gating kernels (norm.cu): RMSNorm, residual add (or MoE combine) +
//! RMSNorm, the GDN's gated RMSNorm. Activations are bf16 `[rows][n]`, row-major; norm weights are fp32.

use std::sync::Arc;

use cudarc::driver::{DevicePtr, LaunchConfig};
use half::bf16;

use super::{
    as_i32, ensure, ensure_aligned, launch, CudaDevice, CudaFunction, CudaStream, CudaView,
    CudaViewMut, Result,
};

/// Rows per block (one warp each); must match NORM_ROWS_PER_BLOCK in norm.cu.
const ROWS_PER_BLOCK: usize = 4;
/// Threads per row (one block each) of residual_rmsnorm; must match RES_THREADS in norm.cu.
const RES_THREADS: u32 = 256;

pub struct NormKernels {
    stream: Arc<CudaStream>,
    rmsnorm: CudaFunction,
    residual_rmsnorm: CudaFunction,
    gated_rmsnorm: CudaFunction,
}

impl NormKernels {
    pub fn load(dev: &CudaDevice) -> Result<Self> {
        Ok(Self {
            stream: dev.stream().clone(),
            rmsnorm: dev.function("norm", "rmsnorm")?,
            residual_rmsnorm: dev.function("norm", "residual_rmsnorm")?,
            gated_rmsnorm: dev.function("norm", "gated_rmsnorm")?,
        })
    }

    /// `y = bf16(x · rsqrt(mean(x²) + eps) · w)` per row of `n = w.len()` values. `w` is the
    /// effective multiplier: 1 + the stored weight for this model's zero-centred norms (MODEL.md §3.2).
    pub fn rmsnorm(
        &self,
        x: &CudaView<bf16>,
        w: &CudaView<f32>,
        y: &mut CudaViewMut<bf16>,
        eps: f32,
    ) -> Result<()> {
        let (rows, n) = self.check_rows("rmsnorm", x.len(), w.len())?;
        ensure!(
            y.len() == x.len(),
            "rmsnorm: y has {} values, x {}",
            y.len(),
            x.len()
        );
        self.check_aligned(&[(x, "x")], w)?;
        ensure_aligned(y, &self.stream, "rmsnorm y")?;
        if rows == 0 {
            return Ok(());
        }
        let (rows, n) = (as_i32(rows, "rows")?, as_i32(n, "n")?);
        unsafe {
            launch!(
                self.stream,
                &self.rmsnorm,
                norm_config(rows),
                x,
                w,
                y,
                &rows,
                &n,
                &eps
            )
        }
    }

    /// The residual add fused with the next norm: `h = bf16(h + r)` in place, then
    /// `y = rmsnorm(h, w)` (of the rounded `h`, as the unfused reference computes it), where
    /// `r = bf16(Σ_j weights[row][j] · parts[row][j])` over the `k = parts.len() / h.len()` parts
    /// of each row (`parts` is `[rows][k][n]`, `weights` `[rows][k]`), or with no weights
    /// `r = parts[row]` (k = 1). The weighted form is the MoE combine (experts + shared expert).
    pub fn residual_rmsnorm(
        &self,
        h: &mut CudaViewMut<bf16>,
        parts: &CudaView<bf16>,
        weights: Option<&CudaView<f32>>,
        w: &CudaView<f32>,
        y: &mut CudaViewMut<bf16>,
        eps: f32,
    ) -> Result<()> {
        let (rows, n) = self.check_rows("residual_rmsnorm", h.len(), w.len())?;
        ensure!(
            y.len() == h.len() && !h.is_empty() && parts.len() % h.len() == 0,
            "residual_rmsnorm: y must match h, parts must be whole multiples of h"
        );
        let k = parts.len() / h.len();
        match weights {
            Some(wt) => ensure!(
                wt.len() == rows * k,
                "residual_rmsnorm: {} weights for {rows} rows of {k} parts",
                wt.len()
            ),
            None => ensure!(k == 1, "residual_rmsnorm: {k} parts per row need weights"),
        }
        self.check_aligned(&[(parts, "parts")], w)?;
        ensure_aligned(h, &self.stream, "residual_rmsnorm h")?;
        ensure_aligned(y, &self.stream, "residual_rmsnorm y")?;
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (RES_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (rows, n, k) = (as_i32(rows, "rows")?, as_i32(n, "n")?, as_i32(k, "k")?);
        // No weights: a null pointer, which the kernel reads as weight 1 for the one part.
        let weights_ptr = weights.map_or(0u64, |wt| wt.device_ptr(&self.stream).0);
        unsafe {
            launch!(
                self.stream,
                &self.residual_rmsnorm,
                cfg,
                h,
                parts,
                &weights_ptr,
                &k,
                w,
                y,
                &rows,
                &n,
                &eps
            )
        }
    }

    /// The GDN output norm (MODEL.md §3.6.7) per head of `n = w.len()` values:
    /// `y = bf16(bf16(w · bf16(rmsnorm(o))) · silu(z))`. `w` is the plain stored weight (no +1).
    pub fn gated_rmsnorm(
        &self,
        o: &CudaView<bf16>,
        z: &CudaView<bf16>,
        w: &CudaView<f32>,
        y: &mut CudaViewMut<bf16>,
        eps: f32,
    ) -> Result<()> {
        let (rows, n) = self.check_rows("gated_rmsnorm", o.len(), w.len())?;
        ensure!(
            z.len() == o.len() && y.len() == o.len(),
            "gated_rmsnorm: o, z and y must have equal lengths"
        );
        self.check_aligned(&[(o, "o"), (z, "z")], w)?;
        ensure_aligned(y, &self.stream, "gated_rmsnorm y")?;
        if rows == 0 {
            return Ok(());
        }
        let (rows, n) = (as_i32(rows, "rows")?, as_i32(n, "n")?);
        unsafe {
            launch!(
                self.stream,
                &self.gated_rmsnorm,
                norm_config(rows),
                o,
                z,
                w,
                y,
                &rows,
                &n,
                &eps
            )
        }
    }

    /// (rows, n) of a `[rows][n]` activation; n must be a multiple of 8 (one 16-byte vector).
    fn check_rows(&self, op: &str, len: usize, n: usize) -> Result<(usize, usize)> {
        ensure!(
            n > 0 && n % 8 == 0,
            "{op}: row length {n} must be a positive multiple of 8"
        );
        ensure!(len % n == 0, "{op}: {len} values are not whole rows of {n}");
        Ok((len / n, n))
    }

    fn check_aligned(&self, inputs: &[(&CudaView<bf16>, &str)], w: &CudaView<f32>) -> Result<()> {
        for (v, what) in inputs {
            ensure_aligned(*v, &self.stream, what)?;
        }
        ensure_aligned(w, &self.stream, "norm weight")
    }
}

fn norm_config(rows: i32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((rows as u32).div_ceil(ROWS_PER_BLOCK as u32), 1, 1),
        block_dim: (32 * ROWS_PER_BLOCK as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}
