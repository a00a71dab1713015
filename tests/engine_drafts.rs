//! The engine's decode steps with drafts (src/engine/scheduler.rs, `decode_with_drafts`): a
//! greedy request decoding alone checks the MTP head's drafts in each pass, and its output is
//! what decoding without drafts gives, whatever the drafts, wherever its stop token or length
//! ends it, with the prefix cache's states restored and beside other requests.

mod common;

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use common::{fixture_dir, Rng};
use lily::checkpoint;
use lily::config::ModelConfig;
use lily::engine::{
    greedy_device_sampler, greedy_sampler, DeviceSampler, DraftSchedule, Engine, EngineOptions,
    Event, FinishReason, GenerateRequest, SampledToken,
};
use lily::model::cpu::{forward, Logits};
use lily::model::{
    argmax, Backend, CpuBackend, SeqId, SequenceState, Snapshot, SnapshotId, Weights,
};
use lily::sampling::{DeviceSampling, Sampler, SamplingParams};

fn weights() -> Weights {
    checkpoint::load(&fixture_dir("tiny-a-mtp")).unwrap()
}

/// Plain greedy decoding of `n` tokens after `context`, one token a step.
fn alone(w: &Weights, context: &[u32], n: usize) -> Vec<u32> {
    let mut s = SequenceState::new(&w.config);
    let mut logits = forward(w, context, &mut s, Logits::Last);
    let mut out = vec![];
    for _ in 0..n {
        out.push(argmax(&logits));
        logits = forward(w, &out[out.len() - 1..], &mut s, Logits::Last);
    }
    out
}

/// The CPU backend, its drafts replaced by plain greedy decoding's next tokens, each made wrong
/// with probability `wrong` (the head still runs): every number of accepted drafts happens.
struct Oracle {
    inner: CpuBackend,
    weights: Weights,
    /// Each sequence's tokens run so far (a verify pass's once cut back), and each snapshot's.
    run: HashMap<SeqId, Vec<u32>>,
    saved: HashMap<SnapshotId, Vec<u32>>,
    verifying: HashMap<SeqId, Vec<u32>>,
    wrong: f64,
    rng: Rng,
    /// Drafting fails (as a device out of drafting slots does).
    refuse: bool,
}

impl Backend for Oracle {
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }
    fn device_name(&self) -> String {
        "oracle".into()
    }
    fn create_sequence(&mut self, seq: SeqId) -> anyhow::Result<()> {
        self.run.insert(seq, Vec::new());
        self.inner.create_sequence(seq)
    }
    fn free_sequence(&mut self, seq: SeqId) {
        self.run.remove(&seq);
        self.inner.free_sequence(seq)
    }
    fn forward(&mut self, seq: SeqId, tokens: &[u32]) -> anyhow::Result<Vec<f32>> {
        let logits = self.inner.forward(seq, tokens)?;
        self.run.get_mut(&seq).unwrap().extend_from_slice(tokens);
        Ok(logits)
    }
    fn can_snapshot(&self) -> bool {
        true
    }
    fn snapshot(&mut self, seq: SeqId) -> anyhow::Result<Snapshot> {
        let s = self.inner.snapshot(seq)?;
        self.saved.insert(s.id, self.run[&seq].clone());
        Ok(s)
    }
    fn restore(&mut self, snapshot: SnapshotId, seq: SeqId) -> anyhow::Result<usize> {
        let at = self.inner.restore(snapshot, seq)?;
        self.run.insert(seq, self.saved[&snapshot].clone());
        Ok(at)
    }
    fn drop_snapshot(&mut self, snapshot: SnapshotId) {
        self.saved.remove(&snapshot);
        self.inner.drop_snapshot(snapshot)
    }
    fn can_draft(&self) -> bool {
        true
    }
    fn start_drafting(&mut self, seq: SeqId) -> anyhow::Result<()> {
        self.inner.start_drafting(seq)
    }
    fn draft(&mut self, seq: SeqId, next: u32, k: usize) -> anyhow::Result<Vec<u32>> {
        anyhow::ensure!(!self.refuse, "no drafts here");
        assert_eq!(self.inner.draft(seq, next, k)?.len(), k);
        let context: Vec<u32> = self.run[&seq].iter().copied().chain([next]).collect();
        let vocab = self.config().vocab_size as u32;
        Ok(alone(&self.weights, &context, k)
            .into_iter()
            .map(|t| {
                if self.rng.uniform() < self.wrong {
                    (t + 1) % vocab
                } else {
                    t
                }
            })
            .collect())
    }
    fn forward_verify_argmax(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        vocab_limit: usize,
    ) -> anyhow::Result<Vec<u32>> {
        self.verifying.insert(seq, tokens.to_vec());
        self.inner.forward_verify_argmax(seq, tokens, vocab_limit)
    }
    fn verified_logits(&mut self, seq: SeqId, row: usize) -> anyhow::Result<Vec<f32>> {
        self.inner.verified_logits(seq, row)
    }
    fn forward_verify(&mut self, seq: SeqId, tokens: &[u32]) -> anyhow::Result<Vec<f32>> {
        self.verifying.insert(seq, tokens.to_vec());
        self.inner.forward_verify(seq, tokens)
    }
    fn keep_verified(&mut self, seq: SeqId, rows: usize) -> anyhow::Result<()> {
        let tokens = self.verifying.remove(&seq).unwrap();
        self.run
            .get_mut(&seq)
            .unwrap()
            .extend_from_slice(&tokens[..rows]);
        self.inner.keep_verified(seq, rows)
    }
}

