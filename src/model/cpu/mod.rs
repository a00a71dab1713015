//! The CPU backend: the reference forward pass (MODEL.md §3), f32 throughout, multi-threaded
//! with rayon. Every other backend is checked against it.

pub mod attention;
pub mod gdn;
pub mod moe;
pub mod mtp;
pub mod ops;

use crate::config::ModelConfig;
use crate::model::state::{LayerState, SequenceState};
use crate::model::weights::{LayerWeights, Mixer, Weights};
use crate::model::RoutingTrace;
use gdn::DeltaRule;
use ops::{matmul, rms_norm_rows, round_activations};

/// Which positions of a forward call need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Every new token (scoring, tests).
    All,
    /// Only the last new token (generation).
    Last,
}

/// Runs `tokens` (new tokens of one sequence) through the model, advancing `state`.
/// Returns logits `[n, vocab]` for the positions chosen by `which`.
pub fn forward(w: &Weights, tokens: &[u32], state: &mut SequenceState, which: Logits) -> Vec<f32> {
    run_one(w, tokens, state, which, Routing::Own)
}

/// Runs the new tokens of several sequences as one batch: their rows go through every
/// projection and the experts together (each weight row decoded once for all of them), the
/// conv, delta rule and attention per sequence. Each sequence's logits are exactly what
/// [`forward`] alone would give.
pub fn forward_batch(
    w: &Weights,
    seqs: &mut [(&[u32], &mut SequenceState)],
    which: Logits,
) -> Vec<Vec<f32>> {
    run(w, seqs, which, Routing::Own, DeltaRule::Chunked)
}

/// Runs the rows of a verify pass (the next token, then drafts) and returns the logits of
/// every row: each row's exactly as decoding the rows one at a time gives them (the delta rule
/// token by token), so that greedy decoding with drafts picks what plain decoding picks.
pub fn forward_verify(w: &Weights, tokens: &[u32], state: &mut SequenceState) -> Vec<f32> {
    let mut seqs = [(tokens, state)];
    run(
        w,
        &mut seqs,
        Logits::All,
        Routing::Own,
        DeltaRule::Recurrent,
    )
    .pop()
    .expect("one sequence in, one out")
}

/// What the MoE layers of a forward call do with routing beyond their own top-k.
enum Routing<'r, 'a> {
    Own,
    Impose(&'r mut ImposedRouting<'a>),
    Record(&'r mut RoutingTrace),
}

/// Routing another device decided, imposed on the reference's MoE layers (`lily agree`): the
/// trace's rows from `row` on are this call's rows; how the device's routing compares with the
/// reference's own is added to `stats` (one per layer).
pub struct ImposedRouting<'a> {
    pub trace: &'a RoutingTrace,
    pub row: usize,
    pub stats: &'a mut [moe::RoutingStats],
}

/// [`forward`] with every MoE layer running the experts `routing` names (moe::forward_routed);
/// `routing.row` then moves past this call's rows. The trace must hold them (ids in range).
pub fn forward_routed(
    w: &Weights,
    tokens: &[u32],
    state: &mut SequenceState,
    which: Logits,
    routing: &mut ImposedRouting,
) -> Vec<f32> {
    let logits = run_one(w, tokens, state, which, Routing::Impose(routing));
    routing.row += tokens.len();
    logits
}

/// [`forward`], appending each MoE layer's router logits and top-k experts to `trace` (as a
/// device traces them for `lily agree`; `trace` has a row list per layer).
pub fn forward_recorded(
    w: &Weights,
    tokens: &[u32],
    state: &mut SequenceState,
    which: Logits,
    trace: &mut RoutingTrace,
) -> Vec<f32> {
    run_one(w, tokens, state, which, Routing::Record(trace))
}

/// [`run`] for one sequence: its logits.
fn run_one(
    w: &Weights,
    tokens: &[u32],
    state: &mut SequenceState,
    which: Logits,
    routing: Routing,
) -> Vec<f32> {
    run(
        w,
        &mut [(tokens, state)],
        which,
        routing,
        DeltaRule::Chunked,
    )
    .pop()
    .expect("one sequence in, one out")
}

