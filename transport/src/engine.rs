//! The transfer engine: configuration, registration, sessions, batches.
//!
//! A [`TransferEngine`] owns one backend, the registry of regions it exposes, and its own
//! executor: a small tokio runtime for sockets (`pdserve-xfer-io` threads) and, for `local` and
//! `shm`, a dedicated memcpy thread (`pdserve-memcpy`) fed through a bounded queue. Callers'
//! tasks never move bytes themselves: [`Session::submit`] validates and plans a batch, hands it
//! to the executor and returns a [`BatchHandle`] at once.
//!
//! Operations of one batch run concurrently and unordered (as in an RDMA batch without
//! fences); a batch must not contain two operations whose byte ranges overlap where one of them
//! writes. Adjacent operations (same direction and regions, contiguous on both sides) are
//! coalesced into one before planning; operations are then split at registration-chunk
//! boundaries and into pieces of at most [`TransferConfig::piece_bytes`] for parallelism.
//!
//! This file is the facade; the pieces it drives live beside it: the configuration
//! (`config.rs`), the operations and their planning (`op.rs`, `plan.rs`), batches
//! (`batch.rs`), and the seam the backends implement (`seam.rs`).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use pdserve_runtime::memory::{HostMemory, HostMemoryAllocator};
use pdserve_runtime::wire::RegionDescriptor;
use tokio::sync::mpsc;

use crate::auth::{
    AuthTable, ClientAuth, FenceId, SessionCredentials, SessionGrant, SessionGrantGuard,
    SESSION_SCOPE,
};
use crate::batch::{BatchHandle, BatchState};
use crate::config::{parse_advertise, BackendKind, TcpIntegrity, TransferConfig};
use crate::error::{Result, TransportError};
use crate::memory::{
    validate_descriptors, BackendRegistrationHolder, RegionEntry, RegionId, RegisteredRegion,
    Registry,
};
use crate::op::TransferOp;
use crate::seam::{Backend, EngineCore, Link, Notification};

/// Whether this build and this machine can run a backend.
pub trait BackendAvailability {
    /// Whether this build and this machine can run the backend (`rdma` needs the feature and
    /// a device listed by ibverbs).
    fn is_available(&self) -> bool;
}

impl BackendAvailability for BackendKind {
    fn is_available(&self) -> bool {
        match self {
            Self::Rdma => crate::backend::rdma::device_available(),
            _ => true,
        }
    }
}

/// The first address of an interface that is up and not loopback (IPv4 first), if any.
fn interface_address() -> Option<std::net::IpAddr> {
    let mut found: Vec<std::net::IpAddr> = Vec::new();
    // SAFETY: getifaddrs fills a list we walk read-only and free with freeifaddrs.
    unsafe {
        let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
        if libc::getifaddrs(&mut list) != 0 {
            return None;
        }
        let mut cur = list;
        while !cur.is_null() {
            let ifa = &*cur;
            let up = ifa.ifa_flags & libc::IFF_UP as u32 != 0;
            let lo = ifa.ifa_flags & libc::IFF_LOOPBACK as u32 != 0;
            if up && !lo && !ifa.ifa_addr.is_null() {
                match i32::from((*ifa.ifa_addr).sa_family) {
                    libc::AF_INET => {
                        let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                        found.push(std::net::IpAddr::from(
                            u32::from_be(sin.sin_addr.s_addr).to_be_bytes(),
                        ));
                    }
                    libc::AF_INET6 => {
                        let sin6 = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                        let ip = std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr);
                        // Link-local addresses need a scope id a peer cannot guess.
                        if ip.segments()[0] & 0xffc0 != 0xfe80 {
                            found.push(ip.into());
                        }
                    }
                    _ => {}
                }
            }
            cur = ifa.ifa_next;
        }
        libc::freeifaddrs(list);
    }
    found.sort_by_key(|ip| ip.is_ipv6());
    found.into_iter().next()
}

