//! Which path a P/D hand-off's KV takes between two instances, decided once per peer at the
//! handshake: the transfer engine's host path (the existing backends: `local`, `shm`, `tcp`,
//! `quic`, `rdma`), or **CUDA IPC** — the decode rank opens the prefill rank's device KV
//! regions and copies blocks device to device — when both instances keep their KV on the same
//! GPU of the same host.
//!
//! Each side advertises a [`KvPlacement`]: its engine id, a [`HostIdentity`] and, per TP rank,
//! whether its KV lives in host memory ([`RankPlacement::Host`]) or on a GPU
//! ([`RankPlacement::Device`]: GPU UUID and ordinal, whether its regions can be exported over
//! CUDA IPC, their sizes, and — only to a peer it verified as local — their IPC handles).
//! [`negotiate`] is a pure function of both advertisements, both sides' region shapes and what
//! the local host says about the peer's host proof ([`HostProof`]). It answers
//!
//! - [`KvPath::CudaIpc`] only when every rank of both sides is on a device, the peer proved it
//!   runs on this host, TP sizes and region shapes are equal, each rank pair shares one GPU
//!   (same UUID: peer access between two GPUs is not attempted yet), both sides can export,
//!   and the peer's handles are well-formed;
//! - otherwise [`KvPath::Host`] with a typed [`HostReason`] (for logs, metrics, `inspect`);
//! - or a [`KvPathError`] for an advertisement that is malformed, inconsistent with the
//!   peer's published layout, or forged (a same-host claim whose proof does not check out).
//!
//! # Host identity
//! A remote must not be able to look local: if it could, a decode instance would open "IPC
//! handles" it supplies (replayed from a real local process) and copy another hand-off's KV.
//! An advertisement's [`HostIdentity`] holds the kernel boot id (`/proc/sys/kernel/random/
//! boot_id`, shared by every process and container of one boot), a random `proof_id`, and a
//! random 32-byte `nonce`. Before advertising, the process writes its engine id and nonce to a
//! host-local file named after `proof_id` (mode 0600 under a per-user directory on tmpfs,
//! `pdserve_actors::handoff::device`). The verifier compares the boot id, then reads that file
//! on its own host ([`HostProof`]):
//! - no such file (another host with the same boot id cannot exist, but a container with its
//!   own `/dev/shm` can): not verified, host path ([`HostReason::HostUnverified`]);
//! - a file whose engine id or nonce differs from the advertisement: refused
//!   ([`KvPathError::ForgedHost`]). Replaying a local process's identity needs its engine id,
//!   which the control plane binds to the caller's certificate.
//!
//! Every count and length of a remote's advertisement is bounded ([`KvPlacement::validate_bounds`],
//! on receipt, before it reaches shared state).

/// Bytes of a CUDA IPC memory handle (`CUipcMemHandle`).
pub const IPC_HANDLE_BYTES: usize = 64;
/// Bytes of a host identity's nonce.
pub const HOST_NONCE_BYTES: usize = 32;
/// Longest boot id, in bytes (a UUID string is 36).
pub const MAX_BOOT_ID_BYTES: usize = 64;
/// Longest engine id in an advertisement, in bytes (the peer protocol's name bound).
pub const MAX_ENGINE_ID_BYTES: usize = 1024;
/// Most TP ranks one advertisement names (the peer protocol's `MAX_RANKS`).
pub const MAX_PLACEMENT_RANKS: usize = 1024;
/// Most regions (layers) of one rank (the peer protocol's `MAX_RANK_REGIONS`).
pub const MAX_PLACEMENT_REGIONS: usize = 4096;

/// Who claims to run on which host (see the module's "Host identity").
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct HostIdentity {
    /// The kernel's boot id.
    pub boot_id: String,
    /// Names the host-local proof file of the advertising process.
    pub proof_id: u64,
    /// What that file holds beside the engine id.
    pub nonce: [u8; HOST_NONCE_BYTES],
}

/// One exported device region, as the peer process opens it.
#[derive(Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct IpcRegion {
    /// The `CUipcMemHandle` bytes; exactly [`IPC_HANDLE_BYTES`] when well-formed.
    pub handle: Vec<u8>,
    /// Length of the region in bytes.
    pub bytes: u64,
}

impl std::fmt::Debug for IpcRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // A handle opens memory: keep it out of logs.
        f.debug_struct("IpcRegion")
            .field("handle", &format_args!("<{} bytes>", self.handle.len()))
            .field("bytes", &self.bytes)
            .finish()
    }
}

/// One TP rank's KV on a GPU.
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct DeviceRank {
    /// The GPU's UUID (`cuDeviceGetUuid`).
    pub gpu_uuid: [u8; 16],
    /// Its ordinal in the advertising process (for logs: ordinals depend on
    /// `CUDA_VISIBLE_DEVICES`, the UUID does not).
    pub ordinal: u32,
    /// Whether the rank's regions can be exported (and peers' opened) over CUDA IPC.
    pub ipc_export: bool,
    /// Bytes of each layer's region, in layer order.
    pub region_bytes: Vec<u64>,
    /// The regions' IPC handles, in layer order; empty when not shared with this peer.
    pub handles: Vec<IpcRegion>,
}

