//! Dense projections of prefill chunks and batched passes through cuBLAS: an MLX affine weight matrix is
//! dequantised into a bf16 scratch matrix (dense.cu), then one cuBLAS bf16 GEMM with fp32
//! accumulation computes `y = x · Wᵀ`. For thousands of rows cuBLAS's Hopper kernels (wgmma, TMA)
//! run far above our mma.sync GEMM (gemm_prefill.rs), and writing a layer's 25M dequantised values
//! costs ~15 µs against a GEMM of ~0.3 ms at 4096 tokens. Short chunks keep the fused kernel.
//!
//! The weights the product sees are rounded to bf16 once (the fused kernels apply scale and bias
//! in fp32): ≤ 2⁻⁹ relative per weight, below the bf16 rounding of the output.
//!
//! The dequantised copies of the model's dense matrices (GDN and attention projections, routers:
//! ≈ 2.6 GB at the full shape) are kept from the backend's start ([`DenseGemm::keep`]), so a prefill
//! chunk multiplies without first dequantising ≈ 2.3 ms of weights per 4K chunk (bench/NOTES.md
//! v1.34), and passes of 9+ rows (batched decode steps) use them too (forward/projection.rs):
//! `LILY_DENSE_CACHE=0` (CudaOptions) dequantises per product into one scratch matrix instead, and
//! then only chunks of [`MIN_TOKENS`] rows or more take this path. Products of batched passes are
//! captured in decode graphs, so the handle has a workspace of its own and the padded output
//! (below) is reserved before any capture.
//!
//! cuBLAS runs a slow kernel for a row count that is no multiple of 8 (the router with the shared
//! expert's gate, 257 rows: ≈ 0.10 ms at 4096 tokens against ≈ 0.02 for 256 rows, at either output
//! pitch, NOTES v1.31/v1.34). Such matrices are multiplied with zero rows appended up to the next
//! multiple of 8, into an aligned scratch output whose real rows `dense_unpad` copies into place,
//! or, for a consumer that reads rows at a pitch (the router's top-k), into its own output as it is.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::{sys as blas, CudaBlas};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};
use half::bf16;

use super::gemm::{Matrices, WeightData, GROUP};
use super::{
    as_i32, ensure, launch, Context, CudaDevice, CudaError, CudaFunction, CudaStream, CudaView,
    CudaViewMut, Result,
};

/// Chunks of at least this many tokens take the cuBLAS path whether or not a bf16 copy of the
/// matrix is kept (forward/projection.rs).
pub const MIN_TOKENS: usize = 512;

/// The rows a matrix is multiplied with: its own, zero rows appended to a multiple of 8.
pub fn padded_rows(rows: usize) -> usize {
    rows.next_multiple_of(8)
}

pub struct DenseGemm {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    dequant: CudaFunction,
    unpad: CudaFunction,
    /// Room for the largest dequantised matrix (rows padded) not kept in `kept`.
    scratch: CudaSlice<bf16>,
    /// bf16 copies of matrices, rows padded, by the device address of their weights (see the top).
    kept: HashMap<u64, CudaSlice<bf16>>,
    /// Outputs of padded matrices, grown on demand (never while a graph is captured).
    padded: Option<CudaSlice<bf16>>,
    /// cuBLAS's workspace, set on the handle so that a product captured in a decode graph
    /// allocates nothing.
    _workspace: CudaSlice<u8>,
}

/// Bytes of cuBLAS's workspace (what its Hopper kernels ask for at most, per NVIDIA's docs).
const WORKSPACE_BYTES: usize = 32 << 20;

impl DenseGemm {
    /// `max_values`: the most values (rows × cols) of a matrix this will multiply without a kept
    /// copy.
    pub fn new(dev: &CudaDevice, max_values: usize) -> Result<Self> {
        let stream = dev.stream().clone();
        let blas = CudaBlas::new(stream.clone())
            .map_err(|e| CudaError::Shape(format!("creating a cuBLAS handle: {e}")))?;
        let scratch = stream
            .alloc_zeros::<bf16>(max_values.max(8))
            .during(|| format!("{max_values} values of dequantisation scratch"))?;
        let workspace = stream
            .alloc_zeros::<u8>(WORKSPACE_BYTES)
            .during(|| "cuBLAS's workspace".into())?;
        let ptr = workspace.device_ptr(&stream).0;
        // SAFETY: the handle and the buffer live as long as `Self`, which keeps both.
        let status =
            unsafe { blas::cublasSetWorkspace_v2(*blas.handle(), ptr as *mut _, WORKSPACE_BYTES) };
        ensure!(
            status == blas::cublasStatus_t::CUBLAS_STATUS_SUCCESS,
            "setting cuBLAS's workspace: {status:?}"
        );
        Ok(Self {
            dequant: dev.function("dense", "dequant_affine")?,
            unpad: dev.function("dense", "dense_unpad")?,
            stream,
            blas,
            scratch,
            kept: HashMap::new(),
            padded: None,
            _workspace: workspace,
        })
    }

