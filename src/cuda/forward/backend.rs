//! The [`Backend`] face of the CUDA backend: sequences in state slots, steps, batches of steps
//! as shared passes, and snapshots.

use std::panic::{catch_unwind, AssertUnwindSafe};

use half::bf16;

use super::{batch_rows, CudaBackend, DecodeRow, Sequence};
use crate::config::ModelConfig;
use crate::cuda::gdn;
use crate::cuda::profile::{self, OpProfile};
use crate::cuda::sample::{RowDraw, SampleKernels};
use crate::cuda::snapshot::{KeptStates, StatePools};
use crate::cuda::timeline::Timeline;
use crate::cuda::{Context, Result};
use crate::model::passes::{self, PassLimits, PassStep};
use crate::model::{
    panic_message, Backend, DecodeTimeline, OpTime, RoutingTrace, SeqId, Snapshot, SnapshotId,
    Step, StepOutput,
};
use crate::sampling::DeviceSampling;

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
        st.memcpy_htod(&[slot as i32], &mut self.s.slots.slice_mut(..1))
            .during(|| "copying the slot".into())?;
        for (ssm, conv) in self.ssm.iter_mut().zip(self.conv.iter_mut()) {
            self.k.gdn.zero(
                &mut ssm.as_view_mut(),
                &mut conv.as_view_mut(),
                Some(&self.s.slots.slice(..1)),
            )?;
        }
        self.sequences.insert(seq, Sequence { slot, position: 0 });
        Ok(())
    }
    fn free_sequence(&mut self, seq: SeqId) {
        if let Some(s) = self.sequences.remove(&seq) {
            self.stop_drafting_slot(s.slot);
            self.before_last.remove(&s.slot);
            self.free_slots.push(s.slot);
        }
    }
    fn can_draft(&self) -> bool {
        self.has_head()
    }
    fn start_drafting(&mut self, seq: SeqId) -> anyhow::Result<()> {
        let s = self.sequence(seq)?;
        anyhow::ensure!(
            s.position == 0,
            "a sequence starts drafting before its first token"
        );
        let slot = s.slot;
        Ok(self.start_drafting_slot(slot)?)
    }
    fn draft(&mut self, seq: SeqId, next: u32, k: usize) -> anyhow::Result<Vec<u32>> {
        let slot = self.sequence(seq)?.slot;
        self.draft_slot(slot, next, k)
    }
    fn forward_verify(&mut self, seq: SeqId, tokens: &[u32]) -> anyhow::Result<Vec<f32>> {
        self.verify(seq, tokens)?;
        self.verify_logits(tokens.len())
    }
    fn forward_verify_argmax(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        vocab_limit: usize,
    ) -> anyhow::Result<Vec<u32>> {
        self.verify(seq, tokens)?;
        self.verify_argmax(tokens.len(), vocab_limit)
    }
    fn verified_logits(&mut self, seq: SeqId, row: usize) -> anyhow::Result<Vec<f32>> {
        let slot = self.sequence(seq)?.slot;
        let ran = self
            .verify_rows(slot)
            .ok_or_else(|| anyhow::anyhow!("sequence {seq} has no verify pass open"))?;
        // As the CPU backend: a row past the pass's would read another pass's logits (or
        // past the buffer).
        anyhow::ensure!(row < ran, "row {row} of a verify pass of {ran}");
        // Another sequence's pass (or drafts) since would have written over them.
        anyhow::ensure!(
            self.verify_logits_kept,
            "sequence {seq}'s verify logits were overwritten by a later pass"
        );
        self.row_logits(row)
    }
    fn keep_verified(&mut self, seq: SeqId, rows: usize) -> anyhow::Result<()> {
        let slot = self.sequence(seq)?.slot;
        let position = self.keep_verified_slot(slot, rows)?;
        if let Some(s) = self.sequences.get_mut(&seq) {
            s.position = position;
        }
        Ok(())
    }
    fn prepare_decode(&mut self, max_batch: usize) -> anyhow::Result<()> {
        Ok(self.capture_decode_graphs(max_batch)?)
    }
    fn forward(&mut self, seq: SeqId, tokens: &[u32]) -> anyhow::Result<Vec<f32>> {
        self.step(seq, tokens)?;
        self.row_logits(0)
    }
    fn forward_greedy(&mut self, seq: SeqId, tokens: &[u32]) -> anyhow::Result<u32> {
        self.step(seq, tokens)?;
        Ok(self.next_tokens(1)?[0])
    }
    fn forward_sample(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        sampling: &DeviceSampling,
        u: f64,
    ) -> anyhow::Result<u32> {
        self.step(seq, tokens)?;
        self.pick(sampling, u)?;
        Ok(self.next_tokens(1)?[0])
    }
    /// With [`CudaOptions::batch_steps`](super::CudaOptions), the steps run as shared passes
    /// (prompt chunks and decode tokens of up to `max_sequences` sequences, up to
    /// `prefill_chunk` rows); a step no pass can take, or alone in its pass, runs by itself, so a
    /// bad step fails alone.
    fn forward_batch(&mut self, steps: &[Step]) -> Vec<anyhow::Result<StepOutput>> {
        let mut results: Vec<Option<anyhow::Result<StepOutput>>> =
            steps.iter().map(|_| None).collect();
        if self.options.batch_steps {
            for pass in self.plan_passes(steps) {
                if pass.len() < 2 {
                    continue;
                }
                let outcome = catch_unwind(AssertUnwindSafe(|| self.run_pass(steps, &pass)))
                    .unwrap_or_else(|panic| {
                        Err(anyhow::anyhow!("internal error: {}", panic_message(panic)))
                    });
                self.shared_passes += 1;
                match outcome {
                    Ok(outputs) => {
                        for (p, out) in pass.iter().zip(outputs) {
                            results[p.index] = Some(out);
                        }
                    }
                    Err(e) => {
                        let why = format!("{e:#}");
                        for p in &pass {
                            results[p.index] = Some(Err(anyhow::anyhow!("{why}")));
                        }
                    }
                }
            }
        }
        steps
            .iter()
            .zip(results)
            .map(|(step, done)| {
                done.unwrap_or_else(|| {
                    catch_unwind(AssertUnwindSafe(|| self.forward_step(step))).unwrap_or_else(
                        |panic| Err(anyhow::anyhow!("internal error: {}", panic_message(panic))),
                    )
                })
            })
            .collect()
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
        let head = self.save_head(slot)?;
        let pools = StatePools {
            ssm: &mut self.ssm,
            conv: &mut self.conv,
            kv: &mut self.kv,
        };
        let mut snapshot = self
            .snapshots
            .take(self.dev.stream(), pools, slot, position)?;
        if let Some(head) = head {
            snapshot.bytes += head.bytes();
            self.head_snapshots.insert(snapshot.id, head);
        }
        Ok(snapshot)
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
        let head = self.head_snapshots.remove(&snapshot);
        let restored = self.restore_head(slot, position, head.as_ref());
        if let Some(head) = head {
            self.head_snapshots.insert(snapshot, head);
        }
        restored?;
        Ok(position)
    }
    fn can_keep_state_before_last(&self) -> bool {
        self.options.keep_before_last
    }
    fn keep_state_before_last(&mut self, seq: SeqId) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.options.keep_before_last,
            "keeping states before a step's last token is off (LILY_KEEP_BEFORE_LAST=0)"
        );
        let slot = self.sequence(seq)?.slot;
        // (A drafting sequence's snapshot carries its head's rows, which this does not keep.)
        anyhow::ensure!(
            !self.drafting.contains_key(&slot),
            "sequence {seq} drafts: its states before a step's last token are not kept"
        );
        let kept = match self.before_last.remove(&slot) {
            Some(mut k) => {
                k.position = None;
                k
            }
            None => KeptStates::new(self.dev.stream(), self.ssm.len())?,
        };
        self.before_last.insert(slot, kept);
        Ok(())
    }
    fn snapshot_before_last(&mut self, seq: SeqId) -> anyhow::Result<Snapshot> {
        let s = self.sequence(seq)?;
        let slot = s.slot;
        let Some(kept) = self.before_last.remove(&slot) else {
            anyhow::bail!("sequence {seq} kept no states before a step's last token");
        };
        let Some(position) = kept.position else {
            self.before_last.insert(slot, kept);
            anyhow::bail!("sequence {seq} has not run the step that keeps its states");
        };
        let mut kept = Some(kept);
        let pools = StatePools {
            ssm: &mut self.ssm,
            conv: &mut self.conv,
            kv: &mut self.kv,
        };
        let taken = self
            .snapshots
            .take_with(self.dev.stream(), pools, slot, position, &mut kept);
        if let Some(kept) = kept {
            // Not taken (out of memory, say): left for another try.
            self.before_last.insert(slot, kept);
        }
        Ok(taken?)
    }
    fn drop_snapshot(&mut self, snapshot: SnapshotId) {
        self.snapshots.drop_snapshot(snapshot);
        self.head_snapshots.remove(&snapshot);
    }
    fn peak_memory(&self) -> Option<u64> {
        Some(self.peak_memory)
    }
    fn reset_peak_memory(&mut self) {
        self.peak_memory = 0;
    }
    fn set_op_timing(&mut self, on: bool) -> bool {
        self.profile = on.then(OpProfile::default);
        true
    }
    fn take_op_times(&mut self) -> Vec<OpTime> {
        self.profile.as_mut().map_or_else(Vec::new, OpProfile::take)
    }
    fn start_timeline(&mut self) -> anyhow::Result<bool> {
        anyhow::ensure!(self.timeline.is_none(), "a timeline is already being taken");
        self.timeline = Some((Timeline::install(&self.dev)?, None));
        Ok(true)
    }
    fn stop_timeline(&mut self) -> anyhow::Result<Option<DecodeTimeline>> {
        let Some((timeline, batch)) = self.timeline.take() else {
            return Ok(None);
        };
        let (stamps, blocks) = timeline.uninstall(&self.dev)?;
        let Some(batch) = batch else {
            return Ok(None);
        };
        use crate::model::timeline::{per_launch, stamped_labels};
        // cuBLAS's kernels (batched passes' dense products, forward/projection.rs) do not stamp.
        let labels = stamped_labels(&self.decode_graphs[&(batch, false)].1, |k| {
            k == profile::CUBLAS
        });
        let mut t = per_launch(&stamps, &labels)?;
        t.blocks = blocks;
        Ok(Some(t))
    }
    fn trace_routing(&mut self) -> bool {
        self.routing = Some(RoutingTrace::new(self.model.layers.len()));
        true
    }
    fn take_routing_trace(&mut self) -> Option<RoutingTrace> {
        self.routing.take()
    }
}

