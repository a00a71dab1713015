//! The HTTP routes and their handlers.
//!
//! Each generation handler: model ready? (else 503) → body parsed (400/413) → model name known?
//! (404) → admitted? (503 when full) → request prepared on a blocking thread (template,
//! tokenizer, grammar: 400s) → generations started → a streamed or a whole response.
//!
//! Disconnects: a streamed response is written by a task that stops, dropping its generations,
//! as soon as a write fails; a whole response is awaited inside the handler, whose future the
//! server drops when the client goes away. Either way the engine cancels the sequence before its
//! next step.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use rand::distr::{Alphanumeric, SampleString};
use serde_json::{json, Value};
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::cors::CorsLayer;

use super::errors::ApiError;
use super::openai::{
    self, ChatChoice, ChatCompletion, ChatCompletionRequest, ChatMessage, Completion,
    CompletionChoice, CompletionRequest, FunctionCall, ModelCard, ToolCall, Usage,
};
use super::request::{prepare_chat, prepare_completion, StreamUsage};
use super::stream::{self, Api, ResponseHead};
use super::{AppState, InFlight, ServedModel};
use crate::chat::tools::ParsedOutput;
use crate::engine::generate::{Generation, GenerationError, GenerationPlan, Output, TokenInfo};

type Shared = Arc<AppState>;

pub fn router(state: Shared) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/responses", post(super::responses::create_response))
        .route("/v1/messages", post(super::messages::create_message))
        .route(
            "/v1/messages/count_tokens",
            post(super::messages::count_tokens),
        )
        .route("/v1/models", get(list_models))
        .route("/v1/models/{id}", get(get_model))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    Router::new()
        .merge(api)
        // Health and metrics need no key: orchestrators and scrapers poll them.
        .route("/health", get(health))
        .route("/v1/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Bodies are read by the handlers (as `Bytes`), which turn an oversize body into 413.
        .layer(axum::extract::DefaultBodyLimit::max(state.max_body_bytes))
        .layer(CatchPanicLayer::custom(
            |panic: Box<dyn std::any::Any + Send>| {
                let message = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "panic".into());
                ApiError::internal(format!(
                    "internal error while handling the request: {message}"
                ))
                .into_response()
            },
        ))
        // Browser chat UIs call from other origins; allow them (the key still guards the API).
        .layer(CorsLayer::permissive())
        .with_state(state)
}

/// `Authorization: Bearer KEY`, or `x-api-key: KEY` as Anthropic's clients send it, when the
/// server has a key.
async fn require_api_key(State(state): State<Shared>, request: Request, next: Next) -> Response {
    if let Some(key) = &state.api_key {
        let headers = request.headers();
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        let x_api_key = headers.get("x-api-key").and_then(|v| v.to_str().ok());
        let given = bearer.or(x_api_key).map(str::trim);
        if !given.is_some_and(|g| constant_time_eq(g.as_bytes(), key.as_bytes())) {
            return api_error(request.uri(), ApiError::unauthorized());
        }
    }
    next.run(request).await
}

/// An error in the shape of the API the path belongs to.
fn api_error(uri: &Uri, error: ApiError) -> Response {
    if uri.path().starts_with("/v1/messages") {
        super::messages::error_response(error)
    } else {
        error.into_response()
    }
}

/// Compares without an early exit, so response timing does not reveal how much of a guessed
/// key was right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn not_found(method: Method, uri: Uri) -> Response {
    api_error(&uri, ApiError::route_not_found(method.as_str(), uri.path()))
}

async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    api_error(
        &uri,
        ApiError::method_not_allowed(method.as_str(), uri.path()),
    )
}

async fn health(State(state): State<Shared>) -> Response {
    match state.model() {
        Some(_) => Json(json!({"status": "ok"})).into_response(),
        None => ApiError::loading().into_response(),
    }
}

