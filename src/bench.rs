//! The benchmark sweep (the protocol of Perplexity's Lily): batch 1, prompt length = context,
//! a warm-up at that context, then per round one measured prefill followed by N greedy decode
//! steps; the median of the rounds is reported. Works on any [`Backend`].

pub mod drafts;
pub mod spans;
pub mod timeline;

use std::time::Instant;

use crate::model::{Backend, OpTime, SeqId, Step, StepOutput};
use crate::sampling::DeviceSampling;

/// The contexts of the standard sweep.
pub const CONTEXTS: [usize; 10] = [
    256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072,
];

#[derive(Debug, Clone)]
pub struct BenchOptions {
    pub contexts: Vec<usize>,
    pub decode_steps: usize,
    pub rounds: usize,
    /// An idle pause between each round's prefill and its decode steps, so that the decode is
    /// measured apart from what the prefill leaves behind (clocks and power after a long prefill:
    /// a change that slowed prefill once seemed to speed decode, bench/NOTES.md v1.70).
    pub decode_pause: std::time::Duration,
}

#[derive(Debug, Clone, PartialEq)]
pub struct BenchPoint {
    pub context: usize,
    /// Seconds for the whole prompt (median over rounds).
    pub prefill_s: f64,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    /// Peak device memory seen during the point, when the backend can tell.
    pub peak_memory_bytes: Option<u64>,
}

/// Deterministic pseudo-random prompt ids below `vocab` (never a run of one id).
pub fn synthetic_prompt(len: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut x = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % vocab.min(200_000) as u64) as u32
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// One prefill of `context` tokens, a `pause`, and `steps` decode steps; returns (prefill s,
/// decode s).
fn one_round(
    backend: &mut dyn Backend,
    seq: SeqId,
    context: usize,
    steps: usize,
    pause: std::time::Duration,
) -> anyhow::Result<(f64, f64)> {
    let vocab = backend.config().vocab_size;
    let prompt = synthetic_prompt(context, vocab, context as u64);
    backend.create_sequence(seq)?;
    let t0 = Instant::now();
    let mut next = backend.forward_greedy(seq, &prompt)?;
    let prefill = t0.elapsed().as_secs_f64();
    std::thread::sleep(pause);
    let t1 = Instant::now();
    for _ in 0..steps {
        next = backend.forward_greedy(seq, &[next])?;
    }
    let decode = t1.elapsed().as_secs_f64();
    backend.free_sequence(seq);
    Ok((prefill, decode))
}

/// Runs the sweep, calling `report` after each point.
pub fn sweep(
    backend: &mut dyn Backend,
    options: &BenchOptions,
    mut report: impl FnMut(&BenchPoint),
) -> anyhow::Result<Vec<BenchPoint>> {
    anyhow::ensure!(options.rounds >= 1, "at least one round");
    let mut seq: SeqId = 1 << 40;
    let mut points = Vec::new();
    for &context in &options.contexts {
        // Warm-up at the exact shape, as the peers' scripts do: module loading, allocations,
        // graph capture and a library's first use of a shape (cuBLAS from 512 tokens on) stay
        // out of the numbers.
        seq += 1;
        let no_pause = std::time::Duration::ZERO; // the warm-up measures nothing
        one_round(backend, seq, context, options.decode_steps.min(8), no_pause)?;
        backend.reset_peak_memory();
        let mut prefills = Vec::new();
        let mut decodes = Vec::new();
        for _ in 0..options.rounds {
            seq += 1;
            let (p, d) = one_round(
                backend,
                seq,
                context,
                options.decode_steps,
                options.decode_pause,
            )?;
            prefills.push(p);
            decodes.push(d);
        }
        let prefill_s = median(prefills);
        let decode_s = median(decodes);
        let point = BenchPoint {
            context,
            prefill_s,
            prefill_tok_s: context as f64 / prefill_s,
            decode_tok_s: options.decode_steps as f64 / decode_s,
            peak_memory_bytes: backend.peak_memory(),
        };
        report(&point);
        points.push(point);
    }
    Ok(points)
}

