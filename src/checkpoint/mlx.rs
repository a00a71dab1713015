//! MLX checkpoints (what `mlx_lm.convert` writes and mlx-community uploads; MODEL.md §5.1):
//! loaded as they are into the canonical weights, and planned tensor by tensor for the writers
//! (`lily quantize`, `lily synth --quant`, see [`super::mlx_write`]).
//!
//! How the layout differs from the Hugging Face checkpoint of the same model:
//! - names: `language_model.model.X` for `model.language_model.X` (readers also accept `model.X`),
//!   `language_model.lm_head` for `lm_head`; no vision tower, no MTP block;
//! - routed experts: `mlp.switch_mlp.{gate,up,down}_proj.weight`, stacks `[experts, out, in]`; the
//!   gate and up halves of the fused `mlp.experts.gate_up_proj` are separate stacks;
//! - `linear_attn.conv1d.weight` is `[channels, kernel, 1]` instead of `[channels, 1, kernel]`;
//! - the zero-centred RMSNorm weights (layer norms, final norm, q/k norms) hold `1 + w`;
//! - a quantised module `M` stores `M.weight` (u32 packed codes), `M.scales` and `M.biases`
//!   (the model dtype). A module is quantised iff `M.scales` exists (mlx-lm's rule); its bits and
//!   group size are `config.json`'s `quantization[M]` if present, else the global ones;
//! - mlx-lm quantises every linear layer, embedding and expert stack whose input width is a
//!   multiple of the group size: 4-bit by default, but the routers (`mlp.gate`) and shared-expert
//!   gates 8-bit with group 64, recorded per layer in the config.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Map, Value};

use super::tensor::{DType, RawTensor, TensorStore};
use super::CheckpointError;
use crate::config::{ConfigError, ModelConfig};
use crate::model::weights::{
    AttentionWeights, DeltaNetWeights, FeedForward, LayerWeights, Matrix, Mixer, MoeWeights,
    MtpWeights, WeightFormat, Weights,
};
use crate::quant::Affine;

/// Module-path prefix of the language model in files mlx-lm writes.
pub const MODEL_PREFIX: &str = "language_model.model.";
/// Module path of the output head in files mlx-lm writes.
pub const LM_HEAD: &str = "language_model.lm_head";
/// mlx-lm's parameters for the routers and shared-expert gates, whatever the global ones.
pub const GATE_QUANT: Affine = Affine {
    bits: 8,
    group_size: 64,
};

/// Whether `store` holds an MLX checkpoint rather than a Hugging Face one.
pub fn is_mlx_layout(store: &TensorStore) -> bool {
    store
        .tensors
        .keys()
        .any(|k| k.starts_with("language_model.") || k.contains(".switch_mlp."))
}

/// The `quantization` block of an MLX `config.json`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct QuantConfig {
    /// The global parameters; `None` when the config has no block (an unquantised conversion).
    pub default: Option<Affine>,
    /// Per-module entries by module path: parameters, or `None` for "not quantised".
    pub overrides: BTreeMap<String, Option<Affine>>,
}

impl QuantConfig {
    /// Reads `quantization` (or its copy `quantization_config`) from a parsed config.json.
    pub fn from_json(root: &Value) -> Result<QuantConfig, ConfigError> {
        let (key, block) = match ["quantization", "quantization_config"]
            .iter()
            .find_map(|k| root.get(*k).map(|b| (*k, b)))
        {
            Some(found) => found,
            None => return Ok(QuantConfig::default()),
        };
        let obj = block
            .as_object()
            .ok_or_else(|| field_err(key, "an object", &block.to_string()))?;
        let default = parse_params(key, obj)?;
        let mut overrides = BTreeMap::new();
        for (path, v) in obj {
            let entry = match v {
                Value::Object(o) => Some(parse_params(&format!("{key}.{path}"), o)?),
                Value::Bool(true) => Some(default),
                Value::Bool(false) => None,
                // Scalars are the global fields (bits, group_size, mode) or metadata.
                _ => continue,
            };
            overrides.insert(path.clone(), entry);
        }
        Ok(QuantConfig {
            default: Some(default),
            overrides,
        })
    }

    /// The parameters for module `path`, if it is meant to be quantised.
    pub fn for_module(&self, path: &str) -> Option<Affine> {
        match self.overrides.get(path) {
            Some(entry) => *entry,
            None => self.default,
        }
    }
}

