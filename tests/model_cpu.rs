//! The CPU reference forward pass against transformers' `qwen3_5_moe` (fixtures made by
//! tools/make_fixtures.py), and the consistency of its prefill and decode paths.

mod common;

use common::{argmax, fixture_dir, rel_error, Reference};
use lily::checkpoint;
use lily::model::cpu::{forward, Logits};
use lily::model::SequenceState;

/// f32 weights, f32 arithmetic on both sides: only summation order differs.
const F32_TOLERANCE: f32 = 1e-4;

fn greedy(weights: &lily::model::Weights, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut state = SequenceState::new(&weights.config);
    let mut logits = forward(weights, prompt, &mut state, Logits::Last);
    let mut out = Vec::new();
    for _ in 0..n {
        let next = argmax(&logits);
        out.push(next);
        logits = forward(weights, &[next], &mut state, Logits::Last);
    }
    out
}

fn check_f32_model(name: &str) {
    let weights = checkpoint::load(&fixture_dir(name)).unwrap();
    let reference = Reference::load(name);
    assert!(reference.prompts() >= 3);
    for p in 0..reference.prompts() {
        let ids = reference.ids(p, "ids");
        let mut state = SequenceState::new(&weights.config);
        let logits = forward(&weights, &ids, &mut state, Logits::All);
        let err = rel_error(&logits, &reference.f32s(p, "logits"));
        println!(
            "{name} prompt {p} ({} tokens): logits rel. error {err:.2e}",
            ids.len()
        );
        assert!(
            err <= F32_TOLERANCE,
            "{name} prompt {p}: logits rel. error {err:.2e} > {F32_TOLERANCE:e}"
        );
        let want = reference.ids(p, "greedy");
        assert_eq!(
            greedy(&weights, &ids, want.len()),
            want,
            "{name} prompt {p}: greedy continuation differs"
        );
    }
}

#[test]
fn official_layout_f32_matches_transformers() {
    check_f32_model("tiny-a");
}

#[test]
fn text_only_layout_f32_matches_transformers() {
    check_f32_model("tiny-b");
}

/// The bf16 model: transformers rounds every activation to bf16, we keep f32 activations over
/// the same bf16 weights. So we compare with transformers' f32 run of those weights, and with
/// its bf16 run no worse than bf16 arithmetic itself moves the logits (the distance between its
/// own bf16 and f32 runs), with a 2× margin since both sides round differently.
///
/// Against the f32 run the bound is 1e-3, not 1e-4: with these bf16-rounded random weights one
/// position (of 40) of one prompt amplifies f32 summation-order differences to 4.8e-4 (the
/// errors before it stay ≤ 6e-5 and decay after it), while the bf16 run itself is 0.6 away.
const BF16_WEIGHTS_F32_TOLERANCE: f32 = 1e-3;
#[test]
fn bf16_models_match_transformers() {
    check_bf16_model("tiny-a-bf16");
    check_bf16_model("tiny-c");
}

fn check_bf16_model(name: &str) {
    let weights = checkpoint::load(&fixture_dir(name)).unwrap();
    let reference = Reference::load(name);
    for p in 0..reference.prompts() {
        let ids = reference.ids(p, "ids");
        let mut state = SequenceState::new(&weights.config);
        let logits = forward(&weights, &ids, &mut state, Logits::All);
        let ref_f32 = reference.f32s(p, "logits_f32");
        let ref_bf16 = reference.f32s(p, "logits");
        let err_f32 = rel_error(&logits, &ref_f32);
        let err_bf16 = rel_error(&logits, &ref_bf16);
        let bf16_noise = rel_error(&ref_bf16, &ref_f32);
        println!("{name} prompt {p}: vs f32 run {err_f32:.2e}, vs bf16 run {err_bf16:.2e} (bf16 noise {bf16_noise:.2e})");
        assert!(
            err_f32 <= BF16_WEIGHTS_F32_TOLERANCE,
            "prompt {p}: {err_f32:.2e} against transformers' f32 run"
        );
        assert!(
            err_bf16 <= 2.0 * bf16_noise + F32_TOLERANCE,
            "prompt {p}: {err_bf16:.2e} against the bf16 run"
        );
    }
}

