//! Helpers of the prefill GEMM and grouped-MoE tests (tests/cuda_gemm_prefill.rs,
//! tests/cuda_moe.rs): random weights in lily's formats, device buffers with poisoned guard zones,
//! element-wise checks with stated tolerances, CUDA-event timing.
#![allow(dead_code)]

use std::sync::Arc;

use half::bf16;
use lily::checkpoint::tensor::{Bytes, DType};
use lily::cuda::{CudaDevice, CudaSlice, CudaStream, CudaView, CudaViewMut};
use lily::model::weights::{Matrix, WeightFormat};
use lily::quant::{quantize, Affine};
use rand::rngs::SmallRng;
use rand::{Rng, RngExt, SeedableRng};

pub fn device() -> CudaDevice {
    CudaDevice::new(0)
        .unwrap_or_else(|e| panic!("the prefill GEMM / MoE tests need an sm_90 GPU: {e}"))
}

/// A fresh seed each run, printed; LILY_TEST_SEED repeats one.
pub fn rng(test: &str) -> SmallRng {
    let seed = std::env::var("LILY_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    println!("{test}: seed {seed} (LILY_TEST_SEED={seed} repeats it)");
    SmallRng::seed_from_u64(seed)
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind {
    Q4,
    Q8,
    Bf16,
}

/// A `[rows][cols]` matrix of values uniform in ±`amp`, stored as `kind`: bf16, or quantised by
/// lily's MLX-exact quantiser (group 64, bf16 scales and biases).
pub fn matrix(rng: &mut SmallRng, kind: Kind, rows: usize, cols: usize, amp: f32) -> Matrix {
    let values: Vec<f32> = (0..rows * cols)
        .map(|_| rng.random_range(-amp..amp))
        .collect();
    from_values(kind, rows, cols, &values)
}

pub fn from_values(kind: Kind, rows: usize, cols: usize, values: &[f32]) -> Matrix {
    let bits = match kind {
        Kind::Q4 => 4,
        Kind::Q8 => 8,
        Kind::Bf16 => {
            let bytes: Vec<u8> = values
                .iter()
                .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
                .collect();
            return Matrix::dense(rows, cols, DType::BF16, Bytes::from_vec(bytes));
        }
    };
    let q = quantize(values, cols, Affine::new(bits, 64).unwrap(), DType::BF16).unwrap();
    affine(bits, rows, cols, q.packed, q.scales, q.biases)
}

/// A `[rows][cols]` affine matrix of random codes with random per-group scales (either sign, as
/// MLX makes them) and biases centring the codes: fast to make for whole expert stacks.
/// Weights come out within about ±0.03.
pub fn random_codes(rng: &mut SmallRng, bits: u32, rows: usize, cols: usize) -> Matrix {
    let mut packed = vec![0u8; rows * cols * bits as usize / 8];
    rng.fill_bytes(&mut packed);
    let groups = rows * cols / 64;
    let max_code = ((1u32 << bits) - 1) as f32;
    let (mut scales, mut biases) = (
        Vec::with_capacity(2 * groups),
        Vec::with_capacity(2 * groups),
    );
    for _ in 0..groups {
        let s = rng.random_range(0.02f32..0.06) / max_code
            * if rng.random::<bool>() { 1.0 } else { -1.0 };
        let b = -s * max_code / 2.0 + rng.random_range(-0.005f32..0.005);
        scales.extend(bf16::from_f32(s).to_le_bytes());
        biases.extend(bf16::from_f32(b).to_le_bytes());
    }
    affine(bits, rows, cols, packed, scales, biases)
}

fn affine(
    bits: u32,
    rows: usize,
    cols: usize,
    packed: Vec<u8>,
    scales: Vec<u8>,
    biases: Vec<u8>,
) -> Matrix {
    Matrix {
        rows,
        cols,
        format: WeightFormat::Affine {
            bits,
            group_size: 64,
        },
        data: Bytes::from_vec(packed),
        scales: Some(Bytes::from_vec(scales)),
        biases: Some(Bytes::from_vec(biases)),
        scale_dtype: DType::BF16,
    }
}

/// Σ_c W[r][c]² of every row (dequantised), for the tolerance scale.
pub fn row_sq(m: &Matrix) -> Vec<f32> {
    let mut row = vec![0f32; m.cols];
    (0..m.rows)
        .map(|r| {
            m.row_into(r, &mut row);
            row.iter().map(|v| v * v).sum()
        })
        .collect()
}

/// bf16 values uniform in ±amp and their f32 copies.
pub fn activations(rng: &mut SmallRng, n: usize, amp: f32) -> (Vec<bf16>, Vec<f32>) {
    let b: Vec<bf16> = (0..n)
        .map(|_| bf16::from_f32(rng.random_range(-amp..amp)))
        .collect();
    let f = b.iter().map(|v| v.to_f32()).collect();
    (b, f)
}

pub fn upload<T: cudarc::driver::DeviceRepr>(s: &Arc<CudaStream>, v: &[T]) -> CudaSlice<T> {
    s.clone_htod(v).expect("upload")
}

pub fn download<T: cudarc::driver::DeviceRepr>(s: &Arc<CudaStream>, v: &CudaView<T>) -> Vec<T> {
    let out = s.clone_dtoh(v).expect("download");
    s.synchronize().expect("stream");
    out
}

/// A NaN no kernel writes: outputs are poisoned with it before a launch.
pub const POISON: u16 = 0x7FA5;
/// Guard values on each side of an output (16 keeps the payload 16-byte aligned).
pub const GUARD: usize = 16;

/// An output of `n` bf16 values between two guard zones, all poisoned.
pub struct Output {
    buf: CudaSlice<bf16>,
    n: usize,
}

impl Output {
    pub fn new(s: &Arc<CudaStream>, n: usize) -> Self {
        Output {
            buf: upload(s, &vec![bf16::from_bits(POISON); n + 2 * GUARD]),
            n,
        }
    }
    pub fn view(&mut self) -> CudaViewMut<'_, bf16> {
        self.buf.slice_mut(GUARD..GUARD + self.n)
    }
    pub fn as_view(&self) -> CudaView<'_, bf16> {
        self.buf.slice(GUARD..GUARD + self.n)
    }
    pub fn repoison(&mut self, s: &Arc<CudaStream>) {
        s.memcpy_htod(
            &vec![bf16::from_bits(POISON); self.n + 2 * GUARD],
            &mut self.buf,
        )
        .expect("poison");
    }
    /// The payload; panics if a guard value changed or a payload value is not finite (never written,
    /// or written as NaN/inf).
    pub fn get(&self, s: &Arc<CudaStream>, what: &str) -> Vec<bf16> {
        let all = download(s, &self.buf.as_view());
        for (i, v) in all[..GUARD]
            .iter()
            .chain(&all[GUARD + self.n..])
            .enumerate()
        {
            assert_eq!(
                v.to_bits(),
                POISON,
                "{what}: guard value {i} was overwritten"
            );
        }
        let out = all[GUARD..GUARD + self.n].to_vec();
        if let Some(i) = out.iter().position(|v| !v.to_f32().is_finite()) {
            panic!(
                "{what}: element {i} of {} is {:?} (bits {:#06x}): not written or not finite",
                self.n,
                out[i].to_f32(),
                out[i].to_bits()
            );
        }
        out
    }
}

