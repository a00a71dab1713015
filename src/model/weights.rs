//! The canonical weights every loader produces and every backend consumes (DESIGN.md: backends
//! never see file formats). Matrices keep their storage format (bf16, f32, affine Q4/Q8, ...)
//! and point into the memory-mapped checkpoint; small vectors (norms, gates) are f32.
//!
//! Norm vectors hold the *effective* multiplier: `1 + w` for the zero-centred RMSNorms of the
//! Hugging Face checkpoint, the stored value for MLX/GGUF files that baked the `+1` in, and the
//! plain weight for the GDN gated norm. So `+1` is applied in exactly one place: the loader.

use crate::checkpoint::tensor::{Bytes, DType};
use crate::config::ModelConfig;
use crate::ggml::GgmlType;
use crate::quant::read_scalar;

/// How a matrix's numbers are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    F32,
    F16,
    BF16,
    /// MLX affine quantisation: `w = scale · q + bias` per group of `group_size` columns, with
    /// `bits`-bit unsigned q packed little-endian into u32 words (MODEL.md §5.1).
    Affine {
        bits: u32,
        group_size: usize,
    },
    /// A GGML block format (Q8_0, Q4_K, Q5_K, Q6_K) as a GGUF file stores it: blocks along the
    /// row, scales inside the blocks (MODEL.md §5.2).
    Ggml(GgmlType),
    /// FP8 e4m3 values with one multiplier per `block`×`block` tile (the official FP8 release:
    /// `weight_scale_inv`, MODEL.md §5.3): `scales` is `[⌈rows/block⌉, ⌈cols/block⌉]`.
    Fp8 {
        block: usize,
    },
}

impl WeightFormat {
    pub fn name(&self) -> String {
        match self {
            WeightFormat::F32 => "f32".into(),
            WeightFormat::F16 => "f16".into(),
            WeightFormat::BF16 => "bf16".into(),
            WeightFormat::Affine { bits, group_size } => format!("q{bits} g{group_size}"),
            WeightFormat::Ggml(t) => t.name().into(),
            WeightFormat::Fp8 { block } => format!("fp8 e4m3 {block}x{block}"),
        }
    }
}

/// A `[rows, cols]` weight matrix (PyTorch `[out, in]`), row-major, in any [`WeightFormat`].
#[derive(Debug, Clone)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub format: WeightFormat,
    /// The packed values.
    pub data: Bytes,
    /// Affine formats: `[rows, cols / group_size]` scales and biases; FP8: the block scales.
    pub scales: Option<Bytes>,
    pub biases: Option<Bytes>,
    /// Element type of scales and biases (bf16 in MLX checkpoints).
    pub scale_dtype: DType,
}

impl Matrix {
    /// A dense matrix over raw little-endian bytes.
    pub fn dense(rows: usize, cols: usize, dtype: DType, data: Bytes) -> Matrix {
        let format = match dtype {
            DType::F32 => WeightFormat::F32,
            DType::F16 => WeightFormat::F16,
            DType::BF16 => WeightFormat::BF16,
            other => panic!("dense matrix of {other:?} (loaders check dtypes first)"),
        };
        assert_eq!(
            data.len(),
            rows * cols * dtype.size(),
            "dense matrix byte count"
        );
        Matrix {
            rows,
            cols,
            format,
            data,
            scales: None,
            biases: None,
            scale_dtype: DType::BF16,
        }
    }

    /// An f32 matrix owning its values (tests, synthetic models).
    pub fn from_f32(rows: usize, cols: usize, values: &[f32]) -> Matrix {
        assert_eq!(values.len(), rows * cols);
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Matrix::dense(rows, cols, DType::F32, Bytes::from_vec(bytes))
    }

    /// Bytes of packed data per row.
    pub fn row_bytes(&self) -> usize {
        match self.format {
            WeightFormat::F32 => self.cols * 4,
            WeightFormat::F16 | WeightFormat::BF16 => self.cols * 2,
            WeightFormat::Affine { bits, .. } => self.cols * bits as usize / 8,
            WeightFormat::Ggml(t) => t.row_bytes(self.cols),
            WeightFormat::Fp8 { .. } => self.cols,
        }
    }

