//! The control plane: authenticated QUIC connections between cluster members carrying typed
//! [`ControlMessage`]s (rkyv, validated on receipt; see `pdserve_runtime::wire`).
//!
//! - **Authentication**: mutual TLS 1.3 with certificates from the cluster CA ([`tls`]); then
//!   both sides exchange [`Hello`] and check the cluster name, and that the node name the peer
//!   announces is the one its certificate is bound to ([`tls::verify_peer_node`]): a member
//!   cannot pose as another node. A stranger (no certificate, or one from another CA) fails the
//!   handshake; a member announcing another node's name, or presenting a certificate issued
//!   before node binding, is refused at the greeting with an `unauthenticated` error that says
//!   why. Either is logged and counted ([`ControlEndpoint::refused_connections`]) and never
//!   reaches [`ControlEndpoint::accept`].
//! - **Messages**: a request is one bidirectional stream (request frame, response frame), a
//!   one-way message one unidirectional stream. Each stream carries one length-prefixed frame.
//!   A malformed, truncated or oversized frame is answered with [`ControlMessage::Error`]
//!   (`kind` = the [`WireError`] kind) or dropped with a log line; the connection lives on.
//! - **Liveness**: `Ping` is answered by the connection itself with `Pong`; QUIC keep-alives
//!   and the idle timeout detect dead peers; [`ControlClient`] sends heartbeats and reconnects
//!   with exponential backoff.
//!
//! Each connection has one task that accepts streams and one task per stream; received
//! messages go to a bounded queue ([`ControlConnection::recv`]). Nothing here blocks a caller.

pub mod tls;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdserve_runtime::wire::{
    decode_payload, encode_frame, frame_len, ControlMessage, Envelope, EnvelopeKind, ErrorMessage,
    Heartbeat, Hello, LoadFigures, Role, WireError, DEFAULT_MAX_FRAME_BYTES, FRAME_HEADER_BYTES,
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::error::{Result, TransportError};
use tls::{quic_transport, MemberCredentials, ALPN_CONTROL, MEMBER_SERVER_NAME};

/// Settings of a control endpoint.
#[derive(Debug, Clone)]
pub struct ControlConfig {
    /// Where to listen (port 0 picks a free port).
    pub listen: SocketAddr,
    /// This member's role, announced in [`Hello`].
    pub role: Role,
    /// Largest frame accepted or sent.
    pub max_frame_bytes: usize,
    /// Limit for a request's answer (and for the greeting).
    pub request_timeout: Duration,
    /// A silent peer is gone after this long (QUIC idle timeout; keep-alives at a third).
    pub idle_timeout: Duration,
    /// Bounded queue of accepted connections and of received messages per connection.
    pub queue_depth: usize,
}

impl Default for ControlConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            role: Role::Other,
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
            request_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(10),
            queue_depth: 256,
        }
    }
}

/// Writes one frame on a stream.
async fn write_frame(send: &mut quinn::SendStream, env: &Envelope, max: usize) -> Result<()> {
    let frame = encode_frame(env, max)?;
    send.write_all(&frame)
        .await
        .map_err(|e| TransportError::peer_gone("control peer", e))?;
    let _ = send.finish();
    Ok(())
}

/// Reads one frame from a stream; truncation, oversize and malformed payloads are errors.
async fn read_frame(
    recv: &mut quinn::RecvStream,
    max: usize,
    budget: Option<&Arc<tokio::sync::Semaphore>>,
) -> Result<Envelope> {
    let mut header = [0u8; FRAME_HEADER_BYTES];
    read_exact_stream(recv, &mut header).await?;
    let len = frame_len(header, max)?;
    // Grown as bytes arrive, not allocated at the declared length: a peer that declares
    // 16 MiB on each of its streams and sends nothing costs nothing (what arrives is bounded
    // by the connection's receive window). Frames a connection's peer sends at once are
    // assembled within `budget`: a frame takes a permit per chunk of its declared length
    // before its payload is read (all at once, so frames waiting for room hold none and
    // cannot starve each other) and gives them back once decoded. Past the budget, that
    // connection's streams wait, and no other's.
    let _held = match budget {
        Some(b) => {
            let chunks = len.div_ceil(FRAME_READ_CHUNK).max(1);
            let chunks = u32::try_from(chunks.min(ASSEMBLY_BUDGET_BYTES / FRAME_READ_CHUNK))
                .expect("the budget's permits fit in u32");
            Some(b.clone().acquire_many_owned(chunks).await.map_err(|_| {
                TransportError::peer_gone("control peer", "the connection is closing")
            })?)
        }
        None => None,
    };
    let mut payload = Vec::with_capacity(len.min(FRAME_READ_CHUNK));
    while payload.len() < len {
        let want = (len - payload.len()).min(FRAME_READ_CHUNK);
        match recv.read_chunk(want, true).await {
            Ok(Some(chunk)) => payload.extend_from_slice(&chunk.bytes),
            Ok(None) => {
                return Err(TransportError::Wire(WireError::Truncated {
                    needed: len,
                    have: payload.len(),
                }))
            }
            Err(e) => return Err(TransportError::peer_gone("control peer", e)),
        }
    }
    Ok(decode_payload(&payload)?)
}

