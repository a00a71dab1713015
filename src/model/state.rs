//! Per-sequence state: what a sequence carries from one forward call to the next
//! (MODEL.md §3.9). GDN layers keep a conv window and an fp32 recurrent state of constant size;
//! attention layers keep a growing KV cache.

use crate::config::{LayerKind, ModelConfig};

#[derive(Debug, Clone, PartialEq)]
pub struct DeltaNetState {
    /// The last `kernel - 1` pre-conv `qkv` rows, oldest first: `[kernel - 1, conv_dim]`.
    pub conv: Vec<f32>,
    /// Recurrent state per value head: `[value_heads, key_dim, value_dim]`.
    pub ssm: Vec<f32>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct KvCache {
    /// `[tokens, kv_heads, head_dim]`, post-norm and post-RoPE.
    pub keys: Vec<f32>,
    pub values: Vec<f32>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum LayerState {
    DeltaNet(DeltaNetState),
    Attention(KvCache),
}

/// What drafting with the MTP head (MODEL.md §4.2) keeps for a sequence. Its row for position
/// t needs the model's hidden state of t and the token at t + 1, so a row can run only once the
/// next token is known: `committed + pending rows == position` always.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MtpState {
    /// The MTP layer's own cache: `committed` rows built from the model's hidden states, then
    /// the rows of the last drafts (dropped before the next rows are committed).
    pub kv: KvCache,
    pub committed: usize,
    /// The final-normed hidden states `[rows, hidden]` of the model's rows whose MTP row has
    /// not run yet (their next token was not known then), and the tokens of those rows (each
    /// row's next token is the following row's; the last one's comes with the next drafts).
    pub pending: Vec<f32>,
    pub tokens: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SequenceState {
    /// Tokens processed so far (the position of the next token).
    pub position: usize,
    pub layers: Vec<LayerState>,
    /// Set for a sequence that drafts tokens with the MTP head.
    pub mtp: Option<MtpState>,
}

impl SequenceState {
    pub fn new(c: &ModelConfig) -> SequenceState {
        let layers = c
            .layer_types
            .iter()
            .map(|kind| match kind {
                LayerKind::LinearAttention => LayerState::DeltaNet(DeltaNetState {
                    conv: vec![0.0; (c.linear_conv_kernel_dim - 1) * c.conv_dim()],
                    ssm: vec![
                        0.0;
                        c.linear_num_value_heads
                            * c.linear_key_head_dim
                            * c.linear_value_head_dim
                    ],
                }),
                LayerKind::FullAttention => LayerState::Attention(KvCache {
                    keys: Vec::new(),
                    values: Vec::new(),
                }),
            })
            .collect();
        SequenceState {
            position: 0,
            layers,
            mtp: None,
        }
    }
}

impl SequenceState {
    /// Bytes this state holds in memory (f32 values).
    pub fn bytes_held(&self) -> u64 {
        let values: usize = self
            .layers
            .iter()
            .map(|l| match l {
                LayerState::DeltaNet(d) => d.conv.len() + d.ssm.len(),
                LayerState::Attention(kv) => kv.keys.len() + kv.values.len(),
            })
            .sum::<usize>()
            + self.mtp.as_ref().map_or(0, |m| {
                m.kv.keys.len() + m.kv.values.len() + m.pending.len() + m.tokens.len()
            });
        (values * std::mem::size_of::<f32>()) as u64
    }

    /// Bytes the state of a sequence of `tokens` tokens holds, for any backend that stores it
    /// in f32 as this one does.
    pub fn bytes(c: &ModelConfig, tokens: usize) -> u64 {
        let per_layer = |kind: &LayerKind| match kind {
            LayerKind::LinearAttention => {
                (c.linear_conv_kernel_dim - 1) * c.conv_dim()
                    + c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
            }
            LayerKind::FullAttention => 2 * tokens * c.num_key_value_heads * c.head_dim,
        };
        let values: usize = c.layer_types.iter().map(per_layer).sum();
        (values * std::mem::size_of::<f32>()) as u64
    }
}
