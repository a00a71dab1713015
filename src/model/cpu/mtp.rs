//! The MTP head (MODEL.md §4): one more decoder layer that drafts the token after next from the
//! model's final-normed hidden state and the next token's embedding, and the drafting of a
//! sequence with it (§4.2).

use super::ops::{matmul, rms_norm_rows};
use super::{attention, decoder_layer, moe, Logits};
use crate::model::argmax;
use crate::model::state::{KvCache, SequenceState};
use crate::model::weights::{Mixer, MtpWeights, Weights};

/// Runs the head over `next.len()` rows of one sequence at positions `start ..`, appending to
/// its cache `kv`: row i takes `hidden` row i (a final-normed hidden state `[hidden]`, of the
/// token at `start + i`) and the token `next[i]` (at `start + i + 1`). Returns the head's
/// normed outputs `[rows, hidden]` (what a following draft step takes as its hidden state) and
/// the logits of the rows `which` names; row i's predict the token at `start + i + 2`.
pub fn forward(
    w: &Weights,
    mtp: &MtpWeights,
    hidden: &[f32],
    next: &[u32],
    start: usize,
    kv: &mut KvCache,
    which: Logits,
) -> (Vec<f32>, Vec<f32>) {
    let c = &w.config;
    let (hd, t) = (c.hidden_size, next.len());
    assert!(
        t > 0 && hidden.len() == t * hd,
        "one hidden state per next token"
    );
    let mut embedded = vec![0f32; t * hd];
    for (row, &token) in embedded.chunks_exact_mut(hd).zip(next) {
        w.embed.row_into(token as usize, row);
    }
    let e = rms_norm_rows(&embedded, &mtp.embedding_norm, c.rms_norm_eps);
    let hh = rms_norm_rows(hidden, &mtp.hidden_norm, c.rms_norm_eps);
    // concat(embedding, hidden): the embedding first.
    let mut both = Vec::with_capacity(2 * t * hd);
    for (e, hh) in e.chunks_exact(hd).zip(hh.chunks_exact(hd)) {
        both.extend_from_slice(e);
        both.extend_from_slice(hh);
    }
    let mut u = matmul(&mtp.fc, &both, t);
    let Mixer::Attention(a) = &mtp.layer.mixer else {
        panic!("the MTP layer is a full-attention layer")
    };
    let mixer = |x: &[f32]| attention::forward(c, a, x, t, start, kv);
    decoder_layer(c, &mtp.layer, &mut u, t, mixer, moe::LayerRouting::Own);
    let normed = rms_norm_rows(&u, &mtp.norm, c.rms_norm_eps);
    let first = match which {
        Logits::All => 0,
        Logits::Last => t - 1,
    };
    let logits = matmul(&w.lm_head, &normed[first * hd..], t - first);
    (normed, logits)
}

/// Drafts `k` tokens (greedy) for a drafting sequence (MODEL.md §4.2). First the head's rows
/// for the model's pending rows, each with the token that follows it: the next pending row's,
/// and `next` for the last (the token the model picked and has not run yet); their last row
/// drafts the token after `next`. The cache rows of earlier drafts are dropped first: these
/// rows replace them. Then k − 1 steps, each on the draft before and the head's own output.
pub fn draft(
    w: &Weights,
    state: &mut SequenceState,
    next: u32,
    k: usize,
) -> anyhow::Result<Vec<u32>> {
    let mtp_weights = w
        .mtp
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("this checkpoint has no MTP head"))?;
    let c = &w.config;
    let hd = c.hidden_size;
    let vocab = c.vocab_size;
    anyhow::ensure!(
        (next as usize) < vocab,
        "token id {next} is outside the model's vocabulary ({vocab})"
    );
    anyhow::ensure!(k > 0, "no tokens to draft");
    let mtp = state
        .mtp
        .as_mut()
        .ok_or_else(|| anyhow::anyhow!("the sequence does not draft"))?;
    anyhow::ensure!(
        !mtp.tokens.is_empty(),
        "no rows have run since the last drafts"
    );
    let kept = mtp.committed * c.num_key_value_heads * c.head_dim;
    mtp.kv.keys.truncate(kept);
    mtp.kv.values.truncate(kept);
    let pending = std::mem::take(&mut mtp.pending);
    let tokens = std::mem::take(&mut mtp.tokens);
    let following: Vec<u32> = tokens[1..].iter().copied().chain([next]).collect();
    debug_assert_eq!(pending.len(), following.len() * hd);
    let start = mtp.committed;
    let (normed, logits) = forward(
        w,
        mtp_weights,
        &pending,
        &following,
        start,
        &mut mtp.kv,
        Logits::Last,
    );
    mtp.committed += following.len();
    let mut drafts = vec![argmax(&logits)];
    let mut hidden = normed[normed.len() - hd..].to_vec();
    for position in mtp.committed..mtp.committed + k - 1 {
        let last = *drafts.last().expect("one draft at least");
        let (normed, logits) = forward(
            w,
            mtp_weights,
            &hidden,
            &[last],
            position,
            &mut mtp.kv,
            Logits::Last,
        );
        drafts.push(argmax(&logits));
        hidden = normed;
    }
    Ok(drafts)
}
