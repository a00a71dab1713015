//! From the parser's output events to Responses output items, and the stream events that build
//! them (openai-python's `types/responses/`). One [`OutputBuilder`] serves both a whole and a
//! streamed response, so the two cannot disagree.
//!
//! Items, in the order the model writes them: `reasoning` (its text as one `reasoning_text`
//! part), `message` (one `output_text` part), `function_call` (one per call). Each item's events:
//! `response.output_item.added`; for text items `response.content_part.added`, the `.delta`s,
//! the `.done` with the whole text and `response.content_part.done`; for calls the
//! `response.function_call_arguments.delta`s and `.done`; then `response.output_item.done`.
//! One item is open at a time: an event of another kind closes it.

use serde::Serialize;
use serde_json::{json, Value};

use crate::chat::tools::OutputEvent;
use crate::engine::generate::Counts;
use crate::server::routes::new_id;

#[derive(Debug, Clone, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputItem {
    Reasoning {
        id: String,
        /// Reasoning summaries are an OpenAI model feature; the full text is in `content`.
        summary: Vec<Value>,
        content: Vec<Part>,
        status: &'static str,
    },
    Message {
        id: String,
        role: &'static str,
        status: &'static str,
        content: Vec<Part>,
    },
    FunctionCall {
        id: String,
        call_id: String,
        name: String,
        /// The arguments as JSON text.
        arguments: String,
        status: &'static str,
    },
}

#[derive(Debug, Clone, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Part {
    OutputText {
        text: String,
        annotations: Vec<Value>,
        logprobs: Vec<Value>,
    },
    ReasoningText {
        text: String,
    },
}

impl Part {
    fn text_mut(&mut self) -> &mut String {
        match self {
            Part::OutputText { text, .. } | Part::ReasoningText { text } => text,
        }
    }
}

impl OutputItem {
    fn id(&self) -> &str {
        match self {
            OutputItem::Reasoning { id, .. }
            | OutputItem::Message { id, .. }
            | OutputItem::FunctionCall { id, .. } => id,
        }
    }

    fn set_status(&mut self, to: &'static str) {
        match self {
            OutputItem::Reasoning { status, .. }
            | OutputItem::Message { status, .. }
            | OutputItem::FunctionCall { status, .. } => *status = to,
        }
    }

    /// The text that deltas extend: the one part's text, or a call's arguments.
    fn text_mut(&mut self) -> Option<&mut String> {
        match self {
            OutputItem::Reasoning { content, .. } | OutputItem::Message { content, .. } => {
                content.first_mut().map(Part::text_mut)
            }
            OutputItem::FunctionCall { arguments, .. } => Some(arguments),
        }
    }

    fn to_json(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }
}

/// `usage` of a response.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ResponseUsage {
    pub input_tokens: usize,
    pub input_tokens_details: Value,
    pub output_tokens: usize,
    pub output_tokens_details: Value,
    pub total_tokens: usize,
}

impl ResponseUsage {
    pub fn new(counts: &Counts) -> ResponseUsage {
        ResponseUsage {
            input_tokens: counts.prompt_tokens,
            // Prompt states the engine saves are not counted as "cache writes": always 0.
            input_tokens_details: json!({"cached_tokens": counts.cached_tokens, "cache_write_tokens": 0}),
            output_tokens: counts.completion_tokens,
            output_tokens_details: json!({"reasoning_tokens": counts.reasoning_tokens}),
            total_tokens: counts.prompt_tokens + counts.completion_tokens,
        }
    }
}

/// Builds the output items from parser events; when streaming, also the events that announce
/// them (without `sequence_number`, which the writer adds).
pub struct OutputBuilder {
    items: Vec<OutputItem>,
    /// The last item is still receiving text.
    open: bool,
    streaming: bool,
    events: Vec<Value>,
}

#[derive(PartialEq)]
enum TextKind {
    Reasoning,
    Message,
}

impl OutputBuilder {
    pub fn new(streaming: bool) -> OutputBuilder {
        OutputBuilder {
            items: Vec::new(),
            open: false,
            streaming,
            events: Vec::new(),
        }
    }

