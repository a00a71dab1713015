//! The whole model on the GPU against the CPU reference (run on the H200 by scripts/gpu-check.sh).
//!
//! The GPU kernels are built for Qwen3.6-35B-A3B's head shapes, so the model here has exactly
//! those GDN and attention shapes (16/32 heads × 128, 16 query / 2 KV heads × 256) with fewer
//! layers, experts and a narrower hidden size: small enough for the CPU reference, and every
//! kernel of the real model runs. bf16 and Q4 weights; the CPU computes in f32 over the same
//! weights while the GPU keeps bf16 activations, so logits agree to bf16 accuracy and greedy
//! continuations agree up to near-ties (a divergence is accepted only where the CPU's top two
//! logits are within the tolerance).
#![cfg(feature = "cuda")]

mod common;

use lily::checkpoint::{self, synth, tensor::DType};
use lily::cuda::forward::{CudaBackend, CudaOptions};
use lily::cuda::model::CudaModel;
use lily::cuda::CudaDevice;
use lily::model::{argmax, Backend, CpuBackend, Step, StepOutput, Weights};
use lily::sampling::DeviceSampling;

/// Logit error bound relative to the logit range. The GPU rounds activations to bf16 (8 bits of
/// mantissa) after every projection, as the reference implementation does; the CPU keeps f32.
/// Over 4 layers of a random model that is measured at 1.6–3.6e-2 (first H200 run); transformers'
/// own bf16 run of the tiny-c fixture is 4e-2 to 3e-1 away from its f32 run. A wrong kernel gives
/// errors of order 1.
const TOLERANCE: f32 = 8e-2;

/// The fused decode norms (forward/residual.rs) as the environment sets them: gpu-check runs this
/// binary once with the default and once more with `LILY_FUSED_NORMS=1`.
fn fused_norms() -> bool {
    CudaOptions::default().fused_norms
}

fn config() -> serde_json::Value {
    common::real_shaped_config([
        "linear_attention",
        "linear_attention",
        "linear_attention",
        "full_attention",
    ])
}

/// Relative error of the logits: max |a − b| / max |b|.
fn rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn prompt(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed * 97)) % 2000)
        .collect()
}

fn compare(weights: Weights, label: &str, tolerance: f32) {
    let mut cpu = CpuBackend::new(weights.clone());
    let dev = CudaDevice::new(0)
        .expect("a CUDA GPU (these tests run on the H200 through scripts/gpu-check.sh)");
    let model = CudaModel::upload(&dev, &weights).unwrap();
    let options = CudaOptions {
        max_sequences: 2,
        max_context: 4096,
        prefill_chunk: 256,
        cuda_graphs: true,
        batch_steps: false,
        fused_norms: fused_norms(),
        ..CudaOptions::default()
    };
    let mut gpu = CudaBackend::new(dev, model, options).unwrap();

    for (i, n) in [1usize, 7, 64, 300].into_iter().enumerate() {
        let p = prompt(n, i as u32);
        let seq = i as u64;
        cpu.create_sequence(seq).unwrap();
        gpu.create_sequence(seq).unwrap();
        let mut c = cpu.forward(seq, &p).unwrap();
        let mut g = gpu.forward(seq, &p).unwrap();
        let err = rel(&g, &c);
        println!("{label}: prompt {n}: logits rel. error {err:.2e}");
        assert!(
            err <= tolerance,
            "{label}: prompt of {n}: logits differ by {err:.2e} > {tolerance:e}"
        );
        // Greedy continuation, both fed the CPU's choice so the sequences stay comparable.
        let mut agree = 0;
        for step in 0..24 {
            let (tc, tg) = (argmax(&c), argmax(&g));
            if tc == tg {
                agree += 1;
            } else {
                let gap =
                    (c[tc as usize] - c[tg as usize]) / c.iter().fold(0f32, |m, v| m.max(v.abs()));
                println!(
                    "{label}: prompt {n}: step {step}: cpu {tc} vs gpu {tg}, cpu gap {gap:.2e}"
                );
                assert!(
                    gap <= tolerance,
                    "{label}: greedy divergence at step {step} is not a near-tie (gap {gap:.2e})"
                );
            }
            c = cpu.forward(seq, &[tc]).unwrap();
            g = gpu.forward(seq, &[tc]).unwrap();
            let err = rel(&g, &c);
            assert!(
                err <= tolerance,
                "{label}: prompt {n}, decode step {step}: logits differ by {err:.2e}"
            );
        }
        println!("{label}: prompt {n}: greedy agreement {agree}/24");
        // The device-side argmax agrees with the logits it returns.
        cpu.free_sequence(seq);
        gpu.free_sequence(seq);
    }
}