/// `bits`, `group_size` and an optional `mode` (only "affine" is supported).
fn parse_params(field: &str, obj: &Map<String, Value>) -> Result<Affine, ConfigError> {
    if let Some(mode) = obj.get("mode") {
        if mode.as_str() != Some("affine") {
            return Err(field_err(
                &format!("{field}.mode"),
                "\"affine\" (the only MLX quantisation mode lily reads)",
                &mode.to_string(),
            ));
        }
    }
    let int = |k: &str| {
        let v = obj.get(k);
        v.and_then(Value::as_u64).ok_or_else(|| {
            field_err(
                &format!("{field}.{k}"),
                "a positive integer",
                &v.map_or("nothing (missing)".into(), Value::to_string),
            )
        })
    };
    let (bits, group_size) = (int("bits")?, int("group_size")?);
    Affine::new(bits as u32, group_size as usize)
        .map_err(|e| field_err(field, "supported affine parameters", &e.to_string()))
}

fn field_err(field: &str, expected: &str, found: &str) -> ConfigError {
    ConfigError::Field {
        field: field.to_string(),
        expected: expected.to_string(),
        found: found.to_string(),
    }
}

/// Loads the MLX checkpoint in `dir` whose config and tensors are already open.
pub fn load(
    dir: &Path,
    config: ModelConfig,
    store: &TensorStore,
) -> Result<Weights, CheckpointError> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|source| CheckpointError::Io {
        path: path.display().to_string(),
        source,
    })?;
    let root: Value = serde_json::from_str(&text).map_err(|source| ConfigError::Json {
        path: path.display().to_string(),
        source,
    })?;
    from_store(config, &QuantConfig::from_json(&root)?, store)
}