    /// Keeps a bf16 copy of matrix 0 of `w` (rows padded, see the top) for later products with
    /// these weights; returns its bytes. The weights must outlive this `DenseGemm` unchanged.
    pub fn keep(&mut self, w: &Matrices) -> Result<usize> {
        w.check_lengths("dense keep")?;
        let key = address(w, &self.stream);
        if let Some(kept) = self.kept.get(&key) {
            return Ok(kept.len() * 2);
        }
        let n = padded_rows(w.rows) * w.cols;
        let mut copy = self
            .stream
            .alloc_zeros::<bf16>(n)
            .during(|| format!("a bf16 copy of a {}×{} matrix", w.rows, w.cols))?;
        to_bf16(&self.stream, &self.dequant, w, &mut copy)?;
        self.kept.insert(key, copy);
        Ok(n * 2)
    }

    /// Room for `values` of padded output, allocated now if there is less: a product captured
    /// in a decode graph must find it there (allocating while the stream is captured fails).
    pub fn reserve_padded(&mut self, values: usize) -> Result<()> {
        if self.padded.as_ref().is_some_and(|p| p.len() >= values) {
            return Ok(());
        }
        let capturing = self
            .stream
            .capture_status()
            .map_err(|e| CudaError::Shape(format!("reading the stream's capture status: {e}")))?;
        ensure!(
            capturing == cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE,
            "dense gemm: {values} values of padded output not reserved before a graph capture"
        );
        self.padded = None; // freed before the larger one is allocated
        self.padded = Some(
            self.stream
                .alloc_zeros::<bf16>(values)
                .during(|| format!("{values} values of padded GEMM output"))?,
        );
        Ok(())
    }

    /// Whether a bf16 copy of `w` is kept (products with it need no dequantising).
    pub fn keeps(&self, w: &Matrices) -> bool {
        self.kept.contains_key(&address(w, &self.stream))
    }

    /// Bytes of the kept copies.
    pub fn kept_bytes(&self) -> usize {
        self.kept.values().map(|c| c.len() * 2).sum()
    }

    /// `y = x · Wᵀ` for matrix 0 of `w` (bf16, or 4/8-bit affine): x `[t][cols]`, y `[t][rows]`.
    pub fn gemm(
        &mut self,
        w: &Matrices,
        x: &CudaView<bf16>,
        y: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        self.product(w, x, y, false).map(|_| ())
    }

    /// As [`Self::gemm`], but y's rows are [`padded_rows`]`(w.rows)` values apart (cuBLAS's aligned
    /// output as it is, no copy; the values past `w.rows` in each row are zero): y holds
    /// `t · pitch` values. Returns the pitch. For a consumer that can read rows at a pitch (the
    /// router's top-k).
    pub fn gemm_pitched(
        &mut self,
        w: &Matrices,
        x: &CudaView<bf16>,
        y: &mut CudaViewMut<bf16>,
    ) -> Result<usize> {
        self.product(w, x, y, true)
    }

