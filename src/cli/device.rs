//! Choosing the backend a command runs on: `--device cpu`, `cuda` or `cuda:N`; without the
//! flag, the GPU when this build has CUDA and one is present, else the CPU.

use lily::model::{Backend, CpuBackend, Weights};

/// The device named by `spec`, or the default.
pub fn resolve(spec: Option<&str>) -> String {
    match spec {
        Some(s) => s.to_string(),
        None if cfg!(feature = "cuda") && gpu_present() => "cuda".into(),
        None => "cpu".into(),
    }
}

fn gpu_present() -> bool {
    #[cfg(feature = "cuda")]
    {
        lily::cuda::CudaDevice::new(0).is_ok()
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

/// How a GPU backend is sized and run (`--max-sequences`, `--batch-steps`); the CPU backend
/// needs neither.
#[derive(Debug, Clone, Copy, Default)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub struct GpuOptions {
    /// Sequences holding state at once (default: the backend's).
    pub slots: Option<usize>,
    /// The steps of several sequences run as shared passes (default: the backend's).
    pub batch_steps: Option<bool>,
    /// Rows one shared pass may hold, at least (default: the backend's, one prefill chunk).
    pub pass_rows: Option<usize>,
    /// The decode kernels built with the timeline's stamps (`lily bench --timeline`).
    pub timeline: bool,
}

#[cfg(feature = "cuda")]
pub fn cuda_options(max_context: usize, gpu: GpuOptions) -> lily::cuda::forward::CudaOptions {
    let defaults = lily::cuda::forward::CudaOptions::default();
    lily::cuda::forward::CudaOptions {
        max_context,
        max_sequences: gpu.slots.unwrap_or(defaults.max_sequences),
        batch_steps: gpu.batch_steps.unwrap_or(defaults.batch_steps),
        prefill_chunk: gpu.pass_rows.map_or(defaults.prefill_chunk, |rows| {
            rows.max(defaults.prefill_chunk)
        }),
        ..defaults
    }
}

/// A backend for `weights` on `device`, holding sequences of up to `max_context` tokens.
pub fn backend(
    device: &str,
    weights: Weights,
    max_context: usize,
    gpu: GpuOptions,
) -> anyhow::Result<Box<dyn Backend>> {
    if device == "cpu" {
        return Ok(Box::new(CpuBackend::new(weights)));
    }
    if !device.starts_with("cuda") {
        anyhow::bail!("unknown device `{device}`: use cpu, cuda or cuda:N");
    }
    #[cfg(feature = "cuda")]
    {
        use lily::cuda::{forward::CudaBackend, model::CudaModel, CudaDevice};
        let dev = CudaDevice::open_with(device, gpu.timeline)?;
        let model = CudaModel::upload(&dev, &weights)?;
        drop(weights);
        Ok(Box::new(CudaBackend::new(
            dev,
            model,
            cuda_options(max_context, gpu),
        )?))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (max_context, gpu);
        anyhow::bail!(
            "this build of lily has no CUDA support: rebuild with `--features cuda` (see README)"
        )
    }
}
