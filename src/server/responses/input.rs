//! A Responses request as the chat completions request it means (llama.cpp's approach): `input`
//! items become chat messages, flat function tools become chat tools, `text.format` becomes
//! `response_format`, `reasoning.effort` becomes `reasoning_effort`. The chat path then
//! validates, renders and plans it; its errors are renamed to the Responses fields
//! ([`responses_param`]).

use serde_json::{json, Map, Value};

use super::ResponsesRequest;
use crate::server::errors::ApiError;
use crate::server::openai::ChatCompletionRequest;

/// The chat request a Responses request stands for. Checks what the chat path cannot check
/// under the Responses names: the stateless rules, item and tool shapes.
pub fn to_chat_request(req: &ResponsesRequest) -> Result<ChatCompletionRequest, ApiError> {
    reject_stateful(req)?;
    let mut messages = Vec::new();
    match &req.instructions {
        None | Some(Value::Null) => {}
        Some(Value::String(text)) => {
            messages.push(json!({"role": "system", "content": text}));
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "instructions",
                "`instructions` must be a string.",
            ))
        }
    }
    messages.extend(input_messages(req.input.as_ref())?);
    let tools = match &req.tools {
        Some(tools) => Some(
            tools
                .iter()
                .enumerate()
                .map(|(i, tool)| chat_tool(tool, i))
                .collect::<Result<Vec<_>, _>>()?,
        ),
        None => None,
    };
    let reasoning_effort = match req.reasoning.as_ref().and_then(|r| r.get("effort")) {
        None | Some(Value::Null) => None,
        Some(Value::String(effort)) => Some(effort.clone()),
        Some(_) => {
            return Err(ApiError::invalid(
                "reasoning.effort",
                "`reasoning.effort` must be a string such as \"none\", \"low\", \"medium\" or \"high\".",
            ))
        }
    };
    Ok(ChatCompletionRequest {
        model: req.model.clone(),
        messages,
        tools,
        tool_choice: chat_tool_choice(req.tool_choice.as_ref())?,
        parallel_tool_calls: req.parallel_tool_calls,
        response_format: text_format(req.text.as_ref())?,
        stream: req.stream,
        max_completion_tokens: req.max_output_tokens,
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        min_p: req.min_p,
        presence_penalty: req.presence_penalty,
        frequency_penalty: req.frequency_penalty,
        repetition_penalty: req.repetition_penalty,
        seed: req.seed,
        thinking_token_budget: req.thinking_token_budget,
        chat_template_kwargs: req.chat_template_kwargs.clone(),
        reasoning_effort,
        prompt_cache_key: req.prompt_cache_key.clone(),
        ..ChatCompletionRequest::default()
    })
}

/// This server keeps nothing between requests: what needs a stored response or conversation is
/// refused, naming the field, rather than silently answering without the context it refers to.
fn reject_stateful(req: &ResponsesRequest) -> Result<(), ApiError> {
    let stateless = " This server is stateless: send the whole conversation in `input`.";
    if req.previous_response_id.is_some() {
        return Err(ApiError::unsupported(
            "previous_response_id",
            format!("`previous_response_id` is not supported.{stateless}"),
        ));
    }
    if req.conversation.as_ref().is_some_and(|c| !c.is_null()) {
        return Err(ApiError::unsupported(
            "conversation",
            format!("`conversation` is not supported.{stateless}"),
        ));
    }
    if req.background == Some(true) {
        return Err(ApiError::unsupported(
            "background",
            "`background` responses are not supported: they must be stored to be fetched later.",
        ));
    }
    if req.prompt.as_ref().is_some_and(|p| !p.is_null()) {
        return Err(ApiError::unsupported(
            "prompt",
            "Stored prompt templates (`prompt`) are not supported; send `instructions` and `input`.",
        ));
    }
    match req.truncation.as_deref() {
        None | Some("disabled") => Ok(()),
        Some("auto") => Err(ApiError::unsupported(
            "truncation",
            "`truncation: \"auto\"` is not supported: an input that does not fit is refused with `context_length_exceeded`.",
        )),
        Some(other) => Err(ApiError::invalid(
            "truncation",
            format!("`truncation` must be \"disabled\" or \"auto\", got {other:?}."),
        )),
    }
}

