//! What a request asks for ([`SamplingOptions`]), its validated and complete form
//! ([`SamplingParams`]), and the range checks that `generation_config.json` goes through too.

use std::collections::BTreeMap;

use super::GenerationDefaults;

/// Temperatures below this are treated as greedy decoding (vLLM's `_SAMPLING_EPS`).
pub const GREEDY_TEMPERATURE: f32 = 1e-5;

/// The most alternatives a request may ask for in `top_logprobs` (OpenAI's and vLLM's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

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
    /// vLLM's `min_tokens`: no stop token or stop string before this many tokens.
    pub min_tokens: Option<i64>,
    /// vLLM's `ignore_eos`: the model's end-of-sequence tokens do not end the generation (the
    /// request's own `stop_token_ids` still do); benchmark clients use it for fixed lengths.
    pub ignore_eos: bool,
    /// vLLM's `allowed_token_ids`: sample only among these.
    pub allowed_token_ids: Option<Vec<i64>>,
    /// vLLM's `include_stop_str_in_output`: a matched stop string stays in the text.
    pub include_stop_str_in_output: bool,
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
    /// Tokens that end generation: the request's `stop_token_ids` plus the model's EOS ids
    /// (without them under `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    /// `None`: thinking is not limited.
    pub thinking_budget: Option<usize>,
    /// `Some(n)`: return the chosen token's logprob and the `n` most likely alternatives.
    pub top_logprobs: Option<usize>,
    /// No stop token or stop string ends the generation before this many tokens (`0`: off).
    pub min_tokens: usize,
    /// `Some`: only these tokens may be sampled (sorted, deduplicated, non-empty).
    pub allowed_tokens: Option<Vec<u32>>,
    /// The text keeps the stop string that ended it.
    pub include_stop_str: bool,
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
            min_tokens: 0,
            allowed_tokens: None,
            include_stop_str: false,
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
    /// config, then from [`SamplingParams::default`]. The model's EOS ids are stop tokens unless
    /// the request sets `ignore_eos`.
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
        if !opts.ignore_eos {
            stop_token_ids.extend(&defaults.eos_token_ids);
        }
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

        let min_tokens = match opts.min_tokens {
            None => 0,
            Some(n) if n < 0 => {
                return Err(ParamError::new(
                    "min_tokens",
                    format!("must be at least 0, got {n}"),
                ))
            }
            Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
        };
        if let Some(max) = max_tokens.filter(|&m| min_tokens > m) {
            return Err(ParamError::new(
                "min_tokens",
                format!("must be at most max_tokens ({max}), got {min_tokens}"),
            ));
        }

        let allowed_tokens = match &opts.allowed_token_ids {
            None => None,
            Some(ids) if ids.is_empty() => {
                return Err(ParamError::new(
                    "allowed_token_ids",
                    "must list at least one token",
                ))
            }
            Some(ids) => {
                let mut allowed = ids
                    .iter()
                    .map(|&id| check_token_id("allowed_token_ids", id, vocab_size))
                    .collect::<Result<Vec<_>, _>>()?;
                allowed.sort_unstable();
                allowed.dedup();
                Some(allowed)
            }
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
            min_tokens,
            allowed_tokens,
            include_stop_str: opts.include_stop_str_in_output,
        })
    }
}

pub(super) fn check_temperature(t: f64) -> Result<f32, ParamError> {
    // vLLM accepts any non-negative temperature (OpenAI documents 0..2); we follow vLLM.
    if !t.is_finite() || t < 0.0 {
        return Err(ParamError::new(
            "temperature",
            format!("must be a finite number >= 0, got {t}"),
        ));
    }
    Ok(t as f32)
}

pub(super) fn check_top_p(p: f64) -> Result<f32, ParamError> {
    if !(p > 0.0 && p <= 1.0) {
        return Err(ParamError::new(
            "top_p",
            format!("must be in (0, 1], got {p}"),
        ));
    }
    Ok(p as f32)
}

pub(super) fn check_top_k(k: i64) -> Result<Option<usize>, ParamError> {
    match k {
        -1 | 0 => Ok(None),
        k if k > 0 => Ok(Some(usize::try_from(k).unwrap_or(usize::MAX))),
        k => Err(ParamError::new(
            "top_k",
            format!("must be -1, 0 (disabled) or positive, got {k}"),
        )),
    }
}

pub(super) fn check_min_p(p: f64) -> Result<f32, ParamError> {
    if !(0.0..=1.0).contains(&p) {
        return Err(ParamError::new(
            "min_p",
            format!("must be in [0, 1], got {p}"),
        ));
    }
    Ok(p as f32)
}

pub(super) fn check_openai_penalty(param: &'static str, v: f64) -> Result<f32, ParamError> {
    if !(-2.0..=2.0).contains(&v) {
        return Err(ParamError::new(
            param,
            format!("must be in [-2, 2], got {v}"),
        ));
    }
    Ok(v as f32)
}

pub(super) fn check_repetition_penalty(v: f64) -> Result<f32, ParamError> {
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
