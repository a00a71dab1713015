//! `POST /v1/messages`, Anthropic's Messages API (what Claude Code speaks through
//! `ANTHROPIC_BASE_URL`), and `POST /v1/messages/count_tokens` (spec/API.md §1 row 20).
//!
//! As `/v1/responses` does, the request is translated into the chat completions request it means
//! (`input.rs`) and runs through the chat path: validation, template, sampling, grammars, the
//! engine, the reasoning and tool-call parsers. Its output events become content blocks
//! (`output.rs`), returned whole or streamed as named SSE events (`event: content_block_delta` +
//! `data: {...}`) from `message_start` to `message_stop`. Errors have Anthropic's shape,
//! `{"type": "error", "error": {"type", "message"}}`, also mid-stream as `event: error`.

mod input;
mod output;

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use self::output::{ContentBlock, ContentBuilder, MessageUsage};
use super::errors::ApiError;
use super::metrics::RequestTimer;
use super::request::{prepare_chat, render_chat};
use super::routes::{accept, blocking, request_id, spawn_sse, start, with_request_id};
use super::AppState;
use crate::engine::generate::{Generation, GenerationError, Output};
use crate::sampling::FinishReason;

/// `POST /v1/messages` (and, without `max_tokens`, `count_tokens`). Only what this server acts on
/// is read; other fields (`metadata`, `service_tier`, `cache_control` in blocks, ...) are ignored.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct MessagesRequest {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    /// A list of `{role, content}` turns; checked by `input.rs`, which names the bad field.
    pub messages: Option<Value>,
    /// A string or a list of text blocks.
    pub system: Option<Value>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub stop_sequences: Option<Vec<String>>,
    pub stream: Option<bool>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    /// `{type: enabled, budget_tokens}`, `{type: adaptive}` or `{type: disabled}`.
    pub thinking: Option<Value>,
}

/// The message object (`type: "message"`).
#[derive(Debug, Clone, Serialize)]
struct Message {
    id: String,
    #[serde(rename = "type")]
    kind: &'static str,
    role: &'static str,
    model: String,
    content: Vec<ContentBlock>,
    stop_reason: Option<&'static str>,
    stop_sequence: Option<String>,
    usage: MessageUsage,
}

impl Message {
    /// Records how the generation ended.
    fn finish(
        &mut self,
        finish: FinishReason,
        stop_sequence: Option<String>,
        counts: MessageUsage,
    ) {
        let reason = match (finish, &stop_sequence) {
            (FinishReason::ToolCalls, _) => "tool_use",
            (FinishReason::Length, _) => "max_tokens",
            (FinishReason::Stop, Some(_)) => "stop_sequence",
            (FinishReason::Stop, None) => "end_turn",
        };
        self.stop_reason = Some(reason);
        self.stop_sequence = stop_sequence.filter(|_| reason == "stop_sequence");
        self.usage = counts;
    }
}

