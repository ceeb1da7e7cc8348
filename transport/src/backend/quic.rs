//! The `quic` backend: quinn streams over `max(tcp_connections, io_threads)` QUIC connections
//! per peer (each connection is driven by one task, so several spread the AES-GCM work over
//! the I/O threads), each from its own client endpoint, to a server that binds one endpoint
//! per I/O thread to its port (an `SO_REUSEPORT` group, so the kernel spreads connections),
//! mutual TLS from the cluster CA. Every piece and control request is its own bidirectional
//! stream (header, payload, answer), so pieces run in parallel without head-of-line blocking;
//! a semaphore per connection bounds the streams in flight. Bulk settings: MTU discovery up to
//! [`MAX_UDP_PAYLOAD`] (65507 bytes, also announced as the endpoint's largest datagram), so a
//! path carries the largest packets it can (over a 1500-byte veth pair the cost stayed what
//! 1452-byte packets cost; over a 9000-byte one it fell to 1.1 CPU-s/GB, see below);
//! segmentation offload (GSO) with batches cut at 64 KB ([`BoundedGsoSocket`]); 8 MiB socket
//! buffers (capped by `rmem_max`/`wmem_max`); flow-control windows sized for a window of
//! pieces; no stream fairness; write payloads are handed to quinn as views of registered
//! memory and read answers land straight from quinn's buffers (no per-op allocation).
//!
//! Issue 16 measurements (2 vCPUs shared with another engineer's benchmarks; the figures are
//! CPU-seconds of both processes per GB moved, 16 MiB writes, 8 in flight). The transfer is
//! CPU-bound: an idle-machine `perf record -e cpu-clock -a` of the bench left 6 % idle. With
//! quinn's default 1452-byte packets it cost 2.2-3.1 CPU-s/GB, most of it quinn's
//! per-packet work (`poll_transmit`, `handle_decode`, the reassembly heap, one channel send
//! per datagram, malloc), so two cores capped it at ~0.65-0.9 GB/s against 2-4.8 GB/s for the
//! plain socket (0.3-0.6 CPU-s/GB for both ends). With 64 KB packets it costs 0.74-0.93
//! CPU-s/GB and the profile is per-byte work only: ~23 % memmove (quinn's copy into the
//! packet; on receipt quinn's copy of the datagram and ours into registered memory), ~28 %
//! AES-GCM seal + open, ~14 % the kernel's two UDP copies. That is this design's floor
//! (three user copies at ~0.07, two AES-GCM passes at 0.12-0.14, the kernel's copies at about
//! what TCP costs), so two cores give at most ~2.5 GB/s; 1.1-2.6 GB/s measured under load.
//! Larger payloads looked no better in earlier attempts; the likely reasons, from quinn's
//! source: its default endpoint announces 1472 bytes as its largest datagram (capping the
//! peer's packets), and a GSO batch of 10 datagrams over ~6.5 KB exceeds what one `sendmsg`
//! may carry and is dropped whole (`EMSGSIZE`, silenced by quinn-udp). Forcing 64 MiB socket buffers (`SO_RCVBUFFORCE`) removed the receive-buffer
//! drops (30-80 congestion events per connection in 2 s without) but not measurably the cost
//! or the rate; 1, 2, 4 or 8 connections, 1-16 MiB pieces and 1-4 I/O threads were within the
//! noise (the last on the client only). Later (idle machine): both ends prefer AES-128-GCM
//! (`control::tls::provider`, 0.100 against 0.113-0.116 CPU-s/GB per pass), and a quinn
//! patched to hand received datagrams on without copying them saved ~5 % (not kept). Confined
//! to one vCPU quic moves about half what it moves on two, while the plain socket it is
//! compared with is one stream that one vCPU nearly saturates. See docs/transport.md.
//! A peer that goes silent is gone after the idle timeout (`peer_timeout`), which fails every
//! stream of the connection. Both sides are known by the node name their certificates are
//! bound to (see `control::tls`): the server's HELLO check refuses a client announcing another
//! name, and the client reads the server's node from its certificate (a certificate without a
//! node binding is refused) and, when the session was opened for a named node, checks it.