/// The most bytes of a frame read (and allocated) at a time.
const FRAME_READ_CHUNK: usize = 64 << 10;

/// Bytes of frames one connection's peer may have in assembly at once (across its streams).
pub const ASSEMBLY_BUDGET_BYTES: usize = 64 << 20;

async fn read_exact_stream(recv: &mut quinn::RecvStream, buf: &mut [u8]) -> Result<()> {
    recv.read_exact(buf).await.map_err(|e| match e {
        quinn::ReadExactError::FinishedEarly(have) => TransportError::Wire(WireError::Truncated {
            needed: buf.len(),
            have,
        }),
        quinn::ReadExactError::ReadError(e) => TransportError::peer_gone("control peer", e),
    })
}

fn error_message(e: &TransportError) -> ControlMessage {
    let kind = match e {
        TransportError::Wire(w) => w.kind(),
        other => other.kind(),
    };
    ControlMessage::Error(ErrorMessage {
        kind: kind.to_string(),
        message: e.to_string(),
    })
}

/// A message received on a [`ControlConnection`].
#[derive(Debug)]
pub struct Incoming {
    /// The message.
    pub message: ControlMessage,
    /// Present for requests: answer through it (dropping it resets the peer's stream).
    pub responder: Option<Responder>,
}

/// The way back to a request's sender.
#[derive(Debug)]
pub struct Responder {
    send: quinn::SendStream,
    id: u64,
    max_frame: usize,
}

impl Responder {
    /// Sends the response.
    ///
    /// # Errors
    /// [`TransportError::Wire`] when it does not encode or is too large;
    /// [`TransportError::PeerGone`] when the stream is gone.
    pub async fn respond(mut self, message: ControlMessage) -> Result<()> {
        let env = Envelope {
            id: self.id,
            kind: EnvelopeKind::Response,
            message,
        };
        write_frame(&mut self.send, &env, self.max_frame).await
    }
}

struct ConnShared {
    conn: quinn::Connection,
    peer: Hello,
    next_id: AtomicU64,
    config: ControlConfig,
    last_heartbeat: Mutex<Option<(Instant, Heartbeat)>>,
    /// [`ASSEMBLY_BUDGET_BYTES`] in chunks of [`FRAME_READ_CHUNK`].
    assembly: Arc<tokio::sync::Semaphore>,
}

/// An authenticated connection to one cluster member.
pub struct ControlConnection {
    shared: Arc<ConnShared>,
    incoming: tokio::sync::Mutex<mpsc::Receiver<Incoming>>,
}

impl std::fmt::Debug for ControlConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlConnection")
            .field("peer", &self.shared.peer)
            .field("remote", &self.shared.conn.remote_address())
            .finish()
    }
}

