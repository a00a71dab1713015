//! The official FP8 layout (`Qwen/Qwen3.6-35B-A3B-FP8`: F8_E4M3 weights, `weight_scale_inv`
//! tile multipliers, experts stored one module each) on a synthetic checkpoint made here from the
//! tiny-a fixture with 16×16 tiles (the real release has 128×128; 16 makes several tiles and
//! partial ones at this size). Its expected weights are computed exactly from the e4m3 definition.

mod common;

use std::path::Path;

use common::{fixture_dir, matrix_values, rel_rms};
use lily::checkpoint::safetensors::{open_file, write_file};
use lily::checkpoint::tensor::DType;
use lily::checkpoint::{self, CheckpointError};
use lily::model::convert;
use lily::model::cpu::{forward, Logits};
use lily::model::weights::{WeightFormat, Weights};
use lily::model::SequenceState;
use rand::RngExt;

const BLOCK: usize = 16;

/// The value of e4m3 byte `b` from the format's definition (sign, 4-bit exponent with bias 7,
/// 3-bit mantissa, subnormals at exponent 0), in f64; `None` for NaN.
fn e4m3(b: u8) -> Option<f64> {
    let (e, m) = ((b >> 3) & 15, (b & 7) as f64);
    if e == 15 && b & 7 == 7 {
        return None;
    }
    let v = if e == 0 {
        m / 8.0 * 2f64.powi(-6)
    } else {
        (1.0 + m / 8.0) * 2f64.powi(e as i32 - 7)
    };
    Some(if b & 0x80 != 0 { -v } else { v })
}

/// `values` (`[rows, cols]`) as e4m3 codes and bf16 tile multipliers, and the exact values
/// those stand for.
fn quantize_fp8(values: &[f32], rows: usize, cols: usize) -> (Vec<u8>, Vec<u8>, Vec<f32>) {
    let codes_by_value: Vec<(f64, u8)> = (0..=255u8)
        .filter_map(|b| e4m3(b).map(|v| (v, b)))
        .collect();
    let tiles = cols.div_ceil(BLOCK);
    let mut scales = vec![0f32; rows.div_ceil(BLOCK) * tiles];
    for (i, s) in scales.iter_mut().enumerate() {
        let (tr, tc) = (i / tiles, i % tiles);
        let mut amax = 0f32;
        for r in tr * BLOCK..((tr + 1) * BLOCK).min(rows) {
            for c in tc * BLOCK..((tc + 1) * BLOCK).min(cols) {
                amax = amax.max(values[r * cols + c].abs());
            }
        }
        *s = half::bf16::from_f32((amax / 448.0).max(1e-12)).to_f32();
    }
    let mut codes = Vec::with_capacity(values.len());
    let mut exact = Vec::with_capacity(values.len());
    for (i, &v) in values.iter().enumerate() {
        let s = scales[(i / cols) / BLOCK * tiles + (i % cols) / BLOCK];
        let target = (v / s) as f64;
        let &(q, code) = codes_by_value
            .iter()
            .min_by(|a, b| (a.0 - target).abs().total_cmp(&(b.0 - target).abs()))
            .unwrap();
        codes.push(code);
        // At most 4 × 8 significant bits: exact in f32.
        exact.push((q * s as f64) as f32);
    }
    let scale_bytes = scales
        .iter()
        .flat_map(|&s| half::bf16::from_f32(s).to_le_bytes())
        .collect();
    (codes, scale_bytes, exact)
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}
fn bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

type Tensors = Vec<(String, DType, Vec<usize>, Vec<u8>)>;

