//! MoE routing and grouping by expert (moe.cu), on the device. The combine is
//! `NormKernels::residual_rmsnorm`, fused with the residual add and the next norm.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, LaunchConfig};
use half::bf16;

use super::{
    as_i32, ensure, launch, Context, CudaDevice, CudaFunction, CudaStream, CudaView, CudaViewMut,
    Result,
};

/// Experts the router kernel handles (8 per lane of a warp).
pub const MAX_EXPERTS: usize = 256;
/// Experts the grouping handles: the routed ones and the shared expert, in whole warps
/// (GROUP_MAX_EXPERTS in moe.cu).
pub const MAX_GROUP_EXPERTS: usize = 288;
pub const MAX_TOP_K: usize = 16;
/// Pairs per block of the grouping kernels (GROUP_CHUNK in moe.cu).
const GROUP_CHUNK: usize = 1024;
/// Tokens of one gathered GEMV slot, and the most tokens a slot table takes (SLOT_TOKENS and
/// SLOT_MAX_TOKENS in moe.cu); SLOT_WORDS is the GEMV's.
pub const SLOT_TOKENS: usize = crate::cuda::gemm::MAX_TOKENS;
pub const SLOT_MAX_TOKENS: usize = 256;
use crate::cuda::gemm::SLOT_WORDS;

/// The most slots [`MoeKernels::slot_table`] can fill for `tokens` tokens each routed to
/// `per_token` distinct experts of `experts`: Σ_e ⌈count_e / 8⌉ ≤ (pairs + 7 · active experts) / 8,
/// and no more than the pairs.
pub fn max_gathered_slots(tokens: usize, per_token: usize, experts: usize) -> usize {
    let pairs = tokens * per_token;
    pairs.min((pairs + (SLOT_TOKENS - 1) * experts.min(pairs)).div_ceil(SLOT_TOKENS))
}

pub struct MoeKernels {
    stream: Arc<CudaStream>,
    router_topk: CudaFunction,
    group_count: CudaFunction,
    group_scatter: CudaFunction,
    slot_table: CudaFunction,
}

/// The (token, slot) pairs of a prefill chunk grouped by expert, on the device: what the grouped
/// expert GEMMs (gemm_prefill.rs) read. Allocated once for the largest chunk; filled by
/// [`MoeKernels::group_by_expert`].
///
/// Pair `p = token·top_k + slot`. `sorted` lists the pairs expert after expert, each expert's in
/// increasing p (so in token order); `tiles` cuts each expert's run into tiles of `tile_rows`
/// (chosen per grouping), of which the last also takes a remainder of up to `spill` rows:
/// `{expert, first position in sorted, rows, 0}`, and `num_tiles` says how many are valid.
pub struct ExpertGroups {
    experts: usize,
    /// The shortest tiles the map has room for.
    min_tile_rows: usize,
    max_pairs: usize,
    /// `[chunks][experts]`: each chunk's pairs per expert.
    chunk_counts: CudaSlice<i32>,
    sorted: CudaSlice<i32>,
    tiles: CudaSlice<i32>,
    num_tiles: CudaSlice<i32>,
    /// Set by the last grouping.
    pairs: usize,
    top_k: usize,
    tile_rows: usize,
    spill: usize,
}

impl ExpertGroups {
    /// Room for up to `max_tokens` tokens routed to `top_k` of `experts` experts, for tiles of
    /// at least `min_tile_rows` rows (`gemm_prefill::MIN_TILE_ROWS` for the GEMMs).
    pub fn new(
        stream: &Arc<CudaStream>,
        max_tokens: usize,
        top_k: usize,
        experts: usize,
        min_tile_rows: usize,
    ) -> Result<Self> {
        ensure!(
            experts > 0 && experts <= MAX_GROUP_EXPERTS,
            "expert groups: {experts} experts (1..={MAX_GROUP_EXPERTS})"
        );
        ensure!(min_tile_rows > 0, "expert groups: tiles of 0 rows");
        let max_pairs = max_tokens.max(1) * top_k.max(1);
        as_i32(max_pairs, "pairs")?;
        let alloc = |n: usize| {
            stream
                .alloc_zeros::<i32>(n.max(1))
                .during(|| format!("allocating {n} expert-grouping values"))
        };
        Ok(Self {
            experts,
            min_tile_rows,
            max_pairs,
            chunk_counts: alloc(max_pairs.div_ceil(GROUP_CHUNK) * experts)?,
            sorted: alloc(max_pairs)?,
            tiles: alloc(4 * max_tiles(max_pairs, experts, min_tile_rows))?,
            num_tiles: alloc(1)?,
            pairs: 0,
            top_k: 0,
            tile_rows: min_tile_rows,
            spill: 0,
        })
    }

