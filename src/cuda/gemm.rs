//! Decode matrix-vector products (gemm.cu): `y[n][r] = Σ_c W[r][c] · x[n][c]` for 1..=8 tokens,
//! with W in bf16 or MLX affine 4/8-bit, group 64 (spec/MODEL.md §5.1), dequantised on the fly.
//! The kernel and the reasons for its shape are described at the top of gemm.cu.

use std::cell::Cell;
use std::sync::Arc;

use cudarc::driver::{sys, DevicePtr, DevicePtrMut, LaunchConfig};
use half::bf16;

use super::pdl::KernelValue;
use super::{
    addr, as_i32, ensure, ensure_aligned, env_count, env_percent, launch, prefer_carveout, Context,
    CudaDevice, CudaError, CudaFunction, CudaStream, CudaView, CudaViewMut, Result,
};

mod inputs;
pub use inputs::{FusedTopK, L2Ahead, Matrices, NormIn, ResidualInput, ResidualOut, WeightData};
use inputs::{L2_AHEAD, MAX_TOP_K};

/// Tokens one launch can take: the mma's N.
pub const MAX_TOKENS: usize = 8;
/// The quantisation group size: one scale and one bias per 64 columns of a row.
pub const GROUP: usize = 64;
const TILE_ROWS: usize = 16;
/// Iterations a warp copies into shared memory at once (BATCH in gemm.cu) ...
const BATCH: usize = 4;
/// ... and how many such batches each warp has in flight (STAGES in gemm.cu), three in the
/// gathered kernels (GATHERED_STAGES: two blocks per SM, bench/NOTES.md v1.61).
const STAGES: usize = 4;
const GATHERED_STAGES: usize = 3;

/// Kernel arguments, field for field the `GemvArgs` struct of gemm.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct GemvArgs {
    w: u64,
    scales: u64,
    biases: u64,
    x: u64,
    y: u64,
    ids: u64,
    w_mat_words: i64,
    x_slot_stride: i64,
    rows: i32,
    cols: i32,
    ntok: i32,
    tiles_per_block: i32,
    warps_per_tile: i32,
    count: i32,
    swiglu: i32,
    slots_per_x: i32,
    chunk_rows: i32,
    x_rows: i32,
    y_rows: i32,
    ahead: [u64; L2_AHEAD],
    ahead_bytes: [i64; L2_AHEAD],
    ahead_stride: [i64; L2_AHEAD],
    res_h: u64,
    res_parts: u64,
    res_weights: u64,
    res_norm_w: u64,
    res_h_out: u64,
    res_x_out: u64,
    res_k: i32,
    res_eps: f32,
    ids_ready: i32,
    topk_k: i32,
    topk_experts: i32,
    topk_ids: u64,
    topk_weights: u64,
    topk_counter: u64,
    rout_h: u64,
    rout_ss: u64,
    rout_late: i32,
    nin_h: u64,
    nin_ss: u64,
    nin_w: u64,
    nin_x_out: u64,
    nin_eps: f32,
}

// SAFETY: plain integers, laid out as the C struct the kernel takes by value.
unsafe impl KernelValue for GemvArgs {}

/// In the order of `GemvKernels`' kernel arrays.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Format {
    Q4,
    Q8,
    Bf16,
}

impl Format {
    /// Columns one kernel iteration covers (COLS in gemm.cu).
    fn cols_per_iter(self) -> usize {
        match self {
            Format::Q4 | Format::Q8 => 64,
            Format::Bf16 => 32,
        }
    }
    fn bits(self) -> usize {
        match self {
            Format::Q4 => 4,
            Format::Q8 => 8,
            Format::Bf16 => 16,
        }
    }
    /// Bytes of staged x per 32-bit weight word (STAGE in gemm.cu).
    fn stage_bytes_per_word(self) -> usize {
        match self {
            Format::Q4 | Format::Q8 => 16,
            Format::Bf16 => 4,
        }
    }
    /// Bytes of one batch of 16 rows in shared memory (Slot<F>::BYTES in gemm.cu): padded rows,
    /// then the scales and biases of the quantised formats.
    fn slot_bytes(self) -> usize {
        match self {
            Format::Q4 => TILE_ROWS * (128 + 32) + 2 * TILE_ROWS * 8,
            Format::Q8 => TILE_ROWS * (256 + 64) + 2 * TILE_ROWS * 8,
            Format::Bf16 => TILE_ROWS * (256 + 64),
        }
    }
}

/// Whether decode may read inputs before the PDL wait where that is safe (the experts' ids here,
/// the GDN state in gdn.rs): on unless `LILY_EARLY_READS=0`, to measure what it brings.
pub(crate) fn early_reads() -> bool {
    std::env::var("LILY_EARLY_READS").map_or(true, |v| v != "0")
}

/// Threads per block of the residual_rmsnorm kernel (norm.rs): a fused launch must have as many
/// for its sums to add up in the same order.
const RES_THREADS: usize = 256;

/// Where each slot of a [`GemvKernels::gemv_slots`] launch takes its x from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SlotInput {
    /// One x `[ntok][cols]` for every slot (e.g. the experts' gate‖up of one token).
    Shared,
    /// x `[slots][ntok][cols]`, one per slot.
    PerSlot,
    /// x `[slots][ntok][2·cols]`, each token's row gate‖up: the product takes
    /// `bf16(silu(gate) · up)`, the SwiGLU activation fused into the experts' down projection.
    PerSlotSwiGlu,
    /// x `[slots / n][ntok][cols]`: each run of `n` consecutive slots shares one x (e.g. the
    /// experts' gate‖up of several tokens, `n` experts per token).
    PerGroup(usize),
    /// x `[t][cols]` of any `t` rows cut into chunks of `ntok` rows, slot s taking chunk s (the
    /// last may be short), all with matrix 0; y `[t][rows]`. The chunks' blocks read the same
    /// weights at about the same time, so DRAM sends them about once.
    RowChunks(usize),
    /// Slots from a table on the device (the `ids` argument, `[slots][SLOT_WORDS]`, made by
    /// `MoeKernels::slot_table`): each slot's matrix, tokens (≤ 8), their rows of x and their
    /// rows of y (`[·][rows]`). x is `[·][cols]` read at the tokens' rows (the experts' gate‖up),
    /// or with `swiglu` `[·][2·cols]` gate‖up rows through SwiGLU read at the output rows (the
    /// experts' down, whose rows are the (token, expert) pairs of its gate‖up).
    Gathered { swiglu: bool },
}