/// Builds canonical weights from the tensors of an MLX checkpoint.
pub fn from_store(
    config: ModelConfig,
    quant: &QuantConfig,
    store: &TensorStore,
) -> Result<Weights, CheckpointError> {
    let prefix = if store.contains(&format!("{MODEL_PREFIX}embed_tokens.weight")) {
        MODEL_PREFIX
    } else {
        "model."
    };
    let r = Reader { store, quant };
    let c = &config;
    let h = c.hidden_size;
    // mlx-lm's own test for a file it has not converted yet: a conv kernel still in the PyTorch
    // layout means the norms do not hold the +1 either (mlx-lm adds it while converting).
    let unconverted = store
        .tensors
        .iter()
        .any(|(k, t)| k.ends_with("conv1d.weight") && t.shape.last() != Some(&1));
    let norm = |name: &str, n: usize| -> Result<Vec<f32>, CheckpointError> {
        let w = r.vector(name, n)?;
        Ok(if unconverted {
            w.into_iter().map(|w| 1.0 + w).collect()
        } else {
            w
        })
    };

    let embed = r.matrix(&format!("{prefix}embed_tokens"), None, c.vocab_size, h)?;
    let head = [LM_HEAD, "lm_head"]
        .into_iter()
        .find(|m| store.contains(&format!("{m}.weight")));
    let lm_head = match head {
        Some(m) => r.matrix(m, None, c.vocab_size, h)?,
        None if c.tie_word_embeddings => embed.clone(),
        None => {
            return Err(CheckpointError::Missing {
                tensor: format!("{LM_HEAD}.weight"),
                location: store.source.clone(),
            })
        }
    };
    let final_norm = norm(&format!("{prefix}norm.weight"), h)?;

    let layers = (0..c.num_hidden_layers)
        .map(|i| {
            layer(
                &r,
                c,
                &format!("{prefix}layers.{i}."),
                c.is_full_attention(i),
                &norm,
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mtp_tensors = store
        .tensors
        .keys()
        .filter(|k| k.starts_with("mtp.") || k.starts_with("language_model.mtp."))
        .cloned()
        .collect();
    // `lily quantize` keeps the MTP head under its Hugging Face names (mlx-lm drops it).
    let mtp = if c.mtp_num_hidden_layers > 0 && store.contains("mtp.fc.weight") {
        Some(MtpWeights {
            embedding_norm: norm("mtp.pre_fc_norm_embedding.weight", h)?,
            hidden_norm: norm("mtp.pre_fc_norm_hidden.weight", h)?,
            fc: r.matrix("mtp.fc", None, h, 2 * h)?,
            layer: layer(&r, c, "mtp.layers.0.", true, &norm)?,
            norm: norm("mtp.norm.weight", h)?,
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

/// Reads a norm's effective multiplier (name, length).
type NormReader<'a> = dyn Fn(&str, usize) -> Result<Vec<f32>, CheckpointError> + 'a;

/// The decoder layer whose modules start with `p`: its mixer, full attention or Gated
/// DeltaNet, and its MoE. `norm` reads a norm's effective multiplier.
fn layer(
    r: &Reader,
    c: &ModelConfig,
    p: &str,
    full_attention: bool,
    norm: &NormReader,
) -> Result<LayerWeights, CheckpointError> {
    let h = c.hidden_size;
    let mixer = if full_attention {
        let a = format!("{p}self_attn.");
        let kv_out = c.num_key_value_heads * c.head_dim;
        Mixer::Attention(AttentionWeights {
            q_proj: r.matrix(
                &format!("{a}q_proj"),
                None,
                2 * c.num_attention_heads * c.head_dim,
                h,
            )?,
            k_proj: r.matrix(&format!("{a}k_proj"), None, kv_out, h)?,
            v_proj: r.matrix(&format!("{a}v_proj"), None, kv_out, h)?,
            o_proj: r.matrix(
                &format!("{a}o_proj"),
                None,
                h,
                c.num_attention_heads * c.head_dim,
            )?,
            q_norm: norm(&format!("{a}q_norm.weight"), c.head_dim)?,
            k_norm: norm(&format!("{a}k_norm.weight"), c.head_dim)?,
        })
    } else {
        let l = format!("{p}linear_attn.");
        let nv = c.linear_num_value_heads;
        let k = c.linear_conv_kernel_dim;
        let conv_name = format!("{l}conv1d.weight");
        let conv = r.float_tensor(&conv_name)?;
        // [C, K, 1] as MLX stores it, or [C, 1, K] not yet converted: the same element order.
        if conv.shape != [c.conv_dim(), k, 1] && conv.shape != [c.conv_dim(), 1, k] {
            return Err(shape_err(&conv_name, conv, vec![c.conv_dim(), k, 1]));
        }
        Mixer::DeltaNet(DeltaNetWeights {
            in_proj_qkv: r.matrix(&format!("{l}in_proj_qkv"), None, c.conv_dim(), h)?,
            in_proj_z: r.matrix(&format!("{l}in_proj_z"), None, c.linear_value_dim(), h)?,
            in_proj_b: r.matrix(&format!("{l}in_proj_b"), None, nv, h)?,
            in_proj_a: r.matrix(&format!("{l}in_proj_a"), None, nv, h)?,
            conv1d: conv.to_f32(&conv_name)?,
            a_log: r.vector(&format!("{l}A_log"), nv)?,
            dt_bias: r.vector(&format!("{l}dt_bias"), nv)?,
            norm: r.vector(&format!("{l}norm.weight"), c.linear_value_head_dim)?,
            out_proj: r.matrix(&format!("{l}out_proj"), None, h, c.linear_value_dim())?,
        })
    };

    let m = format!("{p}mlp.");
    let (e, inter, si) = (
        c.num_experts,
        c.moe_intermediate_size,
        c.shared_expert_intermediate_size,
    );
    let gate = r.matrix(&format!("{m}switch_mlp.gate_proj"), Some(e), inter, h)?;
    let up = r.matrix(&format!("{m}switch_mlp.up_proj"), Some(e), inter, h)?;
    let down = r.matrix(&format!("{m}switch_mlp.down_proj"), Some(e), h, inter)?;
    let experts = (0..e)
        .map(|x| FeedForward {
            gate: gate.rows_view(x * inter, inter),
            up: up.rows_view(x * inter, inter),
            down: down.rows_view(x * h, h),
        })
        .collect();
    let moe = MoeWeights {
        router: r.matrix(&format!("{m}gate"), None, e, h)?,
        experts,
        shared_expert: FeedForward {
            gate: r.matrix(&format!("{m}shared_expert.gate_proj"), None, si, h)?,
            up: r.matrix(&format!("{m}shared_expert.up_proj"), None, si, h)?,
            down: r.matrix(&format!("{m}shared_expert.down_proj"), None, h, si)?,
        },
        shared_expert_gate: r.matrix(&format!("{m}shared_expert_gate"), None, 1, h)?,
    };
    Ok(LayerWeights {
        input_norm: norm(&format!("{p}input_layernorm.weight"), h)?,
        post_attention_norm: norm(&format!("{p}post_attention_layernorm.weight"), h)?,
        mixer,
        moe,
    })
}

/// Typed lookups of MLX modules, checking every quantised tensor against the config.
struct Reader<'a> {
    store: &'a TensorStore,
    quant: &'a QuantConfig,
}

impl Reader<'_> {
    fn float_tensor(&self, name: &str) -> Result<&RawTensor, CheckpointError> {
        let t = self.store.get(name)?;
        if !is_float(t.dtype) {
            return Err(CheckpointError::DType {
                tensor: name.to_string(),
                file: t.file.display().to_string(),
                expected: "BF16, F16 or F32".into(),
                found: t.dtype.safetensors_name().into(),
            });
        }
        Ok(t)
    }

    fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>, CheckpointError> {
        let t = self.float_tensor(name)?;
        if t.shape != [n] {
            return Err(shape_err(name, t, vec![n]));
        }
        t.to_f32(name)
    }

    /// Module `module`'s weight: `[rows, cols]`, or with `stack = Some(n)` an `[n, rows, cols]`
    /// stack returned as one `[n·rows, cols]` matrix (take views per expert). Quantised iff
    /// `{module}.scales` exists.
    fn matrix(
        &self,
        module: &str,
        stack: Option<usize>,
        rows: usize,
        cols: usize,
    ) -> Result<Matrix, CheckpointError> {
        let weight_name = format!("{module}.weight");
        let scales_name = format!("{module}.scales");
        let biases_name = format!("{module}.biases");
        let weight = self.store.get(&weight_name)?;
        let shape = |last: usize| stack.into_iter().chain([rows, last]).collect::<Vec<_>>();
        let total_rows = stack.unwrap_or(1) * rows;
        let bad = |tensor: &str, t: &RawTensor, message: String| CheckpointError::Quantization {
            tensor: tensor.to_string(),
            file: t.file.display().to_string(),
            message,
        };

        let Some(scales) = self.store.tensors.get(&scales_name) else {
            if weight.dtype == DType::U32 {
                return Err(bad(
                    &weight_name,
                    weight,
                    format!("holds packed (U32) codes but `{scales_name}` is missing"),
                ));
            }
            if let Some(b) = self.store.tensors.get(&biases_name) {
                return Err(bad(
                    &biases_name,
                    b,
                    format!("exists but `{scales_name}` is missing"),
                ));
            }
            let t = self.float_tensor(&weight_name)?;
            if t.shape != shape(cols) {
                return Err(shape_err(&weight_name, t, shape(cols)));
            }
            return Ok(Matrix::dense(total_rows, cols, t.dtype, t.data.clone()));
        };

        let q = self.quant.for_module(module).ok_or_else(|| {
            bad(
                &scales_name,
                scales,
                format!("exists but config.json has no `quantization` parameters for `{module}`"),
            )
        })?;
        if cols % q.group_size != 0 {
            return Err(bad(
                &weight_name,
                weight,
                format!(
                    "has {cols} columns, which group size {} (config.json) does not divide",
                    q.group_size
                ),
            ));
        }
        let biases = self.store.tensors.get(&biases_name).ok_or_else(|| {
            bad(
                &biases_name,
                scales,
                format!("is missing: affine quantisation needs biases next to `{scales_name}`"),
            )
        })?;
        if weight.dtype != DType::U32 {
            return Err(bad(&weight_name, weight, format!("is quantised (`{scales_name}` exists) so it must hold U32 packed codes, found {}", weight.dtype.safetensors_name())));
        }
        let words = q.words_per_row(cols);
        if weight.shape != shape(words) {
            let hint = match weight.shape.last() {
                Some(&w) if weight.shape.len() == shape(words).len() && w > 0 && w != words => {
                    format!(
                        " ({w} words per row would mean {}-bit codes)",
                        w * 32 / cols
                    )
                }
                _ => String::new(),
            };
            return Err(bad(&weight_name, weight, format!(
                "has shape {:?}, but {cols} columns of {}-bit codes (config.json) pack into {words} u32 words per row: expected {:?}{hint}",
                weight.shape, q.bits, shape(words)
            )));
        }
        let groups = q.groups_per_row(cols);
        for (name, t) in [(&scales_name, scales), (&biases_name, biases)] {
            if !is_float(t.dtype) {
                return Err(bad(
                    name,
                    t,
                    format!(
                        "must be BF16, F16 or F32, found {}",
                        t.dtype.safetensors_name()
                    ),
                ));
            }
            if t.shape != shape(groups) {
                let hint = match t.shape.last() {
                    Some(&g)
                        if t.shape.len() == shape(groups).len()
                            && g > 0
                            && g != groups
                            && cols % g == 0 =>
                    {
                        format!(" ({g} groups per row would mean group size {})", cols / g)
                    }
                    _ => String::new(),
                };
                return Err(bad(name, t, format!(
                    "has shape {:?}, but group size {} (config.json) gives {groups} groups per row: expected {:?}{hint}",
                    t.shape, q.group_size, shape(groups)
                )));
            }
        }
        if biases.dtype != scales.dtype {
            return Err(bad(
                &biases_name,
                biases,
                format!(
                    "is {} but `{scales_name}` is {}",
                    biases.dtype.safetensors_name(),
                    scales.dtype.safetensors_name()
                ),
            ));
        }
        Ok(Matrix {
            rows: total_rows,
            cols,
            format: WeightFormat::Affine {
                bits: q.bits,
                group_size: q.group_size,
            },
            data: weight.data.clone(),
            scales: Some(scales.data.clone()),
            biases: Some(biases.data.clone()),
            scale_dtype: scales.dtype,
        })
    }
}

fn is_float(d: DType) -> bool {
    matches!(d, DType::F32 | DType::BF16 | DType::F16)
}

fn shape_err(name: &str, t: &RawTensor, expected: Vec<usize>) -> CheckpointError {
    CheckpointError::Shape {
        tensor: name.to_string(),
        file: t.file.display().to_string(),
        expected,
        found: t.shape.clone(),
    }
}

// ---------------------------------------------------------------------------------------------
// The plan: every tensor of the MLX checkpoint converted from a Hugging Face one.

/// One tensor as written to an MLX checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl TensorInfo {
    pub fn bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
}

/// How a weight matrix (or stack of them) is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatrixFormat {
    /// Unquantised, in this dtype (input width not a multiple of the group size).
    Dense(DType),
    /// Affine codes with scales and biases in `dtype`.
    Quantized { q: Affine, dtype: DType },
}

/// What becomes of one Hugging Face tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Conversion {
    /// A weight matrix or stack `[.., rows, cols]` written as module `modules[0]`; with
    /// `split_gate_up`, the fused expert `gate_up_proj` `[E, 2I, H]` written as two modules (the
    /// gate rows then the up rows of each expert).
    Matrix {
        modules: Vec<String>,
        format: MatrixFormat,
        split_gate_up: bool,
    },
    /// Any other tensor, cast to `dtype` and given `shape` (same element order); the
    /// zero-centred norms get `+ 1` first.
    Plain {
        name: String,
        dtype: DType,
        shape: Vec<usize>,
        plus_one: bool,
    },
}

/// One Hugging Face tensor and what it becomes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanItem {
    pub source: String,
    pub source_shape: Vec<usize>,
    pub conversion: Conversion,
}

impl PlanItem {
    /// The MLX tensors this item writes, in order.
    pub fn outputs(&self) -> Vec<TensorInfo> {
        match &self.conversion {
            Conversion::Plain {
                name, dtype, shape, ..
            } => vec![TensorInfo {
                name: name.clone(),
                dtype: *dtype,
                shape: shape.clone(),
            }],
            Conversion::Matrix {
                modules,
                format,
                split_gate_up,
            } => {
                let mut shape = self.source_shape.clone();
                let n = shape.len();
                let cols = shape[n - 1];
                if *split_gate_up {
                    shape[n - 2] /= 2;
                }
                let with_last = |last: usize| {
                    shape[..n - 1]
                        .iter()
                        .copied()
                        .chain([last])
                        .collect::<Vec<_>>()
                };
                let mut out = Vec::new();
                for m in modules {
                    match *format {
                        MatrixFormat::Dense(dtype) => out.push(TensorInfo {
                            name: format!("{m}.weight"),
                            dtype,
                            shape: with_last(cols),
                        }),
                        MatrixFormat::Quantized { q, dtype } => {
                            out.push(TensorInfo {
                                name: format!("{m}.weight"),
                                dtype: DType::U32,
                                shape: with_last(q.words_per_row(cols)),
                            });
                            out.push(TensorInfo {
                                name: format!("{m}.scales"),
                                dtype,
                                shape: with_last(q.groups_per_row(cols)),
                            });
                            out.push(TensorInfo {
                                name: format!("{m}.biases"),
                                dtype,
                                shape: with_last(q.groups_per_row(cols)),
                            });
                        }
                    }
                }
                out
            }
        }
    }
}

/// Every tensor of an MLX checkpoint and the config block that describes its quantisation.
#[derive(Debug, Clone)]
pub struct Plan {
    pub items: Vec<PlanItem>,
    /// The `quantization` block for config.json (mlx-lm writes it twice, also as
    /// `quantization_config`).
    pub quantization: Map<String, Value>,
}

impl Plan {
    pub fn tensors(&self) -> Vec<TensorInfo> {
        self.items.iter().flat_map(PlanItem::outputs).collect()
    }
    /// Bytes of tensor data in the checkpoint.
    pub fn total_bytes(&self) -> usize {
        self.tensors().iter().map(TensorInfo::bytes).sum()
    }
    /// Parameters as mlx-lm counts them for the index: a quantised weight counts its logical
    /// elements, scales and biases do not count, and neither do `A_log` and `dt_bias` (mlx-lm
    /// only counts the parameters of leaf modules, and those two belong to the GDN mixer itself).
    pub fn total_parameters(&self) -> usize {
        self.items
            .iter()
            .map(|i| match &i.conversion {
                Conversion::Matrix { .. } => i.source_shape.iter().product(),
                Conversion::Plain { name, .. }
                    if name.ends_with("A_log") || name.ends_with("dt_bias") =>
                {
                    0
                }
                Conversion::Plain { shape, .. } => shape.iter().product::<usize>(),
            })
            .sum()
    }
}

/// What `plan` needs to know about the source checkpoint and the conversion.
pub struct PlanOptions<'a> {
    /// Prefix of the language model's tensors in the source: `model.language_model.` (official
    /// layout) or `model.` (text-only layout).
    pub source_prefix: &'a str,
    /// Global quantisation parameters.
    pub quant: Affine,
    /// The dtype every floating tensor except `A_log` is cast to (mlx-lm's conversion dtype), or
    /// `None` to keep each source tensor's dtype.
    pub cast_to: Option<DType>,
    /// The dtype of a source tensor, by name.
    pub source_dtype: &'a dyn Fn(&str) -> DType,
    /// Carry the MTP head (`mtp.*`, kept under the same names, quantised as the layers are):
    /// what drafting needs, which mlx-lm's conversion drops.
    pub mtp: bool,
}

