//! Saved copies of one sequence's device state, for the engine's prefix cache (the contract is
//! `Backend::snapshot` / `restore` / `drop_snapshot` in `model/mod.rs`).
//!
//! A sequence's state lives in its slot of the backend's pools: per GDN layer a conv window and
//! a recurrent state (fixed size), per attention layer the K and V rows of its tokens. A
//! snapshot copies the slot's GDN states of every layer and the KV rows `[0, position)` of
//! every attention layer and KV head into buffers of its own, all device-to-device on the
//! backend's stream; restoring copies them back into another slot. The KV rows past
//! `position` in the restored slot are left as they are: attention reads only `[0, position)`.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, DeviceRepr, DriverError};
use half::bf16;

use super::attention::{KvCache, HEAD_DIM, KV_HEADS};
use super::gdn::{CONV_STATE_LEN, SSM_STATE_LEN};
use super::{ensure, Context, CudaStream, Result};
use crate::model::{Snapshot, SnapshotId};

/// The backend's per-slot state pools, borrowed for one copy.
pub struct StatePools<'a> {
    /// Per GDN layer: `[slots][SSM_STATE_LEN]` and `[slots][CONV_STATE_LEN]`.
    pub ssm: &'a mut [CudaSlice<f32>],
    pub conv: &'a mut [CudaSlice<bf16>],
    pub kv: &'a mut KvCache,
}

struct DeviceSnapshot {
    /// Tokens the state covers.
    position: usize,
    /// The GDN layers' states back to back: `[layer][SSM_STATE_LEN]`, `[layer][CONV_STATE_LEN]`.
    ssm: CudaSlice<f32>,
    conv: CudaSlice<bf16>,
    /// `[layer][kv_head][position][HEAD_DIM]`.
    k: CudaSlice<bf16>,
    v: CudaSlice<bf16>,
}

impl DeviceSnapshot {
    fn bytes(&self) -> u64 {
        (self.ssm.len() * size_of::<f32>()
            + (self.conv.len() + self.k.len() + self.v.len()) * size_of::<bf16>()) as u64
    }
}

/// The snapshots taken and not yet dropped.
#[derive(Default)]
pub struct SnapshotPool {
    snapshots: HashMap<SnapshotId, DeviceSnapshot>,
    next_id: SnapshotId,
}