/// Words of one gathered slot in its table: {matrix, tokens, x row of each, y row of each}
/// (SLOT_WORDS in gemm.cu and moe.cu).
pub const SLOT_WORDS: usize = 2 + 2 * MAX_TOKENS;

/// How a launch cuts the work: warps sharing one 16-row tile along K, and tiles per block.
/// `GemvKernels::shape` picks one; benchmarks may try others.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GemvShape {
    pub warps_per_tile: usize,
    pub tiles_per_block: usize,
}

pub struct GemvKernels {
    stream: Arc<CudaStream>,
    /// The kernels by format (Q4, Q8, bf16): for one token, for several (gemm.cu: x staged at
    /// once), and for gathered slots ([`SlotInput::Gathered`]).
    one_token: [CudaFunction; 3],
    multi: [CudaFunction; 3],
    gathered: [CudaFunction; 3],
    /// One token's routed gate‖up with its x staged before the PDL wait
    /// ([`Self::then_routed_gate_up`]).
    x_early: [CudaFunction; 3],
    /// One token's mixer output projection adding the residual, and the router's GEMV making
    /// the norm after it ([`Self::then_residual_out`], [`Self::then_norm_in`]).
    res_out: [CudaFunction; 3],
    norm_in: [CudaFunction; 3],
    max_shared: usize,
    sm_count: usize,
    /// What the next launch pulls into L2 ([`GemvKernels::then_prefetch`]).
    ahead: Cell<L2Ahead>,
    /// The next launch's ids are final before its PDL wait ([`GemvKernels::then_ids_ready`]).
    ids_ready: Cell<bool>,
    /// The next launch is one token's routed gate‖up ([`GemvKernels::then_routed_gate_up`]).
    routed_gate_up: Cell<bool>,
    /// Launches of the x_early kernels so far (for tests: that they ran).
    x_early_launches: Cell<usize>,
    /// The next launch ends with the router's top-k ([`GemvKernels::then_topk`]).
    topk: Cell<Option<FusedTopK>>,
    /// The next launch adds the residual ([`GemvKernels::then_residual_out`]) ...
    residual_out: Cell<Option<ResidualOut>>,
    /// ... or makes its x as the norm after it ([`GemvKernels::then_norm_in`]).
    norm_in_next: Cell<Option<NormIn>>,
    /// When a residual-out launch starts its dependents (the router): as its last batch begins
    /// (2, the default), at its blocks' start (`LILY_NORM_IN_LATE=0`: the router's blocks then
    /// slow its own, and the norm-in lost 1.3–2.3 %) or after its tiles (`=1`: the router's
    /// launch is then on the chain, −1 %; bench/NOTES.md v1.69).
    residual_out_late: usize,
    /// `LILY_FUSED_TOPK=1`: decode folds the router's top-k into its GEMV (off by default: it
    /// passed its H200 tests but decoded 1 % slower, bench/NOTES.md v1.13).
    fused_topk: bool,
    /// Early reads before the PDL wait are on unless `LILY_EARLY_READS=0` (for A/B runs).
    early_reads: bool,
    /// One token's routed experts (bench/NOTES.md v1.66: the three together +2.3–2.8 % decode
    /// @4K, each alone a loss): the gate‖up stages its x before its wait unless `LILY_X_EARLY=0`,
    /// and runs as 4-warp blocks with K split in two, up to `spread` (`LILY_GEMV_SPREAD`, 3;
    /// 0: 8-warp blocks, one a SM) a SM ([`spread_shape`]); the down, whose ids are ready
    /// before its wait, takes up to `down_per_sm` blocks a SM (`LILY_GEMV_DOWN_PER_SM`, 2), so
    /// that each block holds its whole share of the weights in its ring before the wait.
    x_early_enabled: bool,
    spread: usize,
    down_per_sm: usize,
    /// The prefetching is on with `LILY_L2_AHEAD=1` (off by default: 17 % slower decode on the
    /// H200, bench/NOTES.md v1.13).
    ahead_enabled: bool,
    /// Warps per SM that [`GemvKernels::shape`] splits K until it has: 4 (decode +6 % over 16 on
    /// the H200, bench/NOTES.md v1.34), or `LILY_GEMV_WARPS_PER_SM` (1, 2, 4, 8, 16 or 32).
    warps_per_sm: usize,
    /// Passes whose rows are in this range run their experts as gathered slots
    /// ([`Self::gathers_experts`]); `LILY_GATHERED_ROWS=a-b` sets it (`0-0`: never).
    gathered_rows: (usize, usize),
    /// Passes of up to this many rows may run their dense projections as row chunks in one launch
    /// ([`Self::chunks_rows`]); `LILY_ROW_CHUNKS_MAX` sets it (0: never).
    row_chunks_max: usize,
    /// Blocks per gathered slot: `LILY_GATHERED_BLOCKS`, else (0) about two blocks per SM
    /// over the launch's slots, at least one (bench/NOTES.md v1.42: a 64-row pass's ~297 slots
    /// ran fastest at one block each, 1.7 waves, and more, shorter blocks were slower — each
    /// stages its x and ramps its copies; an 8-row pass's 72 at four).
    gathered_blocks: usize,
}

/// The tallest matrix [`GemvKernels::chunks_rows`] runs as row chunks: out_proj, o_proj, the router.
const ROW_CHUNKS_MAX_ROWS: usize = 4096;

/// The one-token GEMVs' preferred shared-memory carveout, % (see `GemvKernels::load`).
const GEMV_CARVEOUT: usize = 72;