    /// The product into y, at `rows` or (`pitched`) at the padded pitch; returns y's pitch.
    fn product(
        &mut self,
        w: &Matrices,
        x: &CudaView<bf16>,
        y: &mut CudaViewMut<bf16>,
        pitched: bool,
    ) -> Result<usize> {
        let (rows, cols) = (w.rows, w.cols);
        ensure!(
            cols > 0 && cols % GROUP == 0 && x.len() % cols == 0,
            "dense gemm: x has {} values, not whole rows of {cols} (a multiple of {GROUP})",
            x.len()
        );
        let t = x.len() / cols;
        let pitch = padded_rows(rows);
        let y_pitch = if pitched { pitch } else { rows };
        ensure!(
            y.len() == t * y_pitch,
            "dense gemm: y has {} values, expected {t}×{y_pitch}",
            y.len()
        );
        w.check_lengths("dense gemm")?;
        let stream = self.stream.clone();
        let stream = &*stream;
        let weights = match self.kept.get(&address(w, stream)) {
            Some(kept) if kept.len() == pitch * cols => kept.device_ptr(stream).0,
            _ => match &w.data {
                // bf16 weights of whole 8-row groups are multiplied where they are.
                WeightData::Bf16(v) if pitch == rows => {
                    ensure!(
                        v.len() >= rows * cols,
                        "dense gemm: bf16 weights shorter than {rows}×{cols}"
                    );
                    v.device_ptr(stream).0
                }
                _ => {
                    to_bf16(&self.stream, &self.dequant, w, &mut self.scratch)?;
                    self.scratch.device_ptr(stream).0
                }
            },
        };
        let xp = x.device_ptr(stream).0;
        let yp = if y_pitch == pitch {
            y.device_ptr_mut(stream).0
        } else {
            self.reserve_padded(t * pitch)?;
            let padded = self.padded.as_mut().expect("reserved above");
            padded.device_ptr_mut(stream).0
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (m, nn, k) = (
            as_i32(pitch, "rows")?,
            as_i32(t, "tokens")?,
            as_i32(cols, "cols")?,
        );
        // Column-major view: Y is [pitch × t] (ld pitch) = W [cols × pitch]ᵀ (ld cols) · X [cols × t].
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
                m,
                blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| CudaError::Shape(format!("cuBLAS GEMM [{t}×{cols}]·[{rows}×{cols}]ᵀ: {e}")))?;
        super::profile::after_launch(stream, super::profile::CUBLAS)?;
        if y_pitch != pitch {
            let padded = self.padded.as_ref().expect("allocated above");
            let cfg = LaunchConfig {
                grid_dim: ((t * rows).div_ceil(256).min(132 * 16) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let width = as_i32(rows, "rows")?;
            // SAFETY: `padded` holds t rows at `pitch` ≥ `rows` (allocated above), y t × rows
            // values (checked at the top).
            unsafe { launch!(stream, &self.unpad, cfg, padded, &m, y, &width, &nn) }?;
        }
        Ok(y_pitch)
    }
}

/// The device address of `w`'s weights: the key of its kept copy.
fn address(w: &Matrices, stream: &CudaStream) -> u64 {
    match &w.data {
        WeightData::Bf16(v) => v.device_ptr(stream).0,
        WeightData::Affine { packed, .. } => packed.device_ptr(stream).0,
    }
}

/// Matrix 0 of `w` into `out` as bf16 `[padded rows][cols]`, the appended rows zero.
fn to_bf16(
    stream: &Arc<CudaStream>,
    dequant: &CudaFunction,
    w: &Matrices,
    out: &mut CudaSlice<bf16>,
) -> Result<()> {
    let (rows, cols) = (w.rows, w.cols);
    let (n, n_padded) = (rows * cols, padded_rows(rows) * cols);
    ensure!(
        n_padded <= out.len(),
        "dense gemm: a {rows}×{cols} matrix exceeds the scratch of {} values",
        out.len()
    );
    match &w.data {
        WeightData::Bf16(v) => {
            ensure!(
                v.len() >= n,
                "dense gemm: bf16 weights shorter than {rows}×{cols}"
            );
            stream
                .memcpy_dtod(&v.slice(..n), &mut out.slice_mut(..n))
                .during(|| "copying bf16 weights".into())?;
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
            dequantise(
                stream,
                dequant,
                packed,
                scales,
                biases,
                out,
                n,
                cols,
                *bits as usize,
            )?;
        }
    }
    if n_padded > n {
        stream
            .memset_zeros(&mut out.slice_mut(n..n_padded))
            .during(|| "zeroing padding rows".into())?;
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn dequantise(
    stream: &CudaStream,
    dequant: &CudaFunction,
    packed: &CudaView<u32>,
    scales: &CudaView<bf16>,
    biases: &CudaView<bf16>,
    out: &mut CudaSlice<bf16>,
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
    let mut out = out.slice_mut(..n);
    // SAFETY: the kernel writes vectors·8 = n values of `out` and reads the n values' codes,
    // scales and biases, all checked by the callers.
    unsafe {
        launch!(stream, dequant, cfg, packed, scales, biases, &mut out, &vectors, &cols, &bits)
    }
}
