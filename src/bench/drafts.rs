//! Decode with the MTP head's drafts at a forced acceptance (`lily bench --forced-drafts`).
//!
//! A synthetic model's head is random, so its drafts are almost never right and a benchmark of
//! real drafting shows only its cost. Here every pass still runs the head and the verify pass as
//! decoding with drafts does, but the verify pass's picks are forced: each draft stands with
//! probability a, the first that does not is replaced by another token, and the picks after
//! follow (so the first m drafts of a pass stand with probability aᵐ, as with a head whose
//! drafts are right at rate a). The head, the verify pass and the cut back run on the tokens
//! this decides, so their cost is real; the tokens are not the model's greedy output. (Forcing
//! the drafts to plain decoding's tokens instead, which [`ForcedDrafts::new`] does for the
//! tests, works only where the drafted path picks exactly plain decoding's tokens: on the GPU
//! a random model's near-ties part the two paths within a few tokens, after which every draft
//! is wrong.) What this measures is what a checkpoint whose head reaches that acceptance would
//! decode at; the table says so.

use std::time::Instant;

use super::synthetic_prompt;
use crate::config::ModelConfig;
use crate::model::speculative::{self, DraftStats};
use crate::model::{Backend, SeqId};

/// One context and number of drafts: plain decoding against decoding with forced drafts.
#[derive(Debug, Clone, PartialEq)]
pub struct DraftPoint {
    pub context: usize,
    pub drafts: usize,
    /// The acceptance asked for, and the share of drafts that stood.
    pub forced: f64,
    pub accepted: f64,
    pub plain_tok_s: f64,
    pub drafted_tok_s: f64,
    /// Passes (verify passes and plain steps) for the decoded tokens.
    pub passes: usize,
    pub tokens: usize,
    /// Mean µs a pass of its parts, as the host waits for them: the head's drafts, the verify
    /// pass (with its picks), the cut back (its launches; what they leave to run shows in the
    /// next draft).
    pub draft_us: f64,
    pub verify_us: f64,
    pub keep_us: f64,
}

/// Tokens a sequence must have room for at `context`.
pub fn context_needed(context: usize, steps: usize, drafts: &[usize]) -> usize {
    context + WARM_UP_TOKENS + steps + 1 + drafts.iter().max().copied().unwrap_or(0)
}

/// Tokens the drafting run decodes before its clock starts: one pass with one draft, whose
/// head runs over the whole prompt first (prompt work, as the prefill is for plain decoding).
const WARM_UP_TOKENS: usize = 2;

