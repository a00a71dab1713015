//! From an OpenAI request body to a [`GenerationPlan`]: validation, the chat template, the
//! tokenizer, sampling parameters, the context limit, grammars. One place, used by the server
//! and by `lily render` (which prints the prompt this code builds), so the two cannot drift.

use serde_json::{json, Value};

use super::errors::ApiError;
use super::openai::{ChatCompletionRequest, CompletionRequest, OneOrMany};
use crate::chat::template::ChatInput;
use crate::chat::tools::ToolSchemas;
use crate::engine::generate::{GenerationPlan, Grammar, TextModel};
use crate::sampling::{SamplingOptions, SamplingParams};

/// Most choices one request may ask for (`n`): each is a full generation.
pub const MAX_CHOICES: usize = 8;

/// Tool-call names as OpenAI allows them.
const MAX_TOOL_NAME: usize = 64;

/// A chat request, rendered and ready to run.
pub struct PreparedChat {
    /// The prompt text exactly as the template rendered it.
    pub prompt_text: String,
    /// One plan per choice (`n`), differing only in their seed.
    pub plans: Vec<GenerationPlan>,
    pub stream: bool,
    pub usage: StreamUsage,
    /// vLLM's `include_reasoning` (default true): the reasoning is returned.
    pub include_reasoning: bool,
    /// The request's `max_tokens` (or `max_completion_tokens`), for metrics.
    pub requested_max_tokens: Option<usize>,
}

