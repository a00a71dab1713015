//! What all backends share: the canonical weights, per-sequence state, the [`Backend`] trait,
//! and the CPU reference backend.

pub mod block_trace;
pub mod convert;
pub mod cpu;
pub mod passes;
pub mod speculative;
pub mod state;
pub mod timeline;
pub mod weights;

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};

use passes::PassLimits;
use state::MtpState;
pub use state::SequenceState;
pub use timeline::{DecodeTimeline, LaunchTime};
pub use weights::Weights;

use crate::config::ModelConfig;
use crate::sampling::DeviceSampling;

/// Identifies one sequence's state inside a backend.
pub type SeqId = u64;

/// Identifies a saved copy of a sequence's state inside a backend (see [`Backend::snapshot`]).
pub type SnapshotId = u64;

/// A snapshot just taken: its id and the memory it holds (what a prefix cache accounts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Snapshot {
    pub id: SnapshotId,
    pub bytes: u64,
}

/// Device time of one op of the forward pass, summed over the calls since timing was turned on
/// ([`Backend::set_op_timing`]): a kernel (or other work) within a section of the pass.
#[derive(Debug, Clone, PartialEq)]
pub struct OpTime {
    /// The part of the forward pass: "gdn in_proj", "attn mixer", "moe experts", ...
    pub section: String,
    /// The kernel, or "rest" for the section's work not launched by lily (cuBLAS's kernels).
    pub kernel: String,
    pub ms: f64,
    pub calls: u64,
}

