//! The CPU sampler: one step's logits to a token, with the request's own RNG and penalty history.

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use rustc_hash::FxHashMap;

use super::logits::{argmax, key_token, rank_key, sanitize, top_keys, Filters, Penalties, RankKey};
use super::{DeviceSampling, SamplingParams};

/// The logits handed to the sampler cannot be sampled from. These are engine bugs, not user errors.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SampleError {
    #[error("logits are empty")]
    EmptyLogits,
    #[error("no logit is finite (all NaN or -inf)")]
    NoFiniteLogits,
    #[error("token {token} is outside the vocabulary of {vocab} logits")]
    TokenOutOfRange { token: u32, vocab: usize },
}

/// One step's result.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// Present when the request asked for logprobs.
    pub logprobs: Option<TokenLogprobs>,
}

/// Log-probabilities for one generated position.
///
/// Like vLLM's default (`logprobs_mode = "raw_logprobs"`), these come from the model's own
/// distribution: log-softmax of the raw logits, before bias, penalties, temperature and filters.
/// So they describe what the model thought, not the (possibly truncated) distribution drawn from,
/// and a token filtered out by top-k can still appear among the alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The chosen token's logprob.
    pub logprob: f32,
    /// The most likely tokens, most likely first (ties: lower id first).
    pub top: Vec<(u32, f32)>,
}

/// Per-request sampler: owns the RNG (so a seed reproduces a request whatever it is batched with)
/// and the token history the penalties need.
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// The tokens the penalties act on, as (token, occurrences in the output so far): every output
    /// token, and every prompt token (count 0) when the repetition penalty is on. One list for both
    /// samplers: the CPU walks it, the device sampler gets it as it is ([`DeviceSampling`]).
    history: Vec<(u32, u32)>,
    /// Where each token of `history` is.
    history_index: FxHashMap<u32, usize>,
    /// Scratch buffers reused across steps so that a step allocates nothing vocabulary-sized.
    work: Vec<f32>,
    candidates: Vec<RankKey>,
    weights: Vec<f64>,
}

impl SamplingParams {
    /// Temperature and the three filters, as the sampler applies them.
    fn filters(&self) -> Filters {
        Filters {
            temperature: self.temperature,
            min_p: self.min_p,
            top_k: self.top_k,
            top_p: self.top_p,
        }
    }
}

impl Sampler {
    pub fn new(params: &SamplingParams, prompt: &[u32]) -> Self {
        let rng = match params.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => rand::make_rng(),
        };
        let mut sampler = Self {
            params: params.clone(),
            rng,
            history: Vec::new(),
            history_index: FxHashMap::default(),
            work: Vec::new(),
            candidates: Vec::new(),
            weights: Vec::new(),
        };
        if params.repetition_penalty != 1.0 {
            for &token in prompt {
                sampler.history_entry(token);
            }
        }
        sampler
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Pick the next token from this step's raw logits (one per vocabulary entry) and record it
    /// in the history the penalties use.
    pub fn sample(&mut self, logits: &[f32]) -> Result<Sampled, SampleError> {
        self.prepare(logits)?;
        let token = if self.params.is_greedy() {
            argmax(&self.work)
        } else {
            let u = self.next_uniform();
            let (work, cands, weights) = (&self.work, &mut self.candidates, &mut self.weights);
            self.params.filters().draw(work, u, cands, weights)
        };
        self.finish_step(token, logits)
    }

    /// This step's sampling for the device sampler, when the device can do all of it (no logit
    /// bias, no logprobs), with the uniform number its draw uses. The RNG advances exactly as
    /// [`sample`](Self::sample) would advance it, so a seed gives the same tokens on both
    /// samplers. Report the token the device chose with [`record`](Self::record).
    pub fn device_step(&mut self, vocab_limit: usize) -> Option<(DeviceSampling, f64)> {
        let p = &self.params;
        if !p.logit_bias.is_empty() || p.top_logprobs.is_some() {
            return None;
        }
        let u = if p.is_greedy() {
            0.0
        } else {
            self.rng.random()
        };
        let p = &self.params;
        let penalised =
            p.repetition_penalty != 1.0 || p.frequency_penalty != 0.0 || p.presence_penalty != 0.0;
        let step = DeviceSampling {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            min_p: p.min_p,
            repetition_penalty: p.repetition_penalty,
            frequency_penalty: p.frequency_penalty,
            presence_penalty: p.presence_penalty,
            vocab_limit,
            history: if penalised {
                self.history.clone()
            } else {
                Vec::new()
            },
        };
        Some((step, u))
    }

    /// Record a token chosen elsewhere (by the device sampler) in the penalty history.
    pub fn record(&mut self, token: u32) {
        self.history_entry(token).1 += 1;
    }

