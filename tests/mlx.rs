//! MLX checkpoints: loading mlx-lm's output (tests/fixtures/mlx, made by tools/check_mlx.py),
//! clear errors for broken quantised files, `lily quantize` / `synth --quant`, and sizes.

mod common;

use std::path::{Path, PathBuf};

use common::{rel_error, rewrite};
use lily::checkpoint::{self, mlx, mlx_write, safetensors, synth, tensor::DType};
use lily::model::cpu::{forward, Logits};
use lily::model::weights::{Mixer, WeightFormat};
use lily::model::SequenceState;
use lily::quant::Affine;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx/tiny-q4")
}

fn reference() -> std::collections::BTreeMap<String, lily::checkpoint::tensor::RawTensor> {
    safetensors::open_file(&fixture().join("reference.safetensors")).unwrap()
}

fn floats(
    r: &std::collections::BTreeMap<String, lily::checkpoint::tensor::RawTensor>,
    name: &str,
) -> Vec<f32> {
    r[name].to_f32(name).unwrap()
}

fn ids(
    r: &std::collections::BTreeMap<String, lily::checkpoint::tensor::RawTensor>,
    p: usize,
) -> Vec<u32> {
    r[&format!("p{p}.ids")]
        .data
        .as_slice()
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect()
}

/// mlx computes the same quantised weights in f32 when asked (`set_dtype(float32)`): then only
/// summation order differs. Its own bf16 run rounds every activation, so against that run lily
/// may differ by as much as bf16 moves mlx itself.
const F32_TOLERANCE: f32 = 1e-4;

#[test]
fn mlx_lm_q4_checkpoint_matches_mlx_logits() {
    let w = checkpoint::load(&fixture()).unwrap();
    // What mlx-lm quantised: embeddings 4-bit, routers 8-bit, the 96-wide shared down projection
    // (not a multiple of 64) left in bf16.
    assert_eq!(
        w.embed.format,
        WeightFormat::Affine {
            bits: 4,
            group_size: 64
        }
    );
    assert_eq!(
        w.layers[0].moe.router.format,
        WeightFormat::Affine {
            bits: 8,
            group_size: 64
        }
    );
    assert_eq!(
        w.layers[0].moe.shared_expert_gate.format,
        WeightFormat::Affine {
            bits: 8,
            group_size: 64
        }
    );
    assert_eq!(
        w.layers[0].moe.shared_expert.down.format,
        WeightFormat::BF16
    );
    assert!(
        matches!(&w.layers[0].mixer, Mixer::DeltaNet(d) if d.in_proj_b.format == WeightFormat::Affine { bits: 4, group_size: 64 })
    );

    let r = reference();
    let prompts = r.keys().filter(|k| k.ends_with(".ids")).count();
    assert!(prompts >= 3);
    for p in 0..prompts {
        let ids = ids(&r, p);
        let mut state = SequenceState::new(&w.config);
        let logits = forward(&w, &ids, &mut state, Logits::All);
        let (f32_run, bf16_run) = (
            floats(&r, &format!("p{p}.logits_f32")),
            floats(&r, &format!("p{p}.logits")),
        );
        let err = rel_error(&logits, &f32_run);
        let err_bf16 = rel_error(&logits, &bf16_run);
        let noise = rel_error(&bf16_run, &f32_run);
        println!("prompt {p} ({} tokens): vs mlx f32 {err:.2e}, vs mlx bf16 {err_bf16:.2e} (mlx bf16 vs f32 {noise:.2e})", ids.len());
        assert!(
            err <= F32_TOLERANCE,
            "prompt {p}: {err:.2e} against mlx's f32 run"
        );
        assert!(
            err_bf16 <= 2.0 * noise + F32_TOLERANCE,
            "prompt {p}: {err_bf16:.2e} against mlx's bf16 run"
        );
    }
}

/// A copy of the fixture's model (no index, so tensors can be removed) whose tensors and config
/// a test can break.
fn broken_copy() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture().join(f), dir.path().join(f)).unwrap();
    }
    let file = dir.path().join("model.safetensors");
    (dir, file)
}

