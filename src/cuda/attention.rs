//! Gated full attention on the GPU (attention.cu; spec/MODEL.md §3.4-3.5): q/k RMSNorm, partial
//! RoPE, the KV cache, causal attention with GQA and the sigmoid output gate, for the 10
//! full-attention layers of Qwen3.6-35B-A3B (16 query heads, 2 KV heads, head_dim 256, 64 rotary
//! dims). bf16 activations, fp32 math.
//!
//! Per layer the forward pass calls one of
//! * [`AttentionKernels::prefill`]: `T` new tokens of one sequence (a prefill chunk) at positions
//!   `start ..`; earlier chunks are already in the cache and visible;
//! * [`AttentionKernels::decode`]: one new token for each of `B` sequences, with slots and
//!   positions read from device memory, so the same launches can be captured in a CUDA graph and
//!   replayed at every step.
//!
//! Both take `qkv`, the fused projection `q(+gate)‖k‖v` per token ([`QKV_WIDTH`] values: q_proj's
//! output, 16 heads × [query 256 ‖ gate 256], then k 2 × 256, then v 2 × 256), append the new keys
//! and values to the cache, and write `[tokens][4096]`, the input of o_proj (the gated output).
//!
//! Decode is split-KV (flash-decoding): the cached keys of a sequence are cut into chunks that
//! fill the GPU (see [`AttentionKernels::decode_splits`]), each chunk is attended by one block,
//! and a second kernel merges the chunks. Prefill splits the keys the same way when its chunk is
//! too short to fill the GPU by itself (see [`AttentionKernels::prefill_split`]). Long prefill
//! chunks can run on Hopper's warpgroup products instead (attention_wgmma.cu, [`PrefillKernel`]),
//! split over the keys too where whole blocks would leave the GPU's last wave mostly idle (a
//! conversation's turn after a long cached prefix; `wgmma_split`).

use std::cell::Cell;
use std::sync::Arc;

use cudarc::driver::{sys, DevicePtrMut, LaunchConfig, SyncOnDrop};
use half::bf16;

use super::pdl::KernelValue;
use super::{
    as_i32, ensure, ensure_aligned, launch, Context, CudaDevice, CudaFunction, CudaSlice,
    CudaStream, CudaView, CudaViewMut, Result,
};
use crate::config::ModelConfig;

mod wgmma_split;

pub const HEAD_DIM: usize = 256;
pub const Q_HEADS: usize = 16;
pub const KV_HEADS: usize = 2;
pub const ROTARY_DIM: usize = 64;
/// Values per token of the fused projection `q(+gate)‖k‖v`.
pub const QKV_WIDTH: usize = Q_HEADS * 2 * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM;
/// Values per token of the output, the input of o_proj.
pub const OUT_WIDTH: usize = Q_HEADS * HEAD_DIM;

// Launch shapes; each must match the #define of the same name in attention.cu.
const PREP_UNITS: usize = 20;
const PREP_WARPS: usize = 4;
const PF_TOKENS: usize = 8;
const PF_THREADS: usize = 128;
const PF_SMEM_BYTES: usize = 101_376;
const PF_TILE: usize = 32;
/// The fewest keys a split of prefill attention takes (eight tiles); to be tuned.
const PF_MIN_CHUNK: usize = 256;
/// attn_prefill_wgmma's block (attention_wgmma.cu): 16 tokens, two warpgroups, ~193 KB.
const PF_WGMMA_TOKENS: usize = 16;
const PF_WGMMA_THREADS: usize = 256;
const PF_WGMMA_SMEM_BYTES: usize = 197_632;
const DEC_THREADS: usize = 128;
const DEC_TILE: usize = 64;
const DEC_SMEM_BYTES: usize = 202_752;
/// The most key splits one (row, head) can have: attn_combine's thread count.
const MAX_SPLITS: usize = 256;
const COMBINE_THREADS: usize = 256;
/// attn_combine's dims per block: a head's 256 in four blocks.
const COMBINE_DIMS: usize = 64;
/// attn_combine_few: (row, head) entries per block, a warp each; at most FEW_SPLITS splits.
const COMBINE_FEW_ENTRIES: usize = 8;
const _: () = assert!(
    WGMMA_MAX_SPLITS <= 4,
    "attn_combine_few merges up to FEW_SPLITS = 4"
);