/// Prefill in one call (chunked delta rule, batched attention) and token-by-token decode
/// (recurrent delta rule) must give the same logits and the same final state.
#[test]
fn chunked_prefill_matches_token_by_token_decode() {
    let weights = checkpoint::load(&fixture_dir("tiny-b")).unwrap();
    let reference = Reference::load("tiny-b");
    let ids = reference.ids(reference.prompts() - 1, "ids");
    assert!(
        ids.len() > lily::model::cpu::gdn::CHUNK * 2,
        "needs a prompt spanning several GDN chunks"
    );

    let mut batched = SequenceState::new(&weights.config);
    let all = forward(&weights, &ids, &mut batched, Logits::All);
    let mut stepped = SequenceState::new(&weights.config);
    let mut one_by_one = Vec::new();
    for &id in &ids {
        one_by_one.extend(forward(&weights, &[id], &mut stepped, Logits::Last));
    }
    let err = rel_error(&one_by_one, &all);
    assert!(err <= F32_TOLERANCE, "logits differ: {err:.2e}");
    assert_states_close(&batched, &stepped);
}

/// Splitting a prompt into prefill chunks of any size changes nothing.
#[test]
fn prefill_chunk_size_changes_nothing() {
    let weights = checkpoint::load(&fixture_dir("tiny-a")).unwrap();
    let reference = Reference::load("tiny-a");
    let ids = reference.ids(reference.prompts() - 1, "ids");
    let mut whole = SequenceState::new(&weights.config);
    let want = forward(&weights, &ids, &mut whole, Logits::All);
    for chunk in [1usize, 5, 63, 64, 65, 100] {
        let mut state = SequenceState::new(&weights.config);
        let mut got = Vec::new();
        for part in ids.chunks(chunk) {
            got.extend(forward(&weights, part, &mut state, Logits::All));
        }
        let err = rel_error(&got, &want);
        assert!(
            err <= F32_TOLERANCE,
            "chunk {chunk}: logits differ by {err:.2e}"
        );
        assert_states_close(&state, &whole);
    }
}

fn assert_states_close(a: &SequenceState, b: &SequenceState) {
    use lily::model::state::LayerState;
    assert_eq!(a.position, b.position);
    for (i, (x, y)) in a.layers.iter().zip(&b.layers).enumerate() {
        let (u, v) = match (x, y) {
            (LayerState::DeltaNet(x), LayerState::DeltaNet(y)) => {
                let err = rel_error(&x.conv, &y.conv);
                assert!(
                    err <= F32_TOLERANCE,
                    "layer {i}: conv windows differ by {err:.2e}"
                );
                (&x.ssm, &y.ssm)
            }
            (LayerState::Attention(x), LayerState::Attention(y)) => (&x.keys, &y.keys),
            _ => panic!("layer kinds differ"),
        };
        let err = rel_error(u, v);
        assert!(
            err <= F32_TOLERANCE,
            "layer {i}: states differ by {err:.2e}"
        );
    }
}