#[test]
fn bf16_model_matches_cpu() {
    let dir = tempfile::tempdir().unwrap();
    synth::write_checkpoint(
        &config(),
        dir.path(),
        3,
        DType::BF16,
        synth::SHARD_BYTES,
        false,
    )
    .unwrap();
    compare(checkpoint::load(dir.path()).unwrap(), "bf16", TOLERANCE);
}

#[test]
fn q4_model_matches_cpu() {
    compare(q4_weights(4), "q4", TOLERANCE);
}

/// Graph replay with the on-device argmax (a) against plain launches returning logits (b).
#[test]
fn greedy_on_device_equals_argmax_of_logits() {
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
    let weights = checkpoint::load(dir.path()).unwrap();
    let dev = CudaDevice::new(0).expect("a CUDA GPU");
    let model = CudaModel::upload(&dev, &weights).unwrap();
    let mut a = CudaBackend::new(
        dev,
        model,
        CudaOptions {
            max_sequences: 1,
            max_context: 512,
            prefill_chunk: 256,
            cuda_graphs: true,
            batch_steps: false,
            fused_norms: fused_norms(),
            ..CudaOptions::default()
        },
    )
    .unwrap();
    let dev = CudaDevice::new(0).unwrap();
    let model = CudaModel::upload(&dev, &weights).unwrap();
    let mut b = CudaBackend::new(
        dev,
        model,
        CudaOptions {
            max_sequences: 1,
            max_context: 512,
            prefill_chunk: 256,
            cuda_graphs: false,
            batch_steps: false,
            fused_norms: fused_norms(),
            ..CudaOptions::default()
        },
    )
    .unwrap();
    a.create_sequence(0).unwrap();
    b.create_sequence(0).unwrap();
    let mut tok = a.forward_greedy(0, &prompt(33, 9)).unwrap();
    let mut logits = b.forward(0, &prompt(33, 9)).unwrap();
    for _ in 0..16 {
        assert_eq!(tok, argmax(&logits));
        logits = b.forward(0, &[tok]).unwrap();
        tok = a.forward_greedy(0, &[tok]).unwrap();
    }
}

/// Prefill chunks of ≥ 512 tokens take the cuBLAS path (src/cuda/dense.rs), the 257-row router
/// with zero rows appended: from kept bf16 copies of the dense matrices (the default) and
/// dequantised per product the logits are the same bit for bit, and within the bound of the CPU's.
/// (1,100 tokens: long enough for attn_prefill_wgmma, attention.rs.)
#[test]
fn long_chunks_through_cublas_match_cpu_with_and_without_kept_copies() {
    let weights = q4_weights(6);
    let p = prompt(1100, 3);
    let logits = |keep: bool| {
        let dev = CudaDevice::new(0).expect("a CUDA GPU");
        let model = CudaModel::upload(&dev, &weights).unwrap();
        let options = CudaOptions {
            max_sequences: 1,
            max_context: 2048,
            prefill_chunk: 2048,
            keep_dense_bf16: keep,
            ..CudaOptions::default()
        };
        let mut gpu = CudaBackend::new(dev, model, options).unwrap();
        gpu.create_sequence(0).unwrap();
        gpu.forward(0, &p).unwrap()
    };
    let (kept, per_product) = (logits(true), logits(false));
    assert!(
        kept.iter()
            .zip(&per_product)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "kept copies change the logits: rel. difference {:.2e}",
        rel(&kept, &per_product)
    );
    let mut cpu = CpuBackend::new(weights);
    cpu.create_sequence(0).unwrap();
    let c = cpu.forward(0, &p).unwrap();
    let err = rel(&kept, &c);
    println!("q4, 1100-token chunk through cuBLAS: logits rel. error {err:.2e}");
    assert!(
        err <= TOLERANCE,
        "logits differ by {err:.2e} > {TOLERANCE:e}"
    );
}

