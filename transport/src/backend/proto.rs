//! The byte-stream protocol of the `tcp`, `quic` and `shm` (control only) backends.
//!
//! Requests are a fixed 40-byte header (`op, req id, region, offset, len`) followed by `len`
//! payload bytes for writes, greetings and notifications; answers are a fixed 32-byte header
//! (`status, req id, aux, len`) followed by `len` payload bytes. Payloads of writes and reads go
//! straight between the socket and registered memory, with no intermediate buffer. The target
//! checks every request against its own registry, whatever the initiator checked.

use std::sync::atomic::{fence, Ordering};
use std::sync::{Arc, Mutex};

use pdserve_runtime::wire::{from_archive, to_archive, RegionDescriptor};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::engine::{BackendKind, EngineCore};
use crate::error::{Result, Side, TransportError};

pub(crate) const REQ_HEADER: usize = 40;
pub(crate) const RESP_HEADER: usize = 32;
/// Largest payload the target drains for a refused write before giving up on the connection.
const MAX_DRAIN: u64 = 1 << 30;
/// Largest descriptor list accepted from a peer.
const MAX_REGIONS_BYTES: u64 = 64 << 20;
/// Largest error text accepted from a peer.
const MAX_ERROR_BYTES: u64 = 64 << 10;

pub(crate) const OP_HELLO: u8 = 1;
pub(crate) const OP_GET_REGIONS: u8 = 2;
pub(crate) const OP_WRITE: u8 = 3;
pub(crate) const OP_READ: u8 = 4;
pub(crate) const OP_NOTIFY: u8 = 5;
/// RDMA: exchange queue-pair endpoints (payload: JSON endpoint; answer: the target's).
pub(crate) const OP_RDMA_CONNECT: u8 = 6;

/// Accepts an RDMA connection: takes the initiator's endpoint, returns the target's endpoint and
/// the state (queue pair) to keep while the control connection lives.
pub(crate) type RdmaAcceptHook =
    Arc<dyn Fn(&[u8]) -> Result<(Vec<u8>, Box<dyn std::any::Any + Send>)> + Send + Sync>;

pub(crate) const ST_OK: u8 = 0;
pub(crate) const ST_REGIONS: u8 = 1;
pub(crate) const ST_DATA: u8 = 2;
pub(crate) const ST_UNKNOWN_REGION: u8 = 3;
pub(crate) const ST_OUT_OF_BOUNDS: u8 = 4;
pub(crate) const ST_ERROR: u8 = 5;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ReqHeader {
    pub(crate) op: u8,
    pub(crate) req: u64,
    pub(crate) region: u64,
    pub(crate) offset: u64,
    pub(crate) len: u64,
}

