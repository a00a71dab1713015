//! The text side of generation, around the token-level [`Engine`]: what a request needs before
//! its first token (tokenizer, chat template, model defaults, grammar compiler) and what turns
//! the engine's token stream back into an answer.
//!
//! Per request, two halves cooperate:
//! * a [`TokenPicker`] runs on the engine thread as the request's sampler. It applies the
//!   request's sampling parameters, forces `</think>` when the thinking budget is spent, and,
//!   once the reasoning is over, masks the logits with the request's grammar (`response_format`,
//!   `tool_choice: required` or a named tool);
//! * a [`Generation`] runs in the HTTP handler. It detokenizes incrementally, splits the text into
//!   reasoning, content and tool calls ([`OutputParser`]), applies stop strings to the content
//!   only (so a stop string can neither cut a tool call nor leak `</think>`), and counts usage.
//!
//! Dropping a [`Generation`] drops the engine's receiver, which cancels the sequence before its
//! next step: that is how a client disconnect and a matched stop string end generation.

use std::collections::{HashSet, VecDeque};
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{self, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use tokio::sync::mpsc::UnboundedReceiver;

use super::{
    DeviceSampler, Engine, Event, FinishReason as EngineFinish, GenerateRequest, SampledToken,
};
use crate::chat::template::ChatTemplate;
use crate::chat::tools::{OutputEvent, OutputParser, ToolSchemas};
use crate::sampling::{
    DeviceSampling, FinishReason, GenerationDefaults, Sampler, SamplingParams, StopChecker,
    ThinkTokens, ThinkingBudget,
};
use crate::tokenizer::{IncrementalDecoder, Tokenizer, ADDED_TOKENS};

/// Ids of the special tokens the pipeline acts on.
#[derive(Debug, Clone)]
pub struct SpecialTokens {
    /// `<|im_end|>`: ends an assistant turn; the grammar's end-of-sequence token.
    pub im_end: u32,
    /// `<think>`, `</think>`, `<tool_call>`, `</tool_call>`, when the vocabulary has them.
    pub think: Option<ThinkTokens>,
    /// Control tokens (`<|...|>`: `<|im_start|>`, `<|vision_pad|>`, ...). Their text is never
    /// part of an answer (vLLM's `skip_special_tokens` default); `<think>` and `<tool_call>` are
    /// not among them, since the parsers read them.
    pub control: Arc<HashSet<u32>>,
}

/// Everything about a model except its weights: enough to render, tokenize, constrain and parse.
/// `lily render` and `lily tokenize` use it without loading weights.
pub struct TextModel {
    pub tokenizer: Arc<Tokenizer>,
    pub template: ChatTemplate,
    pub defaults: GenerationDefaults,
    pub special: SpecialTokens,
    /// Compiles `response_format` and tool-call grammars against this vocabulary. Built on
    /// first use (it indexes the whole vocabulary): `lily render` never needs it, and the
    /// server builds it while loading (see [`TextModel::prepare_grammars`]).
    grammars: OnceLock<Result<ParserFactory, String>>,
}

impl TextModel {
    /// The tokenizer, chat template and `generation_config.json` of a model directory. A
    /// directory without a chat template gets the built-in Qwen3.6 one (the only family lily
    /// serves), with a warning.
    pub fn from_dir(dir: &Path) -> anyhow::Result<TextModel> {
        let tokenizer = Tokenizer::from_dir(dir)?;
        let template = match ChatTemplate::from_model_dir(dir) {
            Ok(t) => t,
            Err(crate::chat::template::TemplateError::Missing(_)) => {
                tracing::warn!(
                    "{} has no chat template; using the built-in Qwen3.6 template",
                    dir.display()
                );
                ChatTemplate::qwen36()
            }
            Err(e) => return Err(e.into()),
        };
        let defaults = GenerationDefaults::load(dir)?;
        TextModel::new(tokenizer, template, defaults)
    }

    /// The built-in demo model's text side: the byte-level demo tokenizer, the real Qwen3.6
    /// template, no model defaults.
    pub fn demo() -> anyhow::Result<TextModel> {
        TextModel::new(
            Tokenizer::byte_level_demo()?,
            ChatTemplate::qwen36(),
            GenerationDefaults::default(),
        )
    }

    pub fn new(
        tokenizer: Tokenizer,
        template: ChatTemplate,
        mut defaults: GenerationDefaults,
    ) -> anyhow::Result<TextModel> {
        let id = |t: &str| tokenizer.token_id(t);
        let im_end = id("<|im_end|>")
            .ok_or_else(|| anyhow::anyhow!("the tokenizer has no <|im_end|> token"))?;
        // Every generation stops at these (they become stop tokens of each request): chat turns
        // end with <|im_end|> whatever generation_config.json lists; <|endoftext|> ends raw
        // completions.
        defaults.eos_token_ids.push(im_end);
        defaults.eos_token_ids.extend(id("<|endoftext|>"));
        defaults.eos_token_ids.sort_unstable();
        defaults.eos_token_ids.dedup();
        let think = match (
            id("<think>"),
            id("</think>"),
            id("<tool_call>"),
            id("</tool_call>"),
        ) {
            (Some(think_start), Some(think_end), Some(tool_call_start), Some(tool_call_end)) => {
                Some(ThinkTokens {
                    think_start,
                    think_end,
                    tool_call_start,
                    tool_call_end,
                })
            }
            _ => None,
        };
        let control = ADDED_TOKENS
            .iter()
            .filter(|t| t.starts_with("<|") && t.ends_with("|>"))
            .filter_map(|t| tokenizer.token_id(t))
            .collect();
        let special = SpecialTokens {
            im_end,
            think,
            control: Arc::new(control),
        };
        Ok(TextModel {
            tokenizer: Arc::new(tokenizer),
            template,
            defaults,
            special,
            grammars: OnceLock::new(),
        })
    }

    /// Builds the grammar compiler now rather than on the first request that needs it.
    pub fn prepare_grammars(&self) -> Result<(), String> {
        self.grammars().map(|_| ())
    }

    fn grammars(&self) -> Result<&ParserFactory, String> {
        self.grammars
            .get_or_init(|| {
                grammar_factory(&self.tokenizer, &self.special).map_err(|e| format!("{e:#}"))
            })
            .as_ref()
            .map_err(|e| format!("the grammar compiler is unavailable: {e}"))
    }

    /// Compiles a grammar for this vocabulary. A bad grammar (an unsupported or unsatisfiable
    /// JSON schema) is the request's fault: the error text says why.
    pub fn compile(&self, grammar: &Grammar) -> Result<Matcher, String> {
        let top = match grammar {
            Grammar::JsonSchema {
                schema,
                after_thinking,
            } => TopLevelGrammar::from_lark(json_lark(schema, *after_thinking)),
            Grammar::Regex {
                pattern,
                after_thinking,
            } => TopLevelGrammar::from_lark(format!(
                "{}answer: /{}/\n",
                answer_start(*after_thinking),
                lark_regex_body(pattern)
            )),
            Grammar::Choice {
                options,
                after_thinking,
            } => {
                let options: Vec<String> = options
                    .iter()
                    .map(|o| serde_json::to_string(o).unwrap_or_default())
                    .collect();
                TopLevelGrammar::from_lark(format!(
                    "{}answer: {}\n",
                    answer_start(*after_thinking),
                    options.join(" | ")
                ))
            }
            Grammar::Lark(source) => TopLevelGrammar::from_lark(source.clone()),
        };
        let parser = self
            .grammars()?
            .create_parser(top)
            .map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        match matcher.get_error() {
            Some(e) => Err(e),
            None => Ok(matcher),
        }
    }

    /// Queues a generation on `engine`. The grammar, if any, must already be compiled (see
    /// [`TextModel::compile`]) so that a bad schema is reported before anything starts.
    pub fn start(&self, engine: &Engine, plan: GenerationPlan) -> Generation {
        let think_ids = self.special.think;
        let budget = |budget| think_ids.map(|ids| ThinkingBudget::new(ids, plan.thinking, budget));
        let picker = TokenPicker {
            sampler: Sampler::new(&plan.params, &plan.prompt),
            budget: budget(plan.params.thinking_budget),
            grammar: plan.grammar,
            answer_started: !plan.thinking,
            think_end: think_ids.map(|t| t.think_end),
            vocab: self.tokenizer.vocab_size(),
            banned: plan.banned_tokens,
            stop_tokens: plan.params.stop_token_ids.clone(),
            im_end: self.special.im_end,
            min_tokens: plan.params.min_tokens,
            generated: 0,
            allowed: plan.params.allowed_tokens.clone(),
            bad_words: plan.bad_words,
            history: Vec::new(),
        };
        let (sampler, device_sampler) = picker.into_samplers();
        let request = GenerateRequest {
            prompt: plan.prompt.clone(),
            max_tokens: plan.params.max_tokens.unwrap_or(0),
            stop_token_ids: plan.params.stop_token_ids.clone(),
            sampler,
            device_sampler: Some(device_sampler),
            prompt_cache_key: plan.prompt_cache_key.clone(),
            prompt_logprobs: plan.prompt_logprobs,
            draft: true,
        };
        let events = engine.submit(request);
        Generation {
            events: Some(events),
            ready: VecDeque::new(),
            tokenizer: self.tokenizer.clone(),
            decoder: IncrementalDecoder::new(),
            parser: (!plan.raw).then(|| OutputParser::new(plan.thinking, plan.tools)),
            stop: StopChecker::new(&plan.params),
            stop_ids: plan.params.stop_token_ids.clone(),
            control: self.special.control.clone(),
            reasoning: budget(None),
            want_logprobs: plan.params.top_logprobs.is_some(),
            single_tool_call: plan.single_tool_call,
            prompt_tokens: plan.prompt.len(),
            completion_tokens: 0,
            cached_tokens: 0,
            open_calls: 0,
            calls: 0,
        }
    }
}

/// A grammar the answer must follow.
#[derive(Debug, Clone)]
pub enum Grammar {
    /// JSON matching this schema (`{"type": "object"}` for `json_object`). `after_thinking`:
    /// the answer follows `</think>`, where the model writes a blank line first (the reasoning
    /// parser drops it); elsewhere the JSON starts at once.
    JsonSchema {
        schema: serde_json::Value,
        after_thinking: bool,
    },
    /// Text matching this regular expression (vLLM's `regex`), whole.
    Regex {
        pattern: String,
        after_thinking: bool,
    },
    /// Exactly one of these strings (vLLM's `choice`).
    Choice {
        options: Vec<String>,
        after_thinking: bool,
    },
    /// A grammar in llguidance's Lark dialect (tool calls in Qwen's XML format, or a request's
    /// own `grammar`), used as it is.
    Lark(String),
}

/// One validated request, ready for the engine.
pub struct GenerationPlan {
    pub prompt: Vec<u32>,
    /// `max_tokens` must be set: the caller resolves it against the context length.
    pub params: SamplingParams,
    /// The prompt ends inside `<think>`: generation starts in the reasoning.
    pub thinking: bool,
    /// Parse tool calls with these schemas (`None`: all content is text).
    pub tools: Option<ToolSchemas>,
    /// Constrains the answer (everything after `</think>`), compiled by [`TextModel::compile`].
    pub grammar: Option<Matcher>,
    /// Tokens that may never be generated (`<tool_call>` under `tool_choice: "none"`).
    pub banned_tokens: Vec<u32>,
    /// vLLM's `bad_words` as token sequences: the last token of one is banned wherever the
    /// tokens before it were just generated.
    pub bad_words: Vec<Vec<u32>>,
    /// `parallel_tool_calls: false`: stop after the first complete tool call.
    pub single_tool_call: bool,
    /// A text completion: the output is plain text, with no reasoning or tool calls to find.
    pub raw: bool,
    /// The request's `prompt_cache_key` (see [`GenerateRequest`]).
    pub prompt_cache_key: Option<String>,
    /// Score the prompt's tokens with this many alternatives each ([`Output::PromptToken`]).
    pub prompt_logprobs: Option<usize>,
}

/// The Lark grammar for a JSON answer: JSON per the schema, laid out like Python's `json.dumps`
/// (", " and ": ", no other whitespace, so a model cannot wander into endless blank space),
/// after the thinking optionally preceded by the usual blank line.
fn json_lark(schema: &serde_json::Value, after_thinking: bool) -> String {
    let mut schema = schema.clone();
    if let Some(object) = schema.as_object_mut() {
        object.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
        });
    }
    format!("{}answer: %json {schema}\n", answer_start(after_thinking))
}

