//! Prefill matrix products (gemm_prefill.cu): `Y[p][n] = Σ_k X[p][k] · W[n][k]` for many rows at
//! once on the tensor cores, W in bf16 or MLX affine 4/8-bit (group 64) dequantised on the fly.
//! Dense projections of a prompt chunk, and the grouped expert products of a MoE layer whose rows
//! were sorted by expert on the device ([`super::moe::ExpertGroups`]). The decode path (≤ 8
//! tokens) uses the GEMV of gemm.rs instead.
//!
//! The kernel and the reasons for its shape are described at the top of gemm_prefill.cu. For
//! 4-bit and 8-bit weights a second kernel does the same products on Hopper's warpgroup instructions
//! (gemm_wgmma.cu, the weights dequantised into wgmma's register operand, tiles of up to 128
//! rows), the default for them since it measured faster (bench/NOTES.md v1.21; `LILY_WGMMA=0`
//! turns it off for A/B runs). Its tiles of 128 rows halve the dequantisation per product, which
//! is what bounds both kernels. Experts of few rows each (a cached conversation turn's ≈ 2.3K
//! tokens: ≈ 73 rows an expert) run on its narrow blocks, two per SM ([`WgmmaShape`]).

use std::sync::Arc;

use cudarc::driver::{DevicePtrMut, LaunchConfig};
use half::bf16;

use super::gemm::{Matrices, WeightData, GROUP};
use super::moe::ExpertGroups;
use super::pdl::KernelValue;
use super::{
    addr, as_i32, ensure, ensure_aligned, env_count, launch, CudaDevice, CudaError, CudaFunction,
    CudaStream, CudaView, CudaViewMut, Result,
};

/// Rows (tokens, or an expert's rows) per block tile of the dense products.
pub const TILE_ROWS: usize = 64;
/// Rows per block tile of the wgmma kernels (a tile of at most 64 runs their N = 64 products):
/// what the experts' tile map is built for when they run on wgmma.
pub const WGMMA_TILE_ROWS: usize = 128;
/// Rows beyond [`WGMMA_TILE_ROWS`] that an expert's last tile may take on the wgmma kernels (SPILL
/// in gemm_wgmma.cu): an expert of 129..160 rows is one tile of N = 160 rather than two, of which
/// the second would cost about as much as a full one.
pub const WGMMA_SPILL_ROWS: usize = 32;
/// The tile heights of the mma.sync kernels (MI = 4, 2, 1 in gemm_prefill.cu): the grouped expert
/// products take the short ones when each expert sees few rows ([`GemmKernels::expert_tile_rows`]).
pub const TILE_HEIGHTS: [usize; 3] = [64, 32, 16];
/// The shortest tiles: what an [`ExpertGroups`] tile map must have room for.
pub const MIN_TILE_ROWS: usize = 16;
/// Passes of at least this many rows run their experts as grouped GEMMs by default: one more than
/// the decode GEMV takes in one launch (gemm.rs `MAX_TOKENS`).
const GROUPED_FROM_ROWS: usize = super::gemm::MAX_TOKENS + 1;
/// Weight rows per block tile (BN in gemm_prefill.cu).
const TILE_COLS: usize = 256;
const THREADS: u32 = 128;
/// Columns of a matrix the wgmma kernels take are a multiple of this: four quantisation groups.
const WGMMA_COL_MULTIPLE: usize = 256;
/// The wgmma kernels' two block shapes (gemm_wgmma.cu): wide, 256 weight rows, 4 warpgroups and 6
/// stages, one block per SM; narrow, 128 weight rows, 2 warpgroups and 4 stages, two blocks per
/// SM, for experts of few rows each, whose tiles' short products leave a wide block's lockstep
/// warpgroups idle (bench/NOTES.md v1.84).
#[derive(Clone, Copy, PartialEq, Debug)]
enum WgmmaShape {
    Wide,
    Narrow,
}

