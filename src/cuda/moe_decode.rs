//! The MoE block of one decode token as one persistent kernel (moe_decode.cu): router GEMV, top-k,
//! the experts' gate‖up and down GEMVs in one launch, each block putting all its tasks' weight
//! copies in flight as soon as their addresses are known (bench/NOTES.md v1.40–v1.41). It leaves
//! what the launch-per-op path leaves (forward/experts.rs): the slots' expert ids and weights and
//! their outputs `[9][hidden]`, for the same combine. Off unless `LILY_MOE_PERSISTENT=1` (CudaOptions::persistent_moe): measured
//! 3.7 % slower decode than the launch-per-op path (bench/NOTES.md v1.41).
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
/// MD_COUNTERS in moe_decode.cu: router, gate‖up per slot, blocks done.
const COUNTERS: usize = 1 + SLOTS + 1;
const THREADS: u32 = 256;
/// MD_TRACE_WORDS in moe_decode.cu: the words of one block's trace (see there).
pub const TRACE_WORDS: usize = 16;
/// The fewest blocks (SMs) the kernel runs on: 897 tasks, at most 8 per block (MD_STAGES).
const MIN_BLOCKS: u32 = 113;
/// MD_SMEM_BYTES in moe_decode.cu: 8 stages of 16 KB of weights + 2 KB of scales and biases.
const SMEM_BYTES: usize = 8 * (16384 + 2 * 1024);

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
    logits: u64,
    ids: u64,
    weights: u64,
    gu: u64,
    routed: u64,
    counters: u64,
    trace: u64,
}

// SAFETY: plain integers, laid out as the C struct the kernel takes by value.
unsafe impl KernelValue for MoeDecodeArgs {}

pub struct MoeDecode {
    stream: Arc<CudaStream>,
    step: CudaFunction,
    /// The step's weight stream alone, for measurements (`probe_stream`).
    stream_probe: CudaFunction,
    /// One block per SM: every block must be resident (the tasks wait on each other).
    blocks: u32,
    logits: CudaSlice<bf16>,
    gu: CudaSlice<bf16>,
    /// Zero between launches: the kernel's last block resets them.
    counters: CudaSlice<u32>,
    /// Where each block records when it got where (tests), `[blocks][TRACE_WORDS]`.
    trace: Option<CudaSlice<u64>>,
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
        ensure!(
            sm_count >= MIN_BLOCKS,
            "the persistent MoE needs a GPU of at least {MIN_BLOCKS} SMs; this one has {sm_count}"
        );
        let step = dev.function("moe_decode", "moe_decode_step")?;
        dev.allow_dynamic_shared(&step, "moe_decode_step", SMEM_BYTES)?;
        let stream_probe = dev.function("moe_decode", "moe_decode_stream_probe")?;
        dev.allow_dynamic_shared(&stream_probe, "moe_decode_stream_probe", SMEM_BYTES)?;
        Ok(Self {
            step,
            stream_probe,
            blocks: sm_count,
            logits: zeros(ROUTER_ROWS)?,
            gu: zeros(SLOTS * 2 * INTER)?,
            counters: stream
                .alloc_zeros::<u32>(COUNTERS)
                .during(|| "persistent MoE counters".into())?,
            trace: None,
            stream,
        })
    }

    /// Blocks per launch: one per SM.
    pub fn blocks(&self) -> usize {
        self.blocks as usize
    }

    /// Records a trace of each launch into `trace` (`[blocks][TRACE_WORDS]`: each block's start on
    /// the global timer in ns, then its clock64 at its start, once x is in, after its top-k (0 if
    /// none), after each of its first 8 tasks, at its end; then its end on the global timer; then
    /// its clock64 when it saw the router done, 0 if it did not wait for it), or stops recording.
    pub fn set_trace(&mut self, trace: Option<CudaSlice<u64>>) -> Result<()> {
        if let Some(t) = &trace {
            ensure!(
                t.len() == self.blocks() * TRACE_WORDS,
                "persistent MoE trace: {} words for {} blocks",
                t.len(),
                self.blocks()
            );
        }
        self.trace = trace;
        Ok(())
    }

    /// The trace buffer, if one is set.
    pub fn trace(&self) -> Option<&CudaSlice<u64>> {
        self.trace.as_ref()
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
        let args = self.args(w, x, ids, weights, routed);
        // SAFETY: every pointer is a live device buffer of the size checked above and in
        // `supports`; the scratch is this struct's own.
        unsafe { launch!(self.stream, &self.step, self.config(), &args) }
    }

    /// Measurement only: the step's weight stream without its compute (moe_decode_stream_probe;
    /// `mode` 0–3 as there), the routed experts those in `ids` (left by a `run` before).
    pub fn probe_stream(
        &mut self,
        w: &DeviceMoe,
        x: &CudaView<bf16>,
        ids: &mut CudaViewMut<i32>,
        weights: &mut CudaViewMut<f32>,
        routed: &mut CudaViewMut<bf16>,
        mode: i32,
    ) -> Result<()> {
        ensure!(
            Self::supports(w) && ids.len() == SLOTS && (0..4).contains(&mode),
            "persistent MoE stream probe: the model's weights, {SLOTS} ids, mode 0–3"
        );
        let args = self.args(w, x, ids, weights, routed);
        // SAFETY: as in `run`; the probe reads the weights and ids only.
        unsafe { launch!(self.stream, &self.stream_probe, self.config(), &args, &mode) }
    }

    fn config(&self) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (self.blocks, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: SMEM_BYTES as u32,
        }
    }

    /// The kernels' arguments: the weights' and buffers' device addresses.
    fn args(
        &mut self,
        w: &DeviceMoe,
        x: &CudaView<bf16>,
        ids: &mut CudaViewMut<i32>,
        weights: &mut CudaViewMut<f32>,
        routed: &mut CudaViewMut<bf16>,
    ) -> MoeDecodeArgs {
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
        // (A binding, not the tail expression: the pointer guards must drop before `stream`.)
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
            logits: self.logits.device_ptr_mut(stream).0,
            ids: ids.device_ptr_mut(stream).0,
            weights: weights.device_ptr_mut(stream).0,
            gu: self.gu.device_ptr_mut(stream).0,
            routed: routed.device_ptr_mut(stream).0,
            counters: self.counters.device_ptr_mut(stream).0,
            trace: self
                .trace
                .as_mut()
                .map_or(0, |t| t.device_ptr_mut(stream).0),
        };
        args
    }
}
