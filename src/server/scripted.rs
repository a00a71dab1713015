//! A test-only [`Backend`] that "generates" scripted replies: its logits make one token
//! overwhelmingly likely, so the sampler picks the script's next token and everything after the
//! model (detokenizer, reasoning and tool-call parsers, stop strings, SSE) runs for real on a
//! known token sequence. Reached only through the hidden `lily serve --scripted-tokens FILE`
//! flag, and announced in the log and in `/v1/models` when used.
//!
//! The script is JSON:
//!
//! ```json
//! {"replies": [{"when": "weather", "text": "Let me check.\n</think>\n\n<tool_call>…"}],
//!  "default": "Hello!", "token_delay_ms": 0}
//! ```
//!
//! A sequence replies with the `text` of the first entry whose `when` occurs in the last user
//! turn of its prompt (the whole prompt for raw completions), else with `default`, then
//! `<|im_end|>`. `token_delay_ms` slows every decode step (to test disconnects mid-stream). An
//! entry with `"panic": true` makes the backend panic instead (to test that one failing request
//! leaves the others alone).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use crate::config::ModelConfig;
use crate::model::{Backend, SeqId};
use crate::tokenizer::Tokenizer;

/// The logit of the scripted token; every other token gets 0. With a vocabulary of 250K,
/// exp(-30) · 250K ≈ 2e-8: even plain sampling at temperature 1 follows the script.
const SCRIPTED_LOGIT: f32 = 30.0;

#[derive(Debug, Clone, Deserialize)]
pub struct Script {
    #[serde(default)]
    pub replies: Vec<Reply>,
    #[serde(default)]
    pub default: String,
    #[serde(default)]
    pub token_delay_ms: u64,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Reply {
    pub when: String,
    #[serde(default)]
    pub text: String,
    #[serde(default)]
    pub panic: bool,
}

impl Script {
    pub fn load(path: &Path) -> anyhow::Result<Script> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("cannot read the script {}: {e}", path.display()))?;
        serde_json::from_str(&text)
            .map_err(|e| anyhow::anyhow!("the script {} is not valid: {e}", path.display()))
    }
}

struct Sequence {
    /// Every token fed so far (prompt, then generated).
    history: Vec<u32>,
    /// The reply and how much of it has been generated.
    reply: Vec<u32>,
    position: usize,
    replying: bool,
}

pub struct ScriptedBackend {
    config: ModelConfig,
    tokenizer: Arc<Tokenizer>,
    replies: Vec<Reply>,
    /// The token ids of each reply's text.
    reply_ids: Vec<Vec<u32>>,
    default: Vec<u32>,
    delay: Duration,
    sequences: HashMap<SeqId, Sequence>,
}

impl ScriptedBackend {
    /// `config` gives the shape the engine sees (its vocabulary must cover the tokenizer's).
    pub fn new(
        config: ModelConfig,
        tokenizer: Arc<Tokenizer>,
        script: &Script,
    ) -> anyhow::Result<ScriptedBackend> {
        let end = tokenizer
            .token_id("<|im_end|>")
            .ok_or_else(|| anyhow::anyhow!("the tokenizer has no <|im_end|>"))?;
        let encode = |text: &str| -> anyhow::Result<Vec<u32>> {
            let mut ids = tokenizer.encode(text)?;
            ids.push(end);
            Ok(ids)
        };
        let reply_ids = script
            .replies
            .iter()
            .map(|r| encode(&r.text))
            .collect::<anyhow::Result<_>>()?;
        let default = encode(&script.default)?;
        Ok(ScriptedBackend {
            config,
            tokenizer,
            replies: script.replies.clone(),
            reply_ids,
            default,
            delay: Duration::from_millis(script.token_delay_ms),
            sequences: HashMap::new(),
        })
    }

    /// The reply for a prompt: by its last user turn, or all of it when it has no chat markup.
    fn choose(&self, prompt: &[u32]) -> Vec<u32> {
        let text = self.tokenizer.decode_lossy(prompt).unwrap_or_default();
        let user = text
            .rfind("<|im_start|>user")
            .map_or(text.as_str(), |at| &text[at..]);
        match self
            .replies
            .iter()
            .position(|r| user.contains(r.when.as_str()))
        {
            Some(i) if self.replies[i].panic => panic!("scripted panic (reply {i} of the script)"),
            Some(i) => self.reply_ids[i].clone(),
            None => self.default.clone(),
        }
    }
}

impl Backend for ScriptedBackend {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn device_name(&self) -> String {
        "scripted (test replies, no model)".into()
    }

    fn create_sequence(&mut self, seq: SeqId) -> anyhow::Result<()> {
        self.sequences.insert(
            seq,
            Sequence {
                history: Vec::new(),
                reply: Vec::new(),
                position: 0,
                replying: false,
            },
        );
        Ok(())
    }

    fn free_sequence(&mut self, seq: SeqId) {
        self.sequences.remove(&seq);
    }

    fn forward(&mut self, seq: SeqId, tokens: &[u32]) -> anyhow::Result<Vec<f32>> {
        let mut state = self
            .sequences
            .remove(&seq)
            .ok_or_else(|| anyhow::anyhow!("unknown sequence {seq}"))?;
        state.history.extend_from_slice(tokens);
        if state.replying
            && tokens.len() == 1
            && state.reply.get(state.position) == Some(&tokens[0])
        {
            // A decode step: the token just fed is the one this script asked for. (The engine
            // feeds prompts in chunks; a last chunk of one token that happens to equal the
            // scripted token would be mistaken for a step, which test prompts do not risk.)
            state.position += 1;
            std::thread::sleep(self.delay);
        } else {
            // A prefill chunk (or a sampler that left the script): choose the reply from the
            // text seen so far and start it over.
            state.reply = self.choose(&state.history);
            state.position = 0;
            state.replying = true;
        }
        let mut logits = vec![0.0; self.config.vocab_size];
        let next = state
            .reply
            .get(state.position)
            .or(state.reply.last())
            .copied()
            .unwrap_or(0);
        if let Some(l) = logits.get_mut(next as usize) {
            *l = SCRIPTED_LOGIT;
        }
        self.sequences.insert(seq, state);
        Ok(logits)
    }
}
