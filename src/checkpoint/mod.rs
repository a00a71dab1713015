//! Every way weights arrive, mapped onto one canonical set of weights ([`crate::model::Weights`]).

pub mod fp8;
pub mod gguf;
pub mod mlx;
pub mod mlx_write;
pub mod safetensors;
pub mod synth;
pub mod tensor;

use std::path::Path;

use crate::config::{ConfigError, ModelConfig};
use crate::model::weights::{
    AttentionWeights, DeltaNetWeights, FeedForward, LayerWeights, Matrix, Mixer, MoeWeights,
    MtpWeights, WeightFormat, Weights,
};
use tensor::{DType, RawTensor, TensorStore};

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{file}: {message}")]
    Header { file: String, message: String },
    #[error("{file}: tensor `{tensor}` needs bytes up to {needed} but the file has {size}: the file is truncated")]
    Truncated {
        file: String,
        tensor: String,
        needed: usize,
        size: usize,
    },
    #[error("no *.safetensors files in {dir}")]
    NoWeights { dir: String },
    #[error("tensor `{tensor}` is missing from the checkpoint in {location}")]
    Missing { tensor: String, location: String },
    #[error("{file}: tensor `{tensor}` has shape {found:?}, expected {expected:?}")]
    Shape {
        tensor: String,
        file: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("{file}: tensor `{tensor}` has dtype {found}, expected {expected}")]
    DType {
        tensor: String,
        file: String,
        expected: String,
        found: String,
    },
    #[error("{file}: tensor `{tensor}` {message}")]
    Quantization {
        tensor: String,
        file: String,
        message: String,
    },
}

/// Loads the checkpoint at `path`: a GGUF file (or a directory whose only weights are one
/// `.gguf` file), else a directory with `config.json` and safetensors in the Hugging Face
/// layout (bf16/f16/f32, or the official FP8 release) or the MLX layout.
pub fn load(path: &Path) -> Result<Weights, CheckpointError> {
    if let Some(file) = gguf::find(path)? {
        return gguf::load(&file);
    }
    let config = ModelConfig::from_dir(path)?;
    let store = safetensors::open_dir(path)?;
    if mlx::is_mlx_layout(&store) {
        return mlx::load(path, config, &store);
    }
    let config_path = path.join("config.json");
    let text = std::fs::read_to_string(&config_path).map_err(|source| CheckpointError::Io {
        path: config_path.display().to_string(),
        source,
    })?;
    let root: serde_json::Value =
        serde_json::from_str(&text).map_err(|source| crate::config::ConfigError::Json {
            path: config_path.display().to_string(),
            source,
        })?;
    from_store(config, &store, fp8::block_size(&root)?)
}

