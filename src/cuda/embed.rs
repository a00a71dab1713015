//! Embedding gather (embed.cu): token ids on the device → bf16 rows.

use std::sync::Arc;

use cudarc::driver::LaunchConfig;
use half::bf16;

use super::gemm::{Matrices, WeightData};
use super::{
    as_i32, ensure, ensure_aligned, launch, CudaDevice, CudaFunction, CudaStream, CudaView,
    CudaViewMut, Result,
};

pub struct EmbedKernels {
    stream: Arc<CudaStream>,
    bf16: CudaFunction,
    affine: CudaFunction,
}

impl EmbedKernels {
    pub fn load(dev: &CudaDevice) -> Result<Self> {
        Ok(Self {
            stream: dev.stream().clone(),
            bf16: dev.function("embed", "embed_bf16")?,
            affine: dev.function("embed", "embed_affine")?,
        })
    }

    /// `out[t] = table[ids[t]]` for `ids.len()` tokens; `out` is `[tokens][cols]`. Ids are
    /// validated by the caller (the kernel clamps rather than read out of bounds).
    pub fn gather(
        &self,
        table: &Matrices,
        ids: &CudaView<i32>,
        out: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        let tokens = ids.len();
        ensure!(table.count == 1, "embed: one table expected");
        ensure!(
            table.cols % 64 == 0,
            "embed: {} columns, a multiple of 64 needed",
            table.cols
        );
        ensure!(
            out.len() == tokens * table.cols,
            "embed: out has {} values, expected {tokens}×{}",
            out.len(),
            table.cols
        );
        ensure_aligned(out, &self.stream, "embed out")?;
        if tokens == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (tokens as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let (rows, cols) = (as_i32(table.rows, "rows")?, as_i32(table.cols, "cols")?);
        match &table.data {
            WeightData::Bf16(t) => {
                ensure!(t.len() == table.rows * table.cols, "embed: table size");
                ensure_aligned(t, &self.stream, "embed table")?;
                unsafe { launch!(self.stream, &self.bf16, cfg, t, ids, out, &rows, &cols) }
            }
            WeightData::Affine {
                bits,
                packed,
                scales,
                biases,
            } => {
                ensure!(
                    *bits == 4 || *bits == 8,
                    "embed: {bits}-bit tables are not supported"
                );
                ensure!(
                    packed.len() == table.rows * table.cols * *bits as usize / 32,
                    "embed: packed table size"
                );
                ensure!(
                    scales.len() == table.rows * table.cols / 64 && biases.len() == scales.len(),
                    "embed: scales/biases size"
                );
                let bits = *bits as i32;
                unsafe {
                    launch!(
                        self.stream,
                        &self.affine,
                        cfg,
                        packed,
                        scales,
                        biases,
                        ids,
                        out,
                        &rows,
                        &cols,
                        &bits
                    )
                }
            }
        }
    }
}
