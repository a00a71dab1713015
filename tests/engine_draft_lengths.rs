//! The choice of how many drafts a pass checks (src/engine/draft_lengths.rs), against
//! simulated heads and backends: each pass's drafts stand one after another with a given
//! chance, and a pass with k drafts costs what the simulated backend says.

mod common;

use common::Rng;
use lily::engine::draft_lengths::{Acceptance, DraftLengths, DraftSchedule, EXPLORE_EVERY};

/// A simulated request: the head's drafts stand with chance `acceptance` each (given those
/// before stood), a pass with k drafts costs `cost(k)` seconds.
struct Sim<'a> {
    lengths: DraftLengths,
    request: Acceptance,
    rng: Rng,
    cost: &'a dyn Fn(usize) -> f64,
}

impl Sim<'_> {
    fn new<'a>(max: usize, schedule: DraftSchedule, cost: &'a dyn Fn(usize) -> f64) -> Sim<'a> {
        Sim {
            lengths: DraftLengths::new(max, schedule),
            request: Acceptance::default(),
            rng: Rng::new("draft lengths"),
            cost,
        }
    }

    /// One pass: the length chosen, then what it gave recorded. Returns the length.
    fn pass(&mut self, acceptance: f64, limit: usize) -> usize {
        let k = self.lengths.choose(&self.request, limit);
        let mut stood = 0;
        while stood < k && self.rng.uniform() < acceptance {
            stood += 1;
        }
        // The check stops at the first draft that does not stand.
        let checked = (stood + 1).min(k);
        let seconds = (self.cost)(k);
        if k == 0 {
            self.lengths.record_plain(&mut [&mut self.request], seconds);
        } else {
            (self.lengths).record_drafted(&mut self.request, k, seconds, checked, stood);
        }
        k
    }

    /// `n` passes; how often each length was chosen.
    fn passes(&mut self, n: usize, acceptance: f64) -> Vec<usize> {
        let mut seen = vec![0; 17];
        for _ in 0..n {
            seen[self.pass(acceptance, usize::MAX)] += 1;
        }
        seen
    }
}

/// The length with the most tokens a second for acceptance `a` and costs `cost`, by formula.
fn best(a: f64, max: usize, cost: &dyn Fn(usize) -> f64) -> usize {
    let rate = |k: usize| (0..=k).map(|j| a.powi(j as i32)).sum::<f64>() / cost(k);
    (0..=max)
        .max_by(|&x, &y| rate(x).total_cmp(&rate(y)))
        .unwrap()
}

#[test]
fn the_fixed_schedule_checks_every_draft_the_request_leaves_room_for() {
    let cost = |k: usize| 1.0 + k as f64;
    let mut sim = Sim::new(3, DraftSchedule::Fixed, &cost);
    for _ in 0..50 {
        assert_eq!(sim.pass(0.0, usize::MAX), 3, "drafts that never stand");
    }
    assert_eq!(sim.pass(0.9, 2), 2);
    assert_eq!(sim.pass(0.9, 0), 0);
    // More than a pass can hold is held to the most it can.
    let mut many = DraftLengths::new(100, DraftSchedule::Fixed);
    assert_eq!(many.choose(&Acceptance::default(), usize::MAX), 16);
}

/// Each length runs twice (its first run may pay for warming up) before any is chosen, the
/// longest first; a first run ten times dearer than the others does not keep a length away.
#[test]
fn each_length_is_tried_until_its_cost_is_known_the_longest_first() {
    let cost = |k: usize| 1.0 + 0.1 * k as f64;
    let mut sim = Sim::new(3, DraftSchedule::Adaptive, &cost);
    let first: Vec<usize> = (0..8).map(|_| sim.pass(0.8, usize::MAX)).collect();
    assert_eq!(first, [3, 3, 2, 2, 1, 1, 0, 0]);
    let runs = std::cell::Cell::new(0);
    let cold = |k: usize| {
        runs.set(runs.get() + 1);
        let warm = if runs.get() == 1 { 10.0 } else { 1.0 };
        warm * (1.0 + 0.1 * k as f64)
    };
    let mut sim = Sim::new(3, DraftSchedule::Adaptive, &cold);
    let seen = sim.passes(100, 0.95);
    assert!(seen[3] >= 80, "{seen:?}");
    // A request near its end: only lengths it leaves room for.
    let mut sim = Sim::new(3, DraftSchedule::Adaptive, &cost);
    for _ in 0..40 {
        assert!(sim.pass(0.8, 1) <= 1);
    }
}

