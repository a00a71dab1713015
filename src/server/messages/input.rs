//! A Messages request as the chat completions request it means: `system` becomes the system
//! message, content blocks become chat messages (`tool_use` blocks the assistant's tool calls,
//! `tool_result` blocks `tool` messages, `thinking` blocks its reasoning), Anthropic tools and
//! `tool_choice` their chat forms, `thinking` the template switch and the thinking budget. The
//! chat path then validates, renders and plans it; its error messages are renamed to the
//! Messages fields ([`messages_param`]).

use serde_json::{json, Value};

use super::MessagesRequest;
use crate::server::errors::ApiError;
use crate::server::openai::{ChatCompletionRequest, OneOrMany};

/// The chat request a Messages request stands for. `max_tokens` is required by the Messages API
/// but not by `count_tokens`, which passes `needs_max_tokens: false`.
pub fn to_chat_request(
    req: &MessagesRequest,
    needs_max_tokens: bool,
) -> Result<ChatCompletionRequest, ApiError> {
    if needs_max_tokens && req.max_tokens.is_none() {
        return Err(ApiError::invalid(
            "max_tokens",
            "max_tokens: Field required",
        ));
    }
    let mut messages = Vec::new();
    if let Some(system) = system_message(req.system.as_ref())? {
        messages.push(system);
    }
    let Some(Value::Array(turns)) = &req.messages else {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must be a list of messages.",
        ));
    };
    for (i, turn) in turns.iter().enumerate() {
        messages.extend(chat_messages(turn, &format!("messages.{i}"))?);
    }
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
    let (tool_choice, parallel_tool_calls) = chat_tool_choice(req.tool_choice.as_ref())?;
    let (enable_thinking, thinking_token_budget) = thinking(req.thinking.as_ref())?;
    Ok(ChatCompletionRequest {
        model: req.model.clone(),
        messages,
        tools,
        tool_choice,
        parallel_tool_calls,
        stream: req.stream,
        max_completion_tokens: req.max_tokens,
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        stop: req.stop_sequences.clone().map(OneOrMany::Many),
        enable_thinking,
        thinking_token_budget,
        ..ChatCompletionRequest::default()
    })
}

/// `system`: a string or a list of text blocks (whose `cache_control` is ignored).
fn system_message(system: Option<&Value>) -> Result<Option<Value>, ApiError> {
    match system {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(text)) => Ok(Some(json!({"role": "system", "content": text}))),
        Some(Value::Array(blocks)) => {
            let mut parts = Vec::with_capacity(blocks.len());
            for (i, block) in blocks.iter().enumerate() {
                let at = format!("system.{i}");
                match block_type(block, &at)? {
                    "text" => parts.push(text_part(block, &at)?),
                    other => {
                        return Err(ApiError::invalid(
                            format!("{at}.type"),
                            format!("`system` takes text blocks only, got `{other}`."),
                        ))
                    }
                }
            }
            Ok(Some(json!({"role": "system", "content": parts})))
        }
        Some(_) => Err(ApiError::invalid(
            "system",
            "`system` must be a string or a list of text blocks.",
        )),
    }
}

