//! Device KV in the hand-off: same-GPU P/D over CUDA IPC, a transfer path chosen per peer at
//! the handshake (the rules are the pure [`kv_path::negotiate`] of `pdserve-core`).
//!
//! - **The seam.** A TP rank whose KV lives on a GPU registers a [`DeviceKvPeer`] with the
//!   instance's [`KvContext`] ([`KvContext::set_device`]); the CUDA rank executor implements
//!   it (`export_ipc` / `copy_from_peer` of `pdserve_gpu::cuda`). Without one — every CPU rank —
//!   the instance advertises nothing, sends no placement request, and keeps the host path.
//! - **The handshake.** A decode instance whose every rank registered a device, after the
//!   `Info` handshake with a prefill instance, sends [`PeerRequest::Placement`] with its own
//!   info and placement. The prefill instance checks the asker like a handshake, verifies its
//!   host proof locally ([`HostProofs`]) and answers its own placement — with its IPC handles
//!   only when the asker proved it runs on this host and each rank pair shares a GPU
//!   ([`kv_path::may_share_handles`]). The decode instance negotiates with the answer and
//!   caches the path per peer ([`Negotiated`], forgotten with the handshake after a failed
//!   hand-off). Each decision is logged with its reason.
//! - **The read.** A pull whose path is [`KvPath::CudaIpc`] skips the transfer engine: every
//!   rank calls [`DeviceKvPeer::copy_from_peer`] with the prefill rank's handles and the
//!   (remote block, local block) pairs; each copy's end is a rank report to the Aggregator as
//!   a batch's would be. The blocks land in device memory directly, so no mirror → device
//!   upload may follow for that hand-off. Pushes keep the host path.
//!
//! # Where the pieces live
//! The seam ([`DeviceKvPeer`]) and our placement are in [`super::device_kv`], host proofs
//! ([`HostProofs`]: how a peer's claim to run on this host is verified) in
//! [`super::host_proof`], the per-peer cache of negotiated paths ([`Negotiated`]) in
//! [`super::peer`]; this module holds the exchange and the read. They are re-exported here.

use super::aggregator::{AggregatorHandle, RankReport};
use super::context::KvContext;
use super::peer::{PeerAddr, Peers};
use super::plan::{check_blocks, validate_peer};
use super::protocol::{HandoffError, KvPeerInfo, PeerAnswer, PeerRequest, PlacementAsk};
use pdserve_core::handoff::kv_path::{
    self, HostProof, KvPath, KvPathError, KvPlacement, RankPlacement, RankShape, Side,
};
use pdserve_gpu::kv::KvLayout;
use pdserve_runtime::ids::TransferId;
use std::sync::Arc;

pub use super::device_kv::{CopyDone, DeviceCopyError, DeviceKvPeer, DeviceRankKv};
pub use super::host_proof::{boot_id, HostProofs, PublishedProof, HOST_PROOF_DIR_ENV};
pub use super::peer::Negotiated;

/// The region shapes of a published KV memory, for [`kv_path::negotiate`].
pub fn rank_shapes(info: &KvPeerInfo) -> Vec<RankShape> {
    info.ranks
        .iter()
        .map(|r| RankShape {
            heads: r.heads,
            num_layers: r.layout.num_layers,
            block_bytes: r.layout.block_bytes() as u64,
            num_blocks: r.layout.num_blocks as u64,
        })
        .collect()
}

/// A refused advertisement as the hand-off's error (kind `handshake`).
pub fn refusal(peer: &str, e: &KvPathError) -> HandoffError {
    HandoffError::LayoutMismatch {
        peer: peer.to_string(),
        reason: format!("KV placement refused ({}): {e}", e.kind()),
    }
}

impl Peers {
    /// The KV paths negotiated so far, per peer, for `inspect` (at most
    /// [`pdserve_runtime::wire::bounds::MAX_KV_PATHS`], names cut to their wire bounds).
    pub fn kv_paths(&self) -> Vec<pdserve_runtime::supervision::KvPathSnapshot> {
        use pdserve_runtime::wire::bounds::{MAX_ADDRESS_BYTES, MAX_KV_PATHS, MAX_NAME_BYTES};
        let cut = |s: String, max: usize| -> String {
            let mut end = s.len().min(max);
            while !s.is_char_boundary(end) {
                end -= 1;
            }
            s[..end].to_string()
        };
        let mut paths: Vec<_> = self
            .paths
            .iter()
            .take(MAX_KV_PATHS)
            .map(|e| pdserve_runtime::supervision::KvPathSnapshot {
                peer: cut(e.key().to_string(), MAX_ADDRESS_BYTES),
                path: e.value().path.as_str().to_string(),
                reason: match &e.value().path {
                    KvPath::CudaIpc => String::new(),
                    KvPath::Host(r) => cut(r.to_string(), MAX_NAME_BYTES),
                },
            })
            .collect();
        paths.sort_by(|a, b| a.peer.cmp(&b.peer));
        paths
    }