/// Where the time of one prefill of `context` tokens and of the decode steps after it goes, op by
/// op (`lily bench --profile`; see [`Backend::set_op_timing`]).
#[derive(Debug, Clone)]
pub struct ProfilePoint {
    pub context: usize,
    pub decode_steps: usize,
    pub prefill: Vec<OpTime>,
    pub decode: Vec<OpTime>,
    /// The same decode steps for `batch` sequences at once (shared passes, as the server runs
    /// concurrent streams), at contexts up to [`PROFILE_BATCH_MAX_CONTEXT`]: (batch, op times).
    pub batched_decode: Option<(usize, Vec<OpTime>)>,
}

/// Default sequences per decode step in the batched part of a profile: issue 10's 8 streams.
pub const PROFILE_BATCH: usize = 8;
/// Longest context whose profile also times batched decode steps (their prompts are
/// `batch` prefills of the context each).
pub const PROFILE_BATCH_MAX_CONTEXT: usize = 4096;

/// Times the ops of one prefill and `steps` decode steps at each context, then (up to
/// [`PROFILE_BATCH_MAX_CONTEXT`]) the same steps for `batch` sequences at once, or None where the
/// backend cannot time its ops. Run it after the sweep: it takes the sweep's shapes as warm.
pub fn profile(
    backend: &mut dyn Backend,
    contexts: &[usize],
    steps: usize,
    batch: usize,
) -> anyhow::Result<Option<Vec<ProfilePoint>>> {
    if !backend.set_op_timing(true) {
        return Ok(None);
    }
    let mut seq: SeqId = 1 << 41;
    let mut points = Vec::new();
    let vocab = backend.config().vocab_size;
    for &context in contexts {
        seq += 1;
        backend.create_sequence(seq)?;
        let mut run = || -> anyhow::Result<ProfilePoint> {
            backend.take_op_times();
            let prompt = synthetic_prompt(context, vocab, context as u64);
            let mut next = backend.forward_greedy(seq, &prompt)?;
            let prefill = backend.take_op_times();
            for _ in 0..steps {
                next = backend.forward_greedy(seq, &[next])?;
            }
            Ok(ProfilePoint {
                context,
                decode_steps: steps,
                prefill,
                decode: backend.take_op_times(),
                batched_decode: None,
            })
        };
        let point = run();
        backend.free_sequence(seq);
        let mut point = point?;
        if batch > 1 && context <= PROFILE_BATCH_MAX_CONTEXT {
            // Reported beside the rest, never in its way: a failure here costs only this table.
            seq += batch as SeqId;
            match profile_batched_decode(backend, seq, batch, context, steps) {
                Ok(ops) => point.batched_decode = Some((batch, ops)),
                Err(e) => eprintln!("profile: batched decode at context {context}: {e:#}"),
            }
        }
        points.push(point);
    }
    backend.set_op_timing(false);
    Ok(Some(points))
}

/// The op times of `steps` decode steps of `batch` sequences at once (sequence ids
/// `first − batch + 1 ..= first`), each after its own prompt of `context` tokens; the
/// sequences are freed again. Empty where the backend does not time its ops.
pub fn profile_batched_decode(
    backend: &mut dyn Backend,
    first: SeqId,
    batch: usize,
    context: usize,
    steps: usize,
) -> anyhow::Result<Vec<OpTime>> {
    let seqs: Vec<SeqId> = (0..batch as SeqId).map(|i| first - i).collect();
    let run = |backend: &mut dyn Backend| -> anyhow::Result<Vec<OpTime>> {
        let mut next = start_sequences(backend, &seqs, context)?;
        backend.take_op_times();
        for _ in 0..steps {
            batched_greedy_step(backend, &seqs, &mut next)?;
        }
        Ok(backend.take_op_times())
    };
    let ops = run(backend);
    for &seq in &seqs {
        backend.free_sequence(seq);
    }
    ops
}

