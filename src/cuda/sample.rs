//! Greedy sampling on the device (sample.cu).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, LaunchConfig};
use half::bf16;

use super::{
    as_i32, ensure, launch, Context, CudaDevice, CudaFunction, CudaStream, CudaView, CudaViewMut,
    Result,
};

/// Blocks of the first pass per row (each reduces a slice of the vocabulary).
const PARTS: usize = 64;

pub struct SampleKernels {
    stream: Arc<CudaStream>,
    partial: CudaFunction,
    finish: CudaFunction,
    part_v: CudaSlice<f32>,
    part_i: CudaSlice<i32>,
    max_rows: usize,
}

impl SampleKernels {
    /// Scratch for up to `max_rows` rows is allocated once here, so `argmax` allocates nothing.
    pub fn load(dev: &CudaDevice, max_rows: usize) -> Result<Self> {
        let stream = dev.stream().clone();
        let part_v = stream
            .alloc_zeros::<f32>(max_rows * PARTS)
            .during(|| "argmax scratch".into())?;
        let part_i = stream
            .alloc_zeros::<i32>(max_rows * PARTS)
            .during(|| "argmax scratch".into())?;
        Ok(Self {
            partial: dev.function("sample", "argmax_partial")?,
            finish: dev.function("sample", "argmax_final")?,
            stream,
            part_v,
            part_i,
            max_rows,
        })
    }

    /// `out[r]` = index of the largest of `logits[r]` (`[rows][n]`), lowest index on ties.
    pub fn argmax(
        &mut self,
        logits: &CudaView<bf16>,
        n: usize,
        out: &mut CudaViewMut<i32>,
    ) -> Result<()> {
        ensure!(
            n > 0 && logits.len() % n == 0,
            "argmax: logits are not whole rows of {n}"
        );
        let rows = logits.len() / n;
        ensure!(
            rows <= self.max_rows && out.len() == rows,
            "argmax: {rows} rows (scratch for {}), out {}",
            self.max_rows,
            out.len()
        );
        if rows == 0 {
            return Ok(());
        }
        let chunk = n.div_ceil(PARTS);
        let (ni, ci, parts) = (as_i32(n, "n")?, as_i32(chunk, "chunk")?, PARTS as i32);
        let cfg = LaunchConfig {
            grid_dim: (PARTS as u32, rows as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        unsafe {
            launch!(
                self.stream,
                &self.partial,
                cfg,
                logits,
                &ni,
                &ci,
                &mut self.part_v,
                &mut self.part_i
            )?
        };
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (64, 1, 1),
            shared_mem_bytes: 0,
        };
        unsafe {
            launch!(
                self.stream,
                &self.finish,
                cfg,
                &self.part_v,
                &self.part_i,
                &parts,
                out
            )
        }
    }
}
