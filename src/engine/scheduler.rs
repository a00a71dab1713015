//! The engine thread's loop: admission, continuous batching, prefix reuse and cancellation.
//!
//! Each iteration:
//! 1. new requests join the waiting queue; requests whose receiver is gone leave the queue, and
//!    running ones free their state;
//! 2. admission in arrival order: the request at the head of the queue starts when a sequence
//!    slot is free (`max_sequences`, and the backend accepts a new sequence) and the state it
//!    can grow to (`Backend::sequence_bytes(prompt + max_tokens)`) fits in the memory budget.
//!    Later requests never overtake it, so a large request is not starved by small ones. A
//!    starting request restores the longest cached state of its prompt's prefix;
//! 3. sampling: every sequence with logits waiting picks its next token and sends it (or sends
//!    the token the backend sampled, see [`DeviceSampler`](super::DeviceSampler));
//! 4. one batch through `Backend::forward_batch`: a decode step for each sequence that sampled
//!    and goes on, and beside them prefill chunks of sequences still reading their prompt,
//!    taken round-robin from where the previous batch stopped, up to `batch_tokens` prompt
//!    tokens (at least one chunk per batch), so every prompt advances. A step whose token the
//!    request's device sampler can pick brings back the token instead of the logits;
//! 5. states worth keeping are saved in the prefix cache: every `snapshot_interval` prompt
//!    tokens, before the prompt's last token (the prefill stops there for it), and at the end
//!    of the turn.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};

use tokio::sync::mpsc::UnboundedSender;

use super::draft_lengths::{Acceptance, DraftLengths, MAX_DRAFT_TOKENS};
use super::prefix_cache::PrefixCache;
use super::{
    EngineOptions, EngineStats, Event, FinishReason, GenerateRequest, SampledToken, Sampler,
};
use crate::model::{panic_message, Backend, SeqId, Step, StepOutput};
use crate::sampling::{check_draft, DeviceSampling};

/// A request as the engine thread receives it: the request and where its events go.
pub type Submission = (GenerateRequest, UnboundedSender<Event>);

/// One sequence being served.
struct Running {
    seq: SeqId,
    request: GenerateRequest,
    events: UnboundedSender<Event>,
    /// Prompt tokens already in the sequence's state (restored or run through the model).
    prefilled: usize,
    /// Prompt tokens restored from the prefix cache.
    cached: usize,
    generated: Vec<u32>,
    /// What the last forward pass left for choosing the next token.
    next: Option<Next>,
    /// State bytes reserved at admission.
    reserved: u64,
    /// The sequence keeps what the MTP head needs (EngineOptions::draft_tokens).
    drafting: bool,
    /// How its drafts have fared, for the choice of how many a pass checks.
    acceptance: Acceptance,
    /// The prompt's last chunk `(from, to, before_last)`, whose state the prefix cache saves
    /// once the first token is out (`Scheduler::save_pending`): a snapshot is ≈ 0.8 ms of the
    /// host's time (bench/NOTES.md v1.84).
    pending_save: Option<(usize, usize, bool)>,
}

impl Running {
    fn prefilling(&self) -> bool {
        self.prefilled < self.request.prompt.len()
    }
}

enum Next {
    /// Logits of the last position, waiting for the request's sampler.
    Logits(Vec<f32>),
    /// The token the backend sampled (see [`DeviceSampler`](super::DeviceSampler)).
    Sampled(u32),
    /// The request's sampler's pick from its logits, made beside the backend's pass or the
    /// other requests' picks (`Scheduler::iterate`); an error when the sampler panicked.
    Picked(Result<SampledToken, String>),
}

/// Whether `r` waits for its CPU sampler's pick from logits the last pass brought back
/// (logprobs, a logit bias, a grammar: what its device sampler cannot take).
fn waits_for_cpu_pick(r: &Running) -> bool {
    !r.prefilling() && r.request.max_tokens > 0 && matches!(r.next, Some(Next::Logits(_)))
}

/// One request's CPU pick, its sampler and logits taken out of the request while it runs.
struct SidePick {
    index: usize,
    sampler: Sampler,
    logits: Vec<f32>,
    generated: Vec<u32>,
    picked: Option<Result<SampledToken, String>>,
}

/// Runs the picks side by side on all cores; a sampler's panic fails only its request.
fn run_picks(picks: &mut [SidePick]) {
    use rayon::prelude::*;
    picks.par_iter_mut().for_each(|p| {
        let (sampler, logits, generated) = (&mut p.sampler, &mut p.logits, &p.generated);
        let picked = catch_unwind(AssertUnwindSafe(|| sampler(logits, generated)))
            .map_err(|panic| format!("internal error: {}", panic_message(panic)));
        p.picked = Some(picked);
    });
}

/// What a request's sampler is while its pick runs elsewhere (never called: the request is
/// not sampled until the pick is back).
fn taken_sampler(_: &mut [f32], _: &[u32]) -> SampledToken {
    unreachable!("a request's sampler was called while its pick was running")
}

/// A step's sampling on the device and its uniform draw, or `None`: its logits come back.
type DeviceStep = Option<(DeviceSampling, f64)>;

