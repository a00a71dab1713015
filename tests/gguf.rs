//! GGUF checkpoints (llama.cpp, arch `qwen35moe`) against the safetensors models they were
//! converted from (fixtures written by tools/check_gguf.py with gguf-py, llama.cpp's
//! conventions), their conversion for the CUDA kernels, and bad files.

mod common;

use std::path::{Path, PathBuf};

use common::{fixture_dir, map_matrices, matrix_values, rel_error, rel_rms};
use lily::chat::template::ChatInput;
use lily::checkpoint::tensor::{Bytes, DType};
use lily::checkpoint::{self, synth, CheckpointError};
use lily::model::convert;
use lily::model::cpu::{forward, mtp, Logits};
use lily::model::state::{KvCache, MtpState};
use lily::model::weights::{Matrix, Mixer, MtpWeights, WeightFormat, Weights};
use lily::model::{argmax, SequenceState};
use lily::quant::{self, Affine};
use lily::server::ModelSource;
use rand::RngExt;

fn gguf_fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gguf")
        .join(name)
}

/// The f32 model tiny-k.gguf was quantised from (`lily synth`, seed 7).
fn tiny_k_source(dir: &Path) -> Weights {
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(gguf_fixture("tiny-k.json")).unwrap())
            .unwrap();
    synth::write_checkpoint(&config, dir, 7, DType::F32, synth::SHARD_BYTES, false).unwrap();
    checkpoint::load(dir).unwrap()
}

fn random_prompt(vocab: usize, len: usize) -> Vec<u32> {
    let mut rng = rand::rng();
    (0..len)
        .map(|_| rng.random_range(0..vocab as u32))
        .collect()
}

fn logits(w: &Weights, ids: &[u32]) -> Vec<f32> {
    forward(w, ids, &mut SequenceState::new(&w.config), Logits::All)
}

/// Small vectors of two models: norms, conv taps, gates.
fn vectors(w: &Weights) -> Vec<(String, Vec<f32>)> {
    let mut out = vec![("final_norm".to_string(), w.final_norm.clone())];
    for (i, l) in w.layers.iter().enumerate() {
        out.push((format!("{i}.input_norm"), l.input_norm.clone()));
        out.push((format!("{i}.post_norm"), l.post_attention_norm.clone()));
        match &l.mixer {
            Mixer::DeltaNet(d) => {
                out.push((format!("{i}.conv1d"), d.conv1d.clone()));
                out.push((format!("{i}.a_log"), d.a_log.clone()));
                out.push((format!("{i}.dt_bias"), d.dt_bias.clone()));
                out.push((format!("{i}.norm"), d.norm.clone()));
            }
            Mixer::Attention(a) => {
                out.push((format!("{i}.q_norm"), a.q_norm.clone()));
                out.push((format!("{i}.k_norm"), a.k_norm.clone()));
            }
        }
    }
    out
}

/// A bf16 model converted with every matrix kept BF16: the same numbers, so the same model.
/// Only `A_log` goes through `−exp` and back (an ulp or so).
#[test]
fn bf16_gguf_is_the_safetensors_model() {
    let want = checkpoint::load(&fixture_dir("tiny-a-bf16")).unwrap();
    let got = checkpoint::load(&gguf_fixture("tiny-a-bf16.gguf")).unwrap();
    assert_eq!(got.config, want.config);
    for ((name, g), (_, w)) in got.matrices().into_iter().zip(want.matrices()) {
        // The shared-expert gate is 1-D in GGUF, and llama.cpp writes 1-D tensors as F32.
        let format = if g.rows == 1 {
            WeightFormat::F32
        } else {
            WeightFormat::BF16
        };
        assert_eq!(g.format, format, "{name}");
        assert_eq!(matrix_values(g), matrix_values(w), "{name}");
    }
    for ((name, g), (_, w)) in vectors(&got).into_iter().zip(vectors(&want)) {
        let tolerance = if name.ends_with("a_log") { 1e-6 } else { 0.0 };
        assert!(rel_error(&g, &w) <= tolerance, "{name}: {g:?} vs {w:?}");
    }
    for len in [1, 9, 70] {
        let ids = random_prompt(want.config.vocab_size, len);
        let err = rel_error(&logits(&got, &ids), &logits(&want, &ids));
        // A_log's ulp moves the decay of every GDN step, and the recurrence carries it: over 70
        // tokens that reached 2.2e-5 on one random prompt and 1.8e-4 on another (a CI run); a
        // misplaced head or row gives ~1e-1.
        assert!(err <= 1e-3, "{len} tokens: logits rel. error {err:.2e}");
    }
}

