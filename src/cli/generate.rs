//! `lily generate`: generation from the command line.
//!
//! * `--prompt TEXT` streams text, through the same request path as the server (`--chat` wraps
//!   the prompt in the chat template as a user message; reasoning goes to stderr, the answer to
//!   stdout), with the sampling flags below.
//! * `--prompt-ids 1,2,3` runs the forward pass directly, greedy, and prints token ids: the
//!   check against reference outputs.

use std::io::Write;
use std::time::Instant;

use clap::Args;
use serde_json::{json, Value};

use lily::chat::tools::OutputEvent;
use lily::checkpoint;
use lily::engine::generate::{Output, TextModel};
use lily::engine::{Engine, EngineOptions};
use lily::model::{speculative, Backend, Weights};

use super::device::GpuOptions;
use lily::server::request::{prepare_chat, prepare_completion};
use lily::server::{load_model, openai, ModelSource};

#[derive(Args)]
pub struct GenerateArgs {
    /// Model directory, GGUF file or Hugging Face repo id; the built-in demo model when left out.
    #[arg(long)]
    pub model: Option<String>,
    /// The prompt text.
    #[arg(
        long,
        conflicts_with = "prompt_ids",
        required_unless_present = "prompt_ids"
    )]
    pub prompt: Option<String>,
    /// Prompt as comma-separated token ids (greedy; prints the generated ids).
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Vec<u32>,
    /// With --prompt-ids: check up to this many tokens a pass drafted by the checkpoint's MTP
    /// head (speculative decoding; the output is plain greedy decoding's).
    #[arg(long, requires = "prompt_ids", value_parser = clap::value_parser!(u32).range(1..=16))]
    pub draft_tokens: Option<u32>,
    /// Send the prompt as a user message through the chat template.
    #[arg(long, requires = "prompt")]
    pub chat: bool,
    /// With --chat: thinking off.
    #[arg(long, requires = "chat")]
    pub no_think: bool,
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// 0 for greedy decoding. Unset: the model's generation_config.json, else 1.
    #[arg(long)]
    pub temperature: Option<f64>,
    #[arg(long)]
    pub top_p: Option<f64>,
    #[arg(long)]
    pub top_k: Option<i64>,
    #[arg(long)]
    pub min_p: Option<f64>,
    #[arg(long)]
    pub presence_penalty: Option<f64>,
    #[arg(long)]
    pub frequency_penalty: Option<f64>,
    #[arg(long)]
    pub repetition_penalty: Option<f64>,
    #[arg(long)]
    pub seed: Option<i64>,
    /// A stop string (repeat for several).
    #[arg(long)]
    pub stop: Vec<String>,
    /// cpu, cuda or cuda:N (default: the GPU when this build has CUDA and one is
    /// present).
    #[arg(long)]
    pub device: Option<String>,
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let source = ModelSource::from_arg(args.model.as_deref())?;
    match (&args.prompt, source) {
        (Some(prompt), source) => {
            let (text, weights) = load_model(&source)?;
            generate_text(&args, prompt, text, weights)
        }
        // Token ids need no tokenizer: test checkpoints without one work too.
        (None, ModelSource::Dir(dir)) => generate_ids(&args, checkpoint::load(&dir)?),
        (None, ModelSource::Demo) => generate_ids(&args, load_model(&ModelSource::Demo)?.1),
    }
}

/// The request body the server would get for this command line.
fn request_body(args: &GenerateArgs, prompt: &str) -> Value {
    let mut body = json!({
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "repetition_penalty": args.repetition_penalty,
        "seed": args.seed,
        "stop": args.stop,
    });
    if args.chat {
        body["messages"] = json!([{"role": "user", "content": prompt}]);
        body["chat_template_kwargs"] = json!({"enable_thinking": !args.no_think});
    } else {
        body["prompt"] = json!(prompt);
    }
    body
}

