//! The benchmark's op-timing report (`lily bench --profile`): how op times become tables, and
//! that a backend without op timing says so instead of reporting nothing.

mod common;

use lily::bench::{self, ProfilePoint};
use lily::checkpoint;
use lily::model::{Backend, CpuBackend, OpTime};

fn op(section: &str, kernel: &str, ms: f64) -> OpTime {
    OpTime {
        section: section.into(),
        kernel: kernel.into(),
        ms,
        calls: 1,
    }
}

#[test]
fn profile_tables_sum_by_section_and_by_kernel() {
    let point = ProfilePoint {
        context: 4096,
        decode_steps: 4,
        prefill: vec![
            op("moe experts", "gemm_prefill experts_gate_up", 30.0),
            op("gdn mixer", "gdn state", 20.0),
            op("moe experts", "gemm_prefill experts_down", 10.0),
            op("gdn mixer", "gdn prep", 15.0),
            op("norms", "norm residual_rmsnorm", 25.0),
        ],
        // 4 steps: 2 ms of experts is 500 µs per step; attention appears in decode only.
        decode: vec![
            op("moe experts", "gemv slots", 2.0),
            op("attn mixer", "attention decode_split", 2.0),
        ],
        // 8 sequences: experts 3× as long, attention 2×.
        batched_decode: Some((
            8,
            vec![
                op("moe experts", "gemv slots", 6.0),
                op("attn mixer", "attention decode_split", 4.0),
            ],
        )),
    };
    let md = bench::profile_markdown(&[point]);
    assert!(
        md.contains("### context 4096: prefill 100.0 ms, decode 1000 µs per step"),
        "{md}"
    );
    // By section, in order of prefill time: experts 40 (40 %), gdn 35, norms 25, then decode-only rows.
    let sections: Vec<&str> = md
        .lines()
        .skip_while(|l| !l.starts_with("| section |"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .collect();
    assert_eq!(
        sections,
        [
            "| moe experts | 40.00 | 40.0 % | 500.0 | 50.0 % |",
            "| gdn mixer | 35.00 | 35.0 % | 0.0 | 0.0 % |",
            "| norms | 25.00 | 25.0 % | 0.0 | 0.0 % |",
            "| attn mixer | 0.00 | 0.0 % | 500.0 | 50.0 % |",
        ],
        "{md}"
    );
    assert!(
        md.contains("| moe experts: gemm_prefill experts_gate_up | 30.00 | 30.0 % | 0.0 | 0.0 % |"),
        "{md}"
    );
    assert!(
        md.contains("| attn mixer: attention decode_split | 0.00 | 0.0 % | 500.0 | 50.0 % |"),
        "{md}"
    );
    // The batched steps beside the single ones, by section, longest batched first.
    assert!(
        md.contains(
            "Decode with 8 sequences per step: 2500 µs per step (2.50× one sequence's 1000 µs)"
        ),
        "{md}"
    );
    let batched: Vec<&str> = md
        .lines()
        .skip_while(|l| !l.starts_with("| section | µs/step, 1 sequence |"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .collect();
    assert_eq!(
        batched,
        [
            "| moe experts | 500.0 | 1500.0 | 3.00× |",
            "| attn mixer | 500.0 | 1000.0 | 2.00× |",
        ],
        "{md}"
    );
}

#[test]
fn batched_decode_steps_run_and_free_their_sequences() {
    let weights = checkpoint::load(&common::fixture_dir("tiny-a")).unwrap();
    let mut cpu = CpuBackend::new(weights);
    // No op timing on the CPU: nothing to report, but the 5 sequences prefill, decode together
    // and are freed (a step for any of them fails: unknown sequence).
    let ops = bench::profile_batched_decode(&mut cpu, 100, 5, 12, 3).unwrap();
    assert!(ops.is_empty());
    for seq in 100 - 5 + 1..=100 {
        assert!(
            cpu.forward(seq, &[1]).is_err(),
            "sequence {seq} was not freed"
        );
    }
}

#[test]
fn mixed_pass_profile_runs_and_frees_its_sequences() {
    let weights = checkpoint::load(&common::fixture_dir("tiny-a")).unwrap();
    let mut cpu = CpuBackend::new(weights);
    // 2 prompts alone, 2 with 3 decode rows: 7 sequences, none left afterwards.
    let (alone, mixed) = bench::profile_mixed_pass(&mut cpu, 200, 2, 9, 3).unwrap();
    assert!(alone.is_empty() && mixed.is_empty());
    for seq in 200 - 6..=200 {
        assert!(
            cpu.forward(seq, &[1]).is_err(),
            "sequence {seq} was not freed"
        );
    }
}

#[test]
fn the_cpu_backend_has_no_op_timing() {
    let weights = checkpoint::load(&common::fixture_dir("tiny-a")).unwrap();
    let mut cpu = CpuBackend::new(weights);
    assert!(bench::profile(&mut cpu, &[16], 2, 8).unwrap().is_none());
}

/// `--decode-pause-ms` on the command line: a sweep with an idle pause between each round's
/// prefill and its decode steps runs and reports its point; a pause that is not a number is
/// refused with a clear error.
#[test]
fn the_sweep_takes_a_decode_pause() {
    let run = |pause: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_lily"))
            .args(["bench", "--synthetic", "tiny", "--device", "cpu"])
            .args(["--contexts", "8", "--decode-steps", "2", "--rounds", "1"])
            .args(["--decode-pause-ms", pause])
            .output()
            .expect("running lily bench")
    };
    let ok = run("20");
    let stdout = String::from_utf8_lossy(&ok.stdout);
    assert!(
        ok.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert_eq!(stdout.matches("\n| 8 |").count(), 1, "{stdout}");
    let bad = run("soon");
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("decode-pause-ms"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
}

/// `lily bench --span-tokens`: passes of 1, 2 and 4 tokens of one sequence at each context, one
/// table row each, the one-token pass the unit of the ratio column; a pass of 0 tokens is refused.
#[test]
fn span_passes_report_each_length_and_free_their_sequence() {
    let weights = checkpoint::load(&common::fixture_dir("tiny-a")).unwrap();
    let mut cpu = CpuBackend::new(weights);
    let points = bench::spans::span_passes(&mut cpu, 300, 10, &[1, 2, 4], 3).unwrap();
    let lengths: Vec<usize> = points.iter().map(|p| p.tokens).collect();
    assert_eq!(lengths, [1, 2, 4]);
    assert!(points
        .iter()
        .all(|p| p.context == 10 && p.us_per_pass > 0.0));
    assert!(
        cpu.forward(300, &[1]).is_err(),
        "sequence 300 was not freed"
    );
    assert!(bench::spans::span_passes(&mut cpu, 301, 10, &[2, 0], 3).is_err());
    assert!(
        cpu.forward(301, &[1]).is_err(),
        "sequence 301 was not freed"
    );

    let md = bench::spans::to_markdown(&[
        bench::spans::SpanPoint {
            context: 4096,
            tokens: 1,
            us_per_pass: 1000.0,
        },
        bench::spans::SpanPoint {
            context: 4096,
            tokens: 4,
            us_per_pass: 2500.0,
        },
    ]);
    assert!(md.contains("| 4096 | 1 | 1000 | 1.00 | 1000 |"), "{md}");
    assert!(md.contains("| 4096 | 4 | 2500 | 2.50 | 1600 |"), "{md}");

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lily"))
        .args(["bench", "--synthetic", "tiny", "--device", "cpu"])
        .args([
            "--contexts",
            "8,12",
            "--decode-steps",
            "2",
            "--span-tokens",
            "1,3",
        ])
        .output()
        .expect("running lily bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for row in ["| 8 | 1 |", "| 8 | 3 |", "| 12 | 1 |", "| 12 | 3 |"] {
        assert_eq!(stdout.matches(row).count(), 1, "{row}: {stdout}");
    }
}

/// `lily bench --forced-drafts`: drafts forced right always stand (every drafted token kept,
/// fewer passes than tokens), forced wrong never do (a pass a token), forced at 0.6 stand at
/// about that rate; the sequences are freed;
/// a model without an MTP head, or a pass of no drafts, is refused.
#[test]
fn forced_drafts_stand_at_the_rate_asked_and_free_their_sequences() {
    let weights = checkpoint::load(&common::fixture_dir("tiny-a-mtp")).unwrap();
    let mut cpu = CpuBackend::new(weights);
    let steps = 20;
    let right = bench::drafts::forced_drafts(&mut cpu, 400, 12, &[1, 3], 1.0, steps).unwrap();
    assert_eq!(right.iter().map(|p| p.drafts).collect::<Vec<_>>(), [1, 3]);
    for p in &right {
        assert_eq!(p.accepted, 1.0, "{p:?}");
        assert!(p.passes < steps && p.tokens == steps, "{p:?}");
        assert!(p.plain_tok_s > 0.0 && p.drafted_tok_s > 0.0);
    }
    let wrong = bench::drafts::forced_drafts(&mut cpu, 410, 12, &[2], 0.0, steps).unwrap();
    assert_eq!(wrong[0].accepted, 0.0);
    assert_eq!(wrong[0].passes, steps, "a pass a token");
    // In between, the drafts stand at about the rate asked (≈ 190 drafts checked: a standard
    // error of ≈ 0.035).
    let half = bench::drafts::forced_drafts(&mut cpu, 412, 12, &[1], 0.6, 400).unwrap();
    assert!((half[0].accepted - 0.6).abs() < 0.15, "{:?}", half[0]);
    for seq in [400, 401, 410, 411, 412, 413] {
        assert!(
            cpu.forward(seq, &[1]).is_err(),
            "sequence {seq} was not freed"
        );
    }
    assert!(bench::drafts::forced_drafts(&mut cpu, 420, 12, &[0], 0.5, steps).is_err());
    let mut no_head = CpuBackend::new(checkpoint::load(&common::fixture_dir("tiny-a")).unwrap());
    assert!(bench::drafts::forced_drafts(&mut no_head, 430, 12, &[1], 0.5, steps).is_err());
    let md = bench::drafts::to_markdown(&right);
    assert!(md.contains("| 12 | 3 | 1.00 / 1.00 |"), "{md}");
    assert!(
        right.iter().all(|p| p.draft_us > 0.0 && p.verify_us > 0.0),
        "{right:?}"
    );
}