/// The grammar's start rule: the `answer` rule, after the thinking optionally preceded by the
/// blank line the model writes after `</think>` (the reasoning parser drops it).
fn answer_start(after_thinking: bool) -> &'static str {
    if after_thinking {
        "start: NL? answer\nNL: /\\n\\n?/\n"
    } else {
        "start: answer\n"
    }
}

/// A regular expression as the body of a Lark `/.../` literal: unescaped slashes escaped.
fn lark_regex_body(pattern: &str) -> String {
    let mut out = String::with_capacity(pattern.len() + 8);
    let mut chars = pattern.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                out.push(c);
                if let Some(next) = chars.next() {
                    out.push(next);
                }
            }
            '/' => out.push_str("\\/"),
            _ => out.push(c),
        }
    }
    out
}

/// llguidance's view of our vocabulary: every id's bytes, with control tokens marked (0xFF
/// prefix) so that grammar text can never produce them by accident; `<|im_end|>` is the
/// end-of-sequence token a finished grammar allows.
fn grammar_factory(
    tokenizer: &Arc<Tokenizer>,
    special: &SpecialTokens,
) -> anyhow::Result<ParserFactory> {
    let vocab = tokenizer.vocab_size();
    let mut words = Vec::with_capacity(vocab);
    for id in 0..vocab as u32 {
        let bytes = tokenizer.token_to_bytes(id).unwrap_or(&[]);
        let mut word = Vec::with_capacity(bytes.len() + 1);
        if special.control.contains(&id) {
            word.push(TokTrie::SPECIAL_TOKEN_MARKER);
        }
        word.extend_from_slice(bytes);
        words.push(word);
    }
    let trie = TokTrie::from(&TokRxInfo::new(vocab as u32, special.im_end), &words);
    let env: TokEnv = Arc::new(GrammarTokenizer {
        trie,
        tokenizer: tokenizer.clone(),
    });
    let mut factory = ParserFactory::new_simple(&env)?;
    // Grammar problems come back as errors on the matcher; nothing should go to stderr.
    factory.set_stderr_log_level(0);
    Ok(factory)
}

