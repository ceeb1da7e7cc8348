//! The seam between the hand-off and a TP rank whose KV lives on a GPU ([`DeviceKvPeer`]),
//! and this instance's KV placement built from the ranks that registered one
//! ([`placement_of`]). What the placement exchange and the CUDA IPC reads do with them is
//! [`super::device`].

use super::protocol::KvPeerInfo;
use pdserve_core::handoff::kv_path::{self, HostIdentity, IpcRegion, KvPlacement, RankPlacement};
use pdserve_gpu::kv::KvLayout;
use pdserve_gpu::ModelError;
use std::sync::Arc;

/// What one rank's device KV offers the hand-off.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceRankKv {
    /// The GPU's UUID (`cuDeviceGetUuid`): what "same GPU" compares.
    pub gpu_uuid: [u8; 16],
    /// Its ordinal in this process (for logs).
    pub ordinal: u32,
    /// The rank's KV regions' IPC handles in layer order (`export_ipc`), or `None` when they
    /// cannot be exported (or peers' opened) on this system.
    pub handles: Option<Vec<IpcRegion>>,
}

/// Why a rank's device copy ([`DeviceKvPeer::copy_from_peer`]) failed.
#[derive(Debug, thiserror::Error)]
pub enum DeviceCopyError {
    /// The rank's executor failed the copy (opening the peer's regions, the copy itself, a
    /// lost device) or could not take it (its thread gone).
    #[error(transparent)]
    Device(#[from] ModelError),
    /// The thread that waits for the copy could not start.
    #[error("cannot start a CUDA IPC copy thread: {0}")]
    Spawn(#[source] std::io::Error),
}

impl DeviceCopyError {
    /// A short, stable name for this error's kind, for metrics labels and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Device(e) => e.kind(),
            Self::Spawn(_) => "spawn",
        }
    }
}

/// Where a device copy's outcome goes: called exactly once, from any thread.
pub type CopyDone = Box<dyn FnOnce(Result<(), DeviceCopyError>) + Send>;

/// The seam between the hand-off and a TP rank whose KV lives on a GPU: the CUDA rank
/// executor implements it (`CudaRankExecutor::export_ipc` / `copy_from_peer`); the TpWorker
/// registers it with [`KvContext::set_device`](super::KvContext::set_device) once its executor runs, and clears it when the
/// executor goes. On CPU there is none, and negotiation never picks CUDA IPC.
///
/// Implementations must not block the caller (a hand-off driver task): queue the copy on the
/// rank's thread and answer through `done`.
pub trait DeviceKvPeer: Send + Sync {
    /// This rank's GPU and the IPC handles of its current KV regions (a restarted rank has
    /// new regions, so new handles: peers that cached the old ones fail their next copy and
    /// handshake again). Called on every pull and placement answer, from async code: answer
    /// from what was exported once when the executor started (`export_ipc` waits on the rank
    /// thread), never by asking the device.
    fn device(&self) -> DeviceRankKv;

    /// Copies `pairs` of `(peer block, own block)` — every layer, K and V — from a process on
    /// the same GPU whose rank has layout `peer_layout` and exported `handles` (one per layer,
    /// checked by the negotiation), into this rank's device KV on its stream, and calls
    /// `done` once the copy *completed* on the device (an event, not host bookkeeping): only
    /// then may the decode step read the blocks. No host mirror is involved, so no upload
    /// may follow.
    fn copy_from_peer(
        &self,
        peer_layout: KvLayout,
        handles: Vec<IpcRegion>,
        pairs: Vec<(u32, u32)>,
        done: CopyDone,
    );
}

/// Our placement, from the ranks' registered devices: `None` when no rank has one; a rank
/// without one is `Host` (which keeps the host path with every peer).
pub(crate) fn placement_of(
    engine_id: &str,
    identity: &HostIdentity,
    info: &KvPeerInfo,
    devices: &[Option<Arc<dyn DeviceKvPeer>>],
) -> Option<KvPlacement> {
    if devices.iter().all(Option::is_none) {
        return None;
    }
    let ranks = info
        .ranks
        .iter()
        .enumerate()
        .map(|(r, rank)| match devices.get(r).and_then(Option::as_ref) {
            None => RankPlacement::Host,
            Some(d) => {
                let dev = d.device();
                let layers = rank.layout.num_layers;
                RankPlacement::Device(kv_path::DeviceRank {
                    gpu_uuid: dev.gpu_uuid,
                    ordinal: dev.ordinal,
                    ipc_export: dev.handles.is_some(),
                    region_bytes: vec![rank.layout.region_bytes() as u64; layers],
                    handles: dev.handles.unwrap_or_default(),
                })
            }
        })
        .collect();
    Some(KvPlacement {
        engine_id: engine_id.to_string(),
        host: identity.clone(),
        ranks,
    })
}