/// Several sequences as one batch (their rows through the projections and experts together)
/// give each exactly the logits and state it gets alone: prompts, a mid-prompt chunk and decode
/// tokens mixed, at different positions.
#[test]
fn a_batch_of_sequences_equals_each_alone() {
    use rand::RngExt;
    let weights = checkpoint::load(&fixture_dir("tiny-a")).unwrap();
    let vocab = weights.config.vocab_size as u32;
    let mut rng = rand::rng();
    let mut random =
        |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(0..vocab)).collect() };
    // Each sequence first reads a different history alone, then all take one batched step.
    let histories = [random(0), random(3), random(70), random(1)];
    let steps = [random(9), random(1), random(1), random(130)];
    for which in [Logits::Last, Logits::All] {
        let mut states: Vec<SequenceState> = histories
            .iter()
            .map(|h| {
                let mut s = SequenceState::new(&weights.config);
                if !h.is_empty() {
                    forward(&weights, h, &mut s, Logits::Last);
                }
                s
            })
            .collect();
        let mut alone_states = states.clone();
        let mut batch: Vec<(&[u32], &mut SequenceState)> = steps
            .iter()
            .map(|s| s.as_slice())
            .zip(states.iter_mut())
            .collect();
        let batched = lily::model::cpu::forward_batch(&weights, &mut batch, which);
        for (i, (step, state)) in steps.iter().zip(alone_states.iter_mut()).enumerate() {
            let alone = forward(&weights, step, state, which);
            assert_eq!(batched[i], alone, "sequence {i} ({which:?}): logits");
            assert_eq!(states[i], *state, "sequence {i} ({which:?}): state");
        }
    }
}

/// `CpuBackend::forward_batch`: the valid steps of a batch give exactly what each gives alone
/// (logits, or the token its sampling picks); a bad step (unknown sequence, token outside the
/// vocabulary, no tokens) fails alone and leaves its sequence as it was; a sequence's second
/// step runs after its first.
#[test]
fn backend_batch_steps_equal_each_alone_and_bad_steps_fail_alone() {
    use lily::model::{Backend, CpuBackend, Step};
    use lily::sampling::DeviceSampling;
    use rand::RngExt;
    let weights = checkpoint::load(&fixture_dir("tiny-a")).unwrap();
    let vocab = weights.config.vocab_size;
    let mut rng = rand::rng();
    let mut random =
        |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(0..vocab as u32)).collect() };
    let mut batched = CpuBackend::new(weights.clone());
    let mut alone = CpuBackend::new(weights);
    for seq in 0..5u64 {
        let history = random(1 + 20 * seq as usize);
        for b in [&mut batched, &mut alone] {
            b.create_sequence(seq).unwrap();
            b.forward(seq, &history).unwrap();
        }
    }
    let sampled = DeviceSampling {
        temperature: 1.0,
        top_k: Some(40),
        top_p: 0.9,
        min_p: 0.0,
        repetition_penalty: 1.0,
        frequency_penalty: 0.0,
        presence_penalty: 0.0,
        vocab_limit: vocab,
        history: Vec::new(),
    };
    let greedy = DeviceSampling {
        temperature: 0.0,
        ..sampled.clone()
    };
    let (one, chunk, two) = (random(1), random(9), random(1));
    let u: f64 = rand::random();
    let bad_token = [vocab as u32];
    let steps = [
        Step {
            seq: 0,
            tokens: &one,
            sample: None,
        },
        Step {
            seq: 1,
            tokens: &one,
            sample: Some((&sampled, u)),
        },
        Step {
            seq: 2,
            tokens: &chunk,
            sample: Some((&greedy, 0.0)),
        },
        Step {
            seq: 3,
            tokens: &bad_token,
            sample: None,
        },
        Step {
            seq: 77,
            tokens: &one,
            sample: None,
        },
        Step {
            seq: 4,
            tokens: &[],
            sample: None,
        },
        Step {
            seq: 0,
            tokens: &two,
            sample: None,
        },
    ];
    let got = batched.forward_batch(&steps);
    assert_eq!(got.len(), steps.len());
    for (i, result) in got.into_iter().enumerate() {
        let want = alone.forward_step(&steps[i]);
        match (result, want) {
            (Ok(g), Ok(w)) => assert_eq!(g, w, "step {i}"),
            (Err(_), Err(_)) => assert!((3..=5).contains(&i), "step {i} failed"),
            (g, w) => panic!("step {i}: batched {g:?}, alone {w:?}"),
        }
    }
    // The sequences of the failed steps run on as before.
    for seq in [3u64, 4] {
        let (g, w) = (
            batched.forward(seq, &two).unwrap(),
            alone.forward(seq, &two).unwrap(),
        );
        assert_eq!(g, w, "sequence {seq} after its failed step");
    }
}

