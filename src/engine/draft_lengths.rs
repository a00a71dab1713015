//! How many drafts a decode pass checks (`EngineOptions::draft_schedule`).
//!
//! A pass that checks k drafts yields on average E(k) = 1 + a₁ + a₁a₂ + … + a₁⋯a_k tokens, a_j
//! being the chance that draft j stands once those before it stood, and takes what passes with
//! k drafts took lately. The adaptive schedule picks, for a request decoding alone, the k with
//! the most tokens a second, 0 (a plain step) included: drafting backs off where the head is
//! often wrong (late in a long context, a hard passage) and stops where it cannot win (a
//! backend whose verify rows cost as much as steps), and comes back when the head does better.
//! A few requests decoding together either step together without drafts, or each checks its
//! best number of drafts in a pass of its own, one after another: whichever yields more
//! tokens a second. Output never depends on these choices: greedy tokens are plain greedy
//! decoding's and sampled ones keep their distribution whatever the drafts (see
//! `Scheduler::decode_with_drafts`); only the speed does.
//!
//! Acceptance is learnt per request (a code completion and a story differ), starting from what
//! the engine's recent requests saw; costs per engine (they are the backend's), measured on the
//! wall clock (a length's first run, which may pay for warming up, left out). Each length is
//! tried until its cost is known before any is chosen; a request's acceptance drifts
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
/// The most requests decoding together that may draft (each its own pass, one after another);
/// more step together without drafts.
pub const MAX_DRAFT_STREAMS: usize = 4;
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

/// The engine's choice of draft lengths: what passes cost, and acceptance pooled over requests.
#[derive(Clone, Debug)]
pub struct DraftLengths {
    schedule: DraftSchedule,
    max: usize,
    /// Seconds (moving averages) a drafted pass of one sequence took lately, by its drafts
    /// (index 0 unused), and a plain step of n sequences decoding together (index n).
    drafted: Vec<Cost>,
    plain: Vec<Cost>,
    /// Passes planned so far.
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
            drafted: vec![Cost::default(); max + 1],
            plain: vec![Cost::default(); MAX_DRAFT_STREAMS + 1],
            passes: 0,
            pooled: Acceptance::default(),
        }
    }

    /// The drafts the next pass of a request decoding alone checks: [`DraftLengths::plan`]
    /// for one.
    pub fn choose(&mut self, acceptance: &Acceptance, limit: usize) -> usize {
        self.plan(&[(acceptance, limit)])[0]
    }

    /// The next step of requests decoding together (each with its acceptance so far and the
    /// most drafts it leaves room for): all zeros, one plain step of all of them; else each
    /// one's drafts, checked in a pass of its own, one request after another. Drafting wins
    /// where the tokens those passes yield a second beat the plain step's: with a few
    /// requests and a head that is often right, or with one alone. More than
    /// [`MAX_DRAFT_STREAMS`] requests always step together.
    pub fn plan(&mut self, requests: &[(&Acceptance, usize)]) -> Vec<usize> {
        let n = requests.len();
        let tops: Vec<usize> = requests.iter().map(|r| self.max.min(r.1)).collect();
        let plain = vec![0; n];
        if n == 0 || n > MAX_DRAFT_STREAMS || tops.contains(&0) {
            return plain;
        }
        if self.schedule == DraftSchedule::Fixed {
            return tops;
        }
        self.passes += 1;
        // Each drafted length until its cost is known, the longest (the one asked for) first;
        // then the plain step.
        let top = tops.iter().copied().min().unwrap_or(0);
        if let Some(k) = (1..=top).rev().find(|&k| self.drafted[k].known().is_none()) {
            return vec![k; n];
        }
        let Some(step) = self.plain[n].known() else {
            return plain;
        };
        // Now and then by acceptances as high as what is known of them allows: what is seldom
        // checked (drafting at all, or positions past the lengths chosen lately) gets checked.
        let hopeful = self.passes % EXPLORE_EVERY == 0;
        let (mut tokens, mut seconds) = (0.0, 0.0);
        let mut ks = Vec::with_capacity(n);
        for (&(acceptance, _), &top) in requests.iter().zip(&tops) {
            let (k, e, cost) = self.best_drafted(acceptance, top, hopeful);
            ks.push(k);
            tokens += e;
            seconds += cost;
        }
        // The plain step where drafting is no better.
        if tokens * step > n as f64 * seconds {
            ks
        } else {
            plain
        }
    }

    /// The drafted length of `1..=top` (those measured) with the most tokens a second for a
    /// request with `acceptance`; its expected tokens and cost. The shorter of two equal ones.
    fn best_drafted(
        &self,
        acceptance: &Acceptance,
        top: usize,
        hopeful: bool,
    ) -> (usize, f64, f64) {
        let mut best = (0, 0.0, f64::INFINITY);
        for k in 1..=top {
            let Some(cost) = self.drafted[k].known() else {
                continue;
            };
            let tokens = self.expected_tokens(acceptance, k, hopeful);
            if tokens * best.2 > best.1 * cost {
                best = (k, tokens, cost);
            }
        }
        best
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

    /// A request's drafted pass with `k` drafts took `seconds`, and checked `checked` of them
    /// of which `stood` stood.
    pub fn record_drafted(
        &mut self,
        acceptance: &mut Acceptance,
        k: usize,
        seconds: f64,
        checked: usize,
        stood: usize,
    ) {
        if let Some(cost) = self.drafted.get_mut(k).filter(|_| k > 0) {
            cost.add(seconds);
        }
        acceptance.record(checked, stood, REQUEST_DECAY);
        // The engine's memory of the head fades only as it is checked.
        if checked > 0 {
            self.pooled.record(checked, stood, POOLED_DECAY);
        }
    }

    /// A plain step of the requests with these acceptances, decoding together, took `seconds`.
    pub fn record_plain(&mut self, acceptances: &mut [&mut Acceptance], seconds: f64) {
        if let Some(cost) = self.plain.get_mut(acceptances.len()) {
            cost.add(seconds);
        }
        for acceptance in acceptances {
            acceptance.record(0, 0, REQUEST_DECAY);
        }
    }
}

/// What passes of one kind cost lately: a moving average of their seconds.
#[derive(Clone, Copy, Debug, Default)]
struct Cost {
    seconds: f64,
    runs: u32,
}

impl Cost {
    /// Known from the second run on: the first of a kind may pay for warming up (memory
    /// allocated, code paged in), and a length that once looked dear might never run again.
    fn known(&self) -> Option<f64> {
        (self.runs >= 2).then_some(self.seconds)
    }

    fn add(&mut self, seconds: f64) {
        self.seconds = match self.runs {
            0 | 1 => seconds,
            _ => self.seconds + COST_WEIGHT * (seconds - self.seconds),
        };
        self.runs = self.runs.saturating_add(1);
    }
}