/// A device that runs the model. It owns the per-sequence states (KV caches and recurrent
/// states live where the compute is), addressed by [`SeqId`].
///
/// Snapshots (for prefix reuse) follow this contract:
/// * [`snapshot`](Backend::snapshot) copies the whole state of a sequence as it is now (conv
///   windows, recurrent states, KV entries of every token so far, the position); the sequence
///   itself is unchanged and runs on.
/// * [`restore`](Backend::restore) overwrites the state of an existing sequence (typically one
///   just created) with a copy of the snapshot; the sequence then continues from the snapshot's
///   position. A snapshot can be restored any number of times, into any sequence.
/// * a snapshot lives until [`drop_snapshot`](Backend::drop_snapshot), independent of the
///   sequence it was taken from; its memory is the `bytes` reported when it was taken.
///
/// Backends without snapshots keep the defaults (`can_snapshot` false); the engine then caches
/// nothing.
pub trait Backend: Send {
    fn config(&self) -> &ModelConfig;
    /// A short description for logs and `/v1/models` ("cpu", "cuda:0 NVIDIA H200", ...).
    fn device_name(&self) -> String;
    /// Allocates a fresh state for a new sequence.
    fn create_sequence(&mut self, seq: SeqId) -> anyhow::Result<()>;
    fn free_sequence(&mut self, seq: SeqId);
    /// Runs `tokens` (the next tokens of `seq`) and returns the logits of the last one.
    fn forward(&mut self, seq: SeqId, tokens: &[u32]) -> anyhow::Result<Vec<f32>>;
    /// Runs `tokens` and returns the greedy next token. Devices override this to keep the
    /// logits where they are and bring back one id.
    fn forward_greedy(&mut self, seq: SeqId, tokens: &[u32]) -> anyhow::Result<u32> {
        let logits = self.forward(seq, tokens)?;
        Ok(argmax(&logits))
    }
    /// Runs `tokens` and samples the next token as `sampling` says, the draw at `u` (uniform in
    /// [0, 1), from the request's RNG). Devices override this to sample where the logits are and
    /// bring back one id; this default is the reference they must match.
    fn forward_sample(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        sampling: &DeviceSampling,
        u: f64,
    ) -> anyhow::Result<u32> {
        let logits = self.forward(seq, tokens)?;
        Ok(sampling.sample(&logits, u)?)
    }
    /// Runs one step for each of several sequences (a prefill chunk or a decode token each, each
    /// sequence at most once) and returns, in order, what each step asked for: the logits of
    /// its last token, or the token sampled after it. An error is reported for its own step
    /// only, except that a fault of a shared pass fails every step of it; a sequence whose step
    /// failed may be left in any state (callers free it). The default runs the steps one by one
    /// (a panic in one becomes that step's error); devices override it to batch them.
    fn forward_batch(&mut self, steps: &[Step]) -> Vec<anyhow::Result<StepOutput>> {
        steps
            .iter()
            .map(|step| {
                catch_unwind(AssertUnwindSafe(|| self.forward_step(step))).unwrap_or_else(|panic| {
                    Err(anyhow::anyhow!("internal error: {}", panic_message(panic)))
                })
            })
            .collect()
    }
    /// One step alone: [`forward`](Backend::forward) or [`forward_sample`](Backend::forward_sample).
    fn forward_step(&mut self, step: &Step) -> anyhow::Result<StepOutput> {
        match step.sample {
            Some((sampling, u)) => self
                .forward_sample(step.seq, step.tokens, sampling, u)
                .map(StepOutput::Token),
            None => self.forward(step.seq, step.tokens).map(StepOutput::Logits),
        }
    }
    /// Readies decode passes of up to `max_batch` sequences before the first request (the CUDA
    /// backend captures their graphs, so that no step of a run pays a capture). Called once by
    /// the engine; a failure is logged and serving goes on.
    fn prepare_decode(&mut self, max_batch: usize) -> anyhow::Result<()> {
        let _ = max_batch;
        Ok(())
    }
    /// Bytes of state a sequence of `tokens` tokens holds (recurrent state and KV entries):
    /// what admission by memory reserves for a request.
    fn sequence_bytes(&self, tokens: usize) -> u64 {
        SequenceState::bytes(self.config(), tokens)
    }
    /// Whether [`snapshot`](Backend::snapshot) and [`restore`](Backend::restore) work here.
    fn can_snapshot(&self) -> bool {
        false
    }
    /// Saves a copy of `seq`'s state; see the trait's documentation.
    fn snapshot(&mut self, seq: SeqId) -> anyhow::Result<Snapshot> {
        let _ = seq;
        anyhow::bail!("{} cannot snapshot sequence states", self.device_name())
    }
    /// Replaces `seq`'s state with a copy of `snapshot`; returns the position it resumes at.
    fn restore(&mut self, snapshot: SnapshotId, seq: SeqId) -> anyhow::Result<usize> {
        let _ = (snapshot, seq);
        anyhow::bail!("{} cannot restore sequence states", self.device_name())
    }
    /// Frees a snapshot; unknown ids are ignored.
    fn drop_snapshot(&mut self, snapshot: SnapshotId) {
        let _ = snapshot;
    }
    /// Whether [`keep_state_before_last`](Backend::keep_state_before_last) and
    /// [`snapshot_before_last`](Backend::snapshot_before_last) work here. The prefix cache saves
    /// a prompt's state before its last token (a later request with the same prompt resumes
    /// there: the last token must run for the logits); with these, the prompt's last chunk
    /// keeps that state as it runs, where otherwise the engine stops one token short and runs
    /// the last token as a step of its own (a decode step's time).
    fn can_keep_state_before_last(&self) -> bool {
        false
    }
    /// `seq`'s next step keeps the state before its last token (for one
    /// [`snapshot_before_last`](Backend::snapshot_before_last)).
    fn keep_state_before_last(&mut self, seq: SeqId) -> anyhow::Result<()> {
        let _ = seq;
        anyhow::bail!(
            "{} cannot keep a state before a step's last token",
            self.device_name()
        )
    }
    /// A snapshot of the state the last step of `seq` kept (all its tokens but the step's last),
    /// as [`snapshot`](Backend::snapshot) gives; the kept state is used up, unless this fails.
    fn snapshot_before_last(&mut self, seq: SeqId) -> anyhow::Result<Snapshot> {
        let _ = seq;
        anyhow::bail!(
            "{} cannot keep a state before a step's last token",
            self.device_name()
        )
    }
    /// Whether sequences here can draft tokens with the checkpoint's MTP head (MODEL.md §4):
    /// the methods down to [`keep_verified`](Backend::keep_verified) work.
    fn can_draft(&self) -> bool {
        false
    }
    /// Makes `seq`, created and not yet run, a drafting sequence: from now on it keeps what its
    /// MTP head needs (the hidden state of every row run).
    fn start_drafting(&mut self, seq: SeqId) -> anyhow::Result<()> {
        let _ = seq;
        anyhow::bail!("{} cannot draft tokens", self.device_name())
    }
    /// Drafts `k` tokens for `seq` (greedy; [`cpu::mtp::draft`] is the reference): the tokens
    /// after `next`, the token picked after the last row run (not run yet). Some row must have
    /// run since the last drafts.
    fn draft(&mut self, seq: SeqId, next: u32, k: usize) -> anyhow::Result<Vec<u32>> {
        let _ = (seq, next, k);
        anyhow::bail!("{} cannot draft tokens", self.device_name())
    }
    /// Runs `tokens` of `seq` (its next token, then drafts) as one pass and returns the logits
    /// of every row, `[rows, vocab]`. [`keep_verified`](Backend::keep_verified) follows before
    /// anything else runs for `seq`.
    fn forward_verify(&mut self, seq: SeqId, tokens: &[u32]) -> anyhow::Result<Vec<f32>> {
        let _ = (seq, tokens);
        anyhow::bail!("{} cannot verify drafts", self.device_name())
    }
    /// [`forward_verify`](Backend::forward_verify), the logits left where they are: each row's
    /// argmax below `vocab_limit` (greedy's pick without penalties). Until
    /// [`keep_verified`](Backend::keep_verified), [`verified_logits`](Backend::verified_logits)
    /// gives a row's logits.
    fn forward_verify_argmax(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        vocab_limit: usize,
    ) -> anyhow::Result<Vec<u32>> {
        let _ = (seq, tokens, vocab_limit);
        anyhow::bail!("{} cannot verify drafts", self.device_name())
    }
    /// Row `row`'s logits of the verify pass open for `seq` (after
    /// [`forward_verify_argmax`](Backend::forward_verify_argmax)).
    fn verified_logits(&mut self, seq: SeqId, row: usize) -> anyhow::Result<Vec<f32>> {
        let _ = (seq, row);
        anyhow::bail!("{} keeps no verify pass's logits", self.device_name())
    }
    /// Keeps the first `rows` rows (at least one) of `seq`'s last
    /// [`forward_verify`](Backend::forward_verify): its state becomes what running only them
    /// would have made it.
    fn keep_verified(&mut self, seq: SeqId, rows: usize) -> anyhow::Result<()> {
        let _ = (seq, rows);
        anyhow::bail!("{} cannot verify drafts", self.device_name())
    }
    /// Turns timing of each op of the forward pass on or off (`lily bench --profile`); returns
    /// whether this backend can time its ops.
    fn set_op_timing(&mut self, on: bool) -> bool {
        let _ = on;
        false
    }
    /// The op times gathered since timing was turned on or last taken, largest first.
    fn take_op_times(&mut self) -> Vec<OpTime> {
        Vec::new()
    }
    /// Starts a timeline of the decode steps from now on, as their CUDA graph runs (`lily bench
    /// --timeline`); returns whether this backend can take one.
    fn start_timeline(&mut self) -> anyhow::Result<bool> {
        Ok(false)
    }
    /// Ends the timeline begun by [`start_timeline`](Backend::start_timeline): None where none
    /// was taken.
    fn stop_timeline(&mut self) -> anyhow::Result<Option<DecodeTimeline>> {
        Ok(None)
    }
    /// Starts recording what the MoE routers decide for every row run from now on (`lily
    /// agree`); returns whether this backend can.
    fn trace_routing(&mut self) -> bool {
        false
    }
    /// The routing recorded since [`trace_routing`](Backend::trace_routing), which stops.
    fn take_routing_trace(&mut self) -> Option<RoutingTrace> {
        None
    }
    /// Peak device memory in use since the last reset, where the device can tell.
    fn peak_memory(&self) -> Option<u64> {
        None
    }
    fn reset_peak_memory(&mut self) {}
}