/// The local address the kernel would send from to reach `peer` (a UDP socket `connect`,
/// which sends nothing).
fn route_source(peer: SocketAddr) -> Option<std::net::IpAddr> {
    let any: SocketAddr = if peer.is_ipv4() {
        ([0, 0, 0, 0], 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let s = std::net::UdpSocket::bind(any).ok()?;
    s.connect(peer).ok()?;
    s.local_addr()
        .ok()
        .map(|a| a.ip())
        .filter(|ip| !ip.is_unspecified())
}

struct EngineShared {
    runtime: Option<tokio::runtime::Runtime>,
    core: Arc<EngineCore>,
    backend: Box<dyn Backend>,
    notify_rx: Mutex<Option<mpsc::Receiver<Notification>>>,
}

impl Drop for EngineShared {
    fn drop(&mut self) {
        self.core.alive.store(false, Ordering::Release);
        crate::backend::local::unregister_engine(&self.backend.address());
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// The transfer engine of one instance (cheap to clone; the last clone shuts it down, closing
/// its listeners and connections).
#[derive(Clone)]
pub struct TransferEngine {
    shared: Arc<EngineShared>,
}

impl std::fmt::Debug for TransferEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferEngine")
            .field("name", &self.shared.core.name)
            .field("backend", &self.shared.core.config.backend)
            .field("address", &self.address())
            .finish()
    }
}

impl TransferEngine {
    /// Builds an engine: starts its executor threads and, for network backends, binds its
    /// listener. Callable from sync or async code.
    ///
    /// # Errors
    /// [`TransportError::Config`] for invalid settings, [`TransportError::Unsupported`] for
    /// `rdma` without the feature or a device, I/O and TLS errors from binding.
    pub fn new(config: TransferConfig) -> Result<Self> {
        config.validate()?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.io_threads)
            .thread_name("pdserve-xfer-io")
            .enable_all()
            .build()?;
        let (notify_tx, notify_rx) = mpsc::channel(config.queue_depth);
        let core = Arc::new(EngineCore {
            name: config.name.clone(),
            registry: Arc::new(Registry::new()),
            notify_tx,
            alive: AtomicBool::new(true),
            memcpy: crate::memcpy::MemcpyExecutor::start(
                &config.name,
                config.memcpy_threads,
                config.queue_depth,
            )?,
            auth: Arc::new(AuthTable::new(config.require_auth)),
            config,
        });
        let backend: Box<dyn Backend> = {
            let _guard = runtime.enter();
            match core.config.backend {
                BackendKind::Local => Box::new(crate::backend::local::LocalBackend::new(&core)),
                BackendKind::Shm => Box::new(crate::backend::shm::ShmBackend::new(&core)?),
                BackendKind::Tcp => Box::new(crate::backend::tcp::TcpBackend::new(&core)?),
                BackendKind::Quic => Box::new(crate::backend::quic::QuicBackend::new(&core)?),
                BackendKind::Rdma => crate::backend::rdma::new_backend(&core)?,
            }
        };
        tracing::debug!(engine = %core.name, backend = %core.config.backend, address = %backend.address(), "transfer engine started");
        Ok(Self {
            shared: Arc::new(EngineShared {
                runtime: Some(runtime),
                core,
                backend,
                notify_rx: Mutex::new(Some(notify_rx)),
            }),
        })
    }

    /// Holds this engine's copy threads (`local`, `shm`: the initiator copies the bytes) just
    /// before their next piece lands, until the returned guard is dropped. A fault-injection hook for tests
    /// of timeouts and late completions: a transfer made slow by construction, not by sizing
    /// it against a wall clock. A held piece has passed every check but the landing fence, so
    /// one of a batch given up meanwhile (timeout, cancel) shows that the fence stops it.
    ///
    /// # Errors
    /// [`TransportError::Unsupported`] for backends whose bytes move on their I/O threads or
    /// the NIC (`tcp`, `quic`, `rdma`): stop the peer instead.
    #[doc(hidden)]
    pub fn hold_copies(&self) -> Result<crate::CopyHold> {
        match self.shared.core.config.backend {
            BackendKind::Local | BackendKind::Shm => Ok(self.shared.core.memcpy.hold()),
            other => Err(TransportError::Unsupported(format!(
                "{other} moves bytes on its I/O threads; hold_copies covers local and shm"
            ))),
        }
    }

    /// The engine's name.
    pub fn name(&self) -> &str {
        &self.shared.core.name
    }

    /// The backend in use.
    pub fn backend(&self) -> BackendKind {
        self.shared.core.config.backend
    }

    /// The address peers pass to [`TransferEngine::connect`] (`local:N` or `host:port`):
    /// `advertise_addr` when configured (behind NAT, say); else the bound address, except that
    /// an engine listening on an unspecified address (`0.0.0.0`, `::`) never publishes it but
    /// the first address of an interface that is up and not loopback (else loopback). Prefer [`TransferEngine::address_for`] when
    /// the peer is known.
    pub fn address(&self) -> String {
        self.published(None)
    }

    /// The address to give the peer at `peer` (its transfer or control address): as
    /// [`TransferEngine::address`], but an engine listening on an unspecified address
    /// publishes the address of the interface that routes to `peer`, unless `advertise_addr`
    /// is configured.
    pub fn address_for(&self, peer: &str) -> String {
        self.published(peer.parse::<SocketAddr>().ok())
    }

    fn published(&self, peer: Option<SocketAddr>) -> String {
        let bound = self.shared.backend.address();
        let Ok(sock) = bound.parse::<SocketAddr>() else {
            return bound; // `local:N`
        };
        let config = &self.shared.core.config;
        if let Some((ip, port)) = config
            .advertise_addr
            .as_deref()
            .and_then(|a| parse_advertise(a).ok())
        {
            return SocketAddr::new(ip, port.unwrap_or(sock.port())).to_string();
        }
        if !sock.ip().is_unspecified() {
            return bound;
        }
        let ip = peer
            .and_then(route_source)
            .or_else(interface_address)
            .unwrap_or(if sock.is_ipv4() {
                std::net::Ipv4Addr::LOCALHOST.into()
            } else {
                std::net::Ipv6Addr::LOCALHOST.into()
            });
        SocketAddr::new(ip, sock.port()).to_string()
    }

    /// The allocator whose memory this backend can register and a peer can reach
    /// ([`crate::memory::ShmAllocator`] for `shm`, anonymous memory otherwise).
    pub fn allocator(&self) -> Arc<dyn HostMemoryAllocator> {
        self.shared.backend.allocator()
    }

    /// Allocates `len` bytes with [`TransferEngine::allocator`] and registers them.
    ///
    /// # Errors
    /// The allocation's I/O error, or a registration error.
    pub fn allocate_and_register(&self, len: usize) -> Result<RegisteredRegion> {
        let mem = self.allocator().allocate(len)?;
        self.register(mem)
    }

    /// Registers memory so peers can read and write it. Large memory is registered in chunks
    /// where the backend limits one registration (invisible to callers). Dropping the returned
    /// handle deregisters it.
    ///
    /// # Errors
    /// [`TransportError::NotShareable`] when `shm` is given memory a peer cannot map;
    /// backend registration errors (RDMA).
    pub fn register(&self, mem: Arc<dyn HostMemory>) -> Result<RegisteredRegion> {
        if mem.is_empty() {
            return Err(TransportError::Config(
                "cannot register an empty region".into(),
            ));
        }
        let (chunks, shm, backend) = self.shared.backend.register(&mem)?;
        let id = self.shared.core.registry.next_id();
        let descriptor = RegionDescriptor {
            id,
            len: mem.len() as u64,
            chunks,
            shm,
        };
        let entry = Arc::new(RegionEntry {
            id,
            mem,
            descriptor,
            backend: backend.map(BackendRegistrationHolder),
        });
        self.shared.core.registry.insert(entry.clone());
        Ok(RegisteredRegion {
            entry,
            registry: Arc::downgrade(&self.shared.core.registry),
        })
    }

    /// Descriptors of every region registered now (what a peer's `GetRegisteredMemory` gets).
    pub fn local_regions(&self) -> Vec<RegionDescriptor> {
        self.shared.core.registry.descriptors()
    }

    /// Takes the receiver of notifications from peers (once; later calls return `None`).
    pub fn take_notifications(&self) -> Option<mpsc::Receiver<Notification>> {
        self.shared
            .notify_rx
            .lock()
            .expect("engine poisoned")
            .take()
    }

    /// Grants a peer session access to this engine's memory (this engine is the target):
    /// from now on every connection must prove a session key, and one proving `grant.key` may
    /// reach what `grant.regions` allow (and scopes opened later with
    /// [`SessionGrantGuard::allow`]). Dropping the guard revokes the grant. Hand
    /// `grant.key` to the peer over the mutual-TLS control plane; it connects with
    /// [`TransferEngine::connect_with`].
    ///
    /// # Errors
    /// [`TransportError::Config`] for an invalid peer name, an empty range, or a key that is
    /// already granted.
    pub fn grant_session(&self, grant: SessionGrant) -> Result<SessionGrantGuard> {
        self.shared.core.auth.grant(grant)
    }

    /// Whether this engine requires a session key of every connection.
    pub fn requires_auth(&self) -> bool {
        self.shared.core.auth.required()
    }

    /// Connections and key proofs this engine refused so far (unauthenticated, wrong or spent
    /// key, revoked grant).
    pub fn refused_sessions(&self) -> u64 {
        self.shared.core.auth.refused()
    }

    /// Opens a session to the engine at `addr` and fetches its registered-memory descriptors.
    /// Without a session key: a target that requires keys refuses it.
    ///
    /// # Errors
    /// [`TransportError::Timeout`] after `connect_timeout`, [`TransportError::PeerGone`] when
    /// nobody answers, [`TransportError::LayoutMismatch`] for inconsistent descriptors, TLS
    /// errors (`quic`), [`TransportError::Unauthenticated`] from a target that requires keys.
    pub async fn connect(&self, addr: &str) -> Result<Session> {
        self.open_session(addr, None).await
    }

    /// Opens an authenticated session to the engine at `addr` with the key it granted
    /// ([`TransferEngine::grant_session`] on the target): every connection proves the key
    /// before any operation, and the target checks each operation against the grant.
    ///
    /// # Errors
    /// As [`TransferEngine::connect`]; [`TransportError::Unauthenticated`] for a key the target
    /// does not know, revoked, or already spent by an ended session, and when the target cannot
    /// prove the key itself; [`TransportError::Unsupported`] on `local`.
    pub async fn connect_with(&self, addr: &str, creds: SessionCredentials) -> Result<Session> {
        let integrity = if self.backend() == BackendKind::Tcp {
            self.shared.core.config.tcp_integrity
        } else {
            TcpIntegrity::None // quic: TLS protects every byte; shm/rdma: no bytes on a socket
        };
        self.open_session(addr, Some(ClientAuth::new(&creds, integrity)?))
            .await
    }

    async fn open_session(&self, addr: &str, auth: Option<ClientAuth>) -> Result<Session> {
        let core = self.shared.core.clone();
        let timeout = core.config.connect_timeout;
        let fut = self
            .shared
            .backend
            .connect(core.clone(), addr.to_string(), auth);
        let handle = self.io_handle()?;
        let link = run_on(&handle, async move {
            tokio::time::timeout(timeout, fut)
                .await
                .map_err(|_| TransportError::Timeout {
                    what: "connect".into(),
                    after: timeout,
                })?
        })
        .await?;
        let session = Session {
            link,
            core,
            handle,
            remote: RwLock::new(RemoteView::default()),
            refreshes: std::sync::atomic::AtomicU64::new(0),
        };
        session.refresh_regions().await?;
        Ok(session)
    }

    /// Blocking [`TransferEngine::connect`] for code outside async contexts.
    ///
    /// # Errors
    /// As [`TransferEngine::connect`].
    pub fn connect_blocking(&self, addr: &str) -> Result<Session> {
        let handle = self.io_handle()?;
        let this = self.clone();
        let addr = addr.to_string();
        block_on_io(&handle, async move { this.connect(&addr).await })
    }

    fn io_handle(&self) -> Result<tokio::runtime::Handle> {
        self.shared
            .runtime
            .as_ref()
            .map(|r| r.handle().clone())
            .ok_or_else(|| TransportError::peer_gone(&self.shared.core.name, "engine shut down"))
    }
}

/// Runs `fut` on the engine's runtime and awaits it from whatever runtime the caller uses.
async fn run_on<T: Send + 'static>(
    handle: &tokio::runtime::Handle,
    fut: impl Future<Output = Result<T>> + Send + 'static,
) -> Result<T> {
    handle
        .spawn(fut)
        .await
        .map_err(|e| TransportError::peer_gone("local engine", format!("engine task ended: {e}")))?
}

