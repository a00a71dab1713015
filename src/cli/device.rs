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

/// A backend for `weights` on `device`, holding sequences of up to `max_context` tokens; on a
/// GPU, `slots` sequences at once (default: the backend's).
pub fn backend(
    device: &str,
    weights: Weights,
    max_context: usize,
    slots: Option<usize>,
) -> anyhow::Result<Box<dyn Backend>> {
    if device == "cpu" {
        return Ok(Box::new(CpuBackend::new(weights)));
    }
    if !device.starts_with("cuda") {
        anyhow::bail!("unknown device `{device}`: use cpu, cuda or cuda:N");
    }
    #[cfg(feature = "cuda")]
    {
        use lily::cuda::{
            forward::CudaBackend, forward::CudaOptions, model::CudaModel, CudaDevice,
        };
        let dev = CudaDevice::open(device)?;
        let model = CudaModel::upload(&dev, &weights)?;
        drop(weights);
        let defaults = CudaOptions::default();
        let options = CudaOptions {
            max_context,
            max_sequences: slots.unwrap_or(defaults.max_sequences),
            ..defaults
        };
        Ok(Box::new(CudaBackend::new(dev, model, options)?))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (max_context, slots);
        anyhow::bail!(
            "this build of lily has no CUDA support: rebuild with `--features cuda` (see README)"
        )
    }
}
