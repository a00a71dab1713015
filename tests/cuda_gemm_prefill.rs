//! The prefill GEMM (src/cuda/gemm_prefill.rs) against the CPU reference `model::cpu::ops::matmul`
//! on the same `Matrix` (MLX affine Q4/Q8 group 64, or bf16), at Qwen3.6-35B-A3B's shapes plus odd
//! ones, and timing printouts at 4096 tokens. Needs an sm_90 GPU: without one every test fails.
//!
//! Tolerance. The reference dequantises in f32 and sums in f32; the GPU rounds each dequantised
//! weight to bf16 (relative ≤ 2⁻⁹, as MLX's own kernels do), sums in fp32 and rounds the output to
//! bf16 (≤ 2⁻⁹). With scale(t, n) = ‖x_t‖·‖W_n‖/√K (the size of a typical |x_t·W_n|), every
//! element must satisfy |gpu − ref| ≤ 2⁻⁸·|ref| + 1e-2·scale, and the mean of |gpu − ref|/scale
//! must be ≤ 2e-3 (the expected weight-rounding error is ~1e-3·scale; one wrong weight of 2048
//! is ~2e-2·scale, a wrong group ~0.1·scale). SwiGLU outputs propagate the same bound through
//! silu(g)·u. Every output is poisoned before a launch and fenced by guard values: an element never
//! written, or written outside its place, fails.
//!
//! Seeds are fresh each run and printed; set LILY_TEST_SEED to repeat one.
#![cfg(feature = "cuda")]

mod cuda_prefill_common;

use cuda_prefill_common::*;
use half::bf16;
use lily::cuda::dense::DenseGemm;
use lily::cuda::gemm::Matrices;
use lily::cuda::gemm_prefill::GemmKernels;
use lily::cuda::weights::DeviceMatrices;
use lily::cuda::{CudaView, CudaViewMut};
use lily::model::cpu::ops::{matmul, silu};
use lily::model::weights::Matrix;
use rand::rngs::SmallRng;
use rand::RngExt;

const REL: f32 = 1.0 / 256.0;
const ABS: f32 = 1e-2;
// The output's bf16 rounding alone gives means of 1.7-1.9e-3 (H200); one row's 100 outputs
// share their weights, so their mean wanders more (2.11e-3 seen).
const MEAN_ABS: f32 = 2.5e-3;
/// Above this many tokens only a sample of rows is compared with the (slow) CPU reference; every
/// row is still checked for being written.
const FULL_CHECK_ROWS: usize = 300;

/// Which token rows to compare: all, or a sample with both ends and the tile edges.
fn rows_to_check(rng: &mut SmallRng, t: usize) -> Vec<usize> {
    if t <= FULL_CHECK_ROWS {
        return (0..t).collect();
    }
    let mut rows: Vec<usize> = [0, 1, 63, 64, 65, t / 2, t - 65, t - 64, t - 1]
        .into_iter()
        .filter(|&r| r < t)
        .collect();
    rows.extend((0..88).map(|_| rng.random_range(0..t)));
    rows.sort_unstable();
    rows.dedup();
    rows
}

fn gather(x: &[f32], rows: &[usize], k: usize) -> Vec<f32> {
    rows.iter()
        .flat_map(|&r| x[r * k..(r + 1) * k].iter().copied())
        .collect()
}

fn pick(y: &[bf16], rows: &[usize], n: usize) -> Vec<bf16> {
    rows.iter()
        .flat_map(|&r| y[r * n..(r + 1) * n].iter().copied())
        .collect()
}

/// Computes `y = x · Wᵀ` on the GPU: our fused GEMM or the cuBLAS path.
type Product<'a> = dyn FnMut(&Matrices, &CudaView<bf16>, &mut CudaViewMut<bf16>) + 'a;

