//! The engine thread: interleaved (batched) requests give the same greedy output as each alone,
//! with and without the prefix cache; cancellation and bad requests don't disturb the others;
//! under a random load with random cancellations every request ends cleanly and the engine
//! returns to its baseline (no sequence, reservation or snapshot left behind).

mod common;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use common::fixture_dir;
use lily::checkpoint;
use lily::engine::{
    greedy_device_sampler, greedy_sampler, DeviceSampler, Engine, EngineOptions, Event,
    FinishReason, GenerateRequest, SampledToken,
};
use lily::model::cpu::{forward, Logits};
use lily::model::{
    Backend, CpuBackend, SeqId, SequenceState, Snapshot, SnapshotId, Step, StepOutput,
};
use lily::sampling::{DeviceSampling, Sampler, SamplingParams};
use rand::RngExt;

fn weights() -> lily::model::Weights {
    checkpoint::load(&fixture_dir("tiny-a")).unwrap()
}

fn engine(prefill_chunk: usize) -> (Engine, lily::model::Weights) {
    let w = weights();
    let e = Engine::start(
        Box::new(CpuBackend::new(w.clone())),
        EngineOptions {
            prefill_chunk,
            max_sequences: 3,
            ..EngineOptions::default()
        },
    );
    (e, w)
}

fn greedy(prompt: Vec<u32>, max_tokens: usize, key: Option<&str>) -> GenerateRequest {
    GenerateRequest {
        prompt,
        max_tokens,
        stop_token_ids: vec![],
        sampler: greedy_sampler(),
        prompt_cache_key: key.map(str::to_string),
        device_sampler: None,
        prompt_logprobs: None,
        draft: false,
    }
}

fn random_tokens(n: usize) -> Vec<u32> {
    let mut rng = rand::rng();
    (0..n).map(|_| rng.random_range(0..256)).collect()
}

fn alone(w: &lily::model::Weights, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut s = SequenceState::new(&w.config);
    let mut logits = forward(w, prompt, &mut s, Logits::Last);
    let mut out = vec![];
    for _ in 0..n {
        let best = lily::model::argmax(&logits);
        out.push(best);
        logits = forward(w, &[best], &mut s, Logits::Last);
    }
    out
}

fn collect(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
) -> (Vec<u32>, Option<FinishReason>, Option<String>) {
    let mut ids = vec![];
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Started { .. } | Event::PromptToken(_) => {}
            Event::Token(t) => ids.push(t.id),
            Event::Done {
                reason,
                completion_tokens,
                ..
            } => {
                assert_eq!(completion_tokens, ids.len());
                return (ids, Some(reason), None);
            }
            Event::Error(e) => return (ids, None, Some(e)),
        }
    }
    (ids, None, None)
}

/// A scored prompt (`prompt_logprobs`, what `echo` with `logprobs` asks for) reports every prompt
/// token after the first with the log-softmax of the reference's logits at the position before it
/// and the most likely alternatives, alongside other requests, and with the prefix cache on
/// (whose saved states a scored prompt must not skip over); then generates as usual.
#[test]
fn scored_prompts_match_the_reference_log_softmax() {
    let w = weights();
    let engine = Engine::start(
        Box::new(CpuBackend::new(w.clone())),
        EngineOptions {
            prefill_chunk: 8,
            max_sequences: 3,
            prefix_cache_bytes: 64 << 20,
            ..EngineOptions::default()
        },
    );
    let prompt = random_tokens(30);
    // The same prompt once unscored first, so the cache holds a state of it.
    let (_, reason, _) = collect(engine.submit(greedy(prompt.clone(), 2, None)));
    assert!(reason.is_some());
    let other = engine.submit(greedy(random_tokens(40), 6, None));
    let mut request = greedy(prompt.clone(), 3, None);
    request.prompt_logprobs = Some(4);
    let rx = engine.submit(request);
    let mut scored = Vec::new();
    let mut generated = Vec::new();
    let mut rx = rx;
    while let Some(event) = rx.blocking_recv() {
        match event {
            Event::PromptToken(t) => scored.push(t),
            Event::Token(t) => generated.push(t.id),
            Event::Done { cached_tokens, .. } => {
                assert_eq!(cached_tokens, 0, "a scored prompt runs every position");
                break;
            }
            Event::Started { .. } => {}
            Event::Error(e) => panic!("{e}"),
        }
    }
    let _ = collect(other);
    assert_eq!(scored.len(), prompt.len() - 1);
    let mut state = SequenceState::new(&w.config);
    let logits = forward(&w, &prompt, &mut state, Logits::All);
    let vocab = w.config.vocab_size;
    for (i, t) in scored.iter().enumerate() {
        assert_eq!(t.id, prompt[i + 1]);
        let row = &logits[i * vocab..(i + 1) * vocab];
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let log_z = max
            + row
                .iter()
                .map(|&l| (l as f64 - max).exp())
                .sum::<f64>()
                .ln();
        let want = row[t.id as usize] as f64 - log_z;
        let got = t.logprob.expect("a logprob") as f64;
        // The engine's positions ran one token at a time, the reference's as one chunk.
        assert!(
            (got - want).abs() < 2e-3,
            "position {}: {got} vs {want}",
            i + 1
        );
        assert_eq!(t.top_logprobs.len(), 4);
        let best = lily::model::argmax(row);
        assert_eq!(t.top_logprobs[0].0, best, "position {}", i + 1);
        assert!(t.top_logprobs.windows(2).all(|p| p[0].1 >= p[1].1));
    }
    assert_eq!(
        generated,
        alone(&w, &prompt, 3),
        "then it generates as usual"
    );
}

