//! From parser events to Messages content blocks: reasoning becomes `thinking` blocks, content
//! `text` blocks, each tool call a `tool_use` block whose `input` is the parsed arguments. One
//! builder serves whole and streamed responses; when streaming it also records the events that
//! announce the blocks (`content_block_start`, `content_block_delta`, `content_block_stop`).
//!
//! One block is open at a time: an event of another kind closes it.

use serde::Serialize;
use serde_json::{json, Value};

use crate::chat::tools::OutputEvent;
use crate::engine::generate::Counts;
use crate::server::routes::new_id;

#[derive(Debug, Clone, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentBlock {
    Thinking {
        thinking: String,
        /// Anthropic signs its reasoning so that it can check it when sent back; this server
        /// takes reasoning back as it is, so the signature is empty.
        signature: String,
    },
    Text {
        text: String,
    },
    ToolUse {
        id: String,
        name: String,
        /// The arguments, parsed when the call ends (`{}` until then).
        input: Value,
        /// The arguments as JSON text while they arrive.
        #[serde(skip)]
        arguments: String,
    },
}

impl ContentBlock {
    fn to_json(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }
}

/// `usage` of a message. `input_tokens` counts only the prompt tokens that were not read from
/// the prefix cache: Anthropic's total input is the sum of the three input counts.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct MessageUsage {
    pub input_tokens: usize,
    pub output_tokens: usize,
    pub cache_read_input_tokens: usize,
    /// Saving prompt states is not billed as a cache write: always 0.
    pub cache_creation_input_tokens: usize,
}

impl MessageUsage {
    pub fn new(counts: &Counts) -> MessageUsage {
        MessageUsage {
            input_tokens: counts.prompt_tokens.saturating_sub(counts.cached_tokens),
            output_tokens: counts.completion_tokens,
            cache_read_input_tokens: counts.cached_tokens,
            cache_creation_input_tokens: 0,
        }
    }
}

#[derive(Clone, Copy, PartialEq)]
enum TextKind {
    Thinking,
    Text,
}

/// Builds the content blocks from parser events; when streaming, also the events about them.
pub struct ContentBuilder {
    blocks: Vec<ContentBlock>,
    /// The last block is still receiving text.
    open: bool,
    streaming: bool,
    events: Vec<Value>,
}

impl ContentBuilder {
    pub fn new(streaming: bool) -> ContentBuilder {
        ContentBuilder {
            blocks: Vec::new(),
            open: false,
            streaming,
            events: Vec::new(),
        }
    }

    pub fn push(&mut self, event: &OutputEvent) {
        match event {
            OutputEvent::Reasoning(text) => self.text(TextKind::Thinking, text),
            OutputEvent::Content(text) => self.text(TextKind::Text, text),
            OutputEvent::ToolCallStart { name, .. } => {
                self.close();
                self.open(ContentBlock::ToolUse {
                    id: new_id("toolu_"),
                    name: name.clone(),
                    input: json!({}),
                    arguments: String::new(),
                });
            }
            OutputEvent::ToolCallArguments { delta, .. } => {
                if let (true, Some(ContentBlock::ToolUse { arguments, .. })) =
                    (self.open, self.blocks.last_mut())
                {
                    arguments.push_str(delta);
                    self.emit_delta(json!({"type": "input_json_delta", "partial_json": delta}));
                }
            }
            OutputEvent::ToolCallEnd { .. } => self.close(),
        }
    }

    /// Closes the open block and returns all blocks.
    pub fn finish(&mut self) -> &[ContentBlock] {
        self.close();
        &self.blocks
    }

    /// Stream events made since the last call.
    pub fn take_events(&mut self) -> Vec<Value> {
        std::mem::take(&mut self.events)
    }

    /// Empty text is not a block: a block opens with its first text.
    fn text(&mut self, kind: TextKind, text: &str) {
        if text.is_empty() {
            return;
        }
        let same = self.open
            && match self.blocks.last() {
                Some(ContentBlock::Thinking { .. }) => kind == TextKind::Thinking,
                Some(ContentBlock::Text { .. }) => kind == TextKind::Text,
                _ => false,
            };
        if !same {
            self.close();
            self.open(match kind {
                TextKind::Thinking => ContentBlock::Thinking {
                    thinking: String::new(),
                    signature: String::new(),
                },
                TextKind::Text => ContentBlock::Text {
                    text: String::new(),
                },
            });
        }
        match self.blocks.last_mut() {
            Some(ContentBlock::Thinking { thinking, .. }) => {
                thinking.push_str(text);
                self.emit_delta(json!({"type": "thinking_delta", "thinking": text}));
            }
            Some(ContentBlock::Text { text: all, .. }) => {
                all.push_str(text);
                self.emit_delta(json!({"type": "text_delta", "text": text}));
            }
            _ => {}
        }
    }