/// The MLX checkpoint `mlx_lm.convert -q` makes of a Hugging Face checkpoint of `c`.
///
/// mlx-lm gives the routers and shared-expert gates 8 bits with group 64 even when the global
/// group size is another; where 64 does not divide their width mlx-lm fails, and this plan leaves
/// them unquantised instead.
pub fn plan(c: &ModelConfig, o: &PlanOptions) -> Plan {
    let h = c.hidden_size;
    let sp = o.source_prefix;
    let out_dtype = |src: &str| o.cast_to.unwrap_or_else(|| (o.source_dtype)(src));
    let mut quantization = Map::new();
    quantization.insert("group_size".into(), json!(o.quant.group_size));
    quantization.insert("bits".into(), json!(o.quant.bits));
    quantization.insert("mode".into(), json!("affine"));
    let mut items = Vec::new();

    // `modules` is one module, or the gate and up modules that a fused `gate_up_proj` splits into.
    let mut matrix =
        |items: &mut Vec<PlanItem>, source: String, shape: Vec<usize>, modules: Vec<String>| {
            let cols = *shape.last().expect("matrices have columns");
            let dtype = out_dtype(&source);
            let module = &modules[0];
            let is_gate = module.ends_with("mlp.gate") || module.ends_with("shared_expert_gate");
            let format = if cols % o.quant.group_size != 0
                || (is_gate && cols % GATE_QUANT.group_size != 0)
            {
                MatrixFormat::Dense(dtype)
            } else if is_gate {
                quantization.insert(
                    module.clone(),
                    json!({"group_size": GATE_QUANT.group_size, "bits": GATE_QUANT.bits}),
                );
                MatrixFormat::Quantized {
                    q: GATE_QUANT,
                    dtype,
                }
            } else {
                MatrixFormat::Quantized { q: o.quant, dtype }
            };
            let split_gate_up = modules.len() == 2;
            items.push(PlanItem {
                source,
                source_shape: shape,
                conversion: Conversion::Matrix {
                    modules,
                    format,
                    split_gate_up,
                },
            });
        };
    let plain = |items: &mut Vec<PlanItem>,
                 source: String,
                 source_shape: Vec<usize>,
                 name: String,
                 shape: Vec<usize>,
                 plus_one: bool| {
        // mlx-lm keeps A_log in its source dtype (its cast predicate excludes it).
        let dtype = if source.ends_with("A_log") {
            (o.source_dtype)(&source)
        } else {
            out_dtype(&source)
        };
        items.push(PlanItem {
            source,
            source_shape,
            conversion: Conversion::Plain {
                name,
                dtype,
                shape,
                plus_one,
            },
        });
    };

    let mp = MODEL_PREFIX;
    matrix(
        &mut items,
        format!("{sp}embed_tokens.weight"),
        vec![c.vocab_size, h],
        vec![format!("{mp}embed_tokens")],
    );
    // (source prefix, destination prefix, full attention) of each decoder layer; the MTP head's
    // layer is one more full-attention layer.
    let mut layers: Vec<(String, String, bool)> = (0..c.num_hidden_layers)
        .map(|i| {
            let (src, dst) = (format!("{sp}layers.{i}."), format!("{mp}layers.{i}."));
            (src, dst, c.is_full_attention(i))
        })
        .collect();
    if o.mtp {
        layers.push(("mtp.layers.0.".into(), "mtp.layers.0.".into(), true));
    }
    for (src, dst, full_attention) in layers {
        if full_attention {
            let q_out = 2 * c.num_attention_heads * c.head_dim;
            let kv_out = c.num_key_value_heads * c.head_dim;
            let o_in = c.num_attention_heads * c.head_dim;
            for (n, shape) in [
                ("q_proj", [q_out, h]),
                ("k_proj", [kv_out, h]),
                ("v_proj", [kv_out, h]),
                ("o_proj", [h, o_in]),
            ] {
                matrix(
                    &mut items,
                    format!("{src}self_attn.{n}.weight"),
                    shape.to_vec(),
                    vec![format!("{dst}self_attn.{n}")],
                );
            }
            for n in ["q_norm", "k_norm"] {
                let name = format!("self_attn.{n}.weight");
                plain(
                    &mut items,
                    format!("{src}{name}"),
                    vec![c.head_dim],
                    format!("{dst}{name}"),
                    vec![c.head_dim],
                    true,
                );
            }
        } else {
            let (nv, k, conv) = (
                c.linear_num_value_heads,
                c.linear_conv_kernel_dim,
                c.conv_dim(),
            );
            let l = "linear_attn.";
            for (n, rows) in [
                ("in_proj_qkv", conv),
                ("in_proj_z", c.linear_value_dim()),
                ("in_proj_b", nv),
                ("in_proj_a", nv),
            ] {
                matrix(
                    &mut items,
                    format!("{src}{l}{n}.weight"),
                    vec![rows, h],
                    vec![format!("{dst}{l}{n}")],
                );
            }
            plain(
                &mut items,
                format!("{src}{l}conv1d.weight"),
                vec![conv, 1, k],
                format!("{dst}{l}conv1d.weight"),
                vec![conv, k, 1],
                false,
            );
            for (n, len) in [
                ("A_log", nv),
                ("dt_bias", nv),
                ("norm.weight", c.linear_value_head_dim),
            ] {
                plain(
                    &mut items,
                    format!("{src}{l}{n}"),
                    vec![len],
                    format!("{dst}{l}{n}"),
                    vec![len],
                    false,
                );
            }
            matrix(
                &mut items,
                format!("{src}{l}out_proj.weight"),
                vec![h, c.linear_value_dim()],
                vec![format!("{dst}{l}out_proj")],
            );
        }
        for n in ["input_layernorm.weight", "post_attention_layernorm.weight"] {
            plain(
                &mut items,
                format!("{src}{n}"),
                vec![h],
                format!("{dst}{n}"),
                vec![h],
                true,
            );
        }
        let (m, mo) = (format!("{src}mlp."), format!("{dst}mlp."));
        let (e, inter, si) = (
            c.num_experts,
            c.moe_intermediate_size,
            c.shared_expert_intermediate_size,
        );
        matrix(
            &mut items,
            format!("{m}gate.weight"),
            vec![e, h],
            vec![format!("{mo}gate")],
        );
        let (gate, up) = (
            format!("{mo}switch_mlp.gate_proj"),
            format!("{mo}switch_mlp.up_proj"),
        );
        matrix(
            &mut items,
            format!("{m}experts.gate_up_proj"),
            vec![e, 2 * inter, h],
            vec![gate, up],
        );
        matrix(
            &mut items,
            format!("{m}experts.down_proj"),
            vec![e, h, inter],
            vec![format!("{mo}switch_mlp.down_proj")],
        );
        for (n, shape) in [
            ("gate_proj", [si, h]),
            ("up_proj", [si, h]),
            ("down_proj", [h, si]),
        ] {
            matrix(
                &mut items,
                format!("{m}shared_expert.{n}.weight"),
                shape.to_vec(),
                vec![format!("{mo}shared_expert.{n}")],
            );
        }
        matrix(
            &mut items,
            format!("{m}shared_expert_gate.weight"),
            vec![1, h],
            vec![format!("{mo}shared_expert_gate")],
        );
    }
    plain(
        &mut items,
        format!("{sp}norm.weight"),
        vec![h],
        format!("{mp}norm.weight"),
        vec![h],
        true,
    );
    if o.mtp {
        matrix(
            &mut items,
            "mtp.fc.weight".into(),
            vec![h, 2 * h],
            vec!["mtp.fc".into()],
        );
        for n in [
            "pre_fc_norm_embedding.weight",
            "pre_fc_norm_hidden.weight",
            "norm.weight",
        ] {
            let name = format!("mtp.{n}");
            plain(&mut items, name.clone(), vec![h], name, vec![h], true);
        }
    }
    if !c.tie_word_embeddings {
        matrix(
            &mut items,
            "lm_head.weight".into(),
            vec![c.vocab_size, h],
            vec![LM_HEAD.into()],
        );
    }
    Plan {
        items,
        quantization,
    }
}

