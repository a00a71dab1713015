//! `POST /v1/responses`, OpenAI's Responses API, stateless (spec/API.md §2.12).
//!
//! The request is translated into the chat completions request it means (`input.rs`) and runs
//! through the chat path: validation, template, sampling, grammars, the engine, the reasoning and
//! tool-call parsers. Its output events become Responses items (`output.rs`), returned whole or
//! streamed as named SSE events (`event: response.output_text.delta` + `data: {...}`), numbered
//! by `sequence_number`, from `response.created` to `response.completed` (or
//! `response.incomplete` when `max_output_tokens` cut the answer, `response.failed` when the
//! engine failed). As OpenAI does, the stream has no `[DONE]`. A panic while streaming ends it
//! with `event: error` and `data: {"error": {...}}`, which openai-python raises as an `APIError`.
//!
//! Nothing is stored: `previous_response_id`, `conversation` and `background` are refused (400
//! naming the field), `store` is accepted and the response says `store: false`.

mod input;
mod output;

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;

use self::output::{OutputBuilder, OutputItem, ResponseUsage};
use super::errors::ApiError;
use super::metrics::RequestTimer;
use super::request::prepare_chat;
use super::routes::{accept, blocking, now, request_id, spawn_sse, start, with_request_id};
use super::AppState;
use crate::engine::generate::{Generation, GenerationError, Output};
use crate::sampling::FinishReason;

/// `POST /v1/responses`. Only what this server acts on or echoes is read; other fields are
/// ignored, as on the chat path.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ResponsesRequest {
    pub model: Option<String>,
    /// A string, or a list of input items.
    pub input: Option<Value>,
    pub instructions: Option<Value>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    /// `{format: {type: text | json_object | json_schema, ...}}`.
    pub text: Option<Value>,
    /// `{effort, summary}`; `effort: "none"` turns thinking off.
    pub reasoning: Option<Value>,
    pub max_output_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub stream: Option<bool>,
    pub metadata: Option<BTreeMap<String, String>>,
    pub user: Option<String>,
    pub truncation: Option<String>,
    pub store: Option<bool>,
    pub previous_response_id: Option<String>,
    pub conversation: Option<Value>,
    pub background: Option<bool>,
    pub prompt: Option<Value>,
    pub prompt_cache_key: Option<String>,
    // The chat path's extensions, for clients that tune sampling or the template.
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub seed: Option<i64>,
    pub thinking_token_budget: Option<i64>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
}

/// The response object (`object: "response"`). `echo` holds the request's settings as the
/// response reports them.
#[derive(Debug, Clone, Serialize)]
struct ResponseObject {
    id: String,
    object: &'static str,
    created_at: u64,
    completed_at: Option<u64>,
    status: &'static str,
    error: Option<Value>,
    incomplete_details: Option<Value>,
    model: String,
    output: Vec<OutputItem>,
    usage: Option<ResponseUsage>,
    #[serde(flatten)]
    echo: Map<String, Value>,
}

impl ResponseObject {
    /// Records how the generation ended.
    fn finish(&mut self, finish: FinishReason, items: &[OutputItem], usage: ResponseUsage) {
        self.completed_at = Some(now());
        self.output = items.to_vec();
        self.usage = Some(usage);
        if finish == FinishReason::Length {
            self.status = "incomplete";
            self.incomplete_details = Some(json!({"reason": "max_output_tokens"}));
        } else {
            self.status = "completed";
        }
    }
}

/// The request's settings as the response echoes them, with OpenAI's defaults for those left out.
fn echo(req: &ResponsesRequest) -> Map<String, Value> {
    let fields = json!({
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": req.tools.clone().unwrap_or_default(),
        "tool_choice": req.tool_choice.clone().unwrap_or_else(|| json!("auto")),
        "parallel_tool_calls": req.parallel_tool_calls.unwrap_or(true),
        "text": req.text.clone().unwrap_or_else(|| json!({"format": {"type": "text"}})),
        "reasoning": req.reasoning.clone().unwrap_or_else(|| json!({"effort": null, "summary": null})),
        "metadata": req.metadata.clone().unwrap_or_default(),
        "user": req.user,
        "truncation": "disabled",
        "store": false,
        "background": false,
        "previous_response_id": null,
        "prompt_cache_key": req.prompt_cache_key,
    });
    match fields {
        Value::Object(map) => map,
        _ => Map::new(),
    }
}