    pub fn push(&mut self, event: &OutputEvent) {
        match event {
            OutputEvent::Reasoning(text) => self.text(TextKind::Reasoning, text),
            OutputEvent::Content(text) => self.text(TextKind::Message, text),
            OutputEvent::ToolCallStart { id, name, .. } => {
                self.close("completed");
                self.open(OutputItem::FunctionCall {
                    id: new_id("fc_"),
                    call_id: id.clone(),
                    name: name.clone(),
                    arguments: String::new(),
                    status: "in_progress",
                });
            }
            OutputEvent::ToolCallArguments { delta, .. } => {
                if self.open_is(|item| matches!(item, OutputItem::FunctionCall { .. })) {
                    self.extend(delta, "response.function_call_arguments.delta");
                }
            }
            OutputEvent::ToolCallEnd { .. } => self.close("completed"),
        }
    }

    /// Closes the open item (`incomplete` when the output was cut short) and returns all items.
    /// A finished response without a message or a call gets an empty message, so that there is
    /// one answer to read.
    pub fn finish(&mut self, complete: bool) -> &[OutputItem] {
        let status = if complete { "completed" } else { "incomplete" };
        let answered = self
            .items
            .iter()
            .any(|i| !matches!(i, OutputItem::Reasoning { .. }));
        if complete && !answered {
            self.text(TextKind::Message, "");
        }
        self.close(status);
        &self.items
    }

    /// The items so far (the last one possibly still open).
    pub fn items(&self) -> &[OutputItem] {
        &self.items
    }

    /// Stream events made since the last call.
    pub fn take_events(&mut self) -> Vec<Value> {
        std::mem::take(&mut self.events)
    }

    /// Records a stream event about the last item: `type`, `output_index`, `item_id` (unless
    /// the event carries the item itself) and `fields`.
    fn emit(&mut self, kind: &str, fields: Value) {
        if !self.streaming {
            return;
        }
        let output_index = self.items.len().saturating_sub(1);
        let mut event = json!({"type": kind, "output_index": output_index});
        if let Value::Object(fields) = fields {
            if !fields.contains_key("item") {
                let id = self.items.last().map(OutputItem::id).unwrap_or_default();
                event["item_id"] = json!(id);
            }
            if let Some(event) = event.as_object_mut() {
                event.extend(fields);
            }
        }
        self.events.push(event);
    }

    fn open_is(&self, kind: impl Fn(&OutputItem) -> bool) -> bool {
        self.open && self.items.last().is_some_and(kind)
    }

    fn text(&mut self, kind: TextKind, text: &str) {
        let same = self.open_is(|item| match item {
            OutputItem::Reasoning { .. } => kind == TextKind::Reasoning,
            OutputItem::Message { .. } => kind == TextKind::Message,
            OutputItem::FunctionCall { .. } => false,
        });
        if !same {
            self.close("completed");
            let (item, part) = match kind {
                TextKind::Reasoning => (
                    OutputItem::Reasoning {
                        id: new_id("rs_"),
                        summary: Vec::new(),
                        content: Vec::new(),
                        status: "in_progress",
                    },
                    Part::ReasoningText {
                        text: String::new(),
                    },
                ),
                TextKind::Message => (
                    OutputItem::Message {
                        id: new_id("msg_"),
                        role: "assistant",
                        status: "in_progress",
                        content: Vec::new(),
                    },
                    Part::OutputText {
                        text: String::new(),
                        annotations: Vec::new(),
                        logprobs: Vec::new(),
                    },
                ),
            };
            self.open(item);
            self.emit(
                "response.content_part.added",
                json!({"content_index": 0, "part": part}),
            );
            if let Some(
                OutputItem::Reasoning { content, .. } | OutputItem::Message { content, .. },
            ) = self.items.last_mut()
            {
                content.push(part);
            }
        }
        if !text.is_empty() {
            match kind {
                TextKind::Reasoning => self.extend(text, "response.reasoning_text.delta"),
                TextKind::Message => self.extend(text, "response.output_text.delta"),
            }
        }
    }

    fn open(&mut self, item: OutputItem) {
        let snapshot = item.to_json();
        self.items.push(item);
        self.open = true;
        self.emit("response.output_item.added", json!({"item": snapshot}));
    }

    fn extend(&mut self, delta: &str, kind: &'static str) {
        if let Some(text) = self.items.last_mut().and_then(OutputItem::text_mut) {
            text.push_str(delta);
        }
        let fields = match kind {
            "response.output_text.delta" => {
                json!({"content_index": 0, "delta": delta, "logprobs": []})
            }
            "response.reasoning_text.delta" => json!({"content_index": 0, "delta": delta}),
            _ => json!({"delta": delta}),
        };
        self.emit(kind, fields);
    }