/// Creates each sequence of `seqs` and runs its own synthetic prompt of `context` tokens (seeded
/// by its place); returns each one's greedy next token. The caller frees them.
pub fn start_sequences(
    backend: &mut dyn Backend,
    seqs: &[SeqId],
    context: usize,
) -> anyhow::Result<Vec<u32>> {
    let vocab = backend.config().vocab_size;
    let mut next = Vec::with_capacity(seqs.len());
    for (i, &seq) in seqs.iter().enumerate() {
        backend.create_sequence(seq)?;
        let prompt = synthetic_prompt(context, vocab, (context + i) as u64);
        next.push(backend.forward_greedy(seq, &prompt)?);
    }
    Ok(next)
}

/// One decode step of every sequence of `seqs` in one batch, each fed its token of `next` and
/// given back its greedy next token there (picked on the device where the backend can).
pub fn batched_greedy_step(
    backend: &mut dyn Backend,
    seqs: &[SeqId],
    next: &mut [u32],
) -> anyhow::Result<()> {
    let greedy = DeviceSampling::greedy(backend.config().vocab_size);
    let tokens: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
    let batch: Vec<Step> = seqs
        .iter()
        .zip(&tokens)
        .map(|(&seq, token)| Step {
            seq,
            tokens: token,
            sample: Some((&greedy, 0.0)),
        })
        .collect();
    for (slot, out) in backend.forward_batch(&batch).into_iter().enumerate() {
        next[slot] = match out? {
            StepOutput::Token(t) => t,
            StepOutput::Logits(l) => crate::model::argmax(&l),
        };
    }
    Ok(())
}

/// One shared pass of `prompts` new prompts of `prompt_len` tokens each, with and without
/// `decode_rows` decode rows riding along (sequences that each prefilled a short prompt first), as
/// the server's passes mix them: (op times of the prompts alone, of the same with the rows).
/// Sequence ids from `first` downwards; all are freed again.
pub fn profile_mixed_pass(
    backend: &mut dyn Backend,
    first: SeqId,
    prompts: usize,
    prompt_len: usize,
    decode_rows: usize,
) -> anyhow::Result<(Vec<OpTime>, Vec<OpTime>)> {
    let vocab = backend.config().vocab_size;
    let greedy = DeviceSampling::greedy(vocab);
    let ids: Vec<SeqId> = (0..(2 * prompts + decode_rows) as SeqId)
        .map(|i| first - i)
        .collect();
    let run = |backend: &mut dyn Backend| -> anyhow::Result<(Vec<OpTime>, Vec<OpTime>)> {
        for &seq in &ids {
            backend.create_sequence(seq)?;
        }
        let (alone, rest) = ids.split_at(prompts);
        let (mixed, riders) = rest.split_at(prompts);
        let mut next = Vec::new();
        for (i, &seq) in riders.iter().enumerate() {
            next.push(backend.forward_greedy(seq, &synthetic_prompt(32, vocab, i as u64))?);
        }
        let texts: Vec<Vec<u32>> = (0..prompts)
            .map(|i| synthetic_prompt(prompt_len, vocab, (1000 + i) as u64))
            .collect();
        let singles: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let mut pass = |prompt_seqs: &[SeqId], rows: &[SeqId]| -> anyhow::Result<Vec<OpTime>> {
            let mut steps: Vec<Step> = prompt_seqs
                .iter()
                .zip(&texts)
                .map(|(&seq, text)| Step {
                    seq,
                    tokens: text,
                    sample: Some((&greedy, 0.0)),
                })
                .collect();
            steps.extend(rows.iter().zip(&singles).map(|(&seq, token)| Step {
                seq,
                tokens: token,
                sample: Some((&greedy, 0.0)),
            }));
            backend.take_op_times();
            for out in backend.forward_batch(&steps) {
                out?;
            }
            Ok(backend.take_op_times())
        };
        Ok((pass(alone, &[])?, pass(mixed, riders)?))
    };
    let ops = run(backend);
    for &seq in &ids {
        backend.free_sequence(seq);
    }
    ops
}

