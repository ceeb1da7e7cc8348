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

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use pdserve_runtime::memory::{HostMemory, HostMemoryAllocator};
use pdserve_runtime::wire::{RegionChunk, RegionDescriptor, ShmHandle};
use tokio::sync::{mpsc, watch};

use crate::auth::{
    AuthTable, ClientAuth, FenceId, SessionCredentials, SessionGrant, SessionGrantGuard,
    SESSION_SCOPE,
};
use crate::control::tls::MemberCredentials;
use crate::error::{Result, Side, TransportError};
use crate::memory::{
    check_range, validate_descriptors, BackendRegistration, BackendRegistrationHolder, RegionEntry,
    RegionId, RegisteredRegion, Registry,
};

pub(crate) type BoxFut<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// Which medium moves the bytes: the config's `transfer.backend` enum (one type from the
/// config file to the engine; `FromStr`/serde accept `local`, `shm`, `tcp`, `quic`, `rdma`).
pub use pdserve_runtime::config::TransferBackend as BackendKind;

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

/// How to build a [`TransferEngine`].
#[derive(Debug, Clone)]
pub struct TransferConfig {
    /// The backend.
    pub backend: BackendKind,
    /// This engine's name, shown to peers (in notifications) and in logs.
    pub name: String,
    /// Where `shm` (control), `tcp` and `quic` listen; port 0 picks a free port.
    pub listen: SocketAddr,
    /// Parallel data connections per peer (`tcp`).
    pub tcp_connections: usize,
    /// Largest piece one wire operation or memcpy step moves; larger operations are split.
    pub piece_bytes: u64,
    /// Largest single registration; larger regions are registered in chunks (RDMA limits it;
    /// `None` means one chunk per region).
    pub max_registration_bytes: Option<u64>,
    /// Limit for opening a session.
    pub connect_timeout: Duration,
    /// A silent peer is declared gone after this long (`quic` idle timeout).
    pub peer_timeout: Duration,
    /// Threads of the engine's I/O runtime.
    pub io_threads: usize,
    /// Copy threads of the `local` and `shm` backends (a batch of several pieces is copied
    /// by all of them at once).
    pub memcpy_threads: usize,
    /// Bounded queue depth of the executors (batches for memcpy, pieces per connection).
    pub queue_depth: usize,
    /// Largest notification payload.
    pub max_notify_bytes: usize,
    /// Cluster member credentials (required by `quic`: mutual TLS).
    pub credentials: Option<MemberCredentials>,
    /// Every connection must prove a session key ([`TransferEngine::grant_session`]) before
    /// any operation. When false, keys become required anyway from the first grant on.
    pub require_auth: bool,
    /// What peers are told to connect to: an IP (the bound port is kept) or `IP:port`.
    /// `None`: the bound address, or, when `listen` is unspecified (`0.0.0.0`, `::`), the
    /// address of the interface that routes to the peer ([`TransferEngine::address_for`]).
    pub advertise_addr: Option<String>,
    /// Protection of `tcp` frames of authenticated sessions.
    pub tcp_integrity: TcpIntegrity,
    /// RDMA devices, port, GID, MTU and queue depths (`rdma`).
    pub rdma: RdmaConfig,
}

/// Protection of the frames of an authenticated `tcp` session (`transfer.tcp_integrity`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TcpIntegrity {
    /// Frames travel as they are: the key proof authenticates the connection, not its bytes.
    #[default]
    None,
    /// Every frame carries an AES-256-GCM tag over its header and payload (tampering,
    /// replay and reordering are detected; bytes travel in the clear).
    Mac,
    /// Every frame's payload is encrypted with AES-256-GCM, its header authenticated.
    Encrypt,
}

impl std::str::FromStr for TcpIntegrity {
    type Err = TransportError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "none" => Ok(Self::None),
            "mac" => Ok(Self::Mac),
            "encrypt" => Ok(Self::Encrypt),
            other => Err(TransportError::Config(format!(
                "unknown tcp_integrity {other:?} (none, mac, encrypt)"
            ))),
        }
    }
}

