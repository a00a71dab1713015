//! Gated DeltaNet layer kernels (gdn.cu, spec/MODEL.md §3.6): from the outputs of the input
//! projections (qkv, z, b, a) to the input of `out_proj`, for one GDN layer:
//! causal conv + SiLU, l2-normalised q/k, gates β and g, the gated delta rule on the fp32 state,
//! and the gated RMSNorm. Decode runs one token for each of a batch of sequences; prefill runs a
//! chunk of tokens of one sequence in the chunked (WY) form, which agrees with decode token by
//! token.
//!
//! The kernels are specialised to Qwen3.6-35B-A3B's shapes (`check_config`). Per sequence and layer
//! the state is
//! * `ssm`: fp32 `[32 value heads][128 dk][128 dv]` (`SSM_STATE_LEN` values), `S[d][v]` as in the
//!   CPU reference's `DeltaNetState::ssm`;
//! * `conv`: bf16 `[3][8192]` (`CONV_STATE_LEN` values), the last three pre-conv qkv rows, oldest
//!   first, as `DeltaNetState::conv` (bf16 holds the bf16 inputs exactly).
//!
//! Decode addresses states in pools (`[n_slots][...]`, one pool per layer) through device-side
//! slot ids, so a batch's decode step can be captured in a CUDA graph once and replayed.

use std::sync::Arc;

use cudarc::driver::{DevicePtrMut, LaunchConfig, SyncOnDrop};
use half::bf16;

use super::pdl::KernelValue;
use super::{
    addr, as_i32, ensure, ensure_aligned, launch, Context, CudaDevice, CudaError, CudaFunction,
    CudaSlice, CudaStream, CudaView, CudaViewMut, Result,
};
use crate::config::ModelConfig;

pub const KEY_HEADS: usize = 16;
pub const VALUE_HEADS: usize = 32;
/// dk = dv = 128.
pub const HEAD_DIM: usize = 128;
pub const KEY_DIM: usize = KEY_HEADS * HEAD_DIM;
pub const VALUE_DIM: usize = VALUE_HEADS * HEAD_DIM;
/// q ‖ k ‖ v channels of the conv.
pub const CONV_DIM: usize = 2 * KEY_DIM + VALUE_DIM;
pub const CONV_KERNEL: usize = 4;
/// Width of the fused projection output qkv ‖ z ‖ b ‖ a (see `GdnInputs::fused`).
pub const PROJ_DIM: usize = CONV_DIM + VALUE_DIM + 2 * VALUE_HEADS;
/// fp32 values of one sequence's recurrent state in one layer.
pub const SSM_STATE_LEN: usize = VALUE_HEADS * HEAD_DIM * HEAD_DIM;
/// bf16 values of one sequence's conv state in one layer.
pub const CONV_STATE_LEN: usize = (CONV_KERNEL - 1) * CONV_DIM;
/// Prefill chunk length (CHUNK in gdn.cu).
pub const CHUNK: usize = 64;

// Launch shapes, as in gdn.cu.
const DEC_THREADS: u32 = 128;
const DEC_BLOCKS: u32 = (VALUE_HEADS * HEAD_DIM / 32) as u32; // one per (value head, 32 dv columns)
const PF_THREADS: u32 = 256;
const ST_COLS: usize = 32;
const PITCH: usize = 132;
const LPITCH: usize = 68;
const VPITCH: usize = 136;
const SPITCH: usize = 40;
const XPITCH: usize = 24;
/// gdn_prefill_qk: two buffers of a chunk's 67 input rows of q ‖ k (256 bf16 each).
const QK_SMEM: usize = 2 * (CHUNK + 3) * 256 * 2;
/// gdn_prefill_qk's blocks per key head: each walks every QK_GROUPS-th chunk, copying the next
/// one's rows while it computes this one. 16 × 16 blocks fill the 132 SMs twice.
const QK_GROUPS: u32 = 16;
const PREP_SMEM: usize = (2 * CHUNK * PITCH + CHUNK * LPITCH + 2 * CHUNK) * 4;
/// gdn_prefill_state: slack to align to 1024 bytes, Sᵀ and Vnᵀ split for its products (hi and lo
/// parts), two buffers of W, k, U and G, K̃'s row factors, W·S's halves exchanged.
const STATE_SMEM: usize = 1024
    + 2 * ST_COLS * (HEAD_DIM + CHUNK) * 4
    + (2 * (CHUNK * PITCH + CHUNK * VPITCH + CHUNK * SPITCH + CHUNK) + CHUNK + 2 * CHUNK * XPITCH)
        * 4;
/// gdn_prefill_out: slack to align to 1024 bytes, a slab of Vnᵀ or Sᵀ split (hi and lo parts of 128
/// rows × 32 values), q, k then A, G.
const OUT_SMEM: usize = 1024 + 2 * HEAD_DIM * 32 * 4 + (CHUNK * PITCH + CHUNK * VPITCH + CHUNK) * 4;

