//! `lily bench --serve`: the engine under many users, in process (no HTTP). Three
//! measurements, each on a fresh engine over the same backend:
//!
//! * throughput: N streams with P-token prompts and M output tokens submitted at once; output
//!   and total (prompt + output) tokens per second of wall time;
//! * an agent conversation: T turns, each prompt the previous prompt plus the previous answer
//!   plus a new message, growing to about C tokens; time to first token per turn without and
//!   with the prefix cache. The first turn may open with S tokens of system prompt (an agent's
//!   instructions and tool schemas), the rest of C shared equally by the turns;
//! * decode scaling: the decode speed of one stream alone and per stream among K concurrent.
//!
//! Requests have no stop token, so every one generates exactly M tokens; they are greedy, or
//! sample with the options' [`SamplingParams`] (`--temperature`, `--top-p`, `--top-k`), the
//! token picked on the device as the server picks it for such requests.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedReceiver;

use crate::bench::synthetic_prompt;
use crate::engine::{
    greedy_device_sampler, greedy_sampler, DeviceSampler, Engine, EngineOptions, Event,
    GenerateRequest, SampledToken,
};
use crate::model::Backend;
use crate::sampling::{DeviceSampling, Sampler, SamplingParams};

#[derive(Debug, Clone)]
pub struct ServeBenchOptions {
    /// Concurrent streams of the throughput measurement.
    pub streams: usize,
    pub prompt_tokens: usize,
    /// Tokens generated per request (every measurement).
    pub output_tokens: usize,
    pub turns: usize,
    /// Times the conversation runs, cold and cached (each in an engine of its own, so each round's
    /// cache starts empty): a turn's TTFTs are the medians of the rounds.
    pub conversation_rounds: usize,
    /// The conversation's length at its last turn, about.
    pub conversation_tokens: usize,
    /// Tokens of system prompt before the first turn's message (0: every turn adds an equal
    /// share from the start).
    pub system_tokens: usize,
    /// Concurrent streams of the decode-scaling measurement.
    pub decode_streams: usize,
    /// Engine settings; the conversation runs once with `prefix_cache_bytes` 0 and once with
    /// this (which must not be 0).
    pub engine: EngineOptions,
    /// `None`: greedy requests; else every request samples with these (a fresh seed each).
    pub sampling: Option<SamplingParams>,
    /// Ids the requests may pick: below this (`None`: the model's whole vocabulary). A real
    /// checkpoint's tokenizer has fewer ids than the model has rows (Qwen3.6: 248,077 of
    /// 248,320), and the server limits every request to them.
    pub vocab_limit: Option<usize>,
}

/// How every request of a run picks its tokens.
#[derive(Clone, Copy)]
struct Asks<'a> {
    sampling: Option<&'a SamplingParams>,
    vocab_limit: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Throughput {
    pub seconds: f64,
    /// Of which in the backend (`Backend::forward_batch`); the rest is the engine's own work.
    pub backend_seconds: f64,
    pub output_tok_s: f64,
    pub total_tok_s: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    pub prompt_tokens: usize,
    pub ttft_cold_s: f64,
    pub ttft_cached_s: f64,
    pub cached_tokens: usize,
}

