//! Subcommands of the `lily` binary, one file each.

use clap::{Parser, Subcommand};

mod agree;
mod bench;
mod device;
mod generate;
mod inspect;
mod quantize;
mod render;
mod serve;
mod synth;
mod tokenize;

#[derive(Parser)]
#[command(name = "lily", version, about = "Inference engine for Qwen3.6-35B-A3B")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Check greedy decoding on a device against the CPU reference, token by token.
    Agree(agree::AgreeArgs),
    /// Measure prefill and decode speed over a sweep of contexts.
    Bench(bench::BenchArgs),
    /// Generate tokens from a prompt.
    Generate(generate::GenerateArgs),
    /// Show a checkpoint's configuration, formats, parameter counts and memory needs.
    Inspect(inspect::InspectArgs),
    /// Quantise a Hugging Face checkpoint into an MLX one (affine, as mlx_lm.convert -q).
    Quantize(quantize::QuantizeArgs),
    /// Print the exact prompt built for an OpenAI-style chat request.
    Render(render::RenderArgs),
    /// Serve the OpenAI-compatible API (a built-in demo model when no --model is given).
    Serve(serve::ServeArgs),
    /// Write a random-weight checkpoint in the official layout.
    Synth(synth::SynthArgs),
    /// Text to token ids (JSON), or back with --decode.
    Tokenize(tokenize::TokenizeArgs),
}

pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Agree(a) => agree::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Generate(a) => generate::run(a),
        Command::Inspect(a) => inspect::run(a),
        Command::Quantize(a) => quantize::run(a),
        Command::Render(a) => render::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Synth(a) => synth::run(a),
        Command::Tokenize(a) => tokenize::run(a),
    }
}