/// Checks that a model's GDN layers have the shapes these kernels are compiled for.
pub fn check_config(c: &ModelConfig) -> Result<()> {
    let found = [
        ("linear_num_key_heads", c.linear_num_key_heads, KEY_HEADS),
        (
            "linear_num_value_heads",
            c.linear_num_value_heads,
            VALUE_HEADS,
        ),
        ("linear_key_head_dim", c.linear_key_head_dim, HEAD_DIM),
        ("linear_value_head_dim", c.linear_value_head_dim, HEAD_DIM),
        (
            "linear_conv_kernel_dim",
            c.linear_conv_kernel_dim,
            CONV_KERNEL,
        ),
    ];
    for (name, have, want) in found {
        ensure!(
            have == want,
            "gdn kernels are built for {name} = {want}, the model has {have}"
        );
    }
    Ok(())
}

/// One GDN layer's small weights, as the kernels take them (fp32, converted once at load time).
pub struct GdnWeights<'a> {
    /// `[8192][4]` depthwise conv taps (the checkpoint's `conv1d.weight` `[8192, 1, 4]`); tap 3
    /// multiplies the current token.
    pub conv_w: CudaView<'a, f32>,
    /// `[32]`, as stored (the kernels compute −exp(A_log)).
    pub a_log: CudaView<'a, f32>,
    /// `[32]`.
    pub dt_bias: CudaView<'a, f32>,
    /// `[128]` gated-norm weight, plain (this norm is not zero-centred).
    pub norm_w: CudaView<'a, f32>,
    /// The gated norm's epsilon (`rms_norm_eps`).
    pub eps: f32,
}

/// `rows` rows of a bf16 matrix inside a buffer: row r starts at element `r · stride`.
pub struct Rows<'a> {
    pub data: CudaView<'a, bf16>,
    pub stride: usize,
}

/// The input projections' outputs for a number of rows (tokens or sequences):
/// qkv `[8192]`, z `[4096]`, b `[32]`, a `[32]` per row.
pub struct GdnInputs<'a> {
    pub qkv: Rows<'a>,
    pub z: Rows<'a>,
    pub b: Rows<'a>,
    pub a: Rows<'a>,
}

impl<'a> GdnInputs<'a> {
    /// The four inputs inside one fused projection output `[rows][stride]`, each row laid out
    /// qkv ‖ z ‖ b ‖ a (the concatenated `in_proj_qkv ‖ in_proj_z ‖ in_proj_b ‖ in_proj_a`), with
    /// `stride` ≥ `PROJ_DIM`.
    pub fn fused(proj: &CudaView<'a, bf16>, stride: usize) -> Result<Self> {
        ensure!(
            stride >= PROJ_DIM,
            "gdn: fused projection rows of {stride} values, need at least {PROJ_DIM}"
        );
        ensure!(
            proj.len() >= PROJ_DIM,
            "gdn: fused projection buffer of {} values is shorter than one row",
            proj.len()
        );
        let part = |start: usize| Rows {
            data: proj.slice(start..),
            stride,
        };
        Ok(Self {
            qkv: part(0),
            z: part(CONV_DIM),
            b: part(CONV_DIM + VALUE_DIM),
            a: part(CONV_DIM + VALUE_DIM + VALUE_HEADS),
        })
    }
}

/// Scratch of the chunked prefill, sized for chunks of up to `max_tokens` tokens:
/// W and U/Vn (`[chunks][32][64][128]` fp32 each), the state at each chunk start
/// (`[chunks][32][128][128]` fp32), the normalised q and k (`[chunks][16][64][128]` fp32 each),
/// β and G (`[chunks][32][64]`) — about 80 KiB per token (321 MiB for 4096 tokens). Allocate
/// once; it is filled with NaNs so that a read of anything not written first would show in the
/// outputs.
pub struct GdnWorkspace {
    w: CudaSlice<f32>,
    u: CudaSlice<f32>,
    h: CudaSlice<f32>,
    q_norm: CudaSlice<f32>,
    k_norm: CudaSlice<f32>,
    beta: CudaSlice<f32>,
    g: CudaSlice<f32>,
    max_tokens: usize,
}

impl GdnWorkspace {
    pub fn new(stream: &Arc<CudaStream>, max_tokens: usize) -> Result<Self> {
        ensure!(max_tokens > 0, "gdn workspace: max_tokens must be positive");
        let chunks = max_tokens.div_ceil(CHUNK);
        let alloc = |n: usize| -> Result<CudaSlice<f32>> {
            // SAFETY: filled right below, before any use.
            let mut buf = unsafe { stream.alloc::<f32>(n) }
                .during(|| format!("allocating {n} floats of gdn workspace"))?;
            let (ptr, _g) = buf.device_ptr_mut(stream);
            // SAFETY: `ptr` is the start of `buf`, which holds exactly n · 4 bytes.
            unsafe {
                cudarc::driver::result::memset_d8_async(ptr, 0xff, n * 4, stream.cu_stream())
            }
            .during(|| "filling gdn workspace".into())?;
            drop(_g);
            Ok(buf)
        };
        let tile = chunks * VALUE_HEADS * CHUNK * HEAD_DIM;
        let key_tile = chunks * KEY_HEADS * CHUNK * HEAD_DIM;
        Ok(Self {
            w: alloc(tile)?,
            u: alloc(tile)?,
            h: alloc(chunks * SSM_STATE_LEN)?,
            q_norm: alloc(key_tile)?,
            k_norm: alloc(key_tile)?,
            beta: alloc(chunks * VALUE_HEADS * CHUNK)?,
            g: alloc(chunks * VALUE_HEADS * CHUNK)?,
            max_tokens,
        })
    }

