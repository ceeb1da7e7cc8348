//! Authenticated transfer sessions: session keys, grants and fences.
//!
//! The **target** of transfers (the engine whose memory is read or written) hands out a
//! [`SessionGrant`] per peer session with [`crate::TransferEngine::grant_session`]: a fresh
//! [`SessionKey`], the peer's node name, and the byte ranges of its regions the peer may read
//! or write. The **initiator** opens the session with
//! [`crate::TransferEngine::connect_with`] and the same key in [`SessionCredentials`]. The key
//! travels between the two over the mutual-TLS control plane (the caller's job); the transfer
//! connections never carry it. Each connection proves the key before any operation: the client
//! answers the server's random nonce with an HMAC-SHA256 over the whole greeting (backend,
//! both names, both nonces, the session id), and the server answers with its own HMAC, so
//! each side knows the other holds the key.
//!
//! Every operation is checked at the target against the grant: region, offset, length and
//! direction ([`Access`]). Operations carry a [`FenceId`]: 0 is the session's own scope (the
//! grant's `regions`), any other id a scope opened with [`SessionGrantGuard::allow`] (one per
//! KV hand-off, say). [`SessionGrantGuard::fence`] (or dropping the [`FenceScope`]) closes a
//! scope: from the moment it returns, no byte of an operation of that scope lands in target
//! memory any more, and later operations of it are refused with
//! [`TransportError::Fenced`](crate::TransportError::Fenced). Bytes land under the scope's gate
//! (a read lock held only while one non-blocking read copies into memory), and closing takes
//! the gate's write lock, so `fence` waits for at most one such copy, never for the network.
//!
//! A session key serves one initiator session: the connections of the first session that
//! proves it are bound to it, and once they have all closed the key is spent — a replay is
//! refused. Dropping the [`SessionGrantGuard`] revokes the grant: its connections are refused
//! from their next operation on.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};

use ring::hmac;

use crate::config::TcpIntegrity;
use crate::error::{Result, TransportError};
use crate::integrity::Framing;
use crate::keys::random;
pub use crate::keys::{KeyId, SessionKey, KEY_BYTES, KEY_ID_BYTES};
use crate::memory::RegionId;
use crate::op::OpKind;

/// Bytes of a handshake nonce.
pub(crate) const NONCE_BYTES: usize = 32;
/// Bytes of a session id (binds the connections of one initiator session).
pub(crate) const SESSION_ID_BYTES: usize = 16;
/// Bytes of an HMAC-SHA256 tag.
pub(crate) const TAG_BYTES: usize = 32;

/// Identifies a scope of operations inside a session; [`SESSION_SCOPE`] is the session's own.
pub type FenceId = u64;
/// The session's own scope: the grant's `regions`, open until the grant is revoked.
pub const SESSION_SCOPE: FenceId = 0;

const LABEL: &[u8] = b"pdserve-transfer-auth/1";

/// What the initiator may do to granted target bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Access {
    /// The initiator may read them (pull).
    Read,
    /// The initiator may write them (push).
    Write,
    /// Both.
    ReadWrite,
}

/// Bytes of one target region a session may reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RegionGrant {
    /// The target's region id.
    pub region: RegionId,
    /// First granted byte.
    pub offset: u64,
    /// Granted bytes (`u64::MAX`: to the end of the region).
    pub len: u64,
    /// Directions allowed.
    pub access: Access,
}

impl RegionGrant {
    /// All of `region`.
    pub fn whole(region: RegionId, access: Access) -> Self {
        Self {
            region,
            offset: 0,
            len: u64::MAX,
            access,
        }
    }

    /// `len` bytes of `region` from `offset`.
    pub fn range(region: RegionId, offset: u64, len: u64, access: Access) -> Self {
        Self {
            region,
            offset,
            len,
            access,
        }
    }

    fn end(&self) -> u64 {
        self.offset.saturating_add(self.len)
    }
}

/// What the target hands out for one initiator session.
#[derive(Debug, Clone)]
pub struct SessionGrant {
    /// The session key (also given to the initiator).
    pub key: SessionKey,
    /// The initiator's node name: the engine name its greeting must announce (on `quic`, also
    /// the node its certificate is bound to).
    pub peer: String,
    /// The session scope ([`SESSION_SCOPE`]): what operations without a fence may reach.
    pub regions: Vec<RegionGrant>,
}

