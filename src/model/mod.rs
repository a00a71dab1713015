//! What all backends share: the canonical weights, per-sequence state, the [`Backend`] trait,
//! and the CPU reference backend.

pub mod cpu;
pub mod state;
pub mod weights;

use std::collections::HashMap;

pub use state::SequenceState;
pub use weights::Weights;

use crate::config::ModelConfig;
use crate::sampling::DeviceSampling;

/// Identifies one sequence's state inside a backend.
pub type SeqId = u64;

/// A device that runs the model. It owns the per-sequence states (KV caches and recurrent
/// states live where the compute is), addressed by [`SeqId`].
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
    /// Peak device memory in use since the last reset, where the device can tell.
    fn peak_memory(&self) -> Option<u64> {
        None
    }
    fn reset_peak_memory(&mut self) {}
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
}

impl CpuBackend {
    pub fn new(weights: Weights) -> CpuBackend {
        CpuBackend {
            weights,
            states: HashMap::new(),
        }
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
    }
    fn forward(&mut self, seq: SeqId, tokens: &[u32]) -> anyhow::Result<Vec<f32>> {
        let vocab = self.weights.config.vocab_size;
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            anyhow::bail!("token id {bad} is outside the model's vocabulary ({vocab})");
        }
        let state = self
            .states
            .get_mut(&seq)
            .ok_or_else(|| anyhow::anyhow!("unknown sequence {seq}"))?;
        Ok(cpu::forward(
            &self.weights,
            tokens,
            state,
            cpu::Logits::Last,
        ))
    }
}