    /// Device bytes a workspace for `max_tokens` tokens takes.
    pub fn bytes(max_tokens: usize) -> usize {
        let chunks = max_tokens.div_ceil(CHUNK);
        4 * chunks
            * (2 * VALUE_HEADS * CHUNK * HEAD_DIM
                + SSM_STATE_LEN
                + 2 * KEY_HEADS * CHUNK * HEAD_DIM
                + 2 * VALUE_HEADS * CHUNK)
    }

    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// Points `args`' workspace fields at these buffers; the guards must live until the launch
    /// is queued.
    fn bind<'a>(&'a mut self, stream: &'a CudaStream, args: &mut GdnArgs) -> [SyncOnDrop<'a>; 7] {
        let (w, gw) = self.w.device_ptr_mut(stream);
        let (u, gu) = self.u.device_ptr_mut(stream);
        let (h, gh) = self.h.device_ptr_mut(stream);
        let (q, gq) = self.q_norm.device_ptr_mut(stream);
        let (kn, gkn) = self.k_norm.device_ptr_mut(stream);
        let (beta, gb) = self.beta.device_ptr_mut(stream);
        let (g, gg) = self.g.device_ptr_mut(stream);
        (args.ws_w, args.ws_u, args.ws_h) = (w, u, h);
        (args.ws_q, args.ws_kn, args.ws_beta, args.ws_g) = (q, kn, beta, g);
        [gw, gu, gh, gq, gkn, gb, gg]
    }
}

/// One sequence's states copied by [`GdnKernels::copy_states`].
pub struct StateCopy<'a> {
    pub ssm_from: CudaView<'a, f32>,
    pub ssm_to: CudaViewMut<'a, f32>,
    pub conv_from: CudaView<'a, bf16>,
    pub conv_to: CudaViewMut<'a, bf16>,
}

/// Kernel arguments, field for field the `GdnArgs` struct of gdn.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct GdnArgs {
    qkv: u64,
    z: u64,
    b: u64,
    a: u64,
    conv_w: u64,
    a_log: u64,
    dt_bias: u64,
    norm_w: u64,
    ssm: u64,
    conv_state: u64,
    slots: u64,
    y: u64,
    ws_w: u64,
    ws_u: u64,
    ws_h: u64,
    ws_q: u64,
    ws_kn: u64,
    ws_beta: u64,
    ws_g: u64,
    qkv_stride: i64,
    z_stride: i64,
    b_stride: i64,
    a_stride: i64,
    rows: i32,
    n_slots: i32,
    eps: f32,
    state_early: i32,
    ssm_rows: u64,
    conv_rows: u64,
}

// SAFETY: plain integers and floats, laid out as the C struct the kernels take by value.
unsafe impl KernelValue for GdnArgs {}

pub struct GdnKernels {
    stream: Arc<CudaStream>,
    decode: CudaFunction,
    zero: CudaFunction,
    copy_states: CudaFunction,
    qk: CudaFunction,
    prep: CudaFunction,
    state: CudaFunction,
    out: CudaFunction,
    /// The output kernel with its products in plain tf32 (gdn.cu).
    out_tf32: CudaFunction,
    /// Prefill runs `out_tf32` with `LILY_GDN_OUT_TF32=1` (bench/NOTES.md v1.37: the kernel 22 %
    /// faster, prefill @4K +2 %, but errors of up to 5 % of the normalised output, so off).
    use_out_tf32: bool,
    conv_update: CudaFunction,
    /// `decode_in_pass` reads the state before the PDL wait (unless `LILY_EARLY_READS=0`).
    early_state: bool,
    /// Decode of many sequences in two kernels (gdn.cu): conv, norms and gates, then the state.
    decode_prep: CudaFunction,
    decode_state: CudaFunction,
    /// The same two for consecutive tokens of one sequence (`decode_tokens`).
    decode_prep_rows: CudaFunction,
    decode_state_rows: CudaFunction,
    /// The fewest sequences a decode runs as the two kernels (given a workspace to hold their
    /// intermediates); `LILY_GDN_SPLIT_ROWS` sets it (0: never).
    split_rows: usize,
}

/// Decodes of this many sequences or more run as two kernels. Below it the second launch costs
/// more than the shorter chain saves (cuda_gdn's timing on the H200, 30 layers in a graph: 2
/// sequences 7.9 µs a layer as one kernel, 8.7 as two; 4: 12.6 and 12.2; 64: 120 and 99).
const SPLIT_ROWS: usize = 4;

