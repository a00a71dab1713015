//! `lily tokenize`: text to token ids (JSON), or back with `--decode`.

use std::path::PathBuf;

use clap::{ArgGroup, Args};

use lily::server::hub;
use lily::tokenizer::Tokenizer;

#[derive(Args)]
#[command(group(ArgGroup::new("input").required(true).args(["text", "file"])))]
pub struct TokenizeArgs {
    /// Model directory or Hugging Face repo id; the built-in demo tokenizer when left out.
    #[arg(long)]
    pub model: Option<String>,
    /// The text (or, with --decode, a JSON list of ids).
    #[arg(long)]
    pub text: Option<String>,
    /// Read the input from this file instead.
    #[arg(long)]
    pub file: Option<PathBuf>,
    /// Decode a JSON list of token ids to text.
    #[arg(long)]
    pub decode: bool,
}

pub fn run(args: TokenizeArgs) -> anyhow::Result<()> {
    let tokenizer = match &args.model {
        Some(arg) => Tokenizer::from_dir(hub::resolve(arg)?)?,
        None => Tokenizer::byte_level_demo()?,
    };
    let input = match (&args.text, &args.file) {
        (Some(text), _) => text.clone(),
        (None, Some(file)) => std::fs::read_to_string(file)
            .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", file.display()))?,
        (None, None) => anyhow::bail!("give --text or --file"),
    };
    if args.decode {
        let ids: Vec<u32> = serde_json::from_str(&input)
            .map_err(|e| anyhow::anyhow!("--decode expects a JSON list of token ids: {e}"))?;
        print!("{}", tokenizer.decode_lossy(&ids)?);
    } else {
        println!("{}", serde_json::to_string(&tokenizer.encode(&input)?)?);
    }
    Ok(())
}
