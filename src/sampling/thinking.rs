//! The thinking budget: when the engine must force `</think>` instead of sampling.

/// Token ids that delimit thinking and tool calls, looked up in the tokenizer by the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThinkTokens {
    pub think_start: u32,
    pub think_end: u32,
    pub tool_call_start: u32,
    pub tool_call_end: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ThinkState {
    /// Nothing generated yet: the first token may still open `<think>` itself.
    Start,
    Reasoning,
    /// Inside `<tool_call>` … `</tool_call>` emitted while thinking: never force `</think>` here,
    /// that would cut the call in half.
    ToolCall,
    Done,
}

/// Counts reasoning tokens and says when `</think>` must be forced.
///
/// Each step: ask [`forced_token`](Self::forced_token) before sampling; if it returns a token,
/// append that instead of sampling (via [`Sampler::force`]); then report the appended token to
/// [`observe`](Self::observe). [`reasoning_tokens`](Self::reasoning_tokens) is the count for
/// `usage.completion_tokens_details.reasoning_tokens`.
///
/// [`Sampler::force`]: super::Sampler::force
#[derive(Debug, Clone)]
pub struct ThinkingBudget {
    ids: ThinkTokens,
    budget: Option<usize>,
    thinking: bool,
    state: ThinkState,
    reasoning_tokens: usize,
}

impl ThinkingBudget {
    /// `thinking`: the prompt ends inside `<think>` (the template's default). With thinking off the
    /// budget only applies if the model opens `<think>` itself as its first token.
    pub fn new(ids: ThinkTokens, thinking: bool, budget: Option<usize>) -> Self {
        Self {
            ids,
            budget,
            thinking,
            state: ThinkState::Start,
            reasoning_tokens: 0,
        }
    }

    pub fn reasoning_tokens(&self) -> usize {
        self.reasoning_tokens
    }

    /// Whether the next token would still be part of the reasoning.
    pub fn in_reasoning(&self) -> bool {
        match self.state {
            ThinkState::Start => self.thinking,
            ThinkState::Reasoning => true,
            ThinkState::ToolCall | ThinkState::Done => false,
        }
    }

    /// `Some(</think>)` when the budget is spent and the next token must close the reasoning.
    pub fn forced_token(&self) -> Option<u32> {
        let budget = self.budget?;
        (self.in_reasoning() && self.reasoning_tokens >= budget).then_some(self.ids.think_end)
    }

    pub fn observe(&mut self, token: u32) {
        if self.state == ThinkState::Start {
            self.state = if self.thinking {
                ThinkState::Reasoning
            } else {
                ThinkState::Done
            };
            if token == self.ids.think_start {
                // A model that opens `<think>` itself (older templates): the tag is not reasoning.
                self.state = ThinkState::Reasoning;
                return;
            }
        }
        match self.state {
            ThinkState::Reasoning if token == self.ids.think_end => self.state = ThinkState::Done,
            ThinkState::Reasoning if token == self.ids.tool_call_start => {
                self.state = ThinkState::ToolCall
            }
            ThinkState::Reasoning => self.reasoning_tokens += 1,
            ThinkState::ToolCall if token == self.ids.tool_call_end => {
                self.state = ThinkState::Reasoning
            }
            ThinkState::Start | ThinkState::ToolCall | ThinkState::Done => {}
        }
    }
}
