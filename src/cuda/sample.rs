//! Sampling on the device (sample.cu): greedy argmax over rows of logits, and the full sampler
//! (penalties, temperature, min-p, top-k, top-p, a draw) for one row, matching src/sampling/.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig};
use half::bf16;

use crate::sampling::DeviceSampling;

use super::{
    as_i32, ensure, launch, Context, CudaDevice, CudaFunction, CudaStream, CudaView, CudaViewMut,
    Result,
};

/// Blocks of the first pass per row (each reduces a slice of the vocabulary).
const PARTS: usize = 64;

/// Blocks of the sampler's grid launches (`SAMPLE_BLOCKS` in sample.cu).
const SAMPLE_BLOCKS: usize = 128;
/// Threads per block of the grid launches.
const GRID_THREADS: u32 = 512;
/// Threads of the final walk through one slice (`WALK_THREADS` in sample.cu).
const WALK_THREADS: u32 = 1024;
/// Bins of one radix-select round (`RADIX_BINS` in sample.cu).
const RADIX_BINS: usize = 2048;
/// Bytes reserved for sample.cu's `SampleState` (it needs under 100).
const STATE_BYTES: usize = 256;

/// sample.cu's `SampleParams`, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct Params {
    temperature: f32,
    top_p: f32,
    log_min_p: f32,
    repetition: f32,
    frequency: f32,
    presence: f32,
    top_k: i32,
    min_p_on: i32,
    greedy: i32,
    vocab_limit: i32,
    history_len: i32,
    row: i32,
    history_at: i32,
    pad: i32,
    u: f64,
}

// sample.cu asserts the same size.
const _: () = assert!(std::mem::size_of::<Params>() == 64);

// SAFETY: plain old data with the C layout sample.cu declares.
unsafe impl DeviceRepr for Params {}

impl Params {
    fn new(s: &DeviceSampling, u: f64, n: usize) -> Result<Self> {
        ensure!(
            (0.0..1.0).contains(&u),
            "sampling: the draw {u} is not in [0, 1)"
        );
        // top-k at or past the vocabulary keeps everything: off, as the CPU sampler has it.
        let top_k = match s.top_k {
            Some(k) if k < n => as_i32(k, "top_k")?,
            _ => 0,
        };
        Ok(Self {
            temperature: s.temperature,
            top_p: s.top_p,
            // The same f32 ln as the CPU's min-p threshold.
            log_min_p: if s.min_p > 0.0 { s.min_p.ln() } else { 0.0 },
            repetition: s.repetition_penalty,
            frequency: s.frequency_penalty,
            presence: s.presence_penalty,
            top_k,
            min_p_on: (s.min_p > 0.0) as i32,
            greedy: s.is_greedy() as i32,
            vocab_limit: as_i32(s.vocab_limit.min(n), "vocab_limit")?,
            history_len: as_i32(s.history.len(), "penalty history")?,
            row: 0,
            history_at: 0,
            pad: 0,
            u,
        })
    }
}

/// One row's draw of a batched [`SampleKernels::sample_rows`].
pub struct RowDraw<'a> {
    /// The row of the logits, and the entry of `out`.
    pub row: usize,
    pub sampling: &'a DeviceSampling,
    /// The draw, uniform in [0, 1).
    pub u: f64,
}

/// The sampler's device memory for one vocabulary size and up to `rows` rows a launch
/// ([`SampleKernels::reserve`]; again on use for other sizes).
struct SamplerBuffers {
    n: usize,
    rows: usize,
    params: CudaSlice<Params>,
    /// (token, output count) pairs; grows with the longest history seen.
    history: CudaSlice<u32>,
    work: CudaSlice<f32>,
    /// `SampleState`; zero at allocation, and every launch leaves its counter at zero.
    state: CudaSlice<u8>,
    hist_count: CudaSlice<u32>,
    hist_mass: CudaSlice<f64>,
    block_v: CudaSlice<f32>,
    block_i: CudaSlice<i32>,
    block_mass: CudaSlice<f64>,
    block_ties: CudaSlice<u32>,
}