/// One dense product `y = x · Wᵀ` of `t` tokens checked against the CPU.
fn dense_case(
    g: &mut Product,
    dev: &lily::cuda::CudaDevice,
    rng: &mut SmallRng,
    m: &Matrix,
    w_sq: &[f32],
    t: usize,
    label: &str,
) {
    let s = dev.stream();
    let (n, k) = (m.rows, m.cols);
    let (xb, xf) = activations(rng, t * k, 1.0);
    let dm = DeviceMatrices::concat(s, &[m]).expect("upload weights");
    let dx = upload(s, &xb);
    let mut y = Output::new(s, t * n);
    g(&dm.view(), &dx.as_view(), &mut y.view());
    let what = format!("{label} [{n}×{k}] × {t} tokens");
    let got = y.get(s, &what);
    let rows = rows_to_check(rng, t);
    let want = matmul(m, &gather(&xf, &rows, k), rows.len());
    let x_sq: Vec<f32> = rows
        .iter()
        .map(|&r| xf[r * k..(r + 1) * k].iter().map(|v| v * v).sum())
        .collect();
    let scale = |i: usize| (x_sq[i / n] * w_sq[i % n] / k as f32).sqrt();
    check(
        &what,
        &pick(&got, &rows, n),
        &want,
        &scale,
        REL,
        ABS,
        MEAN_ABS,
    );
}

/// Both 4-bit kernels: mma.sync (gemm_prefill.cu) and wgmma (gemm_wgmma.cu), the latter also with
/// its outputs stored through shared memory (`LILY_WGMMA_STAGED_STORES`).
#[test]
fn q4_matches_cpu_at_model_shapes() {
    for (wgmma, staged) in [(false, false), (true, false), (true, true)] {
        q4_at_model_shapes(wgmma, staged);
    }
}

/// Sets which kernel `k` runs (mma.sync or wgmma) and names it for messages.
fn select(k: &mut GemmKernels, wgmma: bool) -> &'static str {
    k.set_wgmma(wgmma);
    if wgmma {
        " wgmma"
    } else {
        ""
    }
}

fn q4_at_model_shapes(wgmma: bool, staged: bool) {
    let dev = device();
    let mut k = GemmKernels::load(&dev).expect("kernels");
    k.set_staged_stores(staged);
    let label = format!(
        "q4{}{}",
        select(&mut k, wgmma),
        if staged { " staged" } else { "" }
    );
    let label = label.as_str();
    let g = &mut |w: &Matrices, x: &CudaView<bf16>, y: &mut CudaViewMut<bf16>| {
        k.gemm(w, x, y).expect("gemm")
    };
    let mut rng = rng(label);
    // GDN in_proj (qkv‖z‖b‖a), attention q‖k‖v, shared expert gate‖up, MoE hidden, output width.
    for n in [12352, 9216, 1024, 512, 2048] {
        let m = matrix(&mut rng, Kind::Q4, n, 2048, 0.05);
        let w_sq = row_sq(&m);
        for t in [16, 17, 100, 256, 4096] {
            dense_case(g, &dev, &mut rng, &m, &w_sq, t, label);
        }
    }
    // out_proj / o_proj (K = 4096), shared down (K = 512), a small down (K = 128: on mma.sync
    // even with wgmma on, whose scale copies take K in 256-column pieces).
    for (n, k, ts) in [
        (2048, 4096, &[33usize, 300][..]),
        (2048, 512, &[16, 129]),
        (512, 128, &[9, 64]),
        (300, 2048, &[1, 65]),
    ] {
        let m = matrix(&mut rng, Kind::Q4, n, k, 0.05);
        let w_sq = row_sq(&m);
        for &t in ts {
            dense_case(g, &dev, &mut rng, &m, &w_sq, t, label);
        }
    }
}