/// What the initiator needs to open an authenticated session.
#[derive(Debug, Clone)]
pub struct SessionCredentials {
    /// The key the target granted.
    pub key: SessionKey,
}

/// Merged ranges of one region for one direction, sorted by start, disjoint and not adjacent.
#[derive(Debug, Default)]
struct RangeSet(Vec<(u64, u64)>);

impl RangeSet {
    fn insert_all(&mut self, mut ranges: Vec<(u64, u64)>) {
        ranges.append(&mut self.0);
        ranges.retain(|(s, e)| e > s);
        ranges.sort_unstable();
        for (s, e) in ranges {
            match self.0.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => self.0.push((s, e)),
            }
        }
    }

    fn covers(&self, offset: u64, end: u64) -> bool {
        let i = self.0.partition_point(|&(s, _)| s <= offset);
        i > 0 && self.0[i - 1].1 >= end
    }
}

/// One scope of a session: its ranges and the gate bytes land under.
#[derive(Debug)]
pub(crate) struct Scope {
    id: FenceId,
    read: HashMap<RegionId, RangeSet>,
    write: HashMap<RegionId, RangeSet>,
    /// Open while true. Bytes land under its read lock; closing takes the write lock.
    gate: RwLock<bool>,
}

impl Scope {
    pub(crate) fn new(id: FenceId, grants: &[RegionGrant]) -> Self {
        let mut read: HashMap<RegionId, Vec<(u64, u64)>> = HashMap::new();
        let mut write: HashMap<RegionId, Vec<(u64, u64)>> = HashMap::new();
        for g in grants {
            if matches!(g.access, Access::Read | Access::ReadWrite) {
                read.entry(g.region).or_default().push((g.offset, g.end()));
            }
            if matches!(g.access, Access::Write | Access::ReadWrite) {
                write.entry(g.region).or_default().push((g.offset, g.end()));
            }
        }
        let build = |m: HashMap<RegionId, Vec<(u64, u64)>>| {
            m.into_iter()
                .map(|(k, v)| {
                    let mut set = RangeSet::default();
                    set.insert_all(v);
                    (k, set)
                })
                .collect()
        };
        Self {
            id,
            read: build(read),
            write: build(write),
            gate: RwLock::new(true),
        }
    }

    /// Checks one operation against the scope.
    pub(crate) fn check(
        &self,
        kind: OpKind,
        region: RegionId,
        offset: u64,
        len: u64,
    ) -> Result<()> {
        let sets = match kind {
            OpKind::Read => &self.read,
            OpKind::Write => &self.write,
        };
        let granted = offset
            .checked_add(len)
            .is_some_and(|end| sets.get(&region).is_some_and(|s| s.covers(offset, end)));
        if granted {
            Ok(())
        } else {
            Err(TransportError::NotGranted {
                region,
                offset,
                len,
                write: kind == OpKind::Write,
                fence: self.id,
            })
        }
    }

    fn regions(&self) -> impl Iterator<Item = RegionId> + '_ {
        self.read.keys().chain(self.write.keys()).copied()
    }

    /// Runs `land` under the gate unless the scope has been fenced; returns whether it ran.
    pub(crate) fn land<T>(&self, land: impl FnOnce() -> T) -> Option<T> {
        let open = self.gate.read().unwrap_or_else(|e| e.into_inner());
        (*open).then(land)
    }

    fn close(&self) {
        *self.gate.write().unwrap_or_else(|e| e.into_inner()) = false;
    }

    /// The session-scope grants as the initiator learns them (`shm` checks them itself).
    fn grants(&self) -> Vec<RegionGrant> {
        let mut out = Vec::new();
        for (sets, access) in [(&self.read, Access::Read), (&self.write, Access::Write)] {
            for (&region, set) in sets {
                out.extend(
                    set.0
                        .iter()
                        .map(|&(s, e)| RegionGrant::range(region, s, e - s, access)),
                );
            }
        }
        out.sort_by_key(|g| (g.region, g.offset));
        out
    }
}

