//! The MoE block's experts in a pass: the router and its top-k, then the grouped expert GEMMs
//! (rows sorted by expert on the device, tiles as tall as the rows each expert sees) for long
//! passes, the decode GEMVs over gathered slots (each expert's rows, up to 8 a slot) for 2 to 256
//! rows, or the decode GEMVs over every (row, expert) slot for one row (or by setting).

use cudarc::driver::CudaSlice;

use super::fp8;
use super::projection::router_logits;
use super::residual::{Output, Parts, ResidualStream};
use super::{Kernels, Scratch};
use crate::config::ModelConfig;
use crate::cuda::gemm::{FusedTopK, L2Ahead, SlotInput, MAX_TOKENS, SLOT_WORDS};
use crate::cuda::gemm_prefill::GemmKernels;
use crate::cuda::model::DeviceMoe;
use crate::cuda::moe_decode::MoeDecode;
use crate::cuda::Result;

/// The MoE block's experts for `t` rows of `s.xn`: routing, then each (token, slot)'s expert
/// output unweighted in `s.routed` `[t][slots][hidden]`, slot top_k being the shared expert; the
/// weights are left in `s.expert_weights` for the combine. With `router_input` the router's x is
/// made in its GEMV from the residual stream plus `s.r` and that norm (forward/residual.rs).
/// `ahead`: what the GEMV path's gate‖up and down launches pull into L2.
#[allow(clippy::too_many_arguments)]
pub(super) fn moe_experts(
    c: &ModelConfig,
    k: &mut Kernels,
    w: &DeviceMoe,
    s: &mut Scratch,
    t: usize,
    router_input: Option<(&mut ResidualStream, &CudaSlice<f32>)>,
    ahead: (L2Ahead, L2Ahead),
    section: &impl Fn(&'static str) -> Result<()>,
) -> Result<()> {
    let (hd, e, topk, inter) = (
        c.hidden_size,
        c.num_experts,
        c.num_experts_per_tok,
        c.moe_intermediate_size,
    );
    let slots = topk + 1;
    // One token: the whole block in one persistent kernel, where it takes these weights.
    if t == 1 && router_input.is_none() {
        if let Some(md) = k.moe_decode.as_mut().filter(|_| MoeDecode::supports(w)) {
            section("moe experts")?;
            return md.run(
                w,
                &s.xn.slice(..hd),
                &mut s.expert_ids.slice_mut(..slots),
                &mut s.expert_weights.slice_mut(..slots),
                &mut s.routed.slice_mut(..slots * hd),
            );
        }
    }
    section("moe router")?;
    // Decode rows in one router launch: its last block can do the top-k (LILY_FUSED_TOPK=1).
    let fused_topk = k.gemv.fuses_topk()
        && t <= MAX_TOKENS
        && (router_input.is_some() || t <= k.gemv.max_tokens(&w.router.view()));
    if fused_topk {
        let st = s.router.stream().clone();
        k.gemv.then_topk(FusedTopK::new(
            e,
            topk,
            &mut s.expert_ids.slice_mut(..t * slots),
            &mut s.expert_weights.slice_mut(..t * slots),
            &mut s.topk_counter.slice_mut(..),
            &st,
        ));
    }
    // Logits rows `pitch` apart: packed from the GEMVs, padded from cuBLAS.
    s.router_pitch = match router_input {
        // The residual add and post-mixer norm made in the router's GEMV, xn written for the experts.
        Some((stream, norm)) => {
            let eps = c.rms_norm_eps;
            k.gemv.then_prefetch(L2Ahead::default());
            stream.gemv(
                k,
                &w.router,
                s,
                t,
                Parts::Mixer,
                norm,
                eps,
                true,
                Output::Router,
                slots,
            )?;
            e + 1
        }
        None => router_logits(
            k,
            &w.router,
            &s.xn.slice(..t * hd),
            &mut s.router.as_view_mut(),
            t,
        )?,
    };
    if !fused_topk {
        k.moe.router_topk(
            &s.router.slice(..t * s.router_pitch),
            s.router_pitch,
            e,
            topk,
            true,
            &mut s.expert_ids.slice_mut(..t * slots),
            &mut s.expert_weights.slice_mut(..t * slots),
        )?;
    }
    // An FP8 checkpoint's passes of FROM_ROWS rows or more keep its FP8 products (below), as
    // before the gathered slots reached 256 rows: those beat its Q8 conversion's GEMMs from 72
    // rows on (fp8.rs); against the gathered slots at 65–256 rows they are not measured yet.
    let fp8_experts =
        t >= fp8::FROM_ROWS && k.fp8.is_some() && w.gate_up.fp8.is_some() && w.down.fp8.is_some();
    if k.gemv.gathers_experts(t) && !fp8_experts {
        section("moe experts")?;
        // Each expert's rows as slots of up to 8 tokens: its weights read once for all of them.
        // routed[token][slot] as below; gate‖up per (token, slot) pair in s.gu.
        let pairs = t * slots;
        let n = k.moe.slot_table(
            &s.expert_ids.slice(..pairs),
            slots,
            e + 1,
            &mut s.slot_table.slice_mut(..),
        )?;
        let table = s.slot_table.slice(..n * SLOT_WORDS);
        k.gemv.gemv_gathered(
            &w.gate_up.view(),
            &table,
            n,
            &s.xn.slice(..t * hd),
            false,
            &mut s.gu.slice_mut(..pairs * 2 * inter),
        )?;
        // Gate‖up, just before, read the table after its PDL wait.
        k.gemv.then_ids_ready();
        return k.gemv.gemv_gathered(
            &w.down.view(),
            &table,
            n,
            &s.gu.slice(..pairs * 2 * inter),
            true,
            &mut s.routed.slice_mut(..pairs * hd),
        );
    }
    let grouped = k.gemm.groups_experts(t)
        && GemmKernels::supports(&w.gate_up.view())
        && GemmKernels::supports(&w.down.view());
    section("moe experts")?;
    if fp8_experts {
        if let (Some(path), Some(gate_up), Some(down)) = (&mut k.fp8, &w.gate_up.fp8, &w.down.fp8) {
            // An FP8 checkpoint's prefill: its experts as they ship, on the FP8 tensor cores.
            k.moe.group_by_expert(
                &s.expert_ids.slice(..t * slots),
                slots,
                fp8::TILE_ROWS,
                0,
                &mut s.groups,
            )?;
            return path.experts(
                gate_up,
                down,
                &s.xn.slice(..t * hd),
                &s.groups,
                &mut s.act,
                &mut s.routed.slice_mut(..t * slots * hd),
            );
        }
    }
    if grouped {
        // Pairs sorted by expert, then one grouped GEMM per projection; routed[token][slot] as below.
        // Tiles as tall as the experts' rows: few rows each (a batched decode step, a short
        // prompt) take short tiles. The shared expert (id e) is one of e + 1.
        let stacks = [&w.gate_up.view(), &w.down.view()];
        let tile_rows = k.gemm.expert_tile_rows(t * slots, e + 1, &stacks);
        k.moe.group_by_expert(
            &s.expert_ids.slice(..t * slots),
            slots,
            tile_rows,
            k.gemm.expert_tile_spill(tile_rows, &stacks),
            &mut s.groups,
        )?;
        let mut act = s.act.slice_mut(..t * slots * inter);
        k.gemm.experts_gate_up(
            &w.gate_up.view(),
            &s.xn.slice(..t * hd),
            &s.groups,
            &mut act,
        )?;
        k.gemm.experts_down(
            &w.down.view(),
            &s.act.slice(..t * slots * inter),
            &s.groups,
            &mut s.routed.slice_mut(..t * slots * hd),
        )
    } else {
        // Up to 8 rows at a time, every (row, slot) one slot of the launch: gate‖up with the
        // row's x, then down through SwiGLU, into routed[row][slot].
        let mut row = 0;
        while row < t {
            let n = MAX_TOKENS.min(t - row);
            let pairs = row * slots..(row + n) * slots;
            let ids = s.expert_ids.slice(pairs.clone());
            k.gemv.then_prefetch(ahead.0);
            let gate_up = w.gate_up.view();
            let shape = if t == 1 && !fused_topk {
                // The top-k launch just before starts this one only after its own wait, by when
                // the router's GEMV had finished, and with it (or before it) the writer of xn.
                k.gemv.then_routed_gate_up();
                k.gemv.routed_gate_up_shape(&gate_up, slots)
            } else {
                k.gemv.shape(&gate_up, n * slots)
            };
            k.gemv.gemv_slots_shaped(
                &gate_up,
                Some(&ids),
                n * slots,
                &s.xn.slice(row * hd..(row + n) * hd),
                SlotInput::PerGroup(slots),
                1,
                &mut s.gu.slice_mut(..n * slots * 2 * inter),
                shape,
            )?;
            if row + n == t {
                k.gemv.then_prefetch(ahead.1);
            }
            // Gate‖up, just before, read these ids after its PDL wait.
            k.gemv.then_ids_ready();
            k.gemv.gemv_slots(
                &w.down.view(),
                Some(&ids),
                n * slots,
                &s.gu.slice(..n * slots * 2 * inter),
                SlotInput::PerSlotSwiGlu,
                1,
                &mut s.routed.slice_mut(pairs.start * hd..pairs.end * hd),
            )?;
            row += n;
        }
        Ok(())
    }
}
