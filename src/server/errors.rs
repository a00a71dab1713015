//! OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status.
//!
//! The status decides what clients do: openai-python (and every SDK built the same way) retries
//! 408, 409, 429 and all 5xx, so anything the request itself got wrong must be a 4xx, and a 5xx
//! means a real fault on our side. See spec/API.md §2.8 for the table this follows.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

/// An error answer. Build one with the constructors below; they fix status, type and code
/// together so that the same situation always looks the same to clients.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Extra keys next to `message` (llama.cpp's `n_prompt_tokens` / `n_ctx` for overflow).
    pub extra: Vec<(&'static str, Value)>,
    /// Seconds for a `retry-after` header (overload).
    pub retry_after: Option<u32>,
}

impl ApiError {
    /// An error of the chat path for a request that was translated into a chat request
    /// (Responses, Messages), renamed to the fields the client sent: each `(chat, field)` of
    /// `renames` in the message's backticked names and in `param`; params under `messages` (which
    /// do not map one to one) become `messages_as`; `tools[i].function<rest>` becomes
    /// `tool_param(i, rest)`.
    pub fn renamed_from_chat(
        mut self,
        renames: &[(&str, &str)],
        messages_as: &str,
        tool_param: impl Fn(&str, &str) -> String,
    ) -> ApiError {
        for (chat, field) in renames {
            self.message = self
                .message
                .replace(&format!("`{chat}`"), &format!("`{field}`"));
        }
        self.param = self.param.map(|param| {
            if param.starts_with("messages") {
                return messages_as.to_string();
            }
            if let Some((tool, rest)) = param
                .strip_prefix("tools[")
                .and_then(|rest| rest.split_once("].function"))
            {
                return tool_param(tool, rest);
            }
            renames
                .iter()
                .find(|(chat, _)| param == *chat)
                .map_or(param.clone(), |(_, field)| field.to_string())
        });
        self
    }

    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            extra: Vec::new(),
            retry_after: None,
        }
    }

    /// 400: a field has a bad value. `param` is the field's name as the client wrote it.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError {
            param: Some(param.into()),
            code: Some("invalid_value"),
            ..ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    /// 400: the request is wrong as a whole (not one field): malformed JSON, a template rule.
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 400 with `code: unsupported_value`: a valid OpenAI feature this server does not offer.
    /// Deliberately not 501, which SDKs would retry as a server error.
    pub fn unsupported(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError {
            param: Some(param.into()),
            code: Some("unsupported_value"),
            ..ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    /// 400 `context_length_exceeded`. The message carries both vLLM's and llama.cpp's wording,
    /// because agent clients match those phrases to decide to compact their history.
    pub fn context_length(
        prompt_tokens: usize,
        max_tokens: Option<usize>,
        max_model_len: usize,
    ) -> ApiError {
        let message = match max_tokens {
            Some(out) => format!(
                "This model's maximum context length is {max_model_len} tokens. However, you requested \
                 {} tokens ({prompt_tokens} in the messages, {out} in the completion). The request \
                 exceeds the available context size; please reduce the length of the messages or \
                 the completion.",
                prompt_tokens + out
            ),
            None => format!(
                "This model's maximum context length is {max_model_len} tokens. However, your messages \
                 resulted in {prompt_tokens} tokens, which leaves no room for a completion. The request \
                 exceeds the available context size; please reduce the length of the messages."
            ),
        };
        ApiError {
            param: Some("messages".into()),
            code: Some("context_length_exceeded"),
            extra: vec![
                ("n_prompt_tokens", json!(prompt_tokens)),
                ("n_ctx", json!(max_model_len)),
            ],
            ..ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    pub fn unauthorized() -> ApiError {
        ApiError {
            code: Some("invalid_api_key"),
            ..ApiError::new(
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                "Incorrect or missing API key: send it as `Authorization: Bearer KEY`.",
            )
        }
    }

    pub fn model_not_found(model: &str, served: &str) -> ApiError {
        ApiError {
            param: Some("model".into()),
            code: Some("model_not_found"),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!("The model `{model}` does not exist. This server serves `{served}`."),
            )
        }
    }

    pub fn route_not_found(method: &str, path: &str) -> ApiError {
        ApiError {
            code: Some("not_found"),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!("No route for {method} {path}."),
            )
        }
    }

    pub fn method_not_allowed(method: &str, path: &str) -> ApiError {
        ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            format!("{method} is not allowed on {path}."),
        )
    }

    pub fn body_too_large(limit: usize) -> ApiError {
        ApiError {
            code: Some("request_too_large"),
            ..ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                format!("The request body is larger than this server's limit of {limit} bytes."),
            )
        }
    }

    /// 503 while the model loads (llama.cpp's shape; test harnesses poll /health for it).
    pub fn loading() -> ApiError {
        ApiError {
            retry_after: Some(1),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable_error",
                "Loading model",
            )
        }
    }

    /// 503 when too many requests are in flight; clients retry after the delay.
    pub fn overloaded(limit: usize) -> ApiError {
        ApiError {
            retry_after: Some(1),
            code: Some("server_overloaded"),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable_error",
                format!("The server is at its limit of {limit} requests in flight; retry shortly."),
            )
        }
    }

    /// 500: a real fault (an engine error, a panic). The message says what happened; nothing
    /// about the request was wrong, so the client may retry.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The JSON body: `{"error": {...}}`.
    pub fn body(&self) -> Value {
        let mut error = serde_json::Map::new();
        error.insert("message".into(), json!(self.message));
        error.insert("type".into(), json!(self.kind));
        error.insert("param".into(), json!(self.param));
        error.insert("code".into(), json!(self.code));
        for (key, value) in &self.extra {
            error.insert((*key).into(), value.clone());
        }
        json!({ "error": error })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status == StatusCode::INTERNAL_SERVER_ERROR {
            tracing::error!(status = %self.status, "{}", self.message);
        } else {
            tracing::debug!(status = %self.status, "{}", self.message);
        }
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.status)
    }
}

impl std::error::Error for ApiError {}

impl From<crate::sampling::ParamError> for ApiError {
    fn from(e: crate::sampling::ParamError) -> ApiError {
        ApiError::invalid(e.param, e.to_string())
    }
}

impl From<crate::chat::template::TemplateError> for ApiError {
    /// Every template failure on a request is the request's fault (see `TemplateError`): 400
    /// with the template's own message, so the client sees which rule it broke.
    fn from(e: crate::chat::template::TemplateError) -> ApiError {
        ApiError {
            param: Some("messages".into()),
            ..ApiError::bad_request(e.to_string())
        }
    }
}
