//! The CUDA backend: the forward pass of MODEL.md §3 in terms of the kernels of this module.
//!
//! Activations are bf16 `[tokens][width]` rows, norms and the recurrent state fp32. A call runs
//! one sequence's next tokens: prompts in chunks of up to [`CudaOptions::prefill_chunk`] tokens
//! (chunked GDN, flash attention), single tokens through the decode kernels. A pass can also take
//! the steps of several sequences as rows of one batch: prompt spans, then one decode token each;
//! the projections and experts run over all rows at once, GDN and attention per span and for all
//! decode rows together. Up to 8 rows, the
//! projections and the experts are GEMVs; longer chunks use the tensor-core GEMM for the dense
//! projections and, for the experts, group their (token, slot) pairs by expert on the device and
//! run one grouped GEMM for gate‖up (SwiGLU fused) and one for down. Routing, expert selection
//! and greedy sampling stay on the device; a greedy step brings back one token id.

mod backend;
mod experts;
mod fp8;
mod mtp;
mod projection;
mod residual;

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{sys, CudaGraph, CudaSlice};
use half::bf16;

use super::attention::{AttentionKernels, AttentionWorkspace, KvCache, QKV_WIDTH};
use super::dense::{self, DenseGemm};
use super::embed::EmbedKernels;
use super::gdn::{self, GdnInputs, GdnKernels, GdnWeights, GdnWorkspace};
use super::gemm::{GemvKernels, L2Ahead, NormIn, ResidualOut, MAX_TOKENS, SLOT_WORDS};
use super::gemm_prefill::{GemmKernels, MIN_TILE_ROWS};
use super::model::{CudaModel, DeviceMixer};
use super::moe::{max_gathered_slots, ExpertGroups, MoeKernels};
use super::moe_decode::MoeDecode;
use super::norm::NormKernels;
use super::profile::{self, OpProfile};
use super::sample::SampleKernels;
use super::snapshot::{KeptStates, SnapshotPool};
use super::timeline::Timeline;
use super::weights::DeviceMatrices;
use super::{ensure, Context, CudaDevice, CudaError, CudaStream, Result};
use crate::config::LayerKind;
use crate::model::{RoutingTrace, SeqId, SnapshotId};
use experts::moe_experts;
use projection::{first_projection, gemv_rows};
use residual::ResidualStream;

/// How much the backend allocates up front.
#[derive(Debug, Clone)]
pub struct CudaOptions {
    /// Sequences that can hold state at once (state slots).
    pub max_sequences: usize,
    /// Tokens per sequence (KV cache capacity).
    pub max_context: usize,
    /// Prompt tokens per forward chunk. Long chunks keep the tensor cores busy (each expert sees
    /// ~chunk/32 rows); the workspaces grow with it (~100 KiB per token). Default: the engine's
    /// [`GPU_PREFILL_CHUNK`](crate::engine::GPU_PREFILL_CHUNK).
    pub prefill_chunk: usize,
    /// Replay decode steps from captured CUDA graphs (one per batch size).
    pub cuda_graphs: bool,
    /// [`forward_batch`](crate::model::Backend::forward_batch) runs the steps of several
    /// sequences (prompt chunks and decode tokens) as shared passes, each weight read once per
    /// pass, instead of one by one. On by default since its H200 test (tests/cuda_forward.rs,
    /// `batched_steps_equal_one_by_one`) passed; `--batch-steps false` turns it off.
    pub batch_steps: bool,
    /// Decode passes fold the residual adds and norms into the GEMVs that read them
    /// (forward/residual.rs). Off by default (`LILY_FUSED_NORMS=1` turns it on): it passed its
    /// H200 tests but decoded 1.5 % slower (bench/NOTES.md v1.13).
    pub fused_norms: bool,
    /// Keep bf16 copies of the dense matrices (mixer projections, routers: ≈ 2.6 GB at the full
    /// shape) for long prefill chunks instead of dequantising them per chunk (dense.rs). On by
    /// default; `LILY_DENSE_CACHE=0` turns it off.
    pub keep_dense_bf16: bool,
    /// One-token decode passes run each MoE block as one persistent kernel (moe_decode.rs) where
    /// the weights have the model's MLX layout. Off unless `LILY_MOE_PERSISTENT=1` (measured:
    /// decode 3.7 % slower, bench/NOTES.md v1.41).
    pub persistent_moe: bool,
    /// One-token decode passes add each mixer's output to the residual stream in its output
    /// projection's GEMV, which leaves sums of squares from which the router's GEMV makes the
    /// post-mixer norm itself: that norm's launch saved, the same bits (gemm.cu, RES_OUT and
    /// NORM_IN). On by default (decode +0.7–1.0 % @4K, +1.6–2.8 % @32K on the H200, bench/NOTES.md
    /// v1.69); `LILY_NORM_IN=0` turns it off.
    pub norm_in: bool,
    /// Dense products of at least this many rows run through cuBLAS on the kept bf16 copies
    /// (dense.rs) instead of our 4-bit kernels (forward/projection.rs says why); default: more
    /// rows than one GEMV launch takes; `LILY_CUBLAS_FROM_ROWS` sets it.
    pub cublas_from_rows: usize,
    /// How a verify pass of the MTP head's drafts runs (forward/mtp.rs); `LILY_VERIFY_PASS`
    /// (`rows` or `span`) sets it.
    pub verify_pass: VerifyPass,
    /// A prompt's last chunk keeps the GDN states before its last token for the prefix cache
    /// (`Backend::keep_state_before_last`: its GDN layers step that token on its own), where
    /// otherwise the engine runs it as a step of its own: a cached turn's first token ≈ 3 ms
    /// sooner on an H100 (bench/NOTES.md v1.84). `LILY_KEEP_BEFORE_LAST=0` turns it off.
    pub keep_before_last: bool,
}

/// How a verify pass runs (forward/mtp.rs). Its GDN layers step the rows one token after
/// another (`GdnKernels::decode_tokens`: each row the bits one-token decoding gives, three
/// launches) and keep the states after each. (A prefill chunk instead, with the states stepped
/// again over the kept rows on a cut back, cost 1.5 ms more a pass: bench/NOTES.md v1.81.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VerifyPass {
    /// Decode rows of one sequence, replayed from a graph captured per row count (default).
    Rows,
    /// One prompt span with every row's logits, launch by launch (v1.80–v1.81's, to compare).
    Span,
}

