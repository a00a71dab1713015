//! Random-weight checkpoints of any configuration, written in the official Hugging Face layout
//! (config.json with `text_config`, `model.safetensors.index.json`, shards), so that speed can
//! be measured on the real shapes without the real weights.
//!
//! Initialisation follows transformers: matrices ~ N(0, 0.02), zero-centred norms 0 (effective
//! gain 1), the GDN gated-norm weight 1, `A_log = ln U(1, 16)`, `dt_bias = 1`, conv weights
//! U(−1/√K, 1/√K). Tensors are generated in parallel chunks and streamed to disk, so a
//! full-size model never sits in memory.
//!
//! With `--quant`, the same values (rounded to the chosen dtype) are quantised on the fly and
//! written in the MLX layout: byte for byte what `lily quantize` makes of the unquantised
//! checkpoint with the same seed.

use std::io::Write;
use std::path::Path;

use rayon::prelude::*;
use serde_json::{json, Value};

use super::mlx::{self, Plan, PlanOptions};
use super::mlx_write::{self, Values};
use super::tensor::DType;
use super::CheckpointError;
use crate::config::ModelConfig;
use crate::quant::{self, Affine};

/// Shards are cut at about this many bytes by default.
pub const SHARD_BYTES: usize = 4 << 30;
/// Elements generated per parallel task; each chunk of each tensor has its own random stream.
pub const CHUNK: usize = 1 << 22;

/// The configuration presets `lily synth --config` knows by name.
pub fn preset(name: &str) -> Option<Value> {
    match name {
        "qwen3.6-35b-a3b" => Some(json!({
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "model_type": "qwen3_5_moe",
            "tie_word_embeddings": false,
            "image_token_id": 248056, "video_token_id": 248057,
            "vision_start_token_id": 248053, "vision_end_token_id": 248054,
            "text_config": {
                "attention_bias": false, "attention_dropout": 0.0, "attn_output_gate": true,
                "bos_token_id": 248044, "dtype": "bfloat16", "eos_token_id": 248044,
                "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
                "initializer_range": 0.02,
                "layer_types": (0..40).map(|i| if (i + 1) % 4 == 0 { "full_attention" } else { "linear_attention" }).collect::<Vec<_>>(),
                "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
                "linear_num_value_heads": 32, "linear_value_head_dim": 128, "mamba_ssm_dtype": "float32",
                "max_position_embeddings": 262144, "model_type": "qwen3_5_moe_text",
                "moe_intermediate_size": 512, "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": false,
                "num_attention_heads": 16, "num_experts": 256, "num_experts_per_tok": 8,
                "num_hidden_layers": 40, "num_key_value_heads": 2, "output_router_logits": false,
                "pad_token_id": null, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
                "rope_parameters": {"mrope_interleaved": true, "mrope_section": [11, 11, 10],
                                    "partial_rotary_factor": 0.25, "rope_theta": 10000000, "rope_type": "default"},
                "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512,
                "tie_word_embeddings": false, "use_cache": true, "vocab_size": 248320
            }
        })),
        // A small model with the real structure: the built-in demo model and quick tests.
        "tiny" => Some(json!({
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "model_type": "qwen3_5_moe",
            "tie_word_embeddings": false,
            "text_config": {
                "model_type": "qwen3_5_moe_text", "hidden_act": "silu", "attention_bias": false,
                "hidden_size": 64, "num_hidden_layers": 8, "full_attention_interval": 4, "vocab_size": 1024,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
                "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 32, "rms_norm_eps": 1e-06,
                "max_position_embeddings": 32768, "eos_token_id": 0, "mtp_num_hidden_layers": 0,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                    "mrope_interleaved": true, "mrope_section": [2, 1, 1]}
            }
        })),
        _ => None,
    }
}

/// How the values of one tensor are drawn.
#[derive(Debug, Clone, Copy)]
enum Init {
    Normal(f32),
    Uniform(f32, f32),
    /// `ln U(lo, hi)`.
    LogUniform(f32, f32),
    Const(f32),
}

struct Spec {
    name: String,
    shape: Vec<usize>,
    init: Init,
}

