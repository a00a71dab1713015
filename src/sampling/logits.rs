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

/// The `n` most likely of `keys` into `top`, most likely first. For a few (logprobs' up to 20
/// alternatives) in one pass: a key goes in only if it beats the `n`-th kept so far, one
/// comparison for almost every key of 248K (keys are distinct: the token id is part of each);
/// for many, by partial selection.
pub(super) fn top_keys(keys: impl Iterator<Item = RankKey>, n: usize, top: &mut Vec<RankKey>) {
    top.clear();
    if n == 0 {
        return;
    }
    if n > 64 {
        top.extend(keys);
        if n < top.len() {
            top.select_nth_unstable(n - 1);
            top.truncate(n);
        }
        top.sort_unstable();
        return;
    }
    for key in keys {
        if top.len() == n {
            if key >= top[n - 1] {
                continue;
            }
            top.pop();
        }
        let at = top.partition_point(|&k| k < key);
        top.insert(at, key);
    }
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

    /// The token a draw at `u` picks: [`draw`] over [`distribution`](Self::distribution), bit
    /// for bit. Without top-k and top-p the candidates stay in token order, so their weights are
    /// summed and walked in place instead of ranked and collected (a temperature-only step over
    /// the model's 248K logits: 3.1 → 1.5 ms on one core of the build machine). `cands` and
    /// `weights` are scratch.
    pub(super) fn draw(
        &self,
        work: &[f32],
        u: f64,
        cands: &mut Vec<RankKey>,
        weights: &mut Vec<f64>,
    ) -> u32 {
        if self.top_k.is_some() || self.top_p < 1.0 {
            return draw(&self.distribution(work, cands), u);
        }
        // What `select` keeps without top-k and top-p: the finite logits at or above the min-p
        // floor, in token order; `softmax_over`'s maximum over them is the maximum of `work`.
        let l_max = work.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let threshold = self.min_p_threshold(l_max);
        let kept = |l: f32| l > f32::NEG_INFINITY && l >= threshold;
        weights.clear();
        weights.extend(
            work.iter()
                .filter(|&&l| kept(l))
                .map(|&l| softmax_weight(l, l_max, self.temperature)),
        );
        let total: f64 = weights.iter().sum();
        // `draw` over (token, weight / total), the same divisions and additions in the same order.
        let mut acc = 0.0;
        let mut last = 0;
        let tokens = work.iter().zip(0u32..).filter(|&(&l, _)| kept(l));
        for ((_, token), &w) in tokens.zip(weights.iter()) {
            acc += w / total;
            if u < acc {
                return token;
            }
            last = token;
        }
        last
    }

    /// min-p keeps p_i >= min_p * p_max: l_i >= l_max + T * ln(min_p) (none when off).
    fn min_p_threshold(&self, l_max: f32) -> f32 {
        if self.min_p > 0.0 {
            l_max + self.temperature * self.min_p.ln()
        } else {
            f32::NEG_INFINITY
        }
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
        let threshold = self.min_p_threshold(l_max);
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
