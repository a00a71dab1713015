//! Reading safetensors checkpoints: one file, or a directory of shards with
//! `model.safetensors.index.json`. Files are memory-mapped; nothing is copied.
//!
//! The header is parsed here rather than by the `safetensors` crate so that every failure can
//! name the file and the tensor (a truncated shard, a corrupt header, a size that does not match
//! the shape).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;

use super::tensor::{Bytes, DType, RawTensor, TensorStore};
use super::CheckpointError;

/// Opens every tensor of the checkpoint in `dir` (sharded with an index, or plain `*.safetensors`).
pub fn open_dir(dir: &Path) -> Result<TensorStore, CheckpointError> {
    let index = dir.join("model.safetensors.index.json");
    let mut store = TensorStore {
        source: dir.display().to_string(),
        ..Default::default()
    };
    if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|e| io_err(&index, e))?;
        let json: Value = serde_json::from_str(&text).map_err(|e| CheckpointError::Header {
            file: index.display().to_string(),
            message: format!("not valid JSON: {e}"),
        })?;
        let map = json
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| CheckpointError::Header {
                file: index.display().to_string(),
                message: "no `weight_map` object".into(),
            })?;
        let mut files: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (name, file) in map {
            let file = file.as_str().ok_or_else(|| CheckpointError::Header {
                file: index.display().to_string(),
                message: format!("weight_map entry for `{name}` is not a file name"),
            })?;
            if file.contains('/') || file.contains('\\') || file.starts_with('.') {
                return Err(CheckpointError::Header {
                    file: index.display().to_string(),
                    message: format!("weight_map entry for `{name}` names `{file}`, which is not a file in the checkpoint directory"),
                });
            }
            files
                .entry(file.to_string())
                .or_default()
                .push(name.clone());
        }
        for (file, names) in files {
            let path = dir.join(&file);
            let tensors = open_file(&path)?;
            for name in names {
                let t = tensors.get(&name).ok_or_else(|| CheckpointError::Header {
                    file: path.display().to_string(),
                    message: format!(
                        "the index says tensor `{name}` is in this file, but it is not"
                    ),
                })?;
                store.tensors.insert(name, t.clone());
            }
        }
    } else {
        let mut shards: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| io_err(dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        shards.sort();
        if shards.is_empty() {
            return Err(CheckpointError::NoWeights {
                dir: dir.display().to_string(),
            });
        }
        for path in shards {
            for (name, t) in open_file(&path)? {
                if store.tensors.insert(name.clone(), t).is_some() {
                    return Err(CheckpointError::Header {
                        file: path.display().to_string(),
                        message: format!("tensor `{name}` appears in more than one file"),
                    });
                }
            }
        }
    }
    Ok(store)
}

/// Memory-maps one safetensors file and lists its tensors.
pub fn open_file(path: &Path) -> Result<BTreeMap<String, RawTensor>, CheckpointError> {
    let file = std::fs::File::open(path).map_err(|e| io_err(path, e))?;
    // SAFETY: the file is opened read-only; a checkpoint modified while mapped is the user's
    // problem, as with every engine that maps weights.
    let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| io_err(path, e))?;
    let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = Arc::new(mmap);
    parse(path, owner)
}

/// Parses a safetensors buffer (the whole file).
pub fn parse(
    path: &Path,
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
) -> Result<BTreeMap<String, RawTensor>, CheckpointError> {
    let buf: &[u8] = (*owner).as_ref();
    let file = path.display().to_string();
    let header_err = |message: String| CheckpointError::Header {
        file: file.clone(),
        message,
    };
    if buf.len() < 8 {
        return Err(header_err(format!(
            "file is {} bytes, too short for a safetensors header",
            buf.len()
        )));
    }
    let n = u64::from_le_bytes(buf[..8].try_into().expect("8 bytes")) as usize;
    if n > buf.len() - 8 || n > 100 << 20 {
        return Err(header_err(format!(
            "header length {n} does not fit in the file ({} bytes): corrupt or truncated",
            buf.len()
        )));
    }
    let header: Value = serde_json::from_slice(&buf[8..8 + n])
        .map_err(|e| header_err(format!("header is not valid JSON: {e}")))?;
    let entries = header
        .as_object()
        .ok_or_else(|| header_err("header is not a JSON object".into()))?;
    let data_start = 8 + n;
    let data_len = buf.len() - data_start;
    let mut out = BTreeMap::new();
    for (name, info) in entries {
        if name == "__metadata__" {
            continue;
        }
        let bad = |what: &str| header_err(format!("tensor `{name}`: {what}"));
        let dtype_s = info
            .get("dtype")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("no dtype"))?;
        let dtype = DType::from_safetensors(dtype_s)
            .ok_or_else(|| bad(&format!("unsupported dtype {dtype_s}")))?;
        let shape: Vec<usize> = info
            .get("shape")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("no shape"))?
            .iter()
            .map(|d| d.as_u64().map(|d| d as usize))
            .collect::<Option<_>>()
            .ok_or_else(|| bad("shape is not a list of integers"))?;
        let offsets = info
            .get("data_offsets")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("no data_offsets"))?;
        let (begin, end) = match offsets.as_slice() {
            [a, b] => (
                a.as_u64().ok_or_else(|| bad("bad data_offsets"))? as usize,
                b.as_u64().ok_or_else(|| bad("bad data_offsets"))? as usize,
            ),
            _ => return Err(bad("data_offsets must have two entries")),
        };
        let numel = shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| bad("shape overflows"))?;
        if end < begin || end - begin != numel * dtype.size() {
            return Err(bad(&format!(
                "data_offsets [{begin}, {end}) hold {} bytes but shape {shape:?} of {dtype_s} needs {}",
                end.saturating_sub(begin),
                numel * dtype.size()
            )));
        }
        if end > data_len {
            return Err(CheckpointError::Truncated {
                file: file.clone(),
                tensor: name.clone(),
                needed: data_start + end,
                size: buf.len(),
            });
        }
        out.insert(
            name.clone(),
            RawTensor {
                dtype,
                shape,
                data: Bytes::new(owner.clone(), data_start + begin, end - begin),
                file: path.to_path_buf(),
            },
        );
    }
    Ok(out)
}

/// Writes tensors as one safetensors file (used by `synth`, `quantize` and tests).
pub fn write_file(
    path: &Path,
    tensors: &[(String, DType, Vec<usize>, Vec<u8>)],
) -> std::io::Result<()> {
    use std::io::Write;
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, dtype, shape, data) in tensors {
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype.safetensors_name(), "shape": shape, "data_offsets": [offset, offset + data.len()]}),
        );
        offset += data.len();
    }
    let mut h = serde_json::to_vec(&Value::Object(header))?;
    while h.len() % 8 != 0 {
        h.push(b' '); // alignment padding, as the reference writer does
    }
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    f.write_all(&(h.len() as u64).to_le_bytes())?;
    f.write_all(&h)?;
    for (_, _, _, data) in tensors {
        f.write_all(data)?;
    }
    f.flush()
}

fn io_err(path: &Path, source: std::io::Error) -> CheckpointError {
    CheckpointError::Io {
        path: path.display().to_string(),
        source,
    }
}
