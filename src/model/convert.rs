//! Weights the CUDA kernels cannot read, converted at load into ones they can.
//!
//! The CUDA matmuls dequantise inside the kernel (fused GEMV/GEMM) for two formats only: bf16
//! and MLX affine Q4/Q8 with group 64. Writing fused kernels for every GGUF block format and
//! for FP8 tiles is not worth it for one model, so GGUF K-quants / Q8_0 and FP8 matrices are
//! dequantised row by row and requantised to **affine Q8, group 64** (8.5 bits per weight).
//!
//! Why Q8 even for Q4_K: measured on N(0, 0.02) matrices (`tools/check_gguf.py` encoders,
//! relative RMS error):
//!
//! | source | its own error | → Q4 g64: added / total | → Q8 g64: added / total |
//! |---|---|---|---|
//! | Q4_K | 7.8 % | 8.9 % / 11.9 % | 0.78 % / 7.9 % |
//! | Q5_K | 3.8 % | 9.1 % / 9.9 % | 0.79 % / 3.9 % |
//! | Q6_K | 1.9 % | 9.1 % / 9.3 % | 0.78 % / 2.1 % |
//! | Q8_0 | 0.54 % | 9.1 % / 9.1 % | 0.78 % / 0.95 % |
//!
//! Requantising to Q4 would add as much error as the file's own quantisation (Q4_K's blocks do
//! not fall on a group-64 grid), so Q4 is never chosen: Q8 keeps the file's quality for twice
//! the memory of Q4 (a Q4_K_M Qwen3.6-35B-A3B takes ~37 GB on the GPU; the H200 has 141). For
//! Q4 speed, use an MLX 4-bit checkpoint or `lily quantize`.
//!
//! Matrices the backend concatenates (GDN `qkv‖z‖b‖a`, attention `q‖k‖v`, an expert's
//! `gate‖up`, the experts of a layer, the shared expert's `gate‖up`) must share one format:
//! when one of them is converted, all are (a dense one included). Where the width is not a
//! multiple of 64 they become f32 instead (uploaded as bf16), and so do dense parts of different
//! dtypes. A GGUF `ssm_out` whose value heads are not whole blocks arrives here already dense (the
//! loader dequantised it to reorder its columns) and goes up as bf16.

use std::borrow::Cow;
use std::collections::BTreeMap;

use rayon::prelude::*;

use crate::checkpoint::tensor::{Bytes, DType};
use crate::model::weights::{FeedForward, LayerWeights, Matrix, Mixer, WeightFormat, Weights};
use crate::quant::{self, Affine};

/// What converted matrices become.
pub const TARGET: Affine = Affine {
    bits: 8,
    group_size: 64,
};

/// Whether the CUDA kernels read `m` as it is (dense formats go up as bf16).
pub fn kernel_ready(m: &Matrix) -> bool {
    match m.format {
        WeightFormat::F32 | WeightFormat::F16 | WeightFormat::BF16 => true,
        WeightFormat::Affine { group_size, .. } => group_size == TARGET.group_size,
        WeightFormat::Ggml(_) | WeightFormat::Fp8 { .. } => false,
    }
}

/// How far converted values are from the source values.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ErrorStats {
    pub values: usize,
    sum_sq_err: f64,
    sum_sq: f64,
    pub max_abs_err: f32,
}

impl ErrorStats {
    fn add_row(&mut self, source: &[f32], converted: &[f32]) {
        for (&s, &c) in source.iter().zip(converted) {
            let e = c - s;
            self.sum_sq_err += (e as f64).powi(2);
            self.sum_sq += (s as f64).powi(2);
            self.max_abs_err = self.max_abs_err.max(e.abs());
        }
        self.values += source.len();
    }
    fn merge(&mut self, o: &ErrorStats) {
        self.values += o.values;
        self.sum_sq_err += o.sum_sq_err;
        self.sum_sq += o.sum_sq;
        self.max_abs_err = self.max_abs_err.max(o.max_abs_err);
    }
    /// `‖converted − source‖ / ‖source‖`.
    pub fn relative_rms(&self) -> f64 {
        (self.sum_sq_err / self.sum_sq.max(f64::MIN_POSITIVE)).sqrt()
    }
}

