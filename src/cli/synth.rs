//! `lily synth`: write a random-weight checkpoint in the official layout.

use std::path::PathBuf;

use clap::{Args, ValueEnum};

use lily::checkpoint::synth;
use lily::checkpoint::tensor::DType;

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
    let dtype = match args.dtype {
        SynthDType::Bf16 => DType::BF16,
        SynthDType::F32 => DType::F32,
    };
    let start = std::time::Instant::now();
    let bytes = synth::write_checkpoint(
        &config,
        &args.out,
        args.seed,
        dtype,
        synth::SHARD_BYTES,
        true,
    )?;
    let secs = start.elapsed().as_secs_f64();
    println!(
        "wrote {} ({:.2} GB) in {secs:.1} s ({:.2} GB/s)",
        args.out.display(),
        bytes as f64 / 1e9,
        bytes as f64 / 1e9 / secs
    );
    Ok(())
}