    /// The uniform number in [0, 1) a draw uses: the request's RNG, one number per sampled step.
    fn next_uniform(&mut self) -> f64 {
        self.rng.random()
    }

    fn history_entry(&mut self, token: u32) -> &mut (u32, u32) {
        let next = self.history.len();
        let i = *self.history_index.entry(token).or_insert(next);
        if i == next {
            self.history.push((token, 0));
        }
        &mut self.history[i]
    }

    /// Record a token the engine chose without sampling (a forced `</think>`), so the penalties
    /// see it and, if asked, report its logprobs like any other token.
    pub fn force(&mut self, token: u32, logits: &[f32]) -> Result<Sampled, SampleError> {
        if token as usize >= logits.len() {
            return Err(SampleError::TokenOutOfRange {
                token,
                vocab: logits.len(),
            });
        }
        self.finish_step(token, logits)
    }

    /// The distribution the next draw would use: (token, probability) pairs after bias,
    /// penalties, temperature, min-p, top-k and top-p, in the order the draw walks them
    /// (ascending token id); probabilities sum to 1. Greedy requests give the argmax with
    /// probability 1. Exposed for tests and for checking the device sampler.
    pub fn distribution(&mut self, logits: &[f32]) -> Result<Vec<(u32, f64)>, SampleError> {
        self.prepare(logits)?;
        if self.params.is_greedy() {
            return Ok(vec![(argmax(&self.work), 1.0)]);
        }
        let filters = self.params.filters();
        Ok(filters.distribution(&self.work, &mut self.candidates))
    }

    /// Copy the logits into the work buffer and apply bias and penalties (vLLM applies the logit
    /// bias first, then repetition, then frequency and presence penalties).
    fn prepare(&mut self, logits: &[f32]) -> Result<(), SampleError> {
        if logits.is_empty() {
            return Err(SampleError::EmptyLogits);
        }
        self.work.clear();
        self.work.extend(logits.iter().copied().map(sanitize));
        for &(token, bias) in &self.params.logit_bias {
            if let Some(l) = self.work.get_mut(token as usize) {
                *l += bias;
            }
        }
        let p = &self.params;
        let penalties = Penalties {
            repetition: p.repetition_penalty,
            frequency: p.frequency_penalty,
            presence: p.presence_penalty,
        };
        penalties.apply(&mut self.work, &self.history);
        if self.work.iter().all(|&l| l == f32::NEG_INFINITY) {
            return Err(SampleError::NoFiniteLogits);
        }
        Ok(())
    }

    fn finish_step(&mut self, token: u32, logits: &[f32]) -> Result<Sampled, SampleError> {
        self.record(token);
        let logprobs = match self.params.top_logprobs {
            Some(n) => Some(raw_logprobs(logits, token, n, &mut self.candidates)?),
            None => None,
        };
        Ok(Sampled { token, logprobs })
    }
}

/// The log-probability of `token` under `logits` (raw log-softmax, no sampling parameters) and
/// the `n` most likely tokens: what scoring a given text reports (`echo` with `logprobs`).
pub fn token_logprobs(logits: &[f32], token: u32, n: usize) -> Result<TokenLogprobs, SampleError> {
    raw_logprobs(logits, token, n, &mut Vec::new())
}

/// Raw log-softmax of the model's logits: the chosen token's value and the `n` most likely.
/// `scratch` is a reusable buffer.
fn raw_logprobs(
    logits: &[f32],
    token: u32,
    n: usize,
    scratch: &mut Vec<RankKey>,
) -> Result<TokenLogprobs, SampleError> {
    if token as usize >= logits.len() {
        return Err(SampleError::TokenOutOfRange {
            token,
            vocab: logits.len(),
        });
    }
    let l_max = logits
        .iter()
        .copied()
        .map(sanitize)
        .fold(f32::NEG_INFINITY, f32::max);
    if l_max == f32::NEG_INFINITY {
        return Err(SampleError::NoFiniteLogits);
    }
    let sum: f64 = logits
        .iter()
        .map(|&l| ((sanitize(l) - l_max) as f64).exp())
        .sum();
    let log_z = l_max as f64 + sum.ln();
    let logprob = |t: u32| (sanitize(logits[t as usize]) as f64 - log_z) as f32;

    let keys = logits
        .iter()
        .zip(0u32..)
        .map(|(&l, t)| rank_key(sanitize(l), t));
    top_keys(keys, n, scratch);
    Ok(TokenLogprobs {
        logprob: logprob(token),
        top: scratch
            .iter()
            .map(|&k| (key_token(k), logprob(key_token(k))))
            .collect(),
    })
}
