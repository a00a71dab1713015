//! Sampler, parameters, stop handling and thinking budget.
//!
//! Filters are checked against a brute-force reference written the way vLLM computes them (full
//! softmax, full sort, masks), on random logits.

mod common;

use std::collections::BTreeMap;

use lily::sampling::*;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

const QWEN_VOCAB: usize = 248_320;

fn random_logits(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.random::<f32>() - 0.5) * 2.0 * scale)
        .collect()
}

fn params(temperature: f32, top_k: Option<usize>, top_p: f32, min_p: f32) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        seed: Some(1),
        ..SamplingParams::default()
    }
}

// ---------------------------------------------------------------------------------------------
// Brute-force reference (vLLM's order: min-p on the full softmax, then top-k, then top-p over the
// renormalised survivors via an ascending cumulative sum).
// ---------------------------------------------------------------------------------------------

fn reference_distribution(logits: &[f32], p: &SamplingParams) -> BTreeMap<u32, f64> {
    let t = p.temperature as f64;
    let scaled: Vec<f64> = logits.iter().map(|&l| l as f64 / t).collect();
    let mut alive: Vec<bool> = scaled.iter().map(|l| l.is_finite()).collect();

    let softmax = |alive: &[bool]| -> Vec<f64> {
        let max = scaled
            .iter()
            .zip(alive)
            .filter(|(_, &a)| a)
            .map(|(l, _)| *l)
            .fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = scaled
            .iter()
            .zip(alive)
            .map(|(l, &a)| if a { (l - max).exp() } else { 0.0 })
            .collect();
        let z: f64 = w.iter().sum();
        w.into_iter().map(|x| x / z).collect()
    };

    if p.min_p > 0.0 {
        let probs = softmax(&alive);
        let max = probs.iter().cloned().fold(0.0, f64::max);
        for (i, &q) in probs.iter().enumerate() {
            if q < p.min_p as f64 * max {
                alive[i] = false;
            }
        }
    }
    if let Some(k) = p.top_k {
        let mut sorted: Vec<f64> = scaled
            .iter()
            .zip(&alive)
            .filter(|(_, &a)| a)
            .map(|(l, _)| *l)
            .collect();
        sorted.sort_by(|a, b| b.total_cmp(a));
        if k < sorted.len() {
            let kth = sorted[k - 1];
            for (i, l) in scaled.iter().enumerate() {
                if *l < kth {
                    alive[i] = false;
                }
            }
        }
    }
    if p.top_p < 1.0 {
        let probs = softmax(&alive);
        let mut order: Vec<usize> = (0..scaled.len()).filter(|&i| alive[i]).collect();
        order.sort_by(|&a, &b| probs[a].total_cmp(&probs[b]).then(b.cmp(&a))); // ascending
        let mut cum = 0.0;
        let last = order.len() - 1;
        for (pos, &i) in order.iter().enumerate() {
            cum += probs[i];
            if cum <= 1.0 - p.top_p as f64 && pos != last {
                alive[i] = false;
            }
        }
    }
    let probs = softmax(&alive);
    (0..logits.len())
        .filter(|&i| alive[i])
        .map(|i| (i as u32, probs[i]))
        .collect()
}

fn assert_same_distribution(got: Vec<(u32, f64)>, want: &BTreeMap<u32, f64>, what: &str) {
    let got: BTreeMap<u32, f64> = got.into_iter().collect();
    let got_keys: Vec<_> = got.keys().collect();
    let want_keys: Vec<_> = want.keys().collect();
    assert_eq!(got_keys, want_keys, "{what}: different candidate sets");
    let total: f64 = got.values().sum();
    assert!(
        (total - 1.0).abs() < 1e-9,
        "{what}: probabilities sum to {total}"
    );
    for (t, &q) in &got {
        let r = want[t];
        assert!(
            (q - r).abs() <= 1e-5 * r.max(1e-12) + 1e-12,
            "{what}: token {t}: {q} vs reference {r}"
        );
    }
}

#[test]
fn filters_match_brute_force_reference() {
    let mut rng = StdRng::seed_from_u64(7);
    let temps = [0.3f32, 0.7, 1.0, 1.5];
    let top_ks = [None, Some(1), Some(5), Some(40), Some(2000)];
    let top_ps = [1.0f32, 0.95, 0.5, 0.1];
    let min_ps = [0.0f32, 0.05, 0.3];
    let mut cases = 0;
    for &t in &temps {
        for &k in &top_ks {
            for &tp in &top_ps {
                for &mp in &min_ps {
                    let logits = random_logits(&mut rng, 1000, 6.0);
                    let p = params(t, k, tp, mp);
                    let got = Sampler::new(&p, &[]).distribution(&logits).unwrap();
                    let what = format!("T={t} k={k:?} top_p={tp} min_p={mp}");
                    assert_same_distribution(got, &reference_distribution(&logits, &p), &what);
                    cases += 1;
                }
            }
        }
    }
    assert_eq!(cases, 4 * 5 * 4 * 3);
}