#[test]
fn interleaved_requests_match_each_run_alone() {
    let (engine, w) = engine(7);
    let prompts: Vec<Vec<u32>> = (0..6)
        .map(|i| {
            (0..(5 + 13 * i))
                .map(|j| ((j * 31 + i * 7) % 256) as u32)
                .collect()
        })
        .collect();
    let receivers: Vec<_> = prompts
        .iter()
        .map(|p| {
            engine.submit(GenerateRequest {
                prompt: p.clone(),
                max_tokens: 12,
                stop_token_ids: vec![],
                sampler: greedy_sampler(),
                prompt_cache_key: None,
                device_sampler: None,
                prompt_logprobs: None,
                draft: false,
            })
        })
        .collect();
    for (p, rx) in prompts.iter().zip(receivers) {
        let (ids, reason, err) = collect(rx);
        assert_eq!(err, None);
        assert_eq!(reason, Some(FinishReason::Length));
        assert_eq!(ids, alone(&w, p, 12), "prompt of {} tokens", p.len());
    }
}

#[test]
fn stop_tokens_end_generation() {
    let (engine, w) = engine(64);
    let prompt = vec![3, 1, 4, 1, 5];
    let expected = alone(&w, &prompt, 8);
    let stop = expected[4];
    let first = expected.iter().position(|&t| t == stop).unwrap();
    let (ids, reason, _) = collect(engine.submit(GenerateRequest {
        prompt,
        max_tokens: 8,
        stop_token_ids: vec![stop],
        sampler: greedy_sampler(),
        prompt_cache_key: None,
        device_sampler: None,
        prompt_logprobs: None,
        draft: false,
    }));
    assert_eq!(reason, Some(FinishReason::Stop));
    assert_eq!(ids, expected[..=first]);
}

#[test]
fn cancelled_and_bad_requests_leave_others_untouched() {
    let (engine, w) = engine(16);
    let dropped = engine.submit(GenerateRequest {
        prompt: vec![1; 40],
        max_tokens: 1000,
        stop_token_ids: vec![],
        sampler: greedy_sampler(),
        prompt_cache_key: None,
        device_sampler: None,
        prompt_logprobs: None,
        draft: false,
    });
    let bad = engine.submit(GenerateRequest {
        prompt: vec![1, 999_999],
        max_tokens: 4,
        stop_token_ids: vec![],
        sampler: greedy_sampler(),
        prompt_cache_key: None,
        device_sampler: None,
        prompt_logprobs: None,
        draft: false,
    });
    let panicking = engine.submit(GenerateRequest {
        prompt: vec![2, 3],
        max_tokens: 4,
        stop_token_ids: vec![],
        sampler: Box::new(|_: &mut [f32], _: &[u32]| panic!("sampler bug")),
        prompt_cache_key: None,
        device_sampler: None,
        prompt_logprobs: None,
        draft: false,
    });
    let good = engine.submit(GenerateRequest {
        prompt: vec![7, 8, 9],
        max_tokens: 6,
        stop_token_ids: vec![],
        sampler: greedy_sampler(),
        prompt_cache_key: None,
        device_sampler: None,
        prompt_logprobs: None,
        draft: false,
    });
    drop(dropped);
    let (_, _, err) = collect(bad);
    assert!(err.unwrap().contains("999999"));
    let (_, _, err) = collect(panicking);
    assert!(err.unwrap().contains("sampler bug"));
    let (ids, reason, _) = collect(good);
    assert_eq!(reason, Some(FinishReason::Length));
    assert_eq!(ids, alone(&w, &[7, 8, 9], 6));
    // Everything finished or was cancelled: nothing stays running.
    for _ in 0..200 {
        if engine
            .stats()
            .running
            .load(std::sync::atomic::Ordering::Relaxed)
            == 0
        {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    panic!("a cancelled request kept running");
}

/// Runs `collect` and also returns the `cached_tokens` of the Done event.
fn collect_cached(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
) -> (Vec<u32>, Option<FinishReason>, usize) {
    let mut ids = vec![];
    let mut started = None;
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Started { cached_tokens } => started = Some(cached_tokens),
            Event::PromptToken(_) => {}
            Event::Token(t) => ids.push(t.id),
            Event::Done {
                reason,
                cached_tokens,
                ..
            } => {
                assert_eq!(
                    started,
                    Some(cached_tokens),
                    "Started comes first, and agrees"
                );
                return (ids, Some(reason), cached_tokens);
            }
            Event::Error(e) => panic!("request failed: {e}"),
        }
    }
    panic!("the engine dropped a request")
}

#[test]
fn batches_within_a_token_budget_match_each_run_alone() {
    // Many sequences at once, small chunks and a batch budget smaller than all of them: decode
    // steps and prefill chunks of different sequences share batches. With a budget of 3
    // (`--batch-tokens 3`) the chunks shrink to the budget too.
    let w = weights();
    let mut rng = rand::rng();
    for budget in [12, 3] {
        let options = EngineOptions {
            prefill_chunk: 5,
            max_sequences: 8,
            ..EngineOptions::default()
        }
        .with_batch_tokens(budget);
        assert_eq!(
            (options.batch_tokens, options.prefill_chunk),
            (budget, budget.min(5))
        );
        let engine = Engine::start(Box::new(CpuBackend::new(w.clone())), options);
        let prompts: Vec<Vec<u32>> = (0..10)
            .map(|_| random_tokens(rng.random_range(1..40)))
            .collect();
        let receivers: Vec<_> = prompts
            .iter()
            .map(|p| engine.submit(greedy(p.clone(), 6, None)))
            .collect();
        for (p, rx) in prompts.iter().zip(receivers) {
            let (ids, reason, err) = collect(rx);
            assert_eq!((err, reason), (None, Some(FinishReason::Length)));
            assert_eq!(ids, alone(&w, p, 6), "budget {budget}, prompt {p:?}");
        }
    }
}

