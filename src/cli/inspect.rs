//! `lily inspect`: what a checkpoint holds and what it needs.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use clap::Args;

use lily::checkpoint;
use lily::model::convert;

/// Rows of each matrix `inspect` converts to measure the conversion error (all rows of the
/// full model would take minutes).
const CONVERSION_SAMPLE_ROWS: usize = 64;

#[derive(Args)]
pub struct InspectArgs {
    /// Model directory (safetensors: Hugging Face bf16/FP8 or MLX) or GGUF file.
    #[arg(long)]
    pub model: PathBuf,
}

pub fn run(args: InspectArgs) -> anyhow::Result<()> {
    let weights = checkpoint::load(&args.model)?;
    let c = &weights.config;
    let n_full = c
        .layer_types
        .iter()
        .filter(|k| **k == lily::config::LayerKind::FullAttention)
        .count();
    println!("model: {}", args.model.display());
    if let Some(file) = checkpoint::gguf::find(&args.model)? {
        println!("file: GGUF ({}), llama.cpp's layout", file.display());
    }
    println!(
        "layers: {} ({} Gated DeltaNet, {} full attention); hidden {}; vocab {}; experts {} (top {}), expert width {}, shared {}",
        c.num_hidden_layers,
        c.num_hidden_layers - n_full,
        n_full,
        c.hidden_size,
        c.vocab_size,
        c.num_experts,
        c.num_experts_per_tok,
        c.moe_intermediate_size,
        c.shared_expert_intermediate_size
    );
    let counts = c.parameter_counts();
    println!(
        "parameters: {} total, {} active per token",
        group_digits(counts.total),
        group_digits(counts.active)
    );

    // Bytes, weights and formats per component. A tied head shares the embedding's storage.
    #[derive(Default)]
    struct Component {
        bytes: usize,
        weights: usize,
        formats: BTreeSet<String>,
    }
    let mut by_component: BTreeMap<&str, Component> = BTreeMap::new();
    for (name, m) in weights.matrices() {
        if name == "lm_head" && c.tie_word_embeddings {
            continue;
        }
        let entry = by_component.entry(component_of(&name)).or_default();
        entry.bytes += m.storage_bytes();
        entry.weights += m.rows * m.cols;
        entry.formats.insert(m.format.name());
    }
    let mut total = 0;
    println!("weights by component (bits per weight include quantisation scales and biases):");
    for (component, entry) in &by_component {
        let formats: Vec<String> = entry.formats.iter().cloned().collect();
        let bpw = entry.bytes as f64 * 8.0 / entry.weights.max(1) as f64;
        println!(
            "  {component:<16} {:>10.3} GB  {bpw:>5.2} b/w  {}",
            entry.bytes as f64 / 1e9,
            formats.join(", ")
        );
        total += entry.bytes;
    }
    println!(
        "  {:<16} {:>10.3} GB ({} bytes; small vectors not counted)",
        "total",
        total as f64 / 1e9,
        group_digits(total)
    );
    let per_token_kv = n_full * 2 * c.num_key_value_heads * c.head_dim * 2;
    let gdn_state = (c.num_hidden_layers - n_full)
        * ((c.linear_conv_kernel_dim - 1) * c.conv_dim() * 2
            + c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4);
    println!(
        "per sequence: recurrent state {:.1} MiB; KV cache {} bytes per token (bf16)",
        gdn_state as f64 / (1 << 20) as f64,
        per_token_kv
    );
    println!(
        "memory for one sequence at the full {} tokens: {:.2} GB",
        c.max_position_embeddings,
        (total + gdn_state + per_token_kv * c.max_position_embeddings) as f64 / 1e9
    );
    let conversion = convert::measure(&weights, CONVERSION_SAMPLE_ROWS);
    if !conversion.0.is_empty() {
        println!(
            "on the GPU: the CUDA kernels read bf16 and affine q4/q8 g64 only, so these formats are converted at load \
             (error measured on the first {CONVERSION_SAMPLE_ROWS} rows of each matrix):"
        );
        for line in conversion.lines() {
            println!("  {line}");
        }
    }
    if !weights.mtp_tensors.is_empty() {
        let how = if weights.mtp.is_some() {
            "loaded: drafts with `--draft-tokens`"
        } else {
            "kept aside: not read from this format"
        };
        println!(
            "multi-token prediction: {} tensors present ({how})",
            weights.mtp_tensors.len()
        );
    }
    Ok(())
}

fn component_of(name: &str) -> &'static str {
    if name.contains(".mlp.experts.") {
        "routed experts"
    } else if name.contains("shared_expert") {
        "shared experts"
    } else if name.ends_with("mlp.gate") {
        "routers"
    } else if name.contains("linear_attn") {
        "GDN projections"
    } else if name.contains("self_attn") {
        "attention"
    } else if name == "lm_head" {
        "lm_head"
    } else {
        "embedding"
    }
}

fn group_digits(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(ch);
    }
    out
}
