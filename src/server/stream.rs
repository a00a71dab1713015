//! Server-sent events and the pieces shared by streamed and whole responses.
//!
//! The SSE contract (spec/API.md §2.5), which `run_stream` follows for chat and text completions:
//! * every event is `data: <json>\n\n`; the stream ends with `data: [DONE]\n\n`;
//! * chat: the first chunk of each choice is `delta: {"role": "assistant", "content": ""}`;
//! * deltas carry only the fields they have (no `content: null`); reasoning is sent under both
//!   `reasoning` and `reasoning_content`; tool calls stream with their own `index`, the first
//!   delta of a call carrying `id`, `type` and the name;
//! * exactly one chunk per choice has a `finish_reason`, and it is that choice's last;
//! * with `stream_options.include_usage`, one more chunk with `choices: []` and `usage` comes
//!   after all finish chunks; without it no chunk has `usage`; with vLLM's
//!   `continuous_usage_stats` too, every chunk also carries the usage counted so far;
//! * a failure mid-stream is sent as `data: {"error": {...}}` (openai-python raises it as an
//!   `APIError`), then `[DONE]`;
//! * `: ping` comments keep idle connections open during long prompts.

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use futures_util::stream::{self, StreamExt};
use serde::Serialize;
use tokio::sync::mpsc;

use super::errors::ApiError;
use super::metrics::RequestTimer;
use super::openai::{
    ChatCompletionChunk, ChatDelta, ChoiceLogprobs, ChunkChoice, Completion, CompletionChoice,
    CompletionLogprobs, FunctionDelta, TokenLogprob, ToolCallDelta, TopLogprob, Usage,
};
use super::request::StreamUsage;
use crate::chat::tools::OutputEvent;
use crate::engine::generate::{Counts, Generation, GenerationError, Output, TokenInfo};
use crate::tokenizer::Tokenizer;

/// How often an idle stream gets a `: ping` comment.
const PING_EVERY: Duration = Duration::from_secs(15);

/// Identity shared by every chunk of one response.
#[derive(Debug, Clone)]
pub struct ResponseHead {
    pub id: String,
    pub created: u64,
    pub model: String,
}

/// Which API's chunks to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `/v1/chat/completions`; `reasoning: false` (vLLM's `include_reasoning: false`) leaves the
    /// reasoning out of the deltas.
    Chat { reasoning: bool },
    /// `/v1/completions`, with legacy logprobs when asked for.
    Text { logprobs: bool },
}

/// One SSE event carrying `value` as JSON.
pub fn sse_data<T: Serialize>(value: &T) -> Bytes {
    let json = serde_json::to_string(value).unwrap_or_else(|e| {
        format!("{{\"error\":{{\"message\":\"cannot encode a chunk: {e}\"}}}}")
    });
    Bytes::from(format!("data: {json}\n\n"))
}

const DONE: &[u8] = b"data: [DONE]\n\n";
const PING: &[u8] = b": ping\n\n";

/// The keep-alive comment, and the timer for it (first tick after one period).
pub fn ping() -> Bytes {
    Bytes::from_static(PING)
}

pub fn ping_interval() -> tokio::time::Interval {
    tokio::time::interval_at(tokio::time::Instant::now() + PING_EVERY, PING_EVERY)
}

/// A streaming response whose events come from `rx`.
pub fn sse_response(rx: mpsc::Receiver<Bytes>, request_id: &str) -> Response {
    let body = Body::from_stream(
        tokio_stream::wrappers::ReceiverStream::new(rx).map(Ok::<_, std::convert::Infallible>),
    );
    let mut response = Response::new(body);
    *response.status_mut() = StatusCode::OK;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // Proxies such as nginx buffer responses unless told not to; streaming needs them unbuffered.
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    if let Ok(v) = HeaderValue::from_str(request_id) {
        headers.insert("x-request-id", v);
    }
    response
}

