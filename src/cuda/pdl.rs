//! Kernel launches, all with programmatic dependent launch (PDL).
//!
//! A decode step is ~400 small dependent kernels, and between two of them the GPU would
//! otherwise drain: the next kernel's blocks are only scheduled once the previous grid has
//! finished and its writes are flushed, a few µs each time. With PDL (Hopper), a kernel may start
//! while its predecessor is still running: every lily kernel first does what depends on no earlier
//! kernel (a GEMV streams its first weight tiles into shared memory), then waits at
//! `pdl_wait()` (griddepcontrol.wait, common.cuh) until the predecessor has completed and its
//! memory is visible. Every kernel calls `pdl_launch_dependents()` early, so that its successor
//! can be scheduled; hence when a kernel starts, its predecessors have only *started*, and before
//! its `pdl_wait()` it may read only what no kernel writes once the model is loaded: the weights
//! (CudaModel waits for them). Everything else (activations, caches, recurrent state, which
//! prefill kernels write too) comes after the wait. Launched without the
//! attribute (`LILY_PDL=0`, for A/B measurements), `pdl_wait()` returns at once and the stream
//! serialises kernels as usual. The dependency edges survive CUDA-graph capture.

use std::ffi::c_void;
use std::sync::OnceLock;

use cudarc::driver::{sys, CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DriverError};

use super::{CudaFunction, CudaStream};
pub use cudarc::driver::LaunchConfig;

/// Whether launches carry the PDL attribute: on unless `LILY_PDL=0`.
pub fn pdl_enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var("LILY_PDL").map_or(true, |v| v != "0"))
}

/// Values a kernel takes by value: plain integers and floats, and `#[repr(C)]` argument structs
/// made of them.
///
/// # Safety
/// The type must have the size, alignment (≤ 8) and layout of the kernel's C parameter.
pub unsafe trait KernelValue: Copy {}

unsafe impl KernelValue for i32 {}
unsafe impl KernelValue for u32 {}
unsafe impl KernelValue for f32 {}
unsafe impl KernelValue for i64 {}
unsafe impl KernelValue for u64 {}

const MAX_PARAMS: usize = 24;
const STORAGE_WORDS: usize = 64;

/// A kernel's parameters: each one's bytes copied into aligned storage, plus the array of
/// pointers to them that cuLaunchKernelEx takes. Must not move once pointers are taken (it lives
/// in one `launch!` block).
pub struct Params {
    storage: [u64; STORAGE_WORDS],
    used: usize,
    ptrs: [*mut c_void; MAX_PARAMS],
    count: usize,
}

impl Params {
    pub fn new() -> Params {
        Params {
            storage: [0; STORAGE_WORDS],
            used: 0,
            ptrs: [std::ptr::null_mut(); MAX_PARAMS],
            count: 0,
        }
    }

    fn push<T: KernelValue>(&mut self, value: T) {
        let words = std::mem::size_of::<T>().div_ceil(8);
        assert!(
            std::mem::align_of::<T>() <= 8,
            "kernel parameter over-aligned"
        );
        assert!(
            self.count < MAX_PARAMS && self.used + words <= STORAGE_WORDS,
            "too many kernel parameters"
        );
        let dst = self.storage[self.used..].as_mut_ptr();
        // SAFETY: `words` u64 words hold size_of::<T>() bytes; u64 storage is 8-aligned.
        unsafe { std::ptr::write_unaligned(dst.cast::<T>(), value) };
        self.ptrs[self.count] = dst.cast();
        self.used += words;
        self.count += 1;
    }
}

impl Default for Params {
    fn default() -> Self {
        Params::new()
    }
}

/// Something that can be a kernel parameter: a device buffer (passed as its address) or a value.
pub trait KernelArg {
    fn push_to(self, params: &mut Params, stream: &CudaStream);
}

impl<T: KernelValue> KernelArg for &T {
    fn push_to(self, params: &mut Params, _: &CudaStream) {
        params.push(*self);
    }
}

// The guards device_ptr() returns are cudarc's event-tracking hooks; lily turns event tracking
// off (CudaDevice::new), so dropping them at once is a no-op.
impl<T> KernelArg for &CudaView<'_, T> {
    fn push_to(self, params: &mut Params, stream: &CudaStream) {
        params.push(self.device_ptr(stream).0);
    }
}
impl<T> KernelArg for &mut CudaViewMut<'_, T> {
    fn push_to(self, params: &mut Params, stream: &CudaStream) {
        params.push(self.device_ptr_mut(stream).0);
    }
}
impl<T> KernelArg for &CudaSlice<T> {
    fn push_to(self, params: &mut Params, stream: &CudaStream) {
        params.push(self.device_ptr(stream).0);
    }
}
impl<T> KernelArg for &mut CudaSlice<T> {
    fn push_to(self, params: &mut Params, stream: &CudaStream) {
        params.push(self.device_ptr_mut(stream).0);
    }
}

/// Launches `func` on `stream` with the PDL attribute (see the module comment).
///
/// # Safety
/// The parameters must match the kernel's signature, and every index the kernel computes from
/// them must stay inside its buffers.
pub unsafe fn launch(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    params: &mut Params,
) -> Result<(), DriverError> {
    stream.context().bind_to_thread()?;
    let mut attr: sys::CUlaunchAttribute = std::mem::zeroed();
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: u32::from(pdl_enabled()),
    };
    sys::cuLaunchKernelEx(
        &config,
        func.cu_function(),
        params.ptrs.as_mut_ptr(),
        std::ptr::null_mut(),
    )
    .result()
}