/// What a device's MoE routers decided (for `lily agree`, src/agree.rs): per MoE layer, the rows
/// run since tracing began, in order (a pass's prompt rows, then its decode rows).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RoutingTrace {
    /// `[layer][row · num_experts + e]`: the router logits as the device computed them.
    pub logits: Vec<Vec<f32>>,
    /// `[layer][row · top_k + j]`: the experts the device ran for the row.
    pub experts: Vec<Vec<u32>>,
}

impl RoutingTrace {
    /// A trace of no rows yet for a model of `layers` layers.
    pub fn new(layers: usize) -> Self {
        RoutingTrace {
            logits: vec![Vec::new(); layers],
            experts: vec![Vec::new(); layers],
        }
    }
}

/// One step of a batch ([`Backend::forward_batch`]): the next tokens of one sequence, and
/// what comes back after them.
#[derive(Debug, Clone, Copy)]
pub struct Step<'a> {
    pub seq: SeqId,
    pub tokens: &'a [u32],
    /// `Some((sampling, u))`: the backend picks the next token as
    /// [`Backend::forward_sample`] does and only the token comes back; `None`: the logits of
    /// the last token come back.
    pub sample: Option<(&'a DeviceSampling, f64)>,
}

/// What one step of a batch gives back.
#[derive(Debug, Clone, PartialEq)]
pub enum StepOutput {
    Logits(Vec<f32>),
    Token(u32),
}

