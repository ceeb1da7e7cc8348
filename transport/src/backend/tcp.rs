//! The `tcp` backend: tokio sockets, one control connection and several parallel data
//! connections per peer.
//!
//! Each connection has a writer task (takes pieces from a bounded queue, sends header and
//! payload straight from registered memory) and a reader task (takes answers in order, reads
//! read-payloads straight into registered memory, completes pieces). Requests are pipelined.
//! When a connection breaks, every piece queued or in flight on it fails with `PeerGone`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use pdserve_runtime::memory::{AnonAllocator, HostMemory, HostMemoryAllocator};
use pdserve_runtime::wire::{RegionChunk, RegionDescriptor, ShmHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::codec::{self, ReqHeader, RespHeader};
use super::proto::{self, ConnShared, ServerCtx};
use crate::auth::{ClientAuth, RegionGrant};
use crate::batch::{BatchState, PieceCompletion};
use crate::config::BackendKind;
use crate::error::{Result, TransportError};
use crate::integrity::{FrameSealer, TAG};
use crate::memory::{plain_chunks, BackendRegistration};
use crate::op::OpKind;
use crate::plan::PlannedOp;
use crate::seam::{Backend, BoxFut, EngineCore, Link};

/// Most connections one engine's listener serves at once (`tcp`, `shm`, `rdma`): a peer opens
/// `tcp_connections` + 1 (at most 65) per session, so this admits ~60 peers with room to
/// spare. Past it a new connection is closed at once, before it costs a task.
pub(crate) const MAX_SERVED_CONNECTIONS: usize = 4096;
const ACCEPT_BACKOFF_MIN: std::time::Duration = std::time::Duration::from_millis(5);
const ACCEPT_BACKOFF_MAX: std::time::Duration = std::time::Duration::from_secs(1);

/// Binds the listener and serves incoming connections with [`proto::serve`].
pub(crate) fn listen(
    core: &Arc<EngineCore>,
    backend: BackendKind,
    rdma_accept: Option<proto::RdmaAcceptHook>,
) -> Result<SocketAddr> {
    let std_listener = std::net::TcpListener::bind(core.config.listen)?;
    std_listener.set_nonblocking(true)?;
    let addr = std_listener.local_addr()?;
    let listener = TcpListener::from_std(std_listener)?;
    let core = core.clone();
    let open = Arc::new(tokio::sync::Semaphore::new(MAX_SERVED_CONNECTIONS));
    tokio::spawn(async move {
        let mut backoff = ACCEPT_BACKOFF_MIN;
        loop {
            let (stream, remote) = match listener.accept().await {
                Ok(x) => {
                    backoff = ACCEPT_BACKOFF_MIN;
                    x
                }
                Err(e) => {
                    // Out of descriptors (EMFILE) and the like: retrying at once would spin.
                    tracing::warn!(error = %e, retry_in = ?backoff, "transfer listener accept failed");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
                    continue;
                }
            };
            let Ok(permit) = open.clone().try_acquire_owned() else {
                tracing::warn!(peer = %remote, limit = MAX_SERVED_CONNECTIONS, "transfer connection refused: too many open");
                drop(stream);
                continue;
            };
            let _ = stream.set_nodelay(true);
            let ctx = ServerCtx {
                core: core.clone(),
                backend,
                conn: Arc::new(ConnShared::default()),
                remote_addr: remote.to_string(),
                rdma_accept: rdma_accept.clone(),
            };
            tokio::spawn(async move {
                let _permit = permit;
                let (mut r, mut w) = stream.into_split();
                if let Err(e) = proto::serve(&ctx, &mut r, &mut w).await {
                    tracing::debug!(peer = %ctx.remote_addr, error = %e, "transfer connection ended");
                }
            });
        }
    });
    Ok(addr)
}

/// The `tcp` backend.
pub(crate) struct TcpBackend {
    addr: SocketAddr,
    max_reg: Option<u64>,
}

impl TcpBackend {
    pub(crate) fn new(core: &Arc<EngineCore>) -> Result<Self> {
        Ok(Self {
            addr: listen(core, BackendKind::Tcp, None)?,
            max_reg: core.config.max_registration_bytes,
        })
    }
}

impl Backend for TcpBackend {
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
        Box::pin(async move {
            let link =
                TcpLink::connect(&core, &addr, core.config.tcp_connections, auth.as_ref()).await?;
            Ok(Arc::new(link) as Arc<dyn Link>)
        })
    }
}