/// Every tensor of the official layout for `c`, in a stable order.
fn tensor_specs(c: &ModelConfig) -> Vec<Spec> {
    let h = c.hidden_size;
    let std = Init::Normal(0.02);
    let mut v = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, init: Init| v.push(Spec { name, shape, init });
    let lm = "model.language_model.";
    add(
        format!("{lm}embed_tokens.weight"),
        vec![c.vocab_size, h],
        std,
    );
    let attention_layer = |add: &mut dyn FnMut(String, Vec<usize>, Init), p: &str| {
        let a = format!("{p}self_attn.");
        add(
            format!("{a}q_proj.weight"),
            vec![2 * c.num_attention_heads * c.head_dim, h],
            std,
        );
        add(
            format!("{a}k_proj.weight"),
            vec![c.num_key_value_heads * c.head_dim, h],
            std,
        );
        add(
            format!("{a}v_proj.weight"),
            vec![c.num_key_value_heads * c.head_dim, h],
            std,
        );
        add(
            format!("{a}o_proj.weight"),
            vec![h, c.num_attention_heads * c.head_dim],
            std,
        );
        add(
            format!("{a}q_norm.weight"),
            vec![c.head_dim],
            Init::Const(0.0),
        );
        add(
            format!("{a}k_norm.weight"),
            vec![c.head_dim],
            Init::Const(0.0),
        );
    };
    let moe_and_norms = |add: &mut dyn FnMut(String, Vec<usize>, Init), p: &str| {
        add(
            format!("{p}input_layernorm.weight"),
            vec![h],
            Init::Const(0.0),
        );
        add(
            format!("{p}post_attention_layernorm.weight"),
            vec![h],
            Init::Const(0.0),
        );
        let m = format!("{p}mlp.");
        add(format!("{m}gate.weight"), vec![c.num_experts, h], std);
        add(
            format!("{m}experts.gate_up_proj"),
            vec![c.num_experts, 2 * c.moe_intermediate_size, h],
            std,
        );
        add(
            format!("{m}experts.down_proj"),
            vec![c.num_experts, h, c.moe_intermediate_size],
            std,
        );
        let si = c.shared_expert_intermediate_size;
        add(
            format!("{m}shared_expert.gate_proj.weight"),
            vec![si, h],
            std,
        );
        add(format!("{m}shared_expert.up_proj.weight"), vec![si, h], std);
        add(
            format!("{m}shared_expert.down_proj.weight"),
            vec![h, si],
            std,
        );
        add(format!("{m}shared_expert_gate.weight"), vec![1, h], std);
    };
    for i in 0..c.num_hidden_layers {
        let p = format!("{lm}layers.{i}.");
        if c.is_full_attention(i) {
            attention_layer(&mut add, &p);
        } else {
            let l = format!("{p}linear_attn.");
            let nv = c.linear_num_value_heads;
            let k = c.linear_conv_kernel_dim;
            add(format!("{l}in_proj_qkv.weight"), vec![c.conv_dim(), h], std);
            add(
                format!("{l}in_proj_z.weight"),
                vec![c.linear_value_dim(), h],
                std,
            );
            add(format!("{l}in_proj_b.weight"), vec![nv, h], std);
            add(format!("{l}in_proj_a.weight"), vec![nv, h], std);
            let bound = 1.0 / (k as f32).sqrt();
            add(
                format!("{l}conv1d.weight"),
                vec![c.conv_dim(), 1, k],
                Init::Uniform(-bound, bound),
            );
            add(format!("{l}A_log"), vec![nv], Init::LogUniform(1.0, 16.0));
            add(format!("{l}dt_bias"), vec![nv], Init::Const(1.0));
            add(
                format!("{l}norm.weight"),
                vec![c.linear_value_head_dim],
                Init::Const(1.0),
            );
            add(
                format!("{l}out_proj.weight"),
                vec![h, c.linear_value_dim()],
                std,
            );
        }
        moe_and_norms(&mut add, &p);
    }
    add(format!("{lm}norm.weight"), vec![h], Init::Const(0.0));
    if !c.tie_word_embeddings {
        add("lm_head.weight".into(), vec![c.vocab_size, h], std);
    }
    for _ in 0..c.mtp_num_hidden_layers.min(1) {
        add(
            "mtp.pre_fc_norm_embedding.weight".into(),
            vec![h],
            Init::Const(0.0),
        );
        add(
            "mtp.pre_fc_norm_hidden.weight".into(),
            vec![h],
            Init::Const(0.0),
        );
        add("mtp.fc.weight".into(), vec![h, 2 * h], std);
        attention_layer(&mut add, "mtp.layers.0.");
        moe_and_norms(&mut add, "mtp.layers.0.");
        add("mtp.norm.weight".into(), vec![h], Init::Const(0.0));
    }
    v
}

