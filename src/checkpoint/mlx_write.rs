//! Writing MLX checkpoints from a [`Plan`]: the values of each Hugging Face tensor are read in
//! blocks of rows, converted (cast, `+1`, quantised) on all cores and written in order, one
//! tensor at a time, so a full-size model never sits in memory. The values come from a
//! checkpoint (`lily quantize`) or from the random generator (`lily synth --quant`).

use std::io::Write;
use std::path::Path;

use rayon::prelude::*;
use serde_json::{json, Value};

use super::mlx::{self, Conversion, MatrixFormat, Plan, PlanItem, PlanOptions, TensorInfo};
use super::tensor::{DType, TensorStore};
use super::{safetensors, synth, CheckpointError};
use crate::config::ModelConfig;
use crate::quant::{self, Affine};

/// mlx-lm's largest shard: 5 GiB.
pub const SHARD_BYTES: usize = 5 << 30;

/// The values of the source tensors, by Hugging Face name.
pub trait Values: Sync {
    /// Fills `out` with elements `start .. start + out.len()` (row-major) of tensor `name`.
    fn read(&self, name: &str, start: usize, out: &mut [f32]) -> Result<(), CheckpointError>;
    /// The dtype tensor `name` is stored in (the values read are exact in it).
    fn dtype(&self, name: &str) -> Result<DType, CheckpointError>;
}

/// The tensors of an open checkpoint, decoded from bf16, f16 or f32.
pub struct StoreValues<'a>(pub &'a TensorStore);

impl Values for StoreValues<'_> {
    fn read(&self, name: &str, start: usize, out: &mut [f32]) -> Result<(), CheckpointError> {
        let t = self.0.get(name)?;
        let size = t.dtype.size();
        let bytes = &t.data.as_slice()[start * size..(start + out.len()) * size];
        match t.dtype {
            DType::F32 | DType::BF16 | DType::F16 => {
                for (i, o) in out.iter_mut().enumerate() {
                    *o = quant::read_scalar(bytes, t.dtype, i);
                }
                Ok(())
            }
            other => Err(CheckpointError::DType {
                tensor: name.to_string(),
                file: t.file.display().to_string(),
                expected: "BF16, F16 or F32".into(),
                found: other.safetensors_name().into(),
            }),
        }
    }
    fn dtype(&self, name: &str) -> Result<DType, CheckpointError> {
        Ok(self.0.get(name)?.dtype)
    }
}

/// Quantises the Hugging Face checkpoint in `src` into an MLX checkpoint in `out`, as
/// `mlx_lm.convert -q` does; the other files of `src` (tokenizer, generation config, chat
/// template) are copied. Returns the bytes of tensor data written.
pub fn quantize_dir(src: &Path, out: &Path, q: Affine, progress: bool) -> anyhow::Result<usize> {
    let config = ModelConfig::from_dir(src)?;
    let root: Value = serde_json::from_slice(&std::fs::read(src.join("config.json"))?)?;
    let store = safetensors::open_dir(src)?;
    anyhow::ensure!(
        !mlx::is_mlx_layout(&store),
        "{} already holds an MLX checkpoint",
        src.display()
    );
    let source_prefix = if store.contains("model.language_model.embed_tokens.weight") {
        "model.language_model."
    } else {
        "model."
    };
    // A missing tensor gets a placeholder dtype here and is reported just below.
    let source_dtype = |name: &str| store.tensors.get(name).map_or(DType::BF16, |t| t.dtype);
    let plan = mlx::plan(
        &config,
        &PlanOptions {
            source_prefix,
            quant: q,
            cast_to: mlx::conversion_dtype(&root),
            source_dtype: &source_dtype,
            mtp: config.mtp_num_hidden_layers > 0 && store.contains("mtp.fc.weight"),
        },
    );
    // Check every source tensor before writing anything.
    for item in &plan.items {
        let t = store.get_shaped(&item.source, &item.source_shape)?;
        if !matches!(t.dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(CheckpointError::DType {
                tensor: item.source.clone(),
                file: t.file.display().to_string(),
                expected: "BF16, F16 or F32 (an unquantised checkpoint)".into(),
                found: t.dtype.safetensors_name().into(),
            }
            .into());
        }
    }
    let generation = src.join("generation_config.json");
    let eos = if generation.exists() {
        let g: Value = serde_json::from_slice(&std::fs::read(&generation)?)
            .map_err(|e| anyhow::anyhow!("{} is not valid JSON: {e}", generation.display()))?;
        g.get("eos_token_id").cloned()
    } else {
        None
    };
    let cfg = mlx::converted_config(&root, eos.as_ref(), &plan.quantization);
    let bytes = write(
        &plan,
        &StoreValues(&store),
        &cfg,
        out,
        SHARD_BYTES,
        progress,
    )?;
    for entry in std::fs::read_dir(src)? {
        let path = entry?.path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        let weights_or_config = name.ends_with(".safetensors")
            || name == "model.safetensors.index.json"
            || name == "config.json";
        if path.is_file() && !weights_or_config && !name.starts_with('.') {
            std::fs::copy(&path, out.join(name))?;
        }
    }
    Ok(bytes)
}

