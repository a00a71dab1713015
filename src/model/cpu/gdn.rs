//! Gated DeltaNet (MODEL.md §3.6): causal conv, gates, and the delta rule in two equivalent
//! forms — token by token (decode) and in chunks of 64 (prefill).

use rayon::prelude::*;

use super::ops::{l2_normalize, matmul, rms_norm, round_activations, sigmoid, silu, softplus};
use crate::config::ModelConfig;
use crate::model::state::DeltaNetState;
use crate::model::weights::DeltaNetWeights;

/// Chunk length of the chunked delta rule (any value gives the same result up to rounding).
pub const CHUNK: usize = 64;

/// How a run of several tokens of one sequence applies the delta rule (one token is always
/// token by token).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeltaRule {
    /// In chunks: prompts, as transformers' prefill does.
    Chunked,
    /// Token by token: a verify pass, whose rows must give the bits that decoding them one at a
    /// time gives (the chunked form rounds differently).
    Recurrent,
}

/// Runs the GDN mixer over `t` normalised hidden rows `x` (`[t, hidden]`), updating the state.
pub fn forward(
    c: &ModelConfig,
    w: &DeltaNetWeights,
    x: &[f32],
    t: usize,
    state: &mut DeltaNetState,
) -> Vec<f32> {
    forward_spans(c, w, x, &mut [(t, state)], DeltaRule::Chunked)
}

/// The mixer over the rows of several sequences, one after another in `x`: `spans` gives each
/// sequence's row count and state. The projections run once over all rows (each row's result
/// is the same as alone); the conv and the delta rule run per sequence.
pub fn forward_spans(
    c: &ModelConfig,
    w: &DeltaNetWeights,
    x: &[f32],
    spans: &mut [(usize, &mut DeltaNetState)],
    rule: DeltaRule,
) -> Vec<f32> {
    let rows: usize = spans.iter().map(|(t, _)| t).sum();
    let qkv = matmul(&w.in_proj_qkv, x, rows);
    let z = matmul(&w.in_proj_z, x, rows);
    let b = matmul(&w.in_proj_b, x, rows);
    let a = matmul(&w.in_proj_a, x, rows);
    let (conv_dim, value_dim, hv) = (c.conv_dim(), c.linear_value_dim(), c.linear_num_value_heads);
    let mut y = Vec::with_capacity(rows * value_dim);
    let mut r = 0;
    for (t, state) in spans.iter_mut() {
        let t = *t;
        let projected = Projected {
            qkv: &qkv[r * conv_dim..(r + t) * conv_dim],
            z: &z[r * value_dim..(r + t) * value_dim],
            b: &b[r * hv..(r + t) * hv],
            a: &a[r * hv..(r + t) * hv],
        };
        y.extend(mix(c, w, &projected, t, state, rule));
        r += t;
    }
    matmul(&w.out_proj, &y, rows)
}

/// One sequence's input projections: `[t, width]` each.
struct Projected<'a> {
    qkv: &'a [f32],
    z: &'a [f32],
    b: &'a [f32],
    a: &'a [f32],
}

