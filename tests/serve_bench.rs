//! `lily bench --serve` on the CPU with the tiny fixture model: every measurement runs, the
//! conversation grows as asked and its later turns reuse the earlier ones through the cache.

mod common;

use lily::engine::EngineOptions;
use lily::model::CpuBackend;
use lily::sampling::SamplingParams;
use lily::serve_bench::{run, to_markdown, ServeBenchOptions, ServeReport};

#[test]
fn the_serve_benchmark_runs_small_on_the_cpu() {
    let md = serve_small(None, None);
    assert!(md.starts_with("Requests: greedy."), "{md}");
}

/// The same with sampled requests (`--temperature`, `--top-p`): every request still generates
/// exactly its tokens, and the report says how they were sampled.
#[test]
fn the_serve_benchmark_samples_when_asked() {
    let params = SamplingParams {
        temperature: 0.8,
        top_p: 0.9,
        ..SamplingParams::default()
    };
    let md = serve_small(Some(params), None);
    assert!(
        md.starts_with("Requests: sampled on the device, temperature 0.8, top-p 0.9, top-k off."),
        "{md}"
    );
}

/// `--vocab-limit`: requests pick only ids below it, as a real checkpoint's server limits them
/// to its tokenizer's; a limit of 0, or past the model's vocabulary, is refused.
#[test]
fn the_serve_benchmark_takes_a_vocabulary_limit() {
    let md = serve_small(None, Some(100));
    assert!(md.starts_with("Requests: greedy, ids below 100."), "{md}");
    for limit in [0, 1 << 30] {
        let weights = lily::checkpoint::load(&common::fixture_dir("tiny-a")).unwrap();
        let options = ServeBenchOptions {
            vocab_limit: Some(limit),
            ..small_options(None)
        };
        let err = run(Box::new(CpuBackend::new(weights)), &options, |_| {})
            .err()
            .unwrap_or_else(|| panic!("a limit of {limit} ran"));
        assert!(
            err.to_string().contains("vocabulary limit"),
            "{limit}: {err:#}"
        );
    }
}

/// `--system-tokens`: the first turn opens with the system prompt, the turns share the rest of
/// the conversation, and every later turn reuses all of the one before it; a system prompt as
/// long as the conversation is refused.
#[test]
fn the_conversation_can_open_with_a_system_prompt() {
    let weights = lily::checkpoint::load(&common::fixture_dir("tiny-a")).unwrap();
    let options = ServeBenchOptions {
        system_tokens: 80,
        ..small_options(None)
    };
    let (report, backend) =
        run(Box::new(CpuBackend::new(weights)), &options, |_| {}).expect("the benchmark runs");
    // 80 system tokens, then 4 turns of a 24-token message ((200 − 80) / 4 − 6) and 6 answered.
    assert_turns_reuse(&report, &[104, 134, 164, 194]);
    let md = to_markdown(&options, &report);
    assert!(
        md.contains("4 turns after a system prompt of 80 tokens"),
        "{md}"
    );
    let too_long = ServeBenchOptions {
        system_tokens: 200,
        ..small_options(None)
    };
    let err = run(backend, &too_long, |_| {})
        .err()
        .expect("a system prompt as long as the conversation ran");
    assert!(err.to_string().contains("system prompt"), "{err:#}");
}

