//! Saved copies of one sequence's device state, for the engine's prefix cache (the contract is
//! `Backend::snapshot` / `restore` / `drop_snapshot` in `model/mod.rs`).
//!
//! A sequence's state lives in its slot of the backend's pools: per GDN layer a conv window and
//! a recurrent state (fixed size), per attention layer the K and V rows of its tokens. A
//! snapshot copies the slot's GDN states of every layer and the KV rows `[0, position)` of
//! every attention layer and KV head into buffers of its own, all device-to-device on the
//! backend's stream; restoring copies them back into another slot. The KV rows past
//! `position` in the restored slot are left as they are: attention reads only `[0, position)`.
//! Either way the copies go as one launch of snapshot.cu's `copy_runs` over a table of runs.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{
    CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr, DriverError,
    LaunchConfig,
};
use half::bf16;

use super::attention::{KvCache, HEAD_DIM, KV_HEADS};
use super::gdn::{CONV_STATE_LEN, SSM_STATE_LEN};
use super::{ensure, launch, Context, CudaDevice, CudaFunction, CudaStream, Result};
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

/// Device memory of `n` values whose every element is written before anything reads one (the
/// callers' copies: each layer's state and conv window, every (layer, KV head)'s rows; with no
/// rows, the one element of k and v is never read). Zeroing first would cost as much again as
/// the keys' and values' copies (≈ 0.6 GB at 30K tokens).
fn uninit<T: DeviceRepr>(
    stream: &Arc<CudaStream>,
    n: usize,
) -> std::result::Result<CudaSlice<T>, DriverError> {
    // SAFETY: see above; a CudaSlice of plain values has no invalid bit patterns.
    unsafe { stream.alloc(n) }
}

/// The GDN states of one sequence kept in the middle of a step, before its last token (the
/// prompt's end state for the prefix cache, `Backend::keep_state_before_last`): the forward
/// pass copies each GDN layer's state and conv window here before it steps the last token, and
/// a snapshot takes the buffers over.
pub struct KeptStates {
    /// `[layer][SSM_STATE_LEN]` and `[layer][CONV_STATE_LEN]`, as a snapshot holds them.
    pub ssm: CudaSlice<f32>,
    pub conv: CudaSlice<bf16>,
    /// Tokens the kept states cover, once a step filled them (`None`: not yet run).
    pub position: Option<usize>,
}

impl KeptStates {
    pub fn new(stream: &Arc<CudaStream>, layers: usize) -> Result<Self> {
        Ok(Self {
            ssm: uninit(stream, layers * SSM_STATE_LEN)
                .during(|| "allocating kept recurrent states".into())?,
            conv: uninit(stream, layers * CONV_STATE_LEN)
                .during(|| "allocating kept conv windows".into())?,
            position: None,
        })
    }
}

/// The snapshots taken and not yet dropped.
pub struct SnapshotPool {
    snapshots: HashMap<SnapshotId, DeviceSnapshot>,
    next_id: SnapshotId,
    copy_runs: CudaFunction,
    /// copy_runs' table of (from, to, bytes), grown to the most runs a copy has had.
    table: Option<CudaSlice<u64>>,
}

/// Device-to-device copies gathered for one launch of copy_runs.
#[derive(Default)]
struct Runs {
    /// (from, to, bytes) of each run.
    table: Vec<u64>,
}

impl Runs {
    /// Adds the copy of `from` into `to` (equal lengths, 16-byte aligned, whole 16-byte vectors).
    fn push<T>(
        &mut self,
        stream: &CudaStream,
        from: &CudaView<'_, T>,
        to: &mut CudaViewMut<'_, T>,
    ) -> Result<()> {
        let bytes = from.len() * size_of::<T>();
        ensure!(
            from.len() == to.len() && bytes % 16 == 0,
            "a state copy of {} values into {}: not whole, equal 16-byte vectors",
            from.len(),
            to.len()
        );
        // With event tracking off (mod.rs) the guards are no-ops; the addresses stay valid
        // while the snapshot and the pools are borrowed, up to the launch.
        let (src, _) = from.device_ptr(stream);
        let (dst, _) = to.device_ptr_mut(stream);
        ensure!(
            (src | dst) % 16 == 0,
            "a state copy between {src:#x} and {dst:#x}: not 16-byte aligned"
        );
        self.table.extend([src, dst, bytes as u64]);
        Ok(())
    }
}

impl SnapshotPool {
    pub fn new(dev: &CudaDevice) -> Result<Self> {
        Ok(Self {
            snapshots: HashMap::new(),
            next_id: 0,
            copy_runs: dev.function("snapshot", "copy_runs")?,
            table: None,
        })
    }

