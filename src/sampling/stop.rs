//! When generation ends: stop tokens, `max_tokens`, and stop strings matched on decoded text.

use rustc_hash::FxHashSet;

use super::SamplingParams;

/// Why a choice ended, as OpenAI spells it. The sampler side only produces `Stop` and `Length`;
/// `ToolCalls` is the server's call once the output parser has seen a tool call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
    ToolCalls,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCalls => "tool_calls",
        }
    }
}

/// What to do with a token just generated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenVerdict {
    /// Detokenize it and go on.
    Continue,
    /// A stop token (EOS, `<|im_end|>`, a request `stop_token_ids` entry): finish with `stop` and do
    /// not show its text.
    Stop,
    /// The `max_tokens`-th token: show its text, then finish with `length`.
    Length,
}

/// Text released by [`StopChecker::push_text`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopText {
    /// Safe to pass on: contains no part of a stop string.
    pub text: String,
    /// A stop string matched: `text` ends just before it; finish with `stop`.
    pub stopped: bool,
}

/// Per-request stop logic. Per step the engine calls [`check_token`](Self::check_token) with the
/// new token, then (unless it said `Stop`) [`push_text`](Self::push_text) with the detokenizer's
/// delta, and on `Length` (or any other end) [`flush`](Self::flush) for the held-back tail.
///
/// Which text to feed `push_text` is the caller's choice: the raw decoded text (vLLM's behaviour),
/// or only the content after the reasoning / tool-call parser (spec/API.md row 13 recommends this
/// so that a stop string cannot cut a tool call or leak `</think>`).
#[derive(Debug, Clone)]
pub struct StopChecker {
    stop_token_ids: FxHashSet<u32>,
    max_tokens: Option<usize>,
    /// Stop strings count only once this many tokens are out (`min_tokens`).
    min_tokens: usize,
    /// The matched stop string stays in the text (`include_stop_str_in_output`).
    keep_stop: bool,
    generated: usize,
    stop_strings: Vec<String>,
    /// The longest tail of the text seen so far that could still grow into a stop string.
    held: String,
    stopped: bool,
    /// The stop string that ended the text (Anthropic's `stop_sequence` reports it).
    matched: Option<String>,
}

impl StopChecker {
    pub fn new(params: &SamplingParams) -> Self {
        Self {
            stop_token_ids: params.stop_token_ids.iter().copied().collect(),
            max_tokens: params.max_tokens,
            min_tokens: params.min_tokens,
            keep_stop: params.include_stop_str,
            generated: 0,
            stop_strings: params.stop.clone(),
            held: String::new(),
            stopped: false,
            matched: None,
        }
    }

    /// The stop string that matched, once one has.
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    /// Tokens generated so far (every token passed to `check_token`).
    pub fn generated(&self) -> usize {
        self.generated
    }

    pub fn check_token(&mut self, token: u32) -> TokenVerdict {
        self.generated += 1;
        if self.stop_token_ids.contains(&token) {
            TokenVerdict::Stop
        } else if self.max_tokens.is_some_and(|m| self.generated >= m) {
            TokenVerdict::Length
        } else {
            TokenVerdict::Continue
        }
    }

    /// Feed decoded text; get back what may be shown. Once a stop string matched, everything
    /// after it is discarded and further calls return nothing.
    pub fn push_text(&mut self, text: &str) -> StopText {
        if self.stopped {
            return StopText {
                text: String::new(),
                stopped: true,
            };
        }
        // Before `min_tokens` no stop string counts, as in vLLM (whose check starts there too).
        if self.stop_strings.is_empty() || self.generated < self.min_tokens {
            return StopText {
                text: text.to_string(),
                stopped: false,
            };
        }
        self.held.push_str(text);

        // The held part contained no complete stop string, so any match ends in the new text;
        // searching the whole (short) held buffer is simplest and finds the earliest one.
        let earliest = self
            .stop_strings
            .iter()
            .filter_map(|s| Some((self.held.find(s.as_str())?, s)))
            .min_by_key(|&(start, _)| start);
        if let Some((start, stop)) = earliest {
            self.matched = Some(stop.clone());
            let end = if self.keep_stop {
                start + stop.len()
            } else {
                start
            };
            self.held.truncate(end);
            self.stopped = true;
            return StopText {
                text: std::mem::take(&mut self.held),
                stopped: true,
            };
        }

        let keep = longest_suffix_prefix(&self.held, &self.stop_strings);
        let release = self.held.len() - keep;
        let text = self.held[..release].to_string();
        self.held.replace_range(..release, "");
        StopText {
            text,
            stopped: false,
        }
    }

    /// Release the held-back tail at the end of generation (it turned out not to be a stop string).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// Length in bytes of the longest suffix of `text` that is a proper prefix of some stop string,
/// i.e. how much text must be held back because the next token might complete a stop string.
fn longest_suffix_prefix(text: &str, stops: &[String]) -> usize {
    let bytes = text.as_bytes();
    let longest_stop = stops.iter().map(|s| s.len()).max().unwrap_or(0);
    let max_len = bytes.len().min(longest_stop.saturating_sub(1));
    (1..=max_len)
        .rev()
        .find(|&len| {
            let start = bytes.len() - len;
            // Comparing bytes is safe: a UTF-8 prefix can only equal a suffix that starts on a
            // character boundary, so the held-back part is always whole characters.
            text.is_char_boundary(start)
                && stops
                    .iter()
                    .any(|s| s.as_bytes().starts_with(&bytes[start..]))
        })
        .unwrap_or(0)
}
