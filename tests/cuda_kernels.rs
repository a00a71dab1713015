//! GPU kernel tests: each kernel against a plain CPU reference on fresh random inputs at the
//! model's real shapes, and GEMV bandwidth timings (printed, never asserted).
//!
//! They need an H200 (or another sm_90a GPU) and FAIL without one: a passing run means the kernels
//! ran. CI builds them but does not run them; scripts/gpu-check.sh runs them on the GPU machine.
//! Run with `--test-threads=1 --nocapture` to keep the timings readable.
//!
//! The CPU references here are local, written plainly from spec/MODEL.md (§3.2, §3.6.7, §3.7,
//! §5.1) in f64. They are to be replaced by the reference ops of src/model once those exist.
//!
//! Inputs are random with a fresh seed per run (printed; set LILY_TEST_SEED to repeat a run).
//! Outputs are poisoned with NaN before each launch, so an element the kernel skips fails.
#![cfg(feature = "cuda")]

mod common;

use common::Rng;
use std::sync::Arc;

use cudarc::driver::{sys, CudaSlice, CudaStream};
use half::bf16;
use lily::cuda::gemm::{
    FusedTopK, GemvKernels, GemvShape, L2Ahead, Matrices, NormIn, ResidualInput, ResidualOut,
    SlotInput, WeightData, GROUP, MAX_TOKENS, SLOT_WORDS,
};
use lily::cuda::moe::{max_gathered_slots, MoeKernels, SLOT_TOKENS};
use lily::cuda::norm::NormKernels;
use lily::cuda::{CudaDevice, CudaError};
use rayon::prelude::*;

const EPS: f32 = 1e-6;
const HIDDEN: usize = 2048;

// ---------------------------------------------------------------------------------------------
// Test plumbing

fn device() -> CudaDevice {
    CudaDevice::open("cuda").unwrap_or_else(|e| panic!("these tests need a GPU: {e}"))
}

fn upload<T: cudarc::driver::DeviceRepr>(stream: &Arc<CudaStream>, v: &[T]) -> CudaSlice<T> {
    stream.clone_htod(v).expect("host to device copy")
}

fn download<T: cudarc::driver::DeviceRepr + Default + Clone>(
    stream: &Arc<CudaStream>,
    v: &CudaSlice<T>,
) -> Vec<T> {
    stream.clone_dtoh(v).expect("device to host copy")
}

/// A bf16 output buffer filled with NaN, so unwritten elements show.
fn poisoned(stream: &Arc<CudaStream>, n: usize) -> CudaSlice<bf16> {
    upload(stream, &vec![bf16::NAN; n])
}

fn f(v: bf16) -> f64 {
    v.to_f64()
}

fn round_bf16(v: f64) -> f64 {
    bf16::from_f64(v).to_f64()
}

/// Compares a bf16 result with an f64 reference element by element:
/// |got − want| ≤ rel·|want| + abs[i]. Also returns the norm-wise error ‖got − want‖ / ‖want‖.
fn check(what: &str, got: &[bf16], want: &[f64], rel: f64, abs: &dyn Fn(usize) -> f64) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let (mut worst, mut worst_at, mut diff2, mut ref2) = (0.0f64, 0usize, 0.0f64, 0.0f64);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let g = f(g);
        assert!(
            g.is_finite(),
            "{what}: element {i} is {g} (not written, or overflow); want {w}"
        );
        let err = (g - w).abs();
        let allowed = rel * w.abs() + abs(i);
        if err / allowed > worst {
            (worst, worst_at) = (err / allowed, i);
        }
        diff2 += err * err;
        ref2 += w * w;
    }
    let norm_err = (diff2 / ref2.max(f64::MIN_POSITIVE)).sqrt();
    println!("{what}: worst error {worst:.3} of allowed (at {worst_at}), norm-wise {norm_err:.2e}");
    assert!(
        worst <= 1.0,
        "{what}: element {worst_at}: got {}, want {}, error {:.3e} > allowed {:.3e}",
        f(got[worst_at]),
        want[worst_at],
        (f(got[worst_at]) - want[worst_at]).abs(),
        rel * want[worst_at].abs() + abs(worst_at)
    );
    norm_err
}

/// Half a bf16 ulp, relative: what rounding a correct fp32 value to bf16 may cost.
const HALF_ULP: f64 = 1.0 / 256.0;
/// Room for fp32 (instead of f64) arithmetic before that rounding.
const FP32_SLACK: f64 = 1e-5;

// ---------------------------------------------------------------------------------------------
// Device

