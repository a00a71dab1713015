//! `lily quantize`: turn an unquantised Hugging Face checkpoint into an MLX affine-quantised one,
//! the same tensors, dtypes, names and config block `mlx_lm.convert -q` writes (MODEL.md §5.1).

use std::path::PathBuf;

use clap::Args;

use lily::checkpoint::mlx_write;
use lily::quant::Affine;

#[derive(Args)]
pub struct QuantizeArgs {
    /// The unquantised model directory (Hugging Face layout, bf16 or f32).
    #[arg(long)]
    pub model: PathBuf,
    /// Output directory; must not exist yet, or be empty.
    #[arg(long)]
    pub out: PathBuf,
    /// Bits per weight (2, 4 or 8); routers and shared-expert gates always get 8.
    #[arg(long, default_value_t = 4)]
    pub bits: u32,
    /// Columns sharing one scale and bias; must divide a matrix's columns for it to be quantised.
    #[arg(long, default_value_t = 64)]
    pub group_size: usize,
}

pub fn run(args: QuantizeArgs) -> anyhow::Result<()> {
    let q = Affine::new(args.bits, args.group_size)?;
    // Refuse to mix a new checkpoint into an old one (as mlx_lm.convert refuses).
    if let Ok(mut entries) = std::fs::read_dir(&args.out) {
        anyhow::ensure!(
            entries.next().is_none(),
            "{} exists and is not empty",
            args.out.display()
        );
    }
    let start = std::time::Instant::now();
    let bytes = mlx_write::quantize_dir(&args.model, &args.out, q, true)?;
    let secs = start.elapsed().as_secs_f64();
    println!(
        "wrote {} ({:.2} GB, {}-bit, group {}) in {secs:.1} s",
        args.out.display(),
        bytes as f64 / 1e9,
        q.bits,
        q.group_size
    );
    Ok(())
}
