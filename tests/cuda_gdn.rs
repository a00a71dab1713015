//! The Gated DeltaNet kernels (src/cuda/gdn.rs) against the CPU reference
//! (src/model/cpu/gdn.rs) on fresh random inputs at Qwen3.6-35B-A3B's shapes, plus prefill-vs-decode
//! agreement and timing printouts. Needs an sm_90 GPU: without one every test fails.
//!
//! Tolerances (the GPU keeps fp32 everywhere the reference does; differences are summation order):
//! * outputs y (bf16) vs the f32 reference: per element |gpu − ref| ≤ 2e-2·|ref| + 2e-3·rms(head),
//!   and the mean relative error ≤ 5e-3. The GPU rounds o, the normalised o, w·norm(o) and y to
//!   bf16 (as transformers does; 4 roundings of ≤ 2⁻⁸ relative each, ≤ 1.6% together), the
//!   reference rounds nothing. Two GPU paths compared with each other: 4e-2 (each within 1.6%).
//!   Prefill's output kernel in plain tf32 (`LILY_GDN_OUT_TF32=1`; 3xTF32 is the default) rounds
//!   the inputs of its chained products (q·S, q·kᵀ, its product with the new values) to 2⁻¹¹;
//!   where o is a small difference of large terms, that noise reaches 5e-2 of the normalised o
//!   (unit rms) before y = w·norm(o)·silu(z) (measured on the H200), so its outputs get a third
//!   term, 1e-1·|w_d·silu(z_d)| per element. (fla's kernels, which transformers runs on a GPU,
//!   round those inputs to bf16, 4× coarser still.)
//! * fp32 recurrent state: max |gpu − ref| ≤ 1e-4 · max |ref| per sequence.
//! * bf16 conv state: bit-exact (it is a copy of inputs).
//!
//! Every output is poisoned with NaN before a launch, so an element never written fails.
//!
//! Seeds are fresh each run and printed; set LILY_TEST_SEED to repeat one.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use half::bf16;
use lily::config::ModelConfig;
use lily::cuda::gdn::{
    check_config, GdnInputs, GdnKernels, GdnWeights, GdnWorkspace, Rows, StateCopy, CONV_DIM,
    CONV_KERNEL, CONV_STATE_LEN, HEAD_DIM, KEY_DIM, KEY_HEADS, PROJ_DIM, SSM_STATE_LEN, VALUE_DIM,
    VALUE_HEADS,
};
use lily::cuda::profile::OpProfile;
use lily::cuda::{CudaDevice, CudaSlice, CudaStream};
use lily::model::cpu::gdn::{causal_conv, delta_rule_chunked, delta_rule_recurrent, CHUNK};
use lily::model::cpu::ops::{l2_normalize, rms_norm, sigmoid, silu, softplus};
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use rayon::prelude::*;

const EPS: f32 = 1e-6;
const Y_REL: f32 = 2e-2;
const Y_REL_GPU_PAIR: f32 = 4e-2;
const Y_ABS: f32 = 2e-3;
const Y_TF32_NORMED: f32 = 1e-1;
const Y_MEAN_REL: f32 = 5e-3;
const STATE_REL: f32 = 1e-4;

fn device() -> CudaDevice {
    CudaDevice::new(0).unwrap_or_else(|e| panic!("the GDN kernel tests need an sm_90 GPU: {e}"))
}

fn rng(test: &str) -> SmallRng {
    let seed = std::env::var("LILY_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    println!("{test}: seed {seed} (LILY_TEST_SEED={seed} repeats it)");
    SmallRng::seed_from_u64(seed)
}

fn round_bf16(v: f32) -> f32 {
    bf16::from_f32(v).to_f32()
}

fn uniform(rng: &mut SmallRng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

fn download<T: cudarc::driver::DeviceRepr>(stream: &Arc<CudaStream>, buf: &CudaSlice<T>) -> Vec<T> {
    let v = stream.clone_dtoh(buf).expect("copy to host");
    stream.synchronize().expect("stream");
    v
}

/// One layer's small weights, drawn so that the gates cover their real range: β ∈ (0.007, 0.993),
/// g from about −40 (state forgotten in one step) to −1e-5 (kept for thousands).
struct HostLayer {
    conv_w: Vec<f32>,
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
    norm_w: Vec<f32>,
}

impl HostLayer {
    fn random(rng: &mut SmallRng) -> Self {
        Self {
            conv_w: uniform(rng, CONV_DIM * CONV_KERNEL, -0.6, 0.6),
            a_log: uniform(rng, VALUE_HEADS, -2.0, 2.5),
            dt_bias: uniform(rng, VALUE_HEADS, -6.0, 0.0),
            norm_w: uniform(rng, HEAD_DIM, 0.5, 1.5),
        }
    }
}

struct DevLayer {
    conv_w: CudaSlice<f32>,
    a_log: CudaSlice<f32>,
    dt_bias: CudaSlice<f32>,
    norm_w: CudaSlice<f32>,
}

impl DevLayer {
    fn upload(stream: &Arc<CudaStream>, l: &HostLayer) -> Self {
        let up = |v: &[f32]| stream.clone_htod(v).expect("upload");
        Self {
            conv_w: up(&l.conv_w),
            a_log: up(&l.a_log),
            dt_bias: up(&l.dt_bias),
            norm_w: up(&l.norm_w),
        }
    }
    fn weights(&self) -> GdnWeights<'_> {
        GdnWeights {
            conv_w: self.conv_w.slice(..),
            a_log: self.a_log.slice(..),
            dt_bias: self.dt_bias.slice(..),
            norm_w: self.norm_w.slice(..),
            eps: EPS,
        }
    }
}

/// Projection outputs for `rows` rows, already rounded to bf16 (f32 here for the reference).
struct HostInputs {
    rows: usize,
    qkv: Vec<f32>,
    z: Vec<f32>,
    b: Vec<f32>,
    a: Vec<f32>,
}

impl HostInputs {
    fn random(rng: &mut SmallRng, rows: usize) -> Self {
        let mut gen = |n: usize, lo: f32, hi: f32| -> Vec<f32> {
            uniform(rng, n, lo, hi)
                .into_iter()
                .map(round_bf16)
                .collect()
        };
        Self {
            rows,
            qkv: gen(rows * CONV_DIM, -2.0, 2.0),
            z: gen(rows * VALUE_DIM, -4.0, 4.0),
            b: gen(rows * VALUE_HEADS, -5.0, 5.0),
            a: gen(rows * VALUE_HEADS, -3.0, 3.0),
        }
    }

    /// Rows `r0 .. r0 + n`.
    fn rows(&self, r0: usize, n: usize) -> HostInputs {
        HostInputs {
            rows: n,
            qkv: self.qkv[r0 * CONV_DIM..(r0 + n) * CONV_DIM].to_vec(),
            z: self.z[r0 * VALUE_DIM..(r0 + n) * VALUE_DIM].to_vec(),
            b: self.b[r0 * VALUE_HEADS..(r0 + n) * VALUE_HEADS].to_vec(),
            a: self.a[r0 * VALUE_HEADS..(r0 + n) * VALUE_HEADS].to_vec(),
        }
    }

    /// The fused layout `[rows][stride]`, qkv ‖ z ‖ b ‖ a, padding NaN (so reading it shows).
    fn fused(&self, stride: usize) -> Vec<bf16> {
        let mut out = vec![bf16::NAN; self.rows * stride];
        for r in 0..self.rows {
            let row = &mut out[r * stride..];
            let parts: [(&[f32], usize); 4] = [
                (&self.qkv, CONV_DIM),
                (&self.z, VALUE_DIM),
                (&self.b, VALUE_HEADS),
                (&self.a, VALUE_HEADS),
            ];
            let mut at = 0;
            for (src, width) in parts {
                for (dst, &v) in row[at..at + width]
                    .iter_mut()
                    .zip(&src[r * width..(r + 1) * width])
                {
                    *dst = bf16::from_f32(v);
                }
                at += width;
            }
        }
        out
    }
}

/// Device copies of inputs in four separate contiguous buffers.
struct DevInputs {
    qkv: CudaSlice<bf16>,
    z: CudaSlice<bf16>,
    b: CudaSlice<bf16>,
    a: CudaSlice<bf16>,
}

impl DevInputs {
    fn upload(stream: &Arc<CudaStream>, x: &HostInputs) -> Self {
        let up = |v: &[f32]| stream.clone_htod(&to_bf16(v)).expect("upload");
        Self {
            qkv: up(&x.qkv),
            z: up(&x.z),
            b: up(&x.b),
            a: up(&x.a),
        }
    }
    fn inputs(&self) -> GdnInputs<'_> {
        GdnInputs {
            qkv: Rows {
                data: self.qkv.slice(..),
                stride: CONV_DIM,
            },
            z: Rows {
                data: self.z.slice(..),
                stride: VALUE_DIM,
            },
            b: Rows {
                data: self.b.slice(..),
                stride: VALUE_HEADS,
            },
            a: Rows {
                data: self.a.slice(..),
                stride: VALUE_HEADS,
            },
        }
    }
}

