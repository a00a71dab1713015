//! The model configuration, read from a Hugging Face `config.json`.
//!
//! Qwen3.6 checkpoints nest the language model's fields under `text_config` (model type
//! `qwen3_5_moe`); text-only re-uploads put them at the top level (`qwen3_5_moe_text`). Both are
//! accepted. Every field the forward pass depends on is checked here, so the backends can trust
//! the numbers; an error names the field and what was expected.

use std::path::Path;

use serde_json::Value;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not valid JSON: {source}")]
    Json {
        path: String,
        source: serde_json::Error,
    },
    #[error("config field `{field}`: expected {expected}, found {found}")]
    Field {
        field: String,
        expected: String,
        found: String,
    },
}

/// What kind of token mixer a decoder layer has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerKind {
    /// Gated DeltaNet (linear attention with a recurrent state).
    LinearAttention,
    /// Gated full attention with a KV cache.
    FullAttention,
}

/// The language model's hyper-parameters (MODEL.md §1).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ModelConfig {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub layer_types: Vec<LayerKind>,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub tie_word_embeddings: bool,
    // Full attention.
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    /// Number of leading dims of each head that rotate (head_dim · partial_rotary_factor).
    pub rotary_dim: usize,
    pub rope_theta: f64,
    // Gated DeltaNet.
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_conv_kernel_dim: usize,
    // Mixture of experts.
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub shared_expert_intermediate_size: usize,
    // Generation facts carried by the config.
    pub max_position_embeddings: usize,
    pub eos_token_ids: Vec<u32>,
    pub mtp_num_hidden_layers: usize,
}