/// The chat template's input for a request, plus what the rest of the pipeline needs to know
/// about the rendering. Validates messages, tools and the thinking switches.
pub struct RenderedChat {
    pub text: String,
    /// The prompt ends inside `<think>`: generation starts in the reasoning.
    pub thinking: bool,
    tools: Option<Vec<Value>>,
    tool_choice: ToolChoice,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

/// Renders the prompt of a chat request (`lily render` prints this).
pub fn render_chat(
    model: &TextModel,
    req: &ChatCompletionRequest,
) -> Result<RenderedChat, ApiError> {
    validate_messages(&req.messages)?;
    let tools = validate_tools(req.tools.as_deref())?;
    let tool_choice = parse_tool_choice(req.tool_choice.as_ref(), tools.as_deref())?;

    let mut kwargs = req.chat_template_kwargs.clone().unwrap_or_default();
    // Thinking on/off has several spellings (spec/API.md §1 row 4). Precedence, most specific
    // first: chat_template_kwargs.enable_thinking, then top-level enable_thinking / think, then
    // reasoning_effort ("none" = off); with none of them the template's default (on) applies.
    if !kwargs.contains_key("enable_thinking") {
        let effort = req.reasoning_effort.as_deref().map(|e| e != "none");
        if let Some(on) = req.enable_thinking.or(req.think).or(effort) {
            kwargs.insert("enable_thinking".into(), Value::Bool(on));
        }
    }
    // With tool_choice "none" the tools stay out of the prompt, so the model is not invited
    // to call them (and `<tool_call>` is banned at sampling time as well).
    let template_tools = if tool_choice == ToolChoice::None {
        None
    } else {
        tools.clone()
    };
    let input = ChatInput {
        messages: req.messages.clone(),
        tools: template_tools,
        add_generation_prompt: true,
        kwargs,
    };
    let text = model.template.render(&input)?;
    let thinking = prompt_ends_in_thinking(&text);
    Ok(RenderedChat {
        text,
        thinking,
        tools,
        tool_choice,
    })
}

/// Builds everything a chat completion needs; errors are the 400s the client should see.
pub fn prepare_chat(
    model: &TextModel,
    req: &ChatCompletionRequest,
    max_model_len: usize,
) -> Result<PreparedChat, ApiError> {
    let stream = req.stream.unwrap_or(false);
    let usage = stream_usage(stream, req.stream_options.as_ref())?;
    let n = choices(req.n)?;
    if req.top_logprobs.is_some() && req.logprobs != Some(true) {
        return Err(ApiError::invalid(
            "top_logprobs",
            "`top_logprobs` requires `logprobs: true`.",
        ));
    }
    let rendered = render_chat(model, req)?;
    let prompt = model
        .tokenizer
        .encode(&rendered.text)
        .map_err(|e| ApiError::bad_request(format!("Cannot tokenize the prompt: {e}")))?;

    let max_tokens = req.max_completion_tokens.or(req.max_tokens);
    let opts = SamplingOptions {
        max_tokens,
        top_logprobs: (req.logprobs == Some(true)).then(|| req.top_logprobs.unwrap_or(0)),
        thinking_budget: req.thinking_token_budget.or(req.thinking_budget),
        min_tokens: req.min_tokens,
        ignore_eos: req.ignore_eos == Some(true),
        allowed_token_ids: req.allowed_token_ids.clone(),
        include_stop_str_in_output: req.include_stop_str_in_output == Some(true),
        ..sampling_options(
            req.temperature,
            req.top_p,
            req.top_k,
            req.min_p,
            [
                req.presence_penalty,
                req.frequency_penalty,
                req.repetition_penalty,
            ],
            req.logit_bias.as_ref(),
            req.seed,
            req.stop.clone(),
            req.stop_token_ids.as_ref(),
        )
    };
    let param = if req.max_completion_tokens.is_some() {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    let params = resolve(model, &opts, prompt.len(), max_model_len, param)?;

    let tool_schemas = match (&rendered.tools, &rendered.tool_choice) {
        (Some(tools), choice) if *choice != ToolChoice::None => {
            Some(ToolSchemas::from_openai_tools(&Value::Array(tools.clone())))
        }
        _ => None,
    };
    let answer = answer_grammar(&Constraints::of_chat(req), rendered.thinking)?;
    let grammar = match (&rendered.tool_choice, answer) {
        (ToolChoice::Required | ToolChoice::Named(_), Some((_, param))) => {
            return Err(ApiError::invalid(
                param,
                format!("`{param}` cannot be combined with `tool_choice` \"required\" or a named tool: the answer must be a tool call."),
            ))
        }
        (ToolChoice::Required, None) => {
            let parallel = req.parallel_tool_calls != Some(false);
            Some((Grammar::Lark(tool_call_lark(rendered.tools.as_deref().unwrap_or(&[]), None, parallel)), "tool_choice"))
        }
        (ToolChoice::Named(name), None) => {
            Some((Grammar::Lark(tool_call_lark(rendered.tools.as_deref().unwrap_or(&[]), Some(name), false)), "tool_choice"))
        }
        (_, Some((g, param))) => Some((g, param)),
        (_, None) => None,
    };
    let matcher =
        match grammar {
            Some((g, param)) => Some(model.compile(&g).map_err(|e| {
                ApiError::invalid(param, format!("Cannot use this `{param}`: {e}"))
            })?),
            None => None,
        };
    let banned_tokens = match (&rendered.tools, &rendered.tool_choice, model.special.think) {
        (Some(_), ToolChoice::None, Some(ids)) => vec![ids.tool_call_start],
        _ => Vec::new(),
    };
    let single_tool_call = req.parallel_tool_calls == Some(false)
        || matches!(rendered.tool_choice, ToolChoice::Named(_));

    let bad_words = bad_word_tokens(model, req.bad_words.as_ref())?;
    let plans = (0..n)
        .map(|i| GenerationPlan {
            prompt: prompt.clone(),
            params: with_choice_seed(&params, i),
            thinking: rendered.thinking,
            tools: tool_schemas.clone(),
            grammar: matcher.clone(),
            banned_tokens: banned_tokens.clone(),
            bad_words: bad_words.clone(),
            single_tool_call,
            raw: false,
            prompt_cache_key: req.prompt_cache_key.clone(),
            prompt_logprobs: None,
        })
        .collect();
    Ok(PreparedChat {
        prompt_text: rendered.text,
        plans,
        stream,
        usage,
        include_reasoning: req.include_reasoning != Some(false),
        requested_max_tokens: max_tokens.and_then(|m| usize::try_from(m).ok()),
    })
}

/// A text completion, ready to run: the prompt is used as given, no template.
pub struct PreparedCompletion {
    pub plans: Vec<GenerationPlan>,
    pub stream: bool,
    pub usage: StreamUsage,
    /// Legacy `logprobs: N`.
    pub logprobs: Option<usize>,
    /// `echo`: each choice's text starts with the prompt (and its logprobs, with the prompt's).
    pub echo: Option<Vec<u32>>,
    pub requested_max_tokens: Option<usize>,
}

/// OpenAI's default `max_tokens` for `/v1/completions`.
const COMPLETION_DEFAULT_MAX_TOKENS: i64 = 16;

pub fn prepare_completion(
    model: &TextModel,
    req: &CompletionRequest,
    max_model_len: usize,
) -> Result<PreparedCompletion, ApiError> {
    let stream = req.stream.unwrap_or(false);
    let usage = stream_usage(stream, req.stream_options.as_ref())?;
    let n = choices(req.n)?;
    let echo = req.echo == Some(true);
    if echo && stream {
        return Err(ApiError::unsupported(
            "echo",
            "`echo` is supported without `stream` only.",
        ));
    }
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::unsupported(
            "suffix",
            "`suffix` is not supported.",
        ));
    }
    let prompt = completion_prompt(model, req.prompt.as_ref())?;
    // `echo` with `max_tokens: 0` scores the prompt without generating (lm-eval's loglikelihood).
    let score_only = echo && req.max_tokens == Some(0);
    let opts = SamplingOptions {
        max_tokens: Some(if score_only {
            1
        } else {
            req.max_tokens.unwrap_or(COMPLETION_DEFAULT_MAX_TOKENS)
        }),
        top_logprobs: req.logprobs,
        min_tokens: req.min_tokens,
        ignore_eos: req.ignore_eos == Some(true),
        allowed_token_ids: req.allowed_token_ids.clone(),
        include_stop_str_in_output: req.include_stop_str_in_output == Some(true),
        ..sampling_options(
            req.temperature,
            req.top_p,
            req.top_k,
            req.min_p,
            [
                req.presence_penalty,
                req.frequency_penalty,
                req.repetition_penalty,
            ],
            req.logit_bias.as_ref(),
            req.seed,
            req.stop.clone(),
            req.stop_token_ids.as_ref(),
        )
    };
    let mut params =
        resolve(model, &opts, prompt.len(), max_model_len, "max_tokens").map_err(|e| {
            match e.param.as_deref() {
                Some("top_logprobs") => ApiError::invalid("logprobs", e.message),
                _ => e,
            }
        })?;
    if score_only {
        params.max_tokens = Some(0);
    }
    let grammar =
        match answer_grammar(&Constraints::of_completion(req), false)? {
            Some((g, param)) => Some(model.compile(&g).map_err(|e| {
                ApiError::invalid(param, format!("Cannot use this `{param}`: {e}"))
            })?),
            None => None,
        };
    let bad_words = bad_word_tokens(model, req.bad_words.as_ref())?;
    let plans = (0..n)
        .map(|i| GenerationPlan {
            prompt: prompt.clone(),
            params: with_choice_seed(&params, i),
            thinking: false,
            tools: None,
            grammar: grammar.clone(),
            banned_tokens: Vec::new(),
            bad_words: bad_words.clone(),
            single_tool_call: false,
            raw: true,
            prompt_cache_key: req.prompt_cache_key.clone(),
            prompt_logprobs: params.top_logprobs.filter(|_| echo),
        })
        .collect();
    Ok(PreparedCompletion {
        plans,
        stream,
        usage,
        logprobs: params.top_logprobs,
        echo: echo.then(|| prompt.clone()),
        requested_max_tokens: req.max_tokens.and_then(|m| usize::try_from(m).ok()),
    })
}

