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
    /// Save the device's run here and stop (the reference runs later with --load-run): a
    /// full-size comparison can then span several calls on the GPU machine.
    #[arg(long)]
    pub save_run: Option<PathBuf>,
    /// Compare a run saved with --save-run instead of running the device.
    #[arg(long)]
    pub load_run: Option<PathBuf>,
    /// Save the f32 reference's run here (with --bf16-bound, stop before the bf16 pass; finish
    /// with --load-reference).
    #[arg(long)]
    pub save_reference: Option<PathBuf>,
    /// Use the f32 reference run saved with --save-reference instead of running it again.
    #[arg(long)]
    pub load_reference: Option<PathBuf>,
}

pub fn run(args: AgreeArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.prompt_tokens > 0 && args.tokens > 0,
        "--prompt-tokens and --tokens must be positive"
    );
    // Each stage's wall time, to plan runs that must fit the GPU machine's calls.
    let start = std::time::Instant::now();
    let done = |what: &str| eprintln!("{what} after {:.1} s", start.elapsed().as_secs_f64());
    let (device, run) = match &args.load_run {
        Some(path) => {
            let saved = agree::store::load_run(path)?;
            anyhow::ensure!(
                saved.prompt_tokens == args.prompt_tokens && saved.run.steps.len() == args.tokens,
                "{} holds {} tokens after a {}-token prompt, not {} after {}",
                path.display(),
                saved.run.steps.len(),
                saved.prompt_tokens,
                args.tokens,
                args.prompt_tokens
            );
            (saved.device, saved.run)
        }
        None => device_side(&args)?,
    };
    done("device run");
    if let Some(path) = &args.save_run {
        let saved = agree::store::SavedRun {
            device,
            prompt_tokens: args.prompt_tokens,
            run,
        };
        agree::store::save_run(path, &saved)?;
        eprintln!("device run saved to {}", path.display());
        return Ok(());
    }
    eprintln!("CPU reference, teacher-forced on the device's tokens");
    let weights = checkpoint::load(&args.model)?;
    let prompt = synthetic_prompt(args.prompt_tokens, weights.config.vocab_size, 7);
    lily::model::cpu::moe::ROUTER_LOGITS_BF16.store(
        args.reference_router_bf16,
        std::sync::atomic::Ordering::Relaxed,
    );
    lily::model::cpu::ops::ACTIVATIONS_BF16.store(
        args.reference_bf16_activations,
        std::sync::atomic::Ordering::Relaxed,
    );
    let f32_run = match &args.load_reference {
        Some(path) => {
            let values = run.steps.len() * weights.config.vocab_size;
            agree::store::load_reference(path, values)?
        }
        None => agree::reference_run(&weights, &prompt, &run, false)?,
    };
    done("reference");
    if let Some(path) = &args.save_reference {
        agree::store::save_reference(path, &f32_run)?;
        eprintln!("reference run saved to {}", path.display());
        if args.bf16_bound {
            return Ok(());
        }
    }
    let bf16_run = if args.bf16_bound {
        eprintln!("CPU reference again, with bf16 activations");
        let bf16 = agree::reference_run(&weights, &prompt, &run, true)?;
        done("reference with bf16 activations");
        Some(bf16)
    } else {
        None
    };
    let report = agree::report(device, prompt.len(), &run, &f32_run, bf16_run.as_ref());
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

/// The device's greedy run (its routing traced with --device-routing).
fn device_side(args: &AgreeArgs) -> anyhow::Result<(String, agree::DeviceRun)> {
    // The device first, then the CPU on a second copy of the weights (the device backend keeps
    // what it needs on the GPU).
    let weights = checkpoint::load(&args.model)?;
    let prompt = synthetic_prompt(args.prompt_tokens, weights.config.vocab_size, 7);
    let context = args.prompt_tokens + args.tokens + 1;
    let gpu = super::device::GpuOptions {
        slots: Some(1),
        batch_steps: Some(false),
        ..super::device::GpuOptions::default()
    };
    let mut backend = super::device::backend(&args.device, weights, context, gpu)?;
    let device = backend.device_name();
    eprintln!(
        "{device}: {} greedy tokens after {} prompt tokens",
        args.tokens, args.prompt_tokens
    );
    let run = agree::device_run(backend.as_mut(), &prompt, args.tokens, args.device_routing)?;
    Ok((device, run))
}
