//! `lily agree`: greedy decoding on a device against the CPU reference (src/agree.rs).

use std::path::PathBuf;

use clap::Args;

use lily::agree;
use lily::bench::synthetic_prompt;
use lily::checkpoint;

#[derive(Args)]
pub struct AgreeArgs {
    /// Model directory or GGUF file.
    #[arg(long)]
    pub model: PathBuf,
    /// The device checked against the CPU: cuda or cuda:N (cpu checks the comparison itself).
    #[arg(long, default_value = "cuda")]
    pub device: String,
    /// Prompt length (synthetic token ids, as `lily bench` makes them).
    #[arg(long, default_value_t = 4096)]
    pub prompt_tokens: usize,
    /// Greedy tokens compared.
    #[arg(long, default_value_t = 256)]
    pub tokens: usize,
    /// Also write the report here (markdown).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// The CPU reference rounds its router logits to bf16 as the GPU does: what remains of the
    /// distance is then not routing flipped at near-ties by that rounding.
    #[arg(long)]
    pub reference_router_bf16: bool,
    /// The CPU reference rounds its activations to bf16 where a bf16 engine stores them (every
    /// matmul and norm output, the residual stream, ...; src/model/cpu/ops.rs): how far bf16
    /// activations alone move the model from the f32 reference (with `--device cpu`).
    #[arg(long)]
    pub reference_bf16_activations: bool,
    /// Run the reference a second time with bf16 activations and let each position's logits differ
    /// from the f32 reference by twice what that moves them (if more than 8e-2): the rule the bf16
    /// fixtures are held to (twice the CPU time).
    #[arg(long)]
    pub bf16_bound: bool,
    /// The CPU reference runs the experts the device chose (traced), instead of its own top-k:
    /// routing flipped at a random router's near-ties then no longer separates the two, and
    /// every flipped choice is checked against the device's own router logits (src/agree.rs).
    #[arg(long)]
    pub device_routing: bool,
}

pub fn run(args: AgreeArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.prompt_tokens > 0 && args.tokens > 0,
        "--prompt-tokens and --tokens must be positive"
    );
    // The device first, then the CPU on a second copy of the weights (the device backend keeps
    // what it needs on the GPU).
    let weights = checkpoint::load(&args.model)?;
    let prompt = synthetic_prompt(args.prompt_tokens, weights.config.vocab_size, 7);
    let context = args.prompt_tokens + args.tokens + 1;
    let gpu = super::device::GpuOptions {
        slots: Some(1),
        batch_steps: Some(false),
    };
    let mut backend = super::device::backend(&args.device, weights, context, gpu)?;
    let device = backend.device_name();
    eprintln!(
        "{device}: {} greedy tokens after {} prompt tokens",
        args.tokens, args.prompt_tokens
    );
    let run = agree::device_run(backend.as_mut(), &prompt, args.tokens, args.device_routing)?;
    drop(backend);
    eprintln!("CPU reference, teacher-forced on the device's tokens");
    let weights = checkpoint::load(&args.model)?;
    lily::model::cpu::moe::ROUTER_LOGITS_BF16.store(
        args.reference_router_bf16,
        std::sync::atomic::Ordering::Relaxed,
    );
    lily::model::cpu::ops::ACTIVATIONS_BF16.store(
        args.reference_bf16_activations,
        std::sync::atomic::Ordering::Relaxed,
    );
    let report = agree::compare(&weights, device, &prompt, &run, args.bf16_bound)?;
    let md = report.to_markdown();
    print!("{md}");
    if let Some(out) = &args.out {
        std::fs::write(out, &md)?;
    }
    anyhow::ensure!(
        report.passes(),
        "{} divergences are not near-ties, {} positions' logits differ by more than {:.0e} of their \
         range, {} rows' device routing is not the top-k of its own router logits",
        report.unexplained(),
        report.out_of_tolerance(),
        agree::MAX_LOGIT_ERROR,
        report.inconsistent_routing()
    );
    Ok(())
}
