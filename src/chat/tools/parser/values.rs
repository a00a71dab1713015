//! The tool-call parser inside a parameter value: streaming or collecting it, and deciding where
//! it ends.

use serde_json::Value;

use super::{
    read_name_tag, ParamValue, Phase, Read, ToolCallParser, FUNCTION_END, PARAMETER_END,
    PARAMETER_START, TOOL_CALL_END, TOOL_CALL_START,
};
use crate::chat::tools::events::push_event;
use crate::chat::tools::{convert_value, OutputEvent, ValueKind};

impl ToolCallParser {
    pub(super) fn open_value(&mut self, name: String, out: &mut Vec<OutputEvent>) {
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

    pub(super) fn finish_value(&mut self, out: &mut Vec<OutputEvent>) {
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

    pub(super) fn step_value(&mut self, eof: bool, out: &mut Vec<OutputEvent>) -> bool {
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

fn json_string(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// JSON-escape `s` without the surrounding quotes (a piece of a streamed string value).
fn json_string_body(s: &str) -> String {
    let quoted = json_string(s);
    quoted[1..quoted.len() - 1].to_string()
}