struct GrammarTokenizer {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for GrammarTokenizer {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Grammar literals tokenized the way the model's tokenizer would; the trie's greedy split
    /// is the fallback for bytes that are not UTF-8.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<toktrie::TokenId> {
        match std::str::from_utf8(s)
            .ok()
            .and_then(|text| self.tokenizer.encode(text).ok())
        {
            Some(ids) => ids,
            None => self.trie.greedy_tokenize(s),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The engine-thread half: choosing each token
// ---------------------------------------------------------------------------------------------

/// The request's sampler as the engine calls it: masks, forced tokens, then a draw.
struct TokenPicker {
    sampler: Sampler,
    /// `None` when the vocabulary has no thinking tokens.
    budget: Option<ThinkingBudget>,
    grammar: Option<Matcher>,
    /// The reasoning is over (or there was none): the grammar applies from here.
    answer_started: bool,
    think_end: Option<u32>,
    /// Tokenizer vocabulary size; the model's logits can be longer (padding rows), and ids
    /// beyond the tokenizer's cannot be decoded, so they are never chosen.
    vocab: usize,
    banned: Vec<u32>,
    /// The request's stop tokens: not allowed while a grammar still waits for the answer, nor
    /// before `min_tokens` tokens.
    stop_tokens: Vec<u32>,
    im_end: u32,
    min_tokens: usize,
    /// Tokens picked so far.
    generated: usize,
    /// `allowed_token_ids`: every other token is masked.
    allowed: Option<Vec<u32>>,
    /// Token sequences that may not be completed (`bad_words`), and the tokens generated so
    /// far, which say where one could be.
    bad_words: Vec<Vec<u32>>,
    history: Vec<u32>,
}

impl TokenPicker {
    /// The request's two samplers over this one picker: the CPU one, and the device one for the
    /// steps that need nothing the device sampler lacks. Both run on the engine thread, one
    /// after the other, so the lock is never contended.
    fn into_samplers(self) -> (super::Sampler, Box<dyn DeviceSampler>) {
        let shared = Arc::new(Mutex::new(self));
        let cpu = shared.clone();
        (
            Box::new(move |logits: &mut [f32], _generated: &[u32]| lock(&cpu).pick(logits)),
            Box::new(DevicePicker(shared)),
        )
    }

    /// This step's sampling for the backend, unless it needs a mask (grammar, banned tokens) or
    /// forces a token (thinking budget), or the sampler needs the logits (logprobs, logit bias).
    fn device_step(&mut self) -> Option<(DeviceSampling, f64)> {
        let forced = self.budget.as_ref().and_then(ThinkingBudget::forced_token);
        let masked = self.grammar.is_some()
            || !self.banned.is_empty()
            || self.allowed.is_some()
            || !self.bad_words.is_empty()
            || self.too_early_to_stop();
        if masked || forced.is_some() {
            return None;
        }
        self.sampler.device_step(self.vocab)
    }

    /// Records a token the backend sampled, as [`pick`](Self::pick) records its own.
    fn accept(&mut self, token: u32) -> SampledToken {
        self.sampler.record(token);
        self.observe(token);
        SampledToken {
            id: token,
            logprob: None,
            top_logprobs: Vec::new(),
        }
    }

    fn pick(&mut self, logits: &mut [f32]) -> SampledToken {
        for l in logits.iter_mut().skip(self.vocab) {
            *l = f32::NEG_INFINITY;
        }
        // With a grammar, the turn may not end before the answer it constrains has started
        // (a turn that ends inside the reasoning would have no answer at all).
        let pending_grammar = self.grammar.is_some() && !self.answer_started;
        let ended = if pending_grammar || self.too_early_to_stop() {
            self.stop_tokens.as_slice()
        } else {
            &[]
        };
        for &t in self.banned.iter().chain(ended) {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = f32::NEG_INFINITY;
            }
        }
        for word in &self.bad_words {
            let (last, before) = word.split_last().expect("bad words are not empty");
            if self.history.ends_with(before) {
                if let Some(l) = logits.get_mut(*last as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        if let Some(allowed) = &self.allowed {
            for (id, l) in logits.iter_mut().enumerate() {
                if allowed.binary_search(&(id as u32)).is_err() {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        // A forced token (the thinking budget's `</think>`, the `<|im_end|>` of a finished
        // grammar) wins over the masks above: `allowed_token_ids`, `bad_words` and `min_tokens`
        // shape what the model samples, not the structure the request asked for.
        let forced = self
            .budget
            .as_ref()
            .and_then(ThinkingBudget::forced_token)
            .or_else(|| self.mask(logits));
        let result = match forced {
            Some(token) => self.sampler.force(token, logits),
            None => self.sampler.sample(logits),
        };
        let sampled = match result {
            Ok(s) => s,
            // Every token masked out: the grammar and the sampling parameters leave nothing to
            // choose. Ending the turn is the only answer that does not break the grammar.
            Err(crate::sampling::SampleError::NoFiniteLogits) => {
                tracing::warn!("no token is allowed at this step; ending the generation");
                match self.sampler.force(self.im_end, logits) {
                    Ok(s) => s,
                    Err(e) => panic!("sampler: {e}"),
                }
            }
            // The engine reports a panic as this request's error and carries on with the others.
            Err(e) => panic!("sampler: {e}"),
        };
        self.observe(sampled.token);
        let (logprob, top_logprobs) = match sampled.logprobs {
            Some(lp) => (Some(lp.logprob), lp.top),
            None => (None, Vec::new()),
        };
        SampledToken {
            id: sampled.token,
            logprob,
            top_logprobs,
        }
    }

    /// Applies the grammar, if it is active, to `logits`. Returns a token to force instead of
    /// sampling: `<|im_end|>` once the grammar is complete or broken.
    fn mask(&mut self, logits: &mut [f32]) -> Option<u32> {
        if !self.answer_started {
            return None;
        }
        let grammar = self.grammar.as_mut()?;
        if grammar.is_stopped() {
            return Some(self.im_end);
        }
        match grammar.compute_mask() {
            Ok(allowed) => {
                // Ids past the tokenizer's vocabulary are already masked (see `pick`) and
                // outside the grammar's token set.
                for (id, l) in logits.iter_mut().enumerate().take(self.vocab) {
                    if !allowed.is_allowed(id as u32) {
                        *l = f32::NEG_INFINITY;
                    }
                }
                None
            }
            Err(e) => {
                tracing::warn!("grammar failed, ending the generation: {e}");
                Some(self.im_end)
            }
        }
    }

    /// Fewer than `min_tokens` tokens out: the stop tokens are masked.
    fn too_early_to_stop(&self) -> bool {
        self.generated < self.min_tokens
    }

    fn observe(&mut self, token: u32) {
        self.generated += 1;
        if !self.bad_words.is_empty() {
            self.history.push(token);
        }
        if let Some(budget) = &mut self.budget {
            budget.observe(token);
        }
        // `<|im_end|>` ends the sequence: the grammar allowed it because it is complete, and
        // has nothing more to check.
        if self.answer_started && token != self.im_end {
            if let Some(grammar) = &mut self.grammar {
                // An error leaves the matcher stopped; the next step then ends the generation.
                if let Err(e) = grammar.consume_token(token) {
                    tracing::warn!("grammar rejected token {token}: {e}");
                }
            }
        } else if !self.answer_started && Some(token) == self.think_end {
            self.answer_started = true;
        }
    }
}

/// The device half of a [`TokenPicker`] shared with its CPU half.
struct DevicePicker(Arc<Mutex<TokenPicker>>);

impl DeviceSampler for DevicePicker {
    fn device_step(&mut self) -> Option<(DeviceSampling, f64)> {
        lock(&self.0).device_step()
    }
    fn accept(&mut self, token: u32) -> SampledToken {
        lock(&self.0).accept(token)
    }
}

/// A panic inside the picker fails its request (the engine catches it); the request is over, so
/// a poisoned lock can only be met by a later call for the same request, which may go on.
fn lock(picker: &Mutex<TokenPicker>) -> std::sync::MutexGuard<'_, TokenPicker> {
    picker
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

// ---------------------------------------------------------------------------------------------
// The HTTP-side half: from tokens to an answer
// ---------------------------------------------------------------------------------------------

/// Token counts for `usage`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
    pub reasoning_tokens: usize,
}

/// One generated token as `logprobs` reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenInfo {
    pub id: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// What a [`Generation`] yields.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// A prompt token scored in context (plans with `prompt_logprobs`), before any `Delta`, in
    /// prompt order from the prompt's second token on.
    PromptToken(TokenInfo),
    /// Parsed output of one or more tokens (possibly no events while text is held back), and
    /// the counts so far (vLLM's `continuous_usage_stats` reports them with every chunk).
    Delta {
        events: Vec<OutputEvent>,
        logprobs: Vec<TokenInfo>,
        counts: Counts,
    },
    /// The last item.
    Done {
        finish: FinishReason,
        counts: Counts,
        /// The request's stop string that ended the answer, if one did.
        stop_sequence: Option<String>,
    },
}

/// A generation failed on the engine side (a backend error, a panic while serving it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct GenerationError(pub String);

/// A running generation; see the module documentation.
pub struct Generation {
    /// `None` once generation is over (dropping it cancels the engine's sequence).
    events: Option<UnboundedReceiver<Event>>,
    /// Outputs ready to hand out (the end of a generation can yield a last delta and `Done`).
    ready: VecDeque<Output>,
    tokenizer: Arc<Tokenizer>,
    decoder: IncrementalDecoder,
    /// `None` for raw text completions.
    parser: Option<OutputParser>,
    stop: StopChecker,
    /// Stop tokens: they end the turn and their text is not shown.
    stop_ids: Vec<u32>,
    /// Control tokens, whose text is not shown either.
    control: Arc<HashSet<u32>>,
    /// Counts reasoning tokens (a budget without a limit).
    reasoning: Option<ThinkingBudget>,
    want_logprobs: bool,
    single_tool_call: bool,
    prompt_tokens: usize,
    completion_tokens: usize,
    /// Prompt tokens restored from the prefix cache.
    cached_tokens: usize,
    /// Tool calls started and not yet ended, and all calls started.
    open_calls: usize,
    calls: usize,
}

impl Generation {
    /// The next piece of output; `None` after [`Output::Done`] or an error.
    pub async fn next(&mut self) -> Option<Result<Output, GenerationError>> {
        loop {
            if let Some(output) = self.ready.pop_front() {
                return Some(Ok(output));
            }
            let event = match self.events.as_mut()?.recv().await {
                Some(event) => event,
                None => Event::Error("the engine stopped".into()),
            };
            match event {
                Event::Started { cached_tokens } => self.cached_tokens = cached_tokens,
                Event::PromptToken(token) => {
                    if let Some(logprob) = token.logprob {
                        self.ready.push_back(Output::PromptToken(TokenInfo {
                            id: token.id,
                            logprob,
                            top: token.top_logprobs,
                        }));
                    }
                }
                Event::Token(token) => self.on_token(token),
                Event::Done {
                    reason,
                    prompt_tokens,
                    cached_tokens,
                    ..
                } => {
                    self.prompt_tokens = prompt_tokens;
                    self.cached_tokens = cached_tokens;
                    let finish = match reason {
                        EngineFinish::Length => FinishReason::Length,
                        EngineFinish::Stop | EngineFinish::Cancelled => FinishReason::Stop,
                    };
                    self.finish(finish, true);
                }
                Event::Error(message) => {
                    self.events = None;
                    return Some(Err(GenerationError(message)));
                }
            }
        }
    }

    fn on_token(&mut self, token: SampledToken) {
        self.completion_tokens += 1;
        // The stop checker counts every token (stop strings start counting at `min_tokens`);
        // its verdict on ids and length is the engine's business, which ends the sequence itself.
        self.stop.check_token(token.id);
        if let Some(r) = &mut self.reasoning {
            r.observe(token.id);
        }
        // A stop token (the engine ends the sequence after it and sends Done) or a control
        // token is not text of the answer, so it has no logprobs entry either.
        let hidden = self.stop_ids.contains(&token.id) || self.control.contains(&token.id);
        let logprobs = match (self.want_logprobs && !hidden, token.logprob) {
            (true, Some(logprob)) => vec![TokenInfo {
                id: token.id,
                logprob,
                top: token.top_logprobs,
            }],
            _ => Vec::new(),
        };
        let (events, stopped) = if hidden {
            (Vec::new(), false)
        } else {
            // The picker never chooses an id the tokenizer cannot decode; should the engine
            // produce one anyway, it shows as the replacement character rather than vanishing.
            let text = self
                .decoder
                .push(&self.tokenizer, token.id)
                .unwrap_or_else(|_| "\u{FFFD}".into());
            let parsed = self.parse(&text);
            self.filter(parsed)
        };
        let counts = self.counts();
        self.ready.push_back(Output::Delta {
            events,
            logprobs,
            counts,
        });
        if stopped {
            self.finish(FinishReason::Stop, false);
        }
    }

    fn counts(&self) -> Counts {
        Counts {
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.completion_tokens,
            cached_tokens: self.cached_tokens,
            reasoning_tokens: self
                .reasoning
                .as_ref()
                .map_or(0, ThinkingBudget::reasoning_tokens),
        }
    }

    fn parse(&mut self, text: &str) -> Vec<OutputEvent> {
        match &mut self.parser {
            Some(parser) => parser.push(text),
            None if text.is_empty() => Vec::new(),
            None => vec![OutputEvent::Content(text.to_string())],
        }
    }

    /// Applies stop strings to content events and tracks tool calls. Returns the events to pass
    /// on and whether generation must stop here (a stop string matched, or the one allowed tool
    /// call is complete); events after that point are dropped.
    fn filter(&mut self, events: Vec<OutputEvent>) -> (Vec<OutputEvent>, bool) {
        let mut out = Vec::with_capacity(events.len());
        for event in events {
            if let OutputEvent::Content(text) = event {
                let released = self.stop.push_text(&text);
                if !released.text.is_empty() {
                    out.push(OutputEvent::Content(released.text));
                }
                if released.stopped {
                    return (out, true);
                }
                continue;
            }
            // Content held back for a possible stop string comes before what follows it.
            let held = self.stop.flush();
            if !held.is_empty() {
                out.push(OutputEvent::Content(held));
            }
            let call_done = matches!(event, OutputEvent::ToolCallEnd { .. });
            match event {
                OutputEvent::ToolCallStart { .. } => {
                    self.open_calls += 1;
                    self.calls += 1;
                }
                OutputEvent::ToolCallEnd { .. } => {
                    self.open_calls = self.open_calls.saturating_sub(1)
                }
                _ => {}
            }
            out.push(event);
            if call_done && self.single_tool_call {
                return (out, true);
            }
        }
        (out, false)
    }

    /// Ends the generation and drops the engine receiver (cancelling the sequence if it still
    /// runs). With `flush`, text still held by the decoder, parsers and stop checker is released
    /// first; without (a stop string or the single tool call ended it), everything after that
    /// point is dropped.
    fn finish(&mut self, reason: FinishReason, flush: bool) {
        self.events = None;
        // A call cut off by max_tokens is still closed by the parser, but it is truncated.
        let truncated_call = reason == FinishReason::Length && self.open_calls > 0;
        if flush {
            let tail = self.decoder.finish();
            let mut parsed = self.parse(&tail);
            if let Some(parser) = &mut self.parser {
                parsed.extend(parser.finish());
            }
            let (mut events, stopped) = self.filter(parsed);
            if !stopped {
                let held = self.stop.flush();
                if !held.is_empty() {
                    events.push(OutputEvent::Content(held));
                }
            }
            if !events.is_empty() {
                let counts = self.counts();
                self.ready.push_back(Output::Delta {
                    events,
                    logprobs: Vec::new(),
                    counts,
                });
            }
        }
        let finish = if self.calls > 0 && !truncated_call {
            FinishReason::ToolCalls
        } else {
            reason
        };
        let counts = self.counts();
        let stop_sequence = self.stop.matched().map(str::to_string);
        self.ready.push_back(Output::Done {
            finish,
            counts,
            stop_sequence,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn picker(model: &TextModel, grammar: Option<Matcher>) -> TokenPicker {
        TokenPicker {
            sampler: Sampler::new(
                &SamplingParams {
                    seed: Some(1),
                    ..SamplingParams::default()
                },
                &[],
            ),
            budget: None,
            grammar,
            answer_started: true,
            think_end: None,
            vocab: model.tokenizer.vocab_size(),
            banned: Vec::new(),
            stop_tokens: Vec::new(),
            im_end: model.special.im_end,
            min_tokens: 0,
            generated: 0,
            allowed: None,
            bad_words: Vec::new(),
            history: Vec::new(),
        }
    }

    #[test]
    fn a_bad_word_is_never_completed() {
        let model = TextModel::demo().expect("demo text model");
        // The sequence (7, 8, 9): after 7, 8 the model wants 9 and may not have it; elsewhere it
        // may; the one-token word 5 never.
        let mut picker = TokenPicker {
            bad_words: vec![vec![7, 8, 9], vec![5]],
            ..picker(&model, None)
        };
        let vocab = model.tokenizer.vocab_size();
        let wants = |picker: &mut TokenPicker, token: u32| {
            let mut logits = vec![0.0f32; vocab];
            logits[token as usize] = 100.0;
            assert!(picker.device_step().is_none(), "bad words need the logits");
            picker.pick(&mut logits).id
        };
        assert_ne!(wants(&mut picker, 5), 5);
        assert_eq!(wants(&mut picker, 9), 9, "9 alone is fine");
        assert_eq!(wants(&mut picker, 7), 7);
        assert_eq!(wants(&mut picker, 8), 8);
        assert_ne!(wants(&mut picker, 9), 9, "7 8 9 is not");
    }

    #[test]
    fn min_tokens_holds_back_the_stop_tokens_then_lets_them_through() {
        let model = TextModel::demo().expect("demo text model");
        let stop = model.special.im_end;
        let mut picker = TokenPicker {
            stop_tokens: vec![stop],
            min_tokens: 3,
            ..picker(&model, None)
        };
        let wants_to_stop = || {
            let mut logits = vec![0.0f32; model.tokenizer.vocab_size()];
            logits[stop as usize] = 100.0;
            logits
        };
        for step in 0..3 {
            assert!(
                picker.device_step().is_none(),
                "step {step}: needs the mask"
            );
            assert_ne!(picker.pick(&mut wants_to_stop()).id, stop, "step {step}");
        }
        assert_eq!(
            picker.pick(&mut wants_to_stop()).id,
            stop,
            "from min_tokens on"
        );
    }

    #[test]
    fn logits_past_the_tokenizer_are_never_chosen() {
        // Qwen3.6's embedding has 248,320 rows for 248,077 tokens: the extra logits must be
        // ignored, with and without a grammar.
        let model = TextModel::demo().expect("demo text model");
        let vocab = model.tokenizer.vocab_size();
        let schema = serde_json::json!({"type": "object"});
        let grammar = model
            .compile(&Grammar::JsonSchema {
                schema,
                after_thinking: false,
            })
            .expect("compiles");
        for grammar in [None, Some(grammar)] {
            let mut picker = picker(&model, grammar);
            for _ in 0..20 {
                let mut logits = vec![0.0f32; vocab + 200];
                logits[vocab + 7] = 100.0;
                let token = picker.pick(&mut logits);
                assert!((token.id as usize) < vocab);
            }
        }
    }

    #[test]
    fn a_grammar_holds_back_the_end_of_turn_until_the_answer() {
        let model = TextModel::demo().expect("demo text model");
        let ids = model.special.think.expect("thinking tokens");
        let schema = serde_json::json!({"type": "object"});
        let grammar = model
            .compile(&Grammar::JsonSchema {
                schema,
                after_thinking: true,
            })
            .expect("compiles");
        let mut picker = TokenPicker {
            answer_started: false,
            think_end: Some(ids.think_end),
            stop_tokens: vec![model.special.im_end],
            ..picker(&model, Some(grammar))
        };
        // The model wants to end the turn inside its reasoning: not allowed yet.
        let mut logits = vec![0.0f32; model.tokenizer.vocab_size()];
        logits[model.special.im_end as usize] = 100.0;
        assert_ne!(picker.pick(&mut logits).id, model.special.im_end);
        // After </think>, the answer must open the JSON object.
        let mut logits = vec![0.0f32; model.tokenizer.vocab_size()];
        logits[ids.think_end as usize] = 100.0;
        assert_eq!(picker.pick(&mut logits).id, ids.think_end);
        let mut logits = vec![0.0f32; model.tokenizer.vocab_size()];
        logits[model.special.im_end as usize] = 100.0;
        let next = picker.pick(&mut logits).id;
        let text = model.tokenizer.decode_lossy(&[next]).expect("decodes");
        assert!(text.starts_with('{') || text.starts_with('\n'), "{text:?}");
    }
}