enum ConnJob {
    Piece(PlannedOp, PieceCompletion),
    Control {
        op: u8,
        payload: Vec<u8>,
        reply: oneshot::Sender<Result<Vec<u8>>>,
    },
}

enum PendingJob {
    Piece(PlannedOp, PieceCompletion),
    Control(oneshot::Sender<Result<Vec<u8>>>),
}

struct Pending {
    header: ReqHeader,
    job: PendingJob,
}

/// One pipelined connection to a peer.
pub(crate) struct TcpConn {
    tx: mpsc::Sender<ConnJob>,
    alive: Arc<AtomicBool>,
    cancel: CancellationToken,
    /// The session scope's grants the target reported (authenticated connections).
    pub(crate) grants: Option<Vec<RegionGrant>>,
    /// This connection's (local, peer) addresses.
    pub(crate) ends: (std::net::SocketAddr, std::net::SocketAddr),
}

impl TcpConn {
    /// Connects, greets (proving the session key with `auth`), and starts the writer and
    /// reader tasks.
    pub(crate) async fn open(
        core: &Arc<EngineCore>,
        addr: &str,
        peer: Arc<str>,
        auth: Option<&ClientAuth>,
    ) -> Result<Self> {
        let mut stream = TcpStream::connect(addr)
            .await
            .map_err(|e| TransportError::peer_gone(addr, e))?;
        stream.set_nodelay(true)?;
        let ends = (stream.local_addr()?, stream.peer_addr()?);
        let (mut r, mut w) = stream.split();
        let (grants, framing) = proto::client_handshake(&mut r, &mut w, core, auth).await?;
        let (mut sealer, mut opener) = match framing {
            Some(f) => (Some(f.sealer), Some(f.opener)),
            None => (None, None),
        };
        let max_answer = core.config.piece_bytes.max(codec::MAX_REGIONS_BYTES);
        let (mut r, mut w) = stream.into_split();
        let depth = core.config.queue_depth;
        let (tx, mut rx) = mpsc::channel::<ConnJob>(depth);
        let (pending_tx, mut pending_rx) = mpsc::channel::<Pending>(depth);
        let alive = Arc::new(AtomicBool::new(true));
        let cancel = CancellationToken::new();

        // Writer: sends requests in queue order.
        let (w_alive, w_cancel) = (alive.clone(), cancel.clone());
        tokio::spawn(async move {
            let mut next_req = 1u64;
            loop {
                let job = tokio::select! {
                    job = rx.recv() => match job { Some(j) => j, None => break },
                    () = w_cancel.cancelled() => break,
                };
                if !w_alive.load(Ordering::Acquire) {
                    break; // dropping `job` fails its piece
                }
                let req = next_req;
                next_req += 1;
                let sent = match job {
                    ConnJob::Piece(op, done) => {
                        if done.is_cancelled() {
                            done.complete(Err(TransportError::Cancelled));
                            continue;
                        }
                        let header = ReqHeader {
                            op: if op.kind == OpKind::Write {
                                codec::OP_WRITE
                            } else {
                                codec::OP_READ
                            },
                            req,
                            region: op.remote_region,
                            offset: op.remote_offset,
                            len: op.len,
                            fence: op.fence,
                        };
                        let payload = (op.kind == OpKind::Write)
                            .then(|| (op.local.clone(), op.local_offset, op.len));
                        if pending_tx
                            .send(Pending {
                                header,
                                job: PendingJob::Piece(op, done),
                            })
                            .await
                            .is_err()
                        {
                            break;
                        }
                        write_request(&mut w, sealer.as_mut(), &header, payload).await
                    }
                    ConnJob::Control { op, payload, reply } => {
                        let header = ReqHeader::control(op, req, payload.len());
                        if pending_tx
                            .send(Pending {
                                header,
                                job: PendingJob::Control(reply),
                            })
                            .await
                            .is_err()
                        {
                            break;
                        }
                        write_control(&mut w, sealer.as_mut(), &header, &payload).await
                    }
                };
                if let Err(e) = sent {
                    tracing::debug!(error = %e, "transfer connection write failed");
                    w_alive.store(false, Ordering::Release);
                    w_cancel.cancel();
                    break;
                }
            }
            let _ = w.shutdown().await;
        });

        // Reader: matches answers to requests in order.
        let (r_alive, r_cancel, r_peer) = (alive.clone(), cancel.clone(), peer.clone());
        tokio::spawn(async move {
            let mut scratch: Vec<u8> = Vec::new();
            let reason = loop {
                let mut hb = [0u8; codec::RESP_HEADER];
                let got = tokio::select! {
                    got = proto::read_exact_or_eof(&mut r, &mut hb) => got,
                    () = r_cancel.cancelled() => break "connection closed".to_string(),
                };
                match got {
                    Ok(true) => {}
                    Ok(false) => break "peer closed the connection".to_string(),
                    Err(e) => break e.to_string(),
                }
                let resp = RespHeader::decode(&hb);
                if let Some(o) = &mut opener {
                    let checked = match proto::read_tag(&mut r).await {
                        Ok(tag) => o.open_header(&hb, &tag),
                        Err(e) => Err(e),
                    };
                    if let Err(e) = checked {
                        break e.to_string();
                    }
                }
                let Some(p) = pending_rx.recv().await else {
                    break "answer without a request".to_string();
                };
                if let (Some(o), true) = (&mut opener, resp.len > 0) {
                    // A protected payload: read and check it whole, then answer from memory.
                    if resp.len > max_answer {
                        break format!("answer of {} bytes is too large", resp.len);
                    }
                    let len = resp.len as usize;
                    if scratch.len() < len {
                        scratch.resize(len, 0);
                    }
                    let read = proto::read_opened_payload(&mut r, &mut scratch[..len], o);
                    if let Err(e) = read.await {
                        let reason = e.to_string();
                        fail_pending(p, &r_peer, &reason);
                        break reason;
                    }
                    let mut body: &[u8] = &scratch[..len];
                    match p.job {
                        PendingJob::Piece(op, done) => {
                            let res = match (op.kind, resp.status) {
                                (OpKind::Read, codec::ST_DATA) if resp.len == op.len => {
                                    done.land_read(&op, body)
                                }
                                (_, status) if codec::is_refusal(status) => {
                                    Err(proto::answer_error(&mut body, &p.header, &resp).await)
                                }
                                (_, status) => {
                                    let e = TransportError::Protocol(format!(
                                        "unexpected answer status {status} len {}",
                                        resp.len
                                    ));
                                    done.complete(Err(e.clone()));
                                    break e.to_string();
                                }
                            };
                            done.complete(res);
                        }
                        PendingJob::Control(reply) => {
                            let res =
                                proto::read_control_payload(&mut body, &p.header, &resp).await;
                            let _ = reply.send(res);
                        }
                    }
                    continue;
                }
                if p.header.req != resp.req {
                    break format!(
                        "answer for request {} while {} was next",
                        resp.req, p.header.req
                    );
                }
                match p.job {
                    PendingJob::Piece(op, done) => {
                        let res = match (op.kind, resp.status) {
                            (OpKind::Write, codec::ST_OK) if resp.len == 0 => Ok(()),
                            (OpKind::Read, codec::ST_DATA) if resp.len == op.len => {
                                // Off the wire into a buffer, then into registered memory
                                // under the batch's landing fence: an answer that arrives
                                // after its batch timed out or was cancelled (a partition,
                                // a slow peer) is read and dropped, never copied into
                                // memory its owner may already have reused.
                                let len = op.len as usize;
                                if scratch.len() < len {
                                    scratch.resize(len, 0);
                                }
                                if let Err(e) = r.read_exact(&mut scratch[..len]).await {
                                    done.complete(Err(TransportError::peer_gone(&*r_peer, &e)));
                                    break e.to_string();
                                }
                                done.land_read(&op, &scratch[..len])
                            }
                            (_, status) if codec::is_refusal(status) => {
                                Err(proto::answer_error(&mut r, &p.header, &resp).await)
                            }
                            (_, status) => {
                                let e = TransportError::Protocol(format!(
                                    "unexpected answer status {status} len {}",
                                    resp.len
                                ));
                                done.complete(Err(e.clone()));
                                break e.to_string();
                            }
                        };
                        done.complete(res);
                    }
                    PendingJob::Control(reply) => {
                        let res = proto::read_control_payload(&mut r, &p.header, &resp).await;
                        let broken = matches!(
                            res,
                            Err(TransportError::Io(_) | TransportError::Protocol(_))
                        );
                        let _ = reply.send(res);
                        if broken {
                            break "bad control answer".to_string();
                        }
                    }
                }
            };
            tracing::debug!(peer = %r_peer, %reason, "transfer connection reader stopped");
            r_alive.store(false, Ordering::Release);
            r_cancel.cancel();
            pending_rx.close();
            while let Ok(p) = pending_rx.try_recv() {
                match p.job {
                    PendingJob::Piece(_, done) => {
                        done.complete(Err(TransportError::peer_gone(&*r_peer, &reason)))
                    }
                    PendingJob::Control(reply) => {
                        let _ = reply.send(Err(TransportError::peer_gone(&*r_peer, &reason)));
                    }
                }
            }
        });
        Ok(Self {
            tx,
            alive,
            cancel,
            grants,
            ends,
        })
    }