/// Default rows of a pass whose experts run as gathered GEMV slots: from 2 (one row keeps its
/// (row, expert) slots, or the persistent MoE kernel) to 256, the most a slot table takes. Up to
/// 64 rows (a 64-stream decode step) since v1.42; from 65 to 256 rows (short prompts, whose ~8
/// rows an expert the grouped GEMM's 16-row tiles half waste) since v1.73: prefill of 128 tokens
/// 8,987 → 10,139 tok/s, of 256 tokens 15,645 → 17,258 on the H200.
const GATHERED_ROWS: (usize, usize) = (2, 256);

/// Default rows of a pass that may run its dense projections as row chunks in one launch.
const ROW_CHUNKS_MAX: usize = 64;

impl GemvKernels {
    pub fn load(dev: &CudaDevice) -> Result<Self> {
        let sm_attr = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
        let sm_count = dev
            .context()
            .attribute(sm_attr)
            .during(|| "multiprocessor count".into())? as usize;
        // Opt in to all the dynamic shared memory there is: the warps' copy rings take 90-170 KB.
        // The limit only caps what a launch may ask for; launches size their rings to fit the
        // smallest room of the three.
        let mut max_shared = usize::MAX;
        // The one-token GEMVs' preferred carveout (`LILY_GEMV_CARVEOUT`, % of the most shared
        // memory; default 72 ≈ 164 KB; see prefer_carveout). Measured with a 200 ms pause before
        // each decode, so that no clock effect of prefill counts: decode +1.4–1.8 % @4K,
        // +1.2–1.5 % @32K, prefill unchanged; 100 lost 1.7 %, 50 0.8 %.
        // The batched kernels keep the driver's pick unless `LILY_GEMV_BATCHED_CARVEOUT` (for
        // A/Bs): at 72 % two gathered blocks no longer share an SM (8 streams −2.9 %;
        // bench/NOTES.md v1.71).
        let one_token_carveout = env_percent("LILY_GEMV_CARVEOUT")?.unwrap_or(GEMV_CARVEOUT);
        let batched = env_percent("LILY_GEMV_BATCHED_CARVEOUT")?;
        let mut load = |name: &str| -> Result<CudaFunction> {
            let f = dev.function("gemm", name)?;
            let room = dev.dynamic_shared_room(&f, name)?;
            dev.allow_dynamic_shared(&f, name, room)?;
            let carveout = if name.ends_with("_multi") || name.ends_with("_gathered") {
                batched
            } else {
                Some(one_token_carveout)
            };
            if let Some(p) = carveout {
                prefer_carveout(&f, p, &format!("gemm::{name}"))?;
            }
            max_shared = max_shared.min(room);
            Ok(f)
        };
        // Each kind of kernel in the three formats (Format's order): gemv_q4{kind}, ...
        let mut formats = |kind: &str| -> Result<[CudaFunction; 3]> {
            Ok([
                load(&format!("gemv_q4{kind}"))?,
                load(&format!("gemv_q8{kind}"))?,
                load(&format!("gemv_bf16{kind}"))?,
            ])
        };
        let one_token = formats("")?;
        let multi = formats("_multi")?;
        let gathered = formats("_gathered")?;
        let x_early = formats("_x_early")?;
        let res_out = formats("_res_out")?;
        let norm_in = formats("_norm_in")?;
        let warps_per_sm = env_count("LILY_GEMV_WARPS_PER_SM", "1, 2, 4, 8, 16 or 32", |n| {
            [1, 2, 4, 8, 16, 32].contains(&n)
        })?
        .unwrap_or(4);
        let gathered_rows = match std::env::var("LILY_GATHERED_ROWS") {
            Err(_) => GATHERED_ROWS,
            Ok(v) => match v.split_once('-').map(|(a, b)| (a.parse(), b.parse())) {
                Some((Ok(a), Ok(b))) if a <= b && b <= crate::cuda::moe::SLOT_MAX_TOKENS => (a, b),
                _ => {
                    return Err(CudaError::Shape(format!(
                        "LILY_GATHERED_ROWS={v}: expected a-b with a ≤ b ≤ {}",
                        crate::cuda::moe::SLOT_MAX_TOKENS
                    )))
                }
            },
        };
        let row_chunks_max = env_count("LILY_ROW_CHUNKS_MAX", "a number of rows", |_| true)?
            .unwrap_or(ROW_CHUNKS_MAX);
        let gathered_blocks =
            env_count("LILY_GATHERED_BLOCKS", "a count ≥ 1", |n| n >= 1)?.unwrap_or(0);
        let down_per_sm =
            env_count("LILY_GEMV_DOWN_PER_SM", "1 to 4", |n| (1..=4).contains(&n))?.unwrap_or(2);
        let spread = env_count("LILY_GEMV_SPREAD", "0, 2, 3 or 4", |n| {
            [0, 2, 3, 4].contains(&n)
        })?
        .unwrap_or(3);
        Ok(Self {
            stream: dev.stream().clone(),
            one_token,
            multi,
            gathered,
            x_early,
            res_out,
            norm_in,
            max_shared,
            sm_count,
            ahead: Cell::default(),
            ids_ready: Cell::new(false),
            routed_gate_up: Cell::new(false),
            x_early_launches: Cell::new(0),
            topk: Cell::new(None),
            residual_out: Cell::new(None),
            norm_in_next: Cell::new(None),
            residual_out_late: env_count("LILY_NORM_IN_LATE", "0, 1 or 2", |n| n <= 2)?
                .unwrap_or(2),
            fused_topk: std::env::var("LILY_FUSED_TOPK").is_ok_and(|v| v == "1"),
            early_reads: early_reads(),
            x_early_enabled: std::env::var("LILY_X_EARLY").map_or(true, |v| v != "0"),
            down_per_sm,
            spread,
            ahead_enabled: std::env::var("LILY_L2_AHEAD").is_ok_and(|v| v == "1"),
            warps_per_sm,
            gathered_rows,
            row_chunks_max,
            gathered_blocks,
        })
    }

    /// Sets the blocks per gathered slot (for timing; 0: the default rule, see
    /// `LILY_GATHERED_BLOCKS`).
    pub fn set_gathered_blocks(&mut self, blocks: usize) {
        self.gathered_blocks = blocks;
    }

