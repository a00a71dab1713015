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

use std::collections::HashMap;

use rand::distr::Alphanumeric;
use rand::RngExt;
use serde_json::Value;

use super::reasoning::{ReasoningParser, Segment};

const TOOL_CALL_START: &str = "<tool_call>";
const TOOL_CALL_END: &str = "</tool_call>";
const FUNCTION_START: &str = "<function=";
const FUNCTION_END: &str = "</function>";
const PARAMETER_START: &str = "<parameter=";
const PARAMETER_END: &str = "</parameter>";

/// Longest function or parameter name accepted inside a tag; longer means "not a tag", which also
/// bounds how much text is held back waiting for a `>`.
const MAX_NAME_LEN: usize = 256;

// ---------------------------------------------------------------------------------------------
// Events and their accumulation
// ---------------------------------------------------------------------------------------------

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
fn push_event(out: &mut Vec<OutputEvent>, event: OutputEvent) {
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

// ---------------------------------------------------------------------------------------------
// The full output parser
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// Tool schemas and value conversion
// ---------------------------------------------------------------------------------------------

/// The JSON type a parameter's schema declares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueKind {
    String,
    Integer,
    Number,
    Boolean,
    Null,
    Object,
    Array,
    /// No schema, several types, or one we do not know: JSON if it parses, else the raw string.
    Unknown,
}

/// A parameter's declared type; `nullable` when the schema also admits null.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamType {
    pub kind: ValueKind,
    pub nullable: bool,
}

impl ParamType {
    pub const UNKNOWN: ParamType = ParamType {
        kind: ValueKind::Unknown,
        nullable: false,
    };

    /// Read the type out of a JSON-schema fragment: `type` (a name or a list of names), else
    /// `anyOf` / `oneOf`, else hints (`enum` of strings, `properties`, `items`).
    pub fn from_schema(schema: &Value) -> Self {
        let mut kinds = Vec::new();
        let mut nullable = false;
        collect_kinds(schema, &mut kinds, &mut nullable);
        let mut distinct: Vec<ValueKind> = Vec::new();
        for kind in kinds {
            if !distinct.contains(&kind) {
                distinct.push(kind);
            }
        }
        let kind = match distinct.as_slice() {
            [] if nullable => ValueKind::Null,
            [one] => *one,
            _ => ValueKind::Unknown,
        };
        ParamType { kind, nullable }
    }
}

fn collect_kinds(schema: &Value, kinds: &mut Vec<ValueKind>, nullable: &mut bool) {
    let mut add = |name: &str| match kind_from_name(name) {
        Some(ValueKind::Null) => *nullable = true,
        Some(kind) => kinds.push(kind),
        None => kinds.push(ValueKind::Unknown),
    };
    match schema.get("type") {
        Some(Value::String(name)) => return add(name),
        Some(Value::Array(names)) => {
            names.iter().filter_map(Value::as_str).for_each(add);
            return;
        }
        _ => {}
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(Value::Array(options)) = schema.get(key) {
            for option in options {
                collect_kinds(option, kinds, nullable);
            }
            return;
        }
    }
    if let Some(Value::Array(values)) = schema.get("enum") {
        if values.iter().all(Value::is_string) {
            kinds.push(ValueKind::String);
        }
    } else if schema.get("properties").is_some() {
        kinds.push(ValueKind::Object);
    } else if schema.get("items").is_some() {
        kinds.push(ValueKind::Array);
    }
}

/// JSON-schema type names, plus the loose spellings tool authors use (vLLM accepts the same).
fn kind_from_name(name: &str) -> Option<ValueKind> {
    let name = name.trim().to_ascii_lowercase();
    let kind = match name.as_str() {
        "string" | "str" | "text" | "varchar" | "char" | "enum" => ValueKind::String,
        "boolean" | "bool" | "binary" => ValueKind::Boolean,
        "null" | "none" => ValueKind::Null,
        "object" | "dict" | "map" => ValueKind::Object,
        "array" | "arr" | "list" | "tuple" => ValueKind::Array,
        n if ["int", "uint", "long", "short", "unsigned"]
            .iter()
            .any(|p| n.starts_with(p)) =>
        {
            ValueKind::Integer
        }
        n if n.starts_with("num") || n.starts_with("float") || n.starts_with("double") => {
            ValueKind::Number
        }
        _ => return None,
    };
    Some(kind)
}

