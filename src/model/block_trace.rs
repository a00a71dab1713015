//! Which blocks of a launch end last (`lily bench --timeline`): the gathered expert GEMVs' blocks
//! record their start, end and SM in the timeline builds (common.cuh `block_trace_end`), and
//! this part, device-free, summarises them per kind of launch — whether the launch's tail is
//! blocks that started late, SMs that held more blocks, or slots with more tokens.

use std::collections::BTreeMap;
use std::fmt::Write;

/// One block of a traced launch (global timer, ns).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockSpan {
    /// The launch's `%gridid`: the same for every block of one launch, and for every replay of
    /// one graph node (replays are told apart by time, see [`launches`]).
    pub grid: u64,
    pub start: u64,
    pub end: u64,
    pub sm: u32,
    pub block: u32,
    pub slot: u32,
    /// Tokens of the block's slot.
    pub tokens: u32,
    /// Whether its x went through SwiGLU (the experts' down) or not (their gate‖up).
    pub swiglu: bool,
    /// Rows of the launch's matrices.
    pub rows: u32,
}

impl BlockSpan {
    /// From a record's four words, as common.cuh `block_trace_end` writes them.
    pub fn from_words(w: [u64; 4]) -> BlockSpan {
        let what = (w[3] >> 40) as u32;
        BlockSpan {
            grid: w[0],
            start: w[1],
            end: w[2],
            sm: (w[3] & 0xff) as u32,
            block: ((w[3] >> 8) & 0xffff) as u32,
            slot: ((w[3] >> 24) & 0xffff) as u32,
            tokens: what & 0xf,
            swiglu: (what >> 4) & 1 == 1,
            rows: (what >> 8) << 4,
        }
    }
}

/// Per kind of launch (gate‖up or down, by rows), the medians over its launches of where its
/// blocks started and ended, as markdown; empty without spans.
pub fn to_markdown(spans: &[BlockSpan]) -> String {
    let mut kinds: BTreeMap<(bool, u32), Vec<LaunchStats>> = BTreeMap::new();
    for blocks in launches(spans) {
        kinds
            .entry((blocks[0].swiglu, blocks[0].rows))
            .or_default()
            .push(LaunchStats::of(&blocks));
    }
    let mut out = String::new();
    for ((swiglu, rows), stats) in &kinds {
        let name = if *swiglu { "down" } else { "gate‖up" };
        let _ = writeln!(
            out,
            "#### Gathered {name} ({rows} rows): its blocks, medians over {} launches (µs from the launch's first block start)\n",
            stats.len()
        );
        out += "| | value |\n|---|---:|\n";
        let row = |out: &mut String, label: &str, f: &dyn Fn(&LaunchStats) -> Option<f64>| {
            let v: Vec<f64> = stats.iter().filter_map(f).collect();
            if let Some(m) = median(v) {
                let _ = writeln!(out, "| {label} | {m:.2} |");
            }
        };
        row(&mut out, "blocks with tokens", &|s| Some(s.blocks as f64));
        row(&mut out, "SMs holding them", &|s| Some(s.sms as f64));
        for c in 1..=3 {
            let label = format!("SMs holding {c}{} of them", if c == 3 { "+" } else { "" });
            row(&mut out, &label, &|s| Some(s.sms_by_count[c - 1] as f64));
        }
        row(&mut out, "last block's end", &|s| Some(s.last_end));
        for (k, what) in ["block end", "block start", "block duration"]
            .iter()
            .enumerate()
        {
            for (i, q) in QUANTILES.iter().enumerate() {
                row(&mut out, &format!("{what}, {q}"), &|s| {
                    Some([s.end_q, s.start_q, s.dur_q][k][i])
                });
            }
        }
        for c in 1..=3 {
            let label = format!(
                "SM end, SMs holding {c}{} blocks",
                if c == 3 { "+" } else { "" }
            );
            row(&mut out, &label, &|s| s.sm_end_by_count[c - 1]);
        }
        for c in 0..3 {
            let label = format!(
                "block duration, {c}{} other blocks on its SM at its midpoint",
                if c == 2 { "+" } else { "" }
            );
            row(&mut out, &label, &|s| s.dur_by_company[c]);
        }
        for (i, t) in ["1 token", "2", "3–4", "5–8"].iter().enumerate() {
            row(&mut out, &format!("block duration, slots of {t}"), &|s| {
                s.dur_by_tokens[i]
            });
        }
        row(&mut out, "the last block: start", &|s| Some(s.last.0));
        row(&mut out, "the last block: duration", &|s| Some(s.last.1));
        row(&mut out, "the last block: blocks on its SM", &|s| {
            Some(s.last.2 as f64)
        });
        row(&mut out, "the last block: tokens", &|s| {
            Some(s.last.3 as f64)
        });
        out += "\n";
    }
    out
}

