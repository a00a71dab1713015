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

mod defaults;
mod device;
mod drafts;
mod logits;
mod params;
mod sampler;
mod stop;
mod thinking;

pub use defaults::{GenerationConfigError, GenerationDefaults};
pub use device::DeviceSampling;
pub use drafts::check_draft;
pub use logits::draw;
pub use params::{
    ParamError, SamplingOptions, SamplingParams, GREEDY_TEMPERATURE, MAX_TOP_LOGPROBS,
};
pub use sampler::{token_logprobs, SampleError, Sampled, Sampler, TokenLogprobs};
pub use stop::{FinishReason, StopChecker, StopText, TokenVerdict};
pub use thinking::{ThinkTokens, ThinkingBudget};