// ---------------------------------------------------------------------------------------------
// Pieces
// ---------------------------------------------------------------------------------------------

/// `stream_options` is only meaningful with `stream: true` (OpenAI and vLLM answer 400 otherwise).
fn stream_usage(
    stream: bool,
    options: Option<&super::openai::StreamOptions>,
) -> Result<StreamUsage, ApiError> {
    match options {
        Some(_) if !stream => Err(ApiError::invalid(
            "stream_options",
            "`stream_options` is only allowed when `stream` is true.",
        )),
        Some(o) => {
            let last = o.include_usage.unwrap_or(false);
            Ok(StreamUsage {
                last,
                every_chunk: last && o.continuous_usage_stats == Some(true),
            })
        }
        None => Ok(StreamUsage::default()),
    }
}

/// Where a stream reports `usage`: in a last chunk of its own (`include_usage`), and also in
/// every chunk, counted so far (vLLM's `continuous_usage_stats`, with `include_usage`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamUsage {
    pub last: bool,
    pub every_chunk: bool,
}

fn choices(n: Option<i64>) -> Result<usize, ApiError> {
    match n {
        None => Ok(1),
        Some(n) if (1..=MAX_CHOICES as i64).contains(&n) => Ok(n as usize),
        Some(n) => Err(ApiError::invalid(
            "n",
            format!("`n` must be between 1 and {MAX_CHOICES}, got {n}."),
        )),
    }
}

/// Choice `i` of an `n` > 1 request with a seed uses seed + i, so the choices differ and the
/// request as a whole is still reproducible.
fn with_choice_seed(params: &SamplingParams, i: usize) -> SamplingParams {
    let mut p = params.clone();
    p.seed = p.seed.map(|s| s.wrapping_add(i as u64));
    p
}

#[allow(clippy::too_many_arguments)]
fn sampling_options(
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    min_p: Option<f64>,
    [presence_penalty, frequency_penalty, repetition_penalty]: [Option<f64>; 3],
    logit_bias: Option<&std::collections::BTreeMap<String, f64>>,
    seed: Option<i64>,
    stop: Option<OneOrMany>,
    stop_token_ids: Option<&Vec<i64>>,
) -> SamplingOptions {
    SamplingOptions {
        temperature,
        top_p,
        top_k,
        min_p,
        presence_penalty,
        frequency_penalty,
        repetition_penalty,
        logit_bias: logit_bias.cloned().unwrap_or_default(),
        seed,
        stop: stop.map(OneOrMany::into_vec).unwrap_or_default(),
        stop_token_ids: stop_token_ids.cloned().unwrap_or_default(),
        ..SamplingOptions::default()
    }
}