/// The mixed pass of [`profile_mixed_pass`] beside the prompts alone, by section (ms).
pub fn mixed_markdown(
    prompts: usize,
    prompt_len: usize,
    rows: usize,
    alone: &[OpTime],
    mixed: &[OpTime],
) -> String {
    let total = |ops: &[OpTime]| ops.iter().map(|o| o.ms).sum::<f64>();
    let mut s = format!(
        "### One pass of {prompts} prompts × {prompt_len} tokens: {:.1} ms alone, {:.1} ms with {rows} decode rows\n\n",
        total(alone),
        total(mixed)
    );
    let mut table = |title: &str, key: fn(&OpTime) -> String| {
        let mut rows_by = sum_by(alone, mixed, key);
        rows_by.sort_by(|a, b| (b.2 - b.1).total_cmp(&(a.2 - a.1)));
        s += &format!(
            "| {title} | alone ms | with decode rows ms | difference |\n|---|---:|---:|---:|\n"
        );
        for (k, a, b) in rows_by {
            s += &format!("| {k} | {a:.2} | {b:.2} | {:+.2} |\n", b - a);
        }
        s += "\n";
    };
    table("section", |o| o.section.clone());
    table("section: kernel", |o| {
        format!("{}: {}", o.section, o.kernel)
    });
    s
}

/// Tables of a profile: time per section of the forward pass, then per kernel; prefill in ms
/// for the whole prompt, decode in µs per step.
pub fn profile_markdown(points: &[ProfilePoint]) -> String {
    let mut s = String::new();
    for p in points {
        let total = |ops: &[OpTime]| ops.iter().map(|o| o.ms).sum::<f64>();
        let (pf, dc) = (total(&p.prefill), total(&p.decode));
        let steps = p.decode_steps.max(1) as f64;
        s += &format!(
            "### context {}: prefill {:.1} ms, decode {:.0} µs per step (profiled: each op timed by events, decode without its CUDA graph)\n\n",
            p.context,
            pf,
            dc * 1e3 / steps
        );
        let share = |ms: f64, all: f64| if all > 0.0 { 100.0 * ms / all } else { 0.0 };
        let mut table = |title: &str, key: fn(&OpTime) -> String| {
            // Rows in order of prefill time, then decode-only rows in order of decode time.
            let mut rows = sum_by(&p.prefill, &p.decode, key);
            rows.sort_by(|a, b| b.1.total_cmp(&a.1).then(b.2.total_cmp(&a.2)));
            s += &format!("| {title} | prefill ms | share | decode µs/step | share |\n|---|---:|---:|---:|---:|\n");
            for (k, a, b) in rows {
                s += &format!(
                    "| {k} | {a:.2} | {:.1} % | {:.1} | {:.1} % |\n",
                    share(a, pf),
                    b * 1e3 / steps,
                    share(b, dc)
                );
            }
            s += "\n";
        };
        table("section", |o| o.section.clone());
        table("section: kernel", |o| {
            format!("{}: {}", o.section, o.kernel)
        });
        if let Some((batch, ops)) = &p.batched_decode {
            s += &batched_markdown(&p.decode, *batch, ops, steps);
        }
    }
    s
}

