//! The CUDA rank's side of same-GPU P/D ([`DeviceKvPeer`], see `handoff::device`): its GPU's
//! UUID and the IPC handles of its KV regions, exported once when the worker starts, and
//! device-to-device copies from a peer process's regions on the rank's own thread.

use crate::handoff::device_kv::{CopyDone, DeviceCopyError, DeviceKvPeer, DeviceRankKv};
use pdserve_core::handoff::kv_path::IpcRegion;
use pdserve_gpu::cuda::kv::IpcRegionHandle;
use pdserve_gpu::cuda::CudaRankExecutor;
use pdserve_gpu::kv::KvLayout;
use std::sync::Arc;

/// One CUDA rank as the hand-off sees it.
pub(crate) struct CudaKvPeer {
    exec: Arc<CudaRankExecutor>,
    device: DeviceRankKv,
}

impl CudaKvPeer {
    /// Exports the rank's IPC handles (blocking: a job on the rank's thread). A rank whose
    /// regions cannot be exported still advertises its GPU, without handles: peers then
    /// negotiate the host path (`local_no_ipc` / `remote_no_ipc`).
    pub(crate) fn new(exec: Arc<CudaRankExecutor>) -> Self {
        let handles = match exec.export_ipc() {
            Ok(h) => Some(
                h.into_iter()
                    .map(|IpcRegionHandle { handle, bytes }| IpcRegion { handle, bytes })
                    .collect(),
            ),
            Err(e) => {
                tracing::warn!(rank = exec.rank(), error = %e, "KV regions cannot be exported over CUDA IPC: hand-offs keep the host path");
                None
            }
        };
        let device = DeviceRankKv {
            gpu_uuid: exec.gpu_uuid(),
            ordinal: exec.ordinal() as u32,
            handles,
        };
        Self { exec, device }
    }
}

impl DeviceKvPeer for CudaKvPeer {
    fn device(&self) -> DeviceRankKv {
        self.device.clone()
    }

    fn copy_from_peer(
        &self,
        peer_layout: KvLayout,
        handles: Vec<IpcRegion>,
        pairs: Vec<(u32, u32)>,
        done: CopyDone,
    ) {
        // The executor's copy waits for the rank thread (which opens the peer's regions,
        // queues the copies on the rank's stream and synchronizes it before answering): a
        // thread of its own keeps the caller (an async hand-off driver) from blocking.
        let exec = self.exec.clone();
        let handles = handles
            .into_iter()
            .map(|IpcRegion { handle, bytes }| IpcRegionHandle { handle, bytes })
            .collect();
        // `done` is answered exactly once, by the thread or, if it cannot start, here.
        let slot = Arc::new(std::sync::Mutex::new(Some(done)));
        let take = |slot: &std::sync::Mutex<Option<CopyDone>>| {
            slot.lock().unwrap_or_else(|e| e.into_inner()).take()
        };
        let thread_slot = slot.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("pdserve-cuda{}-ipc", exec.rank()))
            .spawn(move || {
                let r = exec
                    .copy_from_peer(peer_layout, handles, pairs)
                    .map_err(DeviceCopyError::from);
                if let Some(done) = take(&thread_slot) {
                    done(r)
                }
            });
        if let Err(e) = spawned {
            if let Some(done) = take(&slot) {
                done(Err(DeviceCopyError::Spawn(e)));
            }
        }
    }
}