/// One sequence's state of one layer, the CPU reference's layout (conv values bf16-exact).
#[derive(Clone)]
struct HostState {
    conv: Vec<f32>,
    ssm: Vec<f32>,
}

impl HostState {
    fn random(rng: &mut SmallRng) -> Self {
        Self {
            conv: uniform(rng, CONV_STATE_LEN, -2.0, 2.0)
                .into_iter()
                .map(round_bf16)
                .collect(),
            ssm: uniform(rng, SSM_STATE_LEN, -0.5, 0.5),
        }
    }
}

/// Device state pools: `slots` sequences' states back to back.
struct DevPools {
    ssm: CudaSlice<f32>,
    conv: CudaSlice<bf16>,
}

impl DevPools {
    fn upload(stream: &Arc<CudaStream>, states: &[HostState]) -> Self {
        let ssm: Vec<f32> = states.iter().flat_map(|s| s.ssm.iter().copied()).collect();
        let conv: Vec<f32> = states.iter().flat_map(|s| s.conv.iter().copied()).collect();
        Self {
            ssm: stream.clone_htod(&ssm).expect("upload"),
            conv: stream.clone_htod(&to_bf16(&conv)).expect("upload"),
        }
    }
    /// (ssm, conv) of slot `i`, as the host sees them.
    fn download(&self, stream: &Arc<CudaStream>) -> Vec<(Vec<f32>, Vec<bf16>)> {
        let (ssm, conv) = (download(stream, &self.ssm), download(stream, &self.conv));
        ssm.chunks(SSM_STATE_LEN)
            .zip(conv.chunks(CONV_STATE_LEN))
            .map(|(s, c)| (s.to_vec(), c.to_vec()))
            .collect()
    }
}

/// The GDN mixer between the projections and out_proj, composed from the CPU reference's pieces
/// exactly as `cpu::gdn::forward` composes them: conv, split, l2norm, gates, the delta rule per value
/// head (recurrent, i.e. decode token by token, or chunked as the CPU prefill), the gated norm.
fn reference(l: &HostLayer, x: &HostInputs, st: &mut HostState, chunked: bool) -> Vec<f32> {
    let t = x.rows;
    let mixed = causal_conv(&x.qkv, t, CONV_DIM, CONV_KERNEL, &l.conv_w, &mut st.conv);
    let scale = 1.0 / (HEAD_DIM as f32).sqrt();
    let mut q = vec![0f32; t * KEY_DIM];
    let mut k = vec![0f32; t * KEY_DIM];
    let mut v = vec![0f32; t * VALUE_DIM];
    for s in 0..t {
        let row = &mixed[s * CONV_DIM..(s + 1) * CONV_DIM];
        q[s * KEY_DIM..(s + 1) * KEY_DIM].copy_from_slice(&row[..KEY_DIM]);
        k[s * KEY_DIM..(s + 1) * KEY_DIM].copy_from_slice(&row[KEY_DIM..2 * KEY_DIM]);
        v[s * VALUE_DIM..(s + 1) * VALUE_DIM].copy_from_slice(&row[2 * KEY_DIM..]);
        for h in 0..KEY_HEADS {
            let head = (s * KEY_HEADS + h) * HEAD_DIM..(s * KEY_HEADS + h + 1) * HEAD_DIM;
            l2_normalize(&mut q[head.clone()], 1e-6);
            q[head.clone()].iter_mut().for_each(|x| *x *= scale);
            l2_normalize(&mut k[head], 1e-6);
        }
    }
    let outs: Vec<Vec<f32>> = st
        .ssm
        .par_chunks_mut(HEAD_DIM * HEAD_DIM)
        .enumerate()
        .map(|(j, s)| {
            let gather = |src: &[f32], width: usize, h: usize| -> Vec<f32> {
                (0..t)
                    .flat_map(|r| {
                        src[r * width + h * HEAD_DIM..r * width + (h + 1) * HEAD_DIM]
                            .iter()
                            .copied()
                    })
                    .collect()
            };
            let kh = j / (VALUE_HEADS / KEY_HEADS);
            let (qj, kj, vj) = (
                gather(&q, KEY_DIM, kh),
                gather(&k, KEY_DIM, kh),
                gather(&v, VALUE_DIM, j),
            );
            let bj: Vec<f32> = (0..t).map(|r| sigmoid(x.b[r * VALUE_HEADS + j])).collect();
            let gj: Vec<f32> = (0..t)
                .map(|r| -l.a_log[j].exp() * softplus(x.a[r * VALUE_HEADS + j] + l.dt_bias[j]))
                .collect();
            if chunked {
                delta_rule_chunked(&qj, &kj, &vj, &bj, &gj, HEAD_DIM, HEAD_DIM, s, CHUNK)
            } else {
                delta_rule_recurrent(&qj, &kj, &vj, &bj, &gj, HEAD_DIM, HEAD_DIM, s)
            }
        })
        .collect();
    let mut y = vec![0f32; t * VALUE_DIM];
    for s in 0..t {
        for (j, o) in outs.iter().enumerate() {
            let at = s * VALUE_DIM + j * HEAD_DIM;
            let out = &mut y[at..at + HEAD_DIM];
            rms_norm(&o[s * HEAD_DIM..(s + 1) * HEAD_DIM], &l.norm_w, EPS, out);
            out.iter_mut()
                .zip(&x.z[at..at + HEAD_DIM])
                .for_each(|(o, &z)| *o *= silu(z));
        }
    }
    y
}