/// What a running sequence does in this iteration's batch.
enum Work {
    /// Prompt tokens `[from, to)`; with `before_last`, the step keeps the state before its last
    /// token (`Backend::keep_state_before_last`), the prompt's end state for the prefix cache.
    Prefill {
        from: usize,
        to: usize,
        before_last: bool,
    },
    /// Feeds back the token it just sampled.
    Decode(u32),
}

/// Which state of a sequence `save_state` saves.
#[derive(Clone, Copy)]
enum Saved {
    /// Its state now.
    Now,
    /// The state its last step kept before its last token.
    BeforeLast,
}

/// What a verify pass gave back: every row's argmax (greedy without penalties: the logits stay
/// on the device, `Backend::verified_logits` fetches a row), or every row's logits.
enum Verified {
    Picks(Vec<u32>),
    Logits(Vec<f32>),
}

/// Row `j`'s logits of the verify pass open for `seq` (`v` a row).
fn verified_row(
    backend: &mut dyn Backend,
    verified: &Verified,
    seq: SeqId,
    j: usize,
    v: usize,
) -> Result<Vec<f32>, String> {
    match verified {
        Verified::Logits(logits) => Ok(logits[j * v..(j + 1) * v].to_vec()),
        Verified::Picks(_) => backend
            .verified_logits(seq, j)
            .map_err(|e| format!("{e:#}")),
    }
}

pub(super) struct EngineLoop {
    backend: Box<dyn Backend>,
    options: EngineOptions,
    stats: Arc<EngineStats>,
    next_seq: SeqId,
    waiting: VecDeque<Submission>,
    running: Vec<Running>,
    /// Bytes reserved by `running`.
    reserved: u64,
    /// Index in `running` of the first sequence offered a prefill chunk next time.
    prefill_turn: usize,
    /// `None` when off, or when the backend has no snapshots.
    cache: Option<PrefixCache>,
    /// Whether requests decoding draft, and how many drafts a pass checks.
    draft_lengths: DraftLengths,
}

impl EngineLoop {
    pub(super) fn new(
        backend: Box<dyn Backend>,
        options: EngineOptions,
        stats: Arc<EngineStats>,
    ) -> EngineLoop {
        let cache = (options.prefix_cache_bytes > 0 && backend.can_snapshot())
            .then(|| PrefixCache::new(options.prefix_cache_bytes));
        let draft_lengths = DraftLengths::new(options.draft_tokens, options.draft_schedule);
        let positions = if backend.can_draft() {
            options.draft_tokens.min(MAX_DRAFT_TOKENS)
        } else {
            0
        };
        stats.draft_positions.store(positions, Ordering::Relaxed);
        EngineLoop {
            backend,
            options,
            stats,
            next_seq: 0,
            waiting: VecDeque::new(),
            running: Vec::new(),
            reserved: 0,
            prefill_turn: 0,
            cache,
            draft_lengths,
        }
    }

    /// Serves requests until every sender is gone and the work is done; returns the backend
    /// with every sequence and snapshot freed.
    pub(super) fn run(mut self, rx: mpsc::Receiver<Submission>) -> Box<dyn Backend> {
        if let Err(e) = self.backend.prepare_decode(self.options.max_sequences) {
            tracing::warn!(
                "readying decode passes failed (they are readied when first run): {e:#}"
            );
        }
        loop {
            // Block only when there is nothing to do.
            if self.running.is_empty() && self.waiting.is_empty() {
                match rx.recv() {
                    Ok(item) => self.waiting.push_back(item),
                    Err(_) => break, // every Engine handle is gone
                }
            }
            while let Ok(item) = rx.try_recv() {
                self.waiting.push_back(item);
            }
            self.drop_cancelled();
            self.admit();
            self.iterate();
            self.publish_stats();
        }
        if let Some(cache) = &mut self.cache {
            for id in cache.clear() {
                self.backend.drop_snapshot(id);
            }
        }
        self.publish_stats();
        self.backend
    }