#[test]
fn q8_and_bf16_match_cpu() {
    let dev = device();
    let mut k = GemmKernels::load(&dev).expect("kernels");
    let mut rng = rng("q8/bf16 gemm");
    // Q8 on both kernels (wgmma, mma.sync): the router (256 experts), the shared-expert gate
    // (one row), odd widths, a 4K-token chunk.
    for wgmma in [true, false] {
        let label = format!("q8{}", select(&mut k, wgmma));
        let label = label.as_str();
        let g = &mut |w: &Matrices, x: &CudaView<bf16>, y: &mut CudaViewMut<bf16>| {
            k.gemm(w, x, y).expect("gemm")
        };
        for (n, cols, t) in [
            (256, 2048, 300),
            (1, 2048, 100),
            (257, 2048, 17),
            (16, 512, 64),
            (512, 128, 40),
            (2048, 512, 4096),
        ] {
            let m = matrix(&mut rng, Kind::Q8, n, cols, 0.05);
            dense_case(g, &dev, &mut rng, &m, &row_sq(&m), t, label);
        }
    }
    let g = &mut |w: &Matrices, x: &CudaView<bf16>, y: &mut CudaViewMut<bf16>| {
        k.gemm(w, x, y).expect("gemm")
    };
    for (n, k, t) in [
        (2048, 2048, 100),
        (9216, 512, 64),
        (300, 128, 300),
        (1, 512, 17),
        (33, 4096, 16),
    ] {
        let m = matrix(&mut rng, Kind::Bf16, n, k, 0.05);
        dense_case(g, &dev, &mut rng, &m, &row_sq(&m), t, "bf16");
    }
}

/// The cuBLAS path of long chunks (src/cuda/dense.rs): dequantise to bf16, then cuBLAS. Same
/// tolerance as the fused kernel (both round each weight to bf16 once).
#[test]
fn cublas_path_matches_cpu() {
    let dev = device();
    let mut rng = rng("cublas gemm");
    // Row counts that are no multiple of 8 (the router with the shared gate, odd ones) are
    // multiplied with zero rows appended; `keep`: from a kept bf16 copy (DenseGemm::keep), else
    // dequantised (or copied, for bf16 with padding) per product. A fresh DenseGemm each case: a
    // kept copy is found by its weights' address, which a later upload may reuse.
    for (kind, n, k, t, keep) in [
        (Kind::Q4, 12352, 2048, 4096, false),
        (Kind::Q4, 2048, 4096, 512, true),
        (Kind::Q4, 9216, 2048, 700, false),
        (Kind::Q8, 257, 2048, 513, false),
        (Kind::Q8, 257, 2048, 4096, true),
        (Kind::Q4, 131, 512, 600, false),
        (Kind::Q4, 1, 2048, 512, true),
        (Kind::Bf16, 2048, 2048, 600, false),
        (Kind::Bf16, 257, 512, 600, false),
        (Kind::Bf16, 131, 512, 600, true),
    ] {
        let mut dense = DenseGemm::new(&dev, if keep { 0 } else { 12352 * 2048 }).expect("cuBLAS");
        let g = &mut |w: &Matrices, x: &CudaView<bf16>, y: &mut CudaViewMut<bf16>| {
            if keep {
                let bytes = dense.keep(w).expect("keep");
                assert_eq!(bytes, w.rows.next_multiple_of(8) * w.cols * 2);
                assert_eq!(dense.kept_bytes(), bytes);
            }
            dense.gemm(w, x, y).expect("dense gemm")
        };
        let m = matrix(&mut rng, kind, n, k, 0.05);
        dense_case(
            g,
            &dev,
            &mut rng,
            &m,
            &row_sq(&m),
            t,
            &format!("cublas {kind:?}{}", if keep { " kept" } else { "" }),
        );
    }
    // gemm_pitched: the same products with rows at the padded pitch, as cuBLAS wrote them (no
    // copy): each row's values bit for bit those of `gemm`, its padding zero.
    let s = dev.stream();
    for (kind, n, t, keep) in [
        (Kind::Q8, 257, 600, true),
        (Kind::Q4, 131, 513, false),
        (Kind::Q4, 256, 512, false),
    ] {
        let m = matrix(&mut rng, kind, n, 2048, 0.05);
        let dm = DeviceMatrices::concat(s, &[&m]).expect("upload weights");
        let x = upload(s, &activations(&mut rng, t * 2048, 1.0).0);
        let mut dense = DenseGemm::new(&dev, n.next_multiple_of(8) * 2048).expect("cuBLAS");
        if keep {
            dense.keep(&dm.view()).expect("keep");
        }
        let pitch = n.next_multiple_of(8);
        let (mut packed, mut pitched) = (Output::new(s, t * n), Output::new(s, t * pitch));
        dense
            .gemm(&dm.view(), &x.as_view(), &mut packed.view())
            .expect("dense gemm");
        let got = dense
            .gemm_pitched(&dm.view(), &x.as_view(), &mut pitched.view())
            .expect("pitched gemm");
        assert_eq!(got, pitch, "{kind:?} {n} rows: the pitch");
        let what = format!("pitched {kind:?} [{n}×2048] × {t}");
        let (a, b) = (packed.get(s, &what), pitched.get(s, &what));
        for r in 0..t {
            let row = &b[r * pitch..(r + 1) * pitch];
            let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&row[..n]),
                bits(&a[r * n..(r + 1) * n]),
                "{what}: row {r}"
            );
            assert!(
                row[n..].iter().all(|v| v.to_f32() == 0.0),
                "{what}: row {r}'s padding"
            );
        }
        // A y of the packed size is refused where the pitch is wider.
        if pitch != n {
            assert!(dense
                .gemm_pitched(&dm.view(), &x.as_view(), &mut packed.view())
                .is_err());
        }
    }
    // A matrix larger than the scratch is an error, not an overrun.
    let mut small = DenseGemm::new(&dev, 64 * 256).expect("cuBLAS");
    let big = matrix(&mut rng, Kind::Q4, 128, 256, 0.05);
    let dm = DeviceMatrices::concat(s, &[&big]).expect("upload");
    let x = upload(s, &vec![bf16::ONE; 512 * 256]);
    let mut y = Output::new(s, 512 * 128);
    assert!(small.gemm(&dm.view(), &x.as_view(), &mut y.view()).is_err());
}