impl WgmmaShape {
    /// Weight rows per block tile (BN in gemm_wgmma.cu).
    fn tile_cols(self) -> usize {
        match self {
            WgmmaShape::Wide => 256,
            WgmmaShape::Narrow => 128,
        }
    }
    /// Threads per block: a warpgroup per 64 weight rows.
    fn threads(self) -> u32 {
        2 * self.tile_cols() as u32
    }
    /// Dynamic shared memory (smem_bytes in gemm_wgmma.cu): the stages of X and packed weights
    /// (32 bytes per row and k-tile in Q4, 64 in Q8), two slots of four k-tiles' scales and
    /// biases, 1 KB to align. Tiles taller by the spill take a stage less in the same bytes.
    fn shared_bytes(self, format: Format) -> usize {
        let row_bytes = if format == Format::Q4 { 32 } else { 64 };
        let stages = match self {
            WgmmaShape::Wide => 6,
            WgmmaShape::Narrow => 4,
        };
        let cols = self.tile_cols();
        stages * (WGMMA_TILE_ROWS * 128 + cols * row_bytes) + 2 * (2 * cols * 8) + 1024
    }
}

/// Grouped expert products run on the narrow wgmma blocks while the experts average at most this
/// many rows (`LILY_WGMMA_NARROW_ROWS`; 0: never).
const WGMMA_NARROW_ROWS: usize = 96;

/// Kernel arguments, field for field the `GemmArgs` struct of gemm_prefill.cuh (also the table
/// part of gemm_fp8.rs's arguments).
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct GemmArgs {
    pub(super) w: u64,
    pub(super) scales: u64,
    pub(super) biases: u64,
    pub(super) x: u64,
    pub(super) y: u64,
    pub(super) a_rows: u64,
    pub(super) c_rows: u64,
    pub(super) tiles: u64,
    pub(super) num_tiles: u64,
    pub(super) w_mat_words: i64,
    pub(super) x_rows: i32,
    pub(super) y_rows: i32,
    pub(super) n: i32,
    pub(super) k: i32,
    pub(super) a_div: i32,
    pub(super) count: i32,
    pub(super) staged_stores: i32,
}

// SAFETY: plain integers, laid out as the C struct the kernel takes by value.
unsafe impl KernelValue for GemmArgs {}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Format {
    Q4,
    Q8,
    Bf16,
}

impl Format {
    fn bits(self) -> usize {
        match self {
            Format::Q4 => 4,
            Format::Q8 => 8,
            Format::Bf16 => 16,
        }
    }
    /// Dynamic shared memory of one block of `tile_rows` rows (Layout<F, MI>::SMEM_BYTES in
    /// gemm_prefill.cu): stages × (X tile + weight tile + {scale, bias} per weight row).
    fn shared_bytes(self, tile_rows: usize) -> usize {
        let a = tile_rows * 128;
        let (row_bytes, stages, sb) = match self {
            Format::Q4 => (32, 4, 4),
            Format::Q8 => (64, 4, 4),
            Format::Bf16 => (128, 2, 0),
        };
        stages * (a + TILE_COLS * (row_bytes + sb))
    }
}

/// What the kernel writes.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Epilogue {
    /// `y[p][n]`, bf16.
    Store,
    /// For a gate‖up stack of `2I` rows: `act[p][j] = silu(gate_j) · up_j`, `[p][I]`.
    SwiGlu,
}

/// How the rows of one launch are found.
struct Rows<'a> {
    /// Positions (dense) or pairs (grouped).
    positions: usize,
    /// Rows of x and of y (bounds the kernel clamps to).
    x_rows: usize,
    y_rows: usize,
    /// Grouped: the tile map and the sorted pairs, gathered into X (`gather`, divided by
    /// `a_div`: pair → token) or scattered into Y (`!gather`).
    grouped: Option<(&'a ExpertGroups, bool, usize)>,
}