fn request(prompt: Vec<u32>, max_tokens: usize, stop: Vec<u32>, vocab: usize) -> GenerateRequest {
    GenerateRequest {
        prompt,
        max_tokens,
        stop_token_ids: stop,
        sampler: greedy_sampler(),
        prompt_cache_key: None,
        device_sampler: Some(greedy_device_sampler(vocab)),
        prompt_logprobs: None,
        draft: true,
    }
}

fn collect(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
) -> (Vec<u32>, Option<FinishReason>, usize) {
    let mut ids = vec![];
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Token(t) => ids.push(t.id),
            Event::Done {
                reason,
                completion_tokens,
                cached_tokens,
                ..
            } => {
                assert_eq!(completion_tokens, ids.len());
                return (ids, Some(reason), cached_tokens);
            }
            Event::Error(e) => panic!("{e}"),
            _ => {}
        }
    }
    panic!("the request ended without Done")
}

/// Three drafts every pass (`DraftSchedule::Fixed`), whatever they cost.
fn drafting_engine(wrong: f64, rng: &mut Rng, prefix_cache_bytes: u64) -> (Engine, Weights) {
    engine_over(wrong, rng, prefix_cache_bytes, false, DraftSchedule::Fixed)
}

fn engine_over(
    wrong: f64,
    rng: &mut Rng,
    prefix_cache_bytes: u64,
    refuse: bool,
    draft_schedule: DraftSchedule,
) -> (Engine, Weights) {
    let w = weights();
    let oracle = Oracle {
        inner: CpuBackend::new(w.clone()),
        weights: w.clone(),
        run: HashMap::new(),
        saved: HashMap::new(),
        verifying: HashMap::new(),
        wrong,
        rng: Rng::new(&format!("oracle drafts {}", rng.next_u64())),
        refuse,
    };
    let engine = Engine::start(
        Box::new(oracle),
        EngineOptions {
            prefill_chunk: 8,
            max_sequences: 3,
            prefix_cache_bytes,
            draft_tokens: 3,
            draft_schedule,
            ..EngineOptions::default()
        },
    );
    (engine, w)
}