/// |w_d·silu(z_d)| per output element: the scale of the gated norm's output for a unit-rms
/// normalised o, which tf32 noise in o reaches through.
fn gate_scale(l: &HostLayer, x: &HostInputs) -> Vec<f32> {
    x.z.iter()
        .enumerate()
        .map(|(i, &z)| (l.norm_w[i % HEAD_DIM] * silu(z)).abs())
        .collect()
}

/// Checks bf16 outputs `[rows][4096]` against a reference, per element within `rel_tol`·|ref| +
/// Y_ABS·rms(head), + Y_TF32_NORMED·gate for outputs of the tf32 kernel (see the top); returns
/// (max, mean) relative error.
fn check_y(
    what: &str,
    gpu: &[bf16],
    want: &[f32],
    rel_tol: f32,
    tf32_gate: Option<&[f32]>,
) -> (f32, f32) {
    assert_eq!(gpu.len(), want.len(), "{what}: output length");
    let (mut max_rel, mut sum_rel, mut n_rel) = (0f32, 0f64, 0usize);
    let mut max_normed = 0f32; // error / gate: the noise in the normalised o
    for (h, (g, w)) in gpu.chunks(HEAD_DIM).zip(want.chunks(HEAD_DIM)).enumerate() {
        let rms = (w.iter().map(|x| x * x).sum::<f32>() / HEAD_DIM as f32).sqrt();
        for (i, (&g, &w)) in g.iter().zip(w).enumerate() {
            let g = g.to_f32();
            let err = (g - w).abs();
            let gate = tf32_gate.map_or(0.0, |gate| gate[h * HEAD_DIM + i]);
            if gate > 1e-3 {
                max_normed = max_normed.max(err / gate);
            }
            let tf32 = Y_TF32_NORMED * gate;
            assert!(
                g.is_finite() && err <= rel_tol * w.abs() + Y_ABS * rms + tf32,
                "{what}: row {} head {} dim {i}: gpu {g}, reference {w} (head rms {rms})",
                h / VALUE_HEADS,
                h % VALUE_HEADS
            );
            if w.abs() > 0.1 * rms {
                let rel = err / w.abs();
                max_rel = max_rel.max(rel);
                sum_rel += rel as f64;
                n_rel += 1;
            }
        }
    }
    let mean = (sum_rel / n_rel.max(1) as f64) as f32;
    assert!(
        mean <= Y_MEAN_REL,
        "{what}: mean relative error {mean:.2e} > {Y_MEAN_REL:.0e}"
    );
    if tf32_gate.is_some() {
        println!(
            "{what}: largest error / |w·silu(z)| {max_normed:.2e} (the tf32 term allows {Y_TF32_NORMED:.0e})"
        );
    }
    (max_rel, mean)
}

/// Checks one sequence's GPU state against the reference's; returns the ssm error relative to its scale.
fn check_state(what: &str, ssm: &[f32], conv: &[bf16], want: &HostState) -> f32 {
    let scale = want.ssm.iter().fold(0f32, |m, x| m.max(x.abs()));
    let mut worst = (0f32, 0usize);
    for (i, (&g, &w)) in ssm.iter().zip(&want.ssm).enumerate() {
        let err = (g - w).abs();
        assert!(g.is_finite(), "{what}: ssm[{i}] = {g}");
        if err > worst.0 {
            worst = (err, i);
        }
    }
    let (err, i) = worst;
    let (head, d, v) = (
        i / (HEAD_DIM * HEAD_DIM),
        i / HEAD_DIM % HEAD_DIM,
        i % HEAD_DIM,
    );
    assert!(
        err <= STATE_REL * scale,
        "{what}: ssm head {head} [{d}][{v}]: gpu {}, reference {} (state scale {scale})",
        ssm[i],
        want.ssm[i]
    );
    for (i, (&g, &w)) in conv.iter().zip(&want.conv).enumerate() {
        assert_eq!(
            g.to_f32(),
            w,
            "{what}: conv state row {} channel {}",
            i / CONV_DIM,
            i % CONV_DIM
        );
    }
    err / scale.max(f32::MIN_POSITIVE)
}

#[test]
fn config_of_the_real_model_is_supported() {
    let json = lily::checkpoint::synth::preset("qwen3.6-35b-a3b").expect("preset");
    let mut c = ModelConfig::from_json(&json).expect("config");
    check_config(&c).expect("the real shapes");
    assert_eq!(CONV_DIM, c.conv_dim());
    assert_eq!(
        PROJ_DIM,
        c.conv_dim() + c.linear_value_dim() + 2 * c.linear_num_value_heads
    );
    c.linear_num_value_heads = 48;
    assert!(check_config(&c).is_err());
}

/// A batch of 4 decode rows over a pool of 5 slots (one row padding with slot −1), 6 steps from
/// random non-zero states, inputs in the fused layout with a padded stride; as one kernel and as
/// the two of many sequences.
#[test]
fn decode_matches_reference() {
    for split_rows in [usize::MAX, 1] {
        decode_matches_reference_with(split_rows);
    }
}