/// Builds canonical weights from the tensors of a Hugging Face–layout checkpoint: the official
/// multimodal naming (`model.language_model.*`, vision tower ignored) or the text-only naming
/// (`model.*`); routed experts fused (`experts.gate_up_proj`) or one module per expert (as the
/// FP8 release stores them). `fp8_block` is the tile size of an FP8 checkpoint's
/// `weight_scale_inv` (from its config), `None` for an unquantised one.
pub fn from_store(
    config: ModelConfig,
    store: &TensorStore,
    fp8_block: Option<usize>,
) -> Result<Weights, CheckpointError> {
    let prefix = if store.contains("model.language_model.embed_tokens.weight") {
        "model.language_model."
    } else {
        "model."
    };
    let r = Reader { store, fp8_block };
    let c = &config;
    let h = c.hidden_size;

    let embed = r.matrix(&format!("{prefix}embed_tokens.weight"), c.vocab_size, h)?;
    let lm_head = if store.contains("lm_head.weight") || !c.tie_word_embeddings {
        r.matrix("lm_head.weight", c.vocab_size, h)?
    } else {
        embed.clone()
    };
    let final_norm = r.norm_plus_one(&format!("{prefix}norm.weight"), h)?;

    let layers = (0..c.num_hidden_layers)
        .map(|i| {
            layer(
                &r,
                c,
                &format!("{prefix}layers.{i}."),
                c.is_full_attention(i),
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mtp_tensors: Vec<String> = store
        .tensors
        .keys()
        .filter(|k| k.starts_with("mtp."))
        .cloned()
        .collect();
    // The head is read when the config says there is one and its tensors are there (a
    // checkpoint stripped of them still runs, without drafts); a head with a tensor missing or
    // misshapen is a corrupt checkpoint.
    let mtp = if c.mtp_num_hidden_layers > 0 && store.contains("mtp.fc.weight") {
        Some(MtpWeights {
            embedding_norm: r.norm_plus_one("mtp.pre_fc_norm_embedding.weight", h)?,
            hidden_norm: r.norm_plus_one("mtp.pre_fc_norm_hidden.weight", h)?,
            fc: r.matrix("mtp.fc.weight", h, 2 * h)?,
            layer: layer(&r, c, "mtp.layers.0.", true)?,
            norm: r.norm_plus_one("mtp.norm.weight", h)?,
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

/// The decoder layer whose tensors start with `p` (`model.layers.3.`, `mtp.layers.0.`): its
/// mixer, full attention or Gated DeltaNet, and its MoE.
fn layer(
    r: &Reader,
    c: &ModelConfig,
    p: &str,
    full_attention: bool,
) -> Result<LayerWeights, CheckpointError> {
    let h = c.hidden_size;
    let store = r.store;
    let mixer = if full_attention {
        let a = format!("{p}self_attn.");
        let q_out = 2 * c.num_attention_heads * c.head_dim;
        let kv_out = c.num_key_value_heads * c.head_dim;
        Mixer::Attention(AttentionWeights {
            q_proj: r.matrix(&format!("{a}q_proj.weight"), q_out, h)?,
            k_proj: r.matrix(&format!("{a}k_proj.weight"), kv_out, h)?,
            v_proj: r.matrix(&format!("{a}v_proj.weight"), kv_out, h)?,
            o_proj: r.matrix(
                &format!("{a}o_proj.weight"),
                h,
                c.num_attention_heads * c.head_dim,
            )?,
            q_norm: r.norm_plus_one(&format!("{a}q_norm.weight"), c.head_dim)?,
            k_norm: r.norm_plus_one(&format!("{a}k_norm.weight"), c.head_dim)?,
        })
    } else {
        let l = format!("{p}linear_attn.");
        let nv = c.linear_num_value_heads;
        let conv = r.store.get(&format!("{l}conv1d.weight"))?;
        let kernel = c.linear_conv_kernel_dim;
        // [conv_dim, 1, K] in PyTorch; [conv_dim, K, 1] in MLX. Same element order.
        if conv.numel() != c.conv_dim() * kernel || conv.shape.first() != Some(&c.conv_dim()) {
            return Err(CheckpointError::Shape {
                tensor: format!("{l}conv1d.weight"),
                file: conv.file.display().to_string(),
                expected: vec![c.conv_dim(), 1, kernel],
                found: conv.shape.clone(),
            });
        }
        Mixer::DeltaNet(DeltaNetWeights {
            in_proj_qkv: r.matrix(&format!("{l}in_proj_qkv.weight"), c.conv_dim(), h)?,
            in_proj_z: r.matrix(&format!("{l}in_proj_z.weight"), c.linear_value_dim(), h)?,
            in_proj_b: r.matrix(&format!("{l}in_proj_b.weight"), nv, h)?,
            in_proj_a: r.matrix(&format!("{l}in_proj_a.weight"), nv, h)?,
            conv1d: conv.to_f32(&format!("{l}conv1d.weight"))?,
            a_log: r.vector(&format!("{l}A_log"), nv)?,
            dt_bias: r.vector(&format!("{l}dt_bias"), nv)?,
            norm: r.vector(&format!("{l}norm.weight"), c.linear_value_head_dim)?,
            out_proj: r.matrix(&format!("{l}out_proj.weight"), h, c.linear_value_dim())?,
        })
    };

    let m = format!("{p}mlp.");
    let e = c.num_experts;
    let inter = c.moe_intermediate_size;
    let experts = if store.contains(&format!("{m}experts.gate_up_proj")) {
        let gate_up = r.stacked(&format!("{m}experts.gate_up_proj"), e, 2 * inter, h)?;
        let down = r.stacked(&format!("{m}experts.down_proj"), e, h, inter)?;
        (0..e)
            .map(|x| FeedForward {
                gate: gate_up.rows_view(x * 2 * inter, inter),
                up: gate_up.rows_view(x * 2 * inter + inter, inter),
                down: down.rows_view(x * h, h),
            })
            .collect()
    } else {
        (0..e)
            .map(|x| {
                let x = format!("{m}experts.{x}.");
                Ok(FeedForward {
                    gate: r.matrix(&format!("{x}gate_proj.weight"), inter, h)?,
                    up: r.matrix(&format!("{x}up_proj.weight"), inter, h)?,
                    down: r.matrix(&format!("{x}down_proj.weight"), h, inter)?,
                })
            })
            .collect::<Result<_, CheckpointError>>()?
    };
    let si = c.shared_expert_intermediate_size;
    let moe = MoeWeights {
        router: r.matrix(&format!("{m}gate.weight"), e, h)?,
        experts,
        shared_expert: FeedForward {
            gate: r.matrix(&format!("{m}shared_expert.gate_proj.weight"), si, h)?,
            up: r.matrix(&format!("{m}shared_expert.up_proj.weight"), si, h)?,
            down: r.matrix(&format!("{m}shared_expert.down_proj.weight"), h, si)?,
        },
        shared_expert_gate: r.matrix(&format!("{m}shared_expert_gate.weight"), 1, h)?,
    };
    Ok(LayerWeights {
        input_norm: r.norm_plus_one(&format!("{p}input_layernorm.weight"), h)?,
        post_attention_norm: r.norm_plus_one(&format!("{p}post_attention_layernorm.weight"), h)?,
        mixer,
        moe,
    })
}

/// Typed lookups with shape and dtype checks.
struct Reader<'a> {
    store: &'a TensorStore,
    fp8_block: Option<usize>,
}

impl Reader<'_> {
    fn float_tensor(&self, name: &str, shape: &[usize]) -> Result<&RawTensor, CheckpointError> {
        let t = self.store.get_shaped(name, shape)?;
        if !matches!(t.dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(CheckpointError::DType {
                tensor: name.to_string(),
                file: t.file.display().to_string(),
                expected: "BF16, F16 or F32".into(),
                found: t.dtype.safetensors_name().into(),
            });
        }
        Ok(t)
    }
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix, CheckpointError> {
        let t = self.store.get_shaped(name, &[rows, cols])?;
        if t.dtype == DType::F8E4M3 {
            return self.fp8_matrix(name, t, rows, cols);
        }
        let t = self.float_tensor(name, &[rows, cols])?;
        Ok(Matrix::dense(rows, cols, t.dtype, t.data.clone()))
    }
    /// An F8_E4M3 weight with its `{name}_scale_inv` tile multipliers.
    fn fp8_matrix(
        &self,
        name: &str,
        t: &RawTensor,
        rows: usize,
        cols: usize,
    ) -> Result<Matrix, CheckpointError> {
        let bad = |message: String| CheckpointError::Quantization {
            tensor: name.to_string(),
            file: t.file.display().to_string(),
            message,
        };
        let block = self.fp8_block.ok_or_else(|| {
            bad("is F8_E4M3 but config.json has no `quantization_config` with quant_method \"fp8\" and weight_block_size".into())
        })?;
        let scale_name = format!("{name}_scale_inv");
        let s = self
            .store
            .get_shaped(&scale_name, &[rows.div_ceil(block), cols.div_ceil(block)])?;
        if !matches!(s.dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(bad(format!(
                "has scales `{scale_name}` of dtype {}; expected BF16, F16 or F32",
                s.dtype.safetensors_name()
            )));
        }
        Ok(Matrix {
            rows,
            cols,
            format: WeightFormat::Fp8 { block },
            data: t.data.clone(),
            scales: Some(s.data.clone()),
            biases: None,
            scale_dtype: s.dtype,
        })
    }
    /// A `[n, rows, cols]` stack as one `[n·rows, cols]` matrix (take views per expert).
    fn stacked(
        &self,
        name: &str,
        n: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Matrix, CheckpointError> {
        let t = self.float_tensor(name, &[n, rows, cols])?;
        Ok(Matrix::dense(n * rows, cols, t.dtype, t.data.clone()))
    }
    fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>, CheckpointError> {
        self.float_tensor(name, &[n])?.to_f32(name)
    }
    /// A zero-centred norm weight as its effective multiplier `1 + w`.
    fn norm_plus_one(&self, name: &str, n: usize) -> Result<Vec<f32>, CheckpointError> {
        Ok(self.vector(name, n)?.into_iter().map(|w| 1.0 + w).collect())
    }
}