use std::net::SocketAddr;
use std::sync::Arc;

use pdserve_runtime::memory::{AnonAllocator, HostMemory, HostMemoryAllocator};
use pdserve_runtime::wire::{RegionChunk, RegionDescriptor, ShmHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Semaphore;

use super::codec::{self, ReqHeader, RespHeader};
use super::proto::{self, ConnShared, ServerCtx};
use crate::auth::ClientAuth;
use crate::batch::{BatchState, PieceCompletion};
use crate::config::BackendKind;
use crate::control::tls::{certified_node, peer_certificate, ALPN_TRANSFER, MEMBER_SERVER_NAME};
use crate::error::{Result, TransportError};
use crate::memory::{plain_chunks, BackendRegistration};
use crate::op::OpKind;
use crate::plan::PlannedOp;
use crate::seam::{Backend, BoxFut, EngineCore, Link};

/// Streams in flight per connection.
const MAX_STREAMS: usize = 64;
/// Most server endpoints (sockets of the `SO_REUSEPORT` group), one per I/O thread.
const MAX_SERVER_ENDPOINTS: usize = 16;
/// Socket send and receive buffers asked for (the kernel caps them at `wmem_max`/`rmem_max`).
const SOCKET_BUFFER: usize = 8 << 20;
/// Largest UDP payload MTU discovery may reach: the largest IPv4 UDP datagram. Discovery
/// (a binary search, probes that are lost mean "too large") stops at what the path carries:
/// 1452 bytes on 1500-byte Ethernet, about 8950 on jumbo frames, this on loopback.
const MAX_UDP_PAYLOAD: u16 = 65_507;
/// Most bytes one segmentation-offload send may carry (one UDP datagram's limit).
const MAX_GSO_BYTES: usize = MAX_UDP_PAYLOAD as usize;

/// quinn's UDP socket, with segmentation-offload batches cut to what one `sendmsg` carries.
///
/// quinn batches up to 10 datagrams of the current MTU into one send; above ~6.5 KB a batch
/// exceeds the 64 KB a UDP send may carry and the kernel refuses it (`EMSGSIZE`, which
/// quinn-udp drops silently: every full batch would be lost). Such a batch goes out as
/// several sends of as many whole datagrams as fit (one each at a 64 KB MTU).
#[derive(Debug)]
struct BoundedGsoSocket(Arc<dyn quinn::AsyncUdpSocket>);

impl quinn::AsyncUdpSocket for BoundedGsoSocket {
    fn create_io_poller(self: Arc<Self>) -> std::pin::Pin<Box<dyn quinn::UdpPoller>> {
        self.0.clone().create_io_poller()
    }

    fn try_send(&self, transmit: &quinn::udp::Transmit) -> std::io::Result<()> {
        let Some(segment) = transmit
            .segment_size
            .filter(|_| transmit.contents.len() > MAX_GSO_BYTES)
        else {
            return self.0.try_send(transmit);
        };
        let per_send = (MAX_GSO_BYTES / segment).max(1) * segment;
        for (i, part) in transmit.contents.chunks(per_send).enumerate() {
            let sent = self.0.try_send(&quinn::udp::Transmit {
                destination: transmit.destination,
                ecn: transmit.ecn,
                contents: part,
                segment_size: (part.len() > segment).then_some(segment),
                src_ip: transmit.src_ip,
            });
            match sent {
                Ok(()) => {}
                // Nothing sent yet: quinn retries the whole batch when the socket is writable.
                Err(e) if i == 0 => return Err(e),
                // Part of the batch is out: the rest counts as lost and QUIC resends it, as
                // quinn-udp treats a datagram the kernel refused.
                Err(_) => return Ok(()),
            }
        }
        Ok(())
    }

    fn poll_recv(
        &self,
        cx: &mut std::task::Context,
        bufs: &mut [std::io::IoSliceMut<'_>],
        meta: &mut [quinn::udp::RecvMeta],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.0.poll_recv(cx, bufs, meta)
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.0.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.0.max_transmit_segments()
    }

    fn max_receive_segments(&self) -> usize {
        self.0.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.0.may_fragment()
    }
}

/// A UDP socket bound to `addr` with large buffers, sending batches through
/// [`BoundedGsoSocket`]. With `reuse_port` it joins `addr`'s `SO_REUSEPORT` group: the kernel
/// hands each remote (address, port) to one socket of the group, so the server's endpoints
/// share its one advertised port and split its connections.
fn bulk_socket(addr: SocketAddr, reuse_port: bool) -> Result<Arc<dyn quinn::AsyncUdpSocket>> {
    use std::os::fd::AsRawFd;
    let raw = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::DGRAM,
        Some(socket2::Protocol::UDP),
    )?;
    if reuse_port {
        raw.set_reuse_port(true)?;
    }
    raw.bind(&addr.into())?;
    let socket: std::net::UdpSocket = raw.into();
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        let size = SOCKET_BUFFER as libc::c_int;
        // SAFETY: a valid socket and a c_int option value of the right size.
        let rc = unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                (&size as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            tracing::debug!(error = %std::io::Error::last_os_error(), "quic socket buffer not raised");
        }
    }
    let runtime = quinn::default_runtime()
        .ok_or_else(|| TransportError::Config("no async runtime for QUIC".into()))?;
    Ok(Arc::new(BoundedGsoSocket(runtime.wrap_udp_socket(socket)?)))
}

