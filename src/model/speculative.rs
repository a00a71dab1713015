//! Speculative decoding with the MTP head's drafts (MODEL.md §4.2): each pass runs the next
//! token and k drafts of the tokens after it; the drafts that match what the model itself picks
//! are kept, with the model's token after them. Greedy output is plain greedy decoding's, in
//! fewer passes the more drafts are right: exactly on the CPU (its verify pass has one-token
//! decoding's bits), up to near-ties on the GPU (its verify pass rounds as a prompt does).

use super::{argmax, Backend, SeqId};

/// How a speculative generation went.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DraftStats {
    /// Passes of the model after the prompt (verify passes, and plain steps where no draft fit).
    pub passes: usize,
    /// Tokens drafted and checked.
    pub drafted: usize,
    /// Drafts that matched.
    pub accepted: usize,
}

/// Generates up to `max_tokens` greedy tokens after `prompt` for `seq` (created, nothing run),
/// drafting up to `k` tokens a pass; ends after a token for which `stop` is true (it is kept).
pub fn greedy(
    backend: &mut dyn Backend,
    seq: SeqId,
    prompt: &[u32],
    max_tokens: usize,
    k: usize,
    stop: impl Fn(u32) -> bool,
) -> anyhow::Result<(Vec<u32>, DraftStats)> {
    anyhow::ensure!(!prompt.is_empty(), "no prompt");
    let mut out = Vec::with_capacity(max_tokens);
    if max_tokens == 0 {
        return Ok((out, DraftStats::default()));
    }
    backend.start_drafting(seq)?;
    out.push(argmax(&backend.forward(seq, prompt)?));
    let stats = decode_greedy(backend, seq, &mut out, max_tokens, k, stop)?;
    Ok((out, stats))
}

/// Greedy decoding with drafts of a drafting sequence whose last token `out` ends with (picked,
/// not run yet), until `out` holds `max_tokens` or ends with a token for which `stop` is true.
pub fn decode_greedy(
    backend: &mut dyn Backend,
    seq: SeqId,
    out: &mut Vec<u32>,
    max_tokens: usize,
    k: usize,
    stop: impl Fn(u32) -> bool,
) -> anyhow::Result<DraftStats> {
    let mut stats = DraftStats::default();
    let vocab = backend.config().vocab_size;
    let mut token = *out
        .last()
        .ok_or_else(|| anyhow::anyhow!("no token to go on from"))?;
    while out.len() < max_tokens && !stop(token) {
        let k_now = k.min(max_tokens - out.len() - 1);
        if k_now == 0 {
            token = argmax(&backend.forward(seq, &[token])?);
            stats.passes += 1;
            out.push(token);
            continue;
        }
        let drafts = backend.draft(seq, token, k_now)?;
        let rows: Vec<u32> = [token].into_iter().chain(drafts.iter().copied()).collect();
        let picks = backend.forward_verify_argmax(seq, &rows, vocab)?;
        anyhow::ensure!(picks.len() == rows.len(), "a pick for every row");
        let matched = drafts
            .iter()
            .zip(&picks)
            .take_while(|(d, p)| d == p)
            .count();
        stats.passes += 1;
        stats.drafted += drafts.len();
        stats.accepted += matched;
        // The model's picks up to and including its first disagreement with the drafts.
        let mut kept = 0;
        for &pick in &picks[..=matched] {
            out.push(pick);
            kept += 1;
            if stop(pick) || out.len() == max_tokens {
                break;
            }
        }
        backend.keep_verified(seq, kept)?;
        token = picks[kept - 1];
    }
    Ok(stats)
}