/// The CPU backend, recording the length of every step of every batch.
struct Batches {
    inner: CpuBackend,
    batches: Arc<Mutex<Vec<Vec<usize>>>>,
}

impl Backend for Batches {
    fn config(&self) -> &lily::config::ModelConfig {
        self.inner.config()
    }
    fn device_name(&self) -> String {
        "batch-recording cpu".into()
    }
    fn create_sequence(&mut self, seq: SeqId) -> anyhow::Result<()> {
        self.inner.create_sequence(seq)
    }
    fn free_sequence(&mut self, seq: SeqId) {
        self.inner.free_sequence(seq)
    }
    fn forward(&mut self, seq: SeqId, tokens: &[u32]) -> anyhow::Result<Vec<f32>> {
        self.inner.forward(seq, tokens)
    }
    fn forward_batch(&mut self, steps: &[Step]) -> Vec<anyhow::Result<StepOutput>> {
        let lens = steps.iter().map(|s| s.tokens.len()).collect();
        self.batches.lock().unwrap().push(lens);
        self.inner.forward_batch(steps)
    }
}

#[test]
fn decode_steps_ride_beside_the_prompt_budget() {
    // Two short prompts decode while two long ones read theirs: batches hold the whole budget
    // of prompt tokens (two chunks of 8) beside the decode steps.
    let w = weights();
    let (budget, sequences) = (16, 4);
    let options = EngineOptions {
        prefill_chunk: 8,
        max_sequences: sequences,
        ..EngineOptions::default()
    }
    .with_batch_tokens(budget);
    assert_eq!(options.pass_rows(), budget + sequences);
    let batches = Arc::new(Mutex::new(Vec::new()));
    let backend = Batches {
        inner: CpuBackend::new(w.clone()),
        batches: batches.clone(),
    };
    let engine = Engine::start(Box::new(backend), options);
    let prompts: Vec<(Vec<u32>, usize)> = vec![
        (random_tokens(5), 20),
        (random_tokens(5), 20),
        (random_tokens(60), 2),
        (random_tokens(60), 2),
    ];
    let receivers: Vec<_> = prompts
        .iter()
        .map(|(p, n)| engine.submit(greedy(p.clone(), *n, None)))
        .collect();
    for ((p, n), rx) in prompts.iter().zip(receivers) {
        let (ids, reason, err) = collect(rx);
        assert_eq!((err, reason), (None, Some(FinishReason::Length)));
        assert_eq!(ids, alone(&w, p, *n), "prompt {p:?}");
    }
    let batches = batches.lock().unwrap();
    for b in batches.iter() {
        let rows: usize = b.iter().sum();
        let prompt: usize = b.iter().filter(|&&l| l > 1).sum();
        assert!(rows <= budget + sequences, "a batch of {rows} rows: {b:?}");
        assert!(prompt <= budget, "{prompt} prompt tokens in a batch: {b:?}");
    }
    let full_beside_decode = |b: &&Vec<usize>| {
        b.iter().filter(|&&l| l > 1).sum::<usize>() == budget && b.iter().sum::<usize>() > budget
    };
    assert!(
        batches.iter().any(|b| full_beside_decode(&b)),
        "no batch held the whole budget beside decode steps: {batches:?}"
    );
}

#[test]
fn the_prefix_cache_changes_no_greedy_output() {
    // A conversation of 6 turns: each prompt is the previous prompt, the previous answer and a
    // new message. With the cache, later turns restore saved states and read only the rest.
    let w = weights();
    let engine = Engine::start(
        Box::new(CpuBackend::new(w.clone())),
        EngineOptions {
            prefill_chunk: 8,
            prefix_cache_bytes: 64 << 20,
            snapshot_interval: 16,
            ..EngineOptions::default()
        },
    );
    let mut prompt = random_tokens(20);
    for turn in 0..6 {
        let (ids, reason, cached) = collect_cached(engine.submit(greedy(prompt.clone(), 5, None)));
        assert_eq!(reason, Some(FinishReason::Length));
        assert_eq!(ids, alone(&w, &prompt, 5), "turn {turn}");
        if turn == 0 {
            assert_eq!(cached, 0);
        } else {
            // The previous turn saved its state after its 4th answer token (the 5th was never
            // fed), so all but that token and the new message is reused.
            assert_eq!(cached, prompt.len() - 1 - NEW_TOKENS, "turn {turn}");
        }
        prompt.extend_from_slice(&ids);
        prompt.extend(random_tokens(NEW_TOKENS));
    }
    // A different cache key shares nothing. The same prompt again restores the state saved
    // before its last token (which must run for the logits).
    let (ids, _, cached) = collect_cached(engine.submit(greedy(prompt.clone(), 3, Some("other"))));
    assert_eq!((ids, cached), (alone(&w, &prompt, 3), 0));
    let (ids, _, cached) = collect_cached(engine.submit(greedy(prompt.clone(), 3, Some("other"))));
    assert_eq!((ids, cached), (alone(&w, &prompt, 3), prompt.len() - 1));
}

const NEW_TOKENS: usize = 7;