/// Chat messages for `input`: a string is one user message; a list holds messages and the items
/// of earlier turns (reasoning, function calls and their outputs).
fn input_messages(input: Option<&Value>) -> Result<Vec<Value>, ApiError> {
    let items = match input {
        Some(Value::String(text)) => return Ok(vec![json!({"role": "user", "content": text})]),
        Some(Value::Array(items)) => items,
        None | Some(Value::Null) => return Err(ApiError::invalid("input", "`input` is required.")),
        Some(_) => {
            return Err(ApiError::invalid(
                "input",
                "`input` must be a string or a list of input items.",
            ))
        }
    };
    let mut turns = Turns::default();
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        if !item.is_object() {
            return Err(ApiError::invalid(
                at,
                "Each input item must be a JSON object.",
            ));
        }
        // A message may leave out `type` (OpenAI's "easy input message").
        let kind = match item.get("type") {
            None if item.get("role").is_some() => "message",
            None => {
                return Err(ApiError::invalid(
                    format!("{at}.type"),
                    "Each input item needs a `type` (or a `role`, for a message).",
                ))
            }
            Some(kind) => kind.as_str().ok_or_else(|| {
                ApiError::invalid(format!("{at}.type"), "`type` must be a string.")
            })?,
        };
        match kind {
            "message" => turns.message(item, &at)?,
            "function_call" => turns.function_call(item, &at)?,
            "function_call_output" => turns.function_call_output(item, &at)?,
            "reasoning" => turns.reasoning(item),
            "item_reference" => {
                return Err(ApiError::unsupported(
                    at,
                    "`item_reference` needs stored items; this server is stateless: send the items themselves.",
                ))
            }
            other => {
                return Err(ApiError::unsupported(
                    format!("{at}.type"),
                    format!("Input items of type `{other}` are not supported: only messages, `reasoning`, `function_call` and `function_call_output`."),
                ))
            }
        }
    }
    Ok(turns.messages)
}

/// Chat messages being built from input items. Reasoning, an assistant message and its function
/// calls arrive as separate items but form one assistant turn in chat.
#[derive(Default)]
struct Turns {
    messages: Vec<Value>,
    /// Reasoning waiting for the assistant message it belongs to.
    reasoning: Option<String>,
}

impl Turns {
    fn message(&mut self, item: &Value, at: &str) -> Result<(), ApiError> {
        let role = match item.get("role").and_then(Value::as_str) {
            Some(role @ ("user" | "assistant" | "system" | "developer")) => role,
            Some(other) => {
                return Err(ApiError::invalid(
                    format!("{at}.role"),
                    format!("Unknown role `{other}`: use user, assistant, system or developer."),
                ))
            }
            None => {
                return Err(ApiError::invalid(
                    format!("{at}.role"),
                    "A message needs a string `role`.",
                ))
            }
        };
        let content = message_content(item.get("content"), &format!("{at}.content"))?;
        let mut message = json!({"role": role, "content": content});
        if role == "assistant" {
            if let Some(reasoning) = self.reasoning.take() {
                message["reasoning_content"] = json!(reasoning);
            }
        }
        self.messages.push(message);
        Ok(())
    }

    /// Joins the assistant turn in progress (the message or calls just before), else starts one.
    fn function_call(&mut self, item: &Value, at: &str) -> Result<(), ApiError> {
        let field = |name: &str| {
            item.get(name).and_then(Value::as_str).ok_or_else(|| {
                ApiError::invalid(
                    format!("{at}.{name}"),
                    format!("A `function_call` item needs a string `{name}`."),
                )
            })
        };
        let call = json!({
            "id": field("call_id")?,
            "type": "function",
            "function": {"name": field("name")?, "arguments": field("arguments")?},
        });
        let joins = self.reasoning.is_none()
            && self
                .messages
                .last()
                .is_some_and(|m| m["role"] == "assistant");
        if !joins {
            let mut message = json!({"role": "assistant", "content": null});
            if let Some(reasoning) = self.reasoning.take() {
                message["reasoning_content"] = json!(reasoning);
            }
            self.messages.push(message);
        }
        if let Some(last) = self.messages.last_mut() {
            match last.get_mut("tool_calls").and_then(Value::as_array_mut) {
                Some(calls) => calls.push(call),
                None => last["tool_calls"] = json!([call]),
            }
        }
        Ok(())
    }

    fn function_call_output(&mut self, item: &Value, at: &str) -> Result<(), ApiError> {
        let call_id = item.get("call_id").and_then(Value::as_str).ok_or_else(|| {
            ApiError::invalid(
                format!("{at}.call_id"),
                "A `function_call_output` item needs a string `call_id`.",
            )
        })?;
        let output = match item.get("output") {
            Some(Value::String(text)) => Value::String(text.clone()),
            Some(parts @ Value::Array(_)) => message_content(Some(parts), &format!("{at}.output"))?,
            _ => {
                return Err(ApiError::invalid(
                    format!("{at}.output"),
                    "`output` must be a string or a list of content parts.",
                ))
            }
        };
        self.messages
            .push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
        Ok(())
    }

