//! The CPU backend: the reference forward pass (MODEL.md §3), f32 throughout, multi-threaded
//! with rayon. Every other backend is checked against it.

pub mod attention;
pub mod gdn;
pub mod moe;
pub mod ops;

use crate::model::state::{LayerState, SequenceState};
use crate::model::weights::{Mixer, Weights};
use ops::{matmul, rms_norm_rows};

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
    let c = &w.config;
    let (t, hd) = (tokens.len(), c.hidden_size);
    assert!(t > 0, "forward needs at least one token");
    let mut h = vec![0f32; t * hd];
    for (s, &tok) in tokens.iter().enumerate() {
        w.embed.row_into(tok as usize, &mut h[s * hd..(s + 1) * hd]);
    }
    for (layer, st) in w.layers.iter().zip(state.layers.iter_mut()) {
        let x = rms_norm_rows(&h, &layer.input_norm, c.rms_norm_eps);
        let r = match (&layer.mixer, st) {
            (Mixer::DeltaNet(m), LayerState::DeltaNet(s)) => gdn::forward(c, m, &x, t, s),
            (Mixer::Attention(m), LayerState::Attention(kv)) => {
                attention::forward(c, m, &x, t, state.position, kv)
            }
            _ => panic!("sequence state does not match the model's layer kinds"),
        };
        h.iter_mut().zip(&r).for_each(|(h, r)| *h += r);
        let m = rms_norm_rows(&h, &layer.post_attention_norm, c.rms_norm_eps);
        let y = moe::forward(c, &layer.moe, &m, t);
        h.iter_mut().zip(&y).for_each(|(h, y)| *h += y);
    }
    state.position += t;
    let rows = match which {
        Logits::All => &h[..],
        Logits::Last => &h[(t - 1) * hd..],
    };
    let n = rows.len() / hd;
    let normed = rms_norm_rows(rows, &w.final_norm, c.rms_norm_eps);
    matmul(&w.lm_head, &normed, n)
}