fn decode_matches_reference_with(split_rows: usize) {
    let dev = device();
    let stream = dev.stream().clone();
    let mut kernels = GdnKernels::load(&dev).expect("load");
    kernels.set_split_rows(split_rows);
    let mut ws = GdnWorkspace::new(&stream, 4).expect("workspace");
    let mut rng = rng("decode_matches_reference");
    let layer = HostLayer::random(&mut rng);
    let dl = DevLayer::upload(&stream, &layer);
    let slots: [i32; 4] = [3, -1, 0, 4];
    let mut states: Vec<HostState> = (0..5).map(|_| HostState::random(&mut rng)).collect();
    let initial = states.clone();
    let mut pools = DevPools::upload(&stream, &states);
    let slots_dev = stream.clone_htod(&slots).expect("upload");
    let stride = PROJ_DIM + 8;
    let (mut max_rel, mut max_state) = (0f32, 0f32);
    for step in 0..6 {
        let x = HostInputs::random(&mut rng, slots.len());
        let proj = stream.clone_htod(&x.fused(stride)).expect("upload");
        let proj_view = proj.slice(..);
        let inputs = GdnInputs::fused(&proj_view, stride).expect("fused inputs");
        let mut y = stream
            .clone_htod(&vec![bf16::NAN; slots.len() * VALUE_DIM])
            .expect("upload");
        kernels
            .decode(
                &dl.weights(),
                &inputs,
                &slots_dev.slice(..),
                &mut pools.ssm.slice_mut(..),
                &mut pools.conv.slice_mut(..),
                Some(&mut ws),
                &mut y.slice_mut(..),
            )
            .expect("decode");
        let y = download(&stream, &y);
        for (i, &slot) in slots.iter().enumerate() {
            let row = &y[i * VALUE_DIM..(i + 1) * VALUE_DIM];
            if slot < 0 {
                assert!(
                    row.iter().all(|v| v.to_bits() == bf16::NAN.to_bits()),
                    "step {step}: skipped row {i} was written"
                );
                continue;
            }
            let want = reference(&layer, &x.rows(i, 1), &mut states[slot as usize], false);
            max_rel = max_rel.max(
                check_y(
                    &format!("decode step {step} row {i}"),
                    row,
                    &want,
                    Y_REL,
                    None,
                )
                .0,
            );
        }
    }
    for (slot, (ssm, conv)) in pools.download(&stream).iter().enumerate() {
        if slots.contains(&(slot as i32)) {
            max_state = max_state.max(check_state(
                &format!("decode slot {slot}"),
                ssm,
                conv,
                &states[slot],
            ));
        } else {
            assert!(
                ssm == &initial[slot].ssm,
                "slot {slot} is in no batch row but its ssm state changed"
            );
            assert!(
                conv.iter()
                    .zip(&initial[slot].conv)
                    .all(|(g, &w)| g.to_f32() == w),
                "slot {slot}: conv state changed"
            );
        }
    }
    println!(
        "decode (two kernels from {split_rows} rows): y max relative error {max_rel:.2e}, \
         state max error / scale {max_state:.2e}"
    );
}

/// Prefill of T tokens from a random state vs the CPU's chunked form, for T around chunk edges and
/// past 16 chunks (2,500 tokens: gdn_prefill_qk's blocks then walk 3 chunks each, the last fewer).
#[test]
fn prefill_matches_reference() {
    let dev = device();
    let stream = dev.stream().clone();
    let mut kernels = GdnKernels::load(&dev).expect("load");
    let mut rng = rng("prefill_matches_reference");
    // Both output kernels: 3xTF32 (the default) and plain tf32 (LILY_GDN_OUT_TF32=1).
    for (t, tf32) in [1, 7, 64, 65, 200, 1000, 2500]
        .into_iter()
        .flat_map(|t| [(t, false), (t, true)])
    {
        kernels.set_out_tf32(tf32);
        let layer = HostLayer::random(&mut rng);
        let dl = DevLayer::upload(&stream, &layer);
        let x = HostInputs::random(&mut rng, t);
        let dx = DevInputs::upload(&stream, &x);
        let mut st = HostState::random(&mut rng);
        let mut pools = DevPools::upload(&stream, std::slice::from_ref(&st));
        // Sized above T (a whole chunk more), so chunks past the end exist and stay unused.
        let mut ws = GdnWorkspace::new(&stream, t + CHUNK).expect("workspace");
        let mut y = stream
            .clone_htod(&vec![bf16::NAN; t * VALUE_DIM])
            .expect("upload");
        kernels
            .prefill(
                &dl.weights(),
                &dx.inputs(),
                t,
                &mut pools.ssm.slice_mut(..),
                &mut pools.conv.slice_mut(..),
                &mut ws,
                &mut y.slice_mut(..),
            )
            .expect("prefill");
        let y = download(&stream, &y);
        let want = reference(&layer, &x, &mut st, true);
        let what = format!("prefill T={t}{}", if tf32 { " (out in tf32)" } else { "" });
        let gate = tf32.then(|| gate_scale(&layer, &x));
        let (max_rel, mean_rel) = check_y(&what, &y, &want, Y_REL, gate.as_deref());
        let (ssm, conv) = &pools.download(&stream)[0];
        let state_err = check_state(&what, ssm, conv, &st);
        println!("{what}: y max/mean relative error {max_rel:.2e}/{mean_rel:.2e}, state error / scale {state_err:.2e}");
    }
}

/// Prefill of 200 tokens then 8 decode steps vs 208 decode steps from the same state, both on the
/// GPU, and the decode-only run vs the CPU's token-by-token reference.
#[test]
fn prefill_then_decode_matches_decode_only() {
    let dev = device();
    let stream = dev.stream().clone();
    let kernels = GdnKernels::load(&dev).expect("load");
    let mut rng = rng("prefill_then_decode_matches_decode_only");
    let (t, steps) = (200, 8);
    let n = t + steps;
    let layer = HostLayer::random(&mut rng);
    let dl = DevLayer::upload(&stream, &layer);
    let x = HostInputs::random(&mut rng, n);
    let initial = HostState::random(&mut rng);
    let stride = PROJ_DIM;
    let proj = stream.clone_htod(&x.fused(stride)).expect("upload");
    let slot0 = stream.clone_htod(&[0i32]).expect("upload");

    // Decode step i of both runs reads fused row i and writes row i of y.
    let decode_steps =
        |pools: &mut DevPools, y: &mut CudaSlice<bf16>, rows: std::ops::Range<usize>| {
            for i in rows {
                let view = proj.slice(i * stride..);
                let inputs = GdnInputs::fused(&view, stride).expect("fused inputs");
                kernels
                    .decode(
                        &dl.weights(),
                        &inputs,
                        &slot0.slice(..),
                        &mut pools.ssm.slice_mut(..),
                        &mut pools.conv.slice_mut(..),
                        None,
                        &mut y.slice_mut(i * VALUE_DIM..(i + 1) * VALUE_DIM),
                    )
                    .expect("decode");
            }
        };

    let mut pools_a = DevPools::upload(&stream, std::slice::from_ref(&initial));
    let mut y_a = stream
        .clone_htod(&vec![bf16::NAN; n * VALUE_DIM])
        .expect("upload");
    let mut ws = GdnWorkspace::new(&stream, t).expect("workspace");
    {
        let view = proj.slice(..);
        let inputs = GdnInputs::fused(&view, stride).expect("fused inputs");
        kernels
            .prefill(
                &dl.weights(),
                &inputs,
                t,
                &mut pools_a.ssm.slice_mut(..),
                &mut pools_a.conv.slice_mut(..),
                &mut ws,
                &mut y_a.slice_mut(..t * VALUE_DIM),
            )
            .expect("prefill");
    }
    decode_steps(&mut pools_a, &mut y_a, t..n);

    let mut pools_b = DevPools::upload(&stream, std::slice::from_ref(&initial));
    let mut y_b = stream
        .clone_htod(&vec![bf16::NAN; n * VALUE_DIM])
        .expect("upload");
    decode_steps(&mut pools_b, &mut y_b, 0..n);

    let mut want = initial.clone();
    let y_ref = reference(&layer, &x, &mut want, false);
    let (y_a, y_b) = (download(&stream, &y_a), download(&stream, &y_b));
    let (rel_a, _) = check_y("prefill+decode vs CPU", &y_a, &y_ref, Y_REL, None);
    let (rel_b, _) = check_y("decode-only vs CPU", &y_b, &y_ref, Y_REL, None);
    let (ssm_b, conv_b) = &pools_b.download(&stream)[0];
    let err_b = check_state("decode-only vs CPU", ssm_b, conv_b, &want);

    // Prefill + decode against decode-only directly: the two differ only where fp32 noise moves a
    // value across a bf16 rounding boundary, so the mean difference is far below the CPU's.
    let y_b_f32: Vec<f32> = y_b.iter().map(|v| v.to_f32()).collect();
    let (rel_ab, mean_ab) = check_y(
        "prefill+decode vs decode-only",
        &y_a,
        &y_b_f32,
        Y_REL_GPU_PAIR,
        None,
    );
    let (ssm_a, conv_a) = &pools_a.download(&stream)[0];
    let state_b = HostState {
        conv: conv_b.iter().map(|v| v.to_f32()).collect(),
        ssm: ssm_b.clone(),
    };
    let err_ab = check_state("prefill+decode vs decode-only", ssm_a, conv_a, &state_b);
    println!(
        "vs CPU: y max relative error prefill+decode {rel_a:.2e}, decode-only {rel_b:.2e}, state {err_b:.2e}; \
         prefill+decode vs decode-only: y max/mean {rel_ab:.2e}/{mean_ab:.2e}, state {err_ab:.2e}"
    );
}