#[test]
fn the_prompts_end_state_is_kept_without_a_step_of_its_own() {
    // The CPU backend keeps the state before a step's last token: a 20-token prompt in chunks of
    // 8 runs as 3 steps (8, 8, 4), not 4 (8, 8, 3 and the last token alone), and the state
    // before its last token is saved all the same.
    let w = weights();
    let engine = Engine::start(
        Box::new(CpuBackend::new(w.clone())),
        EngineOptions {
            prefill_chunk: 8,
            batch_tokens: 8,
            prefix_cache_bytes: 64 << 20,
            snapshot_interval: 1000,
            ..EngineOptions::default()
        },
    );
    let prompt = random_tokens(20);
    let (ids, _, cached) = collect_cached(engine.submit(greedy(prompt.clone(), 1, None)));
    assert_eq!((ids, cached), (alone(&w, &prompt, 1), 0));
    assert_eq!(engine.stats().batches_total.load(Ordering::Relaxed), 3);
    // The same prompt again resumes before its last token, which runs alone for the logits.
    let (ids, _, cached) = collect_cached(engine.submit(greedy(prompt.clone(), 2, None)));
    assert_eq!((ids, cached), (alone(&w, &prompt, 2), 19));
    assert_eq!(engine.stats().batches_total.load(Ordering::Relaxed), 3 + 2);
}

/// The CPU backend with hooks the tests stop it in: before each pass, and before each snapshot
/// of the states kept before a prompt's last token.
struct Hooked {
    inner: CpuBackend,
    before_pass: Box<dyn FnMut() + Send>,
    before_snapshot_before_last: Box<dyn FnMut() + Send>,
}

impl Hooked {
    fn new(w: &lily::model::Weights) -> Self {
        Hooked {
            inner: CpuBackend::new(w.clone()),
            before_pass: Box::new(|| {}),
            before_snapshot_before_last: Box::new(|| {}),
        }
    }
}

impl Backend for Hooked {
    fn config(&self) -> &lily::config::ModelConfig {
        self.inner.config()
    }
    fn device_name(&self) -> String {
        "hooked cpu".into()
    }
    fn create_sequence(&mut self, seq: SeqId) -> anyhow::Result<()> {
        self.inner.create_sequence(seq)
    }
    fn free_sequence(&mut self, seq: SeqId) {
        self.inner.free_sequence(seq)
    }
    fn forward(&mut self, seq: SeqId, tokens: &[u32]) -> anyhow::Result<Vec<f32>> {
        self.inner.forward(seq, tokens)
    }
    fn forward_batch(&mut self, steps: &[Step]) -> Vec<anyhow::Result<StepOutput>> {
        (self.before_pass)();
        self.inner.forward_batch(steps)
    }
    fn can_snapshot(&self) -> bool {
        true
    }
    fn snapshot(&mut self, seq: SeqId) -> anyhow::Result<Snapshot> {
        self.inner.snapshot(seq)
    }
    fn can_keep_state_before_last(&self) -> bool {
        self.inner.can_keep_state_before_last()
    }
    fn keep_state_before_last(&mut self, seq: SeqId) -> anyhow::Result<()> {
        self.inner.keep_state_before_last(seq)
    }
    fn snapshot_before_last(&mut self, seq: SeqId) -> anyhow::Result<Snapshot> {
        (self.before_snapshot_before_last)();
        self.inner.snapshot_before_last(seq)
    }
    fn restore(&mut self, snapshot: SnapshotId, seq: SeqId) -> anyhow::Result<usize> {
        self.inner.restore(snapshot, seq)
    }
    fn drop_snapshot(&mut self, snapshot: SnapshotId) {
        self.inner.drop_snapshot(snapshot)
    }
}

#[test]
fn the_first_token_leaves_before_the_prompts_state_is_saved() {
    // A snapshot takes ≈ 0.8 ms of a GPU engine's time: the first token must not wait for it.
    // Requests that go on after that token, and one that ends with it (max_tokens 1), whose
    // prompt's state is saved all the same.
    let w = weights();
    let (seen_tx, token_seen) = std::sync::mpsc::channel::<()>();
    let token_came_first = Arc::new(Mutex::new(Vec::new()));
    // Each such snapshot waits (up to 10 s) for word that its request's first token has arrived,
    // recording whether it came.
    let recorded = token_came_first.clone();
    let backend = Hooked {
        before_snapshot_before_last: Box::new(move || {
            let seen = token_seen
                .recv_timeout(std::time::Duration::from_secs(10))
                .is_ok();
            recorded.lock().unwrap().push(seen);
        }),
        ..Hooked::new(&w)
    };
    let engine = Engine::start(
        Box::new(backend),
        EngineOptions {
            prefill_chunk: 8,
            prefix_cache_bytes: 64 << 20,
            snapshot_interval: 1000,
            ..EngineOptions::default()
        },
    );
    for (n, max_tokens) in [(20, 4), (13, 1), (30, 3)] {
        let prompt = random_tokens(n);
        let mut rx = engine.submit(greedy(prompt.clone(), max_tokens, None));
        let mut ids = Vec::new();
        while let Some(event) = rx.blocking_recv() {
            match event {
                Event::Token(t) => {
                    if ids.is_empty() {
                        seen_tx.send(()).unwrap();
                    }
                    ids.push(t.id);
                }
                Event::Done { .. } => break,
                Event::Error(e) => panic!("{e}"),
                _ => {}
            }
        }
        assert_eq!(ids, alone(&w, &prompt, max_tokens), "prompt of {n}");
        // The same prompt again resumes before its last token.
        let (ids, _, cached) = collect_cached(engine.submit(greedy(prompt.clone(), 2, None)));
        assert_eq!(
            (ids, cached),
            (alone(&w, &prompt, 2), n - 1),
            "prompt of {n}"
        );
    }
    assert_eq!(*token_came_first.lock().unwrap(), [true; 3]);
}