/// Endpoint settings for bulk transfers: datagrams up to [`MAX_UDP_PAYLOAD`] accepted (and
/// announced to peers, whose MTU discovery is capped by it).
fn bulk_endpoint() -> Result<quinn::EndpointConfig> {
    let mut e = quinn::EndpointConfig::default();
    e.max_udp_payload_size(MAX_UDP_PAYLOAD)
        .map_err(|e| TransportError::Config(e.to_string()))?;
    Ok(e)
}

/// Transport settings for bulk transfers (on top of the control plane's).
fn bulk_transport(peer_timeout: std::time::Duration) -> Result<Arc<quinn::TransportConfig>> {
    let mut t = quinn::TransportConfig::default();
    t.max_idle_timeout(Some(
        quinn::IdleTimeout::try_from(peer_timeout)
            .map_err(|e| TransportError::Config(e.to_string()))?,
    ));
    t.keep_alive_interval(Some(peer_timeout / 3));
    // A window of pieces (64 streams × 1 MiB) in flight per connection.
    t.stream_receive_window(quinn::VarInt::from_u32(16 << 20));
    t.receive_window(quinn::VarInt::from_u32(128 << 20));
    t.send_window(128 << 20);
    t.max_concurrent_bidi_streams(quinn::VarInt::from_u32(1024));
    t.max_concurrent_uni_streams(quinn::VarInt::from_u32(16));
    // Stream data goes out stream by stream, not interleaved: a piece finishes sooner.
    t.send_fairness(false);
    t.enable_segmentation_offload(true);
    // Per-packet work (framing, encryption calls, acknowledgements, the receive path's
    // channel hops) dominates at 1452-byte packets: let discovery find the path's largest.
    let mut mtud = quinn::MtuDiscoveryConfig::default();
    mtud.upper_bound(MAX_UDP_PAYLOAD);
    t.mtu_discovery_config(Some(mtud));
    Ok(Arc::new(t))
}

pub(crate) struct QuicBackend {
    /// The server's endpoints: one per I/O thread, all on the advertised port (one
    /// `SO_REUSEPORT` group), so the kernel spreads incoming connections over their sockets
    /// and receive paths instead of funnelling every datagram through one.
    endpoints: Vec<quinn::Endpoint>,
    /// What a client endpoint is built from (one per outgoing connection).
    client: ClientEndpoints,
    addr: SocketAddr,
    max_reg: Option<u64>,
}

/// Builds the client side's endpoints: each outgoing connection gets its own socket (its own
/// local port, so the server's `SO_REUSEPORT` group may hand it to another endpoint, and its
/// own receive path for pull-mode reads).
#[derive(Clone)]
struct ClientEndpoints {
    creds: crate::control::tls::MemberCredentials,
    bind: SocketAddr,
    peer_timeout: std::time::Duration,
}

