//! Logits of the CPU reference forward pass for token-id prompts, for comparisons with other
//! implementations (tools/check_mlx.py):
//!
//!     cargo run --release --example logits -- MODEL_DIR OUT.safetensors 1,2,3 4,5 ...
//!
//! Each prompt runs from a fresh state in one forward call; OUT gets `p{i}.logits`, F32 `[T, vocab]`.

use std::path::PathBuf;

use anyhow::Context;
use lily::checkpoint::{self, safetensors, tensor::DType};
use lily::model::cpu::{forward, Logits};
use lily::model::SequenceState;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [model, out, prompts @ ..] = args.as_slice() else {
        anyhow::bail!("usage: logits MODEL_DIR OUT.safetensors IDS[,IDS...] ...");
    };
    let weights = checkpoint::load(&PathBuf::from(model))?;
    let vocab = weights.config.vocab_size;
    let mut tensors = Vec::new();
    for (p, prompt) in prompts.iter().enumerate() {
        let ids: Vec<u32> = prompt
            .split(',')
            .map(|s| {
                s.trim()
                    .parse()
                    .with_context(|| format!("prompt {p}: `{s}` is not a token id"))
            })
            .collect::<Result<_, _>>()?;
        anyhow::ensure!(
            ids.iter().all(|&i| (i as usize) < vocab),
            "prompt {p}: a token id is ≥ the vocabulary size {vocab}"
        );
        let mut state = SequenceState::new(&weights.config);
        let logits = forward(&weights, &ids, &mut state, Logits::All);
        tensors.push((
            format!("p{p}.logits"),
            DType::F32,
            vec![ids.len(), vocab],
            logits.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ));
    }
    safetensors::write_file(&PathBuf::from(out), &tensors)?;
    Ok(())
}
