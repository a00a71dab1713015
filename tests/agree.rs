//! `lily agree`'s comparison (src/agree.rs) on the CPU: the CPU reference checked against itself
//! agrees everywhere, and wrong device tokens are caught.

mod common;

use lily::agree;
use lily::bench::synthetic_prompt;
use lily::checkpoint;
use lily::model::CpuBackend;

#[test]
fn the_cpu_agrees_with_itself() {
    let weights = checkpoint::load(&common::fixture_dir("tiny-a")).unwrap();
    let prompt = synthetic_prompt(40, weights.config.vocab_size, 3);
    let mut device = CpuBackend::new(weights.clone());
    let steps = agree::device_run(&mut device, &prompt, 12).unwrap();
    assert_eq!(steps.len(), 12);
    let report = agree::compare(&weights, "cpu".into(), &prompt, &steps);
    // Token by token (device_run) and chunked (compare) differ only by f32 summation order.
    assert_eq!(report.agreeing(), 12, "{}", report.to_markdown());
    assert!(report.positions.iter().all(|p| p.logit_error < 1e-4));
    assert_eq!(report.unexplained(), 0);
    assert!(report.passes());
}

#[test]
fn far_apart_logits_fail_even_where_tokens_agree() {
    let weights = checkpoint::load(&common::fixture_dir("tiny-a")).unwrap();
    let prompt = synthetic_prompt(40, weights.config.vocab_size, 7);
    let mut device = CpuBackend::new(weights.clone());
    let mut steps = agree::device_run(&mut device, &prompt, 6).unwrap();
    // A device that still picks the CPU's tokens but whose logits at position 2 are 30 % of
    // their range away from the CPU's: a near-tie could "explain" any divergence of such a
    // backend, so the report must fail on the logits alone.
    let logits = &mut steps[2].1;
    let (lo, hi) = logits
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(l, h), &v| {
            (l.min(v), h.max(v))
        });
    let shift = 0.3 * (hi - lo);
    for (i, v) in logits.iter_mut().enumerate() {
        *v += if i % 2 == 0 { shift } else { -shift };
    }
    let report = agree::compare(&weights, "cpu".into(), &prompt, &steps);
    assert_eq!(report.agreeing(), 6, "{}", report.to_markdown());
    assert_eq!(report.unexplained(), 0);
    assert_eq!(report.out_of_tolerance(), 1, "{}", report.to_markdown());
    assert!(!report.passes());
    assert!(report.to_markdown().contains("FAIL"));
}

#[test]
fn wrong_device_tokens_are_caught() {
    let weights = checkpoint::load(&common::fixture_dir("tiny-a")).unwrap();
    let prompt = synthetic_prompt(40, weights.config.vocab_size, 5);
    let mut device = CpuBackend::new(weights.clone());
    let mut steps = agree::device_run(&mut device, &prompt, 8).unwrap();
    // A device that picks the CPU's least likely token at position 3: its logits are the
    // CPU's, so the margin is the whole range, far beyond any near-tie.
    let (_, logits) = &steps[3];
    let worst = logits
        .iter()
        .enumerate()
        .min_by(|a, b| a.1.total_cmp(b.1))
        .unwrap()
        .0 as u32;
    steps[3].0 = worst;
    let report = agree::compare(&weights, "cpu".into(), &prompt, &steps);
    assert!(!report.positions[3].agrees());
    assert!(report.unexplained() >= 1, "{}", report.to_markdown());
}
