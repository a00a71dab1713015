//! What the decode GEMVs (gemm.rs) take besides their x and y: the weight stacks, the byte ranges
//! a launch pulls into L2 for the kernels after it, the router top-k folded into the router's
//! GEMV, the residual input made inside a GEMV, and the residual add and norm split between the
//! GEMVs on either side of them (ResidualOut, NormIn).

use cudarc::driver::{DevicePtr, DevicePtrMut, SyncOnDrop};
use half::bf16;

use super::super::{addr, ensure, CudaStream, CudaView, CudaViewMut, Result};
use super::GROUP;

/// The weights of a stack of `count` matrices `[rows][cols]` (one matrix: `count` = 1; the experts
/// of a layer: `count` = 256), row-major, matrix after matrix.
pub enum WeightData<'a> {
    Bf16(CudaView<'a, bf16>),
    /// MLX affine quantisation: `W[r][c] = scales[r][c/64] · q + biases[r][c/64]`. `packed` is
    /// `[count][rows][cols·bits/32]` uint32, element `c` of a word in bits `bits·c ..` (lowest first);
    /// scales and biases are `[count][rows][cols/64]`.
    Affine {
        bits: u32,
        packed: CudaView<'a, u32>,
        scales: CudaView<'a, bf16>,
        biases: CudaView<'a, bf16>,
    },
}

/// A stack of matrices as the kernels take it: weights plus their shape.
pub struct Matrices<'a> {
    pub data: WeightData<'a>,
    pub count: usize,
    pub rows: usize,
    pub cols: usize,
}

impl Matrices<'_> {
    /// Checks that the buffers hold exactly `count` matrices of `rows × cols` in their format
    /// (the kernels index them from the shape alone); `op` names the caller in the error.
    pub(crate) fn check_lengths(&self, op: &str) -> Result<()> {
        let n = self.count * self.rows * self.cols;
        match &self.data {
            WeightData::Bf16(v) => ensure!(
                v.len() == n,
                "{op}: bf16 weights have {} values, expected {n}",
                v.len()
            ),
            WeightData::Affine {
                bits,
                packed,
                scales,
                biases,
            } => {
                let words = n * *bits as usize / 32;
                ensure!(
                    packed.len() == words,
                    "{op}: packed weights have {} words, expected {words}",
                    packed.len()
                );
                let groups = n / GROUP;
                ensure!(
                    scales.len() == groups && biases.len() == groups,
                    "{op}: scales/biases need {groups} values each"
                );
            }
        }
        Ok(())
    }

    /// Device addresses of the weights, scales and biases (0 for bf16's absent scales and
    /// biases), for a kernel's argument struct; see [`addr`].
    pub(crate) fn addrs<'a>(
        &'a self,
        stream: &'a CudaStream,
        guards: &mut Vec<SyncOnDrop<'a>>,
    ) -> (u64, u64, u64) {
        match &self.data {
            WeightData::Bf16(v) => (addr(v, stream, guards), 0, 0),
            WeightData::Affine {
                packed,
                scales,
                biases,
                ..
            } => (
                addr(packed, stream, guards),
                addr(scales, stream, guards),
                addr(biases, stream, guards),
            ),
        }
    }
}

/// Byte ranges one launch can pull into L2 (L2_AHEAD in gemm.cu).
pub(super) const L2_AHEAD: usize = 6;

/// Weights the kernels after a GEMV will read, for its blocks to pull into L2 beside their own
/// ([`GemvKernels::then_prefetch`]): the next GEMVs, which follow kernels that read little (GDN
/// step, attention, norms, top-k), then find their weights in L2 instead of starting cold.
/// Ranges past the sixth are dropped.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct L2Ahead {
    /// (device address, bytes, stride per matrix of the launch); bytes a multiple of 16.
    pub(super) ranges: [(u64, u64, u64); L2_AHEAD],
    len: usize,
}

impl L2Ahead {
    /// All of `w`'s weights, scales and biases.
    pub fn matrices(mut self, w: &Matrices, stream: &CudaStream) -> Self {
        for (ptr, bytes) in raw_ranges(w, stream) {
            self.push(ptr, bytes, 0);
        }
        self
    }
    /// Matrix `m` of `w` (e.g. the shared expert of a stack), weights only.
    pub fn one_matrix(mut self, w: &Matrices, m: usize, stream: &CudaStream) -> Self {
        if let Some((ptr, bytes)) = raw_ranges(w, stream).into_iter().next() {
            let per = bytes / w.count as u64;
            if m < w.count {
                self.push(ptr + m as u64 * per, per, 0);
            }
        }
        self
    }
    /// For a launch over a stack with device-side ids: each slot's own matrix of `w` (the same
    /// experts' next projection).
    pub fn same_matrix(mut self, w: &Matrices, stream: &CudaStream) -> Self {
        for (ptr, bytes) in raw_ranges(w, stream) {
            let per = bytes / w.count as u64;
            self.push(ptr, per, per);
        }
        self
    }
    fn push(&mut self, ptr: u64, bytes: u64, stride: u64) {
        // The prefetch instruction takes 16-byte-aligned ranges of 16-byte multiples.
        let bytes = bytes / 16 * 16;
        if self.len < L2_AHEAD && ptr % 16 == 0 && stride % 16 == 0 && bytes > 0 {
            self.ranges[self.len] = (ptr, bytes, stride);
            self.len += 1;
        }
    }
}

