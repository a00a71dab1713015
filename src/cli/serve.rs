//! `lily serve`: the OpenAI-compatible server (see `lily::server`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;

use std::sync::Arc;

use lily::engine::{DraftSchedule, EngineOptions};
use lily::server::{self, ModelSource, ServeOptions, DEMO_MODEL_NAME};

#[derive(Args)]
pub struct ServeArgs {
    /// Model directory, GGUF file or Hugging Face repo id (found in the local Hugging Face
    /// cache). Without it, a small built-in demo model with random weights is served.
    #[arg(long)]
    pub model: Option<String>,
    /// The name clients put in `model` (default: the repo id or directory name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Address to bind. The default accepts local connections only; use 0.0.0.0 to serve others.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on the API routes.
    #[arg(long, env = "LILY_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Longest prompt + completion, in tokens (default: the model's context length).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// cpu, cuda or cuda:N (default: the GPU when this build has CUDA and one is present).
    #[arg(long)]
    pub device: Option<String>,
    /// Larger request bodies are refused (413).
    #[arg(long, default_value_t = 16 << 20)]
    pub max_body_bytes: usize,
    /// More requests in flight than this are refused (503, retry later).
    #[arg(long, default_value_t = 256)]
    pub max_in_flight: usize,
    /// Seconds that requests in flight get to finish after SIGINT/SIGTERM.
    #[arg(long, default_value_t = 5.0)]
    pub shutdown_grace: f64,
    /// Memory for saved prompt states (prefix reuse across requests and turns), in MiB; 0
    /// turns the prefix cache off.
    #[arg(long, default_value_t = 4096)]
    pub prefix_cache_mb: u64,
    /// Requests are admitted while the sequence state they can grow to (KV entries and
    /// recurrent state for prompt + max_tokens) fits in this many MiB; others wait. Default: no
    /// limit besides the device's sequence slots.
    #[arg(long)]
    pub state_memory_mb: Option<u64>,
    /// GPU: sequences holding state at once (each with KV room for --max-model-len tokens);
    /// more requests wait in a queue.
    #[arg(long, default_value_t = 4)]
    pub max_sequences: usize,
    /// GPU: run the steps of concurrent requests (prompt chunks and decode tokens) as shared
    /// passes, each weight read once per pass, instead of one after another (`--batch-steps
    /// false`: one after another). Default: on.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub batch_steps: Option<bool>,
    /// Prompt tokens one batch of steps may hold beside its decode steps (one per decoding
    /// sequence): prompt chunks up to this many in all, each at most this long. More: higher
    /// throughput when many prompts arrive; fewer: the streams decoding beside them wait less per
    /// token. Default: 8192 on a GPU, 2048 on the CPU.
    #[arg(long)]
    pub batch_tokens: Option<usize>,
    /// Speculative decoding: while at most 4 requests run and all decode, each checks up to this
    /// many tokens drafted by the checkpoint's MTP head in a pass of its own (greedy output
    /// unchanged, sampled tokens' distribution unchanged). Off (0) by default; needs a
    /// checkpoint with the head (Hugging Face bf16/FP8, GGUF with nextn tensors, `lily quantize`
    /// output); on the GPU the path is built but not yet run on one. Metrics: vllm:spec_decode_*.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=16))]
    pub draft_tokens: u32,
    /// How many of the `--draft-tokens` a pass checks: `adaptive` (default) picks, pass by
    /// pass, the number (0 included) with the most tokens a second by the request's acceptance
    /// so far and what passes of each length cost, and whether requests decoding together draft
    /// at all; `fixed` always checks them all.
    #[arg(long, default_value = "adaptive")]
    pub draft_schedule: DraftSchedule,
    /// Test only: reply from this script instead of running a model.
    #[arg(long, hide = true)]
    pub scripted_tokens: Option<PathBuf>,
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let (source, default_name, aliases) = match &args.model {
        None => (ModelSource::Demo, DEMO_MODEL_NAME.to_string(), Vec::new()),
        Some(arg) => {
            let dir = server::hub::resolve(arg)?;
            let name = if Path::new(arg).is_dir() {
                dir.canonicalize()
                    .ok()
                    .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
                    .unwrap_or_else(|| arg.clone())
            } else {
                arg.clone()
            };
            (ModelSource::Dir(dir), name, vec![arg.clone()])
        }
    };
    anyhow::ensure!(
        args.shutdown_grace.is_finite() && args.shutdown_grace >= 0.0,
        "--shutdown-grace must be a number of seconds"
    );
    let device = super::device::resolve(args.device.as_deref());
    let device_name = device.clone();
    anyhow::ensure!(args.max_sequences > 0, "--max-sequences must be at least 1");
    anyhow::ensure!(
        args.batch_tokens != Some(0),
        "--batch-tokens must be at least 1"
    );
    let defaults = EngineOptions::for_device(&device_name);
    let engine = EngineOptions {
        // A GPU holds this many sequences' state (its slots); the CPU backend has no slots.
        max_sequences: if device_name.starts_with("cuda") {
            args.max_sequences
        } else {
            defaults.max_sequences
        },
        prefix_cache_bytes: args.prefix_cache_mb << 20,
        memory_budget: args.state_memory_mb.map(|mb| mb << 20),
        draft_tokens: args.draft_tokens as usize,
        draft_schedule: args.draft_schedule,
        ..defaults
    };
    let engine = match args.batch_tokens {
        Some(tokens) => engine.with_batch_tokens(tokens),
        None => engine,
    };
    // The GPU's passes hold one batch of the engine's.
    let gpu = super::device::GpuOptions {
        slots: Some(args.max_sequences),
        batch_steps: args.batch_steps,
        pass_rows: Some(engine.pass_rows()),
        timeline: false,
    };
    server::run(ServeOptions {
        source,
        served_model_name: args.served_model_name.unwrap_or(default_name),
        aliases,
        host: args.host,
        port: args.port,
        api_key: args.api_key.filter(|k| !k.is_empty()),
        max_model_len: args.max_model_len,
        backend: Arc::new(move |weights, max_context| {
            super::device::backend(&device, weights, max_context, gpu)
        }),
        max_body_bytes: args.max_body_bytes,
        max_in_flight: args.max_in_flight,
        scripted: args.scripted_tokens,
        shutdown_grace: Duration::from_secs_f64(args.shutdown_grace),
        engine,
    })
}
