//! Sampling parameters, the CPU sampler, stop handling and the thinking budget.
//!
//! The pieces, in the order a request meets them:
//!
//! 1. [`SamplingOptions`] is what a request asked for (every field optional, raw numbers as they came
//!    off the wire). [`SamplingParams::resolve`] validates it, fills the gaps from the model's
//!    `generation_config.json` ([`GenerationDefaults`]) and then from built-in defaults.
//! 2. [`Sampler`] turns one step's logits into a token: logit bias → penalties → temperature →
//!    min-p → top-k → top-p → a draw from a per-request seeded RNG. This is the reference the device
//!    sampler is tested against, so it follows vLLM's order and semantics exactly.
//! 3. [`StopChecker`] decides when generation ends: stop token ids (EOS), `max_tokens`, and stop
//!    strings matched on decoded text without ever leaking part of a stop string to the client.
//! 4. [`ThinkingBudget`] tells the engine when it must force `</think>` instead of sampling.

use std::collections::BTreeMap;
use std::path::Path;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use rustc_hash::{FxHashMap, FxHashSet};
use serde::Deserialize;

/// Temperatures below this are treated as greedy decoding (vLLM's `_SAMPLING_EPS`).
pub const GREEDY_TEMPERATURE: f32 = 1e-5;

/// The most alternatives a request may ask for in `top_logprobs` (OpenAI's and vLLM's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// A request parameter outside its accepted range. `param` is the OpenAI field name, so the server
/// can put it in the error object's `param` and answer 400.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid value for `{param}`: {message}")]
pub struct ParamError {
    pub param: &'static str,
    pub message: String,
}

impl ParamError {
    fn new(param: &'static str, message: impl Into<String>) -> Self {
        Self {
            param,
            message: message.into(),
        }
    }
}

/// `generation_config.json` exists but cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum GenerationConfigError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not valid JSON for a generation config: {source}")]
    Json {
        path: String,
        source: serde_json::Error,
    },
    #[error("{path}: {source}")]
    Value { path: String, source: ParamError },
}

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

// ---------------------------------------------------------------------------------------------
// Parameters
// ---------------------------------------------------------------------------------------------

/// Sampling fields as a request gives them; `None` / empty means "not given".
///
/// Numbers are kept as wide as JSON gives them (`f64`, `i64`) so that out-of-range values reach
/// validation instead of failing (or wrapping) in deserialisation.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SamplingOptions {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    /// `0` or `-1` disable top-k (both spellings are in use: vLLM accepts both).
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    /// OpenAI's `logit_bias`: token id (as a decimal string, the JSON key) → bias in [-100, 100].
    pub logit_bias: BTreeMap<String, f64>,
    pub seed: Option<i64>,
    /// `max_completion_tokens`, else `max_tokens` (the server picks; vLLM prefers the former).
    pub max_tokens: Option<i64>,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<i64>,
    /// `thinking_token_budget` (vLLM) / `thinking_budget` (SGLang); `-1` means unlimited.
    pub thinking_budget: Option<i64>,
    /// `Some(n)` when the request set `logprobs: true` (n = `top_logprobs`, 0 if absent).
    pub top_logprobs: Option<i64>,
}

/// Validated, complete sampling parameters for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Below [`GREEDY_TEMPERATURE`] means greedy argmax.
    pub temperature: f32,
    /// `None`: top-k off.
    pub top_k: Option<usize>,
    /// `1.0`: top-p off.
    pub top_p: f32,
    /// `0.0`: min-p off.
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// `1.0`: off.
    pub repetition_penalty: f32,
    /// (token, bias) pairs, sorted by token.
    pub logit_bias: Vec<(u32, f32)>,
    /// `None`: a fresh random seed per request.
    pub seed: Option<u64>,
    /// `None`: until the context is full (the engine enforces that limit).
    pub max_tokens: Option<usize>,
    /// Non-empty stop strings.
    pub stop: Vec<String>,
    /// Tokens that end generation: the request's `stop_token_ids` plus the model's EOS ids.
    pub stop_token_ids: Vec<u32>,
    /// `None`: thinking is not limited.
    pub thinking_budget: Option<usize>,
    /// `Some(n)`: return the chosen token's logprob and the `n` most likely alternatives.
    pub top_logprobs: Option<usize>,
}