    /// Enqueues `runs` as one launch of copy_runs.
    fn copy(&mut self, stream: &Arc<CudaStream>, runs: Runs) -> Result<()> {
        let n = runs.table.len() / 3;
        if n == 0 {
            return Ok(());
        }
        ensure!(n <= 65535, "{n} state copies in one launch");
        if self
            .table
            .as_ref()
            .is_none_or(|t| t.len() < runs.table.len())
        {
            self.table = Some(
                stream
                    .alloc_zeros(runs.table.len())
                    .during(|| "allocating the state copies' table".into())?,
            );
        }
        let table = self.table.as_mut().expect("allocated above");
        stream
            .memcpy_htod(&runs.table, &mut table.slice_mut(..runs.table.len()))
            .during(|| "copying the state copies' table".into())?;
        // 64 blocks a run: a long sequence's keys (15 MB a run at 30K tokens) over every SM.
        let cfg = LaunchConfig {
            grid_dim: (64, n as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: every run is a whole, aligned view of one live buffer (Runs::push), and the
        // buffers outlive the launch (the pools and snapshots are only freed on this stream).
        unsafe {
            launch!(
                stream,
                &self.copy_runs,
                cfg,
                &table.slice(..runs.table.len())
            )
        }
    }

    /// Copies the state of `slot`, which covers `position` tokens.
    pub fn take(
        &mut self,
        stream: &Arc<CudaStream>,
        pools: StatePools,
        slot: usize,
        position: usize,
    ) -> Result<Snapshot> {
        self.take_with(stream, pools, slot, position, &mut None)
    }

    /// [`Self::take`] with the GDN states a step kept before its last token (`kept`, taken out
    /// of it once the snapshot's keys and values are copied: on failure it is left as it was)
    /// instead of the slot's; the KV rows `[0, position)` are the slot's, as the step's last
    /// token only appended a row after them.
    pub fn take_with(
        &mut self,
        stream: &Arc<CudaStream>,
        pools: StatePools,
        slot: usize,
        position: usize,
        kept: &mut Option<KeptStates>,
    ) -> Result<Snapshot> {
        check_slot(&pools, slot, position)?;
        let layers = pools.ssm.len();
        if let Some(k) = kept {
            ensure!(
                k.position == Some(position)
                    && k.ssm.len() == layers * SSM_STATE_LEN
                    && k.conv.len() == layers * CONV_STATE_LEN,
                "the kept states cover {:?} tokens of {} layers, not {position} of {layers}",
                k.position,
                k.ssm.len() / SSM_STATE_LEN
            );
        }
        let kv_rows = pools.kv.layers() * KV_HEADS * position * HEAD_DIM;
        let alloc_err = |what: &str| format!("allocating a snapshot's {what}");
        let mut k = uninit(stream, kv_rows.max(1)).during(|| alloc_err("keys"))?;
        let mut v = uninit(stream, kv_rows.max(1)).during(|| alloc_err("values"))?;
        let mut gdn_states = None;
        if kept.is_none() {
            gdn_states = Some((
                uninit::<f32>(stream, layers * SSM_STATE_LEN)
                    .during(|| alloc_err("recurrent states"))?,
                uninit::<bf16>(stream, layers * CONV_STATE_LEN)
                    .during(|| alloc_err("conv windows"))?,
            ));
        }
        let mut runs = Runs::default();
        if let Some((saved_ssm, saved_conv)) = gdn_states.as_mut() {
            for (i, (ssm, conv)) in pools.ssm.iter().zip(pools.conv.iter()).enumerate() {
                runs.push(
                    stream,
                    &ssm.slice(slot * SSM_STATE_LEN..(slot + 1) * SSM_STATE_LEN),
                    &mut saved_ssm.slice_mut(i * SSM_STATE_LEN..(i + 1) * SSM_STATE_LEN),
                )?;
                runs.push(
                    stream,
                    &conv.slice(slot * CONV_STATE_LEN..(slot + 1) * CONV_STATE_LEN),
                    &mut saved_conv.slice_mut(i * CONV_STATE_LEN..(i + 1) * CONV_STATE_LEN),
                )?;
            }
        }
        let run = position * HEAD_DIM;
        for (j, (layer, head)) in kv_runs(pools.kv).enumerate().filter(|_| run > 0) {
            let from = pools.kv.offset(slot, layer, head, 0);
            let to = j * run;
            for (cache, saved) in [(pools.kv.keys(), &mut k), (pools.kv.values(), &mut v)] {
                runs.push(
                    stream,
                    &cache.slice(from..from + run),
                    &mut saved.slice_mut(to..to + run),
                )?;
            }
        }
        self.copy(stream, runs)?;
        let (ssm, conv) = match gdn_states {
            Some(states) => states,
            None => {
                let kept = kept.take().expect("checked: kept states");
                (kept.ssm, kept.conv)
            }
        };
        let snap = DeviceSnapshot {
            position,
            ssm,
            conv,
            k,
            v,
        };
        let id = self.next_id;
        self.next_id += 1;
        let bytes = snap.bytes();
        self.snapshots.insert(id, snap);
        Ok(Snapshot { id, bytes })
    }

    /// Copies snapshot `id` into `slot`; returns the position it covers.
    pub fn restore(
        &mut self,
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
        let mut runs = Runs::default();
        for (i, (ssm, conv)) in pools.ssm.iter_mut().zip(pools.conv.iter_mut()).enumerate() {
            runs.push(
                stream,
                &snap.ssm.slice(i * SSM_STATE_LEN..(i + 1) * SSM_STATE_LEN),
                &mut ssm.slice_mut(slot * SSM_STATE_LEN..(slot + 1) * SSM_STATE_LEN),
            )?;
            runs.push(
                stream,
                &snap
                    .conv
                    .slice(i * CONV_STATE_LEN..(i + 1) * CONV_STATE_LEN),
                &mut conv.slice_mut(slot * CONV_STATE_LEN..(slot + 1) * CONV_STATE_LEN),
            )?;
        }
        let run = snap.position * HEAD_DIM;
        let kv: Vec<_> = kv_runs(pools.kv).filter(|_| run > 0).collect();
        for (j, (layer, head)) in kv.into_iter().enumerate() {
            let to = pools.kv.offset(slot, layer, head, 0);
            let from = j * run;
            runs.push(
                stream,
                &snap.k.slice(from..from + run),
                &mut pools.kv.keys_mut().slice_mut(to..to + run),
            )?;
            runs.push(
                stream,
                &snap.v.slice(from..from + run),
                &mut pools.kv.values_mut().slice_mut(to..to + run),
            )?;
        }
        let position = snap.position;
        self.copy(stream, runs)?;
        Ok(position)
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
