//! Drafting with the MTP head on the device (MODEL.md §4; `cpu::mtp` is the reference).
//!
//! A drafting sequence keeps the final-normed hidden state and the token of every row the
//! model runs for it (`keep_head_rows`, after each pass), until its drafts take them: the head's
//! rows for those, then k − 1 steps on its own output, each one pass of the head's layer
//! (`head_pass`: the norms, `fc` as two products, one full-attention layer with its MoE on the
//! attention layers' last KV cache, `mtp.norm`, the LM head and its argmax).
//!
//! A verify pass runs the next token and the drafts as decode rows of one sequence, every row's
//! logits kept, replayed from a graph captured per row count (`Pass::one_seq`: the slot and
//! positions are read on the device). Its GDN layers step the rows one token after another
//! (`GdnKernels::decode_tokens_in_slot`: one-token decoding's bits) and keep the states after
//! each row but the last ([`VerifyStates`], ≈ 63 MB a row at the full shape): keeping fewer rows
//! than it ran copies the kept row's states into the slot. Its attention rows see the rows
//! before them (`AttentionKernels::decode_one_sequence`); positions past the kept rows are
//! written over later. To compare (`CudaOptions::verify_pass`, `LILY_VERIFY_PASS=span`): the rows
//! as one prompt span, launch by launch, the GDN layers stepped the same way. The rows'
//! projections and experts round as a batched decode pass of that many rows does (a span's as
//! the prompt path does), so on the GPU greedy output with drafts equals plain decoding's up to
//! near-ties.

use std::sync::Arc;

use cudarc::driver::{sys, CudaSlice, CudaView, CudaViewMut};
use half::bf16;

use super::experts::moe_experts;
use super::projection::{first_projection, gemv_rows};
use super::{alloc, CudaBackend, DecodeGraph, DecodeRow, Pass, VerifyPass};
use crate::cuda::attention::QKV_WIDTH;
use crate::cuda::gdn;
use crate::cuda::gemm::L2Ahead;
use crate::cuda::model::DeviceMixer;
use crate::cuda::profile;
use crate::cuda::sample::RowDraw;
use crate::cuda::{ensure, Context, CudaError, CudaStream, Result};
use crate::sampling::DeviceSampling;

/// The most rows of a verify pass: 16 drafts and the token before them.
pub const MAX_VERIFY_ROWS: usize = 17;

/// Sequences that may draft at once (the engine drafts for up to 4 decoding together): each
/// holds a buffer of the hidden states its head has not taken yet, grown as rows come (a whole
/// prompt's before its first drafts). One verify pass is open at a time.
pub const MAX_DRAFTING: usize = 4;

/// Rows a drafting sequence's buffer of hidden states starts with.
const PENDING_ROWS: usize = 1024;

/// What a drafting sequence keeps for its head.
pub struct Drafting {
    /// `[≥ rows][hidden]`: the final-normed hidden states of the rows run since the last
    /// drafts, `rows` of them, and their tokens.
    pending: CudaSlice<bf16>,
    rows: usize,
    tokens: Vec<u32>,
    /// Positions whose head rows are in its KV cache.
    committed: usize,
    /// The open verify pass's tokens and first position.
    verify: Option<(Vec<u32>, usize)>,
}

/// The GDN states of the open verify pass (one for the backend: one pass is open at a time),
/// grown to the longest pass run: the states after each row but the last.
pub struct VerifyStates {
    /// `[gdn layer][rows][SSM_STATE_LEN]`, `[gdn layer][rows][CONV_STATE_LEN]`.
    ssm: CudaSlice<f32>,
    conv: CudaSlice<bf16>,
    rows: usize,
    /// The addresses of a cut back's copies (`GdnKernels::copy_states`), 4 a GDN layer.
    table: CudaSlice<u64>,
}

impl VerifyStates {
    /// Room for `rows` states a GDN layer.
    fn new(st: &Arc<CudaStream>, n_gdn: usize, rows: usize) -> Result<Self> {
        Ok(VerifyStates {
            ssm: alloc(st, n_gdn * rows * gdn::SSM_STATE_LEN)?,
            conv: alloc(st, n_gdn * rows * gdn::CONV_STATE_LEN)?,
            rows,
            table: alloc(st, 4 * n_gdn)?,
        })
    }