/// Bounds on a matrix's relative RMS error against the f32 source, per format: about twice what
/// each format's quantisation of N(0, 0.02) values gives (measured 7.8 %, 3.8 %, 1.9 %,
/// 0.54 % for Q4_K, Q5_K, Q6_K, Q8_0). A value head or row in the wrong place would be ~140 %.
fn format_bound(f: WeightFormat) -> f32 {
    match f.name().as_str() {
        "Q4_K" => 0.16,
        "Q5_K" => 0.08,
        "Q6_K" => 0.04,
        "Q8_0" => 0.012,
        "f16" => 1e-3,
        // The only f32 matrix is ssm_out, a Q4_K in the file dequantised to reorder its columns.
        "f32" => 0.16,
        other => panic!("unexpected format {other}"),
    }
}

/// A K-quant mix (Q4_K, Q5_K, Q6_K, Q8_0, F16, F32 as llama-quantize mixes them) of a synthetic
/// model: every matrix within its format's error of the source, vectors exact, and logits close.
#[test]
fn kquant_gguf_is_close_to_its_source() {
    let dir = tempfile::tempdir().unwrap();
    let want = tiny_k_source(dir.path());
    let got = checkpoint::load(&gguf_fixture("tiny-k.gguf")).unwrap();
    assert_eq!(got.config, want.config);
    let mut formats = std::collections::BTreeSet::new();
    for ((name, g), (_, w)) in got.matrices().into_iter().zip(want.matrices()) {
        let err = rel_rms(&matrix_values(g), &matrix_values(w));
        formats.insert(g.format.name());
        assert!(
            err <= format_bound(g.format),
            "{name} ({}): rel. RMS error {err:.4}",
            g.format.name()
        );
    }
    for f in ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "f16", "f32"] {
        assert!(formats.contains(f), "the fixture has no {f} matrix");
    }
    for ((name, g), (_, w)) in vectors(&got).into_iter().zip(vectors(&want)) {
        let tolerance = if name.ends_with("a_log") { 1e-6 } else { 0.0 };
        assert!(rel_error(&g, &w) <= tolerance, "{name}");
    }
    // Logits: as close to the source's as those of the source quantised to MLX Q4 g64 (9 %
    // error per matrix, a little more than this mix) — this random model amplifies weight
    // errors (~20 % on the logits), so the bound is relative. Measured over 80 positions of
    // three prompts together: one flipped expert choice of the tiny random router at one
    // position must not decide the test.
    let q4 = quantized_q4(&want);
    let (mut reference, mut in_file, mut in_q4) = (Vec::new(), Vec::new(), Vec::new());
    for len in [1, 9, 70] {
        let ids = random_prompt(want.config.vocab_size, len);
        reference.extend(logits(&want, &ids));
        in_file.extend(logits(&got, &ids));
        in_q4.extend(logits(&q4, &ids));
    }
    let err = rel_rms(&in_file, &reference);
    let q4_err = rel_rms(&in_q4, &reference);
    println!("logits rel. RMS error {err:.4} (source in Q4 g64: {q4_err:.4})");
    assert!(
        err <= 1.5 * q4_err,
        "logits rel. RMS error {err:.4}, Q4 g64 gives {q4_err:.4}"
    );
}

/// `w` with every matrix quantised to MLX affine Q4, group 64.
fn quantized_q4(w: &Weights) -> Weights {
    let mut w = w.clone();
    map_matrices(&mut w, |m| {
        let q = Affine::new(4, 64).unwrap();
        let packed = quant::quantize(&matrix_values(m), m.cols, q, DType::BF16).unwrap();
        *m = Matrix {
            rows: m.rows,
            cols: m.cols,
            format: WeightFormat::Affine {
                bits: 4,
                group_size: 64,
            },
            data: Bytes::from_vec(packed.packed),
            scales: Some(Bytes::from_vec(packed.scales)),
            biases: Some(Bytes::from_vec(packed.biases)),
            scale_dtype: DType::BF16,
        };
    });
    w
}

