//! Authenticated transfer sessions for the hand-off: who may touch which KV bytes.
//!
//! The **target** of a hand-off's transfers is the instance whose memory is touched: the
//! prefill instance in pull mode (decode reads its held blocks), the decode instance in push
//! mode (prefill writes its destination blocks). The target grants the initiator a transfer
//! session ([`Grants`]): a fresh 32-byte key, handed over inside the peer protocol — so over
//! the mutual-TLS control plane between instances with cluster credentials — and proven by
//! every transfer connection before any operation. Each hand-off then opens a **scope** on the
//! grant, fenced by its transfer id ([`fence_id`]), covering exactly the bytes of its blocks
//! (every layer, K and V, every rank): the target checks every operation against it, and once
//! the scope is fenced (the blocks are released, the hand-off was abandoned) no byte of it
//! lands any more — a write that was in flight when decode gave its blocks up is refused at the
//! target instead of landing in a block that is about to be reused.
//!
//! What each backend offers ([`Security::of`]):
//!
//! | backend | session key | per hand-off scope and fence |
//! |---|---|---|
//! | `local` | — (one process) | — |
//! | `shm` | yes | — (the initiator copies into the mapping itself): the grant covers the whole regions |
//! | `tcp`, `quic`, `rdma` | yes | yes |

use super::protocol::{HandoffError, TransferFailure};
use pdserve_gpu::kv::{KvKind, KvLayout};
use pdserve_runtime::ids::TransferId;
use pdserve_transport::{
    Access, BackendKind, BatchHandle, FenceId, FenceScope, RegionGrant, Session, SessionGrant,
    SessionGrantGuard, SessionKey, Side, TransferEngine, TransferOp, TransportError,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// What the hand-off can ask of a backend's sessions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Security {
    /// No keys (the `local` backend: both ends in one process).
    None,
    /// Keyed sessions whose grant covers whole regions (no per-hand-off fence: `shm`).
    Session,
    /// Keyed sessions, one fenced scope per hand-off.
    Fenced,
}

impl Security {
    /// What `backend` offers.
    pub fn of(backend: BackendKind) -> Self {
        match backend {
            BackendKind::Local => Self::None,
            BackendKind::Shm => Self::Session,
            BackendKind::Tcp | BackendKind::Quic | BackendKind::Rdma => Self::Fenced,
        }
    }

    /// Whether a write scope can be fenced at the target (so a write that was in flight when
    /// the hand-off was abandoned can never land).
    pub fn fenced(self) -> bool {
        self == Self::Fenced
    }
}

/// Submits a hand-off's `ops` on `session`, in scope `fence` when given. A session shared by
/// concurrent hand-offs may hold a view of the target's regions fetched before this
/// hand-off's scope was opened (on fenced backends a session sees only the regions of open
/// scopes); when the view lacks a region the ops name, the view is refreshed once — a fetch
/// issued now sees the scope, which stays open until the hand-off ends — and the ops are
/// submitted again.
///
/// # Errors
/// The transport's refusal, or the refresh's failure, as [`HandoffError::Transfer`].
pub async fn submit_ops(
    session: &Session,
    fence: Option<FenceId>,
    ops: &[TransferOp],
) -> Result<BatchHandle, HandoffError> {
    let submit = || match fence {
        Some(f) => session.submit_fenced(f, ops),
        None => session.submit(ops),
    };
    match submit() {
        Err(TransportError::UnknownRegion {
            side: Side::Remote, ..
        }) => {
            session
                .refresh_regions()
                .await
                .map_err(|e| HandoffError::transfer(&e))?;
            submit().map_err(|e| HandoffError::transfer(&e))
        }
        r => r.map_err(|e| HandoffError::transfer(&e)),
    }
}

/// The fence id of a hand-off's scope: derived from its transfer id on both sides (never 0,
/// the session's own scope).
pub fn fence_id(transfer: TransferId) -> FenceId {
    let f = (transfer.0 as u64) ^ ((transfer.0 >> 64) as u64);
    if f == 0 {
        1
    } else {
        f
    }
}

/// The bytes of `blocks` in every layer region of every rank, K and V, all heads: what a
/// hand-off's scope covers. `regions[r][l]` is rank `r`'s region of layer `l`.
pub fn block_grants(
    layouts: &[KvLayout],
    regions: &[Vec<u64>],
    blocks: &[u32],
    access: Access,
) -> Vec<RegionGrant> {
    let mut grants = Vec::new();
    for (layout, rank_regions) in layouts.iter().zip(regions) {
        for (layer, &region) in rank_regions.iter().enumerate() {
            for kind in [KvKind::Key, KvKind::Value] {
                for &b in blocks {
                    let span = layout.span(layer, kind, b as usize, 0..layout.num_kv_heads);
                    grants.push(RegionGrant::range(
                        region,
                        span.offset as u64,
                        span.len as u64,
                        access,
                    ));
                }
            }
        }
    }
    grants
}