async fn metrics(State(state): State<Shared>) -> Response {
    let text = state
        .metrics
        .render(state.model().map(|m| m.engine.stats()));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

fn ready(state: &AppState) -> Result<Arc<ServedModel>, ApiError> {
    state.model().cloned().ok_or_else(ApiError::loading)
}

fn model_card(model: &ServedModel) -> ModelCard {
    ModelCard {
        id: model.name.clone(),
        object: "model",
        created: model.created,
        owned_by: "lily",
        root: model.meta["source"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        parent: None,
        max_model_len: model.max_model_len,
        permission: Vec::new(),
        meta: model.meta.clone(),
    }
}

async fn list_models(State(state): State<Shared>) -> Result<Json<Value>, ApiError> {
    let model = ready(&state)?;
    Ok(Json(
        json!({"object": "list", "data": [model_card(&model)]}),
    ))
}

async fn get_model(
    State(state): State<Shared>,
    Path(id): Path<String>,
) -> Result<Json<ModelCard>, ApiError> {
    let model = ready(&state)?;
    if !model.answers_to(Some(&id)) {
        return Err(ApiError::model_not_found(&id, &model.name));
    }
    Ok(Json(model_card(&model)))
}

/// The body as bytes; an oversize body becomes an OpenAI-shaped 413.
fn body_bytes(state: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| match rejection.status() {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::body_too_large(state.max_body_bytes),
        _ => ApiError::bad_request(format!("Cannot read the request body: {rejection}")),
    })
}

/// Common start of the generation endpoints: ready, parsed, right model, admitted.
pub(super) fn accept<T: serde::de::DeserializeOwned>(
    state: &Shared,
    body: Result<Bytes, BytesRejection>,
    model_of: impl Fn(&T) -> Option<&str>,
) -> Result<(Arc<ServedModel>, T, InFlight), ApiError> {
    let model = ready(state)?;
    let body = body_bytes(state, body)?;
    let request: T = openai::parse_body(&body)?;
    if let Some(name) = model_of(&request).filter(|_| !model.answers_to(model_of(&request))) {
        return Err(ApiError::model_not_found(name, &model.name));
    }
    let admitted = state
        .admit()
        .ok_or_else(|| ApiError::overloaded(state.max_in_flight))?;
    Ok((model, request, admitted))
}

/// Runs `work` on the blocking pool: rendering a long prompt, tokenizing it and compiling a
/// grammar take long enough to stall other requests if done on the async threads.
pub(super) async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(work).await.map_err(|e| {
        ApiError::internal(format!("internal error while preparing the request: {e}"))
    })?
}

/// `prefix` followed by 24 random letters and digits (`prefix` ends in its separator).
pub(super) fn new_id(prefix: &str) -> String {
    format!(
        "{prefix}{}",
        Alphanumeric.sample_string(&mut rand::rng(), 24)
    )
}

pub(super) fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The client's `X-Request-Id` if it sent one (echoed back), else a fresh id.
pub(super) fn request_id(headers: &HeaderMap, prefix: &str) -> String {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128)
        .map_or_else(|| new_id(prefix), str::to_string)
}

pub(super) fn start(model: &ServedModel, plans: Vec<GenerationPlan>) -> Vec<Generation> {
    plans
        .into_iter()
        .map(|plan| model.text.start(&model.engine, plan))
        .collect()
}