impl Default for SamplingParams {
    /// vLLM's built-in defaults: plain sampling at temperature 1, nothing filtered or penalised.
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: None,
            top_p: 1.0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            seed: None,
            max_tokens: None,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            thinking_budget: None,
            top_logprobs: None,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding with nothing else set (tests, `lily generate`).
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_TEMPERATURE
    }

    /// Validate a request's options and fill what it left out: first from the model's generation
    /// config, then from [`SamplingParams::default`]. The model's EOS ids are always stop tokens.
    pub fn resolve(
        opts: &SamplingOptions,
        defaults: &GenerationDefaults,
        vocab_size: usize,
    ) -> Result<Self, ParamError> {
        let builtin = Self::default();
        let pick = |req: Option<f64>, model: Option<f64>| req.or(model);

        let temperature = match pick(opts.temperature, defaults.temperature) {
            Some(t) => check_temperature(t)?,
            None => builtin.temperature,
        };
        let top_p = match pick(opts.top_p, defaults.top_p) {
            Some(p) => check_top_p(p)?,
            None => builtin.top_p,
        };
        let top_k = match opts.top_k.or(defaults.top_k) {
            Some(k) => check_top_k(k)?,
            None => builtin.top_k,
        };
        let min_p = match pick(opts.min_p, defaults.min_p) {
            Some(p) => check_min_p(p)?,
            None => builtin.min_p,
        };
        let presence_penalty = match pick(opts.presence_penalty, defaults.presence_penalty) {
            Some(v) => check_openai_penalty("presence_penalty", v)?,
            None => builtin.presence_penalty,
        };
        let frequency_penalty = match pick(opts.frequency_penalty, defaults.frequency_penalty) {
            Some(v) => check_openai_penalty("frequency_penalty", v)?,
            None => builtin.frequency_penalty,
        };
        let repetition_penalty = match pick(opts.repetition_penalty, defaults.repetition_penalty) {
            Some(v) => check_repetition_penalty(v)?,
            None => builtin.repetition_penalty,
        };

        let mut logit_bias = Vec::with_capacity(opts.logit_bias.len());
        for (key, &bias) in &opts.logit_bias {
            let token = parse_token_key(key, vocab_size)?;
            if !(-100.0..=100.0).contains(&bias) {
                return Err(ParamError::new(
                    "logit_bias",
                    format!("bias {bias} for token {token} is outside [-100, 100]"),
                ));
            }
            logit_bias.push((token, bias as f32));
        }
        logit_bias.sort_by_key(|&(t, _)| t);

        let max_tokens = match opts.max_tokens.or(defaults.max_new_tokens) {
            Some(n) if n < 1 => {
                return Err(ParamError::new(
                    "max_tokens",
                    format!("must be at least 1, got {n}"),
                ))
            }
            Some(n) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
            None => None,
        };

        // An empty stop string would end every request at once; vLLM drops them too.
        let stop: Vec<String> = opts
            .stop
            .iter()
            .filter(|s| !s.is_empty())
            .cloned()
            .collect();

        let mut stop_token_ids =
            Vec::with_capacity(opts.stop_token_ids.len() + defaults.eos_token_ids.len());
        for &id in &opts.stop_token_ids {
            stop_token_ids.push(check_token_id("stop_token_ids", id, vocab_size)?);
        }
        stop_token_ids.extend(&defaults.eos_token_ids);
        stop_token_ids.sort_unstable();
        stop_token_ids.dedup();

        let thinking_budget = match opts.thinking_budget {
            None | Some(-1) => None,
            Some(n) if n < 0 => {
                return Err(ParamError::new(
                    "thinking_token_budget",
                    format!("must be -1 (unlimited) or at least 0, got {n}"),
                ))
            }
            Some(n) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        };

        let top_logprobs = match opts.top_logprobs {
            None => None,
            Some(n) if !(0..=MAX_TOP_LOGPROBS as i64).contains(&n) => {
                return Err(ParamError::new(
                    "top_logprobs",
                    format!("must be between 0 and {MAX_TOP_LOGPROBS}, got {n}"),
                ))
            }
            Some(n) => Some(n as usize),
        };

        Ok(Self {
            temperature,
            top_k,
            top_p,
            min_p,
            presence_penalty,
            frequency_penalty,
            repetition_penalty,
            logit_bias,
            // Negative seeds are valid JSON integers; reinterpreting the bits keeps them distinct.
            seed: opts.seed.map(|s| s as u64),
            max_tokens,
            stop,
            stop_token_ids,
            thinking_budget,
            top_logprobs,
        })
    }
}