/// The RDMA settings (`transfer.rdma_*`), checked by [`TransferConfig::validate`] without
/// touching a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaConfig {
    /// Devices to use (`mlx5_0`, ...); batches are striped over them. Empty: the first device.
    pub devices: Vec<String>,
    /// Port number on each device.
    pub port: u8,
    /// GID table index; `None`: the first RoCE v2 entry holding an IPv4 address (InfiniBand
    /// ports use no GID).
    pub gid_index: Option<u32>,
    /// Path MTU in bytes (256 to 4096, a power of two); `None`: the port's active MTU.
    pub mtu: Option<u32>,
    /// Work requests in flight per queue pair.
    pub send_queue_depth: u32,
    /// Completion-queue entries per queue pair (at least `send_queue_depth`).
    pub cq_depth: u32,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        Self {
            devices: Vec::new(),
            port: 1,
            gid_index: None,
            mtu: None,
            send_queue_depth: 512,
            cq_depth: 1024,
        }
    }
}

impl RdmaConfig {
    /// Checks the values.
    ///
    /// # Errors
    /// [`TransportError::Config`] naming the first bad value.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(TransportError::Config(m));
        if let Some(d) = self
            .devices
            .iter()
            .find(|d| d.is_empty() || d.contains(char::is_whitespace))
        {
            return bad(format!("rdma device name {d:?} is empty or has whitespace"));
        }
        let mut seen = std::collections::HashSet::new();
        if let Some(d) = self.devices.iter().find(|d| !seen.insert(*d)) {
            return bad(format!("rdma device {d:?} is listed twice"));
        }
        if self.port == 0 {
            return bad("rdma port must be ≥ 1".into());
        }
        if let Some(m) = self.mtu {
            if !matches!(m, 256 | 512 | 1024 | 2048 | 4096) {
                return bad(format!(
                    "rdma mtu must be 256, 512, 1024, 2048 or 4096, got {m}"
                ));
            }
        }
        if !(1..=32768).contains(&self.send_queue_depth) {
            return bad(format!(
                "rdma send_queue_depth must be 1..=32768, got {}",
                self.send_queue_depth
            ));
        }
        if self.cq_depth < self.send_queue_depth || self.cq_depth > 1 << 22 {
            return bad(format!(
                "rdma cq_depth must be between send_queue_depth ({}) and 4194304, got {}",
                self.send_queue_depth, self.cq_depth
            ));
        }
        Ok(())
    }
}

impl TransferConfig {
    /// Defaults for `backend`, listening on 127.0.0.1 with a free port.
    pub fn new(backend: BackendKind, name: impl Into<String>) -> Self {
        Self {
            backend,
            name: name.into(),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            tcp_connections: 4,
            piece_bytes: 1 << 20,
            max_registration_bytes: None,
            connect_timeout: Duration::from_secs(5),
            peer_timeout: Duration::from_secs(5),
            io_threads: 2,
            memcpy_threads: 2,
            queue_depth: 256,
            max_notify_bytes: 64 << 10,
            credentials: None,
            require_auth: false,
            advertise_addr: None,
            tcp_integrity: TcpIntegrity::None,
            rdma: RdmaConfig::default(),
        }
    }

