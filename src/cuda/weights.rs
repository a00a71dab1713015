//! Model weights in device memory, in the formats the kernels read: bf16, or MLX affine 4/8-bit
//! with bf16 scales and biases. f32/f16 checkpoint matrices are converted to bf16 on upload;
//! quantised ones are copied as they are (never dequantised). An FP8 checkpoint's matrices are
//! also kept as they ship ([`DeviceFp8`]) for the FP8 prefill products.

use std::sync::Arc;

use cudarc::driver::CudaSlice;
use half::bf16;

use super::gemm::{Matrices, WeightData};
use super::gemm_fp8::{Fp8Matrices, BLOCK as FP8_BLOCK};
use super::{ensure, Context, CudaError, CudaStream, Result};
use crate::checkpoint::tensor::DType;
use crate::model::weights::{Matrix, WeightFormat};
use crate::quant::read_scalar;

pub enum DeviceData {
    Bf16(CudaSlice<bf16>),
    Affine {
        bits: u32,
        packed: CudaSlice<u32>,
        scales: CudaSlice<bf16>,
        biases: CudaSlice<bf16>,
    },
}

/// `count` matrices of `[rows][cols]`, one after the other in device memory.
pub struct DeviceMatrices {
    pub data: DeviceData,
    pub count: usize,
    pub rows: usize,
    pub cols: usize,
    /// The same matrices as an FP8 checkpoint ships them, when it does (`data` then holds their
    /// affine Q8 conversion, for decode): long prefill passes run them on the FP8 products.
    pub fp8: Option<DeviceFp8>,
}

/// Whether FP8 matrices keep their FP8 form for prefill: unless `LILY_FP8_PREFILL=0`.
pub fn fp8_prefill() -> bool {
    !std::env::var("LILY_FP8_PREFILL").is_ok_and(|v| v == "0")
}

impl DeviceMatrices {
    /// The kernels' view of these weights.
    pub fn view(&self) -> Matrices<'_> {
        let data = match &self.data {
            DeviceData::Bf16(w) => WeightData::Bf16(w.as_view()),
            DeviceData::Affine {
                bits,
                packed,
                scales,
                biases,
            } => WeightData::Affine {
                bits: *bits,
                packed: packed.as_view(),
                scales: scales.as_view(),
                biases: biases.as_view(),
            },
        };
        Matrices {
            data,
            count: self.count,
            rows: self.rows,
            cols: self.cols,
        }
    }

    /// Bytes of device memory these weights take (their FP8 form too).
    pub fn bytes(&self) -> usize {
        let fp8 = self.fp8.as_ref().map_or(0, DeviceFp8::bytes);
        fp8 + match &self.data {
            DeviceData::Bf16(w) => w.len() * 2,
            DeviceData::Affine {
                packed,
                scales,
                biases,
                ..
            } => packed.len() * 4 + (scales.len() + biases.len()) * 2,
        }
    }

    /// Keeps `groups` (the checkpoint's matrices these were made of, grouped as for
    /// [`Self::stack_of_concats`]) in FP8 too, if they are FP8 in whole 128 × 128 blocks; unless
    /// `LILY_FP8_PREFILL=0` (no second copy).
    pub fn with_fp8(mut self, stream: &Arc<CudaStream>, groups: &[Vec<&Matrix>]) -> Result<Self> {
        if fp8_prefill() {
            self.fp8 = DeviceFp8::stack_of_concats(stream, groups)?;
        }
        Ok(self)
    }

    /// One matrix made of `parts` stacked along their rows (e.g. q‖k‖v projections that read the
    /// same input: one launch instead of three). All parts need the same format and width.
    pub fn concat(stream: &Arc<CudaStream>, parts: &[&Matrix]) -> Result<Self> {
        Self::stack_of_concats(stream, &[parts.to_vec()])
    }

    /// A stack of matrices addressed by index (the experts of a layer), each made of its group of
    /// parts stacked along the rows (an expert's gate‖up). Every group must have the same height.
    pub fn stack_of_concats(stream: &Arc<CudaStream>, groups: &[Vec<&Matrix>]) -> Result<Self> {
        let heights: Vec<usize> = groups
            .iter()
            .map(|g| g.iter().map(|m| m.rows).sum())
            .collect();
        ensure!(
            !heights.is_empty() && heights.iter().all(|&h| h == heights[0]),
            "weight stack: matrices of different heights"
        );
        let parts: Vec<&Matrix> = groups.iter().flatten().copied().collect();
        Self::upload(stream, &parts, groups.len(), heights[0])
    }

    fn upload(
        stream: &Arc<CudaStream>,
        parts: &[&Matrix],
        count: usize,
        rows: usize,
    ) -> Result<Self> {
        ensure!(!parts.is_empty(), "weights: nothing to upload");
        let cols = parts[0].cols;
        let format = parts[0].format;
        ensure!(
            parts.iter().all(|m| m.cols == cols && m.format == format),
            "weights: parts differ in width or format"
        );
        let data = match format {
            WeightFormat::Affine { bits, group_size } => {
                ensure!(
                    group_size == 64,
                    "weights: group size {group_size}; the kernels take 64"
                );
                let mut packed = Vec::new();
                let mut scales = Vec::new();
                let mut biases = Vec::new();
                for m in parts {
                    packed.extend(
                        m.data
                            .as_slice()
                            .chunks_exact(4)
                            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                    );
                    let (s, b) = (m.scales.as_ref(), m.biases.as_ref());
                    let (s, b) = s.zip(b).ok_or_else(|| {
                        CudaError::Shape("affine matrix without scales or biases".into())
                    })?;
                    let n = m.rows * m.groups_per_row();
                    scales.extend(
                        (0..n).map(|i| bf16::from_f32(read_scalar(s.as_slice(), m.scale_dtype, i))),
                    );
                    biases.extend(
                        (0..n).map(|i| bf16::from_f32(read_scalar(b.as_slice(), m.scale_dtype, i))),
                    );
                }
                DeviceData::Affine {
                    bits,
                    packed: htod(stream, &packed)?,
                    scales: htod(stream, &scales)?,
                    biases: htod(stream, &biases)?,
                }
            }
            WeightFormat::Ggml(_) | WeightFormat::Fp8 { .. } => {
                return Err(CudaError::Shape(format!(
                    "weights in {} reach the upload unconverted (CudaModel::upload converts them)",
                    format.name()
                )))
            }
            WeightFormat::F32 | WeightFormat::F16 | WeightFormat::BF16 => {
                let mut values: Vec<bf16> =
                    Vec::with_capacity(parts.iter().map(|m| m.rows * m.cols).sum());
                for m in parts {
                    values.extend(dense_as_bf16(m));
                }
                DeviceData::Bf16(htod(stream, &values)?)
            }
        };
        Ok(DeviceMatrices {
            data,
            count,
            rows,
            cols,
            fp8: None,
        })
    }
}