    fn drop_cancelled(&mut self) {
        self.waiting.retain(|(_, events)| !events.is_closed());
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].events.is_closed() {
                let r = self.remove(i);
                self.finish(r, FinishReason::Cancelled);
            } else {
                i += 1;
            }
        }
    }

    fn admit(&mut self) {
        // A request about to look up the prefix cache may share a prompt whose state waits to
        // be saved (`pending_save`): saved now, that first token is no longer ahead of it.
        if !self.waiting.is_empty() && self.running.len() < self.options.max_sequences {
            for i in 0..self.running.len() {
                self.save_pending(i);
            }
        }
        while self.running.len() < self.options.max_sequences {
            let Some((request, events)) = self.waiting.pop_front() else {
                break;
            };
            if request.prompt.is_empty() {
                let _ = events.send(Event::Error("the prompt is empty".into()));
                continue;
            }
            let need = self
                .backend
                .sequence_bytes(request.prompt.len() + request.max_tokens);
            if let Some(budget) = self.options.memory_budget {
                if need > budget {
                    let _ = events.send(Event::Error(format!(
                        "the request needs {} MiB of sequence state, more than the engine's \
                         memory budget of {} MiB",
                        need.div_ceil(1 << 20),
                        budget >> 20
                    )));
                    continue;
                }
                if self.reserved + need > budget {
                    // Wait at the head of the queue until running requests free memory.
                    self.waiting.push_front((request, events));
                    break;
                }
            }
            let seq = self.next_seq;
            self.next_seq += 1;
            if let Err(e) = self.backend.create_sequence(seq) {
                if !self.running.is_empty() {
                    // The backend is full (a GPU has a fixed number of state slots): wait at
                    // the head of the queue until a running sequence frees its state.
                    tracing::debug!("the backend cannot take another sequence yet: {e:#}");
                    self.waiting.push_front((request, events));
                    break;
                }
                let _ = events.send(Event::Error(format!("cannot start the sequence: {e:#}")));
                continue;
            }
            // Every sequence of a drafting engine that may draft keeps the head's input from its
            // first token, so that the prefix cache's states have it too.
            let drafting = self.drafts()
                && request.draft
                && request.prompt_logprobs.is_none()
                && self
                    .backend
                    .start_drafting(seq)
                    // A device drafts for a few sequences at once: the others are no news.
                    .inspect_err(|e| {
                        tracing::debug!("sequence {seq} decodes without drafts: {e:#}")
                    })
                    .is_ok();
            let started = std::time::Instant::now();
            let cached = self.restore_prefix(seq, &request);
            tracing::debug!(
                seq,
                cached,
                micros = started.elapsed().as_micros() as u64,
                "prefix restored"
            );
            self.stats
                .prompt_tokens_total
                .fetch_add(request.prompt.len() as u64, Ordering::Relaxed);
            self.stats
                .cached_tokens_total
                .fetch_add(cached as u64, Ordering::Relaxed);
            let _ = events.send(Event::Started {
                cached_tokens: cached,
            });
            self.reserved += need;
            self.running.push(Running {
                seq,
                request,
                events,
                prefilled: cached,
                cached,
                generated: Vec::new(),
                next: None,
                reserved: need,
                drafting,
                acceptance: Acceptance::default(),
                pending_save: None,
            });
        }
    }

    /// Restores the longest cached prefix of the prompt into `seq`; returns its length (0 for
    /// none). At least the prompt's last token is left to run, for the logits.
    fn restore_prefix(&mut self, seq: SeqId, request: &GenerateRequest) -> usize {
        if request.prompt_logprobs.is_some() {
            return 0; // every prompt position must run, for its logits
        }
        let key = request.prompt_cache_key.as_deref();
        let max = request.prompt.len() - 1;
        let Some(hit) = self
            .cache
            .as_mut()
            .and_then(|c| c.lookup(key, &request.prompt, max))
        else {
            return 0;
        };
        match self.backend.restore(hit.snapshot, seq) {
            Ok(position) if position == hit.tokens => hit.tokens,
            outcome => {
                // The sequence may be half overwritten: start it again from nothing.
                tracing::warn!("restoring a cached prefix failed ({outcome:?}); not using it");
                self.backend.free_sequence(seq);
                if let Err(e) = self.backend.create_sequence(seq) {
                    tracing::error!("recreating sequence {seq} failed: {e:#}");
                }
                0
            }
        }
    }

    /// Sampling, one batch, and the snapshots that follow it.
    ///
    /// Requests whose logits came back are picked by their CPU samplers, side by side on all
    /// cores: a pick takes milliseconds over the vocabulary (3–8 ms for 248K logits on one core
    /// of the build machine, bench/NOTES.md v1.77). When other requests have work, the picks run
    /// beside this iteration's pass and their requests join the next one, so that they do not
    /// hold up every other request's step; else they run here, before the batch.
    fn iterate(&mut self) {
        let waiting = self
            .running
            .iter()
            .filter(|r| waits_for_cpu_pick(r))
            .count();
        let beside = waiting > 0 && waiting < self.running.len();
        if waiting > 0 && !beside {
            let picks = self.take_picks();
            self.pick_now(picks);
        }
        let mut work = Vec::new(); // (index in running, work)
        let mut i = 0;
        while i < self.running.len() {
            let r = &self.running[i];
            if r.prefilling() || r.next.is_none() || (beside && waits_for_cpu_pick(r)) {
                i += 1;
                continue;
            }
            match self.sample(i) {
                Ok(None) => {
                    let token = *self.running[i].generated.last().expect("just sampled");
                    work.push((i, Work::Decode(token)));
                    i += 1;
                }
                Ok(Some(reason)) => {
                    let r = self.remove(i);
                    self.finish(r, reason);
                }
                Err(message) => {
                    let r = self.remove(i);
                    self.fail(r, message);
                }
            }
        }
        // Their first tokens are out: the states of prompts that ended in the last pass go to
        // the prefix cache before any sequence steps on.
        for i in 0..self.running.len() {
            self.save_pending(i);
        }
        self.plan_prefill(&mut work);
        // Only the picks left for beside the pass remain (the others ran above).
        let mut picks = self.take_picks();
        if work.is_empty() {
            // Nothing to run beside: the picks run now.
            self.pick_now(picks);
            return;
        }
        // Steps that end with a token the request's device sampler can pick bring back the
        // token; the others the logits.
        let mut sampling: Vec<DeviceStep> = work
            .iter()
            .map(|(i, w)| {
                let r = &mut self.running[*i];
                let gives_token = match w {
                    Work::Prefill { to, .. } => *to == r.request.prompt.len(),
                    Work::Decode(_) => true,
                };
                let device = r.request.device_sampler.as_mut().filter(|_| gives_token)?;
                device.device_step()
            })
            .collect();
        // Every running request decodes, may draft and is sampled on the device: the step may
        // be a drafted pass for each (DraftLengths::plan); a plain step of them is timed, as
        // what drafts compete with.
        let all_may_draft = work.len() == self.running.len()
            && work.iter().zip(&sampling).all(|((i, w), s)| {
                matches!(w, Work::Decode(_)) && s.is_some() && self.running[*i].drafting
            });
        let mut timed_plain = false;
        if all_may_draft {
            let requests: Vec<(&Acceptance, usize)> = (work.iter())
                .map(|(i, _)| {
                    let r = &self.running[*i];
                    // A pass yields up to one token more than its drafts: no more than the
                    // request wants.
                    let left = r.request.max_tokens.saturating_sub(r.generated.len() + 1);
                    (&r.acceptance, left)
                })
                .collect();
            let ks = self.draft_lengths.plan(&requests);
            if ks.iter().all(|&k| k == 0) {
                timed_plain = true;
            } else {
                let plain = self.drafted_passes(&work, &sampling, &ks);
                if plain.is_empty() {
                    return;
                }
                // Those the backend drafted nothing for step as any other.
                (work, sampling) = plain.into_iter().unzip();
            }
        }
        let steps: Vec<Step> = work
            .iter()
            .zip(&sampling)
            .map(|((i, w), device)| {
                let r = &self.running[*i];
                let tokens = match w {
                    Work::Prefill { from, to, .. } => &r.request.prompt[*from..*to],
                    Work::Decode(token) => std::slice::from_ref(token),
                };
                Step {
                    seq: r.seq,
                    tokens,
                    sample: device.as_ref().map(|(s, u)| (s, *u)),
                }
            })
            .collect();
        let backend = &mut self.backend;
        let (outcome, took) = std::thread::scope(|scope| {
            let side = (!picks.is_empty()).then(|| scope.spawn(|| run_picks(&mut picks)));
            let started = std::time::Instant::now();
            let outcome = catch_unwind(AssertUnwindSafe(|| backend.forward_batch(&steps)));
            let took = started.elapsed();
            // run_picks catches its samplers' panics; a pick that did not run fails its request.
            if let Some(side) = side {
                let _ = side.join();
            }
            (outcome, took)
        });
        self.stats.batches_total.fetch_add(1, Ordering::Relaxed);
        self.stats
            .backend_nanos_total
            .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
        tracing::debug!(
            steps = steps.len(),
            tokens = steps.iter().map(|s| s.tokens.len()).sum::<usize>(),
            micros = took.as_micros() as u64,
            "batch"
        );
        let results: Vec<anyhow::Result<Next>> = match outcome {
            Ok(results) if results.len() == steps.len() => results
                .into_iter()
                .map(|r| {
                    r.map(|out| match out {
                        StepOutput::Logits(logits) => Next::Logits(logits),
                        StepOutput::Token(token) => Next::Sampled(token),
                    })
                })
                .collect(),
            // Every step of the batch fails: which states the backend changed is unknown.
            outcome => {
                let why = match outcome {
                    Ok(results) => format!(
                        "the backend returned {} results for {} steps",
                        results.len(),
                        steps.len()
                    ),
                    Err(panic) => panic_message(panic),
                };
                steps
                    .iter()
                    .map(|_| Err(anyhow::anyhow!("internal error: {why}")))
                    .collect()
            }
        };
        if timed_plain {
            let mut acceptances: Vec<&mut Acceptance> =
                self.running.iter_mut().map(|r| &mut r.acceptance).collect();
            (self.draft_lengths).record_plain(&mut acceptances, took.as_secs_f64());
        }
        // The picks made beside the pass: their requests join the next one.
        self.restore_picks(picks);
        let mut failed = Vec::new();
        for ((i, w), result) in work.into_iter().zip(results) {
            match result {
                Ok(next) => {
                    if let Work::Prefill {
                        from,
                        to,
                        before_last,
                    } = w
                    {
                        self.running[i].prefilled = to;
                        if self.running[i].prefilling() {
                            self.save_prompt_state(i, from, to, before_last);
                        } else {
                            self.running[i].pending_save = Some((from, to, before_last));
                        }
                        if let Err(message) = self.score_prompt_token(i, to, &next) {
                            failed.push((i, message));
                            continue;
                        }
                    }
                    // Logits inside the prompt are of no use; after it, they are sampled next.
                    if !self.running[i].prefilling() {
                        self.running[i].next = Some(next);
                    }
                }
                Err(e) => failed.push((i, format!("{e:#}"))),
            }
        }
        // Highest index first, so the others stay valid.
        failed.sort_by_key(|(i, _)| std::cmp::Reverse(*i));
        for (i, message) in failed {
            let r = self.remove(i);
            self.fail(r, message);
        }
    }

    /// Whether this engine drafts (EngineOptions::draft_tokens, and a backend that can).
    fn drafts(&self) -> bool {
        self.options.draft_tokens > 0 && self.backend.can_draft()
    }

    /// The decode steps `work` (each sampled on the device: `sampling`) as drafted passes, one
    /// a request with its `ks` drafts, one after another (`decode_with_drafts`). Returns the
    /// steps still to run, re-indexed: those whose backend drafted nothing.
    fn drafted_passes(
        &mut self,
        work: &[(usize, Work)],
        sampling: &[DeviceStep],
        ks: &[usize],
    ) -> Vec<((usize, Work), DeviceStep)> {
        let mut plain = Vec::new();
        // Highest index first: a request that ends leaves the indices still to come as they are.
        for (((i, w), s), &k) in work.iter().zip(sampling).zip(ks).rev() {
            let (Work::Decode(token), Some(first)) = (w, s) else {
                continue;
            };
            let seq = self.running[*i].seq;
            if k == 0 || !self.decode_with_drafts(*i, *token, k, first.clone()) {
                plain.push((seq, *token, s.clone()));
            }
        }
        plain
            .into_iter()
            .rev()
            .filter_map(|(seq, token, s)| {
                let i = self.running.iter().position(|r| r.seq == seq)?;
                Some(((i, Work::Decode(token)), s))
            })
            .collect()
    }

    /// The decode step of `running[i]` as a pass of its own with drafts: the MTP head
    /// drafts `k` tokens after `token` (just sampled, not run), one pass runs `token` and the
    /// drafts, and the request's sampling checks each draft in turn (`first` is its sampling
    /// for the first row): greedy keeps a draft that is its argmax, sampling keeps it with its
    /// probability and else draws another token without it, which keeps the distribution of
    /// every token what sampling without drafts gives (`check_draft`). The kept drafts are sent
    /// now; the first token in a draft's place (or the one after the last draft) waits in
    /// `next`, as a step's token does, and the sequence keeps only the rows its tokens came
    /// from. A step the sampler cannot take on the device leaves that row's logits in `next`
    /// instead. False when the backend drafted nothing: the sequence then decodes without
    /// drafts from now on, and this step runs as any other.
    fn decode_with_drafts(
        &mut self,
        i: usize,
        token: u32,
        k: usize,
        first: (DeviceSampling, f64),
    ) -> bool {
        let seq = self.running[i].seq;
        let started = std::time::Instant::now();
        let backend = &mut self.backend;
        let drafted = catch_unwind(AssertUnwindSafe(|| backend.draft(seq, token, k)))
            .unwrap_or_else(|panic| Err(anyhow::anyhow!("{}", panic_message(panic))));
        let drafts = match drafted {
            Ok(drafts) if drafts.len() == k => drafts,
            Ok(drafts) => {
                let n = drafts.len();
                tracing::warn!("sequence {seq}: {n} drafts for {k}; no drafts from now on");
                self.running[i].drafting = false;
                return false;
            }
            Err(e) => {
                tracing::warn!("sequence {seq} decodes without drafts from now on: {e:#}");
                self.running[i].drafting = false;
                return false;
            }
        };
        let rows: Vec<u32> = [token].into_iter().chain(drafts.iter().copied()).collect();
        // Greedy without penalties needs only each row's argmax: the logits stay on the device.
        let limit = first.0.vocab_limit;
        let plain_greedy =
            |s: &DeviceSampling| s.is_greedy() && s.history.is_empty() && s.vocab_limit == limit;
        let argmax_only = plain_greedy(&first.0);
        let backend = &mut self.backend;
        let outcome = catch_unwind(AssertUnwindSafe(|| -> anyhow::Result<Verified> {
            let v = backend.config().vocab_size;
            if argmax_only {
                let picks = backend.forward_verify_argmax(seq, &rows, limit)?;
                anyhow::ensure!(picks.len() == rows.len(), "a pick for every row");
                return Ok(Verified::Picks(picks));
            }
            let logits = backend.forward_verify(seq, &rows)?;
            anyhow::ensure!(
                logits.len() == rows.len() * v,
                "the verify pass returned {} logits for {} rows",
                logits.len(),
                rows.len()
            );
            Ok(Verified::Logits(logits))
        }));
        let took = started.elapsed();
        self.stats.batches_total.fetch_add(1, Ordering::Relaxed);
        self.stats
            .backend_nanos_total
            .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
        let verified = match outcome {
            Ok(Ok(verified)) => verified,
            Ok(Err(e)) => {
                let r = self.remove(i);
                self.fail(r, format!("{e:#}"));
                return true;
            }
            Err(panic) => {
                let r = self.remove(i);
                self.fail(r, format!("internal error: {}", panic_message(panic)));
                return true;
            }
        };
        let v = self.backend.config().vocab_size;
        let mut sampling = first;
        // Rows of the pass whose tokens stand (the first always does); drafts checked, and
        // those that stood (the first `accepted`).
        let mut kept = 1;
        let mut checked_drafts = 0;
        let mut accepted = 0;
        let mut ended = None;
        for j in 0..=drafts.len() {
            let (s, u) = &sampling;
            // The draft stands (Ok), or the token in its place (or after the last draft).
            let checked = match &verified {
                // Greedy: the draft stands where it is the argmax.
                Verified::Picks(picks) if plain_greedy(s) => Ok(match drafts.get(j) {
                    Some(&d) if d == picks[j] => Ok(d),
                    _ => Err(picks[j]),
                }),
                _ => verified_row(self.backend.as_mut(), &verified, seq, j, v).and_then(|row| {
                    match drafts.get(j) {
                        // Sampling: speculative sampling's rule keeps the target's distribution.
                        Some(&draft) if !s.is_greedy() => s
                            .distribution(&row)
                            .map(|dist| check_draft(&dist, draft, *u).map(|()| draft))
                            .map_err(|e| e.to_string()),
                        draft => s
                            .sample(&row, *u)
                            .map(|pick| match draft {
                                Some(&d) if d == pick => Ok(pick),
                                _ => Err(pick),
                            })
                            .map_err(|e| e.to_string()),
                    }
                }),
            };
            let stands = match checked {
                Ok(Ok(draft)) => draft,
                Ok(Err(pick)) => {
                    checked_drafts = checked_drafts.max((j + 1).min(drafts.len()));
                    self.running[i].next = Some(Next::Sampled(pick));
                    break;
                }
                Err(e) => {
                    ended = Some(Err(e));
                    break;
                }
            };
            self.running[i].next = Some(Next::Sampled(stands));
            // The draft is the pick: sent now, and the row it was drafted for stands.
            checked_drafts = j + 1;
            accepted += 1;
            match self.sample(i) {
                Ok(None) => {}
                done => {
                    ended = Some(done);
                    break;
                }
            }
            kept += 1;
            let device = self.running[i].request.device_sampler.as_mut();
            match device.and_then(|d| d.device_step()) {
                Some(next) => sampling = next,
                None => {
                    match verified_row(self.backend.as_mut(), &verified, seq, j + 1, v) {
                        Ok(row) => self.running[i].next = Some(Next::Logits(row)),
                        Err(e) => ended = Some(Err(e)),
                    }
                    break;
                }
            }
        }
        let stats = &self.stats;
        stats.draft_passes_total.fetch_add(1, Ordering::Relaxed);
        let drafted = drafts.len() as u64;
        stats
            .draft_tokens_total
            .fetch_add(drafted, Ordering::Relaxed);
        let accepted_total = &stats.accepted_draft_tokens_total;
        accepted_total.fetch_add(accepted as u64, Ordering::Relaxed);
        for at in stats.accepted_per_position.iter().take(accepted) {
            at.fetch_add(1, Ordering::Relaxed);
        }
        let backend = &mut self.backend;
        let cut = catch_unwind(AssertUnwindSafe(|| backend.keep_verified(seq, kept)))
            .unwrap_or_else(|panic| {
                Err(anyhow::anyhow!("internal error: {}", panic_message(panic)))
            });
        let seconds = started.elapsed().as_secs_f64();
        let acceptance = &mut self.running[i].acceptance;
        (self.draft_lengths).record_drafted(acceptance, k, seconds, checked_drafts, accepted);
        match (ended, cut) {
            (Some(Ok(Some(reason))), Ok(())) => {
                let r = self.remove(i);
                self.finish(r, reason);
            }
            (Some(Err(message)), _) => {
                let r = self.remove(i);
                self.fail(r, message);
            }
            (_, Err(e)) => {
                let r = self.remove(i);
                self.fail(r, format!("{e:#}"));
            }
            _ => {}
        }
        true
    }

    /// With `prompt_logprobs`: after the prompt's first `to` tokens, reports prompt token `to`
    /// scored by these logits (the step ran one token: see plan_prefill).
    fn score_prompt_token(&mut self, i: usize, to: usize, next: &Next) -> Result<(), String> {
        let r = &self.running[i];
        let (Some(n), Next::Logits(logits)) = (r.request.prompt_logprobs, next) else {
            return Ok(());
        };
        let Some(&token) = r.request.prompt.get(to) else {
            return Ok(());
        };
        let scored =
            crate::sampling::token_logprobs(logits, token, n).map_err(|e| e.to_string())?;
        let _ = r.events.send(Event::PromptToken(SampledToken {
            id: token,
            logprob: Some(scored.logprob),
            top_logprobs: scored.top,
        }));
        Ok(())
    }

    /// The CPU picks of the requests whose logits came back, taken out of them (their samplers
    /// and logits) so that they can run beside the backend's pass: see `iterate`.
    fn take_picks(&mut self) -> Vec<SidePick> {
        let mut picks = Vec::new();
        for (index, r) in self.running.iter_mut().enumerate() {
            if !waits_for_cpu_pick(r) {
                continue;
            }
            let Some(Next::Logits(logits)) = r.next.take() else {
                continue;
            };
            let sampler = std::mem::replace(&mut r.request.sampler, Box::new(taken_sampler));
            picks.push(SidePick {
                index,
                sampler,
                logits,
                generated: r.generated.clone(),
                picked: None,
            });
        }
        picks
    }

    /// Runs the picks here, side by side, and gives them back.
    fn pick_now(&mut self, mut picks: Vec<SidePick>) {
        run_picks(&mut picks);
        self.restore_picks(picks);
    }

    /// Gives the picks' samplers back, each request's pick waiting for `sample`.
    fn restore_picks(&mut self, picks: Vec<SidePick>) {
        for p in picks {
            let r = &mut self.running[p.index];
            r.request.sampler = p.sampler;
            let picked = p
                .picked
                .unwrap_or_else(|| Err("internal error: the sampler did not run".to_string()));
            r.next = Some(Next::Picked(picked));
        }
    }

    /// Samples the next token of `running[i]` and sends it. `Some(reason)` when the sequence is
    /// done; an error when the sampler panicked.
    fn sample(&mut self, i: usize) -> Result<Option<FinishReason>, String> {
        let r = &mut self.running[i];
        if r.request.max_tokens == 0 {
            return Ok(Some(FinishReason::Length));
        }
        let next = r
            .next
            .take()
            .expect("called with a token or logits waiting");
        let request = &mut r.request;
        let generated = &r.generated;
        let token = match next {
            Next::Picked(picked) => picked?,
            next => catch_unwind(AssertUnwindSafe(|| match next {
                Next::Logits(mut logits) => (request.sampler)(&mut logits, generated),
                Next::Sampled(id) => match &mut request.device_sampler {
                    Some(device) => device.accept(id),
                    None => unreachable!("only a device sampler samples on the backend"),
                },
                Next::Picked(_) => unreachable!("matched above"),
            }))
            .map_err(|panic| format!("internal error: {}", panic_message(panic)))?,
        };
        let id = token.id;
        r.generated.push(id);
        self.stats
            .generation_tokens_total
            .fetch_add(1, Ordering::Relaxed);
        if r.events.send(Event::Token(token)).is_err() {
            return Ok(Some(FinishReason::Cancelled));
        }
        if r.request.stop_token_ids.contains(&id) {
            return Ok(Some(FinishReason::Stop));
        }
        if r.generated.len() >= r.request.max_tokens {
            return Ok(Some(FinishReason::Length));
        }
        Ok(None)
    }

    /// Adds prefill chunks to `work`, round-robin over the sequences still reading their prompt,
    /// within the batch's budget of prompt tokens. The decode steps already in `work` ride
    /// beside it: were they counted, the last prompt tokens of a burst would spill into one more
    /// pass of a few hundred tokens, which reads every expert's weights all the same (a 38 ms
    /// pass for 204 prompt tokens at 64 streams, bench/NOTES.md v1.72).
    fn plan_prefill(&mut self, work: &mut Vec<(usize, Work)>) {
        let n = self.running.len();
        if n == 0 {
            return;
        }
        let mut budget = self.options.batch_tokens;
        let mut planned_any = false;
        let start = self.prefill_turn % n;
        for k in 0..n {
            let i = (start + k) % n;
            let r = &self.running[i];
            if !r.prefilling() {
                continue;
            }
            if budget == 0 && planned_any {
                // Next batch starts with this one.
                self.prefill_turn = i;
                return;
            }
            // The prefix cache saves the state before the prompt's last token: a later request
            // with the same prompt, or one that extends it, resumes from it (the last token
            // must run for the logits anyway). So the prompt stops one token short, and the last
            // token runs as a step of its own (a decode step's time: ≈ 2 ms at 30K tokens on an
            // H100, bench/NOTES.md v1.83), unless the chunk that reaches the stop can take it:
            // when that state is cached already, or when the backend keeps it as the chunk runs
            // (not for drafting sequences, whose snapshots carry the MTP head's rows).
            let whole = r.request.prompt.len();
            let stops_short = self.cache.is_some() && r.prefilled + 1 < whole;
            let end = if stops_short { whole - 1 } else { whole };
            // A scored prompt runs a token per step: each position's logits are reported.
            let chunk = match r.request.prompt_logprobs {
                Some(_) => 1,
                None => self.options.prefill_chunk.max(1),
            };
            let mut len = (end - r.prefilled).min(chunk);
            if planned_any {
                len = len.min(budget);
            }
            let mut before_last = false;
            if stops_short && r.prefilled + len == end && len < chunk {
                let key = r.request.prompt_cache_key.as_deref();
                let cache = self.cache.as_ref().expect("stops_short: a cache");
                if cache.contains(key, &r.request.prompt[..end]) {
                    len += 1;
                } else if !r.drafting
                    && self.backend.can_keep_state_before_last()
                    && (self.backend.keep_state_before_last(r.seq))
                        .inspect_err(|e| tracing::debug!("stopping one token short: {e:#}"))
                        .is_ok()
                {
                    len += 1;
                    before_last = true;
                }
            }
            let to = r.prefilled + len;
            work.push((
                i,
                Work::Prefill {
                    from: r.prefilled,
                    to,
                    before_last,
                },
            ));
            budget = budget.saturating_sub(len);
            planned_any = true;
        }
        self.prefill_turn = start + 1;
    }

    /// After the prompt chunk `[from, to)` of `running[i]`: saves the state if the chunk reached
    /// a multiple of the snapshot interval or the prompt's last token but one. A chunk that took
    /// the last token past that stop (plan_prefill) saves the state it kept before it
    /// (`before_last`), or nothing when that state was cached already: the state at an interval
    /// mark on the way would cost another snapshot's memory for little.
    fn save_prompt_state(&mut self, i: usize, from: usize, to: usize, before_last: bool) {
        let interval = self.options.snapshot_interval.max(1);
        let r = &self.running[i];
        if self.cache.is_none() {
            return;
        }
        let (seq, key) = (r.seq, r.request.prompt_cache_key.clone());
        let whole = r.request.prompt.len();
        if before_last {
            let tokens = r.request.prompt[..to - 1].to_vec();
            self.save_state(seq, key.as_deref(), tokens, Saved::BeforeLast);
        } else if to == whole && to - from >= 2 {
            // Past a cached stop: nothing new.
        } else if to / interval > from / interval || to + 1 == whole {
            let tokens = r.request.prompt[..to].to_vec();
            self.save_state(seq, key.as_deref(), tokens, Saved::Now);
        }
    }

    /// Saves `seq`'s state (now, or the one its last step kept before its last token), which
    /// covers `tokens`, in the prefix cache (unless it is there).
    fn save_state(&mut self, seq: SeqId, key: Option<&str>, tokens: Vec<u32>, which: Saved) {
        let Some(cache) = &mut self.cache else {
            return;
        };
        if cache.contains(key, &tokens) {
            return;
        }
        // Out of device memory, say (the budget is no promise that the device has room): the
        // least recently used states make room for this newer one, which covers more of its
        // conversation; with none left the sequence goes on and only this state is not kept.
        let started = std::time::Instant::now();
        let snapshot = loop {
            let taken = match which {
                Saved::Now => self.backend.snapshot(seq),
                Saved::BeforeLast => self.backend.snapshot_before_last(seq),
            };
            match taken {
                Ok(snapshot) => break snapshot,
                Err(e) => match cache.evict_oldest() {
                    Some(id) => self.backend.drop_snapshot(id),
                    None => {
                        tracing::warn!("cannot save a state for the prefix cache: {e:#}");
                        return;
                    }
                },
            }
        };
        let taken = started.elapsed();
        let count = tokens.len();
        for id in cache.insert(key, tokens, snapshot) {
            self.backend.drop_snapshot(id);
        }
        tracing::debug!(
            seq,
            tokens = count,
            micros = taken.as_micros() as u64,
            total_micros = started.elapsed().as_micros() as u64,
            "state saved"
        );
    }

    /// Saves the state of `running[i]`'s prompt if its end waits for it (`Running::pending_save`).
    fn save_pending(&mut self, i: usize) {
        if let Some((from, to, before_last)) = self.running[i].pending_save.take() {
            self.save_prompt_state(i, from, to, before_last);
        }
    }

    fn remove(&mut self, i: usize) -> Running {
        // A sequence that ends at its first token leaves its prompt's state all the same.
        self.save_pending(i);
        let r = self.running.remove(i);
        self.reserved -= r.reserved;
        r
    }

    fn finish(&mut self, r: Running, reason: FinishReason) {
        let worth_saving = reason != FinishReason::Cancelled && r.generated.len() > 1;
        if self.cache.is_some() && worth_saving && !r.prefilling() {
            // The end of the turn: the state covers the prompt and every generated token but
            // the last (sampled, never fed). The next turn's prompt usually starts with these.
            let mut tokens = r.request.prompt.clone();
            tokens.extend_from_slice(&r.generated[..r.generated.len() - 1]);
            self.save_state(
                r.seq,
                r.request.prompt_cache_key.as_deref(),
                tokens,
                Saved::Now,
            );
        }
        self.backend.free_sequence(r.seq);
        self.stats.requests_finished.fetch_add(1, Ordering::Relaxed);
        let _ = r.events.send(Event::Done {
            reason,
            prompt_tokens: r.request.prompt.len(),
            completion_tokens: r.generated.len(),
            cached_tokens: r.cached,
        });
    }

    fn fail(&mut self, r: Running, message: String) {
        tracing::error!(seq = r.seq, "request failed: {message}");
        self.backend.free_sequence(r.seq);
        let _ = r.events.send(Event::Error(message));
    }

    fn publish_stats(&self) {
        let s = &self.stats;
        s.running.store(self.running.len(), Ordering::Relaxed);
        s.waiting.store(self.waiting.len(), Ordering::Relaxed);
        s.reserved_bytes.store(self.reserved, Ordering::Relaxed);
        let (entries, bytes) = self.cache.as_ref().map_or((0, 0), |c| (c.len(), c.bytes()));
        s.prefix_cache_entries.store(entries, Ordering::Relaxed);
        s.prefix_cache_bytes.store(bytes, Ordering::Relaxed);
    }
}