/// Parameter types of the request's tools, by function name.
#[derive(Debug, Clone, Default)]
pub struct ToolSchemas {
    functions: HashMap<String, HashMap<String, ParamType>>,
}

impl ToolSchemas {
    /// From the request's `tools` array (`[{"type": "function", "function": {"name", "parameters"}}]`).
    /// Entries that do not have that shape are skipped: validating `tools` is the server's job,
    /// this only needs the types.
    pub fn from_openai_tools(tools: &Value) -> Self {
        let mut functions = HashMap::new();
        for tool in tools.as_array().into_iter().flatten() {
            let Some(function) = tool.get("function") else {
                continue;
            };
            let Some(name) = function.get("name").and_then(Value::as_str) else {
                continue;
            };
            let params = function
                .get("parameters")
                .and_then(|p| p.get("properties"))
                .and_then(Value::as_object)
                .map(|props| {
                    props
                        .iter()
                        .map(|(k, v)| (k.clone(), ParamType::from_schema(v)))
                        .collect()
                })
                .unwrap_or_default();
            functions.insert(name.to_string(), params);
        }
        Self { functions }
    }

    /// The declared type of `function`'s `param`; [`ParamType::UNKNOWN`] if undeclared.
    pub fn param_type(&self, function: &str, param: &str) -> ParamType {
        self.functions
            .get(function)
            .and_then(|p| p.get(param))
            .copied()
            .unwrap_or(ParamType::UNKNOWN)
    }

    /// Whether `param` is declared for `function`.
    fn declares(&self, function: &str, param: &str) -> bool {
        self.functions
            .get(function)
            .is_some_and(|p| p.contains_key(param))
    }
}

/// Turn a parameter's raw text (template newlines already stripped) into its JSON value.
pub fn convert_value(raw: &str, ty: ParamType) -> Value {
    let trimmed = raw.trim();
    // Python's `None` too: Qwen3.5-era templates render null arguments with `| string`.
    let is_null = trimmed == "null" || trimmed == "None";
    if is_null && (ty.nullable || ty.kind == ValueKind::Null) {
        return Value::Null;
    }
    let typed = match ty.kind {
        ValueKind::String => return Value::String(raw.to_string()),
        ValueKind::Integer => trimmed
            .parse::<i64>()
            .map(Value::from)
            .or_else(|_| trimmed.parse::<u64>().map(Value::from))
            .ok(),
        ValueKind::Number => parse_number(trimmed),
        ValueKind::Boolean => match trimmed.to_ascii_lowercase().as_str() {
            "true" => Some(Value::Bool(true)),
            "false" => Some(Value::Bool(false)),
            _ => None,
        },
        ValueKind::Null | ValueKind::Object | ValueKind::Array | ValueKind::Unknown => None,
    };
    // Whatever did not fit its declared type: JSON if it parses, else the text itself.
    typed.unwrap_or_else(|| {
        serde_json::from_str(trimmed).unwrap_or_else(|_| Value::String(raw.to_string()))
    })
}

fn parse_number(text: &str) -> Option<Value> {
    if let Ok(i) = text.parse::<i64>() {
        return Some(Value::from(i));
    }
    // Rust's float syntax also takes `1.`, `.5` and `1e3`; infinities and NaN are not JSON.
    let f = text.parse::<f64>().ok().filter(|f| f.is_finite())?;
    serde_json::Number::from_f64(f).map(Value::Number)
}

/// `call_` + 24 random alphanumerics, the shape OpenAI and vLLM use.
fn new_call_id() -> String {
    let suffix: String = rand::rng()
        .sample_iter(Alphanumeric)
        .take(24)
        .map(char::from)
        .collect();
    format!("call_{suffix}")
}

