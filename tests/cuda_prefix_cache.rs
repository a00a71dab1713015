//! Snapshots of GPU sequence states (src/cuda/snapshot.rs; run on the H200 by
//! scripts/gpu-check.sh): a state saved mid-prompt or mid-generation and restored into another,
//! dirty slot continues exactly as the original sequence does, and the engine's prefix cache on
//! the GPU reuses prompts.
//!
//! The model has the real GDN and attention shapes with fewer layers and experts (as in
//! tests/cuda_forward.rs). The original and the restored sequence run the same tokens in the same
//! chunks from the same state, so their logits must agree exactly, not just to bf16 accuracy.
#![cfg(feature = "cuda")]

mod common;

use lily::checkpoint::{self, synth, tensor::DType};
use lily::cuda::forward::{CudaBackend, CudaOptions};
use lily::cuda::model::CudaModel;
use lily::cuda::CudaDevice;
use lily::engine::{greedy_sampler, Engine, EngineOptions, Event, GenerateRequest};
use lily::model::{argmax, Backend};
use rand::RngExt;

fn config() -> serde_json::Value {
    common::real_shaped_config([
        "linear_attention",
        "full_attention",
        "linear_attention",
        "full_attention",
    ])
}

fn backend(max_sequences: usize) -> CudaBackend {
    let dir = tempfile::tempdir().unwrap();
    synth::write_checkpoint(
        &config(),
        dir.path(),
        7,
        DType::BF16,
        synth::SHARD_BYTES,
        false,
    )
    .unwrap();
    let weights = checkpoint::load(dir.path()).unwrap();
    let dev = CudaDevice::new(0)
        .expect("a CUDA GPU (these tests run on the H200 through scripts/gpu-check.sh)");
    let model = CudaModel::upload(&dev, &weights).unwrap();
    let options = CudaOptions {
        max_sequences,
        max_context: 2048,
        prefill_chunk: 128,
        ..CudaOptions::default()
    };
    CudaBackend::new(dev, model, options).unwrap()
}

fn random_tokens(n: usize) -> Vec<u32> {
    let mut rng = rand::rng();
    (0..n).map(|_| rng.random_range(0..2000)).collect()
}

/// Runs `rest` on `seq`, then `steps` greedy decode steps; returns every step's logits.
fn continue_greedy(gpu: &mut CudaBackend, seq: u64, rest: &[u32], steps: usize) -> Vec<Vec<f32>> {
    let mut all = vec![gpu.forward(seq, rest).unwrap()];
    for _ in 0..steps {
        let next = argmax(all.last().unwrap());
        all.push(gpu.forward(seq, &[next]).unwrap());
    }
    all
}

#[test]
fn a_restored_state_continues_exactly() {
    let mut gpu = backend(3);
    let prompt = random_tokens(rand::rng().random_range(300..600));
    let cut = rand::rng().random_range(130..290); // past the first 128-token chunk
                                                  // The original: the prompt up to the cut, a snapshot, the rest and 16 greedy steps.
    gpu.create_sequence(0).unwrap();
    gpu.forward(0, &prompt[..cut]).unwrap();
    let snap = gpu.snapshot(0).unwrap();
    // K and V of `cut` tokens × 2 layers × 2 heads × 256 dims in bf16, plus the GDN states.
    let kv_bytes = (cut * 2 * 2 * 2 * 256 * 2) as u64;
    assert!(snap.bytes > kv_bytes, "{} bytes", snap.bytes);
    let original = continue_greedy(&mut gpu, 0, &prompt[cut..], 16);

    // Another sequence dirties slot 1 with a different prompt and goes; the next one gets
    // that slot and the snapshot.
    gpu.create_sequence(1).unwrap();
    gpu.forward(1, &random_tokens(700)).unwrap();
    gpu.free_sequence(1);
    for seq in [2, 3] {
        gpu.create_sequence(seq).unwrap();
        assert_eq!(gpu.restore(snap.id, seq).unwrap(), cut);
        let restored = continue_greedy(&mut gpu, seq, &prompt[cut..], 16);
        for (step, (a, b)) in original.iter().zip(&restored).enumerate() {
            let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert_eq!(diff, 0.0, "seq {seq}, step {step}: logits differ by {diff}");
        }
        gpu.free_sequence(seq);
    }
    gpu.drop_snapshot(snap.id);
    gpu.create_sequence(4).unwrap();
    assert!(
        gpu.restore(snap.id, 4).is_err(),
        "a dropped snapshot is gone"
    );
}

#[test]
fn a_state_saved_while_decoding_resumes_in_decode() {
    let mut gpu = backend(2);
    let prompt = random_tokens(200);
    gpu.create_sequence(0).unwrap();
    let mut logits = gpu.forward(0, &prompt).unwrap();
    for _ in 0..5 {
        logits = gpu.forward(0, &[argmax(&logits)]).unwrap();
    }
    let snap = gpu.snapshot(0).unwrap();
    let next = argmax(&logits);
    let original = continue_greedy(&mut gpu, 0, &[next], 20);
    gpu.free_sequence(0);
    gpu.create_sequence(1).unwrap();
    assert_eq!(gpu.restore(snap.id, 1).unwrap(), 205);
    let restored = continue_greedy(&mut gpu, 1, &[next], 20);
    let tokens = |all: &[Vec<f32>]| all.iter().map(|l| argmax(l)).collect::<Vec<_>>();
    assert_eq!(tokens(&original), tokens(&restored));
    assert_eq!(original, restored);
}

#[test]
fn the_engine_reuses_prompts_on_the_gpu() {
    let engine = Engine::start(
        Box::new(backend(2)),
        EngineOptions {
            prefill_chunk: 128,
            prefix_cache_bytes: 1 << 30,
            snapshot_interval: 256,
            ..EngineOptions::default()
        },
    );
    let run = |prompt: &[u32]| {
        let mut rx = engine.submit(GenerateRequest {
            prompt: prompt.to_vec(),
            max_tokens: 8,
            stop_token_ids: vec![],
            sampler: greedy_sampler(),
            prompt_cache_key: None,
            device_sampler: None,
            prompt_logprobs: None,
            draft: false,
        });
        let mut ids = vec![];
        loop {
            match rx.blocking_recv().expect("an event") {
                Event::Started { .. } | Event::PromptToken(_) => {}
                Event::Token(t) => ids.push(t.id),
                Event::Done { cached_tokens, .. } => return (ids, cached_tokens),
                Event::Error(e) => panic!("{e}"),
            }
        }
    };
    // Turn 2 restores the state saved at the end of turn 1 (prompt + 7 of its 8 tokens).
    let first = random_tokens(300);
    let (answer, cached) = run(&first);
    assert_eq!(cached, 0);
    let mut second = first.clone();
    second.extend(&answer);
    second.extend(random_tokens(40));
    let (_, cached) = run(&second);
    assert_eq!(cached, first.len() + 7);
}