    /// GDN layer `layer`'s states `rows` (a range of its rows), as views.
    pub(super) fn states(
        &mut self,
        layer: usize,
        rows: std::ops::Range<usize>,
    ) -> (CudaViewMut<'_, f32>, CudaViewMut<'_, bf16>) {
        let (ssm, conv) = (gdn::SSM_STATE_LEN, gdn::CONV_STATE_LEN);
        assert!(
            rows.start <= rows.end && rows.end <= self.rows,
            "rows {rows:?} of a layer's {} kept states",
            self.rows
        );
        let at = layer * self.rows;
        (
            self.ssm
                .slice_mut((at + rows.start) * ssm..(at + rows.end) * ssm),
            self.conv
                .slice_mut((at + rows.start) * conv..(at + rows.end) * conv),
        )
    }
}

impl Drafting {
    /// Makes room for `rows` pending rows of `hidden` (no more than `most`), keeping those held.
    fn reserve(
        &mut self,
        st: &Arc<CudaStream>,
        rows: usize,
        hidden: usize,
        most: usize,
    ) -> Result<()> {
        if rows * hidden <= self.pending.len() {
            return Ok(());
        }
        ensure!(
            rows <= most,
            "a drafting sequence's hidden states exceed its context ({rows} rows of {most})"
        );
        let grown_rows = (2 * self.pending.len() / hidden).clamp(rows, most);
        let mut grown = alloc(st, grown_rows * hidden)?;
        if self.rows > 0 {
            st.memcpy_dtod(
                &self.pending.slice(..self.rows * hidden),
                &mut grown.slice_mut(..self.rows * hidden),
            )
            .during(|| "moving the head's pending rows".into())?;
        }
        self.pending = grown;
        Ok(())
    }
}

/// What a prefix-cache snapshot of a drafting sequence keeps for its head (`save_head`).
pub struct HeadSnapshot {
    committed: usize,
    rows: usize,
    tokens: Vec<u32>,
    /// `[rows][hidden]` (one element when empty).
    pending: CudaSlice<bf16>,
}

impl HeadSnapshot {
    pub fn bytes(&self) -> u64 {
        (self.pending.len() * size_of::<bf16>() + self.tokens.len() * size_of::<u32>()) as u64
    }
}

/// The head's inputs for a pass of up to `rows` rows, and its last output.
pub struct MtpBuffers {
    /// `[rows][hidden]`: the normed embeddings, the normed hidden states.
    e: CudaSlice<bf16>,
    hn: CudaSlice<bf16>,
    /// `[hidden]`: the head's normed output of the last row of its last pass.
    last: CudaSlice<bf16>,
    /// `[MAX_VERIFY_ROWS]`: the drafts of one `draft` call, copied back at once.
    drafts: CudaSlice<i32>,
}

impl MtpBuffers {
    pub fn new(st: &Arc<CudaStream>, rows: usize, hidden: usize) -> Result<Self> {
        Ok(MtpBuffers {
            e: alloc(st, rows * hidden)?,
            hn: alloc(st, rows * hidden)?,
            last: alloc(st, hidden)?,
            drafts: alloc(st, MAX_VERIFY_ROWS)?,
        })
    }
}

/// What a head pass reads.
enum HeadInput<'a> {
    /// Rows of a sequence's pending hidden states, each with the token after it.
    Rows(CudaView<'a, bf16>, &'a [u32]),
    /// One row: the head's own last output and its last draft, both still on the device (a
    /// draft step after the first: no copy back between steps).
    OwnDraft,
}

impl CudaBackend {
    /// Whether the model has an MTP head to draft with.
    pub(super) fn has_head(&self) -> bool {
        self.model.mtp.is_some()
    }