#[test]
fn top_p_on_full_vocabulary_matches_reference() {
    // No top-k: the sampler's growing partial sort must find the same nucleus as a full sort, for
    // peaked (small nucleus) and flat (nucleus of most of the vocabulary) distributions.
    let mut rng = StdRng::seed_from_u64(11);
    for (scale, top_p) in [(20.0, 0.9), (3.0, 0.95), (0.5, 0.99), (0.01, 0.5)] {
        let logits = random_logits(&mut rng, QWEN_VOCAB, scale);
        let p = params(1.0, None, top_p, 0.0);
        let got = Sampler::new(&p, &[]).distribution(&logits).unwrap();
        assert_same_distribution(
            got,
            &reference_distribution(&logits, &p),
            &format!("scale {scale} top_p {top_p}"),
        );
    }
}

#[test]
fn top_k_keeps_ties_at_the_boundary() {
    let logits = [1.0, 3.0, 2.0, 2.0, 0.5];
    let d = Sampler::new(&params(1.0, Some(2), 1.0, 0.0), &[])
        .distribution(&logits)
        .unwrap();
    let mut tokens: Vec<u32> = d.iter().map(|&(t, _)| t).collect();
    tokens.sort();
    assert_eq!(tokens, vec![1, 2, 3]);
}

#[test]
fn greedy_is_argmax_with_lowest_index_on_ties() {
    let mut s = Sampler::new(&SamplingParams::greedy(), &[]);
    assert_eq!(s.sample(&[0.1, 5.0, -1.0, 5.0, 4.9]).unwrap().token, 1);
    assert_eq!(
        s.sample(&[f32::NAN, -3.0, f32::NEG_INFINITY, -2.0])
            .unwrap()
            .token,
        3
    );
    // Temperatures below 1e-5 are greedy too (vLLM); top-k / top-p do not change the argmax.
    let p = SamplingParams {
        temperature: 1e-6,
        top_k: Some(3),
        top_p: 0.1,
        ..SamplingParams::default()
    };
    let logits = random_logits(&mut StdRng::seed_from_u64(3), QWEN_VOCAB, 10.0);
    let best = logits
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(&a.0)))
        .unwrap()
        .0;
    for _ in 0..3 {
        assert_eq!(
            Sampler::new(&p, &[]).sample(&logits).unwrap().token as usize,
            best
        );
    }
}

#[test]
fn logit_bias_and_penalties_follow_vllm() {
    let prompt = [0u32, 1];
    let p = SamplingParams {
        temperature: 1.0,
        repetition_penalty: 2.0,
        presence_penalty: 0.5,
        frequency_penalty: 0.25,
        logit_bias: vec![(4, 1.5)],
        seed: Some(5),
        ..SamplingParams::default()
    };
    let mut s = Sampler::new(&p, &prompt);
    // Generate tokens 2, 2, 3 (forced, so the history is known).
    let flat = [0.0f32; 6];
    for t in [2, 2, 3] {
        s.force(t, &flat).unwrap();
    }
    let logits = [2.0f32, -1.0, 3.0, 1.0, 0.5, -0.5];
    // Expected, by hand: bias, then repetition (prompt + output: 0,1,2,3), then frequency/presence
    // on output counts (2: twice, 3: once).
    let expected = [
        2.0 / 2.0,                    // prompt token, positive
        -2.0,                         // prompt token, negative: -1 * 2
        3.0 / 2.0 - 2.0 * 0.25 - 0.5, // output twice
        1.0 / 2.0 - 0.25 - 0.5,       // output once
        0.5 + 1.5,                    // biased, unseen
        -0.5,                         // untouched
    ];
    let want = reference_distribution(&expected, &SamplingParams::default());
    assert_same_distribution(s.distribution(&logits).unwrap(), &want, "penalised");
}