/// Where one TP rank keeps its KV.
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum RankPlacement {
    /// Host memory (the CPU cache, or a device rank without IPC): only the host path.
    Host,
    /// A GPU.
    Device(DeviceRank),
}

/// What an instance advertises about where its KV lives.
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct KvPlacement {
    /// The advertising instance (its `engine_id`).
    pub engine_id: String,
    /// Its host.
    pub host: HostIdentity,
    /// Per TP rank, in rank order.
    pub ranks: Vec<RankPlacement>,
}

impl KvPlacement {
    /// Whether every rank keeps its KV on a device.
    pub fn all_device(&self) -> bool {
        !self.ranks.is_empty()
            && self
                .ranks
                .iter()
                .all(|r| matches!(r, RankPlacement::Device(_)))
    }

    /// The same advertisement without IPC handles (what a peer that is not verified as local
    /// gets).
    pub fn without_handles(&self) -> Self {
        let mut p = self.clone();
        for r in &mut p.ranks {
            if let RankPlacement::Device(d) = r {
                d.handles.clear();
            }
        }
        p
    }

    /// Checks every count and length a remote controls against the bounds above.
    ///
    /// # Errors
    /// [`KvPathError::Bound`] naming the field.
    pub fn validate_bounds(&self) -> Result<(), KvPathError> {
        bound(
            "placement.engine_id bytes",
            self.engine_id.len(),
            MAX_ENGINE_ID_BYTES,
        )?;
        bound(
            "placement.boot_id bytes",
            self.host.boot_id.len(),
            MAX_BOOT_ID_BYTES,
        )?;
        bound("placement.ranks", self.ranks.len(), MAX_PLACEMENT_RANKS)?;
        for r in &self.ranks {
            if let RankPlacement::Device(d) = r {
                bound(
                    "placement.region_bytes",
                    d.region_bytes.len(),
                    MAX_PLACEMENT_REGIONS,
                )?;
                bound("placement.handles", d.handles.len(), MAX_PLACEMENT_REGIONS)?;
                for h in &d.handles {
                    bound("placement.handle bytes", h.handle.len(), IPC_HANDLE_BYTES)?;
                }
            }
        }
        Ok(())
    }
}

fn bound(field: &'static str, n: usize, max: usize) -> Result<(), KvPathError> {
    if n > max {
        return Err(KvPathError::Bound { field, n, max });
    }
    Ok(())
}

/// One TP rank's region shape, from its published KV layout (`KvLayout` of `pdserve-gpu`;
/// the caller converts, this crate does not know the model).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankShape {
    /// KV heads of the model this rank holds (`start..end`).
    pub heads: (usize, usize),
    /// Layers (one region each).
    pub num_layers: usize,
    /// Bytes of one block of K (or V) of one layer on this rank.
    pub block_bytes: u64,
    /// Blocks in the rank's pool.
    pub num_blocks: u64,
}

impl RankShape {
    /// Bytes of one layer's region (K and V of every block).
    pub fn region_bytes(&self) -> u64 {
        2 * self.num_blocks * self.block_bytes
    }
}

/// What this host says about a peer's host proof: the contents of the proof file named by
/// its `proof_id`, read locally by the caller of [`negotiate`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostProof {
    /// No proof file of that id on this host.
    NotFound,
    /// The file names this engine and nonce.
    Found {
        /// The engine id written in it.
        engine_id: String,
        /// The nonce written in it.
        nonce: [u8; HOST_NONCE_BYTES],
    },
}

/// Why the host path was chosen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostReason {
    /// The peer advertised no placement (a CPU instance, an older pdserve, a build without
    /// CUDA, or a peer that refused the exchange).
    NotAdvertised,
    /// A rank of this instance keeps its KV in host memory.
    LocalOnHost,
    /// A rank of the peer keeps its KV in host memory.
    RemoteOnHost,
    /// The peer runs under another kernel (boot id).
    OtherHost,
    /// The peer claims this kernel, but its proof file is not here (a container with its own
    /// `/dev/shm`, say): CUDA IPC is not attempted.
    HostUnverified,
    /// Different TP sizes (heterogeneous TP maps head ranges: host path only).
    TpDiffers,
    /// A rank pair's region shapes differ (heads or block bytes).
    ShapeDiffers {
        /// The rank.
        rank: usize,
    },
    /// A rank pair sits on two different GPUs (peer access is not attempted yet).
    OtherGpu {
        /// The rank.
        rank: usize,
    },
    /// A rank of this instance cannot open IPC handles.
    LocalNoIpc {
        /// The rank.
        rank: usize,
    },
    /// A rank of the peer cannot export IPC handles.
    RemoteNoIpc {
        /// The rank.
        rank: usize,
    },
    /// The peer did not share its handles (it did not verify us as local).
    HandlesWithheld {
        /// The rank.
        rank: usize,
    },
}

