//! GGUF files (llama.cpp; MODEL.md §5.2) of architecture `qwen35moe`, memory-mapped and mapped
//! onto the canonical weights.
//!
//! The file: `GGUF`, version 3, a list of typed metadata entries (the hyper-parameters under
//! `qwen35moe.*`, the tokenizer under `tokenizer.*`), a list of tensor descriptions (name, ggml
//! dims `ne` — PyTorch's shape reversed —, ggml type, offset), then the aligned tensor data.
//!
//! What llama.cpp's converter changed, undone here so that the canonical weights are those of
//! the Hugging Face checkpoint (up to the file's quantisation):
//! - the zero-centred norms hold `1 + w`: that is the effective multiplier the canonical weights
//!   keep, so they are taken as they are (the GDN gated norm was never shifted);
//! - `ssm_a` holds `−exp(A_log)`: `A_log = ln(−ssm_a)`;
//! - the GDN value heads are in "tiled" order (value head `r·Hk + k` for the `r`-th value head of
//!   key head `k`) instead of grouped (`k·(Hv/Hk) + r`): rows of `attn_qkv`'s V part,
//!   `attn_gate`, `ssm_beta`, `ssm_alpha`, `ssm_dt`, `ssm_a`, the V channels of `ssm_conv1d` and
//!   the input columns of `ssm_out` are put back in grouped order. Rows move as whole rows
//!   (quantised blocks unchanged); `ssm_out`'s columns move by whole blocks when a value head is
//!   a whole number of blocks, else that matrix is dequantised to f32 (exact);
//! - the routed experts' gate and up stacks are separate tensors (or one fused
//!   `ffn_gate_up_exps`), and the MTP block, when present, is layer `block_count − 1`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::json;

use super::tensor::{Bytes, DType};
use super::CheckpointError;
use crate::config::ModelConfig;
use crate::ggml::{self, GgmlType};
use crate::model::weights::{
    AttentionWeights, DeltaNetWeights, FeedForward, LayerWeights, Matrix, Mixer, MoeWeights,
    MtpWeights, WeightFormat, Weights,
};

/// The architecture lily reads.
pub const ARCHITECTURE: &str = "qwen35moe";

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Meta {
    UInt(u64),
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Meta>),
}