impl VerifyPass {
    /// `LILY_VERIFY_PASS`, or the default (a warning for a value it does not know, or for the
    /// variable it replaced).
    fn from_env() -> Self {
        if std::env::var_os("LILY_VERIFY_GDN").is_some() {
            tracing::warn!("LILY_VERIFY_GDN is gone (its chunked verify pass with it)");
        }
        match std::env::var("LILY_VERIFY_PASS").as_deref() {
            Ok("span") => VerifyPass::Span,
            Ok("rows") | Err(_) => VerifyPass::Rows,
            Ok(other) => {
                tracing::warn!("LILY_VERIFY_PASS={other}: expected rows or span; rows");
                VerifyPass::Rows
            }
        }
    }
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            max_sequences: 4,
            max_context: 32768,
            prefill_chunk: crate::engine::GPU_PREFILL_CHUNK,
            cuda_graphs: true,
            batch_steps: true,
            fused_norms: std::env::var("LILY_FUSED_NORMS").is_ok_and(|v| v == "1"),
            keep_dense_bf16: std::env::var("LILY_DENSE_CACHE").map_or(true, |v| v != "0"),
            persistent_moe: std::env::var("LILY_MOE_PERSISTENT").is_ok_and(|v| v == "1"),
            norm_in: std::env::var("LILY_NORM_IN").map_or(true, |v| v != "0"),
            cublas_from_rows: std::env::var("LILY_CUBLAS_FROM_ROWS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(MAX_TOKENS + 1)
                .max(1),
            verify_pass: VerifyPass::from_env(),
            keep_before_last: std::env::var("LILY_KEEP_BEFORE_LAST").map_or(true, |v| v != "0"),
        }
    }
}

struct Kernels {
    norm: NormKernels,
    gemv: GemvKernels,
    gemm: GemmKernels,
    dense: DenseGemm,
    embed: EmbedKernels,
    moe: MoeKernels,
    /// The persistent MoE block of one-token passes, when `CudaOptions::persistent_moe`.
    moe_decode: Option<MoeDecode>,
    sample: SampleKernels,
    gdn: GdnKernels,
    attn: AttentionKernels,
    /// An FP8 checkpoint's prefill products, when some matrix keeps its FP8 form (forward/fp8.rs).
    fp8: Option<fp8::Fp8Path>,
    /// `CudaOptions::cublas_from_rows`.
    cublas_from_rows: usize,
}

/// Activation buffers for a pass of up to `rows` rows, allocated once.
struct Scratch {
    rows: usize,
    ids: CudaSlice<i32>,
    h: CudaSlice<bf16>,
    /// The residual stream's second buffer, for fused decode passes (forward/residual.rs).
    h2: CudaSlice<bf16>,
    xn: CudaSlice<bf16>,
    proj: CudaSlice<bf16>,
    mixed: CudaSlice<bf16>,
    r: CudaSlice<bf16>,
    /// `[tokens][router_pitch]`: router logits, then the shared expert's gate logit (then zeros up
    /// to the pitch, where cuBLAS wrote them: forward/projection.rs `router_logits`).
    router: CudaSlice<bf16>,
    router_pitch: usize,
    /// `[tokens][slots]`, slots = top_k routed experts + the shared expert (DeviceMoe).
    expert_ids: CudaSlice<i32>,
    expert_weights: CudaSlice<f32>,
    /// Up to 8 rows, or the most rows whose experts run as gathered slots: `[rows][slots][2·I]`,
    /// each (row, slot)'s gate‖up.
    gu: CudaSlice<bf16>,
    /// The gathered slots of a pass's experts (`MoeKernels::slot_table`).
    slot_table: CudaSlice<i32>,
    /// Prefill: `[tokens·slots][I]` in expert-sorted order.
    act: CudaSlice<bf16>,
    /// `[tokens][slots][hidden]`: each slot's expert output, before weighting.
    routed: CudaSlice<bf16>,
    groups: ExpertGroups,
    /// `[batch][hidden]`: the final-norm rows the logits are taken of, gathered when they are
    /// not one run of rows.
    last: CudaSlice<bf16>,
    /// `[logit_rows][vocab]`: the logits of each span's last token, then of each decode row
    /// (or of every row of a verify pass).
    logits: CudaSlice<bf16>,
    /// `[logit_rows]`: the token picked after each logits row.
    next: CudaSlice<i32>,
    /// Rows of `logits`: a pass's most sequences, or a verify pass's most rows when the model
    /// drafts (forward/mtp.rs).
    logit_rows: usize,
    /// `[batch]`: each decode row's sequence slot and position.
    slots: CudaSlice<i32>,
    /// Blocks of the router's GEMV done, for its fused top-k (zero between launches).
    topk_counter: CudaSlice<u32>,
    /// `[hidden / 8]`: one decode row's residual stream, each vector's sum of squares, left by
    /// the mixer's output projection for the router (`CudaOptions::norm_in`).
    vec_ss: CudaSlice<f32>,
    positions: CudaSlice<i32>,
}

/// What one pass over the layers runs: prompt spans (rows first), then `decode` rows of one
/// token each; the token ids of all rows in `s.ids`, the decode rows' slots and positions in
/// `s.slots` and `s.positions`.
#[derive(Debug, Clone, Default)]
struct Pass {
    spans: Vec<Span>,
    decode: usize,
    /// Logits of every row (a verify pass as one span), not only of each span's last.
    all_logits: bool,
    /// The decode rows are consecutive tokens of one sequence (a verify pass stepping its GDN
    /// rows as decoding does, forward/mtp.rs): its GDN layers step them in order and keep the
    /// states after each, its attention rows see the rows before them.
    one_seq: bool,
}

/// Prompt tokens of one sequence in a pass: rows `first .. first + len` (at least 2), at
/// positions `start ..`.
#[derive(Debug, Clone, Copy)]
struct Span {
    slot: usize,
    start: usize,
    first: usize,
    len: usize,
}

impl Pass {
    /// The first decode row (the rows of the spans come before).
    fn decode_row(&self) -> usize {
        self.spans.last().map_or(0, |s| s.first + s.len)
    }
    fn rows(&self) -> usize {
        self.decode_row() + self.decode
    }
    /// Rows of logits: each span's last token, then each decode row (or every row).
    fn logit_rows(&self) -> usize {
        if self.all_logits {
            self.rows()
        } else {
            self.spans.len() + self.decode
        }
    }
}

/// One row of a decode pass.
#[derive(Debug, Clone, Copy)]
struct DecodeRow {
    slot: usize,
    position: usize,
    token: u32,
}