async fn chat_completions(
    State(state): State<Shared>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let (model, request, admitted) =
        accept::<ChatCompletionRequest>(&state, body, |r| r.model.as_deref())?;
    let prep_model = model.clone();
    let prepared =
        blocking(move || prepare_chat(&prep_model.text, &request, prep_model.max_model_len))
            .await?;
    let head = ResponseHead {
        id: request_id(&headers, "chatcmpl-"),
        created: now(),
        model: model.name.clone(),
    };
    let timer = state
        .metrics
        .request_started(prepared.requested_max_tokens, prepared.plans.len());
    let generations = start(&model, prepared.plans);
    if prepared.stream {
        return Ok(spawn_stream(
            head,
            Api::Chat {
                reasoning: prepared.include_reasoning,
            },
            generations,
            prepared.usage,
            &model,
            timer,
            admitted,
        ));
    }
    let mut choices = Vec::with_capacity(generations.len());
    let mut usage = None;
    for (index, generation) in generations.into_iter().enumerate() {
        let outcome = collect(generation).await?;
        timer.finished(
            outcome.finish,
            outcome.counts.prompt_tokens,
            outcome.counts.completion_tokens,
        );
        stream::add_usage(&mut usage, &outcome.counts);
        let tool_calls: Vec<ToolCall> = outcome
            .parsed
            .tool_calls
            .into_iter()
            .map(|c| ToolCall {
                id: c.id,
                kind: "function",
                function: FunctionCall {
                    name: c.name,
                    arguments: c.arguments,
                },
            })
            .collect();
        let reasoning =
            Some(outcome.parsed.reasoning).filter(|r| prepared.include_reasoning && !r.is_empty());
        let content = outcome.parsed.content;
        let message = ChatMessage {
            role: "assistant",
            // Only tool calls: `content` is null, as OpenAI sends it.
            content: if content.is_empty() && !tool_calls.is_empty() {
                None
            } else {
                Some(content)
            },
            reasoning: reasoning.clone(),
            reasoning_content: reasoning,
            tool_calls,
        };
        let logprobs = outcome
            .logprobs
            .map(|tokens| stream::chat_logprobs(&model.text.tokenizer, &tokens));
        choices.push(ChatChoice {
            index,
            message,
            logprobs,
            finish_reason: outcome.finish,
        });
    }
    drop(admitted);
    let response = ChatCompletion {
        id: head.id.clone(),
        object: "chat.completion",
        created: head.created,
        model: head.model,
        system_fingerprint: None,
        choices,
        usage: usage.unwrap_or_else(|| Usage::new(0, 0, 0, 0)),
    };
    Ok(with_request_id(Json(response).into_response(), &head.id))
}

async fn completions(
    State(state): State<Shared>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let (model, request, admitted) =
        accept::<CompletionRequest>(&state, body, |r| r.model.as_deref())?;
    let prep_model = model.clone();
    let prepared =
        blocking(move || prepare_completion(&prep_model.text, &request, prep_model.max_model_len))
            .await?;
    let head = ResponseHead {
        id: request_id(&headers, "cmpl-"),
        created: now(),
        model: model.name.clone(),
    };
    let timer = state
        .metrics
        .request_started(prepared.requested_max_tokens, prepared.plans.len());
    let generations = start(&model, prepared.plans);
    let want_logprobs = prepared.logprobs.is_some();
    if prepared.stream {
        let api = Api::Text {
            logprobs: want_logprobs,
        };
        return Ok(spawn_stream(
            head,
            api,
            generations,
            prepared.usage,
            &model,
            timer,
            admitted,
        ));
    }
    let mut choices = Vec::with_capacity(generations.len());
    let mut usage = None;
    for (index, generation) in generations.into_iter().enumerate() {
        let outcome = collect(generation).await?;
        timer.finished(
            outcome.finish,
            outcome.counts.prompt_tokens,
            outcome.counts.completion_tokens,
        );
        stream::add_usage(&mut usage, &outcome.counts);
        let tokenizer = &model.text.tokenizer;
        let (mut text, mut logprobs, mut offset) = (String::new(), None, 0);
        // With `echo` the text and the logprobs start with the prompt's.
        if let Some(prompt) = &prepared.echo {
            text = tokenizer
                .decode_lossy(prompt)
                .map_err(|e| ApiError::internal(format!("cannot detokenize the prompt: {e}")))?;
            if want_logprobs {
                let scores = &outcome.prompt_scores;
                logprobs = Some(stream::echo_logprobs(
                    tokenizer,
                    prompt,
                    scores,
                    &mut offset,
                ));
            }
        }
        text.push_str(&outcome.parsed.content);
        if let Some(generated) = &outcome.logprobs {
            let more = stream::text_logprobs(tokenizer, generated, &mut offset);
            match &mut logprobs {
                Some(l) => l.extend(more),
                None => logprobs = Some(more),
            }
        }
        choices.push(CompletionChoice {
            index,
            text,
            logprobs,
            finish_reason: Some(outcome.finish),
        });
    }
    drop(admitted);
    let response = Completion {
        id: head.id.clone(),
        object: "text_completion",
        created: head.created,
        model: head.model,
        system_fingerprint: None,
        choices,
        usage,
    };
    Ok(with_request_id(Json(response).into_response(), &head.id))
}

