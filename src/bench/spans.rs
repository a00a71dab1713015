//! Passes of a few tokens of one sequence (`lily bench --span-tokens`): what a speculative
//! decoder's verify pass of k drafts + 1 would cost with today's kernels, beside one decode step.
//! Batch 1, after a prompt of the context; each pass advances the sequence by its tokens.

use std::time::Instant;

use super::{median, synthetic_prompt};
use crate::model::{Backend, SeqId};

/// Passes of `tokens` tokens at `context`: the median time of one.
#[derive(Debug, Clone, PartialEq)]
pub struct SpanPoint {
    pub context: usize,
    pub tokens: usize,
    pub us_per_pass: f64,
}

/// Tokens a sequence must have room for to run [`span_passes`] at `context`.
pub fn context_needed(context: usize, spans: &[usize], passes: usize) -> usize {
    // Each span length: one warm-up pass, then the measured ones.
    context + spans.iter().sum::<usize>() * (passes + 1)
}

/// After one prompt of `context` tokens, for each length of `spans`: a warm-up pass, then
/// `passes` timed passes of that many tokens (the greedy token of each fed back first, so the
/// text follows the model as decoding would).
pub fn span_passes(
    backend: &mut dyn Backend,
    seq: SeqId,
    context: usize,
    spans: &[usize],
    passes: usize,
) -> anyhow::Result<Vec<SpanPoint>> {
    anyhow::ensure!(passes >= 1, "at least one pass");
    anyhow::ensure!(
        spans.iter().all(|&k| k >= 1),
        "a pass has at least one token"
    );
    let vocab = backend.config().vocab_size;
    backend.create_sequence(seq)?;
    let run = |backend: &mut dyn Backend| -> anyhow::Result<Vec<SpanPoint>> {
        let mut next = backend.forward_greedy(seq, &synthetic_prompt(context, vocab, 7))?;
        let mut points = Vec::new();
        for &k in spans {
            let mut times = Vec::with_capacity(passes);
            for pass in 0..=passes {
                // The fed-back token, then k − 1 others (drafts; their values do not matter).
                let mut tokens = vec![next];
                tokens.extend(synthetic_prompt(k - 1, vocab, (k * 1000 + pass) as u64));
                let t = Instant::now();
                next = backend.forward_greedy(seq, &tokens)?;
                if pass > 0 {
                    times.push(t.elapsed().as_secs_f64() * 1e6);
                }
            }
            points.push(SpanPoint {
                context,
                tokens: k,
                us_per_pass: median(times),
            });
        }
        Ok(points)
    };
    let points = run(backend);
    backend.free_sequence(seq);
    points
}

/// The table: per context and span length, µs a pass and against one token's pass.
pub fn to_markdown(points: &[SpanPoint]) -> String {
    let mut md = String::from(
        "| context | tokens a pass | µs a pass | × one token's pass | tokens/s if all are kept |\n\
         |---:|---:|---:|---:|---:|\n",
    );
    for p in points {
        let one = points
            .iter()
            .find(|q| q.context == p.context && q.tokens == 1)
            .map_or("–".to_string(), |q| {
                format!("{:.2}", p.us_per_pass / q.us_per_pass)
            });
        md += &format!(
            "| {} | {} | {:.0} | {} | {:.0} |\n",
            p.context,
            p.tokens,
            p.us_per_pass,
            one,
            p.tokens as f64 * 1e6 / p.us_per_pass
        );
    }
    md
}
