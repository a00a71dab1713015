//! How many drafts a decode pass checks (`EngineOptions::draft_schedule`).
//!
//! A pass that checks k drafts yields on average E(k) = 1 + a₁ + a₁a₂ + … + a₁⋯a_k tokens, a_j
//! being the chance that draft j stands once those before it stood, and takes what passes with
//! k drafts took lately (k = 0: a plain step). The adaptive schedule picks the k with the most
//! tokens a second, 0 included: drafting backs off where the head is often wrong (late in a long
//! context, a hard passage) and stops where it cannot win (a backend whose verify rows cost as
//! much as steps), and comes back when the head does better. Output never depends on k: greedy
//! tokens are plain greedy decoding's and sampled ones keep their distribution whatever the
//! drafts (see `Scheduler::decode_with_drafts`); only the speed does.
//!
//! Acceptance is learnt per request (a code completion and a story differ), starting from what
//! the engine's recent requests saw; costs per engine (they are the backend's), measured on the
//! wall clock. Each length is tried once before any is chosen; a request's acceptance drifts
//! back towards the engine's between checks, so that a request that stopped drafting tries
//! again after a while; and every [`EXPLORE_EVERY`]th pass takes each position's acceptance one
//! standard error above its estimate, so that positions seldom checked (those past the length
//! chosen lately) get checked again. A length's cost is measured whenever it runs.

/// How the number of drafts a pass checks is chosen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DraftSchedule {
    /// The length with the most tokens a second by acceptance and cost so far, 0 to the
    /// maximum (`EngineOptions::draft_tokens`).
    #[default]
    Adaptive,
    /// Always the maximum (what is left of the request's tokens allowing).
    Fixed,
}

impl std::str::FromStr for DraftSchedule {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "adaptive" => Ok(DraftSchedule::Adaptive),
            "fixed" => Ok(DraftSchedule::Fixed),
            _ => Err(format!(
                "`{s}`: the draft schedule is `adaptive` or `fixed`"
            )),
        }
    }
}

/// The most drafts a pass checks (a GPU's verify pass holds 17 rows).
pub const MAX_DRAFT_TOKENS: usize = 16;
/// Every this many passes, the length chosen is the best by hopeful acceptances.
pub const EXPLORE_EVERY: u64 = 8;
/// What a draft position's acceptance is taken to be before anything is known of it.
const PRIOR_ACCEPTANCE: f64 = 0.5;
/// How many checks the prior (and, for a request, the engine's pooled acceptance) weighs.
const PRIOR_WEIGHT: f64 = 4.0;
/// A request's counts decay by this each pass (a window of ≈ 20 passes), the engine's pooled
/// counts by the slower one each pass that checks drafts.
const REQUEST_DECAY: f64 = 0.95;
const POOLED_DECAY: f64 = 0.98;
/// A new cost measurement's weight in its length's moving average.
const COST_WEIGHT: f64 = 0.25;

/// Decayed counts, per draft position, of the passes that checked it and of those where the
/// draft stood.
#[derive(Clone, Debug, Default)]
pub struct Acceptance {
    checked: Vec<f64>,
    stood: Vec<f64>,
}

impl Acceptance {
    /// A pass checked its first `checked` drafts, of which the first `stood` stood (a check
    /// stops at the first draft that does not; one that ends the request stops it too). What
    /// was known before weighs `decay` as much, at every position: a plain step (no checks)
    /// lets the estimates drift back to the prior, so that a request that stopped drafting
    /// tries again after a while.
    pub fn record(&mut self, checked: usize, stood: usize, decay: f64) {
        debug_assert!(stood <= checked);
        if self.checked.len() < checked {
            self.checked.resize(checked, 0.0);
            self.stood.resize(checked, 0.0);
        }
        for p in 0..self.checked.len() {
            self.checked[p] = self.checked[p] * decay + f64::from(p < checked);
            self.stood[p] = self.stood[p] * decay + f64::from(p < stood);
        }
    }

    /// Position `p`'s acceptance (0-based: the first draft is 0), `prior` weighing as
    /// [`PRIOR_WEIGHT`] checks.
    fn estimate(&self, p: usize, prior: f64) -> f64 {
        let checked = self.checked.get(p).copied().unwrap_or(0.0);
        let stood = self.stood.get(p).copied().unwrap_or(0.0);
        (stood + prior * PRIOR_WEIGHT) / (checked + PRIOR_WEIGHT)
    }
}