/// The chat messages of one Messages turn. A user turn's `tool_result` blocks become `tool`
/// messages, in order with its text; an assistant turn stays one message.
fn chat_messages(turn: &Value, at: &str) -> Result<Vec<Value>, ApiError> {
    if !turn.is_object() {
        return Err(ApiError::invalid(at, "Each message must be a JSON object."));
    }
    let role = match turn.get("role").and_then(Value::as_str) {
        Some(role @ ("user" | "assistant")) => role,
        Some(other) => {
            return Err(ApiError::invalid(
                format!("{at}.role"),
                format!("Unexpected role `{other}`: messages alternate between `user` and `assistant` (the system prompt goes in `system`)."),
            ))
        }
        None => {
            return Err(ApiError::invalid(
                format!("{at}.role"),
                "Each message needs a `role`: `user` or `assistant`.",
            ))
        }
    };
    let blocks = match turn.get("content") {
        Some(Value::String(text)) => return Ok(vec![json!({"role": role, "content": text})]),
        Some(Value::Array(blocks)) => blocks,
        _ => {
            return Err(ApiError::invalid(
                format!("{at}.content"),
                "`content` must be a string or a list of content blocks.",
            ))
        }
    };
    let mut out = Vec::new();
    let mut text = Vec::new();
    let mut reasoning = String::new();
    let mut tool_calls = Vec::new();
    for (j, block) in blocks.iter().enumerate() {
        let at = format!("{at}.content.{j}");
        match (role, block_type(block, &at)?) {
            (_, "text") => text.push(text_part(block, &at)?),
            (_, "image" | "document" | "search_result") => return Err(unsupported_media(&at)),
            ("user", "tool_result") => {
                // Text written before a tool result stays before it.
                if !text.is_empty() {
                    out.push(json!({"role": "user", "content": std::mem::take(&mut text)}));
                }
                out.push(tool_message(block, &at)?);
            }
            ("assistant", "thinking") => {
                reasoning.push_str(string_field(block, "thinking", &at)?);
            }
            // Anthropic's encrypted reasoning: there is no text to give back.
            ("assistant", "redacted_thinking") => {}
            ("assistant", "tool_use") => tool_calls.push(tool_call(block, &at)?),
            (_, other) => {
                return Err(ApiError::invalid(
                    format!("{at}.type"),
                    format!(
                        "Content blocks of type `{other}` are not accepted in a `{role}` message."
                    ),
                ))
            }
        }
    }
    if role == "user" {
        if !text.is_empty() || out.is_empty() {
            out.push(json!({"role": "user", "content": text}));
        }
        return Ok(out);
    }
    let mut message = json!({"role": "assistant", "content": text});
    if !reasoning.is_empty() {
        message["reasoning_content"] = json!(reasoning);
    }
    if !tool_calls.is_empty() {
        message["tool_calls"] = json!(tool_calls);
    }
    Ok(vec![message])
}

fn block_type<'a>(block: &'a Value, at: &str) -> Result<&'a str, ApiError> {
    block.get("type").and_then(Value::as_str).ok_or_else(|| {
        ApiError::invalid(
            format!("{at}.type"),
            "Each content block needs a string `type`.",
        )
    })
}

fn string_field<'a>(block: &'a Value, field: &str, at: &str) -> Result<&'a str, ApiError> {
    block.get(field).and_then(Value::as_str).ok_or_else(|| {
        ApiError::invalid(
            format!("{at}.{field}"),
            format!("This block needs a string `{field}`."),
        )
    })
}

fn text_part(block: &Value, at: &str) -> Result<Value, ApiError> {
    Ok(json!({"type": "text", "text": string_field(block, "text", at)?}))
}

fn unsupported_media(at: &str) -> ApiError {
    ApiError::unsupported(
        at,
        "This server was started without vision or document support: only text content blocks are accepted.",
    )
}

/// A `tool_use` block as a chat tool call (arguments as JSON text, as OpenAI clients send them).
fn tool_call(block: &Value, at: &str) -> Result<Value, ApiError> {
    let input = match block.get("input") {
        Some(input @ Value::Object(_)) => input.to_string(),
        _ => {
            return Err(ApiError::invalid(
                format!("{at}.input"),
                "A `tool_use` block needs an object `input`.",
            ))
        }
    };
    Ok(json!({
        "id": string_field(block, "id", at)?,
        "type": "function",
        "function": {"name": string_field(block, "name", at)?, "arguments": input},
    }))
}