impl ClientEndpoints {
    fn endpoint(&self) -> Result<quinn::Endpoint> {
        self.creds.quic_endpoint_on(
            bulk_socket(self.bind, false)?,
            ALPN_TRANSFER,
            bulk_transport(self.peer_timeout)?,
            bulk_endpoint()?,
        )
    }
}

impl QuicBackend {
    pub(crate) fn new(core: &Arc<EngineCore>) -> Result<Self> {
        let creds = core
            .config
            .credentials
            .as_ref()
            .ok_or_else(|| TransportError::Config("quic needs credentials".into()))?;
        let group = core.config.io_threads.clamp(1, MAX_SERVER_ENDPOINTS);
        let mut endpoints = Vec::with_capacity(group);
        let mut bind = core.config.listen;
        for _ in 0..group {
            let endpoint = creds.quic_endpoint_on(
                bulk_socket(bind, true)?,
                ALPN_TRANSFER,
                bulk_transport(core.config.peer_timeout)?,
                bulk_endpoint()?,
            )?;
            // The rest of the group binds the port the first one got.
            bind = endpoint.local_addr()?;
            serve_endpoint(endpoint.clone(), core.clone());
            endpoints.push(endpoint);
        }
        let addr = bind;
        Ok(Self {
            endpoints,
            client: ClientEndpoints {
                creds: creds.clone(),
                bind: SocketAddr::new(addr.ip(), 0),
                peer_timeout: core.config.peer_timeout,
            },
            addr,
            max_reg: core.config.max_registration_bytes,
        })
    }
}

impl Drop for QuicBackend {
    fn drop(&mut self) {
        for e in &self.endpoints {
            e.close(quinn::VarInt::from_u32(0), b"engine stopped");
        }
    }
}

/// Accepts transfer connections on one server endpoint, each stream served by its own task.
fn serve_endpoint(ep: quinn::Endpoint, core: Arc<EngineCore>) {
    tokio::spawn(async move {
        while let Some(incoming) = ep.accept().await {
            let core = core.clone();
            tokio::spawn(async move {
                let remote = incoming.remote_address();
                let conn = match incoming.await {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!(%remote, error = %e, "refused transfer connection (TLS handshake failed)");
                        return;
                    }
                };
                // The peer's name is the node its certificate is bound to; a HELLO
                // announcing another engine name is refused (`proto::serve`).
                let certified = match peer_certificate(&conn).and_then(|c| certified_node(&c)) {
                    Ok(node) => node,
                    Err(e) => {
                        tracing::warn!(%remote, error = %e, "refused transfer connection");
                        let reason = e.to_string();
                        let reason = &reason.as_bytes()[..reason.len().min(256)];
                        conn.close(quinn::VarInt::from_u32(1), reason);
                        return;
                    }
                };
                // Shared by the connection's streams: its name, nonce and proven key (a
                // grant's peer must be the certified node).
                let shared = ConnShared::named(certified);
                while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                    let ctx = ServerCtx {
                        core: core.clone(),
                        backend: BackendKind::Quic,
                        conn: shared.clone(),
                        remote_addr: remote.to_string(),
                        rdma_accept: None,
                    };
                    tokio::spawn(async move {
                        match proto::serve(&ctx, &mut recv, &mut send).await {
                            Ok(()) => {
                                let _ = send.finish();
                            }
                            Err(e) => {
                                tracing::debug!(peer = %ctx.remote_addr, error = %e, "transfer stream ended")
                            }
                        }
                    });
                }
            });
        }
    });
}

