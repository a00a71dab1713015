//! The OpenAI wire format: request bodies as clients send them and the responses, chunks and
//! usage objects they expect (openai-python's types; spec/API.md §2).
//!
//! Requests are lenient: unknown fields are ignored (proxies add vendor keys), `model` may be
//! left out, numbers are read wide (`f64`, `i64`) so that range checks, not deserialisation,
//! reject bad values with a message naming the field. Messages stay JSON values: the chat
//! template reads them, and `validate_messages` checks only what it needs.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::errors::ApiError;

/// A field that may be one string or a list of strings (`stop`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
    /// vLLM's: with `include_usage`, every chunk carries the usage so far too.
    #[serde(default)]
    pub continuous_usage_stats: Option<bool>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ChatCompletionRequest {
    pub model: Option<String>,
    #[serde(default)]
    pub messages: Vec<Value>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub response_format: Option<Value>,
    /// vLLM's constraints on the answer: `structured_outputs` (`json`, `regex`, `choice`,
    /// `grammar` in llguidance's Lark, `json_object`) and its older spellings; llama.cpp's
    /// `json_schema`. At most one constraint per request, `response_format` included.
    pub structured_outputs: Option<Value>,
    pub guided_json: Option<Value>,
    pub guided_regex: Option<Value>,
    pub guided_choice: Option<Value>,
    pub guided_grammar: Option<Value>,
    pub json_schema: Option<Value>,
    #[serde(default)]
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// Wins over `max_tokens` when both are set (vLLM's rule).
    pub max_completion_tokens: Option<i64>,
    pub max_tokens: Option<i64>,
    // Sampling. (Repeated in both request types rather than flattened: serde's flatten would
    // hide the field name from the error message.)
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub logit_bias: Option<BTreeMap<String, f64>>,
    pub seed: Option<i64>,
    pub stop: Option<OneOrMany>,
    pub stop_token_ids: Option<Vec<i64>>,
    pub n: Option<i64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    /// Extra chat-template variables (`enable_thinking`, `preserve_thinking`, ...).
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// OpenAI's knob: `"none"` turns thinking off, any other value leaves it on.
    pub reasoning_effort: Option<String>,
    /// Aliases for `chat_template_kwargs.enable_thinking` that some clients send at top level.
    pub enable_thinking: Option<bool>,
    pub think: Option<bool>,
    /// vLLM's name for the thinking budget; `thinking_budget` is SGLang's.
    pub thinking_token_budget: Option<i64>,
    pub thinking_budget: Option<i64>,
    /// Saved prompt states are shared only among requests with the same key.
    pub prompt_cache_key: Option<String>,
    /// vLLM's: no stop before this many tokens; the model's EOS does not stop the generation.
    pub min_tokens: Option<i64>,
    pub ignore_eos: Option<bool>,
    /// vLLM's: sample only among these token ids.
    pub allowed_token_ids: Option<Vec<i64>>,
    /// vLLM's: a matched stop string stays in the output.
    pub include_stop_str_in_output: Option<bool>,
    /// vLLM's: `false` leaves the reasoning out of the response (it is still generated).
    pub include_reasoning: Option<bool>,
    /// vLLM's: words the output may not contain (their last token is banned where it would
    /// complete one).
    pub bad_words: Option<Vec<String>>,
}

/// `POST /v1/completions`: a raw prompt, no chat template.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    /// A string, a list of token ids, or a list holding exactly one of those.
    pub prompt: Option<Value>,
    pub suffix: Option<String>,
    pub echo: Option<bool>,
    #[serde(default)]
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub max_tokens: Option<i64>,
    // Sampling. (Repeated in both request types rather than flattened: serde's flatten would
    // hide the field name from the error message.)
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub logit_bias: Option<BTreeMap<String, f64>>,
    pub seed: Option<i64>,
    pub stop: Option<OneOrMany>,
    pub stop_token_ids: Option<Vec<i64>>,
    pub n: Option<i64>,
    /// Legacy completions logprobs: the number of alternatives (0..=20) per token.
    pub logprobs: Option<i64>,
    pub response_format: Option<Value>,
    /// vLLM's constraints on the answer: `structured_outputs` (`json`, `regex`, `choice`,
    /// `grammar` in llguidance's Lark, `json_object`) and its older spellings; llama.cpp's
    /// `json_schema`. At most one constraint per request, `response_format` included.
    pub structured_outputs: Option<Value>,
    pub guided_json: Option<Value>,
    pub guided_regex: Option<Value>,
    pub guided_choice: Option<Value>,
    pub guided_grammar: Option<Value>,
    pub json_schema: Option<Value>,
    /// Saved prompt states are shared only among requests with the same key.
    pub prompt_cache_key: Option<String>,
    /// vLLM's: no stop before this many tokens; the model's EOS does not stop the generation.
    pub min_tokens: Option<i64>,
    pub ignore_eos: Option<bool>,
    /// vLLM's: sample only among these token ids.
    pub allowed_token_ids: Option<Vec<i64>>,
    /// vLLM's: a matched stop string stays in the output.
    pub include_stop_str_in_output: Option<bool>,
    /// vLLM's: words the output may not contain.
    pub bad_words: Option<Vec<String>>,
}

