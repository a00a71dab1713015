//! Speculative decoding with the MTP head (src/model/speculative.rs, src/model/cpu/mtp.rs) on
//! random tiny checkpoints that carry an MTP head: greedy output with drafts is exactly plain
//! greedy decoding's, whatever the drafts, and the state a verify pass leaves behind is the one
//! plain decoding reaches.

mod common;

use common::Rng;
use lily::bench::drafts::ForcedDrafts;
use lily::checkpoint::{self, synth, tensor::DType};
use lily::config::ModelConfig;
use lily::model::cpu::{self, mtp, Logits};
use lily::model::speculative::{self, DraftStats};
use lily::model::state::KvCache;
use lily::model::{argmax, Backend, CpuBackend, SequenceState, Weights};

/// A random tiny model with an MTP head (fresh weights each run; the seed is printed).
fn model_with_mtp(rng: &mut Rng) -> Weights {
    let mut cfg = synth::preset("tiny").unwrap();
    cfg["text_config"]["mtp_num_hidden_layers"] = 1.into();
    let dir = tempfile::tempdir().unwrap();
    let seed = rng.next_u64();
    synth::write_checkpoint(&cfg, dir.path(), seed, DType::F32, 1 << 30, false).unwrap();
    let w = checkpoint::load(dir.path()).unwrap();
    assert!(w.mtp.is_some(), "the MTP head is loaded");
    w
}

fn plain_greedy(w: &Weights, prompt: &[u32], n: usize) -> (CpuBackend, Vec<u32>) {
    let mut b = CpuBackend::new(w.clone());
    b.create_sequence(0).unwrap();
    let mut out = vec![argmax(&b.forward(0, prompt).unwrap())];
    while out.len() < n {
        out.push(argmax(&b.forward(0, &out[out.len() - 1..]).unwrap()));
    }
    (b, out)
}

/// Bit-identical logits (reported by the first difference, not the whole vectors).
fn assert_same(a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len());
    if let Some(i) = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits()) {
        panic!("logit {i} differs: {} vs {}", a[i], b[i]);
    }
}

fn random_prompt(rng: &mut Rng, c: &ModelConfig) -> Vec<u32> {
    let len = 1 + rng.below(12);
    (0..len).map(|_| rng.below(c.vocab_size) as u32).collect()
}

#[test]
fn drafted_greedy_decoding_equals_plain_greedy_decoding() {
    let mut rng = Rng::new("drafted_greedy_decoding_equals_plain_greedy_decoding");
    let w = model_with_mtp(&mut rng);
    for k in 1..=4 {
        let prompt = random_prompt(&mut rng, &w.config);
        let n = 6 + rng.below(30);
        let (mut plain, expected) = plain_greedy(&w, &prompt, n);
        let mut b = CpuBackend::new(w.clone());
        b.create_sequence(0).unwrap();
        let (got, stats) = speculative::greedy(&mut b, 0, &prompt, n, k, |_| false).unwrap();
        assert_eq!(got, expected, "k = {k}, prompt {prompt:?}");
        assert!(stats.drafted > 0 && stats.passes < n, "{stats:?}");
        // The state left behind runs on exactly as plain decoding's.
        let last = [*got.last().unwrap()];
        assert_eq!(
            b.forward(0, &last).unwrap(),
            plain.forward(0, &last).unwrap()
        );
    }
}

