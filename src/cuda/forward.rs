//! The CUDA backend: the forward pass of MODEL.md §3 in terms of the kernels of this module.
//!
//! Activations are bf16 `[tokens][width]` rows, norms and the recurrent state fp32. A call runs
//! one sequence's next tokens: prompts in chunks of up to [`CudaOptions::prefill_chunk`] tokens
//! (chunked GDN, flash attention), single tokens through the decode kernels. Up to 8 tokens, the
//! projections and the experts are GEMVs; longer chunks use the tensor-core GEMM for the dense
//! projections and, for the experts, group their (token, slot) pairs by expert on the device and
//! run one grouped GEMM for gate‖up (SwiGLU fused) and one for down. Routing, expert selection
//! and greedy sampling stay on the device; a greedy step brings back one token id.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{sys, CudaGraph, CudaSlice, CudaView, CudaViewMut};
use half::bf16;

use super::attention::{AttentionKernels, AttentionWorkspace, KvCache, QKV_WIDTH};
use super::dense::{self, DenseGemm};
use super::embed::EmbedKernels;
use super::gdn::{self, GdnInputs, GdnKernels, GdnWeights, GdnWorkspace};
use super::gemm::{GemvKernels, SlotInput, MAX_TOKENS};
use super::gemm_prefill::{GemmKernels, TILE_ROWS};
use super::model::{CudaModel, DeviceMixer};
use super::moe::{ExpertGroups, MoeKernels};
use super::norm::NormKernels;
use super::sample::SampleKernels;
use super::snapshot::{SnapshotPool, StatePools};
use super::weights::DeviceMatrices;
use super::{ensure, Context, CudaDevice, CudaError, CudaStream, Result};
use crate::config::{LayerKind, ModelConfig};
use crate::model::{Backend, SeqId, Snapshot, SnapshotId};
use crate::sampling::DeviceSampling;

/// How much the backend allocates up front.
#[derive(Debug, Clone)]
pub struct CudaOptions {
    /// Sequences that can hold state at once (state slots).
    pub max_sequences: usize,
    /// Tokens per sequence (KV cache capacity).
    pub max_context: usize,
    /// Prompt tokens per forward chunk. Long chunks keep the tensor cores busy (each expert sees
    /// ~chunk/32 rows); the workspaces grow with it (~100 KiB per token).
    pub prefill_chunk: usize,
    /// Replay decode steps from a captured CUDA graph.
    pub cuda_graphs: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            max_sequences: 4,
            max_context: 32768,
            prefill_chunk: 4096,
            cuda_graphs: true,
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
    sample: SampleKernels,
    gdn: GdnKernels,
    attn: AttentionKernels,
}

/// Activation buffers for one chunk of up to `rows` tokens, allocated once.
struct Scratch {
    rows: usize,
    ids: CudaSlice<i32>,
    h: CudaSlice<bf16>,
    xn: CudaSlice<bf16>,
    proj: CudaSlice<bf16>,
    mixed: CudaSlice<bf16>,
    r: CudaSlice<bf16>,
    /// `[tokens][experts + 1]`: router logits, then the shared expert's gate logit.
    router: CudaSlice<bf16>,
    /// `[tokens][slots]`, slots = top_k routed experts + the shared expert (DeviceMoe).
    expert_ids: CudaSlice<i32>,
    expert_weights: CudaSlice<f32>,
    /// Decode: `[slots][2·I]`, each slot's gate‖up.
    gu: CudaSlice<bf16>,
    /// Prefill: `[tokens·slots][I]` in expert-sorted order.
    act: CudaSlice<bf16>,
    /// `[tokens][slots][hidden]`: each slot's expert output, before weighting.
    routed: CudaSlice<bf16>,
    groups: ExpertGroups,
    logits: CudaSlice<bf16>,
    next: CudaSlice<i32>,
    slot: CudaSlice<i32>,
    position: CudaSlice<i32>,
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
    decode_graph: Option<DecodeGraph>,
    /// Saved sequence states for the prefix cache (snapshot.rs).
    snapshots: SnapshotPool,
    /// Most device memory seen in use after a forward call since the last reset (bytes).
    peak_memory: u64,
}