    /// Kept for the next assistant message: the chat template puts it back in that turn (when
    /// it keeps the reasoning of earlier turns at all). Only summaries or encrypted content:
    /// there is no text to give back, and the item is dropped.
    fn reasoning(&mut self, item: &Value) {
        let texts = |field: &str| -> String {
            item.get(field)
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(|part| part.get("text").and_then(Value::as_str))
                .collect()
        };
        let text = Some(texts("content"))
            .filter(|t| !t.is_empty())
            .unwrap_or_else(|| texts("summary"));
        if !text.is_empty() {
            self.reasoning
                .get_or_insert_with(String::new)
                .push_str(&text);
        }
    }
}

/// A message's content as chat content: a string stays one; text parts (`input_text`,
/// `output_text`, `refusal`) become chat text parts.
fn message_content(content: Option<&Value>, at: &str) -> Result<Value, ApiError> {
    let parts = match content {
        Some(Value::String(text)) => return Ok(Value::String(text.clone())),
        Some(Value::Array(parts)) => parts,
        _ => {
            return Err(ApiError::invalid(
                at,
                "`content` must be a string or a list of content parts.",
            ))
        }
    };
    let mut chat_parts = Vec::with_capacity(parts.len());
    for (j, part) in parts.iter().enumerate() {
        let at = format!("{at}[{j}]");
        let field = match part.get("type").and_then(Value::as_str) {
            Some("input_text" | "output_text" | "text") => "text",
            Some("refusal") => "refusal",
            Some("input_image" | "input_file" | "input_audio") => {
                return Err(ApiError::unsupported(
                    at,
                    "This server was started without vision or audio support: only text content parts are accepted.",
                ))
            }
            Some(other) => {
                return Err(ApiError::invalid(
                    format!("{at}.type"),
                    format!("Unknown content part type `{other}`."),
                ))
            }
            None => {
                return Err(ApiError::invalid(
                    format!("{at}.type"),
                    "Each content part needs a string `type`.",
                ))
            }
        };
        let text = part.get(field).and_then(Value::as_str).ok_or_else(|| {
            ApiError::invalid(
                format!("{at}.{field}"),
                format!("This content part needs a string `{field}`."),
            )
        })?;
        chat_parts.push(json!({"type": "text", "text": text}));
    }
    Ok(Value::Array(chat_parts))
}

/// A flat Responses function tool (`name`, `parameters`, ... at the top) as a chat tool.
fn chat_tool(tool: &Value, i: usize) -> Result<Value, ApiError> {
    let at = format!("tools[{i}]");
    let Some(fields) = tool.as_object() else {
        return Err(ApiError::invalid(at, "Each tool must be a JSON object."));
    };
    match fields.get("type").and_then(Value::as_str) {
        Some("function") => {}
        Some(other) => {
            return Err(ApiError::unsupported(
                format!("{at}.type"),
                format!("Tools of type `{other}` are not supported: only `function` tools, which the client runs."),
            ))
        }
        None => {
            return Err(ApiError::invalid(
                format!("{at}.type"),
                "Each tool needs a `type`.",
            ))
        }
    }
    let function: Map<String, Value> = ["name", "description", "parameters", "strict"]
        .into_iter()
        .filter_map(|key| Some((key.to_string(), fields.get(key)?.clone())))
        .filter(|(_, value)| !value.is_null())
        .collect();
    Ok(json!({"type": "function", "function": function}))
}

/// `tool_choice`: the strings are the chat ones; a named function is `{type, name}`.
fn chat_tool_choice(choice: Option<&Value>) -> Result<Option<Value>, ApiError> {
    match choice {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(Value::String(s.clone()))),
        Some(named) => match (
            named.get("type").and_then(Value::as_str),
            named.get("name").and_then(Value::as_str),
        ) {
            (Some("function"), Some(name)) => {
                Ok(Some(json!({"type": "function", "function": {"name": name}})))
            }
            _ => Err(ApiError::invalid(
                "tool_choice",
                "`tool_choice` must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"name\": ...}.",
            )),
        },
    }
}