pub struct GemmKernels {
    stream: Arc<CudaStream>,
    /// [height (TILE_HEIGHTS)][format][epilogue]
    funcs: [[[CudaFunction; 2]; 3]; 3],
    /// `LILY_EXPERT_TILE_ROWS` (16, 32 or 64): one height for every grouped product (A/B runs).
    expert_tile_override: Option<usize>,
    /// Q4 and Q8 on wgmma (gemm_wgmma.cu), [shape][format][epilogue].
    wgmma: [[[CudaFunction; 2]; 2]; 2],
    use_wgmma: bool,
    /// Grouped products run on the narrow wgmma blocks while the experts average at most this many
    /// rows ([`WGMMA_NARROW_ROWS`] unless `LILY_WGMMA_NARROW_ROWS`).
    narrow_rows: usize,
    /// The wgmma kernels' plain (not SwiGLU) products store their outputs through shared memory as
    /// 16-byte row pieces (on unless `LILY_WGMMA_STAGED_STORES=0`): the experts' down GEMM at 4K
    /// tokens 11 % faster, the SwiGLU products no faster or (≤ 512 tokens) 7 % slower
    /// (bench/NOTES.md v1.39).
    staged_stores: bool,
    /// Experts' groupings for the wgmma kernels let a last tile take up to [`WGMMA_SPILL_ROWS`]
    /// more rows (on unless `LILY_WGMMA_SPILL=0`).
    spill: bool,
}

impl GemmKernels {
    pub fn load(dev: &CudaDevice) -> Result<Self> {
        // Opt in to more than the default 48 KB of dynamic shared memory.
        let load_from = |module: &str, name: &str, need: usize| -> Result<CudaFunction> {
            let f = dev.function(module, name)?;
            dev.allow_dynamic_shared(&f, name, need)?;
            Ok(f)
        };
        let wgmma = |shape: WgmmaShape, kind: &str, format| -> Result<CudaFunction> {
            let name = match shape {
                WgmmaShape::Wide => format!("wgmma_{kind}"),
                WgmmaShape::Narrow => format!("wgmma_narrow_{kind}"),
            };
            let f = load_from("gemm_wgmma", &name, shape.shared_bytes(format))?;
            if shape == WgmmaShape::Narrow {
                // Two blocks per SM need the most shared memory the SM has.
                super::prefer_carveout(&f, 100, &name)?;
            }
            Ok(f)
        };
        let shape = |shape| -> Result<[[CudaFunction; 2]; 2]> {
            Ok([
                [
                    wgmma(shape, "q4", Format::Q4)?,
                    wgmma(shape, "swiglu_q4", Format::Q4)?,
                ],
                [
                    wgmma(shape, "q8", Format::Q8)?,
                    wgmma(shape, "swiglu_q8", Format::Q8)?,
                ],
            ])
        };
        // gemm_q4, gemm_swiglu_q4_m32, ...: [format][epilogue] for one height.
        let height = |rows: usize| -> Result<[[CudaFunction; 2]; 3]> {
            let suffix = if rows == TILE_ROWS {
                String::new()
            } else {
                format!("_m{rows}")
            };
            let load = |kind: &str, format: Format| {
                let name = format!("gemm_{kind}{suffix}");
                load_from("gemm_prefill", &name, format.shared_bytes(rows))
            };
            Ok([
                [load("q4", Format::Q4)?, load("swiglu_q4", Format::Q4)?],
                [load("q8", Format::Q8)?, load("swiglu_q8", Format::Q8)?],
                [
                    load("bf16", Format::Bf16)?,
                    load("swiglu_bf16", Format::Bf16)?,
                ],
            ])
        };
        let expert_tile_override =
            env_count("LILY_EXPERT_TILE_ROWS", "one of 16, 32, 64, 128", |r| {
                TILE_HEIGHTS.contains(&r) || r == WGMMA_TILE_ROWS
            })?;
        Ok(Self {
            stream: dev.stream().clone(),
            funcs: [height(64)?, height(32)?, height(16)?],
            expert_tile_override,
            wgmma: [shape(WgmmaShape::Wide)?, shape(WgmmaShape::Narrow)?],
            use_wgmma: std::env::var("LILY_WGMMA").map_or(true, |v| v != "0"),
            narrow_rows: env_count("LILY_WGMMA_NARROW_ROWS", "a number of rows", |_| true)?
                .unwrap_or(WGMMA_NARROW_ROWS),
            staged_stores: std::env::var("LILY_WGMMA_STAGED_STORES").map_or(true, |v| v != "0"),
            spill: std::env::var("LILY_WGMMA_SPILL").map_or(true, |v| v != "0"),
        })
    }

