//! Dense projections of long prefill chunks through cuBLAS: an MLX affine weight matrix is
//! dequantised into a bf16 scratch matrix (dense.cu), then one cuBLAS bf16 GEMM with fp32
//! accumulation computes `y = x · Wᵀ`. For thousands of rows cuBLAS's Hopper kernels (wgmma, TMA)
//! run far above our mma.sync GEMM (gemm_prefill.rs), and writing a layer's 25M dequantised values
//! costs ~15 µs against a GEMM of ~0.3 ms at 4096 tokens. Short chunks keep the fused kernel.
//!
//! The weights the product sees are rounded to bf16 once (the fused kernels apply scale and bias
//! in fp32): ≤ 2⁻⁹ relative per weight, below the bf16 rounding of the output.
//!
//! An output row of a matrix whose row count is no multiple of 8 (the router with the shared
//! expert's gate: 257 rows) is not 16-byte aligned, and cuBLAS then takes a slow kernel (≈ 94 µs
//! for the router at 4096 tokens, where 256 rows take ≈ 20: bench/NOTES.md v1.31). With
//! `LILY_DENSE_PAD=1` (under trial) such products are written at a pitch rounded up to 8 into a
//! scratch buffer and copied into place by `dense_unpad`.

use std::sync::Arc;

use cudarc::cublas::{sys as blas, CudaBlas};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};
use half::bf16;

use super::gemm::{Matrices, WeightData, GROUP};
use super::{
    as_i32, ensure, launch, Context, CudaDevice, CudaError, CudaFunction, CudaStream, CudaView,
    CudaViewMut, Result,
};

/// Chunks of at least this many tokens take the cuBLAS path (forward.rs).
pub const MIN_TOKENS: usize = 512;

pub struct DenseGemm {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    dequant: CudaFunction,
    unpad: CudaFunction,
    /// Room for the largest dequantised matrix.
    scratch: CudaSlice<bf16>,
    /// Outputs at an aligned pitch, grown on demand (see the top).
    padded: Option<CudaSlice<bf16>>,
    pad_outputs: bool,
}

impl DenseGemm {
    /// `max_values`: the most values (rows × cols) of a quantised matrix this will multiply.
    pub fn new(dev: &CudaDevice, max_values: usize) -> Result<Self> {
        let stream = dev.stream().clone();
        let blas = CudaBlas::new(stream.clone())
            .map_err(|e| CudaError::Shape(format!("creating a cuBLAS handle: {e}")))?;
        let scratch = stream
            .alloc_zeros::<bf16>(max_values.max(8))
            .during(|| format!("{max_values} values of dequantisation scratch"))?;
        Ok(Self {
            dequant: dev.function("dense", "dequant_affine")?,
            unpad: dev.function("dense", "dense_unpad")?,
            stream,
            blas,
            scratch,
            padded: None,
            pad_outputs: std::env::var("LILY_DENSE_PAD").is_ok_and(|v| v == "1"),
        })
    }

    /// Writes the outputs of matrices whose row count is no multiple of 8 at an aligned pitch
    /// first (see the top); off unless `LILY_DENSE_PAD=1`.
    pub fn set_pad_outputs(&mut self, on: bool) {
        self.pad_outputs = on;
    }