/// `--conversation-rounds`: the conversation runs that many times, cold and cached, each round's
/// cache starting empty (so every round reuses the same tokens), and the table says its times are
/// medians; no rounds at all is refused.
#[test]
fn the_conversation_runs_in_rounds() {
    let weights = lily::checkpoint::load(&common::fixture_dir("tiny-a")).unwrap();
    let options = ServeBenchOptions {
        conversation_rounds: 3,
        ..small_options(None)
    };
    let mut lines = 0;
    let (report, backend) = run(Box::new(CpuBackend::new(weights)), &options, |_| lines += 1)
        .expect("the benchmark runs");
    assert_eq!(lines, 1 + 4 + 1, "a line per measurement and per turn");
    assert_turns_reuse(&report, &[44, 94, 144, 194]);
    assert_eq!(report.turns[0].cached_tokens, 0);
    for (i, t) in report.turns.iter().enumerate().skip(1) {
        assert!(
            t.ttft_cold_s > 0.0 && t.ttft_cached_s > 0.0,
            "turn {i}: {t:?}"
        );
    }
    let md = to_markdown(&options, &report);
    assert!(
        md.contains("time to first token (medians of 3 runs)"),
        "{md}"
    );
    let none = ServeBenchOptions {
        conversation_rounds: 0,
        ..small_options(None)
    };
    let err = run(backend, &none, |_| {})
        .err()
        .expect("a conversation of no rounds ran");
    assert!(err.to_string().contains("rounds"), "{err:#}");
}

/// The conversation's turns have these prompt lengths, and every later turn reuses the state the
/// turn before it saved: its prompt and all but the last of its 6 answer tokens.
fn assert_turns_reuse(report: &ServeReport, lengths: &[usize]) {
    let got: Vec<usize> = report.turns.iter().map(|t| t.prompt_tokens).collect();
    assert_eq!(got, lengths);
    for (i, t) in report.turns.iter().enumerate().skip(1) {
        assert_eq!(t.cached_tokens, lengths[i - 1] + 5, "turn {i}");
    }
}

fn small_options(sampling: Option<SamplingParams>) -> ServeBenchOptions {
    ServeBenchOptions {
        streams: 3,
        prompt_tokens: 24,
        output_tokens: 6,
        turns: 4,
        conversation_rounds: 1,
        conversation_tokens: 200,
        system_tokens: 0,
        decode_streams: 3,
        engine: EngineOptions {
            prefill_chunk: 16,
            prefix_cache_bytes: 16 << 20,
            ..EngineOptions::default()
        },
        sampling,
        vocab_limit: None,
    }
}

/// Runs the benchmark small on the tiny fixture and checks what does not depend on the tokens
/// drawn; returns its markdown.
fn serve_small(sampling: Option<SamplingParams>, vocab_limit: Option<usize>) -> String {
    let weights = lily::checkpoint::load(&common::fixture_dir("tiny-a")).unwrap();
    let options = ServeBenchOptions {
        vocab_limit,
        ..small_options(sampling)
    };
    let mut lines = 0;
    let (report, _backend) = run(Box::new(CpuBackend::new(weights)), &options, |_| lines += 1)
        .expect("the benchmark runs");
    assert_eq!(lines, 1 + 4 + 1, "a line per measurement and per turn");
    assert!(report.throughput.output_tok_s > 0.0);
    assert!(report.throughput.total_tok_s > report.throughput.output_tok_s);
    let t = &report.throughput;
    assert!(
        t.backend_seconds > 0.0 && t.backend_seconds <= t.seconds,
        "{t:?}"
    );
    // Each turn adds a 44-token message (200 / 4 − 6) and the 6-token answer.
    assert_turns_reuse(&report, &[44, 94, 144, 194]);
    assert_eq!(report.turns[0].cached_tokens, 0);
    assert!(report.decode.alone_tok_s > 0.0 && report.decode.per_stream_tok_s > 0.0);
    // The three streams decode together for most of their 6 tokens.
    assert!(
        report
            .decode
            .steady_per_stream_tok_s
            .is_some_and(|v| v > 0.0),
        "{:?}",
        report.decode
    );
    let md = to_markdown(&options, &report);
    assert_eq!(md.matches("\n| 4 | 194 |").count(), 1, "{md}");
    // The last column: how many times sooner the cached turn's first token came.
    let row = md.lines().find(|l| l.starts_with("| 4 | 194 |")).unwrap();
    let cells: Vec<&str> = row.trim_matches('|').split('|').map(str::trim).collect();
    assert_eq!(cells.len(), 6, "{row}");
    let shown: f64 = cells[5].parse().unwrap();
    let turn = &report.turns[3];
    assert!(
        (shown - turn.ttft_cold_s / turn.ttft_cached_s).abs() <= 0.006,
        "{row}"
    );
    md
}