/// (address, bytes) of the weights, then the scales and biases, of a whole stack.
fn raw_ranges(w: &Matrices, stream: &CudaStream) -> Vec<(u64, u64)> {
    let bytes = |len: usize, size: usize| (len * size) as u64;
    match &w.data {
        WeightData::Bf16(v) => vec![(v.device_ptr(stream).0, bytes(v.len(), 2))],
        WeightData::Affine {
            packed,
            scales,
            biases,
            ..
        } => vec![
            (packed.device_ptr(stream).0, bytes(packed.len(), 4)),
            (scales.device_ptr(stream).0, bytes(scales.len(), 2)),
            (biases.device_ptr(stream).0, bytes(biases.len(), 2)),
        ],
    }
}

/// The most experts a top-k keeps (MAX_TOP_K in moe.cuh).
pub(super) const MAX_TOP_K: usize = 16;

/// The router's top-k done by the last block of the router's GEMV ([`GemvKernels::then_topk`]),
/// as `MoeKernels::router_topk` does it (both run moe.cuh), sparing its launch: `k` of `experts`
/// plus the shared expert; `ids` and `weights` `[ntok][k + 1]`; `counter` one u32, zero between
/// launches (the kernel leaves it so).
#[derive(Clone, Copy, Default)]
pub struct FusedTopK {
    pub experts: usize,
    pub k: usize,
    pub ids: u64,
    pub weights: u64,
    pub counter: u64,
}

impl FusedTopK {
    /// Device addresses of the outputs and the counter.
    pub fn new(
        experts: usize,
        k: usize,
        ids: &mut CudaViewMut<i32>,
        weights: &mut CudaViewMut<f32>,
        counter: &mut CudaViewMut<u32>,
        stream: &CudaStream,
    ) -> Self {
        FusedTopK {
            experts,
            k,
            ids: ids.device_ptr_mut(stream).0,
            weights: weights.device_ptr_mut(stream).0,
            counter: counter.device_ptr_mut(stream).0,
        }
    }
}

/// A GEMV input made inside the GEMV by the residual add and norm ([`GemvKernels::gemv_residual`]),
/// exactly as `NormKernels::residual_rmsnorm` makes it (both run norm.cuh): for each token row,
/// `sum = bf16(h + r)` with `r = bf16(Σ_j weights[j] · parts[j])` (no weights: the one part), and
/// `x = rmsnorm(sum) · norm_w`. Decode saves the norm's own launch this way.
pub struct ResidualInput<'a> {
    /// `[ntok][cols]`, the residual stream.
    pub h: CudaView<'a, bf16>,
    /// `[ntok][k][cols]`: the mixer's output (k = 1), or each expert slot's (the MoE combine).
    pub parts: CudaView<'a, bf16>,
    /// `[ntok][k]`, required when k > 1.
    pub weights: Option<CudaView<'a, f32>>,
    /// `[cols]`, the norm's effective weight.
    pub norm_w: CudaView<'a, f32>,
    pub eps: f32,
}

/// One token's mixer output projection (out_proj, o_proj) adding its output to the residual
/// stream in its epilogue ([`GemvKernels::then_residual_out`](super::GemvKernels::then_residual_out)):
/// `h[r] = bf16(h[r] + y[r])` in place, as `NormKernels::residual_rmsnorm` adds it, and the sum
/// of squares of each vector of 8 new values into `vec_ss` `[rows / 8]`, from which the router's
/// GEMV makes the norm ([`NormIn`]) in that kernel's order of sums.
#[derive(Clone, Copy)]
pub struct ResidualOut {
    pub(super) h: u64,
    pub(super) vec_ss: u64,
    pub(super) len: usize,
}

impl ResidualOut {
    /// Device addresses of the residual stream `h` (one token's row) and the sums `vec_ss`.
    pub fn new(
        h: &mut CudaViewMut<bf16>,
        vec_ss: &mut CudaViewMut<f32>,
        stream: &CudaStream,
    ) -> Result<Self> {
        ensure!(
            vec_ss.len() * 8 >= h.len(),
            "residual out: {} sums for a row of {}",
            vec_ss.len(),
            h.len()
        );
        let len = h.len();
        Ok(ResidualOut {
            h: h.device_ptr_mut(stream).0,
            vec_ss: vec_ss.device_ptr_mut(stream).0,
            len,
        })
    }
}

/// The router's GEMV input made while it stages it, after a [`ResidualOut`] launch
/// ([`GemvKernels::then_norm_in`](super::GemvKernels::then_norm_in)): `x = rmsnorm(h) · norm_w`,
/// the bits `NormKernels::residual_rmsnorm` would write, also written to `x_out` for the experts.
#[derive(Clone, Copy)]
pub struct NormIn {
    pub(super) h: u64,
    pub(super) vec_ss: u64,
    pub(super) norm_w: u64,
    pub(super) x_out: u64,
    pub(super) eps: f32,
    pub(super) len: usize,
}

impl NormIn {
    /// Device addresses of the residual stream `h` (one token's row), the sums a [`ResidualOut`]
    /// launch left in `vec_ss`, the norm's effective weight `norm_w` and the output `x_out`.
    pub fn new(
        h: &CudaView<bf16>,
        vec_ss: &CudaView<f32>,
        norm_w: &CudaView<f32>,
        eps: f32,
        x_out: &mut CudaViewMut<bf16>,
        stream: &CudaStream,
    ) -> Result<Self> {
        let n = h.len();
        ensure!(
            vec_ss.len() * 8 >= n && norm_w.len() == n && x_out.len() == n,
            "norm in: a row of {n}, {} sums, a norm weight of {}, x_out of {}",
            vec_ss.len(),
            norm_w.len(),
            x_out.len()
        );
        Ok(NormIn {
            h: h.device_ptr(stream).0,
            vec_ss: vec_ss.device_ptr(stream).0,
            norm_w: norm_w.device_ptr(stream).0,
            x_out: x_out.device_ptr_mut(stream).0,
            eps,
            len: n,
        })
    }
}