    /// Checks the values.
    ///
    /// # Errors
    /// [`TransportError::Config`] naming the first bad value.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(TransportError::Config(m.to_string()));
        if self.tcp_connections == 0 || self.tcp_connections > 64 {
            return bad("tcp_connections must be 1..=64");
        }
        if self.piece_bytes < 4096 {
            return bad("piece_bytes must be at least 4096");
        }
        if self.max_registration_bytes == Some(0) {
            return bad("max_registration_bytes must be positive");
        }
        if self.io_threads == 0 || self.queue_depth == 0 {
            return bad("io_threads and queue_depth must be positive");
        }
        if !(1..=64).contains(&self.memcpy_threads) {
            return bad("memcpy_threads must be 1..=64");
        }
        if self.backend == BackendKind::Quic && self.credentials.is_none() {
            return bad("the quic backend needs cluster member credentials (mutual TLS)");
        }
        if let Some(a) = &self.advertise_addr {
            parse_advertise(a)?;
        }
        self.rdma.validate()
    }

    /// The transfer engine an instance configured by `cfg` runs: `transfer.*` (backend,
    /// listen address, advertised address, engine knobs, keys, integrity, RDMA) and, with
    /// `transfer.credentials_dir`, the member credentials of `instance.name`.
    ///
    /// # Errors
    /// [`TransportError::Config`] naming the bad key; credential loading errors.
    pub fn from_serve_config(cfg: &pdserve_runtime::config::ServeConfig) -> Result<Self> {
        let t = &cfg.transfer;
        let key_err = |key: &str, e: &dyn std::fmt::Display| {
            TransportError::Config(format!("transfer.{key}: {e}"))
        };
        let mut c = Self::new(t.backend, cfg.instance.name.clone());
        c.listen = t.listen.parse().map_err(|e| key_err("listen", &e))?;
        c.advertise_addr = t.advertise_addr.clone();
        c.io_threads = t.io_threads;
        c.memcpy_threads = t.memcpy_threads;
        c.queue_depth = t.queue_depth;
        c.piece_bytes = t.piece_bytes;
        c.tcp_connections = t.tcp_connections;
        c.max_registration_bytes = t.registration_chunk_bytes;
        c.require_auth = t.require_auth;
        c.tcp_integrity = t
            .tcp_integrity
            .parse()
            .map_err(|e| key_err("tcp_integrity", &e))?;
        c.rdma = RdmaConfig {
            devices: t.rdma_device_list(),
            port: t.rdma_port,
            gid_index: t.rdma_gid_index,
            mtu: t.rdma_mtu,
            send_queue_depth: t.rdma_send_queue_depth,
            cq_depth: t.rdma_cq_depth,
        };
        if let Some(dir) = &t.credentials_dir {
            c.credentials = Some(
                MemberCredentials::load(std::path::Path::new(dir), &cfg.instance.name)
                    .map_err(|e| key_err("credentials_dir", &e))?,
            );
        }
        c.validate()?;
        Ok(c)
    }
}

/// A configured advertised address: a whole socket address, or an IP to pair with the bound
/// port.
fn parse_advertise(a: &str) -> Result<(std::net::IpAddr, Option<u16>)> {
    if let Ok(sock) = a.parse::<SocketAddr>() {
        return Ok((sock.ip(), Some(sock.port())));
    }
    a.parse::<std::net::IpAddr>()
        .map(|ip| (ip, None))
        .map_err(|_| {
            TransportError::Config(format!(
                "advertise_addr must be an IP or IP:port, got {a:?}"
            ))
        })
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

/// Direction of one operation, seen from the initiator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// Copy remote bytes into the local region.
    Read,
    /// Copy local bytes into the remote region.
    Write,
}

/// One operation of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferOp {
    /// Read or write.
    pub kind: OpKind,
    /// A region registered with this engine.
    pub local_region: RegionId,
    /// Byte offset in the local region.
    pub local_offset: u64,
    /// A region of the peer (from [`Session::remote_regions`]).
    pub remote_region: RegionId,
    /// Byte offset in the remote region.
    pub remote_offset: u64,
    /// Bytes to move.
    pub len: u64,
}

impl TransferOp {
    /// A write of `len` bytes from `local` at `lo` to `remote` at `ro`.
    pub fn write(local: RegionId, lo: u64, remote: RegionId, ro: u64, len: u64) -> Self {
        Self {
            kind: OpKind::Write,
            local_region: local,
            local_offset: lo,
            remote_region: remote,
            remote_offset: ro,
            len,
        }
    }

    /// A read of `len` bytes from `remote` at `ro` into `local` at `lo`.
    pub fn read(local: RegionId, lo: u64, remote: RegionId, ro: u64, len: u64) -> Self {
        Self {
            kind: OpKind::Read,
            local_region: local,
            local_offset: lo,
            remote_region: remote,
            remote_offset: ro,
            len,
        }
    }
}