/// Which initiator session a grant is bound to, and whether it has ended.
#[derive(Debug, Default)]
struct Binding {
    session: Option<[u8; SESSION_ID_BYTES]>,
    live: usize,
    ended: bool,
}

/// A grant as the target keeps it.
#[derive(Debug)]
pub(crate) struct GrantState {
    key: SessionKey,
    key_id: KeyId,
    peer: String,
    revoked: AtomicBool,
    scopes: RwLock<HashMap<FenceId, Arc<Scope>>>,
    binding: Mutex<Binding>,
}

impl GrantState {
    /// The scope an operation names, open and not revoked.
    pub(crate) fn scope(&self, fence: FenceId) -> Result<Arc<Scope>> {
        if self.revoked.load(Ordering::Acquire) {
            return Err(TransportError::Unauthenticated(format!(
                "the session grant {} was revoked",
                self.key_id
            )));
        }
        self.scopes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&fence)
            .cloned()
            .ok_or(TransportError::Fenced { fence })
    }

    /// Regions named by any open scope: what `GetRegisteredMemory` shows this session.
    pub(crate) fn visible_regions(&self) -> std::collections::HashSet<RegionId> {
        self.scopes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .flat_map(|s| s.regions().collect::<Vec<_>>())
            .collect()
    }

    /// The session scope's grants (for an initiator that checks them itself: `shm`).
    pub(crate) fn session_grants(&self) -> Vec<RegionGrant> {
        self.scopes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&SESSION_SCOPE)
            .map(|s| s.grants())
            .unwrap_or_default()
    }

    fn fence(&self, fence: FenceId) -> bool {
        let scope = self
            .scopes
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&fence);
        match scope {
            Some(s) => {
                s.close();
                true
            }
            None => false,
        }
    }

    fn revoke(&self) {
        self.revoked.store(true, Ordering::Release);
        let scopes: Vec<_> = self
            .scopes
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .drain()
            .map(|(_, s)| s)
            .collect();
        scopes.iter().for_each(|s| s.close());
    }

    /// Binds a connection of initiator session `session`; refuses another session's and a
    /// spent key's.
    fn bind(self: &Arc<Self>, session: [u8; SESSION_ID_BYTES]) -> Result<ConnLease> {
        let mut b = self.binding.lock().unwrap_or_else(|e| e.into_inner());
        if b.ended {
            return Err(TransportError::Unauthenticated(format!(
                "session key {} was already used by a session that has ended",
                self.key_id
            )));
        }
        match b.session {
            Some(s) if s != session => {
                return Err(TransportError::Unauthenticated(format!(
                    "session key {} is bound to another session",
                    self.key_id
                )))
            }
            _ => b.session = Some(session),
        }
        b.live += 1;
        Ok(ConnLease {
            grant: self.clone(),
        })
    }
}

/// Held by each authenticated connection; the last one to close spends the key.
#[derive(Debug)]
pub(crate) struct ConnLease {
    grant: Arc<GrantState>,
}

impl Drop for ConnLease {
    fn drop(&mut self) {
        let mut b = self.grant.binding.lock().unwrap_or_else(|e| e.into_inner());
        b.live -= 1;
        if b.live == 0 {
            b.ended = true;
        }
    }
}

/// An authenticated connection at the target.
#[derive(Debug)]
pub(crate) struct ConnAuth {
    pub(crate) grant: Arc<GrantState>,
    _lease: ConnLease,
}

/// The grants of one engine (the target side).
#[derive(Debug, Default)]
pub(crate) struct AuthTable {
    /// Every connection must prove a key: set by config, or by the first grant.
    required: AtomicBool,
    grants: RwLock<HashMap<KeyId, Arc<GrantState>>>,
    refused: AtomicU64,
}

impl AuthTable {
    pub(crate) fn new(required: bool) -> Self {
        Self {
            required: AtomicBool::new(required),
            ..Self::default()
        }
    }

    pub(crate) fn required(&self) -> bool {
        self.required.load(Ordering::Acquire)
    }

    pub(crate) fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Counts and returns a refusal.
    pub(crate) fn refuse(&self, e: TransportError) -> TransportError {
        self.refused.fetch_add(1, Ordering::Relaxed);
        e
    }