    fn close(&mut self, status: &'static str) {
        if !self.open {
            return;
        }
        self.open = false;
        let Some(item) = self.items.last_mut() else {
            return;
        };
        item.set_status(status);
        let item = item.clone();
        match &item {
            OutputItem::Reasoning { content, .. } | OutputItem::Message { content, .. } => {
                if let Some(part) = content.first() {
                    match part {
                        Part::ReasoningText { text } => self.emit(
                            "response.reasoning_text.done",
                            json!({"content_index": 0, "text": text}),
                        ),
                        Part::OutputText { text, .. } => self.emit(
                            "response.output_text.done",
                            json!({"content_index": 0, "text": text, "logprobs": []}),
                        ),
                    }
                    self.emit(
                        "response.content_part.done",
                        json!({"content_index": 0, "part": part}),
                    );
                }
            }
            OutputItem::FunctionCall { arguments, .. } => self.emit(
                "response.function_call_arguments.done",
                json!({"arguments": arguments}),
            ),
        }
        self.emit("response.output_item.done", json!({"item": item.to_json()}));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn build(events: &[OutputEvent], complete: bool) -> (Vec<Value>, Vec<Value>) {
        let mut builder = OutputBuilder::new(true);
        for event in events {
            builder.push(event);
        }
        let items = builder
            .finish(complete)
            .iter()
            .map(OutputItem::to_json)
            .collect();
        (items, builder.take_events())
    }

    #[test]
    fn reasoning_then_calls_make_three_items_with_matching_events() {
        let (items, events) = build(
            &[
                OutputEvent::Reasoning("Hm".into()),
                OutputEvent::Reasoning("m.".into()),
                OutputEvent::ToolCallStart {
                    index: 0,
                    id: "call_a".into(),
                    name: "f".into(),
                },
                OutputEvent::ToolCallArguments {
                    index: 0,
                    delta: "{\"x\":".into(),
                },
                OutputEvent::ToolCallArguments {
                    index: 0,
                    delta: "1}".into(),
                },
                OutputEvent::ToolCallEnd { index: 0 },
                OutputEvent::ToolCallStart {
                    index: 1,
                    id: "call_b".into(),
                    name: "g".into(),
                },
                OutputEvent::ToolCallEnd { index: 1 },
            ],
            true,
        );
        let kinds: Vec<&str> = items.iter().filter_map(|i| i["type"].as_str()).collect();
        assert_eq!(kinds, ["reasoning", "function_call", "function_call"]);
        assert_eq!(
            items[0]["content"],
            json!([{"type": "reasoning_text", "text": "Hmm."}])
        );
        assert_eq!(items[1]["arguments"], "{\"x\":1}");
        assert_eq!(items[1]["call_id"], "call_a");
        assert!(items.iter().all(|i| i["status"] == "completed"));
        let types: Vec<&str> = events.iter().filter_map(|e| e["type"].as_str()).collect();
        assert_eq!(
            types,
            [
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.done",
                "response.output_item.done",
            ]
        );
        // Every event of an item names it by the id and index of its final form.
        for event in &events {
            let index = event["output_index"].as_u64().expect("output_index") as usize;
            let id = event.get("item_id").unwrap_or(&event["item"]["id"]);
            assert_eq!(id, &items[index]["id"], "{event}");
        }
    }

    #[test]
    fn a_cut_answer_is_incomplete_and_an_empty_one_still_has_a_message() {
        let (items, _) = build(&[OutputEvent::Content("Hel".into())], false);
        assert_eq!(items[0]["status"], "incomplete");
        assert_eq!(items[0]["content"][0]["text"], "Hel");
        let (items, _) = build(&[OutputEvent::Reasoning("Hm".into())], false);
        assert_eq!(items.len(), 1, "cut short while reasoning: no answer");
        assert_eq!(items[0]["status"], "incomplete");
        let (items, events) = build(&[OutputEvent::Reasoning("r".into())], true);
        assert_eq!(items.len(), 2);
        assert_eq!(items[1]["type"], "message");
        assert_eq!(
            items[1]["content"][0],
            json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        );
        assert_eq!(
            events.last().map(|e| e["type"].clone()),
            Some(json!("response.output_item.done"))
        );
    }
}