#[test]
fn a_request_decoding_alone_with_drafts_gives_the_plain_output() {
    let mut rng = Rng::new("a_request_decoding_alone_with_drafts_gives_the_plain_output");
    for wrong in [0.0, 0.3, 1.0] {
        let (engine, w) = drafting_engine(wrong, &mut rng, 0);
        let vocab = w.config.vocab_size;
        for _ in 0..4 {
            let prompt: Vec<u32> = (0..1 + rng.below(20))
                .map(|_| rng.below(vocab) as u32)
                .collect();
            let n = 1 + rng.below(30);
            let want = alone(&w, &prompt, n);
            let (got, reason, _) =
                collect(engine.submit(request(prompt.clone(), n, vec![], vocab)));
            assert_eq!(got, want, "wrong {wrong}, prompt {prompt:?}");
            assert_eq!(reason, Some(FinishReason::Length));
            // A stop token wherever it falls, inside a pass's accepted drafts or not.
            let at = rng.below(n);
            let stop = want[at];
            let first = want.iter().position(|&t| t == stop).unwrap();
            let (got, reason, _) = collect(engine.submit(request(prompt, n, vec![stop], vocab)));
            assert_eq!(got, want[..=first], "wrong {wrong}: stop at {first}");
            assert_eq!(reason, Some(FinishReason::Stop));
        }
        let stats = engine.stats();
        let passes = stats.draft_passes_total.load(Ordering::Relaxed);
        let drafted = stats.draft_tokens_total.load(Ordering::Relaxed);
        let accepted = stats.accepted_draft_tokens_total.load(Ordering::Relaxed);
        println!("wrong {wrong}: {passes} passes, {accepted} of {drafted} drafts accepted");
        assert!(passes > 0);
        if wrong == 0.0 {
            // Right drafts are all accepted, but for those after a stop token (at most 3 for
            // each of the 4 requests with one).
            assert!(accepted > 0 && drafted - accepted <= 4 * 3);
        }
        if wrong == 1.0 {
            assert_eq!(accepted, 0);
        }
    }
}

/// The adaptive schedule (the server's default): output unchanged whatever lengths it picks;
/// each position's accepted drafts counted (no more at a position than at the one before it,
/// all of them together the accepted total); and drafts that never stand, from a backend whose
/// drafts cost far more than a step (this oracle decodes the whole context again for them), are
/// soon left for plain steps.
#[test]
fn the_adaptive_schedule_changes_no_output_and_leaves_drafts_that_fail() {
    let mut rng = Rng::new("the_adaptive_schedule_changes_no_output_and_leaves_drafts_that_fail");
    for wrong in [0.0, 0.4, 1.0] {
        let (engine, w) = engine_over(wrong, &mut rng, 0, false, DraftSchedule::Adaptive);
        let vocab = w.config.vocab_size;
        let mut tokens = 0;
        for _ in 0..3 {
            let prompt: Vec<u32> = (0..1 + rng.below(12))
                .map(|_| rng.below(vocab) as u32)
                .collect();
            let n = 40 + rng.below(20);
            let (got, _, _) = collect(engine.submit(request(prompt.clone(), n, vec![], vocab)));
            assert_eq!(
                got,
                alone(&w, &prompt, n),
                "wrong {wrong}, prompt {prompt:?}"
            );
            tokens += n;
        }
        let stats = engine.stats();
        let passes = stats.draft_passes_total.load(Ordering::Relaxed);
        let accepted = stats.accepted_draft_tokens_total.load(Ordering::Relaxed);
        let at: Vec<u64> = (stats.accepted_per_position.iter())
            .map(|a| a.load(Ordering::Relaxed))
            .collect();
        println!("wrong {wrong}: {passes} passes with drafts of {tokens} tokens, accepted {at:?}");
        assert_eq!(stats.draft_positions.load(Ordering::Relaxed), 3);
        assert_eq!(at.iter().sum::<u64>(), accepted);
        assert!(at.windows(2).all(|w| w[1] <= w[0]), "{at:?}");
        assert!(
            at[3..].iter().all(|&a| a == 0),
            "only 3 drafts a pass: {at:?}"
        );
        if wrong == 1.0 {
            assert_eq!(accepted, 0);
            // Each length tried once, then now and then a hopeful retry.
            assert!(
                passes as usize <= tokens / 4,
                "{passes} passes of {tokens} tokens"
            );
        }
    }
}

#[test]
fn drafts_beside_other_requests_and_the_prefix_cache_change_no_output() {
    let mut rng = Rng::new("drafts_beside_other_requests_and_the_prefix_cache_change_no_output");
    let (engine, w) = drafting_engine(0.25, &mut rng, 64 << 20);
    let vocab = w.config.vocab_size;
    let prompts: Vec<Vec<u32>> = (0..3)
        .map(|i| (0..10 + 7 * i).map(|_| rng.below(vocab) as u32).collect())
        .collect();
    let lengths = [5, 25, 40];
    // Together: the shorter ones end first, and the last one decodes alone (with drafts).
    let rxs: Vec<_> = prompts
        .iter()
        .zip(lengths)
        .map(|(p, n)| engine.submit(request(p.clone(), n, vec![], vocab)))
        .collect();
    for ((rx, p), n) in rxs.into_iter().zip(&prompts).zip(lengths) {
        assert_eq!(collect(rx).0, alone(&w, p, n));
    }
    assert!(engine.stats().draft_passes_total.load(Ordering::Relaxed) > 0);
    // A second turn: the first turn's state comes from the prefix cache (a drafting
    // sequence's), and decoding goes on with drafts from there.
    let first = alone(&w, &prompts[2], 40);
    let turn: Vec<u32> = prompts[2]
        .iter()
        .chain(&first)
        .copied()
        .chain([3, 4, 5])
        .collect();
    let (got, _, cached) = collect(engine.submit(request(turn.clone(), 20, vec![], vocab)));
    assert!(cached > 0, "the first turn's state is restored");
    assert_eq!(got, alone(&w, &turn, 20));
}