    /// Runs 4- and 8-bit products on the wgmma kernel (or not); on unless `LILY_WGMMA=0`.
    pub fn set_wgmma(&mut self, on: bool) {
        self.use_wgmma = on;
    }

    /// Runs grouped expert products on the narrow wgmma blocks while the experts average at most
    /// `rows` rows (0: never); [`WGMMA_NARROW_ROWS`] unless `LILY_WGMMA_NARROW_ROWS`.
    pub fn set_narrow_rows(&mut self, rows: usize) {
        self.narrow_rows = rows;
    }

    /// Stores the wgmma kernels' plain products through shared memory (or straight from
    /// registers); on unless `LILY_WGMMA_STAGED_STORES=0`. SwiGLU products never are.
    pub fn set_staged_stores(&mut self, on: bool) {
        self.staged_stores = on;
    }

    /// Lets [`Self::expert_tile_spill`] give the wgmma kernels' expert tiles their extra rows;
    /// on unless `LILY_WGMMA_SPILL=0`.
    pub fn set_spill(&mut self, on: bool) {
        self.spill = on;
    }

    /// Whether products with weights of `format` and `cols` columns run on the wgmma kernels: the
    /// quantised ones whose rows are whole 4-group pieces (the kernels copy scales and biases in
    /// 8-byte pieces; every product of the model qualifies), unless `LILY_WGMMA=0` (bf16 weights
    /// stay on mma.sync or cuBLAS).
    fn on_wgmma(&self, format: Format, cols: usize) -> bool {
        self.use_wgmma
            && matches!(format, Format::Q4 | Format::Q8)
            && cols % WGMMA_COL_MULTIPLE == 0
    }

    /// Whether the products of every stack in `ws` run on the wgmma kernels (valid 4/8-bit
    /// weights, wgmma on): one expert grouping serves gate‖up and down, so both must.
    fn runs_on_wgmma(&self, ws: &[&Matrices]) -> bool {
        ws.iter()
            .all(|w| check_matrices(w).is_ok_and(|f| self.on_wgmma(f, w.cols)))
    }

    /// Whether the experts of a pass of `rows` rows run as grouped GEMMs (each expert's weights
    /// read once for all its rows) rather than as the decode GEMVs' (row, expert) slots: from 9
    /// rows on, the most one GEMV launch takes (from 2 rows measured 15 % slower at 8 streams,
    /// bench/NOTES.md v1.16).
    pub fn groups_experts(&self, rows: usize) -> bool {
        rows >= GROUPED_FROM_ROWS
    }

    /// The tile height for grouping `pairs` (token, slot) pairs over `experts` experts whose
    /// weight stacks (gate‖up, down) are `ws`: 16 rows while the experts average at most 16 (a batched decode step, a
    /// short prompt), 32 up to 48, else 64 — a 64-row tile of a few rows is mostly padding, whose
    /// tensor work costs as much as real rows — or, for 4/8-bit weights on the wgmma kernel, 128
    /// (its tiles of at most 64 rows run shorter products, so they pad no more than 64-row tiles).
    /// `LILY_EXPERT_TILE_ROWS` forces one height (128 only where the wgmma kernel runs these
    /// weights; elsewhere it means 64).
    pub fn expert_tile_rows(&self, pairs: usize, experts: usize, ws: &[&Matrices]) -> usize {
        let wgmma = self.runs_on_wgmma(ws);
        match self.expert_tile_override {
            Some(WGMMA_TILE_ROWS) if !wgmma => return TILE_ROWS,
            Some(rows) => return rows,
            None => {}
        }
        match pairs.div_ceil(experts.max(1)) {
            0..=16 => 16,
            17..=48 => 32,
            _ if wgmma => WGMMA_TILE_ROWS,
            _ => 64,
        }
    }