/// The batched decode steps beside the single-sequence ones, by section: µs per step each, and
/// how many times longer the batched step is (issue 10 asks each of 8 streams to decode at ≥ 60 %
/// of one stream's speed alone: a batched step at most 1 / 0.6 ≈ 1.67× the single step).
fn batched_markdown(single: &[OpTime], batch: usize, batched: &[OpTime], steps: f64) -> String {
    let total = |ops: &[OpTime]| ops.iter().map(|o| o.ms).sum::<f64>();
    let (one, many) = (total(single) * 1e3 / steps, total(batched) * 1e3 / steps);
    let mut s = format!(
        "Decode with {batch} sequences per step: {many:.0} µs per step ({:.2}× one sequence's {one:.0} µs)\n\n",
        if one > 0.0 { many / one } else { 0.0 }
    );
    let mut rows = sum_by(single, batched, |o| o.section.clone());
    rows.sort_by(|a, b| b.2.total_cmp(&a.2));
    s += &format!("| section | µs/step, 1 sequence | µs/step, {batch} sequences | ratio |\n|---|---:|---:|---:|\n");
    for (section, a, b) in rows {
        let ratio = if a > 0.0 {
            format!("{:.2}×", b / a)
        } else {
            "–".into()
        };
        s += &format!(
            "| {section} | {:.1} | {:.1} | {ratio} |\n",
            a * 1e3 / steps,
            b * 1e3 / steps
        );
    }
    s + "\n"
}

/// The ms of two op lists summed per `key`, as (key, ms in `first`, ms in `second`), keys in
/// order of first appearance.
fn sum_by(
    first: &[OpTime],
    second: &[OpTime],
    key: impl Fn(&OpTime) -> String,
) -> Vec<(String, f64, f64)> {
    let mut rows: Vec<(String, f64, f64)> = Vec::new();
    for (ops, in_first) in [(first, true), (second, false)] {
        for o in ops {
            let k = key(o);
            let i = match rows.iter().position(|r| r.0 == k) {
                Some(i) => i,
                None => {
                    rows.push((k, 0.0, 0.0));
                    rows.len() - 1
                }
            };
            if in_first {
                rows[i].1 += o.ms;
            } else {
                rows[i].2 += o.ms;
            }
        }
    }
    rows
}

pub fn to_csv(points: &[BenchPoint]) -> String {
    let mut s = String::from("context,prefill_s,prefill_tok_s,decode_tok_s,peak_memory_bytes\n");
    for p in points {
        s += &format!(
            "{},{:.6},{:.1},{:.1},{}\n",
            p.context,
            p.prefill_s,
            p.prefill_tok_s,
            p.decode_tok_s,
            p.peak_memory_bytes
                .map(|b| b.to_string())
                .unwrap_or_default()
        );
    }
    s
}

pub fn to_markdown(points: &[BenchPoint]) -> String {
    let mut s = String::from("| context | prefill tok/s | decode tok/s | TTFT (s) | peak memory (GB) |\n|---:|---:|---:|---:|---:|\n");
    for p in points {
        s += &format!(
            "| {} | {:.0} | {:.1} | {:.3} | {} |\n",
            p.context,
            p.prefill_tok_s,
            p.decode_tok_s,
            p.prefill_s,
            p.peak_memory_bytes
                .map(|b| format!("{:.2}", b as f64 / 1e9))
                .unwrap_or_else(|| "–".into())
        );
    }
    s
}

/// A PNG chart of `what` ("prefill" or "decode") tok/s against context for several engines.
pub fn to_png(engines: &[(String, Vec<BenchPoint>)], what: &str) -> Vec<u8> {
    use crate::plot::{Chart, Series, PALETTE};
    let series = |f: fn(&BenchPoint) -> f64| -> Vec<Series> {
        engines
            .iter()
            .enumerate()
            .map(|(i, (name, pts))| Series {
                name: name.clone(),
                color: PALETTE[i % PALETTE.len()],
                points: pts.iter().map(|p| (p.context as f64, f(p))).collect(),
            })
            .collect()
    };
    let (title, series) = match what {
        "prefill" => ("Prefill, batch 1", series(|p| p.prefill_tok_s)),
        _ => ("Decode, batch 1", series(|p| p.decode_tok_s)),
    };
    Chart {
        title: title.into(),
        x_label: "context (tokens)".into(),
        y_label: "tok/s".into(),
        series,
    }
    .to_png()
}