/// A small, fast, seedable generator (SplitMix64): each chunk of each tensor gets its own
/// stream, so the output does not depend on the number of threads.
struct SplitMix(u64);

impl SplitMix {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in (0, 1).
    fn unit(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 + 0.5) / (1u64 << 24) as f32
    }
}

fn fill(init: Init, seed: u64, out: &mut [f32]) {
    let mut rng = SplitMix(seed);
    match init {
        Init::Const(c) => out.fill(c),
        Init::Uniform(lo, hi) => out
            .iter_mut()
            .for_each(|x| *x = lo + (hi - lo) * rng.unit()),
        Init::LogUniform(lo, hi) => out
            .iter_mut()
            .for_each(|x| *x = (lo + (hi - lo) * rng.unit()).ln()),
        Init::Normal(std) => {
            // Box–Muller, two values per pair of uniforms.
            for pair in out.chunks_mut(2) {
                let (u1, u2) = (rng.unit(), rng.unit());
                let r = (-2.0 * u1.ln()).sqrt() * std;
                let t = std::f32::consts::TAU * u2;
                pair[0] = r * t.cos();
                if pair.len() > 1 {
                    pair[1] = r * t.sin();
                }
            }
        }
    }
}

/// Chunk `ci` (`n` values) of tensor number `index` of the spec list.
fn chunk_values(init: Init, index: usize, ci: usize, seed: u64, n: usize) -> Vec<f32> {
    let mut vals = vec![0f32; n];
    let stream = seed ^ ((index as u64) << 32) ^ ci as u64;
    fill(init, stream.wrapping_mul(0x2545_F491_4F6C_DD1D), &mut vals);
    vals
}

fn encode(values: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::BF16 => values
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect(),
        other => panic!("synth writes f32 or bf16, not {other:?}"),
    }
}

/// Writes a random checkpoint of the configuration `config_json` (a full config.json value)
/// to `out`, in shards of about `shard_bytes`. Returns the total bytes of tensor data written.
pub fn write_checkpoint(
    config_json: &Value,
    out: &Path,
    seed: u64,
    dtype: DType,
    shard_bytes: usize,
    progress: bool,
) -> anyhow::Result<usize> {
    let config = ModelConfig::from_json(config_json)?;
    let specs = tensor_specs(&config);
    std::fs::create_dir_all(out)?;
    let cfg = with_dtype(config_json, dtype);
    std::fs::write(out.join("config.json"), serde_json::to_string_pretty(&cfg)?)?;

    // Plan shards.
    let bytes_of = |s: &Spec| s.shape.iter().product::<usize>() * dtype.size();
    let mut shards: Vec<Vec<usize>> = vec![Vec::new()];
    let mut in_shard = 0;
    for (i, s) in specs.iter().enumerate() {
        if in_shard > 0 && in_shard + bytes_of(s) > shard_bytes {
            shards.push(Vec::new());
            in_shard = 0;
        }
        shards.last_mut().expect("one shard").push(i);
        in_shard += bytes_of(s);
    }
    let total: usize = specs.iter().map(bytes_of).sum();
    let bar = if progress {
        indicatif::ProgressBar::new(total as u64)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .expect("static template"),
    );

    let n_shards = shards.len();
    let mut weight_map = serde_json::Map::new();
    for (si, members) in shards.iter().enumerate() {
        let file = if n_shards == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", si + 1, n_shards)
        };
        // Header first: every size is known before any value is drawn.
        let mut header = serde_json::Map::new();
        let mut offset = 0;
        for &i in members {
            let s = &specs[i];
            header.insert(s.name.clone(), json!({"dtype": dtype.safetensors_name(), "shape": s.shape, "data_offsets": [offset, offset + bytes_of(s)]}));
            offset += bytes_of(s);
            weight_map.insert(s.name.clone(), json!(file));
        }
        let mut h = serde_json::to_vec(&Value::Object(header))?;
        while h.len() % 8 != 0 {
            h.push(b' ');
        }
        let mut f =
            std::io::BufWriter::with_capacity(1 << 24, std::fs::File::create(out.join(&file))?);
        f.write_all(&(h.len() as u64).to_le_bytes())?;
        f.write_all(&h)?;
        for &i in members {
            let s = &specs[i];
            let numel: usize = s.shape.iter().product();
            let chunks = numel.div_ceil(CHUNK);
            // Generate a window of chunks in parallel, write it in order, repeat.
            let window = rayon::current_num_threads() * 2;
            for w0 in (0..chunks).step_by(window) {
                let encoded: Vec<Vec<u8>> = (w0..(w0 + window).min(chunks))
                    .into_par_iter()
                    .map(|ci| {
                        encode(
                            &chunk_values(s.init, i, ci, seed, CHUNK.min(numel - ci * CHUNK)),
                            dtype,
                        )
                    })
                    .collect();
                for e in encoded {
                    f.write_all(&e)?;
                    bar.inc(e.len() as u64);
                }
            }
        }
        f.flush()?;
    }
    bar.finish_and_clear();
    let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    std::fs::write(
        out.join("model.safetensors.index.json"),
        serde_json::to_string_pretty(&index)?,
    )?;
    Ok(total)
}