    /// The rows beyond `tile_rows` that an expert's last tile may take, for a grouping of the
    /// experts' stacks `ws` in tiles of `tile_rows` ([`super::moe::MoeKernels::group_by_expert`]):
    /// [`WGMMA_SPILL_ROWS`] where the wgmma kernel runs them in its 128-row tiles, else 0.
    pub fn expert_tile_spill(&self, tile_rows: usize, ws: &[&Matrices]) -> usize {
        let wgmma = self.runs_on_wgmma(ws);
        if self.spill && wgmma && tile_rows == WGMMA_TILE_ROWS {
            WGMMA_SPILL_ROWS
        } else {
            0
        }
    }

    /// Whether these weights fit the kernel: 4/8-bit or bf16, `cols` a multiple of 64.
    pub fn supports(w: &Matrices) -> bool {
        check_matrices(w).is_ok()
    }

    /// `y = x · Wᵀ` for matrix 0 of `w`: x is `[t][cols]` (any t ≥ 1), y is `[t][rows]`.
    pub fn gemm(&self, w: &Matrices, x: &CudaView<bf16>, y: &mut CudaViewMut<bf16>) -> Result<()> {
        let t = dense_rows(w, x)?;
        let rows = Rows {
            positions: t,
            x_rows: t,
            y_rows: t,
            grouped: None,
        };
        self.run(w, Epilogue::Store, x, &rows, y)
    }

    /// For a gate‖up matrix (`2I` rows: gate rows then up rows): `act[p][j] =
    /// silu(gate_j · x[p]) · (up_j · x[p])`, x `[t][cols]`, act `[t][I]`, from fp32 sums.
    pub fn gemm_swiglu(
        &self,
        w: &Matrices,
        x: &CudaView<bf16>,
        act: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        let t = dense_rows(w, x)?;
        let rows = Rows {
            positions: t,
            x_rows: t,
            y_rows: t,
            grouped: None,
        };
        self.run(w, Epilogue::SwiGlu, x, &rows, act)
    }

    /// The experts' gate‖up products and SwiGLU for every (token, slot) pair of `groups`: row `p`
    /// of `act` (`[pairs][I]`, in the expert-sorted order of `groups`) is
    /// `swiglu(gate_up[e] · x[token])` for the p-th sorted pair (token, slot) routed to expert e.
    /// `x` is `[tokens][cols]`; `w` the stack of `gate‖up` matrices (`2I` rows each).
    pub fn experts_gate_up(
        &self,
        w: &Matrices,
        x: &CudaView<bf16>,
        groups: &ExpertGroups,
        act: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        let tokens = dense_rows(w, x)?;
        let pairs = groups.pairs();
        ensure!(
            pairs == tokens * groups.top_k(),
            "experts_gate_up: the groups hold {pairs} pairs, x has {tokens} tokens × top-{}",
            groups.top_k()
        );
        let rows = Rows {
            positions: pairs,
            x_rows: tokens,
            y_rows: pairs,
            grouped: Some((groups, true, groups.top_k())),
        };
        self.run(w, Epilogue::SwiGlu, x, &rows, act)
    }

    /// The experts' down products: row `p` of `act` (expert-sorted, from
    /// [`Self::experts_gate_up`]) times `down[e]` is written to `routed[pair]`, where pair =
    /// token·top_k + slot: `routed` is `[tokens][top_k][rows]`, ready for `MoeKernels::combine`.
    pub fn experts_down(
        &self,
        w: &Matrices,
        act: &CudaView<bf16>,
        groups: &ExpertGroups,
        routed: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        let pairs = dense_rows(w, act)?;
        ensure!(
            pairs == groups.pairs(),
            "experts_down: act has {pairs} rows, the groups {} pairs",
            groups.pairs()
        );
        let rows = Rows {
            positions: pairs,
            x_rows: pairs,
            y_rows: pairs,
            grouped: Some((groups, false, 1)),
        };
        self.run(w, Epilogue::Store, act, &rows, routed)
    }