    /// Whether a pass of `rows` rows runs its experts as gathered slots (each expert's weights
    /// read once for the rows routed to it, up to 8 per slot; `MoeKernels::slot_table`).
    pub fn gathers_experts(&self, rows: usize) -> bool {
        rows >= self.gathered_rows.0.max(1) && rows <= self.gathered_rows.1
    }

    /// The most rows of a pass whose experts may run as gathered slots (0: none).
    pub fn max_gathered_rows(&self) -> usize {
        if self.gathered_rows.0 > self.gathered_rows.1 {
            0
        } else {
            self.gathered_rows.1
        }
    }

    /// Whether a pass of `rows` rows runs a projection over `w` as row chunks in one launch
    /// ([`Self::gemv_row_chunks`]) rather than several GEMV launches or the tensor-core GEMM, whose
    /// few tiles at a few dozen rows leave most SMs without work: when one launch does not take
    /// the rows, for matrices of at most ROW_CHUNKS_MAX_ROWS rows. Each chunk dequantises the
    /// weights again, which costs more than the GEMM on taller ones (GDN in_proj, q‖k‖v, lm_head:
    /// bench/NOTES.md v1.42).
    pub fn chunks_rows(&self, rows: usize, w: &Matrices) -> bool {
        rows > self.max_tokens(w) && rows <= self.row_chunks_max && w.rows <= ROW_CHUNKS_MAX_ROWS
    }

    /// The next launch (only that one) reads its device-side ids before its PDL wait and streams
    /// its first expert weights early. Only when the kernel launched just before it read the same
    /// ids after its own wait (PDL started it after that wait returned, when the ids' writer had
    /// finished): the experts' down after their gate‖up.
    pub fn then_ids_ready(&self) {
        self.ids_ready.set(self.early_reads);
    }

    /// The next launch (only that one) is one token's routed experts' gate‖up whose x was final
    /// before the launch could start: its writer ran at least two launches before it and the
    /// launch just before starts its dependents only after its own wait (the top-k kernel). Its
    /// x is then staged before the PDL wait (the x_early kernels; `LILY_X_EARLY=0` or
    /// `LILY_EARLY_READS=0`: not), and a shape of 4-warp blocks ([`Self::routed_gate_up_shape`])
    /// takes up to `LILY_GEMV_SPREAD` of them a SM. Taken by one-token launches of a shared x
    /// without a residual input; ignored by the others.
    pub fn then_routed_gate_up(&self) {
        self.routed_gate_up.set(true);
    }

    /// The launch shape of a routed gate‖up ([`Self::then_routed_gate_up`]) of `slots` slots.
    pub fn routed_gate_up_shape(&self, w: &Matrices, slots: usize) -> GemvShape {
        let shape = self.shape(w, slots);
        if self.spread > 0 {
            spread_shape(format_of(w), w, shape)
        } else {
            shape
        }
    }

    /// How many launches took the x_early kernels so far ([`Self::then_routed_gate_up`]).
    pub fn x_early_launches(&self) -> usize {
        self.x_early_launches.get()
    }

    /// Whether decode should fold the router's top-k into its GEMV (`LILY_FUSED_TOPK=1`).
    pub fn fuses_topk(&self) -> bool {
        self.fused_topk
    }

    /// The next launch (only that one: the router's GEMV over all its token rows) ends with the
    /// router's top-k in its last block, for tokens whose logits it writes (see [`FusedTopK`]).
    pub fn then_topk(&self, topk: FusedTopK) {
        self.topk.set(Some(topk));
    }

    /// The next launch (only that one: one token's mixer output projection, a plain [`Self::gemv`]
    /// of one slot) also adds its output to the residual stream and leaves the sums of squares
    /// the router's GEMV after it makes its norm from ([`Self::then_norm_in`]). Its rows must be
    /// whole vectors of 16 and at most 2,048 (the norm kernel's one vector a thread).
    pub fn then_residual_out(&self, out: ResidualOut) {
        self.residual_out.set(Some(out));
    }

    /// The next launch (only that one: one token's router, a plain [`Self::gemv`] of one slot)
    /// makes its x from the residual stream and the sums a [`Self::then_residual_out`] launch left,
    /// bit for bit as `NormKernels::residual_rmsnorm` would: the norm's own launch saved.
    pub fn then_norm_in(&self, input: NormIn) {
        self.norm_in_next.set(Some(input));
    }

    /// An error if a [`Self::then_residual_out`] or [`Self::then_norm_in`] was not taken by a
    /// launch (`after`: the launch it was meant for); either way it is cleared.
    pub fn ensure_taken(&self, after: &str) -> Result<()> {
        let left = self.residual_out.take().is_some() || self.norm_in_next.take().is_some();
        ensure!(
            !left,
            "gemv: a residual-out or norm-in setting was not taken by {after}"
        );
        Ok(())
    }

    /// Turns the L2 prefetching of [`Self::then_prefetch`] on or off (default: `LILY_L2_AHEAD=1`).
    pub fn set_l2_ahead(&mut self, on: bool) {
        self.ahead_enabled = on;
    }

    /// The next launch (only that one) pulls `ahead` into L2 as its first weights go out.
    pub fn then_prefetch(&self, ahead: L2Ahead) {
        if self.ahead_enabled {
            self.ahead.set(ahead);
        }
    }

    /// `y = W · x` for matrix 0 of `w` and `ntok = x.len() / cols` tokens (1..=8): x is
    /// `[ntok][cols]`, y is `[ntok][rows]`.
    pub fn gemv(&self, w: &Matrices, x: &CudaView<bf16>, y: &mut CudaViewMut<bf16>) -> Result<()> {
        ensure!(
            w.cols > 0 && x.len() % w.cols == 0,
            "gemv: x has {} values, not whole rows of {}",
            x.len(),
            w.cols
        );
        self.gemv_slots(w, None, 1, x, SlotInput::Shared, x.len() / w.cols, y)
    }

