//! The `quic` backend: quinn streams over one QUIC connection per peer, mutual TLS from the
//! cluster CA. Every piece and control request is its own bidirectional stream (header,
//! payload, answer), so pieces run in parallel without head-of-line blocking; a semaphore
//! bounds the streams in flight. A peer that goes silent is gone after the idle timeout
//! (`peer_timeout`), which fails every stream of the connection. A peer is known by the node
//! name its certificate is bound to (see `control::tls`): its HELLO must announce that name as
//! its engine name, and a certificate without a node binding is refused.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use pdserve_runtime::memory::{AnonAllocator, HostMemory, HostMemoryAllocator};
use pdserve_runtime::wire::{RegionChunk, RegionDescriptor, ShmHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Semaphore;

use super::proto::{self, ReqHeader, RespHeader, ServerCtx};
use crate::control::tls::{
    certified_node, peer_certificate, quic_transport, ALPN_TRANSFER, MEMBER_SERVER_NAME,
};
use crate::engine::{
    Backend, BackendKind, BatchState, BoxFut, EngineCore, Link, OpKind, PieceCompletion, PlannedOp,
};
use crate::error::{Result, TransportError};
use crate::memory::{plain_chunks, BackendRegistration};

/// Streams in flight per connection.
const MAX_STREAMS: usize = 64;

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
        let endpoint = creds.quic_endpoint(
            core.config.listen,
            ALPN_TRANSFER,
            quic_transport(core.config.peer_timeout)?,
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
                    let peer_name = Arc::new(Mutex::new(Some(certified)));
                    while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                        let ctx = ServerCtx {
                            core: core.clone(),
                            backend: BackendKind::Quic,
                            peer_name: peer_name.clone(),
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
    fn connect(&self, core: Arc<EngineCore>, addr: String) -> BoxFut<Result<Arc<dyn Link>>> {
        let endpoint = self.endpoint.clone();
        Box::pin(async move {
            let sock: SocketAddr = addr
                .parse()
                .map_err(|e| TransportError::Config(format!("bad address {addr}: {e}")))?;
            let conn = endpoint
                .connect(sock, MEMBER_SERVER_NAME)
                .map_err(|e| TransportError::Config(e.to_string()))?
                .await
                .map_err(|e| classify_connection_error(&addr, e))?;
            let link = Arc::new(QuicLink {
                peer: Arc::from(addr.as_str()),
                conn,
                streams: Arc::new(Semaphore::new(MAX_STREAMS)),
                handle: tokio::runtime::Handle::current(),
            });
            let hello = proto::hello_payload(&core);
            link.control(proto::OP_HELLO, hello).await?;
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

struct QuicLink {
    peer: Arc<str>,
    conn: quinn::Connection,
    streams: Arc<Semaphore>,
    handle: tokio::runtime::Handle,
}

impl QuicLink {
    fn gone(&self, e: impl std::fmt::Display) -> TransportError {
        match self.conn.close_reason() {
            Some(reason) => classify_connection_error(&self.peer, reason),
            None => TransportError::peer_gone(&*self.peer, e),
        }
    }

    async fn control(&self, op: u8, payload: Vec<u8>) -> Result<Vec<u8>> {
        let (mut send, mut recv) = self.conn.open_bi().await.map_err(|e| self.gone(e))?;
        let header = ReqHeader {
            op,
            req: 1,
            region: 0,
            offset: 0,
            len: payload.len() as u64,
        };
        let res = proto::roundtrip_control(&mut recv, &mut send, header, &payload).await;
        let _ = send.finish();
        res.map_err(|e| match e {
            TransportError::Io(_) => self.gone(e),
            other => other,
        })
    }

    async fn piece(&self, op: &PlannedOp, done: &PieceCompletion) -> Result<()> {
        let (mut send, mut recv) = self.conn.open_bi().await.map_err(|e| self.gone(e))?;
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
        };
        let io = async {
            AsyncWriteExt::write_all(&mut send, &header.encode()).await?;
            if op.kind == OpKind::Write {
                // SAFETY: range checked at submit; `op.local` keeps the region alive.
                let src = unsafe {
                    std::slice::from_raw_parts(op.local.ptr_at(op.local_offset), op.len as usize)
                };
                AsyncWriteExt::write_all(&mut send, src).await?;
            }
            let _ = send.finish();
            let mut hb = [0u8; proto::RESP_HEADER];
            AsyncReadExt::read_exact(&mut recv, &mut hb).await?;
            let resp = RespHeader::decode(&hb);
            match (op.kind, resp.status) {
                (OpKind::Write, proto::ST_OK) if resp.len == 0 => Ok(()),
                (OpKind::Read, proto::ST_DATA) if resp.len == op.len => {
                    // Into a buffer, then into registered memory under the batch's landing
                    // fence (see `BatchState::land`): a late answer is dropped.
                    let len = op.len as usize;
                    let mut buf = vec![0u8; len];
                    AsyncReadExt::read_exact(&mut recv, &mut buf).await?;
                    done.land_read(op, &buf)
                }
                (_, proto::ST_UNKNOWN_REGION | proto::ST_OUT_OF_BOUNDS | proto::ST_ERROR) => {
                    Err(proto::answer_error(&mut recv, &header, &resp).await)
                }
                (_, s) => Err(TransportError::Protocol(format!(
                    "unexpected answer status {s}"
                ))),
            }
        };
        io.await.map_err(|e: TransportError| match e {
            TransportError::Io(_) => self.gone(e),
            other => other,
        })
    }
}

impl Link for QuicLink {
    fn peer(&self) -> &str {
        &self.peer
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
                let Ok(permit) = link.streams.clone().acquire_owned().await else {
                    return;
                };
                let link = link.clone();
                tokio::spawn(async move {
                    let res = link.piece(&op, &done).await;
                    drop(permit);
                    done.complete(res);
                });
            }
        });
        Ok(())
    }
    fn is_alive(&self) -> bool {
        self.conn.close_reason().is_none()
    }
    fn close(&self) {
        self.conn
            .close(quinn::VarInt::from_u32(0), b"session closed");
    }
}

impl Drop for QuicLink {
    fn drop(&mut self) {
        self.conn
            .close(quinn::VarInt::from_u32(0), b"session dropped");
    }
}