    pub(crate) fn grant(self: &Arc<Self>, grant: SessionGrant) -> Result<SessionGrantGuard> {
        crate::control::tls::validate_node_name(&grant.peer)?;
        for g in &grant.regions {
            if g.len == 0 {
                return Err(TransportError::Config(format!(
                    "an empty grant of region {}",
                    g.region
                )));
            }
        }
        let key_id = grant.key.id();
        let state = Arc::new(GrantState {
            key_id,
            peer: grant.peer,
            revoked: AtomicBool::new(false),
            scopes: RwLock::new(HashMap::from([(
                SESSION_SCOPE,
                Arc::new(Scope::new(SESSION_SCOPE, &grant.regions)),
            )])),
            binding: Mutex::new(Binding::default()),
            key: grant.key,
        });
        {
            let mut grants = self.grants.write().unwrap_or_else(|e| e.into_inner());
            if grants.contains_key(&key_id) {
                return Err(TransportError::Config(format!(
                    "session key {key_id} is already granted"
                )));
            }
            grants.insert(key_id, state.clone());
        }
        self.required.store(true, Ordering::Release);
        Ok(SessionGrantGuard {
            table: Arc::downgrade(self),
            grant: state,
        })
    }

    /// Verifies a client's proof and binds the connection (see [`Handshake`]); returns the
    /// connection's state, the server's proof and the frame protection the client asked for.
    /// `required` is the weakest frame protection this end accepts.
    pub(crate) fn accept(
        &self,
        hs: &Handshake<'_>,
        key_id: KeyId,
        session: [u8; SESSION_ID_BYTES],
        proof: &[u8],
        required: TcpIntegrity,
    ) -> Result<(ConnAuth, [u8; TAG_BYTES], Option<Framing>)> {
        let refused = |m: String| self.refuse(TransportError::Unauthenticated(m));
        let grant = self
            .grants
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key_id)
            .cloned()
            .ok_or_else(|| refused(format!("unknown session key {key_id}")))?;
        if grant.revoked.load(Ordering::Acquire) {
            return Err(refused(format!("session key {key_id} was revoked")));
        }
        let hs = Handshake { session, ..*hs };
        hmac::verify(&grant.key.hmac_key(), &hs.transcript(b'C'), proof)
            .map_err(|_| refused(format!("wrong proof for session key {key_id}")))?;
        if hs.client_name != grant.peer {
            return Err(refused(format!(
                "session key {key_id} was granted to `{}`, not `{}`",
                grant.peer, hs.client_name
            )));
        }
        if strength(hs.integrity) < strength(required) {
            return Err(refused(format!(
                "this engine requires tcp_integrity {required:?}, the peer asked for {:?}",
                hs.integrity
            )));
        }
        let framing = hs.framing(&grant.key, false)?;
        let lease = grant.bind(session).map_err(|e| self.refuse(e))?;
        let answer = hs.tag(&grant.key, b'S');
        Ok((
            ConnAuth {
                grant,
                _lease: lease,
            },
            answer,
            framing,
        ))
    }

    fn remove(&self, key_id: KeyId) {
        self.grants
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&key_id);
    }
}

/// The target's handle on one grant: opens and fences scopes; dropping it revokes the grant.
#[derive(Debug)]
pub struct SessionGrantGuard {
    table: Weak<AuthTable>,
    grant: Arc<GrantState>,
}

impl SessionGrantGuard {
    /// The granted key's public id.
    pub fn key_id(&self) -> KeyId {
        self.grant.key_id
    }