/// vLLM's `bad_words` as token sequences: each word as written and after a space (as it is
/// tokenised mid-sentence), without duplicates.
fn bad_word_tokens(
    model: &TextModel,
    words: Option<&Vec<String>>,
) -> Result<Vec<Vec<u32>>, ApiError> {
    let mut sequences: Vec<Vec<u32>> = Vec::new();
    for word in words.into_iter().flatten() {
        let word = word.trim_start();
        if word.is_empty() {
            return Err(ApiError::invalid("bad_words", "A bad word is empty."));
        }
        for text in [word.to_string(), format!(" {word}")] {
            let ids = model.tokenizer.encode(&text).map_err(|e| {
                ApiError::invalid("bad_words", format!("Cannot tokenize `{word}`: {e}"))
            })?;
            if !ids.is_empty() && !sequences.contains(&ids) {
                sequences.push(ids);
            }
        }
    }
    Ok(sequences)
}

/// Validates the sampling options and fits `max_tokens` into the context: a prompt that leaves
/// no room, or an explicit `max_tokens` that does not fit, is `context_length_exceeded`;
/// without one, the generation may use the rest of the context.
fn resolve(
    model: &TextModel,
    opts: &SamplingOptions,
    prompt_len: usize,
    max_model_len: usize,
    max_param: &str,
) -> Result<SamplingParams, ApiError> {
    let mut params = SamplingParams::resolve(opts, &model.defaults, model.tokenizer.vocab_size())
        .map_err(|e| {
        let param = if e.param == "max_tokens" {
            max_param
        } else {
            e.param
        };
        ApiError::invalid(
            param,
            e.to_string()
                .replace("`max_tokens`", &format!("`{max_param}`")),
        )
    })?;
    if prompt_len == 0 {
        return Err(ApiError::invalid("prompt", "The prompt is empty."));
    }
    if prompt_len >= max_model_len {
        return Err(ApiError::context_length(
            prompt_len,
            opts.max_tokens.and_then(|m| usize::try_from(m).ok()),
            max_model_len,
        ));
    }
    let room = max_model_len - prompt_len;
    params.max_tokens = match (opts.max_tokens, params.max_tokens) {
        // Asked for explicitly: it must fit.
        (Some(_), Some(m)) if m > room => {
            return Err(ApiError::context_length(prompt_len, Some(m), max_model_len))
        }
        // From generation_config.json: a default, so it shrinks to fit.
        (_, Some(m)) => Some(m.min(room)),
        (_, None) => Some(room),
    };
    Ok(params)
}

/// Whether the rendered prompt leaves the assistant inside `<think>` (the Qwen3.6 template's
/// default); with thinking off it writes an empty, closed `<think></think>` block instead.
fn prompt_ends_in_thinking(text: &str) -> bool {
    let turn = &text[text.rfind("<|im_start|>").unwrap_or(0)..];
    match (turn.rfind("<think>"), turn.rfind("</think>")) {
        (Some(open), Some(close)) => open > close,
        (Some(_), None) => true,
        _ => false,
    }
}

/// Messages the template can render and this server can serve: known roles, text content.
/// (The template itself enforces conversation rules such as "a user message is needed".)
fn validate_messages(messages: &[Value]) -> Result<(), ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must be a non-empty list.",
        ));
    }
    for (i, message) in messages.iter().enumerate() {
        let at = format!("messages[{i}]");
        let Some(fields) = message.as_object() else {
            return Err(ApiError::invalid(at, "Each message must be a JSON object."));
        };
        match fields.get("role").and_then(Value::as_str) {
            Some("system" | "developer" | "user" | "assistant" | "tool") => {}
            Some("function") => {
                return Err(ApiError::unsupported(
                    format!("{at}.role"),
                    "The legacy `function` role is not supported; use `tool`.",
                ))
            }
            Some(other) => {
                return Err(ApiError::invalid(
                    format!("{at}.role"),
                    format!("Unknown role `{other}`."),
                ))
            }
            None => {
                return Err(ApiError::invalid(
                    format!("{at}.role"),
                    "Each message needs a string `role`.",
                ))
            }
        }
        match fields.get("content") {
            None | Some(Value::Null | Value::String(_)) => {}
            Some(Value::Array(parts)) => {
                for (j, part) in parts.iter().enumerate() {
                    validate_part(part, &format!("{at}.content[{j}]"))?;
                }
            }
            Some(_) => {
                return Err(ApiError::invalid(
                    format!("{at}.content"),
                    "`content` must be a string, null or a list of content parts.",
                ))
            }
        }
    }
    Ok(())
}