fn json_string(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// JSON-escape `s` without the surrounding quotes (a piece of a streamed string value).
fn json_string_body(s: &str) -> String {
    let quoted = json_string(s);
    quoted[1..quoted.len() - 1].to_string()
}

// ---------------------------------------------------------------------------------------------
// The tool-call parser (content side)
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Ordinary content, watching for a call to open.
    Text,
    /// Inside `<function=…>`, between parameters.
    Body,
    /// Inside a parameter value.
    Value,
    /// After `</function>`: an optional `</tool_call>` follows.
    AfterFunction,
}

/// The call being parsed.
#[derive(Debug, Clone)]
struct Call {
    index: usize,
    name: String,
    /// Parameters already written into the arguments JSON (also: "is a comma needed").
    written: Vec<String>,
}

/// The parameter value being parsed.
#[derive(Debug, Clone)]
struct ParamValue {
    name: String,
    ty: ParamType,
    /// String values stream; others are collected in `raw` and written when complete.
    streaming: bool,
    raw: String,
    /// Nothing of the value consumed yet: the template's leading newline may still come.
    at_start: bool,
    /// The value just began or the last consumed character was a newline: a `<parameter=` here
    /// is at the start of a line, which is what makes it structural.
    line_start: bool,
    /// Literal `<parameter=…>` tags opened inside the value and not yet closed.
    depth: usize,
}

/// Incremental parser for the tool-call part of the content; see the module documentation.
#[derive(Debug, Clone)]
pub struct ToolCallParser {
    schemas: ToolSchemas,
    phase: Phase,
    /// Text received but not yet consumed.
    buf: String,
    call: Option<Call>,
    value: Option<ParamValue>,
    calls_started: usize,
    /// Inside a function, the last thing consumed was stray text (not a tag): whitespace that
    /// follows it belongs to the text if more text follows.
    in_stray: bool,
    /// Text just after a call: its leading whitespace is the template's separator.
    after_call: bool,
    /// The last content character consumed was a newline (or nothing was consumed yet): a bare
    /// `<function=` only counts as a call at the start of a line.
    line_start: bool,
}

/// Why a `<` at the front of some text does not start the tag being looked for.
enum Read {
    /// It is ordinary text.
    Text,
    /// Cannot tell yet; wait for more text.
    Wait,
}

impl ToolCallParser {
    pub fn new(schemas: ToolSchemas) -> Self {
        Self {
            schemas,
            phase: Phase::Text,
            buf: String::new(),
            call: None,
            value: None,
            calls_started: 0,
            in_stray: false,
            after_call: false,
            line_start: true,
        }
    }

    /// Feed content text; events are appended to `out`.
    pub fn push_into(&mut self, text: &str, out: &mut Vec<OutputEvent>) {
        self.buf.push_str(text);
        self.run(false, out);
    }

    /// End of content: release held-back text and close an unfinished call.
    pub fn finish_into(&mut self, out: &mut Vec<OutputEvent>) {
        self.run(true, out);
        // At the end every phase consumes its text, except a value's final newline (dropped).
        self.buf.clear();
        if self.value.is_some() {
            self.finish_value(out);
        }
        if self.call.is_some() {
            self.close_call(out);
        }
        self.phase = Phase::Text;
    }

    fn run(&mut self, eof: bool, out: &mut Vec<OutputEvent>) {
        loop {
            let progressed = match self.phase {
                Phase::Text => self.step_text(eof, out),
                Phase::Body => self.step_body(eof, out),
                Phase::Value => self.step_value(eof, out),
                Phase::AfterFunction => self.step_after_function(eof),
            };
            if !progressed {
                return;
            }
        }
    }

    // ----- content -----