/// A prompt longer than the default chunk (8,192 tokens: the GDN prefill kernels walk 128 chunks of
/// one span, the experts' groupings see ~2K rows each) gives the logits of the same prompt in
/// chunks of 4,096, and of the CPU.
#[test]
fn one_default_chunk_of_8192_tokens_matches_shorter_chunks_and_cpu() {
    let weights = q4_weights(7);
    let p = prompt(8300, 5);
    let logits = |chunk: Option<usize>| {
        let dev = CudaDevice::new(0).expect("a CUDA GPU");
        let model = CudaModel::upload(&dev, &weights).unwrap();
        let defaults = CudaOptions::default();
        let options = CudaOptions {
            max_sequences: 1,
            max_context: 8704,
            prefill_chunk: chunk.unwrap_or(defaults.prefill_chunk),
            ..defaults
        };
        let mut gpu = CudaBackend::new(dev, model, options).unwrap();
        gpu.create_sequence(0).unwrap();
        gpu.forward(0, &p).unwrap()
    };
    assert_eq!(CudaOptions::default().prefill_chunk, 8192);
    let (long, short) = (logits(None), logits(Some(4096)));
    let mut cpu = CpuBackend::new(weights);
    cpu.create_sequence(0).unwrap();
    let c = cpu.forward(0, &p).unwrap();
    let (err_long, err_short) = (rel(&long, &c), rel(&short, &c));
    println!(
        "q4, 8,300 tokens: logits rel. error {err_long:.2e} in chunks of 8,192, {err_short:.2e} of 4,096 (vs each other {:.2e})",
        rel(&long, &short)
    );
    assert!(
        err_long <= TOLERANCE && err_short <= TOLERANCE,
        "logits differ from the CPU's by {err_long:.2e} / {err_short:.2e} > {TOLERANCE:e}"
    );
}

fn q4_weights(seed: u64) -> Weights {
    quantized_weights(seed, 4)
}

/// The test model quantised to MLX affine `bits` (group 64).
fn quantized_weights(seed: u64, bits: u32) -> Weights {
    let bf16 = tempfile::tempdir().unwrap();
    let q4 = tempfile::tempdir().unwrap();
    synth::write_checkpoint(
        &config(),
        bf16.path(),
        seed,
        DType::BF16,
        synth::SHARD_BYTES,
        false,
    )
    .unwrap();
    lily::checkpoint::mlx_write::quantize_dir(
        bf16.path(),
        q4.path(),
        lily::quant::Affine {
            bits,
            group_size: 64,
        },
        false,
    )
    .unwrap();
    checkpoint::load(q4.path()).unwrap()
}

fn gpu_backend(weights: &Weights, max_sequences: usize, batch_steps: bool) -> CudaBackend {
    gpu_backend_on(
        CudaDevice::new(0).expect("a CUDA GPU"),
        weights,
        max_sequences,
        batch_steps,
    )
}

fn gpu_backend_on(
    dev: CudaDevice,
    weights: &Weights,
    max_sequences: usize,
    batch_steps: bool,
) -> CudaBackend {
    let model = CudaModel::upload(&dev, weights).unwrap();
    let options = CudaOptions {
        max_sequences,
        max_context: 1024,
        prefill_chunk: 256,
        cuda_graphs: true,
        batch_steps,
        fused_norms: fused_norms(),
        ..CudaOptions::default()
    };
    CudaBackend::new(dev, model, options).unwrap()
}