/// Writes the checkpoint `plan` describes to `out`: shards of at most `shard_bytes` (a larger
/// tensor gets a shard of its own), `model.safetensors.index.json` and `config` as config.json.
/// Returns the bytes of tensor data written.
pub fn write(
    plan: &Plan,
    values: &dyn Values,
    config: &Value,
    out: &Path,
    shard_bytes: usize,
    progress: bool,
) -> anyhow::Result<usize> {
    std::fs::create_dir_all(out)?;
    let tensors = plan.tensors();
    // Shards as mlx-lm cuts them: in order, a new one when the next tensor would overflow.
    let mut shards: Vec<Vec<TensorInfo>> = Vec::new();
    let mut in_shard = 0;
    for t in tensors {
        if shards.is_empty() || in_shard + t.bytes() > shard_bytes {
            shards.push(Vec::new());
            in_shard = 0;
        }
        in_shard += t.bytes();
        shards.last_mut().expect("a shard was just pushed").push(t);
    }
    let n = shards.len();
    let file_name = |i: usize| {
        if n == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
        }
    };

    let total = plan.total_bytes();
    let bar = if progress {
        indicatif::ProgressBar::new(total as u64)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .expect("static template"),
    );
    let mut files = ShardFiles {
        dir: out,
        shards: &shards,
        file_name: &file_name,
        current: None,
        next: 0,
    };
    for item in &plan.items {
        for (info, bytes) in convert(item, values, &bar)? {
            files.write(&info, &bytes)?;
        }
    }
    files.finish()?;
    bar.finish_and_clear();

    let mut weight_map: Vec<(String, String)> = shards
        .iter()
        .enumerate()
        .flat_map(|(i, s)| s.iter().map(move |t| (t.name.clone(), file_name(i))))
        .collect();
    weight_map.sort();
    let index = json!({
        "metadata": {"total_size": total, "total_parameters": plan.total_parameters()},
        "weight_map": weight_map.into_iter().map(|(k, v)| (k, Value::String(v))).collect::<serde_json::Map<_, _>>(),
    });
    std::fs::write(out.join("model.safetensors.index.json"), to_json(&index)?)?;
    std::fs::write(out.join("config.json"), to_json(config)?)?;
    Ok(total)
}

/// JSON as Python's `json.dump(indent=4)` lays it out (what mlx-lm writes).
fn to_json(v: &Value) -> anyhow::Result<Vec<u8>> {
    let mut buf = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(
        &mut buf,
        serde_json::ser::PrettyFormatter::with_indent(b"    "),
    );
    serde::Serialize::serialize(v, &mut ser)?;
    Ok(buf)
}

/// The shard files, written strictly in plan order: each header is known before its data.
struct ShardFiles<'a> {
    dir: &'a Path,
    shards: &'a [Vec<TensorInfo>],
    file_name: &'a dyn Fn(usize) -> String,
    /// The open shard, and how many of its tensors are written.
    current: Option<(usize, std::io::BufWriter<std::fs::File>, usize)>,
    next: usize,
}

impl ShardFiles<'_> {
    fn write(&mut self, info: &TensorInfo, bytes: &[u8]) -> anyhow::Result<()> {
        if self
            .current
            .as_ref()
            .is_none_or(|(i, _, written)| *written == self.shards[*i].len())
        {
            self.finish()?;
            let i = self.next;
            self.next += 1;
            let mut f = std::io::BufWriter::with_capacity(
                1 << 24,
                std::fs::File::create(self.dir.join((self.file_name)(i)))?,
            );
            f.write_all(&header(&self.shards[i])?)?;
            self.current = Some((i, f, 0));
        }
        let (i, f, written) = self.current.as_mut().expect("a shard is open");
        let want = &self.shards[*i][*written];
        // The plan and the conversion agree by construction; a mismatch is a bug here.
        assert!(
            want == info && bytes.len() == want.bytes(),
            "tensor {} out of plan",
            info.name
        );
        f.write_all(bytes)?;
        *written += 1;
        Ok(())
    }
    fn finish(&mut self) -> anyhow::Result<()> {
        if let Some((_, mut f, _)) = self.current.take() {
            f.flush()?;
        }
        Ok(())
    }
}

/// A safetensors header (length prefix included) for tensors stored back to back, with
/// mlx's `{"format": "mlx"}` metadata.
fn header(tensors: &[TensorInfo]) -> anyhow::Result<Vec<u8>> {
    let mut map = serde_json::Map::new();
    map.insert("__metadata__".into(), json!({"format": "mlx"}));
    let mut offset = 0;
    for t in tensors {
        map.insert(t.name.clone(), json!({"dtype": t.dtype.safetensors_name(), "shape": t.shape, "data_offsets": [offset, offset + t.bytes()]}));
        offset += t.bytes();
    }
    let mut h = serde_json::to_vec(&Value::Object(map))?;
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    Ok(out)
}

