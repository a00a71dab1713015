//! Where a decode step's time goes inside its CUDA graph (`lily bench --timeline`).
//!
//! `lily bench --profile` puts an event between every two kernels, which costs programmatic
//! dependent launch its overlap and the step its graph. The timeline measures the graph as it
//! runs: while one is installed, block 0 of every kernel stamps the GPU's global timer as it
//! reaches its `pdl_wait()` and as that returns (common.cuh), into a buffer whose address sits in
//! each module's `lily_timeline` global. Only the modules build.rs compiles a second time with the
//! stamps have that global, and only a device opened for a timeline loads them
//! (`CudaDevice::new_with`): the plain kernels carry no trace of it. A kernel's wait returns once
//! the kernel before it has finished and its writes are visible, so the gap between two
//! consecutive stamps is what the first kernel cost the step: its work after the wait, its slowest
//! block, and the hand-over to the next one (and any cuBLAS product launched after it: those carry
//! no stamps, so their time shows in the launch before them). The labels of the launches come from the graph's
//! capture (profile.rs `label_launches`); reading the stamps is `model::timeline`, device-free.
//! The same builds also trace every block of the gathered expert GEMVs (start, end, SM; common.cuh
//! `block_trace_end`), summarised by `model::block_trace`: which blocks of a launch end last.

use cudarc::driver::{CudaSlice, DevicePtr};

use super::{Context, CudaDevice, Result};
use crate::model::block_trace::BlockSpan;
use crate::model::timeline::{Stamp, MARKS};

/// Words of one stamp (TIMELINE_WORDS in common.cuh).
const WORDS: usize = 3 + MARKS;

/// The stamp buffer, installed in every stamped module, and the block trace's.
pub struct Timeline {
    buf: CudaSlice<u64>,
    blocks: CudaSlice<u64>,
}

/// The global every stamped module holds (common.cuh).
const SYMBOL: &str = "lily_timeline";
/// Stamps the buffer holds: common.cuh's TIMELINE_CAPACITY (128 MB; ≈ 5,000 decode steps of one
/// sequence).
const CAPACITY: usize = 1 << 21;
/// The block trace's global (common.cuh), its words a record and its capacity
/// (BLOCK_TRACE_CAPACITY: 32 MB).
const BLOCK_SYMBOL: &str = "lily_block_trace";
const BLOCK_WORDS: usize = 4;
const BLOCK_CAPACITY: usize = 1 << 20;

impl Timeline {
    /// An empty buffer, installed: from now on every kernel stamps its wait.
    pub fn install(dev: &CudaDevice) -> Result<Timeline> {
        let st = dev.stream();
        let buf = st
            .alloc_zeros::<u64>(1 + WORDS * CAPACITY)
            .during(|| "allocating the timeline".into())?;
        let ptr = buf.device_ptr(st).0;
        super::ensure!(
            dev.set_module_global(SYMBOL, ptr)? > 0,
            "no timeline in this device's kernels: open it with CudaDevice::new_with(_, true) \
             (lily bench --timeline does)"
        );
        let blocks = st
            .alloc_zeros::<u64>(1 + BLOCK_WORDS * BLOCK_CAPACITY)
            .during(|| "allocating the block trace".into())?;
        dev.set_module_global(BLOCK_SYMBOL, blocks.device_ptr(st).0)?;
        Ok(Timeline { buf, blocks })
    }

    /// Stops the stamping (the kernels see a null pointer again) and returns the stamps taken,
    /// in the order the kernels ran (the order of their releases: a kernel's wait returns only
    /// after the one before it has finished), and the traced blocks (the first
    /// BLOCK_CAPACITY). An error if the stamps' buffer overflowed.
    pub fn uninstall(self, dev: &CudaDevice) -> Result<(Vec<Stamp>, Vec<BlockSpan>)> {
        dev.set_module_global(SYMBOL, 0)?;
        dev.set_module_global(BLOCK_SYMBOL, 0)?;
        // The count first, then only the stamps taken (the buffer is 128 MB).
        let st = dev.stream();
        let read = |range: std::ops::Range<usize>| {
            st.clone_dtoh(&self.buf.slice(range))
                .during(|| "reading the timeline".into())
        };
        let taken = read(0..1)?[0] as usize;
        super::ensure!(
            taken <= CAPACITY,
            "the timeline holds {CAPACITY} stamps, the kernels took {taken}"
        );
        let blocks = self.blocks(dev)?;
        if taken == 0 {
            return Ok((Vec::new(), blocks));
        }
        let words = read(1..1 + WORDS * taken)?;
        let mut stamps: Vec<Stamp> = words
            .chunks_exact(WORDS)
            .map(|w| Stamp {
                reached: w[0],
                released: w[1],
                grid: w[2],
                marks: std::array::from_fn(|m| w[3 + m]),
            })
            .collect();
        stamps.sort_by_key(|s| s.released);
        Ok((stamps, blocks))
    }

    /// The block trace's records (those that fit; the kernels count all they tried).
    fn blocks(&self, dev: &CudaDevice) -> Result<Vec<BlockSpan>> {
        let st = dev.stream();
        let read = |range: std::ops::Range<usize>| {
            st.clone_dtoh(&self.blocks.slice(range))
                .during(|| "reading the block trace".into())
        };
        let tried = read(0..1)?[0] as usize;
        if tried > BLOCK_CAPACITY {
            tracing::warn!(
                "the block trace holds {BLOCK_CAPACITY} blocks of the {tried} traced: its summary covers the first"
            );
        }
        let taken = tried.min(BLOCK_CAPACITY);
        if taken == 0 {
            return Ok(Vec::new());
        }
        Ok(read(1..1 + BLOCK_WORDS * taken)?
            .chunks_exact(BLOCK_WORDS)
            .map(|w| BlockSpan::from_words([w[0], w[1], w[2], w[3]]))
            .collect())
    }
}