fn validate_part(part: &Value, at: &str) -> Result<(), ApiError> {
    match part.get("type").and_then(Value::as_str) {
        Some("text") if part.get("text").is_some_and(Value::is_string) => Ok(()),
        Some("text") => Err(ApiError::invalid(at, "A text part needs a string `text`.")),
        Some("image_url" | "image" | "input_image" | "video" | "video_url" | "input_audio" | "file") => Err(ApiError::unsupported(
            at,
            "This server was started without vision or audio support: only text content parts are accepted.",
        )),
        Some(other) => Err(ApiError::invalid(at, format!("Unknown content part type `{other}`."))),
        None => Err(ApiError::invalid(at, "Each content part needs a string `type`.")),
    }
}

/// `tools` must be function tools with usable names. An empty list means no tools.
fn validate_tools(tools: Option<&[Value]>) -> Result<Option<Vec<Value>>, ApiError> {
    let Some(tools) = tools.filter(|t| !t.is_empty()) else {
        return Ok(None);
    };
    for (i, tool) in tools.iter().enumerate() {
        let at = format!("tools[{i}]");
        if tool.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::invalid(
                format!("{at}.type"),
                "Only tools of type `function` are supported.",
            ));
        }
        let Some(function) = tool.get("function").and_then(Value::as_object) else {
            return Err(ApiError::invalid(
                format!("{at}.function"),
                "A tool needs a `function` object.",
            ));
        };
        let name = function.get("name").and_then(Value::as_str).unwrap_or("");
        let valid = !name.is_empty()
            && name.len() <= MAX_TOOL_NAME
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':'));
        if !valid {
            return Err(ApiError::invalid(
                format!("{at}.function.name"),
                format!("Tool names must be 1-{MAX_TOOL_NAME} characters of a-z, A-Z, 0-9, '_', '-', '.', ':'; got {name:?}."),
            ));
        }
        match function.get("parameters") {
            None | Some(Value::Null | Value::Object(_)) => {}
            Some(_) => {
                return Err(ApiError::invalid(
                    format!("{at}.function.parameters"),
                    "`parameters` must be a JSON Schema object.",
                ))
            }
        }
    }
    Ok(Some(tools.to_vec()))
}

fn parse_tool_choice(
    choice: Option<&Value>,
    tools: Option<&[Value]>,
) -> Result<ToolChoice, ApiError> {
    let names: Vec<&str> = tools
        .unwrap_or(&[])
        .iter()
        .filter_map(|t| t.get("function")?.get("name")?.as_str())
        .collect();
    let choice = match choice {
        None | Some(Value::Null) => return Ok(if names.is_empty() { ToolChoice::None } else { ToolChoice::Auto }),
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid("tool_choice", format!("`tool_choice` must be \"none\", \"auto\", \"required\" or a named function, got {other:?}.")))
            }
        },
        Some(v) => match v.get("function").and_then(|f| f.get("name")).and_then(Value::as_str) {
            Some(name) if v.get("type").and_then(Value::as_str).unwrap_or("function") == "function" => ToolChoice::Named(name.to_string()),
            _ => return Err(ApiError::invalid("tool_choice", "A named `tool_choice` must be {\"type\": \"function\", \"function\": {\"name\": ...}}.")),
        },
    };
    match &choice {
        ToolChoice::Required | ToolChoice::Named(_) if names.is_empty() => Err(ApiError::invalid(
            "tool_choice",
            "`tool_choice` requires `tools`.",
        )),
        ToolChoice::Named(name) if !names.contains(&name.as_str()) => Err(ApiError::invalid(
            "tool_choice",
            format!("`tool_choice` names `{name}`, which is not in `tools`."),
        )),
        // "auto" without tools means no tools, as OpenAI treats it.
        ToolChoice::Auto if names.is_empty() => Ok(ToolChoice::None),
        _ => Ok(choice),
    }
}

/// The request fields that can constrain the answer, from either request type.
struct Constraints<'a> {
    response_format: Option<&'a Value>,
    structured_outputs: Option<&'a Value>,
    guided_json: Option<&'a Value>,
    guided_regex: Option<&'a Value>,
    guided_choice: Option<&'a Value>,
    guided_grammar: Option<&'a Value>,
    json_schema: Option<&'a Value>,
}