pub async fn create_response(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let (model, request, admitted) =
        accept::<ResponsesRequest>(&state, body, |r| r.model.as_deref())?;
    let chat = input::to_chat_request(&request)?;
    let prep_model = model.clone();
    let prepared = blocking(move || {
        prepare_chat(&prep_model.text, &chat, prep_model.max_model_len)
            .map_err(input::responses_param)
    })
    .await?;
    let mut response = ResponseObject {
        id: request_id(&headers, "resp_"),
        object: "response",
        created_at: now(),
        completed_at: None,
        status: "in_progress",
        error: None,
        incomplete_details: None,
        model: model.name.clone(),
        output: Vec::new(),
        usage: None,
        echo: echo(&request),
    };
    let timer = state
        .metrics
        .request_started(prepared.requested_max_tokens, prepared.plans.len());
    let Some(mut generation) = start(&model, prepared.plans).pop() else {
        return Err(ApiError::internal("the request planned no generation"));
    };
    if prepared.stream {
        let id = response.id.clone();
        return Ok(spawn_sse(
            &id,
            admitted,
            move |tx| write_stream(response, generation, timer, tx),
            |error| vec![sse_event("error", &error.body())],
        ));
    }
    let mut builder = OutputBuilder::new(false);
    loop {
        match generation.next().await {
            Some(Ok(Output::Delta { events, .. })) => {
                events.iter().for_each(|e| builder.push(e));
            }
            Some(Ok(Output::PromptToken(_))) => {}
            Some(Ok(Output::Done { finish, counts, .. })) => {
                timer.finished(
                    finish.as_str(),
                    counts.prompt_tokens,
                    counts.completion_tokens,
                );
                let items = builder.finish(finish != FinishReason::Length);
                response.finish(finish, items, ResponseUsage::new(&counts));
                break;
            }
            Some(Err(GenerationError(message))) => return Err(ApiError::internal(message)),
            None => return Err(ApiError::internal("the generation ended without a result")),
        }
    }
    drop(admitted);
    Ok(with_request_id(
        Json(&response).into_response(),
        &response.id,
    ))
}

/// One named SSE event.
fn sse_event(kind: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {kind}\ndata: {data}\n\n"))
}

/// Numbers the events of one stream and sends them; `false` once the client is gone.
struct EventWriter {
    tx: mpsc::Sender<Bytes>,
    sequence: u64,
}

impl EventWriter {
    async fn send(&mut self, mut event: Value) -> bool {
        event["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        let kind = event["type"].as_str().unwrap_or("message").to_string();
        self.tx.send(sse_event(&kind, &event)).await.is_ok()
    }

    async fn send_all(&mut self, events: Vec<Value>) -> bool {
        for event in events {
            if !self.send(event).await {
                return false;
            }
        }
        true
    }
}

/// Streams one response. Returns early, dropping the generation (which cancels it), as soon as
/// the client is gone.
async fn write_stream(
    mut response: ResponseObject,
    mut generation: Generation,
    mut timer: RequestTimer,
    tx: mpsc::Sender<Bytes>,
) {
    let mut writer = EventWriter { tx, sequence: 0 };
    let snapshot = |r: &ResponseObject| serde_json::to_value(r).unwrap_or(Value::Null);
    let start = [
        json!({"type": "response.created", "response": snapshot(&response)}),
        json!({"type": "response.in_progress", "response": snapshot(&response)}),
    ];
    if !writer.send_all(start.into()).await {
        return;
    }
    let mut builder = OutputBuilder::new(true);
    let mut keep_alive = super::stream::ping_interval();
    loop {
        let next = tokio::select! {
            next = generation.next() => next,
            _ = keep_alive.tick() => {
                if writer.tx.send(super::stream::ping()).await.is_err() {
                    return;
                }
                continue;
            }
        };
        let last = match next {
            Some(Ok(Output::Delta {
                events, logprobs, ..
            })) => {
                if !events.is_empty() || !logprobs.is_empty() {
                    timer.token();
                }
                events.iter().for_each(|e| builder.push(e));
                if !writer.send_all(builder.take_events()).await {
                    return;
                }
                continue;
            }
            Some(Ok(Output::Done { finish, counts, .. })) => {
                timer.finished(
                    finish.as_str(),
                    counts.prompt_tokens,
                    counts.completion_tokens,
                );
                let items = builder.finish(finish != FinishReason::Length).to_vec();
                if !writer.send_all(builder.take_events()).await {
                    return;
                }
                response.finish(finish, &items, ResponseUsage::new(&counts));
                let kind = if response.status == "completed" {
                    "response.completed"
                } else {
                    "response.incomplete"
                };
                json!({"type": kind, "response": snapshot(&response)})
            }
            failure => {
                let message = match failure {
                    Some(Err(GenerationError(message))) => message,
                    _ => "the generation ended without a result".into(),
                };
                response.status = "failed";
                response.output = builder.items().to_vec();
                response.error = Some(json!({"code": "server_error", "message": message}));
                json!({"type": "response.failed", "response": snapshot(&response)})
            }
        };
        writer.send(last).await;
        return;
    }
}