    pub fn experts(&self) -> usize {
        self.experts
    }
    /// Rows per tile of the last grouping.
    pub fn tile_rows(&self) -> usize {
        self.tile_rows
    }
    /// Rows beyond `tile_rows` that an expert's last tile may hold, in the last grouping: its
    /// tiles have at most `tile_rows + spill` rows.
    pub fn spill(&self) -> usize {
        self.spill
    }
    /// Pairs of the last grouping.
    pub fn pairs(&self) -> usize {
        self.pairs
    }
    pub fn top_k(&self) -> usize {
        self.top_k
    }
    /// The most tiles the last grouping can have: the grid size of a grouped GEMM.
    pub fn max_tiles(&self) -> usize {
        max_tiles(self.pairs, self.experts, self.tile_rows)
    }
    /// `[pairs]`: pair ids, expert after expert.
    pub fn sorted_pairs(&self) -> CudaView<'_, i32> {
        self.sorted.slice(..self.pairs.max(1))
    }
    /// `[max_tiles][4]`: {expert, first position, rows, 0}; the first `tile_count` are valid.
    pub fn tile_map(&self) -> CudaView<'_, i32> {
        self.tiles.slice(..4 * self.max_tiles().max(1))
    }
    /// `[1]`: how many tiles the last grouping made.
    pub fn tile_count(&self) -> CudaView<'_, i32> {
        self.num_tiles.as_view()
    }
}

/// Σ_e ceil(count_e / rows) ≤ pairs / rows + (experts with any pair).
fn max_tiles(pairs: usize, experts: usize, rows: usize) -> usize {
    pairs.div_ceil(rows) + experts.min(pairs)
}

impl MoeKernels {
    pub fn load(dev: &CudaDevice) -> Result<Self> {
        Ok(Self {
            stream: dev.stream().clone(),
            router_topk: dev.function("moe", "router_topk")?,
            group_count: dev.function("moe", "moe_group_count")?,
            group_scatter: dev.function("moe", "moe_group_scatter")?,
            slot_table: dev.function("moe", "moe_slot_table")?,
        })
    }