/// `act = silu(x·gateᵀ) ⊙ (x·upᵀ)` from one gate‖up matrix, against the CPU; Q4 on both kernels.
#[test]
fn swiglu_matches_cpu() {
    for wgmma in [false, true] {
        swiglu_cases(wgmma);
    }
}

fn swiglu_cases(wgmma: bool) {
    let dev = device();
    let s = dev.stream();
    let mut g = GemmKernels::load(&dev).expect("kernels");
    let mut rng = rng(&format!("swiglu gemm{}", select(&mut g, wgmma)));
    // The shared expert (I = 512), the test model's (I = 128), a partial last tile, an odd I.
    let cases = [
        (Kind::Q4, 512, 2048, 100),
        (Kind::Q4, 512, 2048, 4096),
        (Kind::Q4, 128, 512, 300),
        (Kind::Q8, 192, 2048, 17),
        (Kind::Bf16, 96, 512, 64),
        (Kind::Bf16, 33, 128, 20),
    ];
    for (kind, inter, k, t) in cases {
        let gate = matrix(&mut rng, kind, inter, k, 0.05);
        let up = matrix(&mut rng, kind, inter, k, 0.05);
        let (g_sq, u_sq) = (row_sq(&gate), row_sq(&up));
        let dm = DeviceMatrices::concat(s, &[&gate, &up]).expect("upload weights");
        let (xb, xf) = activations(&mut rng, t * k, 1.0);
        let dx = upload(s, &xb);
        let mut act = Output::new(s, t * inter);
        g.gemm_swiglu(&dm.view(), &dx.as_view(), &mut act.view())
            .expect("gemm_swiglu");
        let what = format!("swiglu {kind:?} I={inter} K={k} × {t} tokens (wgmma: {wgmma})");
        let got = act.get(s, &what);
        let rows = rows_to_check(&mut rng, t);
        let xs = gather(&xf, &rows, k);
        let (gv, uv) = (matmul(&gate, &xs, rows.len()), matmul(&up, &xs, rows.len()));
        let want: Vec<f32> = gv.iter().zip(&uv).map(|(&g, &u)| silu(g) * u).collect();
        let x_sq: Vec<f32> = rows
            .iter()
            .map(|&r| xf[r * k..(r + 1) * k].iter().map(|v| v * v).sum())
            .collect();
        // The sums' own bounds (ABS·scale each) carried through silu(g)·u (|silu'| ≤ 1.1).
        let scale = |i: usize| {
            let (r, j) = (i / inter, i % inter);
            let sg = (x_sq[r] * g_sq[j] / k as f32).sqrt();
            let su = (x_sq[r] * u_sq[j] / k as f32).sqrt();
            1.1 * sg * (uv[i].abs() + ABS * su) + silu(gv[i]).abs() * su
        };
        check(
            &what,
            &pick(&got, &rows, inter),
            &want,
            &scale,
            REL,
            ABS,
            MEAN_ABS,
        );
    }
}