impl ControlConnection {
    fn start(conn: quinn::Connection, peer: Hello, config: ControlConfig) -> Self {
        let (tx, rx) = mpsc::channel(config.queue_depth);
        let shared = Arc::new(ConnShared {
            conn,
            peer,
            next_id: AtomicU64::new(1),
            config,
            last_heartbeat: Mutex::new(None),
            assembly: Arc::new(tokio::sync::Semaphore::new(
                ASSEMBLY_BUDGET_BYTES / FRAME_READ_CHUNK,
            )),
        });
        let s = shared.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    bi = s.conn.accept_bi() => match bi {
                        Ok((send, recv)) => { tokio::spawn(handle_bi(s.clone(), send, recv, tx.clone())); }
                        Err(_) => break,
                    },
                    uni = s.conn.accept_uni() => match uni {
                        Ok(recv) => { tokio::spawn(handle_uni(s.clone(), recv, tx.clone())); }
                        Err(_) => break,
                    },
                }
            }
            tracing::debug!(peer = %s.peer.node, "control connection closed");
        });
        Self {
            shared,
            incoming: tokio::sync::Mutex::new(rx),
        }
    }

    /// The peer's greeting (cluster, node, role, version). Its node name is the one the
    /// peer's certificate is bound to (checked when the connection was made).
    pub fn peer(&self) -> &Hello {
        &self.shared.peer
    }

    /// The peer's socket address.
    pub fn remote_address(&self) -> SocketAddr {
        self.shared.conn.remote_address()
    }

    /// Whether the connection is open.
    pub fn is_alive(&self) -> bool {
        self.shared.conn.close_reason().is_none()
    }

    /// The last heartbeat received and when.
    pub fn last_heartbeat(&self) -> Option<(Instant, Heartbeat)> {
        self.shared
            .last_heartbeat
            .lock()
            .expect("heartbeat poisoned")
            .clone()
    }

    /// The underlying QUIC connection (for diagnostics and tests).
    pub fn quic_connection(&self) -> &quinn::Connection {
        &self.shared.conn
    }

    /// Sends a request and waits for its response (bounded by `request_timeout`).
    ///
    /// # Errors
    /// [`TransportError::Timeout`]; [`TransportError::PeerGone`] when the connection drops;
    /// [`TransportError::Remote`] when the peer answers [`ControlMessage::Error`];
    /// [`TransportError::Wire`] for a bad or oversized frame either way;
    /// [`TransportError::Protocol`] when the answer is not the matching response.
    pub async fn request(&self, message: ControlMessage) -> Result<ControlMessage> {
        self.request_within(message, self.shared.config.request_timeout)
            .await
    }

    /// [`ControlConnection::request`] with its own bound instead of the connection's
    /// `request_timeout` (a request whose answer takes long by nature, such as a remote
    /// prefill).
    ///
    /// # Errors
    /// As [`ControlConnection::request`].
    pub async fn request_within(
        &self,
        message: ControlMessage,
        timeout: Duration,
    ) -> Result<ControlMessage> {
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let max = self.shared.config.max_frame_bytes;
        let conn = self.shared.conn.clone();
        let fut = async move {
            let (mut send, mut recv) = conn
                .open_bi()
                .await
                .map_err(|e| TransportError::peer_gone("control peer", e))?;
            write_frame(
                &mut send,
                &Envelope {
                    id,
                    kind: EnvelopeKind::Request,
                    message,
                },
                max,
            )
            .await?;
            read_frame(&mut recv, max, Some(&self.shared.assembly)).await
        };
        let env =
            tokio::time::timeout(timeout, fut)
                .await
                .map_err(|_| TransportError::Timeout {
                    what: "control request".into(),
                    after: timeout,
                })??;
        // A frame the peer could not decode is answered with an Error carrying id 0.
        let undecodable = env.id == 0 && matches!(env.message, ControlMessage::Error(_));
        if env.kind != EnvelopeKind::Response || (env.id != id && !undecodable) {
            return Err(TransportError::Protocol(format!(
                "expected response {id}, got {:?} {}",
                env.kind, env.id
            )));
        }
        match env.message {
            ControlMessage::Error(e) => Err(TransportError::Remote {
                kind: e.kind,
                message: e.message,
            }),
            other => Ok(other),
        }
    }

    /// Sends a one-way message.
    ///
    /// # Errors
    /// [`TransportError::PeerGone`] when the connection is gone; [`TransportError::Wire`].
    pub async fn send(&self, message: ControlMessage) -> Result<()> {
        let max = self.shared.config.max_frame_bytes;
        let mut send = self
            .shared
            .conn
            .open_uni()
            .await
            .map_err(|e| TransportError::peer_gone(&self.shared.peer.node, e))?;
        write_frame(
            &mut send,
            &Envelope {
                id: 0,
                kind: EnvelopeKind::OneWay,
                message,
            },
            max,
        )
        .await
    }

    /// Measures a round trip with `Ping`/`Pong`.
    ///
    /// # Errors
    /// As [`ControlConnection::request`]; [`TransportError::Protocol`] for a wrong answer.
    pub async fn ping(&self) -> Result<Duration> {
        let nonce = self.shared.next_id.fetch_add(1, Ordering::Relaxed) ^ 0x5eed;
        let start = Instant::now();
        match self.request(ControlMessage::Ping { nonce }).await? {
            ControlMessage::Pong { nonce: n } if n == nonce => Ok(start.elapsed()),
            other => Err(TransportError::Protocol(format!(
                "ping answered with {other:?}"
            ))),
        }
    }

    /// The next message from the peer; `None` once the connection is closed and drained.
    pub async fn recv(&self) -> Option<Incoming> {
        self.incoming.lock().await.recv().await
    }

    /// Closes the connection.
    pub fn close(&self) {
        self.shared
            .conn
            .close(quinn::VarInt::from_u32(0), b"closed");
    }
}