/// `decode_tokens` (a verify pass's rows: consecutive tokens of one sequence in three launches)
/// gives each row, the recurrent state and the conv state after the last row bit for bit what
/// that many one-token `decode` steps give, for 1 to 17 rows (fewer than the conv's history, and
/// more), and so the CPU reference's values within the decode tolerance; the states it keeps
/// after each row but the last are bit for bit those of the steps.
#[test]
fn decode_tokens_equal_one_token_steps() {
    let dev = device();
    let stream = dev.stream().clone();
    let kernels = GdnKernels::load(&dev).expect("load");
    let mut rng = rng("decode_tokens_equal_one_token_steps");
    let mut ws = GdnWorkspace::new(&stream, 17).expect("workspace");
    let slot0 = stream.clone_htod(&[0i32]).expect("upload");
    let stride = PROJ_DIM + 8; // not the packed width: the rows' stride is honoured
    for n in [1, 2, 3, 4, 5, 17] {
        let layer = HostLayer::random(&mut rng);
        let dl = DevLayer::upload(&stream, &layer);
        let x = HostInputs::random(&mut rng, n);
        let initial = HostState::random(&mut rng);
        let proj = stream.clone_htod(&x.fused(stride)).expect("upload");

        let mut steps = DevPools::upload(&stream, std::slice::from_ref(&initial));
        let mut y_steps = stream
            .clone_htod(&vec![bf16::NAN; n * VALUE_DIM])
            .expect("upload");
        // The states after each step but the last, as decode_tokens keeps them.
        let mut after_each = Vec::new();
        for i in 0..n {
            let view = proj.slice(i * stride..);
            let inputs = GdnInputs::fused(&view, stride).expect("fused inputs");
            kernels
                .decode(
                    &dl.weights(),
                    &inputs,
                    &slot0.slice(..),
                    &mut steps.ssm.slice_mut(..),
                    &mut steps.conv.slice_mut(..),
                    None,
                    &mut y_steps.slice_mut(i * VALUE_DIM..(i + 1) * VALUE_DIM),
                )
                .expect("decode");
            if i + 1 < n {
                after_each.push(steps.download(&stream).remove(0));
            }
        }

        let mut rows = DevPools::upload(&stream, std::slice::from_ref(&initial));
        let mut y_rows = stream
            .clone_htod(&vec![bf16::NAN; n * VALUE_DIM])
            .expect("upload");
        let view = proj.slice(..);
        let inputs = GdnInputs::fused(&view, stride).expect("fused inputs");
        // Room for the states after each row (NaN: a state not written shows); one row has none.
        let mut kept_ssm = stream
            .clone_htod(&vec![f32::NAN; (n - 1).max(1) * SSM_STATE_LEN])
            .expect("upload");
        let mut kept_conv = stream
            .clone_htod(&vec![bf16::NAN; (n - 1).max(1) * CONV_STATE_LEN])
            .expect("upload");
        let mut kept_ssm_view = kept_ssm.slice_mut(..(n - 1) * SSM_STATE_LEN);
        let mut kept_conv_view = kept_conv.slice_mut(..(n - 1) * CONV_STATE_LEN);
        kernels
            .decode_tokens(
                &dl.weights(),
                &inputs,
                n,
                &mut rows.ssm.slice_mut(..),
                &mut rows.conv.slice_mut(..),
                (n > 1).then_some((&mut kept_ssm_view, &mut kept_conv_view)),
                &mut ws,
                &mut y_rows.slice_mut(..),
            )
            .expect("decode_tokens");

        let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<u16>>();
        let (y_steps, y_rows) = (download(&stream, &y_steps), download(&stream, &y_rows));
        assert!(bits(&y_rows) == bits(&y_steps), "{n} rows: outputs differ");
        let (ssm_s, conv_s) = &steps.download(&stream)[0];
        let (ssm_r, conv_r) = &rows.download(&stream)[0];
        let ssm_bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        assert!(
            ssm_bits(ssm_r) == ssm_bits(ssm_s),
            "{n} rows: recurrent states differ"
        );
        assert!(bits(conv_r) == bits(conv_s), "{n} rows: conv states differ");
        let (kept_ssm, kept_conv) = (download(&stream, &kept_ssm), download(&stream, &kept_conv));
        for (i, (ssm_i, conv_i)) in after_each.iter().enumerate() {
            let at = |len: usize| i * len..(i + 1) * len;
            assert!(
                ssm_bits(&kept_ssm[at(SSM_STATE_LEN)]) == ssm_bits(ssm_i),
                "{n} rows: the recurrent state kept after row {i} differs from its step's"
            );
            assert!(
                bits(&kept_conv[at(CONV_STATE_LEN)]) == bits(conv_i),
                "{n} rows: the conv state kept after row {i} differs from its step's"
            );
        }

        let mut want = initial.clone();
        let y_ref = reference(&layer, &x, &mut want, false);
        let (rel, _) = check_y("decode_tokens vs CPU", &y_rows, &y_ref, Y_REL, None);
        let err = check_state("decode_tokens vs CPU", ssm_r, conv_r, &want);
        println!("{n} rows: bit for bit the one-token steps; vs CPU y {rel:.2e}, state {err:.2e}");
    }
}