    /// A batch of `slots` products in one launch. Slot `s` multiplies matrix `ids[s]` of the stack
    /// (ids are read on the device and clamped to `0..count`; without ids, matrix `s`) with its
    /// x, laid out as `input` says. y is `[slots][ntok][rows]`. E.g. the experts of one token:
    /// gate_up with a shared x, then down with each slot's gate‖up through SwiGLU.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_slots(
        &self,
        w: &Matrices,
        ids: Option<&CudaView<i32>>,
        slots: usize,
        x: &CudaView<bf16>,
        input: SlotInput,
        ntok: usize,
        y: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        let shape = self.shape(w, slots);
        self.gemv_slots_shaped(w, ids, slots, x, input, ntok, y, shape)
    }

    /// `y = W · x` for matrix 0 of `w` and any number `t = x.len() / cols` of rows in one launch
    /// (x `[t][cols]`, y `[t][rows]`): chunks of as many rows as fit ([`Self::max_tokens`]) are
    /// its slots (see [`SlotInput::RowChunks`]).
    pub fn gemv_row_chunks(
        &self,
        w: &Matrices,
        x: &CudaView<bf16>,
        y: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        ensure!(
            w.cols > 0 && x.len() % w.cols == 0 && !x.is_empty(),
            "gemv_row_chunks: x has {} values, not whole rows of {}",
            x.len(),
            w.cols
        );
        let t = x.len() / w.cols;
        let ntok = self.max_tokens(w).min(t);
        let slots = t.div_ceil(ntok);
        let shape = self.shape(w, slots);
        self.launch(
            w,
            None,
            slots,
            x,
            SlotInput::RowChunks(t),
            ntok,
            y,
            shape,
            None,
        )
    }

    /// The gathered slots of `table` (`[slots][SLOT_WORDS]`, see [`SlotInput::Gathered`]) over
    /// the stack `w`: slot s's tokens read their rows of x and write theirs of y.
    pub fn gemv_gathered(
        &self,
        w: &Matrices,
        table: &CudaView<i32>,
        slots: usize,
        x: &CudaView<bf16>,
        swiglu: bool,
        y: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        // A slot holds up to 8 tokens, whose staged x may leave too little room for a full
        // block's copy rings (8-bit gate‖up: 66 KB of x beside 172 KB of rings): fewer warps
        // per block then, each ring as deep as before.
        let mut shape = self.shape(w, slots);
        let format = format_of(w);
        while shape.tiles_per_block > 1
            && shared_bytes(format, w.cols, MAX_TOKENS, shape, false, GATHERED_STAGES)
                > self.max_shared
        {
            shape.tiles_per_block /= 2;
        }
        let input = SlotInput::Gathered { swiglu };
        self.launch(w, Some(table), slots, x, input, MAX_TOKENS, y, shape, None)
    }

    /// The most tokens (≤ `MAX_TOKENS`) one launch over `w` can take: the staged x grows with
    /// the tokens and must fit in shared memory (8 tokens of a 4096-wide bf16 row do not).
    pub fn max_tokens(&self, w: &Matrices) -> usize {
        self.most_rows(w, false).unwrap_or(1)
    }

    /// The most rows (≤ `MAX_TOKENS`) whose launch over `w` fits in shared memory, with or
    /// without a residual input; `None` when not even one does.
    fn most_rows(&self, w: &Matrices, residual: bool) -> Option<usize> {
        let (format, shape) = (format_of(w), self.shape(w, 1));
        (1..=MAX_TOKENS)
            .rev()
            .find(|&n| shared_bytes(format, w.cols, n, shape, residual, STAGES) <= self.max_shared)
    }

    /// `y = W · x` for matrix 0 of `w` with x made from `input` (see [`ResidualInput`]) for its
    /// `ntok = h.len() / cols` rows (1..=8); the sums go to `h_out` (not `input.h`: other blocks
    /// still read it) and, when given, the rows x to `x_out`, both `[ntok][cols]`. Fails when the
    /// rows do not fit one launch's shared memory ([`Self::max_tokens_residual`]).
    pub fn gemv_residual(
        &self,
        w: &Matrices,
        input: &ResidualInput,
        h_out: &mut CudaViewMut<bf16>,
        x_out: Option<&mut CudaViewMut<bf16>>,
        y: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        let cols = w.cols;
        ensure!(
            cols > 0 && input.h.len() % cols == 0 && !input.h.is_empty(),
            "gemv_residual: h has {} values, not whole rows of {cols}",
            input.h.len()
        );
        let ntok = input.h.len() / cols;
        let k = input.parts.len() / input.h.len();
        ensure!(
            input.parts.len() == ntok * k * cols && k >= 1,
            "gemv_residual: parts must be whole multiples of h"
        );
        match &input.weights {
            Some(wt) => ensure!(
                wt.len() == ntok * k,
                "gemv_residual: {} weights for {ntok} rows of {k} parts",
                wt.len()
            ),
            None => ensure!(k == 1, "gemv_residual: {k} parts per row need weights"),
        }
        ensure!(
            input.norm_w.len() == cols && h_out.len() == ntok * cols,
            "gemv_residual: the norm weight and h_out must match h's rows of {cols}"
        );
        if let Some(x) = &x_out {
            ensure!(x.len() == ntok * cols, "gemv_residual: x_out must match h");
        }
        ensure!(
            ntok <= self.max_tokens_residual(w),
            "gemv_residual: {ntok} rows do not fit one launch over [{}×{cols}]",
            w.rows
        );
        let shape = self.shape(w, 1);
        ensure!(
            shape.warps_per_tile * shape.tiles_per_block * 32 == RES_THREADS,
            "gemv_residual: a launch shape of {shape:?} is not {RES_THREADS} threads"
        );
        let stream = &*self.stream;
        for (buf, what) in [(&input.h, "h"), (&input.parts, "parts")] {
            ensure_aligned(buf, stream, what)?;
        }
        ensure_aligned(&input.norm_w, stream, "norm weight")?;
        ensure_aligned(h_out, stream, "h_out")?;
        let raw = ResidualRaw {
            h: input.h.device_ptr(stream).0,
            parts: input.parts.device_ptr(stream).0,
            weights: input
                .weights
                .as_ref()
                .map_or(0, |wt| wt.device_ptr(stream).0),
            norm_w: input.norm_w.device_ptr(stream).0,
            h_out: h_out.device_ptr_mut(stream).0,
            x_out: match x_out {
                Some(x) => {
                    ensure_aligned(x, stream, "x_out")?;
                    x.device_ptr_mut(stream).0
                }
                None => 0,
            },
            k: as_i32(k, "parts")?,
            eps: input.eps,
        };
        // x is made in the kernel; h stands in for it in the shape checks.
        self.launch(
            w,
            None,
            1,
            &input.h,
            SlotInput::Shared,
            ntok,
            y,
            shape,
            Some(raw),
        )
    }

    /// The most rows one [`Self::gemv_residual`] launch over `w` takes: its x, sums and the staged
    /// x must fit in shared memory beside the copy rings.
    pub fn max_tokens_residual(&self, w: &Matrices) -> usize {
        self.most_rows(w, true).unwrap_or(0)
    }

    /// `gemv_slots` with a given launch shape (for tuning).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_slots_shaped(
        &self,
        w: &Matrices,
        ids: Option<&CudaView<i32>>,
        slots: usize,
        x: &CudaView<bf16>,
        input: SlotInput,
        ntok: usize,
        y: &mut CudaViewMut<bf16>,
        shape: GemvShape,
    ) -> Result<()> {
        self.launch(w, ids, slots, x, input, ntok, y, shape, None)
    }

    #[allow(clippy::too_many_arguments)]
    fn launch(
        &self,
        w: &Matrices,
        ids: Option<&CudaView<i32>>,
        slots: usize,
        x: &CudaView<bf16>,
        input: SlotInput,
        ntok: usize,
        y: &mut CudaViewMut<bf16>,
        shape: GemvShape,
        residual: Option<ResidualRaw>,
    ) -> Result<()> {
        let ahead = self.ahead.take();
        let ids_ready = self.ids_ready.take();
        let topk = self.topk.take();
        let residual_out = self.residual_out.take();
        let norm_in = self.norm_in_next.take();
        let format = check_matrices(w)?;
        if residual_out.is_some() || norm_in.is_some() {
            // One token, one slot of one matrix, a plain x: the only launches these kernels serve.
            ensure!(
                ntok == 1
                    && slots == 1
                    && ids.is_none()
                    && matches!(input, SlotInput::Shared)
                    && residual.is_none()
                    && !(residual_out.is_some() && norm_in.is_some()),
                "gemv: a residual-out or norm-in launch is one token's plain one-slot product"
            );
        }
        if let Some(r) = &residual_out {
            ensure!(
                r.len == w.rows && w.rows % TILE_ROWS == 0 && w.rows <= 8 * RES_THREADS,
                "gemv: a residual out of {} values over {} rows (whole tiles, at most {})",
                r.len,
                w.rows,
                8 * RES_THREADS
            );
        }
        if let Some(n) = &norm_in {
            ensure!(
                n.len == w.cols && w.cols <= 8 * RES_THREADS,
                "gemv: a norm in of {} values over {} columns (at most {})",
                n.len,
                w.cols,
                8 * RES_THREADS
            );
        }
        let routed = self.routed_gate_up.take()
            && ntok == 1
            && matches!(input, SlotInput::Shared | SlotInput::PerGroup(_))
            && residual.is_none()
            && residual_out.is_none()
            && norm_in.is_none()
            && topk.is_none();
        let x_early = routed && self.early_reads && self.x_early_enabled;
        if let Some(t) = &topk {
            ensure!(
                slots == 1
                    && ids.is_none()
                    && w.rows == t.experts + 1
                    && (1..=t.experts.min(MAX_TOP_K)).contains(&t.k)
                    && t.experts <= 256
                    && t.ids != 0
                    && t.weights != 0
                    && t.counter != 0,
                "gemv: a fused top-k needs the router's one-slot launch over experts + 1 rows ({} rows here), top-k of at most 256 experts",
                w.rows
            );
        }
        let GemvShape {
            warps_per_tile,
            tiles_per_block,
        } = shape;
        ensure!(
            warps_per_tile >= 1
                && tiles_per_block >= 1
                && warps_per_tile * tiles_per_block <= MAX_WARPS,
            "gemv: launch shape {shape:?} needs 1..={MAX_WARPS} warps per block"
        );
        ensure!(
            splits_evenly(format, w.cols, warps_per_tile),
            "gemv: {warps_per_tile} warps cannot split cols = {} evenly",
            w.cols
        );
        ensure!(
            (1..=MAX_TOKENS).contains(&ntok),
            "gemv: {ntok} tokens; one launch takes 1..={MAX_TOKENS}"
        );
        ensure!(slots > 0, "gemv: no slots");
        let (x_slots, x_width, slots_per_x) = match input {
            SlotInput::Shared => (1, w.cols, slots),
            SlotInput::PerSlot | SlotInput::RowChunks(_) => (slots, w.cols, 1),
            SlotInput::PerSlotSwiGlu => (slots, 2 * w.cols, 1),
            SlotInput::PerGroup(n) => {
                ensure!(
                    n > 0 && slots % n == 0,
                    "gemv: {slots} slots are not groups of {n}"
                );
                (slots / n, w.cols, n)
            }
            SlotInput::Gathered { swiglu } => (0, w.cols << swiglu as usize, 1),
        };
        // Rows of x and y: fixed per slot, or any number for the modes that say where each is.
        let (mut x_rows, mut y_rows, mut chunk_rows) = (x_slots * ntok, slots * ntok, 0);
        match input {
            SlotInput::RowChunks(t) => {
                ensure!(
                    t > 0 && slots == t.div_ceil(ntok),
                    "gemv: {t} rows are not {slots} chunks of {ntok}"
                );
                (x_rows, y_rows, chunk_rows) = (t, t, t);
            }
            SlotInput::Gathered { .. } => {
                ensure!(
                    !x.is_empty()
                        && x.len() % x_width == 0
                        && !y.is_empty()
                        && y.len() % w.rows == 0,
                    "gemv: gathered slots need whole rows of x ({x_width}) and y ({})",
                    w.rows
                );
                (x_rows, y_rows) = (x.len() / x_width, y.len() / w.rows);
            }
            _ => {}
        }
        ensure!(
            x.len() == x_rows * x_width,
            "gemv: x has {} values, expected {x_rows}×{x_width}",
            x.len()
        );
        ensure!(
            y.len() == y_rows * w.rows,
            "gemv: y has {} values, expected {y_rows}×{}",
            y.len(),
            w.rows
        );
        let gathered = matches!(input, SlotInput::Gathered { .. });
        match ids {
            Some(ids) => {
                let words = if gathered { SLOT_WORDS } else { 1 };
                ensure!(
                    ids.len() >= slots * words,
                    "gemv: {} ids for {slots} slots of {words}",
                    ids.len()
                )
            }
            None => ensure!(
                !gathered && (chunk_rows > 0 || slots <= w.count),
                "gemv: {slots} slots but only {} matrices",
                w.count
            ),
        }
        // y is written one bf16 at a time, so it may start anywhere (a pass of more rows than
        // one launch holds splits its output at row multiples of any width).
        ensure_aligned(x, &self.stream, "gemv x")?;
        let stages = if gathered { GATHERED_STAGES } else { STAGES };
        let shared_bytes = shared_bytes(format, w.cols, ntok, shape, residual.is_some(), stages);
        ensure!(
            shared_bytes <= self.max_shared,
            "gemv: {shared_bytes} bytes of shared memory needed (cols {}, {ntok} tokens), the GPU allows {}",
            w.cols, self.max_shared
        );

        let stream = &*self.stream;
        // Raw device addresses for the argument struct. The guards are cudarc's stream-ordering
        // hooks (no-ops with event tracking off); they live until the launch is queued.
        let mut guards = Vec::new();
        let (wp, sp, bp) = w.addrs(stream, &mut guards);
        // The kernel copies weights in 16-byte and scales in 8-byte pieces.
        ensure!(
            wp % 16 == 0 && sp % 8 == 0 && bp % 8 == 0,
            "gemv: weights must be 16-byte, scales and biases 8-byte aligned"
        );
        let xp = addr(x, stream, &mut guards);
        let idp = ids.map_or(0, |ids| addr(ids, stream, &mut guards));
        let (yp, _y) = y.device_ptr_mut(stream);
        let args = GemvArgs {
            w: wp,
            scales: sp,
            biases: bp,
            x: xp,
            y: yp,
            ids: idp,
            w_mat_words: (w.rows * w.cols * format.bits() / 32) as i64,
            x_slot_stride: if x_slots > 1 {
                (ntok * x_width) as i64
            } else {
                0
            },
            rows: as_i32(w.rows, "rows")?,
            cols: as_i32(w.cols, "cols")?,
            ntok: ntok as i32,
            tiles_per_block: tiles_per_block as i32,
            warps_per_tile: warps_per_tile as i32,
            count: as_i32(w.count, "count")?,
            swiglu: matches!(
                input,
                SlotInput::PerSlotSwiGlu | SlotInput::Gathered { swiglu: true }
            ) as i32,
            slots_per_x: as_i32(slots_per_x, "slots per x")?,
            chunk_rows: as_i32(chunk_rows, "rows")?,
            x_rows: as_i32(x_rows, "x rows")?,
            y_rows: as_i32(y_rows, "y rows")?,
            ahead: ahead.ranges.map(|r| r.0),
            ahead_bytes: ahead.ranges.map(|r| r.1 as i64),
            ahead_stride: ahead.ranges.map(|r| r.2 as i64),
            res_h: residual.map_or(0, |r| r.h),
            res_parts: residual.map_or(0, |r| r.parts),
            res_weights: residual.map_or(0, |r| r.weights),
            res_norm_w: residual.map_or(0, |r| r.norm_w),
            res_h_out: residual.map_or(0, |r| r.h_out),
            res_x_out: residual.map_or(0, |r| r.x_out),
            res_k: residual.map_or(0, |r| r.k),
            res_eps: residual.map_or(0.0, |r| r.eps),
            ids_ready: i32::from(ids_ready),
            topk_k: topk.map_or(0, |t| t.k as i32),
            topk_experts: topk.map_or(0, |t| t.experts as i32),
            topk_ids: topk.map_or(0, |t| t.ids),
            topk_weights: topk.map_or(0, |t| t.weights),
            topk_counter: topk.map_or(0, |t| t.counter),
            rout_h: residual_out.map_or(0, |r| r.h),
            rout_ss: residual_out.map_or(0, |r| r.vec_ss),
            rout_late: self.residual_out_late as i32,
            nin_h: norm_in.map_or(0, |n| n.h),
            nin_ss: norm_in.map_or(0, |n| n.vec_ss),
            nin_w: norm_in.map_or(0, |n| n.norm_w),
            nin_x_out: norm_in.map_or(0, |n| n.x_out),
            nin_eps: norm_in.map_or(0.0, |n| n.eps),
        };
        let kernels = if gathered {
            &self.gathered
        } else if residual_out.is_some() {
            &self.res_out
        } else if norm_in.is_some() {
            &self.norm_in
        } else if ntok > 1 {
            &self.multi
        } else if x_early {
            self.x_early_launches.set(self.x_early_launches.get() + 1);
            &self.x_early
        } else {
            &self.one_token
        };
        let func = &kernels[format as usize];
        // Persistent blocks: about as many as fit on the GPU at once, each taking the same number
        // of rounds (a round: tiles_per_block tiles), so that none is left with an extra one.
        let threads = 32 * (warps_per_tile * tiles_per_block) as u32;
        let fit = func
            .occupancy_max_active_blocks_per_multiprocessor(threads, shared_bytes, None)
            .during(|| "gemv occupancy".into())? as usize;
        // A decode-sized matrix gets one block per SM (its 8 warps keep enough copies in flight),
        // which leaves room on every SM for the next kernel's block: with PDL (pdl.rs) that one is
        // scheduled early and streams its first weights while this one finishes (two blocks per
        // SM measured 2.8 % slower on the H200, NOTES v1.13). Big matrices (lm_head) take as many
        // blocks as fit. One token's routed experts differ (see `spread`): the gate‖up's 4-warp
        // blocks up to `spread` a SM, the down's up to `down_per_sm`.
        let bytes = slots * w.rows * w.cols * format.bits() / 8;
        let routed_down = ids_ready
            && ntok == 1
            && matches!(input, SlotInput::PerSlotSwiGlu)
            && residual.is_none();
        let per_sm = if routed && warps_per_tile * tiles_per_block < MAX_WARPS {
            self.spread.clamp(1, fit.max(1))
        } else if routed_down {
            self.down_per_sm.clamp(1, fit.max(1))
        } else if bytes < 64 << 20 {
            1
        } else {
            fit
        };
        let rounds = w.rows.div_ceil(TILE_ROWS * tiles_per_block);
        let resident_per_slot = if gathered && self.gathered_blocks > 0 {
            self.gathered_blocks
        } else if gathered {
            (2 * self.sm_count).div_ceil(slots)
        } else {
            (per_sm.max(1) * self.sm_count / slots).max(1)
        };
        let blocks = rounds.div_ceil(rounds.div_ceil(resident_per_slot));
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, slots as u32, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: shared_bytes as u32,
        };
        // SAFETY: check_matrices and the checks above bound every index the kernel forms.
        unsafe { launch!(self.stream, func, cfg, &args) }
    }

    /// The default launch shape: the fewest warps along K (each then streams longer) that still
    /// give 4 warps per SM (`LILY_GEMV_WARPS_PER_SM`), then tiles per block to make 8-warp
    /// blocks. Splitting K further only adds partial sums: each warp's stream is then too short
    /// to cover its ramp (bench/NOTES.md v1.33–v1.34).
    pub fn shape(&self, w: &Matrices, slots: usize) -> GemvShape {
        let format = format_of(w);
        let tiles = w.rows.div_ceil(TILE_ROWS) * slots;
        let mut warps_per_tile = 1;
        while tiles * warps_per_tile < self.warps_per_sm * self.sm_count
            && warps_per_tile < MAX_WARPS
            && splits_evenly(format, w.cols, 2 * warps_per_tile)
        {
            warps_per_tile *= 2;
        }
        GemvShape {
            warps_per_tile,
            tiles_per_block: MAX_WARPS / warps_per_tile,
        }
    }
}

