//! How many key splits attn_prefill_wgmma runs a chunk in (attention_wgmma.cu).
//!
//! A block of the kernel takes 16 tokens × the 8 query heads of one KV head and streams every key
//! its rows see; one block fits an SM. A turn of a few thousand new tokens after a long cached
//! prefix makes blocks of nearly equal length, so the grid runs in whole waves: 2,330 tokens are
//! 292 blocks, 2.2 waves of 132 SMs run as 3, the last one 79 % idle. Splitting every block's keys
//! in `s` chunks makes `s` times as many, shorter blocks (4.4 → 5 waves at s = 2, 6.6 → 7 at 3)
//! at the cost of writing and merging partial results (attn_combine).
//!
//! [`choose`] simulates the launch for each `s`: blocks dispatched in grid order to the first
//! free SM, a block's time its key tiles plus a fixed start and end, and the merge's memory
//! traffic; it picks the cheapest. Chunks that start at position 0 have blocks of every length
//! (the causal triangle, longest first), which already fill the waves, so they stay whole.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Keys per tile of attn_prefill_wgmma (WG_TILE) and tokens per block (WG_TOKENS).
const TILE: usize = 64;
const TOKENS: usize = 16;
/// KV heads: the grid's y.
const KV_HEADS: usize = 2;
/// The most splits considered: beyond 4 the waves are already ≥ 90 % full for any block count
/// above one wave.
pub const MAX_SPLITS: usize = 4;
/// A block's fixed cost in tile times: its queries' copy (64 KB), the pipeline's fill, the
/// epilogue's stores (an estimate; the tile itself ≈ 2.4 µs on an H100).
const BLOCK_START_TILES: f64 = 4.0;
/// The merge's cost in tile times per (token, head, split) entry: 1 KB of fp32 partial sums
/// written by the blocks and read back by attn_combine_few, at ≈ 3 TB/s against a tile's ≈ 2.1–2.4
/// µs (≈ 7 MB per tile time), plus its launch. On an H100 (bench/NOTES.md v1.83) 2,330 tokens
/// after 28K took 3.00 ms a layer whole and 2.36–2.40 ms in 3 splits, where the waves alone
/// predict ≈ 2.4 ms: the merge of 112K entries is ≤ 0.05 ms, within this estimate (with
/// attn_combine it was ≈ 0.25 ms).
const MERGE_TILES_PER_ENTRY: f64 = 2048.0 / 7.2e6;
const MERGE_LAUNCH_TILES: f64 = 4.0;
/// A split must beat whole blocks by this share of their cost: a partial wave's blocks run
/// faster than a full wave's (less traffic beside them), which the model leaves out, so small
/// predicted gains may be none.
const MARGIN: f64 = 0.05;

/// `(splits, chunk)` for a chunk of `tokens` new tokens after `start` cached ones on `sms` SMs,
/// where the partial buffers hold `max_rows` (token, split) rows: split z takes keys
/// `z·chunk .. (z+1)·chunk`, chunk a multiple of 64; `(1, start + tokens)` when whole blocks are
/// the cheapest.
pub fn choose(tokens: usize, start: usize, sms: usize, max_rows: usize) -> (usize, usize) {
    let kv = start + tokens;
    let whole = makespan(tokens, start, sms, 1, kv);
    let mut best = (whole * (1.0 - MARGIN), (1, kv));
    for wanted in 2..=MAX_SPLITS {
        let (splits, chunk) = chunks(kv, wanted);
        if splits < 2 || tokens * splits > max_rows {
            continue;
        }
        let cost = makespan(tokens, start, sms, splits, chunk)
            + MERGE_LAUNCH_TILES
            + (tokens * 16 * splits) as f64 * MERGE_TILES_PER_ENTRY;
        if cost < best.0 {
            best = (cost, (splits, chunk));
        }
    }
    best.1
}