/// The captured decode step.
struct DecodeGraph(CudaGraph);

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
        let k = Kernels {
            norm: NormKernels::load(&dev)?,
            gemv: GemvKernels::load(&dev)?,
            gemm: GemmKernels::load(&dev)?,
            dense: DenseGemm::new(&dev, largest_dense_matrix(&model))?,
            embed: EmbedKernels::load(&dev)?,
            moe: MoeKernels::load(&dev)?,
            sample: SampleKernels::load(&dev, 1)?,
            gdn: GdnKernels::load(&dev)?,
            attn: AttentionKernels::load(&dev, &c)?,
        };
        let rows = options.prefill_chunk.max(1);
        let h = c.hidden_size;
        // The shared expert is one more expert (DeviceMoe): one more router row and slot.
        let (e, slots, inter) = (
            c.num_experts + 1,
            c.num_experts_per_tok + 1,
            c.moe_intermediate_size,
        );
        let proj_width =
            (c.conv_dim() + c.linear_value_dim() + 2 * c.linear_num_value_heads).max(QKV_WIDTH);
        let mixed_width = c.linear_value_dim().max(c.num_attention_heads * c.head_dim);
        let s = Scratch {
            rows,
            ids: alloc(&st, rows)?,
            h: alloc(&st, rows * h)?,
            xn: alloc(&st, rows * h)?,
            proj: alloc(&st, rows * proj_width)?,
            mixed: alloc(&st, rows * mixed_width)?,
            r: alloc(&st, rows * h)?,
            router: alloc(&st, rows * e)?,
            expert_ids: alloc(&st, rows * slots)?,
            expert_weights: alloc(&st, rows * slots)?,
            gu: alloc(&st, slots * 2 * inter)?,
            act: alloc(&st, rows * slots * inter)?,
            routed: alloc(&st, rows * slots * h)?,
            groups: ExpertGroups::new(&st, rows, slots, e, TILE_ROWS)?,
            logits: alloc(&st, c.vocab_size)?,
            next: alloc(&st, 1)?,
            slot: alloc(&st, 1)?,
            position: alloc(&st, 1)?,
        };
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
        let kv = KvCache::new(&st, slots, n_attn.max(1), options.max_context)?;
        let gdn_ws = GdnWorkspace::new(&st, rows)?;
        let attn_ws = AttentionWorkspace::new(&k.attn, rows, 1, options.max_context)?;
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
            decode_graph: None,
            snapshots: SnapshotPool::default(),
            peak_memory: 0,
            options,
        })
    }

    pub fn model(&self) -> &CudaModel {
        &self.model
    }

    /// Runs `tokens` of the sequence in `slot` from `position`; leaves the last token's logits
    /// in `s.logits`.
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
        for part in tokens.chunks(chunk) {
            self.run_chunk(slot, pos, part)?;
            pos += part.len();
        }
        Ok(())
    }

    fn run_chunk(&mut self, slot: usize, start: usize, tokens: &[u32]) -> Result<()> {
        let t = tokens.len();
        let st = self.dev.stream().clone();
        let ids: Vec<i32> = tokens.iter().map(|&x| x as i32).collect();
        st.memcpy_htod(&ids, &mut self.s.ids.slice_mut(..t))
            .during(|| "copying token ids".into())?;
        st.memcpy_htod(&[slot as i32], &mut self.s.slot)
            .during(|| "copying the slot".into())?;
        st.memcpy_htod(&[start as i32], &mut self.s.position)
            .during(|| "copying the position".into())?;
        if t > 1 || !self.options.cuda_graphs {
            return self.body(slot, start, t);
        }
        // A decode step reads its token, slot and position from device memory, so one captured
        // graph serves every step of every sequence: ~600 launches become one.
        if self.decode_graph.is_none() {
            st.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .during(|| "starting the decode graph capture".into())?;
            let captured = self.body(slot, start, 1);
            let graph = st
                .end_capture(sys::CUgraphInstantiate_flags(0))
                .during(|| "capturing the decode graph".into());
            captured?;
            self.decode_graph =
                Some(DecodeGraph(graph?.ok_or_else(|| {
                    CudaError::Shape("the decode graph capture was empty".into())
                })?));
        }
        let graph = self.decode_graph.as_ref().expect("captured above");
        graph
            .0
            .launch()
            .during(|| "replaying the decode graph".into())
    }

    /// Every launch of one forward chunk of `t` tokens whose ids, slot and position are already
    /// in device memory; ends with the greedy next token in `s.next`. No host synchronisation
    /// and no allocation, so the decode step can be captured as a graph.
    fn body(&mut self, slot: usize, start: usize, t: usize) -> Result<()> {
        let c = self.model.config.clone();
        let hd = c.hidden_size;
        let m = &self.model;
        let k = &mut self.k;
        let s = &mut self.s;
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
        let (mut gdn_i, mut attn_i) = (0, 0);
        for (li, layer) in m.layers.iter().enumerate() {
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
                    gemv_rows(
                        k,
                        in_proj,
                        &s.xn.slice(..t * hd),
                        &mut s.proj.slice_mut(..t * width),
                        t,
                    )?;
                    let proj = s.proj.slice(..t * width);
                    let inputs = GdnInputs::fused(&proj, width)?;
                    let w = GdnWeights {
                        conv_w: conv_w.as_view(),
                        a_log: a_log.as_view(),
                        dt_bias: dt_bias.as_view(),
                        norm_w: norm.as_view(),
                        eps: c.rms_norm_eps,
                    };
                    let vd = c.linear_value_dim();
                    let mut y = s.mixed.slice_mut(..t * vd);
                    if t == 1 {
                        k.gdn.decode(
                            &w,
                            &inputs,
                            &s.slot.as_view(),
                            &mut self.ssm[gdn_i].as_view_mut(),
                            &mut self.conv[gdn_i].as_view_mut(),
                            &mut y,
                        )?;
                    } else {
                        let mut ssm = self.ssm[gdn_i]
                            .slice_mut(slot * gdn::SSM_STATE_LEN..(slot + 1) * gdn::SSM_STATE_LEN);
                        let mut conv = self.conv[gdn_i].slice_mut(
                            slot * gdn::CONV_STATE_LEN..(slot + 1) * gdn::CONV_STATE_LEN,
                        );
                        k.gdn.prefill(
                            &w,
                            &inputs,
                            t,
                            &mut ssm,
                            &mut conv,
                            &mut self.gdn_ws,
                            &mut y,
                        )?;
                    }
                    gemv_rows(
                        k,
                        out_proj,
                        &s.mixed.slice(..t * vd),
                        &mut s.r.slice_mut(..t * hd),
                        t,
                    )?;
                    gdn_i += 1;
                }
                DeviceMixer::Attention {
                    qkv,
                    o_proj,
                    q_norm,
                    k_norm,
                } => {
                    gemv_rows(
                        k,
                        qkv,
                        &s.xn.slice(..t * hd),
                        &mut s.proj.slice_mut(..t * QKV_WIDTH),
                        t,
                    )?;
                    let od = c.num_attention_heads * c.head_dim;
                    let proj = s.proj.slice(..t * QKV_WIDTH);
                    let mut out = s.mixed.slice_mut(..t * od);
                    if t == 1 {
                        k.attn.decode(
                            &proj,
                            &q_norm.as_view(),
                            &k_norm.as_view(),
                            &mut self.kv,
                            attn_i,
                            &s.slot.as_view(),
                            &s.position.as_view(),
                            &mut self.attn_ws,
                            &mut out,
                        )?;
                    } else {
                        k.attn.prefill(
                            &proj,
                            &q_norm.as_view(),
                            &k_norm.as_view(),
                            &mut self.kv,
                            attn_i,
                            slot,
                            start,
                            &mut self.attn_ws,
                            &mut out,
                        )?;
                    }
                    gemv_rows(
                        k,
                        o_proj,
                        &s.mixed.slice(..t * od),
                        &mut s.r.slice_mut(..t * hd),
                        t,
                    )?;
                    attn_i += 1;
                }
            }
            // h += mixer output; m = norm(h).
            k.norm.residual_rmsnorm(
                &mut s.h.slice_mut(..t * hd),
                &s.r.slice(..t * hd),
                None,
                &layer.post_norm.as_view(),
                &mut s.xn.slice_mut(..t * hd),
                c.rms_norm_eps,
            )?;
            moe_experts(&c, k, &layer.moe, s, t)?;
            // h += the experts' outputs weighted (the MoE combine); the next layer's input norm
            // (or the final norm).
            let next_norm = m
                .layers
                .get(li + 1)
                .map_or(&m.final_norm, |l| &l.input_norm);
            let slots = c.num_experts_per_tok + 1;
            k.norm.residual_rmsnorm(
                &mut s.h.slice_mut(..t * hd),
                &s.routed.slice(..t * slots * hd),
                Some(&s.expert_weights.slice(..t * slots)),
                &next_norm.as_view(),
                &mut s.xn.slice_mut(..t * hd),
                c.rms_norm_eps,
            )?;
        }
        // Logits of the last token only.
        let last = s.xn.slice((t - 1) * hd..t * hd);
        gemv_rows(k, &m.lm_head, &last, &mut s.logits.as_view_mut(), 1)?;
        k.sample
            .argmax(&s.logits.as_view(), c.vocab_size, &mut s.next.as_view_mut())
    }
}