/// Runs `fut` on the engine runtime and blocks this (non-runtime) thread for its result.
fn block_on_io<T: Send + 'static>(
    handle: &tokio::runtime::Handle,
    fut: impl Future<Output = Result<T>> + Send + 'static,
) -> Result<T> {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    handle.spawn(async move {
        let _ = tx.send(fut.await);
    });
    rx.recv()
        .map_err(|_| TransportError::peer_gone("local engine", "engine shut down"))?
}

/// An open connection to one peer engine.
pub struct Session {
    link: Arc<dyn Link>,
    core: Arc<EngineCore>,
    handle: tokio::runtime::Handle,
    remote: RwLock<RemoteView>,
    /// Tickets of [`Session::refresh_regions`] calls, in the order they were issued.
    refreshes: std::sync::atomic::AtomicU64,
}

/// The peer's descriptors as last fetched, and the ticket of the fetch they came from.
#[derive(Default)]
struct RemoteView {
    ticket: u64,
    regions: Arc<std::collections::HashMap<RegionId, RegionDescriptor>>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("peer", &self.link.peer())
            .field("alive", &self.link.is_alive())
            .finish()
    }
}

impl Session {
    /// The peer's address.
    pub fn peer(&self) -> &str {
        self.link.peer()
    }

    /// The node name the peer proved: on `quic` the node its certificate is bound to (checked
    /// by the TLS handshake against the cluster CA), elsewhere `None`.
    pub fn peer_node(&self) -> Option<&str> {
        self.link.peer_node()
    }