    /// Opens scope `fence` (non-zero, not open yet) over `regions`: operations the initiator
    /// submits with this fence may reach them until the scope is fenced.
    ///
    /// # Errors
    /// [`TransportError::Config`] for fence 0, a fence already open or an empty range;
    /// [`TransportError::Unauthenticated`] when the grant was revoked.
    pub fn allow(&self, fence: FenceId, regions: &[RegionGrant]) -> Result<FenceScope> {
        if fence == SESSION_SCOPE {
            return Err(TransportError::Config(
                "fence 0 is the session scope; pick a non-zero fence id".into(),
            ));
        }
        if regions.iter().any(|g| g.len == 0) {
            return Err(TransportError::Config("an empty region grant".into()));
        }
        if self.grant.revoked.load(Ordering::Acquire) {
            return Err(TransportError::Unauthenticated("grant revoked".into()));
        }
        let mut scopes = self.grant.scopes.write().unwrap_or_else(|e| e.into_inner());
        if scopes.contains_key(&fence) {
            return Err(TransportError::Config(format!(
                "fence {fence} is already open"
            )));
        }
        scopes.insert(fence, Arc::new(Scope::new(fence, regions)));
        Ok(FenceScope {
            grant: self.grant.clone(),
            fence,
        })
    }

    /// Closes scope `fence`: when this returns, no byte of its operations lands any more, and
    /// later ones are refused with [`TransportError::Fenced`]. Returns whether it was open.
    pub fn fence(&self, fence: FenceId) -> bool {
        self.grant.fence(fence)
    }

    /// Whether an initiator session bound to the key has ended (the key is spent).
    pub fn has_ended(&self) -> bool {
        self.grant
            .binding
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .ended
    }

    /// Connections of the bound session open now.
    pub fn live_connections(&self) -> usize {
        self.grant
            .binding
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .live
    }
}

impl Drop for SessionGrantGuard {
    fn drop(&mut self) {
        self.grant.revoke();
        if let Some(t) = self.table.upgrade() {
            t.remove(self.grant.key_id);
        }
    }
}

/// One open scope; dropping it fences it ([`SessionGrantGuard::fence`]).
#[derive(Debug)]
pub struct FenceScope {
    grant: Arc<GrantState>,
    fence: FenceId,
}

impl FenceScope {
    /// The scope's fence id (what the initiator submits with).
    pub fn id(&self) -> FenceId {
        self.fence
    }
}

impl Drop for FenceScope {
    fn drop(&mut self) {
        self.grant.fence(self.fence);
    }
}

fn strength(i: TcpIntegrity) -> u8 {
    match i {
        TcpIntegrity::None => 0,
        TcpIntegrity::Mac => 1,
        TcpIntegrity::Encrypt => 2,
    }
}

fn integrity_of(b: u8) -> Option<TcpIntegrity> {
    [TcpIntegrity::None, TcpIntegrity::Mac, TcpIntegrity::Encrypt]
        .into_iter()
        .find(|i| strength(*i) == b)
}

/// What both ends of one connection's key proof agree on.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Handshake<'a> {
    pub(crate) backend: &'a str,
    pub(crate) client_name: &'a str,
    pub(crate) server_nonce: [u8; NONCE_BYTES],
    pub(crate) client_nonce: [u8; NONCE_BYTES],
    pub(crate) session: [u8; SESSION_ID_BYTES],
    /// The frame protection the client asked for (part of the proof: no downgrade).
    pub(crate) integrity: TcpIntegrity,
}

impl Handshake<'_> {
    /// The frame protection of this connection, keyed from the session key and both nonces.
    pub(crate) fn framing(&self, key: &SessionKey, client: bool) -> Result<Option<Framing>> {
        let mut salt = Vec::with_capacity(2 * NONCE_BYTES + SESSION_ID_BYTES);
        salt.extend_from_slice(&self.server_nonce);
        salt.extend_from_slice(&self.client_nonce);
        salt.extend_from_slice(&self.session);
        Framing::derive(key, self.integrity, &salt, client)
    }

    fn transcript(&self, role: u8) -> Vec<u8> {
        let mut t = Vec::with_capacity(160);
        t.extend_from_slice(LABEL);
        t.push(role);
        t.extend_from_slice(self.backend.as_bytes());
        t.push(0);
        t.extend_from_slice(self.client_name.as_bytes());
        t.push(0);
        t.extend_from_slice(&self.server_nonce);
        t.extend_from_slice(&self.client_nonce);
        t.extend_from_slice(&self.session);
        t.push(strength(self.integrity));
        t
    }

    pub(crate) fn tag(&self, key: &SessionKey, role: u8) -> [u8; TAG_BYTES] {
        let tag = hmac::sign(&key.hmac_key(), &self.transcript(role));
        let mut out = [0u8; TAG_BYTES];
        out.copy_from_slice(tag.as_ref());
        out
    }

    /// Checks the server's answer to the client's proof.
    pub(crate) fn verify_server(&self, key: &SessionKey, proof: &[u8]) -> Result<()> {
        hmac::verify(&key.hmac_key(), &self.transcript(b'S'), proof).map_err(|_| {
            TransportError::Unauthenticated(
                "the target did not prove the session key: not the engine that granted it".into(),
            )
        })
    }
}