impl Backend for QuicBackend {
    fn address(&self) -> String {
        self.addr.to_string()
    }
    fn allocator(&self) -> Arc<dyn HostMemoryAllocator> {
        Arc::new(AnonAllocator)
    }
    fn register(
        &self,
        mem: &Arc<dyn HostMemory>,
    ) -> Result<(
        Vec<RegionChunk>,
        Option<ShmHandle>,
        Option<BackendRegistration>,
    )> {
        Ok((plain_chunks(mem.len() as u64, self.max_reg), None, None))
    }
    fn connect(
        &self,
        core: Arc<EngineCore>,
        addr: String,
        auth: Option<ClientAuth>,
    ) -> BoxFut<Result<Arc<dyn Link>>> {
        let client = self.client.clone();
        Box::pin(async move {
            let sock: SocketAddr = addr
                .parse()
                .map_err(|e| TransportError::Config(format!("bad address {addr}: {e}")))?;
            // At least one connection per I/O thread: each connection's packets are sealed,
            // opened and copied by one task, so fewer connections than threads leave threads
            // idle (the server's endpoints split connections, not packets).
            let count = core
                .config
                .tcp_connections
                .max(core.config.io_threads.min(MAX_SERVER_ENDPOINTS));
            let mut conns = Vec::with_capacity(count);
            let mut node = None;
            for _ in 0..count {
                let conn = client
                    .endpoint()?
                    .connect(sock, MEMBER_SERVER_NAME)
                    .map_err(|e| TransportError::Config(e.to_string()))?
                    .await
                    .map_err(|e| TransportError::quic_closed(&addr, e))?;
                // Which node answered: the one its certificate is bound to.
                let certified = peer_certificate(&conn).and_then(|c| certified_node(&c))?;
                match &node {
                    Some(n) if *n != certified => {
                        return Err(TransportError::Unauthenticated(format!(
                            "{addr} answered as node `{certified}` after `{n}`"
                        )))
                    }
                    _ => node = Some(certified),
                }
                conns.push(QuicConn {
                    conn,
                    streams: Arc::new(Semaphore::new(MAX_STREAMS)),
                });
            }
            let link = Arc::new(QuicLink {
                peer: Arc::from(addr.as_str()),
                node,
                conns,
                next: std::sync::atomic::AtomicUsize::new(0),
                handle: tokio::runtime::Handle::current(),
            });
            let hello = proto::hello_payload(&core);
            for i in 0..link.conns.len() {
                let nonce = link.control_on(i, codec::OP_HELLO, hello.clone()).await?;
                if let Some(auth) = &auth {
                    let proof = proto::ClientProof::new(&core, auth, &nonce)?;
                    let answer = link
                        .control_on(i, codec::OP_AUTH, proof.payload.clone())
                        .await?;
                    proof.finish(&answer)?; // quic asks for no frame protection: TLS has it
                }
            }
            Ok(link as Arc<dyn Link>)
        })
    }
}

/// A checked range of a registered region, kept alive while quinn holds it.
struct RegionSlice {
    entry: Arc<crate::memory::RegionEntry>,
    offset: u64,
    len: usize,
}

impl AsRef<[u8]> for RegionSlice {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the range was checked at submit; `entry` keeps the memory mapped. The batch
        // owns these bytes until it ends; quinn reads them only to send (and resend) them.
        unsafe { std::slice::from_raw_parts(self.entry.ptr_at(self.offset), self.len) }
    }
}

struct QuicConn {
    conn: quinn::Connection,
    streams: Arc<Semaphore>,
}

struct QuicLink {
    peer: Arc<str>,
    /// The node the server's certificate is bound to.
    node: Option<String>,
    conns: Vec<QuicConn>,
    next: std::sync::atomic::AtomicUsize,
    handle: tokio::runtime::Handle,
}

impl QuicLink {
    fn gone(&self, conn: &quinn::Connection, e: impl std::fmt::Display) -> TransportError {
        match conn.close_reason() {
            Some(reason) => TransportError::quic_closed(&self.peer, reason),
            None => TransportError::peer_gone(&*self.peer, e),
        }
    }

    async fn control(&self, op: u8, payload: Vec<u8>) -> Result<Vec<u8>> {
        self.control_on(0, op, payload).await
    }