    /// Makes the sequence in `slot` (nothing run yet) keep what its head needs.
    pub(super) fn start_drafting_slot(&mut self, slot: usize) -> Result<()> {
        ensure!(self.has_head(), "this checkpoint has no MTP head");
        ensure!(
            self.drafting.len() < MAX_DRAFTING,
            "{MAX_DRAFTING} sequences draft already"
        );
        let st = self.dev.stream().clone();
        let h = self.model.config.hidden_size;
        let d = Drafting {
            pending: alloc(&st, PENDING_ROWS.min(self.options.max_context).max(1) * h)?,
            rows: 0,
            tokens: Vec::new(),
            committed: 0,
            verify: None,
        };
        self.drafting.insert(slot, d);
        Ok(())
    }

    /// Forgets the drafting state of `slot` (the sequence is gone).
    pub(super) fn stop_drafting_slot(&mut self, slot: usize) {
        self.drafting.remove(&slot);
    }

    /// What a snapshot of the drafting sequence in `slot` keeps for its head beside the KV
    /// rows (the head's cache is one more attention layer of the KV cache, saved with it): the
    /// rows it has not taken yet, as `cpu::mtp`'s state does. Its first snapshot of a prompt
    /// holds the whole prompt's rows this way (the head runs when the first drafts are asked
    /// for), so without them a restored conversation's head would read cache rows never
    /// written. `None` for a sequence that does not draft.
    pub(super) fn save_head(&self, slot: usize) -> Result<Option<HeadSnapshot>> {
        let Some(d) = self.drafting.get(&slot) else {
            return Ok(None);
        };
        ensure!(
            d.verify.is_none(),
            "a snapshot of a sequence with a verify pass open"
        );
        let h = self.model.config.hidden_size;
        let st = self.dev.stream().clone();
        let mut pending = alloc(&st, (d.rows * h).max(1))?;
        if d.rows > 0 {
            st.memcpy_dtod(
                &d.pending.slice(..d.rows * h),
                &mut pending.slice_mut(..d.rows * h),
            )
            .during(|| "saving the head's pending rows".into())?;
        }
        Ok(Some(HeadSnapshot {
            committed: d.committed,
            rows: d.rows,
            tokens: d.tokens.clone(),
            pending,
        }))
    }

    /// After a prefix-cache restore into `slot` at `position`: the head's pending rows as the
    /// snapshot kept them. A snapshot without them (its sequence did not draft) leaves the
    /// head's cache rows of the restored positions whatever the snapshot held: drafts from
    /// them may be worse, never wrong (a draft only decides what the verify pass checks).
    pub(super) fn restore_head(
        &mut self,
        slot: usize,
        position: usize,
        saved: Option<&HeadSnapshot>,
    ) -> Result<()> {
        let h = self.model.config.hidden_size;
        let most = self.options.max_context;
        let st = self.dev.stream().clone();
        let Some(d) = self.drafting.get_mut(&slot) else {
            return Ok(());
        };
        d.verify = None;
        d.tokens.clear();
        d.rows = 0;
        d.committed = position;
        let Some(saved) = saved else {
            return Ok(());
        };
        ensure!(
            saved.committed + saved.rows == position && saved.tokens.len() == saved.rows,
            "a head snapshot of {} + {} rows for a state of {position} tokens",
            saved.committed,
            saved.rows
        );
        d.reserve(&st, saved.rows, h, most)?;
        if saved.rows > 0 {
            st.memcpy_dtod(
                &saved.pending.slice(..saved.rows * h),
                &mut d.pending.slice_mut(..saved.rows * h),
            )
            .during(|| "restoring the head's pending rows".into())?;
        }
        d.rows = saved.rows;
        d.tokens.clone_from(&saved.tokens);
        d.committed = saved.committed;
        Ok(())
    }

