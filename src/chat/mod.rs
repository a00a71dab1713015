//! Chat: from OpenAI-style conversations to prompts (the template), and from generated text
//! back to reasoning, content and tool calls (the parsers).

pub mod reasoning;
pub mod template;
pub mod tools;