#[test]
fn a_request_arriving_as_a_prompt_ends_reuses_its_state() {
    // The prompt's state is saved after its first token goes out, but a request that arrives
    // meanwhile with the same prompt is admitted first: it must find that state all the same.
    // A 20-token prompt in chunks of 8 runs in 3 passes; the second request comes during the
    // third, the one that ends the prompt.
    let w = weights();
    let (arrived_tx, arrived) = std::sync::mpsc::channel();
    let (go, go_rx) = std::sync::mpsc::channel::<()>();
    // The third pass tells the test it got there, then waits until the test lets it go.
    let mut passes = 0;
    let backend = Hooked {
        before_pass: Box::new(move || {
            passes += 1;
            if passes == 3 {
                arrived_tx.send(()).unwrap();
                go_rx
                    .recv_timeout(std::time::Duration::from_secs(10))
                    .unwrap();
            }
        }),
        ..Hooked::new(&w)
    };
    let engine = Engine::start(
        Box::new(backend),
        EngineOptions {
            prefill_chunk: 8,
            batch_tokens: 8,
            max_sequences: 2,
            prefix_cache_bytes: 64 << 20,
            snapshot_interval: 1000,
            ..EngineOptions::default()
        },
    );
    let prompt = random_tokens(20);
    let first = engine.submit(greedy(prompt.clone(), 3, None));
    arrived
        .recv_timeout(std::time::Duration::from_secs(10))
        .unwrap();
    let second = engine.submit(greedy(prompt.clone(), 3, None));
    go.send(()).unwrap();
    let (ids, _, cached) = collect_cached(first);
    assert_eq!((ids, cached), (alone(&w, &prompt, 3), 0));
    let (ids, _, cached) = collect_cached(second);
    assert_eq!((ids, cached), (alone(&w, &prompt, 3), 19));
}

/// Live sequences and snapshots of a [`Counting`] backend.
#[derive(Default)]
struct Live {
    sequences: usize,
    snapshots: std::collections::HashMap<SnapshotId, u64>,
    max_sequences: usize,
    /// Snapshots that fit on the "device": one more fails as out of memory.
    snapshot_room: Option<usize>,
}

/// The CPU backend, counting what is alive in it.
struct Counting {
    inner: CpuBackend,
    live: Arc<Mutex<Live>>,
}

impl Backend for Counting {
    fn config(&self) -> &lily::config::ModelConfig {
        self.inner.config()
    }
    fn device_name(&self) -> String {
        "counting cpu".into()
    }
    fn create_sequence(&mut self, seq: SeqId) -> anyhow::Result<()> {
        let mut live = self.live.lock().unwrap();
        live.sequences += 1;
        live.max_sequences = live.max_sequences.max(live.sequences);
        self.inner.create_sequence(seq)
    }
    fn free_sequence(&mut self, seq: SeqId) {
        self.live.lock().unwrap().sequences -= 1;
        self.inner.free_sequence(seq)
    }
    fn forward(&mut self, seq: SeqId, tokens: &[u32]) -> anyhow::Result<Vec<f32>> {
        self.inner.forward(seq, tokens)
    }
    fn can_snapshot(&self) -> bool {
        true
    }
    fn snapshot(&mut self, seq: SeqId) -> anyhow::Result<Snapshot> {
        let live = self.live.lock().unwrap();
        if live
            .snapshot_room
            .is_some_and(|room| live.snapshots.len() >= room)
        {
            anyhow::bail!(
                "out of memory (a test's device with room for {} snapshots)",
                live.snapshots.len()
            );
        }
        drop(live);
        let s = self.inner.snapshot(seq)?;
        self.live.lock().unwrap().snapshots.insert(s.id, s.bytes);
        Ok(s)
    }
    fn restore(&mut self, snapshot: SnapshotId, seq: SeqId) -> anyhow::Result<usize> {
        assert!(self.live.lock().unwrap().snapshots.contains_key(&snapshot));
        self.inner.restore(snapshot, seq)
    }
    fn drop_snapshot(&mut self, snapshot: SnapshotId) {
        assert!(self
            .live
            .lock()
            .unwrap()
            .snapshots
            .remove(&snapshot)
            .is_some());
        self.inner.drop_snapshot(snapshot)
    }
    fn forward_batch(&mut self, steps: &[Step]) -> Vec<anyhow::Result<StepOutput>> {
        self.inner.forward_batch(steps)
    }
    fn can_draft(&self) -> bool {
        self.inner.can_draft()
    }
    fn start_drafting(&mut self, seq: SeqId) -> anyhow::Result<()> {
        self.inner.start_drafting(seq)
    }
    fn draft(&mut self, seq: SeqId, next: u32, k: usize) -> anyhow::Result<Vec<u32>> {
        self.inner.draft(seq, next, k)
    }
    fn forward_verify(&mut self, seq: SeqId, tokens: &[u32]) -> anyhow::Result<Vec<f32>> {
        self.inner.forward_verify(seq, tokens)
    }
    fn forward_verify_argmax(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        limit: usize,
    ) -> anyhow::Result<Vec<u32>> {
        self.inner.forward_verify_argmax(seq, tokens, limit)
    }
    fn verified_logits(&mut self, seq: SeqId, row: usize) -> anyhow::Result<Vec<f32>> {
        self.inner.verified_logits(seq, row)
    }
    fn keep_verified(&mut self, seq: SeqId, rows: usize) -> anyhow::Result<()> {
        self.inner.keep_verified(seq, rows)
    }
}