/// How a step of the batched test asks for its next token: logits back, or a token picked on
/// the device by plain greedy, greedy over a vocabulary prefix, or top-1 sampling (the sampler's
/// whole pipeline) — each reading its own row of the pass.
fn way(seq: usize, vocab: usize) -> Option<DeviceSampling> {
    let greedy = DeviceSampling::greedy(vocab);
    match seq % 4 {
        0 => None,
        1 => Some(greedy),
        2 => Some(DeviceSampling {
            vocab_limit: vocab - 7,
            ..greedy
        }),
        _ => Some(DeviceSampling {
            temperature: 0.7,
            top_k: Some(1),
            ..greedy
        }),
    }
}

/// The steps of many sequences as shared passes (`batch_steps`) against the same steps one by
/// one: the prompts themselves as one batch (three passes under the 256-row limit, chunks as
/// spans; a longer prompt alone), then passes of 12 decode rows (the experts' gathered GEMV
/// slots, the dense row chunks), 5 and 2 (GEMVs), and passes mixing decode rows with new prompt chunks (8 rows:
/// GEMVs; 22 rows). Logits agree to bf16 accuracy (the paths round in different orders), picked
/// tokens up to near-ties. Steps for an unknown sequence, with a bad token or with a draw outside
/// [0, 1) in the same batch fail alone.
#[test]
fn batched_steps_equal_one_by_one() {
    batched_against_one_by_one(q4_weights(6));
}

/// The same with 8-bit weights (what GGUF and FP8 checkpoints run as): their kernels' shared
/// memory differs (an 8-bit expert slot of 8 tokens needs a smaller block).
#[test]
fn batched_steps_equal_one_by_one_q8() {
    batched_against_one_by_one(quantized_weights(6, 8));
}

fn batched_against_one_by_one(weights: Weights) {
    let vocab = weights.config.vocab_size;
    let n = 12;
    // Sequence n (batched only) takes a step with a bad draw every time.
    let mut batched = gpu_backend(&weights, n + 1, true);
    let mut alone = gpu_backend(&weights, n, false);
    let ways: Vec<Option<DeviceSampling>> = (0..n).map(|s| way(s, vocab)).collect();
    let bad_draw = way(3, vocab).expect("top-1 sampling");
    // The decode graphs of every batch size are captured up front, as the engine has them
    // captured: the steps below replay graphs made before any sequence existed.
    batched.prepare_decode(n + 1).unwrap();
    for seq in 0..n as u64 {
        batched.create_sequence(seq).unwrap();
        alone.create_sequence(seq).unwrap();
    }
    batched.create_sequence(n as u64).unwrap();
    let mut inputs: Vec<Vec<u32>> = (0..n)
        .map(|seq| prompt([1, 2, 5, 40, 120, 200, 300][seq % 7] + seq, seq as u32))
        .collect();
    let mut checked = 0;
    for (step, live) in [12usize, 12, 12, 5, 5, 2, 2, 12, 12]
        .into_iter()
        .enumerate()
    {
        // Steps 3 and 7: every third sequence gets a new prompt chunk instead of a decode token.
        if step == 3 || step == 7 {
            for seq in (0..live).step_by(3) {
                inputs[seq] = prompt(2 + seq / 3, (100 + step + seq) as u32);
            }
        }
        let mut steps: Vec<Step> = (0..live)
            .map(|seq| Step {
                seq: seq as u64,
                tokens: &inputs[seq],
                sample: ways[seq].as_ref().map(|s| (s, 0.5)),
            })
            .collect();
        let bad_token = [vocab as u32 + 3];
        steps.push(Step {
            seq: 999,
            tokens: &inputs[0],
            sample: None,
        });
        steps.push(Step {
            seq: n as u64,
            tokens: &inputs[1][..1],
            sample: Some((&bad_draw, 1.5)),
        });
        if live < n {
            steps.push(Step {
                seq: live as u64,
                tokens: &bad_token,
                sample: None,
            });
        }
        let passes = batched.shared_passes();
        let outputs = batched.forward_batch(&steps);
        assert!(
            batched.shared_passes() > passes,
            "step {step}: no shared pass ran"
        );
        assert_eq!(outputs.len(), steps.len());
        assert!(outputs[live].is_err(), "an unknown sequence fails");
        assert!(outputs[live + 1].is_err(), "a draw outside [0, 1) fails");
        if live < n {
            assert!(
                outputs[live + 2].is_err(),
                "a token outside the vocabulary fails"
            );
        }
        let mut next = Vec::new();
        for (seq, out) in outputs.into_iter().take(live).enumerate() {
            let what = format!("step {step} ({live} sequences), sequence {seq}");
            let reference = alone.forward(seq as u64, &inputs[seq]).unwrap();
            let scale = reference.iter().fold(0f32, |m, v| m.max(v.abs()));
            let limit = ways[seq].as_ref().map_or(vocab, |s| s.vocab_limit);
            let expected = argmax(&reference[..limit]);
            match out.unwrap_or_else(|e| panic!("{what}: {e:#}")) {
                StepOutput::Logits(logits) => {
                    assert!(ways[seq].is_none(), "{what} asked for a token");
                    let err = rel(&logits, &reference);
                    assert!(err <= TOLERANCE, "{what}: logits differ by {err:.2e}");
                }
                StepOutput::Token(token) => {
                    assert!(ways[seq].is_some(), "{what} asked for logits");
                    assert!(
                        (token as usize) < limit,
                        "{what}: token {token} past {limit}"
                    );
                    let gap = (reference[expected as usize] - reference[token as usize]) / scale;
                    assert!(
                        gap <= TOLERANCE,
                        "{what}: picked {token}, one by one {expected} (gap {gap:.2e}: not a near-tie)"
                    );
                }
            }
            checked += 1;
            next.push(expected);
        }
        for (seq, token) in next.into_iter().enumerate() {
            inputs[seq] = vec![token];
        }
    }
    println!(
        "batched steps: {checked} steps in {} shared passes agree with one-by-one",
        batched.shared_passes()
    );
}