/// Over costs shaped as the H200's (verify rows cheap after the second) and as a backend
/// whose rows cost as much as steps, and acceptances from none to nearly all: the length
/// chosen most is the one that the formula says is best, and the tokens a second are within a
/// tenth of always choosing it (what learning the acceptance and retrying costs; 15 % where
/// the best is within 10 % of another).
#[test]
fn the_length_chosen_is_the_one_with_the_most_tokens_a_second() {
    let gpu = |k: usize| if k == 0 { 1.0 } else { 1.55 + 0.12 * k as f64 };
    let linear = |k: usize| 1.0 + 1.1 * k as f64;
    let mid = |k: usize| 1.0 + 0.35 * k as f64;
    let cases: [(&dyn Fn(usize) -> f64, f64); 10] = [
        (&mid, 0.5),
        (&mid, 0.7),
        (&gpu, 0.0),
        (&gpu, 0.3),
        (&gpu, 0.6),
        (&gpu, 0.85),
        (&gpu, 0.95),
        (&linear, 0.0),
        (&linear, 0.5),
        (&linear, 0.99),
    ];
    for (cost, a) in cases {
        let want = best(a, 4, cost);
        let mut sim = Sim::new(4, DraftSchedule::Adaptive, cost);
        sim.passes(20, a);
        let seen = sim.passes(400, a);
        let chosen = (0..=4).max_by_key(|&k| seen[k]).unwrap();
        println!("a {a}: chosen {seen:?}, best {want}");
        // Where the best length is clearly the best, it is the one chosen most.
        let rate = |k: usize| (0..=k).map(|j| a.powi(j as i32)).sum::<f64>() / cost(k);
        let runner_up = (0..=4).filter(|&k| k != want).map(rate).fold(0.0, f64::max);
        if rate(want) > 1.1 * runner_up {
            assert_eq!(chosen, want, "acceptance {a}: {seen:?}");
        }
        // Tokens a second over those passes, against always the best length.
        let expected = |k: usize| (0..=k).map(|j| a.powi(j as i32)).sum::<f64>();
        let (tokens, seconds) = (0..=4).fold((0.0, 0.0), |(t, s), k| {
            (
                t + seen[k] as f64 * expected(k),
                s + seen[k] as f64 * cost(k),
            )
        });
        let rate = tokens / seconds;
        let ideal = expected(want) / cost(want);
        // Where two lengths are near ties, telling them apart takes more passes than it gains.
        let bound = if ideal > 1.1 * runner_up { 0.9 } else { 0.85 };
        assert!(
            rate >= bound * ideal,
            "acceptance {a}: {rate:.3} tokens a second against {ideal:.3}"
        );
    }
}

/// A head that turns bad (a long context, a hard passage) is soon left, and taken up again
/// once it is good, by the same request.
#[test]
fn drafting_backs_off_when_drafts_fail_and_comes_back_when_they_stand() {
    let gpu = |k: usize| if k == 0 { 1.0 } else { 1.55 + 0.12 * k as f64 };
    let mut sim = Sim::new(3, DraftSchedule::Adaptive, &gpu);
    let good = sim.passes(100, 0.9);
    assert!(good[3] >= 80, "a good head: {good:?}");
    // Bad: within a few passes, plain steps but for the now-and-then retries (a few failed
    // passes each, while the request's acceptance drifts back to the engine's).
    sim.passes(6, 0.0);
    let bad = sim.passes(200, 0.0);
    assert!(bad[0] >= 150, "a failing head: {bad:?}");
    // Good again: drafting resumes within a few exploration rounds.
    let back = sim.passes(3 * EXPLORE_EVERY as usize, 0.9);
    let again = sim.passes(100, 0.9);
    println!("good {good:?}, bad {bad:?}, back {back:?}, again {again:?}");
    assert!(again[3] >= 80, "the good head again: {again:?}");
}