impl HostReason {
    /// A stable name, for metric labels and logs.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::NotAdvertised => "not_advertised",
            Self::LocalOnHost => "local_on_host",
            Self::RemoteOnHost => "remote_on_host",
            Self::OtherHost => "other_host",
            Self::HostUnverified => "host_unverified",
            Self::TpDiffers => "tp_differs",
            Self::ShapeDiffers { .. } => "shape_differs",
            Self::OtherGpu { .. } => "other_gpu",
            Self::LocalNoIpc { .. } => "local_no_ipc",
            Self::RemoteNoIpc { .. } => "remote_no_ipc",
            Self::HandlesWithheld { .. } => "handles_withheld",
        }
    }
}

impl std::fmt::Display for HostReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::ShapeDiffers { rank }
            | Self::OtherGpu { rank }
            | Self::LocalNoIpc { rank }
            | Self::RemoteNoIpc { rank }
            | Self::HandlesWithheld { rank } => write!(f, "{} (rank {rank})", self.as_str()),
            _ => f.write_str(self.as_str()),
        }
    }
}

/// The path a peer's KV takes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvPath {
    /// Device to device over CUDA IPC (same host, same GPU per rank).
    CudaIpc,
    /// The transfer engine's host path, and why.
    Host(HostReason),
}

impl KvPath {
    /// `cuda_ipc` or `host`, for metric labels and logs.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::CudaIpc => "cuda_ipc",
            Self::Host(_) => "host",
        }
    }
}

/// A refused advertisement.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KvPathError {
    /// A count or length past its bound.
    #[error("KV placement: {field}: {n} exceeds the limit of {max}")]
    Bound {
        /// The field.
        field: &'static str,
        /// Its count or length.
        n: usize,
        /// The bound.
        max: usize,
    },
    /// The advertisement names another engine than the peer we talk to.
    #[error("KV placement of `{claimed}` received from `{expected}`")]
    EngineMismatch {
        /// The engine it names.
        claimed: String,
        /// The peer's engine id.
        expected: String,
    },
    /// Not one placement per published rank.
    #[error("KV placement names {placement} ranks, the layout {layout}")]
    RankCount {
        /// Ranks in the placement.
        placement: usize,
        /// Ranks in the layout.
        layout: usize,
    },
    /// A device rank's region sizes are not one per layer.
    #[error("rank {rank}: {regions} region sizes for {layers} layers")]
    RegionCount {
        /// The rank.
        rank: usize,
        /// Region sizes advertised.
        regions: usize,
        /// Layers of its layout.
        layers: usize,
    },
    /// A region (or a handle's region) is not the size the rank's layout gives.
    #[error("rank {rank} layer {layer}: region of {advertised} bytes, the layout gives {layout}")]
    RegionSize {
        /// The rank.
        rank: usize,
        /// The layer.
        layer: usize,
        /// Bytes advertised.
        advertised: u64,
        /// Bytes of the layout.
        layout: u64,
    },
    /// Handles present, but not one per layer.
    #[error("rank {rank}: {handles} IPC handles for {layers} layers")]
    HandleCount {
        /// The rank.
        rank: usize,
        /// Handles advertised.
        handles: usize,
        /// Layers of its layout.
        layers: usize,
    },
    /// A handle of the wrong length.
    #[error("rank {rank} layer {layer}: IPC handle of {len} bytes, not {IPC_HANDLE_BYTES}")]
    HandleLength {
        /// The rank.
        rank: usize,
        /// The layer.
        layer: usize,
        /// Its length.
        len: usize,
    },
    /// A same-host claim whose proof does not check out.
    #[error("`{engine_id}` claims to run on this host, but {reason}")]
    ForgedHost {
        /// The claimant.
        engine_id: String,
        /// What did not match.
        reason: &'static str,
    },
}

impl KvPathError {
    /// A stable name, for metric labels and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Bound { .. } => "bound",
            Self::EngineMismatch { .. } => "engine_mismatch",
            Self::RankCount { .. } => "rank_count",
            Self::RegionCount { .. } => "region_count",
            Self::RegionSize { .. } => "region_size",
            Self::HandleCount { .. } => "handle_count",
            Self::HandleLength { .. } => "handle_length",
            Self::ForgedHost { .. } => "forged_host",
        }
    }
}

/// One side of a negotiation.
#[derive(Clone, Copy, Debug)]
pub struct Side<'a> {
    /// Its advertisement; `None`: none (host path).
    pub placement: Option<&'a KvPlacement>,
    /// Its ranks' region shapes, from its published layout.
    pub shapes: &'a [RankShape],
}