impl GdnKernels {
    pub fn load(dev: &CudaDevice) -> Result<Self> {
        // The prefill kernels keep whole 64-row tiles in shared memory: opt in above 48 KB.
        let big = |name: &str, bytes: usize| -> Result<CudaFunction> {
            let f = dev.function("gdn", name)?;
            dev.allow_dynamic_shared(&f, name, bytes)?;
            Ok(f)
        };
        Ok(Self {
            stream: dev.stream().clone(),
            decode: dev.function("gdn", "gdn_decode")?,
            zero: dev.function("gdn", "gdn_zero_state")?,
            copy_states: dev.function("gdn", "gdn_copy_states")?,
            qk: big("gdn_prefill_qk", QK_SMEM)?,
            prep: big("gdn_prefill_prep", PREP_SMEM)?,
            state: big("gdn_prefill_state", STATE_SMEM)?,
            out: big("gdn_prefill_out", OUT_SMEM)?,
            out_tf32: big("gdn_prefill_out_tf32", OUT_SMEM)?,
            use_out_tf32: std::env::var("LILY_GDN_OUT_TF32").is_ok_and(|v| v == "1"),
            conv_update: dev.function("gdn", "gdn_conv_update")?,
            early_state: super::gemm::early_reads(),
            decode_prep: dev.function("gdn", "gdn_decode_prep")?,
            decode_state: dev.function("gdn", "gdn_decode_state")?,
            decode_prep_rows: dev.function("gdn", "gdn_decode_prep_rows")?,
            decode_state_rows: dev.function("gdn", "gdn_decode_state_rows")?,
            split_rows: match std::env::var("LILY_GDN_SPLIT_ROWS") {
                Err(_) => SPLIT_ROWS,
                Ok(v) => match v.parse::<usize>() {
                    Ok(0) => usize::MAX,
                    Ok(n) => n,
                    Err(_) => {
                        return Err(CudaError::Shape(format!(
                            "LILY_GDN_SPLIT_ROWS={v}: expected a count (0: never)"
                        )))
                    }
                },
            },
        })
    }

    /// Sets the fewest sequences a decode runs as two kernels (usize::MAX: never).
    pub fn set_split_rows(&mut self, rows: usize) {
        self.split_rows = rows;
    }

    /// Runs prefill's output kernel with its products in plain tf32 (or in 3xTF32); off unless
    /// `LILY_GDN_OUT_TF32=1`.
    pub fn set_out_tf32(&mut self, on: bool) {
        self.use_out_tf32 = on;
    }

    /// One decode step of one GDN layer for `slots.len()` sequences: sequence i takes row i of
    /// `x`, updates state slot `slots[i]` of the pools `ssm` (`[n_slots][SSM_STATE_LEN]`) and
    /// `conv` (`[n_slots][CONV_STATE_LEN]`), and writes row i of `y` (`[slots.len()][4096]`, the
    /// input of out_proj). A slot id outside `0..n_slots` (read on the device) skips its sequence,
    /// leaving its row of `y` untouched. Two sequences of one launch must not share a slot.
    /// With a workspace for at least `slots.len()` tokens, a batch of many sequences runs as two
    /// kernels that keep their intermediates there (same results, bit for bit).
    #[allow(clippy::too_many_arguments)]
    pub fn decode(
        &self,
        w: &GdnWeights,
        x: &GdnInputs,
        slots: &CudaView<i32>,
        ssm: &mut CudaViewMut<f32>,
        conv: &mut CudaViewMut<bf16>,
        ws: Option<&mut GdnWorkspace>,
        y: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        self.decode_with(w, x, slots, ssm, conv, ws, y, false)
    }

    /// [`Self::decode`] inside a forward pass: the kernel reads the recurrent state (and pulls its
    /// conv state into L1) before its PDL wait, so the reads overlap the previous kernel. Safe
    /// only when no kernel that may still run (PDL lets a kernel start while its predecessors
    /// finish) writes these states, which holds in a pass: the only writers of a layer's states
    /// are that layer's GDN kernels, each sequence's run once per pass, and every pass starts
    /// after host copies (slots, token ids), which no kernel overlaps. Two decodes of the same
    /// layer back to back (as the kernel tests do) would race: they use [`Self::decode`].
    #[allow(clippy::too_many_arguments)]
    pub fn decode_in_pass(
        &self,
        w: &GdnWeights,
        x: &GdnInputs,
        slots: &CudaView<i32>,
        ssm: &mut CudaViewMut<f32>,
        conv: &mut CudaViewMut<bf16>,
        ws: Option<&mut GdnWorkspace>,
        y: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        self.decode_with(w, x, slots, ssm, conv, ws, y, self.early_state)
    }