macro_rules! constraints_of {
    ($req:expr) => {
        Constraints {
            response_format: $req.response_format.as_ref(),
            structured_outputs: $req.structured_outputs.as_ref(),
            guided_json: $req.guided_json.as_ref(),
            guided_regex: $req.guided_regex.as_ref(),
            guided_choice: $req.guided_choice.as_ref(),
            guided_grammar: $req.guided_grammar.as_ref(),
            json_schema: $req.json_schema.as_ref(),
        }
    };
}

impl<'a> Constraints<'a> {
    fn of_chat(req: &'a ChatCompletionRequest) -> Self {
        constraints_of!(req)
    }
    fn of_completion(req: &'a CompletionRequest) -> Self {
        constraints_of!(req)
    }
}

/// The grammar the request's answer must follow and the field that asked for it: OpenAI's
/// `response_format`, vLLM's `structured_outputs` or its older `guided_json` / `guided_regex` /
/// `guided_choice` / `guided_grammar`, llama.cpp's `json_schema`. Two of them is an error: silently
/// preferring one would hand a client output it did not ask for.
fn answer_grammar(
    c: &Constraints,
    after_thinking: bool,
) -> Result<Option<(Grammar, &'static str)>, ApiError> {
    let present = |v: Option<&Value>| v.filter(|v| !v.is_null()).cloned();
    let mut found: Vec<(&'static str, Grammar)> = Vec::new();
    if let Some(g) = response_format_grammar(c.response_format, after_thinking)? {
        found.push(("response_format", g));
    }
    if let Some(v) = present(c.structured_outputs) {
        found.push((
            "structured_outputs",
            structured_outputs(&v, after_thinking)?,
        ));
    }
    if let Some(v) = present(c.guided_json) {
        found.push((
            "guided_json",
            json_constraint("guided_json", &v, after_thinking)?,
        ));
    }
    if let Some(v) = present(c.json_schema) {
        found.push((
            "json_schema",
            json_constraint("json_schema", &v, after_thinking)?,
        ));
    }
    if let Some(v) = present(c.guided_regex) {
        found.push((
            "guided_regex",
            regex_constraint("guided_regex", &v, after_thinking)?,
        ));
    }
    if let Some(v) = present(c.guided_choice) {
        found.push((
            "guided_choice",
            choice_constraint("guided_choice", &v, after_thinking)?,
        ));
    }
    if let Some(v) = present(c.guided_grammar) {
        found.push(("guided_grammar", grammar_constraint("guided_grammar", &v)?));
    }
    match found.len() {
        0 | 1 => Ok(found.pop().map(|(param, g)| (g, param))),
        _ => Err(ApiError::invalid(
            found[1].0,
            format!(
                "`{}` and `{}` both constrain the answer; send only one.",
                found[0].0, found[1].0
            ),
        )),
    }
}

/// vLLM's `structured_outputs`: an object with exactly one of `json`, `regex`, `choice`,
/// `grammar` or `json_object`; its other options (whitespace, fallback) are ignored.
fn structured_outputs(v: &Value, after_thinking: bool) -> Result<Grammar, ApiError> {
    let object = v.as_object().ok_or_else(|| {
        ApiError::invalid(
            "structured_outputs",
            "`structured_outputs` must be an object.",
        )
    })?;
    let kinds = [
        "json",
        "regex",
        "choice",
        "grammar",
        "json_object",
        "structural_tag",
    ];
    let given: Vec<(&str, &Value)> = kinds
        .iter()
        .filter_map(|&k| {
            object
                .get(k)
                .filter(|v| !v.is_null() && **v != Value::Bool(false))
                .map(|v| (k, v))
        })
        .collect();
    match given.as_slice() {
        [("json", v)] => json_constraint("structured_outputs.json", v, after_thinking),
        [("regex", v)] => regex_constraint("structured_outputs.regex", v, after_thinking),
        [("choice", v)] => choice_constraint("structured_outputs.choice", v, after_thinking),
        [("grammar", v)] => grammar_constraint("structured_outputs.grammar", v),
        [("json_object", _)] => Ok(Grammar::JsonSchema {
            schema: json!({"type": "object"}),
            after_thinking,
        }),
        [("structural_tag", _)] => Err(ApiError::unsupported(
            "structured_outputs.structural_tag",
            "`structural_tag` is not supported; use `json`, `regex`, `choice` or `grammar`.",
        )),
        [] => Err(ApiError::invalid(
            "structured_outputs",
            "`structured_outputs` needs one of `json`, `regex`, `choice`, `grammar` or `json_object`.",
        )),
        _ => Err(ApiError::invalid(
            "structured_outputs",
            "`structured_outputs` takes only one of `json`, `regex`, `choice`, `grammar` and `json_object`.",
        )),
    }
}

/// A JSON Schema given as an object (or `true`), or as a string holding one.
fn json_constraint(
    param: &'static str,
    v: &Value,
    after_thinking: bool,
) -> Result<Grammar, ApiError> {
    let schema = match v {
        Value::String(text) => serde_json::from_str(text).map_err(|e| {
            ApiError::invalid(param, format!("`{param}` is not a JSON schema: {e}"))
        })?,
        other => other.clone(),
    };
    match schema {
        Value::Object(_) | Value::Bool(true) => Ok(Grammar::JsonSchema {
            schema,
            after_thinking,
        }),
        _ => Err(ApiError::invalid(
            param,
            format!("`{param}` must be a JSON Schema object."),
        )),
    }
}

fn regex_constraint(
    param: &'static str,
    v: &Value,
    after_thinking: bool,
) -> Result<Grammar, ApiError> {
    match v.as_str().filter(|s| !s.is_empty()) {
        Some(pattern) => Ok(Grammar::Regex {
            pattern: pattern.to_string(),
            after_thinking,
        }),
        None => Err(ApiError::invalid(
            param,
            format!("`{param}` must be a non-empty regular expression."),
        )),
    }
}

fn choice_constraint(
    param: &'static str,
    v: &Value,
    after_thinking: bool,
) -> Result<Grammar, ApiError> {
    let options: Option<Vec<String>> = v.as_array().filter(|a| !a.is_empty()).and_then(|a| {
        a.iter()
            .map(|o| o.as_str().filter(|s| !s.is_empty()).map(str::to_string))
            .collect()
    });
    match options {
        Some(options) => Ok(Grammar::Choice {
            options,
            after_thinking,
        }),
        None => Err(ApiError::invalid(
            param,
            format!("`{param}` must be a non-empty list of non-empty strings."),
        )),
    }
}

/// A grammar in llguidance's Lark syntax (with a `start` rule), used as it is.
fn grammar_constraint(param: &'static str, v: &Value) -> Result<Grammar, ApiError> {
    match v.as_str().filter(|s| !s.trim().is_empty()) {
        Some(source) => Ok(Grammar::Lark(source.to_string())),
        None => Err(ApiError::invalid(
            param,
            format!("`{param}` must be a grammar in Lark syntax (a string)."),
        )),
    }
}

/// The grammar a `response_format` asks for; `None` for plain text.
fn response_format_grammar(
    format: Option<&Value>,
    after_thinking: bool,
) -> Result<Option<Grammar>, ApiError> {
    let json = |schema: Value| {
        Some(Grammar::JsonSchema {
            schema,
            after_thinking,
        })
    };
    let Some(format) = format.filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        // llama.cpp also accepts a schema next to json_object.
        Some("json_object") => Ok(json(
            format
                .get("schema")
                .cloned()
                .unwrap_or_else(|| json!({"type": "object"})),
        )),
        Some("json_schema") => match format.get("json_schema").and_then(|j| j.get("schema")) {
            Some(schema @ (Value::Object(_) | Value::Bool(true))) => Ok(json(schema.clone())),
            // OpenAI makes the schema optional; without one any JSON object will do.
            None if format.get("json_schema").is_some_and(Value::is_object) => {
                Ok(json(json!({"type": "object"})))
            }
            _ => Err(ApiError::invalid(
                "response_format.json_schema.schema",
                "`json_schema.schema` must be a JSON Schema object.",
            )),
        },
        _ => Err(ApiError::invalid(
            "response_format",
            "`response_format.type` must be \"text\", \"json_object\" or \"json_schema\".",
        )),
    }
}