impl CudaBackend {
    /// A verify pass of `tokens` for `seq` (forward/mtp.rs), the sequence advanced past them.
    fn verify(&mut self, seq: SeqId, tokens: &[u32]) -> anyhow::Result<()> {
        let s = self.sequence(seq)?;
        let (slot, position) = (s.slot, s.position);
        self.verify_slot(slot, position, tokens)?;
        if let Some(s) = self.sequences.get_mut(&seq) {
            s.position += tokens.len();
        }
        self.note_peak_memory();
        Ok(())
    }

    fn sequence(&self, seq: SeqId) -> anyhow::Result<&Sequence> {
        self.sequences
            .get(&seq)
            .ok_or_else(|| anyhow::anyhow!("unknown sequence {seq}"))
    }

    /// Runs `tokens` of `seq`: its logits in row 0 of `s.logits`, its greedy next token in
    /// `s.next[0]`.
    fn step(&mut self, seq: SeqId, tokens: &[u32]) -> anyhow::Result<()> {
        anyhow::ensure!(!tokens.is_empty(), "no tokens to run");
        let s = self.sequence(seq)?;
        let (slot, position) = (s.slot, s.position);
        // As the CPU backend: rows run past an open verify pass would be lost to its cut back
        // (which puts back the GDN states of before the pass).
        anyhow::ensure!(
            !self.verifying_slot(slot),
            "sequence {seq} runs on before its verify pass was cut back"
        );
        self.run(slot, position, tokens)?;
        if let Some(s) = self.sequences.get_mut(&seq) {
            s.position += tokens.len();
        }
        self.note_peak_memory();
        Ok(())
    }