/// The KV caches of the attention layers for a pool of `slots` sequences of up to `capacity`
/// tokens each. K and V are separate buffers of bf16 `[slot][layer][kv_head][capacity][256]`:
/// the keys of one (sequence, layer, KV head) are one contiguous run that the kernels stream in
/// tiles. Rows hold keys after q/k-norm and RoPE, values as projected. A paged layout can replace
/// this once the batching scheduler needs it.
pub struct KvCache {
    k: CudaSlice<bf16>,
    v: CudaSlice<bf16>,
    slots: usize,
    layers: usize,
    capacity: usize,
}

/// Kernel argument, field for field the `KvCacheArgs` struct of attention.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct KvCacheArgs {
    k: u64,
    v: u64,
    slots: i32,
    layers: i32,
    layer: i32,
    capacity: i32,
}

// SAFETY: plain integers, laid out as the C struct the kernels take by value.
unsafe impl KernelValue for KvCacheArgs {}

/// Kernel argument: the rotary inverse frequencies (`RopeFreqs` in attention.cu).
#[repr(C)]
#[derive(Clone, Copy)]
struct RopeFreqs {
    inv_freq: [f32; ROTARY_DIM / 2],
}

// SAFETY: plain floats, laid out as the C struct.
unsafe impl KernelValue for RopeFreqs {}

impl KvCache {
    /// Allocates (zeroed) caches for `layers` attention layers of `slots` sequences.
    pub fn new(
        stream: &Arc<CudaStream>,
        slots: usize,
        layers: usize,
        capacity: usize,
    ) -> Result<Self> {
        ensure!(
            slots > 0 && layers > 0 && capacity > 0,
            "KvCache: slots, layers and capacity must be positive"
        );
        // The kernels take these as int.
        as_i32(slots, "KvCache slots")?;
        as_i32(layers, "KvCache layers")?;
        as_i32(capacity, "KvCache capacity")?;
        let n = [slots, layers, KV_HEADS, capacity, HEAD_DIM]
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| super::CudaError::Shape("KvCache: size overflows".into()))?;
        let k = stream
            .alloc_zeros::<bf16>(n)
            .during(|| format!("allocating the K cache ({n} values)"))?;
        let v = stream
            .alloc_zeros::<bf16>(n)
            .during(|| format!("allocating the V cache ({n} values)"))?;
        Ok(Self {
            k,
            v,
            slots,
            layers,
            capacity,
        })
    }

    pub fn slots(&self) -> usize {
        self.slots
    }

    pub fn layers(&self) -> usize {
        self.layers
    }

    /// Tokens each sequence can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bytes of K and V per token of one sequence, all layers.
    pub fn bytes_per_token(&self) -> usize {
        2 * self.layers * KV_HEADS * HEAD_DIM * std::mem::size_of::<bf16>()
    }

    /// Index in [`keys`](Self::keys) / [`values`](Self::values) of the first of the 256 values of
    /// token `pos` of (slot, layer, kv_head).
    pub fn offset(&self, slot: usize, layer: usize, kv_head: usize, pos: usize) -> usize {
        (((slot * self.layers + layer) * KV_HEADS + kv_head) * self.capacity + pos) * HEAD_DIM
    }

    /// The whole K buffer (`[slot][layer][kv_head][capacity][256]`).
    pub fn keys(&self) -> &CudaSlice<bf16> {
        &self.k
    }

    pub fn keys_mut(&mut self) -> &mut CudaSlice<bf16> {
        &mut self.k
    }

    pub fn values(&self) -> &CudaSlice<bf16> {
        &self.v
    }

    pub fn values_mut(&mut self) -> &mut CudaSlice<bf16> {
        &mut self.v
    }

    /// The kernels' view of layer `layer`. The guards must outlive the launch.
    fn args<'a>(
        &'a mut self,
        stream: &'a CudaStream,
        layer: usize,
    ) -> (KvCacheArgs, [SyncOnDrop<'a>; 2]) {
        let (k, gk) = self.k.device_ptr_mut(stream);
        let (v, gv) = self.v.device_ptr_mut(stream);
        // The casts are exact: `new` checked slots, layers and capacity, callers check layer < layers.
        let args = KvCacheArgs {
            k,
            v,
            slots: self.slots as i32,
            layers: self.layers as i32,
            layer: layer as i32,
            capacity: self.capacity as i32,
        };
        (args, [gk, gv])
    }
}