/// The initiator's side of the key proof for one session (shared by its connections).
#[derive(Debug, Clone)]
pub(crate) struct ClientAuth {
    pub(crate) key: SessionKey,
    pub(crate) session: [u8; SESSION_ID_BYTES],
    /// Frame protection to ask for (`tcp` only).
    pub(crate) integrity: TcpIntegrity,
}

impl ClientAuth {
    pub(crate) fn new(creds: &SessionCredentials, integrity: TcpIntegrity) -> Result<Self> {
        Ok(Self {
            key: creds.key.clone(),
            session: random()?,
            integrity,
        })
    }

    /// The `AUTH` payload: key id, session id, client nonce, proof; and the handshake to check
    /// the server's answer with.
    pub(crate) fn request<'a>(
        &self,
        backend: &'a str,
        client_name: &'a str,
        server_nonce: [u8; NONCE_BYTES],
    ) -> Result<(Vec<u8>, Handshake<'a>)> {
        let hs = Handshake {
            backend,
            client_name,
            server_nonce,
            client_nonce: random()?,
            session: self.session,
            integrity: self.integrity,
        };
        let mut p = Vec::with_capacity(AUTH_REQUEST_BYTES);
        p.extend_from_slice(&self.key.id().0);
        p.extend_from_slice(&hs.session);
        p.extend_from_slice(&hs.client_nonce);
        p.push(strength(self.integrity));
        p.extend_from_slice(&hs.tag(&self.key, b'C'));
        Ok((p, hs))
    }
}

/// Length of an `AUTH` request payload.
pub(crate) const AUTH_REQUEST_BYTES: usize =
    KEY_ID_BYTES + SESSION_ID_BYTES + NONCE_BYTES + 1 + TAG_BYTES;

/// An `AUTH` request as the target reads it.
pub(crate) struct AuthRequest<'a> {
    pub(crate) key_id: KeyId,
    pub(crate) session: [u8; SESSION_ID_BYTES],
    pub(crate) client_nonce: [u8; NONCE_BYTES],
    pub(crate) integrity: TcpIntegrity,
    pub(crate) proof: &'a [u8],
}

/// Splits an `AUTH` payload into key id, session id, client nonce, frame protection and proof.
pub(crate) fn parse_auth_request(p: &[u8]) -> Result<AuthRequest<'_>> {
    if p.len() != AUTH_REQUEST_BYTES {
        return Err(TransportError::Unauthenticated(format!(
            "malformed key proof ({} bytes)",
            p.len()
        )));
    }
    let (id, rest) = p.split_at(KEY_ID_BYTES);
    let (session, rest) = rest.split_at(SESSION_ID_BYTES);
    let (nonce, rest) = rest.split_at(NONCE_BYTES);
    let (mode, proof) = rest.split_at(1);
    Ok(AuthRequest {
        key_id: KeyId(id.try_into().expect("sized")),
        session: session.try_into().expect("sized"),
        client_nonce: nonce.try_into().expect("sized"),
        integrity: integrity_of(mode[0]).ok_or_else(|| {
            TransportError::Unauthenticated(format!("unknown frame protection {}", mode[0]))
        })?,
        proof,
    })
}