    fn step_text(&mut self, eof: bool, out: &mut Vec<OutputEvent>) -> bool {
        if self.after_call {
            let rest = self.buf.trim_start();
            if rest.is_empty() {
                self.buf.clear();
                return false;
            }
            let skip = self.buf.len() - rest.len();
            self.buf.replace_range(..skip, "");
            self.after_call = false;
        }

        let mut search = 0;
        while let Some(rel) = self.buf[search..].find('<') {
            let at = search + rel;
            let line_start = if at == 0 {
                self.line_start
            } else {
                self.buf.as_bytes()[at - 1] == b'\n'
            };
            match self.read_call_open(&self.buf[at..], line_start, eof) {
                Ok((name, header_len)) => {
                    // Whitespace between the text and the call is the template's, not content.
                    let text_end = self.buf[..at].trim_end().len();
                    self.emit_content(text_end, out);
                    self.buf.replace_range(..at - text_end + header_len, "");
                    self.open_call(name, out);
                    return true;
                }
                Err(Read::Wait) => {
                    // Hold the possible tag and the whitespace before it (dropped if it is a call).
                    let text_end = self.buf[..at].trim_end().len();
                    self.emit_content(text_end, out);
                    return false;
                }
                Err(Read::Text) => search = at + 1,
            }
        }
        let end = if eof {
            self.buf.len()
        } else {
            self.buf.trim_end().len()
        };
        self.emit_content(end, out);
        false
    }

    /// Emit `buf[..end]` as content and consume it.
    fn emit_content(&mut self, end: usize, out: &mut Vec<OutputEvent>) {
        if end == 0 {
            return;
        }
        self.line_start = self.buf[..end].ends_with('\n');
        push_event(out, OutputEvent::Content(self.buf[..end].to_string()));
        self.buf.replace_range(..end, "");
    }

    /// Does a call open at the front of `rest`? `Ok((name, header length))` for
    /// `<tool_call>\n<function=NAME>` or — at the start of a line, and followed by a parameter or
    /// `</function>` — a bare `<function=NAME>`.
    fn read_call_open(
        &self,
        rest: &str,
        line_start: bool,
        eof: bool,
    ) -> Result<(String, usize), Read> {
        if let Some(after) = rest.strip_prefix(TOOL_CALL_START) {
            let body = after.trim_start();
            let ws = after.len() - body.len();
            let (name, len) = read_name_tag(body, FUNCTION_START, eof)?;
            return Ok((name, TOOL_CALL_START.len() + ws + len));
        }
        if line_start && rest.starts_with(FUNCTION_START) {
            let (name, len) = read_name_tag(rest, FUNCTION_START, eof)?;
            // A bare function tag is only a call if the body really starts.
            let body = rest[len..].trim_start();
            if body.starts_with(PARAMETER_START) || body.starts_with(FUNCTION_END) {
                return Ok((name, len));
            }
            let could_grow = PARAMETER_START.starts_with(body) || FUNCTION_END.starts_with(body);
            return Err(if could_grow && !eof {
                Read::Wait
            } else {
                Read::Text
            });
        }
        let could_grow =
            TOOL_CALL_START.starts_with(rest) || (line_start && FUNCTION_START.starts_with(rest));
        Err(if could_grow && !eof {
            Read::Wait
        } else {
            Read::Text
        })
    }

    fn open_call(&mut self, name: String, out: &mut Vec<OutputEvent>) {
        let index = self.calls_started;
        self.calls_started += 1;
        push_event(
            out,
            OutputEvent::ToolCallStart {
                index,
                id: new_call_id(),
                name: name.clone(),
            },
        );
        self.call = Some(Call {
            index,
            name,
            written: Vec::new(),
        });
        self.in_stray = false;
        self.phase = Phase::Body;
    }

    fn close_call(&mut self, out: &mut Vec<OutputEvent>) {
        let Some(call) = self.call.take() else { return };
        let tail = if call.written.is_empty() { "{}" } else { "}" };
        push_event(
            out,
            OutputEvent::ToolCallArguments {
                index: call.index,
                delta: tail.to_string(),
            },
        );
        push_event(out, OutputEvent::ToolCallEnd { index: call.index });
    }

    // ----- between parameters -----