    /// After `pass`: the final-normed rows of each drafting sequence in it, and their tokens,
    /// join what its head has not taken yet.
    pub(super) fn keep_head_rows(
        &mut self,
        pass: &Pass,
        spans: &[(usize, usize, &[u32])],
        rows: &[DecodeRow],
    ) -> Result<()> {
        let h = self.model.config.hidden_size;
        let most = self.options.max_context;
        let st = self.dev.stream().clone();
        // (slot, first row in the pass, tokens): a verify pass's decode rows, one sequence's
        // in a row, as one run (one copy).
        let mut runs: Vec<(usize, usize, Vec<u32>)> = pass
            .spans
            .iter()
            .zip(spans)
            .map(|(span, &(slot, _, tokens))| (slot, span.first, tokens.to_vec()))
            .collect();
        for (j, r) in rows.iter().enumerate() {
            match runs.last_mut() {
                Some((slot, _, tokens)) if pass.one_seq && *slot == r.slot => tokens.push(r.token),
                _ => runs.push((r.slot, pass.decode_row() + j, vec![r.token])),
            }
        }
        for (slot, first, tokens) in runs {
            let Some(d) = self.drafting.get_mut(&slot) else {
                continue;
            };
            let n = tokens.len();
            d.reserve(&st, d.rows + n, h, most)?;
            st.memcpy_dtod(
                &self.s.xn.slice(first * h..(first + n) * h),
                &mut d.pending.slice_mut(d.rows * h..(d.rows + n) * h),
            )
            .during(|| "keeping hidden states for the MTP head".into())?;
            d.rows += n;
            d.tokens.extend_from_slice(&tokens);
        }
        Ok(())
    }

    /// `k` greedy drafts after `next` (the token picked after the last row run) for the
    /// sequence in `slot`, as `cpu::mtp::draft` drafts them.
    pub(super) fn draft_slot(
        &mut self,
        slot: usize,
        next: u32,
        k: usize,
    ) -> anyhow::Result<Vec<u32>> {
        let vocab = self.model.config.vocab_size;
        anyhow::ensure!(
            (next as usize) < vocab,
            "token id {next} is outside the model's vocabulary ({vocab})"
        );
        // The verify pass that checks them runs k + 1 rows as one pass: refused here, where the
        // engine decodes on without drafts, rather than in the verify pass, which fails its
        // request.
        let most = (MAX_VERIFY_ROWS.min(self.s.logit_rows).min(self.s.rows)).saturating_sub(1);
        anyhow::ensure!((1..=most).contains(&k), "{k} drafts (1 to {most})");
        // Room for the states the verify pass will keep, taken here: memory short refuses the
        // drafts (the engine decodes on without them), not the verify pass (which fails its
        // request).
        let open = self.drafting.get(&slot).is_some_and(|d| d.verify.is_some());
        anyhow::ensure!(!open, "drafting before the verify pass was cut back");
        self.reserve_verify_states(k + 1)?;
        let mut d = self
            .drafting
            .remove(&slot)
            .ok_or_else(|| anyhow::anyhow!("the sequence does not draft"))?;
        let drafted = self.draft_with(&mut d, slot, next, k);
        self.drafting.insert(slot, d);
        drafted
    }

    fn draft_with(
        &mut self,
        d: &mut Drafting,
        slot: usize,
        next: u32,
        k: usize,
    ) -> anyhow::Result<Vec<u32>> {
        anyhow::ensure!(
            d.verify.is_none(),
            "drafting before the verify pass was cut back"
        );
        anyhow::ensure!(d.rows > 0, "no rows have run since the last drafts");
        let h = self.model.config.hidden_size;
        let following: Vec<u32> = d.tokens[1..].iter().copied().chain([next]).collect();
        // The head's rows for the pending rows, a pass of at most a chunk at a time.
        let mut done = 0;
        while done < d.rows {
            let n = (d.rows - done).min(self.s.rows);
            let rows = d.pending.slice(done * h..(done + n) * h);
            let input = HeadInput::Rows(rows, &following[done..done + n]);
            self.head_pass(input, slot, d.committed + done)?;
            done += n;
        }
        d.committed += d.rows;
        d.rows = 0;
        d.tokens.clear();
        // Each draft stays on the device for the next step; all come back in one copy.
        let st = self.dev.stream().clone();
        for j in 0..k {
            if j > 0 {
                self.head_pass(HeadInput::OwnDraft, slot, d.committed + j - 1)?;
            }
            let io = self.mtp_io.as_mut().expect("head_pass checked it");
            st.memcpy_dtod(&self.s.next.slice(..1), &mut io.drafts.slice_mut(j..j + 1))
                .during(|| "keeping a draft".into())?;
        }
        let io = self.mtp_io.as_ref().expect("head_pass checked it");
        let picked: Vec<i32> = st
            .clone_dtoh(&io.drafts.slice(..k))
            .during(|| "copying the drafts".into())?;
        picked.into_iter().map(|t| self.token(t)).collect()
    }