/// Converts one source tensor into its MLX tensors (name and bytes, in plan order).
fn convert(
    item: &PlanItem,
    values: &dyn Values,
    bar: &indicatif::ProgressBar,
) -> Result<Vec<(TensorInfo, Vec<u8>)>, CheckpointError> {
    let outputs = item.outputs();
    match &item.conversion {
        Conversion::Plain {
            dtype, plus_one, ..
        } => {
            let mut v = vec![0f32; item.source_shape.iter().product()];
            values.read(&item.source, 0, &mut v)?;
            let source_dtype = values.dtype(&item.source)?;
            let mut bytes = Vec::with_capacity(v.len() * dtype.size());
            for x in v {
                // mlx-lm adds 1 in the source dtype, then casts.
                let x = if *plus_one {
                    quant::round_to(x + 1.0, source_dtype)
                } else {
                    x
                };
                quant::encode_scalar(x, *dtype, &mut bytes);
            }
            bar.inc(bytes.len() as u64);
            Ok(vec![(
                outputs.into_iter().next().expect("one output"),
                bytes,
            )])
        }
        Conversion::Matrix {
            modules,
            format,
            split_gate_up,
        } => {
            let cols = *item.source_shape.last().expect("matrices have columns");
            let rows: usize = item.source_shape[..item.source_shape.len() - 1]
                .iter()
                .product();
            let (dtype, data_row, scale_row) = match *format {
                MatrixFormat::Dense(d) => (d, cols * d.size(), 0),
                MatrixFormat::Quantized { q, dtype } => (
                    dtype,
                    q.words_per_row(cols) * 4,
                    q.groups_per_row(cols) * dtype.size(),
                ),
            };
            // Per output module: data, scales, biases.
            let rows_out = if *split_gate_up { rows / 2 } else { rows };
            let mut bufs: Vec<[Vec<u8>; 3]> = modules
                .iter()
                .map(|_| {
                    [
                        vec![0u8; rows_out * data_row],
                        vec![0u8; rows_out * scale_row],
                        vec![0u8; rows_out * scale_row],
                    ]
                })
                .collect();
            // The gate half of expert e is its first `inter` rows, the up half the next `inter`.
            let inter = item.source_shape[item.source_shape.len() - 2] / 2;
            let route = |r: usize| -> (usize, usize) {
                if !split_gate_up {
                    return (0, r);
                }
                let (e, j) = (r / (2 * inter), r % (2 * inter));
                if j < inter {
                    (0, e * inter + j)
                } else {
                    (1, e * inter + j - inter)
                }
            };
            // Blocks of the generator's chunk size, so synthetic values are drawn once.
            let block_rows = (synth::CHUNK / cols).max(1);
            let blocks = rows.div_ceil(block_rows);
            let window = rayon::current_num_threads() * 2;
            let out_bytes_per_row = (data_row + 2 * scale_row) as u64;
            for w0 in (0..blocks).step_by(window) {
                let encoded: Vec<[Vec<u8>; 3]> = (w0..(w0 + window).min(blocks))
                    .into_par_iter()
                    .map(|b| {
                        let r0 = b * block_rows;
                        let n = block_rows.min(rows - r0);
                        let mut v = vec![0f32; n * cols];
                        values.read(&item.source, r0 * cols, &mut v)?;
                        let mut out = [
                            Vec::with_capacity(n * data_row),
                            Vec::with_capacity(n * scale_row),
                            Vec::with_capacity(n * scale_row),
                        ];
                        for row in v.chunks_exact_mut(cols) {
                            // mlx-lm casts to the conversion dtype before quantising.
                            row.iter_mut().for_each(|x| *x = quant::round_to(*x, dtype));
                            match *format {
                                MatrixFormat::Dense(d) => row
                                    .iter()
                                    .for_each(|&x| quant::encode_scalar(x, d, &mut out[0])),
                                MatrixFormat::Quantized { q, dtype } => {
                                    let [data, scales, biases] = &mut out;
                                    quant::quantize_row(row, q, dtype, data, scales, biases);
                                }
                            }
                        }
                        Ok(out)
                    })
                    .collect::<Result<_, CheckpointError>>()?;
                for (b, block) in (w0..).zip(&encoded) {
                    let n = block[0].len() / data_row;
                    for k in 0..n {
                        let (m, r) = route(b * block_rows + k);
                        let dst = &mut bufs[m];
                        dst[0][r * data_row..(r + 1) * data_row]
                            .copy_from_slice(&block[0][k * data_row..(k + 1) * data_row]);
                        for s in 1..3 {
                            dst[s][r * scale_row..(r + 1) * scale_row]
                                .copy_from_slice(&block[s][k * scale_row..(k + 1) * scale_row]);
                        }
                    }
                    bar.inc(n as u64 * out_bytes_per_row);
                }
            }
            let per_module = if matches!(format, MatrixFormat::Quantized { .. }) {
                3
            } else {
                1
            };
            let mut parts = bufs
                .into_iter()
                .flat_map(|b| b.into_iter().take(per_module));
            Ok(outputs
                .into_iter()
                .map(|info| (info, parts.next().expect("one buffer per output")))
                .collect())
        }
    }
}
