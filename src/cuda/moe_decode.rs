//! The MoE block of one decode token as one persistent kernel (moe_decode.cu): router GEMV, top-k,
//! the experts' gate‖up and down GEMVs in one launch, each block streaming its next task's weights
//! while it waits for the task before (bench/NOTES.md v1.40). It leaves what the launch-per-op path
//! leaves (forward/experts.rs): the slots' expert ids and weights and their outputs `[9][hidden]`,
//! for the same combine. Under trial: `LILY_MOE_PERSISTENT=1` (CudaOptions::persistent_moe).
//!
//! Specialised to Qwen3.6-35B-A3B's MoE in its MLX layout: router ‖ shared gate Q8 `[257][2048]`,
//! experts (the shared one last) Q4 gate‖up `[257][1024][2048]` and down `[257][2048][512]`, group
//! 64; other weights take the launch-per-op path ([`MoeDecode::supports`]).

use std::sync::Arc;

use cudarc::driver::{sys, CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};
use half::bf16;

use super::gemm::{Matrices, WeightData};
use super::model::DeviceMoe;
use super::pdl::KernelValue;
use super::{
    ensure, launch, Context, CudaDevice, CudaFunction, CudaStream, CudaView, CudaViewMut, Result,
};

const HIDDEN: usize = 2048;
const INTER: usize = 512;
const EXPERTS: usize = 256;
const TOP_K: usize = 8;
/// The top-k and the shared expert.
pub const SLOTS: usize = TOP_K + 1;
const ROUTER_ROWS: usize = EXPERTS + 1;
const ROUTER_SPLITS: usize = 4;
/// MD_COUNTERS in moe_decode.cu: router, top-k, gate‖up per slot, blocks done.
const COUNTERS: usize = 2 + SLOTS + 1;
const THREADS: u32 = 256;

/// Kernel arguments, field for field `MoeDecodeArgs` in moe_decode.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct MoeDecodeArgs {
    x: u64,
    r_w: u64,
    r_s: u64,
    r_b: u64,
    gu_w: u64,
    gu_s: u64,
    gu_b: u64,
    d_w: u64,
    d_s: u64,
    d_b: u64,
    r_part: u64,
    logits: u64,
    ids: u64,
    weights: u64,
    gu: u64,
    routed: u64,
    counters: u64,
}

// SAFETY: plain integers, laid out as the C struct the kernel takes by value.
unsafe impl KernelValue for MoeDecodeArgs {}

pub struct MoeDecode {
    stream: Arc<CudaStream>,
    step: CudaFunction,
    /// One block per SM: every block must be resident (the tasks wait on each other).
    blocks: u32,
    r_part: CudaSlice<f32>,
    logits: CudaSlice<bf16>,
    gu: CudaSlice<bf16>,
    /// Zero between launches: the kernel's last block resets them.
    counters: CudaSlice<u32>,
}

impl MoeDecode {
    pub fn load(dev: &CudaDevice) -> Result<Self> {
        let stream = dev.stream().clone();
        let sm_attr = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
        let sm_count = dev
            .context()
            .attribute(sm_attr)
            .during(|| "multiprocessor count".into())? as u32;
        let zeros = |n: usize| -> Result<CudaSlice<bf16>> {
            stream
                .alloc_zeros::<bf16>(n)
                .during(|| format!("{n} values of persistent MoE scratch"))
        };
        Ok(Self {
            step: dev.function("moe_decode", "moe_decode_step")?,
            blocks: sm_count,
            r_part: stream
                .alloc_zeros::<f32>(ROUTER_SPLITS * ROUTER_ROWS)
                .during(|| "router partial sums".into())?,
            logits: zeros(ROUTER_ROWS)?,
            gu: zeros(SLOTS * 2 * INTER)?,
            counters: stream
                .alloc_zeros::<u32>(COUNTERS)
                .during(|| "persistent MoE counters".into())?,
            stream,
        })
    }

    /// Whether the kernel takes this layer's weights: the shapes and formats at the top.
    pub fn supports(w: &DeviceMoe) -> bool {
        let is = |m: &Matrices, bits: u32, count: usize, rows: usize, cols: usize| {
            matches!(m.data, WeightData::Affine { bits: b, .. } if b == bits)
                && (m.count, m.rows, m.cols) == (count, rows, cols)
                && m.check_lengths("persistent MoE").is_ok()
        };
        is(&w.router.view(), 8, 1, ROUTER_ROWS, HIDDEN)
            && is(&w.gate_up.view(), 4, EXPERTS + 1, 2 * INTER, HIDDEN)
            && is(&w.down.view(), 4, EXPERTS + 1, HIDDEN, INTER)
    }

    /// The MoE block of one token: x `[2048]` (the normed input) → ids and weights `[9]` (slot 8
    /// the shared expert, id 256) and routed `[9][2048]`, each slot's expert output unweighted.
    pub fn run(
        &mut self,
        w: &DeviceMoe,
        x: &CudaView<bf16>,
        ids: &mut CudaViewMut<i32>,
        weights: &mut CudaViewMut<f32>,
        routed: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        ensure!(
            Self::supports(w),
            "persistent MoE: weights of another shape or format"
        );
        ensure!(
            x.len() == HIDDEN && ids.len() == SLOTS && weights.len() == SLOTS,
            "persistent MoE: one token of {HIDDEN} values, {SLOTS} slots"
        );
        ensure!(
            routed.len() == SLOTS * HIDDEN,
            "persistent MoE: routed has {} values, expected {}",
            routed.len(),
            SLOTS * HIDDEN
        );
        let stream = self.stream.clone();
        let stream = &*stream;
        // (packed, scales, biases) device addresses of a matrix stack.
        let affine = |m: &Matrices| match &m.data {
            WeightData::Affine {
                packed,
                scales,
                biases,
                ..
            } => (
                packed.device_ptr(stream).0,
                scales.device_ptr(stream).0,
                biases.device_ptr(stream).0,
            ),
            WeightData::Bf16(_) => unreachable!("`supports` admits affine weights only"),
        };
        let ((r_w, r_s, r_b), (gu_w, gu_s, gu_b), (d_w, d_s, d_b)) = (
            affine(&w.router.view()),
            affine(&w.gate_up.view()),
            affine(&w.down.view()),
        );
        let args = MoeDecodeArgs {
            x: x.device_ptr(stream).0,
            r_w,
            r_s,
            r_b,
            gu_w,
            gu_s,
            gu_b,
            d_w,
            d_s,
            d_b,
            r_part: self.r_part.device_ptr_mut(stream).0,
            logits: self.logits.device_ptr_mut(stream).0,
            ids: ids.device_ptr_mut(stream).0,
            weights: weights.device_ptr_mut(stream).0,
            gu: self.gu.device_ptr_mut(stream).0,
            routed: routed.device_ptr_mut(stream).0,
            counters: self.counters.device_ptr_mut(stream).0,
        };
        let cfg = LaunchConfig {
            grid_dim: (self.blocks, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: every pointer is a live device buffer of the size checked above and in
        // `supports`; the scratch is this struct's own.
        unsafe { launch!(stream, &self.step, cfg, &args) }
    }
}