/// A key granted to one initiator, and where to reach us with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Offer {
    /// The session key.
    pub key: [u8; 32],
    /// Our transfer engine's address as seen from the initiator.
    pub transfer_addr: String,
}

impl From<&Offer> for super::protocol::SessionOffer {
    fn from(o: &Offer) -> Self {
        Self {
            key: o.key,
            transfer_addr: o.transfer_addr.clone(),
        }
    }
}

/// One grant: the engine's guard (dropping it revokes the grant) and its key.
#[derive(Debug)]
pub struct Grant {
    guard: SessionGrantGuard,
    offer: Offer,
    peer: String,
}

impl Grant {
    /// The initiator's node name.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// The key and address to give the initiator.
    pub fn offer(&self) -> &Offer {
        &self.offer
    }

    /// Opens the scope of `transfer` over `ranges` (`None` where the backend has no scopes:
    /// the grant itself covers the regions).
    ///
    /// # Errors
    /// [`HandoffError::Transfer`] when the engine refuses (the grant was revoked, the scope is
    /// open already).
    pub fn scope(
        &self,
        security: Security,
        transfer: TransferId,
        ranges: &[RegionGrant],
    ) -> Result<Option<FenceScope>, HandoffError> {
        if !security.fenced() || ranges.is_empty() {
            return Ok(None);
        }
        self.guard
            .allow(fence_id(transfer), ranges)
            .map(Some)
            .map_err(|e| HandoffError::transfer(&e))
    }
}

/// Most initiators one instance holds transfer sessions for (an initiator is a peer node; a
/// caller naming ever new ones cannot grow the map past this).
pub const MAX_GRANTS: usize = 1024;

/// The grants this instance (as a target) handed out, one per initiator node.
pub struct Grants {
    engine: Arc<TransferEngine>,
    security: Security,
    by_peer: Mutex<HashMap<String, Arc<Grant>>>,
}

impl Grants {
    /// No grant yet; `security` from the engine's backend.
    pub fn new(engine: Arc<TransferEngine>) -> Self {
        Self {
            security: Security::of(engine.backend()),
            engine,
            by_peer: Mutex::new(HashMap::new()),
        }
    }

    /// What the backend offers.
    pub fn security(&self) -> Security {
        self.security
    }

    /// The grant of `peer` while the session bound to it lives; with `fresh` (the initiator
    /// asks for a new session), or when it ended, a new one that replaces it (the old key is
    /// revoked). `whole` lists the regions the session itself may reach with `access` (on
    /// backends without scopes).
    ///
    /// # Errors
    /// [`HandoffError::Transfer`] when the engine refuses the grant;
    /// [`HandoffError::NotSupported`] on `local`.
    pub fn for_peer(
        &self,
        peer: &str,
        peer_addr: Option<&str>,
        fresh: bool,
        whole: &[u64],
        access: Access,
    ) -> Result<Arc<Grant>, HandoffError> {
        if self.security == Security::None {
            return Err(HandoffError::NotSupported(
                "the local backend has no transfer sessions".into(),
            ));
        }
        let mut by_peer = self.by_peer.lock().unwrap_or_else(|e| e.into_inner());
        if !fresh {
            if let Some(g) = by_peer.get(peer).filter(|g| !g.guard.has_ended()) {
                return Ok(g.clone());
            }
        }
        if by_peer.len() >= MAX_GRANTS && !by_peer.contains_key(peer) {
            by_peer.retain(|_, g| !g.guard.has_ended());
            if by_peer.len() >= MAX_GRANTS {
                return Err(HandoffError::Overloaded(format!(
                    "transfer sessions are open for {MAX_GRANTS} initiators, the most this instance grants"
                )));
            }
        }
        let key = SessionKey::generate().map_err(|e| HandoffError::transfer(&e))?;
        let regions = match self.security {
            Security::Session => whole
                .iter()
                .map(|&r| RegionGrant::whole(r, access))
                .collect(),
            _ => Vec::new(),
        };
        let offer = Offer {
            key: *key.as_bytes(),
            transfer_addr: peer_addr
                .map_or_else(|| self.engine.address(), |a| self.engine.address_for(a)),
        };
        let guard = self
            .engine
            .grant_session(SessionGrant {
                key,
                peer: peer.to_string(),
                regions,
            })
            .map_err(|e| HandoffError::transfer(&e))?;
        let g = Arc::new(Grant {
            guard,
            offer,
            peer: peer.to_string(),
        });
        by_peer.insert(peer.to_string(), g.clone());
        Ok(g)
    }