/// A fresh server nonce.
pub(crate) fn server_nonce() -> Result<[u8; NONCE_BYTES]> {
    random()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn range_sets_merge_and_cover_exactly() {
        let mut s = RangeSet::default();
        s.insert_all(vec![(10, 20), (30, 40), (20, 25), (0, 0)]);
        assert_eq!(s.0, vec![(10, 25), (30, 40)]);
        assert!(s.covers(10, 25));
        assert!(s.covers(12, 13));
        assert!(!s.covers(9, 12));
        assert!(!s.covers(24, 31), "a gap between ranges is not covered");
        assert!(s.covers(30, 40));
        assert!(!s.covers(30, 41));
        assert!(!s.covers(50, 51));
    }

    #[test]
    fn scopes_check_region_range_and_direction() {
        let scope = Scope::new(
            7,
            &[
                RegionGrant::range(1, 4096, 4096, Access::Write),
                RegionGrant::whole(2, Access::Read),
            ],
        );
        scope.check(OpKind::Write, 1, 4096, 4096).unwrap();
        for (kind, region, off, len) in [
            (OpKind::Read, 1, 4096, 10),        // direction
            (OpKind::Write, 1, 4095, 10),       // before the range
            (OpKind::Write, 1, 8000, 200),      // past its end
            (OpKind::Write, 3, 0, 1),           // another region
            (OpKind::Write, 2, 0, 1),           // read-only region
            (OpKind::Read, 2, u64::MAX - 1, 5), // overflow
        ] {
            let e = scope.check(kind, region, off, len).unwrap_err();
            assert_eq!(e.kind(), "not_granted", "{kind:?} {region} {off} {len}");
        }
        scope.check(OpKind::Read, 2, 1 << 40, 1 << 20).unwrap();
        assert_eq!(scope.land(|| 5), Some(5));
        scope.close();
        assert_eq!(scope.land(|| 5), None);
    }

    #[test]
    fn the_key_proof_binds_key_names_and_nonces() {
        let table = Arc::new(AuthTable::new(false));
        let key = SessionKey::generate().unwrap();
        let guard = table
            .grant(SessionGrant {
                key: key.clone(),
                peer: "decode-0".into(),
                regions: vec![RegionGrant::whole(1, Access::Read)],
            })
            .unwrap();
        assert!(table.required(), "the first grant makes keys required");
        let client =
            ClientAuth::new(&SessionCredentials { key: key.clone() }, TcpIntegrity::Mac).unwrap();
        let nonce = server_nonce().unwrap();
        let (req, hs) = client.request("tcp", "decode-0", nonce).unwrap();
        let r = parse_auth_request(&req).unwrap();
        let (id, session, proof) = (r.key_id, r.session, r.proof);
        let server_hs = Handshake {
            backend: "tcp",
            client_name: "decode-0",
            server_nonce: nonce,
            client_nonce: r.client_nonce,
            session,
            integrity: r.integrity,
        };
        let none = TcpIntegrity::None;
        // A target that requires encryption refuses a client asking for a MAC only.
        assert!(table
            .accept(&server_hs, id, session, proof, TcpIntegrity::Encrypt)
            .is_err());
        // A downgraded request fails the proof.
        let downgraded = Handshake {
            integrity: none,
            ..server_hs
        };
        assert!(table.accept(&downgraded, id, session, proof, none).is_err());
        let (auth, answer, framing) = table.accept(&server_hs, id, session, proof, none).unwrap();
        assert!(framing.is_some());
        hs.verify_server(&key, &answer).unwrap();
        // Another nonce, name or key fails.
        let other = Handshake {
            server_nonce: server_nonce().unwrap(),
            ..server_hs
        };
        assert!(table.accept(&other, id, session, proof, none).is_err());
        let renamed = Handshake {
            client_name: "decode-1",
            ..server_hs
        };
        assert!(table.accept(&renamed, id, session, proof, none).is_err());
        let stranger = SessionKey::generate().unwrap();
        assert!(hs.verify_server(&stranger, &answer).is_err());
        assert!(table
            .accept(&server_hs, stranger.id(), session, proof, none)
            .is_err());
        // Another session may not use the key while it is bound; once it ended, nobody may.
        assert!(table.accept(&server_hs, id, [9; 16], proof, none).is_err());
        drop(auth);
        assert!(guard.has_ended());
        let e = table
            .accept(&server_hs, id, session, proof, none)
            .unwrap_err();
        assert!(e.to_string().contains("ended"), "{e}");
        assert!(table.refused() >= 5);
        drop(guard);
        let e = table
            .accept(&server_hs, id, session, proof, none)
            .unwrap_err();
        assert!(e.to_string().contains("unknown session key"), "{e}");
    }
}
