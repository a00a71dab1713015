//! Drafting with the MTP head on the GPU (src/cuda/forward/mtp.rs) against the CPU reference
//! and against plain GPU decoding (run on the H200 by scripts/gpu-check.sh). The model has the
//! real head shapes with 4 layers and an MTP head (tests/common `real_shaped_config`), bf16
//! weights. The GPU's verify pass runs its rows as decode rows of one sequence (its GDN layers
//! stepped as decoding steps them, the rest rounding as a batched decode pass of that many rows
//! does), so greedy output with drafts equals plain GPU decoding up to near-ties: a divergence is
//! accepted only where plain decoding's top two logits are within the tolerance of
//! tests/cuda_forward.rs.
#![cfg(feature = "cuda")]

mod common;

use common::Rng;
use lily::bench::drafts::ForcedDrafts;
use lily::checkpoint::{self, synth, tensor::DType};
use lily::cuda::forward::{CudaBackend, CudaOptions, VerifyPass};
use lily::cuda::model::CudaModel;
use lily::cuda::CudaDevice;
use lily::model::cpu::{self, mtp, Logits};
use lily::model::speculative;
use lily::model::state::{KvCache, MtpState};
use lily::model::{argmax, Backend, SeqId, SequenceState, Weights};

/// As tests/cuda_forward.rs: bf16 activations on the GPU against f32 on the CPU.
const TOLERANCE: f32 = 8e-2;

fn weights(rng: &mut Rng) -> Weights {
    let mut config = common::real_shaped_config([
        "linear_attention",
        "linear_attention",
        "linear_attention",
        "full_attention",
    ]);
    config["text_config"]["mtp_num_hidden_layers"] = 1.into();
    let dir = tempfile::tempdir().unwrap();
    let seed = rng.next_u64();
    synth::write_checkpoint(
        &config,
        dir.path(),
        seed,
        DType::BF16,
        synth::SHARD_BYTES,
        false,
    )
    .unwrap();
    let w = checkpoint::load(dir.path()).unwrap();
    assert!(w.mtp.is_some());
    w
}

fn gpu(w: &Weights) -> CudaBackend {
    gpu_with(w, CudaOptions::default().verify_pass)
}

/// With verify passes run as `verify_pass` says (`CudaOptions::verify_pass`).
fn gpu_with(w: &Weights, verify_pass: VerifyPass) -> CudaBackend {
    let dev = CudaDevice::new(0).expect("a CUDA GPU (run through scripts/gpu-check.sh)");
    let model = CudaModel::upload(&dev, w).unwrap();
    let options = CudaOptions {
        max_sequences: 2,
        max_context: 2048,
        prefill_chunk: 256,
        verify_pass,
        ..CudaOptions::default()
    };
    CudaBackend::new(dev, model, options).unwrap()
}

fn prompt(rng: &mut Rng, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.below(2000) as u32).collect()
}

/// How far apart the top two logits are, relative to the largest magnitude.
fn top_gap(logits: &[f32], a: u32, b: u32) -> f32 {
    let scale = logits.iter().fold(0f32, |m, v| m.max(v.abs()));
    (logits[a as usize] - logits[b as usize]).abs() / scale
}

#[test]
fn the_heads_drafts_on_the_gpu_are_the_references() {
    let mut rng = Rng::new("the_heads_drafts_on_the_gpu_are_the_references");
    let w = weights(&mut rng);
    let head = w.mtp.as_ref().unwrap();
    let mut gpu = gpu(&w);
    assert!(gpu.can_draft());
    for (seq, n) in [1usize, 5, 40, 300].into_iter().enumerate() {
        let seq = seq as SeqId;
        let p = prompt(&mut rng, n);
        // The reference: the model's hidden states of the prompt, then the head over them.
        let mut state = SequenceState::new(&w.config);
        state.mtp = Some(MtpState::default());
        let next = argmax(&cpu::forward(&w, &p, &mut state, Logits::Last));
        let hidden = state.mtp.take().unwrap().pending;
        let following: Vec<u32> = p[1..].iter().copied().chain([next]).collect();
        let mut kv = KvCache::default();
        let (normed, logits) =
            mtp::forward(&w, head, &hidden, &following, 0, &mut kv, Logits::Last);
        let want = argmax(&logits);
        gpu.create_sequence(seq).unwrap();
        gpu.start_drafting(seq).unwrap();
        gpu.forward(seq, &p).unwrap();
        let got = gpu.draft(seq, next, 3).unwrap();
        assert_eq!(got.len(), 3);
        let gap = top_gap(&logits, want, got[0]);
        println!(
            "prompt {n}: first draft cpu {want} gpu {} (gap {gap:.2e}), all {got:?}",
            got[0]
        );
        assert!(
            gap <= TOLERANCE,
            "prompt {n}: the GPU's first draft {} is no near-tie of the reference's {want}",
            got[0]
        );
        // The later drafts (the head on its own output, one row at a time): each against the
        // reference's step on the GPU's draft before it, so that a near-tie taken the other
        // way does not end the comparison.
        let hd = w.config.hidden_size;
        let mut own = normed[normed.len() - hd..].to_vec();
        for j in 1..got.len() {
            let (normed, logits) = mtp::forward(
                &w,
                head,
                &own,
                &[got[j - 1]],
                n + j - 1,
                &mut kv,
                Logits::Last,
            );
            let want = argmax(&logits);
            let gap = top_gap(&logits, want, got[j]);
            assert!(
                gap <= TOLERANCE,
                "prompt {n}: the GPU's draft {j} {} is no near-tie of the reference's {want} \
                 ({gap:.2e})",
                got[j]
            );
            own = normed;
        }
        gpu.free_sequence(seq);
    }
}

