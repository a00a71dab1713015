//! Subcommands of the `lily` binary, one file each.

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "lily", version, about = "Inference engine for Qwen3.6-35B-A3B")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
}

pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
    }
}
