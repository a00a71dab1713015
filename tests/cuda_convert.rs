//! Weights the kernels cannot read, converted at upload (src/model/convert.rs), on the GPU
//! against the CPU reference (run on the H200 by scripts/gpu-check.sh).
//!
//! A synthetic model with the real head shapes (as tests/cuda_forward.rs) has every matrix
//! re-encoded as GGUF Q8_0 blocks. `CudaModel::upload` requantises them to affine Q8 g64; the CPU
//! runs `convert::weights_for_kernels` of the same weights, i.e. the very values the GPU got, so
//! the two differ only by the GPU's bf16 activations (the bound of tests/cuda_forward.rs).
#![cfg(feature = "cuda")]

mod common;

use common::{map_matrices, matrix_values};
use half::f16;
use lily::checkpoint::tensor::{Bytes, DType};
use lily::checkpoint::{self, synth};
use lily::cuda::forward::{CudaBackend, CudaOptions};
use lily::cuda::model::CudaModel;
use lily::cuda::CudaDevice;
use lily::ggml::GgmlType;
use lily::model::convert;
use lily::model::weights::{Matrix, WeightFormat};
use lily::model::{Backend, CpuBackend};
use rand::RngExt;

/// As tests/cuda_forward.rs: measured 1.6–3.6e-2 for bf16 activations over 4 random layers.
const TOLERANCE: f32 = 8e-2;

fn config() -> serde_json::Value {
    common::real_shaped_config([
        "linear_attention",
        "linear_attention",
        "linear_attention",
        "full_attention",
    ])
}

/// `m` as ggml Q8_0 blocks: `{f16 d; i8 q[32]}` with `d = max|w| / 127`.
fn q8_0(m: &Matrix) -> Matrix {
    let mut data = Vec::new();
    for block in matrix_values(m).chunks_exact(32) {
        let d = f16::from_f32(block.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0);
        data.extend(d.to_le_bytes());
        let inv = if d.to_f32() == 0.0 {
            0.0
        } else {
            1.0 / d.to_f32()
        };
        data.extend(
            block
                .iter()
                .map(|v| (v * inv).round().clamp(-127.0, 127.0) as i8 as u8),
        );
    }
    Matrix {
        rows: m.rows,
        cols: m.cols,
        format: WeightFormat::Ggml(GgmlType::Q8_0),
        data: Bytes::from_vec(data),
        scales: None,
        biases: None,
        scale_dtype: DType::BF16,
    }
}

fn rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

#[test]
fn q8_0_weights_convert_at_upload_and_match_cpu() {
    let dir = tempfile::tempdir().unwrap();
    synth::write_checkpoint(
        &config(),
        dir.path(),
        5,
        DType::BF16,
        synth::SHARD_BYTES,
        false,
    )
    .unwrap();
    let mut weights = checkpoint::load(dir.path()).unwrap();
    map_matrices(&mut weights, |m| *m = q8_0(m));
    let (converted, report) = convert::weights_for_kernels(&weights);
    println!("{:?}", report.lines());
    let mut cpu = CpuBackend::new(converted);
    let dev = CudaDevice::new(0)
        .expect("a CUDA GPU (these tests run on the H200 through scripts/gpu-check.sh)");
    let model = CudaModel::upload(&dev, &weights).unwrap();
    let options = CudaOptions {
        max_sequences: 3,
        max_context: 4096,
        ..CudaOptions::default()
    };
    let mut gpu = CudaBackend::new(dev, model, options).unwrap();
    let mut rng = rand::rng();
    for (seq, n) in [1usize, 9, 300].into_iter().enumerate() {
        let p: Vec<u32> = (0..n).map(|_| rng.random_range(0..2000)).collect();
        cpu.create_sequence(seq as u64).unwrap();
        gpu.create_sequence(seq as u64).unwrap();
        let c = cpu.forward(seq as u64, &p).unwrap();
        let g = gpu.forward(seq as u64, &p).unwrap();
        let err = rel(&g, &c);
        println!("prompt of {n}: logits rel. error {err:.2e}");
        assert!(
            err <= TOLERANCE,
            "prompt of {n}: logits differ by {err:.2e}"
        );
    }
}