/// A new request starts from what the engine's earlier requests saw of the head: after many
/// requests whose drafts stood, the next one drafts from its first passes, and after many
/// whose drafts failed, it does not.
#[test]
fn a_new_request_starts_from_the_acceptance_earlier_ones_saw() {
    let gpu = |k: usize| if k == 0 { 1.0 } else { 1.55 + 0.12 * k as f64 };
    for (a, drafts) in [(0.95, true), (0.0, false)] {
        let mut sim = Sim::new(3, DraftSchedule::Adaptive, &gpu);
        for _ in 0..10 {
            sim.request = Acceptance::default();
            sim.passes(30, a);
        }
        sim.request = Acceptance::default();
        // Not a pass that explores (every EXPLORE_EVERY-th).
        let k = sim.lengths.choose(&sim.request, usize::MAX);
        assert_eq!(k > 0, drafts, "acceptance {a}: chose {k}");
        assert!((sim.lengths.acceptance(&sim.request, 0) - a).abs() < 0.2);
    }
}

/// Requests decoding together: drafting each in a pass of its own, one after another, against
/// one plain step of all, with costs shaped as the H200's (a step of 2 rows costs half a step
/// more than one, 4 rows little more than 2: bench/NOTES.md v1.78). Two requests with a good
/// head draft; four step together (their plain step yields more a second than four drafted
/// passes); more than MAX_DRAFT_STREAMS never draft; a request with no room for a draft
/// keeps all of them stepping together.
#[test]
fn requests_decoding_together_draft_only_where_their_passes_beat_the_shared_step() {
    let drafted = |k: usize| 1.55 + 0.12 * k as f64;
    let plain = |n: usize| [0.0, 1.0, 1.5, 1.65, 1.7, 1.75][n];
    let mut rng = Rng::new("requests decoding together");
    // (requests, acceptance, drafted passes expected mostly)
    for (n, a, drafts) in [
        (2, 0.9, true),
        (2, 0.0, false),
        (4, 0.9, false),
        (3, 1.0, true),
    ] {
        let mut lengths = DraftLengths::new(3, DraftSchedule::Adaptive);
        let mut requests = vec![Acceptance::default(); n];
        let mut drafted_steps = 0;
        for step in 0..300 {
            let asked: Vec<(&Acceptance, usize)> = requests.iter().map(|r| (r, 100)).collect();
            let ks = lengths.plan(&asked);
            assert!(
                ks.iter().all(|&k| k > 0) || ks.iter().all(|&k| k == 0),
                "{ks:?}"
            );
            if ks[0] == 0 {
                let mut all: Vec<&mut Acceptance> = requests.iter_mut().collect();
                lengths.record_plain(&mut all, plain(n));
                continue;
            }
            drafted_steps += usize::from(step >= 50);
            for (r, &k) in requests.iter_mut().zip(&ks) {
                let mut stood = 0;
                while stood < k && rng.uniform() < a {
                    stood += 1;
                }
                lengths.record_drafted(r, k, drafted(k), (stood + 1).min(k), stood);
            }
        }
        println!("{n} requests, acceptance {a}: {drafted_steps} of 250 steps drafted");
        if drafts {
            assert!(drafted_steps >= 200, "{n} requests at {a}: {drafted_steps}");
        } else {
            assert!(drafted_steps <= 50, "{n} requests at {a}: {drafted_steps}");
        }
    }
    let mut lengths = DraftLengths::new(3, DraftSchedule::Adaptive);
    let fresh = Acceptance::default();
    let many: Vec<(&Acceptance, usize)> = vec![(&fresh, 100); 5];
    assert_eq!(lengths.plan(&many), [0; 5]);
    let mut fixed = DraftLengths::new(3, DraftSchedule::Fixed);
    assert_eq!(fixed.plan(&many), [0; 5]);
    assert_eq!(fixed.plan(&many[..3]), [3; 3]);
    assert_eq!(fixed.plan(&[(&fresh, 2), (&fresh, 100)]), [2, 3]);
    assert_eq!(fixed.plan(&[(&fresh, 0), (&fresh, 100)]), [0, 0]);
}