    /// Whether the connection is still up (a failed peer makes this false).
    pub fn is_alive(&self) -> bool {
        self.link.is_alive() && self.core.alive.load(Ordering::Acquire)
    }

    /// Fetches the peer's registered-memory descriptors again (`GetRegisteredMemory`),
    /// validates them and makes them the ones later batches are checked against — unless a
    /// refresh issued after this one has already answered (answers of concurrent refreshes
    /// are applied in the order the refreshes were issued, never older over newer).
    ///
    /// # Errors
    /// [`TransportError::LayoutMismatch`] for inconsistent descriptors;
    /// [`TransportError::PeerGone`] when the peer does not answer.
    pub async fn refresh_regions(&self) -> Result<Vec<RegionDescriptor>> {
        let ticket = self
            .refreshes
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
            + 1;
        let link = self.link.clone();
        let regions = run_on(&self.handle, async move { link.fetch_regions().await }).await?;
        validate_descriptors(&regions)?;
        let mut view = self.remote.write().expect("session poisoned");
        // Concurrent refreshes may complete out of order: an answer older than the view (it
        // may predate a scope the target opened since) never replaces a newer one.
        if ticket > view.ticket {
            *view = RemoteView {
                ticket,
                regions: Arc::new(regions.iter().map(|d| (d.id, d.clone())).collect()),
            };
        }
        Ok(regions)
    }