/// Passes of more rows than one GEMV launch takes (9+) multiply the mixers' projections and the
/// routers through cuBLAS on the kept bf16 copies (forward/projection.rs); 8 rows keep the 4-bit
/// GEMVs. Seen in the op timing's kernel names; the results against one-by-one passes are
/// `batched_steps_equal_one_by_one`'s (its passes of 12+ rows take this path).
#[test]
fn passes_of_nine_rows_or_more_take_cublas() {
    let weights = q4_weights(8);
    let sections_on_cublas = |rows: usize| -> Vec<String> {
        let mut b = gpu_backend(&weights, rows, true);
        assert!(b.set_op_timing(true));
        for seq in 0..rows as u64 {
            b.create_sequence(seq).unwrap();
        }
        let tokens: Vec<Vec<u32>> = (0..rows).map(|s| prompt(1, 40 + s as u32)).collect();
        let steps: Vec<Step> = (0..rows)
            .map(|s| Step {
                seq: s as u64,
                tokens: &tokens[s],
                sample: None,
            })
            .collect();
        for out in b.forward_batch(&steps) {
            out.unwrap();
        }
        let mut sections: Vec<String> = b
            .take_op_times()
            .into_iter()
            .filter(|o| o.kernel == "dense cublas")
            .map(|o| o.section)
            .collect();
        sections.sort();
        sections.dedup();
        sections
    };
    // Settings under trial (gpu-check) may move the threshold or drop the kept copies.
    let options = CudaOptions::default();
    if std::env::var("LILY_CUBLAS_FROM_ROWS").is_err() {
        assert_eq!(options.cublas_from_rows, 9, "the default threshold");
    }
    let expected: &[&str] = if options.keep_dense_bf16 && options.cublas_from_rows <= 9 {
        &[
            "attn o_proj",
            "attn qkv",
            "gdn in_proj",
            "gdn out_proj",
            "moe router",
        ]
    } else {
        &[]
    };
    assert_eq!(sections_on_cublas(8), Vec::<String>::new());
    assert_eq!(sections_on_cublas(9), expected);
}