#[test]
fn greedy_output_with_drafts_is_plain_gpu_decodings_up_to_near_ties() {
    let mut rng = Rng::new("greedy_output_with_drafts_is_plain_gpu_decodings_up_to_near_ties");
    let w = weights(&mut rng);
    let mut gpu = gpu(&w);
    let n = 32;
    for (round, (k, wrong)) in [(1, 0.0), (2, 0.3), (3, 0.0), (4, 1.0)]
        .into_iter()
        .enumerate()
    {
        let p = prompt(&mut rng, 20 + 50 * round);
        // Plain decoding, with each step's logits.
        let seq = 2 * round as SeqId;
        gpu.create_sequence(seq).unwrap();
        let mut logits = vec![gpu.forward(seq, &p).unwrap()];
        let mut plain = vec![argmax(&logits[0])];
        while plain.len() < n {
            logits.push(gpu.forward(seq, &plain[plain.len() - 1..]).unwrap());
            plain.push(argmax(logits.last().unwrap()));
        }
        gpu.free_sequence(seq);
        let truth = p.iter().chain(&plain).copied().collect();
        let mut oracle = ForcedDrafts::new(&mut gpu, truth, 1.0 - wrong, rng.next_u64());
        let seq = seq + 1;
        oracle.create_sequence(seq).unwrap();
        let (drafted, stats) = speculative::greedy(&mut oracle, seq, &p, n, k, |_| false).unwrap();
        oracle.free_sequence(seq);
        println!("k {k}, wrong {wrong}: {stats:?}");
        assert_eq!(drafted.len(), n);
        if wrong == 0.0 {
            assert!(stats.accepted > 0, "right drafts are accepted");
        }
        if let Some(i) = (0..n).find(|&i| drafted[i] != plain[i]) {
            let gap = top_gap(&logits[i], plain[i], drafted[i]);
            println!(
                "k {k}: diverges at {i}: plain {} vs {}, gap {gap:.2e}",
                plain[i], drafted[i]
            );
            assert!(
                gap <= TOLERANCE,
                "a divergence at {i} that is no near-tie ({gap:.2e})"
            );
        }
    }
}

#[test]
fn a_cut_back_verify_pass_leaves_the_state_plain_decoding_reaches() {
    let mut rng = Rng::new("a_cut_back_verify_pass_leaves_the_state_plain_decoding_reaches");
    let w = weights(&mut rng);
    for verify in [VerifyPass::Rows, VerifyPass::Span] {
        println!("verify passes as {verify:?}");
        cut_back(&mut rng, &w, &mut gpu_with(&w, verify));
    }
}