    fn open(&mut self, block: ContentBlock) {
        let snapshot = block.to_json();
        self.blocks.push(block);
        self.open = true;
        self.emit("content_block_start", json!({"content_block": snapshot}));
    }

    fn close(&mut self) {
        if !self.open {
            return;
        }
        self.open = false;
        // A call cut short by max_tokens has arguments that do not parse: its input stays `{}`.
        if let Some(ContentBlock::ToolUse {
            input, arguments, ..
        }) = self.blocks.last_mut()
        {
            if let Ok(parsed @ Value::Object(_)) = serde_json::from_str(arguments) {
                *input = parsed;
            }
        }
        self.emit("content_block_stop", json!({}));
    }

    fn emit_delta(&mut self, delta: Value) {
        self.emit("content_block_delta", json!({"delta": delta}));
    }

    /// Records a stream event about the last block: `type`, `index` (its position), `fields`.
    fn emit(&mut self, kind: &str, fields: Value) {
        if !self.streaming {
            return;
        }
        let mut event = json!({"type": kind, "index": self.blocks.len().saturating_sub(1)});
        if let (Some(event), Value::Object(fields)) = (event.as_object_mut(), fields) {
            event.extend(fields);
        }
        self.events.push(event);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasoning_text_and_calls_make_blocks_with_matching_events() {
        let mut builder = ContentBuilder::new(true);
        let events = [
            OutputEvent::Reasoning("Hm".into()),
            OutputEvent::Reasoning("m.".into()),
            OutputEvent::Content(String::new()),
            OutputEvent::Content("Let me see.".into()),
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
                delta: "[1]}".into(),
            },
            OutputEvent::ToolCallEnd { index: 0 },
        ];
        events.iter().for_each(|e| builder.push(e));
        let blocks: Vec<Value> = builder.finish().iter().map(ContentBlock::to_json).collect();
        assert_eq!(
            blocks,
            [
                json!({"type": "thinking", "thinking": "Hmm.", "signature": ""}),
                json!({"type": "text", "text": "Let me see."}),
                json!({"type": "tool_use", "id": blocks[2]["id"], "name": "f", "input": {"x": [1]}}),
            ]
        );
        assert!(blocks[2]["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("toolu_")));
        // Rebuilt from the events alone, the blocks are the same.
        let mut rebuilt: Vec<Value> = Vec::new();
        let mut json_text = String::new();
        for event in builder.take_events() {
            let index = event["index"].as_u64().expect("index") as usize;
            match event["type"].as_str().unwrap_or("") {
                "content_block_start" => {
                    assert_eq!(index, rebuilt.len());
                    rebuilt.push(event["content_block"].clone());
                }
                "content_block_delta" => {
                    let delta = &event["delta"];
                    let block = &mut rebuilt[index];
                    match delta["type"].as_str().unwrap_or("") {
                        "thinking_delta" => {
                            block["thinking"] = json!(format!(
                                "{}{}",
                                block["thinking"].as_str().unwrap_or(""),
                                delta["thinking"].as_str().unwrap_or("")
                            ))
                        }
                        "text_delta" => {
                            block["text"] = json!(format!(
                                "{}{}",
                                block["text"].as_str().unwrap_or(""),
                                delta["text"].as_str().unwrap_or("")
                            ))
                        }
                        "input_json_delta" => {
                            json_text.push_str(delta["partial_json"].as_str().unwrap_or(""))
                        }
                        other => panic!("unexpected delta {other}"),
                    }
                }
                "content_block_stop" => {
                    if rebuilt[index]["type"] == "tool_use" {
                        rebuilt[index]["input"] =
                            serde_json::from_str(&json_text).expect("JSON input");
                    }
                }
                other => panic!("unexpected event {other}"),
            }
        }
        assert_eq!(rebuilt, blocks);
    }

    #[test]
    fn a_cut_call_keeps_an_empty_input_and_usage_splits_the_cache() {
        let mut builder = ContentBuilder::new(false);
        builder.push(&OutputEvent::ToolCallStart {
            index: 0,
            id: "c".into(),
            name: "f".into(),
        });
        builder.push(&OutputEvent::ToolCallArguments {
            index: 0,
            delta: "{\"x\": ".into(),
        });
        assert_eq!(builder.finish()[0].to_json()["input"], json!({}));
        assert!(builder.take_events().is_empty(), "not streaming");
        let usage = MessageUsage::new(&Counts {
            prompt_tokens: 10,
            completion_tokens: 4,
            cached_tokens: 6,
            reasoning_tokens: 1,
        });
        assert_eq!((usage.input_tokens, usage.cache_read_input_tokens), (4, 6));
    }
}
