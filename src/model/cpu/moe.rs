//! The sparse MoE block (MODEL.md §3.7): softmax router over all experts, top-k, renormalised
//! weights, SwiGLU experts, plus the always-on shared expert behind a sigmoid gate.

use std::sync::atomic::{AtomicBool, Ordering};

use super::ops::{matmul, round_activations, sigmoid, silu, softmax, top_k};
use crate::config::ModelConfig;
use crate::model::weights::{FeedForward, MoeWeights};

/// Round the router's logits to bf16 before the softmax, as the GPU does (and transformers in
/// bf16). Off in the reference, which keeps them f32; `lily agree --reference-router-bf16` turns
/// it on for the CPU side to measure how much of a device's distance from the reference is routing
/// flipped at near-ties by that rounding.
pub static ROUTER_LOGITS_BF16: AtomicBool = AtomicBool::new(false);

/// Another device's routing decisions imposed on the reference (`lily agree`): for the `t` rows
/// of one layer, the experts the device ran (`[t · top_k]`) and its router logits
/// (`[t · num_experts]`); how they compare with the reference's own is added to `stats`.
pub struct Imposed<'a> {
    pub experts: &'a [u32],
    pub logits: &'a [f32],
    pub stats: &'a mut RoutingStats,
}

/// How a device's routing compares with the reference's, over the rows of one layer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RoutingStats {
    pub rows: usize,
    /// Expert choices (of rows × top_k) the reference would have made otherwise.
    pub flipped: usize,
    /// Rows whose device choices are not the top-k of the device's own logits (a device fault).
    pub inconsistent: usize,
    /// The largest max |device − reference| router logit of a row, over the row's reference
    /// logit range: how far the device's hidden state is from the reference's by this layer.
    pub largest_distance: f32,
    /// The largest reference margin (its k-th logit minus the expert's, over the range) of an
    /// expert the device chose and the reference would not have.
    pub largest_flip_margin: f32,
}

impl RoutingStats {
    fn record(&mut self, reference: &[f32], device: &[f32], experts: &[u32]) {
        let k = experts.len();
        let (lo, hi) = reference
            .iter()
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
                (lo.min(v), hi.max(v))
            });
        let range = (hi - lo).max(f32::MIN_POSITIVE);
        let distance = reference
            .iter()
            .zip(device)
            .map(|(r, d)| (r - d).abs())
            .fold(0f32, f32::max);
        self.rows += 1;
        self.largest_distance = self.largest_distance.max(distance / range);
        let own = top_k(reference, k);
        let kth = reference[own[k - 1]];
        for &e in experts {
            if !own.contains(&(e as usize)) {
                self.flipped += 1;
                let margin = (kth - reference[e as usize]) / range;
                self.largest_flip_margin = self.largest_flip_margin.max(margin);
            }
        }
        // The device's choice: k distinct experts, none below an expert it left out.
        let mut chosen = vec![false; device.len()];
        let mut distinct = true;
        for &e in experts {
            match chosen.get_mut(e as usize) {
                Some(c) if !*c => *c = true,
                _ => distinct = false,
            }
        }
        let low_in = experts
            .iter()
            .filter_map(|&e| device.get(e as usize))
            .fold(f32::INFINITY, |a, &b| a.min(b));
        let high_out = (0..device.len())
            .filter(|&j| !chosen[j])
            .map(|j| device[j])
            .fold(f32::NEG_INFINITY, f32::max);
        if !distinct || low_in < high_out {
            self.inconsistent += 1;
        }
    }
}

/// What an MoE layer does with its routing beyond choosing its own top-k.
pub enum LayerRouting<'a> {
    Own,
    /// Run the experts another device chose (each weighted by the reference's softmax,
    /// renormalised over them, as the device weights its own).
    Impose(Imposed<'a>),
    /// Append the rows' router logits and top-k experts (as a device traces them for `lily agree`).
    Record {
        logits: &'a mut Vec<f32>,
        experts: &'a mut Vec<u32>,
    },
}

/// `t` normalised rows in, `t` rows of MoE output out (accumulated in f32).
pub fn forward(c: &ModelConfig, w: &MoeWeights, x: &[f32], t: usize) -> Vec<f32> {
    forward_routed(c, w, x, t, LayerRouting::Own)
}

/// [`forward`], its routing imposed or recorded as `routing` says.
pub fn forward_routed(
    c: &ModelConfig,
    w: &MoeWeights,
    x: &[f32],
    t: usize,
    mut routing: LayerRouting,
) -> Vec<f32> {
    let (h, e, k) = (c.hidden_size, c.num_experts, c.num_experts_per_tok);
    let mut logits = matmul(&w.router, x, t);
    round_router_logits(&mut logits);
    // Tokens routed to each expert, with their weights.
    let mut routed: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e];
    for s in 0..t {
        let p = &mut logits[s * e..(s + 1) * e];
        let imposed = match &mut routing {
            LayerRouting::Impose(i) => {
                let experts = &i.experts[s * k..(s + 1) * k];
                i.stats.record(p, &i.logits[s * e..(s + 1) * e], experts);
                Some(experts)
            }
            LayerRouting::Record { logits, .. } => {
                logits.extend_from_slice(p);
                None
            }
            LayerRouting::Own => None,
        };
        softmax(p);
        let top = match imposed {
            Some(experts) => experts.iter().map(|&x| x as usize).collect(),
            None => top_k(p, k),
        };
        if let LayerRouting::Record { experts, .. } = &mut routing {
            experts.extend(top.iter().map(|&j| j as u32));
        }
        let sum: f32 = top.iter().map(|&j| p[j]).sum();
        for j in top {
            routed[j].push((s, p[j] / sum));
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
    let mut act: Vec<f32> = g.iter().zip(&u).map(|(&g, &u)| silu(g) * u).collect();
    round_activations(&mut act);
    matmul(&f.down, &act, t)
}