/// A `tool_result` block as a `tool` message. The chat template has no place for `is_error`,
/// so a failed call's output is marked in its text: the model must not take it for a result.
fn tool_message(block: &Value, at: &str) -> Result<Value, ApiError> {
    let id = string_field(block, "tool_use_id", at)?;
    let mut text = match block.get("content") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(blocks)) => {
            let mut text = String::new();
            for (k, part) in blocks.iter().enumerate() {
                let at = format!("{at}.content.{k}");
                match block_type(part, &at)? {
                    "text" => text.push_str(string_field(part, "text", &at)?),
                    "image" | "document" | "search_result" => return Err(unsupported_media(&at)),
                    other => {
                        return Err(ApiError::invalid(
                            format!("{at}.type"),
                            format!("A tool result holds text blocks, not `{other}`."),
                        ))
                    }
                }
            }
            text
        }
        Some(_) => {
            return Err(ApiError::invalid(
                format!("{at}.content"),
                "A tool result's `content` must be a string or a list of text blocks.",
            ))
        }
    };
    if block.get("is_error") == Some(&Value::Bool(true)) {
        text = format!("Error: {text}");
    }
    Ok(json!({"role": "tool", "tool_call_id": id, "content": text}))
}

/// An Anthropic tool (`name`, `description`, `input_schema`) as a chat function tool. Server
/// tools (those with a `type` other than `custom`) run on Anthropic's side and are refused.
fn chat_tool(tool: &Value, i: usize) -> Result<Value, ApiError> {
    let at = format!("tools.{i}");
    let Some(fields) = tool.as_object() else {
        return Err(ApiError::invalid(at, "Each tool must be a JSON object."));
    };
    match fields.get("type").and_then(Value::as_str) {
        None | Some("custom") => {}
        Some(other) => {
            return Err(ApiError::unsupported(
                format!("{at}.type"),
                format!("Server tools such as `{other}` are not supported: only client tools (`name`, `description`, `input_schema`)."),
            ))
        }
    }
    let mut function = json!({"name": fields.get("name").cloned().unwrap_or(Value::Null)});
    if let Some(description) = fields.get("description").filter(|d| !d.is_null()) {
        function["description"] = description.clone();
    }
    match fields.get("input_schema") {
        Some(schema @ Value::Object(_)) => function["parameters"] = schema.clone(),
        _ => {
            return Err(ApiError::invalid(
                format!("{at}.input_schema"),
                "Each tool needs an `input_schema` (a JSON Schema object).",
            ))
        }
    }
    Ok(json!({"type": "function", "function": function}))
}

/// `tool_choice` as the chat `tool_choice` and `parallel_tool_calls`.
fn chat_tool_choice(choice: Option<&Value>) -> Result<(Option<Value>, Option<bool>), ApiError> {
    let Some(choice) = choice.filter(|c| !c.is_null()) else {
        return Ok((None, None));
    };
    let chat = match (
        choice.get("type").and_then(Value::as_str),
        choice.get("name").and_then(Value::as_str),
    ) {
        (Some("auto"), _) => json!("auto"),
        (Some("any"), _) => json!("required"),
        (Some("none"), _) => json!("none"),
        (Some("tool"), Some(name)) => json!({"type": "function", "function": {"name": name}}),
        _ => {
            return Err(ApiError::invalid(
                "tool_choice",
                "`tool_choice` must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"none\"} or {\"type\": \"tool\", \"name\": ...}.",
            ))
        }
    };
    let parallel = match choice.get("disable_parallel_tool_use") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(disable)) => Some(!disable),
        Some(_) => {
            return Err(ApiError::invalid(
                "tool_choice.disable_parallel_tool_use",
                "`disable_parallel_tool_use` must be a boolean.",
            ))
        }
    };
    Ok((Some(chat), parallel))
}

/// `thinking` as the template switch and the thinking budget. Left out, the template's default
/// applies (Qwen3.6 thinks), as on the other endpoints.
fn thinking(config: Option<&Value>) -> Result<(Option<bool>, Option<i64>), ApiError> {
    let Some(config) = config.filter(|c| !c.is_null()) else {
        return Ok((None, None));
    };
    match config.get("type").and_then(Value::as_str) {
        Some("enabled") => match config.get("budget_tokens") {
            Some(budget) if budget.as_i64().is_some_and(|b| b > 0) => {
                Ok((Some(true), budget.as_i64()))
            }
            _ => Err(ApiError::invalid(
                "thinking.budget_tokens",
                "`thinking.budget_tokens` must be a positive integer.",
            )),
        },
        Some("adaptive") => Ok((Some(true), None)),
        Some("disabled") => Ok((Some(false), None)),
        _ => Err(ApiError::invalid(
            "thinking",
            "`thinking` must be {\"type\": \"enabled\", \"budget_tokens\": N}, {\"type\": \"adaptive\"} or {\"type\": \"disabled\"}.",
        )),
    }
}