impl Drop for ControlConnection {
    fn drop(&mut self) {
        self.close();
    }
}

async fn handle_bi(
    s: Arc<ConnShared>,
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    tx: mpsc::Sender<Incoming>,
) {
    let max = s.config.max_frame_bytes;
    let env = match read_frame(&mut recv, max, Some(&s.assembly)).await {
        Ok(env) => env,
        Err(e) => {
            tracing::warn!(peer = %s.peer.node, error = %e, "rejected control frame");
            let _ = write_frame(
                &mut send,
                &Envelope {
                    id: 0,
                    kind: EnvelopeKind::Response,
                    message: error_message(&e),
                },
                max,
            )
            .await;
            return;
        }
    };
    if env.kind != EnvelopeKind::Request {
        let e = TransportError::Protocol(format!("{:?} on a request stream", env.kind));
        let _ = write_frame(
            &mut send,
            &Envelope {
                id: env.id,
                kind: EnvelopeKind::Response,
                message: error_message(&e),
            },
            max,
        )
        .await;
        return;
    }
    match env.message {
        ControlMessage::Ping { nonce } => {
            let _ = write_frame(
                &mut send,
                &Envelope {
                    id: env.id,
                    kind: EnvelopeKind::Response,
                    message: ControlMessage::Pong { nonce },
                },
                max,
            )
            .await;
        }
        message => {
            if let ControlMessage::Heartbeat(hb) = &message {
                *s.last_heartbeat.lock().expect("heartbeat poisoned") =
                    Some((Instant::now(), hb.clone()));
            }
            let incoming = Incoming {
                message,
                responder: Some(Responder {
                    send,
                    id: env.id,
                    max_frame: max,
                }),
            };
            if let Err(mpsc::error::TrySendError::Full(i)) = tx.try_send(incoming) {
                if let Some(r) = i.responder {
                    let _ = r
                        .respond(error_message(&TransportError::Busy(
                            "control queue full".into(),
                        )))
                        .await;
                }
            }
        }
    }
}

async fn handle_uni(s: Arc<ConnShared>, mut recv: quinn::RecvStream, tx: mpsc::Sender<Incoming>) {
    match read_frame(&mut recv, s.config.max_frame_bytes, Some(&s.assembly)).await {
        Ok(env) if env.kind == EnvelopeKind::OneWay => {
            if let ControlMessage::Heartbeat(hb) = &env.message {
                *s.last_heartbeat.lock().expect("heartbeat poisoned") =
                    Some((Instant::now(), hb.clone()));
            }
            if tx
                .try_send(Incoming {
                    message: env.message,
                    responder: None,
                })
                .is_err()
            {
                tracing::warn!(peer = %s.peer.node, "control queue full: one-way message dropped");
            }
        }
        Ok(env) => {
            tracing::warn!(peer = %s.peer.node, kind = ?env.kind, "rejected control frame: not one-way on a one-way stream")
        }
        Err(e) => tracing::warn!(peer = %s.peer.node, error = %e, "rejected control frame"),
    }
}

/// A cluster member's control-plane endpoint: accepts members and connects to them.
pub struct ControlEndpoint {
    endpoint: quinn::Endpoint,
    hello: Hello,
    config: ControlConfig,
    accepted: tokio::sync::Mutex<mpsc::Receiver<ControlConnection>>,
    refused: Arc<AtomicU64>,
    cancel: CancellationToken,
}

