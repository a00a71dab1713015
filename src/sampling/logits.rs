//! The logit arithmetic both samplers share: sanitising, ranking, the penalties, temperature and
//! the min-p / top-k / top-p filters, and the inverse-CDF draw.

/// NaN would poison every comparison, so a NaN logit becomes -inf (never chosen); +inf becomes the
/// largest finite value so that softmax arithmetic stays finite.
pub(super) fn sanitize(logit: f32) -> f32 {
    if logit.is_nan() {
        f32::NEG_INFINITY
    } else {
        logit.min(f32::MAX)
    }
}

/// Index of the largest value; the lowest index wins ties so greedy decoding is deterministic.
pub(super) fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best as u32
}

/// A candidate token packed into one integer whose ascending order is "more likely first":
/// the logit's bits (arranged so integer order is `f32::total_cmp` order, then inverted so larger
/// logits come first) above the token id (lower id first on ties). Selecting and sorting plain
/// integers is several times faster than comparing through the logits array, and the order is
/// total, so results never depend on the algorithm's tie handling.
pub(super) type RankKey = u64;

pub(super) fn rank_key(logit: f32, token: u32) -> RankKey {
    let bits = logit.to_bits() as i32;
    // Negative floats order backwards as integers: flipping all but the sign bit fixes that.
    let ordered = (bits ^ ((((bits >> 31) as u32) >> 1) as i32)) as u32 ^ 0x8000_0000;
    (u64::from(!ordered) << 32) | u64::from(token)
}

pub(super) fn key_token(key: RankKey) -> u32 {
    key as u32
}

/// Keep the `n` most likely keys of `keys`, most likely first.
pub(super) fn keep_top(keys: &mut Vec<RankKey>, n: usize) {
    if n == 0 {
        keys.clear();
        return;
    }
    if n < keys.len() {
        keys.select_nth_unstable(n - 1);
        keys.truncate(n);
    }
    keys.sort_unstable();
}

/// The penalties of one request (vLLM's semantics; 1, 0, 0 switch them off).
pub(super) struct Penalties {
    pub(super) repetition: f32,
    pub(super) frequency: f32,
    pub(super) presence: f32,
}

impl Penalties {
    /// Apply the penalties to `work` for every (token, output count) of `history` (see
    /// [`Sampler`]): repetition first, then frequency and presence. sample.cu does the same
    /// arithmetic in the same order (f32, no fused multiply-add), so both samplers agree bit for bit.
    ///
    /// [`Sampler`]: super::Sampler
    pub(super) fn apply(&self, work: &mut [f32], history: &[(u32, u32)]) {
        let repeat = self.repetition != 1.0;
        let count_based = self.frequency != 0.0 || self.presence != 0.0;
        if !repeat && !count_based {
            return;
        }
        for &(token, count) in history {
            let Some(l) = work.get_mut(token as usize) else {
                continue;
            };
            if repeat {
                // HF / vLLM: shrink positive logits, push negative ones further down.
                *l = if *l > 0.0 {
                    *l / self.repetition
                } else {
                    *l * self.repetition
                };
            }
            if count_based && count > 0 {
                // OpenAI: mu[j] -= c[j] * alpha_frequency + (c[j] > 0) * alpha_presence.
                *l -= count as f32 * self.frequency + self.presence;
            }
        }
    }
}

/// Temperature and the three filters, applied to penalised logits.
pub(super) struct Filters {
    pub(super) temperature: f32,
    pub(super) min_p: f32,
    pub(super) top_k: Option<usize>,
    pub(super) top_p: f32,
}

impl Filters {
    /// The candidates and their probabilities, in ascending token order (the order a draw walks:
    /// the device sampler can walk it without sorting). `cands` is scratch.
    pub(super) fn distribution(&self, work: &[f32], cands: &mut Vec<RankKey>) -> Vec<(u32, f64)> {
        self.select(work, cands);
        if self.top_k.is_some() || self.top_p < 1.0 {
            // Selection reordered them; min-p alone keeps the vocabulary's order.
            cands.sort_unstable_by_key(|&k| key_token(k));
        }
        let probs = softmax_over(work, cands, self.temperature);
        cands.iter().map(|&k| key_token(k)).zip(probs).collect()
    }