/// Requests decoding together (no more than MAX_DRAFT_STREAMS) draft too, each in a pass of its
/// own (the fixed schedule: every step), and each one's output is its plain greedy output.
/// Three prompts of one length start and decode together: without drafting together they would
/// step in one batch to the end and never draft.
#[test]
fn requests_decoding_together_each_draft_in_a_pass_of_their_own() {
    let mut rng = Rng::new("requests_decoding_together_each_draft_in_a_pass_of_their_own");
    let (engine, w) = drafting_engine(0.3, &mut rng, 0);
    let vocab = w.config.vocab_size;
    let n = 30;
    let prompts: Vec<Vec<u32>> = (0..3)
        .map(|_| (0..8).map(|_| rng.below(vocab) as u32).collect())
        .collect();
    let rxs: Vec<_> = (prompts.iter())
        .map(|p| engine.submit(request(p.clone(), n, vec![], vocab)))
        .collect();
    for (rx, p) in rxs.into_iter().zip(&prompts) {
        assert_eq!(collect(rx).0, alone(&w, p, n));
    }
    let passes = engine.stats().draft_passes_total.load(Ordering::Relaxed);
    // Each request's passes yield at most 4 tokens (3 drafts and the next).
    assert!(
        passes >= 3 * (n as u64 - 1) / 4,
        "{passes} passes with drafts"
    );
}

#[test]
fn a_backend_that_drafts_nothing_leaves_the_request_decoding_without_drafts() {
    let mut rng =
        Rng::new("a_backend_that_drafts_nothing_leaves_the_request_decoding_without_drafts");
    let (engine, w) = engine_over(0.0, &mut rng, 0, true, DraftSchedule::Fixed);
    let vocab = w.config.vocab_size;
    let prompt: Vec<u32> = (0..12).map(|_| rng.below(vocab) as u32).collect();
    let (got, reason, _) = collect(engine.submit(request(prompt.clone(), 16, vec![], vocab)));
    assert_eq!(got, alone(&w, &prompt, 16));
    assert_eq!(reason, Some(FinishReason::Length));
    assert_eq!(engine.stats().draft_passes_total.load(Ordering::Relaxed), 0);
}

/// A request's sampler on the device every step, as the server's device half of it.
struct OnDevice(std::sync::Arc<std::sync::Mutex<Sampler>>);

impl DeviceSampler for OnDevice {
    fn device_step(&mut self) -> Option<(DeviceSampling, f64)> {
        self.0.lock().unwrap().device_step(usize::MAX)
    }
    fn accept(&mut self, token: u32) -> SampledToken {
        self.0.lock().unwrap().record(token);
        SampledToken {
            id: token,
            logprob: None,
            top_logprobs: Vec::new(),
        }
    }
}