impl std::fmt::Debug for ControlEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlEndpoint")
            .field("hello", &self.hello)
            .field("addr", &self.endpoint.local_addr().ok())
            .finish()
    }
}

impl ControlEndpoint {
    /// Binds an endpoint with the member's credentials. Must be called inside a tokio runtime.
    ///
    /// # Errors
    /// TLS errors for unusable credentials; I/O errors binding.
    pub fn bind(creds: &MemberCredentials, config: ControlConfig) -> Result<Self> {
        let endpoint = creds.quic_endpoint(
            config.listen,
            ALPN_CONTROL,
            quic_transport(config.idle_timeout)?,
        )?;
        let hello = Hello {
            cluster: creds.cluster().to_string(),
            node: creds.node().to_string(),
            role: config.role,
            version: pdserve_runtime::PDSERVE_VERSION.to_string(),
        };
        let (tx, rx) = mpsc::channel(config.queue_depth);
        let refused = Arc::new(AtomicU64::new(0));
        let cancel = CancellationToken::new();
        let (ep, h, cfg, r, c) = (
            endpoint.clone(),
            hello.clone(),
            config.clone(),
            refused.clone(),
            cancel.clone(),
        );
        tokio::spawn(async move {
            loop {
                let incoming = tokio::select! {
                    i = ep.accept() => match i { Some(i) => i, None => break },
                    () = c.cancelled() => break,
                };
                let (h, cfg, r, tx) = (h.clone(), cfg.clone(), r.clone(), tx.clone());
                tokio::spawn(async move {
                    let remote = incoming.remote_address();
                    match accept_member(incoming, &h, &cfg).await {
                        Ok(conn) => {
                            if let Err(mpsc::error::TrySendError::Full(conn)) = tx.try_send(conn) {
                                tracing::warn!(%remote, "control accept queue full: connection closed");
                                conn.close();
                            }
                        }
                        Err(e) => {
                            r.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(%remote, error = %e, "refused control connection");
                        }
                    }
                });
            }
        });
        Ok(Self {
            endpoint,
            hello,
            config,
            accepted: tokio::sync::Mutex::new(rx),
            refused,
            cancel,
        })
    }

    /// The bound address.
    ///
    /// # Errors
    /// The socket's I/O error.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        Ok(self.endpoint.local_addr()?)
    }

    /// This member's greeting.
    pub fn hello(&self) -> &Hello {
        &self.hello
    }

    /// Connections refused so far (failed TLS handshake or greeting).
    pub fn refused_connections(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// The next authenticated incoming connection; `None` after [`ControlEndpoint::close`].
    pub async fn accept(&self) -> Option<ControlConnection> {
        self.accepted.lock().await.recv().await
    }

    /// Connects to the member at `addr`: mutual TLS, then the [`Hello`] exchange.
    ///
    /// # Errors
    /// [`TransportError::Unauthenticated`] when the server is not of this cluster or refuses
    /// us; [`TransportError::Timeout`]; [`TransportError::PeerGone`].
    pub async fn connect(&self, addr: SocketAddr) -> Result<ControlConnection> {
        let timeout = self.config.request_timeout;
        let fut = async {
            let conn = self
                .endpoint
                .connect(addr, MEMBER_SERVER_NAME)
                .map_err(|e| TransportError::Config(e.to_string()))?
                .await
                .map_err(|e| TransportError::quic_closed(&addr.to_string(), e))?;
            let max = self.config.max_frame_bytes;
            let (mut send, mut recv) = conn
                .open_bi()
                .await
                .map_err(|e| gone_or_refused(&conn, addr, e))?;
            write_frame(
                &mut send,
                &Envelope {
                    id: 0,
                    kind: EnvelopeKind::Request,
                    message: ControlMessage::Hello(self.hello.clone()),
                },
                max,
            )
            .await
            .map_err(|e| refine(&conn, addr, e))?;
            let env = read_frame(&mut recv, max, None)
                .await
                .map_err(|e| refine(&conn, addr, e))?;
            match env.message {
                ControlMessage::Hello(peer) if peer.cluster == self.hello.cluster => {
                    if let Err(e) = tls::verify_peer_node(&conn, &peer.node) {
                        conn.close(quinn::VarInt::from_u32(1), b"node not certified");
                        return Err(match e {
                            TransportError::Unauthenticated(m) => {
                                TransportError::Unauthenticated(format!("{addr}: {m}"))
                            }
                            other => other,
                        });
                    }
                    Ok(ControlConnection::start(conn, peer, self.config.clone()))
                }
                ControlMessage::Hello(peer) => Err(TransportError::Unauthenticated(format!(
                    "peer is in cluster {:?}",
                    peer.cluster
                ))),
                ControlMessage::Error(e) => Err(TransportError::Unauthenticated(format!(
                    "{}: {}",
                    e.kind, e.message
                ))),
                other => Err(TransportError::Protocol(format!(
                    "greeting answered with {other:?}"
                ))),
            }
        };
        tokio::time::timeout(timeout, fut)
            .await
            .map_err(|_| TransportError::Timeout {
                what: format!("control connect to {addr}"),
                after: timeout,
            })?
    }

    /// Stops accepting and closes every connection of this endpoint.
    pub fn close(&self) {
        self.cancel.cancel();
        self.endpoint
            .close(quinn::VarInt::from_u32(0), b"endpoint closed");
    }
}

