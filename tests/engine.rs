//! The engine thread: interleaved requests give the same greedy output as each alone;
//! cancellation and bad requests don't disturb the others.

mod common;

use common::fixture_dir;
use lily::checkpoint;
use std::sync::{Arc, Mutex};

use lily::engine::{
    greedy_sampler, DeviceSampler, Engine, EngineOptions, Event, FinishReason, GenerateRequest,
    SampledToken,
};
use lily::model::cpu::{forward, Logits};
use lily::model::{CpuBackend, SequenceState};
use lily::sampling::{DeviceSampling, Sampler, SamplingParams};

fn engine(prefill_chunk: usize) -> (Engine, lily::model::Weights) {
    let w = checkpoint::load(&fixture_dir("tiny-a")).unwrap();
    let e = Engine::start(
        Box::new(CpuBackend::new(w.clone())),
        EngineOptions {
            prefill_chunk,
            max_sequences: 3,
        },
    );
    (e, w)
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
                device_sampler: None,
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
        device_sampler: None,
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
        device_sampler: None,
    });
    let bad = engine.submit(GenerateRequest {
        prompt: vec![1, 999_999],
        max_tokens: 4,
        stop_token_ids: vec![],
        sampler: greedy_sampler(),
        device_sampler: None,
    });
    let panicking = engine.submit(GenerateRequest {
        prompt: vec![2, 3],
        max_tokens: 4,
        stop_token_ids: vec![],
        sampler: Box::new(|_: &mut [f32], _: &[u32]| panic!("sampler bug")),
        device_sampler: None,
    });
    let good = engine.submit(GenerateRequest {
        prompt: vec![7, 8, 9],
        max_tokens: 6,
        stop_token_ids: vec![],
        sampler: greedy_sampler(),
        device_sampler: None,
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
            device_sampler,
        }))
    };
    let (cpu, reason, _) = run(false);
    assert_eq!(reason, Some(FinishReason::Length));
    assert_eq!(run(true).0, cpu);
}