/// `kv` keys in about `wanted` chunks of whole tiles: `(splits, chunk)`, splits ≤ wanted.
pub fn chunks(kv: usize, wanted: usize) -> (usize, usize) {
    let chunk = kv.div_ceil(wanted.max(1)).next_multiple_of(TILE);
    (kv.div_ceil(chunk), chunk)
}

/// Tile times until the last block of the grid ends: blocks in launch order (x fastest, the
/// kernel taking x from the last 16 tokens down), each to the SM that frees first.
fn makespan(tokens: usize, start: usize, sms: usize, splits: usize, chunk: usize) -> f64 {
    let nx = tokens.div_ceil(TOKENS);
    // Free times in tile units, ×4 to keep the heap on integers (the start cost is 4 tiles).
    let mut free: BinaryHeap<Reverse<u64>> = (0..sms.max(1)).map(|_| Reverse(0)).collect();
    let mut end = 0u64;
    for z in 0..splits {
        for _ in 0..KV_HEADS {
            for x in 0..nx {
                let t0 = (nx - 1 - x) * TOKENS;
                let kv_len = start + (t0 + TOKENS).min(tokens);
                let k0 = z * chunk;
                if k0 >= kv_len {
                    continue; // the block exits at once
                }
                let k1 = if splits == 1 {
                    kv_len
                } else {
                    (k0 + chunk).min(kv_len)
                };
                let cost = (k1 - k0).div_ceil(TILE) as f64 + BLOCK_START_TILES;
                let Reverse(at) = free.pop().expect("at least one SM");
                let done = at + (cost * 4.0) as u64;
                end = end.max(done);
                free.push(Reverse(done));
            }
        }
    }
    end as f64 / 4.0
}

#[cfg(test)]
mod tests {
    use super::*;

    const H100_SMS: usize = 132;

    #[test]
    fn a_turn_after_a_long_prefix_is_split() {
        // 292 equal blocks: 3 waves for 2.2 waves' work; 3 splits make 6.6 of 7.
        let (splits, chunk) = choose(2330, 28_000, H100_SMS, 8192);
        assert_eq!(splits, 3, "chunk {chunk}");
        assert_eq!(chunk % TILE, 0);
        assert!(splits * chunk >= 30_330 && (splits - 1) * chunk < 30_330);
        // The partial buffers bound the splits: 2 fit 2 × 2,330 rows, 3 do not.
        assert_eq!(choose(2330, 28_000, H100_SMS, 2 * 2330).0, 2);
        assert_eq!(choose(2330, 28_000, H100_SMS, 2329).0, 1);
    }

    #[test]
    fn a_turn_after_a_short_prefix_stays_whole() {
        // After 2K cached tokens the blocks still differ in length by 2×: they fill the waves.
        assert_eq!(choose(2330, 2000, H100_SMS, 8192).0, 1);
        assert_eq!(choose(2330, 100, H100_SMS, 8192).0, 1);
    }

    #[test]
    fn chunks_from_position_zero_stay_whole() {
        // The causal triangle's blocks of every length fill the waves by themselves.
        for tokens in [2048, 4096, 8192] {
            assert_eq!(choose(tokens, 0, H100_SMS, 8192), (1, tokens), "{tokens}");
        }
    }

    #[test]
    fn whole_waves_stay_whole() {
        // 4,224 tokens: 264 blocks, exactly two waves of equal blocks.
        assert_eq!(choose(4224, 20_000, H100_SMS, 8192).0, 1);
    }

    #[test]
    fn chunks_are_whole_tiles_covering_the_keys() {
        for (kv, wanted) in [(1, 3), (64, 2), (65, 2), (30_330, 3), (10_000, 4)] {
            let (splits, chunk) = chunks(kv, wanted);
            assert!(splits >= 1 && splits <= wanted, "{kv} {wanted}");
            assert_eq!(chunk % TILE, 0);
            assert!(
                splits * chunk >= kv && (splits - 1) * chunk < kv,
                "{kv} {wanted}"
            );
        }
    }
}