impl Meta {
    fn as_u64(&self) -> Option<u64> {
        match *self {
            Meta::UInt(v) => Some(v),
            Meta::Int(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
    fn as_f64(&self) -> Option<f64> {
        match *self {
            Meta::Float(v) => Some(v),
            Meta::UInt(v) => Some(v as f64),
            Meta::Int(v) => Some(v as f64),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Meta::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[Meta]> {
        match self {
            Meta::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One tensor of a GGUF file.
#[derive(Debug, Clone)]
pub struct GgufTensor {
    pub ggml_type: GgmlType,
    /// PyTorch order (ggml's `ne` reversed): `[rows, cols]` for a matrix.
    pub shape: Vec<usize>,
    pub data: Bytes,
}

/// A parsed GGUF file: metadata and tensors, the data memory-mapped.
#[derive(Debug)]
pub struct GgufFile {
    pub path: PathBuf,
    pub metadata: BTreeMap<String, Meta>,
    pub tensors: BTreeMap<String, GgufTensor>,
}

/// The GGUF file a `--model` path stands for: the path itself when it is a file ending in
/// `.gguf`, or the only `.gguf` file of a directory that has no safetensors; `None` otherwise.
pub fn find(path: &Path) -> Result<Option<PathBuf>, CheckpointError> {
    if path.is_file() {
        return Ok(path
            .extension()
            .is_some_and(|e| e == "gguf")
            .then(|| path.to_path_buf()));
    }
    let Ok(entries) = std::fs::read_dir(path) else {
        return Ok(None);
    };
    let files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    let has_safetensors = files
        .iter()
        .any(|p| p.extension().is_some_and(|e| e == "safetensors"));
    let mut ggufs: Vec<PathBuf> = files
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
        .collect();
    ggufs.sort();
    match ggufs.len() {
        0 => Ok(None),
        _ if has_safetensors => Ok(None),
        1 => Ok(ggufs.pop()),
        _ => Err(CheckpointError::Header {
            file: path.display().to_string(),
            message: format!(
                "holds {} .gguf files ({}); pass the one to load as --model",
                ggufs.len(),
                ggufs
                    .iter()
                    .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }),
    }
}

impl GgufFile {
    /// Memory-maps and parses `path`.
    pub fn open(path: &Path) -> Result<GgufFile, CheckpointError> {
        let io = |source| CheckpointError::Io {
            path: path.display().to_string(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: read-only mapping; as for safetensors, a file changed while mapped is the
        // user's problem.
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        Self::parse(path, Arc::new(mmap))
    }

    /// Parses a whole GGUF buffer.
    pub fn parse(
        path: &Path,
        owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    ) -> Result<GgufFile, CheckpointError> {
        let buf: &[u8] = (*owner).as_ref();
        let mut r = Cursor {
            buf,
            pos: 0,
            file: path,
        };
        if r.bytes(4)? != b"GGUF" {
            return Err(r.err("not a GGUF file (no `GGUF` magic)".into()));
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(r.err(format!(
                "GGUF version {version}; lily reads versions 2 and 3"
            )));
        }
        let n_tensors = r.u64()?;
        let n_meta = r.u64()?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_meta {
            let key = r.string()?;
            let t = r.u32()?;
            let value = r.value(t, 0)?;
            metadata.insert(key, value);
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a as usize,
                _ => return Err(r.err(format!("general.alignment {v:?} is not a power of two"))),
            },
        };
        let mut infos = Vec::new();
        for _ in 0..n_tensors {
            let name = r.string()?;
            let n_dims = r.u32()?;
            if n_dims > 4 {
                return Err(r.err(format!(
                    "tensor `{name}` has {n_dims} dimensions (at most 4)"
                )));
            }
            let mut ne = Vec::new();
            for _ in 0..n_dims {
                ne.push(r.u64()? as usize);
            }
            let type_number = r.u32()?;
            let offset = r.u64()? as usize;
            infos.push((name, ne, type_number, offset));
        }
        let data_start = r.pos.div_ceil(alignment) * alignment;
        let mut tensors = BTreeMap::new();
        for (name, ne, type_number, offset) in infos {
            let ggml_type = GgmlType::from_number(type_number).map_err(|found| {
                r.err(format!(
                    "tensor `{name}` has type {found}; lily reads {}",
                    ggml::SUPPORTED
                ))
            })?;
            let cols = ne.first().copied().unwrap_or(1);
            if cols % ggml_type.block_values() != 0 {
                return Err(r.err(format!(
                    "tensor `{name}`: rows of {cols} values are not whole {} blocks of {}",
                    ggml_type.name(),
                    ggml_type.block_values()
                )));
            }
            let bytes = ne
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .and_then(|count| {
                    (count / ggml_type.block_values()).checked_mul(ggml_type.block_bytes())
                })
                .ok_or_else(|| r.err(format!("tensor `{name}`: dims {ne:?} overflow")))?;
            let begin = data_start.saturating_add(offset);
            if begin.saturating_add(bytes) > buf.len() {
                return Err(CheckpointError::Truncated {
                    file: path.display().to_string(),
                    tensor: name,
                    needed: begin.saturating_add(bytes),
                    size: buf.len(),
                });
            }
            let shape = ne.iter().rev().copied().collect();
            let tensor = GgufTensor {
                ggml_type,
                shape,
                data: Bytes::new(owner.clone(), begin, bytes),
            };
            if tensors.insert(name.clone(), tensor).is_some() {
                return Err(r.err(format!("tensor `{name}` is listed twice")));
            }
        }
        Ok(GgufFile {
            path: path.to_path_buf(),
            metadata,
            tensors,
        })
    }

    fn header_err(&self, message: String) -> CheckpointError {
        CheckpointError::Header {
            file: self.path.display().to_string(),
            message,
        }
    }

    /// `general.architecture`, checked to be the one lily reads.
    pub fn check_architecture(&self) -> Result<(), CheckpointError> {
        match self.metadata.get("general.architecture").and_then(Meta::as_str) {
            Some(ARCHITECTURE) => Ok(()),
            found => Err(self.header_err(format!(
                "architecture {}: lily reads only `{ARCHITECTURE}` (Qwen3.5/3.6 MoE, e.g. Qwen3.6-35B-A3B) GGUF files",
                found.map_or("missing".into(), |a| format!("`{a}`"))
            ))),
        }
    }

    fn meta_u64(&self, key: &str) -> Result<u64, CheckpointError> {
        let full = format!("{ARCHITECTURE}.{key}");
        self.metadata
            .get(&full)
            .and_then(Meta::as_u64)
            .ok_or_else(|| {
                self.header_err(format!("metadata `{full}` is missing or not an integer"))
            })
    }
    fn meta_f64(&self, key: &str) -> Result<f64, CheckpointError> {
        let full = format!("{ARCHITECTURE}.{key}");
        self.metadata
            .get(&full)
            .and_then(Meta::as_f64)
            .ok_or_else(|| self.header_err(format!("metadata `{full}` is missing or not a number")))
    }

    /// Layers of the text model: `block_count` less the MTP layers the file appends.
    fn text_layers(&self) -> Result<usize, CheckpointError> {
        let blocks = self.meta_u64("block_count")? as usize;
        let mtp = self.meta_u64("nextn_predict_layers").unwrap_or(0) as usize;
        blocks
            .checked_sub(mtp)
            .filter(|&n| n > 0)
            .ok_or_else(|| self.header_err(format!("block_count {blocks} with {mtp} MTP layers")))
    }

    /// The model configuration, as the Hugging Face config.json the file was converted from.
    pub fn config(&self) -> Result<ModelConfig, CheckpointError> {
        self.check_architecture()?;
        let head_dim = self.meta_u64("attention.key_length")?;
        let value_heads = self.meta_u64("ssm.time_step_rank")?;
        let inner = self.meta_u64("ssm.inner_size")?;
        if value_heads == 0 || inner % value_heads != 0 {
            return Err(self.header_err(format!(
                "ssm.inner_size {inner} is not a multiple of ssm.time_step_rank {value_heads}"
            )));
        }
        let vocab = self
            .tensors
            .get("token_embd.weight")
            .map(|t| t.shape[0])
            .ok_or_else(|| self.missing("token_embd.weight"))?;
        let sections: Vec<u64> = self
            .metadata
            .get(&format!("{ARCHITECTURE}.rope.dimension_sections"))
            .and_then(Meta::as_array)
            .map(|a| a.iter().filter_map(Meta::as_u64).take(3).collect())
            .unwrap_or_default();
        let mut rope = json!({
            "rope_type": "default",
            "rope_theta": self.meta_f64("rope.freq_base")?,
            "partial_rotary_factor":
                self.meta_u64("rope.dimension_count")? as f64 / head_dim.max(1) as f64,
        });
        if !sections.is_empty() {
            rope["mrope_section"] = json!(sections);
        }
        let eos = self
            .metadata
            .get("tokenizer.ggml.eos_token_id")
            .and_then(Meta::as_u64);
        let text = json!({
            "model_type": "qwen3_5_moe_text",
            "hidden_size": self.meta_u64("embedding_length")?,
            "num_hidden_layers": self.text_layers()?,
            "mtp_num_hidden_layers": self.meta_u64("nextn_predict_layers").unwrap_or(0),
            "full_attention_interval": self.meta_u64("full_attention_interval")?,
            "vocab_size": vocab,
            "rms_norm_eps": self.meta_f64("attention.layer_norm_rms_epsilon")?,
            "tie_word_embeddings": !self.tensors.contains_key("output.weight"),
            "num_attention_heads": self.meta_u64("attention.head_count")?,
            "num_key_value_heads": self.meta_u64("attention.head_count_kv")?,
            "head_dim": head_dim,
            "rope_parameters": rope,
            "linear_num_key_heads": self.meta_u64("ssm.group_count")?,
            "linear_num_value_heads": value_heads,
            "linear_key_head_dim": self.meta_u64("ssm.state_size")?,
            "linear_value_head_dim": inner / value_heads,
            "linear_conv_kernel_dim": self.meta_u64("ssm.conv_kernel")?,
            "num_experts": self.meta_u64("expert_count")?,
            "num_experts_per_tok": self.meta_u64("expert_used_count")?,
            "moe_intermediate_size": self.meta_u64("expert_feed_forward_length")?,
            "shared_expert_intermediate_size": self.meta_u64("expert_shared_feed_forward_length")?,
            "max_position_embeddings": self.meta_u64("context_length")?,
            "eos_token_id": eos,
        });
        Ok(ModelConfig::from_json(&text)?)
    }

    /// The vocabulary, token strings by id (`tokenizer.ggml.tokens`).
    pub fn token_list(&self) -> Result<Vec<String>, CheckpointError> {
        let tokens = self
            .metadata
            .get("tokenizer.ggml.tokens")
            .and_then(Meta::as_array)
            .ok_or_else(|| {
                self.header_err(
                    "has no vocabulary (`tokenizer.ggml.tokens`); put the model's tokenizer.json beside it".into(),
                )
            })?;
        tokens
            .iter()
            .map(|t| t.as_str().map(str::to_string))
            .collect::<Option<_>>()
            .ok_or_else(|| self.header_err("`tokenizer.ggml.tokens` holds a non-string".into()))
    }

    /// The chat template the file carries (`tokenizer.chat_template`).
    pub fn chat_template(&self) -> Option<&str> {
        self.metadata
            .get("tokenizer.chat_template")
            .and_then(Meta::as_str)
    }

    fn missing(&self, tensor: &str) -> CheckpointError {
        CheckpointError::Missing {
            tensor: tensor.to_string(),
            location: self.path.display().to_string(),
        }
    }

    fn tensor(&self, name: &str, shape: &[usize]) -> Result<&GgufTensor, CheckpointError> {
        let t = self.tensors.get(name).ok_or_else(|| self.missing(name))?;
        if t.shape != shape {
            return Err(CheckpointError::Shape {
                tensor: name.to_string(),
                file: self.path.display().to_string(),
                expected: shape.to_vec(),
                found: t.shape.clone(),
            });
        }
        Ok(t)
    }

    /// A `[rows, cols]` matrix (or an `[n, rows, cols]` stack as `[n·rows, cols]`).
    fn matrix(&self, name: &str, shape: &[usize]) -> Result<Matrix, CheckpointError> {
        let t = self.tensor(name, shape)?;
        let cols = shape[shape.len() - 1];
        Ok(matrix_of(
            t,
            t.data.clone(),
            shape.iter().product::<usize>() / cols,
            cols,
        ))
    }

    fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>, CheckpointError> {
        let t = self.tensor(name, &[n])?;
        let mut out = vec![0f32; n];
        ggml::dequantize_row(t.ggml_type, t.data.as_slice(), &mut out);
        Ok(out)
    }
}

/// A matrix over `data` in the tensor's format.
fn matrix_of(t: &GgufTensor, data: Bytes, rows: usize, cols: usize) -> Matrix {
    let dense = |dtype| Matrix::dense(rows, cols, dtype, data.clone());
    match t.ggml_type {
        GgmlType::F32 => dense(DType::F32),
        GgmlType::F16 => dense(DType::F16),
        GgmlType::BF16 => dense(DType::BF16),
        q => Matrix {
            rows,
            cols,
            format: WeightFormat::Ggml(q),
            data,
            scales: None,
            biases: None,
            scale_dtype: DType::BF16,
        },
    }
}

/// Loads the `qwen35moe` GGUF file at `path` into canonical weights.
pub fn load(path: &Path) -> Result<Weights, CheckpointError> {
    let file = GgufFile::open(path)?;
    let config = file.config()?;
    from_file(config, &file)
}

/// Builds canonical weights from a parsed GGUF file.
pub fn from_file(config: ModelConfig, f: &GgufFile) -> Result<Weights, CheckpointError> {
    let c = &config;
    let h = c.hidden_size;
    let embed = f.matrix("token_embd.weight", &[c.vocab_size, h])?;
    let lm_head = if f.tensors.contains_key("output.weight") {
        f.matrix("output.weight", &[c.vocab_size, h])?
    } else {
        embed.clone()
    };
    let final_norm = f.vector("output_norm.weight", h)?;
    let layers = (0..c.num_hidden_layers)
        .map(|i| layer(f, c, &format!("blk.{i}."), c.is_full_attention(i)))
        .collect::<Result<Vec<_>, _>>()?;
    let mtp_tensors = f
        .tensors
        .keys()
        .filter(|k| {
            k.strip_prefix("blk.")
                .and_then(|r| r.split('.').next())
                .and_then(|n| n.parse::<usize>().ok())
                .is_some_and(|n| n >= c.num_hidden_layers)
        })
        .cloned()
        .collect();
    // Current converters append the MTP head as the block after the last (MODEL.md §5.2).
    let n = c.num_hidden_layers;
    let mtp = if f
        .tensors
        .contains_key(&format!("blk.{n}.nextn.eh_proj.weight"))
    {
        let x = format!("blk.{n}.nextn.");
        Some(MtpWeights {
            embedding_norm: f.vector(&format!("{x}enorm.weight"), h)?,
            hidden_norm: f.vector(&format!("{x}hnorm.weight"), h)?,
            fc: f.matrix(&format!("{x}eh_proj.weight"), &[h, 2 * h])?,
            layer: layer(f, c, &format!("blk.{n}."), true)?,
            norm: f.vector(&format!("{x}shared_head_norm.weight"), h)?,
        })
    } else {
        None
    };
    Ok(Weights {
        config,
        embed,
        layers,
        final_norm,
        lm_head,
        mtp,
        mtp_tensors,
    })
}

/// The block whose tensors start with `b` (`blk.3.`, the MTP head's `blk.40.`): its mixer, full
/// attention or Gated DeltaNet, and its MoE.
fn layer(
    f: &GgufFile,
    c: &ModelConfig,
    b: &str,
    full_attention: bool,
) -> Result<LayerWeights, CheckpointError> {
    let h = c.hidden_size;
    let heads = VHeads {
        key_heads: c.linear_num_key_heads,
        value_heads: c.linear_num_value_heads,
    };
    let mixer = if full_attention {
        let (q_out, kv_out) = (
            2 * c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
        );
        Mixer::Attention(AttentionWeights {
            q_proj: f.matrix(&format!("{b}attn_q.weight"), &[q_out, h])?,
            k_proj: f.matrix(&format!("{b}attn_k.weight"), &[kv_out, h])?,
            v_proj: f.matrix(&format!("{b}attn_v.weight"), &[kv_out, h])?,
            o_proj: f.matrix(
                &format!("{b}attn_output.weight"),
                &[h, c.num_attention_heads * c.head_dim],
            )?,
            q_norm: f.vector(&format!("{b}attn_q_norm.weight"), c.head_dim)?,
            k_norm: f.vector(&format!("{b}attn_k_norm.weight"), c.head_dim)?,
        })
    } else {
        let (nv, dv, qk) = (
            c.linear_num_value_heads,
            c.linear_value_head_dim,
            2 * c.linear_key_dim(),
        );
        let qkv = f.matrix(&format!("{b}attn_qkv.weight"), &[c.conv_dim(), h])?;
        let kernel = c.linear_conv_kernel_dim;
        let conv_name = format!("{b}ssm_conv1d.weight");
        let conv_t = f.tensor(&conv_name, &[c.conv_dim(), kernel])?;
        let mut conv = vec![0f32; c.conv_dim() * kernel];
        ggml::dequantize_row(conv_t.ggml_type, conv_t.data.as_slice(), &mut conv);
        let a_name = format!("{b}ssm_a");
        let a_log = heads
            .untile(&f.vector(&a_name, nv)?, 1)
            .into_iter()
            .map(|a| {
                if a < 0.0 {
                    Ok((-a).ln())
                } else {
                    Err(f.header_err(format!(
                        "`{a_name}` holds {a}; it should be −exp(A_log) < 0"
                    )))
                }
            })
            .collect::<Result<_, _>>()?;
        let out_name = format!("{b}ssm_out.weight");
        let out_t = f.tensor(&out_name, &[h, c.linear_value_dim()])?;
        Mixer::DeltaNet(DeltaNetWeights {
            in_proj_qkv: heads.untile_rows(&qkv, qk, dv),
            in_proj_z: heads.untile_rows(
                &f.matrix(&format!("{b}attn_gate.weight"), &[c.linear_value_dim(), h])?,
                0,
                dv,
            ),
            in_proj_b: heads.untile_rows(
                &f.matrix(&format!("{b}ssm_beta.weight"), &[nv, h])?,
                0,
                1,
            ),
            in_proj_a: heads.untile_rows(
                &f.matrix(&format!("{b}ssm_alpha.weight"), &[nv, h])?,
                0,
                1,
            ),
            conv1d: [
                &conv[..qk * kernel],
                &heads.untile(&conv[qk * kernel..], dv * kernel),
            ]
            .concat(),
            a_log,
            dt_bias: heads.untile(&f.vector(&format!("{b}ssm_dt.bias"), nv)?, 1),
            norm: f.vector(&format!("{b}ssm_norm.weight"), dv)?,
            out_proj: heads.untile_cols(out_t, h, dv),
        })
    };

    let (e, inter, si) = (
        c.num_experts,
        c.moe_intermediate_size,
        c.shared_expert_intermediate_size,
    );
    let (gate, up) = if f
        .tensors
        .contains_key(&format!("{b}ffn_gate_up_exps.weight"))
    {
        let both = f.matrix(&format!("{b}ffn_gate_up_exps.weight"), &[e, 2 * inter, h])?;
        let views = |half: usize| {
            (0..e)
                .map(|x| both.rows_view(x * 2 * inter + half * inter, inter))
                .collect::<Vec<_>>()
        };
        (views(0), views(1))
    } else {
        let stack = |name: &str| -> Result<Vec<Matrix>, CheckpointError> {
            let m = f.matrix(&format!("{b}{name}.weight"), &[e, inter, h])?;
            Ok((0..e).map(|x| m.rows_view(x * inter, inter)).collect())
        };
        (stack("ffn_gate_exps")?, stack("ffn_up_exps")?)
    };
    let down = f.matrix(&format!("{b}ffn_down_exps.weight"), &[e, h, inter])?;
    let experts = gate
        .into_iter()
        .zip(up)
        .enumerate()
        .map(|(x, (gate, up))| FeedForward {
            gate,
            up,
            down: down.rows_view(x * h, h),
        })
        .collect();
    let shexp_gate_name = format!("{b}ffn_gate_inp_shexp.weight");
    let shexp_gate = match f.tensors.get(&shexp_gate_name) {
        Some(t) if t.shape == [h] => matrix_of(t, t.data.clone(), 1, h),
        _ => f.matrix(&shexp_gate_name, &[1, h])?,
    };
    let moe = MoeWeights {
        router: f.matrix(&format!("{b}ffn_gate_inp.weight"), &[e, h])?,
        experts,
        shared_expert: FeedForward {
            gate: f.matrix(&format!("{b}ffn_gate_shexp.weight"), &[si, h])?,
            up: f.matrix(&format!("{b}ffn_up_shexp.weight"), &[si, h])?,
            down: f.matrix(&format!("{b}ffn_down_shexp.weight"), &[h, si])?,
        },
        shared_expert_gate: shexp_gate,
    };
    Ok(LayerWeights {
        input_norm: f.vector(&format!("{b}attn_norm.weight"), h)?,
        post_attention_norm: f.vector(&format!("{b}post_attention_norm.weight"), h)?,
        mixer,
        moe,
    })
}

/// The GDN value-head reorder: tiled order in the file (position `r·Hk + k`), grouped order in
/// the canonical weights (head `k·(Hv/Hk) + r`).
struct VHeads {
    key_heads: usize,
    value_heads: usize,
}

impl VHeads {
    /// The file position of canonical value head `head`.
    fn tiled_position(&self, head: usize) -> usize {
        let per_key = self.value_heads / self.key_heads;
        (head % per_key) * self.key_heads + head / per_key
    }

    /// `values` (`value_heads` chunks of `chunk`) in canonical order.
    fn untile<T: Copy>(&self, values: &[T], chunk: usize) -> Vec<T> {
        (0..self.value_heads)
            .flat_map(|head| {
                let p = self.tiled_position(head);
                values[p * chunk..(p + 1) * chunk].iter().copied()
            })
            .collect()
    }

    /// `m` with its rows after the first `skip` reordered, each value head being `head_rows` rows.
    fn untile_rows(&self, m: &Matrix, skip: usize, head_rows: usize) -> Matrix {
        let rb = m.row_bytes();
        let bytes = m.data.as_slice();
        let mut out = bytes[..skip * rb].to_vec();
        out.extend(self.untile(&bytes[skip * rb..], head_rows * rb));
        Matrix {
            data: Bytes::from_vec(out),
            ..m.clone()
        }
    }

    /// `ssm_out` `[rows, value_heads · head_cols]` with its columns in canonical order: by
    /// whole blocks when a head is whole blocks, else dequantised to f32.
    fn untile_cols(&self, t: &GgufTensor, rows: usize, head_cols: usize) -> Matrix {
        let cols = self.value_heads * head_cols;
        let per_block = t.ggml_type.block_values();
        let m = matrix_of(t, t.data.clone(), rows, cols);
        if head_cols % per_block == 0 {
            let rb = m.row_bytes();
            let head_bytes = head_cols / per_block * t.ggml_type.block_bytes();
            let out: Vec<u8> = m
                .data
                .as_slice()
                .chunks_exact(rb)
                .flat_map(|row| self.untile(row, head_bytes))
                .collect();
            return Matrix {
                data: Bytes::from_vec(out),
                ..m
            };
        }
        let mut row = vec![0f32; cols];
        let mut values = Vec::with_capacity(rows * cols);
        for r in 0..rows {
            m.row_into(r, &mut row);
            values.extend(self.untile(&row, head_cols));
        }
        Matrix::from_f32(rows, cols, &values)
    }
}

/// Reads the header fields, checking every length against the buffer.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    file: &'a Path,
}

impl<'a> Cursor<'a> {
    fn err(&self, message: String) -> CheckpointError {
        CheckpointError::Header {
            file: self.file.display().to_string(),
            message,
        }
    }
    fn bytes(&mut self, n: usize) -> Result<&'a [u8], CheckpointError> {
        if n > self.buf.len() - self.pos {
            return Err(self.err(format!(
                "header runs past the end of the file ({} bytes) at byte {}: truncated or corrupt",
                self.buf.len(),
                self.pos
            )));
        }
        let b = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(b)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], CheckpointError> {
        Ok(self.bytes(N)?.try_into().expect("N bytes"))
    }
    fn u32(&mut self) -> Result<u32, CheckpointError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, CheckpointError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn string(&mut self) -> Result<String, CheckpointError> {
        let n = self.u64()?;
        let n = usize::try_from(n).map_err(|_| self.err(format!("string length {n}")))?;
        let at = self.pos;
        let b = self.bytes(n)?;
        String::from_utf8(b.to_vec())
            .map_err(|_| self.err(format!("string at byte {at} is not UTF-8")))
    }
    /// A value of GGUF type `t` (arrays nest at most once in practice; deeper is refused).
    fn value(&mut self, t: u32, depth: usize) -> Result<Meta, CheckpointError> {
        Ok(match t {
            0 => Meta::UInt(self.array::<1>()?[0] as u64),
            1 => Meta::Int(self.array::<1>()?[0] as i8 as i64),
            2 => Meta::UInt(u16::from_le_bytes(self.array()?) as u64),
            3 => Meta::Int(i16::from_le_bytes(self.array()?) as i64),
            4 => Meta::UInt(self.u32()? as u64),
            5 => Meta::Int(i32::from_le_bytes(self.array()?) as i64),
            6 => Meta::Float(f32::from_le_bytes(self.array()?) as f64),
            7 => Meta::Bool(self.array::<1>()?[0] != 0),
            8 => Meta::Str(self.string()?),
            9 if depth < 2 => {
                let inner = self.u32()?;
                let n = self.u64()?;
                // Every element takes at least one byte: a count beyond the file is corrupt.
                if n > (self.buf.len() - self.pos) as u64 {
                    return Err(self.err(format!("array of {n} elements runs past the end")));
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(inner, depth + 1)?);
                }
                Meta::Array(items)
            }
            10 => Meta::UInt(self.u64()?),
            11 => Meta::Int(i64::from_le_bytes(self.array()?)),
            12 => Meta::Float(f64::from_le_bytes(self.array()?)),
            other => return Err(self.err(format!("metadata value of unknown type {other}"))),
        })
    }
}
