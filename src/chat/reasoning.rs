//! Splitting generated text into reasoning and content, incrementally.
//!
//! Qwen3.5/3.6 templates end the generation prompt with `<think>\n` when thinking is on (the
//! default) and with `<think>\n\n</think>\n\n` when it is off, so the generated text looks like
//!
//! ```text
//! thinking on:   reasoning…\n</think>\n\nanswer…
//! thinking off:  answer…
//! ```
//!
//! Rules (one state machine over generated text only, never the prompt — spec/API.md rows 2 and 13):
//! * Thinking on: everything up to `</think>` is reasoning, everything after it is content.
//!   Without a `</think>` (output truncated) everything is reasoning.
//! * Thinking off: everything is content — unless the output *starts* with `<think>` (a model that
//!   opens the block itself, as older Qwen3 templates made it do), which then begins reasoning.
//!   With thinking on, a leading `<think>` is skipped likewise.
//! * Optionally (when the request has tools) `<tool_call>` followed by `<function=` ends the
//!   reasoning implicitly: Qwen3.5/3.6 often call tools from inside the thinking block without
//!   closing it, and routing the call into `reasoning` would lose it (vLLM's qwen3 parser does the
//!   same, with the same lookahead so that prose mentioning `<tool_call>` stays reasoning).
//! * Newlines the template puts around the tags are not part of either field: leading and trailing
//!   newlines of the reasoning and leading newlines of the content are dropped. (vLLM's qwen3
//!   parser leaves them in; clients then show a blank first line — see omlx#3667 — and the template
//!   trims them anyway when the turn is sent back in history.)
//!
//! Text is held back only while it could still be the start of a tag or a newline that may turn
//! out to precede one; [`ReasoningParser::finish`] releases it.

/// A piece of generated text, classified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    Reasoning(String),
    Content(String),
}

const THINK_START: &str = "<think>";
const THINK_END: &str = "</think>";
const TOOL_CALL_START: &str = "<tool_call>";
const FUNCTION_START: &str = "<function=";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing decided yet: the output may open with `<think>`.
    Start,
    /// Inside the reasoning; `at_start` until its first non-newline character.
    Reasoning { at_start: bool },
    /// Just after `</think>`: drop the newlines the template puts before the answer.
    AfterThink,
    /// Everything from here on is content.
    Content,
}

/// Incremental reasoning/content splitter; see the module documentation.
#[derive(Debug, Clone)]
pub struct ReasoningParser {
    thinking: bool,
    tool_calls_end_reasoning: bool,
    state: State,
    /// Text received but not yet classified.
    buf: String,
}

impl ReasoningParser {
    /// `thinking`: the prompt ends inside `<think>`. `tool_calls_end_reasoning`: treat
    /// `<tool_call><function=` as the end of the reasoning (set it when the request has tools).
    pub fn new(thinking: bool, tool_calls_end_reasoning: bool) -> Self {
        Self {
            thinking,
            tool_calls_end_reasoning,
            state: State::Start,
            buf: String::new(),
        }
    }

    /// Whether text arriving now would be reasoning.
    pub fn in_reasoning(&self) -> bool {
        match self.state {
            State::Start => self.thinking,
            State::Reasoning { .. } => true,
            State::AfterThink | State::Content => false,
        }
    }