#[test]
fn same_seed_same_tokens_different_seed_different_tokens() {
    let mut rng = StdRng::seed_from_u64(99);
    let steps: Vec<Vec<f32>> = (0..64)
        .map(|_| random_logits(&mut rng, 5000, 2.0))
        .collect();
    let run = |seed: u64| -> Vec<u32> {
        let p = SamplingParams {
            temperature: 1.0,
            top_p: 0.95,
            top_k: Some(50),
            seed: Some(seed),
            ..Default::default()
        };
        let mut s = Sampler::new(&p, &[]);
        steps.iter().map(|l| s.sample(l).unwrap().token).collect()
    };
    assert_eq!(run(1234), run(1234));
    assert_ne!(run(1234), run(4321));
}

#[test]
fn draws_follow_the_distribution() {
    let logits = [0.0f32, 1.0, 2.0, -1.0, -30.0];
    let p = SamplingParams {
        seed: Some(42),
        ..SamplingParams::default()
    };
    let mut s = Sampler::new(&p, &[]);
    let probs: Vec<f64> = s
        .distribution(&logits)
        .unwrap()
        .iter()
        .map(|&(_, q)| q)
        .collect();
    let n = 40_000;
    let mut counts = [0usize; 5];
    // Penalties are off, so recording each draw does not change the distribution.
    for _ in 0..n {
        counts[s.sample(&logits).unwrap().token as usize] += 1;
    }
    for (i, &q) in probs.iter().enumerate() {
        let expected = q * n as f64;
        let sigma = (n as f64 * q * (1.0 - q)).sqrt().max(1.0);
        assert!(
            (counts[i] as f64 - expected).abs() < 5.0 * sigma,
            "token {i}: {} draws, expected {expected}",
            counts[i]
        );
    }
}

#[test]
fn logprobs_are_raw_model_logprobs() {
    let logits = [1.0f32, 3.0, 2.0, 3.0, -1.0];
    let p = SamplingParams {
        temperature: 0.5,
        top_k: Some(1),
        top_logprobs: Some(3),
        seed: Some(3),
        ..Default::default()
    };
    let sampled = Sampler::new(&p, &[]).sample(&logits).unwrap();
    let lse = logits.iter().map(|&l| (l as f64).exp()).sum::<f64>().ln();
    let lp = |t: usize| (logits[t] as f64 - lse) as f32;
    let got = sampled.logprobs.unwrap();
    // top-k 1 keeps both tied maxima (1 and 3); whichever was drawn, its logprob is the raw one.
    assert!(sampled.token == 1 || sampled.token == 3);
    assert!((got.logprob - lp(sampled.token as usize)).abs() < 1e-6);
    let top_tokens: Vec<u32> = got.top.iter().map(|&(t, _)| t).collect();
    assert_eq!(top_tokens, vec![1, 3, 2]);
    for &(t, l) in &got.top {
        assert!((l - lp(t as usize)).abs() < 1e-6);
    }
}

