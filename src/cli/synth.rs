//! `lily synth`: write a random-weight checkpoint in the official layout, or quantised in the MLX
//! layout.

use std::path::PathBuf;

use clap::{Args, ValueEnum};

use lily::checkpoint::tensor::DType;
use lily::checkpoint::{mlx_write, synth};
use lily::quant::Affine;

#[derive(Args)]
pub struct SynthArgs {
    /// A preset (`tiny`, `qwen3.6-35b-a3b`) or a config.json file.
    #[arg(long)]
    pub config: String,
    /// Output directory.
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long, value_enum, default_value_t = SynthDType::Bf16)]
    pub dtype: SynthDType,
    /// Write an MLX checkpoint quantised as `lily quantize` would quantise the same model
    /// (group 64; routers and shared-expert gates 8-bit; the MTP head kept). The full-size q4
    /// model is ≈ 19.5 GB, and 0.48 GB more with its MTP head.
    #[arg(long, value_enum)]
    pub quant: Option<SynthQuant>,
    /// Keep only the first N layers (and their pattern of layer types): the same widths at less
    /// depth, e.g. to see how the GPU's distance from the CPU reference grows with depth.
    #[arg(long)]
    pub layers: Option<usize>,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum SynthQuant {
    Q4,
    Q8,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum SynthDType {
    Bf16,
    F32,
}

pub fn run(args: SynthArgs) -> anyhow::Result<()> {
    let config = match synth::preset(&args.config) {
        Some(c) => c,
        None => {
            let text = std::fs::read_to_string(&args.config).map_err(|e| {
                anyhow::anyhow!(
                    "`{}` is neither a preset (tiny, qwen3.6-35b-a3b) nor a readable file: {e}",
                    args.config
                )
            })?;
            serde_json::from_str(&text)?
        }
    };
    let mut config = config;
    if let Some(layers) = args.layers {
        keep_layers(&mut config, layers)?;
    }
    let dtype = match args.dtype {
        SynthDType::Bf16 => DType::BF16,
        SynthDType::F32 => DType::F32,
    };
    let start = std::time::Instant::now();
    let bytes = match args.quant {
        None => synth::write_checkpoint(
            &config,
            &args.out,
            args.seed,
            dtype,
            synth::SHARD_BYTES,
            true,
        )?,
        Some(quant) => {
            let bits = match quant {
                SynthQuant::Q4 => 4,
                SynthQuant::Q8 => 8,
            };
            let q = Affine::new(bits, 64)?;
            synth::write_mlx_checkpoint(
                &config,
                &args.out,
                args.seed,
                dtype,
                q,
                mlx_write::SHARD_BYTES,
                true,
            )?
        }
    };
    let secs = start.elapsed().as_secs_f64();
    println!(
        "wrote {} ({:.2} GB) in {secs:.1} s ({:.2} GB/s)",
        args.out.display(),
        bytes as f64 / 1e9,
        bytes as f64 / 1e9 / secs
    );
    Ok(())
}

/// Cuts a config.json (flat, or with the text model under `text_config`) to its first `layers`
/// layers.
fn keep_layers(config: &mut serde_json::Value, layers: usize) -> anyhow::Result<()> {
    let text = if config.get("text_config").is_some() {
        &mut config["text_config"]
    } else {
        config
    };
    let have = text["num_hidden_layers"].as_u64().unwrap_or(0) as usize;
    anyhow::ensure!(
        (1..=have).contains(&layers),
        "--layers {layers}: the config has {have} layers"
    );
    text["num_hidden_layers"] = layers.into();
    if let Some(types) = text.get_mut("layer_types").and_then(|t| t.as_array_mut()) {
        types.truncate(layers);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keep_layers_cuts_depth_and_pattern() {
        let mut c = synth::preset("qwen3.6-35b-a3b").unwrap();
        keep_layers(&mut c, 4).unwrap();
        let config = lily::config::ModelConfig::from_json(&c).unwrap();
        assert_eq!(config.num_hidden_layers, 4);
        assert_eq!(config.layer_types.len(), 4);
        assert_eq!(config.hidden_size, 2048);
        assert!(keep_layers(&mut c, 5).is_err(), "more layers than it has");
        assert!(keep_layers(&mut c, 0).is_err(), "no layers");
    }
}