fn check_temperature(t: f64) -> Result<f32, ParamError> {
    // vLLM accepts any non-negative temperature (OpenAI documents 0..2); we follow vLLM.
    if !t.is_finite() || t < 0.0 {
        return Err(ParamError::new(
            "temperature",
            format!("must be a finite number >= 0, got {t}"),
        ));
    }
    Ok(t as f32)
}

fn check_top_p(p: f64) -> Result<f32, ParamError> {
    if !(p > 0.0 && p <= 1.0) {
        return Err(ParamError::new(
            "top_p",
            format!("must be in (0, 1], got {p}"),
        ));
    }
    Ok(p as f32)
}

fn check_top_k(k: i64) -> Result<Option<usize>, ParamError> {
    match k {
        -1 | 0 => Ok(None),
        k if k > 0 => Ok(Some(usize::try_from(k).unwrap_or(usize::MAX))),
        k => Err(ParamError::new(
            "top_k",
            format!("must be -1, 0 (disabled) or positive, got {k}"),
        )),
    }
}

fn check_min_p(p: f64) -> Result<f32, ParamError> {
    if !(0.0..=1.0).contains(&p) {
        return Err(ParamError::new(
            "min_p",
            format!("must be in [0, 1], got {p}"),
        ));
    }
    Ok(p as f32)
}

fn check_openai_penalty(param: &'static str, v: f64) -> Result<f32, ParamError> {
    if !(-2.0..=2.0).contains(&v) {
        return Err(ParamError::new(
            param,
            format!("must be in [-2, 2], got {v}"),
        ));
    }
    Ok(v as f32)
}

fn check_repetition_penalty(v: f64) -> Result<f32, ParamError> {
    if !v.is_finite() || v <= 0.0 {
        return Err(ParamError::new(
            "repetition_penalty",
            format!("must be > 0, got {v}"),
        ));
    }
    Ok(v as f32)
}

fn check_token_id(param: &'static str, id: i64, vocab_size: usize) -> Result<u32, ParamError> {
    match u32::try_from(id) {
        Ok(t) if (t as usize) < vocab_size => Ok(t),
        _ => Err(ParamError::new(
            param,
            format!("token id {id} is outside the vocabulary (size {vocab_size})"),
        )),
    }
}

fn parse_token_key(key: &str, vocab_size: usize) -> Result<u32, ParamError> {
    let id: i64 = key
        .trim()
        .parse()
        .map_err(|_| ParamError::new("logit_bias", format!("key {key:?} is not a token id")))?;
    check_token_id("logit_bias", id, vocab_size)
}

// ---------------------------------------------------------------------------------------------
// generation_config.json
// ---------------------------------------------------------------------------------------------

/// The defaults a model ships in `generation_config.json`, used for whatever a request leaves out
/// (vLLM's behaviour; Qwen's recommended temperature / top-p / top-k live there).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationDefaults {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub max_new_tokens: Option<i64>,
    /// Always stop tokens, whatever the request says.
    pub eos_token_ids: Vec<u32>,
}

/// `eos_token_id` is an integer in some configs and a list in others (Qwen uses a list).
#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

/// The file's shape; unknown keys (`do_sample`, `transformers_version`, ...) are ignored.
#[derive(Deserialize)]
struct RawGenerationConfig {
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    min_p: Option<f64>,
    repetition_penalty: Option<f64>,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    max_new_tokens: Option<i64>,
    eos_token_id: Option<OneOrMany>,
}

impl GenerationDefaults {
    pub const FILE_NAME: &'static str = "generation_config.json";

