//! `lily bench`: the prompt × context sweep; writes CSV, a markdown table and PNG charts. With
//! `--serve`: the engine under concurrent streams and a growing conversation (serve_bench.rs).

use std::path::PathBuf;

use clap::{Args, ValueEnum};

use lily::bench::{self, BenchOptions};
use lily::checkpoint;
use lily::engine::{DraftSchedule, EngineOptions};
use lily::model::Backend;
use lily::sampling::SamplingParams;
use lily::serve_bench::{self, ServeBenchOptions};

use super::device::GpuOptions;

#[derive(Args)]
pub struct BenchArgs {
    /// Model directory.
    #[arg(long, conflicts_with = "synthetic")]
    pub model: Option<PathBuf>,
    /// A synthetic model preset (random weights): `tiny` or `qwen3.6-35b-a3b`.
    #[arg(long)]
    pub synthetic: Option<String>,
    /// Contexts (prompt lengths) to measure.
    #[arg(long, value_delimiter = ',', default_values_t = bench::CONTEXTS)]
    pub contexts: Vec<usize>,
    #[arg(long, default_value_t = 64)]
    pub decode_steps: usize,
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    /// Milliseconds of idle time between each round's prefill and its decode steps (0: none),
    /// to measure decode apart from the prefill before it.
    #[arg(long, default_value_t = 0)]
    pub decode_pause_ms: u64,
    /// Weights of a synthetic model: bf16, or MLX-affine 4/8-bit (router and shared-expert gate
    /// 8-bit), or fp8 (as an FP8 checkpoint runs: 8-bit for decode, FP8 experts of their own
    /// random values for prefill). On the GPU they are generated in device memory.
    #[arg(long, value_enum, default_value_t = Quant::Bf16)]
    pub quant: Quant,
    /// cpu, cuda or cuda:N (default: cuda when available).
    #[arg(long)]
    pub device: Option<String>,
    /// Directory for bench.csv, bench.md, prefill.png and decode.png (with --profile also
    /// profile.md; with --serve: serve.md).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// After the sweep, time each op of one prefill and of the decode steps at every context
    /// (GPU only; writes profile.md with --out).
    #[arg(long, conflicts_with = "serve")]
    pub profile: bool,
    /// --profile: sequences per step of its batched decode steps (at contexts up to 4K; 1: none).
    #[arg(long, default_value_t = bench::PROFILE_BATCH)]
    pub profile_batch: usize,
    /// --profile: also one pass of 4 prompts (4,096 rows in all, half a serving pass) with this
    /// many decode rows riding along, against the prompts alone (0: not).
    #[arg(long, default_value_t = 0)]
    pub profile_mixed: usize,
    /// Instead of the sweep, a timeline of the decode steps at every context: each kernel's
    /// share of the step as its CUDA graph runs, from the decode kernels' timeline builds (GPU
    /// only; writes timeline.md with --out).
    #[arg(long, conflicts_with_all = ["serve", "profile"])]
    pub timeline: bool,
    /// --timeline: sequences per decode step (each prefills its own prompt of the context).
    #[arg(long, default_value_t = 1, requires = "timeline")]
    pub timeline_batch: usize,
    /// Instead of the sweep, passes of this many tokens of one sequence at every context (a
    /// list, e.g. 1,2,4: a speculative verify pass's shape), `--decode-steps` timed passes each;
    /// writes spans.md with --out.
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["serve", "profile", "timeline"])]
    pub span_tokens: Vec<usize>,
    /// Instead of the sweep, decode `--decode-steps` tokens at every context with this many MTP
    /// drafts a pass (a list, e.g. 1,2,3), the head and verify passes run as drafting runs them
    /// but the drafts forced from plain decoding's tokens, right at `--forced-acceptance`,
    /// against plain decoding (needs a model with an MTP head; writes drafts.md with --out).
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["serve", "profile", "timeline", "span_tokens"])]
    pub forced_drafts: Vec<usize>,
    /// --forced-drafts: the rate at which a draft is right.
    #[arg(long, default_value_t = 0.8, requires = "forced_drafts")]
    pub forced_acceptance: f64,
    /// Measure the engine under load instead: concurrent streams, a multi-turn conversation
    /// with and without the prefix cache, decode speed per stream (the flags below).
    #[arg(long)]
    pub serve: bool,
    /// --serve: concurrent streams of the throughput measurement.
    #[arg(long, default_value_t = 8)]
    pub streams: usize,
    /// --serve: prompt tokens per stream.
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// --serve: tokens generated per request.
    #[arg(long, default_value_t = 128)]
    pub output_tokens: usize,
    /// --serve: turns of the conversation.
    #[arg(long, default_value_t = 10)]
    pub turns: usize,
    /// --serve: times the conversation runs, cold and cached; each turn's times are the medians.
    #[arg(long, default_value_t = 1)]
    pub conversation_rounds: usize,
    /// --serve: the conversation's length at its last turn (about).
    #[arg(long, default_value_t = 32768)]
    pub conversation_tokens: usize,
    /// --serve: tokens of system prompt (an agent's instructions and tool schemas) before the
    /// conversation's first message; the turns share the rest of --conversation-tokens.
    #[arg(long, default_value_t = 0)]
    pub system_tokens: usize,
    /// --serve: concurrent streams of the decode-speed comparison with one stream.
    #[arg(long, default_value_t = 8)]
    pub decode_streams: usize,
    /// --serve: memory of the prefix cache in MiB.
    #[arg(long, default_value_t = 4096)]
    pub prefix_cache_mb: u64,
    /// --serve on a GPU: the steps of several sequences run as shared passes, or not (`false`);
    /// default: the backend's (see `lily serve`).
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub batch_steps: Option<bool>,
    /// --serve: prompt tokens one batch of steps may hold beside its decode steps (see `lily
    /// serve --batch-tokens`).
    #[arg(long)]
    pub batch_tokens: Option<usize>,
    /// --serve: requests sample at this temperature (on the device, as the server samples)
    /// instead of decoding greedily; with --top-p or --top-k alone, temperature 1.
    #[arg(long, requires = "serve")]
    pub temperature: Option<f32>,
    /// --serve: sampling's nucleus (1: off).
    #[arg(long, requires = "serve")]
    pub top_p: Option<f32>,
    /// --serve: sampling's top-k (off unless given).
    #[arg(long, requires = "serve")]
    pub top_k: Option<usize>,
    /// --serve: requests pick only ids below this, as the server limits them to the
    /// tokenizer's (a real Qwen3.6 checkpoint: 248077 of the model's 248320 rows).
    #[arg(long, requires = "serve")]
    pub vocab_limit: Option<usize>,
    /// --serve: requests decoding alone (or a few together) check this many MTP drafts a pass (`serve
    /// --draft-tokens`); a synthetic model's random head drafts random tokens, so this measures
    /// what drafting costs, not what it gains.
    #[arg(long, requires = "serve", default_value_t = 0)]
    pub draft_tokens: usize,
    /// --serve: how many of the `--draft-tokens` a pass checks (`serve --draft-schedule`):
    /// `adaptive` (default) or `fixed` (always all, which measures their cost).
    #[arg(long, requires = "serve", default_value = "adaptive")]
    pub draft_schedule: DraftSchedule,
}