impl Drop for ControlEndpoint {
    fn drop(&mut self) {
        self.close();
    }
}

fn gone_or_refused(
    conn: &quinn::Connection,
    addr: SocketAddr,
    e: impl std::fmt::Display,
) -> TransportError {
    match conn.close_reason() {
        Some(reason) => TransportError::quic_closed(&addr.to_string(), reason),
        None => TransportError::peer_gone(addr.to_string(), e),
    }
}

fn refine(conn: &quinn::Connection, addr: SocketAddr, e: TransportError) -> TransportError {
    match e {
        TransportError::PeerGone { reason, .. } => gone_or_refused(conn, addr, reason),
        other => other,
    }
}

/// Longest wait for a refused peer to acknowledge the refusal before its connection closes.
const REFUSAL_LINGER: Duration = Duration::from_secs(1);

async fn accept_member(
    incoming: quinn::Incoming,
    hello: &Hello,
    config: &ControlConfig,
) -> Result<ControlConnection> {
    let remote = incoming.remote_address();
    let conn = incoming.await.map_err(|e| {
        TransportError::Unauthenticated(format!("TLS handshake with {remote} failed: {e}"))
    })?;
    let max = config.max_frame_bytes;
    let greet = async {
        let (mut send, mut recv) = conn
            .accept_bi()
            .await
            .map_err(|e| TransportError::peer_gone(remote.to_string(), e))?;
        let env = read_frame(&mut recv, max, None).await?;
        match env.message {
            ControlMessage::Hello(peer) if env.kind == EnvelopeKind::Request => {
                let refusal = if peer.cluster != hello.cluster {
                    Some(TransportError::Unauthenticated(format!(
                        "{} is in cluster {:?}, not {:?}",
                        peer.node, peer.cluster, hello.cluster
                    )))
                } else {
                    tls::verify_peer_node(&conn, &peer.node).err()
                };
                if let Some(e) = refusal {
                    let _ = write_frame(
                        &mut send,
                        &Envelope {
                            id: env.id,
                            kind: EnvelopeKind::Response,
                            message: error_message(&e),
                        },
                        max,
                    )
                    .await;
                    // Let the refusal reach the peer (so it can tell its operator why) before
                    // the connection is closed; bounded, and by the greeting's timeout too.
                    let _ = tokio::time::timeout(REFUSAL_LINGER, send.stopped()).await;
                    return Err(e);
                }
                write_frame(
                    &mut send,
                    &Envelope {
                        id: env.id,
                        kind: EnvelopeKind::Response,
                        message: ControlMessage::Hello(hello.clone()),
                    },
                    max,
                )
                .await?;
                Ok(peer)
            }
            _ => Err(TransportError::Protocol(
                "the first message must be a Hello request".into(),
            )),
        }
    };
    match tokio::time::timeout(config.request_timeout, greet).await {
        Ok(Ok(peer)) => {
            tracing::info!(%remote, node = %peer.node, role = ?peer.role, "control connection accepted");
            Ok(ControlConnection::start(conn, peer, config.clone()))
        }
        Ok(Err(e)) => {
            conn.close(quinn::VarInt::from_u32(1), b"refused");
            Err(e)
        }
        Err(_) => {
            conn.close(quinn::VarInt::from_u32(1), b"no greeting");
            Err(TransportError::Timeout {
                what: "control greeting".into(),
                after: config.request_timeout,
            })
        }
    }
}

