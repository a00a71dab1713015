//! `lily generate`: greedy generation from token ids (text prompts arrive with the tokenizer).

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;

use lily::checkpoint;
use lily::model::cpu::{forward, Logits};
use lily::model::{argmax, SequenceState};

#[derive(Args)]
pub struct GenerateArgs {
    /// Model directory.
    #[arg(long)]
    pub model: PathBuf,
    /// Prompt as comma-separated token ids.
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Vec<u32>,
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let weights = checkpoint::load(&args.model)?;
    let vocab = weights.config.vocab_size;
    anyhow::ensure!(
        !args.prompt_ids.is_empty(),
        "--prompt-ids needs at least one token id"
    );
    if let Some(bad) = args.prompt_ids.iter().find(|&&id| id as usize >= vocab) {
        anyhow::bail!("token id {bad} is out of range: the model's vocabulary has {vocab} entries");
    }
    let mut state = SequenceState::new(&weights.config);
    let t0 = Instant::now();
    let mut logits = forward(&weights, &args.prompt_ids, &mut state, Logits::Last);
    let prefill = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut out = Vec::with_capacity(args.max_tokens);
    for i in 0..args.max_tokens {
        let next = argmax(&logits);
        out.push(next);
        if i + 1 < args.max_tokens {
            logits = forward(&weights, &[next], &mut state, Logits::Last);
        }
    }
    let decode = t1.elapsed().as_secs_f64();
    println!(
        "{}",
        out.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
    );
    eprintln!(
        "prefill {} tokens: {:.1} tok/s; decode {} tokens: {:.1} tok/s (cpu, greedy)",
        args.prompt_ids.len(),
        args.prompt_ids.len() as f64 / prefill,
        out.len(),
        out.len() as f64 / decode.max(1e-9)
    );
    Ok(())
}