/// Checks an advertisement against the layout its sender published: bounds, one placement
/// per rank, one region size per layer equal to the layout's, and handles — when present —
/// one per layer, [`IPC_HANDLE_BYTES`] long, each of its region's size.
///
/// # Errors
/// The first inconsistency, as a [`KvPathError`].
pub fn check_placement(p: &KvPlacement, shapes: &[RankShape]) -> Result<(), KvPathError> {
    p.validate_bounds()?;
    if p.ranks.len() != shapes.len() {
        return Err(KvPathError::RankCount {
            placement: p.ranks.len(),
            layout: shapes.len(),
        });
    }
    for (rank, (r, shape)) in p.ranks.iter().zip(shapes).enumerate() {
        let RankPlacement::Device(d) = r else {
            continue;
        };
        let layers = shape.num_layers;
        let expected = shape.region_bytes();
        if d.region_bytes.len() != layers {
            return Err(KvPathError::RegionCount {
                rank,
                regions: d.region_bytes.len(),
                layers,
            });
        }
        if let Some((layer, &advertised)) = d
            .region_bytes
            .iter()
            .enumerate()
            .find(|(_, &b)| b != expected)
        {
            return Err(KvPathError::RegionSize {
                rank,
                layer,
                advertised,
                layout: expected,
            });
        }
        if d.handles.is_empty() {
            continue;
        }
        if d.handles.len() != layers {
            return Err(KvPathError::HandleCount {
                rank,
                handles: d.handles.len(),
                layers,
            });
        }
        for (layer, h) in d.handles.iter().enumerate() {
            if h.handle.len() != IPC_HANDLE_BYTES {
                return Err(KvPathError::HandleLength {
                    rank,
                    layer,
                    len: h.handle.len(),
                });
            }
            if h.bytes != expected {
                return Err(KvPathError::RegionSize {
                    rank,
                    layer,
                    advertised: h.bytes,
                    layout: expected,
                });
            }
        }
    }
    Ok(())
}

/// Whether `claimant`'s host identity is proven on this host: `Ok(true)` verified, `Ok(false)`
/// another host or unverifiable (with the reason), `Err` a forged claim.
fn verify_host(
    local: &HostIdentity,
    claimant: &KvPlacement,
    proof: &HostProof,
) -> Result<Option<HostReason>, KvPathError> {
    if claimant.host.boot_id != local.boot_id || local.boot_id.is_empty() {
        return Ok(Some(HostReason::OtherHost));
    }
    match proof {
        HostProof::NotFound => Ok(Some(HostReason::HostUnverified)),
        HostProof::Found { engine_id, nonce } => {
            let forged = |reason| KvPathError::ForgedHost {
                engine_id: claimant.engine_id.clone(),
                reason,
            };
            if *engine_id != claimant.engine_id {
                return Err(forged(
                    "the proof file of its proof id names another engine",
                ));
            }
            // Not secret from the claimant itself; compared in constant time anyway.
            let diff = nonce
                .iter()
                .zip(&claimant.host.nonce)
                .fold(0u8, |acc, (a, b)| acc | (a ^ b));
            if diff != 0 {
                return Err(forged("its nonce is not the one of its proof file"));
            }
            Ok(None)
        }
    }
}

/// Chooses the path of the KV that `remote` (named `remote_engine_id` by the carrier and the
/// handshake) hands to `local`: see the module doc for the rules, checked in this order —
/// the remote's advertisement (refusals), advertised or not, local then remote device ranks,
/// host and its proof, TP size, and per rank shape, GPU, IPC on both sides, handles.
///
/// `proof` is what this host's proof directory holds for the remote's `proof_id`
/// ([`HostProof::NotFound`] when it advertised nothing).
///
/// # Errors
/// [`KvPathError`] when the remote's advertisement is malformed, inconsistent with its
/// published layout (`remote.shapes`), names another engine, or claims this host falsely.
/// Our own advertisement is trusted (it is checked in debug builds).
pub fn negotiate(
    local: Side<'_>,
    remote: Side<'_>,
    remote_engine_id: &str,
    proof: &HostProof,
) -> Result<KvPath, KvPathError> {
    let Some(theirs) = remote.placement else {
        return Ok(KvPath::Host(HostReason::NotAdvertised));
    };
    check_placement(theirs, remote.shapes)?;
    if theirs.engine_id != remote_engine_id {
        return Err(KvPathError::EngineMismatch {
            claimed: theirs.engine_id.clone(),
            expected: remote_engine_id.to_string(),
        });
    }
    let Some(ours) = local.placement.filter(|p| p.all_device()) else {
        return Ok(KvPath::Host(HostReason::LocalOnHost));
    };
    debug_assert!(check_placement(ours, local.shapes).is_ok());
    if !theirs.all_device() {
        return Ok(KvPath::Host(HostReason::RemoteOnHost));
    }
    if let Some(reason) = verify_host(&ours.host, theirs, proof)? {
        return Ok(KvPath::Host(reason));
    }
    if ours.ranks.len() != theirs.ranks.len() || local.shapes.len() != remote.shapes.len() {
        return Ok(KvPath::Host(HostReason::TpDiffers));
    }
    let pairs = ours.ranks.iter().zip(&theirs.ranks);
    for (rank, ((a, b), (sa, sb))) in pairs
        .zip(local.shapes.iter().zip(remote.shapes))
        .enumerate()
    {
        let (RankPlacement::Device(a), RankPlacement::Device(b)) = (a, b) else {
            unreachable!("all_device on both sides");
        };
        if (sa.heads, sa.num_layers, sa.block_bytes) != (sb.heads, sb.num_layers, sb.block_bytes) {
            return Ok(KvPath::Host(HostReason::ShapeDiffers { rank }));
        }
        if a.gpu_uuid != b.gpu_uuid {
            return Ok(KvPath::Host(HostReason::OtherGpu { rank }));
        }
        if !a.ipc_export {
            return Ok(KvPath::Host(HostReason::LocalNoIpc { rank }));
        }
        if !b.ipc_export {
            return Ok(KvPath::Host(HostReason::RemoteNoIpc { rank }));
        }
        if b.handles.is_empty() {
            return Ok(KvPath::Host(HostReason::HandlesWithheld { rank }));
        }
    }
    Ok(KvPath::CudaIpc)
}

