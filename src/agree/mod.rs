//! Does a device decode greedily as the CPU reference does? (`lily agree`)
//!
//! The device runs a prompt and then `tokens` greedy steps, keeping each step's logits. The CPU
//! reference then runs the same prompt and, teacher-forced, the device's tokens, so every one of
//! the `tokens` positions is compared on the same history (a free-running comparison would stop
//! meaning anything at the first near-tie). A position agrees when the CPU's argmax is the
//! device's token; where it does not, the divergence is explained by a near-tie when the CPU's
//! own margin between its choice and the device's is within twice the largest difference
//! between the two backends' logits at that position.
//!
//! A random model's router puts its 256 experts within a hair of each other, so the device's bf16
//! rounding flips some of its choices, and each flip moves that token's output by an expert's
//! whole contribution: over 40 layers the two backends drift apart without either being wrong
//! (bench/NOTES.md v1.15). With the device's routing traced, the reference runs the experts the
//! device chose instead of its own top-k: the two then compute the same function, so their
//! logits must stay close, and every choice that differs is checked against the device's own
//! router logits (a correct top-k of them) and measured against the reference's (how close a
//! tie it was, and how far the device's router logits are from the reference's at each layer).

pub mod store;

use crate::model::cpu::moe::RoutingStats;
use crate::model::cpu::{self, ImposedRouting, Logits};
use crate::model::{argmax, Backend, RoutingTrace, SequenceState, Weights};

/// The largest logit difference (of the CPU logits' range) a position may show: the whole-model
/// GPU test's bound (tests/cuda_forward.rs). Past it, the backends compute different functions
/// there, and a divergence can no longer be called a near-tie — so such a position fails even when
/// its tokens agree.
pub const MAX_LOGIT_ERROR: f32 = 8e-2;

/// One compared position.
#[derive(Debug, Clone, PartialEq)]
pub struct Position {
    pub device_token: u32,
    pub cpu_token: u32,
    /// max |device − cpu| over the vocabulary, divided by the CPU logits' range.
    pub logit_error: f32,
    /// The CPU's logit of its choice minus its logit of the device's token (0 when they agree),
    /// divided by the same range.
    pub cpu_margin: f32,
    /// With the bf16 bound: max |bf16-activation reference − f32 reference| over the same range —
    /// how far bf16 activations alone move this position's logits.
    pub bf16_error: Option<f32>,
}

impl Position {
    pub fn agrees(&self) -> bool {
        self.device_token == self.cpu_token
    }
    /// A divergence within the backends' own logit difference.
    pub fn near_tie(&self) -> bool {
        self.cpu_margin <= 2.0 * self.logit_error
    }
    /// The largest logit difference allowed here: [`MAX_LOGIT_ERROR`], or with the bf16 bound
    /// twice what bf16 activations alone move the reference, if that is more (the rule the bf16
    /// fixtures are held to against transformers' bf16 runs, tests/model_cpu.rs).
    pub fn tolerance(&self) -> f32 {
        self.bf16_error
            .map_or(MAX_LOGIT_ERROR, |b| MAX_LOGIT_ERROR.max(2.0 * b))
    }
    /// The logits differ by more than [`tolerance`](Position::tolerance).
    pub fn out_of_tolerance(&self) -> bool {
        self.logit_error > self.tolerance()
    }
}

#[derive(Debug, Clone)]
pub struct Report {
    pub device: String,
    pub prompt_tokens: usize,
    pub positions: Vec<Position>,
    /// Per layer, when the reference ran the device's routing.
    pub routing: Option<Vec<RoutingStats>>,
}

impl Report {
    pub fn agreeing(&self) -> usize {
        self.positions.iter().filter(|p| p.agrees()).count()
    }
    /// Divergences that a near-tie does not explain.
    pub fn unexplained(&self) -> usize {
        self.positions
            .iter()
            .filter(|p| !p.agrees() && !p.near_tie())
            .count()
    }
    /// Positions whose logits differ by more than [`MAX_LOGIT_ERROR`].
    pub fn out_of_tolerance(&self) -> usize {
        self.positions
            .iter()
            .filter(|p| p.out_of_tolerance())
            .count()
    }
    /// Rows whose device routing is not the top-k of the device's own router logits.
    pub fn inconsistent_routing(&self) -> usize {
        self.routing.iter().flatten().map(|l| l.inconsistent).sum()
    }
    /// Every divergence a near-tie, every position's logits within [`MAX_LOGIT_ERROR`], and
    /// (when traced) the device's routing the top-k of its own router logits.
    pub fn passes(&self) -> bool {
        self.unexplained() == 0 && self.out_of_tolerance() == 0 && self.inconsistent_routing() == 0
    }