/// The engine's choice of draft lengths: costs of each length, and acceptance pooled over
/// requests.
#[derive(Clone, Debug)]
pub struct DraftLengths {
    schedule: DraftSchedule,
    max: usize,
    /// Seconds a pass with k drafts took lately (moving average).
    cost: Vec<Option<f64>>,
    /// Passes chosen so far.
    passes: u64,
    pooled: Acceptance,
}

impl DraftLengths {
    /// Up to `max` drafts a pass (no more than [`MAX_DRAFT_TOKENS`]).
    pub fn new(max: usize, schedule: DraftSchedule) -> DraftLengths {
        let max = max.min(MAX_DRAFT_TOKENS);
        DraftLengths {
            schedule,
            max,
            cost: vec![None; max + 1],
            passes: 0,
            pooled: Acceptance::default(),
        }
    }

    /// The drafts the next pass of a request with `acceptance` so far checks, at most `limit`
    /// (what is left of its tokens): 0 is a plain step.
    pub fn choose(&mut self, acceptance: &Acceptance, limit: usize) -> usize {
        let top = self.max.min(limit);
        if top == 0 || self.schedule == DraftSchedule::Fixed {
            return top;
        }
        self.passes += 1;
        // Each length once, the longest (the one asked for) first.
        if let Some(k) = (0..=top).rev().find(|&k| self.cost[k].is_none()) {
            return k;
        }
        // Now and then the length that would be best were each position's acceptance as high
        // as what is known of it allows: what is seldom checked gets checked again.
        let hopeful = self.passes % EXPLORE_EVERY == 0;
        self.best(acceptance, top, hopeful)
    }

    /// The length of `0..=top` (each measured) with the most tokens a second, by each
    /// position's estimated acceptance (`hopeful`: one standard error above it); the shorter of
    /// two equal ones.
    fn best(&self, acceptance: &Acceptance, top: usize, hopeful: bool) -> usize {
        let mut best = (0, f64::MIN);
        for k in 0..=top {
            let Some(cost) = self.cost[k] else { continue };
            let tokens = self.expected_tokens(acceptance, k, hopeful);
            let rate = tokens / cost.max(f64::MIN_POSITIVE);
            if rate > best.1 {
                best = (k, rate);
            }
        }
        best.0
    }

    /// E(k): tokens a pass with `k` drafts yields on average, for a request with `acceptance`
    /// (`hopeful`: each position's acceptance one standard error above its estimate).
    pub fn expected_tokens(&self, acceptance: &Acceptance, k: usize, hopeful: bool) -> f64 {
        let (mut sum, mut all_stood) = (1.0, 1.0);
        for p in 0..k {
            let a = self.acceptance(acceptance, p);
            all_stood *= if hopeful {
                let checks = acceptance.checked.get(p).copied().unwrap_or(0.0) + PRIOR_WEIGHT;
                (a + (a * (1.0 - a) / checks).sqrt()).min(1.0)
            } else {
                a
            };
            sum += all_stood;
        }
        sum
    }

    /// Draft position `p`'s acceptance for a request with `acceptance`: its own counts, the
    /// engine's pooled ones as their prior.
    pub fn acceptance(&self, acceptance: &Acceptance, p: usize) -> f64 {
        acceptance.estimate(p, self.pooled.estimate(p, PRIOR_ACCEPTANCE))
    }

    /// A pass with `k` drafts took `seconds`, and checked `checked` of them of which `stood`
    /// stood (a plain step: k = 0 and no checks).
    pub fn record(
        &mut self,
        acceptance: &mut Acceptance,
        k: usize,
        seconds: f64,
        checked: usize,
        stood: usize,
    ) {
        if let Some(cost) = self.cost.get_mut(k) {
            *cost = Some(match *cost {
                Some(c) => c + COST_WEIGHT * (seconds - c),
                None => seconds,
            });
        }
        acceptance.record(checked, stood, REQUEST_DECAY);
        // The engine's memory of the head fades only as it is checked.
        if checked > 0 {
            self.pooled.record(checked, stood, POOLED_DECAY);
        }
    }
}