/// The CPU matmul (rows dequantised in blocks, threaded for large products) gives exactly what
/// one `dot` per (row, token) gives: odd and even row and token counts, widths with and without a
/// tail past the last 8 columns, serial and threaded sizes.
#[test]
fn matmul_is_one_dot_per_row_and_token() {
    use lily::model::cpu::ops::{dot, matmul};
    use lily::model::weights::Matrix;
    use rand::RngExt;
    let mut rng = rand::rng();
    let mut next = || rng.random_range(-1.0f32..1.0);
    for (rows, cols, tokens) in [
        (1, 8, 1),
        (3, 13, 5),
        (16, 64, 2),
        (33, 70, 7),
        (300, 1024, 9),
    ] {
        let w: Vec<f32> = (0..rows * cols).map(|_| next()).collect();
        let x: Vec<f32> = (0..tokens * cols).map(|_| next()).collect();
        let y = matmul(&Matrix::from_f32(rows, cols, &w), &x, tokens);
        for t in 0..tokens {
            for r in 0..rows {
                let want = dot(&w[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols]);
                assert_eq!(
                    y[t * rows + r].to_bits(),
                    want.to_bits(),
                    "[{rows}×{cols}] × {tokens}: row {r}, token {t}"
                );
            }
        }
    }
}

/// `Backend::keep_state_before_last` on the CPU: a step asked to keep the state before its last
/// token gives the logits a plain step gives, and a snapshot of the kept state resumes exactly
/// as one taken after all but the last token; a kept state no snapshot took is dropped at the
/// sequence's next step, and a failed `snapshot_before_last` leaves an unfilled keep in place.
#[test]
fn a_state_kept_before_a_steps_last_token_resumes_as_a_snapshot_there() {
    use lily::model::{Backend, CpuBackend};
    use rand::RngExt;
    let weights = checkpoint::load(&fixture_dir("tiny-a")).unwrap();
    let vocab = weights.config.vocab_size as u32;
    let mut rng = rand::rng();
    let prompt: Vec<u32> = (0..23).map(|_| rng.random_range(0..vocab)).collect();
    let rest: Vec<u32> = (0..4).map(|_| rng.random_range(0..vocab)).collect();
    let n = prompt.len();
    let mut cpu = CpuBackend::new(weights);
    assert!(cpu.can_keep_state_before_last());

    cpu.create_sequence(0).unwrap();
    cpu.keep_state_before_last(0).unwrap();
    assert!(
        cpu.snapshot_before_last(0).is_err(),
        "nothing kept before the step runs"
    );
    let kept_logits = cpu.forward(0, &prompt).unwrap();
    let kept = cpu.snapshot_before_last(0).unwrap();
    assert!(cpu.snapshot_before_last(0).is_err(), "used up");

    cpu.create_sequence(1).unwrap();
    cpu.forward(1, &prompt[..n - 1]).unwrap();
    let there = cpu.snapshot(1).unwrap();
    assert_eq!(cpu.forward(1, &prompt[n - 1..]).unwrap(), kept_logits);
    assert_eq!(kept.bytes, there.bytes);

    let mut continued = Vec::new();
    for (seq, snap) in [(2, kept.id), (3, there.id)] {
        cpu.create_sequence(seq).unwrap();
        assert_eq!(cpu.restore(snap, seq).unwrap(), n - 1);
        continued.push(cpu.forward(seq, &rest).unwrap());
    }
    assert_eq!(continued[0], continued[1]);

    // Kept, not taken, then another step: stale, gone.
    cpu.keep_state_before_last(2).unwrap();
    cpu.forward(2, &rest).unwrap();
    cpu.forward(2, &rest[..1]).unwrap();
    assert!(
        cpu.snapshot_before_last(2).is_err(),
        "a stale keep is dropped"
    );
}
