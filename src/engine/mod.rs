//! The engine: one thread that owns the backend and every sequence, fed by a channel.
//!
//! Requests arrive as [`GenerateRequest`]s; each streams [`Event`]s back. The thread's loop
//! ([`scheduler`]) batches prefill chunks and decode steps of all running sequences, admits
//! queued requests as sequence slots and memory allow, and reuses saved states of earlier
//! prompts ([`prefix_cache`]). A request whose receiver is gone (client disconnected, stop string
//! matched) is cancelled before its next step. A panic while serving one request ends that
//! request with an error and leaves the others untouched.

pub mod draft_lengths;
pub mod generate;
pub mod prefix_cache;
pub mod scheduler;

pub use draft_lengths::{DraftSchedule, MAX_DRAFT_TOKENS};

use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::config::ModelConfig;
use crate::model::Backend;
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
    /// Saved prompt states are shared only among requests with the same key (OpenAI's
    /// `prompt_cache_key`); requests without one share theirs with each other.
    pub prompt_cache_key: Option<String>,
    /// Set when the request's sampling can run on the backend, next to the logits.
    pub device_sampler: Option<Box<dyn DeviceSampler>>,
    /// With [`EngineOptions::draft_tokens`] the request's sequence keeps what drafting needs
    /// from the start, and it decodes with drafts when alone (each step its device sampler
    /// takes: greedy or sampled, not logprobs, grammars or a logit bias).
    pub draft: bool,
    /// Score the prompt: each prompt token after the first is reported as an
    /// [`Event::PromptToken`] with its log-probability and this many alternatives (`echo` with
    /// `logprobs`). The prompt then runs one token per step and no cached prefix is used.
    pub prompt_logprobs: Option<usize>,
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
    /// The request got its sequence; `cached_tokens` of its prompt came from the prefix cache.
    /// (Also in `Done`, which a receiver that stops early never reads.)
    Started {
        cached_tokens: usize,
    },
    /// A prompt token scored in context (only with `prompt_logprobs`), in prompt order from the
    /// second token on.
    PromptToken(SampledToken),
    Token(SampledToken),
    Done {
        reason: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
        cached_tokens: usize,
    },
    Error(String),
}

/// Prompt tokens of one prefill chunk on a GPU by default, for the engine's steps and the CUDA
/// backend's own chunks alike: each expert then sees ~chunk/32 rows (bench/NOTES.md v1.3); 8,192
/// rather than 4,096 gave prefill +3.0 / +2.0 / +1.3 % at 8K / 32K / 128K for 0.7 GB more memory
/// on the H200 (v1.74).
pub const GPU_PREFILL_CHUNK: usize = 8192;

/// Prompt tokens of one batch of steps on a GPU by default: one prompt's chunk of 8,192 or the
/// chunks of several shorter prompts, besides the decode rows. On the H200 at 64 streams of 1K
/// prompts it gave 3.5 % more throughput than 4,096 (16,384: 7 %, at the price of longer waits
/// for the streams decoding beside a burst of prompts); the same as vLLM's default for its server
/// on large GPUs (bench/NOTES.md v1.55).
pub const GPU_BATCH_TOKENS: usize = 8192;

#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Prompt tokens processed per step of one sequence.
    pub prefill_chunk: usize,
    /// Prompt tokens per batch, beside a decode step for every sequence that decodes: prefill
    /// chunks up to this many tokens in all (at least one chunk per batch, so prompts always
    /// advance). A batch holds up to [`pass_rows`](Self::pass_rows) rows.
    pub batch_tokens: usize,
    /// Sequences holding state at once; more requests wait in a queue.
    pub max_sequences: usize,
    /// Bytes of sequence state (KV entries and recurrent state) that running requests may
    /// reserve, each `Backend::sequence_bytes(prompt + max_tokens)`; `None`: no limit beyond
    /// `max_sequences` and the backend's own slots.
    pub memory_budget: Option<u64>,
    /// Bytes the prefix cache may hold; 0 turns it off.
    pub prefix_cache_bytes: u64,
    /// The prefix cache saves a prompt's state every this many prompt tokens (at the end of the
    /// chunk that reaches the mark), besides the end of the prompt and of the turn.
    pub snapshot_interval: usize,
    /// Tokens drafted by the checkpoint's MTP head and checked in each decode pass of a request
    /// that decodes alone or beside a few others (speculative decoding, MODEL.md §4.2; how many
    /// and when: `draft_schedule`); 0 turns drafting off, as does a backend that cannot draft.
    /// Greedy output is what decoding without drafts gives; sampled tokens keep their
    /// distribution.
    pub draft_tokens: usize,
    /// How many of those a pass checks: adaptive (by acceptance and cost so far, 0 included)
    /// or always all ([`DraftSchedule`]).
    pub draft_schedule: DraftSchedule,
}

impl EngineOptions {
    /// The most rows (tokens) one batch can hold: its prompt tokens and a decode step for every
    /// sequence. A GPU backend's passes are sized to it, so that a batch is one pass.
    pub fn pass_rows(&self) -> usize {
        self.batch_tokens + self.max_sequences
    }

    /// Batches of up to `tokens` prompt tokens (`--batch-tokens`) beside the decode steps, each
    /// sequence's chunk no longer than the batch. More tokens per batch: more prompts share
    /// each pass's weights (throughput); fewer: the streams decoding beside them wait less.
    pub fn with_batch_tokens(self, tokens: usize) -> Self {
        let tokens = tokens.max(1);
        EngineOptions {
            batch_tokens: tokens,
            prefill_chunk: self.prefill_chunk.min(tokens),
            ..self
        }
    }

