//! Gated full attention (MODEL.md §3.4): q/k RMSNorm, partial rotate-half RoPE, GQA over the
//! KV cache, and a sigmoid output gate taken from the second half of each head's q_proj rows.

use rayon::prelude::*;

use super::ops::{
    apply_rope, dot, matmul, rms_norm, rope_angles, round_activations, sigmoid, softmax,
};
use crate::config::ModelConfig;
use crate::model::state::KvCache;
use crate::model::weights::AttentionWeights;

/// Runs attention for `t` new rows at positions `start ..`, appending to the cache.
pub fn forward(
    c: &ModelConfig,
    w: &AttentionWeights,
    x: &[f32],
    t: usize,
    start: usize,
    cache: &mut KvCache,
) -> Vec<f32> {
    forward_spans(c, w, x, &mut [(t, start, cache)])
}

/// Attention over the rows of several sequences, one after another in `x`: `spans` gives each
/// sequence's row count, first position and cache. The projections run once over all rows;
/// norms, RoPE and attention per sequence.
pub fn forward_spans(
    c: &ModelConfig,
    w: &AttentionWeights,
    x: &[f32],
    spans: &mut [(usize, usize, &mut KvCache)],
) -> Vec<f32> {
    let rows: usize = spans.iter().map(|(t, ..)| t).sum();
    let qg = matmul(&w.q_proj, x, rows);
    let k = matmul(&w.k_proj, x, rows);
    let v = matmul(&w.v_proj, x, rows);
    let (nq, nkv, dh) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let mut o = Vec::with_capacity(rows * nq * dh);
    let mut r = 0;
    for (t, start, cache) in spans.iter_mut() {
        let t = *t;
        let projected = Projected {
            qg: &qg[r * 2 * nq * dh..(r + t) * 2 * nq * dh],
            k: &k[r * nkv * dh..(r + t) * nkv * dh],
            v: &v[r * nkv * dh..(r + t) * nkv * dh],
        };
        o.extend(attend(c, w, &projected, t, *start, cache));
        r += t;
    }
    matmul(&w.o_proj, &o, rows)
}

/// One sequence's projections: q‖gate `[t, heads, 2·head_dim]`, k and v `[t, kv_heads, head_dim]`.
struct Projected<'a> {
    qg: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
}

/// Norms, RoPE, the cache append and gated attention for one sequence's `t` rows: the input of
/// o_proj, `[t, heads · head_dim]`.
fn attend(
    c: &ModelConfig,
    w: &AttentionWeights,
    p: &Projected,
    t: usize,
    start: usize,
    cache: &mut KvCache,
) -> Vec<f32> {
    let (nq, nkv, dh) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let (qg, k, v) = (p.qg, p.k, p.v);

    let mut q = vec![0f32; t * nq * dh];
    let mut gate = vec![0f32; t * nq * dh];
    for s in 0..t {
        let (cos, sin) = rope_angles(start + s, c.rotary_dim, c.rope_theta);
        for h in 0..nq {
            let src = &qg[(s * nq + h) * 2 * dh..(s * nq + h + 1) * 2 * dh];
            let qh = &mut q[(s * nq + h) * dh..(s * nq + h + 1) * dh];
            rms_norm(&src[..dh], &w.q_norm, c.rms_norm_eps, qh);
            apply_rope(qh, &cos, &sin);
            round_activations(qh);
            gate[(s * nq + h) * dh..(s * nq + h + 1) * dh].copy_from_slice(&src[dh..]);
        }
        for h in 0..nkv {
            let mut kh = vec![0f32; dh];
            rms_norm(
                &k[(s * nkv + h) * dh..(s * nkv + h + 1) * dh],
                &w.k_norm,
                c.rms_norm_eps,
                &mut kh,
            );
            apply_rope(&mut kh, &cos, &sin);
            round_activations(&mut kh);
            cache.keys.extend_from_slice(&kh);
        }
        cache
            .values
            .extend_from_slice(&v[s * nkv * dh..(s + 1) * nkv * dh]);
    }

    // softmax(q·k / √dh) over positions ≤ own position; query head h reads KV head h / (nq/nkv).
    let group = nq / nkv;
    let scale = 1.0 / (dh as f32).sqrt();
    let mut o = vec![0f32; t * nq * dh];
    o.par_chunks_mut(dh).enumerate().for_each(|(i, out)| {
        let (s, h) = (i / nq, i % nq);
        let kvh = h / group;
        let qh = &q[i * dh..(i + 1) * dh];
        let visible = start + s + 1;
        let mut p: Vec<f32> = (0..visible)
            .map(|j| {
                dot(
                    qh,
                    &cache.keys[(j * nkv + kvh) * dh..(j * nkv + kvh + 1) * dh],
                ) * scale
            })
            .collect();
        softmax(&mut p);
        for (j, pj) in p.iter().enumerate() {
            let vj = &cache.values[(j * nkv + kvh) * dh..(j * nkv + kvh + 1) * dh];
            out.iter_mut().zip(vj).for_each(|(o, &v)| *o += pj * v);
        }
        let g = &gate[i * dh..(i + 1) * dh];
        out.iter_mut().zip(g).for_each(|(o, &g)| *o *= sigmoid(g));
        round_activations(out);
    });
    o
}