/// Sampled requests with drafts: the second token comes out of a verify pass (the first
/// draft kept with its probability, else another drawn without it), and the two tokens' joint
/// distribution over many seeds is the one sampling without drafts has, computed from the
/// reference's logits.
#[test]
fn sampled_tokens_with_drafts_keep_their_distribution() {
    let mut rng = Rng::new("sampled_tokens_with_drafts_keep_their_distribution");
    let (engine, w) = drafting_engine(0.0, &mut rng, 0);
    let vocab = w.config.vocab_size;
    let prompt: Vec<u32> = (0..9).map(|_| rng.below(vocab) as u32).collect();
    let params = SamplingParams {
        temperature: 1.0,
        top_k: Some(3),
        ..SamplingParams::default()
    };
    // The exact joint distribution of the first two tokens.
    let sampling = DeviceSampling {
        temperature: 1.0,
        top_k: Some(3),
        ..DeviceSampling::greedy(vocab)
    };
    let after = |context: &[u32]| {
        let mut s = SequenceState::new(&w.config);
        let logits = forward(&w, context, &mut s, Logits::Last);
        sampling.distribution(&logits).unwrap()
    };
    let mut want: HashMap<(u32, u32), f64> = HashMap::new();
    for (t1, p1) in after(&prompt) {
        let context: Vec<u32> = prompt.iter().copied().chain([t1]).collect();
        for (t2, p2) in after(&context) {
            want.insert((t1, t2), p1 * p2);
        }
    }
    let n = 2000;
    let mut seen: HashMap<(u32, u32), usize> = HashMap::new();
    for _ in 0..n {
        let params = SamplingParams {
            seed: Some(rng.next_u64()),
            ..params.clone()
        };
        let sampler = std::sync::Arc::new(std::sync::Mutex::new(Sampler::new(&params, &prompt)));
        let device = OnDevice(sampler.clone());
        let (ids, _, _) = collect(engine.submit(GenerateRequest {
            prompt: prompt.clone(),
            // After the first token two are left: one draft, checked by the second.
            max_tokens: 3,
            stop_token_ids: vec![],
            sampler: Box::new(move |logits: &mut [f32], _: &[u32]| SampledToken {
                id: sampler.lock().unwrap().sample(logits).unwrap().token,
                logprob: None,
                top_logprobs: Vec::new(),
            }),
            prompt_cache_key: None,
            device_sampler: Some(Box::new(device)),
            prompt_logprobs: None,
            draft: true,
        }));
        *seen.entry((ids[0], ids[1])).or_default() += 1;
    }
    let stats = engine.stats();
    assert_eq!(stats.draft_passes_total.load(Ordering::Relaxed), n as u64);
    let accepted = stats.accepted_draft_tokens_total.load(Ordering::Relaxed);
    println!("{accepted} of {n} drafts kept; cells {want:?}");
    assert!(
        accepted > 0 && accepted < n as u64,
        "drafts both kept and replaced"
    );
    for (cell, &count) in &seen {
        assert!(
            want.contains_key(cell),
            "{cell:?} drawn {count} times, probability 0"
        );
    }
    for (cell, &p) in &want {
        let freq = *seen.get(cell).unwrap_or(&0) as f64 / n as f64;
        let bound = 5.0 * (p * (1.0 - p) / n as f64).sqrt() + 1e-9;
        assert!(
            (freq - p).abs() <= bound,
            "{cell:?}: drawn {freq:.4}, probability {p:.4}"
        );
    }
}

/// Greedy on the device but every third step on the CPU (as a mask or a forced token makes it):
/// a pass whose later row the device cannot take hands that row's logits to the CPU sampler,
/// fetched from the verify pass, and the output is still plain decoding's.
struct EveryThirdOnCpu {
    vocab: usize,
    steps: usize,
}

impl DeviceSampler for EveryThirdOnCpu {
    fn device_step(&mut self) -> Option<(DeviceSampling, f64)> {
        self.steps += 1;
        (self.steps % 3 != 0).then(|| (DeviceSampling::greedy(self.vocab), 0.0))
    }
    fn accept(&mut self, token: u32) -> SampledToken {
        SampledToken {
            id: token,
            logprob: None,
            top_logprobs: Vec::new(),
        }
    }
}

#[test]
fn rows_the_device_cannot_pick_go_to_the_cpu_sampler_with_their_logits() {
    let mut rng = Rng::new("rows_the_device_cannot_pick_go_to_the_cpu_sampler_with_their_logits");
    let (engine, w) = drafting_engine(0.0, &mut rng, 0);
    let vocab = w.config.vocab_size;
    let prompt: Vec<u32> = (0..10).map(|_| rng.below(vocab) as u32).collect();
    let (got, _, _) = collect(engine.submit(GenerateRequest {
        device_sampler: Some(Box::new(EveryThirdOnCpu { vocab, steps: 0 })),
        ..request(prompt.clone(), 30, vec![], vocab)
    }));
    assert_eq!(got, alone(&w, &prompt, 30));
    assert!(engine.stats().draft_passes_total.load(Ordering::Relaxed) > 0);
}
