//! The gated-attention kernels (src/cuda/attention.rs) against the CPU reference
//! (model::cpu::attention's math, from its pieces in model::cpu::ops) on fresh random inputs at
//! the real shapes of Qwen3.6-35B-A3B. Each run draws a new seed (printed, to reproduce a failure:
//! LILY_TEST_SEED=<seed>).
//!
//! Needs an sm_90a GPU: without one every test but `reference_matches_model_cpu_attention` (which
//! checks the reference itself) fails at `CudaDevice::new`.
//! Tolerances: bf16 outputs are compared with an fp32 reference, row by row (a token's 4096
//! outputs), as max |gpu − ref| / max |ref| ≤ 2e-2 (bf16 rounding alone is 2e-3; the rest comes
//! from bf16 queries, keys and softmax weights in the tensor-core products). Queries and keys
//! after norm and RoPE: |gpu − ref| ≤ 8e-3·|ref| + 2e-3 per value. Values: bit-exact copies.
//! Unwritten memory holds NaN (outputs, cache rows past the sequence), so a kernel that skips a
//! value or reads a row it should not shows up as NaN.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use half::bf16;
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use rayon::prelude::*;

use lily::checkpoint::synth::preset;
use lily::config::ModelConfig;
use lily::cuda::attention::{
    AttentionKernels, AttentionWorkspace, KvCache, PrefillKernel, HEAD_DIM, KV_HEADS, OUT_WIDTH,
    QKV_WIDTH, Q_HEADS,
};
use lily::cuda::{CudaDevice, CudaSlice, CudaStream};
use lily::model::cpu::attention;
use lily::model::cpu::ops::{apply_rope, dot, matmul, rms_norm, rope_angles, sigmoid, softmax};
use lily::model::state::KvCache as CpuKvCache;
use lily::model::weights::{AttentionWeights, Matrix};

const OUT_TOLERANCE: f32 = 2e-2;
const QK_REL: f32 = 8e-3;
const QK_ABS: f32 = 2e-3;
/// A bf16 NaN, the content of every buffer before a kernel writes it.
const POISON: bf16 = bf16::from_bits(0x7fc1);
const GROUP: usize = Q_HEADS / KV_HEADS;
/// The prefill kernels the tests run on the same inputs: (kernel, name).
const PREFILL_KERNELS: [(PrefillKernel, &str); 4] = [
    (PrefillKernel::MmaSync, "mma.sync"),
    (PrefillKernel::Wgmma, "wgmma"),
    (PrefillKernel::WgmmaSplit(3), "wgmma, 3 key splits"),
    // What the forward pass runs: wgmma at long chunks, split as the waves ask.
    (PrefillKernel::WgmmaForLong, "default"),
];

struct Gpu {
    _dev: CudaDevice,
    stream: Arc<CudaStream>,
    kernels: AttentionKernels,
    config: ModelConfig,
}

fn gpu() -> Gpu {
    let config = ModelConfig::from_json(&preset("qwen3.6-35b-a3b").unwrap()).unwrap();
    let dev = CudaDevice::new(0)
        .unwrap_or_else(|e| panic!("the attention kernel tests need an H100/H200: {e}"));
    let kernels = AttentionKernels::load(&dev, &config).expect("loading the attention kernels");
    Gpu {
        stream: dev.stream().clone(),
        _dev: dev,
        kernels,
        config,
    }
}