    pub fn to_markdown(&self) -> String {
        let worst = self
            .positions
            .iter()
            .map(|p| p.logit_error)
            .fold(0f32, f32::max);
        let bound = match self
            .positions
            .iter()
            .filter_map(|p| p.bf16_error)
            .reduce(f32::max)
        {
            Some(b) => format!(
                "the bound (max of {MAX_LOGIT_ERROR:.0e} and twice the bf16-activation \
                 reference's distance from the f32 one at that position; that distance at most \
                 {b:.2e})"
            ),
            None => format!("the {MAX_LOGIT_ERROR:.0e} bound"),
        };
        let mut s = format!(
            "{} vs the CPU reference{}: {} of {} greedy tokens after a {}-token prompt agree \
             (teacher-forced on the device's tokens); {} divergences, {} not explained by a \
             near-tie; largest logit difference {:.2e} of the logit range, {} positions above \
             {bound}: {}\n",
            self.device,
            if self.routing.is_some() {
                " running the device's expert choices"
            } else {
                ""
            },
            self.agreeing(),
            self.positions.len(),
            self.prompt_tokens,
            self.positions.len() - self.agreeing(),
            self.unexplained(),
            worst,
            self.out_of_tolerance(),
            if self.passes() { "PASS" } else { "FAIL" }
        );
        if let Some(layers) = &self.routing {
            s += &routing_markdown(layers);
        }
        for (i, p) in self.positions.iter().enumerate() {
            if !p.agrees() || p.out_of_tolerance() {
                s += &format!(
                    "- position {i}: device {} / CPU {}, CPU margin {:.2e}, logit difference {:.2e} \
                     (bound {:.2e}){}\n",
                    p.device_token,
                    p.cpu_token,
                    p.cpu_margin,
                    p.logit_error,
                    p.tolerance(),
                    if p.agrees() {
                        ""
                    } else if p.near_tie() {
                        " (near-tie)"
                    } else {
                        " (not a near-tie)"
                    }
                );
            }
        }
        s
    }
}

/// The routing comparison, a line per layer.
fn routing_markdown(layers: &[RoutingStats]) -> String {
    let choices: usize = layers.iter().map(|l| l.rows).sum::<usize>();
    let flipped: usize = layers.iter().map(|l| l.flipped).sum();
    let inconsistent: usize = layers.iter().map(|l| l.inconsistent).sum();
    let mut s = format!(
        "\nRouting: of {choices} (row, layer) routings the reference's own top-k differs from the \
         device's in {flipped} expert choices; {inconsistent} rows where the device's choice is not \
         the top-k of its own router logits. Per layer: rows, choices flipped, the largest \
         reference margin of a flipped choice and the largest |device − reference| router logit \
         (both over the row's reference logit range).\n\n\
         | layer | rows | flipped | largest flip margin | largest router distance | inconsistent |\n\
         |---:|---:|---:|---:|---:|---:|\n"
    );
    for (i, l) in layers.iter().enumerate() {
        s += &format!(
            "| {i} | {} | {} | {:.2e} | {:.2e} | {} |\n",
            l.rows, l.flipped, l.largest_flip_margin, l.largest_distance, l.inconsistent
        );
    }
    s + "\n"
}

/// What [`device_run`] brings back: each greedy step's token and the logits it was chosen from,
/// and with tracing what the device's routers decided for every row.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceRun {
    pub steps: Vec<(u32, Vec<f32>)>,
    pub routing: Option<RoutingTrace>,
}

/// Greedy steps on the device after `prompt`, its routing traced when `trace_routing`.
pub fn device_run(
    backend: &mut dyn Backend,
    prompt: &[u32],
    tokens: usize,
    trace_routing: bool,
) -> anyhow::Result<DeviceRun> {
    anyhow::ensure!(!prompt.is_empty() && tokens > 0, "nothing to compare");
    if trace_routing {
        anyhow::ensure!(
            backend.trace_routing(),
            "{} cannot trace its routing",
            backend.device_name()
        );
    }
    backend.create_sequence(0)?;
    let mut steps = Vec::with_capacity(tokens);
    let mut logits = backend.forward(0, prompt)?;
    for _ in 0..tokens {
        let token = argmax(&logits);
        let next = if steps.len() + 1 < tokens {
            Some(backend.forward(0, &[token])?)
        } else {
            None
        };
        steps.push((token, logits));
        match next {
            Some(l) => logits = l,
            None => break,
        }
    }
    backend.free_sequence(0);
    let routing = if trace_routing {
        backend.take_routing_trace()
    } else {
        None
    };
    Ok(DeviceRun { steps, routing })
}

/// The CPU reference on the same prompt, teacher-forced on the device's tokens; with the device's
/// routing traced (`run.routing`) running the experts the device chose. With `bf16_bound` the
/// reference runs a second time with bf16 activations, and each position may differ from the f32
/// reference by twice what that moves it ([`Position::tolerance`]).
pub fn compare(
    weights: &Weights,
    device: String,
    prompt: &[u32],
    run: &DeviceRun,
    bf16_bound: bool,
) -> anyhow::Result<Report> {
    let f32_run = reference_run(weights, prompt, run, false)?;
    let bf16_run = if bf16_bound {
        Some(reference_run(weights, prompt, run, true)?)
    } else {
        None
    };
    Ok(report(
        device,
        prompt.len(),
        run,
        &f32_run,
        bf16_run.as_ref(),
    ))
}