/// A Lark grammar for one or more tool calls in Qwen's XML format, restricted to the request's
/// functions and their declared parameter names; each value runs until `\n</parameter>\n`.
/// With `only`, exactly one call of that function.
fn tool_call_lark(tools: &[Value], only: Option<&str>, parallel: bool) -> String {
    let mut rules = Vec::new();
    let mut alternatives = Vec::new();
    let functions = tools
        .iter()
        .filter_map(|t| t.get("function"))
        .filter_map(|f| Some((f.get("name")?.as_str()?, f)));
    for (i, (name, function)) in functions.enumerate() {
        if only.is_some_and(|o| o != name) {
            continue;
        }
        let params: Vec<&String> = function
            .get("parameters")
            .and_then(|p| p.get("properties"))
            .and_then(Value::as_object)
            .map(|props| props.keys().collect())
            .unwrap_or_default();
        let param_name = if params.is_empty() {
            // No declared parameters: any name without a '>' or a line break.
            "/[^>\\n]+/".to_string()
        } else {
            params
                .iter()
                .map(|p| lark_string(p))
                .collect::<Vec<_>>()
                .join(" | ")
        };
        rules.push(format!(
            "fn{i}: {} param{i}*",
            lark_string(&format!("<function={name}>\n"))
        ));
        rules.push(format!(
            "param{i}: \"<parameter=\" ({param_name}) \">\\n\" value"
        ));
        alternatives.push(format!("fn{i}"));
    }
    let calls = if parallel {
        "call (\"\\n\" call)*"
    } else {
        "call"
    };
    format!(
        "start: WS? {calls}\n\
         WS: /\\n+/\n\
         call: \"<tool_call>\\n\" ({}) \"</function>\\n</tool_call>\"\n\
         {}\n\
         value[suffix=\"\\n</parameter>\\n\"]: /(?s:.*)/\n",
        alternatives.join(" | "),
        rules.join("\n"),
    )
}