/// Merges operations that continue each other (same kind and regions, contiguous on both
/// sides), keeping the order of first appearance. Zero-length operations are dropped.
pub fn coalesce(ops: &[TransferOp]) -> Vec<TransferOp> {
    let mut out: Vec<TransferOp> = Vec::with_capacity(ops.len());
    for op in ops.iter().filter(|o| o.len > 0) {
        if let Some(last) = out.last_mut() {
            if last.kind == op.kind
                && last.local_region == op.local_region
                && last.remote_region == op.remote_region
                && last.local_offset.checked_add(last.len) == Some(op.local_offset)
                && last.remote_offset.checked_add(last.len) == Some(op.remote_offset)
            {
                last.len += op.len;
                continue;
            }
        }
        out.push(*op);
    }
    out
}

/// A planned piece: inside one registration chunk on each side, at most `piece_bytes` long.
#[derive(Debug, Clone)]
pub(crate) struct PlannedOp {
    pub(crate) kind: OpKind,
    pub(crate) local: Arc<RegionEntry>,
    pub(crate) local_offset: u64,
    pub(crate) remote_region: RegionId,
    pub(crate) remote_offset: u64,
    pub(crate) len: u64,
    /// The scope at the target the piece belongs to.
    pub(crate) fence: FenceId,
    /// The remote chunk holding the piece (RDMA address and key).
    #[allow(dead_code)]
    pub(crate) remote_chunk: RegionChunk,
}

fn chunk_end(chunks: &[RegionChunk], offset: u64) -> Option<(RegionChunk, u64)> {
    chunks
        .iter()
        .find(|c| c.offset <= offset && offset < c.offset + c.len)
        .map(|c| (c.clone(), c.offset + c.len))
}

/// State of a batch: what the executors complete and the handle observes.
#[derive(Debug)]
pub(crate) struct BatchState {
    total: usize,
    done: AtomicUsize,
    /// The first error. Its lock is also the landing fence: bytes land in local memory
    /// under a read lock ([`BatchState::land`]) and the error is set under the write lock,
    /// so once a batch has failed no byte lands any more.
    error: RwLock<Option<TransportError>>,
    cancelled: AtomicBool,
    finished: watch::Sender<bool>,
}

impl BatchState {
    pub(crate) fn new(total: usize) -> Arc<Self> {
        let (finished, _) = watch::channel(total == 0);
        Arc::new(Self {
            total,
            done: AtomicUsize::new(0),
            error: RwLock::new(None),
            cancelled: AtomicBool::new(false),
            finished,
        })
    }

    /// Records the end of one piece. The piece's bytes are written before this is called; the
    /// counter's release/acquire makes them visible to whoever observes the batch as done.
    pub(crate) fn complete(&self, result: Result<()>) {
        match result {
            Ok(()) => {
                if self.done.fetch_add(1, Ordering::AcqRel) + 1 == self.total {
                    self.finished.send_replace(true);
                }
            }
            Err(e) => {
                let mut slot = self.error.write().unwrap_or_else(|e| e.into_inner());
                if slot.is_none() {
                    *slot = Some(e);
                }
                drop(slot);
                self.finished.send_replace(true);
            }
        }
    }

    /// Ends the batch with `why` and stops its remaining pieces. The error is recorded before
    /// the flag is raised: an executor that sees the flag first would record its own
    /// `Cancelled` and hide why the batch was given up (a timeout, for one).
    fn abandon(&self, why: TransportError) {
        self.complete(Err(why));
        self.cancelled.store(true, Ordering::Relaxed);
    }

    /// Copies received bytes into local memory with `copy` unless the batch has already
    /// ended in failure or been given up; returns whether it copied. A copy runs to its end
    /// before a failure can be recorded, so once [`BatchHandle::wait`] or
    /// [`BatchHandle::cancel`] returned, no byte of this batch lands in local memory: the
    /// caller may reuse it. (Bytes a late answer brings are read off the wire and dropped.)
    pub(crate) fn land(&self, copy: impl FnOnce()) -> bool {
        let error = self.error.read().unwrap_or_else(|e| e.into_inner());
        if error.is_some() || self.cancelled.load(Ordering::Relaxed) {
            return false;
        }
        copy();
        true
    }

