//! Where a decode step's time goes inside its CUDA graph (`lily bench --timeline`).
//!
//! `lily bench --profile` puts an event between every two kernels, which costs programmatic
//! dependent launch its overlap and the step its graph. The timeline measures the graph as it
//! runs: while one is installed, block 0 of every kernel stamps the GPU's global timer as it
//! reaches its `pdl_wait()` and as that returns (common.cuh), into a buffer whose address sits in
//! each module's `lily_timeline` global. Only the modules build.rs compiles a second time with the
//! stamps have that global, and only a device opened for a timeline loads them
//! (`CudaDevice::new_with`): the plain kernels carry no trace of it. A kernel's wait returns once the kernel before it has finished and
//! its writes are visible, so the gap between two consecutive stamps is what the first kernel
//! cost the step: its work after the wait, its slowest block, and the hand-over to the next one.
//! The labels of the launches come from the graph's capture (profile.rs `label_launches`).

use cudarc::driver::{CudaSlice, DevicePtr};

use super::{Context, CudaDevice, Result};
use crate::model::{DecodeTimeline, LaunchTime, OpTime};

/// What block 0 of one kernel stamped (global timer, ns).
#[derive(Debug, Clone, Copy)]
pub struct Stamp {
    /// When it reached its wait (its pre-wait work done).
    pub reached: u64,
    /// When its wait returned: the kernel before it had finished.
    pub released: u64,
    /// Blocks in its grid.
    pub grid: u64,
    /// Points of block 0's own work the kernel marked (common.cuh `timeline_mark`), 0 where not.
    pub marks: [u64; MARKS],
}

/// Marks a kernel can set (TIMELINE_MARKS in common.cuh).
pub const MARKS: usize = 5;
/// Words of one stamp (TIMELINE_WORDS in common.cuh).
const WORDS: usize = 3 + MARKS;

/// The stamp buffer, installed in every kernel module.
pub struct Timeline {
    buf: CudaSlice<u64>,
}

/// The name of the constant every module holds (common.cuh).
const SYMBOL: &str = "lily_timeline";
/// Stamps the buffer holds: common.cuh's TIMELINE_CAPACITY (128 MB; ≈ 5,000 decode steps of one
/// sequence).
const CAPACITY: usize = 1 << 21;

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
        Ok(Timeline { buf })
    }

    /// Stops the stamping (the kernels see a null pointer again) and returns the stamps taken,
    /// in the order the kernels ran (the order of their releases: a kernel's wait returns only
    /// after the one before it has finished). An error if the buffer overflowed.
    pub fn uninstall(self, dev: &CudaDevice) -> Result<Vec<Stamp>> {
        dev.set_module_global(SYMBOL, 0)?;
        let words = dev
            .stream()
            .clone_dtoh(&self.buf)
            .during(|| "reading the timeline".into())?;
        let taken = words[0] as usize;
        super::ensure!(
            taken <= CAPACITY,
            "the timeline holds {CAPACITY} stamps, the kernels took {taken}"
        );
        let mut stamps: Vec<Stamp> = (0..taken)
            .map(|i| {
                let w = &words[1 + WORDS * i..1 + WORDS * (i + 1)];
                Stamp {
                    reached: w[0],
                    released: w[1],
                    grid: w[2],
                    marks: std::array::from_fn(|m| w[3 + m]),
                }
            })
            .collect();
        stamps.sort_by_key(|s| s.released);
        Ok(stamps)
    }
}

/// What each launch of a graph cost over its replays, from the stamps of those replays (in
/// order, nothing else run in between) and the graph's launch labels (section, kernel): the gap
/// from a launch's release to the next one's, and how long it waited at its wait (ready before
/// its predecessor finished; about 0 where it was late). The last launch of a replay has no next
/// release within it and is left out (it is the logits' argmax). An error if the stamps do not
/// make whole replays (a kernel that did not stamp, or something else that ran).
pub fn per_launch(stamps: &[Stamp], labels: &[(&'static str, String)]) -> Result<DecodeTimeline> {
    let n = labels.len();
    super::ensure!(
        n > 1 && !stamps.is_empty() && stamps.len() % n == 0,
        "the timeline has {} stamps, not whole replays of a graph of {n} launches",
        stamps.len()
    );
    let steps = stamps.len() / n;
    let mut ops: Vec<OpTime> = Vec::new();
    let mut gaps = vec![Vec::with_capacity(steps); n - 1];
    let mut waits = vec![Vec::with_capacity(steps); n - 1];
    let mut marks = vec![vec![Vec::new(); MARKS]; n - 1];
    let us = |from: u64, to: u64| to.saturating_sub(from) as f64 / 1e3;
    for step in stamps.chunks(n) {
        for (j, pair) in step.windows(2).enumerate() {
            let us = us(pair[0].released, pair[1].released);
            gaps[j].push(us);
            waits[j].push(pair[0].released.saturating_sub(pair[0].reached) as f64 / 1e3);
            for (m, &t) in pair[0].marks.iter().enumerate() {
                if t != 0 {
                    marks[j][m].push(t.saturating_sub(pair[0].released) as f64 / 1e3);
                }
            }
            let (section, kernel) = &labels[j];
            match ops
                .iter_mut()
                .find(|o| o.section == *section && o.kernel == *kernel)
            {
                Some(o) => {
                    o.ms += us / 1e3;
                    o.calls += 1;
                }
                None => ops.push(OpTime {
                    section: section.to_string(),
                    kernel: kernel.clone(),
                    ms: us / 1e3,
                    calls: 1,
                }),
            }
        }
    }
    ops.sort_by(|a, b| b.ms.total_cmp(&a.ms));
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied()
    };
    let launches = gaps
        .into_iter()
        .zip(waits)
        .zip(marks)
        .zip(labels)
        .map(|(((g, w), m), (section, kernel))| LaunchTime {
            section: section.to_string(),
            kernel: kernel.clone(),
            gap_us: median(g).unwrap_or(0.0),
            waited_us: median(w).unwrap_or(0.0),
            marks_us: m.into_iter().map(median).collect(),
        })
        .collect();
    Ok(DecodeTimeline {
        steps,
        ops,
        launches,
    })
}