/// A Lark string literal (JSON string syntax, which Lark's double-quoted strings accept).
fn lark_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// `/v1/completions` prompts: a string, a list of token ids, or a one-element list of either.
fn completion_prompt(model: &TextModel, prompt: Option<&Value>) -> Result<Vec<u32>, ApiError> {
    let bad = || {
        ApiError::invalid(
            "prompt",
            "`prompt` must be a string or a list of token ids.",
        )
    };
    let prompt = prompt.ok_or_else(|| ApiError::invalid("prompt", "`prompt` is required."))?;
    let prompt = match prompt {
        Value::Array(items) if items.len() == 1 && (items[0].is_string() || items[0].is_array()) => &items[0],
        Value::Array(items) if items.len() > 1 && items.iter().all(|i| i.is_string() || i.is_array()) => {
            return Err(ApiError::unsupported("prompt", "Only one prompt per request is supported; send several requests (they run concurrently)."))
        }
        other => other,
    };
    match prompt {
        Value::String(text) => model
            .tokenizer
            .encode(text)
            .map_err(|e| ApiError::invalid("prompt", format!("Cannot tokenize the prompt: {e}"))),
        Value::Array(ids) => {
            let vocab = model.tokenizer.vocab_size();
            ids.iter()
                .map(|id| match id.as_u64() {
                    Some(id) if (id as usize) < vocab => Ok(id as u32),
                    _ => Err(ApiError::invalid(
                        "prompt",
                        format!("Token ids must be integers below {vocab}; got {id}."),
                    )),
                })
                .collect()
        }
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thinking_is_read_from_the_rendered_prompt() {
        assert!(prompt_ends_in_thinking(
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
        ));
        assert!(!prompt_ends_in_thinking(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        ));
        // An earlier turn's reasoning does not count.
        assert!(!prompt_ends_in_thinking(
            "<|im_start|>assistant\n<think>\nx<|im_end|>\n<|im_start|>assistant\n"
        ));
    }

    #[test]
    fn tool_choice_forms() {
        let tools = vec![json!({"type": "function", "function": {"name": "f"}})];
        assert_eq!(
            parse_tool_choice(None, Some(&tools)).ok(),
            Some(ToolChoice::Auto)
        );
        assert_eq!(parse_tool_choice(None, None).ok(), Some(ToolChoice::None));
        assert_eq!(
            parse_tool_choice(Some(&json!("auto")), None).ok(),
            Some(ToolChoice::None)
        );
        let named = json!({"type": "function", "function": {"name": "f"}});
        assert_eq!(
            parse_tool_choice(Some(&named), Some(&tools)).ok(),
            Some(ToolChoice::Named("f".into()))
        );
        let unknown = json!({"type": "function", "function": {"name": "g"}});
        assert!(parse_tool_choice(Some(&unknown), Some(&tools)).is_err());
        assert!(parse_tool_choice(Some(&json!("sometimes")), Some(&tools)).is_err());
    }

    #[test]
    fn tool_call_grammars_compile() {
        let model = TextModel::demo().expect("demo text model");
        let tools = vec![
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "odd \"name\"": {}}}}}),
            json!({"type": "function", "function": {"name": "no_params"}}),
        ];
        for (only, parallel) in [(None, true), (None, false), (Some("no_params"), false)] {
            let grammar = Grammar::Lark(tool_call_lark(&tools, only, parallel));
            assert!(
                model.compile(&grammar).is_ok(),
                "{grammar:?}: {:?}",
                model.compile(&grammar).err()
            );
        }
        let schema = Grammar::JsonSchema {
            schema: json!({"type": "object", "properties": {"a": {"type": "integer"}}}),
            after_thinking: true,
        };
        assert!(model.compile(&schema).is_ok());
        let unsatisfiable = Grammar::JsonSchema {
            schema: json!({"type": "integer", "minimum": 5, "maximum": 1}),
            after_thinking: false,
        };
        assert!(model.compile(&unsatisfiable).is_err());
    }
}