/// Snapshots that run out of device memory before the cache's budget does: the least recently
/// used states are evicted to make room, so each turn of a conversation still reuses the turn
/// before it (not only the first states saved), and greedy outputs are unchanged.
#[test]
fn snapshots_out_of_memory_evict_the_oldest_states() {
    let w = weights();
    let live = Arc::new(Mutex::new(Live {
        snapshot_room: Some(2),
        ..Live::default()
    }));
    let backend = Counting {
        inner: CpuBackend::new(w.clone()),
        live: live.clone(),
    };
    let engine = Engine::start(
        Box::new(backend),
        EngineOptions {
            prefill_chunk: 8,
            max_sequences: 2,
            prefix_cache_bytes: 1 << 40,
            snapshot_interval: 8,
            ..EngineOptions::default()
        },
    );
    let mut prompt = random_tokens(20);
    let mut previous_end = 0;
    for turn in 0..5 {
        prompt.extend(random_tokens(10));
        let (ids, _, cached) = collect_cached(engine.submit(greedy(prompt.clone(), 3, None)));
        assert_eq!(ids, alone(&w, &prompt, 3), "turn {turn}: output");
        if turn > 0 {
            assert_eq!(
                cached, previous_end,
                "turn {turn} reuses the turn before it"
            );
        }
        // The end of the turn: its prompt and every generated token but the last.
        previous_end = prompt.len() + ids.len() - 1;
        prompt.extend(&ids);
        assert!(live.lock().unwrap().snapshots.len() <= 2);
    }
}

#[test]
fn random_load_with_cancellations_ends_at_baseline() {
    random_load(weights(), 0);
}

/// The same with requests that draft (the fixed schedule: every step of up to 4 requests that
/// all decode), their verify passes cut short by cancellations too.
#[test]
fn random_load_with_drafts_and_cancellations_ends_at_baseline() {
    let w = checkpoint::load(&fixture_dir("tiny-a-mtp")).unwrap();
    random_load(w, 3);
}

/// 300 requests of random prompts (sharing stems, for the prefix cache) and lengths, a third
/// cancelled at once or after a few tokens: each ends as it should, and the engine ends with
/// nothing running, nothing reserved, and exactly the snapshots its cache accounts for.
fn random_load(w: lily::model::Weights, draft_tokens: usize) {
    let live = Arc::new(Mutex::new(Live::default()));
    let backend = Counting {
        inner: CpuBackend::new(w.clone()),
        live: live.clone(),
    };
    // A budget for about 4 average requests' state, and a prefix cache small enough to evict.
    let per_request = backend.sequence_bytes(60);
    let cache_budget = 20 * backend.sequence_bytes(30);
    let (engine, thread) = Engine::spawn(
        Box::new(backend),
        EngineOptions {
            prefill_chunk: 6,
            batch_tokens: 24,
            max_sequences: 6,
            memory_budget: Some(4 * per_request),
            prefix_cache_bytes: cache_budget,
            snapshot_interval: 8,
            draft_tokens,
            draft_schedule: lily::engine::DraftSchedule::Fixed,
        },
    );
    let vocab = w.config.vocab_size;
    let mut rng = rand::rng();
    // Prompts share a few stems so that the cache is used.
    let stems: Vec<Vec<u32>> = (0..4).map(|_| random_tokens(20)).collect();
    let mut pending = Vec::new();
    for i in 0..300 {
        let mut prompt = stems[rng.random_range(0..stems.len())].clone();
        prompt.truncate(rng.random_range(0..=20));
        prompt.extend(random_tokens(rng.random_range(1..30)));
        let max_tokens = rng.random_range(0..12);
        let key = (i % 3 == 0).then_some("k");
        let mut request = greedy(prompt.clone(), max_tokens, key);
        if draft_tokens > 0 {
            request.device_sampler = Some(greedy_device_sampler(vocab));
            request.draft = true;
        }
        let rx = engine.submit(request);
        // A third are cancelled: at once, or after a few tokens.
        let cancel_after = (rng.random_range(0..3) == 0).then(|| rng.random_range(0..4usize));
        pending.push((prompt, max_tokens, rx, cancel_after));
    }
    let mut cancelled = 0;
    for (prompt, max_tokens, mut rx, cancel_after) in pending {
        let mut ids = vec![];
        let done = loop {
            if cancel_after == Some(ids.len()) {
                drop(rx);
                cancelled += 1;
                break None;
            }
            match rx
                .blocking_recv()
                .expect("every request ends with Done or Error")
            {
                Event::Started { .. } | Event::PromptToken(_) => {}
                Event::Token(t) => ids.push(t.id),
                Event::Done {
                    reason,
                    completion_tokens,
                    ..
                } => break Some((reason, completion_tokens)),
                Event::Error(e) => panic!("request failed: {e}"),
            }
        };
        if let Some((reason, completion_tokens)) = done {
            assert_eq!(reason, FinishReason::Length);
            assert_eq!((ids.len(), completion_tokens), (max_tokens, max_tokens));
            // Spot-check outputs against the reference (it is slow to run for all).
            if rng.random_range(0..10) == 0 {
                assert_eq!(ids, alone(&w, &prompt, max_tokens));
            }
        }
    }
    assert!(cancelled > 0);
    if draft_tokens > 0 {
        assert!(engine.stats().draft_passes_total.load(Ordering::Relaxed) > 0);
    }
    // Back to baseline: nothing running, queued, reserved; the cache within its budget and the
    // backend holding exactly the snapshots the cache accounts for.
    let stats = engine.stats();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while stats.running.load(Ordering::Relaxed) + stats.waiting.load(Ordering::Relaxed) > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the engine never went idle"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(stats.reserved_bytes.load(Ordering::Relaxed), 0);
    assert!(stats.cached_tokens_total.load(Ordering::Relaxed) > 0);
    {
        let live = live.lock().unwrap();
        assert_eq!(live.sequences, 0);
        assert!(live.max_sequences <= 6);
        assert_eq!(
            live.snapshots.len(),
            stats.prefix_cache_entries.load(Ordering::Relaxed)
        );
        let snapshot_bytes: u64 = live.snapshots.values().sum();
        let cache_bytes = stats.prefix_cache_bytes.load(Ordering::Relaxed);
        assert!(snapshot_bytes <= cache_bytes && cache_bytes <= cache_budget);
    }
    // Stopping the engine frees every snapshot.
    drop(engine);
    let _backend = thread.join().expect("the engine thread ends");
    assert!(live.lock().unwrap().snapshots.is_empty());
}