/// `--batch-tokens` on the command line: a small budget runs (batches of prompt chunks and decode
/// steps of at most 32 tokens), 0 is refused with a clear error; `--conversation-rounds` reaches
/// the report.
#[test]
fn the_command_line_takes_a_batch_token_budget() {
    let run = |budget: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_lily"))
            .args(["bench", "--serve", "--synthetic", "tiny", "--device", "cpu"])
            .args([
                "--streams",
                "3",
                "--prompt-tokens",
                "40",
                "--output-tokens",
                "4",
            ])
            .args(["--turns", "2", "--conversation-tokens", "120"])
            .args(["--conversation-rounds", "2"])
            .args(["--decode-streams", "2", "--batch-tokens", budget])
            .output()
            .expect("lily runs")
    };
    let ok = run("32");
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let stdout = String::from_utf8_lossy(&ok.stdout);
    assert!(stdout.contains("concurrent streams"), "{stdout}");
    assert!(stdout.contains("(medians of 2 runs)"), "{stdout}");
    let refused = run("0");
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("--batch-tokens must be at least 1"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
}

/// Sampling flags on the command line: `--temperature` and `--top-p` run sampled requests, a
/// top-p of 0 is refused with a clear error, and the flags need `--serve`.
#[test]
fn the_command_line_takes_sampling_flags() {
    let run = |extra: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_lily"))
            .args(["bench", "--synthetic", "tiny", "--device", "cpu"])
            .args(extra)
            .output()
            .expect("lily runs")
    };
    let small = [
        "--serve",
        "--streams",
        "2",
        "--prompt-tokens",
        "40",
        "--output-tokens",
        "4",
        "--turns",
        "2",
        "--conversation-tokens",
        "120",
        "--decode-streams",
        "2",
    ];
    let ok = run(&[&small[..], &["--temperature", "0.7", "--top-p", "0.9"]].concat());
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(
        String::from_utf8_lossy(&ok.stdout).contains("sampled on the device, temperature 0.7"),
        "{}",
        String::from_utf8_lossy(&ok.stdout)
    );
    let refused = run(&[&small[..], &["--top-p", "0"]].concat());
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("--top-p must be in (0, 1]"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    let without_serve = run(&["--contexts", "64", "--temperature", "0.7"]);
    assert!(!without_serve.status.success());
}

/// `--draft-tokens` with a model that has an MTP head: the lone stream decodes with drafts
/// (its random head's are checked, rarely kept), and the report says how many.
#[test]
fn the_lone_stream_reports_its_drafts() {
    let weights = lily::checkpoint::load(&common::fixture_dir("tiny-a-mtp")).unwrap();
    let mut options = small_options(None);
    options.engine.draft_tokens = 2;
    // Every pass checks both (the adaptive schedule would soon stop drafting a random head's).
    options.engine.draft_schedule = lily::engine::DraftSchedule::Fixed;
    let (report, _backend) =
        run(Box::new(CpuBackend::new(weights)), &options, |_| {}).expect("the benchmark runs");
    let d = report.decode.alone_drafts.expect("drafts are counted");
    // 6 tokens: the first from the prompt, then passes of up to 2 drafts.
    assert!(
        d.passes >= 2 && d.drafted >= d.passes && d.accepted <= d.drafted,
        "{d:?}"
    );
    let md = to_markdown(&options, &report);
    assert!(
        md.contains("The lone stream with up to 2 MTP drafts a pass (Fixed schedule)"),
        "{md}"
    );
    // Without drafts, nothing is counted.
    let weights = lily::checkpoint::load(&common::fixture_dir("tiny-a-mtp")).unwrap();
    let (report, _) = run(
        Box::new(CpuBackend::new(weights)),
        &small_options(None),
        |_| {},
    )
    .unwrap();
    assert_eq!(report.decode.alone_drafts, None);
}