impl ModelConfig {
    /// Reads and validates `DIR/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self, ConfigError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_json_str(&text).map_err(|e| match e {
            ConfigError::Json { source, .. } => ConfigError::Json {
                path: path.display().to_string(),
                source,
            },
            other => other,
        })
    }

    pub fn from_json_str(text: &str) -> Result<Self, ConfigError> {
        let root: Value = serde_json::from_str(text).map_err(|source| ConfigError::Json {
            path: "config.json".into(),
            source,
        })?;
        Self::from_json(&root)
    }

    /// Parses the language-model part of a config (top level or `text_config`).
    pub fn from_json(root: &Value) -> Result<Self, ConfigError> {
        let (t, prefix) = match root.get("text_config") {
            Some(tc) if tc.is_object() => (tc, "text_config."),
            _ => (root, ""),
        };
        let f = Fields { obj: t, prefix };

        let model_type = root.get("model_type").and_then(Value::as_str).unwrap_or("");
        if !matches!(model_type, "qwen3_5_moe" | "qwen3_5_moe_text") {
            return Err(field_err(
                "model_type",
                "\"qwen3_5_moe\" or \"qwen3_5_moe_text\"",
                &json_repr(root.get("model_type")),
            ));
        }
        f.expect_str("hidden_act", "silu", true)?;
        f.expect_bool("attention_bias", false, true)?;
        if let Some(v) = t.get("norm_topk_prob") {
            if v.as_bool() != Some(true) {
                return Err(field_err(
                    &format!("{prefix}norm_topk_prob"),
                    "true (routing weights are renormalised)",
                    &v.to_string(),
                ));
            }
        }

        let num_hidden_layers = f.size("num_hidden_layers")?;
        let layer_types = match t.get("layer_types") {
            Some(Value::Array(items)) => {
                let mut kinds = Vec::with_capacity(items.len());
                for (i, item) in items.iter().enumerate() {
                    kinds.push(match item.as_str() {
                        Some("linear_attention") => LayerKind::LinearAttention,
                        Some("full_attention") => LayerKind::FullAttention,
                        _ => {
                            return Err(field_err(
                                &format!("{prefix}layer_types[{i}]"),
                                "\"linear_attention\" or \"full_attention\"",
                                &item.to_string(),
                            ))
                        }
                    });
                }
                if kinds.len() != num_hidden_layers {
                    return Err(field_err(
                        &format!("{prefix}layer_types"),
                        &format!("{num_hidden_layers} entries (num_hidden_layers)"),
                        &format!("{} entries", kinds.len()),
                    ));
                }
                kinds
            }
            Some(other) => {
                return Err(field_err(
                    &format!("{prefix}layer_types"),
                    "a list",
                    &other.to_string(),
                ))
            }
            None => {
                let interval = f.usize_or("full_attention_interval", 4)?;
                if interval == 0 {
                    return Err(field_err(
                        &format!("{prefix}full_attention_interval"),
                        "≥ 1",
                        "0",
                    ));
                }
                (0..num_hidden_layers)
                    .map(|i| {
                        if (i + 1) % interval == 0 {
                            LayerKind::FullAttention
                        } else {
                            LayerKind::LinearAttention
                        }
                    })
                    .collect()
            }
        };

        // RoPE: `rope_parameters` (transformers ≥ 5) or the older top-level fields.
        let rope = t
            .get("rope_parameters")
            .or_else(|| t.get("rope_scaling"))
            .filter(|v| v.is_object());
        let rope_fields = rope.map(|r| Fields {
            obj: r,
            prefix: if prefix.is_empty() {
                "rope_parameters."
            } else {
                "text_config.rope_parameters."
            },
        });
        // A rope field is read from `rope_parameters` when it is there, else from the top level.
        let rope_field = |key: &str, default: f64| match &rope_fields {
            Some(r) if r.obj.get(key).is_some() => r.f64(key),
            _ => f.f64_or(key, default),
        };
        let rope_theta = rope_field("rope_theta", 10000.0)?;
        if let Some(r) = &rope_fields {
            let rope_type = r
                .obj
                .get("rope_type")
                .or_else(|| r.obj.get("type"))
                .and_then(Value::as_str)
                .unwrap_or("default");
            if rope_type != "default" {
                return Err(field_err(
                    &format!("{}rope_type", r.prefix),
                    "\"default\" (YaRN is not supported yet)",
                    &format!("\"{rope_type}\""),
                ));
            }
        }
        let partial = rope_field("partial_rotary_factor", 0.25)?;

        let head_dim = f.size("head_dim")?;
        let rotary_dim = (head_dim as f64 * partial).round() as usize;
        if rotary_dim == 0 || rotary_dim % 2 != 0 || rotary_dim > head_dim {
            return Err(field_err(
                &format!("{prefix}partial_rotary_factor"),
                "a factor giving an even number of rotary dims ≤ head_dim",
                &format!("{partial} (→ {rotary_dim} of {head_dim})"),
            ));
        }
        if let Some(section) = rope
            .and_then(|r| r.get("mrope_section"))
            .and_then(Value::as_array)
        {
            let sum: u64 = section.iter().filter_map(Value::as_u64).sum();
            if sum as usize != rotary_dim / 2 {
                return Err(field_err(
                    &format!("{prefix}rope_parameters.mrope_section"),
                    &format!("sections summing to rotary_dim/2 = {}", rotary_dim / 2),
                    &json_repr(Some(&Value::Array(section.clone()))),
                ));
            }
        }

        let eos_token_ids = match t.get("eos_token_id").or_else(|| root.get("eos_token_id")) {
            Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(Value::as_u64)
                .map(|x| x as u32)
                .collect(),
            _ => Vec::new(),
        };

        let cfg = ModelConfig {
            hidden_size: f.size("hidden_size")?,
            num_hidden_layers,
            layer_types,
            vocab_size: f.size("vocab_size")?,
            rms_norm_eps: f.f64_or("rms_norm_eps", 1e-6)? as f32,
            tie_word_embeddings: t
                .get("tie_word_embeddings")
                .or_else(|| root.get("tie_word_embeddings"))
                .and_then(Value::as_bool)
                .unwrap_or(false),
            num_attention_heads: f.size("num_attention_heads")?,
            num_key_value_heads: f.size("num_key_value_heads")?,
            head_dim,
            rotary_dim,
            rope_theta,
            linear_num_key_heads: f.size("linear_num_key_heads")?,
            linear_num_value_heads: f.size("linear_num_value_heads")?,
            linear_key_head_dim: f.size("linear_key_head_dim")?,
            linear_value_head_dim: f.size("linear_value_head_dim")?,
            linear_conv_kernel_dim: f.size_or("linear_conv_kernel_dim", 4)?,
            num_experts: f.size("num_experts")?,
            num_experts_per_tok: f.size("num_experts_per_tok")?,
            moe_intermediate_size: f.size("moe_intermediate_size")?,
            shared_expert_intermediate_size: f.size("shared_expert_intermediate_size")?,
            max_position_embeddings: f.size_or("max_position_embeddings", 262_144)?,
            eos_token_ids,
            mtp_num_hidden_layers: f.size_or("mtp_num_hidden_layers", 0)?,
        };
        cfg.validate(prefix)?;
        Ok(cfg)
    }

    /// Cross-field checks: divisibility that the forward pass relies on.
    fn validate(&self, prefix: &str) -> Result<(), ConfigError> {
        let p = |name: &str| format!("{prefix}{name}");
        if self.num_key_value_heads == 0 || self.num_attention_heads % self.num_key_value_heads != 0
        {
            return Err(field_err(
                &p("num_key_value_heads"),
                &format!(
                    "a divisor of num_attention_heads ({})",
                    self.num_attention_heads
                ),
                &self.num_key_value_heads.to_string(),
            ));
        }
        if self.linear_num_key_heads == 0
            || self.linear_num_value_heads % self.linear_num_key_heads != 0
        {
            return Err(field_err(
                &p("linear_num_key_heads"),
                &format!(
                    "a divisor of linear_num_value_heads ({})",
                    self.linear_num_value_heads
                ),
                &self.linear_num_key_heads.to_string(),
            ));
        }
        if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.num_experts {
            return Err(field_err(
                &p("num_experts_per_tok"),
                &format!("1..={} (num_experts)", self.num_experts),
                &self.num_experts_per_tok.to_string(),
            ));
        }
        if self.linear_conv_kernel_dim < 1 {
            return Err(field_err(&p("linear_conv_kernel_dim"), "≥ 1", "0"));
        }
        for (name, v) in [
            ("hidden_size", self.hidden_size),
            ("vocab_size", self.vocab_size),
            ("head_dim", self.head_dim),
            ("linear_key_head_dim", self.linear_key_head_dim),
            ("linear_value_head_dim", self.linear_value_head_dim),
            ("moe_intermediate_size", self.moe_intermediate_size),
            (
                "shared_expert_intermediate_size",
                self.shared_expert_intermediate_size,
            ),
        ] {
            if v == 0 {
                return Err(field_err(&p(name), "> 0", "0"));
            }
        }
        if self.rms_norm_eps.is_nan() || self.rms_norm_eps <= 0.0 {
            return Err(field_err(
                &p("rms_norm_eps"),
                "> 0",
                &self.rms_norm_eps.to_string(),
            ));
        }
        Ok(())
    }

    pub fn is_full_attention(&self, layer: usize) -> bool {
        self.layer_types[layer] == LayerKind::FullAttention
    }
    /// Channels of the GDN causal conv: q ‖ k ‖ v.
    pub fn conv_dim(&self) -> usize {
        2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
    }
    pub fn linear_key_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }
    pub fn linear_value_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }
    /// Rows of a GDN layer's fused input projection: q‖k‖v (the conv's input), z, b and a.
    pub fn linear_in_proj_rows(&self) -> usize {
        self.conv_dim() + self.linear_value_dim() + 2 * self.linear_num_value_heads
    }

    /// Parameters of the text model (no MTP, no vision), counted from the shapes.
    pub fn parameter_counts(&self) -> ParameterCounts {
        let h = self.hidden_size;
        let gdn = self.conv_dim() * h
            + self.linear_value_dim() * h
            + 2 * self.linear_num_value_heads * h
            + self.conv_dim() * self.linear_conv_kernel_dim
            + 2 * self.linear_num_value_heads
            + self.linear_value_head_dim
            + h * self.linear_value_dim();
        let q_out = 2 * self.num_attention_heads * self.head_dim;
        let kv_out = self.num_key_value_heads * self.head_dim;
        let attn = q_out * h
            + 2 * kv_out * h
            + h * self.num_attention_heads * self.head_dim
            + 2 * self.head_dim;
        let expert = 3 * self.moe_intermediate_size * h;
        let shared = 3 * self.shared_expert_intermediate_size * h + h;
        let router = self.num_experts * h;
        let n_full = self
            .layer_types
            .iter()
            .filter(|k| **k == LayerKind::FullAttention)
            .count();
        let n_lin = self.num_hidden_layers - n_full;
        let mixers = n_lin * gdn + n_full * attn;
        let norms = self.num_hidden_layers * 2 * h + h;
        let embed = self.vocab_size * h;
        let head = if self.tie_word_embeddings {
            0
        } else {
            self.vocab_size * h
        };
        let per_layer_moe_total = router + self.num_experts * expert + shared;
        let per_layer_moe_active = router + self.num_experts_per_tok * expert + shared;
        ParameterCounts {
            total: embed + head + mixers + norms + self.num_hidden_layers * per_layer_moe_total,
            active: h
                + self.vocab_size * h
                + mixers
                + norms
                + self.num_hidden_layers * per_layer_moe_active,
        }
    }
}