/// The CPU backend, logging when decode is readied and sequences are made; readying fails if
/// asked to.
struct Readied {
    inner: CpuBackend,
    log: Arc<Mutex<Vec<String>>>,
    fail: bool,
}

impl Backend for Readied {
    fn config(&self) -> &lily::config::ModelConfig {
        self.inner.config()
    }
    fn device_name(&self) -> String {
        "readied cpu".into()
    }
    fn prepare_decode(&mut self, max_batch: usize) -> anyhow::Result<()> {
        self.log
            .lock()
            .unwrap()
            .push(format!("prepare {max_batch}"));
        anyhow::ensure!(!self.fail, "no graphs today");
        Ok(())
    }
    fn create_sequence(&mut self, seq: SeqId) -> anyhow::Result<()> {
        self.log.lock().unwrap().push("create".into());
        self.inner.create_sequence(seq)
    }
    fn free_sequence(&mut self, seq: SeqId) {
        self.inner.free_sequence(seq)
    }
    fn forward(&mut self, seq: SeqId, tokens: &[u32]) -> anyhow::Result<Vec<f32>> {
        self.inner.forward(seq, tokens)
    }
}

/// The engine readies decode passes for its most sequences once, before its first request (the
/// CUDA backend captures their graphs then); a backend that fails to still serves.
#[test]
fn decode_is_readied_before_the_first_request() {
    let w = weights();
    for fail in [false, true] {
        let log = Arc::new(Mutex::new(Vec::new()));
        let backend = Readied {
            inner: CpuBackend::new(w.clone()),
            log: log.clone(),
            fail,
        };
        let (engine, thread) = Engine::spawn(
            Box::new(backend),
            EngineOptions {
                max_sequences: 5,
                ..EngineOptions::default()
            },
        );
        let prompt = random_tokens(9);
        let (ids, reason, error) = collect(engine.submit(greedy(prompt.clone(), 4, None)));
        assert_eq!(error, None, "readying failed: {fail}");
        assert_eq!(reason, Some(FinishReason::Length));
        assert_eq!(ids, alone(&w, &prompt, 4));
        drop(engine);
        thread.join().expect("the engine thread ends");
        assert_eq!(*log.lock().unwrap(), ["prepare 5", "create"]);
    }
}

#[test]
fn a_request_larger_than_the_memory_budget_is_refused() {
    let w = weights();
    let backend = CpuBackend::new(w);
    let budget = backend.sequence_bytes(50);
    let engine = Engine::start(
        Box::new(backend),
        EngineOptions {
            memory_budget: Some(budget),
            ..EngineOptions::default()
        },
    );
    let (_, _, err) = collect(engine.submit(greedy(vec![1; 40], 20, None)));
    assert!(err.unwrap().contains("memory budget"));
    let (ids, reason, err) = collect(engine.submit(greedy(vec![1; 40], 10, None)));
    assert_eq!(
        (ids.len(), reason, err),
        (10, Some(FinishReason::Length), None)
    );
}
/// A request's sampler shared by its CPU half and a device half that takes every other step, so
/// both paths and the hand-over between them run.
struct Alternating {
    sampler: Arc<Mutex<Sampler>>,
    steps: usize,
}

impl DeviceSampler for Alternating {
    fn device_step(&mut self) -> Option<(DeviceSampling, f64)> {
        self.steps += 1;
        if self.steps % 2 == 0 {
            return None;
        }
        self.sampler.lock().unwrap().device_step(usize::MAX)
    }
    fn accept(&mut self, token: u32) -> SampledToken {
        self.sampler.lock().unwrap().record(token);
        SampledToken {
            id: token,
            logprob: None,
            top_logprobs: Vec::new(),
        }
    }
}

fn cpu_sampler(sampler: Arc<Mutex<Sampler>>) -> lily::engine::Sampler {
    Box::new(move |logits: &mut [f32], _: &[u32]| SampledToken {
        id: sampler.lock().unwrap().sample(logits).unwrap().token,
        logprob: None,
        top_logprobs: Vec::new(),
    })
}