impl Turn {
    /// How many times sooner the first token comes with the prefix cache (issue 10's measure).
    pub fn speedup(&self) -> f64 {
        self.ttft_cold_s / self.ttft_cached_s
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct DecodeScaling {
    pub alone_tok_s: f64,
    /// Mean over the concurrent streams of each one's rate from its first token to its last: what
    /// a user sees, including the passes that prefill the other streams' prompts meanwhile.
    pub per_stream_tok_s: f64,
    /// Per stream while all of them decode (from the last stream's first token to the first
    /// stream's last): the steady state of K concurrent decodes, without those prefill passes.
    /// `None` if no moment had every stream decoding.
    pub steady_per_stream_tok_s: Option<f64>,
    /// With drafts (`EngineOptions::draft_tokens`): the lone stream's passes that checked drafts,
    /// the drafts and those kept.
    pub alone_drafts: Option<DraftCounts>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DraftCounts {
    pub passes: u64,
    pub drafted: u64,
    pub accepted: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ServeReport {
    pub throughput: Throughput,
    pub turns: Vec<Turn>,
    pub decode: DecodeScaling,
}

/// What one request saw.
struct Timing {
    tokens: Vec<u32>,
    /// When each token arrived.
    token_times: Vec<Duration>,
    cached_tokens: usize,
}

impl Timing {
    /// Decode tokens per second after the first token.
    fn decode_tok_s(&self) -> f64 {
        let steps = self.tokens.len().saturating_sub(1) as f64;
        steps
            / (self.last_token() - self.first_token())
                .as_secs_f64()
                .max(1e-9)
    }

    /// When the first token arrived (zero if none did).
    fn first_token(&self) -> Duration {
        self.token_times.first().copied().unwrap_or_default()
    }

    fn last_token(&self) -> Duration {
        self.token_times.last().copied().unwrap_or_default()
    }
}

/// Tokens per second per stream in the window where every stream is between its first and its
/// last token (tokens arriving after the window's start, up to its end); `None` if the window is
/// empty. Each stream's arrival times are in order.
fn steady_per_stream_tok_s(streams: &[&[Duration]]) -> Option<f64> {
    let start = streams.iter().map(|t| t.first().copied()).max()??;
    let end = streams.iter().map(|t| t.last().copied()).min()??;
    if end <= start {
        return None;
    }
    let tokens: usize = streams
        .iter()
        .map(|t| t.iter().filter(|&&at| at > start && at <= end).count())
        .sum();
    Some(tokens as f64 / (end - start).as_secs_f64() / streams.len() as f64)
}

/// Runs the three measurements; returns the report and the backend. `progress` gets a line per
/// finished step.
pub fn run(
    backend: Box<dyn Backend>,
    o: &ServeBenchOptions,
    mut progress: impl FnMut(&str),
) -> anyhow::Result<(ServeReport, Box<dyn Backend>)> {
    anyhow::ensure!(
        o.streams > 0 && o.decode_streams > 0 && o.turns > 0 && o.conversation_rounds > 0,
        "streams, turns and conversation rounds must be positive"
    );
    anyhow::ensure!(
        o.system_tokens < o.conversation_tokens,
        "the system prompt ({} tokens) must be shorter than the conversation ({})",
        o.system_tokens,
        o.conversation_tokens
    );
    anyhow::ensure!(o.prompt_tokens > 0, "prompts need at least one token");
    anyhow::ensure!(
        o.engine.prefix_cache_bytes > 0,
        "the prefix cache needs memory"
    );
    let vocab = backend.config().vocab_size;
    let drafting = o.engine.draft_tokens > 0 && backend.can_draft();
    if o.engine.draft_tokens > 0 && !drafting {
        progress(
            "--draft-tokens: this model has no MTP head (or the backend cannot draft): no drafts",
        );
    }
    let vocab_limit = o.vocab_limit.unwrap_or(vocab);
    anyhow::ensure!(
        (1..=vocab).contains(&vocab_limit),
        "the vocabulary limit must be 1 to the model's {vocab} ids, not {vocab_limit}"
    );
    let prompt = |seed| synthetic_prompt(o.prompt_tokens, vocab_limit, seed);
    let asks = Asks {
        sampling: o.sampling.as_ref(),
        vocab_limit,
    };
    let no_cache = EngineOptions {
        prefix_cache_bytes: 0,
        ..o.engine.clone()
    };

    // Warm-up (a CUDA backend captures its decode graph on the first step).
    let (backend, _) = with_engine(backend, &no_cache, |e| {
        concurrent(e, vec![prompt(u64::MAX)], o.output_tokens.min(4), asks)
    })?;

    let (backend, (elapsed, in_backend)) = with_engine(backend, &no_cache, |e| {
        let start = Instant::now();
        concurrent(
            e,
            (0..o.streams as u64).map(prompt).collect(),
            o.output_tokens,
            asks,
        )?;
        let nanos = e.stats().backend_nanos_total.load(Ordering::Relaxed);
        Ok((start.elapsed(), Duration::from_nanos(nanos)))
    })?;
    let seconds = elapsed.as_secs_f64();
    let output = (o.streams * o.output_tokens) as f64;
    let throughput = Throughput {
        seconds,
        backend_seconds: in_backend.as_secs_f64(),
        output_tok_s: output / seconds,
        total_tok_s: (output + (o.streams * o.prompt_tokens) as f64) / seconds,
    };
    progress(&format!(
        "{} streams × {} + {} tokens: {:.1} output tok/s, {:.1} total tok/s ({:.2} of {:.2} s in the backend)",
        o.streams,
        o.prompt_tokens,
        o.output_tokens,
        throughput.output_tok_s,
        throughput.total_tok_s,
        throughput.backend_seconds,
        throughput.seconds
    ));

    // Each turn adds a message and an answer of `output_tokens`, after the system prompt.
    let shape = Conversation {
        turns: o.turns,
        system: o.system_tokens,
        message: ((o.conversation_tokens - o.system_tokens) / o.turns)
            .saturating_sub(o.output_tokens)
            .max(1),
        max_tokens: o.output_tokens,
    };
    let mut backend = backend;
    // rounds[r][turn]: (prompt tokens, cold TTFT, cached TTFT, cached tokens).
    let mut rounds = Vec::with_capacity(o.conversation_rounds);
    for _ in 0..o.conversation_rounds {
        let (b, cold) = with_engine(backend, &no_cache, |e| conversation(e, &shape, asks))?;
        let (b, cached) = with_engine(b, &o.engine, |e| conversation(e, &shape, asks))?;
        backend = b;
        let round: Vec<_> = (cold.iter().zip(&cached))
            .map(|((len, c), (_, w))| {
                let ttft = |t: &Timing| t.first_token().as_secs_f64();
                (*len, ttft(c), ttft(w), w.cached_tokens)
            })
            .collect();
        rounds.push(round);
    }
    let turns: Vec<Turn> = (0..shape.turns)
        .map(|i| {
            let of_turn = || rounds.iter().map(move |r| r[i]);
            let (prompt_tokens, _, _, _) = rounds[0][i];
            // The least any round reused: a round whose state was not saved shows.
            let cached_tokens = of_turn().map(|t| t.3).min().unwrap_or(0);
            Turn {
                prompt_tokens,
                ttft_cold_s: median(of_turn().map(|t| t.1).collect()),
                ttft_cached_s: median(of_turn().map(|t| t.2).collect()),
                cached_tokens,
            }
        })
        .collect();
    for (i, t) in turns.iter().enumerate() {
        progress(&format!(
            "turn {:>2}: {:>6} prompt tokens, first token after {:.4} s cold, {:.4} s cached ({} tokens reused; {:.2}× sooner)",
            i + 1,
            t.prompt_tokens,
            t.ttft_cold_s,
            t.ttft_cached_s,
            t.cached_tokens,
            t.speedup()
        ));
    }

    let (backend, (alone, drafts)) = with_engine(backend, &no_cache, |e| {
        let alone = concurrent(e, vec![prompt(1000)], o.output_tokens, asks)?;
        let stats = e.stats();
        let drafts = DraftCounts {
            passes: stats.draft_passes_total.load(Ordering::Relaxed),
            drafted: stats.draft_tokens_total.load(Ordering::Relaxed),
            accepted: stats.accepted_draft_tokens_total.load(Ordering::Relaxed),
        };
        Ok((alone, drafts))
    })?;
    let (backend, together) = with_engine(backend, &no_cache, |e| {
        let prompts = (0..o.decode_streams as u64)
            .map(|i| prompt(2000 + i))
            .collect();
        concurrent(e, prompts, o.output_tokens, asks)
    })?;
    let times: Vec<&[Duration]> = together.iter().map(|t| t.token_times.as_slice()).collect();
    let decode = DecodeScaling {
        alone_tok_s: alone[0].decode_tok_s(),
        per_stream_tok_s: together.iter().map(Timing::decode_tok_s).sum::<f64>()
            / together.len() as f64,
        steady_per_stream_tok_s: steady_per_stream_tok_s(&times),
        alone_drafts: drafting.then_some(drafts),
    };
    if let Some(d) = decode.alone_drafts {
        progress(&format!(
            "drafts alone: {} passes checked {} drafts, {} kept",
            d.passes, d.drafted, d.accepted
        ));
    }
    progress(&format!(
        "decode: {:.1} tok/s alone, {:.1} tok/s per stream with {} streams ({} while all decode)",
        decode.alone_tok_s,
        decode.per_stream_tok_s,
        o.decode_streams,
        decode
            .steady_per_stream_tok_s
            .map_or("no moment".into(), |v| format!("{v:.1} tok/s"))
    ));
    let report = ServeReport {
        throughput,
        turns,
        decode,
    };
    Ok((report, backend))
}

/// Runs `f` on a fresh engine over `backend` and takes the backend back.
fn with_engine<T>(
    backend: Box<dyn Backend>,
    options: &EngineOptions,
    f: impl FnOnce(&Engine) -> anyhow::Result<T>,
) -> anyhow::Result<(Box<dyn Backend>, T)> {
    let (engine, thread) = Engine::spawn(backend, options.clone());
    let result = f(&engine);
    drop(engine);
    let backend = thread
        .join()
        .map_err(|_| anyhow::anyhow!("the engine thread panicked"))?;
    Ok((backend, result?))
}

fn request(prompt: Vec<u32>, max_tokens: usize, asks: Asks) -> GenerateRequest {
    let (sampler, device_sampler) = match asks.sampling {
        None => (greedy_sampler(), greedy_device_sampler(asks.vocab_limit)),
        Some(params) => sampled(params, &prompt, asks.vocab_limit),
    };
    GenerateRequest {
        prompt,
        max_tokens,
        stop_token_ids: Vec::new(),
        sampler,
        prompt_cache_key: None,
        device_sampler: Some(device_sampler),
        prompt_logprobs: None,
        draft: true,
    }
}

/// A sampling request's two halves over one [`Sampler`], as the server pairs them: the CPU's
/// (for steps the backend hands back as logits) and the device's.
fn sampled(
    params: &SamplingParams,
    prompt: &[u32],
    vocab: usize,
) -> (crate::engine::Sampler, Box<dyn DeviceSampler>) {
    use std::sync::{Arc, Mutex};
    struct Device(Arc<Mutex<Sampler>>, usize);
    impl DeviceSampler for Device {
        fn device_step(&mut self) -> Option<(DeviceSampling, f64)> {
            lock(&self.0).device_step(self.1)
        }
        fn accept(&mut self, token: u32) -> SampledToken {
            lock(&self.0).record(token);
            SampledToken {
                id: token,
                logprob: None,
                top_logprobs: Vec::new(),
            }
        }
    }
    fn lock(s: &Mutex<Sampler>) -> std::sync::MutexGuard<'_, Sampler> {
        s.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
    let shared = Arc::new(Mutex::new(Sampler::new(params, prompt)));
    let cpu = shared.clone();
    (
        Box::new(move |logits: &mut [f32], _: &[u32]| SampledToken {
            // A benchmark's logits are always finite; were they not, the argmax stands in.
            id: lock(&cpu)
                .sample(logits)
                .map_or_else(|_| crate::model::argmax(logits), |s| s.token),
            logprob: None,
            top_logprobs: Vec::new(),
        }),
        Box::new(Device(shared, vocab)),
    )
}

/// Submits all prompts at once and waits for every answer.
fn concurrent(
    engine: &Engine,
    prompts: Vec<Vec<u32>>,
    max_tokens: usize,
    asks: Asks,
) -> anyhow::Result<Vec<Timing>> {
    let start = Instant::now();
    let receivers: Vec<_> = prompts
        .into_iter()
        .map(|p| engine.submit(request(p, max_tokens, asks)))
        .collect();
    std::thread::scope(|s| {
        let readers: Vec<_> = receivers
            .into_iter()
            .map(|rx| s.spawn(move || follow(rx, start)))
            .collect();
        readers
            .into_iter()
            .map(|r| r.join().expect("a reader thread"))
            .collect()
    })
}

/// The middle value (the mean of the two middle ones for an even count).
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => values[n / 2],
        _ => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// The shape of the agent conversation, in tokens.
struct Conversation {
    turns: usize,
    /// The system prompt before the first message.
    system: usize,
    /// Each turn's new message.
    message: usize,
    /// Each turn's answer.
    max_tokens: usize,
}

/// Runs the conversation; returns (prompt length, timing) per turn.
fn conversation(
    engine: &Engine,
    shape: &Conversation,
    asks: Asks,
) -> anyhow::Result<Vec<(usize, Timing)>> {
    let mut prompt = synthetic_prompt(shape.system, asks.vocab_limit, 4999);
    let mut out = Vec::with_capacity(shape.turns);
    for turn in 0..shape.turns {
        prompt.extend(synthetic_prompt(
            shape.message,
            asks.vocab_limit,
            5000 + turn as u64,
        ));
        let start = Instant::now();
        let timing = follow(
            engine.submit(request(prompt.clone(), shape.max_tokens, asks)),
            start,
        )?;
        let len = prompt.len();
        prompt.extend(&timing.tokens);
        out.push((len, timing));
    }
    Ok(out)
}

/// Reads one request's events to the end.
fn follow(mut rx: UnboundedReceiver<Event>, start: Instant) -> anyhow::Result<Timing> {
    let mut timing = Timing {
        tokens: Vec::new(),
        token_times: Vec::new(),
        cached_tokens: 0,
    };
    while let Some(event) = rx.blocking_recv() {
        match event {
            Event::Token(t) => {
                timing.tokens.push(t.id);
                timing.token_times.push(start.elapsed());
            }
            Event::Started { cached_tokens } => timing.cached_tokens = cached_tokens,
            Event::PromptToken(_) => {}
            Event::Done { .. } => return Ok(timing),
            Event::Error(e) => anyhow::bail!("a benchmark request failed: {e}"),
        }
    }
    anyhow::bail!("the engine stopped")
}

/// The report as markdown tables.
pub fn to_markdown(o: &ServeBenchOptions, r: &ServeReport) -> String {
    let mut md = match &o.sampling {
        None => "Requests: greedy".to_string(),
        Some(p) => format!(
            "Requests: sampled on the device, temperature {}, top-p {}, top-k {}",
            p.temperature,
            p.top_p,
            p.top_k.map_or("off".to_string(), |k| k.to_string())
        ),
    };
    md += &match o.vocab_limit {
        Some(limit) => format!(", ids below {limit}.\n\n"),
        None => ".\n\n".to_string(),
    };
    md += &format!(
        "### {} concurrent streams, {} prompt + {} output tokens each\n\n\
         | wall s | in the backend s | output tok/s | total tok/s |\n|---:|---:|---:|---:|\n| {:.2} | {:.2} | {:.1} | {:.1} |\n\n",
        o.streams,
        o.prompt_tokens,
        o.output_tokens,
        r.throughput.seconds,
        r.throughput.backend_seconds,
        r.throughput.output_tok_s,
        r.throughput.total_tok_s
    );
    md += &format!(
        "### Agent conversation, {} turns{}, time to first token{}\n\n\
         | turn | prompt tokens | TTFT cold s | TTFT cached s | reused tokens | cold / cached |\n|---:|---:|---:|---:|---:|---:|\n",
        r.turns.len(),
        match o.system_tokens {
            0 => String::new(),
            n => format!(" after a system prompt of {n} tokens"),
        },
        match o.conversation_rounds {
            1 => String::new(),
            n => format!(" (medians of {n} runs)"),
        }
    );
    for (i, t) in r.turns.iter().enumerate() {
        md += &format!(
            "| {} | {} | {:.4} | {:.4} | {} | {:.2} |\n",
            i + 1,
            t.prompt_tokens,
            t.ttft_cold_s,
            t.ttft_cached_s,
            t.cached_tokens,
            t.speedup()
        );
    }
    let steady = r
        .decode
        .steady_per_stream_tok_s
        .map_or("n/a".into(), |v| format!("{v:.1}"));
    md += &format!(
        "\n### Decode speed per stream\n\n\
         | 1 stream tok/s | per stream with {k} tok/s (first to last token) | per stream while all {k} decode tok/s |\n\
         |---:|---:|---:|\n| {:.1} | {:.1} | {steady} |\n",
        r.decode.alone_tok_s,
        r.decode.per_stream_tok_s,
        k = o.decode_streams,
    );
    if let Some(d) = r.decode.alone_drafts {
        md += &format!(
            "\nThe lone stream with up to {} MTP drafts a pass ({:?} schedule): {} passes \
             checked {} drafts, {} kept ({:.1} %).\n",
            o.engine.draft_tokens,
            o.engine.draft_schedule,
            d.passes,
            d.drafted,
            d.accepted,
            100.0 * d.accepted as f64 / d.drafted.max(1) as f64
        );
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: &[u64]) -> Vec<Duration> {
        v.iter().map(|&m| Duration::from_millis(m)).collect()
    }

    #[test]
    fn the_steady_rate_counts_only_the_window_where_every_stream_decodes() {
        // Stream a decodes every 10 ms from 0, b from 50 (its prompt came later); the window is
        // 50..=100 ms, where a sends 5 tokens (60..100) and b 5 (60..100 of its 50..140).
        let a = ms(&[0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100]);
        let b = ms(&[50, 60, 70, 80, 90, 100, 110, 120, 130, 140]);
        let rate = steady_per_stream_tok_s(&[&a, &b]).expect("a window");
        assert!((rate - 100.0).abs() < 1e-9, "{rate}");
        // A stream that ended before another began: no common window.
        let c = ms(&[200, 210]);
        assert_eq!(steady_per_stream_tok_s(&[&a, &c]), None);
        assert_eq!(steady_per_stream_tok_s(&[&ms(&[]), &ms(&[1, 2])]), None);
    }
}