    pub(crate) fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Relaxed)
            || self
                .error
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .is_some()
    }

    fn status(&self) -> BatchStatus {
        if let Some(e) = self.error.read().unwrap_or_else(|e| e.into_inner()).clone() {
            return BatchStatus::Failed(e);
        }
        let done = self.done.load(Ordering::Acquire);
        if done == self.total {
            BatchStatus::Done
        } else {
            BatchStatus::Pending {
                completed: done,
                total: self.total,
            }
        }
    }
}

/// Completes its piece with an error if dropped unfinished (a queue torn down with the
/// connection), so no batch waits for a piece that will never run.
#[derive(Debug)]
pub(crate) struct PieceCompletion {
    batch: Option<Arc<BatchState>>,
    peer: Arc<str>,
}

impl PieceCompletion {
    pub(crate) fn new(batch: Arc<BatchState>, peer: Arc<str>) -> Self {
        Self {
            batch: Some(batch),
            peer,
        }
    }
    pub(crate) fn is_cancelled(&self) -> bool {
        self.batch.as_ref().is_some_and(|b| b.is_cancelled())
    }
    /// Copies a read answer (`bytes`, `op.len` of them) into `op`'s local range under the
    /// batch's landing fence ([`BatchState::land`]); `Cancelled` when the batch has ended.
    pub(crate) fn land_read(&self, op: &PlannedOp, bytes: &[u8]) -> Result<()> {
        assert!(
            bytes.len() as u64 >= op.len,
            "a read answer shorter than its piece"
        );
        self.land_read_at(op, 0, &bytes[..op.len as usize])
    }

    /// As [`PieceCompletion::land_read`] for the part of the answer at `at` (`bytes` must fit
    /// inside the piece).
    pub(crate) fn land_read_at(&self, op: &PlannedOp, at: usize, bytes: &[u8]) -> Result<()> {
        assert!(
            at as u64 + bytes.len() as u64 <= op.len,
            "a read answer longer than its piece"
        );
        let landed = self.batch.as_ref().is_some_and(|b| {
            b.land(|| {
                // SAFETY: the local range was checked at submit; `op.local` keeps the region
                // alive; the batch owns these bytes until it ends, and it has not ended.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        bytes.as_ptr(),
                        op.local.ptr_at(op.local_offset + at as u64),
                        bytes.len(),
                    );
                }
            })
        });
        if landed {
            Ok(())
        } else {
            Err(TransportError::Cancelled)
        }
    }
    pub(crate) fn complete(mut self, result: Result<()>) {
        if let Some(b) = self.batch.take() {
            b.complete(result);
        }
    }
}

impl Drop for PieceCompletion {
    fn drop(&mut self) {
        if let Some(b) = self.batch.take() {
            b.complete(Err(TransportError::peer_gone(
                &*self.peer,
                "connection closed before the operation finished",
            )));
        }
    }
}

/// Where a batch stands.
#[derive(Debug, Clone)]
pub enum BatchStatus {
    /// Still running.
    Pending {
        /// Pieces finished.
        completed: usize,
        /// Pieces in all.
        total: usize,
    },
    /// Every operation finished; written bytes are visible at the receiver.
    Done,
    /// An operation failed (the first error); other pieces may or may not have landed.
    Failed(TransportError),
}

/// A submitted batch.
#[derive(Debug, Clone)]
pub struct BatchHandle {
    state: Arc<BatchState>,
    bytes: u64,
}

impl BatchHandle {
    /// Polls the batch without waiting.
    pub fn status(&self) -> BatchStatus {
        self.state.status()
    }

    /// Bytes the batch moves.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Asks the executors to stop at the next piece boundary; the batch then fails with
    /// [`TransportError::Cancelled`]. Pieces already on the wire may still land.
    pub fn cancel(&self) {
        self.state.abandon(TransportError::Cancelled);
    }