/// Conversion error by conversion ("Q4_K → q8 g64"), for logs and `lily inspect`.
#[derive(Debug, Clone, Default)]
pub struct Report(pub BTreeMap<String, ErrorStats>);

impl Report {
    fn add(&mut self, from: &Matrix, to: &Matrix, stats: ErrorStats) {
        let key = format!("{} → {}", from.format.name(), to.format.name());
        self.0.entry(key).or_default().merge(&stats);
    }
    /// One line per conversion.
    pub fn lines(&self) -> Vec<String> {
        self.0
            .iter()
            .map(|(k, s)| {
                format!(
                    "{k}: {} weights, relative RMS error {:.3} %, max abs error {:.3e}",
                    s.values,
                    100.0 * s.relative_rms(),
                    s.max_abs_err
                )
            })
            .collect()
    }
}

/// `parts`, which the backend stores as one matrix, in formats the kernels read.
pub fn for_kernels<'a>(parts: &[&'a Matrix], report: &mut Report) -> Vec<Cow<'a, Matrix>> {
    let any_converted = parts.iter().any(|m| !kernel_ready(m));
    let same_format = parts.windows(2).all(|p| p[0].format == p[1].format);
    if !any_converted && same_format {
        return parts.iter().map(|m| Cow::Borrowed(*m)).collect();
    }
    // Dense parts in different dtypes need no quantising to share a format; parts of which one
    // is quantised (say Q4 experts beside a Q8 shared expert) meet in Q8.
    let quantizable = parts.iter().all(|m| TARGET.check_cols(m.cols).is_ok());
    let any_affine = parts
        .iter()
        .any(|m| matches!(m.format, WeightFormat::Affine { .. }));
    let target = if (any_converted || any_affine) && quantizable {
        WeightFormat::Affine {
            bits: TARGET.bits,
            group_size: TARGET.group_size,
        }
    } else {
        WeightFormat::F32
    };
    parts
        .iter()
        .map(|m| {
            if m.format == target {
                return Cow::Borrowed(*m);
            }
            let (converted, stats) = convert(m, target);
            report.add(m, &converted, stats);
            Cow::Owned(converted)
        })
        .collect()
}

/// The whole model as the CUDA backend stores it (the same groups as `CudaModel::upload`), so
/// that the CPU backend can run and test exactly what the GPU runs. The MTP head's matrices too
/// (its `fc` alone).
pub fn weights_for_kernels(w: &Weights) -> (Weights, Report) {
    let mut report = Report::default();
    let mut out = w.clone();
    group(vec![&mut out.embed], &mut report);
    group(vec![&mut out.lm_head], &mut report);
    for l in &mut out.layers {
        layer_for_kernels(l, &mut report);
    }
    if let Some(mtp) = &mut out.mtp {
        group(vec![&mut mtp.fc], &mut report);
        layer_for_kernels(&mut mtp.layer, &mut report);
    }
    (out, report)
}

/// Matrices the backend stores together, in one format the kernels read (see [`for_kernels`]).
fn group(ms: Vec<&mut Matrix>, report: &mut Report) {
    let converted: Vec<Matrix> = {
        let parts: Vec<&Matrix> = ms.iter().map(|m| &**m).collect();
        for_kernels(&parts, report)
            .into_iter()
            .map(Cow::into_owned)
            .collect()
    };
    for (m, c) in ms.into_iter().zip(converted) {
        *m = c;
    }
}

/// One layer's matrices, in the groups `CudaModel::upload` stores together.
fn layer_for_kernels(l: &mut LayerWeights, report: &mut Report) {
    match &mut l.mixer {
        Mixer::DeltaNet(d) => {
            group(
                vec![
                    &mut d.in_proj_qkv,
                    &mut d.in_proj_z,
                    &mut d.in_proj_b,
                    &mut d.in_proj_a,
                ],
                report,
            );
            group(vec![&mut d.out_proj], report);
        }
        Mixer::Attention(a) => {
            group(vec![&mut a.q_proj, &mut a.k_proj, &mut a.v_proj], report);
            group(vec![&mut a.o_proj], report);
        }
    }
    // The shared expert joins the routed experts' stacks, its gate the router's rows.
    let m = &mut l.moe;
    group(vec![&mut m.router, &mut m.shared_expert_gate], report);
    group(
        m.experts
            .iter_mut()
            .chain([&mut m.shared_expert])
            .flat_map(|FeedForward { gate, up, .. }| [gate, up])
            .collect(),
        report,
    );
    group(
        m.experts
            .iter_mut()
            .chain([&mut m.shared_expert])
            .map(|e| &mut e.down)
            .collect(),
        report,
    );
}