/// The CPU reference's side of a comparison: its logits at the compared positions
/// (`[positions][vocab]`) and, when it ran the device's routing, how the routings compare.
#[derive(Debug, Clone, PartialEq)]
pub struct ReferenceRun {
    pub logits: Vec<f32>,
    pub routing: Option<Vec<RoutingStats>>,
}

/// One pass of the reference over the prompt and the device's tokens, in f32 or with bf16
/// activations (cpu::ops::ACTIVATIONS_BF16, process-wide, restored after).
pub fn reference_run(
    weights: &Weights,
    prompt: &[u32],
    run: &DeviceRun,
    bf16_activations: bool,
) -> anyhow::Result<ReferenceRun> {
    anyhow::ensure!(
        !prompt.is_empty() && !run.steps.is_empty(),
        "nothing to compare"
    );
    if let Some(trace) = &run.routing {
        check_trace(weights, trace, prompt.len() + run.steps.len() - 1)?;
    }
    use std::sync::atomic::Ordering;
    let flag = &cpu::ops::ACTIVATIONS_BF16;
    let before = flag.swap(
        bf16_activations || flag.load(Ordering::Relaxed),
        Ordering::Relaxed,
    );
    let (logits, routing) = reference(weights, prompt, run);
    flag.store(before, Ordering::Relaxed);
    Ok(ReferenceRun { logits, routing })
}

/// The report from the device's run and the reference's (and, for the bf16 bound, the
/// reference's with bf16 activations), which may have been made in separate processes (store.rs).
pub fn report(
    device: String,
    prompt_tokens: usize,
    run: &DeviceRun,
    f32_run: &ReferenceRun,
    bf16_run: Option<&ReferenceRun>,
) -> Report {
    let vocab = f32_run.logits.len() / run.steps.len().max(1);
    let positions = run
        .steps
        .iter()
        .zip(f32_run.logits.chunks(vocab))
        .enumerate()
        .map(|(i, ((token, device_logits), cpu_row))| {
            let cpu_token = argmax(cpu_row);
            let (lo, hi) = cpu_row
                .iter()
                .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
                    (lo.min(v), hi.max(v))
                });
            let range = (hi - lo).max(f32::MIN_POSITIVE);
            let distance = |other: &[f32]| {
                other
                    .iter()
                    .zip(cpu_row)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max)
                    / range
            };
            Position {
                device_token: *token,
                cpu_token,
                logit_error: distance(device_logits),
                cpu_margin: (cpu_row[cpu_token as usize] - cpu_row[*token as usize]) / range,
                bf16_error: bf16_run.map(|b| distance(&b.logits[i * vocab..(i + 1) * vocab])),
            }
        })
        .collect();
    Report {
        device,
        prompt_tokens,
        positions,
        routing: f32_run.routing.clone(),
    }
}

/// The reference's logits at the compared positions (all but the last prompt token first, then
/// that token and the device's tokens but the last, each with its logits), following the device's
/// routing when traced (checked by the caller), with the routing comparison.
fn reference(
    weights: &Weights,
    prompt: &[u32],
    run: &DeviceRun,
) -> (Vec<f32>, Option<Vec<RoutingStats>>) {
    let mut state = SequenceState::new(&weights.config);
    let (head, last) = prompt.split_at(prompt.len() - 1);
    let mut forced: Vec<u32> = last.to_vec();
    forced.extend(run.steps[..run.steps.len() - 1].iter().map(|(t, _)| *t));
    match &run.routing {
        None => {
            if !head.is_empty() {
                cpu::forward(weights, head, &mut state, Logits::Last);
            }
            (
                cpu::forward(weights, &forced, &mut state, Logits::All),
                None,
            )
        }
        Some(trace) => {
            let mut stats = vec![RoutingStats::default(); weights.layers.len()];
            let mut imposed = ImposedRouting {
                trace,
                row: 0,
                stats: &mut stats,
            };
            if !head.is_empty() {
                cpu::forward_routed(weights, head, &mut state, Logits::Last, &mut imposed);
            }
            let logits =
                cpu::forward_routed(weights, &forced, &mut state, Logits::All, &mut imposed);
            (logits, Some(stats))
        }
    }
}

/// A trace of `rows` rows for every layer of the model, its experts in range.
fn check_trace(weights: &Weights, trace: &RoutingTrace, rows: usize) -> anyhow::Result<()> {
    let (e, k) = (
        weights.config.num_experts,
        weights.config.num_experts_per_tok,
    );
    let layers = weights.layers.len();
    anyhow::ensure!(
        trace.experts.len() == layers && trace.logits.len() == layers,
        "the routing trace has {} layers, the model {layers}",
        trace.experts.len()
    );
    for (i, (experts, logits)) in trace.experts.iter().zip(&trace.logits).enumerate() {
        anyhow::ensure!(
            experts.len() == rows * k && logits.len() == rows * e,
            "layer {i} of the routing trace has {} rows of experts and {} of logits, not {rows}",
            experts.len() / k,
            logits.len() / e
        );
        if let Some(bad) = experts.iter().find(|&&x| x as usize >= e) {
            anyhow::bail!("layer {i} of the routing trace names expert {bad} of {e}");
        }
    }
    Ok(())
}