/// After a prompt of `context` tokens: `steps` tokens of plain greedy decoding (timed from the
/// first decode step), then for each number of drafts `steps` tokens decoded with forced drafts
/// right at rate `acceptance`, timed from the second pass (the first runs the MTP head over the
/// prompt, which belongs to the prompt's time as prefill does). Sequences `seq` and `seq + 1`.
pub fn forced_drafts(
    backend: &mut dyn Backend,
    seq: SeqId,
    context: usize,
    drafts: &[usize],
    acceptance: f64,
    steps: usize,
) -> anyhow::Result<Vec<DraftPoint>> {
    anyhow::ensure!(steps >= 1, "at least one decode step");
    anyhow::ensure!(
        drafts.iter().all(|&k| k >= 1),
        "a pass drafts at least one token"
    );
    anyhow::ensure!(
        (0.0..=1.0).contains(&acceptance),
        "the acceptance is a probability"
    );
    anyhow::ensure!(
        backend.can_draft(),
        "{} cannot draft (a checkpoint with an MTP head, on a backend that drafts)",
        backend.device_name()
    );
    let vocab = backend.config().vocab_size;
    let prompt = synthetic_prompt(context, vocab, 7);
    // Plain decoding: the tokens the drafts are taken from, and the rate to beat.
    backend.create_sequence(seq)?;
    let plain = (|| -> anyhow::Result<(Vec<u32>, f64)> {
        let mut out = vec![backend.forward_greedy(seq, &prompt)?];
        let t = Instant::now();
        for _ in 0..steps {
            let last = *out.last().expect("one token at least");
            out.push(backend.forward_greedy(seq, &[last])?);
        }
        Ok((out, t.elapsed().as_secs_f64()))
    })();
    backend.free_sequence(seq);
    let (_, plain_s) = plain?;
    let mut points = Vec::new();
    for (i, &k) in drafts.iter().enumerate() {
        let drafted = seq + 1;
        let mut forced = ForcedDrafts::forcing_picks(&mut *backend, acceptance, i as u64 + 1);
        forced.create_sequence(drafted)?;
        let run = (|| -> anyhow::Result<(DraftStats, f64)> {
            forced.start_drafting(drafted)?;
            let first = forced.forward(drafted, &prompt)?;
            let mut out = vec![crate::model::argmax(&first)];
            let warm = 1 + WARM_UP_TOKENS;
            speculative::decode_greedy(&mut forced, drafted, &mut out, warm, k, |_| false)?;
            anyhow::ensure!(out.len() == warm, "the warm-up pass decoded {}", out.len());
            forced.seconds = [0.0; 3];
            let t = Instant::now();
            let stats = speculative::decode_greedy(
                &mut forced,
                drafted,
                &mut out,
                warm + steps,
                k,
                |_| false,
            )?;
            Ok((stats, t.elapsed().as_secs_f64()))
        })();
        forced.free_sequence(drafted);
        let [draft_s, verify_s, keep_s] = forced.seconds;
        let (stats, seconds) = run?;
        let per_pass = |s: f64| s * 1e6 / stats.passes.max(1) as f64;
        points.push(DraftPoint {
            context,
            drafts: k,
            forced: acceptance,
            accepted: stats.accepted as f64 / stats.drafted.max(1) as f64,
            plain_tok_s: steps as f64 / plain_s,
            drafted_tok_s: steps as f64 / seconds,
            passes: stats.passes,
            tokens: steps,
            draft_us: per_pass(draft_s),
            verify_us: per_pass(verify_s),
            keep_us: per_pass(keep_s),
        });
    }
    Ok(points)
}

/// The table.
pub fn to_markdown(points: &[DraftPoint]) -> String {
    let mut md = String::from(
        "The verify passes' picks forced, each draft standing at the given rate (a random head \
         drafts nothing right; the head, verify passes and cut backs run on the tokens this \
         decides): what a head of that acceptance would give. Drafts kept is the share of drafts \
         that stood (a pass ends at its first wrong draft: a + a² + … + a^k of k in \
         expectation, 0.65 for k = 3 at 0.8). Timed from the second pass: the first runs the head \
         over the prompt.\n\n\
         | context | drafts a pass | acceptance forced / drafts kept | plain tok/s | with drafts tok/s | × plain | passes for the tokens | µs a pass: drafts / verify / cut back |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for p in points {
        md += &format!(
            "| {} | {} | {:.2} / {:.2} | {:.1} | {:.1} | {:.2} | {} / {} | {:.0} / {:.0} / {:.0} |\n",
            p.context,
            p.drafts,
            p.forced,
            p.accepted,
            p.plain_tok_s,
            p.drafted_tok_s,
            p.drafted_tok_s / p.plain_tok_s,
            p.passes,
            p.tokens,
            p.draft_us,
            p.verify_us,
            p.keep_us
        );
    }
    md
}

/// A backend whose drafts stand at rate a, the head still running for every draft, so the cost
/// is real: either the drafts are `truth`'s next tokens, each wrong with probability 1 − a (the
/// tests that need every number of kept drafts, which a random head cannot give, where the
/// drafted path picks exactly `truth`'s tokens), or the head's own drafts stand by the verify
/// pass's picks forced (this benchmark: any path).
pub struct ForcedDrafts<'a> {
    inner: &'a mut dyn Backend,
    /// The prompt, then plain decoding's tokens (`None`: the picks are forced).
    truth: Option<Vec<u32>>,
    /// Rows the model has kept.
    position: usize,
    acceptance: f64,
    /// splitmix64 state for the coin flips.
    state: u64,
    /// Seconds in the drafts, the verify passes and the cut backs.
    seconds: [f64; 3],
}