    pub(crate) fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    pub(crate) fn close(&self) {
        self.cancel.cancel();
    }

    /// Sends one control request and waits for its answer payload.
    pub(crate) async fn control(&self, peer: &str, op: u8, payload: Vec<u8>) -> Result<Vec<u8>> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(ConnJob::Control { op, payload, reply })
            .await
            .map_err(|_| TransportError::peer_gone(peer, "connection closed"))?;
        rx.await
            .map_err(|_| TransportError::peer_gone(peer, "connection closed"))?
    }

    async fn send_piece(&self, op: PlannedOp, done: PieceCompletion) {
        // A failed send drops the job, which fails the piece.
        let _ = self.tx.send(ConnJob::Piece(op, done)).await;
    }
}

/// Fails the piece or control request of a connection that broke while reading its answer.
fn fail_pending(p: Pending, peer: &Arc<str>, reason: &str) {
    match p.job {
        PendingJob::Piece(_, done) => {
            done.complete(Err(TransportError::peer_gone(&**peer, reason)))
        }
        PendingJob::Control(reply) => {
            let _ = reply.send(Err(TransportError::peer_gone(&**peer, reason)));
        }
    }
}

/// Sends a control request (small payload).
async fn write_control(
    w: &mut tokio::net::tcp::OwnedWriteHalf,
    sealer: Option<&mut FrameSealer>,
    header: &ReqHeader,
    payload: &[u8],
) -> Result<()> {
    let h = header.encode();
    let mut buf = Vec::with_capacity(codec::REQ_HEADER + payload.len() + 2 * TAG);
    buf.extend_from_slice(&h);
    match sealer {
        None => buf.extend_from_slice(payload),
        Some(s) => {
            buf.extend_from_slice(&s.seal_header(&h));
            if !payload.is_empty() {
                let (bytes, tag) = s.seal_payload(payload);
                buf.extend_from_slice(bytes);
                buf.extend_from_slice(&tag);
            }
        }
    }
    w.write_all(&buf).await?;
    Ok(())
}