/// Scratch memory of the attention kernels, allocated once: the normalised, rotated queries and
/// the partial results of split-KV attention.
pub struct AttentionWorkspace {
    /// `[tokens][16][256]` bf16: the queries attn_prepare writes for the attention kernels.
    q: CudaSlice<bf16>,
    /// Partials of split attention: `[row][16][splits][256]` fp32 sums and `[row][16][splits][2]`
    /// (max, sum), a row being a decode sequence or a prefill token.
    part_o: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
    /// Rows of `q`: the larger of the longest prefill chunk and the largest decode batch.
    q_rows: usize,
    /// (sequence, head, split) entries the partial buffers hold.
    partials: usize,
}

impl AttentionWorkspace {
    /// Scratch for prefill chunks of up to `max_tokens` tokens and decode batches of up to
    /// `max_batch` sequences in caches of up to `max_capacity` tokens per sequence.
    pub fn new(
        kernels: &AttentionKernels,
        max_tokens: usize,
        max_batch: usize,
        max_capacity: usize,
    ) -> Result<Self> {
        ensure!(
            max_tokens > 0 || max_batch > 0,
            "AttentionWorkspace: nothing to hold"
        );
        let q_rows = max_tokens.max(max_batch).max(1);
        // Split counts fall as the rows grow; the product peaks somewhere in between.
        let decode = (1..=max_batch).map(|b| b * kernels.decode_splits(b, max_capacity));
        // (A prefill of one split writes its output directly, without partials.)
        let prefill =
            (1..=max_tokens).map(|t| match kernels.prefill_split_limit(t, max_capacity) {
                1 => 0,
                splits => t * splits,
            });
        // attn_prefill_wgmma's splits take what they may (see `prefill_splits`).
        let wgmma = (max_tokens * WGMMA_MAX_SPLITS).min(WGMMA_SPLIT_ROWS);
        let partials = Q_HEADS
            * decode
                .chain(prefill)
                .chain([wgmma])
                .max()
                .unwrap_or(0)
                .max(1);
        let stream = &kernels.stream;
        let q = stream
            .alloc_zeros::<bf16>(q_rows * Q_HEADS * HEAD_DIM)
            .during(|| "allocating attention queries".into())?;
        let part_o = stream
            .alloc_zeros::<f32>(partials * HEAD_DIM)
            .during(|| "allocating attention partials".into())?;
        let part_ml = stream
            .alloc_zeros::<f32>(partials * 2)
            .during(|| "allocating attention partials".into())?;
        Ok(Self {
            q,
            part_o,
            part_ml,
            q_rows,
            partials,
        })
    }

    /// The queries of the last call, `[tokens][16][256]` bf16 after q-norm and RoPE (for tests).
    pub fn queries(&self) -> &CudaSlice<bf16> {
        &self.q
    }
}

/// Which kernel runs prefill attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillKernel {
    /// attn_prefill (mma.sync), split over the keys when the chunk alone would not fill the GPU.
    MmaSync,
    /// attn_prefill_wgmma (Hopper's warpgroup products, attention_wgmma.cu) for chunks whose
    /// 16-token blocks give every SM one; attn_prefill for shorter ones. The default
    /// (`LILY_ATTN_WGMMA=0` turns it off): 1.8× faster at 32K, bench/NOTES.md v1.35.
    WgmmaForLong,
    /// attn_prefill_wgmma for every chunk, never split over the keys (for tests).
    Wgmma,
    /// attn_prefill_wgmma for every chunk, split over the keys in about this many chunks (for
    /// tests; at most [`WGMMA_MAX_SPLITS`], and fewer where the workspace holds fewer).
    WgmmaSplit(usize),
}

/// The most key splits of attn_prefill_wgmma (see `wgmma_split`).
pub const WGMMA_MAX_SPLITS: usize = wgmma_split::MAX_SPLITS;
/// (token, split) rows the partials of a split attn_prefill_wgmma may take: 8,192 rows of
/// `[16][256]` fp32, 128 MiB. A chunk that fills the GPU's waves badly is a few thousand tokens.
const WGMMA_SPLIT_ROWS: usize = 8192;

/// What `wgmma_split::choose` was asked: (tokens, start, partial rows).
type SplitAsked = (usize, usize, usize);

