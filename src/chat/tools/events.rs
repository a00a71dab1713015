//! What the output parser reports, and the whole response assembled from it.

use super::{OutputParser, ToolSchemas};

/// What the output parser reports, in order. Adjacent text of the same kind is merged and empty
/// text is never reported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputEvent {
    Reasoning(String),
    Content(String),
    /// A call begins; `index` counts calls from 0 within the response.
    ToolCallStart {
        index: usize,
        id: String,
        name: String,
    },
    /// More of the call's arguments JSON text.
    ToolCallArguments {
        index: usize,
        delta: String,
    },
    ToolCallEnd {
        index: usize,
    },
}

/// A complete tool call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as a JSON object text (OpenAI's `function.arguments`).
    pub arguments: String,
}

/// The whole response, assembled from events (for non-streaming responses, and for tests).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParsedOutput {
    pub reasoning: String,
    pub content: String,
    pub tool_calls: Vec<ParsedToolCall>,
}

impl ParsedOutput {
    pub fn apply(&mut self, event: &OutputEvent) {
        match event {
            OutputEvent::Reasoning(s) => self.reasoning.push_str(s),
            OutputEvent::Content(s) => self.content.push_str(s),
            OutputEvent::ToolCallStart { id, name, .. } => self.tool_calls.push(ParsedToolCall {
                id: id.clone(),
                name: name.clone(),
                arguments: String::new(),
            }),
            OutputEvent::ToolCallArguments { index, delta } => {
                if let Some(call) = self.tool_calls.get_mut(*index) {
                    call.arguments.push_str(delta);
                }
            }
            OutputEvent::ToolCallEnd { .. } => {}
        }
    }

    /// Parse a complete generation in one go.
    pub fn parse(text: &str, thinking: bool, tools: Option<ToolSchemas>) -> Self {
        let mut parser = OutputParser::new(thinking, tools);
        let mut parsed = Self::default();
        for event in parser.push(text).iter().chain(&parser.finish()) {
            parsed.apply(event);
        }
        parsed
    }
}

/// Append an event, merging it into the previous one where both are text of the same kind.
pub(super) fn push_event(out: &mut Vec<OutputEvent>, event: OutputEvent) {
    use OutputEvent::*;
    match (out.last_mut(), event) {
        (_, Reasoning(s) | Content(s) | ToolCallArguments { delta: s, .. }) if s.is_empty() => {}
        (Some(Reasoning(prev)), Reasoning(s)) | (Some(Content(prev)), Content(s)) => {
            prev.push_str(&s)
        }
        (
            Some(ToolCallArguments {
                index: i,
                delta: prev,
            }),
            ToolCallArguments { index, delta },
        ) if *i == index => prev.push_str(&delta),
        (_, event) => out.push(event),
    }
}