/// Whether the CUDA backend can take `w` as it is: every matrix in a format the kernels read,
/// and the matrices it stores together (see [`weights_for_kernels`]) in one format. An MLX
/// checkpoint quantised as mlx-lm does it is; GGUF and FP8 files, or mixed recipes, are not.
pub fn ready_for_kernels(w: &Weights) -> bool {
    let same = |ms: &[&Matrix]| ms.windows(2).all(|p| p[0].format == p[1].format);
    let head = w.mtp.iter();
    w.matrices().iter().all(|(_, m)| kernel_ready(m))
        && head
            .clone()
            .all(|h| h.matrices().iter().all(|(_, m)| kernel_ready(m)))
        && w.layers.iter().chain(head.map(|h| &h.layer)).all(|l| {
            let m = &l.moe;
            let e = &m.experts[0];
            let s = &m.shared_expert;
            same(&[&m.router, &m.shared_expert_gate])
                && same(&[&e.gate, &e.up, &s.gate, &s.up])
                && same(&[&e.down, &s.down])
        })
}

/// What converting `w` for the kernels costs, measured on the first `sample_rows` rows of each
/// matrix that needs it (each on its own, without the grouping rule): quick enough for
/// `lily inspect` on the full model.
pub fn measure(w: &Weights, sample_rows: usize) -> Report {
    let mut report = Report::default();
    let target = WeightFormat::Affine {
        bits: TARGET.bits,
        group_size: TARGET.group_size,
    };
    for (_, m) in w.matrices() {
        if kernel_ready(m) || TARGET.check_cols(m.cols).is_err() {
            continue;
        }
        let sample = m.rows_view(0, m.rows.min(sample_rows));
        let (converted, stats) = convert(&sample, target);
        report.add(m, &converted, stats);
    }
    report
}

/// One row in the target format and its error.
#[derive(Default)]
struct Row {
    data: Vec<u8>,
    scales: Vec<u8>,
    biases: Vec<u8>,
    stats: ErrorStats,
}

/// `m` in `target` (affine group 64, or f32), with the error of every value.
fn convert(m: &Matrix, target: WeightFormat) -> (Matrix, ErrorStats) {
    let cols = m.cols;
    let affine = matches!(target, WeightFormat::Affine { .. });
    let rows: Vec<Row> = (0..m.rows)
        .into_par_iter()
        .map(|r| {
            let mut src = vec![0f32; cols];
            m.row_into(r, &mut src);
            let mut row = Row::default();
            if !affine {
                row.data = src.iter().flat_map(|v| v.to_le_bytes()).collect();
                row.stats.add_row(&src, &src);
                return row;
            }
            let (data, scales, biases) = (&mut row.data, &mut row.scales, &mut row.biases);
            quant::quantize_row(&src, TARGET, DType::BF16, data, scales, biases);
            let mut back = vec![0f32; cols];
            quant::dequantize_row(
                data,
                scales,
                biases,
                DType::BF16,
                TARGET.bits,
                TARGET.group_size,
                &mut back,
            );
            row.stats.add_row(&src, &back);
            row
        })
        .collect();
    let mut all = Row::default();
    for row in rows {
        all.data.extend(row.data);
        all.scales.extend(row.scales);
        all.biases.extend(row.biases);
        all.stats.merge(&row.stats);
    }
    let matrix = if affine {
        Matrix {
            rows: m.rows,
            cols,
            format: target,
            data: Bytes::from_vec(all.data),
            scales: Some(Bytes::from_vec(all.scales)),
            biases: Some(Bytes::from_vec(all.biases)),
            scale_dtype: DType::BF16,
        }
    } else {
        Matrix::dense(m.rows, cols, DType::F32, Bytes::from_vec(all.data))
    };
    (matrix, all.stats)
}