    /// The live grant of `peer`, if any.
    pub fn current(&self, peer: &str) -> Option<Arc<Grant>> {
        self.by_peer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(peer)
            .filter(|g| !g.guard.has_ended())
            .cloned()
    }

    /// Stops handing out `peer`'s grant (a hand-off with it failed: the session it used may be
    /// stuck behind a broken link): the next hand-off gets a new key; hand-offs holding the old
    /// grant keep it until they end, and it is revoked with its last holder.
    pub fn retire(&self, peer: &str) {
        self.by_peer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(peer);
    }

    /// Revokes every grant (the instance stops).
    pub fn revoke_all(&self) {
        self.by_peer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdserve_gpu::kv::KvDtype;

    #[test]
    fn fence_ids_are_stable_and_never_the_session_scope() {
        assert_eq!(fence_id(TransferId(7)), fence_id(TransferId(7)));
        assert_ne!(fence_id(TransferId(7)), fence_id(TransferId(8)));
        assert_eq!(fence_id(TransferId(0)), 1);
        assert_eq!(fence_id(TransferId((5u128 << 64) | 5)), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_session_whose_view_predates_the_scope_refreshes_once_and_submits() {
        use pdserve_transport::{SessionCredentials, TransferConfig};
        let mut cfg = TransferConfig::new(BackendKind::Tcp, "target");
        cfg.require_auth = true;
        let target = TransferEngine::new(cfg).unwrap();
        let region = target.allocate_and_register(4096).unwrap();
        let initiator =
            TransferEngine::new(TransferConfig::new(BackendKind::Tcp, "initiator")).unwrap();
        let local = initiator.allocate_and_register(4096).unwrap();
        local.write_at(0, &[0x5a; 4096]).unwrap();
        let key = SessionKey::generate().unwrap();
        let grant = target
            .grant_session(SessionGrant {
                key: key.clone(),
                peer: "initiator".into(),
                regions: Vec::new(),
            })
            .unwrap();
        // Connected before any scope is open: the session sees no region of the target.
        let session = initiator
            .connect_with(&target.address(), SessionCredentials { key })
            .await
            .unwrap();
        assert!(session.remote_regions().is_empty());
        let scope = grant
            .allow(
                7,
                &[RegionGrant::range(region.id(), 0, 4096, Access::Write)],
            )
            .unwrap();
        let ops = [TransferOp::write(local.id(), 0, region.id(), 0, 4096)];
        // A plain submit is refused on the stale view; `submit_ops` refreshes and lands it.
        assert!(matches!(
            session.submit_fenced(7, &ops),
            Err(TransportError::UnknownRegion {
                side: Side::Remote,
                ..
            })
        ));
        let batch = submit_ops(&session, Some(7), &ops).await.unwrap();
        batch
            .wait(std::time::Duration::from_secs(10))
            .await
            .unwrap();
        assert_eq!(region.read_at(0, 4096).unwrap(), vec![0x5a; 4096]);
        // Once the scope is fenced, the target refuses the ops and nothing lands.
        drop(scope);
        local.write_at(0, &[0xa5; 4096]).unwrap();
        let batch = submit_ops(&session, Some(7), &ops).await.unwrap();
        let err = batch
            .wait(std::time::Duration::from_secs(10))
            .await
            .unwrap_err();
        assert!(matches!(err, TransportError::Fenced { .. }), "{err:?}");
        assert_eq!(region.read_at(0, 4096).unwrap(), vec![0x5a; 4096]);
    }

    #[test]
    fn a_scope_covers_exactly_its_blocks_in_every_layer_rank_and_kind() {
        let layout = KvLayout {
            num_layers: 2,
            num_blocks: 8,
            block_size: 4,
            num_kv_heads: 2,
            head_dim: 8,
            dtype: KvDtype::F32,
        };
        let grants = block_grants(
            &[layout, layout],
            &[vec![10, 11], vec![20, 21]],
            &[3, 5],
            Access::Write,
        );
        assert_eq!(grants.len(), 2 * 2 * 2 * 2, "ranks × layers × K/V × blocks");
        let block = layout.block_bytes() as u64;
        for g in &grants {
            assert_eq!(g.len, block, "{g:?}");
            assert!(g.offset % block == 0 && [3, 5].contains(&((g.offset / block) % 8)));
            assert_eq!(g.access, Access::Write);
        }
    }
}