/// What the CUDA backend runs: the K-quants requantised to affine Q8 g64, groups sharing one
/// format, each conversion adding under 1 % (relative RMS) to the file's values, and the
/// converted model running on the CPU close to the file's.
#[test]
fn kquants_convert_to_q8_for_the_kernels() {
    let file = checkpoint::load(&gguf_fixture("tiny-k.gguf")).unwrap();
    let (converted, report) = convert::weights_for_kernels(&file);
    let q8 = WeightFormat::Affine {
        bits: 8,
        group_size: 64,
    };
    for ((name, c), (_, f)) in converted.matrices().into_iter().zip(file.matrices()) {
        assert!(convert::kernel_ready(c), "{name} is {}", c.format.name());
        if !convert::kernel_ready(f) {
            assert_eq!(c.format, q8, "{name}");
            let err = rel_rms(&matrix_values(c), &matrix_values(f));
            assert!(err < 0.01, "{name}: conversion adds {err:.4}");
        }
    }
    // The GDN input projections are one group: Q5_K qkv and Q8_0 b/a make all of them Q8.
    let Mixer::DeltaNet(d) = &converted.layers[0].mixer else {
        panic!("layer 0 is a GDN layer")
    };
    assert_eq!(d.in_proj_qkv.format, q8);
    assert_eq!(d.in_proj_a.format, q8);
    let lines = report.lines();
    for f in ["Q4_K", "Q5_K", "Q6_K", "Q8_0"] {
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with(&format!("{f} → q8 g64"))),
            "{lines:?}"
        );
    }
    for s in report.0.values() {
        assert!(s.relative_rms() < 0.01, "{lines:?}");
    }
    // On the logits, the conversion moves the model much less than the file's own quantisation.
    // Measured over 80 positions of three prompts together: a tiny random model's router has
    // near-ties, and one flipped expert choice at one position must not decide the test.
    let dir = tempfile::tempdir().unwrap();
    let source = tiny_k_source(dir.path());
    let (mut in_file, mut in_converted, mut in_source) = (Vec::new(), Vec::new(), Vec::new());
    for len in [1, 9, 70] {
        let ids = random_prompt(file.config.vocab_size, len);
        in_file.extend(logits(&file, &ids));
        in_converted.extend(logits(&converted, &ids));
        in_source.extend(logits(&source, &ids));
    }
    let err = rel_rms(&in_converted, &in_file);
    let file_err = rel_rms(&in_file, &in_source);
    println!("conversion moves the logits by {err:.4}, the file's quantisation by {file_err:.4}");
    assert!(
        err <= 0.5 * file_err,
        "conversion {err:.4}, file {file_err:.4}"
    );
}

/// `--model` may name the .gguf file or a directory holding one.
#[test]
fn a_directory_with_one_gguf_loads_it() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        gguf_fixture("tiny-a-bf16.gguf"),
        dir.path().join("model.gguf"),
    )
    .unwrap();
    let w = checkpoint::load(dir.path()).unwrap();
    assert_eq!(w.config.num_hidden_layers, 8);
    std::fs::copy(
        gguf_fixture("tiny-a-bf16.gguf"),
        dir.path().join("other.gguf"),
    )
    .unwrap();
    let e = checkpoint::load(dir.path()).unwrap_err().to_string();
    assert!(e.contains("2 .gguf files"), "{e}");
}

/// `lily serve --model X.gguf`: the text side comes from the file (vocabulary, chat template).
#[test]
fn a_gguf_file_brings_its_vocabulary_and_template() {
    let source = ModelSource::Dir(gguf_fixture("tiny-k.gguf"));
    let (text, weights) = lily::server::load_model(&source).unwrap();
    assert_eq!(weights.config.vocab_size, 320);
    // 256 byte tokens, then the added tokens: <|im_end|> is 256 + 2.
    assert_eq!(text.special.im_end, 258);
    assert_eq!(
        text.tokenizer.encode("hi<|im_end|>").unwrap(),
        vec![104, 105, 258]
    );
    let input = ChatInput {
        messages: vec![serde_json::json!({"role": "user", "content": "hi"})],
        tools: None,
        add_generation_prompt: true,
        kwargs: Default::default(),
    };
    assert_eq!(
        text.template.render(&input).unwrap(),
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
}

/// Patches `from` with `to` (same length) at its first occurrence in the file's header.
fn patched(dir: &Path, from: &[u8], to: &[u8]) -> PathBuf {
    let mut bytes = std::fs::read(gguf_fixture("tiny-k.gguf")).unwrap();
    let at = bytes
        .windows(from.len())
        .position(|w| w == from)
        .expect("pattern in the file");
    bytes[at..at + to.len()].copy_from_slice(to);
    let path = dir.join("patched.gguf");
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn bad_files_get_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let load = |p: &Path| checkpoint::load(p).unwrap_err().to_string();

    let e = load(&patched(dir.path(), b"qwen35moe", b"qwen3moe_"));
    assert!(
        e.contains("`qwen3moe_`") && e.contains("only `qwen35moe`"),
        "{e}"
    );

    // token_embd.weight's type: Q4_K (12) → Q4_0 (2).
    let name = b"token_embd.weight";
    let mut info = (name.len() as u64).to_le_bytes().to_vec();
    info.extend(name);
    let mut want = info.clone();
    info.extend(2u32.to_le_bytes());
    info.extend(256u64.to_le_bytes()); // ne[0] = hidden
    info.extend(320u64.to_le_bytes()); // ne[1] = vocab
    info.extend(12u32.to_le_bytes());
    want.extend(&info[want.len()..info.len() - 4]);
    want.extend(2u32.to_le_bytes());
    let e = load(&patched(dir.path(), &info, &want));
    assert!(
        e.contains("Q4_0 (ggml type 2)") && e.contains("Q4_K, Q5_K, Q6_K"),
        "{e}"
    );

    let full = std::fs::read(gguf_fixture("tiny-k.gguf")).unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &full[..full.len() - 1000]).unwrap();
    assert!(matches!(
        checkpoint::load(&cut),
        Err(CheckpointError::Truncated { .. })
    ));
    std::fs::write(&cut, &full[..3000]).unwrap();
    let e = load(&cut);
    assert!(e.contains("truncated"), "{e}");
    std::fs::write(&cut, b"GGUF").unwrap();
    let e = load(&cut);
    assert!(e.contains("truncated or corrupt"), "{e}");
    std::fs::write(&cut, b"not a gguf file at all").unwrap();
    let e = load(&cut);
    assert!(e.contains("no `GGUF` magic"), "{e}");
}