/// `decode_tokens_in_slot` (a verify pass in a captured graph: the slot read on the device)
/// gives `decode_tokens`' bits on the listed slot of a pool, keeps the same states after each
/// row, and leaves the other slots alone; a slot outside the pool writes nothing.
#[test]
fn decode_tokens_in_slot_equal_decode_tokens() {
    let dev = device();
    let stream = dev.stream().clone();
    let kernels = GdnKernels::load(&dev).expect("load");
    let mut rng = rng("decode_tokens_in_slot_equal_decode_tokens");
    let mut ws = GdnWorkspace::new(&stream, 17).expect("workspace");
    let stride = PROJ_DIM;
    let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<u16>>();
    let ssm_bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    for (n, slot) in [(2usize, 2usize), (4, 0), (17, 1)] {
        let layer = HostLayer::random(&mut rng);
        let dl = DevLayer::upload(&stream, &layer);
        let x = HostInputs::random(&mut rng, n);
        let states: Vec<HostState> = (0..3).map(|_| HostState::random(&mut rng)).collect();
        let proj = stream.clone_htod(&x.fused(stride)).expect("upload");
        let view = proj.slice(..);
        let inputs = GdnInputs::fused(&view, stride).expect("fused inputs");
        let kept = |stream: &Arc<CudaStream>| {
            (
                stream
                    .clone_htod(&vec![f32::NAN; (n - 1) * SSM_STATE_LEN])
                    .expect("upload"),
                stream
                    .clone_htod(&vec![bf16::NAN; (n - 1) * CONV_STATE_LEN])
                    .expect("upload"),
            )
        };

        // decode_tokens on that slot's state alone.
        let mut one = DevPools::upload(&stream, std::slice::from_ref(&states[slot]));
        let mut y_one = stream
            .clone_htod(&vec![bf16::NAN; n * VALUE_DIM])
            .expect("upload");
        let (mut ssm_one, mut conv_one) = kept(&stream);
        kernels
            .decode_tokens(
                &dl.weights(),
                &inputs,
                n,
                &mut one.ssm.slice_mut(..),
                &mut one.conv.slice_mut(..),
                Some((&mut ssm_one.slice_mut(..), &mut conv_one.slice_mut(..))),
                &mut ws,
                &mut y_one.slice_mut(..),
            )
            .expect("decode_tokens");

        // decode_tokens_in_slot on the pool of three, then on a slot outside it.
        let mut pool = DevPools::upload(&stream, &states);
        let mut y_pool = stream
            .clone_htod(&vec![bf16::NAN; n * VALUE_DIM])
            .expect("upload");
        let (mut ssm_pool, mut conv_pool) = kept(&stream);
        let mut y_outside = stream
            .clone_htod(&vec![bf16::NAN; n * VALUE_DIM])
            .expect("upload");
        for (at, y) in [(slot as i32, &mut y_pool), (3, &mut y_outside)] {
            let slots = stream.clone_htod(&[at, 0]).expect("upload");
            kernels
                .decode_tokens_in_slot(
                    &dl.weights(),
                    &inputs,
                    n,
                    &slots.slice(..),
                    &mut pool.ssm.slice_mut(..),
                    &mut pool.conv.slice_mut(..),
                    Some((&mut ssm_pool.slice_mut(..), &mut conv_pool.slice_mut(..))),
                    &mut ws,
                    &mut y.slice_mut(..),
                )
                .expect("decode_tokens_in_slot");
        }
        assert!(
            download(&stream, &y_outside).iter().all(|v| v.is_nan()),
            "{n} rows: a slot outside the pool wrote outputs"
        );

        let (y_one, y_pool) = (download(&stream, &y_one), download(&stream, &y_pool));
        assert!(bits(&y_pool) == bits(&y_one), "{n} rows: outputs differ");
        let (ones, pools) = (one.download(&stream), pool.download(&stream));
        for (i, (ssm, conv)) in pools.iter().enumerate() {
            let (want_ssm, want_conv) = if i == slot {
                (ones[0].0.clone(), ones[0].1.clone())
            } else {
                let untouched = DevPools::upload(&stream, std::slice::from_ref(&states[i]));
                untouched.download(&stream).remove(0)
            };
            assert!(
                ssm_bits(ssm) == ssm_bits(&want_ssm) && bits(conv) == bits(&want_conv),
                "{n} rows in slot {slot}: slot {i}'s states are not what they should be"
            );
        }
        assert!(
            ssm_bits(&download(&stream, &ssm_pool)) == ssm_bits(&download(&stream, &ssm_one))
                && bits(&download(&stream, &conv_pool)) == bits(&download(&stream, &conv_one)),
            "{n} rows: the states kept after each row differ"
        );
        println!("{n} rows in slot {slot} of 3: bit for bit decode_tokens; slot 3 wrote nothing");
    }
}

/// `copy_states` (a verify pass's cut back: every layer's kept states into the slot, one
/// launch): each copy's states arrive bit for bit, and nothing else in the pools changes.
#[test]
fn copy_states_copies_whole_states_in_one_launch() {
    let dev = device();
    let stream = dev.stream().clone();
    let kernels = GdnKernels::load(&dev).expect("load");
    let mut rng = rng("copy_states_copies_whole_states_in_one_launch");
    let from: Vec<HostState> = (0..3).map(|_| HostState::random(&mut rng)).collect();
    let before: Vec<HostState> = (0..4).map(|_| HostState::random(&mut rng)).collect();
    let src = DevPools::upload(&stream, &from);
    // Three layers' pools of 4 slots; slot 1 of each gets state i.
    let mut pools: Vec<DevPools> = (0..3).map(|_| DevPools::upload(&stream, &before)).collect();
    let mut table = stream.clone_htod(&[0u64; 12]).expect("upload");
    let (ssm, conv) = (SSM_STATE_LEN, CONV_STATE_LEN);
    let mut copies: Vec<StateCopy> = pools
        .iter_mut()
        .enumerate()
        .map(|(i, p)| StateCopy {
            ssm_from: src.ssm.slice(i * ssm..(i + 1) * ssm),
            ssm_to: p.ssm.slice_mut(ssm..2 * ssm),
            conv_from: src.conv.slice(i * conv..(i + 1) * conv),
            conv_to: p.conv.slice_mut(conv..2 * conv),
        })
        .collect();
    kernels.copy_states(&mut copies, &mut table).expect("copy");
    drop(copies);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let wanted = src.download(&stream);
    for (i, p) in pools.iter().enumerate() {
        for (slot, (s, c)) in p.download(&stream).iter().enumerate() {
            let (want_s, want_c) = if slot == 1 {
                (bits(&wanted[i].0), wanted[i].1.clone())
            } else {
                (bits(&before[slot].ssm), to_bf16(&before[slot].conv))
            };
            assert!(bits(s) == want_s, "layer {i} slot {slot}: recurrent state");
            assert!(c == &want_c, "layer {i} slot {slot}: conv state");
        }
    }
    // A table too small for the copies is refused.
    let mut small = stream.clone_htod(&[0u64; 4]).expect("upload");
    let mut two: Vec<StateCopy> = pools
        .iter_mut()
        .take(2)
        .map(|p| {
            let (s, c) = (&mut p.ssm, &mut p.conv);
            StateCopy {
                ssm_from: src.ssm.slice(..ssm),
                ssm_to: s.slice_mut(..ssm),
                conv_from: src.conv.slice(..conv),
                conv_to: c.slice_mut(..conv),
            }
        })
        .collect();
    assert!(kernels.copy_states(&mut two, &mut small).is_err());
}

