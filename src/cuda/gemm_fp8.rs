//! Prefill products of an FP8 checkpoint on Hopper's FP8 tensor cores (gemm_fp8.cu): weights in
//! the official release's layout (e4m3 bytes, one fp32 multiplier per 128 × 128 block), the
//! activations quantised per token and group of 128 columns first ([`Fp8GemmKernels::quantize_rows`]),
//! as transformers' FP8 layers and vLLM run this checkpoint. Dense products (one matrix) and the
//! experts' grouped products (a stack, rows from [`ExpertGroups`]), each plain or with SwiGLU.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, DevicePtrMut, LaunchConfig};
use half::bf16;

use super::gemm_prefill::GemmArgs;
use super::moe::ExpertGroups;
use super::pdl::KernelValue;
use super::{
    addr, as_i32, ensure, ensure_aligned, launch, CudaDevice, CudaStream, CudaView, CudaViewMut,
    Result,
};

/// Scale blocks: 128 × 128 weights, 1 × 128 activations (QBLOCK in gemm_fp8.cu).
pub const BLOCK: usize = 128;
/// Token rows and weight rows per block tile (BM, BN in gemm_fp8.cu).
const TILE_ROWS: usize = 128;
const TILE_COLS: usize = 128;
const THREADS: u32 = 256;
/// Dynamic shared memory (SMEM_BYTES in gemm_fp8.cu): six stages of the X and weight tiles (128
/// bytes per row), the token scales and two weight scales, each stage rounded up to 1 KB; 1 KB to
/// align.
const SHARED_BYTES: usize =
    6 * (TILE_ROWS * 128 + TILE_COLS * 128 + TILE_ROWS * 4 + 16).next_multiple_of(1024) + 1024;
/// quantize_fp8_rows: warps (one per row and group) per block.
const QUANTIZE_WARPS: usize = 8;

/// `count` FP8 matrices of `[rows][cols]` e4m3, with `[count][⌈rows/128⌉][cols/128]` scales.
pub struct Fp8Matrices<'a> {
    pub data: CudaView<'a, u8>,
    pub scales: CudaView<'a, f32>,
    pub count: usize,
    pub rows: usize,
    pub cols: usize,
}

impl Fp8Matrices<'_> {
    fn check(&self) -> Result<()> {
        ensure!(
            self.count > 0 && self.rows > 0 && self.cols > 0 && self.cols % BLOCK == 0,
            "fp8 gemm: {} matrices of {}×{}; cols must be a positive multiple of {BLOCK}",
            self.count,
            self.rows,
            self.cols
        );
        ensure!(
            self.data.len() == self.count * self.rows * self.cols
                && self.scales.len() == self.count * self.rows.div_ceil(BLOCK) * self.cols / BLOCK,
            "fp8 gemm: {} bytes and {} scales for {} matrices of {}×{}",
            self.data.len(),
            self.scales.len(),
            self.count,
            self.rows,
            self.cols
        );
        Ok(())
    }
}

/// Kernel arguments, field for field the `Fp8GemmArgs` struct of gemm_fp8.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct Fp8GemmArgs {
    g: GemmArgs,
    wq: u64,
    ws: u64,
    xq: u64,
    xs: u64,
}

// SAFETY: plain integers, laid out as the C struct the kernel takes by value.
unsafe impl KernelValue for Fp8GemmArgs {}

/// Activations quantised by [`Fp8GemmKernels::quantize_rows`]: `[rows][cols]` e4m3 and
/// `[rows][cols/128]` scales.
pub struct Fp8Rows<'a> {
    pub data: CudaView<'a, u8>,
    pub scales: CudaView<'a, f32>,
    pub rows: usize,
    pub cols: usize,
}

pub struct Fp8GemmKernels {
    stream: Arc<CudaStream>,
    quantize: CudaFunction,
    store: CudaFunction,
    swiglu: CudaFunction,
}

impl Fp8GemmKernels {
    pub fn load(dev: &CudaDevice) -> Result<Self> {
        let big = |name: &str| -> Result<CudaFunction> {
            let f = dev.function("gemm_fp8", name)?;
            dev.allow_dynamic_shared(&f, name, SHARED_BYTES)?;
            Ok(f)
        };
        Ok(Self {
            stream: dev.stream().clone(),
            quantize: dev.function("gemm_fp8", "quantize_fp8_rows")?,
            store: big("wgmma_fp8")?,
            swiglu: big("wgmma_swiglu_fp8")?,
        })
    }