/// Total and per-token active parameters. Active counts one embedding row and the LM head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParameterCounts {
    pub total: usize,
    pub active: usize,
}

/// Generous upper bounds of the sizes a config gives (several times any real model's), so that
/// a corrupt file fails with a message instead of asking for terabytes.
fn max_size(key: &str) -> usize {
    match key {
        "num_hidden_layers" => 1024,
        "mtp_num_hidden_layers" => 64,
        "hidden_size" => 1 << 16,
        "vocab_size" => 1 << 23,
        "num_attention_heads"
        | "num_key_value_heads"
        | "linear_num_key_heads"
        | "linear_num_value_heads" => 1024,
        "head_dim" | "linear_key_head_dim" | "linear_value_head_dim" => 4096,
        "linear_conv_kernel_dim" => 64,
        "num_experts" | "num_experts_per_tok" => 1 << 16,
        "moe_intermediate_size" | "shared_expert_intermediate_size" => 1 << 18,
        "max_position_embeddings" => 1 << 27,
        _ => usize::MAX,
    }
}

fn bounded(field: &str, v: usize, max: usize) -> Result<usize, ConfigError> {
    if v > max {
        return Err(field_err(field, &format!("at most {max}"), &v.to_string()));
    }
    Ok(v)
}

fn field_err(field: &str, expected: &str, found: &str) -> ConfigError {
    ConfigError::Field {
        field: field.to_string(),
        expected: expected.to_string(),
        found: found.to_string(),
    }
}