    fn run(
        &self,
        w: &Matrices,
        epilogue: Epilogue,
        x: &CudaView<bf16>,
        rows: &Rows,
        y: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        let format = check_matrices(w)?;
        let out_width = match epilogue {
            Epilogue::Store => w.rows,
            Epilogue::SwiGlu => {
                ensure!(
                    w.rows % 2 == 0,
                    "gemm: a gate‖up matrix needs an even number of rows, not {}",
                    w.rows
                );
                w.rows / 2
            }
        };
        ensure!(
            y.len() == rows.y_rows * out_width,
            "gemm: y has {} values, expected {}×{out_width}",
            y.len(),
            rows.y_rows
        );
        ensure!(
            x.len() == rows.x_rows * w.cols,
            "gemm: x has {} values, expected {}×{}",
            x.len(),
            rows.x_rows,
            w.cols
        );
        if rows.positions == 0 {
            return Ok(());
        }
        // cp.async reads 16-byte pieces of x; y is written in bf16 pairs.
        ensure_aligned(x, &self.stream, "gemm x")?;
        ensure_aligned(y, &self.stream, "gemm y")?;
        let row_words = w.cols * format.bits() / 32;
        // The kernel keeps a row's word offset within its matrix in an int.
        as_i32(w.rows * row_words, "words of one matrix")?;

        let stream = &*self.stream;
        let group_views = rows
            .grouped
            .map(|(g, _, _)| (g.sorted_pairs(), g.tile_map(), g.tile_count()));
        // Raw device addresses for the argument struct. The guards are cudarc's stream-ordering
        // hooks (no-ops with event tracking off); they live until the launch is queued.
        let mut guards = Vec::new();
        let (wp, sp, bp) = w.addrs(stream, &mut guards);
        ensure!(
            wp % 16 == 0,
            "gemm: weights at {wp:#x} are not 16-byte aligned"
        );
        ensure!(
            !self.on_wgmma(format, w.cols) || (sp % 8 == 0 && bp % 8 == 0),
            "gemm: scales at {sp:#x} or biases at {bp:#x} are not 8-byte aligned"
        );
        let xp = addr(x, stream, &mut guards);
        // The wgmma kernel takes tiles of up to 128 rows (dense products: 128), the mma.sync
        // kernels one of TILE_HEIGHTS.
        let grouped_height = rows.grouped.map(|(g, _, _)| g.tile_rows());
        let wgmma = self.on_wgmma(format, w.cols)
            && matches!(
                grouped_height,
                None | Some(TILE_ROWS) | Some(WGMMA_TILE_ROWS)
            );
        let height = match (wgmma, grouped_height) {
            (true, None) => WGMMA_TILE_ROWS,
            (_, h) => h.unwrap_or(TILE_ROWS),
        };
        let height_index = TILE_HEIGHTS.iter().position(|&h| h == height);
        if !wgmma && height_index.is_none() {
            return Err(CudaError::Shape(format!(
                "gemm: expert groups built for tiles of {height} rows, the kernels take {TILE_HEIGHTS:?}"
            )));
        }
        // Tiles taller than their height: only the wgmma kernel's 128-row tiles take them.
        let spill = rows.grouped.map_or(0, |(g, _, _)| g.spill());
        ensure!(
            spill == 0
                || (wgmma && height == WGMMA_TILE_ROWS && spill <= WGMMA_SPILL_ROWS),
            "gemm: expert groups whose last tiles take {spill} more rows than {height}: the kernels \
             take up to {WGMMA_SPILL_ROWS} more on 128-row wgmma tiles only"
        );
        let (tiles_x, a_rows, c_rows, tiles, num_tiles, a_div) = match (rows.grouped, &group_views)
        {
            (Some((groups, gather, div)), Some((sorted, map, count))) => {
                ensure!(
                    groups.experts() <= w.count,
                    "gemm: {} experts routed but the stack has {} matrices",
                    groups.experts(),
                    w.count
                );
                let sorted = addr(sorted, stream, &mut guards);
                let (a, c) = if gather { (sorted, 0) } else { (0, sorted) };
                (
                    groups.max_tiles(),
                    a,
                    c,
                    addr(map, stream, &mut guards),
                    addr(count, stream, &mut guards),
                    div,
                )
            }
            _ => (rows.positions.div_ceil(height), 0, 0, 0, 0, 1),
        };
        let (yp, _y) = y.device_ptr_mut(stream);
        let args = GemmArgs {
            w: wp,
            scales: sp,
            biases: bp,
            x: xp,
            y: yp,
            a_rows,
            c_rows,
            tiles,
            num_tiles,
            w_mat_words: (w.rows * row_words) as i64,
            x_rows: as_i32(rows.x_rows, "x rows")?,
            y_rows: as_i32(rows.y_rows, "y rows")?,
            n: as_i32(w.rows, "rows")?,
            k: as_i32(w.cols, "cols")?,
            a_div: as_i32(a_div, "top_k")?,
            count: as_i32(w.count, "count")?,
            staged_stores: (self.staged_stores && epilogue == Epilogue::Store) as i32,
        };
        // Experts of few rows each run on the narrow wgmma blocks.
        let shape = match rows.grouped {
            Some((g, _, _))
                if wgmma && rows.positions.div_ceil(g.experts().max(1)) <= self.narrow_rows =>
            {
                WgmmaShape::Narrow
            }
            _ => WgmmaShape::Wide,
        };
        let tile_cols = if wgmma { shape.tile_cols() } else { TILE_COLS };
        let col_tiles = match epilogue {
            Epilogue::Store => w.rows.div_ceil(tile_cols),
            Epilogue::SwiGlu => out_width.div_ceil(tile_cols / 2),
        };
        ensure!(
            col_tiles <= 65535,
            "gemm: {} weight rows are too many for one launch",
            w.rows
        );
        // Both kernels take the same arguments, tile map and grid.
        let (func, shared_bytes, threads) = match height_index {
            Some(i) if !wgmma => (
                &self.funcs[i][format as usize][epilogue as usize],
                format.shared_bytes(height),
                THREADS,
            ),
            _ => (
                &self.wgmma[shape as usize][format as usize][epilogue as usize],
                shape.shared_bytes(format),
                shape.threads(),
            ),
        };
        let cfg = LaunchConfig {
            grid_dim: (as_i32(tiles_x, "row tiles")? as u32, col_tiles as u32, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: shared_bytes as u32,
        };
        // SAFETY: check_matrices and the checks above bound every index the kernel forms; grouped
        // launches read positions < pairs and pair ids that the grouping kernels wrote.
        unsafe { launch!(self.stream, func, cfg, &args) }
    }
}

/// Rows of `x` for matrix `w` (x is `[rows][w.cols]`).
fn dense_rows(w: &Matrices, x: &CudaView<bf16>) -> Result<usize> {
    ensure!(
        w.cols > 0 && x.len() % w.cols == 0,
        "gemm: x has {} values, not whole rows of {}",
        x.len(),
        w.cols
    );
    Ok(x.len() / w.cols)
}

/// Checks a stack of matrices against the kernel's layout rules; returns its format.
fn check_matrices(w: &Matrices) -> Result<Format> {
    ensure!(w.count > 0 && w.rows > 0, "gemm: empty matrix stack");
    let format = match &w.data {
        WeightData::Bf16(_) => Format::Bf16,
        WeightData::Affine { bits: 4, .. } => Format::Q4,
        WeightData::Affine { bits: 8, .. } => Format::Q8,
        WeightData::Affine { bits, .. } => {
            return Err(CudaError::Shape(format!(
                "gemm: {bits}-bit weights are not supported (4 or 8)"
            )))
        }
    };
    ensure!(
        w.cols % GROUP == 0,
        "gemm: cols = {} must be a multiple of {GROUP}",
        w.cols
    );
    w.check_lengths("gemm")?;
    Ok(format)
}