#[test]
fn rejects_bad_shapes() {
    let dev = device();
    let s = dev.stream();
    let g = GemmKernels::load(&dev).expect("kernels");
    let mut rng = rng("gemm shapes");
    let m = matrix(&mut rng, Kind::Q4, 64, 256, 0.05);
    let dm = DeviceMatrices::concat(s, &[&m]).expect("upload");
    let x = upload(s, &vec![bf16::ONE; 16 * 256]);
    let mut y = Output::new(s, 16 * 64);
    assert!(
        g.gemm(&dm.view(), &x.slice(..16 * 256 - 8), &mut y.view())
            .is_err(),
        "x not whole rows"
    );
    assert!(
        g.gemm(&dm.view(), &x.slice(..15 * 256), &mut y.view())
            .is_err(),
        "y of the wrong size"
    );
    let mut y15 = Output::new(s, 15 * 64);
    assert!(
        g.gemm(&dm.view(), &x.slice(4..4 + 15 * 256), &mut y15.view())
            .is_err(),
        "misaligned x"
    );
    // Columns must be whole quantisation groups.
    let odd = matrix(&mut rng, Kind::Bf16, 64, 96, 0.05);
    let dodd = DeviceMatrices::concat(s, &[&odd]).expect("upload");
    assert!(!GemmKernels::supports(&dodd.view()));
    let x96 = upload(s, &vec![bf16::ONE; 16 * 96]);
    assert!(g.gemm(&dodd.view(), &x96.as_view(), &mut y.view()).is_err());
    // SwiGLU needs gate‖up: an even number of rows.
    let m3 = matrix(&mut rng, Kind::Q4, 3, 256, 0.05);
    let dm3 = DeviceMatrices::concat(s, &[&m3]).expect("upload");
    let mut act = Output::new(s, 16);
    assert!(g
        .gemm_swiglu(&dm3.view(), &x.as_view(), &mut act.view())
        .is_err());
}

