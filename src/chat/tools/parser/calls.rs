//! The tool-call parser's ordinary content, the opening and closing of calls, and the text between
//! parameters.

use rand::distr::Alphanumeric;
use rand::RngExt;

use super::{
    read_name_tag, Call, Phase, Read, ToolCallParser, FUNCTION_END, FUNCTION_START,
    PARAMETER_START, TOOL_CALL_END, TOOL_CALL_START,
};
use crate::chat::tools::events::push_event;
use crate::chat::tools::OutputEvent;

impl ToolCallParser {
    // ----- content -----

    pub(super) fn step_text(&mut self, eof: bool, out: &mut Vec<OutputEvent>) -> bool {
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

    pub(super) fn close_call(&mut self, out: &mut Vec<OutputEvent>) {
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

    pub(super) fn step_body(&mut self, eof: bool, out: &mut Vec<OutputEvent>) -> bool {
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

    pub(super) fn step_after_function(&mut self, eof: bool) -> bool {
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