/// Per element `|got − want| ≤ rel·|want| + abs·scale(i)`, and the mean of `|got − want| / scale`
/// at most `mean_abs` — the mean only over at least 64 values, where roundings average out (an
/// H200 run had 17 outputs of one row at a mean of 2.12e-3 against 2e-3). Prints the worst error
/// in units of scale; returns it.
pub fn check(
    what: &str,
    got: &[bf16],
    want: &[f32],
    scale: &dyn Fn(usize) -> f32,
    rel: f32,
    abs: f32,
    mean_abs: f32,
) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let (mut worst, mut worst_i, mut sum) = (0f32, 0usize, 0f64);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let (g, sc) = (g.to_f32(), scale(i).max(1e-30));
        let err = (g - w).abs();
        assert!(
            err <= rel * w.abs() + abs * sc,
            "{what}: element {i}: got {g}, want {w} (error {err:.3e}, {:.3e} of the scale {sc:.3e})",
            err / sc
        );
        sum += (err / sc) as f64;
        if err / sc > worst {
            worst = err / sc;
            worst_i = i;
        }
    }
    let mean = (sum / got.len().max(1) as f64) as f32;
    println!("{what}: max error {worst:.2e} of scale (element {worst_i}), mean {mean:.2e}");
    assert!(
        got.len() < 64 || mean <= mean_abs,
        "{what}: mean error {mean:.2e} of scale exceeds {mean_abs:e}"
    );
    worst
}

/// Median of `runs` timings (ms) of `body` between two events, after 2 warm-up runs.
pub fn median_ms(dev: &CudaDevice, runs: usize, mut body: impl FnMut()) -> f32 {
    for _ in 0..2 {
        body();
    }
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