    async fn control_on(&self, i: usize, op: u8, payload: Vec<u8>) -> Result<Vec<u8>> {
        let conn = &self.conns[i].conn;
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| self.gone(conn, e))?;
        let header = ReqHeader::control(op, 1, payload.len());
        let res = proto::roundtrip_control(&mut recv, &mut send, header, &payload).await;
        let _ = send.finish();
        res.map_err(|e| match e {
            TransportError::Io(_) => self.gone(conn, e),
            other => other,
        })
    }

    async fn piece(
        &self,
        conn: &quinn::Connection,
        op: &PlannedOp,
        done: &PieceCompletion,
    ) -> Result<()> {
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| self.gone(conn, e))?;
        let header = ReqHeader {
            op: if op.kind == OpKind::Write {
                codec::OP_WRITE
            } else {
                codec::OP_READ
            },
            req: 1,
            region: op.remote_region,
            offset: op.remote_offset,
            len: op.len,
            fence: op.fence,
        };
        let io = async {
            if op.kind == OpKind::Write {
                // Header and payload in one write; the payload is handed to quinn as a view of
                // registered memory (no copy of ours: quinn copies it once, into the packet it
                // encrypts).
                let mut parts = [
                    bytes::Bytes::copy_from_slice(&header.encode()),
                    bytes::Bytes::from_owner(RegionSlice {
                        entry: op.local.clone(),
                        offset: op.local_offset,
                        len: op.len as usize,
                    }),
                ];
                send.write_all_chunks(&mut parts)
                    .await
                    .map_err(|e| TransportError::from(std::io::Error::other(e)))?;
            } else {
                AsyncWriteExt::write_all(&mut send, &header.encode()).await?;
            }
            let _ = send.finish();
            let mut hb = [0u8; codec::RESP_HEADER];
            AsyncReadExt::read_exact(&mut recv, &mut hb).await?;
            let resp = RespHeader::decode(&hb);
            match (op.kind, resp.status) {
                (OpKind::Write, codec::ST_OK) if resp.len == 0 => Ok(()),
                (OpKind::Read, codec::ST_DATA) if resp.len == op.len => {
                    // Straight from quinn's receive buffers into registered memory, chunk by
                    // chunk, under the batch's landing fence (see `BatchState::land`): a late
                    // answer is read and dropped.
                    let mut at = 0usize;
                    let len = op.len as usize;
                    let mut res = Ok(());
                    while at < len {
                        let chunk = recv
                            .read_chunk(len - at, true)
                            .await
                            .map_err(|e| TransportError::from(std::io::Error::other(e)))?
                            .ok_or_else(|| {
                                TransportError::from(std::io::Error::from(
                                    std::io::ErrorKind::UnexpectedEof,
                                ))
                            })?;
                        if res.is_ok() {
                            res = done.land_read_at(op, at, &chunk.bytes);
                        }
                        at += chunk.bytes.len();
                    }
                    res
                }
                (_, s) if codec::is_refusal(s) => {
                    Err(proto::answer_error(&mut recv, &header, &resp).await)
                }
                (_, s) => Err(TransportError::Protocol(format!(
                    "unexpected answer status {s}"
                ))),
            }
        };
        io.await.map_err(|e: TransportError| match e {
            TransportError::Io(_) => self.gone(conn, e),
            other => other,
        })
    }
}

impl Link for QuicLink {
    fn peer(&self) -> &str {
        &self.peer
    }
    fn peer_node(&self) -> Option<&str> {
        self.node.as_deref()
    }
    fn fetch_regions(self: Arc<Self>) -> BoxFut<Result<Vec<RegionDescriptor>>> {
        Box::pin(async move {
            codec::decode_regions(&self.control(codec::OP_GET_REGIONS, Vec::new()).await?)
        })
    }
    fn notify(self: Arc<Self>, bytes: Vec<u8>) -> BoxFut<Result<()>> {
        Box::pin(async move { self.control(codec::OP_NOTIFY, bytes).await.map(|_| ()) })
    }
    fn execute(self: Arc<Self>, pieces: Vec<PlannedOp>, batch: Arc<BatchState>) -> Result<()> {
        let link = self.clone();
        self.handle.spawn(async move {
            for op in pieces {
                let done = PieceCompletion::new(batch.clone(), link.peer.clone());
                if done.is_cancelled() {
                    return;
                }
                let i =
                    link.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % link.conns.len();
                let Ok(permit) = link.conns[i].streams.clone().acquire_owned().await else {
                    return;
                };
                let link = link.clone();
                tokio::spawn(async move {
                    let conn = link.conns[i].conn.clone();
                    let res = link.piece(&conn, &op, &done).await;
                    drop(permit);
                    done.complete(res);
                });
            }
        });
        Ok(())
    }
    fn is_alive(&self) -> bool {
        self.conns.iter().all(|c| c.conn.close_reason().is_none())
    }
    fn close(&self) {
        for c in &self.conns {
            c.conn.close(quinn::VarInt::from_u32(0), b"session closed");
        }
    }
}