    /// The head over its input's rows at positions `start ..` of the sequence in `slot`: row i
    /// takes hidden state i and the token after that state's. Leaves the head's normed outputs
    /// in `s.xn`, the last one also in the head's `last`, the last row's logits in `s.logits`
    /// and its argmax in `s.next[0]`.
    fn head_pass(&mut self, input: HeadInput, slot: usize, start: usize) -> Result<()> {
        let t = match &input {
            HeadInput::Rows(_, tokens) => tokens.len(),
            HeadInput::OwnDraft => 1,
        };
        ensure!(t >= 1 && t <= self.s.rows, "a head pass of {t} rows");
        self.verify_logits_kept = false; // its logits take the verify pass's place
        ensure!(
            start + t <= self.options.max_context,
            "the head's rows pass the context of {}",
            self.options.max_context
        );
        // The inputs that come from the host; a draft step's token is its last draft, which
        // the body copies on the device.
        let st = self.dev.stream().clone();
        if let HeadInput::Rows(_, tokens) = &input {
            let ids: Vec<i32> = tokens.iter().map(|&x| x as i32).collect();
            st.memcpy_htod(&ids, &mut self.s.ids.slice_mut(..t))
                .during(|| "copying the head's tokens".into())?;
        }
        if t == 1 {
            st.memcpy_htod(&[slot as i32], &mut self.s.slots.slice_mut(..1))
                .during(|| "copying the head's slot".into())?;
            st.memcpy_htod(&[start as i32], &mut self.s.positions.slice_mut(..1))
                .during(|| "copying the head's position".into())?;
        }
        // A draft step after the first reads only device memory: replayed from its graph.
        let captured = !self.decodes_uncaptured() && self.timeline.is_none();
        if !matches!(input, HeadInput::OwnDraft) || !captured {
            return self.head_body(input, slot, start);
        }
        if self.draft_graph.is_none() {
            st.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .during(|| "starting the draft step's capture".into())?;
            let body = self.head_body(HeadInput::OwnDraft, slot, start);
            let graph = st
                .end_capture(sys::CUgraphInstantiate_flags(0))
                .during(|| "capturing the draft step".into());
            body?;
            let graph = graph?
                .ok_or_else(|| CudaError::Shape("the draft step's capture was empty".into()))?;
            self.draft_graph = Some(DecodeGraph(graph, Vec::new()));
        }
        self.draft_graph
            .as_ref()
            .expect("captured above")
            .0
            .launch()
            .during(|| "replaying the draft step".into())
    }