pub struct AttentionKernels {
    stream: Arc<CudaStream>,
    prepare: CudaFunction,
    prefill: CudaFunction,
    prefill_wgmma: CudaFunction,
    prefill_kernel: PrefillKernel,
    /// attn_prefill_wgmma splits a chunk over the keys where whole blocks would leave the last
    /// wave mostly idle (`wgmma_split`; off with `LILY_ATTN_WGMMA_SPLIT=0`).
    wgmma_splits: bool,
    /// The last `wgmma_split::choose`: ((tokens, start, rows), (splits, chunk)). Every attention
    /// layer of a pass asks the same, and the simulation takes ≈ 20–30 µs of host time.
    last_wgmma_split: Cell<(SplitAsked, (usize, usize))>,
    decode_split: CudaFunction,
    combine: CudaFunction,
    /// attn_combine for the wgmma prefill's few splits (a warp per row and head).
    combine_few: CudaFunction,
    rope: RopeFreqs,
    eps: f32,
    /// 1/√256 · log2(e): the kernels' softmax runs in the log2 domain (exp2).
    scale_log2: f32,
    sm_count: usize,
    /// Decode: the fewest keys per split (a multiple of 64); `LILY_ATTN_MIN_CHUNK` sets it (default
    /// 64: as many splits as fill the GPU), to measure fewer, longer splits at short context.
    min_chunk: i32,
    /// Decode: the split kernel streams its first key tiles before its PDL wait (attention.cu
    /// attn_decode_split; off with `LILY_EARLY_READS=0`).
    early_reads: bool,
}

impl AttentionKernels {
    /// Loads the kernels for `config`, which must have this model's attention shape (the kernels
    /// are specialised to it).
    pub fn load(dev: &CudaDevice, config: &ModelConfig) -> Result<Self> {
        ensure!(
            config.num_attention_heads == Q_HEADS
                && config.num_key_value_heads == KV_HEADS
                && config.head_dim == HEAD_DIM
                && config.rotary_dim == ROTARY_DIM,
            "attention kernels are built for {Q_HEADS} query heads, {KV_HEADS} KV heads, head_dim {HEAD_DIM}, \
             {ROTARY_DIM} rotary dims; the model has {}, {}, {}, {}",
            config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.rotary_dim
        );
        let sm_attr = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
        let sm_count = dev
            .context()
            .attribute(sm_attr)
            .during(|| "multiprocessor count".into())? as usize;
        // Above 48 KB of dynamic shared memory a kernel must opt in.
        let load = |name: &str, smem: usize| -> Result<CudaFunction> {
            let f = dev.function("attention", name)?;
            if smem > 0 {
                dev.allow_dynamic_shared(&f, name, smem)?;
            }
            Ok(f)
        };
        let load_wgmma = |name: &str| -> Result<CudaFunction> {
            let f = dev.function("attention_wgmma", name)?;
            dev.allow_dynamic_shared(&f, name, PF_WGMMA_SMEM_BYTES)?;
            Ok(f)
        };
        // Exactly as the CPU reference (model::cpu::ops::rope_angles): f64, rounded to f32.
        let mut inv_freq = [0f32; ROTARY_DIM / 2];
        for (i, f) in inv_freq.iter_mut().enumerate() {
            *f = (1.0 / config.rope_theta.powf(2.0 * i as f64 / ROTARY_DIM as f64)) as f32;
        }
        Ok(Self {
            stream: dev.stream().clone(),
            prepare: load("attn_prepare", 0)?,
            prefill: load("attn_prefill", PF_SMEM_BYTES)?,
            prefill_wgmma: load_wgmma("attn_prefill_wgmma")?,
            prefill_kernel: if std::env::var("LILY_ATTN_WGMMA").is_ok_and(|v| v == "0") {
                PrefillKernel::MmaSync
            } else {
                PrefillKernel::WgmmaForLong
            },
            wgmma_splits: !std::env::var("LILY_ATTN_WGMMA_SPLIT").is_ok_and(|v| v == "0"),
            last_wgmma_split: Cell::new(((0, 0, 0), (1, 0))),
            decode_split: load("attn_decode_split", DEC_SMEM_BYTES)?,
            combine: load("attn_combine", 0)?,
            combine_few: load("attn_combine_few", 0)?,
            rope: RopeFreqs { inv_freq },
            eps: config.rms_norm_eps,
            scale_log2: (HEAD_DIM as f32).sqrt().recip() * std::f32::consts::LOG2_E,
            sm_count,
            min_chunk: std::env::var("LILY_ATTN_MIN_CHUNK")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .map_or(DEC_TILE, |v| {
                    v.clamp(DEC_TILE, 1 << 20).next_multiple_of(DEC_TILE)
                }) as i32,
            early_reads: super::gemm::early_reads(),
        })
    }

