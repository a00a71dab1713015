//! Grouping a batch's steps into shared passes (src/model/passes.rs), on random batches: every
//! step that may share a pass is in one, in order, within the limits, each sequence at most once,
//! and a pass closes only when the next step would not fit.

use std::collections::{HashMap, HashSet};

use lily::model::passes::{plan, PassLimits};
use lily::model::{SeqId, Step};
use rand::RngExt;

#[test]
fn random_batches_are_planned_in_order_within_the_limits() {
    let mut rng = rand::rng();
    for round in 0..500 {
        let limits = PassLimits {
            rows: rng.random_range(1..64),
            sequences: rng.random_range(1..10),
        };
        // Sequences 0..16 exist (slot, position); 16..20 do not.
        let known: HashMap<SeqId, (usize, usize)> = (0..16)
            .map(|s| (s, (rng.random_range(0..32), rng.random_range(0..1000))))
            .collect();
        let n = rng.random_range(0..40);
        let tokens: Vec<Vec<u32>> = (0..n)
            .map(|_| vec![7; rng.random_range(0..limits.rows + 4)])
            .collect();
        let seqs: Vec<SeqId> = (0..n).map(|_| rng.random_range(0..20)).collect();
        let refused: HashSet<usize> = (0..n).filter(|_| rng.random_range(0..6) == 0).collect();
        let steps: Vec<Step> = (0..n)
            .map(|i| Step {
                seq: seqs[i],
                tokens: &tokens[i],
                sample: None,
            })
            .collect();
        let index_of = |step: &Step| {
            steps
                .iter()
                .position(|s| std::ptr::eq(s, step))
                .expect("one of the steps")
        };
        let passes = plan(
            &steps,
            limits,
            |seq| known.get(&seq).copied(),
            |step, position| {
                let i = index_of(step);
                assert_eq!(Some(position), known.get(&step.seq).map(|k| k.1));
                !refused.contains(&i)
            },
        );
        // What may share a pass: a known sequence's first step, 1..=rows tokens, not refused.
        let mut firsts = HashSet::new();
        let eligible: Vec<usize> = (0..n)
            .filter(|&i| known.contains_key(&seqs[i]) && firsts.insert(seqs[i]))
            .filter(|&i| (1..=limits.rows).contains(&tokens[i].len()) && !refused.contains(&i))
            .collect();
        let planned: Vec<usize> = passes.iter().flatten().map(|p| p.index).collect();
        assert_eq!(planned, eligible, "round {round}: {limits:?}");
        for (k, pass) in passes.iter().enumerate() {
            let rows: usize = pass.iter().map(|p| tokens[p.index].len()).sum();
            assert!(!pass.is_empty(), "round {round}: an empty pass");
            assert!(
                pass.len() <= limits.sequences && rows <= limits.rows,
                "round {round}"
            );
            for p in pass {
                assert_eq!((p.slot, p.position), known[&seqs[p.index]], "round {round}");
            }
            // A pass closes only when the next step would not fit.
            if let Some(next) = passes.get(k + 1) {
                let len = tokens[next[0].index].len();
                assert!(
                    pass.len() == limits.sequences || rows + len > limits.rows,
                    "round {round}: pass {k} closed with room for the next step"
                );
            }
        }
    }
}

/// A sequence whose first step cannot share a pass keeps its later steps out too.
#[test]
fn a_later_step_never_overtakes_the_first() {
    let (long, short) = (vec![1u32; 10], vec![1u32; 1]);
    let steps = [
        Step {
            seq: 5,
            tokens: &long,
            sample: None,
        },
        Step {
            seq: 5,
            tokens: &short,
            sample: None,
        },
        Step {
            seq: 6,
            tokens: &short,
            sample: None,
        },
    ];
    let limits = PassLimits {
        rows: 8,
        sequences: 4,
    };
    let passes = plan(&steps, limits, |seq| Some((seq as usize, 0)), |_, _| true);
    let planned: Vec<usize> = passes.iter().flatten().map(|p| p.index).collect();
    assert_eq!(planned, vec![2]);
}