    /// Groups per row (affine formats).
    pub fn groups_per_row(&self) -> usize {
        match self.format {
            WeightFormat::Affine { group_size, .. } => self.cols / group_size,
            _ => 0,
        }
    }

    /// Rows `start .. start + n` as a matrix of their own (a view: experts of a stacked tensor).
    pub fn rows_view(&self, start: usize, n: usize) -> Matrix {
        assert!(start + n <= self.rows, "row view out of range");
        let rb = self.row_bytes();
        if let WeightFormat::Fp8 { block } = self.format {
            // Scales cover tiles of `block` rows: a view must start on a tile.
            assert_eq!(start % block, 0, "FP8 row view not on a scale tile");
            let tile_row = self.cols.div_ceil(block) * self.scale_dtype.size();
            return Matrix {
                rows: n,
                data: self.data.slice(start * rb, n * rb),
                scales: self
                    .scales
                    .as_ref()
                    .map(|s| s.slice(start / block * tile_row, n.div_ceil(block) * tile_row)),
                ..self.clone()
            };
        }
        let g = self.groups_per_row() * self.scale_dtype.size();
        Matrix {
            rows: n,
            cols: self.cols,
            format: self.format,
            data: self.data.slice(start * rb, n * rb),
            scales: self.scales.as_ref().map(|s| s.slice(start * g, n * g)),
            biases: self.biases.as_ref().map(|b| b.slice(start * g, n * g)),
            scale_dtype: self.scale_dtype,
        }
    }

    /// Columns `start .. start + n` of every row, as a matrix of their own (a copy): dense
    /// formats anywhere, affine ones on whole groups. `None` for other formats, or an affine cut
    /// inside a group.
    pub fn columns(&self, start: usize, n: usize) -> Option<Matrix> {
        assert!(start + n <= self.cols, "column range out of the matrix");
        let (value_bits, group) = match self.format {
            WeightFormat::F32 => (32, 1),
            WeightFormat::F16 | WeightFormat::BF16 => (16, 1),
            WeightFormat::Affine { bits, group_size } => (bits as usize, group_size),
            WeightFormat::Ggml(_) | WeightFormat::Fp8 { .. } => return None,
        };
        if start % group != 0 || n % group != 0 {
            return None;
        }
        // Each row's bytes of values, then (affine) of scales and biases, cut the same way.
        let cut = |bytes: &Bytes, row_bytes: usize, from: usize, len: usize| -> Bytes {
            let all = bytes.as_slice();
            let out: Vec<u8> = (0..self.rows)
                .flat_map(|r| all[r * row_bytes + from..r * row_bytes + from + len].iter())
                .copied()
                .collect();
            Bytes::from_vec(out)
        };
        let data = cut(
            &self.data,
            self.row_bytes(),
            start * value_bits / 8,
            n * value_bits / 8,
        );
        let g = self.scale_dtype.size();
        let (per_row, from, len) = (self.groups_per_row() * g, start / group * g, n / group * g);
        Some(Matrix {
            rows: self.rows,
            cols: n,
            format: self.format,
            data,
            scales: self.scales.as_ref().map(|b| cut(b, per_row, from, len)),
            biases: self.biases.as_ref().map(|b| cut(b, per_row, from, len)),
            scale_dtype: self.scale_dtype,
        })
    }

    /// Bytes this matrix occupies (data + scales + biases).
    pub fn storage_bytes(&self) -> usize {
        self.data.len()
            + self.scales.as_ref().map_or(0, Bytes::len)
            + self.biases.as_ref().map_or(0, Bytes::len)
    }