/// mlx-lm's conversion dtype for a source config.json: `torch_dtype`, else `text_config.dtype`,
/// when it names a float type; `None` keeps every tensor's own dtype.
pub fn conversion_dtype(root: &Value) -> Option<DType> {
    let name = root
        .get("torch_dtype")
        .or_else(|| root.get("text_config").and_then(|t| t.get("dtype")));
    match name.and_then(Value::as_str) {
        Some("bfloat16") => Some(DType::BF16),
        Some("float16") => Some(DType::F16),
        Some("float32") => Some(DType::F32),
        _ => None,
    }
}

/// The config.json mlx-lm writes for a converted model: the source config without
/// `_name_or_path` and `vision_config`, with `eos_token_id` from generation_config.json (when
/// given), the quantisation block under both names, top-level keys sorted.
pub fn converted_config(
    source: &Value,
    generation_eos: Option<&Value>,
    quantization: &Map<String, Value>,
) -> Value {
    let mut root = source.as_object().cloned().unwrap_or_default();
    root.remove("_name_or_path");
    root.remove("vision_config");
    if let Some(eos) = generation_eos {
        root.insert("eos_token_id".into(), eos.clone());
    }
    root.insert("quantization".into(), Value::Object(quantization.clone()));
    root.insert(
        "quantization_config".into(),
        Value::Object(quantization.clone()),
    );
    let mut keys: Vec<String> = root.keys().cloned().collect();
    keys.sort();
    Value::Object(
        keys.into_iter()
            .map(|k| {
                let v = root.remove(&k).expect("key listed from the map");
                (k, v)
            })
            .collect(),
    )
}