    /// Feed a text delta; get back what can be classified so far.
    pub fn push(&mut self, text: &str) -> Vec<Segment> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        self.run(false, &mut out);
        out
    }

    /// End of generation: classify everything still held back.
    pub fn finish(&mut self) -> Vec<Segment> {
        let mut out = Vec::new();
        self.run(true, &mut out);
        out
    }

    /// Advance as far as the buffered text allows. With `eof`, nothing may be left undecided.
    fn run(&mut self, eof: bool, out: &mut Vec<Segment>) {
        loop {
            let progressed = match self.state {
                State::Start => self.step_start(eof),
                State::Reasoning { at_start } => self.step_reasoning(at_start, eof, out),
                State::AfterThink => self.step_after_think(),
                State::Content => {
                    push_segment(out, Segment::Content(std::mem::take(&mut self.buf)));
                    false
                }
            };
            if !progressed {
                return;
            }
        }
    }

    /// Decide whether the output opens with `<think>` (after optional whitespace).
    fn step_start(&mut self, eof: bool) -> bool {
        let rest = self.buf.trim_start();
        if rest.starts_with(THINK_START) {
            let skip = self.buf.len() - rest.len() + THINK_START.len();
            self.buf.replace_range(..skip, "");
            self.state = State::Reasoning { at_start: true };
            return true;
        }
        if THINK_START.starts_with(rest) && !eof {
            return false; // could still become `<think>`
        }
        self.state = if self.thinking {
            State::Reasoning { at_start: true }
        } else {
            State::Content
        };
        true
    }

    fn step_reasoning(&mut self, at_start: bool, eof: bool, out: &mut Vec<Segment>) -> bool {
        // Find the first tag (or possible start of one) that ends the reasoning.
        let mut search = 0;
        let found = loop {
            let Some(rel) = self.buf[search..].find('<') else {
                break None;
            };
            let at = search + rel;
            match self.classify_tag(&self.buf[at..], eof) {
                Tag::Literal => search = at + 1,
                decision => break Some((at, decision)),
            }
        };

        match found {
            Some((at, Tag::EndsReasoning { skip, next })) => {
                self.emit_reasoning(at_start, at, true, out);
                self.buf.replace_range(..skip, "");
                self.state = next;
                true
            }
            Some((at, _)) => {
                // A tag may be forming at `at`: release what comes before it, minus the newlines
                // that would be dropped if the tag completes.
                self.emit_reasoning(at_start, at, false, out);
                false
            }
            None => {
                let end = self.buf.len();
                self.emit_reasoning(at_start, end, eof, out);
                false
            }
        }
    }

    /// Emit `buf[..end]` as reasoning and remove it from `buf`. Leading newlines are dropped while
    /// the reasoning has not started; trailing newlines are dropped when `closing`, and otherwise
    /// kept in `buf` because a closing tag may follow them.
    fn emit_reasoning(
        &mut self,
        at_start: bool,
        end: usize,
        closing: bool,
        out: &mut Vec<Segment>,
    ) {
        let text = &self.buf[..end];
        let body_end = text.trim_end_matches('\n').len();
        let release = if closing { end } else { body_end };
        let mut piece = &self.buf[..body_end.min(release)];
        if at_start {
            piece = piece.trim_start_matches('\n');
        }
        let piece = piece.to_string();
        if !piece.is_empty() {
            self.state = State::Reasoning { at_start: false };
            push_segment(out, Segment::Reasoning(piece));
        }
        self.buf.replace_range(..release, "");
    }

    fn step_after_think(&mut self) -> bool {
        let rest = self.buf.trim_start_matches('\n');
        if rest.is_empty() {
            self.buf.clear();
            return false;
        }
        let skip = self.buf.len() - rest.len();
        self.buf.replace_range(..skip, "");
        self.state = State::Content;
        true
    }

    /// What a `<` at the start of `rest` means inside the reasoning.
    fn classify_tag(&self, rest: &str, eof: bool) -> Tag {
        if rest.starts_with(THINK_END) {
            return Tag::EndsReasoning {
                skip: THINK_END.len(),
                next: State::AfterThink,
            };
        }
        if self.tool_calls_end_reasoning && rest.starts_with(TOOL_CALL_START) {
            let after = rest[TOOL_CALL_START.len()..].trim_start();
            if after.starts_with(FUNCTION_START) {
                // The call itself (from `<tool_call>` on) is content for the tool parser.
                return Tag::EndsReasoning {
                    skip: 0,
                    next: State::Content,
                };
            }
            if FUNCTION_START.starts_with(after) && !eof {
                return Tag::Undecided;
            }
            return Tag::Literal;
        }
        let could_grow = THINK_END.starts_with(rest)
            || (self.tool_calls_end_reasoning && TOOL_CALL_START.starts_with(rest));
        if could_grow && !eof {
            Tag::Undecided
        } else {
            Tag::Literal
        }
    }
}

enum Tag {
    /// Plain text.
    Literal,
    /// Might become a tag once more text arrives.
    Undecided,
    /// The reasoning ends here: drop `skip` bytes and continue in `next`.
    EndsReasoning { skip: usize, next: State },
}

/// Append a segment, merging it with the previous one of the same kind; empty text is dropped.
fn push_segment(out: &mut Vec<Segment>, seg: Segment) {
    match (out.last_mut(), seg) {
        (_, Segment::Reasoning(s) | Segment::Content(s)) if s.is_empty() => {}
        (Some(Segment::Reasoning(prev)), Segment::Reasoning(s)) => prev.push_str(&s),
        (Some(Segment::Content(prev)), Segment::Content(s)) => prev.push_str(&s),
        (_, seg) => out.push(seg),
    }
}
