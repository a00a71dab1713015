//! Does a device decode greedily as the CPU reference does? (`lily agree`)
//!
//! The device runs a prompt and then `tokens` greedy steps, keeping each step's logits. The CPU
//! reference then runs the same prompt and, teacher-forced, the device's tokens, so every one of
//! the `tokens` positions is compared on the same history (a free-running comparison would stop
//! meaning anything at the first near-tie). A position agrees when the CPU's argmax is the
//! device's token; where it does not, the divergence is explained by a near-tie when the CPU's
//! own margin between its choice and the device's is within twice the largest difference
//! between the two backends' logits at that position.

use crate::model::cpu::{self, Logits};
use crate::model::{argmax, Backend, SequenceState, Weights};

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
}

impl Position {
    pub fn agrees(&self) -> bool {
        self.device_token == self.cpu_token
    }
    /// A divergence within the backends' own logit difference.
    pub fn near_tie(&self) -> bool {
        self.cpu_margin <= 2.0 * self.logit_error
    }
    /// The logits differ by more than [`MAX_LOGIT_ERROR`].
    pub fn out_of_tolerance(&self) -> bool {
        self.logit_error > MAX_LOGIT_ERROR
    }
}

#[derive(Debug, Clone)]
pub struct Report {
    pub device: String,
    pub prompt_tokens: usize,
    pub positions: Vec<Position>,
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
    /// Every divergence a near-tie and every position's logits within [`MAX_LOGIT_ERROR`].
    pub fn passes(&self) -> bool {
        self.unexplained() == 0 && self.out_of_tolerance() == 0
    }

    pub fn to_markdown(&self) -> String {
        let worst = self
            .positions
            .iter()
            .map(|p| p.logit_error)
            .fold(0f32, f32::max);
        let mut s = format!(
            "{} vs the CPU reference: {} of {} greedy tokens after a {}-token prompt agree \
             (teacher-forced on the device's tokens); {} divergences, {} not explained by a \
             near-tie; largest logit difference {:.2e} of the logit range, {} positions above \
             the {:.0e} bound: {}\n",
            self.device,
            self.agreeing(),
            self.positions.len(),
            self.prompt_tokens,
            self.positions.len() - self.agreeing(),
            self.unexplained(),
            worst,
            self.out_of_tolerance(),
            MAX_LOGIT_ERROR,
            if self.passes() { "PASS" } else { "FAIL" }
        );
        for (i, p) in self.positions.iter().enumerate() {
            if !p.agrees() {
                s += &format!(
                    "- position {i}: device {} / CPU {}, CPU margin {:.2e}, logit difference {:.2e}{}\n",
                    p.device_token,
                    p.cpu_token,
                    p.cpu_margin,
                    p.logit_error,
                    if p.near_tie() { " (near-tie)" } else { "" }
                );
            }
        }
        s
    }
}

/// Greedy steps on the device: its tokens and the logits each was chosen from.
pub fn device_run(
    backend: &mut dyn Backend,
    prompt: &[u32],
    tokens: usize,
) -> anyhow::Result<Vec<(u32, Vec<f32>)>> {
    anyhow::ensure!(!prompt.is_empty() && tokens > 0, "nothing to compare");
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
    Ok(steps)
}

/// The CPU reference on the same prompt, teacher-forced on the device's tokens.
pub fn compare(
    weights: &Weights,
    device: String,
    prompt: &[u32],
    steps: &[(u32, Vec<f32>)],
) -> Report {
    let vocab = weights.config.vocab_size;
    let mut state = SequenceState::new(&weights.config);
    // All but the last prompt token, then that one and the device's tokens (but the last) with
    // the logits of each position.
    let (head, last) = prompt.split_at(prompt.len() - 1);
    if !head.is_empty() {
        cpu::forward(weights, head, &mut state, Logits::Last);
    }
    let mut forced: Vec<u32> = last.to_vec();
    forced.extend(steps[..steps.len() - 1].iter().map(|(t, _)| *t));
    let cpu_logits = cpu::forward(weights, &forced, &mut state, Logits::All);
    let positions = steps
        .iter()
        .zip(cpu_logits.chunks(vocab))
        .map(|((token, device_logits), cpu_row)| {
            let cpu_token = argmax(cpu_row);
            let (lo, hi) = cpu_row
                .iter()
                .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
                    (lo.min(v), hi.max(v))
                });
            let range = (hi - lo).max(f32::MIN_POSITIVE);
            let diff = device_logits
                .iter()
                .zip(cpu_row)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            Position {
                device_token: *token,
                cpu_token,
                logit_error: diff / range,
                cpu_margin: (cpu_row[cpu_token as usize] - cpu_row[*token as usize]) / range,
            }
        })
        .collect();
    Report {
        device,
        prompt_tokens: prompt.len(),
        positions,
    }
}
