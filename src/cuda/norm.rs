//! Normalisation and gating kernels (norm.cu): RMSNorm, residual add + RMSNorm, the GDN's gated
//! RMSNorm and SwiGLU. Activations are bf16 `[rows][n]`, row-major; norm weights are fp32.

use std::sync::Arc;

use cudarc::driver::LaunchConfig;
use half::bf16;

use super::{
    as_i32, ensure, ensure_aligned, launch, CudaDevice, CudaFunction, CudaStream, CudaView,
    CudaViewMut, Result,
};

/// Rows per block (one warp each); must match NORM_ROWS_PER_BLOCK in norm.cu.
const ROWS_PER_BLOCK: usize = 4;

pub struct NormKernels {
    stream: Arc<CudaStream>,
    rmsnorm: CudaFunction,
    add_rmsnorm: CudaFunction,
    gated_rmsnorm: CudaFunction,
    silu_mul: CudaFunction,
}

impl NormKernels {
    pub fn load(dev: &CudaDevice) -> Result<Self> {
        Ok(Self {
            stream: dev.stream().clone(),
            rmsnorm: dev.function("norm", "rmsnorm")?,
            add_rmsnorm: dev.function("norm", "add_rmsnorm")?,
            gated_rmsnorm: dev.function("norm", "gated_rmsnorm")?,
            silu_mul: dev.function("norm", "silu_mul")?,
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

    /// The residual add fused with the next norm: `h = bf16(h + res)` in place, then
    /// `y = rmsnorm(h, w)` (of the rounded `h`, as the unfused reference computes it).
    pub fn add_rmsnorm(
        &self,
        h: &mut CudaViewMut<bf16>,
        res: &CudaView<bf16>,
        w: &CudaView<f32>,
        y: &mut CudaViewMut<bf16>,
        eps: f32,
    ) -> Result<()> {
        let (rows, n) = self.check_rows("add_rmsnorm", h.len(), w.len())?;
        ensure!(
            res.len() == h.len() && y.len() == h.len(),
            "add_rmsnorm: h, res and y must have equal lengths"
        );
        self.check_aligned(&[(res, "res")], w)?;
        ensure_aligned(h, &self.stream, "add_rmsnorm h")?;
        ensure_aligned(y, &self.stream, "add_rmsnorm y")?;
        if rows == 0 {
            return Ok(());
        }
        let (rows, n) = (as_i32(rows, "rows")?, as_i32(n, "n")?);
        unsafe {
            launch!(
                self.stream,
                &self.add_rmsnorm,
                norm_config(rows),
                h,
                res,
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

    /// SwiGLU over rows laid out gate‖up: `out[r][i] = bf16(silu(gu[r][i]) · gu[r][n + i])`,
    /// with `n = out.len() / rows` and `gu` twice as long as `out`.
    pub fn silu_mul(
        &self,
        gu: &CudaView<bf16>,
        out: &mut CudaViewMut<bf16>,
        n: usize,
    ) -> Result<()> {
        ensure!(
            n > 0 && n % 8 == 0,
            "silu_mul: n = {n} must be a positive multiple of 8"
        );
        ensure!(
            out.len() % n == 0 && gu.len() == 2 * out.len(),
            "silu_mul: need out = [rows][{n}] and gu = [rows][{}]",
            2 * n
        );
        ensure_aligned(gu, &self.stream, "silu_mul gu")?;
        ensure_aligned(out, &self.stream, "silu_mul out")?;
        let rows = out.len() / n;
        if rows == 0 {
            return Ok(());
        }
        // A grid-stride loop: enough blocks to fill the GPU, never more than the work.
        let vectors = (rows * n / 8) as u32;
        let cfg = LaunchConfig {
            grid_dim: (vectors.div_ceil(256).min(132 * 8), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (rows, n) = (as_i32(rows, "rows")?, as_i32(n, "n")?);
        unsafe { launch!(self.stream, &self.silu_mul, cfg, gu, out, &rows, &n) }
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