/// Whether `local` may share its IPC handles with the peer that advertised `remote`: the
/// negotiation from our side, with our own handles assumed present — the prefill instance
/// asks this before answering a placement exchange, so handles go only to a verified local
/// peer on the same GPU.
///
/// # Errors
/// As [`negotiate`], for the asker's advertisement.
pub fn may_share_handles(
    local: Side<'_>,
    remote: Side<'_>,
    remote_engine_id: &str,
    proof: &HostProof,
) -> Result<KvPath, KvPathError> {
    // The asker (decode) advertises no handles of its own; what it would withhold is not a
    // reason here, so pretend its handles are present once its advertisement checked out.
    let Some(theirs) = remote.placement else {
        return Ok(KvPath::Host(HostReason::NotAdvertised));
    };
    check_placement(theirs, remote.shapes)?;
    let mut filled = theirs.clone();
    for (r, shape) in filled.ranks.iter_mut().zip(remote.shapes) {
        if let RankPlacement::Device(d) = r {
            if d.handles.is_empty() {
                d.handles = (0..shape.num_layers)
                    .map(|_| IpcRegion {
                        handle: vec![0; IPC_HANDLE_BYTES],
                        bytes: shape.region_bytes(),
                    })
                    .collect();
            }
        }
    }
    negotiate(
        local,
        Side {
            placement: Some(&filled),
            shapes: remote.shapes,
        },
        remote_engine_id,
        proof,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const UUID: [u8; 16] = [7; 16];

    fn shape(rank: usize) -> RankShape {
        RankShape {
            heads: (rank * 2, rank * 2 + 2),
            num_layers: 3,
            block_bytes: 256,
            num_blocks: 10,
        }
    }

    fn shapes(tp: usize) -> Vec<RankShape> {
        (0..tp).map(shape).collect()
    }

    fn host(proof_id: u64, nonce: u8) -> HostIdentity {
        HostIdentity {
            boot_id: "boot-a".into(),
            proof_id,
            nonce: [nonce; HOST_NONCE_BYTES],
        }
    }

    fn device(handles: bool) -> RankPlacement {
        let s = shape(0);
        RankPlacement::Device(DeviceRank {
            gpu_uuid: UUID,
            ordinal: 0,
            ipc_export: true,
            region_bytes: vec![s.region_bytes(); s.num_layers],
            handles: if handles {
                (0..s.num_layers)
                    .map(|l| IpcRegion {
                        handle: vec![l as u8; IPC_HANDLE_BYTES],
                        bytes: s.region_bytes(),
                    })
                    .collect()
            } else {
                Vec::new()
            },
        })
    }

    fn placement(engine: &str, proof_id: u64, tp: usize, handles: bool) -> KvPlacement {
        KvPlacement {
            engine_id: engine.into(),
            host: host(proof_id, proof_id as u8),
            ranks: (0..tp).map(|_| device(handles)).collect(),
        }
    }

    fn proof_of(p: &KvPlacement) -> HostProof {
        HostProof::Found {
            engine_id: p.engine_id.clone(),
            nonce: p.host.nonce,
        }
    }

    fn run(
        ours: &KvPlacement,
        theirs: &KvPlacement,
        proof: &HostProof,
    ) -> Result<KvPath, KvPathError> {
        let (a, b) = (shapes(ours.ranks.len()), shapes(theirs.ranks.len()));
        negotiate(
            Side {
                placement: Some(ours),
                shapes: &a,
            },
            Side {
                placement: Some(theirs),
                shapes: &b,
            },
            "p0",
            proof,
        )
    }

    fn dev(p: &mut KvPlacement, rank: usize) -> &mut DeviceRank {
        match &mut p.ranks[rank] {
            RankPlacement::Device(d) => d,
            RankPlacement::Host => panic!("host rank"),
        }
    }

    #[test]
    fn same_host_same_gpu_is_cuda_ipc() {
        let ours = placement("d0", 1, 2, false);
        let theirs = placement("p0", 2, 2, true);
        assert_eq!(run(&ours, &theirs, &proof_of(&theirs)), Ok(KvPath::CudaIpc));
    }

    #[test]
    fn every_fallback_has_its_reason() {
        let ours = placement("d0", 1, 2, false);
        let theirs = placement("p0", 2, 2, true);
        let proof = proof_of(&theirs);
        let s2 = shapes(2);
        let host = |r| Ok(KvPath::Host(r));

        // Not advertised (an old peer, a CPU build).
        let none = negotiate(
            Side {
                placement: Some(&ours),
                shapes: &s2,
            },
            Side {
                placement: None,
                shapes: &s2,
            },
            "p0",
            &HostProof::NotFound,
        );
        assert_eq!(none, host(HostReason::NotAdvertised));
        // We are on the host (CPU instance), or one of our ranks is.
        let cpu = negotiate(
            Side {
                placement: None,
                shapes: &s2,
            },
            Side {
                placement: Some(&theirs),
                shapes: &s2,
            },
            "p0",
            &proof,
        );
        assert_eq!(cpu, host(HostReason::LocalOnHost));
        let mut half = ours.clone();
        half.ranks[1] = RankPlacement::Host;
        assert_eq!(run(&half, &theirs, &proof), host(HostReason::LocalOnHost));
        let mut t = theirs.clone();
        t.ranks[0] = RankPlacement::Host;
        assert_eq!(run(&ours, &t, &proof), host(HostReason::RemoteOnHost));
        // Another kernel; this kernel without its proof file.
        let mut t = theirs.clone();
        t.host.boot_id = "boot-b".into();
        assert_eq!(run(&ours, &t, &proof), host(HostReason::OtherHost));
        assert_eq!(
            run(&ours, &theirs, &HostProof::NotFound),
            host(HostReason::HostUnverified)
        );
        // Heterogeneous TP.
        let t1 = placement("p0", 2, 1, true);
        assert_eq!(run(&ours, &t1, &proof_of(&t1)), host(HostReason::TpDiffers));
        // Another GPU, no IPC on either side, handles withheld.
        let mut t = theirs.clone();
        dev(&mut t, 1).gpu_uuid = [8; 16];
        assert_eq!(
            run(&ours, &t, &proof),
            host(HostReason::OtherGpu { rank: 1 })
        );
        let mut o = ours.clone();
        dev(&mut o, 0).ipc_export = false;
        assert_eq!(
            run(&o, &theirs, &proof),
            host(HostReason::LocalNoIpc { rank: 0 })
        );
        let mut t = theirs.clone();
        dev(&mut t, 1).ipc_export = false;
        assert_eq!(
            run(&ours, &t, &proof),
            host(HostReason::RemoteNoIpc { rank: 1 })
        );
        let t = theirs.without_handles();
        assert_eq!(
            run(&ours, &t, &proof),
            host(HostReason::HandlesWithheld { rank: 0 })
        );
    }

    #[test]
    fn shapes_that_differ_fall_back() {
        let ours = placement("d0", 1, 1, false);
        let theirs = placement("p0", 2, 1, true);
        let a = shapes(1);
        let mut b = shapes(1);
        b[0].heads = (0, 4);
        b[0].block_bytes = 128;
        b[0].num_blocks = 20; // same region bytes: the advertisement still fits its layout
        let r = negotiate(
            Side {
                placement: Some(&ours),
                shapes: &a,
            },
            Side {
                placement: Some(&theirs),
                shapes: &b,
            },
            "p0",
            &proof_of(&theirs),
        );
        assert_eq!(r, Ok(KvPath::Host(HostReason::ShapeDiffers { rank: 0 })));
        // A pool of another size alone is fine: copies address blocks on each side.
        let mut c = shapes(1);
        c[0].num_blocks = 20;
        let mut t = theirs.clone();
        let d = dev(&mut t, 0);
        d.region_bytes = vec![c[0].region_bytes(); 3];
        for h in &mut d.handles {
            h.bytes = c[0].region_bytes();
        }
        let r = negotiate(
            Side {
                placement: Some(&ours),
                shapes: &a,
            },
            Side {
                placement: Some(&t),
                shapes: &c,
            },
            "p0",
            &proof_of(&t),
        );
        assert_eq!(r, Ok(KvPath::CudaIpc));
    }

    #[test]
    fn every_refusal_is_typed() {
        let ours = placement("d0", 1, 2, false);
        let theirs = placement("p0", 2, 2, true);
        let proof = proof_of(&theirs);
        let kind = |r: Result<KvPath, KvPathError>| r.unwrap_err().kind();

        let mut t = theirs.clone();
        dev(&mut t, 1).handles.pop();
        let e = run(&ours, &t, &proof).unwrap_err();
        assert_eq!(
            e,
            KvPathError::HandleCount {
                rank: 1,
                handles: 2,
                layers: 3
            }
        );
        assert_eq!(e.to_string(), "rank 1: 2 IPC handles for 3 layers");

        let mut t = theirs.clone();
        dev(&mut t, 0).handles[2].handle.pop();
        assert_eq!(
            run(&ours, &t, &proof),
            Err(KvPathError::HandleLength {
                rank: 0,
                layer: 2,
                len: 63
            })
        );

        let mut t = theirs.clone();
        dev(&mut t, 0).region_bytes[1] += 1;
        assert_eq!(kind(run(&ours, &t, &proof)), "region_size");
        let mut t = theirs.clone();
        dev(&mut t, 1).handles[0].bytes = 1 << 40;
        assert_eq!(kind(run(&ours, &t, &proof)), "region_size");
        let mut t = theirs.clone();
        dev(&mut t, 1).region_bytes.push(0);
        assert_eq!(kind(run(&ours, &t, &proof)), "region_count");

        // A device placement that does not fit its own published layout (rank count).
        let s3 = shapes(3);
        let s2 = shapes(2);
        let e = negotiate(
            Side {
                placement: Some(&ours),
                shapes: &s2,
            },
            Side {
                placement: Some(&theirs),
                shapes: &s3,
            },
            "p0",
            &proof,
        );
        assert_eq!(
            e,
            Err(KvPathError::RankCount {
                placement: 2,
                layout: 3
            })
        );

        // Wrong nonce, or the proof file of another engine: forged.
        let mut t = theirs.clone();
        t.host.nonce[5] ^= 1;
        assert_eq!(kind(run(&ours, &t, &proof)), "forged_host");
        let other = HostProof::Found {
            engine_id: "d0".into(),
            nonce: theirs.host.nonce,
        };
        assert_eq!(kind(run(&ours, &theirs, &other)), "forged_host");

        // An advertisement of another engine than the peer.
        let t = placement("p9", 2, 2, true);
        assert_eq!(kind(run(&ours, &t, &proof)), "engine_mismatch");

        // Refusals win over fallbacks: a malformed advertisement is refused even from a
        // peer that would only get the host path.
        let mut t = theirs.clone();
        t.host.boot_id = "boot-b".into();
        dev(&mut t, 0).handles[0].handle = vec![1; 10];
        assert_eq!(kind(run(&ours, &t, &proof)), "handle_length");
    }

    #[test]
    fn hostile_counts_are_bounded() {
        let mut t = placement("p0", 2, 1, true);
        dev(&mut t, 0).handles = vec![
            IpcRegion {
                handle: vec![0; IPC_HANDLE_BYTES],
                bytes: 0
            };
            MAX_PLACEMENT_REGIONS + 1
        ];
        assert!(matches!(
            t.validate_bounds(),
            Err(KvPathError::Bound {
                field: "placement.handles",
                n: 4097,
                max: 4096
            })
        ));
        let mut t = placement("p0", 2, 1, true);
        dev(&mut t, 0).handles[0].handle = vec![0; 1 << 20];
        assert_eq!(t.validate_bounds().unwrap_err().kind(), "bound");
        let mut t = placement("p0", 2, 1, true);
        t.host.boot_id = "b".repeat(MAX_BOOT_ID_BYTES + 1);
        assert_eq!(t.validate_bounds().unwrap_err().kind(), "bound");
        let mut t = placement("p0", 2, 1, true);
        t.ranks = vec![RankPlacement::Host; MAX_PLACEMENT_RANKS + 1];
        assert_eq!(t.validate_bounds().unwrap_err().kind(), "bound");
        let mut t = placement("p0", 2, 1, true);
        t.engine_id = "e".repeat(MAX_ENGINE_ID_BYTES + 1);
        assert_eq!(t.validate_bounds().unwrap_err().kind(), "bound");
        assert!(placement("p0", 2, 4, true).validate_bounds().is_ok());
    }

    #[test]
    fn handles_go_only_to_a_verified_local_peer_on_our_gpu() {
        // The prefill side (ours, with handles) asks about the decode side (no handles).
        let prefill = placement("p0", 2, 1, true);
        let decode = placement("d0", 1, 1, false);
        let s = shapes(1);
        let ask = |d: &KvPlacement, proof: &HostProof| {
            may_share_handles(
                Side {
                    placement: Some(&prefill),
                    shapes: &s,
                },
                Side {
                    placement: Some(d),
                    shapes: &s,
                },
                "d0",
                proof,
            )
        };
        assert_eq!(ask(&decode, &proof_of(&decode)), Ok(KvPath::CudaIpc));
        assert_eq!(
            ask(&decode, &HostProof::NotFound),
            Ok(KvPath::Host(HostReason::HostUnverified))
        );
        let mut other = decode.clone();
        dev(&mut other, 0).gpu_uuid = [1; 16];
        assert_eq!(
            ask(&other, &proof_of(&other)),
            Ok(KvPath::Host(HostReason::OtherGpu { rank: 0 }))
        );
        let mut forged = decode.clone();
        forged.host.nonce = [0; HOST_NONCE_BYTES];
        assert_eq!(
            ask(&forged, &proof_of(&decode)).unwrap_err().kind(),
            "forged_host"
        );
    }

    #[test]
    fn handles_stay_out_of_debug_output() {
        let p = placement("p0", 2, 1, true);
        let s = format!("{p:?}");
        assert!(s.contains("<64 bytes>"), "{s}");
        assert!(!s.contains("handle: ["), "{s}");
    }

    /// One side's advertisement, drawn from a small space so that every rule is hit.
    #[derive(Clone, Debug)]
    struct Draw {
        advertised: bool,
        tp: usize,
        host_rank: Option<usize>,
        boot_b: bool,
        gpu: u8,
        ipc: bool,
        handles: bool,
    }

    fn draw() -> impl Strategy<Value = Draw> {
        (
            prop::bool::weighted(0.9),
            1usize..3,
            prop::option::weighted(0.2, 0usize..2),
            prop::bool::weighted(0.2),
            prop::sample::select(vec![7u8, 7, 7, 8]),
            prop::bool::weighted(0.85),
            prop::bool::weighted(0.85),
        )
            .prop_map(
                |(advertised, tp, host_rank, boot_b, gpu, ipc, handles)| Draw {
                    advertised,
                    tp,
                    host_rank: host_rank.filter(|&r| r < tp),
                    boot_b,
                    gpu,
                    ipc,
                    handles,
                },
            )
    }

    fn build(d: &Draw, engine: &str, proof_id: u64) -> Option<KvPlacement> {
        d.advertised.then(|| {
            let mut p = placement(engine, proof_id, d.tp, d.handles);
            if d.boot_b {
                p.host.boot_id = "boot-b".into();
            }
            for r in 0..d.tp {
                if Some(r) == d.host_rank {
                    p.ranks[r] = RankPlacement::Host;
                } else {
                    let x = dev(&mut p, r);
                    x.gpu_uuid = [d.gpu; 16];
                    x.ipc_export = d.ipc;
                }
            }
            p
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

        /// The matrix: CUDA IPC exactly when every condition holds; otherwise the host path
        /// (well-formed advertisements are never refused); deterministic.
        #[test]
        fn cuda_ipc_exactly_when_every_condition_holds(l in draw(), r in draw(), proven in prop::bool::weighted(0.8)) {
            let ours = build(&l, "d0", 1);
            let theirs = build(&r, "p0", 2);
            let (sa, sb) = (shapes(l.tp), shapes(r.tp));
            let proof = match (&theirs, proven) {
                (Some(t), true) => proof_of(t),
                _ => HostProof::NotFound,
            };
            let go = || negotiate(
                Side { placement: ours.as_ref(), shapes: &sa },
                Side { placement: theirs.as_ref(), shapes: &sb },
                "p0",
                &proof,
            );
            let path = go().expect("well-formed advertisements are never refused");
            prop_assert_eq!(&path, &go().unwrap());
            let local_boot = if l.boot_b { "boot-b" } else { "boot-a" };
            let remote_boot = if r.boot_b { "boot-b" } else { "boot-a" };
            let expect_ipc = l.advertised && r.advertised
                && l.host_rank.is_none() && r.host_rank.is_none()
                && local_boot == remote_boot && proven
                && l.tp == r.tp && l.gpu == r.gpu
                && l.ipc && r.ipc && r.handles;
            prop_assert_eq!(path == KvPath::CudaIpc, expect_ipc, "{:?}", path);
            if !r.advertised {
                prop_assert_eq!(path, KvPath::Host(HostReason::NotAdvertised));
            } else if !l.advertised || l.host_rank.is_some() {
                prop_assert_eq!(path, KvPath::Host(HostReason::LocalOnHost));
            }
        }

        /// Whatever a hostile peer changes in a good advertisement: a decision or a typed
        /// refusal, never a panic; CUDA IPC only for an advertisement that still checks out.
        #[test]
        fn mutated_advertisements_never_panic(
            edits in prop::collection::vec((0usize..8, any::<u64>()), 1..5),
        ) {
            let ours = placement("d0", 1, 2, false);
            let mut t = placement("p0", 2, 2, true);
            let proof = proof_of(&t);
            for (what, v) in edits {
                let rank = (v as usize) % t.ranks.len();
                match (what, &mut t.ranks[rank]) {
                    (0, RankPlacement::Device(d)) => { d.handles.truncate((v % 4) as usize); }
                    (1, RankPlacement::Device(d)) => if let Some(h) = d.handles.first_mut() {
                        h.handle.resize((v % 100) as usize, 0);
                    },
                    (2, RankPlacement::Device(d)) => if let Some(b) = d.region_bytes.first_mut() { *b = v; },
                    (3, RankPlacement::Device(d)) => d.gpu_uuid[0] = v as u8,
                    (4, _) => t.host.nonce[(v % 32) as usize] = v as u8,
                    (5, _) => t.host.proof_id = v,
                    (6, r) => *r = RankPlacement::Host,
                    _ => t.ranks.truncate(1 + (v % 2) as usize),
                }
            }
            let r = run(&ours, &t, &proof);
            if r == Ok(KvPath::CudaIpc) {
                prop_assert!(check_placement(&t, &shapes(2)).is_ok());
                prop_assert_eq!(t.host.nonce, placement("p0", 2, 2, true).host.nonce);
            }
        }
    }
}