pub(super) fn with_request_id(mut response: Response, id: &str) -> Response {
    if let Ok(v) = header::HeaderValue::from_str(id) {
        response.headers_mut().insert("x-request-id", v);
    }
    response
}

/// Starts the task that writes a streamed chat or text completion.
fn spawn_stream(
    head: ResponseHead,
    api: Api,
    generations: Vec<Generation>,
    usage: StreamUsage,
    model: &ServedModel,
    timer: super::metrics::RequestTimer,
    admitted: InFlight,
) -> Response {
    let tokenizer = model.text.tokenizer.clone();
    let id = head.id.clone();
    spawn_sse(
        &id,
        admitted,
        move |tx| stream::run_stream(head, api, generations, usage, tokenizer, timer, tx),
        |error| {
            vec![
                stream::sse_data(&error.body()),
                Bytes::from_static(b"data: [DONE]\n\n"),
            ]
        },
    )
}

/// Starts the task that writes a streamed response with `write`; it holds the admission guard
/// until it ends. Should `write` panic, `on_panic` gives the events that end the stream.
pub(super) fn spawn_sse<W: std::future::Future<Output = ()> + Send + 'static>(
    id: &str,
    admitted: InFlight,
    write: impl FnOnce(tokio::sync::mpsc::Sender<Bytes>) -> W,
    on_panic: impl FnOnce(ApiError) -> Vec<Bytes> + Send + 'static,
) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel(32);
    let response = stream::sse_response(rx, id);
    let panic_tx = tx.clone();
    let run = write(tx);
    tokio::spawn(async move {
        use futures_util::FutureExt;
        // A panic while streaming must end only this response, and visibly.
        if let Err(panic) = std::panic::AssertUnwindSafe(run).catch_unwind().await {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()));
            let error = ApiError::internal(format!(
                "internal error while streaming: {}",
                message.unwrap_or_else(|| "panic".into())
            ));
            for event in on_panic(error) {
                let _ = panic_tx.send(event).await;
            }
        }
        drop(admitted);
    });
    response
}

/// A whole (non-streamed) choice.
struct Outcome {
    parsed: ParsedOutput,
    logprobs: Option<Vec<TokenInfo>>,
    /// The prompt's tokens after the first, scored (only with `echo` and `logprobs`).
    prompt_scores: Vec<TokenInfo>,
    finish: &'static str,
    counts: crate::engine::generate::Counts,
}

async fn collect(mut generation: Generation) -> Result<Outcome, ApiError> {
    let mut parsed = ParsedOutput::default();
    let mut logprobs: Option<Vec<TokenInfo>> = None;
    let mut prompt_scores = Vec::new();
    while let Some(item) = generation.next().await {
        match item {
            Ok(Output::PromptToken(token)) => prompt_scores.push(token),
            Ok(Output::Delta {
                events,
                logprobs: tokens,
                ..
            }) => {
                for event in &events {
                    parsed.apply(event);
                }
                if !tokens.is_empty() {
                    logprobs.get_or_insert_with(Vec::new).extend(tokens);
                }
            }
            Ok(Output::Done { finish, counts, .. }) => {
                return Ok(Outcome {
                    parsed,
                    logprobs,
                    prompt_scores,
                    finish: finish.as_str(),
                    counts,
                })
            }
            Err(GenerationError(message)) => return Err(ApiError::internal(message)),
        }
    }
    Err(ApiError::internal("the generation ended without a result"))
}