    /// The launches of [`head_pass`](Self::head_pass) once its host inputs are in device
    /// memory (`slot` and `start` only for passes of several rows; one row reads them from
    /// `s.slots` and `s.positions`), so that a draft step can be captured.
    fn head_body(&mut self, input: HeadInput, slot: usize, start: usize) -> Result<()> {
        let c = self.model.config.clone();
        let t = match &input {
            HeadInput::Rows(_, tokens) => tokens.len(),
            HeadInput::OwnDraft => 1,
        };
        let (hd, v, eps) = (c.hidden_size, c.vocab_size, c.rms_norm_eps);
        let st = self.dev.stream().clone();
        let section = |name| profile::section(&st, name);
        let (m, k, s) = (&self.model, &mut self.k, &mut self.s);
        let head = m
            .mtp
            .as_ref()
            .ok_or_else(|| CudaError::Shape("this checkpoint has no MTP head".into()))?;
        let io = self
            .mtp_io
            .as_mut()
            .ok_or_else(|| CudaError::Shape("the MTP head's buffers are missing".into()))?;
        let layer = &head.layer;
        let DeviceMixer::Attention {
            qkv,
            o_proj,
            q_norm,
            k_norm,
        } = &layer.mixer
        else {
            return Err(CudaError::Shape(
                "the MTP head's layer is not attention".into(),
            ));
        };
        section("mtp head")?;
        if let HeadInput::OwnDraft = &input {
            st.memcpy_dtod(&s.next.slice(..1), &mut s.ids.slice_mut(..1))
                .during(|| "feeding the head its draft".into())?;
        }
        // e = norm(embed(token)), hn = norm(hidden): the embedding into r first.
        k.embed.gather(
            &m.embed.view(),
            &s.ids.slice(..t),
            &mut s.r.slice_mut(..t * hd),
        )?;
        k.norm.rmsnorm(
            &s.r.slice(..t * hd),
            &head.embedding_norm.as_view(),
            &mut io.e.slice_mut(..t * hd),
            eps,
        )?;
        match input {
            HeadInput::Rows(rows, _) => k.norm.rmsnorm(
                &rows.slice(..t * hd),
                &head.hidden_norm.as_view(),
                &mut io.hn.slice_mut(..t * hd),
                eps,
            )?,
            HeadInput::OwnDraft => k.norm.rmsnorm(
                &io.last.slice(..hd),
                &head.hidden_norm.as_view(),
                &mut io.hn.slice_mut(..hd),
                eps,
            )?,
        }
        // u = fc · concat(e, hn) as two halves, into the residual stream h; then the layer's
        // input norm into xn.
        let none = L2Ahead::default;
        gemv_rows(
            k,
            &head.fc_embedding,
            &io.e.slice(..t * hd),
            &mut s.h.slice_mut(..t * hd),
            t,
            none(),
        )?;
        gemv_rows(
            k,
            &head.fc_hidden,
            &io.hn.slice(..t * hd),
            &mut s.r.slice_mut(..t * hd),
            t,
            none(),
        )?;
        k.norm.residual_rmsnorm(
            &mut s.h.slice_mut(..t * hd),
            &s.r.slice(..t * hd),
            None,
            &layer.input_norm.as_view(),
            &mut s.xn.slice_mut(..t * hd),
            eps,
        )?;
        // The attention on the last KV cache layer.
        first_projection(&c, k, qkv, s, t, None, none())?;
        let od = c.num_attention_heads * c.head_dim;
        let kv_layer = self.kv.layers() - 1;
        if t >= 2 {
            k.attn.prefill(
                &s.proj.slice(..t * QKV_WIDTH),
                &q_norm.as_view(),
                &k_norm.as_view(),
                &mut self.kv,
                kv_layer,
                slot,
                start,
                &mut self.attn_ws,
                &mut s.mixed.slice_mut(..t * od),
            )?;
        } else {
            k.attn.decode(
                &s.proj.slice(..QKV_WIDTH),
                &q_norm.as_view(),
                &k_norm.as_view(),
                &mut self.kv,
                kv_layer,
                &s.slots.slice(..1),
                &s.positions.slice(..1),
                &mut self.attn_ws,
                &mut s.mixed.slice_mut(..od),
            )?;
        }
        gemv_rows(
            k,
            o_proj,
            &s.mixed.slice(..t * od),
            &mut s.r.slice_mut(..t * hd),
            t,
            none(),
        )?;
        k.gemv.ensure_taken("the MTP head's output projection")?;
        k.norm.residual_rmsnorm(
            &mut s.h.slice_mut(..t * hd),
            &s.r.slice(..t * hd),
            None,
            &layer.post_norm.as_view(),
            &mut s.xn.slice_mut(..t * hd),
            eps,
        )?;
        moe_experts(&c, k, &layer.moe, s, t, None, (none(), none()), &section)?;
        k.gemv.ensure_taken("the MTP head's router")?;
        // h += the experts' outputs; the head's own final norm.
        let slots = c.num_experts_per_tok + 1;
        k.norm.residual_rmsnorm(
            &mut s.h.slice_mut(..t * hd),
            &s.routed.slice(..t * slots * hd),
            Some(&s.expert_weights.slice(..t * slots)),
            &head.norm.as_view(),
            &mut s.xn.slice_mut(..t * hd),
            eps,
        )?;
        st.memcpy_dtod(
            &s.xn.slice((t - 1) * hd..t * hd),
            &mut io.last.slice_mut(..hd),
        )
        .during(|| "keeping the head's last output".into())?;
        gemv_rows(
            k,
            &m.lm_head,
            &s.xn.slice((t - 1) * hd..t * hd),
            &mut s.logits.slice_mut(..v),
            1,
            none(),
        )?;
        k.sample
            .argmax(&s.logits.slice(..v), v, &mut s.next.slice_mut(..1))
    }