/// Op timing (`lily bench --profile`) changes no result: a timed backend's logits after a
/// prompt (two chunks) and 8 decode steps (uncaptured while timed) equal an untimed one's bit for
/// bit; the times name the sections of the pass, are finite and positive, and sum to no more
/// than the calls took on the host.
#[test]
fn op_timing_changes_nothing_and_names_the_sections() {
    let weights = q4_weights(7);
    let mut plain = gpu_backend(&weights, 1, false);
    let mut timed = gpu_backend(&weights, 1, false);
    assert!(timed.set_op_timing(true));
    plain.create_sequence(0).unwrap();
    timed.create_sequence(0).unwrap();
    let p = prompt(300, 11);
    let t0 = std::time::Instant::now();
    let mut logits = timed.forward(0, &p).unwrap();
    let prefill_wall = t0.elapsed().as_secs_f64() * 1e3;
    assert_eq!(logits, plain.forward(0, &p).unwrap());
    let prefill = timed.take_op_times();
    let mut decode_wall = 0.0;
    for _ in 0..8 {
        let tok = argmax(&logits);
        let t0 = std::time::Instant::now();
        logits = timed.forward(0, &[tok]).unwrap();
        decode_wall += t0.elapsed().as_secs_f64() * 1e3;
        assert_eq!(logits, plain.forward(0, &[tok]).unwrap());
    }
    let decode = timed.take_op_times();
    for (ops, wall, what) in [
        (&prefill, prefill_wall, "prefill"),
        (&decode, decode_wall, "decode"),
    ] {
        let sum: f64 = ops.iter().map(|o| o.ms).sum();
        assert!(
            ops.iter()
                .all(|o| o.ms.is_finite() && o.ms >= 0.0 && o.calls > 0),
            "{what}: {ops:?}"
        );
        assert!(
            sum > 0.0 && sum <= wall,
            "{what}: op times sum to {sum} ms, the calls took {wall} ms"
        );
        for section in [
            "embed",
            "gdn in_proj",
            "gdn mixer",
            "gdn out_proj",
            "attn qkv",
            "attn mixer",
            "attn o_proj",
            "norms",
            "moe router",
            "moe experts",
            "lm_head",
            "argmax",
        ] {
            assert!(
                ops.iter().any(|o| o.section == section),
                "{what}: no time for {section}: {ops:?}"
            );
        }
    }
    // The three kernels of the chunked GDN rule are told apart (a variant under trial, e.g.
    // `gdn out_tf32`, by its own name).
    for kernel in ["gdn prep", "gdn state", "gdn out"] {
        assert!(
            prefill.iter().any(|o| o.kernel.starts_with(kernel)),
            "no {kernel}: {prefill:?}"
        );
    }
    assert!(timed.take_op_times().is_empty(), "take starts over");
}

