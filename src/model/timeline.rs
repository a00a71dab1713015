//! A decode step's timeline (`lily bench --timeline`): what each kernel of the step cost, from
//! the stamps its block 0 took at its PDL wait (the CUDA backend's timeline.rs takes them; this
//! part needs no device).

use super::OpTime;

/// Where the decode steps' time went as their CUDA graph ran
/// ([`Backend::stop_timeline`](super::Backend::stop_timeline)).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DecodeTimeline {
    /// Steps measured.
    pub steps: usize,
    /// Per (section, kernel): the gaps from each of its launches to the next launch's start,
    /// summed over the steps.
    pub ops: Vec<OpTime>,
    /// Each launch of one step but the last, in order.
    pub launches: Vec<LaunchTime>,
    /// The gathered GEMVs' blocks, where the backend traces them (block_trace.rs).
    pub blocks: Vec<super::block_trace::BlockSpan>,
}

/// One launch of a decode step in a [`DecodeTimeline`]: medians over the steps, in µs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LaunchTime {
    pub section: String,
    pub kernel: String,
    /// From its wait's return (its predecessor done) to the next launch's.
    pub gap_us: f64,
    /// How long it waited at its wait, ready before its predecessor finished (about 0: late).
    pub waited_us: f64,
    /// Points of its own work it marked, from its wait's return (None: not marked).
    pub marks_us: Vec<Option<f64>>,
}

/// What block 0 of one kernel stamped (global timer, ns).
#[derive(Debug, Clone, Copy)]
pub struct Stamp {
    /// When it reached its wait (its pre-wait work done).
    pub reached: u64,
    /// When its wait returned: the kernel before it had finished.
    pub released: u64,
    /// Blocks in its grid (what tells the launches of a step apart when checking the order).
    pub grid: u64,
    /// Points of block 0's own work the kernel marked (common.cuh `timeline_mark`), 0 where not.
    pub marks: [u64; MARKS],
}

/// Marks a kernel can set (TIMELINE_MARKS in common.cuh).
pub const MARKS: usize = 5;

/// What each launch of a graph cost over its replays, from the stamps of those replays (in
/// order, nothing else run in between) and the graph's launch labels (section, kernel): the gap
/// from a launch's release to the next one's, and how long it waited at its wait (ready before
/// its predecessor finished; about 0 where it was late). The last launch of a replay has no next
/// release within it and is left out (it is the logits' argmax). An error if the stamps do not
/// make whole replays (a kernel that did not stamp, or something else that ran).
pub fn per_launch(
    stamps: &[Stamp],
    labels: &[(&'static str, String)],
) -> anyhow::Result<DecodeTimeline> {
    let n = labels.len();
    anyhow::ensure!(
        n > 1 && !stamps.is_empty() && stamps.len() % n == 0,
        "the timeline has {} stamps, not whole replays of a graph of {n} launches",
        stamps.len()
    );
    let steps = stamps.len() / n;
    // Every replay launches the same grids in the same order: a stamp that is missing or out of
    // place shows as a grid size differing from the first replay's at that position.
    let first = &stamps[..n];
    anyhow::ensure!(
        stamps
            .chunks(n)
            .all(|step| step.iter().zip(first).all(|(a, b)| a.grid == b.grid)),
        "the timeline's stamps do not repeat one launch list ({n} launches a replay)"
    );
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
        blocks: Vec::new(),
    })
}

