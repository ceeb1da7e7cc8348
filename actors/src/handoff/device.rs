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
//! # Host proofs
//! [`HostProofs`] keeps one file per process in a per-user directory on tmpfs
//! (`$PDSERVE_HOST_PROOF_DIR`, else `/dev/shm/pdserve-host-proofs-<uid>`), created with mode
//! 0700 and used only while it is a real directory of ours that nobody else may write; each
//! file (`<proof_id as 16 hex digits>.proof`, mode 0600, removed when the instance drops its
//! context) holds the 32-byte nonce and the engine id of the advertisement. A peer claiming
//! this host is verified by reading the file its `proof_id` names.

use super::aggregator::{AggregatorMsg, RankReport};
use super::context::KvContext;
use super::peer::{PeerAddr, Peers};
use super::plan::{check_blocks, validate_peer};
use super::protocol::{HandoffError, KvPeerInfo, PeerAnswer, PeerRequest, PlacementAsk};
use crate::mailbox::Mailbox;
use pdserve_core::handoff::kv_path::{
    self, HostIdentity, HostProof, IpcRegion, KvPath, KvPathError, KvPlacement, RankPlacement,
    RankShape, Side, HOST_NONCE_BYTES,
};
use pdserve_gpu::kv::KvLayout;
use pdserve_runtime::ids::TransferId;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Environment variable naming the host-proof directory (see the module doc).
pub const HOST_PROOF_DIR_ENV: &str = "PDSERVE_HOST_PROOF_DIR";

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

/// Where a device copy's outcome goes: called exactly once, from any thread.
pub type CopyDone = Box<dyn FnOnce(Result<(), String>) + Send>;

/// The seam between the hand-off and a TP rank whose KV lives on a GPU: the CUDA rank
/// executor implements it (`CudaRankExecutor::export_ipc` / `copy_from_peer`); the TpWorker
/// registers it with [`KvContext::set_device`] once its executor runs, and clears it when the
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

/// This host's proof files (see the module doc).
#[derive(Clone, Debug)]
pub struct HostProofs {
    dir: PathBuf,
}

/// A published proof: the identity to advertise; its file is removed on drop.
#[derive(Debug)]
pub struct PublishedProof {
    /// What the placement advertises.
    pub identity: HostIdentity,
    path: PathBuf,
}

impl Drop for PublishedProof {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The kernel's boot id, or empty where there is none (never the same host then).
pub fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().chars().take(kv_path::MAX_BOOT_ID_BYTES).collect())
        .unwrap_or_default()
}