/// Several requests sampling on the CPU at once (their samplers run side by side, one core each,
/// `Scheduler::pick_on_cpu`) draw what each draws alone with the same seed.
#[test]
fn concurrent_cpu_samplers_draw_what_each_draws_alone() {
    let (engine, _) = engine(9);
    let requests: Vec<(Vec<u32>, SamplingParams)> = (0..5u64)
        .map(|i| {
            let prompt = (0..(6 + 5 * i))
                .map(|j| ((j * 29 + i * 11) % 256) as u32)
                .collect();
            let params = SamplingParams {
                temperature: 0.6 + 0.2 * i as f32,
                top_p: if i % 2 == 0 { 0.9 } else { 1.0 },
                seed: Some(rand::random()),
                ..SamplingParams::default()
            };
            (prompt, params)
        })
        .collect();
    let submit = |(prompt, params): &(Vec<u32>, SamplingParams)| {
        let sampler = Arc::new(Mutex::new(Sampler::new(params, prompt)));
        engine.submit(GenerateRequest {
            prompt: prompt.clone(),
            max_tokens: 10,
            stop_token_ids: vec![],
            sampler: cpu_sampler(sampler),
            prompt_cache_key: None,
            device_sampler: None,
            prompt_logprobs: None,
            draft: false,
        })
    };
    let together: Vec<_> = requests.iter().map(submit).collect();
    let together: Vec<Vec<u32>> = together.into_iter().map(|rx| collect(rx).0).collect();
    for (i, r) in requests.iter().enumerate() {
        let (alone, reason, _) = collect(submit(r));
        assert_eq!(reason, Some(FinishReason::Length));
        assert_eq!(together[i], alone, "request {i}");
    }
}

/// CPU picks beside the backend's pass (`Scheduler::iterate`): requests sampled on the CPU
/// alongside requests whose tokens the backend picks (so the CPU picks run beside their passes)
/// each draw what they draw alone, and a CPU sampler that panics fails only its own request.
#[test]
fn cpu_picks_beside_the_pass_change_no_request() {
    let (engine, w) = engine(6);
    let vocab = engine.config().vocab_size;
    let prompts: Vec<Vec<u32>> = (0..6u64)
        .map(|i| {
            (0..(7 + 4 * i))
                .map(|j| ((j * 17 + i * 5) % 256) as u32)
                .collect()
        })
        .collect();
    let params = |i: usize| SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        seed: Some(1000 + i as u64),
        ..SamplingParams::default()
    };
    // Even: sampled on the CPU; odd: greedy, picked by the backend.
    let submit = |i: usize| {
        let device = i % 2 == 1;
        engine.submit(GenerateRequest {
            prompt: prompts[i].clone(),
            max_tokens: 9,
            stop_token_ids: vec![],
            sampler: if device {
                greedy_sampler()
            } else {
                cpu_sampler(Arc::new(Mutex::new(Sampler::new(&params(i), &prompts[i]))))
            },
            prompt_cache_key: None,
            device_sampler: device.then(|| greedy_device_sampler(vocab)),
            prompt_logprobs: None,
            draft: false,
        })
    };
    let panicking = engine.submit(GenerateRequest {
        prompt: vec![4, 5, 6],
        max_tokens: 5,
        stop_token_ids: vec![],
        sampler: Box::new(|_: &mut [f32], _: &[u32]| panic!("sampler bug beside the pass")),
        prompt_cache_key: None,
        device_sampler: None,
        prompt_logprobs: None,
        draft: false,
    });
    let together: Vec<_> = (0..prompts.len()).map(submit).collect();
    let together: Vec<(Vec<u32>, Option<FinishReason>)> = together
        .into_iter()
        .map(|rx| {
            let (ids, reason, err) = collect(rx);
            assert_eq!(err, None);
            (ids, reason)
        })
        .collect();
    let (_, _, err) = collect(panicking);
    assert!(err.unwrap().contains("sampler bug beside the pass"));
    for (i, (ids, reason)) in together.iter().enumerate() {
        assert_eq!(*reason, Some(FinishReason::Length), "request {i}");
        let (alone, _, _) = collect(submit(i));
        assert_eq!(ids, &alone, "request {i}");
        if i % 2 == 1 {
            assert_eq!(ids, &self::alone(&w, &prompts[i], 9), "request {i}: greedy");
        }
    }
}

/// Sampling through `Backend::forward_sample` (the device path) draws what the CPU sampler draws:
/// same seed, same tokens, penalties included.
#[test]
fn device_sampling_steps_give_the_cpu_samplers_tokens() {
    let (engine, _) = engine(5);
    let prompt: Vec<u32> = (0..23).map(|j| (j * 37 % 256) as u32).collect();
    let params = SamplingParams {
        temperature: 1.5,
        top_k: Some(50),
        top_p: 0.95,
        repetition_penalty: 1.2,
        presence_penalty: 0.5,
        seed: Some(rand::random()),
        ..SamplingParams::default()
    };
    let run = |device: bool| {
        let sampler = Arc::new(Mutex::new(Sampler::new(&params, &prompt)));
        let device_sampler: Option<Box<dyn DeviceSampler>> = device.then(|| {
            Box::new(Alternating {
                sampler: sampler.clone(),
                steps: 0,
            }) as Box<dyn DeviceSampler>
        });
        collect(engine.submit(GenerateRequest {
            prompt: prompt.clone(),
            max_tokens: 24,
            stop_token_ids: vec![],
            sampler: cpu_sampler(sampler),
            prompt_cache_key: None,
            device_sampler,
            prompt_logprobs: None,
            draft: false,
        }))
    };
    let (cpu, reason, _) = run(false);
    assert_eq!(reason, Some(FinishReason::Length));
    assert_eq!(run(true).0, cpu);
}
