//! MoE routing and combine (moe.cu), on the device.

use std::sync::Arc;

use cudarc::driver::LaunchConfig;
use half::bf16;

use super::{
    as_i32, ensure, ensure_aligned, launch, CudaDevice, CudaFunction, CudaStream, CudaView,
    CudaViewMut, Result,
};

/// Experts the router kernel handles (8 per lane of a warp).
pub const MAX_EXPERTS: usize = 256;
pub const MAX_TOP_K: usize = 16;

pub struct MoeKernels {
    stream: Arc<CudaStream>,
    router_topk: CudaFunction,
    combine: CudaFunction,
}

impl MoeKernels {
    pub fn load(dev: &CudaDevice) -> Result<Self> {
        Ok(Self {
            stream: dev.stream().clone(),
            router_topk: dev.function("moe", "router_topk")?,
            combine: dev.function("moe", "moe_combine")?,
        })
    }

    /// Softmax over each token's `experts` router logits, top `k` (ties → lower index),
    /// renormalised: `ids` and `weights` are `[tokens][k]`.
    pub fn router_topk(
        &self,
        logits: &CudaView<bf16>,
        experts: usize,
        k: usize,
        ids: &mut CudaViewMut<i32>,
        weights: &mut CudaViewMut<f32>,
    ) -> Result<()> {
        ensure!(
            experts > 0 && experts <= MAX_EXPERTS,
            "router: {experts} experts (1..={MAX_EXPERTS} supported)"
        );
        ensure!(
            k > 0 && k <= experts.min(MAX_TOP_K),
            "router: top-{k} of {experts}"
        );
        ensure!(
            logits.len() % experts == 0,
            "router: logits are not whole rows of {experts}"
        );
        let tokens = logits.len() / experts;
        ensure!(
            ids.len() == tokens * k && weights.len() == tokens * k,
            "router: ids/weights must be [{tokens}][{k}]"
        );
        if tokens == 0 {
            return Ok(());
        }
        let warps_per_block = 4u32;
        let cfg = LaunchConfig {
            grid_dim: ((tokens as u32).div_ceil(warps_per_block), 1, 1),
            block_dim: (32 * warps_per_block, 1, 1),
            shared_mem_bytes: 0,
        };
        let (t, e, k) = (as_i32(tokens, "tokens")?, experts as i32, k as i32);
        unsafe {
            launch!(
                self.stream,
                &self.router_topk,
                cfg,
                logits,
                &t,
                &e,
                &k,
                ids,
                weights
            )
        }
    }

    /// `out[t] = Σ_j weights[t][j] · routed[t][j] + sigmoid(gate[t]) · shared[t]` with routed
    /// `[tokens][k][n]`, shared `[tokens][n]`, gate `[tokens]`.
    #[allow(clippy::too_many_arguments)]
    pub fn combine(
        &self,
        routed: &CudaView<bf16>,
        weights: &CudaView<f32>,
        shared: &CudaView<bf16>,
        gate: &CudaView<bf16>,
        k: usize,
        out: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        let tokens = gate.len();
        ensure!(
            tokens > 0 && out.len() % tokens == 0,
            "combine: out is not [tokens][n]"
        );
        let n = out.len() / tokens;
        ensure!(n % 8 == 0, "combine: n = {n} must be a multiple of 8");
        ensure!(
            routed.len() == tokens * k * n
                && weights.len() == tokens * k
                && shared.len() == tokens * n,
            "combine: shapes"
        );
        for (v, what) in [(routed, "routed"), (shared, "shared")] {
            ensure_aligned(v, &self.stream, what)?;
        }
        ensure_aligned(out, &self.stream, "combine out")?;
        let vectors = (tokens * n / 8) as u32;
        let cfg = LaunchConfig {
            grid_dim: (vectors.div_ceil(256).min(132 * 8), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (t, k, n) = (as_i32(tokens, "tokens")?, k as i32, as_i32(n, "n")?);
        unsafe {
            launch!(
                self.stream,
                &self.combine,
                cfg,
                routed,
                weights,
                shared,
                gate,
                out,
                &t,
                &k,
                &n
            )
        }
    }
}