/// Times the dense products of one prefill chunk of 4096 tokens at Qwen3.6-35B-A3B's shapes
/// (MLX Q4 g64, router and shared gate Q8). Prints; asserts nothing about speed.
#[test]
fn timing_at_4096_tokens() {
    let dev = device();
    let s = dev.stream();
    // The "fused" column is mma.sync; then wgmma.
    let [mut g, mut gw] = [0; 2].map(|_| GemmKernels::load(&dev).expect("kernels"));
    select(&mut g, false);
    select(&mut gw, true);
    let mut rng = rng("gemm timing");
    const T: usize = 4096;
    // (what, kind, rows, cols, swiglu, layers using it)
    let shapes = [
        ("GDN in_proj qkv‖z‖b‖a", Kind::Q4, 12352, 2048, false, 30),
        ("GDN out_proj", Kind::Q4, 2048, 4096, false, 30),
        ("attn q‖k‖v", Kind::Q4, 9216, 2048, false, 10),
        ("attn o_proj", Kind::Q4, 2048, 4096, false, 10),
        ("shared gate‖up + SwiGLU", Kind::Q4, 1024, 2048, true, 40),
        ("shared down", Kind::Q4, 2048, 512, false, 40),
        ("router (Q8)", Kind::Q8, 256, 2048, false, 40),
        ("shared gate (Q8, 1 row)", Kind::Q8, 1, 2048, false, 40),
    ];
    let (xb, _) = activations(&mut rng, T * 4096, 1.0);
    let dx = upload(s, &xb);
    let mut y = upload(s, &vec![bf16::ZERO; T * 12352]);
    // The mixer projections add up here; the MoE-side products are part of the MoE block timed
    // in tests/cuda_moe.rs.
    let mut mixer_ms = 0.0;
    let mut dense = DenseGemm::new(&dev, 12352 * 2048).expect("cuBLAS");
    println!("| product | rows × cols | fused ms @4096 (TFLOP/s) | wgmma ms @4096 (TFLOP/s) | cuBLAS path ms @4096 (TFLOP/s) | cuBLAS on a kept bf16 copy | ms @512 fused / cuBLAS | layers | best ms per 4K prefill |");
    for (what, kind, n, k, swiglu, layers) in shapes {
        let m = random_weights(&mut rng, kind, n, k);
        let dm = DeviceMatrices::concat(s, &[&m]).expect("upload");
        let out = if swiglu { n / 2 } else { n };
        let x = dx.slice(..T * k);
        let mut yv = y.slice_mut(..T * out);
        let mut fused = |g: &GemmKernels| {
            median_ms(&dev, 10, || {
                if swiglu {
                    g.gemm_swiglu(&dm.view(), &x, &mut yv).expect("gemm_swiglu");
                } else {
                    g.gemm(&dm.view(), &x, &mut yv).expect("gemm");
                }
            })
        };
        let ms = fused(&g);
        let wg = fused(&gw);
        // The cuBLAS path (dequantise + cuBLAS) for the plain products, at 4096 and 512 tokens,
        // beside the fused kernel at 512; and on a kept bf16 copy (what the model runs).
        let cublas = |dense: &mut DenseGemm, t: usize, yv: &mut CudaViewMut<bf16>| {
            let x = dx.slice(..t * k);
            let mut yv = yv.slice_mut(..t * n);
            median_ms(&dev, 10, || {
                dense.gemm(&dm.view(), &x, &mut yv).expect("dense gemm")
            })
        };
        let (cb, kept, cb512, fused512) = if swiglu {
            (f32::NAN, f32::NAN, f32::NAN, f32::NAN)
        } else {
            let x512 = dx.slice(..512 * k);
            let f512 = median_ms(&dev, 10, || {
                g.gemm(&dm.view(), &x512, &mut yv.slice_mut(..512 * n))
                    .expect("gemm")
            });
            let mut keeping = DenseGemm::new(&dev, 0).expect("cuBLAS");
            keeping.keep(&dm.view()).expect("keep");
            (
                cublas(&mut dense, T, &mut yv),
                cublas(&mut keeping, T, &mut yv),
                cublas(&mut dense, 512, &mut yv),
                f512,
            )
        };
        let tflops = |ms: f32, t: usize| 2.0 * (t * n * k) as f64 / (ms as f64 * 1e-3) / 1e12;
        let best = [ms, wg, kept]
            .into_iter()
            .filter(|v| !v.is_nan())
            .fold(f32::INFINITY, f32::min);
        if what.starts_with("GDN") || what.starts_with("attn") {
            mixer_ms += best as f64 * layers as f64;
        }
        println!(
            "| {what} | {n} × {k} | {ms:.3} ({:.0}) | {wg:.3} ({:.0}) | {cb:.3} ({:.0}) | {kept:.3} ({:.0}) | {fused512:.3} / {cb512:.3} | {layers} | {:.2} |",
            tflops(ms, T),
            tflops(wg, T),
            tflops(cb, T),
            tflops(kept, T),
            best as f64 * layers as f64
        );
    }
    println!("GDN and attention projections of a 4096-token prefill: {mixer_ms:.1} ms (the MoE block: tests/cuda_moe.rs)");
    // The router as the model runs it: 256 experts' rows and the shared expert's gate, 257 rows,
    // multiplied as 264 (zero rows appended, dense.rs), dequantised per product and kept.
    let m = random_weights(&mut rng, Kind::Q8, 257, 2048);
    let dm = DeviceMatrices::concat(s, &[&m]).expect("upload");
    let x = dx.slice(..T * 2048);
    let mut yv = y.slice_mut(..T * 257);
    let mut keeping = DenseGemm::new(&dev, 0).expect("cuBLAS");
    keeping.keep(&dm.view()).expect("keep");
    let [per_product, kept] = [&mut dense, &mut keeping].map(|d| {
        median_ms(&dev, 10, || {
            d.gemm(&dm.view(), &x, &mut yv).expect("dense gemm")
        })
    });
    println!(
        "router ‖ shared gate (Q8) 257 × 2048 @4096 as 264 rows, cuBLAS path: {per_product:.3} ms dequantised per product, {kept:.3} ms kept (× 40 layers: {:.2} / {:.2} ms; 257 rows as they are took 0.103 ms, NOTES v1.31)",
        per_product * 40.0,
        kept * 40.0
    );
}