/// Verify passes of 4 rows cut back to each length, on `gpu`: the logits after it are plain
/// decoding's, and the drafts after it the reference's.
fn cut_back(rng: &mut Rng, w: &Weights, gpu: &mut CudaBackend) {
    let p = prompt(rng, 60);
    let rows = prompt(rng, 4);
    // The reference of the drafts after the cut back: the model's state after the prompt, and
    // the head's cache of its rows (as the first drafts below run them, rows[0] after it).
    let head = w.mtp.as_ref().unwrap();
    let mut prompted = SequenceState::new(&w.config);
    prompted.mtp = Some(MtpState::default());
    cpu::forward(w, &p, &mut prompted, Logits::Last);
    let hidden = prompted.mtp.replace(MtpState::default()).unwrap().pending;
    let following: Vec<u32> = p[1..].iter().copied().chain([rows[0]]).collect();
    let mut prompt_kv = KvCache::default();
    mtp::forward(
        w,
        head,
        &hidden,
        &following,
        0,
        &mut prompt_kv,
        Logits::Last,
    );
    for kept in 1..=4 {
        gpu.create_sequence(0).unwrap();
        gpu.forward(0, &p).unwrap();
        for &t in &rows[..kept] {
            gpu.forward(0, &[t]).unwrap();
        }
        let next = 7;
        let want = gpu.forward(0, &[next]).unwrap();
        gpu.free_sequence(0);

        gpu.create_sequence(1).unwrap();
        gpu.start_drafting(1).unwrap();
        gpu.forward(1, &p).unwrap();
        gpu.draft(1, rows[0], 3).unwrap();
        let vocab = w.config.vocab_size;
        if kept % 2 == 1 {
            let all = gpu.forward_verify(1, &rows).unwrap();
            assert_eq!(all.len(), rows.len() * vocab);
        } else {
            // The picks on the device (greedy below a limit, as a real tokenizer's) are the
            // argmax of each row's logits, which stay there until the cut back.
            let limit = vocab - 7;
            let picks = gpu.forward_verify_argmax(1, &rows, limit).unwrap();
            for (r, &pick) in picks.iter().enumerate() {
                let logits = gpu.verified_logits(1, r).unwrap();
                assert_eq!(pick, argmax(&logits[..limit]), "row {r}");
            }
        }
        gpu.keep_verified(1, kept).unwrap();
        assert!(gpu.verified_logits(1, 0).is_err(), "the pass is cut back");
        let got = gpu.forward(1, &[next]).unwrap();
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let err = got
            .iter()
            .zip(&want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
            / scale;
        println!("kept {kept} of 4: logits after it rel. error {err:.2e}");
        assert!(err <= TOLERANCE, "kept {kept}: {err:.2e}");
        // Drafting goes on from the kept rows and `next`, as the reference's: the model over
        // the kept rows and `next`, then the head over them from the prompt's end.
        let mut state = prompted.clone();
        cpu::forward_verify(w, &rows[..kept], &mut state);
        let pick = argmax(&cpu::forward(w, &[next], &mut state, Logits::Last));
        let pending = state.mtp.take().unwrap().pending;
        let following: Vec<u32> = rows[1..kept].iter().copied().chain([next, pick]).collect();
        let mut kv = prompt_kv.clone();
        let (_, logits) = mtp::forward(
            w,
            head,
            &pending,
            &following,
            p.len(),
            &mut kv,
            Logits::Last,
        );
        let want = argmax(&logits);
        let drafts = gpu.draft(1, pick, 2).unwrap();
        let gap = top_gap(&logits, want, drafts[0]);
        println!(
            "kept {kept}: draft after it cpu {want} gpu {} (gap {gap:.2e})",
            drafts[0]
        );
        assert!(
            gap <= TOLERANCE,
            "kept {kept}: the GPU's draft {} is no near-tie of the reference's {want}",
            drafts[0]
        );
        gpu.free_sequence(1);
    }
}

/// One verify pass is open at a time (the GDN states it keeps are the backend's): a second
/// sequence's pass is refused until the first is cut back, then runs, with the first's logits
/// bit for bit (the same state and rows). Another sequence's step while a pass is open leaves
/// its cut back right, but its logits are gone (refused, not another pass's rows).
#[test]
fn a_second_verify_pass_waits_for_the_first_to_be_cut_back() {
    let mut rng = Rng::new("a_second_verify_pass_waits_for_the_first_to_be_cut_back");
    let w = weights(&mut rng);
    let mut gpu = gpu(&w);
    let p = prompt(&mut rng, 40);
    let rows = prompt(&mut rng, 3);
    for seq in [0, 1] {
        gpu.create_sequence(seq).unwrap();
        gpu.start_drafting(seq).unwrap();
        gpu.forward(seq, &p).unwrap();
        gpu.draft(seq, rows[0], 2).unwrap();
    }
    let first = gpu.forward_verify(0, &rows).unwrap();
    let err = gpu.forward_verify(1, &rows).unwrap_err();
    assert!(format!("{err:#}").contains("one at a time"), "{err:#}");
    gpu.keep_verified(0, 2).unwrap();
    let second = gpu.forward_verify(1, &rows).unwrap();
    assert_eq!(first, second, "the same pass over the same state");
    // Sequence 0 steps while sequence 1's pass is open.
    let a = gpu.forward(0, &[5]).unwrap();
    let err = gpu.verified_logits(1, 0).unwrap_err();
    assert!(format!("{err:#}").contains("overwritten"), "{err:#}");
    gpu.keep_verified(1, 2).unwrap();
    // Both cut back to the same rows after the same prompt: the same next logits.
    let b = gpu.forward(1, &[5]).unwrap();
    assert_eq!(
        a, b,
        "the refused pass and the other's step changed nothing"
    );
}

/// A prefix-cache snapshot of a drafting sequence taken mid-prompt (its head has run over none
/// of the prompt yet) and restored into another sequence: the drafts after the rest of the
/// prompt are those of the sequence that never stopped, bit for bit (the same kernels over the
/// same rows). Without the head's pending rows in the snapshot, the restored head would read
/// cache rows never written.
#[test]
fn drafts_after_a_prefix_cache_restore_are_those_without_it() {
    let mut rng = Rng::new("drafts_after_a_prefix_cache_restore_are_those_without_it");
    let w = weights(&mut rng);
    let mut gpu = gpu(&w);
    for cut in [1, 120, 299] {
        // A prompt of its own each time: the slots' head cache rows of an earlier prompt would
        // otherwise be right by chance.
        let p = prompt(&mut rng, 300);
        let next = rng.below(2000) as u32;
        gpu.create_sequence(0).unwrap();
        gpu.start_drafting(0).unwrap();
        gpu.forward(0, &p[..cut]).unwrap();
        let saved = gpu.snapshot(0).unwrap();
        gpu.forward(0, &p[cut..]).unwrap();
        let want = gpu.draft(0, next, 3).unwrap();
        gpu.free_sequence(0);

        gpu.create_sequence(1).unwrap();
        gpu.start_drafting(1).unwrap();
        assert_eq!(gpu.restore(saved.id, 1).unwrap(), cut);
        gpu.forward(1, &p[cut..]).unwrap();
        let got = gpu.draft(1, next, 3).unwrap();
        gpu.free_sequence(1);
        gpu.drop_snapshot(saved.id);
        assert_eq!(
            got,
            want,
            "snapshot after {cut} of {} prompt tokens",
            p.len()
        );
    }
}

/// The engine on the GPU with drafts (the fixed schedule: every step of up to 4 requests that
/// all decode drafts, each in a pass of its own): 4 requests at once, their prompts longer than
/// a drafting sequence's first buffer of hidden rows (it grows), then a second turn of one of
/// them restored from the prefix cache. Every request ends with its tokens, and drafted passes
/// ran while they decoded together and in the restored turn (what the tokens are is checked
/// against plain decoding in the tests above).
#[test]
fn the_engine_drafts_for_several_requests_on_the_gpu() {
    use lily::engine::{
        greedy_device_sampler, greedy_sampler, DraftSchedule, Engine, EngineOptions, Event,
        GenerateRequest,
    };
    let mut rng = Rng::new("the_engine_drafts_for_several_requests_on_the_gpu");
    let w = weights(&mut rng);
    let vocab = w.config.vocab_size;
    let dev = CudaDevice::new(0).expect("a CUDA GPU (run through scripts/gpu-check.sh)");
    let model = CudaModel::upload(&dev, &w).unwrap();
    let options = CudaOptions {
        max_sequences: 4,
        max_context: 4096,
        prefill_chunk: 512,
        ..CudaOptions::default()
    };
    let engine = Engine::start(
        Box::new(CudaBackend::new(dev, model, options).unwrap()),
        EngineOptions {
            prefill_chunk: 512,
            max_sequences: 4,
            prefix_cache_bytes: 1 << 30,
            draft_tokens: 3,
            draft_schedule: DraftSchedule::Fixed,
            ..EngineOptions::default()
        },
    );
    let run = |prompt: Vec<u32>, n: usize| {
        engine.submit(GenerateRequest {
            prompt,
            max_tokens: n,
            stop_token_ids: vec![],
            sampler: greedy_sampler(),
            prompt_cache_key: None,
            device_sampler: Some(greedy_device_sampler(vocab)),
            prompt_logprobs: None,
            draft: true,
        })
    };
    let collect = |mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>| {
        let mut ids = vec![];
        loop {
            match rx.blocking_recv().expect("an event") {
                Event::Token(t) => ids.push(t.id),
                Event::Done { cached_tokens, .. } => return (ids, cached_tokens),
                Event::Error(e) => panic!("{e}"),
                _ => {}
            }
        }
    };
    let prompts: Vec<Vec<u32>> = (0..4).map(|_| prompt(&mut rng, 1500)).collect();
    let rxs: Vec<_> = prompts.iter().map(|p| run(p.clone(), 24)).collect();
    let answers: Vec<Vec<u32>> = (rxs.into_iter())
        .map(|rx| {
            let (ids, _) = collect(rx);
            assert_eq!(ids.len(), 24);
            ids
        })
        .collect();
    let passes = engine
        .stats()
        .draft_passes_total
        .load(std::sync::atomic::Ordering::Relaxed);
    assert!(passes > 0, "no drafted passes");
    // A second turn of the first conversation: restored, then drafting on.
    let turn: Vec<u32> = prompts[0]
        .iter()
        .chain(&answers[0])
        .copied()
        .chain(prompt(&mut rng, 30))
        .collect();
    let (ids, cached) = collect(run(turn, 16));
    assert_eq!(ids.len(), 16);
    assert!(cached > 0, "the first turn's state is restored");
    let after = engine
        .stats()
        .draft_passes_total
        .load(std::sync::atomic::Ordering::Relaxed);
    assert!(after > passes, "the second turn drafts too");
}
