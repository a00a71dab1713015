//! Speculative sampling with drafts of one token each (the MTP head drafts its argmax): the
//! rule that keeps the tokens' distribution exactly the target's (Leviathan et al. 2023, with a
//! draft distribution that puts all its mass on the draft).

use super::logits::draw;

/// Whether `draft` stands where `distribution` (the target's, probabilities summing to 1) is
/// to be sampled, at the uniform draw `u` ∈ [0, 1): it stands with probability p(draft); else
/// the token in its place is drawn from p without the draft, renormalised. Over `u` the result
/// is distributed as p, whatever the draft. Greedy is the case of one token of probability 1.
pub fn check_draft(distribution: &[(u32, f64)], draft: u32, u: f64) -> Result<(), u32> {
    let (keep, replace) = split_uniform(u);
    let p = distribution
        .iter()
        .find(|&&(t, _)| t == draft)
        .map_or(0.0, |&(_, p)| p);
    if keep < p {
        return Ok(());
    }
    let rest: Vec<(u32, f64)> = distribution
        .iter()
        .copied()
        .filter(|&(t, _)| t != draft)
        .collect();
    let mass: f64 = rest.iter().map(|&(_, p)| p).sum();
    if mass <= 0.0 {
        // Only reachable by rounding (p(draft) ≈ 1): the draft it is.
        return Ok(());
    }
    let scaled: Vec<(u32, f64)> = rest.into_iter().map(|(t, p)| (t, p / mass)).collect();
    Err(draw(&scaled, replace))
}

/// Two independent uniforms from one of 53 random bits: its top 26 bits and its low 27.
fn split_uniform(u: f64) -> (f64, f64) {
    let bits = (u.clamp(0.0, 1.0) * (1u64 << 53) as f64) as u64 & ((1 << 53) - 1);
    let high = (bits >> 27) as f64 / (1u64 << 26) as f64;
    let low = (bits & ((1 << 27) - 1)) as f64 / (1u64 << 27) as f64;
    (high, low)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_uniforms_are_in_range() {
        for u in [0.0, 1e-300, 0.25, 0.5, 0.999_999_999, 1.0 - f64::EPSILON] {
            let (a, b) = split_uniform(u);
            assert!(
                (0.0..1.0).contains(&a) && (0.0..1.0).contains(&b),
                "{u}: {a} {b}"
            );
        }
    }
}
