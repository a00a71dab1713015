//! `lily agree --reference-router-bf16`: the CPU reference rounds its router logits to bf16 as the
//! GPU does. Its own binary, since the switch is process-wide (src/model/cpu/moe.rs).

mod common;

use std::sync::atomic::Ordering;

use lily::agree;
use lily::bench::synthetic_prompt;
use lily::checkpoint;
use lily::model::cpu::moe::ROUTER_LOGITS_BF16;
use lily::model::CpuBackend;

#[test]
fn bf16_router_logits_move_the_reference_a_little() {
    let weights = checkpoint::load(&common::fixture_dir("tiny-a")).unwrap();
    let prompt = synthetic_prompt(40, weights.config.vocab_size, 9);
    let mut device = CpuBackend::new(weights.clone());
    let run = agree::device_run(&mut device, &prompt, 8, false).unwrap();
    let exact = agree::compare(&weights, "cpu".into(), &prompt, &run, false).unwrap();
    ROUTER_LOGITS_BF16.store(true, Ordering::Relaxed);
    let rounded = agree::compare(&weights, "cpu".into(), &prompt, &run, false).unwrap();
    ROUTER_LOGITS_BF16.store(false, Ordering::Relaxed);
    let worst = |r: &agree::Report| {
        r.positions
            .iter()
            .map(|p| p.logit_error)
            .fold(0f32, f32::max)
    };
    // The switch reaches the reference (the logits move well beyond f32 summation order), and on
    // this 8-layer fixture they stay close (a wrong rounding would move them by the whole range).
    println!(
        "router logits f32: {:.2e}, bf16: {:.2e}",
        worst(&exact),
        worst(&rounded)
    );
    assert!(worst(&exact) < 1e-4, "{}", exact.to_markdown());
    assert!(worst(&rounded) > 1e-4, "{}", rounded.to_markdown());
    assert!(worst(&rounded) < 0.2, "{}", rounded.to_markdown());
}