#[test]
fn every_number_of_accepted_drafts_keeps_the_output_and_the_state_exact() {
    let mut rng = Rng::new("every_number_of_accepted_drafts_keeps_the_output_and_the_state_exact");
    let w = model_with_mtp(&mut rng);
    for (k, wrong) in [(1, 0.3), (2, 0.0), (3, 0.25), (4, 0.5), (6, 0.15)] {
        let prompt = random_prompt(&mut rng, &w.config);
        let n = 20 + rng.below(20);
        let (mut plain, expected) = plain_greedy(&w, &prompt, n);
        let mut cpu = CpuBackend::new(w.clone());
        let truth = prompt.iter().chain(&expected).copied().collect();
        let mut oracle = ForcedDrafts::new(&mut cpu, truth, 1.0 - wrong, rng.next_u64());
        oracle.create_sequence(0).unwrap();
        let (got, stats) = speculative::greedy(&mut oracle, 0, &prompt, n, k, |_| false).unwrap();
        let position = oracle.position();
        assert_eq!(got, expected[..n], "k = {k}, wrong {wrong}");
        let DraftStats {
            passes,
            drafted,
            accepted,
        } = stats;
        // Each pass yields its accepted drafts and one token of the model's own.
        assert_eq!(passes + accepted, n - 1, "{stats:?}");
        assert!(accepted <= drafted);
        if wrong == 0.0 {
            assert_eq!(accepted, drafted, "right drafts are all accepted");
        }
        // Continuing after the last token: identical logits, bit for bit.
        let last = [got[n - 1]];
        let a = cpu.forward(0, &last).unwrap();
        assert_same(&a, &plain.forward(0, &last).unwrap());
        // ... and drafting goes on from the kept rows (their MTP rows commit).
        assert_eq!(position + 1, prompt.len() + n);
    }
}

#[test]
fn a_stop_token_ends_the_output_where_plain_decoding_would() {
    let mut rng = Rng::new("a_stop_token_ends_the_output_where_plain_decoding_would");
    let w = model_with_mtp(&mut rng);
    let prompt = random_prompt(&mut rng, &w.config);
    let (_, expected) = plain_greedy(&w, &prompt, 24);
    let stop_at = 3 + rng.below(18);
    let stop = expected[stop_at];
    let first = expected.iter().position(|&t| t == stop).unwrap();
    let mut cpu = CpuBackend::new(w.clone());
    let truth = prompt.iter().chain(&expected).copied().collect();
    let mut oracle = ForcedDrafts::new(&mut cpu, truth, 1.0, rng.next_u64());
    oracle.create_sequence(0).unwrap();
    let (got, _) = speculative::greedy(&mut oracle, 0, &prompt, 24, 4, |t| t == stop).unwrap();
    assert_eq!(got, expected[..=first]);
}

#[test]
fn the_head_over_several_rows_equals_the_head_row_by_row() {
    let mut rng = Rng::new("the_head_over_several_rows_equals_the_head_row_by_row");
    let w = model_with_mtp(&mut rng);
    let head = w.mtp.as_ref().unwrap();
    let (hd, t) = (w.config.hidden_size, 2 + rng.below(8));
    let hidden: Vec<f32> = (0..t * hd).map(|_| rng.unit()).collect();
    let next: Vec<u32> = (0..t)
        .map(|_| rng.below(w.config.vocab_size) as u32)
        .collect();
    let empty = || KvCache {
        keys: Vec::new(),
        values: Vec::new(),
    };
    let mut kv = empty();
    let (normed, logits) = mtp::forward(&w, head, &hidden, &next, 0, &mut kv, Logits::All);
    let mut kv_rows = empty();
    for i in 0..t {
        let (n, l) = mtp::forward(
            &w,
            head,
            &hidden[i * hd..(i + 1) * hd],
            &next[i..=i],
            i,
            &mut kv_rows,
            Logits::All,
        );
        assert_eq!(n, normed[i * hd..(i + 1) * hd], "row {i}");
        let v = w.config.vocab_size;
        assert_eq!(l, logits[i * v..(i + 1) * v], "row {i}");
    }
    assert_eq!(kv, kv_rows);
}