    #[allow(clippy::too_many_arguments)]
    fn decode_with(
        &self,
        w: &GdnWeights,
        x: &GdnInputs,
        slots: &CudaView<i32>,
        ssm: &mut CudaViewMut<f32>,
        conv: &mut CudaViewMut<bf16>,
        ws: Option<&mut GdnWorkspace>,
        y: &mut CudaViewMut<bf16>,
        state_early: bool,
    ) -> Result<()> {
        let batch = slots.len();
        ensure!(
            batch <= 65535,
            "gdn decode: {batch} sequences; one launch takes at most 65535"
        );
        let n_slots = check_pools("gdn decode", &self.stream, ssm, conv)?;
        ensure!(
            y.len() == batch * VALUE_DIM,
            "gdn decode: y has {} values, expected {batch}×{VALUE_DIM}",
            y.len()
        );
        ensure_aligned(y, &self.stream, "gdn y")?;
        if batch == 0 {
            return Ok(());
        }
        let stream = &*self.stream;
        let mut guards = Vec::new();
        let mut args = self.common_args(w, x, batch, &mut guards)?;
        args.slots = addr(slots, stream, &mut guards);
        let (ssm_ptr, _s) = ssm.device_ptr_mut(stream);
        let (conv_ptr, _c) = conv.device_ptr_mut(stream);
        let (y_ptr, _y) = y.device_ptr_mut(stream);
        args.ssm = ssm_ptr;
        args.conv_state = conv_ptr;
        args.y = y_ptr;
        args.n_slots = as_i32(n_slots, "gdn decode n_slots")?;
        args.state_early = i32::from(state_early);
        let cfg = LaunchConfig {
            grid_dim: (DEC_BLOCKS, batch as u32, 1),
            block_dim: (DEC_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let ws = ws.filter(|ws| batch >= self.split_rows && batch <= ws.max_tokens);
        let Some(ws) = ws else {
            // SAFETY: the checks above and in common_args bound every index the kernel forms;
            // slot ids are range-checked on the device.
            return unsafe { launch!(self.stream, &self.decode, cfg, &args) };
        };
        // The intermediates, [batch][heads][128] or [batch][heads] each (gdn.cu), fit in the
        // prefill's buffers of max_tokens ≥ batch tokens.
        let _ws = ws.bind(stream, &mut args);
        let prep = LaunchConfig {
            grid_dim: (KEY_HEADS as u32, batch as u32, 1),
            ..cfg
        };
        // SAFETY: as above; the workspace holds batch ≤ max_tokens tokens' intermediates.
        unsafe {
            launch!(self.stream, &self.decode_prep, prep, &args)?;
            launch!(self.stream, &self.decode_state, cfg, &args)
        }
    }

    /// Prefill of `tokens` tokens of one sequence through one GDN layer: rows 0..tokens of `x`,
    /// the sequence's state `ssm` (`SSM_STATE_LEN`) and `conv` (`CONV_STATE_LEN`) updated in place,
    /// `y` (`[tokens][4096]`) the input of out_proj. Four launches, all on the stream.
    #[allow(clippy::too_many_arguments)]
    pub fn prefill(
        &self,
        w: &GdnWeights,
        x: &GdnInputs,
        tokens: usize,
        ssm: &mut CudaViewMut<f32>,
        conv: &mut CudaViewMut<bf16>,
        ws: &mut GdnWorkspace,
        y: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        self.check_one_sequence("gdn prefill", tokens, ssm, conv, ws, y)?;
        if tokens == 0 {
            return Ok(());
        }
        let stream = &*self.stream;
        let mut guards = Vec::new();
        let mut args = self.common_args(w, x, tokens, &mut guards)?;
        let (ssm_ptr, _s) = ssm.device_ptr_mut(stream);
        let (conv_ptr, _c) = conv.device_ptr_mut(stream);
        let (y_ptr, _y) = y.device_ptr_mut(stream);
        let _ws = ws.bind(stream, &mut args);
        args.ssm = ssm_ptr;
        args.conv_state = conv_ptr;
        args.y = y_ptr;
        // `slots` stays null: gdn_conv_update would take the state of slot slots[0].
        args.n_slots = 1;

        let chunks = tokens.div_ceil(CHUNK) as u32;
        let heads = VALUE_HEADS as u32;
        let block = (PF_THREADS, 1, 1);
        let qk = LaunchConfig {
            // as many chunks for every block of a head: 64 chunks are 16 blocks of 4, 40 are 14 of ≤ 3
            grid_dim: (
                chunks.div_ceil(chunks.div_ceil(QK_GROUPS)),
                KEY_HEADS as u32,
                1,
            ),
            block_dim: block,
            shared_mem_bytes: QK_SMEM as u32,
        };
        let prep = LaunchConfig {
            grid_dim: (chunks, heads, 1),
            block_dim: block,
            shared_mem_bytes: PREP_SMEM as u32,
        };
        let state = LaunchConfig {
            grid_dim: ((HEAD_DIM / ST_COLS) as u32, heads, 1),
            block_dim: block,
            shared_mem_bytes: STATE_SMEM as u32,
        };
        let out = LaunchConfig {
            grid_dim: (chunks, heads, 1),
            block_dim: block,
            shared_mem_bytes: OUT_SMEM as u32,
        };
        let conv_update = LaunchConfig {
            grid_dim: ((CONV_DIM / 8) as u32 / PF_THREADS, 1, 1),
            block_dim: block,
            shared_mem_bytes: 0,
        };
        // SAFETY: common_args checked the inputs for `tokens` rows, the state views have exactly
        // one sequence's state, and the workspace holds ceil(tokens / 64) chunks.
        unsafe {
            launch!(self.stream, &self.qk, qk, &args)?;
            launch!(self.stream, &self.prep, prep, &args)?;
            launch!(self.stream, &self.state, state, &args)?;
            if self.use_out_tf32 {
                launch!(self.stream, &self.out_tf32, out, &args)?;
            } else {
                launch!(self.stream, &self.out, out, &args)?;
            }
            // Last: the kernels above read the old conv state.
            launch!(self.stream, &self.conv_update, conv_update, &args)
        }
    }

    /// `tokens` consecutive tokens of one sequence through one GDN layer as decode steps, one
    /// after another: the arguments as [`Self::prefill`]'s, each row of `y` (and the state after
    /// the last) bit for bit what `tokens` one-token [`Self::decode`] steps give — where the
    /// chunked prefill rounds differently. For a verify pass's few rows (forward/mtp.rs), where
    /// prefill's 64-row chunks would be mostly padding: three launches (conv, norms and gates of
    /// every row at once; the state stepped over the rows in order; the conv state's shift). The
    /// workspace holds the rows' intermediates. With `each_row`, the states after each row but
    /// the last are also written there, `[tokens − 1][SSM_STATE_LEN]` and `[tokens − 1]
    /// [CONV_STATE_LEN]` (the verify pass's, so that keeping fewer rows copies a state back).
    #[allow(clippy::too_many_arguments)]
    pub fn decode_tokens(
        &self,
        w: &GdnWeights,
        x: &GdnInputs,
        tokens: usize,
        ssm: &mut CudaViewMut<f32>,
        conv: &mut CudaViewMut<bf16>,
        each_row: Option<(&mut CudaViewMut<f32>, &mut CudaViewMut<bf16>)>,
        ws: &mut GdnWorkspace,
        y: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        self.check_one_sequence("gdn decode_tokens", tokens, ssm, conv, ws, y)?;
        self.decode_tokens_with(w, x, tokens, None, ssm, conv, each_row, ws, y)
    }

    /// [`Self::decode_tokens`] on the state of slot `slots[0]` (read on the device, so that a
    /// captured graph serves any slot; out of range: nothing is written) of the pools `ssm`
    /// (`[n_slots][SSM_STATE_LEN]`) and `conv` (`[n_slots][CONV_STATE_LEN]`).
    #[allow(clippy::too_many_arguments)]
    pub fn decode_tokens_in_slot(
        &self,
        w: &GdnWeights,
        x: &GdnInputs,
        tokens: usize,
        slots: &CudaView<i32>,
        ssm: &mut CudaViewMut<f32>,
        conv: &mut CudaViewMut<bf16>,
        each_row: Option<(&mut CudaViewMut<f32>, &mut CudaViewMut<bf16>)>,
        ws: &mut GdnWorkspace,
        y: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        let what = "gdn decode_tokens_in_slot";
        check_pools(what, &self.stream, ssm, conv)?;
        ensure!(!slots.is_empty(), "{what}: no slot given");
        self.check_rows(what, tokens, ws, y)?;
        self.decode_tokens_with(w, x, tokens, Some(slots), ssm, conv, each_row, ws, y)
    }

    /// The launches of [`Self::decode_tokens`]: the state is `ssm` / `conv` (one sequence's), or
    /// with `slots` that of slot `slots[0]` of those pools (the arguments checked by the caller).
    #[allow(clippy::too_many_arguments)]
    fn decode_tokens_with(
        &self,
        w: &GdnWeights,
        x: &GdnInputs,
        tokens: usize,
        slots: Option<&CudaView<i32>>,
        ssm: &mut CudaViewMut<f32>,
        conv: &mut CudaViewMut<bf16>,
        each_row: Option<(&mut CudaViewMut<f32>, &mut CudaViewMut<bf16>)>,
        ws: &mut GdnWorkspace,
        y: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        ensure!(
            tokens <= 65535,
            "gdn decode_tokens: {tokens} tokens; one launch takes at most 65535"
        );
        if tokens == 0 {
            return Ok(());
        }
        let n_slots = as_i32(ssm.len() / SSM_STATE_LEN, "gdn decode_tokens n_slots")?;
        let stream = &*self.stream;
        let mut guards = Vec::new();
        let mut args = self.common_args(w, x, tokens, &mut guards)?;
        let (ssm_ptr, _s) = ssm.device_ptr_mut(stream);
        let (conv_ptr, _c) = conv.device_ptr_mut(stream);
        let (y_ptr, _y) = y.device_ptr_mut(stream);
        let _ws = ws.bind(stream, &mut args);
        args.ssm = ssm_ptr;
        args.conv_state = conv_ptr;
        args.y = y_ptr;
        args.n_slots = n_slots;
        if let Some(slots) = slots {
            args.slots = addr(slots, stream, &mut guards);
        }
        args.state_early = 0;
        let mut _rows = None;
        if let Some((ssm_rows, conv_rows)) = each_row {
            let n = tokens - 1;
            ensure!(
                ssm_rows.len() == n * SSM_STATE_LEN && conv_rows.len() == n * CONV_STATE_LEN,
                "gdn decode_tokens: the states after {n} rows are {} + {} values, got {} + {}",
                n * SSM_STATE_LEN,
                n * CONV_STATE_LEN,
                ssm_rows.len(),
                conv_rows.len()
            );
            ensure_aligned(ssm_rows, stream, "gdn states after each row")?;
            ensure_aligned(conv_rows, stream, "gdn conv states after each row")?;
            let (s, sg) = ssm_rows.device_ptr_mut(stream);
            let (c, cg) = conv_rows.device_ptr_mut(stream);
            (args.ssm_rows, args.conv_rows) = (s, c);
            _rows = Some((sg, cg));
        }
        let prep = LaunchConfig {
            grid_dim: (KEY_HEADS as u32, tokens as u32, 1),
            block_dim: (DEC_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let state = LaunchConfig {
            grid_dim: (DEC_BLOCKS, 1, 1),
            ..prep
        };
        let conv_update = LaunchConfig {
            grid_dim: ((CONV_DIM / 8) as u32 / PF_THREADS, 1, 1),
            block_dim: (PF_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: common_args checked the inputs for `tokens` rows, the state views hold exactly
        // one sequence's state, and the workspace holds `tokens` rows' intermediates ([tokens]
        // [heads][128] or [tokens][heads] each, within its chunks' buffers).
        unsafe {
            launch!(self.stream, &self.decode_prep_rows, prep, &args)?;
            launch!(self.stream, &self.decode_state_rows, state, &args)?;
            // Last: the conv above reads the old conv state.
            launch!(self.stream, &self.conv_update, conv_update, &args)
        }
    }

    /// The checks of a pass over `tokens` tokens of one sequence (prefill, decode_tokens): its
    /// states, the workspace's room and the output's size.
    fn check_one_sequence(
        &self,
        what: &str,
        tokens: usize,
        ssm: &CudaViewMut<f32>,
        conv: &CudaViewMut<bf16>,
        ws: &GdnWorkspace,
        y: &CudaViewMut<bf16>,
    ) -> Result<()> {
        ensure!(
            ssm.len() == SSM_STATE_LEN && conv.len() == CONV_STATE_LEN,
            "{what}: the state of one sequence is {SSM_STATE_LEN} + {CONV_STATE_LEN} values, got {} + {}",
            ssm.len(),
            conv.len()
        );
        ensure_aligned(ssm, &self.stream, "gdn ssm state")?;
        ensure_aligned(conv, &self.stream, "gdn conv state")?;
        self.check_rows(what, tokens, ws, y)
    }

    /// The checks of `tokens` rows of one sequence: the workspace's room and the output's size.
    fn check_rows(
        &self,
        what: &str,
        tokens: usize,
        ws: &GdnWorkspace,
        y: &CudaViewMut<bf16>,
    ) -> Result<()> {
        ensure!(
            tokens <= ws.max_tokens,
            "{what}: {tokens} tokens, the workspace holds {}",
            ws.max_tokens
        );
        ensure!(
            y.len() == tokens * VALUE_DIM,
            "{what}: y has {} values, expected {tokens}×{VALUE_DIM}",
            y.len()
        );
        ensure_aligned(y, &self.stream, "gdn y")
    }

    /// Zeroes states in the pools `ssm` (`[n_slots][SSM_STATE_LEN]`) and `conv`
    /// (`[n_slots][CONV_STATE_LEN]`): the slots listed in `slots` (read on the device; ids outside
    /// `0..n_slots` are skipped), or every slot when `slots` is None. A new sequence starts from zeros.
    pub fn zero(
        &self,
        ssm: &mut CudaViewMut<f32>,
        conv: &mut CudaViewMut<bf16>,
        slots: Option<&CudaView<i32>>,
    ) -> Result<()> {
        let n_slots = check_pools("gdn zero", &self.stream, ssm, conv)?;
        let count = slots.map_or(n_slots, |s| s.len());
        ensure!(
            count <= 65535,
            "gdn zero: {count} slots; one launch takes at most 65535"
        );
        if count == 0 {
            return Ok(());
        }
        let stream = &*self.stream;
        let mut guards = Vec::new();
        let mut args = GdnArgs {
            n_slots: as_i32(n_slots, "gdn zero n_slots")?,
            ..Default::default()
        };
        args.slots = slots.map_or(0, |s| addr(s, stream, &mut guards));
        let (ssm_ptr, _s) = ssm.device_ptr_mut(stream);
        let (conv_ptr, _c) = conv.device_ptr_mut(stream);
        args.ssm = ssm_ptr;
        args.conv_state = conv_ptr;
        // 64 blocks of 256 threads per slot: 8 float4 stores each for the 2 MiB state.
        let cfg = LaunchConfig {
            grid_dim: (64, count as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: check_pools checked whole slots; slot ids are range-checked on the device.
        unsafe { launch!(self.stream, &self.zero, cfg, &args) }
    }

    /// Copies whole states of one sequence, `(recurrent from, to, conv from, to)` each, in one
    /// launch; `table` (4 entries a copy) is the device scratch for their addresses.
    pub fn copy_states(&self, copies: &mut [StateCopy], table: &mut CudaSlice<u64>) -> Result<()> {
        ensure!(
            copies.len() <= 65535 && 4 * copies.len() <= table.len(),
            "gdn copy_states: {} copies, a table of {} addresses",
            copies.len(),
            table.len()
        );
        if copies.is_empty() {
            return Ok(());
        }
        let n = copies.len();
        let stream = &*self.stream;
        let mut guards = Vec::new();
        let mut addresses = Vec::with_capacity(4 * n);
        for c in copies.iter_mut() {
            ensure!(
                c.ssm_from.len() == SSM_STATE_LEN
                    && c.ssm_to.len() == SSM_STATE_LEN
                    && c.conv_from.len() == CONV_STATE_LEN
                    && c.conv_to.len() == CONV_STATE_LEN,
                "gdn copy_states: a copy is of one sequence's states"
            );
            ensure_aligned(&c.ssm_from, stream, "gdn ssm state")?;
            ensure_aligned(&c.ssm_to, stream, "gdn ssm state")?;
            ensure_aligned(&c.conv_from, stream, "gdn conv state")?;
            ensure_aligned(&c.conv_to, stream, "gdn conv state")?;
            addresses.push(addr(&c.ssm_from, stream, &mut guards));
            let (to, g) = c.ssm_to.device_ptr_mut(stream);
            guards.push(g);
            addresses.push(to);
            addresses.push(addr(&c.conv_from, stream, &mut guards));
            let (to, g) = c.conv_to.device_ptr_mut(stream);
            guards.push(g);
            addresses.push(to);
        }
        self.stream
            .memcpy_htod(&addresses, &mut table.slice_mut(..addresses.len()))
            .during(|| "copying the states' addresses".into())?;
        let cfg = LaunchConfig {
            grid_dim: (64, n as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: every address is a whole, aligned state of one sequence (checked above), held
        // by its guard until the launch is enqueued.
        unsafe {
            launch!(
                self.stream,
                &self.copy_states,
                cfg,
                &table.slice(..addresses.len())
            )
        }
    }

    /// The argument fields shared by decode and prefill: inputs for `rows` rows and the weights,
    /// after checking their sizes and alignment.
    fn common_args<'s>(
        &'s self,
        w: &'s GdnWeights,
        x: &'s GdnInputs,
        rows: usize,
        guards: &mut Vec<SyncOnDrop<'s>>,
    ) -> Result<GdnArgs> {
        let stream = &*self.stream;
        // (input, width, needs 16-byte rows): qkv and z are read as vectors, b and a as scalars.
        for (name, r, width, vector) in [
            ("qkv", &x.qkv, CONV_DIM, true),
            ("z", &x.z, VALUE_DIM, true),
            ("b", &x.b, VALUE_HEADS, false),
            ("a", &x.a, VALUE_HEADS, false),
        ] {
            ensure!(
                r.stride >= width,
                "gdn: {name} rows of stride {} are narrower than {width}",
                r.stride
            );
            let need = (rows - 1) * r.stride + width;
            ensure!(
                r.data.len() >= need,
                "gdn: {name} has {} values, {rows} rows need {need}",
                r.data.len()
            );
            if vector {
                ensure!(
                    r.stride % 8 == 0,
                    "gdn: {name} stride {} must be a multiple of 8",
                    r.stride
                );
                ensure_aligned(&r.data, stream, name)?;
            }
        }
        for (name, v, len) in [
            ("conv_w", &w.conv_w, CONV_DIM * CONV_KERNEL),
            ("a_log", &w.a_log, VALUE_HEADS),
            ("dt_bias", &w.dt_bias, VALUE_HEADS),
            ("norm_w", &w.norm_w, HEAD_DIM),
        ] {
            ensure!(
                v.len() == len,
                "gdn: {name} has {} values, expected {len}",
                v.len()
            );
            ensure_aligned(v, stream, name)?;
        }
        let stride = |r: &Rows| r.stride as i64;
        Ok(GdnArgs {
            qkv: addr(&x.qkv.data, stream, guards),
            z: addr(&x.z.data, stream, guards),
            b: addr(&x.b.data, stream, guards),
            a: addr(&x.a.data, stream, guards),
            conv_w: addr(&w.conv_w, stream, guards),
            a_log: addr(&w.a_log, stream, guards),
            dt_bias: addr(&w.dt_bias, stream, guards),
            norm_w: addr(&w.norm_w, stream, guards),
            qkv_stride: stride(&x.qkv),
            z_stride: stride(&x.z),
            b_stride: stride(&x.b),
            a_stride: stride(&x.a),
            rows: as_i32(rows, "gdn rows")?,
            eps: w.eps,
            ..Default::default()
        })
    }
}

/// Checks a pair of state pools (whole slots, the same count, aligned); returns the slot count.
fn check_pools(
    op: &str,
    stream: &CudaStream,
    ssm: &CudaViewMut<f32>,
    conv: &CudaViewMut<bf16>,
) -> Result<usize> {
    let n_slots = ssm.len() / SSM_STATE_LEN;
    ensure!(
        n_slots > 0 && ssm.len() == n_slots * SSM_STATE_LEN && conv.len() == n_slots * CONV_STATE_LEN,
        "{op}: state pools of {} + {} values are not whole slots of {SSM_STATE_LEN} + {CONV_STATE_LEN}",
        ssm.len(),
        conv.len()
    );
    ensure_aligned(ssm, stream, "gdn ssm state")?;
    ensure_aligned(conv, stream, "gdn conv state")?;
    Ok(n_slots)
}