fn seed(test: &str) -> u64 {
    let seed = std::env::var("LILY_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    println!("{test}: seed {seed}");
    seed
}

/// `n` values uniform in [lo, hi), generated in parallel (the caches hold tens of millions).
fn uniform(n: usize, lo: f32, hi: f32, seed: u64) -> Vec<f32> {
    let mut v = vec![0f32; n];
    v.par_chunks_mut(1 << 16)
        .enumerate()
        .for_each(|(i, chunk)| {
            let mut rng =
                SmallRng::seed_from_u64(seed ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            chunk.iter_mut().for_each(|x| *x = rng.random_range(lo..hi));
        });
    v
}

fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.par_iter().map(|&x| bf16::from_f32(x)).collect()
}

fn to_f32(v: &[bf16]) -> Vec<f32> {
    v.par_iter().map(|x| x.to_f32()).collect()
}

/// Random bf16 activations of the fused projection, `[tokens][QKV_WIDTH]`.
fn random_qkv(tokens: usize, seed: u64) -> Vec<bf16> {
    to_bf16(&uniform(tokens * QKV_WIDTH, -2.0, 2.0, seed))
}

/// Effective norm weights (1 + w) in [0.5, 2): scores of a few units, a softmax neither flat nor one-hot.
fn random_norm(seed: u64) -> Vec<f32> {
    uniform(HEAD_DIM, 0.5, 2.0, seed)
}

fn fill(stream: &Arc<CudaStream>, buf: &mut CudaSlice<bf16>, value: bf16) {
    let chunk = vec![value; 1 << 22];
    let n = buf.len();
    for s in (0..n).step_by(chunk.len()) {
        let e = (s + chunk.len()).min(n);
        stream
            .memcpy_htod(&chunk[..e - s], &mut buf.slice_mut(s..e))
            .unwrap();
    }
}

fn poisoned_cache(g: &Gpu, slots: usize, layers: usize, capacity: usize) -> KvCache {
    let mut cache = KvCache::new(&g.stream, slots, layers, capacity).unwrap();
    fill(&g.stream, cache.keys_mut(), POISON);
    fill(&g.stream, cache.values_mut(), POISON);
    cache
}

fn upload<T: cudarc::driver::DeviceRepr>(g: &Gpu, v: &[T]) -> CudaSlice<T> {
    g.stream.clone_htod(v).unwrap()
}

fn download<T: cudarc::driver::DeviceRepr>(g: &Gpu, v: &CudaSlice<T>) -> Vec<T> {
    g.stream.clone_dtoh(v).unwrap()
}

fn poisoned_out(g: &Gpu, tokens: usize) -> CudaSlice<bf16> {
    upload(g, &vec![POISON; tokens * OUT_WIDTH])
}

/// The keys and values of one (sequence, layer) on the host, fp32 `[kv_head][pos][256]`, as the
/// reference sees them: rows written before (random bf16) and rows the reference computed.
struct HostCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl HostCache {
    fn new(capacity: usize) -> Self {
        Self {
            k: vec![vec![f32::NAN; capacity * HEAD_DIM]; KV_HEADS],
            v: vec![vec![f32::NAN; capacity * HEAD_DIM]; KV_HEADS],
        }
    }
}

/// Writes `len` random rows (positions 0..len) into (slot, layer) of the device cache and the
/// host copy: what earlier chunks of the sequence left there.
fn random_prefix(
    g: &Gpu,
    cache: &mut KvCache,
    host: &mut HostCache,
    slot: usize,
    layer: usize,
    len: usize,
    seed: u64,
) {
    if len == 0 {
        return;
    }
    for h in 0..KV_HEADS {
        let k = to_bf16(&uniform(
            len * HEAD_DIM,
            -2.0,
            2.0,
            seed ^ (2 * h as u64 + 1),
        ));
        let v = to_bf16(&uniform(
            len * HEAD_DIM,
            -1.0,
            1.0,
            seed ^ (2 * h as u64 + 2),
        ));
        let at = cache.offset(slot, layer, h, 0);
        g.stream
            .memcpy_htod(&k, &mut cache.keys_mut().slice_mut(at..at + k.len()))
            .unwrap();
        g.stream
            .memcpy_htod(&v, &mut cache.values_mut().slice_mut(at..at + v.len()))
            .unwrap();
        host.k[h][..k.len()].copy_from_slice(&to_f32(&k));
        host.v[h][..v.len()].copy_from_slice(&to_f32(&v));
    }
}

/// One token after attn_prepare's math, on the CPU: the steps of model::cpu::attention::forward
/// that follow the projections.
struct PreparedToken {
    q: Vec<f32>,    // [16][256], normed and rotated
    gate: Vec<f32>, // [16][256]
    k: Vec<f32>,    // [2][256], normed and rotated
    v: Vec<f32>,    // [2][256]
}

fn prepare_ref(
    c: &ModelConfig,
    row: &[f32],
    pos: usize,
    q_norm: &[f32],
    k_norm: &[f32],
) -> PreparedToken {
    let (cos, sin) = rope_angles(pos, c.rotary_dim, c.rope_theta);
    let mut q = vec![0f32; Q_HEADS * HEAD_DIM];
    let mut gate = vec![0f32; Q_HEADS * HEAD_DIM];
    for h in 0..Q_HEADS {
        let src = &row[h * 2 * HEAD_DIM..(h + 1) * 2 * HEAD_DIM];
        let qh = &mut q[h * HEAD_DIM..(h + 1) * HEAD_DIM];
        rms_norm(&src[..HEAD_DIM], q_norm, c.rms_norm_eps, qh);
        apply_rope(qh, &cos, &sin);
        gate[h * HEAD_DIM..(h + 1) * HEAD_DIM].copy_from_slice(&src[HEAD_DIM..]);
    }
    let kv = Q_HEADS * 2 * HEAD_DIM;
    let mut k = vec![0f32; KV_HEADS * HEAD_DIM];
    for h in 0..KV_HEADS {
        let kh = &mut k[h * HEAD_DIM..(h + 1) * HEAD_DIM];
        rms_norm(
            &row[kv + h * HEAD_DIM..kv + (h + 1) * HEAD_DIM],
            k_norm,
            c.rms_norm_eps,
            kh,
        );
        apply_rope(kh, &cos, &sin);
    }
    let v = row[kv + KV_HEADS * HEAD_DIM..QKV_WIDTH].to_vec();
    PreparedToken { q, gate, k, v }
}

/// Stores a prepared token's key and value at `pos` of the host cache.
fn append_ref(host: &mut HostCache, t: &PreparedToken, pos: usize) {
    for h in 0..KV_HEADS {
        host.k[h][pos * HEAD_DIM..(pos + 1) * HEAD_DIM]
            .copy_from_slice(&t.k[h * HEAD_DIM..(h + 1) * HEAD_DIM]);
        host.v[h][pos * HEAD_DIM..(pos + 1) * HEAD_DIM]
            .copy_from_slice(&t.v[h * HEAD_DIM..(h + 1) * HEAD_DIM]);
    }
}

/// The gated attention output of one token at `pos` (sees rows 0..=pos), `[4096]`: per head
/// softmax(q·k / 16) · V · sigmoid(gate), as model::cpu::attention::forward computes it.
fn attend_ref(host: &HostCache, t: &PreparedToken, pos: usize) -> Vec<f32> {
    let scale = 1.0 / (HEAD_DIM as f32).sqrt();
    let mut out = vec![0f32; OUT_WIDTH];
    out.par_chunks_mut(HEAD_DIM).enumerate().for_each(|(h, o)| {
        let (keys, values) = (&host.k[h / GROUP], &host.v[h / GROUP]);
        let qh = &t.q[h * HEAD_DIM..(h + 1) * HEAD_DIM];
        let mut p: Vec<f32> = (0..=pos)
            .map(|j| dot(qh, &keys[j * HEAD_DIM..(j + 1) * HEAD_DIM]) * scale)
            .collect();
        softmax(&mut p);
        for (j, pj) in p.iter().enumerate() {
            o.iter_mut()
                .zip(&values[j * HEAD_DIM..(j + 1) * HEAD_DIM])
                .for_each(|(o, &v)| *o += pj * v);
        }
        o.iter_mut()
            .zip(&t.gate[h * HEAD_DIM..(h + 1) * HEAD_DIM])
            .for_each(|(o, &g)| *o *= sigmoid(g));
    });
    out
}

/// Max over rows of `row` values of max |gpu − ref| / max |ref|; every gpu value must be finite.
fn row_error(what: &str, gpu: &[f32], reference: &[f32], row: usize) -> f32 {
    assert_eq!(gpu.len(), reference.len(), "{what}: lengths");
    if let Some(i) = gpu.iter().position(|v| !v.is_finite()) {
        panic!(
            "{what}: value {i} (row {}) is {} (never written, or NaN/inf computed)",
            i / row,
            gpu[i]
        );
    }
    gpu.chunks(row)
        .zip(reference.chunks(row))
        .map(|(a, b)| {
            let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
        })
        .fold(0f32, f32::max)
}

fn check_rows(what: &str, gpu: &[f32], reference: &[f32], row: usize, tol: f32) {
    let err = row_error(what, gpu, reference, row);
    println!("  {what}: max row rel. error {err:.2e} (bound {tol:.0e})");
    assert!(err <= tol, "{what}: rel. error {err:.3e} > {tol:.0e}");
}

/// Per value: |gpu − ref| ≤ rel·|ref| + abs.
fn check_each(what: &str, gpu: &[f32], reference: &[f32], rel: f32, abs: f32) {
    assert_eq!(gpu.len(), reference.len(), "{what}: lengths");
    let mut worst = 0f32;
    for (i, (&x, &y)) in gpu.iter().zip(reference).enumerate() {
        let bound = rel * y.abs() + abs;
        assert!(
            (x - y).abs() <= bound,
            "{what}: value {i}: gpu {x}, reference {y}"
        );
        worst = worst.max((x - y).abs() / bound);
    }
    println!("  {what}: worst error {worst:.2} of its bound");
}

/// The device cache rows `rows` of (slot, layer), K and V, as fp32 `[kv_head][row][256]`.
fn cache_rows(
    g: &Gpu,
    cache: &KvCache,
    slot: usize,
    layer: usize,
    rows: std::ops::Range<usize>,
) -> (Vec<f32>, Vec<f32>) {
    let (mut k, mut v) = (Vec::new(), Vec::new());
    for h in 0..KV_HEADS {
        let (a, b) = (
            cache.offset(slot, layer, h, rows.start),
            cache.offset(slot, layer, h, rows.end),
        );
        k.extend(to_f32(
            &g.stream.clone_dtoh(&cache.keys().slice(a..b)).unwrap(),
        ));
        v.extend(to_f32(
            &g.stream.clone_dtoh(&cache.values().slice(a..b)).unwrap(),
        ));
    }
    (k, v)
}

/// Checks the rows a call appended: keys against the reference, values bit for bit.
fn check_appended(
    g: &Gpu,
    cache: &KvCache,
    slot: usize,
    layer: usize,
    pos: usize,
    t: &PreparedToken,
    what: &str,
) {
    let (k, v) = cache_rows(g, cache, slot, layer, pos..pos + 1);
    check_each(&format!("{what} appended key"), &k, &t.k, QK_REL, QK_ABS);
    let v_in: Vec<f32> = t.v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect();
    assert_eq!(v, v_in, "{what}: appended value row differs from the input");
}

/// Every value of the cache except the listed (slot, layer, rows) must still be poison.
fn check_untouched(g: &Gpu, cache: &KvCache, written: &[(usize, usize, std::ops::Range<usize>)]) {
    let (k, v) = (download(g, cache.keys()), download(g, cache.values()));
    let mut expect_written = vec![false; k.len()];
    for (slot, layer, rows) in written {
        for h in 0..KV_HEADS {
            expect_written[cache.offset(*slot, *layer, h, rows.start)
                ..cache.offset(*slot, *layer, h, rows.end)]
                .fill(true);
        }
    }
    for (name, buf) in [("K", &k), ("V", &v)] {
        let bad = buf
            .par_iter()
            .zip(&expect_written)
            .position_any(|(x, &w)| !w && x.to_bits() != POISON.to_bits());
        assert!(
            bad.is_none(),
            "{name} cache value {} was written but belongs to no appended row",
            bad.unwrap()
        );
    }
}

/// The reference above is model::cpu::attention::forward taken apart after its projections.
/// This checks the pieces against the whole on the CPU (no GPU needed): random projections of a
/// small hidden size, the real head shapes, 7 new tokens after 37 cached ones.
#[test]
fn reference_matches_model_cpu_attention() {
    let c = ModelConfig::from_json(&preset("qwen3.6-35b-a3b").unwrap()).unwrap();
    let seed = seed("reference_matches_model_cpu_attention");
    let (hidden, t, start) = (64, 7, 37);
    let q_rows = Q_HEADS * 2 * HEAD_DIM;
    let kv_rows = KV_HEADS * HEAD_DIM;
    let w = AttentionWeights {
        q_proj: Matrix::from_f32(
            q_rows,
            hidden,
            &uniform(q_rows * hidden, -0.3, 0.3, seed ^ 1),
        ),
        k_proj: Matrix::from_f32(
            kv_rows,
            hidden,
            &uniform(kv_rows * hidden, -0.3, 0.3, seed ^ 2),
        ),
        v_proj: Matrix::from_f32(
            kv_rows,
            hidden,
            &uniform(kv_rows * hidden, -0.3, 0.3, seed ^ 3),
        ),
        o_proj: Matrix::from_f32(
            hidden,
            OUT_WIDTH,
            &uniform(hidden * OUT_WIDTH, -0.05, 0.05, seed ^ 4),
        ),
        q_norm: random_norm(seed ^ 5),
        k_norm: random_norm(seed ^ 6),
    };
    let x = uniform(t * hidden, -1.0, 1.0, seed ^ 7);
    // The cache of the earlier tokens, in both layouts.
    let mut host = HostCache::new(start + t);
    let prefix_k = uniform(start * kv_rows, -2.0, 2.0, seed ^ 8);
    let prefix_v = uniform(start * kv_rows, -1.0, 1.0, seed ^ 9);
    for p in 0..start {
        for h in 0..KV_HEADS {
            let (src, dst) = (
                (p * KV_HEADS + h) * HEAD_DIM..(p * KV_HEADS + h + 1) * HEAD_DIM,
                p * HEAD_DIM..(p + 1) * HEAD_DIM,
            );
            host.k[h][dst.clone()].copy_from_slice(&prefix_k[src.clone()]);
            host.v[h][dst].copy_from_slice(&prefix_v[src]);
        }
    }
    let mut cpu_cache = CpuKvCache {
        keys: prefix_k,
        values: prefix_v,
    };
    let whole = attention::forward(&c, &w, &x, t, start, &mut cpu_cache);

    let (q, k, v) = (
        matmul(&w.q_proj, &x, t),
        matmul(&w.k_proj, &x, t),
        matmul(&w.v_proj, &x, t),
    );
    let mut gated = Vec::new();
    for i in 0..t {
        let row: Vec<f32> = [
            &q[i * q_rows..(i + 1) * q_rows],
            &k[i * kv_rows..(i + 1) * kv_rows],
            &v[i * kv_rows..(i + 1) * kv_rows],
        ]
        .concat();
        let p = prepare_ref(&c, &row, start + i, &w.q_norm, &w.k_norm);
        append_ref(&mut host, &p, start + i);
        gated.extend(attend_ref(&host, &p, start + i));
    }
    let pieces = matmul(&w.o_proj, &gated, t);
    let err = row_error("pieces vs attention::forward", &pieces, &whole, hidden);
    println!("  pieces vs attention::forward: rel. error {err:.2e}");
    assert!(
        err <= 1e-5,
        "the test reference differs from model::cpu::attention::forward: {err:.2e}"
    );
    for h in 0..KV_HEADS {
        for p in start..start + t {
            let cpu =
                &cpu_cache.keys[(p * KV_HEADS + h) * HEAD_DIM..(p * KV_HEADS + h + 1) * HEAD_DIM];
            assert_eq!(
                cpu,
                &host.k[h][p * HEAD_DIM..(p + 1) * HEAD_DIM],
                "appended key {p} of KV head {h}"
            );
        }
    }
}

/// Every prefill kernel (attn_prefill, split over the keys where it would be, and
/// attn_prefill_wgmma whole and in 3 key splits, whose chunk edges cut through blocks of tokens)
/// on the same inputs, against the CPU reference.
#[test]
fn prefill_matches_cpu() {
    let mut g = gpu();
    let seed = seed("prefill_matches_cpu");
    let (slots, layers, slot, layer) = (2, 2, 1, 1);
    let cases: Vec<(usize, usize)> = [1, 5, 64, 300]
        .into_iter()
        .flat_map(|t| [(t, 0), (t, 17), (t, 4000)])
        .chain([(1000, 0), (1000, 33)])
        .collect();
    for (case, (t, start)) in cases.into_iter().enumerate() {
        let s = seed.wrapping_add(1000 * case as u64);
        // Every other case fills the cache to the last row.
        let capacity = start + t + if case % 2 == 0 { 0 } else { 29 };
        let (splits, chunk) = g.kernels.prefill_split(t, start + t);
        println!("T = {t}, start = {start}, capacity {capacity}: {splits} key splits of {chunk}");
        let mut cache = poisoned_cache(&g, slots, layers, capacity);
        let mut host = HostCache::new(capacity);
        random_prefix(&g, &mut cache, &mut host, slot, layer, start, s);
        let qkv = random_qkv(t, s ^ 7);
        let (q_norm, k_norm) = (random_norm(s ^ 8), random_norm(s ^ 9));
        let mut ws = AttentionWorkspace::new(&g.kernels, t, 1, capacity).unwrap();
        let (d_qkv, d_qn, d_kn) = (upload(&g, &qkv), upload(&g, &q_norm), upload(&g, &k_norm));
        // Each kernel appends the same rows; the output of each is checked below.
        let outs: Vec<(&str, CudaSlice<bf16>)> = PREFILL_KERNELS
            .into_iter()
            .map(|(kernel, name)| {
                g.kernels.set_prefill_kernel(kernel);
                let mut out = poisoned_out(&g, t);
                g.kernels
                    .prefill(
                        &d_qkv.slice(..),
                        &d_qn.slice(..),
                        &d_kn.slice(..),
                        &mut cache,
                        layer,
                        slot,
                        start,
                        &mut ws,
                        &mut out.slice_mut(..),
                    )
                    .unwrap();
                (name, out)
            })
            .collect();

        let rows = to_f32(&qkv);
        let prepared: Vec<PreparedToken> = (0..t)
            .into_par_iter()
            .map(|i| {
                prepare_ref(
                    &g.config,
                    &rows[i * QKV_WIDTH..(i + 1) * QKV_WIDTH],
                    start + i,
                    &q_norm,
                    &k_norm,
                )
            })
            .collect();
        prepared
            .iter()
            .enumerate()
            .for_each(|(i, p)| append_ref(&mut host, p, start + i));
        let reference: Vec<f32> = prepared
            .iter()
            .enumerate()
            .flat_map(|(i, p)| attend_ref(&host, p, start + i))
            .collect();

        let q_ref: Vec<f32> = prepared.iter().flat_map(|p| p.q.iter().copied()).collect();
        let q_gpu = to_f32(&download(&g, ws.queries())[..t * Q_HEADS * HEAD_DIM]);
        check_each("queries", &q_gpu, &q_ref, QK_REL, QK_ABS);
        for (i, p) in prepared.iter().enumerate() {
            check_appended(&g, &cache, slot, layer, start + i, p, &format!("token {i}"));
        }
        check_untouched(&g, &cache, &[(slot, layer, 0..start + t)]);
        for (kernel, out) in &outs {
            check_rows(
                &format!("output ({kernel})"),
                &to_f32(&download(&g, out)),
                &reference,
                OUT_WIDTH,
                OUT_TOLERANCE,
            );
        }
    }
}

/// Decodes one token for each sequence `(slot, position)` over random earlier rows; checks the
/// outputs and the appended rows against the reference.
fn decode_case(
    g: &Gpu,
    seqs: &[(usize, usize)],
    slots: usize,
    layers: usize,
    layer: usize,
    capacity: usize,
    seed: u64,
) {
    println!(
        "decode of {} sequences at positions {:?}, capacity {capacity}",
        seqs.len(),
        seqs.iter().map(|s| s.1).collect::<Vec<_>>()
    );
    let b = seqs.len();
    let mut cache = poisoned_cache(g, slots, layers, capacity);
    let qkv = random_qkv(b, seed ^ 7);
    let (q_norm, k_norm) = (random_norm(seed ^ 8), random_norm(seed ^ 9));
    let rows = to_f32(&qkv);
    let mut reference = Vec::new();
    let mut prepared = Vec::new();
    for (i, &(slot, pos)) in seqs.iter().enumerate() {
        let mut host = HostCache::new(pos + 1);
        random_prefix(
            g,
            &mut cache,
            &mut host,
            slot,
            layer,
            pos,
            seed.wrapping_add(100 * i as u64),
        );
        let p = prepare_ref(
            &g.config,
            &rows[i * QKV_WIDTH..(i + 1) * QKV_WIDTH],
            pos,
            &q_norm,
            &k_norm,
        );
        append_ref(&mut host, &p, pos);
        reference.extend(attend_ref(&host, &p, pos));
        prepared.push(p);
    }
    let d_slots = upload(g, &seqs.iter().map(|s| s.0 as i32).collect::<Vec<_>>());
    let d_pos = upload(g, &seqs.iter().map(|s| s.1 as i32).collect::<Vec<_>>());
    let mut ws = AttentionWorkspace::new(&g.kernels, 0, b, capacity).unwrap();
    let (d_qkv, d_qn, d_kn) = (upload(g, &qkv), upload(g, &q_norm), upload(g, &k_norm));
    let mut out = poisoned_out(g, b);
    g.kernels
        .decode(
            &d_qkv.slice(..),
            &d_qn.slice(..),
            &d_kn.slice(..),
            &mut cache,
            layer,
            &d_slots.slice(..),
            &d_pos.slice(..),
            &mut ws,
            &mut out.slice_mut(..),
        )
        .unwrap();
    println!("  {} splits", g.kernels.decode_splits(b, capacity));

    let q_ref: Vec<f32> = prepared.iter().flat_map(|p| p.q.iter().copied()).collect();
    check_each(
        "queries",
        &to_f32(&download(g, ws.queries())[..b * Q_HEADS * HEAD_DIM]),
        &q_ref,
        QK_REL,
        QK_ABS,
    );
    for (i, (&(slot, pos), p)) in seqs.iter().zip(&prepared).enumerate() {
        check_appended(g, &cache, slot, layer, pos, p, &format!("sequence {i}"));
        if pos + 1 < capacity {
            let (k, v) = cache_rows(g, &cache, slot, layer, pos + 1..pos + 2);
            assert!(
                k.iter().chain(&v).all(|x| x.is_nan()),
                "sequence {i}: the row after its position was written"
            );
        }
    }
    check_rows(
        "output",
        &to_f32(&download(g, &out)),
        &reference,
        OUT_WIDTH,
        OUT_TOLERANCE,
    );
}

#[test]
fn decode_matches_cpu() {
    let g = gpu();
    let seed = seed("decode_matches_cpu");
    // A batch at lengths 1, 17, 65 (one key past a tile), 1001 and 32768, in shuffled slots of layer 1.
    decode_case(
        &g,
        &[(2, 0), (4, 16), (0, 64), (3, 1000), (1, 32767)],
        5,
        2,
        1,
        32768,
        seed,
    );
    // Alone (the most splits) at lengths around tile and chunk boundaries and up to 32K.
    for (i, pos) in [0usize, 62, 63, 64, 4095, 4096, 20000, 32767]
        .into_iter()
        .enumerate()
    {
        decode_case(
            &g,
            &[(0, pos)],
            1,
            1,
            0,
            32768,
            seed.wrapping_add(10_000 * (i as u64 + 1)),
        );
    }
}

/// `decode_one_sequence` (a verify pass: `n` consecutive tokens of one sequence as decode rows)
/// against the reference: each row attends over the rows before it in the same launch, every
/// row's key and value is appended, nothing else in the cache is written.
#[test]
fn decode_one_sequence_matches_cpu() {
    let g = gpu();
    let seed = seed("decode_one_sequence_matches_cpu");
    let (slots, capacity, slot, layer) = (3usize, 32768usize, 1usize, 1usize);
    // First positions at 0, across a tile and split boundary (64), across a tile boundary
    // (4096), far in, and at the end of the cache.
    for (i, (first, n)) in [
        (0usize, 4usize),
        (61, 4),
        (4094, 3),
        (20000, 17),
        (32766, 2),
    ]
    .into_iter()
    .enumerate()
    {
        let seed = seed.wrapping_add(1000 * i as u64);
        println!("{n} rows of one sequence from position {first}");
        let mut cache = poisoned_cache(&g, slots, 2, capacity);
        let mut host = HostCache::new(first + n);
        random_prefix(&g, &mut cache, &mut host, slot, layer, first, seed);
        let qkv = random_qkv(n, seed ^ 7);
        let (q_norm, k_norm) = (random_norm(seed ^ 8), random_norm(seed ^ 9));
        let rows = to_f32(&qkv);
        let prepared: Vec<PreparedToken> = (0..n)
            .map(|r| {
                let row = &rows[r * QKV_WIDTH..(r + 1) * QKV_WIDTH];
                prepare_ref(&g.config, row, first + r, &q_norm, &k_norm)
            })
            .collect();
        for (r, p) in prepared.iter().enumerate() {
            append_ref(&mut host, p, first + r);
        }
        let reference: Vec<f32> = prepared
            .iter()
            .enumerate()
            .flat_map(|(r, p)| attend_ref(&host, p, first + r))
            .collect();
        let d_slots = upload(&g, &vec![slot as i32; n]);
        let d_pos = upload(
            &g,
            &(first..first + n).map(|p| p as i32).collect::<Vec<_>>(),
        );
        let mut ws = AttentionWorkspace::new(&g.kernels, 0, n, capacity).unwrap();
        let (d_qkv, d_qn, d_kn) = (upload(&g, &qkv), upload(&g, &q_norm), upload(&g, &k_norm));
        let mut out = poisoned_out(&g, n);
        g.kernels
            .decode_one_sequence(
                &d_qkv.slice(..),
                &d_qn.slice(..),
                &d_kn.slice(..),
                &mut cache,
                layer,
                &d_slots.slice(..),
                &d_pos.slice(..),
                &mut ws,
                &mut out.slice_mut(..),
            )
            .unwrap();
        println!("  {} splits", g.kernels.decode_splits(n, capacity));
        for (r, p) in prepared.iter().enumerate() {
            check_appended(&g, &cache, slot, layer, first + r, p, &format!("row {r}"));
        }
        check_untouched(&g, &cache, &[(slot, layer, 0..first + n)]);
        check_rows(
            "output",
            &to_f32(&download(&g, &out)),
            &reference,
            OUT_WIDTH,
            OUT_TOLERANCE,
        );
    }
}

#[test]
fn decode_bad_positions_give_nan_and_no_writes() {
    let g = gpu();
    let seed = seed("decode_bad_positions_give_nan_and_no_writes");
    let capacity = 128;
    let mut cache = poisoned_cache(&g, 2, 1, capacity);
    let mut host = HostCache::new(capacity);
    random_prefix(&g, &mut cache, &mut host, 1, 0, 5, seed);
    // Sequence 0 is valid; then a position at the capacity, a negative one, an unknown slot.
    let seqs: [(i32, i32); 4] = [(1, 5), (1, capacity as i32), (0, -1), (2, 3)];
    let qkv = random_qkv(seqs.len(), seed ^ 7);
    let (q_norm, k_norm) = (random_norm(seed ^ 8), random_norm(seed ^ 9));
    let d_slots = upload(&g, &seqs.iter().map(|s| s.0).collect::<Vec<_>>());
    let d_pos = upload(&g, &seqs.iter().map(|s| s.1).collect::<Vec<_>>());
    let mut ws = AttentionWorkspace::new(&g.kernels, 0, seqs.len(), capacity).unwrap();
    let (d_qkv, d_qn, d_kn) = (upload(&g, &qkv), upload(&g, &q_norm), upload(&g, &k_norm));
    let mut out = poisoned_out(&g, seqs.len());
    g.kernels
        .decode(
            &d_qkv.slice(..),
            &d_qn.slice(..),
            &d_kn.slice(..),
            &mut cache,
            0,
            &d_slots.slice(..),
            &d_pos.slice(..),
            &mut ws,
            &mut out.slice_mut(..),
        )
        .unwrap();
    let out = to_f32(&download(&g, &out));
    let p = prepare_ref(&g.config, &to_f32(&qkv[..QKV_WIDTH]), 5, &q_norm, &k_norm);
    append_ref(&mut host, &p, 5);
    check_rows(
        "valid sequence",
        &out[..OUT_WIDTH],
        &attend_ref(&host, &p, 5),
        OUT_WIDTH,
        OUT_TOLERANCE,
    );
    assert!(
        out[OUT_WIDTH..].iter().all(|v| v.is_nan()),
        "an invalid sequence got a non-NaN output"
    );
    check_untouched(&g, &cache, &[(1, 0, 0..6)]);
}

#[test]
fn prefill_then_decode_equals_whole_prefill() {
    let g = gpu();
    let seed = seed("prefill_then_decode_equals_whole_prefill");
    let (total, capacity, slot, layer) = (300usize, 320usize, 1usize, 0usize);
    let qkv = random_qkv(total, seed);
    let (q_norm, k_norm) = (random_norm(seed ^ 8), random_norm(seed ^ 9));
    let (d_qkv, d_qn, d_kn) = (upload(&g, &qkv), upload(&g, &q_norm), upload(&g, &k_norm));
    let mut ws = AttentionWorkspace::new(&g.kernels, total, 1, capacity).unwrap();

    // Whole: one prefill of all 300 tokens.
    let mut whole_cache = poisoned_cache(&g, 2, 1, capacity);
    let mut whole = poisoned_out(&g, total);
    g.kernels
        .prefill(
            &d_qkv.slice(..),
            &d_qn.slice(..),
            &d_kn.slice(..),
            &mut whole_cache,
            layer,
            slot,
            0,
            &mut ws,
            &mut whole.slice_mut(..),
        )
        .unwrap();

    // Split: prefill chunks of 130 and 70 tokens, then 100 decode steps.
    let mut cache = poisoned_cache(&g, 2, 1, capacity);
    let mut split = poisoned_out(&g, total);
    for (a, b) in [(0, 130), (130, 200)] {
        g.kernels
            .prefill(
                &d_qkv.slice(a * QKV_WIDTH..b * QKV_WIDTH),
                &d_qn.slice(..),
                &d_kn.slice(..),
                &mut cache,
                layer,
                slot,
                a,
                &mut ws,
                &mut split.slice_mut(a * OUT_WIDTH..b * OUT_WIDTH),
            )
            .unwrap();
    }
    let d_slot = upload(&g, &[slot as i32]);
    let mut d_pos = upload(&g, &[0i32]);
    for pos in 200..total {
        g.stream.memcpy_htod(&[pos as i32], &mut d_pos).unwrap();
        g.kernels
            .decode(
                &d_qkv.slice(pos * QKV_WIDTH..(pos + 1) * QKV_WIDTH),
                &d_qn.slice(..),
                &d_kn.slice(..),
                &mut cache,
                layer,
                &d_slot.slice(..),
                &d_pos.slice(..),
                &mut ws,
                &mut split.slice_mut(pos * OUT_WIDTH..(pos + 1) * OUT_WIDTH),
            )
            .unwrap();
    }

    // Both paths compute each key and value with the same kernel: the caches agree bit for bit.
    let (wk, wv) = cache_rows(&g, &whole_cache, slot, layer, 0..total);
    let (sk, sv) = cache_rows(&g, &cache, slot, layer, 0..total);
    assert!(
        wk.iter().zip(&sk).all(|(a, b)| a.to_bits() == b.to_bits()),
        "K caches differ"
    );
    assert!(
        wv.iter().zip(&sv).all(|(a, b)| a.to_bits() == b.to_bits()),
        "V caches differ"
    );

    let (whole, split) = (to_f32(&download(&g, &whole)), to_f32(&download(&g, &split)));
    check_rows(
        "chunked + decode vs whole prefill",
        &split,
        &whole,
        OUT_WIDTH,
        OUT_TOLERANCE,
    );
    let rows = to_f32(&qkv);
    let mut host = HostCache::new(capacity);
    let prepared: Vec<PreparedToken> = (0..total)
        .map(|i| {
            prepare_ref(
                &g.config,
                &rows[i * QKV_WIDTH..(i + 1) * QKV_WIDTH],
                i,
                &q_norm,
                &k_norm,
            )
        })
        .collect();
    prepared
        .iter()
        .enumerate()
        .for_each(|(i, p)| append_ref(&mut host, p, i));
    let reference: Vec<f32> = prepared
        .iter()
        .enumerate()
        .flat_map(|(i, p)| attend_ref(&host, p, i))
        .collect();
    check_rows(
        "whole prefill vs CPU",
        &whole,
        &reference,
        OUT_WIDTH,
        OUT_TOLERANCE,
    );
    check_rows(
        "chunked + decode vs CPU",
        &split,
        &reference,
        OUT_WIDTH,
        OUT_TOLERANCE,
    );
}

#[test]
fn bad_arguments_are_errors() {
    let g = gpu();
    let mut cache = KvCache::new(&g.stream, 2, 2, 64).unwrap();
    let mut ws = AttentionWorkspace::new(&g.kernels, 8, 2, 64).unwrap();
    let qkv = upload(&g, &random_qkv(9, 1));
    let norm = upload(&g, &random_norm(2));
    let mut out = poisoned_out(&g, 9);
    let (qn, kn) = (norm.slice(..), norm.slice(..));
    let mut prefill =
        |tokens: usize, layer, slot, start, out_len: usize, ws: &mut AttentionWorkspace| {
            g.kernels.prefill(
                &qkv.slice(..tokens * QKV_WIDTH),
                &qn,
                &kn,
                &mut cache,
                layer,
                slot,
                start,
                ws,
                &mut out.slice_mut(..out_len),
            )
        };
    assert!(prefill(4, 0, 0, 0, 4 * OUT_WIDTH, &mut ws).is_ok());
    assert!(
        prefill(4, 0, 0, 0, 3 * OUT_WIDTH, &mut ws).is_err(),
        "out too short"
    );
    assert!(
        prefill(9, 0, 0, 0, 9 * OUT_WIDTH, &mut ws).is_err(),
        "more tokens than the workspace holds"
    );
    assert!(
        prefill(4, 2, 0, 0, 4 * OUT_WIDTH, &mut ws).is_err(),
        "layer out of range"
    );
    assert!(
        prefill(4, 0, 2, 0, 4 * OUT_WIDTH, &mut ws).is_err(),
        "slot out of range"
    );
    assert!(
        prefill(4, 0, 0, 61, 4 * OUT_WIDTH, &mut ws).is_err(),
        "past the capacity"
    );
    assert!(prefill(0, 0, 0, 0, 0, &mut ws).is_err(), "no tokens");
    // Misaligned qkv (one value in) and a short norm weight.
    assert!(g
        .kernels
        .prefill(
            &qkv.slice(1..1 + QKV_WIDTH),
            &qn,
            &kn,
            &mut cache,
            0,
            0,
            0,
            &mut ws,
            &mut out.slice_mut(..OUT_WIDTH)
        )
        .is_err());
    assert!(g
        .kernels
        .prefill(
            &qkv.slice(..QKV_WIDTH),
            &norm.slice(..128),
            &kn,
            &mut cache,
            0,
            0,
            0,
            &mut ws,
            &mut out.slice_mut(..OUT_WIDTH)
        )
        .is_err());
    let (slots, pos) = (upload(&g, &[0i32, 1]), upload(&g, &[3i32, 4]));
    let mut decode = |b: usize, npos: usize, ws: &mut AttentionWorkspace| {
        g.kernels.decode(
            &qkv.slice(..b * QKV_WIDTH),
            &qn,
            &kn,
            &mut cache,
            0,
            &slots.slice(..b),
            &pos.slice(..npos),
            ws,
            &mut out.slice_mut(..b * OUT_WIDTH),
        )
    };
    assert!(decode(2, 2, &mut ws).is_ok());
    assert!(
        decode(2, 1, &mut ws).is_err(),
        "positions and slots differ in length"
    );
    let mut small = AttentionWorkspace::new(&g.kernels, 1, 1, 64).unwrap();
    assert!(
        decode(2, 2, &mut small).is_err(),
        "batch larger than the workspace"
    );
    let config = ModelConfig::from_json(&preset("tiny").unwrap()).unwrap();
    assert!(
        AttentionKernels::load(&g._dev, &config).is_err(),
        "a model of another attention shape"
    );
}

fn median(mut v: Vec<f32>) -> f32 {
    v.sort_by(f32::total_cmp);
    v[v.len() / 2]
}

/// Median milliseconds of `f` over `runs` runs after 3 warm-up runs, timed by CUDA events.
fn time_ms(g: &Gpu, runs: usize, mut f: impl FnMut()) -> f32 {
    for _ in 0..3 {
        f();
    }
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let times = (0..runs)
        .map(|_| {
            let start = g.stream.record_event(flags).unwrap();
            f();
            let end = g.stream.record_event(flags).unwrap();
            start.elapsed_ms(&end).unwrap()
        })
        .collect();
    median(times)
}

/// Timings (printed, not asserted) at the sizes that matter, each result also checked.
#[test]
fn timing_decode_and_prefill() {
    let mut g = gpu();
    let seed = seed("timing_decode_and_prefill");
    let (q_norm, k_norm) = (random_norm(seed ^ 8), random_norm(seed ^ 9));
    let (d_qn, d_kn) = (upload(&g, &q_norm), upload(&g, &k_norm));

    // Decode, one sequence, 4K / 32K / 128K context.
    let capacity = 131_072;
    let mut cache = poisoned_cache(&g, 1, 1, capacity);
    let mut host = HostCache::new(capacity);
    random_prefix(&g, &mut cache, &mut host, 0, 0, capacity - 1, seed);
    let mut ws = AttentionWorkspace::new(&g.kernels, 4096, 1, capacity).unwrap();
    let d_slot = upload(&g, &[0i32]);
    let mut d_pos = upload(&g, &[0i32]);
    let qkv = random_qkv(1, seed ^ 7);
    let d_qkv = upload(&g, &qkv);
    let mut out = poisoned_out(&g, 1);
    for len in [4096usize, 32_768, 131_072] {
        let pos = len - 1;
        g.stream.memcpy_htod(&[pos as i32], &mut d_pos).unwrap();
        let ms = time_ms(&g, 20, || {
            g.kernels
                .decode(
                    &d_qkv.slice(..),
                    &d_qn.slice(..),
                    &d_kn.slice(..),
                    &mut cache,
                    0,
                    &d_slot.slice(..),
                    &d_pos.slice(..),
                    &mut ws,
                    &mut out.slice_mut(..),
                )
                .unwrap()
        });
        let bytes = len * KV_HEADS * HEAD_DIM * 2 * 2;
        println!(
            "decode, context {len}: {:.1} µs per layer (prepare + split + combine, {} splits), {:.0} GB/s of K+V read ({:.1} MB)",
            ms * 1e3,
            g.kernels.decode_splits(1, capacity),
            bytes as f64 / (ms as f64 * 1e-3) / 1e9,
            bytes as f64 / 1e6
        );
        // Every timed run appended this token at `pos`, over the random row there.
        let row = pos * HEAD_DIM..(pos + 1) * HEAD_DIM;
        let saved: Vec<(Vec<f32>, Vec<f32>)> = (0..KV_HEADS)
            .map(|h| {
                (
                    host.k[h][row.clone()].to_vec(),
                    host.v[h][row.clone()].to_vec(),
                )
            })
            .collect();
        let p = prepare_ref(&g.config, &to_f32(&qkv), pos, &q_norm, &k_norm);
        append_ref(&mut host, &p, pos);
        check_rows(
            &format!("decode at {len}"),
            &to_f32(&download(&g, &out)),
            &attend_ref(&host, &p, pos),
            OUT_WIDTH,
            OUT_TOLERANCE,
        );
        // Put the random row back for the next, longer context (device and host).
        for (h, (k, v)) in saved.into_iter().enumerate() {
            let at = cache.offset(0, 0, h, pos);
            g.stream
                .memcpy_htod(
                    &to_bf16(&k),
                    &mut cache.keys_mut().slice_mut(at..at + HEAD_DIM),
                )
                .unwrap();
            g.stream
                .memcpy_htod(
                    &to_bf16(&v),
                    &mut cache.values_mut().slice_mut(at..at + HEAD_DIM),
                )
                .unwrap();
            host.k[h][row.clone()].copy_from_slice(&k);
            host.v[h][row.clone()].copy_from_slice(&v);
        }
    }
    drop(cache);

    // Prefill of a 4K prompt in one chunk, the last 4K chunk of a 32K prompt, and a turn of a
    // conversation after a long and a shorter cached prefix (bench --serve: ≈ 2,330 new tokens
    // after ≈ 28K and ≈ 10.6K).
    drop(ws);
    prefill_chunk_timing(
        &mut g,
        4096,
        0,
        seed ^ 11,
        (&q_norm, &k_norm),
        (&d_qn, &d_kn),
    );
    prefill_chunk_timing(
        &mut g,
        4096,
        28_672,
        seed ^ 13,
        (&q_norm, &k_norm),
        (&d_qn, &d_kn),
    );
    prefill_chunk_timing(
        &mut g,
        2330,
        28_000,
        seed ^ 17,
        (&q_norm, &k_norm),
        (&d_qn, &d_kn),
    );
    prefill_chunk_timing(
        &mut g,
        2330,
        10_648,
        seed ^ 19,
        (&q_norm, &k_norm),
        (&d_qn, &d_kn),
    );
}

/// Times a prefill chunk of `t` tokens after `start` random cached rows with each kernel, and
/// checks a sample of its rows against the reference.
fn prefill_chunk_timing(
    g: &mut Gpu,
    t: usize,
    start: usize,
    seed: u64,
    (q_norm, k_norm): (&[f32], &[f32]),
    (d_qn, d_kn): (&CudaSlice<f32>, &CudaSlice<f32>),
) {
    let mut cache = poisoned_cache(g, 1, 1, start + t);
    let mut host = HostCache::new(start + t);
    random_prefix(g, &mut cache, &mut host, 0, 0, start, seed);
    let mut ws = AttentionWorkspace::new(&g.kernels, t, 1, start + t).unwrap();
    let qkv = random_qkv(t, seed ^ 7);
    let d_qkv = upload(g, &qkv);
    // QKᵀ and PV over the visible keys: 2 · 2 · 256 flops per (head, query, visible key).
    let visible = (0..t).map(|i| start + i + 1).sum::<usize>();
    let flops = 4.0 * HEAD_DIM as f64 * Q_HEADS as f64 * visible as f64;
    let mut outs = Vec::new();
    for (kernel, name) in PREFILL_KERNELS {
        g.kernels.set_prefill_kernel(kernel);
        let mut out = poisoned_out(g, t);
        let ms = time_ms(g, 10, || {
            g.kernels
                .prefill(
                    &d_qkv.slice(..),
                    &d_qn.slice(..),
                    &d_kn.slice(..),
                    &mut cache,
                    0,
                    0,
                    start,
                    &mut ws,
                    &mut out.slice_mut(..),
                )
                .unwrap()
        });
        let (splits, _) = g.kernels.prefill_splits(t, start, &ws);
        println!(
            "prefill, {t} tokens after {start} ({name}, {splits} key splits): {ms:.3} ms per layer, {:.0} TFLOP/s",
            flops / (ms as f64 * 1e-3) / 1e12
        );
        outs.push((name, to_f32(&download(g, &out))));
    }
    // Check a sample of tokens: the first, tile and block edges, and a spread.
    let rows = to_f32(&qkv);
    let prepared: Vec<PreparedToken> = (0..t)
        .into_par_iter()
        .map(|i| {
            prepare_ref(
                &g.config,
                &rows[i * QKV_WIDTH..(i + 1) * QKV_WIDTH],
                start + i,
                q_norm,
                k_norm,
            )
        })
        .collect();
    prepared
        .iter()
        .enumerate()
        .for_each(|(i, p)| append_ref(&mut host, p, start + i));
    let sample: Vec<usize> = [0, 1, 7, 8, 15, 16, 31, 32, 33, 2047, t - 1]
        .into_iter()
        .chain((0..t).step_by(97))
        .collect();
    let reference: Vec<Vec<f32>> = sample
        .par_iter()
        .map(|&i| attend_ref(&host, &prepared[i], start + i))
        .collect();
    for (kernel, out) in &outs {
        let (gpu_rows, ref_rows): (Vec<f32>, Vec<f32>) = sample
            .iter()
            .zip(&reference)
            .flat_map(|(&i, r)| {
                out[i * OUT_WIDTH..(i + 1) * OUT_WIDTH]
                    .iter()
                    .copied()
                    .zip(r.iter().copied())
            })
            .unzip();
        check_rows(
            &format!("prefill sample, {t} tokens after {start} ({kernel})"),
            &gpu_rows,
            &ref_rows,
            OUT_WIDTH,
            OUT_TOLERANCE,
        );
    }
}