#[test]
fn zero_clears_listed_slots() {
    let dev = device();
    let stream = dev.stream().clone();
    let kernels = GdnKernels::load(&dev).expect("load");
    let mut rng = rng("zero_clears_listed_slots");
    let states: Vec<HostState> = (0..4).map(|_| HostState::random(&mut rng)).collect();
    let mut pools = DevPools::upload(&stream, &states);
    let list = stream.clone_htod(&[2i32, 0, 7, -1]).expect("upload"); // 7 and −1: out of range, skipped
    kernels
        .zero(
            &mut pools.ssm.slice_mut(..),
            &mut pools.conv.slice_mut(..),
            Some(&list.slice(..)),
        )
        .expect("zero");
    for (slot, (ssm, conv)) in pools.download(&stream).iter().enumerate() {
        if slot == 0 || slot == 2 {
            assert!(
                ssm.iter().all(|&v| v == 0.0) && conv.iter().all(|v| v.to_f32() == 0.0),
                "slot {slot} not zeroed"
            );
        } else {
            assert!(ssm == &states[slot].ssm, "slot {slot} changed");
        }
    }
    kernels
        .zero(
            &mut pools.ssm.slice_mut(..),
            &mut pools.conv.slice_mut(..),
            None,
        )
        .expect("zero all");
    for (slot, (ssm, conv)) in pools.download(&stream).iter().enumerate() {
        assert!(
            ssm.iter().all(|&v| v == 0.0) && conv.iter().all(|v| v.to_f32() == 0.0),
            "slot {slot} not zeroed"
        );
    }
}

/// `decode_in_pass` (the state read before the PDL wait, as forward passes run it) gives the same
/// bits as `decode`, for 3 sequences in a pool of 4 (the launch comes after a host sync here, so
/// nothing can still be writing the state; forward.rs's passes guarantee that by their order);
/// and the two kernels of many sequences give the same bits as the one, either way.
#[test]
fn decode_in_pass_equals_decode() {
    let dev = device();
    let stream = dev.stream().clone();
    let mut kernels = GdnKernels::load(&dev).expect("load");
    let mut ws = GdnWorkspace::new(&stream, 3).expect("workspace");
    let mut rng = rng("decode_in_pass");
    let dl = DevLayer::upload(&stream, &HostLayer::random(&mut rng));
    let states: Vec<HostState> = (0..4).map(|_| HostState::random(&mut rng)).collect();
    let x = HostInputs::random(&mut rng, 3);
    let dx = DevInputs::upload(&stream, &x);
    let slots = stream.clone_htod(&[2i32, 0, 3]).expect("upload");
    let mut outs = Vec::new();
    let ways = [
        (false, usize::MAX),
        (true, usize::MAX),
        (false, 1),
        (true, 1),
    ];
    for (in_pass, split_rows) in ways {
        kernels.set_split_rows(split_rows);
        let mut pools = DevPools::upload(&stream, &states);
        let mut y = stream
            .clone_htod(&vec![bf16::ZERO; 3 * VALUE_DIM])
            .expect("upload");
        stream.synchronize().expect("sync");
        let (w, inputs) = (dl.weights(), dx.inputs());
        let (mut ssm, mut conv) = (pools.ssm.slice_mut(..), pools.conv.slice_mut(..));
        let mut yv = y.slice_mut(..);
        let decode = if in_pass {
            GdnKernels::decode_in_pass
        } else {
            GdnKernels::decode
        };
        let slots = slots.slice(..);
        decode(
            &kernels,
            &w,
            &inputs,
            &slots,
            &mut ssm,
            &mut conv,
            Some(&mut ws),
            &mut yv,
        )
        .expect("decode");
        let y: Vec<u16> = download(&stream, &y).iter().map(|v| v.to_bits()).collect();
        let state: Vec<(Vec<u32>, Vec<u16>)> = pools
            .download(&stream)
            .into_iter()
            .map(|(s, c)| {
                (
                    s.iter().map(|v| v.to_bits()).collect(),
                    c.iter().map(|v| v.to_bits()).collect(),
                )
            })
            .collect();
        outs.push((y, state));
    }
    for (i, (in_pass, split_rows)) in ways.iter().enumerate().skip(1) {
        let what = format!("in pass {in_pass}, two kernels from {split_rows} rows");
        assert!(outs[0].0 == outs[i].0, "{what}: outputs differ");
        assert!(outs[0].1 == outs[i].1, "{what}: states differ");
    }
}

#[test]
fn rejects_bad_arguments() {
    let dev = device();
    let stream = dev.stream().clone();
    let kernels = GdnKernels::load(&dev).expect("load");
    let mut rng = rng("rejects_bad_arguments");
    let dl = DevLayer::upload(&stream, &HostLayer::random(&mut rng));
    let x = HostInputs::random(&mut rng, 2);
    let dx = DevInputs::upload(&stream, &x);
    let mut pools = DevPools::upload(
        &stream,
        &[HostState::random(&mut rng), HostState::random(&mut rng)],
    );
    let slots = stream.clone_htod(&[0i32, 1]).expect("upload");
    let mut y = stream
        .clone_htod(&vec![bf16::ZERO; 2 * VALUE_DIM + 8])
        .expect("upload");
    let mut ws = GdnWorkspace::new(&stream, 1).expect("workspace");
    let w = dl.weights();

    // y one value too long.
    assert!(kernels
        .decode(
            &w,
            &dx.inputs(),
            &slots.slice(..),
            &mut pools.ssm.slice_mut(..),
            &mut pools.conv.slice_mut(..),
            None,
            &mut y.slice_mut(..2 * VALUE_DIM + 1)
        )
        .is_err());
    // A pool that is not whole slots.
    assert!(kernels
        .decode(
            &w,
            &dx.inputs(),
            &slots.slice(..),
            &mut pools.ssm.slice_mut(4..),
            &mut pools.conv.slice_mut(..),
            None,
            &mut y.slice_mut(..2 * VALUE_DIM)
        )
        .is_err());
    // y not 16-byte aligned.
    assert!(kernels
        .decode(
            &w,
            &dx.inputs(),
            &slots.slice(..1),
            &mut pools.ssm.slice_mut(..),
            &mut pools.conv.slice_mut(..),
            None,
            &mut y.slice_mut(1..VALUE_DIM + 1)
        )
        .is_err());
    // qkv rows too short for two sequences, and a stride that is not a multiple of 8.
    let mut short = dx.inputs();
    short.qkv.data = dx.qkv.slice(..CONV_DIM + 100);
    assert!(kernels
        .decode(
            &w,
            &short,
            &slots.slice(..),
            &mut pools.ssm.slice_mut(..),
            &mut pools.conv.slice_mut(..),
            None,
            &mut y.slice_mut(..2 * VALUE_DIM)
        )
        .is_err());
    let mut odd = dx.inputs();
    odd.z = Rows {
        data: dx.z.slice(..),
        stride: VALUE_DIM + 4,
    };
    assert!(kernels
        .decode(
            &w,
            &odd,
            &slots.slice(..1),
            &mut pools.ssm.slice_mut(..),
            &mut pools.conv.slice_mut(..),
            None,
            &mut y.slice_mut(..VALUE_DIM)
        )
        .is_err());
    // Prefill: more tokens than the workspace holds (2 > 1), and a two-sequence state.
    assert!(kernels
        .prefill(
            &w,
            &dx.inputs(),
            2,
            &mut pools.ssm.slice_mut(..SSM_STATE_LEN),
            &mut pools.conv.slice_mut(..CONV_STATE_LEN),
            &mut ws,
            &mut y.slice_mut(..2 * VALUE_DIM)
        )
        .is_err());
    assert!(kernels
        .prefill(
            &w,
            &dx.inputs(),
            1,
            &mut pools.ssm.slice_mut(..),
            &mut pools.conv.slice_mut(..),
            &mut ws,
            &mut y.slice_mut(..VALUE_DIM)
        )
        .is_err());
    // Wrong weight sizes.
    let mut bad = dl.weights();
    bad.norm_w = dl.norm_w.slice(..64);
    assert!(kernels
        .prefill(
            &bad,
            &dx.inputs(),
            1,
            &mut pools.ssm.slice_mut(..SSM_STATE_LEN),
            &mut pools.conv.slice_mut(..CONV_STATE_LEN),
            &mut ws,
            &mut y.slice_mut(..VALUE_DIM)
        )
        .is_err());
    // The fused layout needs whole rows of PROJ_DIM.
    let proj = stream.clone_htod(&x.fused(PROJ_DIM)).expect("upload");
    assert!(GdnInputs::fused(&proj.slice(..), PROJ_DIM - 8).is_err());
}