fn edit_config(dir: &Path, edit: impl Fn(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
}

fn load_err(dir: &Path) -> String {
    match checkpoint::load(dir) {
        Ok(_) => panic!("a broken checkpoint loaded"),
        Err(e) => e.to_string(),
    }
}

const QKV: &str = "language_model.model.layers.0.linear_attn.in_proj_qkv";

#[test]
fn wrong_group_size_names_tensor_file_and_sizes() {
    let (dir, _) = broken_copy();
    edit_config(dir.path(), |v| {
        for key in ["quantization", "quantization_config"] {
            v[key]["group_size"] = 32.into();
        }
    });
    let e = load_err(dir.path());
    assert!(
        e.contains("language_model.model.embed_tokens.scales")
            && e.contains("model.safetensors")
            && e.contains("group size 32")
            && e.contains("group size 64"),
        "{e}"
    );
}

#[test]
fn bits_that_do_not_match_the_packed_width_are_reported() {
    let (dir, _) = broken_copy();
    edit_config(dir.path(), |v| {
        for key in ["quantization", "quantization_config"] {
            v[key]["bits"] = 8.into();
        }
    });
    let e = load_err(dir.path());
    assert!(
        e.contains("language_model.model.embed_tokens.weight")
            && e.contains("8-bit")
            && e.contains("would mean 4-bit"),
        "{e}"
    );
}

#[test]
fn missing_scales_are_reported() {
    let (dir, file) = broken_copy();
    rewrite(&file, |l| l.retain(|(n, ..)| *n != format!("{QKV}.scales")));
    let e = load_err(dir.path());
    assert!(
        e.contains(&format!("{QKV}.weight"))
            && e.contains(&format!("{QKV}.scales"))
            && e.contains("missing")
            && e.contains("model.safetensors"),
        "{e}"
    );
}

#[test]
fn missing_biases_are_reported() {
    let (dir, file) = broken_copy();
    rewrite(&file, |l| l.retain(|(n, ..)| *n != format!("{QKV}.biases")));
    let e = load_err(dir.path());
    assert!(
        e.contains(&format!("{QKV}.biases"))
            && e.contains("missing")
            && e.contains("model.safetensors"),
        "{e}"
    );
}

#[test]
fn wrong_scales_shape_is_reported() {
    let (dir, file) = broken_copy();
    rewrite(&file, |l| {
        let t = l
            .iter_mut()
            .find(|(n, ..)| *n == format!("{QKV}.scales"))
            .unwrap();
        // One row short.
        let row = t.3.len() / t.2[0];
        t.2[0] -= 1;
        t.3.truncate(t.3.len() - row);
    });
    let e = load_err(dir.path());
    assert!(
        e.contains(&format!("{QKV}.scales"))
            && e.contains("model.safetensors")
            && e.contains("[255, 2]")
            && e.contains("[256, 2]"),
        "{e}"
    );
}

#[test]
fn unsupported_quantisation_mode_is_reported() {
    let (dir, _) = broken_copy();
    edit_config(dir.path(), |v| v["quantization"]["mode"] = "mxfp4".into());
    let e = load_err(dir.path());
    assert!(
        e.contains("quantization.mode") && e.contains("mxfp4"),
        "{e}"
    );
}

/// mlx-lm only adds the +1 to norm weights while converting a Hugging Face file; it recognises
/// such a file by its conv kernels in the PyTorch layout, and so does lily.
#[test]
fn unconverted_conv_layout_means_norms_without_the_plus_one() {
    let want = checkpoint::load(&fixture()).unwrap();
    let (dir, file) = broken_copy();
    rewrite(&file, |l| {
        for (name, dtype, shape, data) in l.iter_mut() {
            if name.ends_with("conv1d.weight") {
                *shape = vec![shape[0], 1, shape[1]];
            }
            let zero_centred = [
                "input_layernorm.weight",
                "post_attention_layernorm.weight",
                "q_norm.weight",
                "k_norm.weight",
            ];
            if zero_centred.iter().any(|s| name.ends_with(s))
                || name == "language_model.model.norm.weight"
            {
                // bf16 values near 1 minus 1 are exact in f32.
                let v: Vec<f32> = data
                    .chunks_exact(2)
                    .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32() - 1.0)
                    .collect();
                *dtype = DType::F32;
                *data = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            }
        }
    });
    let got = checkpoint::load(dir.path()).unwrap();
    assert_eq!(got.final_norm, want.final_norm);
    assert_eq!(got.layers[3].input_norm, want.layers[3].input_norm);
    let mut a = SequenceState::new(&want.config);
    let mut b = SequenceState::new(&got.config);
    assert_eq!(
        forward(&want, &[1, 2, 3], &mut a, Logits::All),
        forward(&got, &[1, 2, 3], &mut b, Logits::All)
    );
}