struct Sequence {
    slot: usize,
    position: usize,
}

pub struct CudaBackend {
    dev: CudaDevice,
    model: CudaModel,
    k: Kernels,
    options: CudaOptions,
    s: Scratch,
    /// Per GDN layer: state pools `[slots][...]`.
    ssm: Vec<CudaSlice<f32>>,
    conv: Vec<CudaSlice<bf16>>,
    kv: KvCache,
    gdn_ws: GdnWorkspace,
    attn_ws: AttentionWorkspace,
    sequences: HashMap<SeqId, Sequence>,
    free_slots: Vec<usize>,
    /// Captured decode passes, by batch size and whether their rows are one sequence's (a
    /// verify pass; dropped when its kept states move, `reserve_verify_states`).
    decode_graphs: HashMap<(usize, bool), DecodeGraph>,
    /// Saved sequence states for the prefix cache (snapshot.rs).
    snapshots: SnapshotPool,
    /// By slot: the GDN states its next prompt span keeps before its last token
    /// (`CudaOptions::keep_before_last`), then kept until a snapshot takes them.
    before_last: HashMap<usize, KeptStates>,
    /// Most device memory seen in use after a forward call since the last reset (bytes).
    peak_memory: u64,
    /// Shared passes run by `forward_batch` (backend.rs).
    shared_passes: usize,
    /// Op timing (`lily bench --profile`): passes run uncaptured, each op timed (profile.rs).
    profile: Option<OpProfile>,
    /// Decode passes of up to this many rows fold their norms into the GEMVs (0: never).
    fused_rows: usize,
    /// What the routers decide, while `lily agree` traces it: passes run uncaptured and each MoE
    /// layer's router logits and expert ids are copied out (record_routing).
    routing: Option<RoutingTrace>,
    /// `lily bench --timeline`: the stamps of the decode graphs' kernels (timeline.rs), and the
    /// batch size of the graph replayed since it was installed (one size only).
    timeline: Option<(Timeline, Option<usize>)>,
    /// The sequences that draft with the MTP head, by slot, and the head's buffers
    /// (forward/mtp.rs); the head's KV cache is the attention layers' last.
    drafting: HashMap<usize, mtp::Drafting>,
    /// The GDN states the open verify pass keeps (forward/mtp.rs).
    verify_states: Option<mtp::VerifyStates>,
    /// Whether `s.logits` still holds the open verify pass's rows (no pass or head pass since).
    verify_logits_kept: bool,
    /// The MTP head's draft step on its own last draft, captured on first use (forward/mtp.rs).
    draft_graph: Option<DecodeGraph>,
    /// What the prefix cache's snapshots of drafting sequences keep for the head.
    head_snapshots: HashMap<SnapshotId, mtp::HeadSnapshot>,
    mtp_io: Option<mtp::MtpBuffers>,
}