    /// The grid width of split-KV decode for `batch` sequences in caches of `capacity` tokens:
    /// as many (split, KV head, sequence) blocks as give each SM at most one (a block uses
    /// ~200 KB of shared memory, so one fits per SM): one wave, where rounding up left a second
    /// wave of a few blocks (8 sequences: 144 blocks on 132 SMs, bench/NOTES.md v1.75); at
    /// least one split, at most one per 64-key tile of the capacity.
    ///
    /// The kernels then pick the chunk per sequence from its length `len` on the device:
    /// `chunk = ceil(len / splits)` rounded up to a multiple of 64 keys, and `ceil(len / chunk)`
    /// chunks, so a short context uses few blocks and a long one all of them. E.g. on 132 SMs at
    /// batch 1 (66 splits): 4K → 64 chunks of 64 keys, 32K → 64 of 512, 128K → 64 of 2048.
    /// (To be tuned on the H200: a minimum chunk, two blocks per SM.)
    pub fn decode_splits(&self, batch: usize, capacity: usize) -> usize {
        let fill = self.sm_count / (KV_HEADS * batch.max(1));
        fill.min(capacity.div_ceil(DEC_TILE)).clamp(1, MAX_SPLITS)
    }

    /// Sets which kernel runs prefill attention (see [`PrefillKernel`]).
    pub fn set_prefill_kernel(&mut self, kernel: PrefillKernel) {
        self.prefill_kernel = kernel;
    }

    /// Whether a prefill chunk of `tokens` runs on attn_prefill_wgmma.
    fn prefill_on_wgmma(&self, tokens: usize) -> bool {
        match self.prefill_kernel {
            PrefillKernel::MmaSync => false,
            PrefillKernel::Wgmma | PrefillKernel::WgmmaSplit(_) => true,
            PrefillKernel::WgmmaForLong => {
                tokens.div_ceil(PF_WGMMA_TOKENS) * KV_HEADS >= self.sm_count
            }
        }
    }

    /// How prefill attention of `tokens` new tokens over `kv` keys (the last new position + 1)
    /// is split over the keys: `(splits, chunk)`, split z taking keys `z·chunk .. (z+1)·chunk`.
    /// One split (chunk = kv) when the 8-token blocks of both KV heads give every SM one;
    /// otherwise about that many blocks, chunks of at least 256 keys, a multiple of 32. E.g. on
    /// 132 SMs: 5 tokens after 4000 → 16 splits of 256 keys; 64 after 4000 → 9 of 480; 300 → 2;
    /// 4096 → 1. (To be tuned on the H200.)
    pub fn prefill_split(&self, tokens: usize, kv: usize) -> (usize, usize) {
        let splits = self.prefill_split_limit(tokens, kv);
        if splits == 1 {
            return (1, kv);
        }
        let chunk = kv.div_ceil(splits).next_multiple_of(PF_TILE);
        (kv.div_ceil(chunk), chunk)
    }

    /// `(splits, chunk)` of [`Self::prefill`] for a chunk of `tokens` after `start` cached ones,
    /// with `ws`'s partial buffers: attn_prefill's [`Self::prefill_split`], or attn_prefill_wgmma's
    /// `wgmma_split::choose` (whole unless its waves would run mostly idle).
    pub fn prefill_splits(
        &self,
        tokens: usize,
        start: usize,
        ws: &AttentionWorkspace,
    ) -> (usize, usize) {
        let kv = start + tokens;
        if !self.prefill_on_wgmma(tokens) {
            return self.prefill_split(tokens, kv);
        }
        let rows = ws.partials / Q_HEADS;
        match self.prefill_kernel {
            PrefillKernel::WgmmaSplit(n) => {
                let room = rows.min(WGMMA_SPLIT_ROWS) / tokens;
                wgmma_split::chunks(kv, n.min(WGMMA_MAX_SPLITS).min(room).max(1))
            }
            PrefillKernel::WgmmaForLong if self.wgmma_splits => {
                let asked = (tokens, start, rows.min(WGMMA_SPLIT_ROWS));
                let (last, chosen) = self.last_wgmma_split.get();
                if last == asked {
                    return chosen;
                }
                let chosen = wgmma_split::choose(tokens, start, self.sm_count, asked.2);
                self.last_wgmma_split.set((asked, chosen));
                chosen
            }
            _ => (1, kv),
        }
    }

