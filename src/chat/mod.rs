//! Chat: from OpenAI-style conversations to prompts (and, later, from generated text back to
//! reasoning, content and tool calls).

pub mod template;