    /// The KV path from `peer` (whose handshake answer is `theirs`) to us: with no device
    /// placement of ours, the host path at once (no request); otherwise the placement
    /// exchange, negotiated and cached per peer until [`Peers::forget`].
    ///
    /// # Errors
    /// The call's failure, or a refusal of the peer's advertisement.
    pub async fn kv_path(
        &self,
        peer: &PeerAddr,
        ours: &KvPeerInfo,
        our_placement: Option<KvPlacement>,
        theirs: &KvPeerInfo,
        proofs: &HostProofs,
    ) -> Result<Negotiated, HandoffError> {
        let Some(mine) = our_placement else {
            return Ok(Negotiated {
                path: KvPath::Host(kv_path::HostReason::LocalOnHost),
                remote: None,
            });
        };
        if let Some(n) = self.paths.get(peer) {
            return Ok(n.clone());
        }
        let ask = PeerRequest::Placement(Box::new(PlacementAsk {
            info: ours.clone(),
            placement: mine.without_handles(),
        }));
        let remote = match self.call(peer, &ask, self.timeout).await? {
            PeerAnswer::Placement(p) => Some(*p),
            PeerAnswer::Failed(e) => {
                // An older instance, one without device KV, or one that refused us.
                tracing::info!(%peer, error = %e, "the peer advertises no KV placement");
                None
            }
            other => {
                return Err(HandoffError::Protocol(format!(
                    "{peer} answered Placement with {}",
                    other.name()
                )))
            }
        };
        let proof = remote
            .as_ref()
            .map_or(HostProof::NotFound, |p| proofs.lookup(&p.host));
        let (a, b) = (rank_shapes(ours), rank_shapes(theirs));
        let path = kv_path::negotiate(
            Side {
                placement: Some(&mine),
                shapes: &a,
            },
            Side {
                placement: remote.as_ref(),
                shapes: &b,
            },
            &theirs.engine_id,
            &proof,
        )
        .map_err(|e| {
            tracing::warn!(%peer, kind = e.kind(), error = %e, "KV placement refused");
            refusal(&theirs.engine_id, &e)
        })?;
        match &path {
            KvPath::CudaIpc => tracing::info!(%peer, path = path.as_str(), "KV path negotiated"),
            KvPath::Host(reason) => {
                tracing::info!(%peer, path = path.as_str(), %reason, "KV path negotiated")
            }
        }
        let n = Negotiated {
            remote: (path == KvPath::CudaIpc).then(|| Arc::new(remote.expect("advertised"))),
            path,
        };
        self.paths.insert(peer.clone(), n.clone());
        Ok(n)
    }
}

/// The prefill side of the placement exchange: checks the asker like a handshake (and, on a
/// carrier that authenticated it, that it is who it says), verifies its host proof here, and
/// answers our placement — with our IPC handles only for a verified local asker on our GPUs.
///
/// # Errors
/// [`HandoffError::NotSupported`] without device KV; the handshake's errors; a refusal of the
/// asker's advertisement (forged host, malformed).
pub fn answer_placement(
    kv: &KvContext,
    ask: PlacementAsk,
    caller: Option<&str>,
) -> Result<KvPlacement, HandoffError> {
    let PlacementAsk { info, placement } = ask;
    if let Some(c) = caller.filter(|c| *c != info.engine_id) {
        return Err(HandoffError::BadRequest(format!(
            "node `{c}` cannot ask for KV placement as `{}`",
            info.engine_id
        )));
    }
    let ours_info = kv.info();
    validate_peer(&ours_info, &info)?;
    let Some(ours) = kv.placement() else {
        return Err(HandoffError::NotSupported(
            "this instance keeps its KV in host memory".into(),
        ));
    };
    let proof = kv.host_proofs().lookup(&placement.host);
    let (a, b) = (rank_shapes(&ours_info), rank_shapes(&info));
    let path = kv_path::may_share_handles(
        Side {
            placement: Some(&ours),
            shapes: &a,
        },
        Side {
            placement: Some(&placement),
            shapes: &b,
        },
        &info.engine_id,
        &proof,
    )
    .map_err(|e| refusal(&info.engine_id, &e))?;
    tracing::info!(peer = %info.engine_id, path = path.as_str(), "KV placement asked");
    Ok(match path {
        KvPath::CudaIpc => ours,
        KvPath::Host(_) => ours.without_handles(),
    })
}