impl Drop for QuicLink {
    fn drop(&mut self) {
        for c in &self.conns {
            c.conn.close(quinn::VarInt::from_u32(0), b"session dropped");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::pin::Pin;
    use std::sync::Mutex;
    use std::task::{Context, Poll};

    use quinn::udp::{RecvMeta, Transmit};
    use quinn::{AsyncUdpSocket, UdpPoller};

    use super::*;

    /// Records each send (length, segment size); refuses the send numbered `refuse`.
    #[derive(Debug, Default)]
    struct Recording {
        sends: Mutex<Vec<(usize, Option<usize>)>>,
        refuse: Option<usize>,
    }

    #[derive(Debug)]
    struct Writable;

    impl UdpPoller for Writable {
        fn poll_writable(self: Pin<&mut Self>, _: &mut Context) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    impl AsyncUdpSocket for Recording {
        fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
            Box::pin(Writable)
        }
        fn try_send(&self, t: &Transmit) -> io::Result<()> {
            let mut sends = self.sends.lock().unwrap();
            if self.refuse == Some(sends.len()) {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            sends.push((t.contents.len(), t.segment_size));
            Ok(())
        }
        fn poll_recv(
            &self,
            _: &mut Context,
            _: &mut [io::IoSliceMut<'_>],
            _: &mut [RecvMeta],
        ) -> Poll<io::Result<usize>> {
            Poll::Pending
        }
        fn local_addr(&self) -> io::Result<SocketAddr> {
            Ok(SocketAddr::from(([127, 0, 0, 1], 1)))
        }
    }

    fn send(
        refuse: Option<usize>,
        len: usize,
        segment: usize,
    ) -> (io::Result<()>, Vec<(usize, Option<usize>)>) {
        let inner = Arc::new(Recording {
            refuse,
            ..Default::default()
        });
        let socket = BoundedGsoSocket(inner.clone());
        let contents = vec![0u8; len];
        let res = socket.try_send(&Transmit {
            destination: SocketAddr::from(([127, 0, 0, 1], 2)),
            ecn: None,
            contents: &contents,
            segment_size: Some(segment),
            src_ip: None,
        });
        let sends = inner.sends.lock().unwrap().clone();
        (res, sends)
    }

    #[test]
    fn batches_within_a_datagram_go_out_whole() {
        let (res, sends) = send(None, 10 * 1452, 1452);
        assert!(res.is_ok());
        assert_eq!(sends, vec![(10 * 1452, Some(1452))]);
    }

    #[test]
    fn larger_batches_are_cut_at_whole_datagrams() {
        // 10 × 9000 = 90 000 bytes: 7 datagrams (63 000) fit one send.
        let (res, sends) = send(None, 10 * 9000 - 100, 9000);
        assert!(res.is_ok());
        assert_eq!(sends, vec![(63_000, Some(9000)), (26_900, Some(9000))]);
        // At the largest MTU each datagram is its own send, the short last one included.
        let m = MAX_GSO_BYTES;
        let (res, sends) = send(None, 2 * m + 100, m);
        assert!(res.is_ok());
        assert_eq!(sends, vec![(m, None), (m, None), (100, None)]);
    }

    #[test]
    fn a_full_socket_is_retried_before_the_first_send_and_lost_after() {
        let (res, sends) = send(Some(0), 3 * 9000 * 7, 9000);
        assert_eq!(res.unwrap_err().kind(), io::ErrorKind::WouldBlock);
        assert!(sends.is_empty());
        // Once part of the batch is out, the rest is left to loss recovery.
        let (res, sends) = send(Some(1), 3 * 9000 * 7, 9000);
        assert!(res.is_ok());
        assert_eq!(sends, vec![(63_000, Some(9000))]);
    }
}