    /// Read `<model_dir>/generation_config.json`; a missing file means "no model defaults".
    pub fn load(model_dir: &Path) -> Result<Self, GenerationConfigError> {
        let path = model_dir.join(Self::FILE_NAME);
        match std::fs::read_to_string(&path) {
            Ok(text) => Self::parse(&text, &path.display().to_string()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Self::default()),
            Err(source) => Err(GenerationConfigError::Io {
                path: path.display().to_string(),
                source,
            }),
        }
    }

    /// Parse the file's text. Values are range-checked now, so a bad file fails at start-up rather
    /// than in every request that relies on it.
    pub fn from_json(text: &str) -> Result<Self, GenerationConfigError> {
        Self::parse(text, Self::FILE_NAME)
    }

    /// `path` only names the file in errors.
    fn parse(text: &str, path: &str) -> Result<Self, GenerationConfigError> {
        let raw: RawGenerationConfig =
            serde_json::from_str(text).map_err(|source| GenerationConfigError::Json {
                path: path.to_string(),
                source,
            })?;
        let check = || -> Result<(), ParamError> {
            raw.temperature.map(check_temperature).transpose()?;
            raw.top_p.map(check_top_p).transpose()?;
            raw.top_k.map(check_top_k).transpose()?;
            raw.min_p.map(check_min_p).transpose()?;
            raw.repetition_penalty
                .map(check_repetition_penalty)
                .transpose()?;
            raw.presence_penalty
                .map(|v| check_openai_penalty("presence_penalty", v))
                .transpose()?;
            raw.frequency_penalty
                .map(|v| check_openai_penalty("frequency_penalty", v))
                .transpose()?;
            Ok(())
        };
        check().map_err(|source| GenerationConfigError::Value {
            path: path.to_string(),
            source,
        })?;
        Ok(Self {
            temperature: raw.temperature,
            top_p: raw.top_p,
            top_k: raw.top_k,
            min_p: raw.min_p,
            repetition_penalty: raw.repetition_penalty,
            presence_penalty: raw.presence_penalty,
            frequency_penalty: raw.frequency_penalty,
            // A zero or negative value would make every request invalid; treat it as "not set".
            max_new_tokens: raw.max_new_tokens.filter(|&n| n >= 1),
            eos_token_ids: match raw.eos_token_id {
                None => Vec::new(),
                Some(OneOrMany::One(id)) => vec![id],
                Some(OneOrMany::Many(ids)) => ids,
            },
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Sampler
// ---------------------------------------------------------------------------------------------

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
        let token = if self.params.is_greedy() {
            self.prepare(logits)?;
            argmax(&self.work)
        } else {
            let distribution = self.distribution(logits)?;
            draw(&distribution, self.next_uniform())
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
        let p = &self.params;
        if p.is_greedy() {
            return Ok(vec![(argmax(&self.work), 1.0)]);
        }
        let filters = Filters {
            temperature: p.temperature,
            min_p: p.min_p,
            top_k: p.top_k,
            top_p: p.top_p,
        };
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

/// NaN would poison every comparison, so a NaN logit becomes -inf (never chosen); +inf becomes the
/// largest finite value so that softmax arithmetic stays finite.
fn sanitize(logit: f32) -> f32 {
    if logit.is_nan() {
        f32::NEG_INFINITY
    } else {
        logit.min(f32::MAX)
    }
}

/// Index of the largest value; the lowest index wins ties so greedy decoding is deterministic.
fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best as u32
}

/// A candidate token packed into one integer whose ascending order is "more likely first":
/// the logit's bits (arranged so integer order is `f32::total_cmp` order, then inverted so larger
/// logits come first) above the token id (lower id first on ties). Selecting and sorting plain
/// integers is several times faster than comparing through the logits array, and the order is
/// total, so results never depend on the algorithm's tie handling.
type RankKey = u64;

fn rank_key(logit: f32, token: u32) -> RankKey {
    let bits = logit.to_bits() as i32;
    // Negative floats order backwards as integers: flipping all but the sign bit fixes that.
    let ordered = (bits ^ ((((bits >> 31) as u32) >> 1) as i32)) as u32 ^ 0x8000_0000;
    (u64::from(!ordered) << 32) | u64::from(token)
}

fn key_token(key: RankKey) -> u32 {
    key as u32
}

/// Keep the `n` most likely keys of `keys`, most likely first.
fn keep_top(keys: &mut Vec<RankKey>, n: usize) {
    if n == 0 {
        keys.clear();
        return;
    }
    if n < keys.len() {
        keys.select_nth_unstable(n - 1);
        keys.truncate(n);
    }
    keys.sort_unstable();
}

/// The penalties of one request (vLLM's semantics; 1, 0, 0 switch them off).
struct Penalties {
    repetition: f32,
    frequency: f32,
    presence: f32,
}

impl Penalties {
    /// Apply the penalties to `work` for every (token, output count) of `history` (see
    /// [`Sampler`]): repetition first, then frequency and presence. sample.cu does the same
    /// arithmetic in the same order (f32, no fused multiply-add), so both samplers agree bit for bit.
    fn apply(&self, work: &mut [f32], history: &[(u32, u32)]) {
        let repeat = self.repetition != 1.0;
        let count_based = self.frequency != 0.0 || self.presence != 0.0;
        if !repeat && !count_based {
            return;
        }
        for &(token, count) in history {
            let Some(l) = work.get_mut(token as usize) else {
                continue;
            };
            if repeat {
                // HF / vLLM: shrink positive logits, push negative ones further down.
                *l = if *l > 0.0 {
                    *l / self.repetition
                } else {
                    *l * self.repetition
                };
            }
            if count_based && count > 0 {
                // OpenAI: mu[j] -= c[j] * alpha_frequency + (c[j] > 0) * alpha_presence.
                *l -= count as f32 * self.frequency + self.presence;
            }
        }
    }
}

/// Temperature and the three filters, applied to penalised logits.
struct Filters {
    temperature: f32,
    min_p: f32,
    top_k: Option<usize>,
    top_p: f32,
}

impl Filters {
    /// The candidates and their probabilities, in ascending token order (the order a draw walks:
    /// the device sampler can walk it without sorting). `cands` is scratch.
    fn distribution(&self, work: &[f32], cands: &mut Vec<RankKey>) -> Vec<(u32, f64)> {
        self.select(work, cands);
        if self.top_k.is_some() || self.top_p < 1.0 {
            // Selection reordered them; min-p alone keeps the vocabulary's order.
            cands.sort_unstable_by_key(|&k| key_token(k));
        }
        let probs = softmax_over(work, cands, self.temperature);
        cands.iter().map(|&k| key_token(k)).zip(probs).collect()
    }

    /// Fill `out` with the tokens that survive min-p, then top-k, then top-p — vLLM's order
    /// (min-p is an "argmax-invariant logits processor" applied before its top-k/top-p sampler).
    ///
    /// All three are decided on logits, never on a full softmax, so a step costs O(vocab) plus a
    /// sort of only the tokens top-p has to look at:
    /// * min-p keeps p_i >= min_p * p_max, i.e. l_i >= l_max + T * ln(min_p) in logit space.
    /// * top-k keeps every token whose logit is >= the k-th largest (ties at the boundary all
    ///   stay, as in vLLM and HF), found by partial selection.
    /// * top-p keeps the most likely tokens (ties: lower id first) until the mass *before* a token
    ///   reaches top_p (the token that crosses the line stays), renormalised over what min-p and
    ///   top-k left.
    fn select(&self, logits: &[f32], out: &mut Vec<RankKey>) {
        let l_max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let threshold = if self.min_p > 0.0 {
            l_max + self.temperature * self.min_p.ln()
        } else {
            f32::NEG_INFINITY
        };
        out.clear();
        out.extend(
            logits
                .iter()
                .zip(0u32..)
                .filter(|&(&l, _)| l > f32::NEG_INFINITY && l >= threshold)
                .map(|(&l, t)| rank_key(l, t)),
        );

        if let Some(k) = self.top_k {
            if k < out.len() {
                out.select_nth_unstable(k - 1);
                // The upper half of a key is the logit: keep everything tied with the k-th.
                let kth_logit = out[k - 1] >> 32;
                out.retain(|&key| key >> 32 <= kth_logit);
            }
        }

        if self.top_p < 1.0 {
            truncate_top_p(logits, self.temperature, self.top_p, out);
        }
    }
}

/// Inverse-CDF draw: the first token of `distribution` (in its order) whose cumulative
/// probability exceeds `u` (uniform in [0, 1)). Both samplers draw this way, with `u` from the
/// request's RNG, so a seed picks the same token on either.
pub fn draw(distribution: &[(u32, f64)], u: f64) -> u32 {
    let mut acc = 0.0;
    for &(token, p) in distribution {
        acc += p;
        if u < acc {
            return token;
        }
    }
    // Rounding can leave the total a hair below 1; the last candidate takes the remainder.
    distribution.last().map_or(0, |&(t, _)| t)
}

/// One step's sampling as the device sampler takes it (from [`Sampler::device_step`]): everything
/// but the logit bias and logprobs, which stay on the CPU.
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
    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_TEMPERATURE
    }

    /// The distribution a draw uses (as [`Sampler::distribution`]): the reference the device
    /// sampler is tested against, and the host side of backends without one.
    pub fn distribution(&self, logits: &[f32]) -> Result<Vec<(u32, f64)>, SampleError> {
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
        if self.is_greedy() {
            return Ok(vec![(argmax(&work), 1.0)]);
        }
        let filters = Filters {
            temperature: self.temperature,
            min_p: self.min_p,
            top_k: self.top_k,
            top_p: self.top_p,
        };
        Ok(filters.distribution(&work, &mut Vec::new()))
    }

    /// The token a draw at `u` picks from `logits` (the host version of the device sampler).
    pub fn sample(&self, logits: &[f32], u: f64) -> Result<u32, SampleError> {
        Ok(draw(&self.distribution(logits)?, u))
    }
}

/// Keep the nucleus of `cands` (reordered most likely first). Sorting all 248K tokens would be
/// wasteful when the nucleus is a few dozen, so sort a growing prefix found by partial selection
/// until it holds enough mass.
fn truncate_top_p(logits: &[f32], temperature: f32, top_p: f32, cands: &mut Vec<RankKey>) {
    if cands.is_empty() {
        return;
    }
    let logit = |key: RankKey| logits[key_token(key) as usize];
    let l_max = cands
        .iter()
        .map(|&k| logit(k))
        .fold(f32::NEG_INFINITY, f32::max);
    let weight = |key: RankKey| softmax_weight(logit(key), l_max, temperature);
    let total: f64 = cands.iter().map(|&k| weight(k)).sum();
    let target = top_p as f64 * total;

    let mut prefix = 256.min(cands.len());
    loop {
        if prefix < cands.len() {
            cands.select_nth_unstable(prefix - 1);
        }
        cands[..prefix].sort_unstable();
        let mut before = 0.0;
        for i in 0..prefix {
            if before >= target {
                cands.truncate(i);
                return;
            }
            before += weight(cands[i]);
        }
        if prefix == cands.len() {
            return; // everything is needed
        }
        prefix = (prefix * 4).min(cands.len());
    }
}

/// exp((l - l_max) / T): an unnormalised softmax weight, in f64 so long tails add up accurately.
fn softmax_weight(logit: f32, l_max: f32, temperature: f32) -> f64 {
    (((logit - l_max) / temperature) as f64).exp()
}

fn softmax_over(logits: &[f32], cands: &[RankKey], temperature: f32) -> Vec<f64> {
    let logit = |key: RankKey| logits[key_token(key) as usize];
    let l_max = cands
        .iter()
        .map(|&k| logit(k))
        .fold(f32::NEG_INFINITY, f32::max);
    let weights: Vec<f64> = cands
        .iter()
        .map(|&k| softmax_weight(logit(k), l_max, temperature))
        .collect();
    let total: f64 = weights.iter().sum();
    weights.into_iter().map(|w| w / total).collect()
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

    scratch.clear();
    if n > 0 {
        scratch.extend(
            logits
                .iter()
                .zip(0u32..)
                .map(|(&l, t)| rank_key(sanitize(l), t)),
        );
    }
    keep_top(scratch, n);
    Ok(TokenLogprobs {
        logprob: logprob(token),
        top: scratch
            .iter()
            .map(|&k| (key_token(k), logprob(key_token(k))))
            .collect(),
    })
}

// ---------------------------------------------------------------------------------------------
// Stop handling
// ---------------------------------------------------------------------------------------------

/// Why a choice ended, as OpenAI spells it. The sampler side only produces `Stop` and `Length`;
/// `ToolCalls` is the server's call once the output parser has seen a tool call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
    ToolCalls,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCalls => "tool_calls",
        }
    }
}