impl SamplerBuffers {
    fn new(stream: &Arc<CudaStream>, n: usize, rows: usize) -> Result<Self> {
        let during = || "sampler buffers".to_string();
        Ok(Self {
            n,
            rows,
            params: stream
                .clone_htod(&vec![Params::default(); rows])
                .during(during)?,
            history: stream.alloc_zeros(2).during(during)?,
            work: stream.alloc_zeros(rows * n).during(during)?,
            state: stream.alloc_zeros(rows * STATE_BYTES).during(during)?,
            hist_count: stream.alloc_zeros(rows * RADIX_BINS).during(during)?,
            hist_mass: stream.alloc_zeros(rows * RADIX_BINS).during(during)?,
            block_v: stream.alloc_zeros(rows * SAMPLE_BLOCKS).during(during)?,
            block_i: stream.alloc_zeros(rows * SAMPLE_BLOCKS).during(during)?,
            block_mass: stream.alloc_zeros(rows * SAMPLE_BLOCKS).during(during)?,
            block_ties: stream.alloc_zeros(rows * SAMPLE_BLOCKS).during(during)?,
        })
    }
}

pub struct SampleKernels {
    stream: Arc<CudaStream>,
    partial: CudaFunction,
    finish: CudaFunction,
    part_v: CudaSlice<f32>,
    part_i: CudaSlice<i32>,
    max_rows: usize,
    load: CudaFunction,
    max: CudaFunction,
    select: CudaFunction,
    draw_mass: CudaFunction,
    draw: CudaFunction,
    sampler: Option<SamplerBuffers>,
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
            load: dev.function("sample", "sample_load")?,
            max: dev.function("sample", "sample_max")?,
            select: dev.function("sample", "sample_select")?,
            draw_mass: dev.function("sample", "sample_draw_mass")?,
            draw: dev.function("sample", "sample_draw")?,
            sampler: None,
        })
    }

    /// Allocates the full sampler's scratch for up to `rows` rows of `n` logits now (≈ 1 MB a
    /// row at the model's vocabulary), so that draws of that size allocate nothing while
    /// serving, when the memory may be the prefix cache's. Other sizes still allocate on use.
    pub fn reserve(&mut self, n: usize, rows: usize) -> Result<()> {
        if self
            .sampler
            .as_ref()
            .is_none_or(|b| b.n != n || b.rows < rows)
        {
            self.sampler = None; // the old buffers go first
            self.sampler = Some(SamplerBuffers::new(&self.stream, n, rows.max(1))?);
        }
        Ok(())
    }

    /// Whether [`sample`](Self::sample) takes these parameters for a row of `n` logits.
    pub fn accepts(sampling: &DeviceSampling, u: f64, n: usize) -> bool {
        Params::new(sampling, u, n).is_ok()
    }

    /// `out[0]` = the token `sampling` picks from one row of `logits` with the draw at `u`, as
    /// [`DeviceSampling::sample`] picks it on the host; -1 when no logit is finite. Only the
    /// parameters and the penalty history are copied up; nothing waits for the device.
    pub fn sample(
        &mut self,
        logits: &CudaView<bf16>,
        sampling: &DeviceSampling,
        u: f64,
        out: &mut CudaViewMut<i32>,
    ) -> Result<()> {
        let n = logits.len();
        self.sample_rows(
            logits,
            n,
            &[RowDraw {
                row: 0,
                sampling,
                u,
            }],
            out,
        )
    }

    /// For each of `draws`, `out[row]` = the token its sampling picks from row `row` of
    /// `logits` (`[rows][n]`) with its draw, as [`sample`](Self::sample) picks it; rows not
    /// drawn are left as they are. One set of launches for all the draws (row blockIdx.y of
    /// each grid is draw y), and one copy each of their parameters and penalty histories.
    pub fn sample_rows(
        &mut self,
        logits: &CudaView<bf16>,
        n: usize,
        draws: &[RowDraw],
        out: &mut CudaViewMut<i32>,
    ) -> Result<()> {
        ensure!(
            n > 0 && logits.len() % n == 0 && out.len() == logits.len() / n,
            "sample: {} logits in rows of {n}, out {}",
            logits.len(),
            out.len()
        );
        let rows = out.len();
        if draws.is_empty() {
            return Ok(());
        }
        let mut seen = vec![false; rows];
        let mut params = Vec::with_capacity(draws.len());
        let mut history: Vec<u32> = Vec::new();
        for d in draws {
            ensure!(
                d.row < rows && !seen[d.row],
                "sample: row {} of {rows} drawn twice or out of range",
                d.row
            );
            seen[d.row] = true;
            let mut p = Params::new(d.sampling, d.u, n)?;
            p.row = as_i32(d.row, "sampled row")?;
            p.history_at = as_i32(history.len() / 2, "penalty history")?;
            history.extend(d.sampling.history.iter().flat_map(|&(t, c)| [t, c]));
            params.push(p);
        }
        self.reserve(n, draws.len())?;
        let stream = self.stream.clone();
        let b = self.sampler.as_mut().expect("allocated above");
        if history.len() > b.history.len() {
            b.history = stream
                .alloc_zeros(history.len().next_power_of_two())
                .during(|| "penalty history".into())?;
        }
        if !history.is_empty() {
            stream
                .memcpy_htod(&history, &mut b.history)
                .during(|| "copying the penalty history".into())?;
        }
        stream
            .memcpy_htod(&params, &mut b.params)
            .during(|| "copying the sampling parameters".into())?;

        let ni = as_i32(n, "vocabulary")?;
        let y = draws.len() as u32;
        let grid = LaunchConfig {
            grid_dim: (SAMPLE_BLOCKS as u32, y, 1),
            block_dim: (GRID_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        unsafe {
            launch!(
                stream,
                &self.load,
                grid,
                logits,
                &ni,
                &b.params,
                &b.history,
                &mut b.work,
                &mut b.state
            )?;
            launch!(
                stream,
                &self.max,
                grid,
                &b.work,
                &ni,
                &b.params,
                &mut b.state,
                &mut b.block_v,
                &mut b.block_i,
                &mut *out
            )?;
            // Greedy draws (with penalties) are done after sample_max, and a select round whose
            // parameter is off returns at once: what no row needs is not launched (4 of 10
            // launches for temperature-only draws, 7 with top-p alone, 2 for greedy ones).
            if params.iter().all(|p| p.greedy != 0) {
                return Ok(());
            }
            // top-k (mode 0), then top-p (mode 1), three rounds each: the kernel's `off`.
            let top_p_on = |p: &Params| {
                let off = p.top_p >= 1.0; // NaN: on, as in the kernel
                !off
            };
            let on = [
                params.iter().any(|p| p.greedy == 0 && p.top_k > 0),
                params.iter().any(|p| p.greedy == 0 && top_p_on(p)),
            ];
            for mode in (0i32..2).filter(|&m| on[m as usize]) {
                for round in 0i32..3 {
                    launch!(
                        stream,
                        &self.select,
                        grid,
                        &b.work,
                        &ni,
                        &b.params,
                        &mut b.state,
                        &mut b.hist_count,
                        &mut b.hist_mass,
                        &mode,
                        &round
                    )?;
                }
            }
            launch!(
                stream,
                &self.draw_mass,
                grid,
                &b.work,
                &ni,
                &b.params,
                &mut b.state,
                &mut b.block_mass,
                &mut b.block_ties
            )?;
            let walk = LaunchConfig {
                grid_dim: (1, y, 1),
                block_dim: (WALK_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            launch!(stream, &self.draw, walk, &b.work, &ni, &b.params, &b.state, out)
        }
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