/// Parses a request body, turning serde's complaint into a 400 that names the field.
pub fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("The request body is not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::bad_request(
            "The request body must be a JSON object.",
        ));
    }
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path.is_empty() || path == "." {
            ApiError::bad_request(format!("Invalid request: {inner}"))
        } else {
            ApiError::invalid(path.clone(), format!("Invalid value for `{path}`: {inner}"))
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Responses
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
    pub completion_tokens_details: CompletionTokensDetails,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct CompletionTokensDetails {
    pub reasoning_tokens: usize,
}

impl Usage {
    pub fn new(
        prompt_tokens: usize,
        completion_tokens: usize,
        cached_tokens: usize,
        reasoning_tokens: usize,
    ) -> Usage {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
            completion_tokens_details: CompletionTokensDetails { reasoning_tokens },
        }
    }

    /// Sum over the choices of an `n` > 1 request: the prompt is counted once, as OpenAI does.
    pub fn add_choice(&mut self, other: &Usage) {
        self.completion_tokens += other.completion_tokens;
        self.completion_tokens_details.reasoning_tokens +=
            other.completion_tokens_details.reasoning_tokens;
        self.total_tokens = self.prompt_tokens + self.completion_tokens;
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct FunctionCall {
    pub name: String,
    pub arguments: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatMessage {
    pub role: &'static str,
    /// `null` when the answer is only tool calls.
    pub content: Option<String>,
    /// The same text under both names: vLLM's current `reasoning` and the `reasoning_content`
    /// that llama.cpp, LiteLLM and older clients read (spec/API.md §1 row 3). `null` when the
    /// model did not reason, so that clients reading either field find it.
    pub reasoning: Option<String>,
    pub reasoning_content: Option<String>,
    /// Left out rather than `[]`: agents hang on an empty list (opencode#20669).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChoiceLogprobs {
    pub content: Vec<TokenLogprob>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    pub index: usize,
    pub message: ChatMessage,
    pub logprobs: Option<ChoiceLogprobs>,
    pub finish_reason: &'static str,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: Option<String>,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
}

/// One tool-call entry of a streamed delta: the first for a call carries `id`, `type` and the
/// name; later ones only argument fragments. `index` is distinct per call.
#[derive(Debug, Clone, Serialize)]
pub struct ToolCallDelta {
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionDelta,
}

#[derive(Debug, Clone, Serialize)]
pub struct FunctionDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

/// A streamed delta. Absent fields are left out, never sent as `null` (no `content: null` floods).
#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallDelta>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChunkChoice {
    pub index: usize,
    pub delta: ChatDelta,
    pub logprobs: Option<ChoiceLogprobs>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletionChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: Option<String>,
    pub choices: Vec<ChunkChoice>,
    /// Only on the final usage chunk (whose `choices` is empty); left out elsewhere.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// Legacy completions logprobs (`logprobs: N` on `/v1/completions`). With `echo` the prompt's
/// tokens come first; its first token has no logprob (`null`), as OpenAI reports it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<Option<f32>>,
    pub top_logprobs: Vec<Option<BTreeMap<String, f32>>>,
    pub text_offset: Vec<usize>,
}

impl CompletionLogprobs {
    /// Appends `more`'s tokens (their offsets already continue these).
    pub fn extend(&mut self, more: CompletionLogprobs) {
        self.tokens.extend(more.tokens);
        self.token_logprobs.extend(more.token_logprobs);
        self.top_logprobs.extend(more.top_logprobs);
        self.text_offset.extend(more.text_offset);
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct CompletionChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Completion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: Option<String>,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// An entry of `GET /v1/models` (vLLM's `ModelCard`, plus what this server is running on).
#[derive(Debug, Clone, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    pub root: String,
    pub parent: Option<String>,
    pub max_model_len: usize,
    pub permission: Vec<Value>,
    /// Free-form facts: whether this is the built-in demo model, the device, the source.
    pub meta: Value,
}
