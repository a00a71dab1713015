//! `lily bench`: the prompt × context sweep; writes CSV, a markdown table and PNG charts.

use std::path::PathBuf;

use clap::Args;

use lily::bench::{self, BenchOptions};
use lily::checkpoint;
use lily::model::{Backend, CpuBackend};

#[derive(Args)]
pub struct BenchArgs {
    /// Model directory.
    #[arg(long, conflicts_with = "synthetic")]
    pub model: Option<PathBuf>,
    /// A synthetic model preset (random weights): `tiny` or `qwen3.6-35b-a3b`.
    #[arg(long)]
    pub synthetic: Option<String>,
    /// Contexts (prompt lengths) to measure.
    #[arg(long, value_delimiter = ',', default_values_t = bench::CONTEXTS)]
    pub contexts: Vec<usize>,
    #[arg(long, default_value_t = 64)]
    pub decode_steps: usize,
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    /// Directory for bench.csv, bench.md, prefill.png and decode.png.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    let _tmp;
    let dir = match (&args.model, &args.synthetic) {
        (Some(d), _) => d.clone(),
        (None, Some(name)) => {
            let cfg = checkpoint::synth::preset(name).ok_or_else(|| {
                anyhow::anyhow!("unknown preset `{name}` (tiny, qwen3.6-35b-a3b)")
            })?;
            let tmp =
                std::env::temp_dir().join(format!("lily-bench-{name}-{}", std::process::id()));
            checkpoint::synth::write_checkpoint(
                &cfg,
                &tmp,
                0,
                checkpoint::tensor::DType::BF16,
                checkpoint::synth::SHARD_BYTES,
                true,
            )?;
            _tmp = TempDir(tmp.clone());
            tmp
        }
        (None, None) => anyhow::bail!("give --model DIR or --synthetic PRESET"),
    };
    let weights = checkpoint::load(&dir)?;
    let mut backend: Box<dyn Backend> = Box::new(CpuBackend::new(weights));
    let options = BenchOptions {
        contexts: args.contexts.clone(),
        decode_steps: args.decode_steps,
        rounds: args.rounds,
    };
    eprintln!(
        "device: {}; batch 1; {} decode steps; median of {} rounds",
        backend.device_name(),
        options.decode_steps,
        options.rounds
    );
    let points = bench::sweep(backend.as_mut(), &options, |p| {
        eprintln!(
            "context {:>6}: prefill {:>9.1} tok/s, decode {:>7.1} tok/s",
            p.context, p.prefill_tok_s, p.decode_tok_s
        )
    })?;
    let md = bench::to_markdown(&points);
    println!("{md}");
    if let Some(out) = &args.out {
        std::fs::create_dir_all(out)?;
        std::fs::write(out.join("bench.csv"), bench::to_csv(&points))?;
        std::fs::write(out.join("bench.md"), md)?;
        let engines = vec![(format!("lily ({})", backend.device_name()), points.clone())];
        std::fs::write(out.join("prefill.png"), bench::to_png(&engines, "prefill"))?;
        std::fs::write(out.join("decode.png"), bench::to_png(&engines, "decode"))?;
    }
    Ok(())
}

/// Removes a synthetic checkpoint when the command ends.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