/// cuBLAS on kept bf16 copies at token counts around the prefill chunk and at odd ones (a
/// prompt's last chunk is any length): ms per product and TFLOP/s, to see how far cuBLAS's own
/// kernel choice moves with the count. Prints; asserts nothing about speed.
#[test]
fn cublas_timing_by_token_count() {
    let dev = device();
    let s = dev.stream();
    let mut rng = rng("cublas by tokens");
    let shapes = [
        ("GDN in_proj", Kind::Q4, 12352, 2048),
        ("GDN out_proj / o_proj", Kind::Q4, 2048, 4096),
        ("attn q‖k‖v", Kind::Q4, 9216, 2048),
        ("router ‖ shared gate", Kind::Q8, 257, 2048),
    ];
    let counts = [
        4096, 4088, 4064, 4052, 4032, 4000, 3968, 3148, 2100, 2048, 1100, 1024, 600, 512,
    ];
    let (xb, _) = activations(&mut rng, 4096 * 4096, 1.0);
    let dx = upload(s, &xb);
    let mut y = upload(s, &vec![bf16::ZERO; 4096 * 12352]);
    println!(
        "| product | {} |",
        counts
            .map(|t| format!("{t} tokens ms (TFLOP/s)"))
            .join(" | ")
    );
    for (what, kind, n, k) in shapes {
        let m = random_weights(&mut rng, kind, n, k);
        let dm = DeviceMatrices::concat(s, &[&m]).expect("upload");
        let mut keeping = DenseGemm::new(&dev, 0).expect("cuBLAS");
        keeping.keep(&dm.view()).expect("keep");
        let cells: Vec<String> = counts
            .iter()
            .map(|&t| {
                let x = dx.slice(..t * k);
                let mut yv = y.slice_mut(..t * n);
                let ms = median_ms(&dev, 10, || {
                    keeping.gemm(&dm.view(), &x, &mut yv).expect("dense gemm")
                });
                let tflops = 2.0 * (t * n * k) as f64 / (ms as f64 * 1e-3) / 1e12;
                format!("{ms:.3} ({tflops:.0})")
            })
            .collect();
        println!("| {what} {n} × {k} | {} |", cells.join(" | "));
    }
}

/// Random weights of the given kind without running the quantiser (timing only).
fn random_weights(rng: &mut SmallRng, kind: Kind, n: usize, k: usize) -> Matrix {
    match kind {
        Kind::Q4 => random_codes(rng, 4, n, k),
        Kind::Q8 => random_codes(rng, 8, n, k),
        Kind::Bf16 => matrix(rng, kind, n, k, 0.05),
    }
}