/// Drives the generations of one streamed request (one per choice) and writes their chunks to
/// `tx` until all are done. Returns early, dropping the generations (which cancels them), as
/// soon as the client is gone.
pub async fn run_stream(
    head: ResponseHead,
    api: Api,
    generations: Vec<Generation>,
    usage_mode: StreamUsage,
    tokenizer: std::sync::Arc<Tokenizer>,
    mut timer: RequestTimer,
    tx: mpsc::Sender<Bytes>,
) {
    let n = generations.len();
    if matches!(api, Api::Chat { .. }) {
        for index in 0..n {
            let delta = ChatDelta {
                role: Some("assistant"),
                content: Some(String::new()),
                ..ChatDelta::default()
            };
            let chunk = chat_chunk(
                &head,
                vec![ChunkChoice {
                    index,
                    delta,
                    logprobs: None,
                    finish_reason: None,
                }],
                None,
            );
            if tx.send(sse_data(&chunk)).await.is_err() {
                return;
            }
        }
    }
    // One stream of (choice index, output) over all choices, polled fairly.
    let streams = generations
        .into_iter()
        .enumerate()
        .map(|(index, generation)| {
            stream::unfold(generation, |mut g| async move {
                g.next().await.map(|item| (item, g))
            })
            .map(move |item| (index, item))
            .boxed()
        });
    let mut outputs = stream::select_all(streams);
    let mut usage: Option<Usage> = None;
    // Each choice's counts so far, for `continuous_usage_stats`.
    let mut so_far: Vec<Counts> = vec![Counts::default(); n];
    let running = |so_far: &[Counts]| -> Option<Usage> {
        let mut total = None;
        so_far.iter().for_each(|c| add_usage(&mut total, c));
        total
    };
    let mut text_offsets = vec![0usize; n];
    let mut keep_alive = ping_interval();
    loop {
        let next = tokio::select! {
            next = outputs.next() => next,
            _ = keep_alive.tick() => {
                if tx.send(ping()).await.is_err() {
                    return;
                }
                continue;
            }
        };
        let Some((index, item)) = next else { break };
        let event = match item {
            // Scored prompt tokens come only with `echo`, which streams are not offered.
            Ok(Output::PromptToken(_)) => continue,
            Ok(Output::Delta {
                events,
                logprobs,
                counts,
            }) => {
                if !logprobs.is_empty() || !events.is_empty() {
                    timer.token();
                }
                so_far[index] = counts;
                let chunk_usage = usage_mode.every_chunk.then(|| running(&so_far)).flatten();
                match api {
                    Api::Chat { reasoning } => {
                        let delta = if reasoning {
                            chat_delta(&events)
                        } else {
                            let answer: Vec<OutputEvent> = events
                                .into_iter()
                                .filter(|e| !matches!(e, OutputEvent::Reasoning(_)))
                                .collect();
                            chat_delta(&answer)
                        };
                        let logprobs =
                            (!logprobs.is_empty()).then(|| chat_logprobs(&tokenizer, &logprobs));
                        if is_empty_delta(&delta) && logprobs.is_none() {
                            continue;
                        }
                        sse_data(&chat_chunk(
                            &head,
                            vec![ChunkChoice {
                                index,
                                delta,
                                logprobs,
                                finish_reason: None,
                            }],
                            chunk_usage.clone(),
                        ))
                    }
                    Api::Text { logprobs: want } => {
                        let text = content_text(&events);
                        let logprobs = want.then(|| {
                            text_logprobs(&tokenizer, &logprobs, &mut text_offsets[index])
                        });
                        if text.is_empty() && logprobs.as_ref().is_none_or(|l| l.tokens.is_empty())
                        {
                            continue;
                        }
                        sse_data(&text_chunk(
                            &head,
                            vec![CompletionChoice {
                                index,
                                text,
                                logprobs,
                                finish_reason: None,
                            }],
                            chunk_usage.clone(),
                        ))
                    }
                }
            }
            Ok(Output::Done { finish, counts, .. }) => {
                timer.finished(
                    finish.as_str(),
                    counts.prompt_tokens,
                    counts.completion_tokens,
                );
                add_usage(&mut usage, &counts);
                so_far[index] = counts;
                let chunk_usage = usage_mode.every_chunk.then(|| running(&so_far)).flatten();
                match api {
                    Api::Chat { .. } => sse_data(&chat_chunk(
                        &head,
                        vec![ChunkChoice {
                            index,
                            delta: ChatDelta::default(),
                            logprobs: None,
                            finish_reason: Some(finish.as_str()),
                        }],
                        chunk_usage.clone(),
                    )),
                    Api::Text { .. } => sse_data(&text_chunk(
                        &head,
                        vec![CompletionChoice {
                            index,
                            text: String::new(),
                            logprobs: None,
                            finish_reason: Some(finish.as_str()),
                        }],
                        chunk_usage.clone(),
                    )),
                }
            }
            Err(GenerationError(message)) => {
                // The other choices stop too: the response is broken either way.
                let _ = tx.send(sse_data(&ApiError::internal(message).body())).await;
                let _ = tx.send(Bytes::from_static(DONE)).await;
                return;
            }
        };
        if tx.send(event).await.is_err() {
            return;
        }
    }
    if usage_mode.last {
        let chunk = match api {
            Api::Chat { .. } => sse_data(&chat_chunk(&head, Vec::new(), usage)),
            Api::Text { .. } => sse_data(&text_chunk(&head, Vec::new(), usage)),
        };
        if tx.send(chunk).await.is_err() {
            return;
        }
    }
    let _ = tx.send(Bytes::from_static(DONE)).await;
}

/// Adds one choice's counts to the response's usage (the prompt counts once).
pub fn add_usage(usage: &mut Option<Usage>, counts: &Counts) {
    let choice = Usage::new(
        counts.prompt_tokens,
        counts.completion_tokens,
        counts.cached_tokens,
        counts.reasoning_tokens,
    );
    match usage {
        Some(u) => u.add_choice(&choice),
        None => *usage = Some(choice),
    }
}