/// What to do with a token just generated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenVerdict {
    /// Detokenize it and go on.
    Continue,
    /// A stop token (EOS, `<|im_end|>`, a request `stop_token_ids` entry): finish with `stop` and do
    /// not show its text.
    Stop,
    /// The `max_tokens`-th token: show its text, then finish with `length`.
    Length,
}

/// Text released by [`StopChecker::push_text`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopText {
    /// Safe to pass on: contains no part of a stop string.
    pub text: String,
    /// A stop string matched: `text` ends just before it; finish with `stop`.
    pub stopped: bool,
}

/// Per-request stop logic. Per step the engine calls [`check_token`](Self::check_token) with the
/// new token, then (unless it said `Stop`) [`push_text`](Self::push_text) with the detokenizer's
/// delta, and on `Length` (or any other end) [`flush`](Self::flush) for the held-back tail.
///
/// Which text to feed `push_text` is the caller's choice: the raw decoded text (vLLM's behaviour),
/// or only the content after the reasoning / tool-call parser (spec/API.md row 13 recommends this
/// so that a stop string cannot cut a tool call or leak `</think>`).
#[derive(Debug, Clone)]
pub struct StopChecker {
    stop_token_ids: FxHashSet<u32>,
    max_tokens: Option<usize>,
    generated: usize,
    stop_strings: Vec<String>,
    /// The longest tail of the text seen so far that could still grow into a stop string.
    held: String,
    stopped: bool,
    /// The stop string that ended the text (Anthropic's `stop_sequence` reports it).
    matched: Option<String>,
}