async fn write_request(
    w: &mut tokio::net::tcp::OwnedWriteHalf,
    sealer: Option<&mut FrameSealer>,
    header: &ReqHeader,
    payload: Option<(Arc<crate::memory::RegionEntry>, u64, u64)>,
) -> Result<()> {
    if let Some(s) = sealer {
        let h = header.encode();
        let mut head = Vec::with_capacity(codec::REQ_HEADER + TAG);
        head.extend_from_slice(&h);
        head.extend_from_slice(&s.seal_header(&h));
        w.write_all(&head).await?;
        if let Some((entry, offset, len)) = payload {
            // SAFETY: range checked at submit; `entry` keeps the region alive.
            let src = unsafe { std::slice::from_raw_parts(entry.ptr_at(offset), len as usize) };
            // `mac`: straight from registered memory; `encrypt`: from the sealer's buffer.
            proto::write_sealed_payload(w, s, src).await?;
        }
        return Ok(());
    }
    match payload {
        None => w.write_all(&header.encode()).await?,
        Some((entry, offset, len)) => {
            // SAFETY: range checked at submit; `entry` keeps the region alive.
            let src = unsafe { std::slice::from_raw_parts(entry.ptr_at(offset), len as usize) };
            if len <= 16 << 10 {
                let mut buf = Vec::with_capacity(codec::REQ_HEADER + src.len());
                buf.extend_from_slice(&header.encode());
                buf.extend_from_slice(src);
                w.write_all(&buf).await?;
            } else {
                w.write_all(&header.encode()).await?;
                w.write_all(src).await?; // straight from registered memory: no copy
            }
        }
    }
    Ok(())
}