/// The MoE block's experts for `t` rows of `s.xn`: routing, then each (token, slot)'s expert
/// output unweighted in `s.routed` `[t][slots][hidden]`, slot top_k being the shared expert; the
/// weights are left in `s.expert_weights` for the combine.
fn moe_experts(
    c: &ModelConfig,
    k: &mut Kernels,
    w: &super::model::DeviceMoe,
    s: &mut Scratch,
    t: usize,
) -> Result<()> {
    let (hd, e, topk, inter) = (
        c.hidden_size,
        c.num_experts,
        c.num_experts_per_tok,
        c.moe_intermediate_size,
    );
    let slots = topk + 1;
    gemv_rows(
        k,
        &w.router,
        &s.xn.slice(..t * hd),
        &mut s.router.slice_mut(..t * (e + 1)),
        t,
    )?;
    k.moe.router_topk(
        &s.router.slice(..t * (e + 1)),
        e,
        topk,
        true,
        &mut s.expert_ids.slice_mut(..t * slots),
        &mut s.expert_weights.slice_mut(..t * slots),
    )?;
    let grouped = t > MAX_TOKENS
        && GemmKernels::supports(&w.gate_up.view())
        && GemmKernels::supports(&w.down.view());
    if grouped {
        // Pairs sorted by expert, then one grouped GEMM per projection; routed[token][slot] as below.
        k.moe
            .group_by_expert(&s.expert_ids.slice(..t * slots), slots, &mut s.groups)?;
        let mut act = s.act.slice_mut(..t * slots * inter);
        k.gemm.experts_gate_up(
            &w.gate_up.view(),
            &s.xn.slice(..t * hd),
            &s.groups,
            &mut act,
        )?;
        k.gemm.experts_down(
            &w.down.view(),
            &s.act.slice(..t * slots * inter),
            &s.groups,
            &mut s.routed.slice_mut(..t * slots * hd),
        )
    } else {
        for row in 0..t {
            let ids = s.expert_ids.slice(row * slots..(row + 1) * slots);
            let x = s.xn.slice(row * hd..(row + 1) * hd);
            k.gemv.gemv_slots(
                &w.gate_up.view(),
                Some(&ids),
                slots,
                &x,
                SlotInput::Shared,
                1,
                &mut s.gu.as_view_mut(),
            )?;
            let mut out = s.routed.slice_mut(row * slots * hd..(row + 1) * slots * hd);
            k.gemv.gemv_slots(
                &w.down.view(),
                Some(&ids),
                slots,
                &s.gu.as_view(),
                SlotInput::PerSlotSwiGlu,
                1,
                &mut out,
            )?;
        }
        Ok(())
    }
}

