//! Tokenizer and incremental detokenizer tests.
//!
//! The real-vocabulary tests read `../shared/reference/qwen3_6.tiktoken` (beside the repository)
//! and `target/tokenizer-fixture/tokenizer.json`, which `tools/ci-tokenizer-json.sh` builds.
//! Expected ids come from Python tiktoken (`tools/make_tokenizer_fixtures.py`).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use lily::tokenizer::{
    IncrementalDecoder, Tokenizer, TokenizerError, ADDED_TOKENS, DEMO_VOCAB_SIZE,
};
use serde::Deserialize;

#[derive(Deserialize)]
struct Corpus {
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    text: String,
    ids: Vec<u32>,
    /// The decoded text where NFC changed the input; absent when it equals `text`.
    decoded: Option<String>,
}

impl Case {
    fn expected_text(&self) -> &str {
        self.decoded.as_deref().unwrap_or(&self.text)
    }
}

fn repo_path(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(relative)
}

fn corpus() -> &'static [Case] {
    static CORPUS: OnceLock<Vec<Case>> = OnceLock::new();
    CORPUS.get_or_init(|| {
        let path = repo_path("tests/fixtures/tokenizer/corpus.json");
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        let corpus: Corpus = serde_json::from_str(&text).expect("corpus.json parses");
        corpus.cases
    })
}

fn tiktoken() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        let path = repo_path("../shared/reference/qwen3_6.tiktoken");
        Tokenizer::from_tiktoken_file(&path)
            .unwrap_or_else(|e| panic!("cannot load {}: {e:#}", path.display()))
    })
}

fn tokenizer_json() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        let path = repo_path("target/tokenizer-fixture/tokenizer.json");
        assert!(
            path.is_file(),
            "{} is missing: run tools/ci-tokenizer-json.sh first (it builds the file with \
             transformers' converter; it is too large to commit)",
            path.display()
        );
        Tokenizer::from_tokenizer_json(&path)
            .unwrap_or_else(|e| panic!("cannot load {}: {e:#}", path.display()))
    })
}

fn demo() -> Tokenizer {
    Tokenizer::byte_level_demo().expect("demo tokenizer builds")
}