fn json_repr(v: Option<&Value>) -> String {
    v.map(|v| v.to_string())
        .unwrap_or_else(|| "nothing (missing)".into())
}

/// Typed access to a JSON object with errors that name the field.
struct Fields<'a> {
    obj: &'a Value,
    prefix: &'a str,
}

impl Fields<'_> {
    fn name(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }
    fn usize(&self, key: &str) -> Result<usize, ConfigError> {
        let v = self.obj.get(key);
        v.and_then(Value::as_u64)
            .map(|x| x as usize)
            .ok_or_else(|| field_err(&self.name(key), "a non-negative integer", &json_repr(v)))
    }
    fn usize_or(&self, key: &str, default: usize) -> Result<usize, ConfigError> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(_) => self.usize(key),
        }
    }
    /// A size at most [`max_size`] allows: a corrupt or absurd value (a billion layers) is an
    /// error here, not an allocation that aborts the process later.
    fn size(&self, key: &str) -> Result<usize, ConfigError> {
        let v = self.usize(key)?;
        bounded(&self.name(key), v, max_size(key))
    }
    fn size_or(&self, key: &str, default: usize) -> Result<usize, ConfigError> {
        let v = self.usize_or(key, default)?;
        bounded(&self.name(key), v, max_size(key))
    }
    fn f64(&self, key: &str) -> Result<f64, ConfigError> {
        let v = self.obj.get(key);
        v.and_then(Value::as_f64)
            .ok_or_else(|| field_err(&self.name(key), "a number", &json_repr(v)))
    }
    fn f64_or(&self, key: &str, default: f64) -> Result<f64, ConfigError> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(_) => self.f64(key),
        }
    }
    fn expect_str(&self, key: &str, want: &str, optional: bool) -> Result<(), ConfigError> {
        match self.obj.get(key) {
            None if optional => Ok(()),
            Some(Value::String(s)) if s == want => Ok(()),
            other => Err(field_err(
                &self.name(key),
                &format!("\"{want}\""),
                &json_repr(other),
            )),
        }
    }
    fn expect_bool(&self, key: &str, want: bool, optional: bool) -> Result<(), ConfigError> {
        match self.obj.get(key) {
            None if optional => Ok(()),
            Some(Value::Bool(b)) if *b == want => Ok(()),
            other => Err(field_err(
                &self.name(key),
                &want.to_string(),
                &json_repr(other),
            )),
        }
    }
}