/// The --serve requests' sampling: `None` (greedy) unless a sampling flag is given.
fn serve_sampling(args: &BenchArgs) -> anyhow::Result<Option<SamplingParams>> {
    if args.temperature.is_none() && args.top_p.is_none() && args.top_k.is_none() {
        return Ok(None);
    }
    let params = SamplingParams {
        temperature: args.temperature.unwrap_or(1.0),
        top_p: args.top_p.unwrap_or(1.0),
        top_k: args.top_k,
        ..SamplingParams::default()
    };
    anyhow::ensure!(
        params.temperature.is_finite() && params.temperature >= 0.0,
        "--temperature must be a finite number ≥ 0"
    );
    anyhow::ensure!(
        params.top_p > 0.0 && params.top_p <= 1.0,
        "--top-p must be in (0, 1]"
    );
    anyhow::ensure!(params.top_k != Some(0), "--top-k must be at least 1");
    Ok(Some(params))
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    let device = super::device::resolve(args.device.as_deref());
    let (max_context, gpu) = if args.serve {
        let longest = (args.prompt_tokens.max(args.conversation_tokens)) + args.output_tokens;
        // The last turn's prompt can exceed the target by up to one turn's share.
        let longest = longest + args.conversation_tokens / args.turns.max(1) + 16;
        anyhow::ensure!(
            args.batch_tokens != Some(0),
            "--batch-tokens must be at least 1"
        );
        let gpu = GpuOptions {
            slots: Some(args.streams.max(args.decode_streams)),
            batch_steps: args.batch_steps,
            // The GPU's passes hold one batch of the engine's (serve() below).
            pass_rows: Some(serve_engine(&args, &device).pass_rows()),
            timeline: false,
        };
        (longest, gpu)
    } else {
        let longest = args.contexts.iter().max().copied().unwrap_or(0) + args.decode_steps + 16;
        let longest = longest
            .max(bench::spans::context_needed(
                longest,
                &args.span_tokens,
                args.decode_steps,
            ))
            .max(bench::drafts::context_needed(
                longest,
                args.decode_steps,
                &args.forced_drafts,
            ));
        // --profile also times decode steps of --profile-batch sequences at once,
        // --timeline: as many as its steps hold.
        let slots = if args.profile {
            Some(args.profile_batch.max(1).max(8 + args.profile_mixed))
        } else {
            args.timeline.then_some(args.timeline_batch.max(1))
        };
        (
            longest,
            GpuOptions {
                slots,
                timeline: args.timeline,
                ..GpuOptions::default()
            },
        )
    };
    let backend = match (&args.model, &args.synthetic) {
        (Some(dir), _) => {
            super::device::backend(&device, checkpoint::load(dir)?, max_context, gpu)?
        }
        (None, Some(name)) => synthetic_backend(name, args.quant, &device, max_context, gpu)?,
        (None, None) => anyhow::bail!("give --model DIR or --synthetic PRESET"),
    };
    if args.serve {
        return serve(backend, &args);
    }
    let mut backend = backend;
    anyhow::ensure!(
        !args.profile || backend.set_op_timing(false),
        "--profile: {} cannot time its ops (the CUDA backend can)",
        backend.device_name()
    );
    if args.timeline {
        // Whether the backend can take one, before any prompt runs (a CPU sweep's prefills are long).
        anyhow::ensure!(
            backend.start_timeline()?,
            "--timeline: {} cannot take one (the CUDA backend can)",
            backend.device_name()
        );
        backend.stop_timeline()?;
        let mut md = String::new();
        for &context in &args.contexts {
            let batch = args.timeline_batch.max(1);
            let t = bench::timeline::decode_timeline(
                backend.as_mut(),
                context,
                args.decode_steps,
                batch,
            )?
            .ok_or_else(|| {
                anyhow::anyhow!("--timeline: {} cannot take one", backend.device_name())
            })?;
            let part = bench::timeline::to_markdown(context, batch, &t, 48);
            eprintln!("{}", part.lines().next().unwrap_or(""));
            md += &part;
        }
        println!("{md}");
        if let Some(out) = &args.out {
            std::fs::create_dir_all(out)?;
            std::fs::write(out.join("timeline.md"), md)?;
        }
        return Ok(());
    }
    if !args.forced_drafts.is_empty() {
        let mut points = Vec::new();
        for (i, &context) in args.contexts.iter().enumerate() {
            points.extend(bench::drafts::forced_drafts(
                backend.as_mut(),
                (1 << 47) + 2 * i as u64,
                context,
                &args.forced_drafts,
                args.forced_acceptance,
                args.decode_steps,
            )?);
        }
        let md = bench::drafts::to_markdown(&points);
        println!("{md}");
        if let Some(out) = &args.out {
            std::fs::create_dir_all(out)?;
            std::fs::write(out.join("drafts.md"), md)?;
        }
        return Ok(());
    }
    if !args.span_tokens.is_empty() {
        let mut points = Vec::new();
        for (i, &context) in args.contexts.iter().enumerate() {
            points.extend(bench::spans::span_passes(
                backend.as_mut(),
                (1 << 46) + i as u64,
                context,
                &args.span_tokens,
                args.decode_steps,
            )?);
        }
        let md = bench::spans::to_markdown(&points);
        println!("{md}");
        if let Some(out) = &args.out {
            std::fs::create_dir_all(out)?;
            std::fs::write(out.join("spans.md"), md)?;
        }
        return Ok(());
    }
    let options = BenchOptions {
        contexts: args.contexts.clone(),
        decode_steps: args.decode_steps,
        rounds: args.rounds,
        decode_pause: std::time::Duration::from_millis(args.decode_pause_ms),
    };
    eprintln!(
        "device: {}; batch 1; {} decode steps; median of {} rounds",
        backend.device_name(),
        options.decode_steps,
        options.rounds
    );
    let points = bench::sweep(backend.as_mut(), &options, |p| {
        eprintln!(
            "context {:>6}: prefill {:>9.1} tok/s, decode {:>7.1} tok/s",
            p.context, p.prefill_tok_s, p.decode_tok_s
        )
    })?;
    let md = bench::to_markdown(&points);
    println!("{md}");
    if let Some(out) = &args.out {
        std::fs::create_dir_all(out)?;
        std::fs::write(out.join("bench.csv"), bench::to_csv(&points))?;
        std::fs::write(out.join("bench.md"), md)?;
        let engines = vec![(format!("lily ({})", backend.device_name()), points.clone())];
        std::fs::write(out.join("prefill.png"), bench::to_png(&engines, "prefill"))?;
        std::fs::write(out.join("decode.png"), bench::to_png(&engines, "decode"))?;
    }
    if args.profile {
        match bench::profile(
            backend.as_mut(),
            &args.contexts,
            args.decode_steps,
            args.profile_batch,
        )? {
            Some(profile) => {
                let mut md = bench::profile_markdown(&profile);
                if args.profile_mixed > 0 {
                    backend.set_op_timing(true);
                    // The pass holds 4,096 rows in all: the prompts make room.
                    let rows = args.profile_mixed.min(2048);
                    let (prompts, len) = (4, 1024 - rows.div_ceil(4));
                    let (alone, mixed) =
                        bench::profile_mixed_pass(backend.as_mut(), 1 << 45, prompts, len, rows)?;
                    backend.set_op_timing(false);
                    md += &bench::mixed_markdown(prompts, len, rows, &alone, &mixed);
                }
                println!("{md}");
                if let Some(out) = &args.out {
                    std::fs::write(out.join("profile.md"), md)?;
                }
            }
            None => anyhow::bail!("--profile: op timing stopped working"),
        }
    }
    Ok(())
}