impl HostProofs {
    /// The directory of [`HOST_PROOF_DIR_ENV`], else the per-user default on `/dev/shm`.
    pub fn from_env() -> Self {
        let dir = std::env::var_os(HOST_PROOF_DIR_ENV)
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                let uid = own_uid().unwrap_or(u32::MAX);
                PathBuf::from(format!("/dev/shm/pdserve-host-proofs-{uid}"))
            });
        Self { dir }
    }

    /// Proofs in `dir`.
    pub fn at(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// Writes a fresh proof of `engine_id` under `boot_id`.
    ///
    /// # Errors
    /// The directory is not ours alone, or the file cannot be written.
    pub fn publish(&self, engine_id: &str, boot_id: String) -> std::io::Result<PublishedProof> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        self.ensure_dir()?;
        let key = pdserve_transport::SessionKey::generate().map_err(std::io::Error::other)?;
        let mut nonce = [0u8; HOST_NONCE_BYTES];
        nonce.copy_from_slice(&key.as_bytes()[..HOST_NONCE_BYTES]);
        let proof_id = TransferId::new_random().0 as u64;
        let path = self.file(proof_id);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)?;
        let published = PublishedProof {
            identity: HostIdentity {
                boot_id,
                proof_id,
                nonce,
            },
            path,
        };
        f.write_all(&nonce)?;
        f.write_all(engine_id.as_bytes())?;
        Ok(published)
    }

    /// What this host holds for `claimed`'s proof id: [`HostProof::NotFound`] when nothing
    /// (or the directory is not ours alone, or the file is malformed).
    pub fn lookup(&self, claimed: &HostIdentity) -> HostProof {
        if self.check_dir().is_err() {
            return HostProof::NotFound;
        }
        let Ok(f) = std::fs::File::open(self.file(claimed.proof_id)) else {
            return HostProof::NotFound;
        };
        let mut bytes = Vec::new();
        let limit = (HOST_NONCE_BYTES + kv_path::MAX_ENGINE_ID_BYTES) as u64;
        if f.take(limit + 1).read_to_end(&mut bytes).is_err()
            || bytes.len() as u64 > limit
            || bytes.len() < HOST_NONCE_BYTES
        {
            return HostProof::NotFound;
        }
        let (n, engine) = bytes.split_at(HOST_NONCE_BYTES);
        let Ok(engine_id) = std::str::from_utf8(engine) else {
            return HostProof::NotFound;
        };
        let mut nonce = [0u8; HOST_NONCE_BYTES];
        nonce.copy_from_slice(n);
        HostProof::Found {
            engine_id: engine_id.to_string(),
            nonce,
        }
    }

    fn file(&self, proof_id: u64) -> PathBuf {
        self.dir.join(format!("{proof_id:016x}.proof"))
    }

    fn ensure_dir(&self) -> std::io::Result<()> {
        use std::os::unix::fs::DirBuilderExt;
        match std::fs::DirBuilder::new().mode(0o700).create(&self.dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        self.check_dir()
    }

    /// The directory must be a real directory (not a link) of this user that no one else may
    /// write or read: otherwise another user could plant proofs.
    fn check_dir(&self) -> std::io::Result<()> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::symlink_metadata(&self.dir)?;
        let ours = own_uid()?;
        if !m.is_dir() || m.uid() != ours || m.mode() & 0o077 != 0 {
            return Err(std::io::Error::other(format!(
                "{} is not a private directory of uid {ours}",
                self.dir.display()
            )));
        }
        Ok(())
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

fn own_uid() -> std::io::Result<u32> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").map(|m| m.uid())
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

/// The path negotiated with one peer, cached by [`Peers`].
#[derive(Clone, Debug)]
pub struct Negotiated {
    /// The path.
    pub path: KvPath,
    /// The peer's advertisement when the path is CUDA IPC (its handles).
    pub remote: Option<Arc<KvPlacement>>,
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
        aggregator: &Mailbox<AggregatorMsg>,
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
            Ok(Ok(Err(message))) => Err(HandoffError::Transfer {
                kind: "cuda_ipc".into(),
                message,
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn private_dir() -> (tempfile::TempDir, HostProofs) {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("proofs");
        (t, HostProofs::at(dir))
    }

    #[test]
    fn a_published_proof_is_found_here_until_dropped() {
        let (_t, proofs) = private_dir();
        let p = proofs.publish("p0", "boot".into()).unwrap();
        let mode = std::fs::metadata(proofs.dir())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);
        assert_eq!(
            proofs.lookup(&p.identity),
            HostProof::Found {
                engine_id: "p0".into(),
                nonce: p.identity.nonce,
            }
        );
        let mut other = p.identity.clone();
        other.proof_id ^= 1;
        assert_eq!(proofs.lookup(&other), HostProof::NotFound);
        let q = proofs.publish("p1", "boot".into()).unwrap();
        assert_ne!(q.identity.nonce, p.identity.nonce);
        assert_ne!(q.identity.proof_id, p.identity.proof_id);
        let id = p.identity.clone();
        drop(p);
        assert_eq!(proofs.lookup(&id), HostProof::NotFound);
    }

    #[test]
    fn a_directory_others_may_write_is_not_trusted() {
        let (_t, proofs) = private_dir();
        let p = proofs.publish("p0", "boot".into()).unwrap();
        std::fs::set_permissions(proofs.dir(), std::fs::Permissions::from_mode(0o777)).unwrap();
        assert_eq!(proofs.lookup(&p.identity), HostProof::NotFound);
        assert!(proofs.publish("p1", "boot".into()).is_err());
        // A link to a directory is not the directory.
        std::fs::set_permissions(proofs.dir(), std::fs::Permissions::from_mode(0o700)).unwrap();
        let link = proofs.dir().with_file_name("link");
        std::os::unix::fs::symlink(proofs.dir(), &link).unwrap();
        assert_eq!(
            HostProofs::at(&link).lookup(&p.identity),
            HostProof::NotFound
        );
    }

    #[test]
    fn malformed_proof_files_prove_nothing() {
        let (_t, proofs) = private_dir();
        let p = proofs.publish("p0", "boot".into()).unwrap();
        let file = proofs.file(p.identity.proof_id);
        for bytes in [
            vec![1u8; HOST_NONCE_BYTES - 1],
            [vec![0u8; HOST_NONCE_BYTES], vec![0xff, 0xfe]].concat(),
            vec![b'a'; HOST_NONCE_BYTES + kv_path::MAX_ENGINE_ID_BYTES + 1],
        ] {
            std::fs::write(&file, &bytes).unwrap();
            assert_eq!(proofs.lookup(&p.identity), HostProof::NotFound);
        }
    }

    #[test]
    fn the_boot_id_is_read_here() {
        // Linux test machines have one; it is what two processes of one kernel share.
        let b = boot_id();
        assert_eq!(b, boot_id());
        assert!(b.len() <= kv_path::MAX_BOOT_ID_BYTES);
    }
}