    /// `x` (`[rows][cols]` bf16) as e4m3 per group of 128 columns: `xs = max(amax, 1e-10) / 448`,
    /// `xq = e4m3(x / xs)`, nearest even, saturating (`checkpoint::fp8::e4m3_from_f32`).
    pub fn quantize_rows(
        &self,
        x: &CudaView<bf16>,
        cols: usize,
        xq: &mut CudaViewMut<u8>,
        xs: &mut CudaViewMut<f32>,
    ) -> Result<()> {
        ensure!(
            cols > 0 && cols % BLOCK == 0 && x.len() % cols == 0,
            "fp8 quantize: {} values are not rows of {cols} (a multiple of {BLOCK})",
            x.len()
        );
        let rows = x.len() / cols;
        ensure!(
            xq.len() == x.len() && xs.len() == rows * cols / BLOCK,
            "fp8 quantize: outputs of {} bytes and {} scales for {rows}×{cols}",
            xq.len(),
            xs.len()
        );
        ensure_aligned(x, &self.stream, "fp8 quantize x")?;
        let groups = rows * cols / BLOCK;
        if groups == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (
                as_i32(groups.div_ceil(QUANTIZE_WARPS), "fp8 quantize blocks")? as u32,
                1,
                1,
            ),
            block_dim: (32 * QUANTIZE_WARPS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (rows, cols) = (as_i32(rows, "rows")?, as_i32(cols, "cols")?);
        // SAFETY: the lengths are checked above; each warp reads and writes its own group.
        unsafe {
            launch!(
                self.stream,
                &self.quantize,
                cfg,
                x,
                &mut *xq,
                &mut *xs,
                &rows,
                &cols
            )
        }
    }

    /// `y = x · Wᵀ` for matrix 0 of `w`: `y` is `[x.rows][w.rows]`.
    pub fn gemm(&self, w: &Fp8Matrices, x: &Fp8Rows, y: &mut CudaViewMut<bf16>) -> Result<()> {
        self.run(w, false, x, x.rows, x.rows, None, y)
    }

    /// For a gate‖up matrix (`2I` rows): `act[p][j] = silu(gate_j · x[p]) · (up_j · x[p])`,
    /// `act` `[x.rows][I]`.
    pub fn gemm_swiglu(
        &self,
        w: &Fp8Matrices,
        x: &Fp8Rows,
        act: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        self.run(w, true, x, x.rows, x.rows, None, act)
    }

    /// The experts' gate‖up products and SwiGLU for every (token, slot) pair of `groups`, as
    /// `GemmKernels::experts_gate_up` (`x` the tokens, `act` `[pairs][I]` in sorted order); the
    /// groups' tile map must be built for 128-row tiles.
    pub fn experts_gate_up(
        &self,
        w: &Fp8Matrices,
        x: &Fp8Rows,
        groups: &ExpertGroups,
        act: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        ensure!(
            groups.pairs() == x.rows * groups.top_k(),
            "fp8 experts_gate_up: {} pairs for {} tokens × top-{}",
            groups.pairs(),
            x.rows,
            groups.top_k()
        );
        let grouped = Some((groups, true, groups.top_k()));
        self.run(w, true, x, groups.pairs(), groups.pairs(), grouped, act)
    }

    /// The experts' down products: sorted row `p` of `x` times `down[e]` into `routed[pair]`, as
    /// `GemmKernels::experts_down`.
    pub fn experts_down(
        &self,
        w: &Fp8Matrices,
        x: &Fp8Rows,
        groups: &ExpertGroups,
        routed: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        ensure!(
            x.rows == groups.pairs(),
            "fp8 experts_down: {} rows for {} pairs",
            x.rows,
            groups.pairs()
        );
        self.run(
            w,
            false,
            x,
            x.rows,
            x.rows,
            Some((groups, false, 1)),
            routed,
        )
    }

    /// One launch: `positions` tile positions (dense rows, or grouped pairs), `y_rows` rows of y;
    /// `grouped`: the tile map and whether its sorted pairs gather X rows (divided by the third
    /// value) or scatter Y rows.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        w: &Fp8Matrices,
        swiglu: bool,
        x: &Fp8Rows,
        positions: usize,
        y_rows: usize,
        grouped: Option<(&ExpertGroups, bool, usize)>,
        y: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        w.check()?;
        ensure!(
            x.cols == w.cols
                && x.data.len() == x.rows * x.cols
                && x.scales.len() == x.rows * x.cols / BLOCK,
            "fp8 gemm: activations {}×{} ({} bytes, {} scales) for weights of width {}",
            x.rows,
            x.cols,
            x.data.len(),
            x.scales.len(),
            w.cols
        );
        // The up rows of a SwiGLU tile share one scale block only if I is a multiple of 64.
        ensure!(
            !swiglu || w.rows % TILE_COLS == 0,
            "fp8 gemm_swiglu: {} gate‖up rows; a multiple of {TILE_COLS} needed",
            w.rows
        );
        let out_width = if swiglu { w.rows / 2 } else { w.rows };
        ensure!(
            y.len() == y_rows * out_width,
            "fp8 gemm: y has {} values, expected {y_rows}×{out_width}",
            y.len()
        );
        if positions == 0 {
            return Ok(());
        }
        ensure_aligned(&x.data, &self.stream, "fp8 gemm x")?;
        ensure_aligned(&w.data, &self.stream, "fp8 gemm weights")?;
        ensure_aligned(y, &self.stream, "fp8 gemm y")?;
        as_i32(w.count * w.rows * w.cols, "fp8 weight bytes")?;

        let stream = &*self.stream;
        // The views outlive the guards, which hold on to them until the launch is queued.
        let group_views = grouped.map(|(g, _, _)| (g.sorted_pairs(), g.tile_map(), g.tile_count()));
        let mut guards = Vec::new();
        let (tiles_x, a_rows, c_rows, tiles, num_tiles, a_div) = match (grouped, &group_views) {
            (Some((groups, gather, div)), Some((sorted, map, count))) => {
                ensure!(
                    groups.tile_rows() == TILE_ROWS
                        && groups.spill() == 0
                        && groups.experts() <= w.count,
                    "fp8 gemm: expert groups of {}-row tiles (+{}) over {} experts for {} matrices",
                    groups.tile_rows(),
                    groups.spill(),
                    groups.experts(),
                    w.count
                );
                let sorted = addr(sorted, stream, &mut guards);
                let (a, c) = if gather { (sorted, 0) } else { (0, sorted) };
                let map = addr(map, stream, &mut guards);
                let count = addr(count, stream, &mut guards);
                (groups.max_tiles(), a, c, map, count, div)
            }
            _ => (positions.div_ceil(TILE_ROWS), 0, 0, 0, 0, 1),
        };
        let (yp, _y) = y.device_ptr_mut(stream);
        let args = Fp8GemmArgs {
            g: GemmArgs {
                w: 0,
                scales: 0,
                biases: 0,
                x: 0,
                y: yp,
                a_rows,
                c_rows,
                tiles,
                num_tiles,
                w_mat_words: 0,
                x_rows: as_i32(x.rows, "x rows")?,
                y_rows: as_i32(y_rows, "y rows")?,
                n: as_i32(w.rows, "rows")?,
                k: as_i32(w.cols, "cols")?,
                a_div: as_i32(a_div, "top_k")?,
                count: as_i32(w.count, "count")?,
                staged_stores: 0,
            },
            wq: addr(&w.data, stream, &mut guards),
            ws: addr(&w.scales, stream, &mut guards),
            xq: addr(&x.data, stream, &mut guards),
            xs: addr(&x.scales, stream, &mut guards),
        };
        let col_tiles = if swiglu {
            out_width.div_ceil(TILE_COLS / 2)
        } else {
            w.rows.div_ceil(TILE_COLS)
        };
        ensure!(
            col_tiles <= 65535,
            "fp8 gemm: {} weight rows are too many",
            w.rows
        );
        let cfg = LaunchConfig {
            grid_dim: (as_i32(tiles_x, "row tiles")? as u32, col_tiles as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: SHARED_BYTES as u32,
        };
        let func = if swiglu { &self.swiglu } else { &self.store };
        // SAFETY: the checks above bound every index the kernel forms; grouped launches read
        // positions below the pairs and pair ids that the grouping kernels wrote.
        unsafe { launch!(self.stream, func, cfg, &args) }
    }
}