/// The routed gate‖up's spread shape: one token's 9 slots of 64 tiles as 8-warp blocks of whole
/// tiles, one a SM, run on 72 of 132 SMs, each streaming its warps' copies at ≈ 0.65 µs a batch.
/// Halving each warp's K and the block to 4 warps makes 4× the blocks, several a SM, so every SM
/// streams a share: the launch's loop 5.1 → 2.9 µs (bench/NOTES.md v1.66). Spreading the dense
/// projections too made their loops faster and the kernels after them slower (no room left for
/// their early blocks).
fn spread_shape(format: Format, w: &Matrices, shape: GemvShape) -> GemvShape {
    let kw = 2 * shape.warps_per_tile;
    if kw > 4 || !splits_evenly(format, w.cols, kw) {
        return shape;
    }
    GemvShape {
        warps_per_tile: kw,
        tiles_per_block: 4 / kw,
    }
}

/// Warps per block, at most (the Q4 kernel's launch bounds assume it).
const MAX_WARPS: usize = 8;

/// Whether `warps` warps can split the iterations of a row evenly, in whole batches.
fn splits_evenly(format: Format, cols: usize, warps: usize) -> bool {
    let iters = cols / format.cols_per_iter();
    iters % (warps * BATCH) == 0
}

/// Device addresses of a [`ResidualInput`] and its outputs, for the argument struct.
#[derive(Clone, Copy)]
struct ResidualRaw {
    h: u64,
    parts: u64,
    weights: u64,
    norm_w: u64,
    h_out: u64,
    x_out: u64,
    k: i32,
    eps: f32,
}