impl StopChecker {
    pub fn new(params: &SamplingParams) -> Self {
        Self {
            stop_token_ids: params.stop_token_ids.iter().copied().collect(),
            max_tokens: params.max_tokens,
            generated: 0,
            stop_strings: params.stop.clone(),
            held: String::new(),
            stopped: false,
            matched: None,
        }
    }

    /// The stop string that matched, once one has.
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    /// Tokens generated so far (every token passed to `check_token`).
    pub fn generated(&self) -> usize {
        self.generated
    }

    pub fn check_token(&mut self, token: u32) -> TokenVerdict {
        self.generated += 1;
        if self.stop_token_ids.contains(&token) {
            TokenVerdict::Stop
        } else if self.max_tokens.is_some_and(|m| self.generated >= m) {
            TokenVerdict::Length
        } else {
            TokenVerdict::Continue
        }
    }

    /// Feed decoded text; get back what may be shown. Once a stop string matched, everything
    /// after it is discarded and further calls return nothing.
    pub fn push_text(&mut self, text: &str) -> StopText {
        if self.stopped {
            return StopText {
                text: String::new(),
                stopped: true,
            };
        }
        if self.stop_strings.is_empty() {
            return StopText {
                text: text.to_string(),
                stopped: false,
            };
        }
        self.held.push_str(text);

        // The held part contained no complete stop string, so any match ends in the new text;
        // searching the whole (short) held buffer is simplest and finds the earliest one.
        let earliest = self
            .stop_strings
            .iter()
            .filter_map(|s| Some((self.held.find(s.as_str())?, s)))
            .min_by_key(|&(start, _)| start);
        if let Some((start, stop)) = earliest {
            self.matched = Some(stop.clone());
            self.held.truncate(start);
            self.stopped = true;
            return StopText {
                text: std::mem::take(&mut self.held),
                stopped: true,
            };
        }

        let keep = longest_suffix_prefix(&self.held, &self.stop_strings);
        let release = self.held.len() - keep;
        let text = self.held[..release].to_string();
        self.held.replace_range(..release, "");
        StopText {
            text,
            stopped: false,
        }
    }