/// An error of the chat path, renamed to the Messages field it came from.
pub fn messages_param(error: ApiError) -> ApiError {
    let renames = [
        ("max_completion_tokens", "max_tokens"),
        ("thinking_token_budget", "thinking.budget_tokens"),
        ("stop", "stop_sequences"),
        ("parameters", "input_schema"),
    ];
    error.renamed_from_chat(&renames, "messages", |tool, rest| {
        format!(
            "tools.{tool}{}",
            rest.replace(".parameters", ".input_schema")
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: Value) -> Result<ChatCompletionRequest, ApiError> {
        let req: MessagesRequest = serde_json::from_value(body).expect("a request");
        to_chat_request(&req, true)
    }

    #[test]
    fn a_tool_loop_becomes_assistant_calls_and_tool_messages() {
        let chat = chat(json!({
            "max_tokens": 100,
            "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Look it up.", "signature": ""},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no such city", "is_error": true},
                    {"type": "text", "text": "Thanks."},
                ]},
            ],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
            "thinking": {"type": "enabled", "budget_tokens": 2048},
            "stop_sequences": ["END"],
        }))
        .expect("valid");
        let m = &chat.messages;
        assert_eq!(m.len(), 6, "{m:?}");
        assert_eq!(
            m[0],
            json!({"role": "system", "content": [{"type": "text", "text": "Be brief."}]})
        );
        assert_eq!(m[2]["reasoning_content"], "Look it up.");
        assert_eq!(
            m[2]["content"],
            json!([{"type": "text", "text": "Checking."}])
        );
        assert_eq!(m[2]["tool_calls"][0]["id"], "toolu_1");
        assert_eq!(
            m[2]["tool_calls"][0]["function"]["arguments"],
            "{\"city\":\"Paris\"}"
        );
        assert_eq!(
            m[3],
            json!({"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"})
        );
        assert_eq!(m[4]["content"], "Error: no such city");
        assert_eq!(m[5]["role"], "user");
        assert_eq!(chat.tool_choice, Some(json!("required")));
        assert_eq!(chat.parallel_tool_calls, Some(false));
        assert_eq!(
            (chat.enable_thinking, chat.thinking_token_budget),
            (Some(true), Some(2048))
        );
        assert_eq!(chat.max_completion_tokens, Some(100));
        assert_eq!(chat.stop.map(OneOrMany::into_vec), Some(vec!["END".into()]));
    }

    #[test]
    fn errors_name_the_messages_field() {
        let param = |body: Value| chat(body).err().and_then(|e| e.param);
        let user = json!([{"role": "user", "content": "hi"}]);
        assert_eq!(
            param(json!({"messages": user})).as_deref(),
            Some("max_tokens")
        );
        assert_eq!(
            param(json!({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}))
                .as_deref(),
            Some("messages.0.role")
        );
        let image = json!([{"role": "user", "content": [{"type": "image", "source": {}}]}]);
        assert_eq!(
            param(json!({"max_tokens": 5, "messages": image})).as_deref(),
            Some("messages.0.content.0")
        );
        assert_eq!(
            param(json!({"max_tokens": 5, "messages": user, "tools": [{"type": "web_search_20250305", "name": "w"}]})).as_deref(),
            Some("tools.0.type")
        );
        assert_eq!(
            param(json!({"max_tokens": 5, "messages": user, "thinking": {"type": "enabled"}}))
                .as_deref(),
            Some("thinking.budget_tokens")
        );
        let renamed = messages_param(ApiError::invalid(
            "tools[1].function.parameters",
            "`parameters` must be an object",
        ));
        assert_eq!(
            (renamed.param.as_deref(), renamed.message.as_str()),
            (
                Some("tools.1.input_schema"),
                "`input_schema` must be an object"
            )
        );
    }
}