/// Conv, gates, the delta rule and the gated norm over one sequence's `t` projected rows:
/// the input of out_proj, `[t, value_dim]`.
fn mix(
    c: &ModelConfig,
    w: &DeltaNetWeights,
    p: &Projected,
    t: usize,
    state: &mut DeltaNetState,
    rule: DeltaRule,
) -> Vec<f32> {
    let conv_dim = c.conv_dim();
    let (hk, hv) = (c.linear_num_key_heads, c.linear_num_value_heads);
    let (dk, dv) = (c.linear_key_head_dim, c.linear_value_head_dim);
    let key_dim = c.linear_key_dim();
    let (qkv, z, b, a) = (p.qkv, p.z, p.b, p.a);

    let mixed = causal_conv(
        qkv,
        t,
        conv_dim,
        c.linear_conv_kernel_dim,
        &w.conv1d,
        &mut state.conv,
    );

    // Per token and value head: beta, decay g, and normalised q/k (value head j reads key head
    // j / (hv / hk): the grouped order of the Hugging Face layout).
    let group = hv / hk;
    let scale = 1.0 / (dk as f32).sqrt();
    let mut q = vec![0f32; t * hk * dk];
    let mut k = vec![0f32; t * hk * dk];
    let mut v = vec![0f32; t * hv * dv];
    for s in 0..t {
        let row = &mixed[s * conv_dim..(s + 1) * conv_dim];
        q[s * key_dim..(s + 1) * key_dim].copy_from_slice(&row[..key_dim]);
        k[s * key_dim..(s + 1) * key_dim].copy_from_slice(&row[key_dim..2 * key_dim]);
        v[s * hv * dv..(s + 1) * hv * dv].copy_from_slice(&row[2 * key_dim..]);
        for h in 0..hk {
            let qh = &mut q[(s * hk + h) * dk..(s * hk + h + 1) * dk];
            l2_normalize(qh, 1e-6);
            qh.iter_mut().for_each(|x| *x *= scale);
            l2_normalize(&mut k[(s * hk + h) * dk..(s * hk + h + 1) * dk], 1e-6);
        }
    }
    let beta: Vec<f32> = b.iter().map(|&x| sigmoid(x)).collect();
    let g: Vec<f32> = (0..t * hv)
        .map(|i| {
            let j = i % hv;
            -w.a_log[j].exp() * softplus(a[i] + w.dt_bias[j])
        })
        .collect();

    // The delta rule, one value head per task.
    let head_out: Vec<Vec<f32>> = state
        .ssm
        .par_chunks_mut(dk * dv)
        .enumerate()
        .map(|(j, s)| {
            let kh = j / group;
            let gather = |src: &[f32], heads: usize, d: usize, h: usize| -> Vec<f32> {
                (0..t)
                    .flat_map(|s| {
                        src[(s * heads + h) * d..(s * heads + h + 1) * d]
                            .iter()
                            .copied()
                    })
                    .collect()
            };
            let (qj, kj, vj) = (
                gather(&q, hk, dk, kh),
                gather(&k, hk, dk, kh),
                gather(&v, hv, dv, j),
            );
            let bj: Vec<f32> = (0..t).map(|s| beta[s * hv + j]).collect();
            let gj: Vec<f32> = (0..t).map(|s| g[s * hv + j]).collect();
            if t == 1 || rule == DeltaRule::Recurrent {
                delta_rule_recurrent(&qj, &kj, &vj, &bj, &gj, dk, dv, s)
            } else {
                delta_rule_chunked(&qj, &kj, &vj, &bj, &gj, dk, dv, s, CHUNK)
            }
        })
        .collect();

    // Gated RMSNorm per head (norm before the SiLU gate), then the output projection.
    let value_dim = hv * dv;
    let mut y = vec![0f32; t * value_dim];
    for s in 0..t {
        for j in 0..hv {
            let o = &head_out[j][s * dv..(s + 1) * dv];
            let out = &mut y[s * value_dim + j * dv..s * value_dim + (j + 1) * dv];
            rms_norm(o, &w.norm, c.rms_norm_eps, out);
            let zj = &z[s * value_dim + j * dv..s * value_dim + (j + 1) * dv];
            out.iter_mut().zip(zj).for_each(|(o, &z)| *o *= silu(z));
            round_activations(out);
        }
    }
    y
}

/// Depthwise causal conv over `t` new rows with `kernel-1` rows of history from `conv_state`
/// (oldest first), followed by SiLU. The state is replaced by the last `kernel-1` inputs.
pub fn causal_conv(
    x: &[f32],
    t: usize,
    channels: usize,
    kernel: usize,
    weight: &[f32],
    conv_state: &mut [f32],
) -> Vec<f32> {
    let hist = kernel - 1;
    let mut ext = Vec::with_capacity((hist + t) * channels);
    ext.extend_from_slice(conv_state);
    ext.extend_from_slice(x);
    let mut out = vec![0f32; t * channels];
    for s in 0..t {
        for ch in 0..channels {
            let mut acc = 0f32;
            for j in 0..kernel {
                acc += weight[ch * kernel + j] * ext[(s + j) * channels + ch];
            }
            out[s * channels + ch] = silu(acc);
        }
    }
    conv_state.copy_from_slice(&ext[t * channels..]);
    out
}

