//! The sparse MoE block (MODEL.md §3.7): softmax router over all experts, top-k, renormalised
//! weights, SwiGLU experts, plus the always-on shared expert behind a sigmoid gate.

use std::sync::atomic::{AtomicBool, Ordering};

use super::ops::{matmul, sigmoid, silu, softmax, top_k};
use crate::config::ModelConfig;
use crate::model::weights::{FeedForward, MoeWeights};

/// Round the router's logits to bf16 before the softmax, as the GPU does (and transformers in
/// bf16). Off in the reference, which keeps them f32; `lily agree --reference-router-bf16` turns
/// it on for the CPU side to measure how much of a device's distance from the reference is routing
/// flipped at near-ties by that rounding.
pub static ROUTER_LOGITS_BF16: AtomicBool = AtomicBool::new(false);

/// `t` normalised rows in, `t` rows of MoE output out (accumulated in f32).
pub fn forward(c: &ModelConfig, w: &MoeWeights, x: &[f32], t: usize) -> Vec<f32> {
    let h = c.hidden_size;
    let mut logits = matmul(&w.router, x, t);
    round_router_logits(&mut logits);
    // Tokens routed to each expert, with their weights.
    let mut routed: Vec<Vec<(usize, f32)>> = vec![Vec::new(); c.num_experts];
    for s in 0..t {
        let p = &mut logits[s * c.num_experts..(s + 1) * c.num_experts];
        softmax(p);
        let top = top_k(p, c.num_experts_per_tok);
        let sum: f32 = top.iter().map(|&e| p[e]).sum();
        for e in top {
            routed[e].push((s, p[e] / sum));
        }
    }
    let mut y = vec![0f32; t * h];
    for (e, tokens) in routed.iter().enumerate() {
        if tokens.is_empty() {
            continue;
        }
        let xs: Vec<f32> = tokens
            .iter()
            .flat_map(|&(s, _)| x[s * h..(s + 1) * h].iter().copied())
            .collect();
        let out = swiglu(&w.experts[e], &xs, tokens.len());
        for (i, &(s, weight)) in tokens.iter().enumerate() {
            y[s * h..(s + 1) * h]
                .iter_mut()
                .zip(&out[i * h..(i + 1) * h])
                .for_each(|(y, o)| *y += weight * o);
        }
    }
    let shared = swiglu(&w.shared_expert, x, t);
    let mut gate = matmul(&w.shared_expert_gate, x, t);
    // The GPU computes the shared expert's gate logit with the router's, in bf16 too.
    round_router_logits(&mut gate);
    for s in 0..t {
        let g = sigmoid(gate[s]);
        y[s * h..(s + 1) * h]
            .iter_mut()
            .zip(&shared[s * h..(s + 1) * h])
            .for_each(|(y, o)| *y += g * o);
    }
    y
}

/// Rounds router logits to bf16 when [`ROUTER_LOGITS_BF16`] asks for it.
fn round_router_logits(logits: &mut [f32]) {
    if ROUTER_LOGITS_BF16.load(Ordering::Relaxed) {
        for v in logits {
            *v = half::bf16::from_f32(*v).to_f32();
        }
    }
}

/// `down · (silu(gate · x) ⊙ (up · x))` for `t` rows.
pub fn swiglu(f: &FeedForward, x: &[f32], t: usize) -> Vec<f32> {
    let g = matmul(&f.gate, x, t);
    let u = matmul(&f.up, x, t);
    let act: Vec<f32> = g.iter().zip(&u).map(|(&g, &u)| silu(g) * u).collect();
    matmul(&f.down, &act, t)
}