    /// The peer's descriptors as last fetched, by id.
    fn view(&self) -> Arc<std::collections::HashMap<RegionId, RegionDescriptor>> {
        self.remote
            .read()
            .expect("session poisoned")
            .regions
            .clone()
    }

    /// The peer's descriptors as last fetched, sorted by id.
    pub fn remote_regions(&self) -> Vec<RegionDescriptor> {
        let mut all: Vec<_> = self.view().values().cloned().collect();
        all.sort_by_key(|d| d.id);
        all
    }

    /// Checks the peer's layout against what the caller expects: the listed regions exist
    /// with exactly these lengths.
    ///
    /// # Errors
    /// [`TransportError::LayoutMismatch`] naming the first difference.
    pub fn expect_layout(&self, expected: &[(RegionId, u64)]) -> Result<()> {
        let remote = self.view();
        for &(id, len) in expected {
            match remote.get(&id) {
                None => {
                    return Err(TransportError::LayoutMismatch(format!(
                        "peer has no region {id}"
                    )))
                }
                Some(d) if d.len != len => {
                    return Err(TransportError::LayoutMismatch(format!(
                        "peer region {id} has {} bytes, expected {len}",
                        d.len
                    )))
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    /// Validates, coalesces and plans `ops`, and starts them. Returns at once.
    ///
    /// # Errors
    /// [`TransportError::UnknownRegion`] / [`TransportError::OutOfBounds`] (local or remote, as
    /// last fetched) before anything moves; [`TransportError::PeerGone`] when the session is
    /// closed; [`TransportError::Busy`] when the executor queue is full.
    pub fn submit(&self, ops: &[TransferOp]) -> Result<BatchHandle> {
        self.submit_fenced(SESSION_SCOPE, ops)
    }

    /// As [`Session::submit`], for operations of scope `fence` at the target (opened there
    /// with [`SessionGrantGuard::allow`]): once the target fences the scope, its operations
    /// are refused there with [`TransportError::Fenced`] and none of their bytes land.
    ///
    /// # Errors
    /// As [`Session::submit`].
    pub fn submit_fenced(&self, fence: FenceId, ops: &[TransferOp]) -> Result<BatchHandle> {
        if !self.is_alive() {
            return Err(TransportError::peer_gone(self.peer(), "session closed"));
        }
        let (pieces, bytes) = crate::plan::plan(
            ops,
            &self.core.registry,
            &self.view(),
            self.core.config.piece_bytes,
            fence,
        )?;
        let state = BatchState::new(pieces.len());
        if !pieces.is_empty() {
            self.link.clone().execute(pieces, state.clone())?;
        }
        Ok(BatchHandle::new(state, bytes))
    }

    /// Sends a small notification to the peer, after every batch this session completed
    /// before the call (a release fence orders the written bytes before it).
    ///
    /// # Errors
    /// [`TransportError::Config`] when larger than `max_notify_bytes`;
    /// [`TransportError::PeerGone`] when the peer is unreachable; the peer's
    /// [`TransportError::Busy`] (`Remote` with kind `busy` over a socket) when its queue of
    /// notifications is full.
    pub async fn notify(&self, bytes: &[u8]) -> Result<()> {
        if bytes.len() > self.core.config.max_notify_bytes {
            return Err(TransportError::Config(format!(
                "notification of {} bytes exceeds max_notify_bytes {}",
                bytes.len(),
                self.core.config.max_notify_bytes
            )));
        }
        std::sync::atomic::fence(Ordering::Release);
        let link = self.link.clone();
        let bytes = bytes.to_vec();
        run_on(&self.handle, async move { link.notify(bytes).await }).await
    }

    /// Closes the session (also done on drop).
    pub fn close(&self) {
        self.link.close();
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.link.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_batch_of_many_pieces_copied_by_several_threads_lands_byte_exact() {
        for threads in [1, 3, 4] {
            let mut cfg = TransferConfig::new(BackendKind::Local, format!("a{threads}"));
            cfg.memcpy_threads = threads;
            cfg.piece_bytes = 4096;
            let a = TransferEngine::new(cfg).unwrap();
            let b = TransferEngine::new(TransferConfig::new(BackendKind::Local, "b")).unwrap();
            let len = (1 << 20) + 4096 * 7 + 123;
            let src = a.allocate_and_register(len).unwrap();
            let dst = b.allocate_and_register(len + 4096).unwrap();
            let back = a.allocate_and_register(len).unwrap();
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
            src.write_at(0, &data).unwrap();
            let session = a.connect_blocking(&b.address()).unwrap();
            let run = |op: TransferOp| {
                session
                    .submit(&[op])
                    .unwrap()
                    .wait_blocking(Duration::from_secs(10))
                    .unwrap()
            };
            // Hundreds of pieces in one batch: cut into one run per copy thread.
            run(TransferOp::write(src.id(), 0, dst.id(), 17, len as u64));
            assert!(
                dst.read_at(17, len).unwrap() == data,
                "write, {threads} threads"
            );
            run(TransferOp::read(back.id(), 0, dst.id(), 17, len as u64));
            assert!(
                back.read_at(0, len).unwrap() == data,
                "read, {threads} threads"
            );
        }
    }
}
