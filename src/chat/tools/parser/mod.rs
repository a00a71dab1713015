//! The tool-call parser (content side): its state, the tags it looks for, and the driving loop.
//! The steps of each phase live in `calls.rs` (content, call boundaries, between parameters) and
//! `values.rs` (parameter values).

mod calls;
mod values;

use super::{OutputEvent, ParamType, ToolSchemas};

const TOOL_CALL_START: &str = "<tool_call>";
const TOOL_CALL_END: &str = "</tool_call>";
const FUNCTION_START: &str = "<function=";
const FUNCTION_END: &str = "</function>";
const PARAMETER_START: &str = "<parameter=";
const PARAMETER_END: &str = "</parameter>";

/// Longest function or parameter name accepted inside a tag; longer means "not a tag", which also
/// bounds how much text is held back waiting for a `>`.
const MAX_NAME_LEN: usize = 256;

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
    pub(super) calls_started: usize,
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