fn generate_text(
    args: &GenerateArgs,
    prompt: &str,
    text: TextModel,
    weights: Weights,
) -> anyhow::Result<()> {
    let max_model_len = weights.config.max_position_embeddings;
    let body = serde_json::to_vec(&request_body(args, prompt))?;
    let plan = if args.chat {
        prepare_chat(&text, &openai::parse_body(&body)?, max_model_len)?
            .plans
            .remove(0)
    } else {
        prepare_completion(&text, &openai::parse_body(&body)?, max_model_len)?
            .plans
            .remove(0)
    };
    let prompt_tokens = plan.prompt.len();
    let device = super::device::resolve(args.device.as_deref());
    let engine = Engine::start(
        // The backend holds only as much context as this one generation needs.
        super::device::backend(
            &device,
            weights,
            prompt_tokens + plan.params.max_tokens.unwrap_or(0),
            GpuOptions::default(),
        )?,
        EngineOptions::default(),
    );
    let mut generation = text.start(&engine, plan);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let start = Instant::now();
    let mut first_token = None;
    let (mut stdout, mut stderr) = (std::io::stdout(), std::io::stderr());
    let (finish, counts) = runtime.block_on(async {
        while let Some(item) = generation.next().await {
            match item.map_err(|e| anyhow::anyhow!("generation failed: {e}"))? {
                Output::Delta { events, .. } => {
                    first_token.get_or_insert_with(Instant::now);
                    for event in events {
                        match event {
                            OutputEvent::Reasoning(t) => write!(stderr, "{t}")?,
                            OutputEvent::Content(t) => write!(stdout, "{t}")?,
                            OutputEvent::ToolCallStart { name, .. } => {
                                write!(stdout, "\n[tool call {name}] ")?
                            }
                            OutputEvent::ToolCallArguments { delta, .. } => {
                                write!(stdout, "{delta}")?
                            }
                            OutputEvent::ToolCallEnd { .. } => writeln!(stdout)?,
                        }
                    }
                    stdout.flush()?;
                    stderr.flush()?;
                }
                Output::Done { finish, counts, .. } => return Ok((finish, counts)),
                Output::PromptToken(_) => {} // `generate` never scores its prompt
            }
        }
        anyhow::bail!("the generation ended without finishing")
    })?;
    writeln!(stdout)?;
    let decode = first_token.map_or(0.0, |t| t.elapsed().as_secs_f64());
    eprintln!(
        "\n[{prompt_tokens} prompt tokens, {} generated ({} reasoning), finish: {}; first token after {:.2} s, then {:.1} tok/s]",
        counts.completion_tokens,
        counts.reasoning_tokens,
        finish.as_str(),
        first_token.map_or(0.0, |t| (t - start).as_secs_f64()),
        counts.completion_tokens.saturating_sub(1) as f64 / decode.max(1e-9),
    );
    Ok(())
}

fn generate_ids(args: &GenerateArgs, weights: Weights) -> anyhow::Result<()> {
    let vocab = weights.config.vocab_size;
    anyhow::ensure!(
        !args.prompt_ids.is_empty(),
        "--prompt-ids needs at least one token id"
    );
    if let Some(bad) = args.prompt_ids.iter().find(|&&id| id as usize >= vocab) {
        anyhow::bail!("token id {bad} is out of range: the model's vocabulary has {vocab} entries");
    }
    let device = super::device::resolve(args.device.as_deref());
    let context = args.prompt_ids.len() + args.max_tokens + 1;
    let mut backend = super::device::backend(&device, weights, context, GpuOptions::default())?;
    backend.create_sequence(0)?;
    if let Some(k) = args.draft_tokens {
        return generate_drafted(args, backend.as_mut(), k as usize);
    }
    let t0 = Instant::now();
    let mut next = backend.forward_greedy(0, &args.prompt_ids)?;
    let prefill = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut out = Vec::with_capacity(args.max_tokens);
    for i in 0..args.max_tokens {
        out.push(next);
        if i + 1 < args.max_tokens {
            next = backend.forward_greedy(0, &[next])?;
        }
    }
    let decode = t1.elapsed().as_secs_f64();
    println!(
        "{}",
        out.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
    );
    eprintln!(
        "prefill {} tokens: {:.1} tok/s; decode {} tokens: {:.1} tok/s ({}, greedy)",
        args.prompt_ids.len(),
        args.prompt_ids.len() as f64 / prefill,
        out.len(),
        out.len() as f64 / decode.max(1e-9),
        backend.device_name()
    );
    Ok(())
}

/// `--prompt-ids` with `--draft-tokens`: greedy decoding checking the MTP head's drafts.
fn generate_drafted(
    args: &GenerateArgs,
    backend: &mut dyn Backend,
    k: usize,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        backend.can_draft(),
        "--draft-tokens: {} cannot draft here (the checkpoint has no MTP head, its format's loader does not read it, or this device does not draft yet)",
        backend.device_name()
    );
    let t0 = Instant::now();
    let (out, stats) =
        speculative::greedy(backend, 0, &args.prompt_ids, args.max_tokens, k, |_| false)?;
    let seconds = t0.elapsed().as_secs_f64();
    println!(
        "{}",
        out.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
    );
    eprintln!(
        "prefill and decode of {} tokens: {:.1} tok/s; {} passes after the prompt, {} of {} drafts accepted ({:.1} %) ({}, greedy, {k} drafts a pass)",
        out.len(),
        out.len() as f64 / seconds.max(1e-9),
        stats.passes,
        stats.accepted,
        stats.drafted,
        100.0 * stats.accepted as f64 / stats.drafted.max(1) as f64,
        backend.device_name()
    );
    Ok(())
}