    /// The split count before rounding the chunk, which can only lower it; it grows with `kv`,
    /// so it bounds the splits of any shorter context too (the workspace is sized by it).
    fn prefill_split_limit(&self, tokens: usize, kv: usize) -> usize {
        let blocks = tokens.div_ceil(PF_TOKENS) * KV_HEADS;
        self.sm_count
            .div_ceil(blocks)
            .min(kv.div_ceil(PF_MIN_CHUNK))
            .clamp(1, MAX_SPLITS)
    }

    /// Prefill: `T = qkv.len() / QKV_WIDTH` new tokens of the sequence in `slot`, at positions
    /// `start .. start + T`, for attention layer `layer` (0-based among the cache's layers).
    /// Appends their keys and values to the cache, then attends causally over cache rows
    /// `0 .. start + T` (earlier chunks included) and writes `out` `[T][4096]`.
    /// `q_norm` and `k_norm` are the effective norm weights (1 + stored weight), fp32 `[256]`.
    #[allow(clippy::too_many_arguments)]
    pub fn prefill(
        &self,
        qkv: &CudaView<bf16>,
        q_norm: &CudaView<f32>,
        k_norm: &CudaView<f32>,
        cache: &mut KvCache,
        layer: usize,
        slot: usize,
        start: usize,
        ws: &mut AttentionWorkspace,
        out: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        ensure!(
            !qkv.is_empty() && qkv.len() % QKV_WIDTH == 0,
            "attention prefill: qkv has {} values, not whole tokens of {QKV_WIDTH}",
            qkv.len()
        );
        let t = qkv.len() / QKV_WIDTH;
        ensure!(
            out.len() == t * OUT_WIDTH,
            "attention prefill: out has {} values, expected {t}×{OUT_WIDTH}",
            out.len()
        );
        ensure!(
            t <= ws.q_rows,
            "attention prefill: {t} tokens, the workspace holds {}",
            ws.q_rows
        );
        ensure!(
            layer < cache.layers,
            "attention prefill: layer {layer} of a cache with {} layers",
            cache.layers
        );
        ensure!(
            slot < cache.slots,
            "attention prefill: slot {slot} of a cache with {} slots",
            cache.slots
        );
        ensure!(
            start
                .checked_add(t)
                .is_some_and(|end| end <= cache.capacity),
            "attention prefill: positions {start}..{start}+{t} exceed the cache capacity {}",
            cache.capacity
        );
        let wgmma = self.prefill_on_wgmma(t);
        let (splits, chunk) = self.prefill_splits(t, start, ws);
        ensure!(
            splits == 1 || t * Q_HEADS * splits <= ws.partials,
            "attention prefill: {t} tokens with {splits} key splits need {} partials, the \
             workspace has {} (make it with this cache's capacity)",
            t * Q_HEADS * splits,
            ws.partials
        );
        self.check_common(qkv, q_norm, k_norm, out)?;
        let (rows, slot, start) = (as_i32(t, "tokens")?, slot as i32, start as i32);
        let (splits_i, chunk) = (splits as i32, chunk as i32);

        let stream = &*self.stream;
        let (c, _guards) = cache.args(stream, layer);
        let pf_cfg = LaunchConfig {
            grid_dim: (t.div_ceil(PF_TOKENS) as u32, KV_HEADS as u32, splits as u32),
            block_dim: (PF_THREADS as u32, 1, 1),
            shared_mem_bytes: PF_SMEM_BYTES as u32,
        };
        // SAFETY: the checks above bound every index: t rows of qkv/out/q, positions
        // start..start+t < capacity in slot < slots, layer < layers.
        unsafe {
            launch!(
                stream,
                &self.prepare,
                prepare_config(t),
                qkv,
                q_norm,
                k_norm,
                &self.rope,
                &c,
                &slot,
                &start,
                &mut ws.q,
                &rows,
                &self.eps
            )?;
            if wgmma {
                let cfg = LaunchConfig {
                    grid_dim: (
                        t.div_ceil(PF_WGMMA_TOKENS) as u32,
                        KV_HEADS as u32,
                        splits as u32,
                    ),
                    block_dim: (PF_WGMMA_THREADS as u32, 1, 1),
                    shared_mem_bytes: PF_WGMMA_SMEM_BYTES as u32,
                };
                launch!(
                    stream,
                    &self.prefill_wgmma,
                    cfg,
                    &ws.q,
                    qkv,
                    &c,
                    &slot,
                    &start,
                    &rows,
                    &mut *out,
                    &self.scale_log2,
                    &chunk,
                    &mut ws.part_o,
                    &mut ws.part_ml
                )?;
            } else {
                launch!(
                    stream,
                    &self.prefill,
                    pf_cfg,
                    &ws.q,
                    qkv,
                    &c,
                    &slot,
                    &start,
                    &rows,
                    &mut *out,
                    &self.scale_log2,
                    &chunk,
                    &mut ws.part_o,
                    &mut ws.part_ml
                )?;
            }
            if splits > 1 && wgmma {
                let cfg = LaunchConfig {
                    grid_dim: ((t * Q_HEADS).div_ceil(COMBINE_FEW_ENTRIES) as u32, 1, 1),
                    block_dim: (32 * COMBINE_FEW_ENTRIES as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                launch!(
                    stream,
                    &self.combine_few,
                    cfg,
                    &ws.part_o,
                    &ws.part_ml,
                    qkv,
                    out,
                    &rows,
                    &splits_i,
                    &start,
                    &chunk
                )?;
            } else if splits > 1 {
                let null = 0u64; // no device slots/positions: prefill passes them as scalars
                launch!(
                    stream,
                    &self.combine,
                    combine_config(t),
                    &ws.part_o,
                    &ws.part_ml,
                    qkv,
                    &c,
                    &null,
                    &null,
                    out,
                    &splits_i,
                    &start,
                    &chunk
                )?;
            }
            Ok(())
        }
    }

    /// Decode: one new token for each of `B = slots.len()` sequences, for attention layer
    /// `layer`. Sequence `b` lives in cache slot `slots[b]` and its new token is at position
    /// `positions[b]` (both `[B]` i32 in device memory, read by the kernels: the host can update
    /// them between replays of a captured graph). Appends the new keys and values, attends over
    /// cache rows `0 ..= positions[b]`, and writes `out` `[B][4096]`.
    ///
    /// Slots and positions cannot be checked here: a sequence whose slot or position is out of
    /// range gets no cache write and NaN output (loud, never a stray memory access).
    #[allow(clippy::too_many_arguments)]
    pub fn decode(
        &self,
        qkv: &CudaView<bf16>,
        q_norm: &CudaView<f32>,
        k_norm: &CudaView<f32>,
        cache: &mut KvCache,
        layer: usize,
        slots: &CudaView<i32>,
        positions: &CudaView<i32>,
        ws: &mut AttentionWorkspace,
        out: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        self.decode_with(
            qkv, q_norm, k_norm, cache, layer, slots, positions, ws, out, false,
        )
    }

    /// [`Self::decode`] where the `B` rows are consecutive tokens of one sequence (a verify
    /// pass): row `b` at `positions[b] = positions[0] + b`, all in slot `slots[b] = slots[0]`
    /// (read on the device, so a captured graph serves any slot and position), each row
    /// attending over the rows before it too. One launch as for distinct sequences: the blocks
    /// of a row write the pass's keys that fall in their chunk themselves (the same bytes as
    /// the other rows' blocks write), so none waits for another.
    #[allow(clippy::too_many_arguments)]
    pub fn decode_one_sequence(
        &self,
        qkv: &CudaView<bf16>,
        q_norm: &CudaView<f32>,
        k_norm: &CudaView<f32>,
        cache: &mut KvCache,
        layer: usize,
        slots: &CudaView<i32>,
        positions: &CudaView<i32>,
        ws: &mut AttentionWorkspace,
        out: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        self.decode_with(
            qkv, q_norm, k_norm, cache, layer, slots, positions, ws, out, true,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn decode_with(
        &self,
        qkv: &CudaView<bf16>,
        q_norm: &CudaView<f32>,
        k_norm: &CudaView<f32>,
        cache: &mut KvCache,
        layer: usize,
        slots: &CudaView<i32>,
        positions: &CudaView<i32>,
        ws: &mut AttentionWorkspace,
        out: &mut CudaViewMut<bf16>,
        one_seq: bool,
    ) -> Result<()> {
        let b = slots.len();
        ensure!(
            b > 0 && b <= 65_535,
            "attention decode: batch of {b} sequences (1..=65535)"
        );
        ensure!(
            positions.len() == b,
            "attention decode: {} positions for {b} slots",
            positions.len()
        );
        ensure!(
            qkv.len() == b * QKV_WIDTH,
            "attention decode: qkv has {} values, expected {b}×{QKV_WIDTH}",
            qkv.len()
        );
        ensure!(
            out.len() == b * OUT_WIDTH,
            "attention decode: out has {} values, expected {b}×{OUT_WIDTH}",
            out.len()
        );
        ensure!(
            b <= ws.q_rows,
            "attention decode: batch {b}, the workspace holds {}",
            ws.q_rows
        );
        ensure!(
            layer < cache.layers,
            "attention decode: layer {layer} of a cache with {} layers",
            cache.layers
        );
        let splits = self.decode_splits(b, cache.capacity);
        ensure!(
            b * Q_HEADS * splits <= ws.partials,
            "attention decode: batch {b} with {splits} splits needs {} partials, the workspace has {} \
             (make it with this cache's capacity)",
            b * Q_HEADS * splits,
            ws.partials
        );
        self.check_common(qkv, q_norm, k_norm, out)?;
        let splits_i = splits as i32;

        let stream = &*self.stream;
        let (c, _guards) = cache.args(stream, layer);
        let zero = 0i32;
        let split_cfg = LaunchConfig {
            grid_dim: (splits as u32, KV_HEADS as u32, b as u32),
            block_dim: (DEC_THREADS as u32, 1, 1),
            shared_mem_bytes: DEC_SMEM_BYTES as u32,
        };
        // SAFETY: the checks above bound every host-known index; the kernels check each
        // sequence's slot and position against the cache before using them.
        unsafe {
            launch!(
                stream,
                &self.decode_split,
                split_cfg,
                qkv,
                q_norm,
                k_norm,
                &self.rope,
                &self.eps,
                &mut ws.q,
                &c,
                slots,
                positions,
                &mut ws.part_o,
                &mut ws.part_ml,
                &splits_i,
                &self.scale_log2,
                &self.min_chunk,
                &i32::from(self.early_reads),
                &i32::from(one_seq)
            )?;
            // With positions, attn_combine takes the positions from the device and the chunks from
            // the same rule as the split kernel: `start` is unused, `chunk` is the min chunk.
            launch!(
                stream,
                &self.combine,
                combine_config(b),
                &ws.part_o,
                &ws.part_ml,
                qkv,
                &c,
                slots,
                positions,
                out,
                &splits_i,
                &zero,
                &self.min_chunk
            )
        }
    }

    /// Norm weight lengths and the 16-byte alignment the kernels' vector accesses need.
    fn check_common(
        &self,
        qkv: &CudaView<bf16>,
        q_norm: &CudaView<f32>,
        k_norm: &CudaView<f32>,
        out: &CudaViewMut<bf16>,
    ) -> Result<()> {
        ensure!(
            q_norm.len() == HEAD_DIM && k_norm.len() == HEAD_DIM,
            "attention: q_norm and k_norm need {HEAD_DIM} weights each"
        );
        ensure_aligned(qkv, &self.stream, "attention qkv")?;
        ensure_aligned(q_norm, &self.stream, "attention q_norm")?;
        ensure_aligned(k_norm, &self.stream, "attention k_norm")?;
        ensure_aligned(out, &self.stream, "attention out")
    }
}

/// attn_combine: four blocks per (row, head), 64 of its dims each.
fn combine_config(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            Q_HEADS as u32,
            (HEAD_DIM / COMBINE_DIMS) as u32,
            rows as u32,
        ),
        block_dim: (COMBINE_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// attn_prepare: one warp per (token, head unit), PREP_WARPS warps per block.
fn prepare_config(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((rows * PREP_UNITS).div_ceil(PREP_WARPS) as u32, 1, 1),
        block_dim: (32 * PREP_WARPS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}