    fn step_body(&mut self, eof: bool, out: &mut Vec<OutputEvent>) -> bool {
        let rest = self.buf.trim_start();
        if rest.is_empty() {
            return false; // whitespace between tags is layout, not content
        }
        let ws = self.buf.len() - rest.len();
        if rest.starts_with(PARAMETER_START) {
            match read_name_tag(rest, PARAMETER_START, eof) {
                Ok((name, len)) => {
                    self.buf.replace_range(..ws + len, "");
                    self.in_stray = false;
                    self.open_value(name, out);
                    return true;
                }
                Err(Read::Wait) => return false,
                Err(Read::Text) => {}
            }
        } else if rest.starts_with(FUNCTION_END) {
            self.buf.replace_range(..ws + FUNCTION_END.len(), "");
            self.close_call(out);
            self.phase = Phase::AfterFunction;
            return true;
        } else if rest.starts_with(TOOL_CALL_END) {
            // `</function>` missing: the call ends with its wrapper.
            self.buf.replace_range(..ws + TOOL_CALL_END.len(), "");
            self.close_call(out);
            self.end_of_call_text();
            return true;
        } else if !eof
            && [PARAMETER_START, FUNCTION_END, TOOL_CALL_END]
                .iter()
                .any(|t| t.starts_with(rest))
        {
            return false;
        }

        // Stray text inside the function: pass it on rather than lose it. It runs to the next
        // `<`; whitespace at its edges is layout (trailing whitespace is held back until we know
        // whether more stray text follows it).
        let first = rest.chars().next().map_or(0, char::len_utf8);
        let run_end = ws + rest[first..].find('<').map_or(rest.len(), |i| i + first);
        let end = self.buf[..run_end].trim_end().len();
        let start = if self.in_stray { 0 } else { ws };
        push_event(out, OutputEvent::Content(self.buf[start..end].to_string()));
        self.buf.replace_range(..end, "");
        self.in_stray = true;
        true
    }

    fn step_after_function(&mut self, eof: bool) -> bool {
        let rest = self.buf.trim_start();
        if rest.starts_with(TOOL_CALL_END) {
            let skip = self.buf.len() - rest.len() + TOOL_CALL_END.len();
            self.buf.replace_range(..skip, "");
        } else if TOOL_CALL_END.starts_with(rest) && !eof {
            return false;
        }
        // Whatever else follows is content (leading whitespace dropped by `after_call`).
        self.end_of_call_text();
        true
    }

    fn end_of_call_text(&mut self) {
        self.phase = Phase::Text;
        self.after_call = true;
        self.line_start = true;
    }

    // ----- parameter values -----

    fn open_value(&mut self, name: String, out: &mut Vec<OutputEvent>) {
        let Some(call) = &self.call else { return };
        let ty = self.schemas.param_type(&call.name, &name);
        let streaming = ty.kind == ValueKind::String && !ty.nullable;
        if streaming {
            let prefix = self.key_prefix(&name);
            push_event(
                out,
                OutputEvent::ToolCallArguments {
                    index: call.index,
                    delta: format!("{prefix}\""),
                },
            );
        }
        self.value = Some(ParamValue {
            name,
            ty,
            streaming,
            raw: String::new(),
            at_start: true,
            line_start: true,
            depth: 0,
        });
        self.phase = Phase::Value;
    }

    /// `{"name": ` for the first parameter, `, "name": ` after that (Python json.dumps spacing,
    /// as vLLM produces).
    fn key_prefix(&self, name: &str) -> String {
        let first = self.call.as_ref().is_none_or(|c| c.written.is_empty());
        format!("{}{}: ", if first { "{" } else { ", " }, json_string(name))
    }

    /// Add value text: streamed out at once for strings, collected otherwise.
    fn append_value(&mut self, end: usize, out: &mut Vec<OutputEvent>) {
        let (Some(value), Some(call)) = (&mut self.value, &self.call) else {
            return;
        };
        if end == 0 {
            return;
        }
        let text = &self.buf[..end];
        if value.streaming {
            push_event(
                out,
                OutputEvent::ToolCallArguments {
                    index: call.index,
                    delta: json_string_body(text),
                },
            );
        } else {
            value.raw.push_str(text);
        }
        value.at_start = false;
        value.line_start = text.ends_with('\n');
    }