/// The spans grouped by launch: by grid id, then, since a graph's replays repeat their nodes'
/// grid ids, apart where a block starts more than REPLAY_GAP after the one before it.
fn launches(spans: &[BlockSpan]) -> Vec<Vec<BlockSpan>> {
    const REPLAY_GAP: u64 = 200_000; // ns: a launch's blocks start within µs, replays ms apart
    let mut by_grid: BTreeMap<u64, Vec<BlockSpan>> = BTreeMap::new();
    for s in spans {
        by_grid.entry(s.grid).or_default().push(*s);
    }
    let mut out = Vec::new();
    for mut blocks in by_grid.into_values() {
        blocks.sort_by_key(|b| b.start);
        let mut launch: Vec<BlockSpan> = Vec::new();
        for b in blocks {
            if launch
                .last()
                .is_some_and(|l| b.start > l.start + REPLAY_GAP)
            {
                out.push(std::mem::take(&mut launch));
            }
            launch.push(b);
        }
        out.push(launch);
    }
    out
}

const QUANTILES: [&str; 3] = ["p10", "p50", "p90"];

/// One launch's blocks, summarised (µs from its first block's start).
struct LaunchStats {
    blocks: usize,
    sms: usize,
    /// SMs holding 1, 2, 3+ of its blocks.
    sms_by_count: [usize; 3],
    last_end: f64,
    end_q: [f64; 3],
    start_q: [f64; 3],
    dur_q: [f64; 3],
    /// Mean last end of the SMs holding 1, 2, 3+ blocks.
    sm_end_by_count: [Option<f64>; 3],
    /// Mean duration of blocks with 0, 1, 2+ other blocks running on their SM at their midpoint.
    dur_by_company: [Option<f64>; 3],
    /// Mean duration of blocks whose slot has 1, 2, 3–4, 5–8 tokens.
    dur_by_tokens: [Option<f64>; 4],
    /// The last block to end: start, duration, blocks on its SM, tokens.
    last: (f64, f64, usize, u32),
}

