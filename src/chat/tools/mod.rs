//! Qwen XML tool calls, parsed incrementally, and the full output parser (reasoning + content +
//! tool calls) the server drives with detokenizer deltas.
//!
//! The format (Qwen3-Coder / Qwen3.5 / Qwen3.6 templates; vLLM's `qwen3_coder` parser):
//!
//! ```text
//! <tool_call>
//! <function=get_weather>
//! <parameter=city>
//! Paris
//! </parameter>
//! <parameter=days>
//! 3
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! Each call becomes `ToolCallStart` (index, `call_…` id, name), `ToolCallArguments` deltas whose
//! concatenation is the final JSON object text (`{"city": "Paris", "days": 3}`), and
//! `ToolCallEnd`. Arguments stream as they are generated: a string-typed parameter streams
//! character by character; other values are emitted once complete, because their JSON form
//! depends on the whole value.
//!
//! Parameter values are converted by the tool's JSON schema ([`ToolSchemas`]): strings raw (minus
//! the newline the template puts on each side), integers / numbers / booleans / null parsed,
//! objects and arrays as JSON; a value that does not fit its type, a parameter outside the schema,
//! or a function without a schema falls back to "JSON if it parses, else the raw string".
//!
//! Robustness choices (spec/API.md §1 rows 1–2, 12–13: lost tool calls are the worst failure):
//! * Decisions depend only on the text, never on how it was split into deltas: text that might be
//!   the start of a tag is held back until it is decided. Tests feed every split point.
//! * Several calls in one delta, several calls per turn, and `<function=…>` blocks without the
//!   `<tool_call>` wrapper (seen in practice, mlx-lm accepts them) are all calls.
//! * A `<tool_call>` not followed by a well-formed `<function=NAME>` is content, never dropped.
//! * Once `<function=NAME>` is seen the call has been announced to the client; if the text ends
//!   early (e.g. `max_tokens`), the call is closed with the parameters seen so far.
//! * A missing `</parameter>` ends at the next `<parameter=` of another parameter in the schema
//!   (not yet given) or at `</function>`; a missing `</function>` at `</tool_call>`.
//! * A `</parameter>` counts only when followed by `<parameter=`, `</function>`, `</tool_call>` or
//!   the end, and literal `<parameter=…>` / `</parameter>` pairs inside a value (code that writes
//!   this very format) are balanced, so such values survive intact.
//! * Function names the request did not declare are still returned as calls (vLLM does the same):
//!   the agent can answer "unknown tool" and the model can recover, whereas text would be lost.
//!   Names that cannot be function names (empty, spaces, quotes, `<>{}`) are not tags at all.
//! * Stray text between parameters is passed on as content, not dropped.
//! * Whitespace around calls (the template's `\n\n` before the first call, `\n` between calls) is
//!   dropped; other text before and after calls is content.

mod events;
mod output;
mod parser;
mod schema;

pub use events::{OutputEvent, ParsedOutput, ParsedToolCall};
pub use output::OutputParser;
pub use parser::ToolCallParser;
pub use schema::{convert_value, ParamType, ToolSchemas, ValueKind};
