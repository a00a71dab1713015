//! The engine: one thread that owns the backend and every sequence, fed by a channel.
//!
//! Requests arrive as [`GenerateRequest`]s; each streams [`Event`]s back. Until the batching
//! scheduler lands, the engine serves active sequences round-robin, one unit of work each (a
//! prefill chunk or one decode step), so no request starves. A request whose receiver is gone
//! (client disconnected, stop string matched) is cancelled before its next step. A panic while
//! serving one request ends that request with an error and leaves the others untouched.

pub mod generate;

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::config::ModelConfig;
use crate::model::{Backend, SeqId};
use crate::sampling::DeviceSampling;

/// What the sampler returns for one step.
#[derive(Debug, Clone, PartialEq)]
pub struct SampledToken {
    pub id: u32,
    /// Log-probability of `id` and the most likely alternatives, when asked for.
    pub logprob: Option<f32>,
    pub top_logprobs: Vec<(u32, f32)>,
}

/// Picks the next token from the logits and the tokens generated so far. Owned by the request:
/// it carries the request's sampling parameters, RNG and any per-request state (a thinking
/// budget that forces `</think>`, a grammar).
pub type Sampler = Box<dyn FnMut(&mut [f32], &[u32]) -> SampledToken + Send>;

pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    /// Generation ends after emitting one of these (the token is reported, with reason Stop).
    pub stop_token_ids: Vec<u32>,
    pub sampler: Sampler,
    /// Set when the request's sampling can run on the backend, next to the logits.
    pub device_sampler: Option<Box<dyn DeviceSampler>>,
}

/// The backend half of a request's sampler. Before each forward pass whose logits give the next
/// token, the engine asks it whether that token can be sampled by the backend
/// ([`Backend::forward_sample`]): then only the token comes back, not the logits.
pub trait DeviceSampler: Send {
    /// The next token's sampling and the uniform number its draw uses, or `None` when this step
    /// needs the logits (`sampler` then picks the token).
    fn device_step(&mut self) -> Option<(DeviceSampling, f64)>;
    /// The token the backend chose, recorded as `sampler` records its own picks.
    fn accept(&mut self, token: u32) -> SampledToken;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was generated.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The receiver went away.
    Cancelled,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Token(SampledToken),
    Done {
        reason: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
        cached_tokens: usize,
    },
    Error(String),
}

#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Prompt tokens processed per step of one sequence.
    pub prefill_chunk: usize,
    /// Sequences holding state at once; more requests wait in a queue.
    pub max_sequences: usize,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            prefill_chunk: 512,
            max_sequences: 64,
        }
    }
}

/// A handle to the engine thread; cheap to clone.
#[derive(Clone)]
pub struct Engine {
    tx: mpsc::Sender<(GenerateRequest, UnboundedSender<Event>)>,
    config: Arc<ModelConfig>,
    device: Arc<String>,
    stats: Arc<EngineStats>,
}

/// Counters for `/metrics` and admission.
#[derive(Debug, Default)]
pub struct EngineStats {
    pub running: AtomicUsize,
    pub waiting: AtomicUsize,
    pub prompt_tokens_total: AtomicU64,
    pub generation_tokens_total: AtomicU64,
    pub requests_finished: AtomicU64,
}

impl Engine {
    /// Starts the engine thread over `backend`.
    pub fn start(backend: Box<dyn Backend>, options: EngineOptions) -> Engine {
        let config = Arc::new(backend.config().clone());
        let device = Arc::new(backend.device_name());
        let stats = Arc::new(EngineStats::default());
        let (tx, rx) = mpsc::channel();
        let loop_stats = stats.clone();
        std::thread::Builder::new()
            .name("lily-engine".into())
            .spawn(move || EngineLoop::new(backend, options, loop_stats).run(rx))
            .expect("spawn the engine thread");
        Engine {
            tx,
            config,
            device,
            stats,
        }
    }