/// A captured decode pass, with the (section, kernel) of each of its launches in order.
struct DecodeGraph(CudaGraph, Vec<(&'static str, String)>);

// SAFETY: a CUDA graph may be launched from any thread once its context is bound, which
// `CudaGraph::launch` does; the backend (and with it the graph) is used by one thread at a time.
unsafe impl Send for DecodeGraph {}

fn alloc<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    s: &Arc<CudaStream>,
    n: usize,
) -> Result<CudaSlice<T>> {
    s.alloc_zeros::<T>(n.max(1))
        .during(|| format!("allocating {n} activation values"))
}

impl CudaBackend {
    pub fn new(dev: CudaDevice, model: CudaModel, options: CudaOptions) -> Result<Self> {
        let c = model.config.clone();
        gdn::check_config(&c)?;
        ensure!(
            c.num_experts_per_tok <= super::moe::MAX_TOP_K,
            "top-{} routing is not supported",
            c.num_experts_per_tok
        );
        let st = dev.stream().clone();
        let batch = batch_rows(&options);
        // A pass's sampled rows are drawn at once (a verify pass's too): their scratch is
        // allocated with the rest.
        let logit_rows = most_decode_rows(&model, &options);
        let mut k = Kernels {
            norm: NormKernels::load(&dev)?,
            gemv: GemvKernels::load(&dev)?,
            gemm: GemmKernels::load(&dev)?,
            dense: dense_gemm(&dev, &model, &options)?,
            embed: EmbedKernels::load(&dev)?,
            moe: MoeKernels::load(&dev)?,
            moe_decode: if options.persistent_moe {
                Some(MoeDecode::load(&dev)?)
            } else {
                None
            },
            // The argmax scratch holds every logits row of a pass: a verify pass's are more
            // than a decode pass's (body's argmax refused a verify pass of more rows than
            // `batch_rows` when this was `batch_rows`).
            sample: SampleKernels::load(&dev, logit_rows)?,
            gdn: GdnKernels::load(&dev)?,
            attn: AttentionKernels::load(&dev, &c)?,
            fp8: None,
            cublas_from_rows: options.cublas_from_rows,
        };
        let rows = options.prefill_chunk.max(batch).max(1);
        k.sample.reserve(c.vocab_size, logit_rows)?;
        let h = c.hidden_size;
        // The shared expert is one more expert (DeviceMoe): one more router row and slot.
        let (e, slots, inter) = (
            c.num_experts + 1,
            c.num_experts_per_tok + 1,
            c.moe_intermediate_size,
        );
        let proj_width = c.linear_in_proj_rows().max(QKV_WIDTH);
        let mixed_width = c.linear_value_dim().max(c.num_attention_heads * c.head_dim);
        // Passes of up to this many rows may gather their experts' rows (GemvKernels).
        let gathered_rows = k.gemv.max_gathered_rows().min(rows);
        let gu_rows = MAX_TOKENS.max(gathered_rows);
        let s = Scratch {
            rows,
            ids: alloc(&st, rows)?,
            h: alloc(&st, rows * h)?,
            h2: alloc(&st, MAX_TOKENS * h)?,
            xn: alloc(&st, rows * h)?,
            proj: alloc(&st, rows * proj_width)?,
            mixed: alloc(&st, rows * mixed_width)?,
            r: alloc(&st, rows * h)?,
            router: alloc(&st, rows * dense::padded_rows(e))?,
            router_pitch: e,
            expert_ids: alloc(&st, rows * slots)?,
            expert_weights: alloc(&st, rows * slots)?,
            gu: alloc(&st, gu_rows * slots * 2 * inter)?,
            slot_table: alloc(
                &st,
                (max_gathered_slots(gathered_rows, slots, e) * SLOT_WORDS).max(1),
            )?,
            act: alloc(&st, rows * slots * inter)?,
            routed: alloc(&st, rows * slots * h)?,
            groups: ExpertGroups::new(&st, rows, slots, e, MIN_TILE_ROWS)?,
            last: alloc(&st, batch * h)?,
            logits: alloc(&st, logit_rows * c.vocab_size)?,
            next: alloc(&st, logit_rows)?,
            logit_rows,
            // A verify pass's rows are decode rows too (`logit_rows` of them at most).
            slots: alloc(&st, logit_rows)?,
            topk_counter: alloc(&st, 1)?,
            vec_ss: alloc(&st, h.div_ceil(8))?,
            positions: alloc(&st, logit_rows)?,
        };
        // An FP8 checkpoint's prefill: activations of up to `rows` rows of the widest FP8 matrix's
        // input, or of the experts' SwiGLU outputs (`slots` per row).
        if let Some(widest) = fp8::Fp8Path::widest(&model) {
            k.fp8 = Some(fp8::Fp8Path::new(&dev, rows, widest.max(slots * inter))?);
        }
        let n_gdn = c
            .layer_types
            .iter()
            .filter(|k| **k == LayerKind::LinearAttention)
            .count();
        let n_attn = c.num_hidden_layers - n_gdn;
        let slots = options.max_sequences.max(1);
        let mut ssm = Vec::with_capacity(n_gdn);
        let mut conv = Vec::with_capacity(n_gdn);
        for _ in 0..n_gdn {
            ssm.push(alloc(&st, slots * gdn::SSM_STATE_LEN)?);
            conv.push(alloc(&st, slots * gdn::CONV_STATE_LEN)?);
        }
        // The MTP head's layer keeps its KV cache as one more attention layer.
        let kv_layers = n_attn + usize::from(model.mtp.is_some());
        let kv = KvCache::new(&st, slots, kv_layers.max(1), options.max_context)?;
        let mtp_io = match &model.mtp {
            Some(_) => Some(mtp::MtpBuffers::new(&st, rows, h)?),
            None => None,
        };
        let gdn_ws = GdnWorkspace::new(&st, rows)?;
        let attn_ws = AttentionWorkspace::new(&k.attn, rows, logit_rows, options.max_context)?;
        let fused_rows = if options.fused_norms {
            residual::fused_rows(&k.gemv, &model)
        } else {
            0
        };
        let snapshots = SnapshotPool::new(&dev)?;
        Ok(CudaBackend {
            dev,
            model,
            k,
            s,
            ssm,
            conv,
            kv,
            gdn_ws,
            attn_ws,
            sequences: HashMap::new(),
            free_slots: (0..slots).rev().collect(),
            decode_graphs: HashMap::new(),
            snapshots,
            before_last: HashMap::new(),
            peak_memory: 0,
            shared_passes: 0,
            profile: None,
            fused_rows,
            routing: None,
            timeline: None,
            drafting: HashMap::new(),
            verify_states: None,
            verify_logits_kept: false,
            draft_graph: None,
            head_snapshots: HashMap::new(),
            mtp_io,
            options,
        })
    }

    pub fn model(&self) -> &CudaModel {
        &self.model
    }

    /// Runs `tokens` of the sequence in `slot` from `position`; leaves the last token's logits
    /// in row 0 of `s.logits` and its greedy successor in `s.next[0]`.
    fn run(&mut self, slot: usize, position: usize, tokens: &[u32]) -> Result<()> {
        let vocab = self.model.config.vocab_size;
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(CudaError::Shape(format!(
                "token id {bad} is outside the vocabulary ({vocab})"
            )));
        }
        ensure!(
            position + tokens.len() <= self.options.max_context,
            "{} tokens exceed the context of {}",
            position + tokens.len(),
            self.options.max_context
        );
        let chunk = self.s.rows;
        let mut pos = position;
        // States to keep before the last token: only the last part's span keeps them (see
        // `before_last`), so they are set aside while the others run.
        let mut keep = self
            .before_last
            .remove(&slot)
            .filter(|k| k.position.is_none());
        let parts = tokens.len().div_ceil(chunk);
        for (i, part) in tokens.chunks(chunk).enumerate() {
            let mut decoded_after = None;
            if i + 1 == parts {
                if let Some(mut kept) = keep.take() {
                    if part.len() == 1 {
                        // Decoded, not a span: the states before it are the slot's now (put
                        // back after the pass, which drops filled ones as stale).
                        self.keep_slot_states(slot, &mut kept)?;
                        kept.position = Some(pos);
                        decoded_after = Some(kept);
                    } else {
                        self.before_last.insert(slot, kept);
                    }
                }
            }
            if let [token] = *part {
                self.decode(&[DecodeRow {
                    slot,
                    position: pos,
                    token,
                }])?;
            } else {
                self.prefill_chunk(slot, pos, part)?;
            }
            if let Some(kept) = decoded_after {
                self.before_last.insert(slot, kept);
            }
            pos += part.len();
        }
        Ok(())
    }

    fn prefill_chunk(&mut self, slot: usize, start: usize, tokens: &[u32]) -> Result<()> {
        self.pass(&[(slot, start, tokens)], &[])
    }

    /// One decode pass over `rows` (distinct sequences, checked by the caller): leaves each
    /// row's logits in `s.logits` and its greedy successor in `s.next`.
    fn decode(&mut self, rows: &[DecodeRow]) -> Result<()> {
        self.pass(&[], rows)
    }

    /// One pass over prompt spans `(slot, start, tokens)` (at least 2 tokens each) and decode
    /// rows, all of distinct sequences (checked by the caller): leaves the logits of each span's
    /// last token, then of each decode row, in `s.logits` and the greedy successors in `s.next`.
    fn pass(&mut self, spans: &[(usize, usize, &[u32])], rows: &[DecodeRow]) -> Result<()> {
        self.pass_with(spans, rows, false)
    }

    /// [`pass`](Self::pass), or a `verify` pass (`CudaOptions::verify_pass`: one span with every
    /// row's logits, or decode rows of one sequence); then the rows of drafting sequences are
    /// kept for their MTP head.
    fn pass_with(
        &mut self,
        spans: &[(usize, usize, &[u32])],
        rows: &[DecodeRow],
        verify: bool,
    ) -> Result<()> {
        self.verify_logits_kept = false;
        let one_seq = verify && self.options.verify_pass == VerifyPass::Rows;
        let all_logits = verify && !one_seq;
        let mut pass = Pass {
            spans: Vec::with_capacity(spans.len()),
            decode: rows.len(),
            all_logits,
            one_seq,
        };
        let mut ids: Vec<i32> = Vec::new();
        for &(slot, start, tokens) in spans {
            ensure!(
                tokens.len() >= 2,
                "a prompt span of {} tokens",
                tokens.len()
            );
            pass.spans.push(Span {
                slot,
                start,
                first: ids.len(),
                len: tokens.len(),
            });
            ids.extend(tokens.iter().map(|&x| x as i32));
        }
        ids.extend(rows.iter().map(|r| r.token as i32));
        let (t, b, n) = (pass.rows(), pass.decode, pass.logit_rows());
        let most = if verify {
            self.s.logit_rows
        } else {
            batch_rows(&self.options)
        };
        ensure!(
            t >= 1 && t <= self.s.rows && n <= most,
            "a pass of {t} rows and {n} logits rows (at most {} and {most})",
            self.s.rows,
        );
        ensure!(
            !all_logits || (spans.len() == 1 && rows.is_empty()),
            "a verify pass of {:?} is one span",
            self.options.verify_pass
        );
        ensure!(
            !pass.one_seq
                || (spans.is_empty()
                    && rows
                        .windows(2)
                        .all(|r| { r[1].slot == r[0].slot && r[1].position == r[0].position + 1 })),
            "a verify pass's rows are consecutive tokens of one sequence"
        );
        let st = self.dev.stream().clone();
        st.memcpy_htod(&ids, &mut self.s.ids.slice_mut(..t))
            .during(|| "copying token ids".into())?;
        if b > 0 {
            let column = |f: fn(&DecodeRow) -> usize| -> Vec<i32> {
                rows.iter().map(|r| f(r) as i32).collect()
            };
            st.memcpy_htod(&column(|r| r.slot), &mut self.s.slots.slice_mut(..b))
                .during(|| "copying the slots".into())?;
            st.memcpy_htod(
                &column(|r| r.position),
                &mut self.s.positions.slice_mut(..b),
            )
            .during(|| "copying the positions".into())?;
        }
        // States an earlier step of these sequences kept and no snapshot took are stale now.
        for slot in spans.iter().map(|s| s.0).chain(rows.iter().map(|r| r.slot)) {
            if self
                .before_last
                .get(&slot)
                .is_some_and(|k| k.position.is_some())
            {
                self.before_last.remove(&slot);
            }
        }
        self.launch(&pass)?;
        if !all_logits {
            // The spans whose GDN layers kept the states before their last token (body).
            for span in &pass.spans {
                if let Some(kept) =
                    (self.before_last.get_mut(&span.slot)).filter(|k| k.position.is_none())
                {
                    kept.position = Some(span.start + span.len - 1);
                }
            }
        }
        if !self.drafting.is_empty() {
            self.keep_head_rows(&pass, spans, rows)?;
        }
        Ok(())
    }

    /// Copies every GDN layer's state and conv window of `slot` into `kept`.
    fn keep_slot_states(&self, slot: usize, kept: &mut KeptStates) -> Result<()> {
        let st = self.dev.stream();
        let (ssm_len, conv_len) = (gdn::SSM_STATE_LEN, gdn::CONV_STATE_LEN);
        for (i, (ssm, conv)) in self.ssm.iter().zip(&self.conv).enumerate() {
            st.memcpy_dtod(
                &ssm.slice(slot * ssm_len..(slot + 1) * ssm_len),
                &mut kept.ssm.slice_mut(i * ssm_len..(i + 1) * ssm_len),
            )
            .during(|| "keeping a recurrent state".into())?;
            st.memcpy_dtod(
                &conv.slice(slot * conv_len..(slot + 1) * conv_len),
                &mut kept.conv.slice_mut(i * conv_len..(i + 1) * conv_len),
            )
            .during(|| "keeping a conv window".into())?;
        }
        Ok(())
    }

    /// Runs `pass` (its inputs in device memory): timed op by op, launch by launch, or as its
    /// captured decode graph.
    fn launch(&mut self, pass: &Pass) -> Result<()> {
        let b = pass.decode;
        if let Some(mut timing) = self.profile.take() {
            let st = self.dev.stream().clone();
            let timed = timing.time(&st, || self.body(pass));
            self.profile = Some(timing);
            return timed;
        }
        if !pass.spans.is_empty() || self.decodes_uncaptured() {
            return self.body(pass);
        }
        self.capture_decode_graph(b, pass.one_seq)?;
        if let Some((_, replayed)) = self.timeline.as_mut().filter(|_| !pass.one_seq) {
            ensure!(
                replayed.is_none_or(|r| r == b),
                "a timeline covers decode passes of one batch size"
            );
            *replayed = Some(b);
        }
        self.decode_graphs[&(b, pass.one_seq)]
            .0
            .launch()
            .during(|| "replaying the decode graph".into())
    }

    /// Captures the decode pass of `b` rows (`one_seq`: of one sequence) as a graph, unless it
    /// has been. A decode pass reads its tokens, slots and positions from device memory, so one
    /// captured graph per batch size serves every step: ~600 launches become one.
    fn capture_decode_graph(&mut self, b: usize, one_seq: bool) -> Result<()> {
        if self.decode_graphs.contains_key(&(b, one_seq)) {
            return Ok(());
        }
        let pass = Pass {
            spans: Vec::new(),
            decode: b,
            all_logits: false,
            one_seq,
        };
        let st = self.dev.stream().clone();
        st.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .during(|| "starting the decode graph capture".into())?;
        let (captured, labels) = profile::label_launches(|| self.body(&pass));
        let graph = st
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .during(|| "capturing the decode graph".into());
        captured?;
        let graph =
            graph?.ok_or_else(|| CudaError::Shape("the decode graph capture was empty".into()))?;
        self.decode_graphs
            .insert((b, one_seq), DecodeGraph(graph, labels));
        Ok(())
    }

    /// Decode passes run launch by launch: graphs off, op timing, or a routing trace.
    fn decodes_uncaptured(&self) -> bool {
        !self.options.cuda_graphs || self.profile.is_some() || self.routing.is_some()
    }

    /// Captures the decode graphs of 1 to `max_batch` rows (as many as one pass holds) before
    /// serving, so that no step of a run pays a capture (≈ 3 ms each, bench/NOTES.md v1.57).
    /// Nothing while passes run uncaptured, or while a timeline's stamped kernels are installed
    /// (graphs captured then would keep them).
    fn capture_decode_graphs(&mut self, max_batch: usize) -> Result<()> {
        if self.decodes_uncaptured() || self.timeline.is_some() {
            return Ok(());
        }
        let most = if self.options.batch_steps {
            max_batch.min(batch_rows(&self.options))
        } else {
            1
        };
        for b in 1..=most {
            self.capture_decode_graph(b, false)?;
        }
        Ok(())
    }

    /// Every launch of one pass whose inputs are already in device memory; ends with the logits
    /// and the greedy next token of each span's last token and each decode row in `s.logits`
    /// and `s.next`. No host synchronisation and no allocation, so a decode pass can be
    /// captured as a graph.
    fn body(&mut self, pass: &Pass) -> Result<()> {
        let (t, d, b) = (pass.rows(), pass.decode_row(), pass.decode);
        let c = self.model.config.clone();
        let hd = c.hidden_size;
        let m = &self.model;
        let k = &mut self.k;
        let s = &mut self.s;
        let st = self.dev.stream().clone();
        let section = |name| profile::section(&st, name);
        section("embed")?;
        k.embed.gather(
            &m.embed.view(),
            &s.ids.slice(..t),
            &mut s.h.slice_mut(..t * hd),
        )?;
        k.norm.rmsnorm(
            &s.h.slice(..t * hd),
            &m.layers[0].input_norm.as_view(),
            &mut s.xn.slice_mut(..t * hd),
            c.rms_norm_eps,
        )?;
        // L2 ahead (decode GEMVs): each dense projection pulls the next one into L2 (gemm.rs).
        let after_mixer = |moe: &super::model::DeviceMoe| {
            let e = c.num_experts;
            L2Ahead::default()
                .matrices(&moe.router.view(), &st)
                .one_matrix(&moe.gate_up.view(), e, &st)
                .one_matrix(&moe.down.view(), e, &st)
        };
        let first_matrix = |li: usize| match m.layers.get(li).map(|l| &l.mixer) {
            Some(DeviceMixer::DeltaNet { in_proj, .. }) => {
                L2Ahead::default().matrices(&in_proj.view(), &st)
            }
            Some(DeviceMixer::Attention { qkv, .. }) => {
                L2Ahead::default().matrices(&qkv.view(), &st)
            }
            None => L2Ahead::default(),
        };
        // Decode passes of few rows fold the residual adds and norms into the GEMVs that read
        // them (forward/residual.rs); `stream` says where the residual stream is.
        let fused = t <= self.fused_rows;
        // One decode row: the post-mixer residual add in the mixer's output projection, the norm
        // in the router's GEMV (CudaOptions::norm_in). Both are plain one-token GEMV launches
        // here (cuBLAS only from more rows), the experts' input xn written by the router.
        let norm_in = self.options.norm_in
            && t == 1
            && b == 1
            && !fused
            && !k.gemv.fuses_topk()
            && k.moe_decode.is_none()
            && k.cublas_from_rows > 1
            && hd % 16 == 0
            && hd <= 2048;
        let residual_out = |k: &Kernels, s: &mut Scratch| -> Result<()> {
            if norm_in {
                let out =
                    ResidualOut::new(&mut s.h.slice_mut(..hd), &mut s.vec_ss.as_view_mut(), &st)?;
                k.gemv.then_residual_out(out);
            }
            Ok(())
        };
        let mut stream = ResidualStream::default();
        let slots = c.num_experts_per_tok + 1;
        let (mut gdn_i, mut attn_i) = (0, 0);
        for (li, layer) in m.layers.iter().enumerate() {
            // The previous layer's MoE combine and this layer's input norm, not yet done.
            let pending_combine = fused && li > 0;
            match &layer.mixer {
                DeviceMixer::DeltaNet {
                    in_proj,
                    out_proj,
                    conv_w,
                    a_log,
                    dt_bias,
                    norm,
                } => {
                    let width = in_proj.rows;
                    section("gdn in_proj")?;
                    let ahead = L2Ahead::default().matrices(&out_proj.view(), &st);
                    let combine = pending_combine.then_some((&mut stream, &layer.input_norm));
                    first_projection(&c, k, in_proj, s, t, combine, ahead)?;
                    let w = GdnWeights {
                        conv_w: conv_w.as_view(),
                        a_log: a_log.as_view(),
                        dt_bias: dt_bias.as_view(),
                        norm_w: norm.as_view(),
                        eps: c.rms_norm_eps,
                    };
                    let vd = c.linear_value_dim();
                    section("gdn mixer")?;
                    for span in &pass.spans {
                        let (a, z) = (span.first, span.first + span.len);
                        let proj = s.proj.slice(a * width..z * width);
                        let inputs = GdnInputs::fused(&proj, width)?;
                        let slot = span.slot;
                        let mut ssm = self.ssm[gdn_i]
                            .slice_mut(slot * gdn::SSM_STATE_LEN..(slot + 1) * gdn::SSM_STATE_LEN);
                        let mut conv = self.conv[gdn_i].slice_mut(
                            slot * gdn::CONV_STATE_LEN..(slot + 1) * gdn::CONV_STATE_LEN,
                        );
                        let y = &mut s.mixed.slice_mut(a * vd..z * vd);
                        // A verify pass as a span (`VerifyPass::Span`): its GDN rows step as
                        // decoding steps them, keeping the states after each (forward/mtp.rs).
                        if pass.all_logits {
                            let kept = self.verify_states.as_mut().ok_or_else(|| {
                                CudaError::Shape("no room for a verify pass's GDN states".into())
                            })?;
                            let (mut ssm_rows, mut conv_rows) = kept.states(gdn_i, 0..span.len - 1);
                            k.gdn.decode_tokens(
                                &w,
                                &inputs,
                                span.len,
                                &mut ssm,
                                &mut conv,
                                Some((&mut ssm_rows, &mut conv_rows)),
                                &mut self.gdn_ws,
                                y,
                            )?;
                        } else if let Some(kept) = self
                            .before_last
                            .get_mut(&slot)
                            .filter(|k| k.position.is_none())
                        {
                            // The prompt's end state for the prefix cache: all rows but the
                            // last as a prefill chunk, the states kept, then the last row as
                            // one-token decoding steps it.
                            let rest = span.len - 1;
                            if rest > 0 {
                                let proj = s.proj.slice(a * width..(z - 1) * width);
                                k.gdn.prefill(
                                    &w,
                                    &GdnInputs::fused(&proj, width)?,
                                    rest,
                                    &mut ssm,
                                    &mut conv,
                                    &mut self.gdn_ws,
                                    &mut s.mixed.slice_mut(a * vd..(z - 1) * vd),
                                )?;
                            }
                            let (ssm_len, conv_len) = (gdn::SSM_STATE_LEN, gdn::CONV_STATE_LEN);
                            st.memcpy_dtod(
                                &ssm,
                                &mut kept.ssm.slice_mut(gdn_i * ssm_len..(gdn_i + 1) * ssm_len),
                            )
                            .during(|| "keeping a recurrent state".into())?;
                            st.memcpy_dtod(
                                &conv,
                                &mut kept
                                    .conv
                                    .slice_mut(gdn_i * conv_len..(gdn_i + 1) * conv_len),
                            )
                            .during(|| "keeping a conv window".into())?;
                            let proj = s.proj.slice((z - 1) * width..z * width);
                            k.gdn.decode_tokens(
                                &w,
                                &GdnInputs::fused(&proj, width)?,
                                1,
                                &mut ssm,
                                &mut conv,
                                None,
                                &mut self.gdn_ws,
                                &mut s.mixed.slice_mut((z - 1) * vd..z * vd),
                            )?;
                        } else {
                            k.gdn.prefill(
                                &w,
                                &inputs,
                                span.len,
                                &mut ssm,
                                &mut conv,
                                &mut self.gdn_ws,
                                y,
                            )?;
                        }
                    }
                    if b > 0 && pass.one_seq {
                        // A verify pass: its rows stepped in order, the state after each but
                        // the last kept (forward/mtp.rs).
                        let proj = s.proj.slice(d * width..t * width);
                        let kept = self.verify_states.as_mut().ok_or_else(|| {
                            CudaError::Shape("no room for a verify pass's GDN states".into())
                        })?;
                        let (mut ssm_rows, mut conv_rows) = kept.states(gdn_i, 0..b - 1);
                        k.gdn.decode_tokens_in_slot(
                            &w,
                            &GdnInputs::fused(&proj, width)?,
                            b,
                            &s.slots.slice(..1),
                            &mut self.ssm[gdn_i].as_view_mut(),
                            &mut self.conv[gdn_i].as_view_mut(),
                            Some((&mut ssm_rows, &mut conv_rows)),
                            &mut self.gdn_ws,
                            &mut s.mixed.slice_mut(d * vd..t * vd),
                        )?;
                    } else if b > 0 {
                        let proj = s.proj.slice(d * width..t * width);
                        k.gdn.decode_in_pass(
                            &w,
                            &GdnInputs::fused(&proj, width)?,
                            &s.slots.slice(..b),
                            &mut self.ssm[gdn_i].as_view_mut(),
                            &mut self.conv[gdn_i].as_view_mut(),
                            Some(&mut self.gdn_ws),
                            &mut s.mixed.slice_mut(d * vd..t * vd),
                        )?;
                    }
                    section("gdn out_proj")?;
                    residual_out(k, s)?;
                    gemv_rows(
                        k,
                        out_proj,
                        &s.mixed.slice(..t * vd),
                        &mut s.r.slice_mut(..t * hd),
                        t,
                        after_mixer(&layer.moe),
                    )?;
                    gdn_i += 1;
                }
                DeviceMixer::Attention {
                    qkv,
                    o_proj,
                    q_norm,
                    k_norm,
                } => {
                    section("attn qkv")?;
                    let ahead = L2Ahead::default().matrices(&o_proj.view(), &st);
                    let combine = pending_combine.then_some((&mut stream, &layer.input_norm));
                    first_projection(&c, k, qkv, s, t, combine, ahead)?;
                    let od = c.num_attention_heads * c.head_dim;
                    section("attn mixer")?;
                    for span in &pass.spans {
                        let (a, z) = (span.first, span.first + span.len);
                        k.attn.prefill(
                            &s.proj.slice(a * QKV_WIDTH..z * QKV_WIDTH),
                            &q_norm.as_view(),
                            &k_norm.as_view(),
                            &mut self.kv,
                            attn_i,
                            span.slot,
                            span.start,
                            &mut self.attn_ws,
                            &mut s.mixed.slice_mut(a * od..z * od),
                        )?;
                    }
                    if b > 0 {
                        let decode = if pass.one_seq {
                            AttentionKernels::decode_one_sequence
                        } else {
                            AttentionKernels::decode
                        };
                        decode(
                            &k.attn,
                            &s.proj.slice(d * QKV_WIDTH..t * QKV_WIDTH),
                            &q_norm.as_view(),
                            &k_norm.as_view(),
                            &mut self.kv,
                            attn_i,
                            &s.slots.slice(..b),
                            &s.positions.slice(..b),
                            &mut self.attn_ws,
                            &mut s.mixed.slice_mut(d * od..t * od),
                        )?;
                    }
                    section("attn o_proj")?;
                    residual_out(k, s)?;
                    gemv_rows(
                        k,
                        o_proj,
                        &s.mixed.slice(..t * od),
                        &mut s.r.slice_mut(..t * hd),
                        t,
                        after_mixer(&layer.moe),
                    )?;
                    attn_i += 1;
                }
            }
            k.gemv.ensure_taken("the mixer's output projection")?;
            // h += mixer output; m = norm(h) (fused: in the router's GEMV; norm_in: the add in the
            // output projection just before, the norm in the router's GEMV).
            if norm_in {
                let input = NormIn::new(
                    &s.h.slice(..hd),
                    &s.vec_ss.as_view(),
                    &layer.post_norm.as_view(),
                    c.rms_norm_eps,
                    &mut s.xn.slice_mut(..hd),
                    &st,
                )?;
                k.gemv.then_norm_in(input);
            } else if !fused {
                section("norms")?;
                k.norm.residual_rmsnorm(
                    &mut s.h.slice_mut(..t * hd),
                    &s.r.slice(..t * hd),
                    None,
                    &layer.post_norm.as_view(),
                    &mut s.xn.slice_mut(..t * hd),
                    c.rms_norm_eps,
                )?;
            }
            // L2 ahead: gate‖up pulls in the same experts' down weights, down the next layer's
            // first matrix.
            let ahead = (
                L2Ahead::default().same_matrix(&layer.moe.down.view(), &st),
                first_matrix(li + 1),
            );
            let router_input = fused.then_some((&mut stream, &layer.post_norm));
            moe_experts(&c, k, &layer.moe, s, t, router_input, ahead, &section)?;
            k.gemv.ensure_taken("the router")?;
            if let Some(trace) = self.routing.as_mut() {
                record_routing(&c, &st, s, t, li, trace)?;
            }
            // h += the experts' outputs weighted (the MoE combine); the next layer's input norm
            // (fused: in its first GEMV), or the final norm.
            let next = m.layers.get(li + 1);
            if fused && next.is_some() {
                continue;
            }
            let next_norm = next.map_or(&m.final_norm, |l| &l.input_norm);
            section("norms")?;
            let h = if stream.in_second() {
                &mut s.h2
            } else {
                &mut s.h
            };
            k.norm.residual_rmsnorm(
                &mut h.slice_mut(..t * hd),
                &s.routed.slice(..t * slots * hd),
                Some(&s.expert_weights.slice(..t * slots)),
                &next_norm.as_view(),
                &mut s.xn.slice_mut(..t * hd),
                c.rms_norm_eps,
            )?;
        }
        // Logits of each span's last token and each decode row: rows of `xn` as they are when
        // they are one run (decode rows only, or one span), else gathered into `last`.
        let n = pass.logit_rows();
        let v = c.vocab_size;
        section("lm_head")?;
        let rows = match pass.spans.as_slice() {
            _ if pass.all_logits => s.xn.slice(..t * hd),
            [] => s.xn.slice(..t * hd),
            [span] if b == 0 => s.xn.slice((span.first + span.len - 1) * hd..t * hd),
            spans => {
                let st = self.dev.stream();
                for (i, span) in spans.iter().enumerate() {
                    let row = span.first + span.len - 1;
                    st.memcpy_dtod(
                        &s.xn.slice(row * hd..(row + 1) * hd),
                        &mut s.last.slice_mut(i * hd..(i + 1) * hd),
                    )
                    .during(|| "gathering the rows of the logits".into())?;
                }
                if b > 0 {
                    st.memcpy_dtod(
                        &s.xn.slice(d * hd..t * hd),
                        &mut s.last.slice_mut(spans.len() * hd..n * hd),
                    )
                    .during(|| "gathering the rows of the logits".into())?;
                }
                s.last.slice(..n * hd)
            }
        };
        gemv_rows(
            k,
            &m.lm_head,
            &rows,
            &mut s.logits.slice_mut(..n * v),
            n,
            L2Ahead::default(),
        )?;
        section("argmax")?;
        k.sample
            .argmax(&s.logits.slice(..n * v), v, &mut s.next.slice_mut(..n))
    }
}