/// An error as Anthropic's clients expect it; the HTTP status stays the one the chat path chose.
pub fn error_body(error: &ApiError) -> Value {
    let kind = match error.status {
        StatusCode::BAD_REQUEST | StatusCode::METHOD_NOT_ALLOWED => "invalid_request_error",
        StatusCode::UNAUTHORIZED => "authentication_error",
        StatusCode::FORBIDDEN => "permission_error",
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
        StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
        _ => "api_error",
    };
    let message = match error.status {
        StatusCode::UNAUTHORIZED => {
            "Incorrect or missing API key: send it as `x-api-key: KEY` or `Authorization: Bearer KEY`."
                .to_string()
        }
        _ => error.message.clone(),
    };
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

pub fn error_response(error: ApiError) -> Response {
    let mut response = (error.status, Json(error_body(&error))).into_response();
    if let Some(seconds) = error.retry_after {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    }
    response
}

pub async fn create_message(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    create(state, headers, body)
        .await
        .unwrap_or_else(error_response)
}

pub async fn count_tokens(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let count = async {
        let (model, request, admitted) =
            accept::<MessagesRequest>(&state, body, |r| r.model.as_deref())?;
        let chat = input::to_chat_request(&request, false)?;
        let tokens = blocking(move || {
            let rendered = render_chat(&model.text, &chat).map_err(input::messages_param)?;
            model
                .text
                .tokenizer
                .encode(&rendered.text)
                .map_err(|e| ApiError::bad_request(format!("Cannot tokenize the prompt: {e}")))
        })
        .await?;
        drop(admitted);
        Ok(Json(json!({"input_tokens": tokens.len()})).into_response())
    };
    count.await.unwrap_or_else(error_response)
}

async fn create(
    state: Arc<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let (model, request, admitted) =
        accept::<MessagesRequest>(&state, body, |r| r.model.as_deref())?;
    let chat = input::to_chat_request(&request, true)?;
    let prep_model = model.clone();
    let prepared = blocking(move || {
        prepare_chat(&prep_model.text, &chat, prep_model.max_model_len)
            .map_err(input::messages_param)
    })
    .await?;
    let prompt_tokens = prepared.plans.first().map_or(0, |p| p.prompt.len());
    let mut message = Message {
        id: request_id(&headers, "msg_"),
        kind: "message",
        role: "assistant",
        model: model.name.clone(),
        content: Vec::new(),
        stop_reason: None,
        stop_sequence: None,
        // Until the generation starts, the prefix cache's share is not known.
        usage: MessageUsage {
            input_tokens: prompt_tokens,
            ..MessageUsage::default()
        },
    };
    let timer = state
        .metrics
        .request_started(prepared.requested_max_tokens, prepared.plans.len());
    let Some(mut generation) = start(&model, prepared.plans).pop() else {
        return Err(ApiError::internal("the request planned no generation"));
    };
    if prepared.stream {
        let id = message.id.clone();
        return Ok(spawn_sse(
            &id,
            admitted,
            move |tx| write_stream(message, generation, timer, tx),
            |error| vec![sse_event("error", &error_body(&error))],
        ));
    }
    let mut builder = ContentBuilder::new(false);
    loop {
        match generation.next().await {
            Some(Ok(Output::Delta { events, .. })) => events.iter().for_each(|e| builder.push(e)),
            Some(Ok(Output::PromptToken(_))) => {}
            Some(Ok(Output::Done {
                finish,
                counts,
                stop_sequence,
            })) => {
                timer.finished(
                    finish.as_str(),
                    counts.prompt_tokens,
                    counts.completion_tokens,
                );
                message.content = builder.finish().to_vec();
                message.finish(finish, stop_sequence, MessageUsage::new(&counts));
                break;
            }
            Some(Err(GenerationError(error))) => return Err(ApiError::internal(error)),
            None => return Err(ApiError::internal("the generation ended without a result")),
        }
    }
    drop(admitted);
    Ok(with_request_id(Json(&message).into_response(), &message.id))
}

/// One named SSE event; the name is the event's `type`.
fn sse_event(kind: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {kind}\ndata: {data}\n\n"))
}

/// Sends events named by their type; `false` once the client is gone.
async fn send_all(tx: &mpsc::Sender<Bytes>, events: Vec<Value>) -> bool {
    for event in events {
        let kind = event["type"].as_str().unwrap_or("message").to_string();
        if tx.send(sse_event(&kind, &event)).await.is_err() {
            return false;
        }
    }
    true
}

/// Streams one message. Returns early, dropping the generation (which cancels it), as soon as
/// the client is gone.
async fn write_stream(
    mut message: Message,
    mut generation: Generation,
    mut timer: RequestTimer,
    tx: mpsc::Sender<Bytes>,
) {
    let shell = serde_json::to_value(&message).unwrap_or(Value::Null);
    if !send_all(
        &tx,
        vec![json!({"type": "message_start", "message": shell})],
    )
    .await
    {
        return;
    }
    let mut builder = ContentBuilder::new(true);
    let mut keep_alive = super::stream::ping_interval();
    loop {
        let next = tokio::select! {
            next = generation.next() => next,
            _ = keep_alive.tick() => {
                if !send_all(&tx, vec![json!({"type": "ping"})]).await {
                    return;
                }
                continue;
            }
        };
        match next {
            Some(Ok(Output::Delta {
                events, logprobs, ..
            })) => {
                if !events.is_empty() || !logprobs.is_empty() {
                    timer.token();
                }
                events.iter().for_each(|e| builder.push(e));
                if !send_all(&tx, builder.take_events()).await {
                    return;
                }
            }
            Some(Ok(Output::Done {
                finish,
                counts,
                stop_sequence,
            })) => {
                timer.finished(
                    finish.as_str(),
                    counts.prompt_tokens,
                    counts.completion_tokens,
                );
                builder.finish();
                message.finish(finish, stop_sequence, MessageUsage::new(&counts));
                let mut last = builder.take_events();
                last.push(json!({
                    "type": "message_delta",
                    "delta": {"stop_reason": message.stop_reason, "stop_sequence": message.stop_sequence},
                    "usage": message.usage,
                }));
                last.push(json!({"type": "message_stop"}));
                send_all(&tx, last).await;
                return;
            }
            failure => {
                let error = match failure {
                    Some(Err(GenerationError(error))) => error,
                    _ => "the generation ended without a result".into(),
                };
                let body = error_body(&ApiError::internal(error));
                let _ = tx.send(sse_event("error", &body)).await;
                return;
            }
        }
    }
}