/// `config_json` with `text_config.dtype` naming `dtype`.
fn with_dtype(config_json: &Value, dtype: DType) -> Value {
    let mut cfg = config_json.clone();
    let dtype_name = if dtype == DType::BF16 {
        "bfloat16"
    } else {
        "float32"
    };
    if let Some(tc) = cfg.get_mut("text_config").and_then(Value::as_object_mut) {
        tc.insert("dtype".into(), json!(dtype_name));
    }
    cfg
}

/// The MLX checkpoint `write_mlx_checkpoint` writes for `config_json` (a full config.json
/// value), planned from the shapes alone: its size is known without writing it.
pub fn mlx_plan(config_json: &Value, dtype: DType, q: Affine) -> anyhow::Result<Plan> {
    let config = ModelConfig::from_json(config_json)?;
    let cfg = with_dtype(config_json, dtype);
    Ok(mlx::plan(
        &config,
        &PlanOptions {
            source_prefix: "model.language_model.",
            quant: q,
            cast_to: mlx::conversion_dtype(&cfg),
            source_dtype: &|_| dtype,
            mtp: config.mtp_num_hidden_layers > 0,
        },
    ))
}

/// Writes a random checkpoint of `config_json` in the MLX layout, quantised with `q`: the
/// values of `write_checkpoint` with the same seed and dtype, converted as `mlx_lm.convert -q`
/// converts. Returns the bytes of tensor data written.
pub fn write_mlx_checkpoint(
    config_json: &Value,
    out: &Path,
    seed: u64,
    dtype: DType,
    q: Affine,
    shard_bytes: usize,
    progress: bool,
) -> anyhow::Result<usize> {
    let config = ModelConfig::from_json(config_json)?;
    let plan = mlx_plan(config_json, dtype, q)?;
    let values = SynthValues {
        specs: tensor_specs(&config)
            .into_iter()
            .enumerate()
            .map(|(i, s)| (s.name, (i, s.init, s.shape.iter().product())))
            .collect(),
        seed,
        dtype,
    };
    let cfg = mlx::converted_config(&with_dtype(config_json, dtype), None, &plan.quantization);
    mlx_write::write(&plan, &values, &cfg, out, shard_bytes, progress)
}

/// The values `write_checkpoint` writes, drawn on demand: per tensor name, its index in the spec
/// list (which seeds its streams), its initialisation and its number of elements.
struct SynthValues {
    specs: std::collections::HashMap<String, (usize, Init, usize)>,
    seed: u64,
    dtype: DType,
}

impl Values for SynthValues {
    fn read(&self, name: &str, start: usize, out: &mut [f32]) -> Result<(), CheckpointError> {
        let &(index, init, numel) =
            self.specs
                .get(name)
                .ok_or_else(|| CheckpointError::Missing {
                    tensor: name.to_string(),
                    location: "the synthetic model".into(),
                })?;
        let end = start + out.len();
        assert!(end <= numel, "read past the end of {name}");
        let mut pos = start;
        while pos < end {
            let ci = pos / CHUNK;
            let first = ci * CHUNK;
            let vals = chunk_values(init, index, ci, self.seed, CHUNK.min(numel - first));
            let take = (first + vals.len()).min(end) - pos;
            for (o, v) in out[pos - start..pos - start + take]
                .iter_mut()
                .zip(&vals[pos - first..])
            {
                *o = quant::round_to(*v, self.dtype);
            }
            pos += take;
        }
        Ok(())
    }
    fn dtype(&self, _name: &str) -> Result<DType, CheckpointError> {
        Ok(self.dtype)
    }
}