/// Appends layer `li`'s router logits and expert ids of the pass's `t` rows to `trace` (a
/// synchronising copy: tracing is for `lily agree`, not for speed).
fn record_routing(
    c: &crate::config::ModelConfig,
    st: &Arc<CudaStream>,
    s: &Scratch,
    t: usize,
    li: usize,
    trace: &mut RoutingTrace,
) -> Result<()> {
    let (e, topk) = (c.num_experts, c.num_experts_per_tok);
    let slots = topk + 1;
    let logits: Vec<bf16> = st
        .clone_dtoh(&s.router.slice(..t * s.router_pitch))
        .during(|| "copying the router logits".into())?;
    let ids: Vec<i32> = st
        .clone_dtoh(&s.expert_ids.slice(..t * slots))
        .during(|| "copying the expert ids".into())?;
    // Each row: e router logits, then the shared expert's gate (not a choice); top_k routed
    // slots, then the shared expert's.
    for row in logits.chunks(s.router_pitch) {
        trace.logits[li].extend(row[..e].iter().map(|x| x.to_f32()));
    }
    for row in ids.chunks(slots) {
        trace.experts[li].extend(row[..topk].iter().map(|&x| x as u32));
    }
    Ok(())
}

/// The most rows of one decode pass: every sequence slot, below the rows where products take
/// cuBLAS even on matrices without a kept bf16 copy (whose dequantising has no room in a graph).
fn batch_rows(options: &CudaOptions) -> usize {
    options.max_sequences.clamp(1, dense::MIN_TOKENS - 1)
}