/// Writes the FP8 checkpoint of tiny-a to `fp8` and, to `exact`, tiny-a with the FP8 matrices'
/// exact values in f32 (the original layout).
fn write_checkpoints(fp8: &Path, exact: &Path) {
    let src = fixture_dir("tiny-a");
    let mut quantized: Tensors = Vec::new();
    let mut plain: Tensors = Vec::new();
    let push_fp8 = |quantized: &mut Tensors, name: String, values: &[f32], rows, cols| {
        let (codes, scales, exact) = quantize_fp8(values, rows, cols);
        quantized.push((name.clone(), DType::F8E4M3, vec![rows, cols], codes));
        let s = vec![rows.div_ceil(BLOCK), cols.div_ceil(BLOCK)];
        quantized.push((format!("{name}_scale_inv"), DType::BF16, s, scales));
        exact
    };
    for (name, t) in open_file(&src.join("model.safetensors")).unwrap() {
        assert_eq!(t.dtype, DType::F32);
        let values = f32s(t.data.as_slice());
        let shape = t.shape.clone();
        let linear = [
            "q_proj.",
            "k_proj.",
            "v_proj.",
            "o_proj.",
            "in_proj_qkv.",
            "in_proj_z.",
            "out_proj.",
            "shared_expert.gate_proj.",
            "shared_expert.up_proj.",
            "shared_expert.down_proj.",
        ]
        .iter()
        .any(|p| name.contains(p));
        let out = if linear {
            push_fp8(&mut quantized, name.clone(), &values, shape[0], shape[1])
        } else if name.ends_with("experts.gate_up_proj") || name.ends_with("experts.down_proj") {
            let (e, rows, cols) = (shape[0], shape[1], shape[2]);
            let prefix = name
                .trim_end_matches("gate_up_proj")
                .trim_end_matches("down_proj");
            let per = rows * cols;
            let mut out = Vec::new();
            for x in 0..e {
                let w = &values[x * per..(x + 1) * per];
                if name.ends_with("down_proj") {
                    out.extend(push_fp8(
                        &mut quantized,
                        format!("{prefix}{x}.down_proj.weight"),
                        w,
                        rows,
                        cols,
                    ));
                } else {
                    let half = per / 2;
                    out.extend(push_fp8(
                        &mut quantized,
                        format!("{prefix}{x}.gate_proj.weight"),
                        &w[..half],
                        rows / 2,
                        cols,
                    ));
                    out.extend(push_fp8(
                        &mut quantized,
                        format!("{prefix}{x}.up_proj.weight"),
                        &w[half..],
                        rows / 2,
                        cols,
                    ));
                }
            }
            out
        } else {
            quantized.push((
                name.clone(),
                DType::F32,
                shape.clone(),
                t.data.as_slice().to_vec(),
            ));
            values
        };
        plain.push((name, DType::F32, shape, bytes(&out)));
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    for dir in [fp8, exact] {
        std::fs::create_dir_all(dir).unwrap();
    }
    std::fs::write(exact.join("config.json"), config.to_string()).unwrap();
    write_file(&exact.join("model.safetensors"), &plain).unwrap();
    config["quantization_config"] = serde_json::json!({
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
        "modules_to_not_convert": ["lm_head", "model.language_model.embed_tokens"]
    });
    std::fs::write(fp8.join("config.json"), config.to_string()).unwrap();
    write_file(&fp8.join("model.safetensors"), &quantized).unwrap();
}

fn logits(w: &Weights, ids: &[u32]) -> Vec<f32> {
    forward(w, ids, &mut SequenceState::new(&w.config), Logits::All)
}

#[test]
fn fp8_checkpoint_dequantises_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let (fp8_dir, exact_dir) = (dir.path().join("fp8"), dir.path().join("exact"));
    write_checkpoints(&fp8_dir, &exact_dir);
    let fp8 = checkpoint::load(&fp8_dir).unwrap();
    let exact = checkpoint::load(&exact_dir).unwrap();
    let mut fp8_matrices = 0;
    for ((name, g), (_, w)) in fp8.matrices().into_iter().zip(exact.matrices()) {
        if g.format == (WeightFormat::Fp8 { block: BLOCK }) {
            fp8_matrices += 1;
        }
        assert_eq!(matrix_values(g), matrix_values(w), "{name}");
    }
    assert!(fp8_matrices > 100, "{fp8_matrices} FP8 matrices");
    let mut rng = rand::rng();
    for len in [1, 9, 70] {
        let ids: Vec<u32> = (0..len).map(|_| rng.random_range(0..256)).collect();
        assert_eq!(logits(&fp8, &ids), logits(&exact, &ids), "{len} tokens");
    }

    // For the CUDA kernels: FP8 becomes Q8 g64 where the width allows, f32 elsewhere.
    let (converted, report) = convert::weights_for_kernels(&fp8);
    for ((name, c), (_, f)) in converted.matrices().into_iter().zip(fp8.matrices()) {
        assert!(convert::kernel_ready(c), "{name}");
        let err = rel_rms(&matrix_values(c), &matrix_values(f));
        assert!(err < 0.01, "{name}: conversion error {err}");
    }
    let lines = report.lines();
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("fp8 e4m3 16x16 → q8 g64")),
        "{lines:?}"
    );
}

#[test]
fn fp8_without_its_config_or_scales_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let (fp8_dir, exact_dir) = (dir.path().join("fp8"), dir.path().join("exact"));
    write_checkpoints(&fp8_dir, &exact_dir);
    std::fs::copy(exact_dir.join("config.json"), fp8_dir.join("config.json")).unwrap();
    let e = checkpoint::load(&fp8_dir).unwrap_err().to_string();
    assert!(e.contains("F8_E4M3") && e.contains("quant_method"), "{e}");

    write_checkpoints(&fp8_dir, &exact_dir);
    common::rewrite(&fp8_dir.join("model.safetensors"), |ts| {
        ts.retain(|t| {
            !t.0.ends_with("layers.0.linear_attn.in_proj_z.weight_scale_inv")
        })
    });
    match checkpoint::load(&fp8_dir) {
        Err(CheckpointError::Missing { tensor, .. }) => {
            assert!(tensor.ends_with("in_proj_z.weight_scale_inv"), "{tensor}")
        }
        other => panic!("{:?}", other.err()),
    }
}