    /// Fill `out` with the tokens that survive min-p, then top-k, then top-p — vLLM's order
    /// (min-p is an "argmax-invariant logits processor" applied before its top-k/top-p sampler).
    ///
    /// All three are decided on logits, never on a full softmax, so a step costs O(vocab) plus a
    /// sort of only the tokens top-p has to look at:
    /// * min-p keeps p_i >= min_p * p_max, i.e. l_i >= l_max + T * ln(min_p) in logit space.
    /// * top-k keeps every token whose logit is >= the k-th largest (ties at the boundary all
    ///   stay, as in vLLM and HF), found by partial selection.
    /// * top-p keeps the most likely tokens (ties: lower id first) until the mass *before* a token
    ///   reaches top_p (the token that crosses the line stays), renormalised over what min-p and
    ///   top-k left.
    fn select(&self, logits: &[f32], out: &mut Vec<RankKey>) {
        let l_max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let threshold = if self.min_p > 0.0 {
            l_max + self.temperature * self.min_p.ln()
        } else {
            f32::NEG_INFINITY
        };
        out.clear();
        out.extend(
            logits
                .iter()
                .zip(0u32..)
                .filter(|&(&l, _)| l > f32::NEG_INFINITY && l >= threshold)
                .map(|(&l, t)| rank_key(l, t)),
        );

        if let Some(k) = self.top_k {
            if k < out.len() {
                out.select_nth_unstable(k - 1);
                // The upper half of a key is the logit: keep everything tied with the k-th.
                let kth_logit = out[k - 1] >> 32;
                out.retain(|&key| key >> 32 <= kth_logit);
            }
        }

        if self.top_p < 1.0 {
            truncate_top_p(logits, self.temperature, self.top_p, out);
        }
    }
}

/// Inverse-CDF draw: the first token of `distribution` (in its order) whose cumulative
/// probability exceeds `u` (uniform in [0, 1)). Both samplers draw this way, with `u` from the
/// request's RNG, so a seed picks the same token on either.
pub fn draw(distribution: &[(u32, f64)], u: f64) -> u32 {
    let mut acc = 0.0;
    for &(token, p) in distribution {
        acc += p;
        if u < acc {
            return token;
        }
    }
    // Rounding can leave the total a hair below 1; the last candidate takes the remainder.
    distribution.last().map_or(0, |&(t, _)| t)
}

/// Keep the nucleus of `cands` (reordered most likely first). Sorting all 248K tokens would be
/// wasteful when the nucleus is a few dozen, so sort a growing prefix found by partial selection
/// until it holds enough mass.
fn truncate_top_p(logits: &[f32], temperature: f32, top_p: f32, cands: &mut Vec<RankKey>) {
    if cands.is_empty() {
        return;
    }
    let logit = |key: RankKey| logits[key_token(key) as usize];
    let l_max = cands
        .iter()
        .map(|&k| logit(k))
        .fold(f32::NEG_INFINITY, f32::max);
    let weight = |key: RankKey| softmax_weight(logit(key), l_max, temperature);
    let total: f64 = cands.iter().map(|&k| weight(k)).sum();
    let target = top_p as f64 * total;

    let mut prefix = 256.min(cands.len());
    loop {
        if prefix < cands.len() {
            cands.select_nth_unstable(prefix - 1);
        }
        cands[..prefix].sort_unstable();
        let mut before = 0.0;
        for i in 0..prefix {
            if before >= target {
                cands.truncate(i);
                return;
            }
            before += weight(cands[i]);
        }
        if prefix == cands.len() {
            return; // everything is needed
        }
        prefix = (prefix * 4).min(cands.len());
    }
}

/// exp((l - l_max) / T): an unnormalised softmax weight, in f64 so long tails add up accurately.
fn softmax_weight(logit: f32, l_max: f32, temperature: f32) -> f64 {
    (((logit - l_max) / temperature) as f64).exp()
}

fn softmax_over(logits: &[f32], cands: &[RankKey], temperature: f32) -> Vec<f64> {
    let logit = |key: RankKey| logits[key_token(key) as usize];
    let l_max = cands
        .iter()
        .map(|&k| logit(k))
        .fold(f32::NEG_INFINITY, f32::max);
    let weights: Vec<f64> = cands
        .iter()
        .map(|&k| softmax_weight(logit(k), l_max, temperature))
        .collect();
    let total: f64 = weights.iter().sum();
    weights.into_iter().map(|w| w / total).collect()
}