#[test]
fn drafting_calls_out_of_order_are_errors_not_panics() {
    let mut rng = Rng::new("drafting_calls_out_of_order_are_errors_not_panics");
    let w = model_with_mtp(&mut rng);
    let mut b = CpuBackend::new(w.clone());
    b.create_sequence(0).unwrap();
    // Not a drafting sequence.
    assert!(b.draft(0, 1, 2).is_err());
    assert!(b.keep_verified(0, 1).is_err());
    b.forward(0, &[1, 2]).unwrap();
    let e = b.start_drafting(0).unwrap_err().to_string();
    assert!(e.contains("before its first token"), "{e}");
    b.create_sequence(1).unwrap();
    b.start_drafting(1).unwrap();
    let e = b.draft(1, 1, 2).unwrap_err().to_string();
    assert!(e.contains("no rows have run"), "{e}");
    b.forward(1, &[1, 2, 3]).unwrap();
    assert!(b.draft(1, 5_000, 2).is_err(), "out of the vocabulary");
    assert!(b.draft(1, 4, 0).is_err());
    let d = b.draft(1, 4, 2).unwrap();
    assert!(
        b.draft(1, 4, 2).is_err(),
        "the drafted rows are not run yet"
    );
    b.forward_verify(1, &[4, d[0], d[1]]).unwrap();
    assert!(
        b.forward(1, &[4]).is_err(),
        "the verify pass is not cut back yet"
    );
    let step = lily::model::Step {
        seq: 1,
        tokens: &[4],
        sample: None,
    };
    assert!(b.forward_batch(&[step])[0].is_err(), "nor in a batch");
    assert!(b.keep_verified(1, 0).is_err());
    assert!(b.keep_verified(1, 4).is_err());
    b.keep_verified(1, 2).unwrap();
    assert!(b.keep_verified(1, 1).is_err(), "cut back once");
    let d = b.draft(1, 7, 3).unwrap();
    // The argmax form: each row's pick below the limit is its logits' argmax there.
    let rows = [7, d[0], d[1], d[2]];
    let limit = w.config.vocab_size - 5;
    let picks = b.forward_verify_argmax(1, &rows, limit).unwrap();
    for (r, &pick) in picks.iter().enumerate() {
        assert_eq!(pick, argmax(&b.verified_logits(1, r).unwrap()[..limit]));
    }
    assert!(b.verified_logits(1, 4).is_err());
    b.keep_verified(1, 4).unwrap();
    assert!(b.verified_logits(1, 0).is_err(), "no pass open");
    // A model without the head.
    let mut cfg = synth::preset("tiny").unwrap();
    cfg["text_config"]["num_hidden_layers"] = 4.into();
    let dir = tempfile::tempdir().unwrap();
    synth::write_checkpoint(&cfg, dir.path(), rng.next_u64(), DType::F32, 1 << 30, false).unwrap();
    let mut plain = CpuBackend::new(checkpoint::load(dir.path()).unwrap());
    assert!(!plain.can_draft());
    plain.create_sequence(0).unwrap();
    let e = plain.start_drafting(0).unwrap_err().to_string();
    assert!(e.contains("no MTP head"), "{e}");
}

#[test]
fn a_verify_pass_gives_each_row_the_bits_of_one_token_decoding() {
    let mut rng = Rng::new("a_verify_pass_gives_each_row_the_bits_of_one_token_decoding");
    let w = model_with_mtp(&mut rng);
    let prompt = random_prompt(&mut rng, &w.config);
    let rows = random_prompt(&mut rng, &w.config);
    let mut one_by_one = SequenceState::new(&w.config);
    let mut verified = SequenceState::new(&w.config);
    cpu::forward(&w, &prompt, &mut one_by_one, Logits::Last);
    cpu::forward(&w, &prompt, &mut verified, Logits::Last);
    let expected: Vec<f32> = rows
        .iter()
        .flat_map(|&t| cpu::forward(&w, &[t], &mut one_by_one, Logits::Last))
        .collect();
    assert_same(&cpu::forward_verify(&w, &rows, &mut verified), &expected);
    assert_eq!(verified, one_by_one);
}