    fn finish_value(&mut self, out: &mut Vec<OutputEvent>) {
        let Some(value) = self.value.take() else {
            return;
        };
        let delta = if value.streaming {
            "\"".to_string()
        } else {
            let json = convert_value(&value.raw, value.ty).to_string();
            format!("{}{json}", self.key_prefix(&value.name))
        };
        if let Some(call) = &mut self.call {
            push_event(
                out,
                OutputEvent::ToolCallArguments {
                    index: call.index,
                    delta,
                },
            );
            call.written.push(value.name);
        }
        self.phase = Phase::Body;
    }

    fn step_value(&mut self, eof: bool, out: &mut Vec<OutputEvent>) -> bool {
        let Some(value) = &self.value else {
            self.phase = Phase::Body;
            return true;
        };
        if value.at_start {
            // The template writes a newline after `<parameter=NAME>`; it is not part of the value.
            match self.buf.as_bytes().first() {
                None => return false,
                Some(b'\n') => {
                    self.buf.remove(0);
                    if let Some(v) = &mut self.value {
                        v.at_start = false; // still at the start of a line
                    }
                    return true;
                }
                Some(_) => {}
            }
        }

        let Some(at) = self.buf.find('<') else {
            // No tag in sight. Hold back a final newline: it is the template's if `</parameter>`
            // follows (and at the end of a truncated value it is dropped likewise).
            let end = self.buf.len() - usize::from(self.buf.ends_with('\n'));
            self.append_value(end, out);
            self.buf.replace_range(..end, "");
            return false;
        };

        let newline_before = if at == 0 {
            value.line_start
        } else {
            self.buf.as_bytes()[at - 1] == b'\n'
        };
        // Value text ends before the template's newline in front of a closing tag.
        let value_end = if at > 0 && newline_before { at - 1 } else { at };
        match self.read_value_tag(at, newline_before, eof) {
            ValueTag::Text { len, depth_change } => {
                self.append_value(at + len, out);
                self.buf.replace_range(..at + len, "");
                if let Some(v) = &mut self.value {
                    v.depth = v.depth.saturating_add_signed(depth_change);
                }
                true
            }
            ValueTag::Wait => {
                self.append_value(value_end, out);
                self.buf.replace_range(..value_end, "");
                false
            }
            ValueTag::End {
                len,
                closes_function,
            } => {
                self.append_value(value_end, out);
                self.buf.replace_range(..at + len, "");
                self.finish_value(out);
                if closes_function {
                    self.close_call(out);
                    self.phase = Phase::AfterFunction;
                }
                true
            }
        }
    }

