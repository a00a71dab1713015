//! Bringing OpenAI-style messages into the shape chat templates expect.
//!
//! Clients send what the OpenAI API allows; the Qwen template was written for what transformers
//! passes it. The differences, each of which would otherwise be an error or a wrong prompt:
//! * keys whose value is `null` are dropped, as transformers does (`content: null` next to
//!   `tool_calls`, `reasoning_content: null`...), so templates see them as undefined;
//! * the `developer` role, which the official template rejects ("Unexpected message role."),
//!   becomes `system`: OpenAI clients such as Codex send it where older clients send `system`;
//! * all system messages are merged, in order and separated by a blank line, into one leading
//!   system message: the template rejects a system message anywhere but first, yet clients send
//!   several (OpenCode) or add one later in the conversation (plugins);
//! * `reasoning` (vLLM's newer name) fills `reasoning_content` when that is absent;
//! * tool-call `arguments`, a JSON *string* in the OpenAI API, are parsed into an object because
//!   the template iterates them as a mapping (vLLM does the same); absent or empty arguments
//!   become `{}`, and an empty `tool_calls` list is dropped.
//!
//! `tools/make_template_fixtures.py` repeats these steps in Python for the reference renderings;
//! the two must change together.

use serde_json::{Map, Value};

use super::TemplateError;

pub(super) fn normalize_messages(messages: &[Value]) -> Result<Vec<Value>, TemplateError> {
    let mut out = Vec::with_capacity(messages.len());
    for (i, message) in messages.iter().enumerate() {
        let Value::Object(fields) = message else {
            return Err(invalid(format!("messages[{i}] must be a JSON object")));
        };
        let mut message: Map<String, Value> = fields
            .iter()
            .filter(|(_, v)| !v.is_null())
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        if role(&message) == Some("developer") {
            message.insert("role".into(), "system".into());
        }
        if !message.contains_key("reasoning_content") {
            if let Some(reasoning) = message.get("reasoning").cloned() {
                message.insert("reasoning_content".into(), reasoning);
            }
        }
        if role(&message) == Some("assistant") {
            parse_tool_call_arguments(&mut message, i)?;
        }
        out.push(message);
    }
    merge_system_messages(out)
}

fn role(message: &Map<String, Value>) -> Option<&str> {
    message.get("role").and_then(Value::as_str)
}

fn invalid(message: String) -> TemplateError {
    TemplateError::InvalidInput(message)
}

fn parse_tool_call_arguments(
    message: &mut Map<String, Value>,
    i: usize,
) -> Result<(), TemplateError> {
    let Some(Value::Array(calls)) = message.get_mut("tool_calls") else {
        return Ok(());
    };
    if calls.is_empty() {
        // An empty list would still send the template down its tool-call path.
        message.remove("tool_calls");
        return Ok(());
    }
    for (j, call) in calls.iter_mut().enumerate() {
        // Calls without the OpenAI `function` wrapper are left for the template to read as they are.
        let Some(Value::Object(function)) = call.get_mut("function") else {
            continue;
        };
        let at = format!("messages[{i}].tool_calls[{j}].function.arguments");
        let arguments = match function.get("arguments") {
            None | Some(Value::Null) => Value::Object(Map::new()),
            Some(Value::String(s)) if s.is_empty() => Value::Object(Map::new()),
            Some(Value::String(s)) => serde_json::from_str(s)
                .map_err(|e| invalid(format!("{at} is not valid JSON: {e}")))?,
            Some(other) => other.clone(),
        };
        if !arguments.is_object() {
            return Err(invalid(format!("{at} must be a JSON object")));
        }
        function.insert("arguments".into(), arguments);
    }
    Ok(())
}