/// `y = W · x` for `t` rows: cuBLAS on dequantised weights for long chunks (dense.rs), our
/// tensor-core GEMM for more than 8 rows, else (or for weights it does not take) GEMVs of as
/// many tokens per launch as fit in shared memory (≤ 8).
fn gemv_rows(
    k: &mut Kernels,
    w: &DeviceMatrices,
    x: &CudaView<bf16>,
    y: &mut CudaViewMut<bf16>,
    t: usize,
) -> Result<()> {
    let (rows, cols) = (w.rows, w.cols);
    let view = w.view();
    if t >= dense::MIN_TOKENS && GemmKernels::supports(&view) {
        return k
            .dense
            .gemm(&view, &x.slice(..t * cols), &mut y.slice_mut(..t * rows));
    }
    if t > MAX_TOKENS && GemmKernels::supports(&view) {
        return k
            .gemm
            .gemm(&view, &x.slice(..t * cols), &mut y.slice_mut(..t * rows));
    }
    let per_launch = k.gemv.max_tokens(&view);
    let mut done = 0;
    while done < t {
        let n = per_launch.min(t - done);
        let xs = x.slice(done * cols..(done + n) * cols);
        let mut ys = y.slice_mut(done * rows..(done + n) * rows);
        k.gemv.gemv(&view, &xs, &mut ys)?;
        done += n;
    }
    Ok(())
}