/// A dense matrix's values as bf16 (bf16 bytes are taken as they are).
fn dense_as_bf16(m: &Matrix) -> Vec<bf16> {
    let b = m.data.as_slice();
    match m.format {
        WeightFormat::BF16 => b
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]))
            .collect(),
        WeightFormat::F32 => (0..m.rows * m.cols)
            .map(|i| bf16::from_f32(read_scalar(b, DType::F32, i)))
            .collect(),
        WeightFormat::F16 => (0..m.rows * m.cols)
            .map(|i| bf16::from_f32(read_scalar(b, DType::F16, i)))
            .collect(),
        WeightFormat::Affine { .. } | WeightFormat::Ggml(_) | WeightFormat::Fp8 { .. } => {
            unreachable!("dense_as_bf16 of a quantised matrix")
        }
    }
}

pub(crate) fn htod<T: cudarc::driver::DeviceRepr>(
    stream: &Arc<CudaStream>,
    values: &[T],
) -> Result<CudaSlice<T>> {
    stream.clone_htod(values).during(|| {
        format!(
            "copying {} bytes of weights to the GPU",
            std::mem::size_of_val(values)
        )
    })
}

/// FP8 matrices as the official checkpoint ships them, for the FP8 prefill products
/// (gemm_fp8.rs): `count` matrices of `[rows][cols]` e4m3 one after the other, and
/// `[count][rows/128][cols/128]` fp32 block multipliers.
pub struct DeviceFp8 {
    pub data: CudaSlice<u8>,
    pub scales: CudaSlice<f32>,
    pub count: usize,
    pub rows: usize,
    pub cols: usize,
}

impl DeviceFp8 {
    pub fn view(&self) -> Fp8Matrices<'_> {
        Fp8Matrices {
            data: self.data.as_view(),
            scales: self.scales.as_view(),
            count: self.count,
            rows: self.rows,
            cols: self.cols,
        }
    }

    pub fn bytes(&self) -> usize {
        self.data.len() + self.scales.len() * 4
    }

    /// As [`DeviceMatrices::stack_of_concats`], for matrices that are all FP8 in 128 × 128 blocks
    /// with whole blocks (so that stacking rows keeps every block whole); `None` when they are not.
    pub fn stack_of_concats(
        stream: &Arc<CudaStream>,
        groups: &[Vec<&Matrix>],
    ) -> Result<Option<Self>> {
        let parts = || groups.iter().flatten();
        let whole = |m: &Matrix| {
            m.format == WeightFormat::Fp8 { block: FP8_BLOCK }
                && m.rows % FP8_BLOCK == 0
                && m.cols % FP8_BLOCK == 0
                && m.scales.is_some()
        };
        let Some(first) = groups.first().and_then(|g| g.first()) else {
            return Ok(None);
        };
        let cols = first.cols;
        let rows: usize = groups[0].iter().map(|m| m.rows).sum();
        let same_shape = groups
            .iter()
            .all(|g| g.iter().map(|m| m.rows).sum::<usize>() == rows);
        if !parts().all(|m| whole(m) && m.cols == cols) || !same_shape {
            return Ok(None);
        }
        let mut data = Vec::with_capacity(groups.len() * rows * cols);
        let mut scales = Vec::with_capacity(groups.len() * rows * cols / FP8_BLOCK / FP8_BLOCK);
        for m in parts() {
            data.extend_from_slice(m.data.as_slice());
            let s = m.scales.as_ref().expect("checked above");
            let n = (m.rows / FP8_BLOCK) * (m.cols / FP8_BLOCK);
            scales.extend((0..n).map(|i| read_scalar(s.as_slice(), m.scale_dtype, i)));
        }
        Ok(Some(DeviceFp8 {
            data: htod(stream, &data)?,
            scales: htod(stream, &scales)?,
            count: groups.len(),
            rows,
            cols,
        }))
    }
}