/// A pull's reads over CUDA IPC, when that is the path negotiated with its peer.
pub(crate) struct DeviceRead {
    remote: Arc<KvPlacement>,
    layouts: Vec<KvLayout>,
    pairs: Vec<(u32, u32)>,
}

impl DeviceRead {
    /// Prepares the reads of `remote` blocks into `local` ones over CUDA IPC, when the path
    /// negotiated with `peer` is CUDA IPC; `None` for the host path (and at once, without any
    /// call, on an instance without device KV).
    ///
    /// # Errors
    /// The handshake's, the block checks', the negotiation's.
    pub(crate) async fn prepare(
        kv: &KvContext,
        peer: &PeerAddr,
        remote: &[u32],
        local: &[u32],
        cached_blocks: usize,
        prompt_len: usize,
    ) -> Result<Option<Self>, HandoffError> {
        let Some(mine) = kv.placement() else {
            return Ok(None);
        };
        let ours = kv.info();
        let theirs = kv.peers.info(peer, &ours).await?;
        let n = check_blocks(&ours, &theirs, local, remote, prompt_len)?;
        let negotiated = kv
            .peers
            .kv_path(peer, &ours, Some(mine), &theirs, kv.host_proofs())
            .await?;
        let Some(placement) = negotiated.remote else {
            return Ok(None);
        };
        // Delta transfer: the leading blocks our prefix cache holds are not copied.
        let skip = cached_blocks.min(n.saturating_sub(1));
        Ok(Some(Self {
            remote: placement,
            layouts: theirs.ranks.iter().map(|r| r.layout).collect(),
            pairs: remote[skip..n]
                .iter()
                .copied()
                .zip(local[skip..n].iter().copied())
                .collect(),
        }))
    }

    /// Runs the copies, one per rank, joined by the Aggregator like a pull's batches; every
    /// copy is awaited to its end, or, past the transfer bound, for one more bound (a copy
    /// queued on a stream cannot be cancelled, and a late one would land in our blocks).
    pub(crate) async fn run(
        self,
        kv: &KvContext,
        aggregator: &AggregatorHandle,
        transfer: TransferId,
    ) -> Result<(), HandoffError> {
        let bound = kv.bounds().transfer;
        let this = &self;
        super::aggregator::joined(
            aggregator,
            transfer,
            kv.epochs.current(),
            bound,
            |rank| async move {
                match this.copy_rank(kv, rank, bound).await {
                    Ok(bytes) => {
                        kv.received(bytes);
                        RankReport::Done
                    }
                    Err(e) => RankReport::Failed(e),
                }
            },
        )
        .await
    }

    async fn copy_rank(
        &self,
        kv: &KvContext,
        rank: usize,
        bound: std::time::Duration,
    ) -> Result<u64, HandoffError> {
        let device = kv.device(rank).ok_or_else(|| {
            HandoffError::CacheLost(format!("rank {rank} no longer has device KV"))
        })?;
        let (Some(RankPlacement::Device(d)), Some(layout)) =
            (self.remote.ranks.get(rank), self.layouts.get(rank))
        else {
            return Err(HandoffError::Protocol(format!(
                "the peer's placement has no device rank {rank}"
            )));
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        device.copy_from_peer(
            *layout,
            d.handles.clone(),
            self.pairs.clone(),
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        let what = "the CUDA IPC copy";
        let mut rx = rx;
        match tokio::time::timeout(bound, &mut rx).await {
            Ok(Ok(Ok(()))) => Ok(self.pairs.len() as u64
                * 2
                * layout.num_layers as u64
                * layout.block_bytes() as u64),
            Ok(Ok(Err(e))) => Err(HandoffError::Transfer {
                kind: "cuda_ipc".into(),
                message: format!("rank {rank}: {e}"),
            }),
            Ok(Err(_)) => Err(HandoffError::Interrupted(format!(
                "{what} of rank {rank} was dropped"
            ))),
            Err(_) => {
                // A queued device copy cannot be cancelled: give it one more bound to end
                // before this rank reports (after which the blocks may be reused).
                let _ = tokio::time::timeout(bound, rx).await;
                Err(HandoffError::timeout(what, bound))
            }
        }
    }
}