fn chat_chunk(
    head: &ResponseHead,
    choices: Vec<ChunkChoice>,
    usage: Option<Usage>,
) -> ChatCompletionChunk {
    ChatCompletionChunk {
        id: head.id.clone(),
        object: "chat.completion.chunk",
        created: head.created,
        model: head.model.clone(),
        system_fingerprint: None,
        choices,
        usage,
    }
}

fn text_chunk(
    head: &ResponseHead,
    choices: Vec<CompletionChoice>,
    usage: Option<Usage>,
) -> Completion {
    Completion {
        id: head.id.clone(),
        object: "text_completion",
        created: head.created,
        model: head.model.clone(),
        system_fingerprint: None,
        choices,
        usage,
    }
}

fn is_empty_delta(delta: &ChatDelta) -> bool {
    delta.role.is_none()
        && delta.content.is_none()
        && delta.reasoning.is_none()
        && delta.tool_calls.is_empty()
}

/// The chat delta for a batch of parser events. A call's start and its first argument
/// fragment share one entry; fragments of one call in a row are joined.
pub fn chat_delta(events: &[OutputEvent]) -> ChatDelta {
    let mut delta = ChatDelta::default();
    for event in events {
        match event {
            OutputEvent::Reasoning(text) => {
                delta
                    .reasoning
                    .get_or_insert_with(String::new)
                    .push_str(text);
                delta
                    .reasoning_content
                    .get_or_insert_with(String::new)
                    .push_str(text);
            }
            OutputEvent::Content(text) => {
                delta.content.get_or_insert_with(String::new).push_str(text)
            }
            OutputEvent::ToolCallStart { index, id, name } => {
                delta.tool_calls.push(ToolCallDelta {
                    index: *index,
                    id: Some(id.clone()),
                    kind: Some("function"),
                    function: FunctionDelta {
                        name: Some(name.clone()),
                        arguments: String::new(),
                    },
                })
            }
            OutputEvent::ToolCallArguments {
                index,
                delta: fragment,
            } => match delta.tool_calls.last_mut() {
                Some(last) if last.index == *index => last.function.arguments.push_str(fragment),
                _ => delta.tool_calls.push(ToolCallDelta {
                    index: *index,
                    id: None,
                    kind: None,
                    function: FunctionDelta {
                        name: None,
                        arguments: fragment.clone(),
                    },
                }),
            },
            OutputEvent::ToolCallEnd { .. } => {}
        }
    }
    delta
}

/// The text of content events (text completions have no other kind).
pub fn content_text(events: &[OutputEvent]) -> String {
    events
        .iter()
        .filter_map(|e| match e {
            OutputEvent::Content(text) => Some(text.as_str()),
            _ => None,
        })
        .collect()
}

fn token_text(tokenizer: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let bytes = tokenizer
        .token_to_bytes(id)
        .map(<[u8]>::to_vec)
        .unwrap_or_default();
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

/// Chat `logprobs.content` entries.
pub fn chat_logprobs(tokenizer: &Tokenizer, tokens: &[TokenInfo]) -> ChoiceLogprobs {
    let content = tokens
        .iter()
        .map(|t| {
            let (token, bytes) = token_text(tokenizer, t.id);
            let top_logprobs = t
                .top
                .iter()
                .map(|&(id, logprob)| {
                    let (token, bytes) = token_text(tokenizer, id);
                    TopLogprob {
                        token,
                        logprob,
                        bytes,
                    }
                })
                .collect();
            TokenLogprob {
                token,
                logprob: t.logprob,
                bytes,
                top_logprobs,
            }
        })
        .collect();
    ChoiceLogprobs { content }
}

/// Legacy completions logprobs; `offset` is the running character offset of the choice's text.
pub fn text_logprobs(
    tokenizer: &Tokenizer,
    tokens: &[TokenInfo],
    offset: &mut usize,
) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    for t in tokens {
        push_text_logprob(&mut out, tokenizer, t.id, Some(t), offset);
    }
    out
}

/// With `echo`: the prompt's tokens as legacy logprobs, the first without a value, the others
/// from `scores` (the engine's [`Output::PromptToken`]s, one per prompt token after the first).
pub fn echo_logprobs(
    tokenizer: &Tokenizer,
    prompt: &[u32],
    scores: &[TokenInfo],
    offset: &mut usize,
) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    for (i, &id) in prompt.iter().enumerate() {
        let score = i.checked_sub(1).and_then(|j| scores.get(j));
        push_text_logprob(&mut out, tokenizer, id, score, offset);
    }
    out
}

fn push_text_logprob(
    out: &mut CompletionLogprobs,
    tokenizer: &Tokenizer,
    id: u32,
    score: Option<&TokenInfo>,
    offset: &mut usize,
) {
    let (token, _) = token_text(tokenizer, id);
    out.text_offset.push(*offset);
    *offset += token.len();
    out.tokens.push(token);
    out.token_logprobs.push(score.map(|t| t.logprob));
    out.top_logprobs.push(score.map(|t| {
        t.top
            .iter()
            .map(|&(id, lp)| (token_text(tokenizer, id).0, lp))
            .collect()
    }));
}
