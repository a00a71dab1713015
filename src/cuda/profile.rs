//! Where a pass's GPU time goes (`lily bench --profile`). While a profile is installed on this
//! thread, every kernel launch (the `launch!` macro) and every new section of the forward pass
//! records a CUDA event; the time between two events is charged to what ran between them: the
//! kernel just launched, or (at a section change) the rest of the section, such as cuBLAS's
//! kernels, which are not launched through `launch!`.
//!
//! An event between every two kernels costs programmatic dependent launch its overlap and adds
//! a host call per kernel, so a profiled pass runs slower than a plain one (and a decode step
//! runs without its CUDA graph): prefill kernels (milliseconds) are measured closely, decode
//! kernels (microseconds) include their launch gaps. The shares are what it is for.

use std::cell::RefCell;

use cudarc::driver::{sys, CudaEvent};

use super::{Context, CudaStream, Result};
use crate::model::OpTime;

/// Op times gathered over passes, and the events of the pass in flight.
#[derive(Default)]
pub struct OpProfile {
    /// Reused from pass to pass; the first `used` were recorded in this pass.
    events: Vec<CudaEvent>,
    used: usize,
    /// `ops[i]`: what ran between events i and i + 1, as (section, kernel).
    ops: Vec<(&'static str, &'static str)>,
    section: &'static str,
    totals: Vec<OpTime>,
}

thread_local! {
    static ACTIVE: RefCell<Option<OpProfile>> = const { RefCell::new(None) };
    static LABELS: RefCell<Option<Labels>> = const { RefCell::new(None) };
}

/// The launches of a pass as they are made (for a captured graph, whose replays the timeline
/// measures: timeline.rs): (section, kernel) each.
#[derive(Default)]
struct Labels {
    section: &'static str,
    launches: Vec<(&'static str, String)>,
}

/// Runs `pass` and returns, beside its result, the (section, kernel) of each launch it made.
pub(crate) fn label_launches<T>(
    pass: impl FnOnce() -> Result<T>,
) -> (Result<T>, Vec<(&'static str, String)>) {
    LABELS.with_borrow_mut(|l| *l = Some(Labels::default()));
    let out = pass();
    let labels = LABELS.with_borrow_mut(Option::take).unwrap_or_default();
    (out, labels.launches)
}

impl OpProfile {
    /// Runs `pass` with this profile installed on the thread; charges its time once it is done
    /// (which waits for the GPU).
    pub fn time<T>(&mut self, stream: &CudaStream, pass: impl FnOnce() -> Result<T>) -> Result<T> {
        self.used = 0;
        self.ops.clear();
        self.section = "";
        self.record(stream)?;
        ACTIVE.with_borrow_mut(|a| *a = Some(std::mem::take(self)));
        let out = pass();
        *self = ACTIVE
            .with_borrow_mut(Option::take)
            .expect("the profile stays installed during the pass");
        let out = out?;
        self.mark(stream, "rest")?;
        self.charge()?;
        Ok(out)
    }

    /// The times gathered so far, largest first; starts over.
    pub fn take(&mut self) -> Vec<OpTime> {
        let mut t = std::mem::take(&mut self.totals);
        t.sort_by(|a, b| b.ms.total_cmp(&a.ms));
        t
    }

    fn record(&mut self, stream: &CudaStream) -> Result<()> {
        if self.used == self.events.len() {
            let ev = stream
                .context()
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .during(|| "creating a profiling event".into())?;
            self.events.push(ev);
        }
        self.events[self.used]
            .record(stream)
            .during(|| "recording a profiling event".into())?;
        self.used += 1;
        Ok(())
    }

    fn mark(&mut self, stream: &CudaStream, kernel: &'static str) -> Result<()> {
        self.record(stream)?;
        self.ops.push((self.section, kernel));
        Ok(())
    }

    /// Waits for the pass's events and adds each interval to its op.
    fn charge(&mut self) -> Result<()> {
        for (i, &(section, kernel)) in self.ops.iter().enumerate() {
            let ms = self.events[i]
                .elapsed_ms(&self.events[i + 1])
                .during(|| "reading a profiling event".into())? as f64;
            let kernel = kernel_name(kernel);
            match self
                .totals
                .iter_mut()
                .find(|t| t.section == section && t.kernel == kernel)
            {
                Some(t) => {
                    t.ms += ms;
                    t.calls += 1;
                }
                None => self.totals.push(OpTime {
                    section: section.to_string(),
                    kernel,
                    ms,
                    calls: 1,
                }),
            }
        }
        Ok(())
    }
}

/// Starts a section of the forward pass ("gdn in_proj", "moe experts", ...); the work since the
/// last event goes to the section before. A no-op without an installed profile.
pub(crate) fn section(stream: &CudaStream, name: &'static str) -> Result<()> {
    LABELS.with_borrow_mut(|l| {
        if let Some(l) = l {
            l.section = name;
        }
    });
    ACTIVE.with_borrow_mut(|a| match a {
        Some(p) => {
            if p.used > 0 && !p.section.is_empty() {
                p.mark(stream, "rest")?;
            }
            p.section = name;
            Ok(())
        }
        None => Ok(()),
    })
}

/// The label of a cuBLAS product (dense.rs): a launch with no timeline stamp.
pub(crate) const CUBLAS: &str = "dense cublas";

/// Called by `launch!` after each launch: the time until this event is the kernel's.
pub(crate) fn after_launch(stream: &CudaStream, kernel: &'static str) -> Result<()> {
    LABELS.with_borrow_mut(|l| {
        if let Some(l) = l {
            l.launches.push((l.section, kernel_name(kernel)));
        }
    });
    ACTIVE.with_borrow_mut(|a| match a {
        Some(p) => p.mark(stream, kernel),
        None => Ok(()),
    })
}

/// `launch!`'s label (`lily::cuda::gdn &self.prep`) as `gdn prep`.
fn kernel_name(label: &str) -> String {
    let label = label.strip_prefix("lily::cuda::").unwrap_or(label);
    label.replace("&self.", "").replace(['&', '*'], "")
}