    /// Everything lily allocates is allocated up front, so the device's memory in use after a
    /// call is its peak for that call (other processes on the GPU would count too).
    fn note_peak_memory(&mut self) {
        if let Ok((free, total)) = cudarc::driver::result::mem_get_info() {
            self.peak_memory = self.peak_memory.max((total - free) as u64);
        }
    }

    /// The steps that can share passes ([`passes::plan`]): besides what `plan` checks, token
    /// ids in the vocabulary, room in the context, and sampling parameters the sampler takes;
    /// a pass holds up to `s.rows` rows and `batch_rows` sequences.
    fn plan_passes(&self, steps: &[Step]) -> Vec<Vec<PassStep>> {
        let vocab = self.model.config.vocab_size;
        let limits = PassLimits {
            rows: self.s.rows,
            sequences: batch_rows(&self.options),
        };
        let sequence = |seq| self.sequences.get(&seq).map(|s| (s.slot, s.position));
        let runnable = |step: &Step, position: usize| {
            // A sequence with a verify pass open runs alone, which refuses it (`step`).
            let verifying = self
                .sequences
                .get(&step.seq)
                .is_some_and(|s| self.verifying_slot(s.slot));
            !verifying
                && step.tokens.iter().all(|&t| (t as usize) < vocab)
                && position + step.tokens.len() <= self.options.max_context
                && step
                    .sample
                    .is_none_or(|(sampling, u)| SampleKernels::accepts(sampling, u, vocab))
        };
        passes::plan(steps, limits, sequence, runnable)
    }