/// `lily bench --timeline` (the CUDA backend's timeline.rs): on a device opened with the decode
/// kernels' timeline builds, the logits are those of the plain kernels, bit for bit, with and
/// without a timeline being taken; every launch of every replay of the decode graph stamps once
/// (the stamps make whole replays of the captured launch list), the gaps are positive and sum
/// to less than the steps' wall time, and the sections of a decode step are all there. A device
/// with the plain kernels refuses a timeline with an error.
#[test]
fn timeline_stamps_every_launch_of_the_decode_graph() {
    let weights = q4_weights(13);
    let mut plain = gpu_backend(&weights, 1, false);
    let err = plain.start_timeline().unwrap_err().to_string();
    assert!(err.contains("no timeline"), "{err}");
    let stamped = CudaDevice::new_with(0, true).expect("a CUDA GPU");
    let mut traced = gpu_backend_on(stamped, &weights, 1, false);
    plain.create_sequence(0).unwrap();
    traced.create_sequence(0).unwrap();
    let p = prompt(200, 5);
    let mut logits = traced.forward(0, &p).unwrap();
    assert_eq!(logits, plain.forward(0, &p).unwrap());
    let step = |plain: &mut CudaBackend, traced: &mut CudaBackend, logits: &mut Vec<f32>| {
        let tok = argmax(logits);
        let t0 = std::time::Instant::now();
        *logits = traced.forward(0, &[tok]).unwrap();
        let wall = t0.elapsed().as_secs_f64() * 1e6;
        assert_eq!(*logits, plain.forward(0, &[tok]).unwrap());
        wall
    };
    step(&mut plain, &mut traced, &mut logits); // captures the graph
    assert!(traced.start_timeline().unwrap());
    let steps = 6;
    let wall: f64 = (0..steps)
        .map(|_| step(&mut plain, &mut traced, &mut logits))
        .sum();
    let t = traced.stop_timeline().unwrap().expect("a timeline");
    assert_eq!(t.steps, steps);
    let per_step = t.launches.len() + 1;
    let calls: u64 = t.ops.iter().map(|o| o.calls).sum();
    assert_eq!(calls as usize, steps * (per_step - 1));
    // The 4-layer test model's step is 42 launches, 38 with the top-k in the router's GEMV
    // (LILY_FUSED_TOPK=1, one launch fewer per layer).
    assert!(per_step > 32, "{per_step} launches per step");
    let sum_us: f64 = t.ops.iter().map(|o| o.ms).sum::<f64>() * 1e3;
    assert!(
        sum_us > 0.0 && sum_us < wall,
        "gaps sum to {sum_us} µs, the steps took {wall} µs"
    );
    assert!(
        t.launches
            .iter()
            .all(|l| l.gap_us.is_finite() && l.gap_us >= 0.0 && l.waited_us >= 0.0),
        "{:?}",
        t.launches
    );
    // The GEMVs mark their work in order: x staged, first batch in, tiles done, end, all within
    // the gap to the next launch's release.
    let gemvs: Vec<_> = t
        .launches
        .iter()
        .filter(|l| l.section == "gdn in_proj")
        .collect();
    assert!(!gemvs.is_empty());
    for l in gemvs {
        let m: Vec<f64> = l.marks_us[1..].iter().map(|m| m.expect("marked")).collect();
        assert!(
            m.windows(2).all(|w| w[0] <= w[1]) && m[3] <= l.gap_us,
            "{l:?}"
        );
    }
    for section in [
        "embed",
        "gdn in_proj",
        "gdn mixer",
        "attn mixer",
        "moe experts",
        "lm_head",
    ] {
        assert!(
            t.ops.iter().any(|o| o.section == section),
            "no {section}: {:?}",
            t.ops
        );
    }
    // Off again: nothing stamps, nothing changes.
    assert!(traced.stop_timeline().unwrap().is_none());
    step(&mut plain, &mut traced, &mut logits);
    assert!(traced.start_timeline().unwrap());
    assert!(
        traced.stop_timeline().unwrap().is_none(),
        "no decode step ran under the second timeline"
    );
    println!(
        "timeline: {per_step} launches per step, {:.1} µs per step of gaps, {:.1} µs per step of wall time",
        sum_us / steps as f64,
        wall / steps as f64
    );
}

/// `lily agree --device-routing` on the GPU (src/agree.rs): a traced run (passes uncaptured, each
/// layer's router logits and experts copied out) gives the plain run's logits bit for bit; the
/// trace holds every row (a 300-token prompt in two chunks, then decode steps); the device's
/// choices are the top-k of its own router logits; and the CPU reference running those choices
/// stays within the whole-model bound.
#[test]
fn traced_routing_is_consistent_and_the_reference_follows_it() {
    let weights = q4_weights(5);
    let p = prompt(300, 13);
    let mut plain = gpu_backend(&weights, 1, false);
    let mut traced = gpu_backend(&weights, 1, false);
    let untraced = lily::agree::device_run(&mut plain, &p, 16, false).unwrap();
    let run = lily::agree::device_run(&mut traced, &p, 16, true).unwrap();
    assert_eq!(run.steps, untraced.steps, "tracing changed the logits");
    let trace = run
        .routing
        .as_ref()
        .expect("the CUDA backend traces its routing");
    let k = weights.config.num_experts_per_tok;
    assert!(trace.experts.iter().all(|l| l.len() == (300 + 15) * k));
    let report = lily::agree::compare(&weights, "cuda".into(), &p, &run, false).unwrap();
    println!("{}", report.to_markdown());
    assert_eq!(report.inconsistent_routing(), 0);
    assert!(report.passes(), "{}", report.to_markdown());
}