    /// Queues a request; events arrive on the returned receiver. Dropping the receiver
    /// cancels the request.
    pub fn submit(&self, request: GenerateRequest) -> UnboundedReceiver<Event> {
        let (etx, erx) = unbounded_channel();
        if let Err(mpsc::SendError((_, etx))) = self.tx.send((request, etx)) {
            let _ = etx.send(Event::Error("the engine has stopped".into()));
        }
        erx
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }
    pub fn device_name(&self) -> &str {
        &self.device
    }
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }
}

/// One sequence being served.
struct Active {
    seq: SeqId,
    request: GenerateRequest,
    events: UnboundedSender<Event>,
    /// Prompt tokens already run through the model.
    prefilled: usize,
    generated: Vec<u32>,
    /// What the last forward pass left for choosing the next token.
    next: Option<Next>,
}

enum Next {
    /// Logits of the last position, waiting for the request's sampler.
    Logits(Vec<f32>),
    /// The token the backend sampled (see [`DeviceSampler`]).
    Sampled(u32),
}

enum Step {
    Continue,
    Finished(FinishReason),
}

struct EngineLoop {
    backend: Box<dyn Backend>,
    options: EngineOptions,
    stats: Arc<EngineStats>,
    next_seq: SeqId,
    waiting: VecDeque<(GenerateRequest, UnboundedSender<Event>)>,
    active: VecDeque<Active>,
}

impl EngineLoop {
    fn new(
        backend: Box<dyn Backend>,
        options: EngineOptions,
        stats: Arc<EngineStats>,
    ) -> EngineLoop {
        EngineLoop {
            backend,
            options,
            stats,
            next_seq: 0,
            waiting: VecDeque::new(),
            active: VecDeque::new(),
        }
    }