/// The message of a caught panic.
pub fn panic_message(panic: Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "panic".into())
}

/// Index of the largest value; the lowest index on ties.
pub fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in values.iter().enumerate() {
        if x > values[best] {
            best = i;
        }
    }
    best as u32
}

/// The reference backend: [`cpu::forward`] over weights in host memory.
pub struct CpuBackend {
    weights: Weights,
    states: HashMap<SeqId, SequenceState>,
    snapshots: HashMap<SnapshotId, SequenceState>,
    next_snapshot: SnapshotId,
    /// What the routers decide while `lily agree` traces it (one call at a time then).
    routing: Option<RoutingTrace>,
    /// Per sequence with a verify pass not yet cut back: its state before the pass, the pass's
    /// tokens (the reference rolls back by running the kept rows again) and its logits.
    verifying: HashMap<SeqId, (SequenceState, Vec<u32>, Vec<f32>)>,
    /// Sequences whose next step keeps its state before the last token (`None` until it runs).
    before_last: HashMap<SeqId, Option<SequenceState>>,
}

impl CpuBackend {
    pub fn new(weights: Weights) -> CpuBackend {
        CpuBackend {
            weights,
            states: HashMap::new(),
            snapshots: HashMap::new(),
            next_snapshot: 0,
            routing: None,
            verifying: HashMap::new(),
            before_last: HashMap::new(),
        }
    }

    /// Runs `tokens` of `seq`: the logits `which` names.
    fn run(&mut self, seq: SeqId, tokens: &[u32], which: cpu::Logits) -> anyhow::Result<Vec<f32>> {
        self.check_tokens(seq, tokens)?;
        let tokens = self.run_all_but_last(seq, tokens, which)?;
        let state = self
            .states
            .get_mut(&seq)
            .ok_or_else(|| anyhow::anyhow!("unknown sequence {seq}"))?;
        Ok(match self.routing.as_mut() {
            Some(trace) => cpu::forward_recorded(&self.weights, tokens, state, which, trace),
            None => cpu::forward(&self.weights, tokens, state, which),
        })
    }