impl SnapshotPool {
    /// Copies the state of `slot`, which covers `position` tokens.
    pub fn take(
        &mut self,
        stream: &Arc<CudaStream>,
        pools: StatePools,
        slot: usize,
        position: usize,
    ) -> Result<Snapshot> {
        check_slot(&pools, slot, position)?;
        let layers = pools.ssm.len();
        let kv_rows = pools.kv.layers() * KV_HEADS * position * HEAD_DIM;
        let alloc_err = |what: &str| format!("allocating a snapshot's {what}");
        // SAFETY: the copies below write every element before anything reads one: each layer's
        // state and conv window, and every (layer, KV head)'s `position` rows, `kv_rows` in all
        // (with no rows, the one element of k and v is never read). Zeroing first would cost
        // as much again as the keys' and values' copies (≈ 0.6 GB at 30K tokens).
        fn uninit<T: DeviceRepr>(
            stream: &Arc<CudaStream>,
            n: usize,
        ) -> std::result::Result<CudaSlice<T>, DriverError> {
            unsafe { stream.alloc(n) }
        }
        let mut snap = DeviceSnapshot {
            position,
            ssm: uninit(stream, layers * SSM_STATE_LEN).during(|| alloc_err("recurrent states"))?,
            conv: uninit(stream, layers * CONV_STATE_LEN).during(|| alloc_err("conv windows"))?,
            k: uninit(stream, kv_rows.max(1)).during(|| alloc_err("keys"))?,
            v: uninit(stream, kv_rows.max(1)).during(|| alloc_err("values"))?,
        };
        for (i, (ssm, conv)) in pools.ssm.iter().zip(pools.conv.iter()).enumerate() {
            stream
                .memcpy_dtod(
                    &ssm.slice(slot * SSM_STATE_LEN..(slot + 1) * SSM_STATE_LEN),
                    &mut snap
                        .ssm
                        .slice_mut(i * SSM_STATE_LEN..(i + 1) * SSM_STATE_LEN),
                )
                .during(|| "saving a recurrent state".into())?;
            stream
                .memcpy_dtod(
                    &conv.slice(slot * CONV_STATE_LEN..(slot + 1) * CONV_STATE_LEN),
                    &mut snap
                        .conv
                        .slice_mut(i * CONV_STATE_LEN..(i + 1) * CONV_STATE_LEN),
                )
                .during(|| "saving a conv window".into())?;
        }
        let run = position * HEAD_DIM;
        for (j, (layer, head)) in kv_runs(pools.kv).enumerate().filter(|_| run > 0) {
            let from = pools.kv.offset(slot, layer, head, 0);
            let to = j * run;
            for (cache, saved) in [
                (pools.kv.keys(), &mut snap.k),
                (pools.kv.values(), &mut snap.v),
            ] {
                stream
                    .memcpy_dtod(
                        &cache.slice(from..from + run),
                        &mut saved.slice_mut(to..to + run),
                    )
                    .during(|| "saving KV rows".into())?;
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        let bytes = snap.bytes();
        self.snapshots.insert(id, snap);
        Ok(Snapshot { id, bytes })
    }

    /// Copies snapshot `id` into `slot`; returns the position it covers.
    pub fn restore(
        &self,
        stream: &Arc<CudaStream>,
        pools: StatePools,
        id: SnapshotId,
        slot: usize,
    ) -> Result<usize> {
        let Some(snap) = self.snapshots.get(&id) else {
            return Err(super::CudaError::Shape(format!("unknown snapshot {id}")));
        };
        check_slot(&pools, slot, snap.position)?;
        ensure!(
            snap.ssm.len() == pools.ssm.len() * SSM_STATE_LEN,
            "snapshot {id} has the states of another model"
        );
        for (i, (ssm, conv)) in pools.ssm.iter_mut().zip(pools.conv.iter_mut()).enumerate() {
            stream
                .memcpy_dtod(
                    &snap.ssm.slice(i * SSM_STATE_LEN..(i + 1) * SSM_STATE_LEN),
                    &mut ssm.slice_mut(slot * SSM_STATE_LEN..(slot + 1) * SSM_STATE_LEN),
                )
                .during(|| "restoring a recurrent state".into())?;
            stream
                .memcpy_dtod(
                    &snap
                        .conv
                        .slice(i * CONV_STATE_LEN..(i + 1) * CONV_STATE_LEN),
                    &mut conv.slice_mut(slot * CONV_STATE_LEN..(slot + 1) * CONV_STATE_LEN),
                )
                .during(|| "restoring a conv window".into())?;
        }
        let run = snap.position * HEAD_DIM;
        let runs: Vec<_> = kv_runs(pools.kv).filter(|_| run > 0).collect();
        for (j, (layer, head)) in runs.into_iter().enumerate() {
            let to = pools.kv.offset(slot, layer, head, 0);
            let from = j * run;
            stream
                .memcpy_dtod(
                    &snap.k.slice(from..from + run),
                    &mut pools.kv.keys_mut().slice_mut(to..to + run),
                )
                .during(|| "restoring keys".into())?;
            stream
                .memcpy_dtod(
                    &snap.v.slice(from..from + run),
                    &mut pools.kv.values_mut().slice_mut(to..to + run),
                )
                .during(|| "restoring values".into())?;
        }
        Ok(snap.position)
    }

    /// Frees snapshot `id` (the device memory returns to the stream's pool); unknown ids are
    /// ignored.
    pub fn drop_snapshot(&mut self, id: SnapshotId) {
        self.snapshots.remove(&id);
    }
}

/// (attention layer, KV head) pairs in the order their rows are stored in a snapshot.
fn kv_runs(kv: &KvCache) -> impl Iterator<Item = (usize, usize)> {
    let layers = kv.layers();
    (0..layers).flat_map(|layer| (0..KV_HEADS).map(move |head| (layer, head)))
}

fn check_slot(pools: &StatePools, slot: usize, position: usize) -> Result<()> {
    ensure!(
        slot < pools.kv.slots(),
        "slot {slot} is outside the {} state slots",
        pools.kv.slots()
    );
    ensure!(
        position <= pools.kv.capacity(),
        "a state of {position} tokens does not fit the KV cache of {}",
        pools.kv.capacity()
    );
    ensure!(
        pools.ssm.len() == pools.conv.len(),
        "{} recurrent states but {} conv windows",
        pools.ssm.len(),
        pools.conv.len()
    );
    Ok(())
}