/// `synth --quant` draws the same values as `synth` and converts them as `lily quantize` does:
/// every file of the two checkpoints is identical. And the quantised model stays close to the
/// unquantised one.
#[test]
fn synthetic_quantised_checkpoint_equals_quantising_the_synthetic_one() {
    let cfg = synth::preset("tiny").unwrap();
    let bf16 = tempfile::tempdir().unwrap();
    let via_quantize = tempfile::tempdir().unwrap();
    let direct = tempfile::tempdir().unwrap();
    let q = Affine::new(4, 64).unwrap();
    synth::write_checkpoint(&cfg, bf16.path(), 9, DType::BF16, synth::SHARD_BYTES, false).unwrap();
    mlx_write::quantize_dir(bf16.path(), via_quantize.path(), q, false).unwrap();
    synth::write_mlx_checkpoint(
        &cfg,
        direct.path(),
        9,
        DType::BF16,
        q,
        mlx_write::SHARD_BYTES,
        false,
    )
    .unwrap();
    let mut files: Vec<_> = std::fs::read_dir(direct.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "config.json",
            "model.safetensors",
            "model.safetensors.index.json"
        ]
    );
    for f in &files {
        assert!(
            std::fs::read(direct.path().join(f)).unwrap()
                == std::fs::read(via_quantize.path().join(f)).unwrap(),
            "{f:?} differs"
        );
    }

    let full = checkpoint::load(bf16.path()).unwrap();
    let quantised = checkpoint::load(direct.path()).unwrap();
    // The tiny preset's expert down projections are 32 wide: too narrow for group 64.
    assert_eq!(
        quantised.layers[0].moe.experts[0].down.format,
        WeightFormat::BF16
    );
    assert_eq!(
        quantised.layers[0].moe.experts[0].gate.format,
        WeightFormat::Affine {
            bits: 4,
            group_size: 64
        }
    );
    let prompt = [5, 17, 300, 2, 999, 64, 8];
    let a = forward(
        &full,
        &prompt,
        &mut SequenceState::new(&full.config),
        Logits::All,
    );
    let b = forward(
        &quantised,
        &prompt,
        &mut SequenceState::new(&quantised.config),
        Logits::All,
    );
    let kl = mean_kl(&a, &b, full.config.vocab_size);
    // tools/check_mlx.py measures 2.6e-3 on other prompts of this model (tests/fixtures/mlx/REPORT.md).
    assert!(kl > 0.0 && kl < 2e-2, "KL(bf16 ‖ 4-bit) = {kl:.2e}");
}

/// Mean over positions of KL(softmax(p) ‖ softmax(q)), rows of `vocab` logits.
fn mean_kl(p: &[f32], q: &[f32], vocab: usize) -> f64 {
    let log_softmax = |x: &[f32]| {
        let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
        let lse = x.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln() + max;
        x.iter().map(|&v| v as f64 - lse).collect::<Vec<_>>()
    };
    let rows = p.len() / vocab;
    let total: f64 = p
        .chunks_exact(vocab)
        .zip(q.chunks_exact(vocab))
        .map(|(p, q)| {
            let (lp, lq) = (log_softmax(p), log_softmax(q));
            lp.iter()
                .zip(&lq)
                .map(|(a, b)| a.exp() * (a - b))
                .sum::<f64>()
        })
        .sum();
    total / rows as f64
}