    /// Release the held-back tail at the end of generation (it turned out not to be a stop string).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// Length in bytes of the longest suffix of `text` that is a proper prefix of some stop string,
/// i.e. how much text must be held back because the next token might complete a stop string.
fn longest_suffix_prefix(text: &str, stops: &[String]) -> usize {
    let bytes = text.as_bytes();
    let longest_stop = stops.iter().map(|s| s.len()).max().unwrap_or(0);
    let max_len = bytes.len().min(longest_stop.saturating_sub(1));
    (1..=max_len)
        .rev()
        .find(|&len| {
            let start = bytes.len() - len;
            // Comparing bytes is safe: a UTF-8 prefix can only equal a suffix that starts on a
            // character boundary, so the held-back part is always whole characters.
            text.is_char_boundary(start)
                && stops
                    .iter()
                    .any(|s| s.as_bytes().starts_with(&bytes[start..]))
        })
        .unwrap_or(0)
}

// ---------------------------------------------------------------------------------------------
// Thinking budget
// ---------------------------------------------------------------------------------------------

/// Token ids that delimit thinking and tool calls, looked up in the tokenizer by the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThinkTokens {
    pub think_start: u32,
    pub think_end: u32,
    pub tool_call_start: u32,
    pub tool_call_end: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ThinkState {
    /// Nothing generated yet: the first token may still open `<think>` itself.
    Start,
    Reasoning,
    /// Inside `<tool_call>` … `</tool_call>` emitted while thinking: never force `</think>` here,
    /// that would cut the call in half.
    ToolCall,
    Done,
}

/// Counts reasoning tokens and says when `</think>` must be forced.
///
/// Each step: ask [`forced_token`](Self::forced_token) before sampling; if it returns a token,
/// append that instead of sampling (via [`Sampler::force`]); then report the appended token to
/// [`observe`](Self::observe). [`reasoning_tokens`](Self::reasoning_tokens) is the count for
/// `usage.completion_tokens_details.reasoning_tokens`.
#[derive(Debug, Clone)]
pub struct ThinkingBudget {
    ids: ThinkTokens,
    budget: Option<usize>,
    thinking: bool,
    state: ThinkState,
    reasoning_tokens: usize,
}

impl ThinkingBudget {
    /// `thinking`: the prompt ends inside `<think>` (the template's default). With thinking off the
    /// budget only applies if the model opens `<think>` itself as its first token.
    pub fn new(ids: ThinkTokens, thinking: bool, budget: Option<usize>) -> Self {
        Self {
            ids,
            budget,
            thinking,
            state: ThinkState::Start,
            reasoning_tokens: 0,
        }
    }