    /// The gathered GEMV slots (`GemvKernels::gemv_gathered`) of the pairs of `ids`
    /// (`[tokens][per_token]` expert ids, distinct per token, clamped to `0..experts`): each
    /// expert's pairs in token order, cut into slots of up to 8 tokens, into `table`
    /// (`[max_gathered_slots][SLOT_WORDS]`; the slots after the last get 0 tokens). One launch.
    /// Returns the launch's slot count, [`max_gathered_slots`].
    pub fn slot_table(
        &self,
        ids: &CudaView<i32>,
        per_token: usize,
        experts: usize,
        table: &mut CudaViewMut<i32>,
    ) -> Result<usize> {
        ensure!(
            per_token > 0 && ids.len() % per_token == 0 && !ids.is_empty(),
            "slot_table: ids are not whole rows of {per_token}"
        );
        let tokens = ids.len() / per_token;
        ensure!(
            tokens <= SLOT_MAX_TOKENS && experts > 0 && experts <= MAX_GROUP_EXPERTS,
            "slot_table: {tokens} tokens of {experts} experts (at most {SLOT_MAX_TOKENS} of {MAX_GROUP_EXPERTS})"
        );
        let slots = max_gathered_slots(tokens, per_token, experts);
        ensure!(
            table.len() >= slots * SLOT_WORDS,
            "slot_table: room for {} words, {slots} slots need {}",
            table.len(),
            slots * SLOT_WORDS
        );
        let (t, k, e, m) = (
            as_i32(tokens, "tokens")?,
            as_i32(per_token, "slots per token")?,
            as_i32(experts, "experts")?,
            as_i32(slots, "slots")?,
        );
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (MAX_GROUP_EXPERTS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the kernel reads tokens · per_token ids and writes slots entries, both checked.
        unsafe {
            launch!(
                self.stream,
                &self.slot_table,
                cfg,
                ids,
                &t,
                &k,
                &e,
                &m,
                table
            )?;
        }
        Ok(slots)
    }

    /// Groups the pairs of `ids` (`[tokens][top_k]` expert ids from [`Self::router_topk`]) by
    /// expert into `groups`, in tiles of `tile_rows`, for the grouped expert GEMMs; an expert's
    /// last tile takes a remainder of up to `spill` rows (0: none) instead of a tile of its own.
    /// Two launches, no host round trip.
    pub fn group_by_expert(
        &self,
        ids: &CudaView<i32>,
        top_k: usize,
        tile_rows: usize,
        spill: usize,
        groups: &mut ExpertGroups,
    ) -> Result<()> {
        ensure!(
            top_k > 0 && ids.len() % top_k == 0,
            "group_by_expert: ids are not whole rows of {top_k}"
        );
        let pairs = ids.len();
        ensure!(pairs > 0, "group_by_expert: no tokens");
        ensure!(
            pairs <= groups.max_pairs,
            "group_by_expert: {pairs} pairs, the groups were allocated for {}",
            groups.max_pairs
        );
        ensure!(
            tile_rows >= groups.min_tile_rows,
            "group_by_expert: tiles of {tile_rows} rows, the map has room for tiles of {} or more",
            groups.min_tile_rows
        );
        groups.pairs = pairs;
        groups.top_k = top_k;
        groups.tile_rows = tile_rows;
        groups.spill = spill;
        let chunks = pairs.div_ceil(GROUP_CHUNK);
        let (p, e) = (pairs as i32, groups.experts as i32);
        let (rows, spill, max) = (
            as_i32(groups.tile_rows, "tile rows")?,
            as_i32(spill, "spill rows")?,
            as_i32(groups.max_tiles(), "tiles")?,
        );
        let per_chunk = LaunchConfig {
            grid_dim: (chunks as u32, 1, 1),
            block_dim: (GROUP_CHUNK as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut counts = groups.chunk_counts.slice_mut(..chunks * groups.experts);
        // SAFETY: every index is bounded by pairs, chunks and experts, which fit the buffers
        // (checked above and at allocation); expert ids are clamped to 0..experts in the kernels.
        unsafe {
            launch!(
                self.stream,
                &self.group_count,
                per_chunk,
                ids,
                &p,
                &e,
                &mut counts
            )?;
        }
        let counts = counts.as_view();
        // SAFETY: as above; at most max_tiles tiles are written.
        unsafe {
            launch!(
                self.stream,
                &self.group_scatter,
                per_chunk,
                ids,
                &p,
                &e,
                &counts,
                &rows,
                &spill,
                &max,
                &mut groups.tiles,
                &mut groups.num_tiles,
                &mut groups.sorted
            )
        }
    }

    /// Softmax over each token's `experts` router logits, top `k` (ties → lower index),
    /// renormalised. With `shared`, each logits row ends with the shared expert's gate logit and
    /// the shared expert becomes slot k (id `experts`, weight sigmoid(gate)). `logits` is
    /// `[tokens][pitch]`, each row's first `experts + shared` values read, `ids` and `weights`
    /// are `[tokens][k + shared]`.
    #[allow(clippy::too_many_arguments)]
    pub fn router_topk(
        &self,
        logits: &CudaView<bf16>,
        pitch: usize,
        experts: usize,
        k: usize,
        shared: bool,
        ids: &mut CudaViewMut<i32>,
        weights: &mut CudaViewMut<f32>,
    ) -> Result<()> {
        ensure!(
            experts > 0 && experts <= MAX_EXPERTS,
            "router: {experts} experts (1..={MAX_EXPERTS} supported)"
        );
        ensure!(
            k > 0 && k <= experts.min(MAX_TOP_K),
            "router: top-{k} of {experts}"
        );
        let (row, slots) = (experts + shared as usize, k + shared as usize);
        ensure!(
            pitch >= row && logits.len() % pitch == 0,
            "router: logits are not whole rows of {pitch} values (≥ {row})"
        );
        let tokens = logits.len() / pitch;
        ensure!(
            ids.len() == tokens * slots && weights.len() == tokens * slots,
            "router: ids/weights must be [{tokens}][{slots}]"
        );
        if tokens == 0 {
            return Ok(());
        }
        let warps_per_block = 4u32;
        let cfg = LaunchConfig {
            grid_dim: ((tokens as u32).div_ceil(warps_per_block), 1, 1),
            block_dim: (32 * warps_per_block, 1, 1),
            shared_mem_bytes: 0,
        };
        let (pitch, t, e, k, sh) = (
            as_i32(pitch, "router pitch")?,
            as_i32(tokens, "tokens")?,
            experts as i32,
            k as i32,
            shared as i32,
        );
        unsafe {
            launch!(
                self.stream,
                &self.router_topk,
                cfg,
                logits,
                &pitch,
                &t,
                &e,
                &k,
                &sh,
                ids,
                weights
            )
        }
    }
}