#[test]
fn quantize_refuses_an_mlx_checkpoint() {
    let out = tempfile::tempdir().unwrap();
    let e = mlx_write::quantize_dir(&fixture(), out.path(), Affine::new(4, 64).unwrap(), false)
        .unwrap_err();
    assert!(
        e.to_string().contains("already holds an MLX checkpoint"),
        "{e}"
    );
}

/// MODEL.md §7: the MLX 4-bit text model is about 19.4 GB, without the MTP head (mlx-lm drops
/// it); the plan `synth --quant q4` writes from must agree, computed from the shapes alone, and
/// carries the head besides (one more attention layer with its MoE, `mtp.fc`, three norms).
#[test]
fn full_size_q4_checkpoint_is_19_4_gb() {
    let mut cfg = synth::preset("qwen3.6-35b-a3b").unwrap();
    let q4 = Affine::new(4, 64).unwrap();
    let with_head = synth::mlx_plan(&cfg, DType::BF16, q4).unwrap();
    cfg["text_config"]["mtp_num_hidden_layers"] = 0.into();
    let plan = synth::mlx_plan(&cfg, DType::BF16, q4).unwrap();
    let bytes = plan.total_bytes();
    println!("full-size q4: {bytes} bytes ({:.3} GB)", bytes as f64 / 1e9);
    assert!((bytes as f64 / 19.4e9 - 1.0).abs() < 0.02, "{bytes} bytes");
    // The head at 4.5 bits a weight: 256 experts' 3 × 512 × 2048 (453 MB), the attention's
    // 27.3 M and mtp.fc's 8.4 M weights (20 MB), the shared expert and the 8-bit router.
    let head = with_head.total_bytes() - bytes;
    println!("its MTP head: {head} bytes");
    assert!((head as f64 / 0.475e9 - 1.0).abs() < 0.02, "{head} bytes");
    // mlx-lm's tensor count: per GDN layer 5 quantised projections ×3, conv, A_log, dt_bias,
    // norm; per attention layer 4 ×3 and q/k norms; per layer 2 norms and 8 quantised MLP
    // modules ×3 (router, 3 expert stacks, 3 shared-expert projections, shared-expert gate);
    // plus embedding ×3, final norm, head ×3.
    assert_eq!(
        plan.tensors().len(),
        30 * (15 + 4) + 10 * (12 + 2) + 40 * (2 + 24) + 3 + 1 + 3
    );
    // The MTP head: its layer as an attention layer's, mtp.fc ×3 and three norms.
    assert_eq!(
        with_head.tensors().len() - plan.tensors().len(),
        (12 + 2) + (2 + 24) + 3 + 3
    );
    // Router and shared-expert gate of every layer at 8 bits (the head's too).
    let overrides = |p: &mlx::Plan| p.quantization.iter().filter(|(_, v)| v.is_object()).count();
    assert_eq!(overrides(&plan), 80);
    assert_eq!(overrides(&with_head), 82);
    assert_eq!(
        plan.quantization["language_model.model.layers.39.mlp.gate"],
        serde_json::json!({"group_size": 64, "bits": 8})
    );
}

/// `lily inspect` on a quantised checkpoint: formats per component, and the total equals the
/// bytes of the matrices' tensors in the file (packed weights, scales and biases included).
#[test]
fn inspect_reports_quantised_storage() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lily"))
        .args(["inspect", "--model"])
        .arg(fixture())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    for want in ["q4 g64", "q8 g64", "bf16"] {
        assert!(text.contains(want), "no {want} in:\n{text}");
    }
    let store = lily::checkpoint::safetensors::open_dir(&fixture()).unwrap();
    let vectors = ["norm.weight", "conv1d.weight", "A_log", "dt_bias"];
    // (The fixture directory also holds mlx's reference logits; only the model's tensors count.)
    let want: usize = store
        .tensors
        .iter()
        .filter(|(n, _)| {
            n.starts_with("language_model.") && !vectors.iter().any(|v| n.ends_with(v))
        })
        .map(|(_, t)| t.data.len())
        .sum();
    let total = text
        .lines()
        .find(|l| l.trim_start().starts_with("total"))
        .unwrap();
    let bytes: usize = total
        .split('(')
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .replace(',', "")
        .parse()
        .unwrap();
    assert_eq!(bytes, want, "{total}");
    assert!(mlx::is_mlx_layout(&store));
}