impl<'a> ForcedDrafts<'a> {
    /// Over `inner`: `truth` is the prompt, then plain greedy decoding's tokens; `seed` seeds
    /// the coin flips.
    pub fn new(inner: &'a mut dyn Backend, truth: Vec<u32>, acceptance: f64, seed: u64) -> Self {
        ForcedDrafts {
            truth: Some(truth),
            ..Self::forcing_picks(inner, acceptance, seed)
        }
    }

    /// Over `inner`: the head's drafts, each standing with probability `acceptance` by the
    /// verify pass's picks forced (the first draft that does not gets another token in its
    /// place); `seed` seeds the coin flips.
    pub fn forcing_picks(inner: &'a mut dyn Backend, acceptance: f64, seed: u64) -> Self {
        ForcedDrafts {
            inner,
            truth: None,
            position: 0,
            acceptance,
            state: 0x9E37_79B9_7F4A_7C15 ^ seed,
            seconds: [0.0; 3],
        }
    }

    /// Rows the model has kept since the sequence was created.
    pub fn position(&self) -> usize {
        self.position
    }

    fn coin(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
}

impl Backend for ForcedDrafts<'_> {
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }
    fn device_name(&self) -> String {
        self.inner.device_name()
    }
    fn create_sequence(&mut self, seq: SeqId) -> anyhow::Result<()> {
        self.position = 0;
        self.inner.create_sequence(seq)
    }
    fn free_sequence(&mut self, seq: SeqId) {
        self.inner.free_sequence(seq)
    }
    fn forward(&mut self, seq: SeqId, tokens: &[u32]) -> anyhow::Result<Vec<f32>> {
        self.position += tokens.len();
        self.inner.forward(seq, tokens)
    }
    fn can_draft(&self) -> bool {
        self.inner.can_draft()
    }
    fn start_drafting(&mut self, seq: SeqId) -> anyhow::Result<()> {
        self.inner.start_drafting(seq)
    }
    fn draft(&mut self, seq: SeqId, next: u32, k: usize) -> anyhow::Result<Vec<u32>> {
        let t = Instant::now();
        let head = self.inner.draft(seq, next, k)?;
        self.seconds[0] += t.elapsed().as_secs_f64();
        anyhow::ensure!(head.len() == k, "{} drafts for {k}", head.len());
        let Some(truth) = &self.truth else {
            return Ok(head);
        };
        let vocab = self.config().vocab_size as u32;
        let right: Vec<u32> = (0..k)
            .map(|j| truth.get(self.position + 1 + j).copied().unwrap_or(0))
            .collect();
        Ok(right
            .into_iter()
            .map(|right| {
                if self.coin() < self.acceptance {
                    right
                } else {
                    (right + 1) % vocab
                }
            })
            .collect())
    }
    fn forward_verify_argmax(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        vocab_limit: usize,
    ) -> anyhow::Result<Vec<u32>> {
        let t = Instant::now();
        let mut picks = self.inner.forward_verify_argmax(seq, tokens, vocab_limit)?;
        self.seconds[1] += t.elapsed().as_secs_f64();
        if self.truth.is_none() {
            // Each draft stands or not by a coin; the first that does not gets another token.
            for (pick, &draft) in picks.iter_mut().zip(&tokens[1..]) {
                if self.coin() < self.acceptance {
                    *pick = draft;
                } else {
                    *pick = (draft + 1) % vocab_limit.max(2) as u32;
                    break;
                }
            }
        }
        Ok(picks)
    }
    fn verified_logits(&mut self, seq: SeqId, row: usize) -> anyhow::Result<Vec<f32>> {
        self.inner.verified_logits(seq, row)
    }
    fn forward_verify(&mut self, seq: SeqId, tokens: &[u32]) -> anyhow::Result<Vec<f32>> {
        self.inner.forward_verify(seq, tokens)
    }
    fn keep_verified(&mut self, seq: SeqId, rows: usize) -> anyhow::Result<()> {
        self.position += rows;
        let t = Instant::now();
        let kept = self.inner.keep_verified(seq, rows);
        self.seconds[2] += t.elapsed().as_secs_f64();
        kept
    }
}