    /// Waits until the batch ends or `timeout` passes. On timeout the batch is cancelled.
    ///
    /// # Errors
    /// [`TransportError::Timeout`], or the batch's first error (typed: unknown region, out of
    /// bounds, peer gone, ...).
    pub async fn wait(&self, timeout: Duration) -> Result<()> {
        let mut rx = self.state.finished.subscribe();
        let finished = tokio::time::timeout(timeout, rx.wait_for(|f| *f)).await;
        if finished.is_err() {
            self.state.abandon(TransportError::Timeout {
                what: "transfer batch".into(),
                after: timeout,
            });
        }
        match self.status() {
            BatchStatus::Done => Ok(()),
            BatchStatus::Failed(e) => Err(e),
            BatchStatus::Pending { .. } => Err(TransportError::Timeout {
                what: "transfer batch".into(),
                after: timeout,
            }),
        }
    }

    /// Blocking wait for code outside async contexts (benchmarks, tools).
    ///
    /// # Errors
    /// As [`BatchHandle::wait`].
    pub fn wait_blocking(&self, timeout: Duration) -> Result<()> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()?;
        rt.block_on(self.wait(timeout))
    }
}

/// A notification from a peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// The sending engine's name.
    pub from: String,
    /// The payload.
    pub bytes: Vec<u8>,
}

/// One open connection to a peer, as a backend implements it.
pub(crate) trait Link: Send + Sync {
    fn peer(&self) -> &str;
    /// The node name the peer proved (`quic`: from its certificate).
    fn peer_node(&self) -> Option<&str> {
        None
    }
    fn fetch_regions(self: Arc<Self>) -> BoxFut<Result<Vec<RegionDescriptor>>>;
    fn notify(self: Arc<Self>, bytes: Vec<u8>) -> BoxFut<Result<()>>;
    /// Starts the pieces; each is completed through `batch` later, possibly on another thread.
    fn execute(self: Arc<Self>, pieces: Vec<PlannedOp>, batch: Arc<BatchState>) -> Result<()>;
    fn is_alive(&self) -> bool;
    fn close(&self);
}

/// What a backend does for an engine.
pub(crate) trait Backend: Send + Sync {
    fn address(&self) -> String;
    fn allocator(&self) -> Arc<dyn HostMemoryAllocator>;
    /// Registers memory with the medium: chunks, shm handle, backend state.
    fn register(
        &self,
        mem: &Arc<dyn HostMemory>,
    ) -> Result<(
        Vec<RegionChunk>,
        Option<ShmHandle>,
        Option<BackendRegistration>,
    )>;
    /// Opens a link; with `auth`, every connection of it proves the session key.
    fn connect(
        &self,
        core: Arc<EngineCore>,
        addr: String,
        auth: Option<ClientAuth>,
    ) -> BoxFut<Result<Arc<dyn Link>>>;
}

/// What the engine's executors and servers share. Never owns the runtime.
#[derive(Debug)]
pub(crate) struct EngineCore {
    pub(crate) name: String,
    pub(crate) config: TransferConfig,
    pub(crate) registry: Arc<Registry>,
    pub(crate) notify_tx: mpsc::Sender<Notification>,
    pub(crate) alive: AtomicBool,
    pub(crate) memcpy: crate::backend::memcpy::MemcpyExecutor,
    /// The grants this engine handed out as a target.
    pub(crate) auth: Arc<AuthTable>,
}

