//! Corrupted checkpoints: a GGUF file and a safetensors shard with random bytes overwritten
//! (mostly in their headers: lengths, counts, types, offsets, the JSON), loaded again and again.
//! Each load either succeeds (a byte of weights changed) or fails with an error — never a panic,
//! and never an allocation sized by a corrupt length (which would abort the process, failing this
//! test run as a whole).
//!
//! The corruptions come from a seeded generator (the seed is printed; LILY_TEST_SEED repeats one).

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{fixture_dir, Rng};
use lily::checkpoint;

/// Per load: a corrupt count must not make the reader loop for long either.
const SLOW: Duration = Duration::from_secs(20);

/// `bytes` with 1–4 random changes: a byte set to a random or an extreme value, or a little-endian
/// u32/u64 overwritten with a large one, at an offset below `header` most of the time.
fn corrupt(rng: &mut Rng, bytes: &[u8], header: usize) -> Vec<u8> {
    let mut b = bytes.to_vec();
    for _ in 0..1 + rng.below(4) {
        let limit = if rng.below(5) == 0 {
            b.len()
        } else {
            header.min(b.len())
        };
        let at = rng.below(limit.max(1));
        match rng.below(4) {
            0 => b[at] = rng.next_u64() as u8,
            1 => b[at] = [0x00, 0xFF, 0x7F, 0x80][rng.below(4)],
            2 => {
                let v = [u32::MAX, u32::MAX / 2, 1 << 31, 1 << 24][rng.below(4)];
                let end = (at + 4).min(b.len());
                b[at..end].copy_from_slice(&v.to_le_bytes()[..end - at]);
            }
            _ => {
                let v = [u64::MAX, 1 << 62, 1 << 40, 1 << 33][rng.below(4)];
                let end = (at + 8).min(b.len());
                b[at..end].copy_from_slice(&v.to_le_bytes()[..end - at]);
            }
        }
    }
    b
}

/// Loads `path` (the file or its directory), catching panics: Err(message) on a panic.
fn load_without_panic(path: &Path) -> Result<bool, String> {
    catch_unwind(AssertUnwindSafe(|| checkpoint::load(path).is_ok())).map_err(|e| {
        e.downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default()
    })
}

/// `rounds` corruptions of `original` written to `target` and loaded from `load_path`.
fn fuzz(
    rng: &mut Rng,
    what: &str,
    original: &[u8],
    header: usize,
    target: &Path,
    load_path: &Path,
    rounds: usize,
) {
    let (mut loaded, mut refused) = (0, 0);
    for round in 0..rounds {
        let bytes = corrupt(rng, original, header);
        std::fs::write(target, &bytes).unwrap();
        let started = Instant::now();
        match load_without_panic(load_path) {
            Ok(true) => loaded += 1,
            Ok(false) => refused += 1,
            Err(panic) => {
                let kept = std::env::temp_dir().join(format!("lily-fuzz-{what}-{round}"));
                std::fs::write(&kept, &bytes).unwrap();
                panic!(
                    "{what}, round {round}: the load panicked ({panic}); the file is kept at {}",
                    kept.display()
                );
            }
        }
        assert!(
            started.elapsed() < SLOW,
            "{what}, round {round}: the load took {:?}",
            started.elapsed()
        );
    }
    println!("{what}: {loaded} loaded, {refused} refused with an error");
}

/// The first bytes of a GGUF file that are not tensor data: its metadata and tensor infos end
/// before the data section, which in the fixture starts after ≈ 10–20 KB.
fn gguf_header_bytes(path: &PathBuf) -> usize {
    std::fs::read(path).unwrap().len().min(24 * 1024)
}

/// The bf16 GGUF fixture and the K-quant one (Q4_K, Q5_K, Q6_K, Q8_0 blocks).
#[test]
fn corrupt_gguf_files_fail_cleanly() {
    let mut rng = Rng::new("gguf fuzz");
    for name in ["tiny-a-bf16.gguf", "tiny-k.gguf"] {
        let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/gguf")
            .join(name);
        let original = std::fs::read(&fixture).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("model.gguf");
        fuzz(
            &mut rng,
            name,
            &original,
            gguf_header_bytes(&fixture),
            &target,
            &target,
            200,
        );
    }
}

/// An MLX 4-bit checkpoint's shard (packed weights with their scales and biases).
#[test]
fn corrupt_mlx_shards_fail_cleanly() {
    let mut rng = Rng::new("mlx fuzz");
    let dir = tempfile::tempdir().unwrap();
    let source = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx/tiny-q4");
    for entry in std::fs::read_dir(&source).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    let target = dir.path().join("model.safetensors");
    let original = std::fs::read(&target).unwrap();
    let header = 8 + u64::from_le_bytes(original[..8].try_into().unwrap()) as usize;
    fuzz(&mut rng, "mlx", &original, header, &target, dir.path(), 300);
}

#[test]
fn corrupt_safetensors_shards_fail_cleanly() {
    let mut rng = Rng::new("safetensors fuzz");
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture_dir("tiny-b")).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name() != "reference.safetensors" {
            std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
        }
    }
    let target = dir.path().join("model.safetensors");
    let original = std::fs::read(&target).unwrap();
    // The 8-byte length, then the JSON header.
    let header = 8 + u64::from_le_bytes(original[..8].try_into().unwrap()) as usize;
    fuzz(
        &mut rng,
        "safetensors",
        &original,
        header,
        &target,
        dir.path(),
        300,
    );
}