fn merge_system_messages(messages: Vec<Map<String, Value>>) -> Result<Vec<Value>, TemplateError> {
    let system_at: Vec<usize> = messages
        .iter()
        .enumerate()
        .filter(|(_, m)| role(m) == Some("system"))
        .map(|(i, _)| i)
        .collect();
    if system_at.is_empty() || system_at == [0] {
        // Nothing to merge: the conversation reaches the template exactly as sent.
        return Ok(messages.into_iter().map(Value::Object).collect());
    }
    let mut contents = Vec::new();
    for &i in &system_at {
        match messages[i].get("content") {
            None => {}
            Some(content @ (Value::String(_) | Value::Array(_))) => contents.push(content.clone()),
            Some(_) => {
                return Err(invalid(format!(
                    "messages[{i}].content must be a string or a list of content parts"
                )))
            }
        }
    }
    let merged = if contents.iter().all(Value::is_string) {
        let texts: Vec<&str> = contents.iter().filter_map(Value::as_str).collect();
        Value::String(texts.join("\n\n"))
    } else {
        // Some content is a list of parts (maybe images, which the template must still see and
        // reject in a system message), so the merge is a list of parts too.
        let mut parts = Vec::new();
        for (n, content) in contents.into_iter().enumerate() {
            if n > 0 {
                parts.push(text_part("\n\n".into()));
            }
            match content {
                Value::Array(items) => parts.extend(items),
                text => parts.push(text_part(text)),
            }
        }
        Value::Array(parts)
    };
    let mut system = Map::new();
    system.insert("role".into(), "system".into());
    system.insert("content".into(), merged);
    let rest = messages
        .into_iter()
        .filter(|m| role(m) != Some("system"))
        .map(Value::Object);
    Ok(std::iter::once(Value::Object(system)).chain(rest).collect())
}

fn text_part(text: Value) -> Value {
    serde_json::json!({"type": "text", "text": text})
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn normalize(messages: Value) -> Result<Value, TemplateError> {
        let list = messages.as_array().cloned().unwrap_or_default();
        normalize_messages(&list).map(Value::Array)
    }

    #[test]
    fn single_leading_system_is_untouched() {
        let messages = json!([{"role": "system", "content": "s", "name": "x"}, {"role": "user", "content": "u"}]);
        assert_eq!(normalize(messages.clone()).ok(), Some(messages));
    }

    #[test]
    fn system_and_developer_messages_merge_in_order() {
        let merged = normalize(json!([
            {"role": "user", "content": "u"},
            {"role": "developer", "content": "d"},
            {"role": "system", "content": "s"},
        ]));
        assert_eq!(
            merged.ok(),
            Some(
                json!([{"role": "system", "content": "d\n\ns"}, {"role": "user", "content": "u"}])
            )
        );
    }

    #[test]
    fn merge_keeps_content_parts() {
        let merged = normalize(json!([
            {"role": "system", "content": "a"},
            {"role": "system", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
            {"role": "user", "content": "u"},
        ]));
        let expected = json!([{"role": "system", "content": [
            {"type": "text", "text": "a"},
            {"type": "text", "text": "\n\n"},
            {"type": "image_url", "image_url": {"url": "x"}},
        ]}, {"role": "user", "content": "u"}]);
        assert_eq!(merged.ok(), Some(expected));
    }

    #[test]
    fn arguments_are_parsed_in_key_order() {
        let out = normalize(
            json!([{"role": "assistant", "content": null, "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": "{\"z\": 1, \"a\": [true]}"}}
            ]}]),
        );
        let Ok(out) = out else {
            panic!("normalisation failed")
        };
        let arguments = &out[0]["tool_calls"][0]["function"]["arguments"];
        let keys: Vec<&String> = arguments
            .as_object()
            .map(|m| m.keys().collect())
            .unwrap_or_default();
        assert_eq!(keys, ["z", "a"]);
        assert!(out[0].get("content").is_none(), "null content is dropped");
    }

    #[test]
    fn bad_arguments_name_the_field() {
        let err = normalize(
            json!([{"role": "user", "content": "u"}, {"role": "assistant", "tool_calls": [
                {"function": {"name": "f", "arguments": "{oops"}}
            ]}]),
        );
        match err {
            Err(TemplateError::InvalidInput(message)) => {
                assert!(message
                    .starts_with("messages[1].tool_calls[0].function.arguments is not valid JSON"))
            }
            other => panic!("expected InvalidInput, got {other:?}"),
        }
    }
}
