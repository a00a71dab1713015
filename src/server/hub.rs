//! `--model` as a Hugging Face repo id: found in the local Hugging Face cache, where
//! `hf download ORG/NAME` (or transformers, vLLM, ...) put it. lily does not download by
//! itself: the hub clients for Rust pull a TLS stack built from C, which this project keeps out.

use std::path::{Path, PathBuf};

/// The hub cache folder, as huggingface_hub finds it: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
/// `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`.
pub fn hub_cache_dir() -> Option<PathBuf> {
    let var = |name: &str| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    var("HF_HUB_CACHE")
        .or_else(|| var("HF_HOME").map(|h| h.join("hub")))
        .or_else(|| var("XDG_CACHE_HOME").map(|c| c.join("huggingface").join("hub")))
        .or_else(|| var("HOME").map(|h| h.join(".cache").join("huggingface").join("hub")))
}

/// Whether `arg` has the shape of a repo id (`ORG/NAME`) rather than a path.
pub fn looks_like_repo_id(arg: &str) -> bool {
    let mut parts = arg.split('/');
    let ok = |p: Option<&str>| {
        p.is_some_and(|p| {
            !p.is_empty()
                && p != "."
                && p != ".."
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        })
    };
    ok(parts.next()) && ok(parts.next()) && parts.next().is_none()
}

/// The snapshot folder of `repo_id` in the cache at `hub`: the one `refs/main` names, else the
/// most recently modified. It must hold a `config.json`.
pub fn find_in_cache(hub: &Path, repo_id: &str) -> Option<PathBuf> {
    let repo = hub.join(format!("models--{}", repo_id.replace('/', "--")));
    let snapshots = repo.join("snapshots");
    let pinned = std::fs::read_to_string(repo.join("refs").join("main"))
        .ok()
        .map(|r| snapshots.join(r.trim()));
    let newest = || {
        std::fs::read_dir(&snapshots)
            .ok()?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.join("config.json").is_file())
            .max_by_key(|p| p.metadata().and_then(|m| m.modified()).ok())
    };
    pinned
        .filter(|p| p.join("config.json").is_file())
        .or_else(newest)
}

/// Turns `--model` into a directory or a GGUF file: an existing directory or `.gguf` file as
/// is, a repo id through the cache.
pub fn resolve(arg: &str) -> anyhow::Result<PathBuf> {
    let path = Path::new(arg);
    if path.is_dir() || (path.is_file() && path.extension().is_some_and(|e| e == "gguf")) {
        return Ok(path.to_path_buf());
    }
    if !looks_like_repo_id(arg) {
        anyhow::bail!("--model {arg}: no such directory");
    }
    let hub = hub_cache_dir().ok_or_else(|| anyhow::anyhow!("--model {arg}: not a directory, and no Hugging Face cache folder is known (set HF_HOME)"))?;
    find_in_cache(&hub, arg).ok_or_else(|| {
        anyhow::anyhow!(
            "--model {arg}: not a directory, and not in the Hugging Face cache at {}. lily does not download \
             models itself; fetch it first, e.g. `pip install -U huggingface_hub && hf download {arg}`, or pass the \
             model's directory.",
            hub.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids_and_paths() {
        assert!(looks_like_repo_id("Qwen/Qwen3.6-35B-A3B"));
        assert!(looks_like_repo_id("mlx-community/Qwen3.6-35B-A3B-4bit"));
        assert!(!looks_like_repo_id("./models/qwen"));
        assert!(!looks_like_repo_id("/models/qwen"));
        assert!(!looks_like_repo_id("qwen"));
        assert!(!looks_like_repo_id("../x"));
    }

    #[test]
    fn cache_lookup_prefers_refs_main() {
        let hub = std::env::temp_dir().join(format!("lily-hub-test-{}", std::process::id()));
        let repo = hub.join("models--Org--Name");
        for rev in ["aaa", "bbb"] {
            std::fs::create_dir_all(repo.join("snapshots").join(rev)).expect("mkdir");
            std::fs::write(repo.join("snapshots").join(rev).join("config.json"), "{}")
                .expect("write");
        }
        std::fs::create_dir_all(repo.join("refs")).expect("mkdir");
        std::fs::write(repo.join("refs").join("main"), "aaa\n").expect("write");
        assert_eq!(
            find_in_cache(&hub, "Org/Name"),
            Some(repo.join("snapshots").join("aaa"))
        );
        assert_eq!(find_in_cache(&hub, "Org/Other"), None);
        std::fs::remove_dir_all(&hub).expect("cleanup");
    }
}