/// The labels of the launches that stamp, from a graph's launch labels where those of `unstamped`
/// kernels (a library's, e.g. cuBLAS's, which have no timeline build) take no stamp: such a launch
/// runs inside the gap of the stamped launch before it, which is then labelled with the
/// unstamped launch's section and both kernels ("cublas after norm"), since the library's product
/// is most of that gap.
pub fn stamped_labels(
    labels: &[(&'static str, String)],
    unstamped: impl Fn(&str) -> bool,
) -> Vec<(&'static str, String)> {
    let mut out: Vec<(&'static str, String)> = Vec::with_capacity(labels.len());
    for (section, kernel) in labels {
        match out.last_mut() {
            Some(last) if unstamped(kernel) => {
                *last = (*section, format!("{kernel} after {}", last.1));
            }
            _ if unstamped(kernel) => {} // nothing stamped before it: its time is not seen
            _ => out.push((*section, kernel.clone())),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stamp(released: u64, grid: u64) -> Stamp {
        Stamp {
            reached: released.saturating_sub(500),
            released,
            grid,
            marks: [0, released + 100, 0, 0, 0],
        }
    }

    fn labels() -> Vec<(&'static str, String)> {
        vec![
            ("embed", "embed".to_string()),
            ("gdn in_proj", "gemv".to_string()),
            ("gdn mixer", "gdn".to_string()),
            ("gdn in_proj", "gemv".to_string()),
        ]
    }

    #[test]
    fn gaps_waits_and_marks_per_launch() {
        // Two replays of four launches, 1, 2, 3 µs apart (the last launch has no gap).
        let stamps: Vec<Stamp> = [0u64, 10_000]
            .iter()
            .flat_map(|&t0| {
                [(0, 1), (1_000, 97), (3_000, 32), (6_000, 97)].map(|(t, g)| stamp(t0 + t, g))
            })
            .collect();
        let t = per_launch(&stamps, &labels()).unwrap();
        assert_eq!(t.steps, 2);
        let gaps: Vec<f64> = t.launches.iter().map(|l| l.gap_us).collect();
        assert_eq!(gaps, [1.0, 2.0, 3.0]);
        assert!(t.launches.iter().all(|l| l.waited_us == 0.5));
        assert!(t
            .launches
            .iter()
            .all(|l| l.marks_us[1] == Some(0.1) && l.marks_us[0].is_none()));
        // Per op, summed over the steps; the step's last launch (the second in_proj) has no gap.
        let op = |section| t.ops.iter().find(|o| o.section == section).unwrap();
        let in_proj = op("gdn in_proj");
        assert_eq!((in_proj.calls, (in_proj.ms * 1e3).round()), (2, 4.0));
        assert_eq!(t.ops[0].section, "gdn mixer", "largest first");
        assert_eq!(t.ops.iter().map(|o| o.calls).sum::<u64>(), 6);
    }

    #[test]
    fn unstamped_launches_fold_into_the_launch_before() {
        let labels = vec![
            ("norms", "rmsnorm".to_string()),
            ("gdn in_proj", "cublas".to_string()),
            ("gdn mixer", "gdn".to_string()),
            ("gdn out_proj", "cublas".to_string()),
            ("gdn out_proj", "unpad".to_string()),
        ];
        let stamped = stamped_labels(&labels, |k| k == "cublas");
        assert_eq!(
            stamped,
            [
                ("gdn in_proj", "cublas after rmsnorm".to_string()),
                ("gdn out_proj", "cublas after gdn".to_string()),
                ("gdn out_proj", "unpad".to_string()),
            ]
        );
        // Four replays of those three stamped launches make a timeline.
        let stamps: Vec<Stamp> = (0..4u64)
            .flat_map(|r| [(0, 1), (1_000, 97), (3_000, 32)].map(|(t, g)| stamp(r * 10_000 + t, g)))
            .collect();
        assert_eq!(per_launch(&stamps, &stamped).unwrap().steps, 4);
    }

    #[test]
    fn stamps_that_do_not_repeat_the_launch_list_are_refused() {
        let good = |t0: u64| {
            [(0, 1), (1_000, 97), (3_000, 32), (6_000, 97)].map(|(t, g)| stamp(t0 + t, g))
        };
        // One stamp missing: not whole replays.
        let mut short: Vec<Stamp> = good(0).into_iter().chain(good(10_000)).collect();
        short.pop();
        assert!(per_launch(&short, &labels()).is_err());
        // Whole in count, but the second replay's grids out of place.
        let mut swapped: Vec<Stamp> = good(0).into_iter().chain(good(10_000)).collect();
        swapped[5].grid = 32;
        assert!(per_launch(&swapped, &labels()).is_err());
        assert!(per_launch(&[], &labels()).is_err());
    }
}