/// `text.format` as a chat `response_format`.
fn text_format(text: Option<&Value>) -> Result<Option<Value>, ApiError> {
    let Some(format) = text.and_then(|t| t.get("format")).filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text" | "json_object") => Ok(Some(format.clone())),
        Some("json_schema") => {
            let mut schema = Map::new();
            for key in ["name", "schema", "strict", "description"] {
                if let Some(value) = format.get(key) {
                    schema.insert(key.into(), value.clone());
                }
            }
            Ok(Some(json!({"type": "json_schema", "json_schema": schema})))
        }
        _ => Err(ApiError::invalid(
            "text.format",
            "`text.format.type` must be \"text\", \"json_object\" or \"json_schema\".",
        )),
    }
}

/// An error of the chat path, renamed to the Responses field it came from.
pub fn responses_param(error: ApiError) -> ApiError {
    let renames = [
        ("max_completion_tokens", "max_output_tokens"),
        ("response_format.json_schema.schema", "text.format.schema"),
        ("json_schema.schema", "text.format.schema"),
        ("response_format", "text.format"),
    ];
    error.renamed_from_chat(&renames, "input", |tool, rest| {
        format!("tools[{tool}]{rest}")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(body: Value) -> ResponsesRequest {
        serde_json::from_value(body).expect("a request")
    }

    #[test]
    fn a_tool_loop_becomes_one_assistant_turn_and_tool_messages() {
        let chat = to_chat_request(&request(json!({
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": "Weather in Paris?"},
                {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Look it up."}]},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
                {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
            ],
        })))
        .expect("valid");
        let m = &chat.messages;
        assert_eq!(m.len(), 5, "{m:?}");
        assert_eq!(m[0], json!({"role": "system", "content": "Be brief."}));
        assert_eq!(m[2]["reasoning_content"], "Look it up.");
        assert_eq!(m[2]["tool_calls"].as_array().map(Vec::len), Some(2));
        assert_eq!(m[2]["tool_calls"][1]["id"], "call_2");
        assert_eq!(
            m[3],
            json!({"role": "tool", "tool_call_id": "call_1", "content": "sunny"})
        );
        assert_eq!(m[4]["content"][0]["text"], "rain");
    }

    #[test]
    fn flat_tools_named_choice_and_formats_translate() {
        let chat = to_chat_request(&request(json!({
            "input": "hi",
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": true}],
            "tool_choice": {"type": "function", "name": "f"},
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
            "reasoning": {"effort": "none"},
            "max_output_tokens": 7,
        })))
        .expect("valid");
        assert_eq!(
            chat.tools
                .as_ref()
                .map(|t| t[0]["function"]["name"].clone()),
            Some(json!("f"))
        );
        assert_eq!(
            chat.tool_choice,
            Some(json!({"type": "function", "function": {"name": "f"}}))
        );
        assert_eq!(
            chat.response_format
                .as_ref()
                .map(|f| f["json_schema"]["name"].clone()),
            Some(json!("x"))
        );
        assert_eq!(chat.reasoning_effort.as_deref(), Some("none"));
        assert_eq!(chat.max_completion_tokens, Some(7));
    }

    #[test]
    fn errors_name_the_responses_field() {
        let param = |body: Value| to_chat_request(&request(body)).err().and_then(|e| e.param);
        assert_eq!(param(json!({"input": 3})).as_deref(), Some("input"));
        assert_eq!(
            param(json!({"input": "x", "previous_response_id": "resp_1"})).as_deref(),
            Some("previous_response_id")
        );
        assert_eq!(
            param(json!({"input": [{"role": "robot", "content": "x"}]})).as_deref(),
            Some("input[0].role")
        );
        assert_eq!(
            param(json!({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}))
                .as_deref(),
            Some("input[0].content[0]")
        );
        assert_eq!(
            param(json!({"input": "x", "tools": [{"type": "web_search"}]})).as_deref(),
            Some("tools[0].type")
        );
        assert_eq!(
            param(json!({"input": "x", "tool_choice": {"type": "web_search"}})).as_deref(),
            Some("tool_choice")
        );
        let renamed = responses_param(ApiError::invalid("tools[2].function.name", "bad"));
        assert_eq!(renamed.param.as_deref(), Some("tools[2].name"));
        let renamed = responses_param(ApiError::invalid(
            "max_completion_tokens",
            "`max_completion_tokens` is bad",
        ));
        assert_eq!(
            (renamed.param.as_deref(), renamed.message.as_str()),
            (Some("max_output_tokens"), "`max_output_tokens` is bad")
        );
    }
}