pub(crate) struct TcpLink {
    peer: Arc<str>,
    control: TcpConn,
    data: Vec<TcpConn>,
    next: AtomicUsize,
    handle: tokio::runtime::Handle,
}

impl TcpLink {
    async fn connect(
        core: &Arc<EngineCore>,
        addr: &str,
        connections: usize,
        auth: Option<&ClientAuth>,
    ) -> Result<Self> {
        let peer: Arc<str> = Arc::from(addr);
        let control = TcpConn::open(core, addr, peer.clone(), auth).await?;
        let mut data = Vec::with_capacity(connections);
        for _ in 0..connections {
            data.push(TcpConn::open(core, addr, peer.clone(), auth).await?);
        }
        Ok(Self {
            peer,
            control,
            data,
            next: AtomicUsize::new(0),
            handle: tokio::runtime::Handle::current(),
        })
    }
}

impl Link for TcpLink {
    fn peer(&self) -> &str {
        &self.peer
    }

    fn fetch_regions(self: Arc<Self>) -> BoxFut<Result<Vec<RegionDescriptor>>> {
        Box::pin(async move {
            let bytes = self
                .control
                .control(&self.peer, codec::OP_GET_REGIONS, Vec::new())
                .await?;
            codec::decode_regions(&bytes)
        })
    }

    fn notify(self: Arc<Self>, bytes: Vec<u8>) -> BoxFut<Result<()>> {
        Box::pin(async move {
            self.control
                .control(&self.peer, codec::OP_NOTIFY, bytes)
                .await?;
            Ok(())
        })
    }

    fn execute(self: Arc<Self>, pieces: Vec<PlannedOp>, batch: Arc<BatchState>) -> Result<()> {
        let link = self.clone();
        self.handle.spawn(async move {
            for op in pieces {
                let done = PieceCompletion::new(batch.clone(), link.peer.clone());
                let i = link.next.fetch_add(1, Ordering::Relaxed) % link.data.len();
                link.data[i].send_piece(op, done).await;
            }
        });
        Ok(())
    }

    fn is_alive(&self) -> bool {
        self.control.is_alive() && self.data.iter().all(TcpConn::is_alive)
    }

    fn close(&self) {
        self.control.close();
        self.data.iter().for_each(TcpConn::close);
    }
}