/// The most decode rows of a pass: `batch_rows`, or a verify pass's when the model drafts
/// (forward/mtp.rs); also the most rows of logits a pass leaves.
fn most_decode_rows(m: &CudaModel, options: &CudaOptions) -> usize {
    if m.mtp.is_some() {
        batch_rows(options).max(mtp::MAX_VERIFY_ROWS)
    } else {
        batch_rows(options)
    }
}

/// The matrices the cuBLAS path of long chunks multiplies (dense.rs): every layer's mixer
/// projections and router, the MTP head's too (its passes over a prompt's rows are as long).
fn dense_matrices(m: &CudaModel) -> impl Iterator<Item = &DeviceMatrices> {
    let head = m.mtp.iter();
    let layers = m.layers.iter().chain(head.clone().map(|h| &h.layer));
    layers
        .flat_map(|l| {
            let mixer = match &l.mixer {
                DeviceMixer::DeltaNet {
                    in_proj, out_proj, ..
                } => [in_proj, out_proj],
                DeviceMixer::Attention { qkv, o_proj, .. } => [qkv, o_proj],
            };
            mixer.into_iter().chain([&l.moe.router])
        })
        .chain(head.flat_map(|h| [&h.fc_embedding, &h.fc_hidden]))
}

/// The cuBLAS path, with bf16 copies of the model's dense matrices kept (`keep_dense_bf16`) or
/// scratch room to dequantise the largest one per product; where decode passes take it (kept
/// copies, `cublas_from_rows`), the padded output their graphs will need is reserved now.
fn dense_gemm(dev: &CudaDevice, m: &CudaModel, options: &CudaOptions) -> Result<DenseGemm> {
    let keep = options.keep_dense_bf16;
    let largest = dense_matrices(m)
        .map(|w| dense::padded_rows(w.rows) * w.cols)
        .max()
        .unwrap_or(0);
    let mut dense = DenseGemm::new(dev, if keep { 0 } else { largest })?;
    if keep {
        let batch = most_decode_rows(m, options);
        if options.cublas_from_rows <= batch {
            let unaligned = dense_matrices(m)
                .filter(|w| w.rows % 8 != 0)
                .map(|w| dense::padded_rows(w.rows))
                .max()
                .unwrap_or(0);
            dense.reserve_padded(batch * unaligned)?;
        }
        for w in dense_matrices(m) {
            dense.keep(&w.view())?;
        }
        dev.stream()
            .synchronize()
            .during(|| "keeping bf16 copies of the dense matrices".into())?;
    }
    Ok(dense)
}