// ---------------------------------------------------------------------------------------------
// /tokenize and /detokenize (vLLM's shape), handy for clients that count tokens and for tests
// ---------------------------------------------------------------------------------------------

async fn tokenize(
    State(state): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let model = ready(&state)?;
    let body = body_bytes(&state, body)?;
    let value: Value = openai::parse_body(&body)?;
    let work_model = model.clone();
    let tokens = blocking(move || {
        let text = if value.get("messages").is_some() {
            let request: ChatCompletionRequest = openai::parse_body(&body)?;
            super::request::render_chat(&work_model.text, &request)?.text
        } else {
            match value.get("prompt") {
                Some(Value::String(text)) => text.clone(),
                _ => {
                    return Err(ApiError::invalid(
                        "prompt",
                        "Send `prompt` (a string) or `messages`.",
                    ))
                }
            }
        };
        work_model
            .text
            .tokenizer
            .encode(&text)
            .map_err(|e| ApiError::invalid("prompt", format!("Cannot tokenize: {e}")))
    })
    .await?;
    Ok(Json(
        json!({"count": tokens.len(), "max_model_len": model.max_model_len, "tokens": tokens}),
    ))
}

async fn detokenize(
    State(state): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let model = ready(&state)?;
    let body = body_bytes(&state, body)?;
    let value: Value = openai::parse_body(&body)?;
    let ids: Vec<u32> = value
        .get("tokens")
        .and_then(Value::as_array)
        .and_then(|ids| {
            ids.iter()
                .map(|id| id.as_u64().and_then(|i| u32::try_from(i).ok()))
                .collect()
        })
        .ok_or_else(|| ApiError::invalid("tokens", "`tokens` must be a list of token ids."))?;
    let text = model
        .text
        .tokenizer
        .decode_lossy(&ids)
        .map_err(|e| ApiError::invalid("tokens", e.to_string()))?;
    Ok(Json(json!({"prompt": text})))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::{cpu_backend, ModelSource, ServeOptions};

    fn loading_state() -> Shared {
        Arc::new(AppState::new(&ServeOptions {
            source: ModelSource::Demo,
            served_model_name: "m".into(),
            aliases: Vec::new(),
            host: "127.0.0.1".into(),
            port: 0,
            api_key: None,
            max_model_len: None,
            backend: cpu_backend(),
            max_body_bytes: 1024,
            max_in_flight: 1,
            scripted: None,
            shutdown_grace: std::time::Duration::ZERO,
            engine: crate::engine::EngineOptions::default(),
        }))
    }

    #[tokio::test]
    async fn while_loading_everything_is_503() {
        let state = loading_state();
        assert_eq!(
            health(State(state.clone())).await.status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
        let body = Ok(Bytes::from_static(
            b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}",
        ));
        let chat = chat_completions(State(state.clone()), HeaderMap::new(), body).await;
        let error = chat.err().map(|e| (e.status, e.kind));
        assert_eq!(
            error,
            Some((StatusCode::SERVICE_UNAVAILABLE, "unavailable_error"))
        );
        assert!(list_models(State(state)).await.is_err());
    }

    #[test]
    fn admission_is_limited() {
        let state = loading_state();
        let first = state.admit();
        assert!(first.is_some());
        assert!(state.admit().is_none(), "one in flight is the limit");
        drop(first);
        assert!(state.admit().is_some(), "the slot is free again");
    }

    #[test]
    fn key_comparison() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secrets"));
    }
}
