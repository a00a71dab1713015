//! The [`Backend`] face of the CUDA backend: sequences in state slots, steps, batches of decode
//! steps as one pass, and snapshots.

use std::panic::{catch_unwind, AssertUnwindSafe};

use half::bf16;

use super::{batch_rows, CudaBackend, DecodeRow, Sequence};
use crate::config::ModelConfig;
use crate::cuda::gdn;
use crate::cuda::snapshot::StatePools;
use crate::cuda::{Context, Result};
use crate::model::{panic_message, Backend, SeqId, Snapshot, SnapshotId, Step, StepOutput};
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
            self.free_slots.push(s.slot);
        }
    }
    fn forward(&mut self, seq: SeqId, tokens: &[u32]) -> anyhow::Result<Vec<f32>> {
        self.step(seq, tokens)?;
        let vocab = self.model.config.vocab_size;
        let logits: Vec<bf16> = self
            .dev
            .stream()
            .clone_dtoh(&self.s.logits.slice(..vocab))
            .during(|| "copying logits".into())?;
        Ok(logits.iter().map(|x| x.to_f32()).collect())
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
        self.pick(0, sampling, u)?;
        Ok(self.next_tokens(1)?[0])
    }
    /// With [`CudaOptions::batch_decode`](super::CudaOptions), the decode steps (one token each)
    /// run as passes of up to `max_sequences` rows; prefill chunks, and any step a pass would
    /// refuse, run one by one, so a bad step fails alone.
    fn forward_batch(&mut self, steps: &[Step]) -> Vec<anyhow::Result<StepOutput>> {
        let mut results: Vec<Option<anyhow::Result<StepOutput>>> =
            steps.iter().map(|_| None).collect();
        if self.options.batch_decode {
            let rows = self.decode_rows(steps);
            for pass in rows.chunks(batch_rows(&self.options)) {
                if pass.len() < 2 {
                    continue;
                }
                let outcome = catch_unwind(AssertUnwindSafe(|| self.decode_steps(steps, pass)))
                    .unwrap_or_else(|panic| {
                        Err(anyhow::anyhow!("internal error: {}", panic_message(panic)))
                    });
                match outcome {
                    Ok(outputs) => {
                        for ((i, ..), out) in pass.iter().zip(outputs) {
                            results[*i] = Some(Ok(out));
                        }
                    }
                    Err(e) => {
                        let why = format!("{e:#}");
                        for (i, ..) in pass {
                            results[*i] = Some(Err(anyhow::anyhow!("{why}")));
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
}

impl CudaBackend {
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

    /// The decode steps a pass can take, as (index in `steps`, sequence, row): one token, a
    /// known sequence not already taken, a token id in the vocabulary, room in the context.
    /// The others are left to the one-by-one path, which reports what is wrong with them.
    fn decode_rows(&self, steps: &[Step]) -> Vec<(usize, SeqId, DecodeRow)> {
        let vocab = self.model.config.vocab_size;
        let mut rows: Vec<(usize, SeqId, DecodeRow)> = Vec::new();
        for (i, step) in steps.iter().enumerate() {
            let (&[token], Some(s)) = (step.tokens, self.sequences.get(&step.seq)) else {
                continue;
            };
            let fits = (token as usize) < vocab && s.position < self.options.max_context;
            if fits && rows.iter().all(|(_, seq, _)| *seq != step.seq) {
                let row = DecodeRow {
                    slot: s.slot,
                    position: s.position,
                    token,
                };
                rows.push((i, step.seq, row));
            }
        }
        rows
    }

    /// One decode pass over `pass` (from [`decode_rows`](Self::decode_rows)); each row's
    /// token picked on the device or its logits copied back, as its step asks.
    fn decode_steps(
        &mut self,
        steps: &[Step],
        pass: &[(usize, SeqId, DecodeRow)],
    ) -> anyhow::Result<Vec<StepOutput>> {
        let rows: Vec<DecodeRow> = pass.iter().map(|(_, _, row)| *row).collect();
        self.decode(&rows)?;
        for (r, (i, ..)) in pass.iter().enumerate() {
            if let Some((sampling, u)) = steps[*i].sample {
                self.pick(r, sampling, u)?;
            }
        }
        let b = rows.len();
        let next = self.next_tokens(b);
        let vocab = self.model.config.vocab_size;
        let logits: Vec<bf16> = if pass.iter().any(|(i, ..)| steps[*i].sample.is_none()) {
            self.dev
                .stream()
                .clone_dtoh(&self.s.logits.slice(..b * vocab))
                .during(|| "copying logits".into())?
        } else {
            Vec::new()
        };
        for (_, seq, _) in pass {
            if let Some(s) = self.sequences.get_mut(seq) {
                s.position += 1;
            }
        }
        self.note_peak_memory();
        let next = next?;
        Ok(pass
            .iter()
            .enumerate()
            .map(|(r, (i, ..))| match steps[*i].sample {
                Some(_) => StepOutput::Token(next[r]),
                None => StepOutput::Logits(
                    logits[r * vocab..(r + 1) * vocab]
                        .iter()
                        .map(|x| x.to_f32())
                        .collect(),
                ),
            })
            .collect())
    }

    /// Picks the token after logits row `row` as `sampling` says, into `s.next[row]`. Plain
    /// greedy is the argmax the pass already left there; greedy over the tokenizer's ids only
    /// (a real checkpoint's padding rows masked) the argmax of the row's prefix.
    fn pick(&mut self, row: usize, sampling: &DeviceSampling, u: f64) -> Result<()> {
        let vocab = self.model.config.vocab_size;
        let limit = sampling.vocab_limit.min(vocab);
        let greedy = sampling.is_greedy() && sampling.history.is_empty();
        if greedy && limit == vocab {
            return Ok(());
        }
        let logits = self.s.logits.slice(row * vocab..(row + 1) * vocab);
        let mut next = self.s.next.slice_mut(row..row + 1);
        if greedy && limit > 0 {
            self.k
                .sample
                .argmax(&logits.slice(..limit), limit, &mut next)
        } else {
            self.k.sample.sample(&logits, sampling, u, &mut next)
        }
    }

    /// The first `n` picked tokens; -1 (no finite logit) is an error.
    fn next_tokens(&self, n: usize) -> anyhow::Result<Vec<u32>> {
        let next: Vec<i32> = self
            .dev
            .stream()
            .clone_dtoh(&self.s.next.slice(..n))
            .during(|| "copying the picked tokens".into())?;
        next.into_iter()
            .map(|t| {
                u32::try_from(t)
                    .map_err(|_| anyhow::anyhow!("no logit is finite (all NaN or -inf)"))
            })
            .collect()
    }
}
