//! One step's sampling as the device sampler takes it, with its host reference.

use super::logits::{argmax, sanitize, Filters, Penalties};
use super::{SampleError, GREEDY_TEMPERATURE};

/// One step's sampling as the device sampler takes it (from [`Sampler::device_step`]): everything
/// but the logit bias and logprobs, which stay on the CPU.
///
/// [`Sampler::device_step`]: super::Sampler::device_step
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceSampling {
    /// Below [`GREEDY_TEMPERATURE`]: the argmax of the penalised logits.
    pub temperature: f32,
    pub top_k: Option<usize>,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// Ids at or past this are never chosen: the model's vocabulary can be longer than the
    /// tokenizer's (padding rows).
    pub vocab_limit: usize,
    /// (token, occurrences in the output) for each token the penalties act on; empty when they
    /// are off. No token appears twice.
    pub history: Vec<(u32, u32)>,
}

impl DeviceSampling {
    /// The argmax (lowest id on ties) below `vocab_limit`, no penalties.
    pub fn greedy(vocab_limit: usize) -> Self {
        DeviceSampling {
            temperature: 0.0,
            top_k: None,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            vocab_limit,
            history: Vec::new(),
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_TEMPERATURE
    }

    /// The distribution a draw uses (as [`Sampler::distribution`]): the reference the device
    /// sampler is tested against, and the host side of backends without one.
    ///
    /// [`Sampler::distribution`]: super::Sampler::distribution
    pub fn distribution(&self, logits: &[f32]) -> Result<Vec<(u32, f64)>, SampleError> {
        let work = self.work(logits)?;
        if self.is_greedy() {
            return Ok(vec![(argmax(&work), 1.0)]);
        }
        Ok(self.filters().distribution(&work, &mut Vec::new()))
    }

    /// The token a draw at `u` picks from `logits` (the host version of the device sampler):
    /// [`draw`](super::draw) over [`distribution`](Self::distribution).
    pub fn sample(&self, logits: &[f32], u: f64) -> Result<u32, SampleError> {
        let work = self.work(logits)?;
        if self.is_greedy() {
            return Ok(argmax(&work));
        }
        Ok(self
            .filters()
            .draw(&work, u, &mut Vec::new(), &mut Vec::new()))
    }

    fn filters(&self) -> Filters {
        Filters {
            temperature: self.temperature,
            min_p: self.min_p,
            top_k: self.top_k,
            top_p: self.top_p,
        }
    }

    /// The sanitised logits (ids past the limit: -inf) after the penalties.
    fn work(&self, logits: &[f32]) -> Result<Vec<f32>, SampleError> {
        if logits.is_empty() {
            return Err(SampleError::EmptyLogits);
        }
        let mut work: Vec<f32> = logits
            .iter()
            .enumerate()
            .map(|(t, &l)| {
                if t < self.vocab_limit {
                    sanitize(l)
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
        let penalties = Penalties {
            repetition: self.repetition_penalty,
            frequency: self.frequency_penalty,
            presence: self.presence_penalty,
        };
        penalties.apply(&mut work, &self.history);
        if work.iter().all(|&l| l == f32::NEG_INFINITY) {
            return Err(SampleError::NoFiniteLogits);
        }
        Ok(work)
    }
}