    /// For a sequence asked to keep its state before a step's last token: runs all of `tokens`
    /// but the last, keeps the state and returns the last token, which runs as the step's rest
    /// (with `which` All, the earlier rows' logits would be lost: refused). Else `tokens`.
    fn run_all_but_last<'t>(
        &mut self,
        seq: SeqId,
        tokens: &'t [u32],
        which: cpu::Logits,
    ) -> anyhow::Result<&'t [u32]> {
        match self.before_last.get(&seq) {
            Some(None) => {}
            Some(Some(_)) => {
                // Kept by an earlier step and not taken: stale now.
                self.before_last.remove(&seq);
                return Ok(tokens);
            }
            None => return Ok(tokens),
        }
        anyhow::ensure!(
            matches!(which, cpu::Logits::Last),
            "a step that keeps the state before its last token gives only the last logits"
        );
        let (last, rest) = tokens.split_last().expect("checked: some tokens");
        let state = self
            .states
            .get_mut(&seq)
            .ok_or_else(|| anyhow::anyhow!("unknown sequence {seq}"))?;
        if !rest.is_empty() {
            cpu::forward(&self.weights, rest, state, cpu::Logits::Last);
        }
        let kept = state.clone();
        self.before_last.insert(seq, Some(kept));
        Ok(std::slice::from_ref(last))
    }

    /// Whether `tokens` may run next for `seq`: some, in the vocabulary, no verify pass open.
    fn check_tokens(&self, seq: SeqId, tokens: &[u32]) -> anyhow::Result<()> {
        anyhow::ensure!(!tokens.is_empty(), "no tokens to run");
        let vocab = self.weights.config.vocab_size;
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            anyhow::bail!("token id {bad} is outside the model's vocabulary ({vocab})");
        }
        anyhow::ensure!(
            !self.verifying.contains_key(&seq),
            "sequence {seq} runs on before its verify pass was cut back"
        );
        Ok(())
    }

    fn state(&mut self, seq: SeqId) -> anyhow::Result<&mut SequenceState> {
        self.states
            .get_mut(&seq)
            .ok_or_else(|| anyhow::anyhow!("unknown sequence {seq}"))
    }
}