    /// `y = x · Wᵀ` for matrix 0 of `w` (bf16, or 4/8-bit affine): x `[t][cols]`, y `[t][rows]`.
    pub fn gemm(
        &mut self,
        w: &Matrices,
        x: &CudaView<bf16>,
        y: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        let (rows, cols) = (w.rows, w.cols);
        ensure!(
            cols > 0 && cols % GROUP == 0 && x.len() % cols == 0,
            "dense gemm: x has {} values, not whole rows of {cols} (a multiple of {GROUP})",
            x.len()
        );
        let t = x.len() / cols;
        ensure!(
            y.len() == t * rows,
            "dense gemm: y has {} values, expected {t}×{rows}",
            y.len()
        );
        w.check_lengths("dense gemm")?;
        let n = rows * cols;
        let stream = self.stream.clone();
        let stream = &*stream;
        let weights = match &w.data {
            WeightData::Bf16(v) => {
                ensure!(
                    v.len() >= n,
                    "dense gemm: bf16 weights shorter than {rows}×{cols}"
                );
                v.device_ptr(stream).0
            }
            WeightData::Affine {
                bits,
                packed,
                scales,
                biases,
            } => {
                ensure!(
                    matches!(bits, 4 | 8),
                    "dense gemm: {bits}-bit weights (4 or 8 supported)"
                );
                ensure!(
                    n <= self.scratch.len(),
                    "dense gemm: a {rows}×{cols} matrix exceeds the scratch of {} values",
                    self.scratch.len()
                );
                self.dequantise(packed, scales, biases, n, cols, *bits as usize)?;
                self.scratch.device_ptr(stream).0
            }
        };
        let xp = x.device_ptr(stream).0;
        // The output's pitch: the row count, or the next multiple of 8 into `padded`.
        let pitch = if self.pad_outputs && rows % 8 != 0 {
            rows.next_multiple_of(8)
        } else {
            rows
        };
        let yp = if pitch == rows {
            y.device_ptr_mut(stream).0
        } else {
            if self.padded.as_ref().is_none_or(|p| p.len() < t * pitch) {
                self.padded = None; // freed before the larger one is allocated
                self.padded = Some(
                    self.stream
                        .alloc_zeros::<bf16>(t * pitch)
                        .during(|| format!("{t}×{pitch} values of padded GEMM output"))?,
                );
            }
            let padded = self.padded.as_mut().expect("allocated above");
            padded.device_ptr_mut(stream).0
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (m, nn, k, ldc) = (
            as_i32(rows, "rows")?,
            as_i32(t, "tokens")?,
            as_i32(cols, "cols")?,
            as_i32(pitch, "pitch")?,
        );
        // Column-major view: Y is [rows × t] (ld rows) = W [cols × rows]ᵀ (ld cols) · X [cols × t].
        // SAFETY: the pointers are live device buffers of the sizes checked above; cuBLAS runs on
        // lily's stream, ordered with the kernels around it.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                blas::cublasOperation_t::CUBLAS_OP_T,
                blas::cublasOperation_t::CUBLAS_OP_N,
                m,
                nn,
                k,
                (&alpha as *const f32).cast(),
                weights as *const _,
                blas::cudaDataType::CUDA_R_16BF,
                k,
                xp as *const _,
                blas::cudaDataType::CUDA_R_16BF,
                k,
                (&beta as *const f32).cast(),
                yp as *mut _,
                blas::cudaDataType::CUDA_R_16BF,
                ldc,
                blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| CudaError::Shape(format!("cuBLAS GEMM [{t}×{cols}]·[{rows}×{cols}]ᵀ: {e}")))?;
        super::profile::after_launch(stream, "dense cublas")?;
        if pitch != rows {
            let padded = self.padded.as_ref().expect("allocated above");
            let cfg = LaunchConfig {
                grid_dim: ((t * rows).div_ceil(256).min(132 * 16) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: `padded` holds t rows at `pitch` ≥ `rows` (allocated above), y t × rows
            // values (checked at the top).
            unsafe { launch!(stream, &self.unpad, cfg, padded, &ldc, y, &m, &nn) }?;
        }
        Ok(())
    }

    fn dequantise(
        &mut self,
        packed: &CudaView<u32>,
        scales: &CudaView<bf16>,
        biases: &CudaView<bf16>,
        n: usize,
        cols: usize,
        bits: usize,
    ) -> Result<()> {
        let vectors = (n / 8) as u64;
        let cfg = LaunchConfig {
            grid_dim: ((vectors as u32).div_ceil(256).min(132 * 16), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (cols, bits) = (as_i32(cols, "cols")?, bits as i32);
        let mut out = self.scratch.slice_mut(..n);
        // SAFETY: the kernel writes vectors·8 = n scratch values and reads the n values' codes,
        // scales and biases, all checked in `gemm`.
        unsafe {
            launch!(
                self.stream,
                &self.dequant,
                cfg,
                packed,
                scales,
                biases,
                &mut out,
                &vectors,
                &cols,
                &bits
            )
        }
    }
}