fn run(
    w: &Weights,
    seqs: &mut [(&[u32], &mut SequenceState)],
    which: Logits,
    mut routing: Routing,
    rule: DeltaRule,
) -> Vec<Vec<f32>> {
    let c = &w.config;
    let hd = c.hidden_size;
    assert!(
        seqs.iter().all(|(tokens, _)| !tokens.is_empty()),
        "forward needs at least one token per sequence"
    );
    fn mismatch() -> ! {
        panic!("sequence state does not match the model's layer kinds")
    }
    let t: usize = seqs.iter().map(|(tokens, _)| tokens.len()).sum();
    let mut h = vec![0f32; t * hd];
    let ids = seqs.iter().flat_map(|(tokens, _)| tokens.iter());
    for (s, &tok) in ids.enumerate() {
        w.embed.row_into(tok as usize, &mut h[s * hd..(s + 1) * hd]);
    }
    for (li, layer) in w.layers.iter().enumerate() {
        let (e, k) = (c.num_experts, c.num_experts_per_tok);
        let layer_routing = match &mut routing {
            Routing::Own => moe::LayerRouting::Own,
            Routing::Impose(r) => moe::LayerRouting::Impose(moe::Imposed {
                experts: &r.trace.experts[li][r.row * k..(r.row + t) * k],
                logits: &r.trace.logits[li][r.row * e..(r.row + t) * e],
                stats: &mut r.stats[li],
            }),
            Routing::Record(trace) => moe::LayerRouting::Record {
                logits: &mut trace.logits[li],
                experts: &mut trace.experts[li],
            },
        };
        let mixer = |x: &[f32]| match &layer.mixer {
            Mixer::DeltaNet(m) => {
                let mut spans: Vec<_> = seqs
                    .iter_mut()
                    .map(|(tokens, st)| match &mut st.layers[li] {
                        LayerState::DeltaNet(s) => (tokens.len(), s),
                        _ => mismatch(),
                    })
                    .collect();
                gdn::forward_spans(c, m, x, &mut spans, rule)
            }
            Mixer::Attention(m) => {
                let mut spans: Vec<_> = seqs
                    .iter_mut()
                    .map(|(tokens, st)| {
                        let start = st.position;
                        match &mut st.layers[li] {
                            LayerState::Attention(kv) => (tokens.len(), start, kv),
                            _ => mismatch(),
                        }
                    })
                    .collect();
                attention::forward_spans(c, m, x, &mut spans)
            }
        };
        decoder_layer(c, layer, &mut h, t, mixer, layer_routing);
    }
    // A drafting sequence keeps the final-normed hidden state of every row for its MTP head;
    // the others need only the rows whose logits are wanted (the norm is per row either way).
    let drafting = seqs.iter().any(|(_, st)| st.mtp.is_some());
    let all_normed = drafting.then(|| rms_norm_rows(&h, &w.final_norm, c.rms_norm_eps));
    let mut rows = Vec::new();
    let mut counts = Vec::with_capacity(seqs.len());
    let mut end = 0;
    for (tokens, st) in seqs.iter_mut() {
        st.position += tokens.len();
        end += tokens.len();
        let first = match which {
            Logits::All => end - tokens.len(),
            Logits::Last => end - 1,
        };
        match &all_normed {
            Some(normed) => {
                if let Some(mtp) = &mut st.mtp {
                    let span = &normed[(end - tokens.len()) * hd..end * hd];
                    mtp.pending.extend_from_slice(span);
                    mtp.tokens.extend_from_slice(tokens);
                }
                rows.extend_from_slice(&normed[first * hd..end * hd]);
            }
            None => rows.extend_from_slice(&h[first * hd..end * hd]),
        }
        counts.push(end - first);
    }
    let normed = match all_normed {
        Some(_) => rows,
        None => rms_norm_rows(&rows, &w.final_norm, c.rms_norm_eps),
    };
    let logits = matmul(&w.lm_head, &normed, normed.len() / hd);
    let v = c.vocab_size;
    let mut at = 0;
    counts
        .into_iter()
        .map(|n| {
            at += n;
            logits[(at - n) * v..at * v].to_vec()
        })
        .collect()
}

/// One decoder layer over the rows `h` (`t` of them), in place (MODEL.md §3.3):
/// `h += mixer(norm(h))`, then `h += moe(norm(h))`. `mixer` runs the layer's token mixer over
/// the normed rows with the sequences' states.
fn decoder_layer(
    c: &ModelConfig,
    layer: &LayerWeights,
    h: &mut [f32],
    t: usize,
    mixer: impl FnOnce(&[f32]) -> Vec<f32>,
    routing: moe::LayerRouting,
) {
    let x = rms_norm_rows(h, &layer.input_norm, c.rms_norm_eps);
    let r = mixer(&x);
    h.iter_mut().zip(&r).for_each(|(h, r)| *h += r);
    round_activations(h);
    let m = rms_norm_rows(h, &layer.post_attention_norm, c.rms_norm_eps);
    let y = moe::forward_routed(c, &layer.moe, &m, t, routing);
    h.iter_mut().zip(&y).for_each(|(h, y)| *h += y);
    round_activations(h);
}