    pub fn reasoning_tokens(&self) -> usize {
        self.reasoning_tokens
    }

    /// Whether the next token would still be part of the reasoning.
    pub fn in_reasoning(&self) -> bool {
        match self.state {
            ThinkState::Start => self.thinking,
            ThinkState::Reasoning => true,
            ThinkState::ToolCall | ThinkState::Done => false,
        }
    }

    /// `Some(</think>)` when the budget is spent and the next token must close the reasoning.
    pub fn forced_token(&self) -> Option<u32> {
        let budget = self.budget?;
        (self.in_reasoning() && self.reasoning_tokens >= budget).then_some(self.ids.think_end)
    }

    pub fn observe(&mut self, token: u32) {
        if self.state == ThinkState::Start {
            self.state = if self.thinking {
                ThinkState::Reasoning
            } else {
                ThinkState::Done
            };
            if token == self.ids.think_start {
                // A model that opens `<think>` itself (older templates): the tag is not reasoning.
                self.state = ThinkState::Reasoning;
                return;
            }
        }
        match self.state {
            ThinkState::Reasoning if token == self.ids.think_end => self.state = ThinkState::Done,
            ThinkState::Reasoning if token == self.ids.tool_call_start => {
                self.state = ThinkState::ToolCall
            }
            ThinkState::Reasoning => self.reasoning_tokens += 1,
            ThinkState::ToolCall if token == self.ids.tool_call_end => {
                self.state = ThinkState::Reasoning
            }
            ThinkState::Start | ThinkState::ToolCall | ThinkState::Done => {}
        }
    }
}