/// Median of `runs` timings (ms) of `body`, each between two events on the stream.
fn median_ms(dev: &CudaDevice, runs: usize, mut body: impl FnMut()) -> f32 {
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let (start, end) = (
        dev.context().new_event(flags).expect("event"),
        dev.context().new_event(flags).expect("event"),
    );
    let mut times: Vec<f32> = (0..runs)
        .map(|_| {
            start.record(dev.stream()).expect("record");
            body();
            end.record(dev.stream()).expect("record");
            start.elapsed_ms(&end).expect("elapsed")
        })
        .collect();
    times.sort_by(f32::total_cmp);
    times[runs / 2]
}

/// The decode step of all 30 GDN layers (one CUDA graph of 30 launches, or 60 as two kernels),
/// for batches of 1, 2, 4, 8 and 64 sequences, and a 4096-token prefill of one layer. Prints; asserts
/// nothing about speed.
#[test]
fn timing() {
    const LAYERS: usize = 30;
    let dev = device();
    let stream = dev.stream().clone();
    let mut kernels = GdnKernels::load(&dev).expect("load");
    let mut rng = rng("timing");
    let layers: Vec<DevLayer> = (0..LAYERS)
        .map(|_| DevLayer::upload(&stream, &HostLayer::random(&mut rng)))
        .collect();
    let mut dws = GdnWorkspace::new(&stream, 64).expect("workspace");
    for (batch, split_rows) in [
        (1usize, usize::MAX),
        (2, usize::MAX),
        (2, 1),
        (4, usize::MAX),
        (4, 1),
        (8, usize::MAX),
        (8, 1),
        (64, usize::MAX),
        (64, 1),
    ] {
        kernels.set_split_rows(split_rows);
        let states: Vec<HostState> = (0..batch).map(|_| HostState::random(&mut rng)).collect();
        let mut pools: Vec<DevPools> = (0..LAYERS)
            .map(|_| DevPools::upload(&stream, &states))
            .collect();
        let x = HostInputs::random(&mut rng, batch);
        let proj = stream.clone_htod(&x.fused(PROJ_DIM)).expect("upload");
        let slots: Vec<i32> = (0..batch as i32).collect();
        let slots = stream.clone_htod(&slots).expect("upload");
        let mut y = stream
            .clone_htod(&vec![bf16::ZERO; batch * VALUE_DIM])
            .expect("upload");
        stream.synchronize().expect("sync");

        stream
            .begin_capture(
                cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
            .expect("capture");
        {
            let view = proj.slice(..);
            let inputs = GdnInputs::fused(&view, PROJ_DIM).expect("fused inputs");
            for (l, p) in layers.iter().zip(pools.iter_mut()) {
                kernels
                    .decode(
                        &l.weights(),
                        &inputs,
                        &slots.slice(..),
                        &mut p.ssm.slice_mut(..),
                        &mut p.conv.slice_mut(..),
                        Some(&mut dws),
                        &mut y.slice_mut(..),
                    )
                    .expect("decode");
            }
        }
        let graph = stream
            .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
            .expect("end capture")
            .expect("a graph");
        for _ in 0..5 {
            graph.launch().expect("graph");
        }
        let ms = median_ms(&dev, 50, || graph.launch().expect("graph"));
        let bytes = (LAYERS * batch * 2 * SSM_STATE_LEN * 4) as f64;
        println!(
            "decode, {LAYERS} layers, batch {batch}{}: {:.1} µs per step ({:.2} µs per layer), {:.0} GB/s of fp32 state read + written",
            if batch >= split_rows { " as two kernels" } else { "" },
            ms * 1e3,
            ms * 1e3 / LAYERS as f32,
            bytes / (ms as f64 * 1e-3) / 1e9
        );
    }

    let t = 4096;
    let dl = &layers[0];
    let x = HostInputs::random(&mut rng, t);
    let dx = DevInputs::upload(&stream, &x);
    let mut pools = DevPools::upload(&stream, &[HostState::random(&mut rng)]);
    let mut ws = GdnWorkspace::new(&stream, t).expect("workspace");
    let mut y = stream
        .clone_htod(&vec![bf16::ZERO; t * VALUE_DIM])
        .expect("upload");
    let mut run_with = |k: &GdnKernels| {
        k.prefill(
            &dl.weights(),
            &dx.inputs(),
            t,
            &mut pools.ssm.slice_mut(..),
            &mut pools.conv.slice_mut(..),
            &mut ws,
            &mut y.slice_mut(..),
        )
        .expect("prefill")
    };
    run_with(&kernels);
    let ms = median_ms(&dev, 5, || run_with(&kernels));
    println!(
        "prefill, one layer, {t} tokens: {ms:.3} ms ({:.0} tokens/s per layer; ×{LAYERS} layers: {:.1} ms)",
        t as f32 / (ms * 1e-3),
        ms * LAYERS as f32
    );
    // Each of the chunked rule's kernels apart (CUDA events between them: lily bench --profile's),
    // with either output kernel.
    for tf32 in [false, true] {
        kernels.set_out_tf32(tf32);
        let mut profile = OpProfile::default();
        for _ in 0..3 {
            profile
                .time(&stream, || {
                    run_with(&kernels);
                    Ok(())
                })
                .expect("profiled prefill");
        }
        for op in profile.take() {
            println!("  {}: {:.3} ms per prefill", op.kernel, op.ms / 3.0);
        }
    }
}