impl Backend for CudaBackend {
    fn config(&self) -> &ModelConfig {
        &self.model.config
    }
    fn device_name(&self) -> String {
        format!("cuda ({})", self.dev.name())
    }
    fn create_sequence(&mut self, seq: SeqId) -> anyhow::Result<()> {
        let slot = self.free_slots.pop().ok_or_else(|| {
            anyhow::anyhow!(
                "all {} GPU sequence slots are in use",
                self.options.max_sequences
            )
        })?;
        let st = self.dev.stream().clone();
        st.memcpy_htod(&[slot as i32], &mut self.s.slot)
            .during(|| "copying the slot".into())?;
        for (ssm, conv) in self.ssm.iter_mut().zip(self.conv.iter_mut()) {
            self.k.gdn.zero(
                &mut ssm.as_view_mut(),
                &mut conv.as_view_mut(),
                Some(&self.s.slot.as_view()),
            )?;
        }
        self.sequences.insert(seq, Sequence { slot, position: 0 });
        Ok(())
    }
    fn free_sequence(&mut self, seq: SeqId) {
        if let Some(s) = self.sequences.remove(&seq) {
            self.free_slots.push(s.slot);
        }
    }
    fn forward(&mut self, seq: SeqId, tokens: &[u32]) -> anyhow::Result<Vec<f32>> {
        self.step(seq, tokens)?;
        let st = self.dev.stream().clone();
        let logits: Vec<bf16> = st
            .clone_dtoh(&self.s.logits)
            .during(|| "copying logits".into())?;
        Ok(logits.iter().map(|x| x.to_f32()).collect())
    }
    fn sequence_bytes(&self, tokens: usize) -> u64 {
        let gdn = gdn::SSM_STATE_LEN * size_of::<f32>() + gdn::CONV_STATE_LEN * size_of::<bf16>();
        (self.ssm.len() * gdn + tokens * self.kv.bytes_per_token()) as u64
    }
    fn can_snapshot(&self) -> bool {
        true
    }
    fn snapshot(&mut self, seq: SeqId) -> anyhow::Result<Snapshot> {
        let s = self.sequence(seq)?;
        let (slot, position) = (s.slot, s.position);
        let pools = StatePools {
            ssm: &mut self.ssm,
            conv: &mut self.conv,
            kv: &mut self.kv,
        };
        Ok(self
            .snapshots
            .take(self.dev.stream(), pools, slot, position)?)
    }
    fn restore(&mut self, snapshot: SnapshotId, seq: SeqId) -> anyhow::Result<usize> {
        let slot = self.sequence(seq)?.slot;
        let pools = StatePools {
            ssm: &mut self.ssm,
            conv: &mut self.conv,
            kv: &mut self.kv,
        };
        let position = self
            .snapshots
            .restore(self.dev.stream(), pools, snapshot, slot)?;
        if let Some(s) = self.sequences.get_mut(&seq) {
            s.position = position;
        }
        Ok(position)
    }
    fn drop_snapshot(&mut self, snapshot: SnapshotId) {
        self.snapshots.drop_snapshot(snapshot);
    }
    fn peak_memory(&self) -> Option<u64> {
        Some(self.peak_memory)
    }
    fn reset_peak_memory(&mut self) {
        self.peak_memory = 0;
    }
    fn forward_greedy(&mut self, seq: SeqId, tokens: &[u32]) -> anyhow::Result<u32> {
        self.step(seq, tokens)?;
        let st = self.dev.stream().clone();
        let next: Vec<i32> = st
            .clone_dtoh(&self.s.next)
            .during(|| "copying the next token".into())?;
        Ok(next[0] as u32)
    }
    fn forward_sample(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        sampling: &DeviceSampling,
        u: f64,
    ) -> anyhow::Result<u32> {
        // Plain greedy is the argmax the forward pass already ends with; greedy over the
        // tokenizer's ids only (a real checkpoint's padding rows masked) the argmax of that prefix.
        let vocab = self.model.config.vocab_size;
        let limit = sampling.vocab_limit.min(vocab);
        if sampling.is_greedy() && sampling.history.is_empty() && limit == vocab {
            return self.forward_greedy(seq, tokens);
        }
        self.step(seq, tokens)?;
        if sampling.is_greedy() && sampling.history.is_empty() && limit > 0 {
            self.k.sample.argmax(
                &self.s.logits.slice(..limit),
                limit,
                &mut self.s.next.as_view_mut(),
            )?;
        } else {
            self.k.sample.sample(
                &self.s.logits.as_view(),
                sampling,
                u,
                &mut self.s.next.as_view_mut(),
            )?;
        }
        let next: Vec<i32> = self
            .dev
            .stream()
            .clone_dtoh(&self.s.next)
            .during(|| "copying the sampled token".into())?;
        u32::try_from(next[0]).map_err(|_| anyhow::anyhow!("no logit is finite (all NaN or -inf)"))
    }
}

