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
    let run = agree::device_run(&mut device, &prompt, 12, false).unwrap();
    assert_eq!(run.steps.len(), 12);
    let report = agree::compare(&weights, "cpu".into(), &prompt, &run, false).unwrap();
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
    let mut run = agree::device_run(&mut device, &prompt, 6, false).unwrap();
    // A device that still picks the CPU's tokens but whose logits at position 2 are 30 % of
    // their range away from the CPU's: a near-tie could "explain" any divergence of such a
    // backend, so the report must fail on the logits alone.
    let logits = &mut run.steps[2].1;
    let (lo, hi) = logits
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(l, h), &v| {
            (l.min(v), h.max(v))
        });
    let shift = 0.3 * (hi - lo);
    for (i, v) in logits.iter_mut().enumerate() {
        *v += if i % 2 == 0 { shift } else { -shift };
    }
    let report = agree::compare(&weights, "cpu".into(), &prompt, &run, false).unwrap();
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
    let mut run = agree::device_run(&mut device, &prompt, 8, false).unwrap();
    // A device that picks the CPU's least likely token at position 3: its logits are the
    // CPU's, so the margin is the whole range, far beyond any near-tie.
    let (_, logits) = &run.steps[3];
    let worst = logits
        .iter()
        .enumerate()
        .min_by(|a, b| a.1.total_cmp(b.1))
        .unwrap()
        .0 as u32;
    run.steps[3].0 = worst;
    let report = agree::compare(&weights, "cpu".into(), &prompt, &run, false).unwrap();
    assert!(!report.positions[3].agrees());
    assert!(report.unexplained() >= 1, "{}", report.to_markdown());
}

/// The CPU backend as the device, its routing traced: prompt rows, then a row per step but the last.
fn traced(seed: u64, tokens: usize) -> (lily::model::Weights, Vec<u32>, agree::DeviceRun) {
    let weights = checkpoint::load(&common::fixture_dir("tiny-a")).unwrap();
    let prompt = synthetic_prompt(40, weights.config.vocab_size, seed);
    let mut device = CpuBackend::new(weights.clone());
    let run = agree::device_run(&mut device, &prompt, tokens, true).unwrap();
    (weights, prompt, run)
}

#[test]
fn the_reference_runs_the_traced_routing() {
    let (weights, prompt, run) = traced(11, 8);
    let trace = run
        .routing
        .as_ref()
        .expect("the CPU backend traces its routing");
    let (layers, k) = (weights.layers.len(), weights.config.num_experts_per_tok);
    assert_eq!(trace.experts.len(), layers);
    assert!(trace.experts.iter().all(|l| l.len() == (40 + 7) * k));
    let report = agree::compare(&weights, "cpu".into(), &prompt, &run, false).unwrap();
    let stats = report.routing.as_ref().unwrap();
    assert!(stats.iter().all(|l| l.rows == 47 && l.inconsistent == 0));
    // The same f32 arithmetic in another order: the router logits agree to rounding.
    assert!(
        stats.iter().all(|l| l.largest_distance < 1e-4),
        "{}",
        report.to_markdown()
    );
    assert!(report.passes(), "{}", report.to_markdown());
    assert!(report.to_markdown().contains("| 0 | 47 |"));
}

#[test]
fn a_choice_below_the_devices_own_logits_is_caught() {
    let (weights, prompt, mut run) = traced(12, 4);
    let (e, k) = (
        weights.config.num_experts,
        weights.config.num_experts_per_tok,
    );
    let trace = run.routing.as_mut().unwrap();
    // Row 30 of layer 1 runs the expert with the lowest device logit instead of its first choice.
    let (row, logits) = (30, &trace.logits[1]);
    let lowest = (0..e)
        .min_by(|&a, &b| logits[row * e + a].total_cmp(&logits[row * e + b]))
        .unwrap() as u32;
    trace.experts[1][row * k] = lowest;
    let report = agree::compare(&weights, "cpu".into(), &prompt, &run, false).unwrap();
    let layer = &report.routing.as_ref().unwrap()[1];
    assert_eq!(layer.inconsistent, 1, "{}", report.to_markdown());
    assert!(layer.flipped >= 1 && layer.largest_flip_margin > 0.0);
    assert!(!report.passes());
}