    /// The defaults for a backend on `device` (`cpu`, `cuda...`): the GPU's prefill GEMMs want
    /// long chunks ([`GPU_PREFILL_CHUNK`]) and batches as long ([`GPU_BATCH_TOKENS`]); the CPU
    /// reference keeps short ones for fair interleaving.
    pub fn for_device(device: &str) -> Self {
        if device.starts_with("cuda") {
            EngineOptions {
                prefill_chunk: GPU_PREFILL_CHUNK,
                batch_tokens: GPU_BATCH_TOKENS,
                ..EngineOptions::default()
            }
        } else {
            EngineOptions::default()
        }
    }
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            prefill_chunk: 512,
            batch_tokens: 2048,
            max_sequences: 64,
            memory_budget: None,
            prefix_cache_bytes: 0,
            snapshot_interval: 2048,
            draft_tokens: 0,
            draft_schedule: DraftSchedule::Adaptive,
        }
    }
}

/// A handle to the engine thread; cheap to clone.
#[derive(Clone)]
pub struct Engine {
    // Declared first, so dropped first: the last handle's drop closes the channel, which ends
    // the engine loop, before `joined` waits for the thread.
    tx: mpsc::Sender<scheduler::Submission>,
    config: Arc<ModelConfig>,
    device: Arc<String>,
    stats: Arc<EngineStats>,
    /// For [`Engine::start`]: the thread, joined when the last handle is dropped.
    joined: Option<Arc<JoinOnDrop>>,
}

/// Joins the engine thread when dropped, so that the backend (GPU memory, CUDA streams) is freed
/// before the process can exit: a process that exits while the thread is still freeing device
/// memory can crash in the CUDA driver's teardown (seen at the end of a GPU test binary).
struct JoinOnDrop(Mutex<Option<JoinHandle<Box<dyn Backend>>>>);

impl Drop for JoinOnDrop {
    fn drop(&mut self) {
        let handle = self.0.get_mut().map(Option::take).unwrap_or_default();
        if let Some(handle) = handle {
            // The backend comes back and is dropped here; a panicked engine thread has
            // already reported itself.
            let _ = handle.join();
        }
    }
}

/// Counters for `/metrics`, admission and tests (updated after every engine iteration).
#[derive(Debug, Default)]
pub struct EngineStats {
    pub running: AtomicUsize,
    pub waiting: AtomicUsize,
    pub prompt_tokens_total: AtomicU64,
    pub generation_tokens_total: AtomicU64,
    pub requests_finished: AtomicU64,
    /// Prompt tokens restored from the prefix cache instead of computed.
    pub cached_tokens_total: AtomicU64,
    /// State bytes reserved by running requests (see `EngineOptions::memory_budget`).
    pub reserved_bytes: AtomicU64,
    /// Entries and bytes held by the prefix cache.
    pub prefix_cache_entries: AtomicUsize,
    pub prefix_cache_bytes: AtomicU64,
    /// Batches run through the backend, and the time spent in them (what the engine's own
    /// work adds to it is the rest of the wall time).
    pub batches_total: AtomicU64,
    pub backend_nanos_total: AtomicU64,
    /// Decode passes that checked drafts, the drafts they checked, and those accepted.
    pub draft_passes_total: AtomicU64,
    pub draft_tokens_total: AtomicU64,
    pub accepted_draft_tokens_total: AtomicU64,
    /// The most drafts a pass checks (0: the engine does not draft), and the drafts accepted
    /// at each position of their pass (0: the first draft).
    pub draft_positions: AtomicUsize,
    pub accepted_per_position: [AtomicU64; MAX_DRAFT_TOKENS],
}

impl Engine {
    /// Starts the engine thread over `backend`.
    pub fn start(backend: Box<dyn Backend>, options: EngineOptions) -> Engine {
        let (mut engine, thread) = Engine::spawn(backend, options);
        engine.joined = Some(Arc::new(JoinOnDrop(Mutex::new(Some(thread)))));
        engine
    }

    /// Starts the engine thread; the thread hands the backend back (with every sequence and
    /// snapshot freed) once every handle to the engine is dropped and its work is done.
    pub fn spawn(
        backend: Box<dyn Backend>,
        options: EngineOptions,
    ) -> (Engine, JoinHandle<Box<dyn Backend>>) {
        let config = Arc::new(backend.config().clone());
        let device = Arc::new(backend.device_name());
        let stats = Arc::new(EngineStats::default());
        let (tx, rx) = mpsc::channel();
        let loop_stats = stats.clone();
        let thread = std::thread::Builder::new()
            .name("lily-engine".into())
            .spawn(move || scheduler::EngineLoop::new(backend, options, loop_stats).run(rx))
            .expect("spawn the engine thread");
        let engine = Engine {
            tx,
            config,
            device,
            stats,
            joined: None,
        };
        (engine, thread)
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

/// Greedy picks on the device (what the server does for a plain greedy request): only the token
/// comes back from the backend. `vocab_limit`: ids at or past it are never picked.
pub fn greedy_device_sampler(vocab_limit: usize) -> Box<dyn DeviceSampler> {
    struct Greedy(DeviceSampling);
    impl DeviceSampler for Greedy {
        fn device_step(&mut self) -> Option<(DeviceSampling, f64)> {
            Some((self.0.clone(), 0.0))
        }
        fn accept(&mut self, token: u32) -> SampledToken {
            SampledToken {
                id: token,
                logprob: None,
                top_logprobs: Vec::new(),
            }
        }
    }
    Box::new(Greedy(DeviceSampling::greedy(vocab_limit)))
}

/// A greedy sampler (argmax, lowest index on ties) with no logprobs: tests and `generate`.
pub fn greedy_sampler() -> Sampler {
    Box::new(|logits: &mut [f32], _: &[u32]| SampledToken {
        id: crate::model::argmax(logits),
        logprob: None,
        top_logprobs: Vec::new(),
    })
}