/// Dynamic shared memory of one block with rings of `stages` batches per warp; the layout is
/// described in gemm.cu.
fn shared_bytes(
    format: Format,
    cols: usize,
    ntok: usize,
    shape: GemvShape,
    residual: bool,
    stages: usize,
) -> usize {
    let words_per_row = cols * format.bits() / 32;
    let staged_x = ntok * (words_per_row * format.stage_bytes_per_word() + 16);
    let xsum = if format == Format::Bf16 {
        0
    } else {
        cols / GROUP * MAX_TOKENS * 4
    };
    let warps = shape.warps_per_tile * shape.tiles_per_block;
    let reduction = if shape.warps_per_tile > 1 {
        2 * warps * MAX_TOKENS * TILE_ROWS * 4
    } else {
        0
    };
    let ring = warps * stages * format.slot_bytes();
    // A residual input: the rows of x and one row of sums in bf16, a float per warp.
    let residual = if residual {
        (ntok + 1) * cols * 2 + warps * 4
    } else {
        0
    };
    staged_x + xsum + reduction + ring + residual
}

fn format_of(w: &Matrices) -> Format {
    match &w.data {
        WeightData::Bf16(_) => Format::Bf16,
        WeightData::Affine { bits: 8, .. } => Format::Q8,
        WeightData::Affine { .. } => Format::Q4,
    }
}

/// Checks a stack of matrices against the kernel's layout rules; returns its format.
fn check_matrices(w: &Matrices) -> Result<Format> {
    ensure!(w.count > 0 && w.rows > 0, "gemv: empty matrix stack");
    if let WeightData::Affine { bits, .. } = &w.data {
        ensure!(
            *bits == 4 || *bits == 8,
            "gemv: {bits}-bit weights are not supported (4 or 8)"
        );
    }
    let format = format_of(w);
    // Whole batches of iterations (see splits_evenly): 256 columns for Q4/Q8, 128 for bf16.
    let step = BATCH * format.cols_per_iter();
    ensure!(
        w.cols % step == 0,
        "gemv: cols = {} must be a multiple of {step}",
        w.cols
    );
    w.check_lengths("gemv")?;
    Ok(format)
}