/// The delta rule token by token (MODEL.md §3.6.5). `state` is `[dk, dv]`; returns `[t, dv]`.
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_recurrent(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    beta: &[f32],
    g: &[f32],
    dk: usize,
    dv: usize,
    state: &mut [f32],
) -> Vec<f32> {
    let t = beta.len();
    let mut out = vec![0f32; t * dv];
    let mut u = vec![0f32; dv];
    for s in 0..t {
        let (qs, ks, vs) = (
            &q[s * dk..(s + 1) * dk],
            &k[s * dk..(s + 1) * dk],
            &v[s * dv..(s + 1) * dv],
        );
        let alpha = g[s].exp();
        state.iter_mut().for_each(|x| *x *= alpha);
        u.iter_mut().for_each(|x| *x = 0.0);
        for d in 0..dk {
            let row = &state[d * dv..(d + 1) * dv];
            u.iter_mut().zip(row).for_each(|(u, &r)| *u += r * ks[d]);
        }
        for (u, &vv) in u.iter_mut().zip(vs) {
            *u = beta[s] * (vv - *u); // u now holds the delta
        }
        for d in 0..dk {
            let row = &mut state[d * dv..(d + 1) * dv];
            row.iter_mut().zip(&u).for_each(|(r, &dl)| *r += ks[d] * dl);
        }
        let o = &mut out[s * dv..(s + 1) * dv];
        for d in 0..dk {
            let row = &state[d * dv..(d + 1) * dv];
            o.iter_mut().zip(row).for_each(|(o, &r)| *o += r * qs[d]);
        }
    }
    out
}

/// The delta rule in chunks (MODEL.md §3.6.6, WY form): within a chunk the interactions are
/// solved as a unit-lower-triangular system; the state is carried between chunks.
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_chunked(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    beta: &[f32],
    g: &[f32],
    dk: usize,
    dv: usize,
    state: &mut [f32],
    chunk: usize,
) -> Vec<f32> {
    let t = beta.len();
    let mut out = vec![0f32; t * dv];
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
    for c0 in (0..t).step_by(chunk) {
        let n = chunk.min(t - c0);
        // Row r of the chunk in a [t, dk] array.
        let rk = |r: usize| (c0 + r) * dk..(c0 + r + 1) * dk;
        // Cumulative log-decay inside the chunk.
        let mut gc = vec![0f32; n];
        let mut acc = 0f32;
        for r in 0..n {
            acc += g[c0 + r];
            gc[r] = acc;
        }
        // A[r][s] = β_r (k_r · k_s) exp(G_r − G_s) for s < r; solve (I + A) U = β v and
        // (I + A) W = β k exp(G) by forward substitution.
        let mut u = vec![0f32; n * dv];
        let mut wk = vec![0f32; n * dk];
        for r in 0..n {
            let kr = &k[rk(r)];
            let br = beta[c0 + r];
            for x in 0..dv {
                u[r * dv + x] = br * v[(c0 + r) * dv + x];
            }
            let er = gc[r].exp();
            for x in 0..dk {
                wk[r * dk + x] = br * kr[x] * er;
            }
            for s in 0..r {
                let a_rs = br * dot(kr, &k[rk(s)]) * (gc[r] - gc[s]).exp();
                for x in 0..dv {
                    u[r * dv + x] -= a_rs * u[s * dv + x];
                }
                for x in 0..dk {
                    wk[r * dk + x] -= a_rs * wk[s * dk + x];
                }
            }
        }
        // New values against the carried state: Vn = U − W·S.
        let mut vn = u;
        for r in 0..n {
            for d in 0..dk {
                let wrd = wk[r * dk + d];
                let srow = &state[d * dv..(d + 1) * dv];
                for x in 0..dv {
                    vn[r * dv + x] -= wrd * srow[x];
                }
            }
        }
        // Outputs: exp(G_r) q_r·S + Σ_{s≤r} (q_r·k_s) exp(G_r − G_s) Vn_s.
        for r in 0..n {
            let qr = &q[rk(r)];
            let o = &mut out[(c0 + r) * dv..(c0 + r + 1) * dv];
            let er = gc[r].exp();
            for d in 0..dk {
                let srow = &state[d * dv..(d + 1) * dv];
                let f = qr[d] * er;
                for x in 0..dv {
                    o[x] += f * srow[x];
                }
            }
            for s in 0..=r {
                let f = dot(qr, &k[rk(s)]) * (gc[r] - gc[s]).exp();
                for x in 0..dv {
                    o[x] += f * vn[s * dv + x];
                }
            }
        }
        // Carry the state: S·exp(G_last) + Σ_s k_s exp(G_last − G_s) ⊗ Vn_s.
        let glast = gc[n - 1];
        let el = glast.exp();
        state.iter_mut().for_each(|x| *x *= el);
        for s in 0..n {
            let ks = &k[rk(s)];
            let f = (glast - gc[s]).exp();
            for d in 0..dk {
                let kd = ks[d] * f;
                let srow = &mut state[d * dv..(d + 1) * dv];
                for x in 0..dv {
                    srow[x] += kd * vn[s * dv + x];
                }
            }
        }
    }
    out
}
