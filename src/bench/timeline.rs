//! `lily bench --timeline`: where a decode step's time goes while its CUDA graph runs, kernel by
//! kernel (see the CUDA backend's timeline.rs for how it is measured). Beside `--profile`, whose
//! events between kernels undo the overlap it would measure.

use super::{batched_greedy_step, median, start_sequences};
use crate::model::{Backend, DecodeTimeline, SeqId};

/// `batch` sequences each prefill `context` tokens, then `steps` greedy decode steps of all of
/// them in one pass each (one sequence: its own steps) under a timeline, after one step that
/// captures the graph; None where the backend cannot take a timeline.
pub fn decode_timeline(
    backend: &mut dyn Backend,
    context: usize,
    steps: usize,
    batch: usize,
) -> anyhow::Result<Option<DecodeTimeline>> {
    let seqs: Vec<SeqId> = (0..batch.max(1) as SeqId).map(|i| (1 << 46) + i).collect();
    let run = |backend: &mut dyn Backend| -> anyhow::Result<Option<DecodeTimeline>> {
        let mut next = start_sequences(backend, &seqs, context)?;
        let mut step = |backend: &mut dyn Backend| match &seqs[..] {
            [seq] => {
                next[0] = backend.forward_greedy(*seq, &[next[0]])?;
                Ok(())
            }
            _ => batched_greedy_step(backend, &seqs, &mut next),
        };
        step(backend)?;
        if !backend.start_timeline()? {
            return Ok(None);
        }
        let decoded = (0..steps).try_for_each(|_| step(backend));
        let timeline = backend.stop_timeline();
        decoded?;
        timeline
    };
    let out = run(backend);
    for &seq in &seqs {
        backend.free_sequence(seq);
    }
    out
}

/// The timeline as markdown: µs per step by section and by kernel, then one step's first
/// launches in order (the embedding and the first layers: a GDN layer, then the pattern
/// repeats to the first attention layer), each the median over the steps of its gap to the next
/// launch and of how long it waited for its predecessor (about 0: it was late, its launch or
/// its own work before the wait on the step's critical path).
pub fn to_markdown(
    context: usize,
    batch: usize,
    t: &DecodeTimeline,
    first_launches: usize,
) -> String {
    let steps = t.steps.max(1) as f64;
    let total: f64 = t.ops.iter().map(|o| o.ms).sum::<f64>() * 1e3 / steps;
    let mut s = format!(
        "### context {context}, {batch} sequences per step: {total:.0} µs per decode step in its CUDA graph, {} steps (from each kernel's start after its wait to the next kernel's; the last launch, the argmax, left out)\n\n",
        t.steps
    );
    let mut table = |title: &str, key: fn(&crate::model::OpTime) -> String| {
        let mut rows: Vec<(String, f64, u64)> = Vec::new();
        for o in &t.ops {
            let k = key(o);
            match rows.iter_mut().find(|r| r.0 == k) {
                Some(r) => {
                    r.1 += o.ms;
                    r.2 += o.calls;
                }
                None => rows.push((k, o.ms, o.calls)),
            }
        }
        rows.sort_by(|a, b| b.1.total_cmp(&a.1));
        s += &format!(
            "| {title} | µs/step | share | launches/step | µs/launch |\n|---|---:|---:|---:|---:|\n"
        );
        for (k, ms, calls) in rows {
            let per_step = ms * 1e3 / steps;
            s += &format!(
                "| {k} | {per_step:.1} | {:.1} % | {:.0} | {:.2} |\n",
                100.0 * per_step / total.max(1e-9),
                calls as f64 / steps,
                ms * 1e3 / calls.max(1) as f64
            );
        }
        s += "\n";
    };
    table("section", |o| o.section.clone());
    table("section: kernel", |o| {
        format!("{}: {}", o.section, o.kernel)
    });
    s += "| launch | section: kernel | median µs | waited µs | its marks, µs after its wait |\n|---:|---|---:|---:|---|\n";
    for (i, l) in t.launches.iter().take(first_launches).enumerate() {
        let marks: Vec<String> = l
            .marks_us
            .iter()
            .enumerate()
            .filter_map(|(m, us)| us.map(|us| format!("{m}: {us:.2}")))
            .collect();
        s += &format!(
            "| {i} | {}: {} | {:.2} | {:.2} | {} |\n",
            l.section,
            l.kernel,
            l.gap_us,
            l.waited_us,
            marks.join(", ")
        );
    }
    let all: Vec<f64> = t.launches.iter().map(|l| l.gap_us).collect();
    s += &format!(
        "\nMedian launch {:.2} µs over {} launches per step.\n\n",
        median(all),
        t.launches.len()
    );
    s + &crate::model::block_trace::to_markdown(&t.blocks)
}