impl ReqHeader {
    pub(crate) fn encode(&self) -> [u8; REQ_HEADER] {
        let mut b = [0u8; REQ_HEADER];
        b[0] = self.op;
        b[8..16].copy_from_slice(&self.req.to_le_bytes());
        b[16..24].copy_from_slice(&self.region.to_le_bytes());
        b[24..32].copy_from_slice(&self.offset.to_le_bytes());
        b[32..40].copy_from_slice(&self.len.to_le_bytes());
        b
    }
    pub(crate) fn decode(b: &[u8; REQ_HEADER]) -> Self {
        let u = |r: std::ops::Range<usize>| u64::from_le_bytes(b[r].try_into().expect("8 bytes"));
        Self {
            op: b[0],
            req: u(8..16),
            region: u(16..24),
            offset: u(24..32),
            len: u(32..40),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RespHeader {
    pub(crate) status: u8,
    pub(crate) req: u64,
    pub(crate) aux: u64,
    pub(crate) len: u64,
}

impl RespHeader {
    pub(crate) fn encode(&self) -> [u8; RESP_HEADER] {
        let mut b = [0u8; RESP_HEADER];
        b[0] = self.status;
        b[8..16].copy_from_slice(&self.req.to_le_bytes());
        b[16..24].copy_from_slice(&self.aux.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b
    }
    pub(crate) fn decode(b: &[u8; RESP_HEADER]) -> Self {
        let u = |r: std::ops::Range<usize>| u64::from_le_bytes(b[r].try_into().expect("8 bytes"));
        Self {
            status: b[0],
            req: u(8..16),
            aux: u(16..24),
            len: u(24..32),
        }
    }
}

/// The greeting payload: backend, engine name, host identity.
pub(crate) fn hello_payload(core: &EngineCore) -> Vec<u8> {
    format!("{}\n{}\n{}", core.config.backend, core.name, host_id()).into_bytes()
}

/// Identifies the running kernel (same value for every process of one host boot).
pub(crate) fn host_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Per-connection server state.
pub(crate) struct ServerCtx {
    pub(crate) core: Arc<EngineCore>,
    pub(crate) backend: BackendKind,
    /// The peer's name: set by its HELLO, or beforehand by a backend that authenticates it
    /// (`quic`: the node its certificate is bound to), after which a HELLO announcing another
    /// name is refused.
    pub(crate) peer_name: Arc<Mutex<Option<String>>>,
    pub(crate) remote_addr: String,
    pub(crate) rdma_accept: Option<RdmaAcceptHook>,
}

impl ServerCtx {
    fn peer_name(&self) -> String {
        self.peer_name
            .lock()
            .expect("peer name poisoned")
            .clone()
            .unwrap_or_else(|| self.remote_addr.clone())
    }
}

/// Reads exactly `buf.len()` bytes; `Ok(false)` on a clean end of stream before the first byte.
pub(crate) async fn read_exact_or_eof<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut [u8],
) -> std::io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        let n = r.read(&mut buf[got..]).await?;
        if n == 0 {
            if got == 0 {
                return Ok(false);
            }
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        got += n;
    }
    Ok(true)
}

async fn drain<R: AsyncRead + Unpin>(r: &mut R, mut len: u64) -> Result<()> {
    if len > MAX_DRAIN {
        return Err(TransportError::Protocol(format!(
            "refusing to drain {len} bytes"
        )));
    }
    let mut buf = vec![0u8; 64 << 10];
    while len > 0 {
        let n = (buf.len() as u64).min(len) as usize;
        r.read_exact(&mut buf[..n]).await?;
        len -= n as u64;
    }
    Ok(())
}

async fn respond<W: AsyncWrite + Unpin>(
    w: &mut W,
    status: u8,
    req: u64,
    aux: u64,
    payload: &[u8],
) -> Result<()> {
    let h = RespHeader {
        status,
        req,
        aux,
        len: payload.len() as u64,
    };
    if payload.len() <= 16 << 10 {
        let mut buf = Vec::with_capacity(RESP_HEADER + payload.len());
        buf.extend_from_slice(&h.encode());
        buf.extend_from_slice(payload);
        w.write_all(&buf).await?;
    } else {
        w.write_all(&h.encode()).await?;
        w.write_all(payload).await?;
    }
    Ok(())
}

async fn respond_error<W: AsyncWrite + Unpin>(
    w: &mut W,
    req: u64,
    e: &TransportError,
) -> Result<()> {
    match e {
        TransportError::UnknownRegion { .. } => respond(w, ST_UNKNOWN_REGION, req, 0, &[]).await,
        TransportError::OutOfBounds { region_len, .. } => {
            respond(w, ST_OUT_OF_BOUNDS, req, *region_len, &[]).await
        }
        other => {
            respond(
                w,
                ST_ERROR,
                req,
                0,
                format!("{}\n{other}", other.kind()).as_bytes(),
            )
            .await
        }
    }
}

/// Serves requests from one stream until it ends. Each request is checked against this
/// engine's registry; refused writes have their payload drained so the stream stays in sync.
///
/// # Errors
/// I/O errors, and protocol violations (after which the caller drops the connection).
pub(crate) async fn serve<R, W>(ctx: &ServerCtx, r: &mut R, w: &mut W) -> Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let max_notify = ctx.core.config.max_notify_bytes as u64;
    // Per-connection state (RDMA queue pairs) lives as long as this loop.
    let mut _kept: Vec<Box<dyn std::any::Any + Send>> = Vec::new();
    loop {
        let mut hb = [0u8; REQ_HEADER];
        if !read_exact_or_eof(r, &mut hb).await? {
            return Ok(());
        }
        let h = ReqHeader::decode(&hb);
        match h.op {
            OP_HELLO | OP_NOTIFY => {
                if h.len > max_notify {
                    let e = TransportError::Protocol(format!(
                        "message of {} bytes is too large",
                        h.len
                    ));
                    respond_error(w, h.req, &e).await?;
                    return Err(e);
                }
                let mut payload = vec![0u8; h.len as usize];
                r.read_exact(&mut payload).await?;
                if h.op == OP_HELLO {
                    let text = String::from_utf8_lossy(&payload).to_string();
                    let mut parts = text.splitn(3, '\n');
                    let backend = parts.next().unwrap_or_default();
                    let name = parts.next().unwrap_or_default().to_string();
                    let host = parts.next().unwrap_or_default();
                    if backend != ctx.backend.as_str() {
                        let e = TransportError::Config(format!(
                            "peer speaks backend {backend:?}, this engine is {}",
                            ctx.backend
                        ));
                        respond_error(w, h.req, &e).await?;
                        return Err(e);
                    }
                    if ctx.backend == BackendKind::Shm && host != host_id() {
                        let e = TransportError::Unsupported(
                            "shm peers must run on the same host".into(),
                        );
                        respond_error(w, h.req, &e).await?;
                        return Err(e);
                    }
                    let known = {
                        let mut known = ctx.peer_name.lock().expect("peer name poisoned");
                        match known.as_deref() {
                            Some(k) if k != name => Some(k.to_string()),
                            _ => {
                                *known = Some(name.clone());
                                None
                            }
                        }
                    };
                    if let Some(known) = known {
                        let e = TransportError::Unauthenticated(format!(
                            "the peer announced engine `{name}` on a connection of `{known}` \
                             (the node its certificate is bound to)"
                        ));
                        respond_error(w, h.req, &e).await?;
                        return Err(e);
                    }
                } else {
                    ctx.core.deliver(ctx.peer_name(), payload).await;
                }
                respond(w, ST_OK, h.req, 0, &[]).await?;
            }
            OP_GET_REGIONS => {
                let bytes = to_archive(&ctx.core.registry.descriptors())?;
                respond(w, ST_REGIONS, h.req, 0, &bytes).await?;
            }
            OP_WRITE => {
                let checked = ctx
                    .core
                    .registry
                    .get(Side::Local, h.region)
                    .and_then(|e| e.check(Side::Local, h.offset, h.len).map(|()| e));
                match checked {
                    Ok(entry) => {
                        // SAFETY: the range was checked against the region, which `entry`
                        // keeps alive until the read finishes. Concurrent access to these
                        // bytes is excluded by the users' block ownership (HostMemory's
                        // contract).
                        let dst = unsafe {
                            std::slice::from_raw_parts_mut(entry.ptr_at(h.offset), h.len as usize)
                        };
                        r.read_exact(dst).await?;
                        // Release: the bytes are in memory before the acknowledgement leaves.
                        fence(Ordering::Release);
                        respond(w, ST_OK, h.req, 0, &[]).await?;
                    }
                    Err(e) => {
                        drain(r, h.len).await?;
                        respond_error(w, h.req, &e).await?;
                    }
                }
            }
            OP_READ => {
                let checked = ctx
                    .core
                    .registry
                    .get(Side::Local, h.region)
                    .and_then(|e| e.check(Side::Local, h.offset, h.len).map(|()| e));
                match checked {
                    Ok(entry) => {
                        fence(Ordering::Acquire);
                        // SAFETY: as for writes; the bytes are only read.
                        let src = unsafe {
                            std::slice::from_raw_parts(entry.ptr_at(h.offset), h.len as usize)
                        };
                        respond(w, ST_DATA, h.req, 0, src).await?;
                    }
                    Err(e) => respond_error(w, h.req, &e).await?,
                }
            }
            OP_RDMA_CONNECT if h.len <= max_notify => {
                let mut payload = vec![0u8; h.len as usize];
                r.read_exact(&mut payload).await?;
                match ctx.rdma_accept.as_ref().map(|hook| hook(&payload)) {
                    Some(Ok((answer, state))) => {
                        _kept.push(state);
                        respond(w, ST_OK, h.req, 0, &answer).await?;
                    }
                    Some(Err(e)) => respond_error(w, h.req, &e).await?,
                    None => {
                        respond_error(
                            w,
                            h.req,
                            &TransportError::Unsupported("not an rdma engine".into()),
                        )
                        .await?
                    }
                }
            }
            other => {
                let e = TransportError::Protocol(format!("unknown request op {other}"));
                respond_error(w, h.req, &e).await?;
                return Err(e);
            }
        }
        w.flush().await?;
    }
}

/// Turns an error answer into the typed error of the request it answers.
pub(crate) async fn answer_error<R: AsyncRead + Unpin>(
    r: &mut R,
    req: &ReqHeader,
    resp: &RespHeader,
) -> TransportError {
    match resp.status {
        ST_UNKNOWN_REGION => TransportError::UnknownRegion {
            side: Side::Remote,
            id: req.region,
        },
        ST_OUT_OF_BOUNDS => TransportError::OutOfBounds {
            side: Side::Remote,
            id: req.region,
            offset: req.offset,
            len: req.len,
            region_len: resp.aux,
        },
        ST_ERROR if resp.len <= MAX_ERROR_BYTES => {
            let mut buf = vec![0u8; resp.len as usize];
            if let Err(e) = r.read_exact(&mut buf).await {
                return e.into();
            }
            let text = String::from_utf8_lossy(&buf).to_string();
            let (kind, message) = text.split_once('\n').unwrap_or(("remote", &text));
            TransportError::Remote {
                kind: kind.to_string(),
                message: message.to_string(),
            }
        }
        other => TransportError::Protocol(format!(
            "unexpected answer status {other} ({} bytes)",
            resp.len
        )),
    }
}

/// Reads the payload of a control answer (`Ok`, `Regions`), bounded.
pub(crate) async fn read_control_payload<R: AsyncRead + Unpin>(
    r: &mut R,
    req: &ReqHeader,
    resp: &RespHeader,
) -> Result<Vec<u8>> {
    match resp.status {
        ST_OK | ST_REGIONS if resp.len <= MAX_REGIONS_BYTES => {
            let mut buf = vec![0u8; resp.len as usize];
            r.read_exact(&mut buf).await?;
            Ok(buf)
        }
        ST_OK | ST_REGIONS => Err(TransportError::Protocol(format!(
            "answer of {} bytes is too large",
            resp.len
        ))),
        _ => Err(answer_error(r, req, resp).await),
    }
}

/// Decodes a `GetRegions` answer.
pub(crate) fn decode_regions(bytes: &[u8]) -> Result<Vec<RegionDescriptor>> {
    Ok(from_archive::<Vec<RegionDescriptor>>(bytes)?)
}

/// One request/answer on a fresh stream (QUIC, greetings): no pipelining.
pub(crate) async fn roundtrip_control<R, W>(
    r: &mut R,
    w: &mut W,
    req: ReqHeader,
    payload: &[u8],
) -> Result<Vec<u8>>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = Vec::with_capacity(REQ_HEADER + payload.len());
    buf.extend_from_slice(&req.encode());
    buf.extend_from_slice(payload);
    w.write_all(&buf).await?;
    w.flush().await?;
    let mut hb = [0u8; RESP_HEADER];
    r.read_exact(&mut hb).await?;
    let resp = RespHeader::decode(&hb);
    if resp.req != req.req {
        return Err(TransportError::Protocol(format!(
            "answer to request {} arrived for {}",
            resp.req, req.req
        )));
    }
    read_control_payload(r, &req, &resp).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip() {
        let h = ReqHeader {
            op: OP_WRITE,
            req: 7,
            region: 3,
            offset: 1 << 40,
            len: 12345,
        };
        assert_eq!(ReqHeader::decode(&h.encode()), h);
        let r = RespHeader {
            status: ST_OUT_OF_BOUNDS,
            req: 7,
            aux: 99,
            len: 0,
        };
        assert_eq!(RespHeader::decode(&r.encode()), r);
    }
}