/// `lily quantize` keeps the MTP head (mlx-lm's conversion drops it) under its Hugging Face
/// names, quantised as the layers are, its norms with the +1 baked in as the others; `synth
/// --quant` writes the same files; the loader reads the head back.
#[test]
fn the_mtp_head_survives_quantisation() {
    // The fixture's head has random norms (a lost or doubled +1 shows); its matrices 64 wide or
    // more are quantised (8 bits), the 32-wide ones stay as they were.
    let src = common::fixture_dir("tiny-a-mtp");
    let out = tempfile::tempdir().unwrap();
    mlx_write::quantize_dir(&src, out.path(), Affine::new(8, 64).unwrap(), false).unwrap();
    let (want, got) = (
        checkpoint::load(&src).unwrap(),
        checkpoint::load(out.path()).unwrap(),
    );
    let (w, g) = (want.mtp.as_ref().unwrap(), got.mtp.as_ref().unwrap());
    assert_eq!(g.embedding_norm, w.embedding_norm);
    assert_eq!(g.hidden_norm, w.hidden_norm);
    assert_eq!(g.norm, w.norm);
    assert_eq!(g.layer.input_norm, w.layer.input_norm);
    for ((name, a), (_, b)) in g.matrices().into_iter().zip(w.matrices()) {
        let (x, y) = (common::matrix_values(a), common::matrix_values(b));
        if matches!(a.format, WeightFormat::Affine { .. }) {
            let err = common::rel_rms(&x, &y);
            assert!(err < 0.01, "{name}: Q8 rel. RMS error {err:.4}");
        } else {
            assert!(x == y, "{name} changed");
        }
    }

    // A head wide enough to quantise: synth --quant equals quantising the synthetic model.
    let mut cfg = synth::preset("tiny").unwrap();
    cfg["text_config"]["mtp_num_hidden_layers"] = 1.into();
    let (bf16, via_quantize, direct) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let q = Affine::new(4, 64).unwrap();
    synth::write_checkpoint(&cfg, bf16.path(), 4, DType::BF16, synth::SHARD_BYTES, false).unwrap();
    mlx_write::quantize_dir(bf16.path(), via_quantize.path(), q, false).unwrap();
    synth::write_mlx_checkpoint(
        &cfg,
        direct.path(),
        4,
        DType::BF16,
        q,
        mlx_write::SHARD_BYTES,
        false,
    )
    .unwrap();
    for f in [
        "config.json",
        "model.safetensors",
        "model.safetensors.index.json",
    ] {
        assert!(
            std::fs::read(direct.path().join(f)).unwrap()
                == std::fs::read(via_quantize.path().join(f)).unwrap(),
            "{f} differs"
        );
    }
    let quantised = checkpoint::load(direct.path()).unwrap();
    let head = quantised.mtp.as_ref().expect("the head is kept");
    let q4 = WeightFormat::Affine {
        bits: 4,
        group_size: 64,
    };
    assert_eq!(head.fc.format, q4);
    assert_eq!(head.layer.moe.experts[0].gate.format, q4);
    // The router 8-bit, as mlx-lm quantises every layer's.
    assert_eq!(
        head.layer.moe.router.format,
        WeightFormat::Affine {
            bits: 8,
            group_size: 64
        }
    );
    let full = checkpoint::load(bf16.path()).unwrap();
    let (a, b) = (full.mtp.as_ref().unwrap(), head);
    for ((name, x), (_, y)) in b.matrices().into_iter().zip(a.matrices()) {
        let err = common::rel_rms(&common::matrix_values(x), &common::matrix_values(y));
        assert!(
            err < 0.2,
            "{name}: rel. RMS error {err:.3} against the bf16 head"
        );
    }
}
