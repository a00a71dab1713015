//! The full output parser: reasoning, content and tool calls from generated text.

use super::events::push_event;
use super::{OutputEvent, ToolCallParser, ToolSchemas};
use crate::chat::reasoning::{ReasoningParser, Segment};

/// Reasoning, content and tool calls from generated text, fed delta by delta.
///
/// ```
/// use lily::chat::tools::{OutputParser, ParsedOutput, ToolSchemas};
/// let tools = ToolSchemas::from_openai_tools(&serde_json::json!([{"type": "function", "function": {
///     "name": "get_weather",
///     "parameters": {"type": "object", "properties": {"days": {"type": "integer"}}}}}]));
/// let mut parser = OutputParser::new(true, Some(tools));
/// let mut out = ParsedOutput::default();
/// for delta in ["Check.\n</think>\n\n<tool_call>\n<function=get_", "weather>\n<parameter=days>\n3\n",
///               "</parameter>\n</function>\n</tool_call>"] {
///     for event in parser.push(delta) { out.apply(&event); }
/// }
/// for event in parser.finish() { out.apply(&event); }
/// assert_eq!(out.reasoning, "Check.");
/// assert_eq!(out.tool_calls[0].arguments, r#"{"days": 3}"#);
/// ```
#[derive(Debug, Clone)]
pub struct OutputParser {
    reasoning: ReasoningParser,
    /// `None` when the request has no tools (or `tool_choice: "none"`): all content is text.
    tools: Option<ToolCallParser>,
}

impl OutputParser {
    /// `thinking`: the prompt ends inside `<think>`. `tools`: parse tool calls with these schemas.
    pub fn new(thinking: bool, tools: Option<ToolSchemas>) -> Self {
        Self {
            reasoning: ReasoningParser::new(thinking, tools.is_some()),
            tools: tools.map(ToolCallParser::new),
        }
    }

    pub fn push(&mut self, text: &str) -> Vec<OutputEvent> {
        let segments = self.reasoning.push(text);
        self.route(segments, false)
    }

    /// End of generation: flush everything held back and close an unfinished call.
    pub fn finish(&mut self) -> Vec<OutputEvent> {
        let segments = self.reasoning.finish();
        self.route(segments, true)
    }

    /// How many tool calls have started (the server reports `finish_reason: "tool_calls"` when
    /// this is non-zero, and can stop generating after the first when `parallel_tool_calls` is
    /// false).
    pub fn tool_calls_started(&self) -> usize {
        self.tools.as_ref().map_or(0, |t| t.calls_started)
    }

    fn route(&mut self, segments: Vec<Segment>, eof: bool) -> Vec<OutputEvent> {
        let mut out = Vec::new();
        for segment in segments {
            match (segment, &mut self.tools) {
                (Segment::Reasoning(s), _) => push_event(&mut out, OutputEvent::Reasoning(s)),
                (Segment::Content(s), Some(tools)) => tools.push_into(&s, &mut out),
                (Segment::Content(s), None) => push_event(&mut out, OutputEvent::Content(s)),
            }
        }
        if eof {
            if let Some(tools) = &mut self.tools {
                tools.finish_into(&mut out);
            }
        }
        out
    }
}
