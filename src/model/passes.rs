//! Grouping a batch's steps into shared passes, for devices that run the steps of several
//! sequences as the rows of one forward pass: which steps may share a pass, and how many fit.

use std::collections::HashSet;

use super::{SeqId, Step};

/// What one pass holds at most.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PassLimits {
    /// Token rows (prompt chunks and decode tokens together).
    pub rows: usize,
    /// Sequences (steps).
    pub sequences: usize,
}

/// A step placed in a pass: its index in the batch, its sequence's slot and position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PassStep {
    pub index: usize,
    pub slot: usize,
    pub position: usize,
}

/// Groups `steps` into passes, in order. A step joins one when its sequence is known
/// (`sequence` gives its slot and position), it is that sequence's first step in the batch, it
/// has `1 ..= limits.rows` tokens, and `runnable(step, position)` says the device takes it
/// (tokens in the vocabulary, room in the context, ...). A pass closes when the next step would
/// take it past its rows or sequences. Steps in no pass are the caller's to run alone, which
/// reports what is wrong with them; a sequence's later steps stay out when its first one does,
/// so they never run before it.
pub fn plan(
    steps: &[Step],
    limits: PassLimits,
    sequence: impl Fn(SeqId) -> Option<(usize, usize)>,
    runnable: impl Fn(&Step, usize) -> bool,
) -> Vec<Vec<PassStep>> {
    let mut passes: Vec<Vec<PassStep>> = Vec::new();
    let mut seen = HashSet::new();
    let mut rows = 0;
    for (index, step) in steps.iter().enumerate() {
        let Some((slot, position)) = sequence(step.seq) else {
            continue;
        };
        let first = seen.insert(step.seq);
        let len = step.tokens.len();
        if !first || !(1..=limits.rows).contains(&len) || !runnable(step, position) {
            continue;
        }
        let full = passes
            .last()
            .is_none_or(|p| p.len() >= limits.sequences || rows + len > limits.rows);
        if full {
            passes.push(Vec::new());
            rows = 0;
        }
        rows += len;
        passes.last_mut().expect("pushed above").push(PassStep {
            index,
            slot,
            position,
        });
    }
    passes
}