    /// Decodes row `r` to f32 (dequantising affine formats).
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        debug_assert_eq!(out.len(), self.cols);
        let rb = self.row_bytes();
        let row = &self.data.as_slice()[r * rb..(r + 1) * rb];
        match self.format {
            WeightFormat::F32 => {
                for (o, c) in out.iter_mut().zip(row.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            WeightFormat::BF16 => {
                for (o, c) in out.iter_mut().zip(row.chunks_exact(2)) {
                    *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
                }
            }
            WeightFormat::F16 => {
                for (o, c) in out.iter_mut().zip(row.chunks_exact(2)) {
                    *o = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
            WeightFormat::Affine { bits, group_size } => {
                let g = self.groups_per_row();
                let ss = self.scale_dtype.size();
                let scales = &self
                    .scales
                    .as_ref()
                    .expect("affine matrix has scales")
                    .as_slice()[r * g * ss..(r + 1) * g * ss];
                let biases = &self
                    .biases
                    .as_ref()
                    .expect("affine matrix has biases")
                    .as_slice()[r * g * ss..(r + 1) * g * ss];
                crate::quant::dequantize_row(
                    row,
                    scales,
                    biases,
                    self.scale_dtype,
                    bits,
                    group_size,
                    out,
                );
            }
            WeightFormat::Ggml(t) => crate::ggml::dequantize_row(t, row, out),
            WeightFormat::Fp8 { block } => {
                let table = crate::checkpoint::fp8::e4m3_table();
                let tiles = self.cols.div_ceil(block);
                let scales = self.scales.as_ref().expect("FP8 matrix has scales");
                let first = r / block * tiles;
                for (tile, chunk) in out.chunks_mut(block).enumerate() {
                    let s = read_scalar(scales.as_slice(), self.scale_dtype, first + tile);
                    let codes = &row[tile * block..tile * block + chunk.len()];
                    for (o, &c) in chunk.iter_mut().zip(codes) {
                        *o = table[c as usize] * s;
                    }
                }
            }
        }
    }
}

/// Experts' projections: SwiGLU `down · (silu(gate · x) ⊙ (up · x))`.
#[derive(Debug, Clone)]
pub struct FeedForward {
    pub gate: Matrix,
    pub up: Matrix,
    pub down: Matrix,
}

#[derive(Debug, Clone)]
pub struct MoeWeights {
    /// `[num_experts, hidden]` router.
    pub router: Matrix,
    pub experts: Vec<FeedForward>,
    pub shared_expert: FeedForward,
    /// `[1, hidden]` scalar gate of the shared expert.
    pub shared_expert_gate: Matrix,
}

/// Gated DeltaNet mixer (MODEL.md §2.3, §3.6).
#[derive(Debug, Clone)]
pub struct DeltaNetWeights {
    /// `[conv_dim, hidden]`: rows q ‖ k ‖ v, head-major.
    pub in_proj_qkv: Matrix,
    /// `[value_dim, hidden]`: the output gate z.
    pub in_proj_z: Matrix,
    /// `[num_value_heads, hidden]`: β logits.
    pub in_proj_b: Matrix,
    /// `[num_value_heads, hidden]`: decay input a.
    pub in_proj_a: Matrix,
    /// `[conv_dim × kernel]` depthwise causal conv; tap `kernel-1` multiplies the current token.
    pub conv1d: Vec<f32>,
    pub a_log: Vec<f32>,
    pub dt_bias: Vec<f32>,
    /// `[value_head_dim]` gated-norm weight (plain, not 1+w).
    pub norm: Vec<f32>,
    /// `[hidden, value_dim]`.
    pub out_proj: Matrix,
}

/// Gated full attention (MODEL.md §2.4, §3.4).
#[derive(Debug, Clone)]
pub struct AttentionWeights {
    /// `[heads · 2 · head_dim, hidden]`: per head, query rows then gate rows.
    pub q_proj: Matrix,
    pub k_proj: Matrix,
    pub v_proj: Matrix,
    pub o_proj: Matrix,
    /// Effective per-head norm multipliers `[head_dim]`.
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
}

#[derive(Debug, Clone)]
pub enum Mixer {
    DeltaNet(DeltaNetWeights),
    Attention(AttentionWeights),
}

#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub input_norm: Vec<f32>,
    pub post_attention_norm: Vec<f32>,
    pub mixer: Mixer,
    pub moe: MoeWeights,
}

impl LayerWeights {
    /// The layer's matrices, named after the checkpoint's tensors under `prefix`.
    pub fn matrices(&self, prefix: &str) -> Vec<(String, &Matrix)> {
        let mut out = Vec::new();
        match &self.mixer {
            Mixer::DeltaNet(d) => {
                for (n, m) in [
                    ("in_proj_qkv", &d.in_proj_qkv),
                    ("in_proj_z", &d.in_proj_z),
                    ("in_proj_b", &d.in_proj_b),
                    ("in_proj_a", &d.in_proj_a),
                    ("out_proj", &d.out_proj),
                ] {
                    out.push((format!("{prefix}linear_attn.{n}"), m));
                }
            }
            Mixer::Attention(a) => {
                for (n, m) in [
                    ("q_proj", &a.q_proj),
                    ("k_proj", &a.k_proj),
                    ("v_proj", &a.v_proj),
                    ("o_proj", &a.o_proj),
                ] {
                    out.push((format!("{prefix}self_attn.{n}"), m));
                }
            }
        }
        let moe = &self.moe;
        out.push((format!("{prefix}mlp.gate"), &moe.router));
        out.push((
            format!("{prefix}mlp.shared_expert_gate"),
            &moe.shared_expert_gate,
        ));
        let s = &moe.shared_expert;
        for (n, m) in [
            ("gate_proj", &s.gate),
            ("up_proj", &s.up),
            ("down_proj", &s.down),
        ] {
            out.push((format!("{prefix}mlp.shared_expert.{n}"), m));
        }
        for (e, x) in moe.experts.iter().enumerate() {
            for (n, m) in [
                ("gate_proj", &x.gate),
                ("up_proj", &x.up),
                ("down_proj", &x.down),
            ] {
                out.push((format!("{prefix}mlp.experts.{e}.{n}"), m));
            }
        }
        out
    }
}

/// The whole text model.
#[derive(Debug, Clone)]
pub struct Weights {
    pub config: ModelConfig,
    /// `[vocab, hidden]`.
    pub embed: Matrix,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Vec<f32>,
    /// `[vocab, hidden]`.
    pub lm_head: Matrix,
    /// The multi-token-prediction head, where the checkpoint has one and the loader reads its
    /// format (MODEL.md §2.5): what drafting tokens needs.
    pub mtp: Option<MtpWeights>,
    /// Names of the multi-token-prediction tensors found in the checkpoint (whether loaded or
    /// not: `inspect` lists them).
    pub mtp_tensors: Vec<String>,
}

/// The MTP head (MODEL.md §2.5, §4.1): from the final-normed hidden state of token t and the
/// embedding of token t + 1, one more full-attention decoder layer predicts token t + 2. It has
/// no embedding or LM head of its own: it shares the model's.
#[derive(Debug, Clone)]
pub struct MtpWeights {
    /// Effective multipliers of the two input norms: the embedding's, the hidden state's.
    pub embedding_norm: Vec<f32>,
    pub hidden_norm: Vec<f32>,
    /// `[hidden, 2 · hidden]`: over `concat(normed embedding, normed hidden)`, embedding first.
    pub fc: Matrix,
    /// A full-attention layer with its own KV cache and the full MoE.
    pub layer: LayerWeights,
    /// The final norm before the shared LM head.
    pub norm: Vec<f32>,
}

impl MtpWeights {
    /// The head's matrices, named after the checkpoint's tensors.
    pub fn matrices(&self) -> Vec<(String, &Matrix)> {
        let mut out = vec![("mtp.fc".to_string(), &self.fc)];
        out.extend(self.layer.matrices("mtp.layers.0."));
        out
    }
}

impl Weights {
    /// Every matrix with a descriptive name, for `inspect` and for uploading to a device.
    pub fn matrices(&self) -> Vec<(String, &Matrix)> {
        let mut out = vec![
            ("embed_tokens".to_string(), &self.embed),
            ("lm_head".to_string(), &self.lm_head),
        ];
        for (i, l) in self.layers.iter().enumerate() {
            out.extend(l.matrices(&format!("layers.{i}.")));
        }
        out
    }
}