/// Compares ids for every corpus string; reports all mismatches at once.
fn check_corpus_ids(tokenizer: &Tokenizer) {
    let cases = corpus();
    assert!(cases.len() >= 300, "corpus has only {} cases", cases.len());
    let mut failures = Vec::new();
    for case in cases {
        match tokenizer.encode(&case.text) {
            Ok(ids) if ids == case.ids => {}
            Ok(ids) => failures.push(format!(
                "{:?}\n    expected {:?}\n    got      {:?}",
                case.text, case.ids, ids
            )),
            Err(e) => failures.push(format!("{:?}: {e}", case.text)),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} corpus strings encode differently:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// decode(ids) gives the (NFC-normalised) text back, and so do the incremental deltas.
fn check_corpus_decoding(tokenizer: &Tokenizer) {
    let cases = corpus();
    assert!(
        cases.iter().filter(|c| c.decoded.is_some()).count() >= 10,
        "the corpus should hold strings that NFC changes"
    );
    for case in cases {
        let decoded = tokenizer.decode(&case.ids).expect("corpus ids decode");
        assert_eq!(decoded, case.expected_text(), "decoding {:?}", case.ids);
        assert_eq!(
            stream(tokenizer, &case.ids),
            decoded,
            "streaming {:?}",
            case.ids
        );
    }
}

/// Runs the ids through an IncrementalDecoder; returns the concatenated deltas.
fn stream(tokenizer: &Tokenizer, ids: &[u32]) -> String {
    let mut decoder = IncrementalDecoder::new();
    let mut text = String::new();
    for &id in ids {
        text += &decoder.push(tokenizer, id).expect("known id");
    }
    text + &decoder.finish()
}

/// The deltas, one per pushed id, then the one from finish().
fn deltas(tokenizer: &Tokenizer, ids: &[u32]) -> Vec<String> {
    let mut decoder = IncrementalDecoder::new();
    let mut out: Vec<String> = ids
        .iter()
        .map(|&id| decoder.push(tokenizer, id).expect("known id"))
        .collect();
    out.push(decoder.finish());
    out
}

// ---------------------------------------------------------------------------------------------
// The real vocabulary.

#[test]
fn tiktoken_vocab_matches_python_tiktoken_on_the_corpus() {
    check_corpus_ids(tiktoken());
}

#[test]
fn tiktoken_vocab_decodes_the_corpus() {
    check_corpus_decoding(tiktoken());
}

#[test]
fn tokenizer_json_from_transformers_converter_gives_the_same_ids() {
    check_corpus_ids(tokenizer_json());
}

#[test]
fn tokenizer_json_decodes_the_corpus() {
    check_corpus_decoding(tokenizer_json());
}

#[test]
fn from_dir_prefers_tokenizer_json() {
    let dir = repo_path("target/tokenizer-fixture");
    // Make sure the fixture exists (with the helpful message) before loading it a second way.
    tokenizer_json();
    let tokenizer = Tokenizer::from_dir(&dir).expect("loads");
    assert!(format!("{tokenizer:?}").contains("tokenizer.json"));
    assert_eq!(tokenizer.encode("user").unwrap(), vec![846]);
}

#[test]
fn special_token_ids_follow_the_spec() {
    for tokenizer in [tiktoken(), tokenizer_json()] {
        assert_eq!(tokenizer.vocab_size(), 248_077);
        for (i, token) in ADDED_TOKENS.iter().enumerate() {
            assert_eq!(
                tokenizer.token_id(token),
                Some(248_044 + i as u32),
                "{token}"
            );
        }
        assert_eq!(tokenizer.token_id("<|im_end|>"), Some(248_046));
        assert_eq!(tokenizer.token_id("<think>"), Some(248_068));
        assert_eq!(tokenizer.token_id("</think>"), Some(248_069));
        assert_eq!(tokenizer.token_id("user"), None);
        assert_eq!(tokenizer.token_to_bytes(248_046).unwrap(), b"<|im_end|>");
        // Observed encodings (spec/MODEL.md §6.2).
        assert_eq!(tokenizer.encode("\n").unwrap(), vec![198]);
        assert_eq!(tokenizer.encode("assistant").unwrap(), vec![74455]);
        assert_eq!(
            tokenizer
                .encode("<|im_start|>assistant\n<think>\n")
                .unwrap(),
            vec![248_045, 74455, 198, 248_068, 198]
        );
    }
}

#[test]
fn added_tokens_are_found_before_normalisation() {
    // NFC would turn ">\u{338}" into "≯"; the reference cuts out <|im_end|> first.
    let ids = tiktoken().encode("<|im_end|>\u{338}").unwrap();
    assert_eq!(ids[0], 248_046);
    assert_eq!(tiktoken().decode(&ids).unwrap(), "<|im_end|>\u{338}");
}

#[test]
fn very_long_whitespace_runs_encode() {
    let text = " ".repeat(100_000) + "x";
    let ids = tiktoken().encode(&text).expect("encodes");
    assert_eq!(tiktoken().decode(&ids).unwrap(), text);
    assert_eq!(tokenizer_json().encode(&text).expect("encodes"), ids);
}

#[test]
fn unknown_ids_are_errors() {
    for tokenizer in [tiktoken(), tokenizer_json()] {
        let past_end = tokenizer.vocab_size() as u32;
        // The model's embedding has padding rows up to 248,320: not tokens.
        for id in [past_end, 248_319, u32::MAX] {
            assert!(matches!(
                tokenizer.decode(&[198, id]),
                Err(TokenizerError::UnknownTokenId { id: bad, .. }) if bad == id
            ));
            assert!(tokenizer.token_to_bytes(id).is_err());
            let mut decoder = IncrementalDecoder::new();
            assert!(decoder.push(tokenizer, id).is_err());
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Decoding: strict, lossy and incremental.

/// Ids of single-byte tokens in the real vocabulary.
fn byte_ids(tokenizer: &Tokenizer, bytes: &[u8]) -> Vec<u32> {
    let by_bytes = |b: u8| {
        (0..tokenizer.vocab_size() as u32)
            .find(|&id| tokenizer.token_to_bytes(id).ok() == Some(&[b][..]))
            .unwrap_or_else(|| panic!("no token for byte {b:#x}"))
    };
    bytes.iter().map(|&b| by_bytes(b)).collect()
}

#[test]
fn strict_decode_rejects_a_cut_character_and_lossy_decode_marks_it() {
    let tokenizer = tiktoken();
    // "é" is C3 A9; give only C3 after "a".
    let ids = byte_ids(tokenizer, b"a\xC3");
    assert!(matches!(
        tokenizer.decode(&ids),
        Err(TokenizerError::InvalidUtf8 { valid_up_to: 1 })
    ));
    assert_eq!(tokenizer.decode_lossy(&ids).unwrap(), "a\u{FFFD}");
}

#[test]
fn incremental_decoder_holds_back_split_characters() {
    let tokenizer = demo(); // ids 0..=255 are the bytes themselves
    let bytes_of = |s: &str| -> Vec<u32> { s.bytes().map(u32::from).collect() };

    // A CJK character is three bytes: nothing comes out until the third.
    assert_eq!(
        deltas(&tokenizer, &bytes_of("你好")),
        ["", "", "你", "", "", "好", ""]
    );
    // A four-byte emoji.
    assert_eq!(
        deltas(&tokenizer, &bytes_of("a😀")),
        ["a", "", "", "", "😀", ""]
    );
    // A ZWJ family: every scalar value comes out whole, the joiners included.
    let family = "👨\u{200D}👩\u{200D}👧";
    let got = deltas(&tokenizer, &bytes_of(family));
    assert_eq!(got.concat(), family);
    assert_eq!(
        got.iter()
            .filter(|d| !d.is_empty())
            .cloned()
            .collect::<Vec<_>>(),
        ["👨", "\u{200D}", "👩", "\u{200D}", "👧"]
    );
}

#[test]
fn incremental_decoder_on_real_multi_token_characters() {
    let tokenizer = tiktoken();
    for text in ["龘靐齉爩", "👩🏾‍💻 and 🏴󠁧󠁢󠁳󠁣󠁴󠁿", "𠀀𠀁𠀂", "안녕하세요"]
    {
        let ids = tokenizer.encode(text).unwrap();
        let got = deltas(tokenizer, &ids);
        assert_eq!(got.concat(), text);
        // Each delta is exactly what the bytes so far make complete.
        let mut expected_so_far = 0;
        for (n, delta) in got.iter().enumerate().take(ids.len()) {
            let prefix = tokenizer.decode_bytes(&ids[..=n]).unwrap();
            let complete = match std::str::from_utf8(&prefix) {
                Ok(s) => s.len(),
                Err(e) => e.valid_up_to(),
            };
            assert_eq!(
                delta.len(),
                complete - expected_so_far,
                "{text:?} token {n}"
            );
            expected_so_far = complete;
        }
    }
}

#[test]
fn incremental_decoder_replaces_invalid_bytes_at_once_and_flushes_at_finish() {
    let tokenizer = demo();
    // 0xFF can never be valid; C3 followed by 'a' cannot complete; E4 BD at the end is cut off.
    let ids: Vec<u32> = b"x\xFFy\xC3a\xE4\xBD"
        .iter()
        .map(|&b| u32::from(b))
        .collect();
    let got = deltas(&tokenizer, &ids);
    assert_eq!(
        got,
        ["x", "\u{FFFD}", "y", "", "\u{FFFD}a", "", "", "\u{FFFD}"]
    );
    assert_eq!(got.concat(), tokenizer.decode_lossy(&ids).unwrap());

    // finish() leaves the decoder empty and reusable.
    let mut decoder = IncrementalDecoder::new();
    assert_eq!(decoder.push(&tokenizer, 0xE4).unwrap(), "");
    assert_eq!(decoder.finish(), "\u{FFFD}");
    assert_eq!(decoder.finish(), "");
    assert_eq!(decoder.push(&tokenizer, u32::from(b'k')).unwrap(), "k");
}

#[test]
fn incremental_decoder_error_leaves_state_unchanged() {
    let tokenizer = demo();
    let mut decoder = IncrementalDecoder::new();
    assert_eq!(decoder.push(&tokenizer, 0xE4).unwrap(), "");
    assert!(decoder.push(&tokenizer, DEMO_VOCAB_SIZE as u32).is_err());
    assert_eq!(decoder.push(&tokenizer, 0xBD).unwrap(), "");
    assert_eq!(decoder.push(&tokenizer, 0xA0).unwrap(), "你");
}

#[test]
fn incremental_deltas_concatenate_to_lossy_decode_for_random_ids() {
    let tokenizer = demo();
    // xorshift64: deterministic, no dependency.
    let mut state = 0x9E37_79B9_7F4A_7C15_u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _ in 0..500 {
        let len = (next() % 40) as usize;
        let ids: Vec<u32> = (0..len)
            .map(|_| {
                // Mostly high bytes, so that multi-byte sequences, valid or not, are common.
                let r = next();
                if r % 4 == 0 {
                    (r >> 8) as u32 % DEMO_VOCAB_SIZE as u32
                } else {
                    0x80 + (r >> 8) as u32 % 0x80
                }
            })
            .collect();
        assert_eq!(
            stream(&tokenizer, &ids),
            tokenizer.decode_lossy(&ids).unwrap(),
            "{ids:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The demo tokenizer.

#[test]
fn demo_tokenizer_has_the_documented_layout() {
    let tokenizer = demo();
    assert_eq!(tokenizer.vocab_size(), DEMO_VOCAB_SIZE);
    for byte in 0..=255u8 {
        assert_eq!(tokenizer.token_to_bytes(u32::from(byte)).unwrap(), [byte]);
    }
    for (i, token) in ADDED_TOKENS.iter().enumerate() {
        let id = (DEMO_VOCAB_SIZE - ADDED_TOKENS.len() + i) as u32;
        assert_eq!(tokenizer.token_id(token), Some(id));
        assert_eq!(tokenizer.encode(token).unwrap(), vec![id]);
    }
    // Merged tokens are distinct byte strings of length ≥ 2.
    let merged: std::collections::HashSet<&[u8]> = (256..479)
        .map(|id| tokenizer.token_to_bytes(id).unwrap())
        .collect();
    assert_eq!(merged.len(), 223);
    assert!(merged.iter().all(|t| t.len() >= 2));
}

#[test]
fn demo_tokenizer_compresses_english_and_round_trips_everything() {
    let tokenizer = demo();
    assert_eq!(tokenizer.encode(" the").unwrap().len(), 1);
    let text = "The assistant answers the question.";
    assert!(tokenizer.encode(text).unwrap().len() <= text.len() / 2);
    for case in corpus() {
        let ids = tokenizer.encode(&case.text).unwrap();
        assert!(ids.iter().all(|&id| (id as usize) < DEMO_VOCAB_SIZE));
        assert_eq!(tokenizer.decode(&ids).unwrap(), case.expected_text());
    }
    let prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n";
    let ids = tokenizer.encode(prompt).unwrap();
    assert_eq!(ids[0], tokenizer.token_id("<|im_start|>").unwrap());
    assert_eq!(*ids.last().unwrap(), u32::from(b'\n'));
    assert_eq!(tokenizer.decode(&ids).unwrap(), prompt);
}

#[test]
fn tokenizer_is_shareable_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
    assert_send_sync::<IncrementalDecoder>();
}

// ---------------------------------------------------------------------------------------------
// Loading errors.

/// A small valid tiktoken file: the 256 bytes, then "ab".
fn small_vocab() -> String {
    use base64::Engine as _;
    let b64 = |bytes: &[u8]| base64::engine::general_purpose::STANDARD.encode(bytes);
    let mut lines: Vec<String> = (0..=255u8).map(|b| format!("{} {b}", b64(&[b]))).collect();
    lines.push(format!("{} 256", b64(b"ab")));
    lines.join("\n") + "\n"
}

fn write(dir: &Path, name: &str, contents: impl AsRef<[u8]>) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path
}

#[test]
fn from_dir_loads_a_single_tiktoken_file() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "vocab.tiktoken", small_vocab());
    let tokenizer = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(tokenizer.vocab_size(), 257 + 33);
    assert_eq!(tokenizer.encode("abc").unwrap(), vec![256, u32::from(b'c')]);
    assert_eq!(tokenizer.token_id("<|endoftext|>"), Some(257));
}

#[test]
fn from_dir_reports_missing_and_ambiguous_vocabularies() {
    let dir = tempfile::tempdir().unwrap();
    let err = Tokenizer::from_dir(dir.path()).unwrap_err();
    assert!(matches!(err, TokenizerError::NotFound { .. }), "{err}");
    assert!(err.to_string().contains("tokenizer.json"));

    write(dir.path(), "a.tiktoken", small_vocab());
    write(dir.path(), "b.tiktoken", small_vocab());
    let err = Tokenizer::from_dir(dir.path()).unwrap_err();
    assert!(err.to_string().contains("a.tiktoken, b.tiktoken"), "{err}");

    let err = Tokenizer::from_dir(dir.path().join("absent")).unwrap_err();
    assert!(matches!(err, TokenizerError::Read { .. }), "{err}");
}

#[test]
fn corrupt_tiktoken_lines_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let good = small_vocab();
    let cases = [
        ("bad base64", "IQ== 0\n!!!! 1\n", 2, "base64"),
        ("bad rank", "IQ== 0\nIg== one\n", 2, "rank \"one\""),
        ("one field", "IQ== 0\n\nIg==\n", 3, "found 1 field"),
        ("three fields", "IQ== 0 7\n", 1, "found 3 field"),
        (
            "duplicate rank",
            "IQ== 0\nIg== 0\n",
            2,
            "already given on line 1",
        ),
        (
            "duplicate token",
            "IQ== 0\nIQ== 1\n",
            2,
            "already given on line 1",
        ),
        ("gap", "IQ== 0\nIg== 5\n", 2, "gaps"),
    ];
    for (what, contents, line, needle) in cases {
        let path = write(dir.path(), "v.tiktoken", contents);
        let err = Tokenizer::from_tiktoken_file(&path).unwrap_err();
        let message = err.to_string();
        assert!(
            matches!(err, TokenizerError::CorruptVocabLine { line: l, .. } if l == line),
            "{what}: {message}"
        );
        assert!(
            message.contains(&format!("line {line}")),
            "{what}: {message}"
        );
        assert!(message.contains(needle), "{what}: {message}");
    }
    let path = write(dir.path(), "v.tiktoken", b"IQ== 0\n\xFF 1\n");
    let err = Tokenizer::from_tiktoken_file(&path).unwrap_err();
    assert!(err.to_string().contains("line 2: not UTF-8"), "{err}");
    let path = write(dir.path(), "v.tiktoken", "\n\n");
    assert!(matches!(
        Tokenizer::from_tiktoken_file(&path),
        Err(TokenizerError::InvalidVocab { .. })
    ));
    // The good file still loads, so the cases above fail for their stated reasons.
    let path = write(dir.path(), "v.tiktoken", &good);
    assert!(Tokenizer::from_tiktoken_file(&path).is_ok());
}

#[test]
fn non_byte_level_tokenizer_json_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let json = r#"{
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": null,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false,
                  "vocab": {"a": 0, "一": 1}, "merges": []}
    }"#;
    let path = write(dir.path(), "tokenizer.json", json);
    let err = Tokenizer::from_tokenizer_json(&path).unwrap_err();
    assert!(
        matches!(&err, TokenizerError::NotByteLevel { id: 1, .. }),
        "{err}"
    );

    let path = write(dir.path(), "tokenizer.json", "{ not json");
    let err = Tokenizer::from_tokenizer_json(&path).unwrap_err();
    assert!(matches!(err, TokenizerError::TokenizerJson { .. }), "{err}");
}