impl LaunchStats {
    fn of(blocks: &[BlockSpan]) -> LaunchStats {
        let t0 = blocks.iter().map(|b| b.start).min().unwrap_or(0);
        let us = |t: u64| t.saturating_sub(t0) as f64 / 1e3;
        let mut per_sm: BTreeMap<u32, Vec<&BlockSpan>> = BTreeMap::new();
        for b in blocks {
            per_sm.entry(b.sm).or_default().push(b);
        }
        let bucket = |n: usize| n.clamp(1, 3) - 1;
        let mut sms_by_count = [0; 3];
        let mut sm_ends: [Vec<f64>; 3] = Default::default();
        for held in per_sm.values() {
            sms_by_count[bucket(held.len())] += 1;
            sm_ends[bucket(held.len())].push(held.iter().map(|b| us(b.end)).fold(0.0, f64::max));
        }
        let mut by_company: [Vec<f64>; 3] = Default::default();
        let mut by_tokens: [Vec<f64>; 4] = Default::default();
        for b in blocks {
            let mid = b.start / 2 + b.end / 2;
            let company = per_sm[&b.sm]
                .iter()
                .filter(|o| !std::ptr::eq(**o, b) && o.start <= mid && mid < o.end)
                .count();
            let dur = us(b.end) - us(b.start);
            by_company[company.min(2)].push(dur);
            let t = match b.tokens {
                0 | 1 => 0,
                2 => 1,
                3 | 4 => 2,
                _ => 3,
            };
            by_tokens[t].push(dur);
        }
        let quantiles = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            let at = |q: f64| v.get(((v.len() - 1) as f64 * q).round() as usize).copied();
            [at(0.1), at(0.5), at(0.9)].map(|x| x.unwrap_or(0.0))
        };
        let last = blocks.iter().max_by_key(|b| b.end).copied();
        LaunchStats {
            blocks: blocks.len(),
            sms: per_sm.len(),
            sms_by_count,
            last_end: last.map_or(0.0, |b| us(b.end)),
            end_q: quantiles(blocks.iter().map(|b| us(b.end)).collect()),
            start_q: quantiles(blocks.iter().map(|b| us(b.start)).collect()),
            dur_q: quantiles(blocks.iter().map(|b| us(b.end) - us(b.start)).collect()),
            sm_end_by_count: sm_ends.map(mean),
            dur_by_company: by_company.map(mean),
            dur_by_tokens: by_tokens.map(mean),
            last: last.map_or((0.0, 0.0, 0, 0), |b| {
                (
                    us(b.start),
                    us(b.end) - us(b.start),
                    per_sm[&b.sm].len(),
                    b.tokens,
                )
            }),
        }
    }
}

fn mean(v: Vec<f64>) -> Option<f64> {
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(grid: u64, start: u64, end: u64, sm: u32, tokens: u32) -> BlockSpan {
        BlockSpan {
            grid,
            start,
            end,
            sm,
            block: 0,
            slot: 0,
            tokens,
            swiglu: false,
            rows: 1024,
        }
    }

    #[test]
    fn words_round_trip_the_device_layout() {
        let w3 = 7u64 | 3 << 8 | 42 << 24 | ((5 | 1 << 4 | (2048 >> 4) << 8) as u64) << 40;
        let b = BlockSpan::from_words([9, 100, 250, w3]);
        assert_eq!(
            (b.grid, b.start, b.end, b.sm, b.block, b.slot, b.tokens, b.swiglu, b.rows),
            (9, 100, 250, 7, 3, 42, 5, true, 2048)
        );
    }

    #[test]
    fn a_launch_whose_shared_sm_ends_last() {
        // SM 0 holds two blocks that overlap, SM 1 one block alone that starts 1 µs late.
        let spans = [
            span(1, 0, 20_000, 0, 1),
            span(1, 0, 22_000, 0, 1),
            span(1, 1_000, 12_000, 1, 2),
        ];
        let s = LaunchStats::of(&spans);
        assert_eq!((s.blocks, s.sms, s.sms_by_count), (3, 2, [1, 1, 0]));
        assert_eq!(s.last_end, 22.0);
        assert_eq!(s.sm_end_by_count[..2], [Some(12.0), Some(22.0)]);
        assert_eq!(s.dur_by_company[0], Some(11.0), "the lone block");
        assert_eq!(s.dur_by_company[1], Some(21.0), "the two sharing SM 0");
        assert_eq!(s.last, (0.0, 22.0, 2, 1));
        let md = to_markdown(&spans);
        assert!(md.contains("Gathered gate‖up (1024 rows)"), "{md}");
        assert!(md.contains("| last block's end | 22.00 |"), "{md}");
    }

    #[test]
    fn replays_of_one_node_are_separate_launches() {
        let spans = [
            span(1, 0, 20_000, 0, 1),
            span(1, 1_000_000, 1_020_000, 0, 1),
            span(1, 1_001_000, 1_030_000, 1, 1),
            span(2, 500, 9_000, 0, 1),
        ];
        let mut sizes: Vec<usize> = launches(&spans).iter().map(Vec::len).collect();
        sizes.sort();
        assert_eq!(sizes, [1, 1, 2]);
        assert!(to_markdown(&spans).contains("medians over 3 launches"));
    }

    #[test]
    fn no_spans_no_section() {
        assert!(to_markdown(&[]).is_empty());
    }
}
