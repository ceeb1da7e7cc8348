//! The `quic` backend: quinn streams over `tcp_connections` QUIC connections per peer (each
//! connection is driven by one task, so several spread the AES-GCM work over the I/O threads),
//! mutual TLS from the cluster CA. Every piece and control request is its own bidirectional
//! stream (header, payload, answer), so pieces run in parallel without head-of-line blocking;
//! a semaphore per connection bounds the streams in flight. Bulk settings: segmentation offload
//! (GSO) where the kernel has it, 8 MiB socket buffers (capped by `rmem_max`/`wmem_max`),
//! flow-control windows sized for a window of pieces, no stream fairness; write payloads are
//! handed to quinn as views of registered memory and read answers land straight from quinn's
//! buffers (no per-op allocation). Larger UDP payloads (MTU discovery up to 9000 or 64 KiB)
//! were tried on loopback and made things worse (losses, PTO stalls): quinn's default
//! discovery (up to 1452 bytes) is kept. See docs/transport.md for what was measured.
//! Issue 16 profile (`perf record -e cpu-clock -a` over `bench transfer --backend quic`,
//! load 2.2-2.4 from another engineer's decode benchmark): 0.82 / 0.42 / 0.40 GB/s at
//! 1 / 16 / 64 MiB against 4.0 / 2.6 / 2.6 for the plain socket in the same run
//! (0.15-0.20x). Both processes' I/O threads together took 41 % of the two cores' samples,
//! i.e. under one core for 0.4-0.8 GB/s: the transfer is not CPU-bound. Of their samples,
//! ring's AES-GCM (seal, open, GHASH) is ~16 %, the kernel's UDP copies ~19 %, and the rest
//! is spread over quinn's per-packet work (`poll_transmit`, `handle_decode`, the receive
//! reassembly heap, stream frame writing) with no hot spot. The floor is therefore not
//! per-byte work but how quinn paces, acknowledges and flow-controls ~1.4 KB packets;
//! `initial_mtu`/`min_mtu` pinned above 1452 with matching socket buffers, GRO, pacing off,
//! an ACK-frequency change and fewer larger streams were not tried in the time box.
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

use super::proto::{self, ConnShared, ReqHeader, RespHeader, ServerCtx};
use crate::auth::ClientAuth;
use crate::control::tls::{certified_node, peer_certificate, ALPN_TRANSFER, MEMBER_SERVER_NAME};
use crate::engine::{
    Backend, BackendKind, BatchState, BoxFut, EngineCore, Link, OpKind, PieceCompletion, PlannedOp,
};
use crate::error::{Result, TransportError};
use crate::memory::{plain_chunks, BackendRegistration};

/// Streams in flight per connection.
const MAX_STREAMS: usize = 64;
/// Socket send and receive buffers asked for (the kernel caps them at `wmem_max`/`rmem_max`).
const SOCKET_BUFFER: usize = 8 << 20;

/// A UDP socket bound to `addr` with large buffers.
fn bulk_socket(addr: SocketAddr) -> Result<std::net::UdpSocket> {
    use std::os::fd::AsRawFd;
    let socket = std::net::UdpSocket::bind(addr)?;
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
    Ok(socket)
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
    Ok(Arc::new(t))
}

pub(crate) struct QuicBackend {
    endpoint: quinn::Endpoint,
    addr: SocketAddr,
    max_reg: Option<u64>,
}

impl QuicBackend {
    pub(crate) fn new(core: &Arc<EngineCore>) -> Result<Self> {
        let creds = core
            .config
            .credentials
            .as_ref()
            .ok_or_else(|| TransportError::Config("quic needs credentials".into()))?;
        let endpoint = creds.quic_endpoint_on(
            bulk_socket(core.config.listen)?,
            ALPN_TRANSFER,
            bulk_transport(core.config.peer_timeout)?,
            quinn::EndpointConfig::default(),
        )?;
        let addr = endpoint.local_addr()?;
        let ep = endpoint.clone();
        let core2 = core.clone();
        tokio::spawn(async move {
            while let Some(incoming) = ep.accept().await {
                let core = core2.clone();
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
        Ok(Self {
            endpoint,
            addr,
            max_reg: core.config.max_registration_bytes,
        })
    }
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
        let endpoint = self.endpoint.clone();
        Box::pin(async move {
            let sock: SocketAddr = addr
                .parse()
                .map_err(|e| TransportError::Config(format!("bad address {addr}: {e}")))?;
            let mut conns = Vec::with_capacity(core.config.tcp_connections);
            let mut node = None;
            for _ in 0..core.config.tcp_connections {
                let conn = endpoint
                    .connect(sock, MEMBER_SERVER_NAME)
                    .map_err(|e| TransportError::Config(e.to_string()))?
                    .await
                    .map_err(|e| classify_connection_error(&addr, e))?;
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
                let nonce = link.control_on(i, proto::OP_HELLO, hello.clone()).await?;
                if let Some(auth) = &auth {
                    let proof = proto::ClientProof::new(&core, auth, &nonce)?;
                    let answer = link
                        .control_on(i, proto::OP_AUTH, proof.payload.clone())
                        .await?;
                    proof.finish(&answer)?; // quic asks for no frame protection: TLS has it
                }
            }
            Ok(link as Arc<dyn Link>)
        })
    }
}

pub(crate) fn classify_connection_error(peer: &str, e: quinn::ConnectionError) -> TransportError {
    match e {
        quinn::ConnectionError::TransportError(t)
            if t.code.to_string().contains("crypto") || t.to_string().contains("certificate") =>
        {
            TransportError::Unauthenticated(format!("{peer}: {t}"))
        }
        quinn::ConnectionError::ConnectionClosed(c)
            if c.error_code.to_string().contains("crypto") =>
        {
            TransportError::Unauthenticated(format!("{peer}: {c}"))
        }
        quinn::ConnectionError::TimedOut => TransportError::peer_gone(peer, "QUIC idle timeout"),
        other => TransportError::peer_gone(peer, other),
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
            Some(reason) => classify_connection_error(&self.peer, reason),
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
                proto::OP_WRITE
            } else {
                proto::OP_READ
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
            let mut hb = [0u8; proto::RESP_HEADER];
            AsyncReadExt::read_exact(&mut recv, &mut hb).await?;
            let resp = RespHeader::decode(&hb);
            match (op.kind, resp.status) {
                (OpKind::Write, proto::ST_OK) if resp.len == 0 => Ok(()),
                (OpKind::Read, proto::ST_DATA) if resp.len == op.len => {
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
                (_, s) if proto::is_refusal(s) => {
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
            proto::decode_regions(&self.control(proto::OP_GET_REGIONS, Vec::new()).await?)
        })
    }
    fn notify(self: Arc<Self>, bytes: Vec<u8>) -> BoxFut<Result<()>> {
        Box::pin(async move { self.control(proto::OP_NOTIFY, bytes).await.map(|_| ()) })
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