/// The engine's options for `--serve` on `device`: a sequence for every stream.
fn serve_engine(args: &BenchArgs, device: &str) -> EngineOptions {
    let engine = EngineOptions {
        max_sequences: args.streams.max(args.decode_streams),
        prefix_cache_bytes: args.prefix_cache_mb << 20,
        draft_tokens: args.draft_tokens,
        draft_schedule: args.draft_schedule,
        ..EngineOptions::for_device(device)
    };
    match args.batch_tokens {
        Some(tokens) => engine.with_batch_tokens(tokens),
        None => engine,
    }
}

fn serve(backend: Box<dyn Backend>, args: &BenchArgs) -> anyhow::Result<()> {
    let options = ServeBenchOptions {
        streams: args.streams,
        prompt_tokens: args.prompt_tokens,
        output_tokens: args.output_tokens,
        turns: args.turns,
        conversation_rounds: args.conversation_rounds,
        conversation_tokens: args.conversation_tokens,
        system_tokens: args.system_tokens,
        decode_streams: args.decode_streams,
        engine: serve_engine(args, &backend.device_name()),
        sampling: serve_sampling(args)?,
        vocab_limit: args.vocab_limit,
    };
    eprintln!("device: {}; in-process engine", backend.device_name());
    let (report, _) = serve_bench::run(backend, &options, |line| eprintln!("{line}"))?;
    let md = serve_bench::to_markdown(&options, &report);
    println!("{md}");
    if let Some(out) = &args.out {
        std::fs::create_dir_all(out)?;
        std::fs::write(out.join("serve.md"), md)?;
    }
    Ok(())
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Quant {
    Bf16,
    Q4,
    Q8,
    /// As an FP8 checkpoint runs: Q8 for decode, FP8 expert stacks for prefill.
    Fp8,
}

/// A backend over random weights of a preset: generated in GPU memory on CUDA; on the CPU,
/// written as a bf16 checkpoint to a temporary directory and loaded.
fn synthetic_backend(
    name: &str,
    quant: Quant,
    device: &str,
    max_context: usize,
    gpu: GpuOptions,
) -> anyhow::Result<Box<dyn Backend>> {
    let cfg = checkpoint::synth::preset(name)
        .ok_or_else(|| anyhow::anyhow!("unknown preset `{name}` (tiny, qwen3.6-35b-a3b)"))?;
    if device.starts_with("cuda") {
        #[cfg(feature = "cuda")]
        {
            use lily::cuda::{forward::CudaBackend, model::CudaModel, CudaDevice};
            let bits = match quant {
                Quant::Bf16 => None,
                Quant::Q4 => Some(4),
                Quant::Q8 | Quant::Fp8 => Some(8),
            };
            let dev = CudaDevice::open_with(device, gpu.timeline)?;
            let t = std::time::Instant::now();
            let config = lily::config::ModelConfig::from_json(&cfg)?;
            let model = if quant == Quant::Fp8 {
                CudaModel::synthetic_fp8(&dev, config, 0)?
            } else {
                CudaModel::synthetic(&dev, config, bits, 0)?
            };
            eprintln!(
                "synthetic weights: {:.2} GB on the GPU in {:.1} s",
                model.bytes() as f64 / 1e9,
                t.elapsed().as_secs_f64()
            );
            let options = super::device::cuda_options(max_context, gpu);
            return Ok(Box::new(CudaBackend::new(dev, model, options)?));
        }
    }
    anyhow::ensure!(quant == Quant::Bf16, "synthetic quantised models are generated on the GPU only; on the CPU use `lily synth --quant` and --model");
    let dir = std::env::temp_dir().join(format!("lily-bench-{name}-{}", std::process::id()));
    checkpoint::synth::write_checkpoint(
        &cfg,
        &dir,
        0,
        checkpoint::tensor::DType::BF16,
        checkpoint::synth::SHARD_BYTES,
        true,
    )?;
    let weights = checkpoint::load(&dir);
    let _ = std::fs::remove_dir_all(&dir); // the weights stay mapped until dropped
    super::device::backend(device, weights?, max_context, gpu)
}
