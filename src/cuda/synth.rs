//! Random weights in device memory (synth.cu), for benchmarks on a full-size model without a
//! checkpoint: `lily bench --synthetic qwen3.6-35b-a3b --quant q4` has its 19 GB of weights in
//! about a second.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, LaunchConfig};
use half::bf16;

use super::weights::{DeviceData, DeviceFp8, DeviceMatrices};
use super::{ensure, launch, Context, CudaDevice, CudaFunction, CudaStream, Result};

/// Standard deviation of the synthetic weights (transformers' initializer_range).
const STD: f32 = 0.02;

pub struct SynthKernels {
    stream: Arc<CudaStream>,
    fill_u32: CudaFunction,
    fill_bf16: CudaFunction,
    fill_groups: CudaFunction,
    fill_e4m3: CudaFunction,
    fill_f32: CudaFunction,
}

fn grid(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u64).div_ceil(256).clamp(1, 132 * 16) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl SynthKernels {
    pub fn load(dev: &CudaDevice) -> Result<Self> {
        Ok(Self {
            stream: dev.stream().clone(),
            fill_u32: dev.function("synth", "fill_u32")?,
            fill_bf16: dev.function("synth", "fill_bf16_uniform")?,
            fill_groups: dev.function("synth", "fill_affine_groups")?,
            fill_e4m3: dev.function("synth", "fill_e4m3")?,
            fill_f32: dev.function("synth", "fill_f32")?,
        })
    }

    /// `count` random `[rows][cols]` matrices, bf16 (`bits` = None) or affine 4/8-bit, group 64.
    pub fn matrices(
        &self,
        bits: Option<u32>,
        count: usize,
        rows: usize,
        cols: usize,
        seed: u64,
    ) -> Result<DeviceMatrices> {
        let n = count * rows * cols;
        let data = match bits {
            None => {
                let mut w = self.alloc::<bf16>(n)?;
                // Uniform with the same standard deviation: a = std·√3.
                let a = STD * 3f32.sqrt();
                let n64 = n as u64;
                unsafe {
                    launch!(
                        self.stream,
                        &self.fill_bf16,
                        grid(n),
                        &mut w,
                        &n64,
                        &seed,
                        &a
                    )?
                };
                DeviceData::Bf16(w)
            }
            Some(bits) => {
                ensure!(
                    (bits == 4 || bits == 8) && cols % 64 == 0,
                    "synthetic {bits}-bit weights need 4 or 8 bits and cols % 64 == 0"
                );
                let words = n * bits as usize / 32;
                let groups = n / 64;
                let mut packed = self.alloc::<u32>(words)?;
                let mut scales = self.alloc::<bf16>(groups)?;
                let mut biases = self.alloc::<bf16>(groups)?;
                let (bits_i, words64, groups64, group_seed) =
                    (bits as i32, words as u64, groups as u64, seed ^ 0x5EED);
                unsafe {
                    launch!(
                        self.stream,
                        &self.fill_u32,
                        grid(words),
                        &mut packed,
                        &words64,
                        &seed
                    )?;
                    launch!(
                        self.stream,
                        &self.fill_groups,
                        grid(groups),
                        &mut scales,
                        &mut biases,
                        &groups64,
                        &group_seed,
                        &STD,
                        &bits_i
                    )?;
                }
                DeviceData::Affine {
                    bits,
                    packed,
                    scales,
                    biases,
                }
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

    /// `count` FP8 matrices of `[rows][cols]` (multiples of 128): random e4m3 codes (fill_e4m3)
    /// and one block multiplier for all, so that the values have a spread near STD's.
    pub fn fp8_matrices(
        &self,
        count: usize,
        rows: usize,
        cols: usize,
        seed: u64,
    ) -> Result<DeviceFp8> {
        ensure!(
            rows % 128 == 0 && cols % 128 == 0,
            "synthetic FP8 weights need rows and cols in whole 128-blocks, not {rows}×{cols}"
        );
        let n = count * rows * cols;
        let blocks = n / (128 * 128);
        // fill_e4m3 writes the bytes four at a time (allocations are 256-byte aligned).
        let mut data = self.alloc::<u8>(n)?;
        let mut scales = self.alloc::<f32>(blocks)?;
        // Random codes of exponents 0..14 have a root mean square near 60.
        let (words64, blocks64, scale) = ((n / 4) as u64, blocks as u64, STD / 60.0);
        unsafe {
            launch!(
                self.stream,
                &self.fill_e4m3,
                grid(n / 4),
                &mut data,
                &words64,
                &seed
            )?;
            launch!(
                self.stream,
                &self.fill_f32,
                grid(blocks),
                &mut scales,
                &blocks64,
                &scale
            )?;
        }
        Ok(DeviceFp8 {
            data,
            scales,
            count,
            rows,
            cols,
        })
    }

    fn alloc<T: cudarc::driver::DeviceRepr>(&self, n: usize) -> Result<CudaSlice<T>> {
        // SAFETY: every element is written by a fill kernel before anything reads it.
        unsafe { self.stream.alloc::<T>(n) }
            .during(|| format!("allocating {n} values of synthetic weights"))
    }
}