#[test]
fn bad_logits_are_errors_not_panics() {
    let mut s = Sampler::new(&SamplingParams::default(), &[]);
    assert_eq!(s.sample(&[]), Err(SampleError::EmptyLogits));
    assert_eq!(
        s.sample(&[f32::NAN, f32::NEG_INFINITY]),
        Err(SampleError::NoFiniteLogits)
    );
    assert!(matches!(
        s.force(10, &[0.0; 4]),
        Err(SampleError::TokenOutOfRange {
            token: 10,
            vocab: 4
        })
    ));
    // +inf must not turn into NaN probabilities.
    let d = s.distribution(&[0.0, f32::INFINITY, 1.0]).unwrap();
    assert!(
        d.iter().all(|&(t, q)| q == if t == 1 { 1.0 } else { 0.0 }),
        "{d:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Parameters and generation_config.json
// ---------------------------------------------------------------------------------------------

fn resolve(opts: SamplingOptions) -> Result<SamplingParams, ParamError> {
    SamplingParams::resolve(&opts, &GenerationDefaults::default(), 1000)
}

#[test]
fn validation_names_the_bad_parameter() {
    let cases: Vec<(SamplingOptions, &str)> = vec![
        (
            SamplingOptions {
                temperature: Some(-0.1),
                ..Default::default()
            },
            "temperature",
        ),
        (
            SamplingOptions {
                temperature: Some(f64::NAN),
                ..Default::default()
            },
            "temperature",
        ),
        (
            SamplingOptions {
                top_p: Some(0.0),
                ..Default::default()
            },
            "top_p",
        ),
        (
            SamplingOptions {
                top_p: Some(1.01),
                ..Default::default()
            },
            "top_p",
        ),
        (
            SamplingOptions {
                top_k: Some(-2),
                ..Default::default()
            },
            "top_k",
        ),
        (
            SamplingOptions {
                min_p: Some(1.5),
                ..Default::default()
            },
            "min_p",
        ),
        (
            SamplingOptions {
                presence_penalty: Some(2.5),
                ..Default::default()
            },
            "presence_penalty",
        ),
        (
            SamplingOptions {
                frequency_penalty: Some(-2.5),
                ..Default::default()
            },
            "frequency_penalty",
        ),
        (
            SamplingOptions {
                repetition_penalty: Some(0.0),
                ..Default::default()
            },
            "repetition_penalty",
        ),
        (
            SamplingOptions {
                max_tokens: Some(0),
                ..Default::default()
            },
            "max_tokens",
        ),
        (
            SamplingOptions {
                logit_bias: [("abc".to_string(), 1.0)].into(),
                ..Default::default()
            },
            "logit_bias",
        ),
        (
            SamplingOptions {
                logit_bias: [("5".to_string(), 101.0)].into(),
                ..Default::default()
            },
            "logit_bias",
        ),
        (
            SamplingOptions {
                logit_bias: [("1000".to_string(), 1.0)].into(),
                ..Default::default()
            },
            "logit_bias",
        ),
        (
            SamplingOptions {
                stop_token_ids: vec![-1],
                ..Default::default()
            },
            "stop_token_ids",
        ),
        (
            SamplingOptions {
                thinking_budget: Some(-5),
                ..Default::default()
            },
            "thinking_token_budget",
        ),
        (
            SamplingOptions {
                top_logprobs: Some(21),
                ..Default::default()
            },
            "top_logprobs",
        ),
    ];
    for (opts, param) in cases {
        let err = resolve(opts.clone()).expect_err(&format!("{opts:?} should be rejected"));
        assert_eq!(err.param, param, "{err}");
        assert!(err.to_string().contains(param));
    }
}

#[test]
fn accepted_edge_values() {
    let p = resolve(SamplingOptions {
        temperature: Some(0.0),
        top_p: Some(1.0),
        top_k: Some(-1),
        min_p: Some(0.0),
        presence_penalty: Some(-2.0),
        frequency_penalty: Some(2.0),
        logit_bias: [("7".to_string(), -100.0), (" 3".to_string(), 100.0)].into(),
        seed: Some(-1),
        stop: vec!["".to_string(), "END".to_string()],
        thinking_budget: Some(-1),
        top_logprobs: Some(0),
        ..Default::default()
    })
    .unwrap();
    assert!(p.is_greedy());
    assert_eq!(p.top_k, None);
    assert_eq!(p.logit_bias, vec![(3, 100.0), (7, -100.0)]);
    assert_eq!(p.seed, Some(u64::MAX));
    assert_eq!(p.stop, vec!["END".to_string()]);
    assert_eq!(p.thinking_budget, None);
    assert_eq!(p.top_logprobs, Some(0));
    assert_eq!(
        resolve(SamplingOptions {
            top_k: Some(0),
            ..Default::default()
        })
        .unwrap()
        .top_k,
        None
    );
}

#[test]
fn generation_config_defaults_fill_what_the_request_leaves_out() {
    let qwen = r#"{"bos_token_id": 248044, "do_sample": true, "eos_token_id": [248046, 248044],
                   "pad_token_id": 248044, "temperature": 1.0, "top_k": 20, "top_p": 0.95,
                   "transformers_version": "4.57.0"}"#;
    let d = GenerationDefaults::from_json(qwen).unwrap();
    assert_eq!(d.eos_token_ids, vec![248046, 248044]);
    let p = SamplingParams::resolve(
        &SamplingOptions {
            temperature: Some(0.6),
            stop_token_ids: vec![5],
            ..Default::default()
        },
        &d,
        QWEN_VOCAB,
    )
    .unwrap();
    assert_eq!(p.temperature, 0.6); // the request wins
    assert_eq!(p.top_k, Some(20)); // the model's default
    assert!((p.top_p - 0.95).abs() < 1e-7);
    assert_eq!(p.min_p, 0.0); // built-in default
    assert_eq!(p.stop_token_ids, vec![5, 248044, 248046]);

    let single =
        GenerationDefaults::from_json(r#"{"eos_token_id": 2, "max_new_tokens": 64}"#).unwrap();
    assert_eq!(single.eos_token_ids, vec![2]);
    let p = SamplingParams::resolve(&SamplingOptions::default(), &single, 10).unwrap();
    assert_eq!(p.max_tokens, Some(64));
    assert_eq!(p.temperature, 1.0);

    assert!(GenerationDefaults::from_json("{not json").is_err());
    let bad = GenerationDefaults::from_json(r#"{"top_p": 2.0}"#).unwrap_err();
    assert!(bad.to_string().contains("top_p"), "{bad}");
}

#[test]
fn generation_config_file_is_optional() {
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(
        GenerationDefaults::load(dir.path()).unwrap(),
        GenerationDefaults::default()
    );
    std::fs::write(
        dir.path().join("generation_config.json"),
        r#"{"temperature": 0.7}"#,
    )
    .unwrap();
    assert_eq!(
        GenerationDefaults::load(dir.path()).unwrap().temperature,
        Some(0.7)
    );
    std::fs::write(dir.path().join("generation_config.json"), "[").unwrap();
    let err = GenerationDefaults::load(dir.path()).unwrap_err();
    assert!(err.to_string().contains("generation_config.json"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// Stop handling
// ---------------------------------------------------------------------------------------------

fn stop_params(stops: &[&str]) -> SamplingParams {
    SamplingParams {
        stop: stops.iter().map(|s| s.to_string()).collect(),
        ..SamplingParams::default()
    }
}

/// Feed `pieces` through a checker; return (shown text, stopped).
fn run_stops(stops: &[&str], pieces: &[&str]) -> (String, bool) {
    let mut c = StopChecker::new(&stop_params(stops));
    let mut shown = String::new();
    for piece in pieces {
        let out = c.push_text(piece);
        shown.push_str(&out.text);
        if out.stopped {
            return (shown, true);
        }
    }
    shown.push_str(&c.flush());
    (shown, false)
}

/// Every way of cutting `text` into two or three pieces (on char boundaries), plus one char at a time.
fn all_splits(text: &str) -> Vec<Vec<&str>> {
    let cuts: Vec<usize> = (0..=text.len())
        .filter(|&i| text.is_char_boundary(i))
        .collect();
    let mut out = vec![text
        .char_indices()
        .map(|(i, c)| &text[i..i + c.len_utf8()])
        .collect()];
    for &a in &cuts {
        out.push(vec![&text[..a], &text[a..]]);
        for &b in cuts.iter().filter(|&&b| b >= a) {
            out.push(vec![&text[..a], &text[a..b], &text[b..]]);
        }
    }
    out
}

#[test]
fn stop_strings_across_every_split() {
    let cases: &[(&str, &[&str], &str, bool)] = &[
        ("Hello world. STOP here", &["STOP"], "Hello world. ", true),
        (
            "no stop in this text at all",
            &["STOP", "\n\n"],
            "no stop in this text at all",
            false,
        ),
        (
            "ends with a partial ST",
            &["STOP"],
            "ends with a partial ST",
            false,
        ),
        (
            "overlap aab then aaab!",
            &["aaab"],
            "overlap aab then ",
            true,
        ),
        ("two: xyz then abc", &["abc", "xyz"], "two: ", true),
        (
            "nested: <|end|> vs <|e",
            &["<|e", "<|end|>"],
            "nested: ",
            true,
        ),
        (
            "unicode: héllo wörld ✓ done",
            &["wörld ✓"],
            "unicode: héllo ",
            true,
        ),
        ("stop at the very start", &["stop"], "", true),
        ("line one\n\nline two", &["\n\n"], "line one", true),
    ];
    for &(text, stops, want, want_stopped) in cases {
        for pieces in all_splits(text) {
            let (shown, stopped) = run_stops(stops, &pieces);
            assert_eq!(
                (shown.as_str(), stopped),
                (want, want_stopped),
                "text {text:?} split {pieces:?}"
            );
        }
    }
}

#[test]
fn stop_text_is_never_shown_while_pending() {
    // After each piece, nothing shown may run into a stop string's prefix that later completes.
    let mut c = StopChecker::new(&stop_params(&["</answer>"]));
    let mut shown = String::new();
    for piece in ["The answer is 4", "</", "ans", "wer", ">", " trailing"] {
        let out = c.push_text(piece);
        shown.push_str(&out.text);
        assert!(!shown.contains('<'), "leaked {shown:?}");
        if out.stopped {
            break;
        }
    }
    assert_eq!(shown, "The answer is 4");
    // Once stopped, nothing more comes out.
    assert_eq!(
        c.push_text("more"),
        StopText {
            text: String::new(),
            stopped: true
        }
    );
}

#[test]
fn the_matched_stop_string_is_the_one_that_occurs_first() {
    for pieces in all_splits("two: xyz then abc") {
        let mut c = StopChecker::new(&stop_params(&["abc", "xyz", "nope"]));
        assert_eq!(c.matched(), None);
        for piece in pieces {
            c.push_text(piece);
        }
        assert_eq!(c.matched(), Some("xyz"));
    }
    let mut c = StopChecker::new(&stop_params(&["abc"]));
    c.push_text("no match here");
    c.flush();
    assert_eq!(c.matched(), None);
}

#[test]
fn stop_tokens_and_max_tokens() {
    let p = SamplingParams {
        stop_token_ids: vec![7, 9],
        max_tokens: Some(3),
        ..SamplingParams::default()
    };
    let mut c = StopChecker::new(&p);
    assert_eq!(c.check_token(1), TokenVerdict::Continue);
    assert_eq!(c.check_token(9), TokenVerdict::Stop);
    let mut c = StopChecker::new(&p);
    assert_eq!(c.check_token(1), TokenVerdict::Continue);
    assert_eq!(c.check_token(2), TokenVerdict::Continue);
    assert_eq!(c.check_token(3), TokenVerdict::Length);
    assert_eq!(c.generated(), 3);
    // A stop token that is also the last allowed one is a stop, not a length cut.
    let mut c = StopChecker::new(&p);
    c.check_token(1);
    c.check_token(2);
    assert_eq!(c.check_token(7), TokenVerdict::Stop);
    assert_eq!(FinishReason::Length.as_str(), "length");
}

// ---------------------------------------------------------------------------------------------
// Thinking budget
// ---------------------------------------------------------------------------------------------

const IDS: ThinkTokens = ThinkTokens {
    think_start: 100,
    think_end: 101,
    tool_call_start: 102,
    tool_call_end: 103,
};

/// Drive a budget with a "model" that would emit `model` tokens in order; return what was appended.
fn drive(thinking: bool, budget: Option<usize>, model: &[u32]) -> (Vec<u32>, ThinkingBudget) {
    let mut b = ThinkingBudget::new(IDS, thinking, budget);
    let mut appended = Vec::new();
    let mut model = model.iter();
    loop {
        let token = match b.forced_token() {
            Some(t) => t,
            None => match model.next() {
                Some(&t) => t,
                None => break,
            },
        };
        b.observe(token);
        appended.push(token);
    }
    (appended, b)
}

#[test]
fn thinking_budget_forces_think_end() {
    let (out, b) = drive(true, Some(3), &[1, 2, 3, 4, 5, 6]);
    assert_eq!(out, vec![1, 2, 3, 101, 4, 5, 6]);
    assert_eq!(b.reasoning_tokens(), 3);
    assert!(!b.in_reasoning());

    // The model closing thinking itself within budget: nothing forced.
    let (out, b) = drive(true, Some(10), &[1, 2, 101, 4, 5]);
    assert_eq!(out, vec![1, 2, 101, 4, 5]);
    assert_eq!(b.reasoning_tokens(), 2);

    // Budget 0: close at once.
    let (out, _) = drive(true, Some(0), &[1, 2]);
    assert_eq!(out, vec![101, 1, 2]);

    // No budget: never forced, but still counted.
    let (out, b) = drive(true, None, &[1, 2, 3]);
    assert_eq!(out, vec![1, 2, 3]);
    assert_eq!(b.reasoning_tokens(), 3);
}

#[test]
fn thinking_budget_never_cuts_a_tool_call() {
    // A tool call inside the thinking: its tokens are not reasoning and nothing is forced inside.
    let (out, b) = drive(true, Some(2), &[1, 102, 5, 6, 7, 103, 8, 9]);
    assert_eq!(out, vec![1, 102, 5, 6, 7, 103, 8, 101, 9]);
    assert_eq!(b.reasoning_tokens(), 2);
}

#[test]
fn thinking_off_unless_the_model_opens_think() {
    let (out, b) = drive(false, Some(1), &[1, 2, 3]);
    assert_eq!(out, vec![1, 2, 3]);
    assert_eq!(b.reasoning_tokens(), 0);

    let (out, b) = drive(false, Some(2), &[100, 1, 2, 3, 4]);
    assert_eq!(out, vec![100, 1, 2, 101, 3, 4]);
    assert_eq!(b.reasoning_tokens(), 2);

    // With thinking on, a leading <think> is not counted either.
    let (_, b) = drive(true, None, &[100, 1, 101]);
    assert_eq!(b.reasoning_tokens(), 1);
}

/// The device path (`device_step`, the backend's draw, `record`) is the CPU path step for step:
/// the same distribution, the same draws from the same seed, the same penalty history after.
#[test]
fn device_steps_reproduce_cpu_sampling() {
    let mut rng = StdRng::seed_from_u64(rand::random());
    let vocab = 4096;
    let prompt: Vec<u32> = (0..300)
        .map(|_| rng.random_range(0..vocab as u32))
        .collect();
    for case in 0..12 {
        let p = SamplingParams {
            temperature: [0.0, 0.5, 1.0][case % 3],
            top_k: [None, Some(40)][case % 2],
            top_p: [1.0, 0.9][(case / 2) % 2],
            min_p: [0.0, 0.05][(case / 4) % 2],
            repetition_penalty: [1.0, 1.3][(case / 3) % 2],
            frequency_penalty: 0.2,
            presence_penalty: [0.0, 0.5][(case / 6) % 2],
            seed: Some(rng.random()),
            ..SamplingParams::default()
        };
        let (mut cpu, mut dev) = (Sampler::new(&p, &prompt), Sampler::new(&p, &prompt));
        for step in 0..40 {
            let logits = random_logits(&mut rng, vocab, 4.0);
            let want = cpu.distribution(&logits).unwrap();
            let token = cpu.sample(&logits).unwrap().token;
            let (sampling, u) = dev.device_step(vocab).expect("nothing needs the CPU here");
            assert_eq!(sampling.distribution(&logits).unwrap(), want, "case {case}");
            assert_eq!(
                sampling.sample(&logits, u).unwrap(),
                token,
                "case {case} step {step}"
            );
            dev.record(token);
        }
    }
}

#[test]
fn device_step_leaves_bias_and_logprobs_to_the_cpu() {
    let bias = SamplingParams {
        logit_bias: vec![(3, 1.0)],
        ..SamplingParams::default()
    };
    let logprobs = SamplingParams {
        top_logprobs: Some(0),
        ..SamplingParams::default()
    };
    for p in [bias, logprobs] {
        assert!(Sampler::new(&p, &[]).device_step(10).is_none());
    }
}

/// Ids at or past the vocabulary limit (the model's padding rows) are never candidates.
#[test]
fn device_sampling_masks_ids_past_the_limit() {
    let mut logits = vec![0.0f32; 100];
    logits[95] = 50.0;
    let (sampling, _) = Sampler::new(&params(1.0, None, 1.0, 0.0), &[])
        .device_step(90)
        .unwrap();
    let dist = sampling.distribution(&logits).unwrap();
    assert_eq!(dist.len(), 90);
    assert!(dist.iter().all(|&(t, _)| t < 90));
    // In token order, which the draw walks.
    assert!(dist.windows(2).all(|w| w[0].0 < w[1].0));
}

/// Without top-k and top-p the draw walks its candidates in place (no ranked list, no
/// collected distribution): it must pick what `draw` over `distribution` picks for every `u`,
/// right at each cumulative boundary too (one ulp either side), so the arithmetic must be the
/// same bit for bit. Logits with ties, -inf and ids past the limit; min-p on and off.
#[test]
fn the_in_place_draw_equals_draw_over_the_distribution() {
    let mut rng = StdRng::seed_from_u64(rand::random());
    for case in 0..24 {
        let vocab = if case % 4 == 0 { QWEN_VOCAB } else { 4096 };
        let mut logits = random_logits(&mut rng, vocab, [4.0, 12.0, 30.0][case % 3]);
        for _ in 0..vocab / 50 {
            let i = rng.random_range(0..vocab);
            logits[i] = if rng.random::<bool>() {
                f32::NEG_INFINITY
            } else {
                logits[(i + 1) % vocab]
            };
        }
        let sampling = DeviceSampling {
            temperature: [0.3, 0.7, 1.0, 1.7][case % 4],
            min_p: [0.0, 0.05, 0.5][(case / 4) % 3],
            vocab_limit: vocab - case,
            ..DeviceSampling::greedy(vocab)
        };
        let dist = sampling.distribution(&logits).unwrap();
        let mut us: Vec<f64> = (0..50).map(|_| rng.random()).collect();
        let mut acc = 0.0;
        for (j, &(_, p)) in dist.iter().enumerate() {
            acc += p;
            if j % (dist.len() / 40 + 1) == 0 || j + 1 == dist.len() {
                us.extend(
                    [acc.next_down(), acc, acc.next_up()]
                        .iter()
                        .filter(|u| **u < 1.0),
                );
            }
        }
        us.push(1.0f64.next_down());
        for u in us {
            assert_eq!(
                sampling.sample(&logits, u).unwrap(),
                draw(&dist, u),
                "case {case}: {sampling:?} at u = {u:e}"
            );
        }
    }
}

/// The top alternatives of `logprobs` are the `n` largest raw logits (ties: lower id first, NaN
/// never), as a full sort has them, for any `n` — including more than there are logits.
#[test]
fn top_logprobs_equal_a_full_sort() {
    let mut rng = StdRng::seed_from_u64(rand::random());
    for case in 0..12 {
        let vocab = [7, 300, 4096, QWEN_VOCAB][case % 4];
        let mut logits = random_logits(&mut rng, vocab, 6.0);
        for _ in 0..vocab / 10 + 2 {
            let i = rng.random_range(0..vocab);
            logits[i] = match rng.random_range(0..4) {
                0 => f32::NAN,
                1 => f32::NEG_INFINITY,
                _ => logits[rng.random_range(0..vocab)], // a tie
            };
        }
        let mut sorted: Vec<(u32, f32)> = logits
            .iter()
            .zip(0u32..)
            .map(|(&l, t)| (t, if l.is_nan() { f32::NEG_INFINITY } else { l }))
            .collect();
        sorted.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let token = rng.random_range(0..vocab as u32);
        for n in [0, 1, 5, 20, vocab + 3] {
            let got = token_logprobs(&logits, token, n).unwrap();
            let tokens: Vec<u32> = got.top.iter().map(|&(t, _)| t).collect();
            let want: Vec<u32> = sorted.iter().take(n).map(|&(t, _)| t).collect();
            assert_eq!(tokens, want, "case {case}, vocab {vocab}, n {n}");
        }
    }
}

/// Speculative sampling's rule (src/sampling/drafts.rs): a draft checked against the target's
/// distribution stands, or is replaced, so that the token that results is distributed as the
/// target's, whatever the draft: in the support, outside it, its most likely token. Greedy keeps
/// exactly the argmax.
#[test]
fn checked_drafts_keep_the_target_distribution() {
    let mut rng = common::Rng::new("checked_drafts_keep_the_target_distribution");
    for round in 0..6 {
        let vocab = 6 + rng.below(10);
        let logits: Vec<f32> = (0..vocab).map(|_| 3.0 * rng.unit()).collect();
        let mut sampling = lily::sampling::DeviceSampling::greedy(vocab);
        sampling.temperature = 0.3 + 1.2 * rng.uniform() as f32;
        if round % 2 == 1 {
            sampling.top_k = Some(2 + rng.below(4));
        }
        if round % 3 == 2 {
            sampling.top_p = 0.8;
        }
        let dist = sampling.distribution(&logits).unwrap();
        let p = |t: u32| dist.iter().find(|&&(x, _)| x == t).map_or(0.0, |&(_, p)| p);
        let best = dist
            .iter()
            .fold((0, -1.0), |b, &(t, q)| if q > b.1 { (t, q) } else { b })
            .0;
        let outside = (0..vocab as u32).find(|&t| p(t) == 0.0);
        let drafts = [Some(best), Some(dist[dist.len() - 1].0), outside];
        for draft in drafts.into_iter().flatten() {
            let n = 400_000;
            let mut count = vec![0usize; vocab];
            for _ in 0..n {
                let token = match lily::sampling::check_draft(&dist, draft, rng.uniform()) {
                    Ok(()) => draft,
                    Err(t) => {
                        assert_ne!(t, draft, "a replacement is never the draft");
                        t
                    }
                };
                count[token as usize] += 1;
            }
            for t in 0..vocab as u32 {
                let freq = count[t as usize] as f64 / n as f64;
                let want = p(t);
                // Five standard deviations of a frequency over n draws.
                let bound = 5.0 * (want * (1.0 - want) / n as f64).sqrt() + 1e-9;
                assert!(
                    (freq - want).abs() <= bound,
                    "round {round}, draft {draft}: token {t} drawn {freq:.5}, p = {want:.5}"
                );
            }
        }
    }
    // Greedy: the argmax stands, anything else is replaced by it.
    let greedy = [(7u32, 1.0)];
    for _ in 0..1000 {
        let u = rng.uniform();
        assert_eq!(lily::sampling::check_draft(&greedy, 7, u), Ok(()));
        assert_eq!(lily::sampling::check_draft(&greedy, 3, u), Err(7));
    }
}