    /// One shared pass over `pass` (from [`plan_passes`](Self::plan_passes)): prompt chunks as
    /// spans, single tokens as decode rows; each step's token picked on the device or its logits
    /// copied back, as it asks. An error of the pass fails all its steps; a step whose logits
    /// have no finite value fails alone.
    fn run_pass(
        &mut self,
        steps: &[Step],
        pass: &[PassStep],
    ) -> anyhow::Result<Vec<anyhow::Result<StepOutput>>> {
        let (chunks, tokens): (Vec<&PassStep>, Vec<&PassStep>) =
            pass.iter().partition(|p| steps[p.index].tokens.len() > 1);
        let spans: Vec<(usize, usize, &[u32])> = chunks
            .iter()
            .map(|p| (p.slot, p.position, steps[p.index].tokens))
            .collect();
        let rows: Vec<DecodeRow> = tokens
            .iter()
            .map(|p| DecodeRow {
                slot: p.slot,
                position: p.position,
                token: steps[p.index].tokens[0],
            })
            .collect();
        self.pass(&spans, &rows)?;
        // Every sequence of the pass has advanced on the device.
        for p in pass {
            let step = &steps[p.index];
            if let Some(s) = self.sequences.get_mut(&step.seq) {
                s.position += step.tokens.len();
            }
        }
        self.note_peak_memory();
        // Logits rows: the spans' in order, then the decode rows'.
        let (mut span_row, mut decode_row) = (0, spans.len());
        let row_of: Vec<usize> = pass
            .iter()
            .map(|p| {
                let row = if steps[p.index].tokens.len() > 1 {
                    &mut span_row
                } else {
                    &mut decode_row
                };
                *row += 1;
                *row - 1
            })
            .collect();
        // Every row the pass's own argmax does not answer is drawn by the sampler, all in one
        // set of launches: greedy over the tokenizer's ids too (a real checkpoint's every greedy
        // request), which the sampler's first two launches finish for all such rows at once.
        let vocab = self.model.config.vocab_size;
        let draws: Vec<RowDraw> = pass
            .iter()
            .zip(&row_of)
            .filter_map(|(p, &row)| {
                let (sampling, u) = steps[p.index].sample?;
                (!argmax_is_the_pick(sampling, vocab)).then_some(RowDraw { row, sampling, u })
            })
            .collect();
        let n = pass.len();
        self.k.sample.sample_rows(
            &self.s.logits.slice(..n * vocab),
            vocab,
            &draws,
            &mut self.s.next.slice_mut(..n),
        )?;
        let next = self.picked(n)?;
        Ok(pass
            .iter()
            .zip(&row_of)
            .map(|(p, &r)| match steps[p.index].sample {
                Some(_) => self.token(next[r]).map(StepOutput::Token),
                // Only the rows whose step asked for its logits come back (≈ 0.5 MB each): one
                // such step in a pass of 64 copied all 64 rows' before.
                None => self.row_logits(r).map(StepOutput::Logits),
            })
            .collect())
    }