impl Backend for CpuBackend {
    fn config(&self) -> &ModelConfig {
        &self.weights.config
    }
    fn device_name(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }
    fn create_sequence(&mut self, seq: SeqId) -> anyhow::Result<()> {
        self.states
            .insert(seq, SequenceState::new(&self.weights.config));
        Ok(())
    }
    fn free_sequence(&mut self, seq: SeqId) {
        self.states.remove(&seq);
        self.verifying.remove(&seq);
        self.before_last.remove(&seq);
    }
    fn forward(&mut self, seq: SeqId, tokens: &[u32]) -> anyhow::Result<Vec<f32>> {
        self.run(seq, tokens, cpu::Logits::Last)
    }
    /// The steps a batch can take ([`passes::plan`], tokens in the vocabulary, no verify pass
    /// open) run as one [`cpu::forward_batch`]; the others one by one, which reports what is
    /// wrong with them.
    fn forward_batch(&mut self, steps: &[Step]) -> Vec<anyhow::Result<StepOutput>> {
        let keeps_before_last = |s: &Step| self.before_last.contains_key(&s.seq);
        if self.routing.is_some() || steps.iter().any(keeps_before_last) {
            // Traced rows go in the order the steps come; a step keeping its state before the
            // last token runs in two parts, and a kept state not taken is dropped
            // (run_all_but_last).
            return steps
                .iter()
                .map(|s| {
                    catch_unwind(AssertUnwindSafe(|| self.forward_step(s))).unwrap_or_else(
                        |panic| Err(anyhow::anyhow!("internal error: {}", panic_message(panic))),
                    )
                })
                .collect();
        }
        let vocab = self.weights.config.vocab_size;
        // One pass of any size; the CPU has no slots (0).
        let unlimited = PassLimits {
            rows: usize::MAX,
            sequences: usize::MAX,
        };
        let planned = passes::plan(
            steps,
            unlimited,
            |seq| self.states.get(&seq).map(|s| (0, s.position)),
            |step, _| {
                step.tokens.iter().all(|&t| (t as usize) < vocab)
                    && !self.verifying.contains_key(&step.seq)
            },
        );
        // (index in steps, sequence, its state taken out of the map for the batch)
        let mut taken: Vec<(usize, SeqId, SequenceState)> = planned
            .into_iter()
            .flatten()
            .map(|p| {
                let seq = steps[p.index].seq;
                let state = self
                    .states
                    .remove(&seq)
                    .expect("planned steps have a state");
                (p.index, seq, state)
            })
            .collect();
        let mut results: Vec<Option<anyhow::Result<StepOutput>>> =
            steps.iter().map(|_| None).collect();
        let weights = &self.weights;
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            let mut seqs: Vec<(&[u32], &mut SequenceState)> = taken
                .iter_mut()
                .map(|(i, _, state)| (steps[*i].tokens, state))
                .collect();
            cpu::forward_batch(weights, &mut seqs, cpu::Logits::Last)
        }));
        match outcome {
            Ok(all_logits) => {
                for ((i, ..), logits) in taken.iter().zip(all_logits) {
                    results[*i] = Some(match steps[*i].sample {
                        Some((sampling, u)) => sampling
                            .sample(&logits, u)
                            .map(StepOutput::Token)
                            .map_err(anyhow::Error::from),
                        None => Ok(StepOutput::Logits(logits)),
                    });
                }
            }
            Err(panic) => {
                let why = panic_message(panic);
                for (i, ..) in &taken {
                    results[*i] = Some(Err(anyhow::anyhow!("internal error: {why}")));
                }
            }
        }
        for (_, seq, state) in taken {
            self.states.insert(seq, state);
        }
        steps
            .iter()
            .zip(results)
            .map(|(step, done)| {
                done.unwrap_or_else(|| {
                    catch_unwind(AssertUnwindSafe(|| self.forward_step(step))).unwrap_or_else(
                        |panic| Err(anyhow::anyhow!("internal error: {}", panic_message(panic))),
                    )
                })
            })
            .collect()
    }
    fn can_draft(&self) -> bool {
        self.weights.mtp.is_some()
    }
    fn start_drafting(&mut self, seq: SeqId) -> anyhow::Result<()> {
        anyhow::ensure!(self.can_draft(), "this checkpoint has no MTP head");
        let state = self.state(seq)?;
        anyhow::ensure!(
            state.position == 0,
            "a sequence starts drafting before its first token"
        );
        state.mtp = Some(MtpState::default());
        Ok(())
    }
    fn draft(&mut self, seq: SeqId, next: u32, k: usize) -> anyhow::Result<Vec<u32>> {
        anyhow::ensure!(
            !self.verifying.contains_key(&seq),
            "drafting before the verify pass was cut back"
        );
        let state = self
            .states
            .get_mut(&seq)
            .ok_or_else(|| anyhow::anyhow!("unknown sequence {seq}"))?;
        cpu::mtp::draft(&self.weights, state, next, k)
    }
    fn forward_verify(&mut self, seq: SeqId, tokens: &[u32]) -> anyhow::Result<Vec<f32>> {
        self.check_tokens(seq, tokens)?;
        let state = self
            .states
            .get_mut(&seq)
            .ok_or_else(|| anyhow::anyhow!("unknown sequence {seq}"))?;
        let before = state.clone();
        let logits = cpu::forward_verify(&self.weights, tokens, state);
        self.verifying
            .insert(seq, (before, tokens.to_vec(), logits.clone()));
        Ok(logits)
    }
    fn forward_verify_argmax(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        vocab_limit: usize,
    ) -> anyhow::Result<Vec<u32>> {
        let logits = self.forward_verify(seq, tokens)?;
        let v = self.weights.config.vocab_size;
        let limit = vocab_limit.clamp(1, v);
        Ok(logits
            .chunks_exact(v)
            .map(|row| argmax(&row[..limit]))
            .collect())
    }
    fn verified_logits(&mut self, seq: SeqId, row: usize) -> anyhow::Result<Vec<f32>> {
        let v = self.weights.config.vocab_size;
        let (_, tokens, logits) = self
            .verifying
            .get(&seq)
            .ok_or_else(|| anyhow::anyhow!("sequence {seq} has no verify pass open"))?;
        anyhow::ensure!(
            row < tokens.len(),
            "row {row} of a verify pass of {}",
            tokens.len()
        );
        Ok(logits[row * v..(row + 1) * v].to_vec())
    }
    fn keep_verified(&mut self, seq: SeqId, rows: usize) -> anyhow::Result<()> {
        let ran = self
            .verifying
            .get(&seq)
            .ok_or_else(|| anyhow::anyhow!("sequence {seq} has no verify pass to cut back"))?
            .1
            .len();
        anyhow::ensure!(
            (1..=ran).contains(&rows),
            "keeping {rows} rows of a verify pass of {ran}"
        );
        let (before, tokens, _) = self.verifying.remove(&seq).expect("looked up above");
        if rows < tokens.len() {
            // Run the kept rows again from the state before the pass, as the pass ran them.
            let state = self
                .states
                .get_mut(&seq)
                .ok_or_else(|| anyhow::anyhow!("unknown sequence {seq}"))?;
            *state = before;
            cpu::forward_verify(&self.weights, &tokens[..rows], state);
        }
        Ok(())
    }
    fn trace_routing(&mut self) -> bool {
        self.routing = Some(RoutingTrace::new(self.weights.layers.len()));
        true
    }
    fn take_routing_trace(&mut self) -> Option<RoutingTrace> {
        self.routing.take()
    }
    fn can_snapshot(&self) -> bool {
        true
    }
    fn snapshot(&mut self, seq: SeqId) -> anyhow::Result<Snapshot> {
        let copy = self.state(seq)?.clone();
        let bytes = copy.bytes_held();
        let id = self.next_snapshot;
        self.next_snapshot += 1;
        self.snapshots.insert(id, copy);
        Ok(Snapshot { id, bytes })
    }
    fn restore(&mut self, snapshot: SnapshotId, seq: SeqId) -> anyhow::Result<usize> {
        let copy = self
            .snapshots
            .get(&snapshot)
            .ok_or_else(|| anyhow::anyhow!("unknown snapshot {snapshot}"))?
            .clone();
        let position = copy.position;
        *self.state(seq)? = copy;
        Ok(position)
    }
    fn drop_snapshot(&mut self, snapshot: SnapshotId) {
        self.snapshots.remove(&snapshot);
    }
    fn can_keep_state_before_last(&self) -> bool {
        true
    }
    fn keep_state_before_last(&mut self, seq: SeqId) -> anyhow::Result<()> {
        anyhow::ensure!(self.states.contains_key(&seq), "unknown sequence {seq}");
        self.before_last.insert(seq, None);
        Ok(())
    }
    fn snapshot_before_last(&mut self, seq: SeqId) -> anyhow::Result<Snapshot> {
        if !matches!(self.before_last.get(&seq), Some(Some(_))) {
            anyhow::bail!("sequence {seq} kept no state before a step's last token");
        }
        let Some(Some(kept)) = self.before_last.remove(&seq) else {
            unreachable!("checked above");
        };
        let bytes = kept.bytes_held();
        let id = self.next_snapshot;
        self.next_snapshot += 1;
        self.snapshots.insert(id, kept);
        Ok(Snapshot { id, bytes })
    }
}
