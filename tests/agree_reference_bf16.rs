//! `lily agree --reference-bf16-activations`: the CPU reference rounds its activations to bf16
//! where a bf16 engine stores them (src/model/cpu/ops.rs). Its own binary, since the switch is
//! process-wide.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Mutex;

use common::{fixture_dir, rel_error, Reference};
use lily::checkpoint;
use lily::model::cpu::ops::ACTIVATIONS_BF16;
use lily::model::cpu::{forward, Logits};
use lily::model::SequenceState;

/// The tests of this binary one at a time: they turn the process-wide switch.
static SWITCH: Mutex<()> = Mutex::new(());

/// transformers' bf16 runs of the bf16 fixtures against our f32 and bf16-activation runs. Random
/// tiny models amplify rounding, so two bf16 engines that round at different points do not land
/// near each other (measured: ours is 2e-2 to 4e-1 from transformers' bf16 run); what must hold is
/// that our rounding moves the model from transformers' f32 run about as far as transformers' own
/// bf16 does (measured ratios 0.33–1.05): within 4× either way. Missing roundings would leave the
/// f32 run (ratio ~1e-3); a coarser format would overshoot.
#[test]
fn bf16_activations_move_the_model_as_transformers_bf16_does() {
    let _one_at_a_time = SWITCH.lock().unwrap();
    for name in ["tiny-a-bf16", "tiny-c"] {
        let weights = checkpoint::load(&fixture_dir(name)).unwrap();
        let reference = Reference::load(name);
        for p in 0..reference.prompts() {
            let ids = reference.ids(p, "ids");
            let run = |bf16: bool| {
                ACTIVATIONS_BF16.store(bf16, Ordering::Relaxed);
                let mut state = SequenceState::new(&weights.config);
                let logits = forward(&weights, &ids, &mut state, Logits::All);
                ACTIVATIONS_BF16.store(false, Ordering::Relaxed);
                logits
            };
            let (f32_run, bf16_run) = (run(false), run(true));
            let tf_bf16 = reference.f32s(p, "logits");
            let tf_f32 = reference.f32s(p, "logits_f32");
            println!(
                "{name} prompt {p}: bf16 activations vs transformers bf16 {:.2e}, vs transformers f32 {:.2e}; \
                 f32 vs transformers bf16 {:.2e}; transformers bf16 vs f32 {:.2e}",
                rel_error(&bf16_run, &tf_bf16),
                rel_error(&bf16_run, &tf_f32),
                rel_error(&f32_run, &tf_bf16),
                rel_error(&tf_bf16, &tf_f32),
            );
            let ratio = rel_error(&bf16_run, &tf_f32) / rel_error(&tf_bf16, &tf_f32);
            assert!(
                (0.25..=4.0).contains(&ratio),
                "{name} prompt {p}: bf16 activations move the logits {ratio:.2}× as far as transformers' bf16"
            );
        }
    }
}

/// `lily agree --bf16-bound`: the reference runs again with bf16 activations, and each position's
/// bound is twice how far that moves it (when above 8e-2). The CPU as the device is far inside it;
/// a device whose logits sit three times that distance (and past 8e-2) away is not.
#[test]
fn the_bf16_bound_is_twice_what_bf16_activations_do() {
    let _one_at_a_time = SWITCH.lock().unwrap();
    let weights = checkpoint::load(&fixture_dir("tiny-a")).unwrap();
    let prompt = lily::bench::synthetic_prompt(40, weights.config.vocab_size, 21);
    let mut device = lily::model::CpuBackend::new(weights.clone());
    let mut run = lily::agree::device_run(&mut device, &prompt, 8, true).unwrap();
    let report = lily::agree::compare(&weights, "cpu".into(), &prompt, &run, true).unwrap();
    println!("{}", report.to_markdown());
    assert!(
        !ACTIVATIONS_BF16.load(Ordering::Relaxed),
        "the switch is restored"
    );
    for p in &report.positions {
        let b = p.bf16_error.expect("the bf16 reference ran");
        assert!(
            b > 1e-4,
            "bf16 activations moved the logits by only {b:.2e}"
        );
        assert_eq!(p.tolerance(), lily::agree::MAX_LOGIT_ERROR.max(2.0 * b));
    }
    assert!(report.passes(), "{}", report.to_markdown());
    // Position 3's device logits moved by 3× its bf16 distance (at least 0.1 of the range).
    let b = report.positions[3].bf16_error.unwrap();
    let logits = &mut run.steps[3].1;
    let (lo, hi) = logits
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(l, h), &v| {
            (l.min(v), h.max(v))
        });
    let shift = (3.0 * b).max(0.1) * (hi - lo);
    let top = lily::model::argmax(logits) as usize;
    for (i, v) in logits.iter_mut().enumerate() {
        if i != top {
            *v -= shift;
        }
    }
    let report = lily::agree::compare(&weights, "cpu".into(), &prompt, &run, true).unwrap();
    assert!(
        report.positions[3].out_of_tolerance(),
        "{}",
        report.to_markdown()
    );
    assert!(!report.passes());
}

/// `--bf16-bound` split over processes: the f32 reference saved, then loaded beside a bf16 pass,
/// gives the one-shot report.
#[test]
fn the_bf16_bound_split_over_runs_is_the_same() {
    let _one_at_a_time = SWITCH.lock().unwrap();
    let weights = checkpoint::load(&fixture_dir("tiny-a")).unwrap();
    let prompt = lily::bench::synthetic_prompt(40, weights.config.vocab_size, 22);
    let mut device = lily::model::CpuBackend::new(weights.clone());
    let run = lily::agree::device_run(&mut device, &prompt, 6, true).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("ref");
    let f32_run = lily::agree::reference_run(&weights, &prompt, &run, false).unwrap();
    lily::agree::store::save_reference(&file, &f32_run).unwrap();
    let values = run.steps.len() * weights.config.vocab_size;
    let loaded = lily::agree::store::load_reference(&file, values).unwrap();
    let bf16_run = lily::agree::reference_run(&weights, &prompt, &run, true).unwrap();
    assert!(
        !ACTIVATIONS_BF16.load(Ordering::Relaxed),
        "the switch is restored"
    );
    let split = lily::agree::report("cpu".into(), prompt.len(), &run, &loaded, Some(&bf16_run));
    let whole = lily::agree::compare(&weights, "cpu".into(), &prompt, &run, true).unwrap();
    assert_eq!(split.positions, whole.positions);
    assert!(split.positions.iter().all(|p| p.bf16_error.is_some()));
}