impl CudaBackend {
    fn step(&mut self, seq: SeqId, tokens: &[u32]) -> anyhow::Result<()> {
        anyhow::ensure!(!tokens.is_empty(), "no tokens to run");
        let (slot, position) = {
            let s = self
                .sequences
                .get(&seq)
                .ok_or_else(|| anyhow::anyhow!("unknown sequence {seq}"))?;
            (s.slot, s.position)
        };
        self.run(slot, position, tokens)?;
        if let Some(s) = self.sequences.get_mut(&seq) {
            s.position += tokens.len();
        }
        // Everything lily allocates is allocated up front, so the device's memory in use after
        // a call is its peak for that call (other processes on the GPU would count too).
        if let Ok((free, total)) = cudarc::driver::result::mem_get_info() {
            self.peak_memory = self.peak_memory.max((total - free) as u64);
        }
        Ok(())
    }
}

/// The most values of one dense (non-expert) matrix: the size of the cuBLAS path's scratch.
fn largest_dense_matrix(m: &CudaModel) -> usize {
    let mats = m.layers.iter().flat_map(|l| {
        let mixer = match &l.mixer {
            DeviceMixer::DeltaNet {
                in_proj, out_proj, ..
            } => [in_proj, out_proj],
            DeviceMixer::Attention { qkv, o_proj, .. } => [qkv, o_proj],
        };
        mixer.into_iter().chain([&l.moe.router])
    });
    mats.map(|w| w.rows * w.cols).max().unwrap_or(0)
}

impl CudaBackend {
    fn sequence(&self, seq: SeqId) -> anyhow::Result<&Sequence> {
        self.sequences
            .get(&seq)
            .ok_or_else(|| anyhow::anyhow!("unknown sequence {seq}"))
    }
}