    fn run(mut self, rx: mpsc::Receiver<(GenerateRequest, UnboundedSender<Event>)>) {
        loop {
            // Block only when there is nothing to do.
            if self.active.is_empty() && self.waiting.is_empty() {
                match rx.recv() {
                    Ok(item) => self.waiting.push_back(item),
                    Err(_) => return, // every Engine handle is gone
                }
            }
            while let Ok(item) = rx.try_recv() {
                self.waiting.push_back(item);
            }
            self.admit();
            if let Some(mut a) = self.active.pop_front() {
                let outcome = catch_unwind(AssertUnwindSafe(|| self.step(&mut a)));
                match outcome {
                    Ok(Ok(Step::Continue)) => self.active.push_back(a),
                    Ok(Ok(Step::Finished(reason))) => self.finish(a, reason),
                    Ok(Err(e)) => self.fail(a, format!("{e:#}")),
                    Err(panic) => {
                        let msg = panic
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()));
                        self.fail(
                            a,
                            format!("internal error: {}", msg.unwrap_or_else(|| "panic".into())),
                        );
                    }
                }
            }
            self.stats
                .running
                .store(self.active.len(), Ordering::Relaxed);
            self.stats
                .waiting
                .store(self.waiting.len(), Ordering::Relaxed);
        }
    }

    fn admit(&mut self) {
        while self.active.len() < self.options.max_sequences {
            let Some((request, events)) = self.waiting.pop_front() else {
                break;
            };
            if events.is_closed() {
                continue; // cancelled while queued
            }
            let seq = self.next_seq;
            self.next_seq += 1;
            if request.prompt.is_empty() {
                let _ = events.send(Event::Error("the prompt is empty".into()));
                continue;
            }
            if let Err(e) = self.backend.create_sequence(seq) {
                if !self.active.is_empty() {
                    // The backend is full (a GPU has a fixed number of state slots): wait at
                    // the head of the queue until a running sequence frees its state.
                    tracing::debug!("the backend cannot take another sequence yet: {e:#}");
                    self.waiting.push_front((request, events));
                    break;
                }
                let _ = events.send(Event::Error(format!("cannot start the sequence: {e:#}")));
                continue;
            }
            self.stats
                .prompt_tokens_total
                .fetch_add(request.prompt.len() as u64, Ordering::Relaxed);
            self.active.push_back(Active {
                seq,
                request,
                events,
                prefilled: 0,
                generated: Vec::new(),
                next: None,
            });
        }
    }

    /// One unit of work for one sequence: a prefill chunk, or sampling plus one decode step.
    fn step(&mut self, a: &mut Active) -> anyhow::Result<Step> {
        if a.events.is_closed() {
            return Ok(Step::Finished(FinishReason::Cancelled));
        }
        if a.prefilled < a.request.prompt.len() {
            let end = (a.prefilled + self.options.prefill_chunk).min(a.request.prompt.len());
            // Only the last chunk's logits give a token.
            let device = match end == a.request.prompt.len() {
                true => a.request.device_sampler.as_mut(),
                false => None,
            };
            let tokens = &a.request.prompt[a.prefilled..end];
            a.next = Some(forward_next(&mut *self.backend, a.seq, tokens, device)?);
            a.prefilled = end;
            return Ok(Step::Continue);
        }
        if a.request.max_tokens == 0 {
            return Ok(Step::Finished(FinishReason::Length));
        }
        let token = match a
            .next
            .take()
            .expect("a forward pass after prefill or decode")
        {
            Next::Logits(mut logits) => (a.request.sampler)(&mut logits, &a.generated),
            Next::Sampled(id) => match &mut a.request.device_sampler {
                Some(device) => device.accept(id),
                None => unreachable!("only a device sampler samples on the backend"),
            },
        };
        let id = token.id;
        a.generated.push(id);
        self.stats
            .generation_tokens_total
            .fetch_add(1, Ordering::Relaxed);
        if a.events.send(Event::Token(token)).is_err() {
            return Ok(Step::Finished(FinishReason::Cancelled));
        }
        if a.request.stop_token_ids.contains(&id) {
            return Ok(Step::Finished(FinishReason::Stop));
        }
        if a.generated.len() >= a.request.max_tokens {
            return Ok(Step::Finished(FinishReason::Length));
        }
        let device = a.request.device_sampler.as_mut();
        a.next = Some(forward_next(&mut *self.backend, a.seq, &[id], device)?);
        Ok(Step::Continue)
    }

    fn finish(&mut self, a: Active, reason: FinishReason) {
        self.backend.free_sequence(a.seq);
        self.stats.requests_finished.fetch_add(1, Ordering::Relaxed);
        let _ = a.events.send(Event::Done {
            reason,
            prompt_tokens: a.request.prompt.len(),
            completion_tokens: a.generated.len(),
            cached_tokens: 0,
        });
    }

    fn fail(&mut self, a: Active, message: String) {
        tracing::error!(seq = a.seq, "request failed: {message}");
        self.backend.free_sequence(a.seq);
        let _ = a.events.send(Event::Error(message));
    }
}

/// Runs `tokens` of sequence `seq`: sampled on the backend when the device sampler can take this
/// step, else bringing back the logits.
fn forward_next(
    backend: &mut dyn Backend,
    seq: SeqId,
    tokens: &[u32],
    device: Option<&mut Box<dyn DeviceSampler>>,
) -> anyhow::Result<Next> {
    match device.and_then(|d| d.device_step()) {
        Some((sampling, u)) => Ok(Next::Sampled(
            backend.forward_sample(seq, tokens, &sampling, u)?,
        )),
        None => Ok(Next::Logits(backend.forward(seq, tokens)?)),
    }
}

/// A greedy sampler (argmax, lowest index on ties) with no logprobs: tests and `generate`.
pub fn greedy_sampler() -> Sampler {
    Box::new(|logits: &mut [f32], _: &[u32]| SampledToken {
        id: crate::model::argmax(logits),
        logprob: None,
        top_logprobs: Vec::new(),
    })
}