impl EngineCore {
    /// Delivers a notification to this engine's receiver. The acquire fence pairs with the
    /// sender's release: bytes the sender wrote before notifying are visible to whoever reads
    /// the notification.
    ///
    /// # Errors
    /// [`TransportError::Busy`] when the queue of `queue_depth` notifications is full: the
    /// owner does not take them (fast enough). Waiting for room instead would hold the
    /// sender's connection forever on an engine whose owner never takes them.
    pub(crate) fn deliver(&self, from: String, bytes: Vec<u8>) -> Result<()> {
        std::sync::atomic::fence(Ordering::Acquire);
        match self.notify_tx.try_send(Notification { from, bytes }) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full(_)) => Err(TransportError::Busy(format!(
                "the notification queue of engine {} is full",
                self.name
            ))),
            Err(mpsc::error::TrySendError::Closed(_)) => {
                tracing::debug!(engine = %self.name, "notification dropped: receiver closed");
                Ok(())
            }
        }
    }
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
            memcpy: crate::backend::memcpy::MemcpyExecutor::start(
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
        let ops = coalesce(ops);
        let remote = self.view();
        let piece = self.core.config.piece_bytes;
        let mut pieces = Vec::new();
        let mut bytes = 0u64;
        for op in &ops {
            let local = self.core.registry.get(Side::Local, op.local_region)?;
            local.check(Side::Local, op.local_offset, op.len)?;
            let rdesc = remote
                .get(&op.remote_region)
                .ok_or(TransportError::UnknownRegion {
                    side: Side::Remote,
                    id: op.remote_region,
                })?;
            check_range(Side::Remote, rdesc.id, op.remote_offset, op.len, rdesc.len)?;
            bytes += op.len;
            let mut done = 0u64;
            while done < op.len {
                let lo = op.local_offset + done;
                let ro = op.remote_offset + done;
                let (_, lend) = chunk_end(&local.descriptor.chunks, lo).ok_or_else(|| {
                    TransportError::LayoutMismatch("local chunks do not cover the region".into())
                })?;
                let (rchunk, rend) = chunk_end(&rdesc.chunks, ro).ok_or_else(|| {
                    TransportError::LayoutMismatch(format!(
                        "peer region {} chunks leave a gap",
                        rdesc.id
                    ))
                })?;
                let n = (op.len - done).min(piece).min(lend - lo).min(rend - ro);
                pieces.push(PlannedOp {
                    kind: op.kind,
                    local: local.clone(),
                    local_offset: lo,
                    remote_region: op.remote_region,
                    remote_offset: ro,
                    len: n,
                    fence,
                    remote_chunk: rchunk,
                });
                done += n;
            }
        }
        let state = BatchState::new(pieces.len());
        if !pieces.is_empty() {
            self.link.clone().execute(pieces, state.clone())?;
        }
        Ok(BatchHandle { state, bytes })
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

    #[test]
    fn coalesce_merges_contiguous_runs_only() {
        let ops = [
            TransferOp::write(1, 0, 2, 100, 10),
            TransferOp::write(1, 10, 2, 110, 5),
            TransferOp::write(1, 15, 2, 200, 5), // remote not contiguous
            TransferOp::read(1, 20, 2, 205, 5),  // kind differs
            TransferOp::read(1, 25, 2, 210, 0),  // empty: dropped
            TransferOp::read(1, 25, 2, 210, 7),
        ];
        let out = coalesce(&ops);
        assert_eq!(
            out,
            vec![
                TransferOp::write(1, 0, 2, 100, 15),
                TransferOp::write(1, 15, 2, 200, 5),
                TransferOp::read(1, 20, 2, 205, 12),
            ]
        );
    }

    #[test]
    fn config_validation_names_bad_values() {
        let mut c = TransferConfig::new(BackendKind::Tcp, "a");
        c.validate().unwrap();
        c.tcp_connections = 0;
        assert!(matches!(c.validate(), Err(TransportError::Config(_))));
        let q = TransferConfig::new(BackendKind::Quic, "q");
        assert!(matches!(q.validate(), Err(TransportError::Config(_))));
        assert_eq!("shm".parse::<BackendKind>().unwrap(), BackendKind::Shm);
        assert!("nope".parse::<BackendKind>().is_err());
        let mut m = TransferConfig::new(BackendKind::Shm, "m");
        for bad in [0, 65] {
            m.memcpy_threads = bad;
            assert!(
                matches!(m.validate(), Err(TransportError::Config(_))),
                "{bad}"
            );
        }
    }

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