    /// What the `<` at `buf[at]` means inside the current value.
    fn read_value_tag(&self, at: usize, newline_before: bool, eof: bool) -> ValueTag {
        let rest = &self.buf[at..];
        let (Some(value), Some(call)) = (&self.value, &self.call) else {
            return ValueTag::Text {
                len: 1,
                depth_change: 0,
            };
        };

        if let Some(after) = rest.strip_prefix(PARAMETER_END) {
            if value.depth > 0 {
                return ValueTag::Text {
                    len: PARAMETER_END.len(),
                    depth_change: -1,
                };
            }
            // Only a close followed by more structure (or the end) is real.
            let after = after.trim_start();
            let follows = [PARAMETER_START, FUNCTION_END, TOOL_CALL_END];
            if follows.iter().any(|t| after.starts_with(t)) || (after.is_empty() && eof) {
                return ValueTag::End {
                    len: PARAMETER_END.len(),
                    closes_function: false,
                };
            }
            if !eof && follows.iter().any(|t| t.starts_with(after)) {
                return ValueTag::Wait;
            }
            return ValueTag::Text {
                len: PARAMETER_END.len(),
                depth_change: 0,
            };
        }

        if newline_before && rest.starts_with(PARAMETER_START) {
            return match read_name_tag(rest, PARAMETER_START, eof) {
                Err(Read::Wait) => ValueTag::Wait,
                Err(Read::Text) => ValueTag::Text {
                    len: PARAMETER_START.len(),
                    depth_change: 0,
                },
                Ok((name, len)) => {
                    let missing_close = value.depth == 0
                        && name != value.name
                        && self.schemas.declares(&call.name, &name)
                        && !call.written.contains(&name);
                    if missing_close {
                        // `</parameter>` was left out: the next declared parameter starts here.
                        ValueTag::End {
                            len: 0,
                            closes_function: false,
                        }
                    } else {
                        ValueTag::Text {
                            len,
                            depth_change: 1,
                        }
                    }
                }
            };
        }

        // `</parameter>` left out: the value ends at `</function>` or `</tool_call>` — but only where
        // the call really ends, so that a value quoting those tags is not cut short.
        if value.depth == 0 && rest.starts_with(FUNCTION_END) {
            let after = rest[FUNCTION_END.len()..].trim_start();
            let verdict = match after.strip_prefix(TOOL_CALL_END) {
                Some(after_wrapper) => call_ends_here(after_wrapper, eof),
                None if after.is_empty() => eof.then_some(true),
                None if TOOL_CALL_END.starts_with(after) && !eof => None,
                None => Some(false),
            };
            return match verdict {
                Some(true) => ValueTag::End {
                    len: FUNCTION_END.len(),
                    closes_function: true,
                },
                Some(false) => ValueTag::Text {
                    len: FUNCTION_END.len(),
                    depth_change: 0,
                },
                None => ValueTag::Wait,
            };
        }
        if value.depth == 0 && rest.starts_with(TOOL_CALL_END) {
            return match call_ends_here(&rest[TOOL_CALL_END.len()..], eof) {
                // Leave `</tool_call>` for the after-function phase to consume.
                Some(true) => ValueTag::End {
                    len: 0,
                    closes_function: true,
                },
                Some(false) => ValueTag::Text {
                    len: TOOL_CALL_END.len(),
                    depth_change: 0,
                },
                None => ValueTag::Wait,
            };
        }

        let could_grow = PARAMETER_END.starts_with(rest)
            || FUNCTION_END.starts_with(rest)
            || TOOL_CALL_END.starts_with(rest)
            || (newline_before && PARAMETER_START.starts_with(rest));
        if could_grow && !eof {
            ValueTag::Wait
        } else {
            ValueTag::Text {
                len: 1,
                depth_change: 0,
            }
        }
    }
}

enum ValueTag {
    /// Value text through `len` bytes from the `<`; adjusts the literal-tag depth.
    Text {
        len: usize,
        depth_change: isize,
    },
    Wait,
    /// The value ends at the `<` (minus the newline before it); `len` bytes of tag are consumed.
    End {
        len: usize,
        closes_function: bool,
    },
}

/// After a closing `</tool_call>`: does the turn's tool-call section really end here, i.e. is it
/// followed (after whitespace) by the end of the text or another `<tool_call>`? `None`: undecided.
fn call_ends_here(after: &str, eof: bool) -> Option<bool> {
    let after = after.trim_start();
    if after.starts_with(TOOL_CALL_START) {
        Some(true)
    } else if after.is_empty() {
        eof.then_some(true)
    } else if TOOL_CALL_START.starts_with(after) && !eof {
        None
    } else {
        Some(false)
    }
}

/// Read `PREFIX NAME >` at the front of `rest` (e.g. `<function=get_weather>`).
/// `Ok((name, length through '>'))`; `Wait` while the name may still be completed;
/// `Text` if this cannot be such a tag.
fn read_name_tag(rest: &str, prefix: &str, eof: bool) -> Result<(String, usize), Read> {
    let Some(after) = rest.strip_prefix(prefix) else {
        let could_grow = prefix.starts_with(rest);
        return Err(if could_grow && !eof {
            Read::Wait
        } else {
            Read::Text
        });
    };
    let close = after.find('>');
    let name = close.map_or(after, |i| &after[..i]);
    let valid_so_far = name.len() <= MAX_NAME_LEN
        && !name
            .chars()
            .any(|c| c.is_whitespace() || "<>{}\"'".contains(c));
    match close {
        Some(_) if valid_so_far && !name.is_empty() => {
            Ok((name.to_string(), prefix.len() + name.len() + 1))
        }
        None if valid_so_far && !eof => Err(Read::Wait),
        _ => Err(Read::Text),
    }
}