/// `lily inspect` names the file kind, the block formats and what the GPU load converts, with
/// its error; a file it cannot read fails with what it supports.
#[test]
fn inspect_reports_formats_and_conversion() {
    let inspect = |path: &Path| {
        std::process::Command::new(env!("CARGO_BIN_EXE_lily"))
            .args(["inspect", "--model"])
            .arg(path)
            .output()
            .unwrap()
    };
    let out = inspect(&gguf_fixture("tiny-k.gguf"));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for want in [
        "GGUF",
        "Q4_K",
        "Q6_K",
        "Q4_K → q8 g64",
        "relative RMS error",
    ] {
        assert!(text.contains(want), "no {want} in:\n{text}");
    }
    let dir = tempfile::tempdir().unwrap();
    let out = inspect(&patched(dir.path(), b"qwen35moe", b"llama\0\0\0\0"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("only `qwen35moe`"), "{err}");
}

/// The MTP head a current converter appends as the block after the last (`blk.N` with its
/// `nextn.*` tensors, `block_count` N + 1, `nextn_predict_layers` 1), from the fixture with a
/// random head (its norms random too, so a norm read from the wrong tensor shows): the same
/// numbers as the safetensors head, and the same drafts.
#[test]
fn the_mtp_head_of_a_gguf_is_its_sources() {
    let want = checkpoint::load(&fixture_dir("tiny-a-mtp")).unwrap();
    let got = checkpoint::load(&gguf_fixture("tiny-a-mtp.gguf")).unwrap();
    assert_eq!(got.config, want.config);
    let (g, w) = (got.mtp.as_ref().unwrap(), want.mtp.as_ref().unwrap());
    let (gm, wm) = (g.matrices(), w.matrices());
    assert_eq!(gm.len(), wm.len());
    for ((name, a), (_, b)) in gm.into_iter().zip(wm) {
        assert_eq!(matrix_values(a), matrix_values(b), "{name}");
    }
    let norms = |m: &MtpWeights| {
        let Mixer::Attention(a) = &m.layer.mixer else {
            panic!("the head's layer is full attention")
        };
        [
            m.embedding_norm.clone(),
            m.hidden_norm.clone(),
            m.norm.clone(),
            m.layer.input_norm.clone(),
            m.layer.post_attention_norm.clone(),
            a.q_norm.clone(),
            a.k_norm.clone(),
        ]
    };
    assert_eq!(norms(g), norms(w));
    // The head's logits over a prompt, from each model's own hidden states (the model's GDN
    // decay differs by A_log's ulp, see above).
    let head_logits = |m: &Weights, ids: &[u32]| {
        let mut state = SequenceState::new(&m.config);
        state.mtp = Some(MtpState::default());
        let last = forward(m, ids, &mut state, Logits::Last);
        let next: Vec<u32> = ids[1..].iter().copied().chain([argmax(&last)]).collect();
        let hidden = state.mtp.take().unwrap().pending;
        let head = m.mtp.as_ref().unwrap();
        mtp::forward(
            m,
            head,
            &hidden,
            &next,
            0,
            &mut KvCache::default(),
            Logits::All,
        )
        .1
    };
    for len in [1, 9, 40] {
        let ids = random_prompt(want.config.vocab_size, len);
        let err = rel_error(&head_logits(&got, &ids), &head_logits(&want, &ids));
        assert!(
            err <= 1e-3,
            "{len} tokens: head logits rel. error {err:.2e}"
        );
    }
}