    /// Logits row `row` of the last pass, as f32.
    fn row_logits(&self, row: usize) -> anyhow::Result<Vec<f32>> {
        let vocab = self.model.config.vocab_size;
        let logits: Vec<bf16> = self
            .dev
            .stream()
            .clone_dtoh(&self.s.logits.slice(row * vocab..(row + 1) * vocab))
            .during(|| "copying logits".into())?;
        Ok(logits.iter().map(|x| x.to_f32()).collect())
    }

    /// Picks the token after a one-sequence step's logits into `s.next[0]` as `sampling` says:
    /// plain greedy is the argmax the pass already left there, greedy over the tokenizer's ids
    /// only (a real checkpoint's padding rows masked) the argmax of the row's prefix, anything
    /// else the sampler's draw at `u`.
    fn pick(&mut self, sampling: &DeviceSampling, u: f64) -> Result<()> {
        let vocab = self.model.config.vocab_size;
        if argmax_is_the_pick(sampling, vocab) {
            return Ok(());
        }
        let limit = sampling.vocab_limit.min(vocab);
        let logits = self.s.logits.slice(..vocab);
        let mut next = self.s.next.slice_mut(..1);
        if sampling.is_greedy() && sampling.history.is_empty() && limit > 0 {
            self.k
                .sample
                .argmax(&logits.slice(..limit), limit, &mut next)
        } else {
            self.k.sample.sample(&logits, sampling, u, &mut next)
        }
    }

    /// The first `n` picked tokens as the kernels left them.
    fn picked(&self, n: usize) -> Result<Vec<i32>> {
        self.dev
            .stream()
            .clone_dtoh(&self.s.next.slice(..n))
            .during(|| "copying the picked tokens".into())
    }

    /// A picked token; none in the vocabulary (-1 from the sampler, or the argmax of a row of
    /// NaNs) means no logit was finite.
    pub(super) fn token(&self, picked: i32) -> anyhow::Result<u32> {
        u32::try_from(picked)
            .ok()
            .filter(|&t| (t as usize) < self.model.config.vocab_size)
            .ok_or_else(|| anyhow::anyhow!("no logit is finite (all NaN or -inf)"))
    }

    /// The first `n` picked tokens; see [`token`](Self::token).
    pub(super) fn next_tokens(&self, n: usize) -> anyhow::Result<Vec<u32>> {
        self.picked(n)?.into_iter().map(|t| self.token(t)).collect()
    }

    /// Passes [`forward_batch`](Backend::forward_batch) ran with more than one step (tests
    /// check that batching happened).
    pub fn shared_passes(&self) -> usize {
        self.shared_passes
    }
}

/// Whether the argmax every pass leaves per row (over the whole vocabulary, no penalties) is
/// the token `sampling` picks.
fn argmax_is_the_pick(sampling: &DeviceSampling, vocab: usize) -> bool {
    sampling.is_greedy() && sampling.history.is_empty() && sampling.vocab_limit >= vocab
}