    /// Runs `tokens` of the drafting sequence in `slot` from `position` as one verify pass:
    /// every row's logits left in `s.logits`, each row's argmax in `s.next`; the GDN states it
    /// keeps in `verify_states` (see the top).
    pub(super) fn verify_slot(
        &mut self,
        slot: usize,
        position: usize,
        tokens: &[u32],
    ) -> anyhow::Result<()> {
        let vocab = self.model.config.vocab_size;
        anyhow::ensure!(
            (2..=MAX_VERIFY_ROWS.min(self.s.logit_rows)).contains(&tokens.len()),
            "a verify pass of {} rows (2 to {})",
            tokens.len(),
            MAX_VERIFY_ROWS.min(self.s.logit_rows)
        );
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            anyhow::bail!("token id {bad} is outside the model's vocabulary ({vocab})");
        }
        anyhow::ensure!(
            position + tokens.len() <= self.options.max_context,
            "{} tokens exceed the context of {}",
            position + tokens.len(),
            self.options.max_context
        );
        let d = self
            .drafting
            .get(&slot)
            .ok_or_else(|| anyhow::anyhow!("the sequence does not draft"))?;
        anyhow::ensure!(d.verify.is_none(), "a verify pass is open already");
        anyhow::ensure!(
            self.drafting.values().all(|d| d.verify.is_none()),
            "another sequence's verify pass is open (one at a time)"
        );
        self.reserve_verify_states(tokens.len())?;
        if self.options.verify_pass == VerifyPass::Rows {
            let rows: Vec<DecodeRow> = (position..)
                .zip(tokens)
                .map(|(position, &token)| DecodeRow {
                    slot,
                    position,
                    token,
                })
                .collect();
            self.pass_with(&[], &rows, true)?;
        } else {
            self.pass_with(&[(slot, position, tokens)], &[], true)?;
        }
        self.verify_logits_kept = true;
        // Open only once the pass ran (as the CPU backend's): a failed pass left open would
        // refuse the sequence's drafts and let a cut back replay inputs it never kept.
        if let Some(d) = self.drafting.get_mut(&slot) {
            d.verify = Some((tokens.to_vec(), position));
        }
        Ok(())
    }

    /// Room for what a verify pass of `rows` rows keeps of its GDN states (see the top).
    fn reserve_verify_states(&mut self, rows: usize) -> Result<()> {
        let st = self.dev.stream().clone();
        let n_gdn = self.ssm.len();
        ensure!(rows >= 2, "a verify pass of {rows} rows (at least 2)");
        let rows = rows - 1; // the states after the last row are the slot's
        if self.verify_states.as_ref().is_some_and(|v| v.rows >= rows) {
            return Ok(());
        }
        // Growing drops what the open pass kept.
        ensure!(
            self.drafting.values().all(|d| d.verify.is_none()),
            "room for a longer verify pass while another sequence's is open (one at a time)"
        );
        // Freed before the larger ones are taken; the verify graphs, which write the states
        // where the old ones were, go with them.
        self.verify_states = None;
        self.decode_graphs.retain(|&(_, one_seq), _| !one_seq);
        self.verify_states = Some(VerifyStates::new(&st, n_gdn, rows)?);
        Ok(())
    }

    /// Every row's logits of the last verify pass (`rows` of them), as f32 `[rows][vocab]`.
    pub(super) fn verify_logits(&self, rows: usize) -> anyhow::Result<Vec<f32>> {
        let vocab = self.model.config.vocab_size;
        let logits: Vec<bf16> = self
            .dev
            .stream()
            .clone_dtoh(&self.s.logits.slice(..rows * vocab))
            .during(|| "copying the verify pass's logits".into())?;
        Ok(logits.iter().map(|x| x.to_f32()).collect())
    }

    /// Each row's argmax below `limit` of the last verify pass (`rows` of them): the pass's own
    /// argmax over the whole vocabulary, or the sampler's greedy rows over the prefix.
    pub(super) fn verify_argmax(&mut self, rows: usize, limit: usize) -> anyhow::Result<Vec<u32>> {
        let vocab = self.model.config.vocab_size;
        if limit < vocab {
            let greedy = DeviceSampling::greedy(limit.max(1));
            let draws: Vec<RowDraw> = (0..rows)
                .map(|row| RowDraw {
                    row,
                    sampling: &greedy,
                    u: 0.0,
                })
                .collect();
            self.k.sample.sample_rows(
                &self.s.logits.slice(..rows * vocab),
                vocab,
                &draws,
                &mut self.s.next.slice_mut(..rows),
            )?;
        }
        self.next_tokens(rows)
    }

    /// Whether the sequence in `slot` has a verify pass open.
    pub(super) fn verifying_slot(&self, slot: usize) -> bool {
        self.verify_rows(slot).is_some()
    }

    /// The rows of the verify pass open for the sequence in `slot`, if one is.
    pub(super) fn verify_rows(&self, slot: usize) -> Option<usize> {
        self.drafting
            .get(&slot)
            .and_then(|d| d.verify.as_ref())
            .map(|(tokens, _)| tokens.len())
    }

    /// Keeps the first `rows` rows of the open verify pass of `slot`; returns the position after
    /// them. The GDN states become those after the last kept row, copied from those the pass
    /// kept. Attention needs nothing, and the head keeps the kept rows' hidden states.
    pub(super) fn keep_verified_slot(&mut self, slot: usize, rows: usize) -> anyhow::Result<usize> {
        let d = self
            .drafting
            .get(&slot)
            .ok_or_else(|| anyhow::anyhow!("the sequence does not draft"))?;
        let ran = d
            .verify
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("no verify pass to cut back"))?
            .0
            .len();
        anyhow::ensure!(
            (1..=ran).contains(&rows),
            "keeping {rows} rows of a verify pass of {ran}"
        );
        let position = d.verify.as_ref().expect("checked above").1;
        if rows < ran {
            self.restore_kept_states(slot, rows)?;
        }
        // The pass closes only once the states are the kept rows' (a failed copy leaves it open).
        let d = self.drafting.get_mut(&slot).expect("checked above");
        d.verify = None;
        d.rows -= ran - rows;
        d.tokens.truncate(d.tokens.len() - (ran - rows));
        self.verify_logits_kept = false;
        Ok(position + rows)
    }

    /// The GDN states of `slot` after the first `rows` rows of its open verify pass.
    fn restore_kept_states(&mut self, slot: usize, rows: usize) -> anyhow::Result<()> {
        let kept = self
            .verify_states
            .as_mut()
            .ok_or_else(|| anyhow::anyhow!("the verify pass kept no GDN states"))?;
        let (ssm, conv) = (gdn::SSM_STATE_LEN, gdn::CONV_STATE_LEN);
        // The states after row rows − 1: every layer's in one launch (60 copies of their own cost
        // ≈ 3 µs each to enqueue).
        let from = rows - 1;
        anyhow::ensure!(from < kept.rows, "row {from} of {} kept states", kept.rows);
        let VerifyStates {
            ssm: kept_ssm,
            conv: kept_conv,
            rows: kept_rows,
            table,
        } = kept;
        let mut copies: Vec<gdn::StateCopy> = self
            .ssm
            .iter_mut()
            .zip(&mut self.conv)
            .enumerate()
            .map(|(g, (layer_ssm, layer_conv))| {
                let at = g * *kept_rows + from;
                gdn::StateCopy {
                    ssm_from: kept_ssm.slice(at * ssm..(at + 1) * ssm),
                    ssm_to: layer_ssm.slice_mut(slot * ssm..(slot + 1) * ssm),
                    conv_from: kept_conv.slice(at * conv..(at + 1) * conv),
                    conv_to: layer_conv.slice_mut(slot * conv..(slot + 1) * conv),
                }
            })
            .collect();
        self.k.gdn.copy_states(&mut copies, table)?;
        Ok(())
    }
}