#[test]
fn device_opens_and_rejects_bad_specs() {
    let dev = device();
    println!("device: {}", dev.name());
    assert!(matches!(
        CudaDevice::open("gpu0"),
        Err(CudaError::BadDeviceSpec(_))
    ));
    assert!(matches!(
        CudaDevice::open("cuda:x"),
        Err(CudaError::BadDeviceSpec(_))
    ));
    assert!(matches!(
        CudaDevice::open("cuda:999"),
        Err(CudaError::NoSuchDevice { index: 999, .. })
    ));
    assert!(matches!(
        dev.function("nope", "f"),
        Err(CudaError::MissingModule(_))
    ));
    // Which libcuda/libcublas were loaded, from where (the loader path or our preload).
    if let Ok(maps) = std::fs::read_to_string("/proc/self/maps") {
        let mut libs: Vec<&str> = maps
            .lines()
            .filter_map(|l| l.split_whitespace().nth(5))
            .filter(|p| p.contains("libcuda.so") || p.contains("libcublas"))
            .collect();
        libs.dedup();
        println!("libraries: {libs:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Norms (MODEL.md §3.2, §3.6.7, §3.7)

/// rsqrt(mean(x²) + eps) of one row, f64.
fn inv_rms(x: &[f64]) -> f64 {
    1.0 / (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + EPS as f64).sqrt()
}

#[test]
fn rmsnorm_matches_reference() {
    let dev = device();
    let k = NormKernels::load(&dev).unwrap();
    let s = dev.stream();
    let mut rng = Rng::new("rmsnorm");
    // Hidden-state norms for 7 tokens, and q_norm over 16 heads × 3 tokens of 256.
    for (rows, n, scale) in [(7, HIDDEN, 4.0), (48, 256, 0.5)] {
        let x = rng.bf16s(rows * n, scale);
        let w: Vec<f32> = (0..n).map(|_| 1.0 + 0.5 * rng.unit()).collect(); // effective 1 + w
        let (dx, dw, mut dy) = (upload(s, &x), upload(s, &w), poisoned(s, rows * n));
        k.rmsnorm(&dx.as_view(), &dw.as_view(), &mut dy.as_view_mut(), EPS)
            .unwrap();
        let y = download(s, &dy);
        let mut want = Vec::with_capacity(rows * n);
        for row in x.chunks(n) {
            let xf: Vec<f64> = row.iter().map(|&v| f(v)).collect();
            let r = inv_rms(&xf);
            want.extend(xf.iter().zip(&w).map(|(v, &wi)| v * r * wi as f64));
        }
        // Tolerance: half a bf16 ulp of the output, plus fp32 arithmetic.
        check(
            &format!("rmsnorm [{rows}×{n}]"),
            &y,
            &want,
            HALF_ULP + FP32_SLACK,
            &|_| 1e-30,
        );
    }
}

#[test]
fn residual_rmsnorm_matches_reference() {
    let dev = device();
    let k = NormKernels::load(&dev).unwrap();
    let s = dev.stream();
    let mut rng = Rng::new("residual_rmsnorm");
    let (rows, n) = (5, HIDDEN);
    let w: Vec<f32> = (0..n).map(|_| 1.0 + 0.5 * rng.unit()).collect();
    // parts = 1: the plain residual add; parts = 9: the MoE combine (8 experts + the shared one).
    for parts in [1, 9] {
        let what = format!("residual_rmsnorm, {parts} parts");
        let h = rng.bf16s(rows * n, 8.0);
        let p = rng.bf16s(rows * parts * n, 2.0);
        let weights: Vec<f32> = (0..rows * parts).map(|_| rng.unit().abs()).collect();
        let (mut dh, dp, dwt, dw, mut dy) = (
            upload(s, &h),
            upload(s, &p),
            upload(s, &weights),
            upload(s, &w),
            poisoned(s, rows * n),
        );
        let dwt = dwt.as_view();
        k.residual_rmsnorm(
            &mut dh.as_view_mut(),
            &dp.as_view(),
            (parts > 1).then_some(&dwt),
            &dw.as_view(),
            &mut dy.as_view_mut(),
            EPS,
        )
        .unwrap();
        let (h_gpu, y) = (download(s, &dh), download(s, &dy));
        // r = bf16(Σ_j weight_j · part_j) (or the one part), h = bf16(h + r), then the norm of the
        // rounded h. r's own rounding can differ by an ulp of r from the f64 one where fp32
        // summation lands on the other side of a rounding boundary: allowed per element.
        let mut r = vec![0f64; rows * n];
        let mut r_ulp = vec![0f64; rows * n];
        for row in 0..rows {
            for i in 0..n {
                let sum: f64 = (0..parts)
                    .map(|j| {
                        let wj = if parts > 1 {
                            weights[row * parts + j] as f64
                        } else {
                            1.0
                        };
                        wj * f(p[(row * parts + j) * n + i])
                    })
                    .sum();
                r[row * n + i] = round_bf16(sum);
                r_ulp[row * n + i] = if parts > 1 {
                    2.0 * HALF_ULP * sum.abs()
                } else {
                    0.0
                };
            }
        }
        let h_sum: Vec<f64> = h.iter().zip(&r).map(|(&a, &b)| f(a) + b).collect();
        check(
            &format!("{what}: h"),
            &h_gpu,
            &h_sum,
            HALF_ULP + FP32_SLACK,
            &|i| r_ulp[i] + 1e-30,
        );
        // The norm is checked from the GPU's own rounded h.
        let h_new: Vec<f64> = h_gpu.iter().map(|&v| f(v)).collect();
        let mut want = Vec::with_capacity(rows * n);
        for row in h_new.chunks(n) {
            let inv = inv_rms(row);
            want.extend(row.iter().zip(&w).map(|(v, &wi)| v * inv * wi as f64));
        }
        check(
            &format!("{what}: y"),
            &y,
            &want,
            HALF_ULP + FP32_SLACK,
            &|_| 1e-30,
        );
    }
}

fn silu(v: f64) -> f64 {
    v / (1.0 + (-v).exp())
}

#[test]
fn gated_rmsnorm_matches_reference() {
    let dev = device();
    let k = NormKernels::load(&dev).unwrap();
    let s = dev.stream();
    let mut rng = Rng::new("gated_rmsnorm");
    // 32 value heads of 128, for 3 tokens.
    let (rows, n) = (96, 128);
    let o = rng.bf16s(rows * n, 1.0);
    let z = rng.bf16s(rows * n, 4.0);
    let w: Vec<f32> = (0..n)
        .map(|_| bf16::from_f32(1.0 + 0.3 * rng.unit()).to_f32())
        .collect();
    let (d_o, dz, dw, mut dy) = (
        upload(s, &o),
        upload(s, &z),
        upload(s, &w),
        poisoned(s, rows * n),
    );
    k.gated_rmsnorm(
        &d_o.as_view(),
        &dz.as_view(),
        &dw.as_view(),
        &mut dy.as_view_mut(),
        EPS,
    )
    .unwrap();
    let y = download(s, &dy);
    let mut want = Vec::with_capacity(rows * n);
    for (orow, zrow) in o.chunks(n).zip(z.chunks(n)) {
        let of: Vec<f64> = orow.iter().map(|&v| f(v)).collect();
        let r = inv_rms(&of);
        for i in 0..n {
            let t = round_bf16(of[i] * r);
            let u = round_bf16(w[i] as f64 * t);
            want.push(u * silu(f(zrow[i])));
        }
    }
    // Tolerance: the two intermediate bf16 roundings can land one ulp (2^-7) apart when the fp32
    // value sits near a rounding boundary, so allow 2^-5 per element; the norm-wise error must
    // still be that of plain output rounding.
    let norm_err = check("gated_rmsnorm", &y, &want, 1.0 / 32.0, &|_| 1e-30);
    assert!(
        norm_err < HALF_ULP,
        "gated_rmsnorm: norm-wise error {norm_err:.2e}"
    );
}

// ---------------------------------------------------------------------------------------------
// GEMV (MODEL.md §5.1)

/// A stack of matrices on the host, in the kernel's input format.
struct HostMatrices {
    bits: u32, // 4, 8 or 16 (bf16)
    count: usize,
    rows: usize,
    cols: usize,
    packed: Vec<u32>, // affine formats
    scales: Vec<bf16>,
    biases: Vec<bf16>,
    dense: Vec<bf16>, // bf16 format
}

impl HostMatrices {
    /// Random weights: any bits are valid packed values; scales around 0.01 and biases around
    /// −7.5·scale, as MLX's quantiser makes them for zero-centred weights.
    fn random(rng: &mut Rng, bits: u32, count: usize, rows: usize, cols: usize) -> Self {
        let n = count * rows * cols;
        if bits == 16 {
            let dense = rng.bf16s(n, 0.08);
            return Self {
                bits,
                count,
                rows,
                cols,
                packed: vec![],
                scales: vec![],
                biases: vec![],
                dense,
            };
        }
        let levels = ((1u32 << bits) - 1) as f32;
        let packed = rng.words(n * bits as usize / 32);
        let (mut scales, mut biases) =
            (Vec::with_capacity(n / GROUP), Vec::with_capacity(n / GROUP));
        for _ in 0..n / GROUP {
            let s = 0.15 / levels * (1.0 + 0.5 * rng.unit());
            scales.push(bf16::from_f32(s));
            biases.push(bf16::from_f32(-s * levels / 2.0 * (1.0 + 0.2 * rng.unit())));
        }
        Self {
            bits,
            count,
            rows,
            cols,
            packed,
            scales,
            biases,
            dense: vec![],
        }
    }

    /// W[m][r][c] as f64, and the bf16 offset the quantised kernel adds to q before its fp32 sums
    /// and removes after them (128, or 128·17 for Q8), times |scale|: the magnitude those sums
    /// carry, which bounds their rounding error.
    fn weight(&self, m: usize, r: usize, c: usize) -> (f64, f64) {
        let row = m * self.rows + r;
        if self.bits == 16 {
            return (f(self.dense[row * self.cols + c]), 0.0);
        }
        let per_word = 32 / self.bits as usize;
        let word = self.packed[(row * self.cols + c) / per_word];
        let q = (word >> (self.bits as usize * (c % per_word))) & ((1 << self.bits) - 1);
        let g = row * (self.cols / GROUP) + c / GROUP;
        let (s, b) = (f(self.scales[g]), f(self.biases[g]));
        let offset = if self.bits == 4 { 128.0 } else { 128.0 * 17.0 };
        (s * q as f64 + b, offset * s.abs())
    }

    /// y[n][r] = Σ_c W[m][r][c]·x[n][c] in f64, and the error each output may have (see check_gemv).
    fn gemv(&self, m: usize, x: &[bf16], ntok: usize) -> (Vec<f64>, Vec<f64>) {
        let per_row: Vec<Vec<(f64, f64)>> = (0..self.rows)
            .into_par_iter()
            .map(|r| {
                (0..ntok)
                    .map(|n| {
                        let xn = &x[n * self.cols..(n + 1) * self.cols];
                        let (mut y, mut mag_w, mut mag_offset) = (0.0, 0.0, 0.0);
                        for (c, &xc) in xn.iter().enumerate() {
                            let (w, offset) = self.weight(m, r, c);
                            y += w * f(xc);
                            mag_w += (w * f(xc)).abs();
                            mag_offset += offset * f(xc).abs();
                        }
                        (y, GEMV_ABS_TOL * mag_w + GEMV_OFFSET_TOL * mag_offset)
                    })
                    .collect()
            })
            .collect();
        let (mut y, mut tol) = (vec![0.0; ntok * self.rows], vec![0.0; ntok * self.rows]);
        for (r, outs) in per_row.iter().enumerate() {
            for (n, &(v, t)) in outs.iter().enumerate() {
                y[n * self.rows + r] = v;
                tol[n * self.rows + r] = t;
            }
        }
        (y, tol)
    }
}

/// GEMV tolerance, besides half a bf16 ulp of each output: fp32 accumulation of up to 4096
/// products costs at most ~5e-6 of Σ|W·x| (one missing product is ~1/K of it, far more) ...
const GEMV_ABS_TOL: f64 = 3e-5;
/// ... and removing the quantised kernel's bf16 offset from its per-group fp32 sums costs a few
/// fp32 ulps of Σ offset·|s|·|x|.
const GEMV_OFFSET_TOL: f64 = 1.0 / (1 << 18) as f64;

/// Device copies of a HostMatrices.
struct DeviceMatrices {
    bits: u32,
    count: usize,
    rows: usize,
    cols: usize,
    packed: Option<CudaSlice<u32>>,
    scales: Option<CudaSlice<bf16>>,
    biases: Option<CudaSlice<bf16>>,
    dense: Option<CudaSlice<bf16>>,
}

impl DeviceMatrices {
    fn upload(s: &Arc<CudaStream>, h: &HostMatrices) -> Self {
        let opt = |v: &[bf16]| (!v.is_empty()).then(|| upload(s, v));
        Self {
            bits: h.bits,
            count: h.count,
            rows: h.rows,
            cols: h.cols,
            packed: (!h.packed.is_empty()).then(|| upload(s, &h.packed)),
            scales: opt(&h.scales),
            biases: opt(&h.biases),
            dense: opt(&h.dense),
        }
    }

    fn view(&self) -> Matrices<'_> {
        let data = match &self.dense {
            Some(d) => WeightData::Bf16(d.as_view()),
            None => WeightData::Affine {
                bits: self.bits,
                packed: self.packed.as_ref().unwrap().as_view(),
                scales: self.scales.as_ref().unwrap().as_view(),
                biases: self.biases.as_ref().unwrap().as_view(),
            },
        };
        Matrices {
            data,
            count: self.count,
            rows: self.rows,
            cols: self.cols,
        }
    }

    /// Bytes of weights (and scales, biases) one matrix of the stack occupies.
    fn matrix_bytes(&self) -> usize {
        let quant = if self.bits == 16 {
            0
        } else {
            4 * self.rows * self.cols / GROUP
        };
        self.rows * self.cols * self.bits as usize / 8 + quant
    }
}

fn format_name(bits: u32) -> &'static str {
    match bits {
        4 => "Q4",
        8 => "Q8",
        _ => "bf16",
    }
}

/// A GEMV output against the f64 reference: per element within half a bf16 ulp plus `tol`
/// (from HostMatrices::gemv), and norm-wise within half an ulp. The norm-wise bound is a
/// statement about many roundings averaging out, so it is checked only on outputs of at least
/// 64 values (a single output near zero can have any relative rounding error).
fn check_gemv(what: &str, got: &[bf16], want: &[f64], tol: &[f64]) {
    let norm_err = check(what, got, want, HALF_ULP, &|i| tol[i]);
    assert!(
        got.len() < 64 || norm_err < HALF_ULP,
        "{what}: norm-wise error {norm_err:.2e}"
    );
}

#[test]
fn gemv_matches_reference() {
    let dev = device();
    let k = GemvKernels::load(&dev).unwrap();
    let s = dev.stream();
    let mut rng = Rng::new("gemv");
    // (bits, rows, cols, tokens): the model's decode shapes. 4-bit: GDN in_proj_qkv / attention
    // q_proj [8192, 2048], in_proj_a/b [32, 2048], out_proj / o_proj [2048, 4096], lm_head
    // [248320, 2048]; 8-bit: router [256, 2048], shared_expert_gate [1, 2048]; bf16 for
    // unquantised checkpoints. Odd token counts and a row count that is no multiple of 16 too.
    let cases: &[(u32, usize, usize, usize)] = &[
        (4, 8192, 2048, 1),
        (4, 32, 2048, 1),
        (4, 2048, 4096, 1),
        (4, 2048, 4096, 8),
        (4, 8192, 2048, 3),
        (4, 40, 512, 5),
        (4, 248_320, 2048, 1),
        (8, 256, 2048, 1),
        (8, 256, 2048, 6),
        (8, 2048, 4096, 3),
        (8, 1, 2048, 1),
        (16, 8192, 2048, 1),
        (16, 2048, 4096, 4),
        (16, 8192, 2048, 8),
    ];
    for &(bits, rows, cols, ntok) in cases {
        let what = format!("gemv {} [{rows}×{cols}] ×{ntok}", format_name(bits));
        let h = HostMatrices::random(&mut rng, bits, 1, rows, cols);
        let m = DeviceMatrices::upload(s, &h);
        let x = rng.bf16s(ntok * cols, 1.0);
        let (dx, mut dy) = (upload(s, &x), poisoned(s, ntok * rows));
        k.gemv(&m.view(), &dx.as_view(), &mut dy.as_view_mut())
            .unwrap();
        let y = download(s, &dy);
        let (want, tol) = h.gemv(0, &x, ntok);
        check_gemv(&what, &y, &want, &tol);
    }
    // The output may start at any element: a pass of more rows than one launch holds splits them
    // (the 8-bit router‖shared gate, 257 rows, takes 6 tokens a launch, so the 7th row's output
    // starts 6·257 values in). Here one value in, and that value is left alone.
    let (rows, cols, ntok) = (257, 2048, 2);
    let h = HostMatrices::random(&mut rng, 8, 1, rows, cols);
    let m = DeviceMatrices::upload(s, &h);
    let x = rng.bf16s(ntok * cols, 1.0);
    let (dx, mut dy) = (upload(s, &x), poisoned(s, 1 + ntok * rows));
    k.gemv(&m.view(), &dx.as_view(), &mut dy.slice_mut(1..))
        .unwrap();
    let y = download(s, &dy);
    assert!(y[0].is_nan(), "gemv wrote before its output");
    let (want, tol) = h.gemv(0, &x, ntok);
    check_gemv(
        "gemv Q8 [257×2048] ×2 at an odd offset",
        &y[1..],
        &want,
        &tol,
    );
}

#[test]
fn gemv_expert_slots_match_reference() {
    let dev = device();
    let k = GemvKernels::load(&dev).unwrap();
    let s = dev.stream();
    let mut rng = Rng::new("gemv experts");
    // One token's routed experts: gate_up [1024, 2048] of 8 experts chosen by id (one chosen
    // twice) with the shared x, then down [2048, 512] with one x per slot; and two tokens of 4
    // experts each, every token's x shared by its 4 slots. A stack of 16 experts stands in for
    // the layer's 256 (same layout, less host work).
    let (experts, slots) = (16, 8);
    let ids: Vec<i32> = {
        let mut ids: Vec<i32> = (0..slots).map(|_| rng.below(experts) as i32).collect();
        ids[slots - 1] = ids[0];
        ids
    };
    println!("expert ids {ids:?}");
    let dids = upload(s, &ids);
    for (rows, cols, input) in [
        (1024, 2048, SlotInput::Shared),
        (2048, 512, SlotInput::PerSlot),
        (2048, 512, SlotInput::PerSlotSwiGlu),
        (1024, 2048, SlotInput::PerGroup(4)),
    ] {
        let what = format!("gemv Q4 experts [{rows}×{cols}] ×{slots} slots, x {input:?}");
        let h = HostMatrices::random(&mut rng, 4, experts, rows, cols);
        let m = DeviceMatrices::upload(s, &h);
        let x = match input {
            SlotInput::Shared => rng.bf16s(cols, 1.0),
            SlotInput::PerSlot => rng.bf16s(slots * cols, 1.0),
            // gate‖up pairs as the gate_up projection leaves them, with gates across SiLU's bend.
            SlotInput::PerSlotSwiGlu => rng.bf16s(slots * 2 * cols, 4.0),
            SlotInput::PerGroup(n) => rng.bf16s(slots / n * cols, 1.0),
            _ => unreachable!("tested on their own"),
        };
        let (dx, mut dy) = (upload(s, &x), poisoned(s, slots * rows));
        k.gemv_slots(
            &m.view(),
            Some(&dids.as_view()),
            slots,
            &dx.as_view(),
            input,
            1,
            &mut dy.as_view_mut(),
        )
        .unwrap();
        let y = download(s, &dy);
        let (mut want, mut tol) = (Vec::new(), Vec::new());
        for (slot, &id) in ids.iter().enumerate() {
            // The x the product should see: for SwiGLU, bf16(silu(gate) · up), the reference's
            // rounded activation.
            let xs: Vec<bf16> = match input {
                SlotInput::Shared => x.clone(),
                SlotInput::PerSlot => x[slot * cols..(slot + 1) * cols].to_vec(),
                SlotInput::PerGroup(n) => x[slot / n * cols..(slot / n + 1) * cols].to_vec(),
                SlotInput::PerSlotSwiGlu => {
                    let gu = &x[slot * 2 * cols..(slot + 1) * 2 * cols];
                    (0..cols)
                        .map(|i| {
                            // fp32, as the kernel computes it.
                            let (g, u) = (gu[i].to_f32(), gu[cols + i].to_f32());
                            bf16::from_f32(g / (1.0 + (-g).exp()) * u)
                        })
                        .collect()
                }
                _ => unreachable!(),
            };
            let (w, t) = h.gemv(id as usize, &xs, 1);
            want.extend(w);
            tol.extend(t);
        }
        check_gemv(&what, &y, &want, &tol);
    }
}

/// More than 8 rows in one launch as row chunks (dense projections of a batched decode pass):
/// each row against the reference, the last chunk short, in the three formats.
#[test]
fn gemv_row_chunks_match_reference() {
    let dev = device();
    let k = GemvKernels::load(&dev).unwrap();
    let s = dev.stream();
    let mut rng = Rng::new("gemv row chunks");
    // (bits, rows, cols, token rows): out_proj, the router ‖ shared gate, a bf16 matrix.
    for &(bits, rows, cols, t) in &[
        (4, 2048, 4096, 21),
        (8, 257, 2048, 64),
        (16, 512, 2048, 9),
        (4, 8192, 2048, 40),
    ] {
        let what = format!("gemv row chunks {} [{rows}×{cols}] ×{t}", format_name(bits));
        let h = HostMatrices::random(&mut rng, bits, 1, rows, cols);
        let m = DeviceMatrices::upload(s, &h);
        let x = rng.bf16s(t * cols, 1.0);
        let (dx, mut dy) = (upload(s, &x), poisoned(s, t * rows));
        k.gemv_row_chunks(&m.view(), &dx.as_view(), &mut dy.as_view_mut())
            .unwrap();
        let (want, tol) = h.gemv(0, &x, t);
        check_gemv(&what, &download(s, &dy), &want, &tol);
    }
}

/// The slot table of a batched pass's experts (moe_slot_table) on the CPU: for each expert in
/// order, its (token, pair) list in token order, cut into slots of 8.
fn cpu_slot_table(ids: &[i32], per_token: usize, experts: usize) -> Vec<(i32, Vec<(i32, i32)>)> {
    let mut slots = Vec::new();
    for e in 0..experts as i32 {
        let pairs: Vec<(i32, i32)> = (0..ids.len())
            .filter(|&p| ids[p].clamp(0, experts as i32 - 1) == e)
            .map(|p| ((p / per_token) as i32, p as i32))
            .collect();
        for chunk in pairs.chunks(SLOT_TOKENS) {
            slots.push((e, chunk.to_vec()));
        }
    }
    slots
}

/// A batched pass's experts as gathered slots: the table made on the device is the CPU's
/// grouping, and gate‖up (x at the tokens' rows) then down (x at the pairs' rows through SwiGLU)
/// give every (token, expert) pair its product. Routings: 40 tokens over 16 experts + a shared
/// one (experts with more than 8 tokens, so several slots), 9 tokens, and 64 tokens all on the
/// same 4 experts and the shared one (every expert 8 slots), and 200 tokens (a short prompt's
/// chunk: the shared expert's 25 slots). Weights in 4 bits, and for the first
/// routing in 8 bits and bf16 too (checkpoints of those formats run the same passes).
#[test]
fn gemv_gathered_slots_match_reference() {
    let dev = device();
    let (k, moe) = (
        GemvKernels::load(&dev).unwrap(),
        MoeKernels::load(&dev).unwrap(),
    );
    let s = dev.stream();
    let mut rng = Rng::new("gemv gathered");
    let (experts, top_k) = (16, 4);
    let per_token = top_k + 1;
    for (bits, t, same) in [
        (4, 40, false),
        (4, 9, false),
        (4, 64, true),
        (4, 200, false),
        (8, 40, false),
        (16, 40, false),
    ] {
        let gate_up = HostMatrices::random(&mut rng, bits, experts + 1, 1024, 2048);
        let down = HostMatrices::random(&mut rng, bits, experts + 1, 2048, 512);
        let (dgu, ddown) = (
            DeviceMatrices::upload(s, &gate_up),
            DeviceMatrices::upload(s, &down),
        );
        let name = format_name(bits);
        let mut ids = Vec::new();
        for _ in 0..t {
            let mut chosen: Vec<i32> = Vec::new();
            while chosen.len() < top_k {
                let e = if same {
                    chosen.len()
                } else {
                    rng.below(experts)
                } as i32;
                if !chosen.contains(&e) {
                    chosen.push(e);
                }
            }
            chosen.push(experts as i32); // the shared expert
            ids.extend(chosen);
        }
        let pairs = t * per_token;
        let slots = max_gathered_slots(t, per_token, experts + 1);
        let mut table = upload(s, &vec![-7i32; slots * SLOT_WORDS]);
        let n = moe
            .slot_table(
                &upload(s, &ids).as_view(),
                per_token,
                experts + 1,
                &mut table.as_view_mut(),
            )
            .unwrap();
        assert_eq!(n, slots);
        let got = download(s, &table);
        let want = cpu_slot_table(&ids, per_token, experts + 1);
        assert!(
            want.len() <= slots,
            "{} slots over the bound {slots}",
            want.len()
        );
        for (i, entry) in got.chunks(SLOT_WORDS).enumerate() {
            match want.get(i) {
                Some((e, list)) => {
                    let ntok = list.len();
                    assert_eq!((entry[0], entry[1] as usize), (*e, ntok), "slot {i}");
                    let toks: Vec<(i32, i32)> = (0..ntok)
                        .map(|j| (entry[2 + j], entry[2 + SLOT_TOKENS + j]))
                        .collect();
                    assert_eq!(&toks, list, "slot {i}'s tokens");
                }
                None => assert_eq!(entry[1], 0, "slot {i} past the last has tokens"),
            }
        }
        let dtable = table.as_view();
        // gate‖up at the tokens' rows of x, into the pairs' rows.
        let x = rng.bf16s(t * 2048, 1.0);
        let mut gu = poisoned(s, pairs * 1024);
        k.gemv_gathered(
            &dgu.view(),
            &dtable,
            slots,
            &upload(s, &x).as_view(),
            false,
            &mut gu.as_view_mut(),
        )
        .unwrap();
        let (mut want, mut tol) = (Vec::new(), Vec::new());
        for (p, &id) in ids.iter().enumerate() {
            let tok = p / per_token;
            let (w, e) = gate_up.gemv(id as usize, &x[tok * 2048..(tok + 1) * 2048], 1);
            want.extend(w);
            tol.extend(e);
        }
        check_gemv(
            &format!("gathered gate_up {name}, {t} tokens"),
            &download(s, &gu),
            &want,
            &tol,
        );
        // down through SwiGLU at the pairs' rows of a gate‖up with gates across SiLU's bend.
        let act_in = rng.bf16s(pairs * 1024, 4.0);
        let mut y = poisoned(s, pairs * 2048);
        k.gemv_gathered(
            &ddown.view(),
            &dtable,
            slots,
            &upload(s, &act_in).as_view(),
            true,
            &mut y.as_view_mut(),
        )
        .unwrap();
        let (mut want, mut tol) = (Vec::new(), Vec::new());
        for p in 0..pairs {
            let row = &act_in[p * 1024..(p + 1) * 1024];
            let act: Vec<bf16> = (0..512)
                .map(|i| {
                    let (g, u) = (row[i].to_f32(), row[512 + i].to_f32());
                    bf16::from_f32(g / (1.0 + (-g).exp()) * u)
                })
                .collect();
            let (w, e) = down.gemv(ids[p] as usize, &act, 1);
            want.extend(w);
            tol.extend(e);
        }
        check_gemv(
            &format!("gathered down {name}, {t} tokens"),
            &download(s, &y),
            &want,
            &tol,
        );
    }
}

/// The launch hints change nothing: pulling the next kernels' weights into L2 (`then_prefetch`)
/// and reading the ids before the PDL wait (`then_ids_ready`, after a sync here) give the same
/// products with and without, bit for bit; prefetched: whole matrices (dense, an odd row count),
/// one matrix of a stack, and each slot's own matrix of another stack (addressed by the launch's
/// device-side ids, here the last expert too) — any address fault would fail the launch.
#[test]
fn gemv_launch_hints_change_nothing() {
    let dev = device();
    let mut k = GemvKernels::load(&dev).unwrap();
    k.set_l2_ahead(true);
    let s = dev.stream();
    let mut rng = Rng::new("gemv l2 ahead");
    let (experts, slots) = (16, 9);
    let mut ids: Vec<i32> = (0..slots).map(|_| rng.below(experts) as i32).collect();
    ids[slots - 1] = experts as i32 - 1;
    let dids = upload(s, &ids);
    let dense = DeviceMatrices::upload(s, &HostMatrices::random(&mut rng, 4, 1, 8192, 2048));
    let odd = DeviceMatrices::upload(s, &HostMatrices::random(&mut rng, 8, 1, 257, 2048));
    let gate_up =
        DeviceMatrices::upload(s, &HostMatrices::random(&mut rng, 4, experts, 1024, 2048));
    let down = DeviceMatrices::upload(s, &HostMatrices::random(&mut rng, 4, experts, 2048, 512));
    let ahead = [
        L2Ahead::default(),
        L2Ahead::default()
            .matrices(&odd.view(), s)
            .one_matrix(&gate_up.view(), experts - 1, s)
            .one_matrix(&down.view(), experts - 1, s),
        L2Ahead::default().same_matrix(&down.view(), s),
        L2Ahead::default().matrices(&dense.view(), s),
    ];
    let x = upload(s, &rng.bf16s(2048, 1.0));
    let mut outputs = Vec::new();
    for a in ahead {
        let mut y1 = poisoned(s, 8192);
        k.then_prefetch(a);
        k.gemv(&dense.view(), &x.as_view(), &mut y1.as_view_mut())
            .unwrap();
        let mut y2 = poisoned(s, slots * 1024);
        k.then_prefetch(a);
        if a != L2Ahead::default() {
            s.synchronize().unwrap();
            k.then_ids_ready();
        }
        k.gemv_slots(
            &gate_up.view(),
            Some(&dids.as_view()),
            slots,
            &x.as_view(),
            SlotInput::Shared,
            1,
            &mut y2.as_view_mut(),
        )
        .unwrap();
        let bits = |v: Vec<bf16>| v.iter().map(|x| x.to_bits()).collect::<Vec<u16>>();
        outputs.push((bits(download(s, &y1)), bits(download(s, &y2))));
    }
    for (i, o) in outputs.iter().enumerate().skip(1) {
        assert!(o == &outputs[0], "ahead case {i} changed the products");
    }
}

/// One token's routed gate‖up (`then_routed_gate_up`, after a sync here: x and the ids are final):
/// its x staged before the PDL wait, its blocks spread (`routed_gate_up_shape`), against the plain
/// one-token kernel in the same shape (a shape's K split sets the sums' order; how many blocks
/// share the tiles does not): the same bits, for the three formats, the real width (2,048) and the
/// test model's (512), nine slots sharing one x as the experts' gate‖up launch has them.
#[test]
fn routed_gate_up_equals_the_plain_kernel() {
    let dev = device();
    let k = GemvKernels::load(&dev).unwrap();
    let s = dev.stream();
    let mut rng = Rng::new("gemv routed gate up");
    let (experts, slots) = (16, 9);
    for bits in [4, 8, 16] {
        for (rows, cols) in [(1024, 2048), (256, 512)] {
            let ids: Vec<i32> = (0..slots).map(|_| rng.below(experts) as i32).collect();
            let dids = upload(s, &ids);
            let w = DeviceMatrices::upload(
                s,
                &HostMatrices::random(&mut rng, bits, experts, rows, cols),
            );
            let x = upload(s, &rng.bf16s(cols, 1.0));
            let shape = k.routed_gate_up_shape(&w.view(), slots);
            let run = |routed: bool| {
                let mut y = poisoned(s, slots * rows);
                s.synchronize().unwrap();
                if routed {
                    k.then_routed_gate_up();
                }
                k.gemv_slots_shaped(
                    &w.view(),
                    Some(&dids.as_view()),
                    slots,
                    &x.as_view(),
                    SlotInput::PerGroup(slots),
                    1,
                    &mut y.as_view_mut(),
                    shape,
                )
                .unwrap();
                download(s, &y)
                    .iter()
                    .map(|v| v.to_bits())
                    .collect::<Vec<u16>>()
            };
            let launched = k.x_early_launches();
            let (plain, routed) = (run(false), run(true));
            assert_eq!(
                k.x_early_launches(),
                launched + 1,
                "{bits}-bit {rows}×{cols}: the x_early kernel did not run"
            );
            assert!(
                plain.iter().all(|&b| !bf16::from_bits(b).is_nan()),
                "{bits}-bit {rows}×{cols}: the plain kernel left rows unwritten"
            );
            assert!(
                plain == routed,
                "{bits}-bit {rows}×{cols}: the routed launch changed the products"
            );
        }
    }
}

/// The GEMV that makes its own input (`gemv_residual`: residual add, MoE combine and norm inside,
/// the decode path of forward/residual.rs) against the two kernels it replaces, residual_rmsnorm
/// then gemv: the same bits in y, in the new residual stream and in the normalised rows. Shapes:
/// the router (Q8, 257 rows, one part: after the mixer), GDN in_proj and attention q‖k‖v (Q4,
/// nine weighted parts: the MoE combine), the test model's width (512), bf16.
#[test]
fn gemv_residual_equals_norm_then_gemv() {
    let dev = device();
    let (k, norm) = (
        GemvKernels::load(&dev).unwrap(),
        NormKernels::load(&dev).unwrap(),
    );
    let s = dev.stream();
    let mut rng = Rng::new("gemv residual");
    for (bits, rows, cols, parts) in [
        (8, 257, 2048, 1),
        (4, 12352, 2048, 9),
        (4, 9216, 2048, 9),
        (4, 12352, 512, 9),
        (16, 257, 512, 1),
    ] {
        let m = DeviceMatrices::upload(s, &HostMatrices::random(&mut rng, bits, 1, rows, cols));
        let most = k.max_tokens_residual(&m.view());
        assert!(most >= 1, "{bits}-bit [{rows}×{cols}]: no row fits");
        for ntok in [1, most] {
            let what = format!(
                "gemv_residual {} [{rows}×{cols}] ×{ntok}, {parts} parts",
                format_name(bits)
            );
            let h = rng.bf16s(ntok * cols, 8.0);
            let p = rng.bf16s(ntok * parts * cols, 2.0);
            let weights: Vec<f32> = (0..ntok * parts).map(|_| rng.unit().abs()).collect();
            let w: Vec<f32> = (0..cols).map(|_| 1.0 + 0.5 * rng.unit()).collect();
            let (dh, dp, dwt, dw) = (
                upload(s, &h),
                upload(s, &p),
                upload(s, &weights),
                upload(s, &w),
            );
            let weights = (parts > 1).then(|| dwt.as_view());
            // The two kernels.
            let (mut h_ref, mut x_ref, mut y_ref) = (
                upload(s, &h),
                poisoned(s, ntok * cols),
                poisoned(s, ntok * rows),
            );
            norm.residual_rmsnorm(
                &mut h_ref.as_view_mut(),
                &dp.as_view(),
                weights.as_ref(),
                &dw.as_view(),
                &mut x_ref.as_view_mut(),
                EPS,
            )
            .unwrap();
            k.gemv(&m.view(), &x_ref.as_view(), &mut y_ref.as_view_mut())
                .unwrap();
            // The fused one.
            let input = ResidualInput {
                h: dh.as_view(),
                parts: dp.as_view(),
                weights: (parts > 1).then(|| dwt.as_view()),
                norm_w: dw.as_view(),
                eps: EPS,
            };
            let (mut h_out, mut x_out, mut y) = (
                poisoned(s, ntok * cols),
                poisoned(s, ntok * cols),
                poisoned(s, ntok * rows),
            );
            k.gemv_residual(
                &m.view(),
                &input,
                &mut h_out.as_view_mut(),
                Some(&mut x_out.as_view_mut()),
                &mut y.as_view_mut(),
            )
            .unwrap();
            let bits_of = |v: Vec<bf16>| v.iter().map(|x| x.to_bits()).collect::<Vec<u16>>();
            assert!(
                bits_of(download(s, &h_out)) == bits_of(download(s, &h_ref)),
                "{what}: residual stream"
            );
            assert!(
                bits_of(download(s, &x_out)) == bits_of(download(s, &x_ref)),
                "{what}: normalised rows"
            );
            assert!(
                bits_of(download(s, &y)) == bits_of(download(s, &y_ref)),
                "{what}: products"
            );
            assert!(
                bits_of(download(s, &dh)) == bits_of(h.clone()),
                "{what}: the input stream is left as it was"
            );
        }
        // More rows than one launch fits is an error, not a wrong answer.
        if most < 8 {
            let n = most + 1;
            let (dh, dp) = (
                upload(s, &rng.bf16s(n * cols, 1.0)),
                upload(s, &rng.bf16s(n * parts * cols, 1.0)),
            );
            let dwt = upload(s, &vec![0.5f32; n * parts]);
            let dw = upload(s, &vec![1.0f32; cols]);
            let input = ResidualInput {
                h: dh.as_view(),
                parts: dp.as_view(),
                weights: (parts > 1).then(|| dwt.as_view()),
                norm_w: dw.as_view(),
                eps: EPS,
            };
            let (mut h_out, mut y) = (poisoned(s, n * cols), poisoned(s, n * rows));
            assert!(k
                .gemv_residual(
                    &m.view(),
                    &input,
                    &mut h_out.as_view_mut(),
                    None,
                    &mut y.as_view_mut()
                )
                .is_err());
        }
    }
}

/// One decode row's post-mixer residual add and norm split between the GEMVs on either side
/// (forward.rs `norm_in`): the mixer's output projection adds its output to the residual stream
/// and leaves each vector's sum of squares, the router's GEMV makes the norm from them. Its
/// residual stream, normalised row and products must be the bits of the plain GEMV, the
/// residual_rmsnorm kernel and the plain router GEMV. The shapes cover both epilogues (a warp
/// per tile: K = 256; K split over warps, one and two rounds of items a block) and each format.
#[test]
fn residual_out_then_norm_in_equal_the_norm_kernel() {
    let dev = device();
    let (k, norm) = (
        GemvKernels::load(&dev).unwrap(),
        NormKernels::load(&dev).unwrap(),
    );
    let s = dev.stream();
    let mut rng = Rng::new("residual out, norm in");
    let bits_of = |v: Vec<bf16>| v.iter().map(|x| x.to_bits()).collect::<Vec<u16>>();
    // (output projection bits, its rows = hidden, its cols; router bits, router rows)
    for (out_bits, hidden, cols, router_bits, router_rows) in [
        (4, 2048, 4096, 8, 257),
        (4, 2048, 512, 8, 257),
        (4, 2048, 256, 4, 264),
        (8, 1024, 4096, 8, 257),
        (16, 2048, 1024, 16, 257),
        (4, 256, 512, 8, 33),
    ] {
        let what = format!(
            "{} [{hidden}×{cols}] then {} router [{router_rows}×{hidden}]",
            format_name(out_bits),
            format_name(router_bits)
        );
        let out = DeviceMatrices::upload(
            s,
            &HostMatrices::random(&mut rng, out_bits, 1, hidden, cols),
        );
        let router = DeviceMatrices::upload(
            s,
            &HostMatrices::random(&mut rng, router_bits, 1, router_rows, hidden),
        );
        let h = rng.bf16s(hidden, 8.0);
        let o = upload(s, &rng.bf16s(cols, 1.0));
        let w: Vec<f32> = (0..hidden).map(|_| 1.0 + 0.5 * rng.unit()).collect();
        let dw = upload(s, &w);
        // The plain kernels.
        let (mut y_ref, mut h_ref, mut x_ref, mut logits_ref) = (
            poisoned(s, hidden),
            upload(s, &h),
            poisoned(s, hidden),
            poisoned(s, router_rows),
        );
        k.gemv(&out.view(), &o.as_view(), &mut y_ref.as_view_mut())
            .unwrap();
        norm.residual_rmsnorm(
            &mut h_ref.as_view_mut(),
            &y_ref.as_view(),
            None,
            &dw.as_view(),
            &mut x_ref.as_view_mut(),
            EPS,
        )
        .unwrap();
        k.gemv(
            &router.view(),
            &x_ref.as_view(),
            &mut logits_ref.as_view_mut(),
        )
        .unwrap();
        // The split: residual out, then norm in.
        let (mut y, mut hs, mut x, mut logits) = (
            poisoned(s, hidden),
            upload(s, &h),
            poisoned(s, hidden),
            poisoned(s, router_rows),
        );
        let mut vec_ss = upload(s, &vec![f32::NAN; hidden / 8]);
        let res = ResidualOut::new(&mut hs.as_view_mut(), &mut vec_ss.as_view_mut(), s).unwrap();
        k.then_residual_out(res);
        k.gemv(&out.view(), &o.as_view(), &mut y.as_view_mut())
            .unwrap();
        k.ensure_taken("the output projection").unwrap();
        let input = NormIn::new(
            &hs.as_view(),
            &vec_ss.as_view(),
            &dw.as_view(),
            EPS,
            &mut x.as_view_mut(),
            s,
        )
        .unwrap();
        k.then_norm_in(input);
        let x_shape = upload(s, &vec![bf16::NAN; hidden]); // not read: x is made from h
        k.gemv(
            &router.view(),
            &x_shape.as_view(),
            &mut logits.as_view_mut(),
        )
        .unwrap();
        k.ensure_taken("the router").unwrap();
        assert!(
            bits_of(download(s, &y)) == bits_of(download(s, &y_ref)),
            "{what}: products"
        );
        assert!(
            bits_of(download(s, &hs)) == bits_of(download(s, &h_ref)),
            "{what}: residual stream"
        );
        assert!(
            bits_of(download(s, &x)) == bits_of(download(s, &x_ref)),
            "{what}: normalised row"
        );
        assert!(
            bits_of(download(s, &logits)) == bits_of(download(s, &logits_ref)),
            "{what}: router products"
        );
    }
    // Misuse is an error, not a wrong answer: two tokens, rows that are not whole tiles, and a
    // setting no launch took.
    let out = DeviceMatrices::upload(s, &HostMatrices::random(&mut rng, 4, 1, 2048, 512));
    let (o2, mut y2) = (upload(s, &rng.bf16s(2 * 512, 1.0)), poisoned(s, 2 * 2048));
    let (mut hs, mut vec_ss) = (
        upload(s, &rng.bf16s(2048, 1.0)),
        upload(s, &vec![0f32; 256]),
    );
    k.then_residual_out(
        ResidualOut::new(&mut hs.as_view_mut(), &mut vec_ss.as_view_mut(), s).unwrap(),
    );
    assert!(k
        .gemv(&out.view(), &o2.as_view(), &mut y2.as_view_mut())
        .is_err());
    let odd = DeviceMatrices::upload(s, &HostMatrices::random(&mut rng, 4, 1, 2040, 512));
    let (o1, mut y1) = (upload(s, &rng.bf16s(512, 1.0)), poisoned(s, 2040));
    let mut h_odd = upload(s, &rng.bf16s(2040, 1.0));
    k.then_residual_out(
        ResidualOut::new(&mut h_odd.as_view_mut(), &mut vec_ss.as_view_mut(), s).unwrap(),
    );
    assert!(k
        .gemv(&odd.view(), &o1.as_view(), &mut y1.as_view_mut())
        .is_err());
    k.then_residual_out(
        ResidualOut::new(&mut hs.as_view_mut(), &mut vec_ss.as_view_mut(), s).unwrap(),
    );
    assert!(k.ensure_taken("nothing").is_err());
    assert!(
        k.ensure_taken("nothing").is_ok(),
        "cleared by the first check"
    );
}

/// The router's top-k kernel against a plain reference: 256 experts (and 16) plus the shared
/// gate, 8 of them chosen by probability, the lowest index among equal logits (rows with many
/// repeated values and all-negative rows included), weights renormalised over the chosen, the
/// shared expert's weight sigmoid(gate).
#[test]
fn router_topk_matches_reference() {
    let dev = device();
    let moe = MoeKernels::load(&dev).unwrap();
    let s = dev.stream();
    let mut rng = Rng::new("router topk");
    let (top, slots) = (8usize, 9usize);
    for experts in [256usize, 16] {
        let tokens = 12;
        let mut logits: Vec<bf16> = rng.bf16s(tokens * (experts + 1), 3.0);
        for t in 0..tokens {
            let row = &mut logits[t * (experts + 1)..(t + 1) * (experts + 1)];
            match t % 4 {
                // Ties: a few values repeated over the whole row.
                1 => row[..experts]
                    .iter_mut()
                    .enumerate()
                    .for_each(|(i, v)| *v = bf16::from_f32([0.5f32, -1.25, 2.0, 0.5][i % 4])),
                // All negative.
                2 => row[..experts]
                    .iter_mut()
                    .for_each(|v| *v = bf16::from_f32(-v.to_f32().abs() - 0.5)),
                _ => {}
            }
        }
        let dl = upload(s, &logits);
        let (mut ids, mut weights) = (
            upload(s, &vec![-1i32; tokens * slots]),
            upload(s, &vec![-1.0f32; tokens * slots]),
        );
        moe.router_topk(
            &dl.as_view(),
            experts + 1,
            experts,
            top,
            true,
            &mut ids.as_view_mut(),
            &mut weights.as_view_mut(),
        )
        .unwrap();
        let (ids, weights) = (download(s, &ids), download(s, &weights));
        for t in 0..tokens {
            let row: Vec<f64> = logits[t * (experts + 1)..(t + 1) * (experts + 1)]
                .iter()
                .map(|v| v.to_f32() as f64)
                .collect();
            let mut order: Vec<usize> = (0..experts).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            let mx = row[order[0]];
            let p: Vec<f64> = order[..top].iter().map(|&e| (row[e] - mx).exp()).collect();
            let chosen: f64 = p.iter().sum();
            let what = format!("{experts} experts, token {t}");
            let got_ids: Vec<usize> = ids[t * slots..t * slots + top]
                .iter()
                .map(|&i| i as usize)
                .collect();
            assert_eq!(got_ids, order[..top], "{what}: ids");
            assert_eq!(ids[t * slots + top], experts as i32, "{what}: shared id");
            for r in 0..top {
                let (got, want) = (weights[t * slots + r] as f64, p[r] / chosen);
                assert!(
                    (got - want).abs() <= 1e-5 * want.max(1e-3),
                    "{what}: weight {r}: {got} vs {want}"
                );
            }
            let gate = 1.0 / (1.0 + (-row[experts]).exp());
            let got = weights[t * slots + top] as f64;
            assert!(
                (got - gate).abs() <= 1e-6,
                "{what}: shared weight {got} vs {gate}"
            );
        }
    }
}

/// The router's top-k in the last block of its GEMV (`then_topk`, decode with LILY_FUSED_TOPK=1)
/// picks the same experts as the top-k kernel on the same logits, with the same weights to a few
/// ulps (the GEMV keeps the top-k's older form, which divides by the full softmax sum first;
/// moe.cuh): the router's shape (256 experts + the shared gate, Q8), 1, 3 and 8 tokens, three launches
/// in a row (each must leave its counter at zero for the next), and a 16-expert router.
#[test]
fn router_gemv_with_fused_topk_equals_the_topk_kernel() {
    let dev = device();
    let (k, moe) = (
        GemvKernels::load(&dev).unwrap(),
        MoeKernels::load(&dev).unwrap(),
    );
    let s = dev.stream();
    let mut rng = Rng::new("fused topk");
    let mut counter = upload(s, &[0u32]);
    for (experts, cols) in [(256usize, 2048usize), (16, 512)] {
        let m = DeviceMatrices::upload(s, &HostMatrices::random(&mut rng, 8, 1, experts + 1, cols));
        for ntok in [1usize, 3, 8, 1, 1] {
            if ntok > k.max_tokens(&m.view()) {
                continue;
            }
            let slots = 8 + 1;
            let x = upload(s, &rng.bf16s(ntok * cols, 1.0));
            let mut logits = poisoned(s, ntok * (experts + 1));
            let (mut ids, mut weights) = (
                upload(s, &vec![-1i32; ntok * slots]),
                upload(s, &vec![-1.0f32; ntok * slots]),
            );
            k.then_topk(FusedTopK::new(
                experts,
                8,
                &mut ids.as_view_mut(),
                &mut weights.as_view_mut(),
                &mut counter.as_view_mut(),
                s,
            ));
            k.gemv(&m.view(), &x.as_view(), &mut logits.as_view_mut())
                .unwrap();
            let (mut want_ids, mut want_weights) = (
                upload(s, &vec![-2i32; ntok * slots]),
                upload(s, &vec![-2.0f32; ntok * slots]),
            );
            moe.router_topk(
                &logits.as_view(),
                experts + 1,
                experts,
                8,
                true,
                &mut want_ids.as_view_mut(),
                &mut want_weights.as_view_mut(),
            )
            .unwrap();
            let what = format!("{experts} experts, {ntok} tokens");
            // The same logits rows at a wider pitch (cuBLAS's padded output in long passes), the
            // padding values large enough to win if they were read: the same choice, same bits.
            let pitch = (experts + 1).next_multiple_of(8) + 8;
            let mut rows = vec![bf16::from_f32(100.0); ntok * pitch];
            for (t, row) in download(s, &logits).chunks(experts + 1).enumerate() {
                rows[t * pitch..t * pitch + experts + 1].copy_from_slice(row);
            }
            let pitched = upload(s, &rows);
            let (mut p_ids, mut p_weights) = (
                upload(s, &vec![-3i32; ntok * slots]),
                upload(s, &vec![-3.0f32; ntok * slots]),
            );
            moe.router_topk(
                &pitched.as_view(),
                pitch,
                experts,
                8,
                true,
                &mut p_ids.as_view_mut(),
                &mut p_weights.as_view_mut(),
            )
            .unwrap();
            assert_eq!(
                download(s, &p_ids),
                download(s, &want_ids),
                "{what}: ids at pitch {pitch}"
            );
            assert_eq!(
                download(s, &p_weights)
                    .iter()
                    .map(|x| x.to_bits())
                    .collect::<Vec<_>>(),
                download(s, &want_weights)
                    .iter()
                    .map(|x| x.to_bits())
                    .collect::<Vec<_>>(),
                "{what}: weights at pitch {pitch}"
            );
            assert_eq!(download(s, &ids), download(s, &want_ids), "{what}: ids");
            for (i, (got, want)) in download(s, &weights)
                .into_iter()
                .zip(download(s, &want_weights))
                .enumerate()
            {
                assert!(
                    (got - want).abs() <= 4e-7 * want.abs(),
                    "{what}: weight {i}: {got} against {want}"
                );
            }
            assert_eq!(
                download(s, &counter),
                vec![0u32],
                "{what}: the counter is left at zero"
            );
        }
    }
}

#[test]
fn gemv_rejects_bad_shapes() {
    let dev = device();
    let k = GemvKernels::load(&dev).unwrap();
    let s = dev.stream();
    let mut rng = Rng::new("gemv shapes");
    let h = HostMatrices::random(&mut rng, 4, 1, 64, 2048);
    let m = DeviceMatrices::upload(s, &h);
    let x = upload(s, &rng.bf16s(9 * 2048, 1.0));
    let mut y = poisoned(s, 9 * 64);
    // 9 tokens: more than one launch takes.
    assert!(matches!(
        k.gemv(&m.view(), &x.as_view(), &mut y.as_view_mut()),
        Err(CudaError::Shape(_))
    ));
    // x not a whole number of rows.
    assert!(matches!(
        k.gemv(&m.view(), &x.slice(..2047), &mut y.as_view_mut()),
        Err(CudaError::Shape(_))
    ));
    // A misaligned view.
    let mut y1 = poisoned(s, 64);
    assert!(matches!(
        k.gemv(&m.view(), &x.slice(1..2049), &mut y1.as_view_mut()),
        Err(CudaError::Shape(_))
    ));
}

// ---------------------------------------------------------------------------------------------
// GEMV timing: printed, not asserted.

/// Median milliseconds per launch of `launch`, run `reps` times between two events, 5 samples.
fn time_ms(dev: &CudaDevice, reps: usize, launch: &mut dyn FnMut(usize)) -> f64 {
    let s = dev.stream();
    let ev = || {
        dev.context()
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .unwrap()
    };
    let (start, end) = (ev(), ev());
    for i in 0..reps {
        launch(i); // warm-up
    }
    let mut samples: Vec<f64> = (0..5)
        .map(|_| {
            start.record(s).unwrap();
            for i in 0..reps {
                launch(i);
            }
            end.record(s).unwrap();
            start.elapsed_ms(&end).unwrap() as f64 / reps as f64
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    samples[2]
}

/// A batched pass's experts as gathered slots (gate‖up then down, 257 Q4 experts of the real
/// shapes, random routing) at the default and 1, 2, 4 and 8 blocks per slot: µs per pair of launches, and the
/// touched experts' bytes per second. 64 rows (≈ 220 experts touched) and 8 (≈ 57), where the
/// per-(row, expert) slots of `SlotInput::PerGroup` are timed too (72 slots, each expert read
/// once per row that chose it).
#[test]
fn gemv_gathered_timing() {
    let dev = device();
    let (mut k, moe) = (
        GemvKernels::load(&dev).unwrap(),
        MoeKernels::load(&dev).unwrap(),
    );
    let s = dev.stream();
    let mut rng = Rng::new("gemv gathered timing");
    let (experts, top_k) = (256, 8);
    let per_token = top_k + 1;
    let stack = |rng: &mut Rng, rows: usize, cols: usize| {
        let one = HostMatrices::random(rng, 4, 1, rows, cols);
        let m = HostMatrices {
            count: experts + 1,
            packed: one.packed.repeat(experts + 1),
            scales: one.scales.repeat(experts + 1),
            biases: one.biases.repeat(experts + 1),
            dense: Vec::new(),
            ..one
        };
        DeviceMatrices::upload(s, &m)
    };
    let (gate_up, down) = (stack(&mut rng, 1024, 2048), stack(&mut rng, 2048, 512));
    for t in [64, 8] {
        let slots = max_gathered_slots(t, per_token, experts + 1);
        // Four routings, launches cycling through them.
        let (mut tables, mut id_sets) = (Vec::new(), Vec::new());
        let mut touched = 0usize;
        for _ in 0..4 {
            let mut ids = Vec::new();
            for _ in 0..t {
                let mut chosen: Vec<i32> = Vec::new();
                while chosen.len() < top_k {
                    let e = rng.below(experts) as i32;
                    if !chosen.contains(&e) {
                        chosen.push(e);
                    }
                }
                chosen.push(experts as i32);
                ids.extend(chosen);
            }
            let mut distinct = ids.clone();
            distinct.sort();
            distinct.dedup();
            touched += distinct.len();
            let dids = upload(s, &ids);
            let mut table = upload(s, &vec![0i32; slots * SLOT_WORDS]);
            moe.slot_table(
                &dids.as_view(),
                per_token,
                experts + 1,
                &mut table.as_view_mut(),
            )
            .unwrap();
            tables.push(table);
            id_sets.push(dids);
        }
        let expert_bytes = (gate_up.matrix_bytes() + down.matrix_bytes()) as f64;
        let bytes = touched as f64 / 4.0 * expert_bytes;
        let x = upload(s, &rng.bf16s(t * 2048, 1.0));
        let mut gu = s.alloc_zeros::<bf16>(t * per_token * 1024).unwrap();
        let mut y = s.alloc_zeros::<bf16>(t * per_token * 2048).unwrap();
        println!(
            "\n{t} rows, ≈{:.0} experts touched, {:.0} MB per pass",
            touched as f64 / 4.0,
            bytes / 1e6
        );
        for blocks in [0, 1, 2, 4, 8] {
            k.set_gathered_blocks(blocks);
            let ms = time_ms(&dev, 8, &mut |i| {
                let table = tables[i % 4].as_view();
                k.gemv_gathered(
                    &gate_up.view(),
                    &table,
                    slots,
                    &x.as_view(),
                    false,
                    &mut gu.as_view_mut(),
                )
                .unwrap();
                k.gemv_gathered(
                    &down.view(),
                    &table,
                    slots,
                    &gu.as_view(),
                    true,
                    &mut y.as_view_mut(),
                )
                .unwrap();
            });
            println!(
                "gathered, {} blocks per slot: {:.1} µs per gate‖up + down, {:.0} GB/s",
                if blocks == 0 {
                    "default".to_string()
                } else {
                    blocks.to_string()
                },
                ms * 1e3,
                bytes / (ms * 1e-3) / 1e9
            );
        }
        if t <= MAX_TOKENS {
            let pairs = t * per_token;
            let ms = time_ms(&dev, 8, &mut |i| {
                let ids = id_sets[i % 4].as_view();
                k.gemv_slots(
                    &gate_up.view(),
                    Some(&ids),
                    pairs,
                    &x.as_view(),
                    SlotInput::PerGroup(per_token),
                    1,
                    &mut gu.as_view_mut(),
                )
                .unwrap();
                k.gemv_slots(
                    &down.view(),
                    Some(&ids),
                    pairs,
                    &gu.as_view(),
                    SlotInput::PerSlotSwiGlu,
                    1,
                    &mut y.as_view_mut(),
                )
                .unwrap();
            });
            println!(
                "per (row, expert) slot: {:.1} µs per gate‖up + down, {:.0} GB/s of {:.0} MB read",
                ms * 1e3,
                pairs as f64 * expert_bytes / (ms * 1e-3) / 1e9,
                pairs as f64 * expert_bytes / 1e6
            );
        }
    }
}

/// The same launches captured once into a CUDA graph and replayed (how decode will run them):
/// median milliseconds per launch.
fn time_graph_ms(dev: &CudaDevice, reps: usize, launch: &mut dyn FnMut(usize)) -> f64 {
    let s = dev.stream();
    s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    for i in 0..reps {
        launch(i);
    }
    let graph = s
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("captured graph");
    time_ms(dev, 1, &mut |_| graph.launch().unwrap()) / reps as f64
}

#[test]
fn gemv_bandwidth() {
    let dev = device();
    let k = GemvKernels::load(&dev).unwrap();
    let s = dev.stream();
    let mut rng = Rng::new("gemv bandwidth");
    // The ceiling: a 1 GiB device-to-device copy (bytes read + written).
    {
        let n = 1 << 29;
        let src = s.alloc_zeros::<u16>(n).unwrap();
        let mut dst = s.alloc_zeros::<u16>(n).unwrap();
        let ms = time_ms(&dev, 4, &mut |_| s.memcpy_dtod(&src, &mut dst).unwrap());
        println!(
            "device-to-device copy: {:.0} GB/s (read + written)",
            4.0 * n as f64 / (ms * 1e-3) / 1e9
        );
    }
    // Each case cycles through enough different weights (≥ 300 MB, most ≥ 500 MB, against a
    // 60 MB L2) that launches read their weights from HBM. (bits, matrices in the stack, rows,
    // cols, slots, tokens).
    let cases: &[(&str, u32, usize, usize, usize, usize, usize)] = &[
        ("Q4 in_proj_qkv / q_proj", 4, 56, 8192, 2048, 1, 1),
        ("Q4 out_proj / o_proj", 4, 112, 2048, 4096, 1, 1),
        ("Q4 8 experts gate_up", 4, 256, 1024, 2048, 8, 1),
        ("Q4 8 experts down", 4, 512, 2048, 512, 8, 1),
        ("Q4 lm_head", 4, 2, 248_320, 2048, 1, 1),
        ("Q4 lm_head, 8 tokens", 4, 2, 248_320, 2048, 1, 8),
        ("Q8 router", 8, 512, 256, 2048, 1, 1),
        ("bf16 [8192×2048]", 16, 16, 8192, 2048, 1, 1),
    ];
    println!(
        "\n{:<24} {:>9} {:>11} {:>10} {:>7} {:>10} {:>7}   best other shape (graph)",
        "GEMV", "MB/launch", "shape", "µs stream", "GB/s", "µs graph", "GB/s"
    );
    for &(name, bits, count, rows, cols, slots, ntok) in cases {
        // One random matrix, copied to fill the stack (the copies sit at different addresses,
        // which is all the timing needs).
        let one = HostMatrices::random(&mut rng, bits, 1, rows, cols);
        let stack = HostMatrices {
            count,
            packed: one.packed.repeat(count),
            scales: one.scales.repeat(count),
            biases: one.biases.repeat(count),
            dense: one.dense.repeat(count),
            ..one
        };
        let m = DeviceMatrices::upload(s, &stack);
        drop(stack);
        let x_per_slot = name.contains("down");
        let xs = upload(
            s,
            &rng.bf16s(if x_per_slot { slots } else { 1 } * ntok * cols, 1.0),
        );
        let mut y = poisoned(s, slots * ntok * rows);
        // Launch i uses matrices (i·slots .. i·slots + slots) mod count: distinct until the stack wraps.
        let ids = upload(
            s,
            &(0..count * slots)
                .map(|i| (i % count) as i32)
                .collect::<Vec<_>>(),
        );
        let sets = count.div_ceil(slots);
        let reps = sets.max(32);
        let bytes = (slots * m.matrix_bytes() + 2 * slots * ntok * (cols + rows)) as f64;
        let gbs = |ms: f64| bytes / (ms * 1e-3) / 1e9;
        let view = m.view();
        // Times one launch shape (stream, graph); None if the kernel does not take it.
        let mut time = |shape: GemvShape| -> Option<(f64, f64)> {
            let mut launch = |i: usize| {
                let set = (i % sets) * slots;
                if slots == 1 {
                    k.gemv_slots_shaped(
                        &sub_matrix(&m, set),
                        None,
                        1,
                        &xs.as_view(),
                        SlotInput::Shared,
                        ntok,
                        &mut y.as_view_mut(),
                        shape,
                    )
                } else {
                    let id = ids.slice(set..set + slots);
                    k.gemv_slots_shaped(
                        &view,
                        Some(&id),
                        slots,
                        &xs.as_view(),
                        if x_per_slot {
                            SlotInput::PerSlot
                        } else {
                            SlotInput::Shared
                        },
                        ntok,
                        &mut y.as_view_mut(),
                        shape,
                    )
                }
            };
            launch(0).ok()?;
            let mut launch = |i: usize| launch(i).unwrap();
            Some((
                time_ms(&dev, reps, &mut launch),
                time_graph_ms(&dev, reps, &mut launch),
            ))
        };
        let default = k.shape(&view, slots);
        let (t_stream, t_graph) = time(default).expect("the default shape launches");
        // Other launch shapes, to tune the default by: K-split halved or doubled, 1..8 tiles a block.
        let mut best: Option<(GemvShape, f64)> = None;
        for kw in [
            default.warps_per_tile / 2,
            default.warps_per_tile,
            default.warps_per_tile * 2,
        ] {
            for tb in [1, 2, 4, 8] {
                let shape = GemvShape {
                    warps_per_tile: kw,
                    tiles_per_block: tb,
                };
                if kw == 0 || shape == default {
                    continue;
                }
                if let Some((_, t)) = time(shape) {
                    if best.is_none_or(|(_, b)| t < b) {
                        best = Some((shape, t));
                    }
                }
            }
        }
        let shape_str = |s: GemvShape| format!("{}k×{}t", s.warps_per_tile, s.tiles_per_block);
        let other = best.map_or(String::new(), |(sh, t)| {
            format!("{} {:.2} µs {:.0} GB/s", shape_str(sh), t * 1e3, gbs(t))
        });
        println!(
            "{name:<24} {:>9.2} {:>11} {:>10.2} {:>7.0} {:>10.2} {:>7.0}   {other}",
            bytes / 1e6,
            shape_str(default),
            t_stream * 1e3,
            gbs(t_stream),
            t_graph * 1e3,
            gbs(t_graph)
        );
    }
    println!("(MB/launch: weights, scales and biases read, plus x and y. shape: warps per tile along K × tiles per block.)\n");
}

/// Matrix `i` of a device stack, as a stack of one.
fn sub_matrix(m: &DeviceMatrices, i: usize) -> Matrices<'_> {
    let (rows, cols) = (m.rows, m.cols);
    let n = rows * cols;
    let data = match &m.dense {
        Some(d) => WeightData::Bf16(d.slice(i * n..(i + 1) * n)),
        None => {
            let words = n * m.bits as usize / 32;
            let groups = n / GROUP;
            WeightData::Affine {
                bits: m.bits,
                packed: m.packed.as_ref().unwrap().slice(i * words..(i + 1) * words),
                scales: m
                    .scales
                    .as_ref()
                    .unwrap()
                    .slice(i * groups..(i + 1) * groups),
                biases: m
                    .biases
                    .as_ref()
                    .unwrap()
                    .slice(i * groups..(i + 1) * groups),
            }
        }
    };
    Matrices {
        data,
        count: 1,
        rows,
        cols,
    }
}