#[test]
fn imposed_experts_are_the_ones_that_run() {
    let (weights, prompt, mut run) = traced(13, 4);
    let (e, k) = (
        weights.config.num_experts,
        weights.config.num_experts_per_tok,
    );
    let trace = run.routing.as_mut().unwrap();
    // The last prompt row of layer 2 (the first compared position) gets a device whose logits put
    // an expert the reference would not choose on top: a consistent device choice, a flip.
    let row = prompt.len() - 1;
    let chosen = &trace.experts[2][row * k..(row + 1) * k];
    let other = (0..e as u32).find(|x| !chosen.contains(x)).unwrap();
    trace.logits[2][row * e + other as usize] = 1e3;
    trace.experts[2][row * k + k - 1] = other;
    let report = agree::compare(&weights, "cpu".into(), &prompt, &run, false).unwrap();
    let layer = &report.routing.as_ref().unwrap()[2];
    assert_eq!(
        (layer.flipped, layer.inconsistent),
        (1, 0),
        "{}",
        report.to_markdown()
    );
    // The device's logits were not computed with that expert: the reference's now differ.
    assert!(
        report.positions[0].logit_error > 1e-3,
        "{}",
        report.to_markdown()
    );
}

#[test]
fn a_trace_of_other_rows_is_an_error() {
    let (weights, prompt, mut run) = traced(14, 4);
    run.routing.as_mut().unwrap().experts[3].truncate(5);
    let err = agree::compare(&weights, "cpu".into(), &prompt, &run, false).unwrap_err();
    assert!(err.to_string().contains("layer 3"), "{err}");
}

/// A comparison split over processes (tests/agree_reference_bf16.rs has the bf16 pass): the
/// device's run and the reference's survive the disk bit for bit and give the one-shot report;
/// truncated, foreign or mismatched files are errors.
#[test]
fn runs_saved_and_loaded_give_the_same_report() {
    use lily::agree::store;
    let (weights, prompt, run) = traced(15, 6);
    let dir = tempfile::tempdir().unwrap();
    let (run_file, ref_file) = (dir.path().join("run"), dir.path().join("ref"));
    let saved = store::SavedRun {
        device: "cpu".into(),
        prompt_tokens: prompt.len(),
        run: run.clone(),
    };
    store::save_run(&run_file, &saved).unwrap();
    assert_eq!(store::load_run(&run_file).unwrap(), saved);
    let reference = agree::reference_run(&weights, &prompt, &run, false).unwrap();
    store::save_reference(&ref_file, &reference).unwrap();
    let values = run.steps.len() * weights.config.vocab_size;
    let loaded = store::load_reference(&ref_file, values).unwrap();
    assert_eq!(loaded, reference);
    let split = agree::report("cpu".into(), prompt.len(), &run, &loaded, None);
    let whole = agree::compare(&weights, "cpu".into(), &prompt, &run, false).unwrap();
    assert_eq!(split.positions, whole.positions);
    assert_eq!(split.routing, whole.routing);

    // Truncated, foreign, or of another size: errors that say so.
    let bytes = std::fs::read(&run_file).unwrap();
    std::fs::write(&run_file, &bytes[..bytes.len() - 3]).unwrap();
    let err = store::load_run(&run_file).unwrap_err().to_string();
    assert!(
        err.contains("ends early") || err.contains("past the end"),
        "{err}"
    );
    let err = store::load_run(&ref_file).unwrap_err().to_string();
    assert!(err.contains("not a lily agree device run file"), "{err}");
    let err = store::load_reference(&ref_file, values + 1)
        .unwrap_err()
        .to_string();
    assert!(err.contains("this comparison has"), "{err}");
    let mut huge = b"LILYREF1".to_vec();
    huge.extend_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&ref_file, &huge).unwrap();
    assert!(store::load_reference(&ref_file, values).is_err());
}
