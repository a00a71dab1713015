//! Loading checkpoints: layouts, synthetic checkpoints, and clear errors for broken files.

mod common;

use std::path::Path;

use common::{fixture_dir, rewrite};
use lily::checkpoint::{self, synth, tensor::DType, CheckpointError};
use lily::model::cpu::{forward, Logits};
use lily::model::SequenceState;

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// A copy of the text-layout fixture whose single file we can break.
fn broken_copy() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&fixture_dir("tiny-b"), dir.path());
    std::fs::remove_file(dir.path().join("reference.safetensors")).unwrap();
    let file = dir.path().join("model.safetensors");
    (dir, file)
}

fn load_err(dir: &Path) -> String {
    match checkpoint::load(dir) {
        Ok(_) => panic!("a broken checkpoint loaded"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn missing_tensor_is_named() {
    let (dir, file) = broken_copy();
    rewrite(&file, |l| {
        l.retain(|(n, ..)| n != "model.layers.2.self_attn.k_norm.weight")
    });
    let e = load_err(dir.path());
    assert!(
        e.contains("model.layers.2.self_attn.k_norm.weight") && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn wrong_shape_names_tensor_file_and_shapes() {
    let (dir, file) = broken_copy();
    rewrite(&file, |l| {
        let t = l
            .iter_mut()
            .find(|(n, ..)| n == "model.layers.0.linear_attn.in_proj_z.weight")
            .unwrap();
        t.2 = vec![t.2[1], t.2[0]];
    });
    let e = load_err(dir.path());
    assert!(
        e.contains("in_proj_z")
            && e.contains("model.safetensors")
            && e.contains("[48, 72]")
            && e.contains("[72, 48]"),
        "{e}"
    );
}

#[test]
fn wrong_dtype_is_named() {
    let (dir, file) = broken_copy();
    rewrite(&file, |l| {
        let t = l.iter_mut().find(|(n, ..)| n == "lm_head.weight").unwrap();
        t.1 = DType::I32;
    });
    let e = load_err(dir.path());
    assert!(e.contains("lm_head.weight") && e.contains("I32"), "{e}");
}

#[test]
fn truncated_shard_is_reported() {
    let (dir, file) = broken_copy();
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() - 1000]).unwrap();
    let e = load_err(dir.path());
    assert!(
        e.contains("truncated") && e.contains("model.safetensors"),
        "{e}"
    );
}

#[test]
fn corrupt_header_is_reported() {
    let (dir, file) = broken_copy();
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[8] = b'#'; // the opening brace of the JSON header
    std::fs::write(&file, &bytes).unwrap();
    let e = load_err(dir.path());
    assert!(e.contains("model.safetensors") && e.contains("JSON"), "{e}");

    std::fs::write(&file, [0xffu8; 16]).unwrap();
    let e = load_err(dir.path());
    assert!(e.contains("header length"), "{e}");
}

#[test]
fn index_pointing_at_a_missing_shard_is_reported() {
    let (dir, _) = broken_copy();
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        r#"{"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    let e = load_err(dir.path());
    assert!(e.contains("model-00002-of-00002.safetensors"), "{e}");
}

#[test]
fn synthetic_checkpoint_is_sharded_deterministic_and_runs() {
    let cfg = synth::preset("tiny").unwrap();
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    synth::write_checkpoint(&cfg, a.path(), 7, DType::F32, 1 << 20, false).unwrap();
    synth::write_checkpoint(&cfg, b.path(), 7, DType::F32, 1 << 20, false).unwrap();
    let shards: Vec<_> = std::fs::read_dir(a.path())
        .unwrap()
        .filter_map(|e| {
            let n = e.unwrap().file_name().into_string().unwrap();
            n.starts_with("model-").then_some(n)
        })
        .collect();
    assert!(shards.len() > 1, "expected several shards, got {shards:?}");
    for s in &shards {
        assert_eq!(
            std::fs::read(a.path().join(s)).unwrap(),
            std::fs::read(b.path().join(s)).unwrap(),
            "{s} differs between runs"
        );
    }
    let w = checkpoint::load(a.path()).unwrap();
    let mut state = SequenceState::new(&w.config);
    let logits = forward(&w, &[1, 2, 3], &mut state, Logits::Last);
    assert!(logits.iter().all(|x| x.is_finite()) && logits.iter().any(|&x| x != 0.0));
}

#[test]
fn official_layout_keeps_mtp_aside_and_ignores_vision() {
    let (dir, file) = broken_copy();
    rewrite(&file, |l| {
        let rename = |n: &str| {
            n.strip_prefix("model.")
                .map(|r| format!("model.language_model.{r}"))
                .unwrap_or(n.to_string())
        };
        for t in l.iter_mut() {
            t.0 = rename(&t.0);
        }
        l.push(("mtp.fc.weight".into(), DType::F32, vec![2, 2], vec![0; 16]));
        l.push((
            "model.visual.blocks.0.attn.qkv.weight".into(),
            DType::F32,
            vec![2],
            vec![0; 8],
        ));
    });
    let w = checkpoint::load(dir.path()).unwrap();
    assert_eq!(w.mtp_tensors, vec!["mtp.fc.weight".to_string()]);
    assert!(
        w.mtp.is_none(),
        "the config has no MTP layer: nothing to read"
    );
}

/// A copy of the fixture with an MTP head, its tensors edited.
fn mtp_copy(edit: impl Fn(&mut Vec<(String, DType, Vec<usize>, Vec<u8>)>)) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&fixture_dir("tiny-a-mtp"), dir.path());
    rewrite(&dir.path().join("model.safetensors"), edit);
    dir
}

#[test]
fn an_mtp_head_is_read_whole_or_not_at_all() {
    let whole = checkpoint::load(&fixture_dir("tiny-a-mtp")).unwrap();
    assert_eq!(whole.mtp_tensors.len(), 19);
    assert!(whole.mtp.is_some());
    // A checkpoint stripped of its head runs without drafts.
    let stripped = mtp_copy(|l| l.retain(|t| !t.0.starts_with("mtp.")));
    assert!(checkpoint::load(stripped.path()).unwrap().mtp.is_none());
    // One tensor of it missing, or misshapen: a corrupt checkpoint, named.
    let missing = mtp_copy(|l| l.retain(|t| t.0 != "mtp.norm.weight"));
    let e = load_err(missing.path());
    assert!(e.contains("mtp.norm.weight"), "{e}");
    let misshapen = mtp_copy(|l| {
        let t = l.iter_mut().find(|t| t.0 == "mtp.fc.weight").unwrap();
        t.2 = vec![t.2[1], t.2[0]];
    });
    let e = load_err(misshapen.path());
    assert!(e.contains("mtp.fc.weight"), "{e}");
}

#[test]
fn missing_directory_is_an_error_not_a_panic() {
    let e = checkpoint::load(Path::new("/nonexistent/model")).unwrap_err();
    assert!(matches!(e, CheckpointError::Config(_)), "{e}");
    assert!(
        e.to_string().contains("/nonexistent/model/config.json"),
        "{e}"
    );
}