/// Exponential backoff for reconnecting.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    /// First delay.
    pub initial: Duration,
    /// Largest delay.
    pub max: Duration,
    /// Attempts before giving up on one call.
    pub max_attempts: u32,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(50),
            max: Duration::from_secs(2),
            max_attempts: 8,
        }
    }
}

/// A connection to one member that reconnects with backoff when it breaks, and can send
/// heartbeats.
pub struct ControlClient {
    endpoint: Arc<ControlEndpoint>,
    addr: SocketAddr,
    backoff: Backoff,
    current: tokio::sync::Mutex<Option<Arc<ControlConnection>>>,
    connects: AtomicU64,
}

impl std::fmt::Debug for ControlClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlClient")
            .field("addr", &self.addr)
            .finish()
    }
}

impl ControlClient {
    /// A client for the member at `addr` (no connection is made until first use).
    pub fn new(endpoint: Arc<ControlEndpoint>, addr: SocketAddr, backoff: Backoff) -> Self {
        Self {
            endpoint,
            addr,
            backoff,
            current: tokio::sync::Mutex::new(None),
            connects: AtomicU64::new(0),
        }
    }

    /// Successful connects so far (1 + reconnects).
    pub fn connects(&self) -> u64 {
        self.connects.load(Ordering::Relaxed)
    }

    /// The live connection, reconnecting with backoff if needed.
    ///
    /// # Errors
    /// The last connect error after `max_attempts` failures; authentication errors at once.
    pub async fn connection(&self) -> Result<Arc<ControlConnection>> {
        let mut current = self.current.lock().await;
        if let Some(c) = current.as_ref().filter(|c| c.is_alive()) {
            return Ok(c.clone());
        }
        let mut delay = self.backoff.initial;
        let mut last = None;
        for attempt in 0..self.backoff.max_attempts.max(1) {
            if attempt > 0 {
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(self.backoff.max);
            }
            match self.endpoint.connect(self.addr).await {
                Ok(c) => {
                    self.connects.fetch_add(1, Ordering::Relaxed);
                    let c = Arc::new(c);
                    *current = Some(c.clone());
                    return Ok(c);
                }
                Err(e @ TransportError::Unauthenticated(_)) => return Err(e),
                Err(e) => {
                    tracing::debug!(addr = %self.addr, attempt, error = %e, "control reconnect failed");
                    last = Some(e);
                }
            }
        }
        Err(last
            .unwrap_or_else(|| TransportError::peer_gone(self.addr.to_string(), "no attempt made")))
    }

    /// A request over the live connection; if it fails because the peer is gone, reconnects
    /// and retries once.
    ///
    /// # Errors
    /// As [`ControlConnection::request`] and [`ControlClient::connection`].
    pub async fn request(&self, message: ControlMessage) -> Result<ControlMessage> {
        let conn = self.connection().await?;
        match conn.request(message.clone()).await {
            Err(TransportError::PeerGone { .. }) => self.connection().await?.request(message).await,
            other => other,
        }
    }

    /// Sends heartbeats every `interval` until `cancel` fires, reconnecting as needed.
    pub fn spawn_heartbeats<F>(
        self: Arc<Self>,
        interval: Duration,
        load: F,
        cancel: CancellationToken,
    ) -> tokio::task::JoinHandle<()>
    where
        F: Fn() -> LoadFigures + Send + Sync + 'static,
    {
        tokio::spawn(async move {
            let mut seq = 0u64;
            let mut tick = tokio::time::interval(interval);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    () = cancel.cancelled() => break,
                }
                seq += 1;
                let hb = Heartbeat {
                    node: self.endpoint.hello.node.clone(),
                    seq,
                    load: load(),
                };
                let sent = match self.connection().await {
                    Ok(c) => c.send(ControlMessage::Heartbeat(hb)).await,
                    Err(e) => Err(e),
                };
                if let Err(e) = sent {
                    tracing::debug!(addr = %self.addr, error = %e, "heartbeat not sent");
                }
            }
        })
    }
}
