//! `lily render`: the exact prompt the server would build for an OpenAI-style chat request.

use std::path::PathBuf;

use clap::Args;

use lily::engine::generate::TextModel;
use lily::server::{hub, openai, request};

#[derive(Args)]
pub struct RenderArgs {
    /// Model directory or Hugging Face repo id (its tokenizer and chat template); the built-in
    /// demo model's when left out.
    #[arg(long)]
    pub model: Option<String>,
    /// A chat completions request body (JSON), as a client would send it.
    #[arg(long)]
    pub request: PathBuf,
    /// Print the token ids (JSON) instead of the text.
    #[arg(long)]
    pub ids: bool,
}

pub fn run(args: RenderArgs) -> anyhow::Result<()> {
    let text_model = match &args.model {
        Some(arg) => TextModel::from_dir(&hub::resolve(arg)?)?,
        None => TextModel::demo()?,
    };
    let body = std::fs::read(&args.request)
        .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", args.request.display()))?;
    let chat: openai::ChatCompletionRequest = openai::parse_body(&body)?;
    let rendered = request::render_chat(&text_model, &chat)?;
    let ids = text_model.tokenizer.encode(&rendered.text)?;
    if args.ids {
        println!("{}", serde_json::to_string(&ids)?);
    } else {
        print!("{}", rendered.text);
    }
    eprintln!(
        "{} tokens; generation starts {}",
        ids.len(),
        if rendered.thinking {
            "in the reasoning"
        } else {
            "in the answer"
        }
    );
    Ok(())
}
