//! [`HttpServer`]: the connection loop under axum's router, shared by an instance's
//! HttpFrontend and the proxy; plain HTTP or HTTPS ([`super::tls`]).
//!
//! `axum::serve` takes every connection and waits on a client's headers for ever. Here each
//! server holds at most [`ConnLimits::max_connections`] connections: one more is answered
//! `503` with `Retry-After` and closed (over TLS it is closed unanswered, a refusal must not
//! cost a handshake), and counted in `pdserve_requests_shed_total{reason="connections"}`. A
//! client must send a whole request header within [`ConnLimits::header_read_timeout`] —
//! which also closes keep-alive connections idle that long — and finish its TLS handshake
//! within the same bound. Handlers may ask for the peer's address (`POST /drain` from
//! loopback): every request carries axum's `ConnectInfo<SocketAddr>`.

use axum::extract::ConnectInfo;
use axum::Router;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use pdserve_runtime::telemetry as m;
use ractor::ActorProcessingErr;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio_rustls::TlsAcceptor;

/// Bounds on the connections of one HTTP server (`server.max_connections`,
/// `server.header_read_timeout_s`; the proxy's keys of the same names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLimits {
    /// Connections served at once.
    pub max_connections: usize,
    /// Time a client has to send a request's header (and to finish a TLS handshake); also
    /// how long an idle keep-alive connection stays open.
    pub header_read_timeout: Duration,
}

impl Default for ConnLimits {
    fn default() -> Self {
        let d = pdserve_runtime::config::ServerConfig::default();
        Self {
            max_connections: d.max_connections,
            header_read_timeout: Duration::from_secs(d.header_read_timeout_s),
        }
    }
}

/// Refusals written at once (each lasts at most [`REFUSAL_TIME`]); past this, a connection
/// over the cap is dropped without an answer.
const MAX_REFUSALS: usize = 256;
/// Bound on reading a refused request's header, answering it and waiting for the client to
/// close.
const REFUSAL_TIME: Duration = Duration::from_secs(2);
/// Bytes of a refused request read before answering anyway.
const REFUSAL_READ: usize = 16 << 10;

/// An HTTP server on its own task, bound before it is returned (so a bad address reaches
/// whoever starts it) and stopped gracefully by [`HttpServer::stop`].
pub struct HttpServer {
    addr: SocketAddr,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl HttpServer {
    /// Binds `bind` and starts serving `app` within `limits`, over TLS with `tls`; `what`
    /// names it in logs.
    ///
    /// # Errors
    /// When the address cannot be bound.
    pub async fn start(
        bind: SocketAddr,
        app: Router,
        tls: Option<Arc<rustls::ServerConfig>>,
        limits: ConnLimits,
        what: &'static str,
    ) -> Result<Self, ActorProcessingErr> {
        let listener = TcpListener::bind(bind)
            .await
            .map_err(|e| format!("{what}: cannot listen on {bind}: {e}"))?;
        let addr = listener.local_addr()?;
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let scheme = if tls.is_some() { "https" } else { "http" };
        let server = Accept {
            app,
            tls: tls.map(TlsAcceptor::from),
            limits,
            what,
        };
        let task = tokio::spawn(server.run(listener, rx));
        tracing::info!(%addr, scheme, max_connections = limits.max_connections, "{what} listening");
        Ok(Self {
            addr,
            shutdown: Some(tx),
            task,
        })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, lets requests in flight finish for up to 5 s, then aborts.
    pub async fn stop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if tokio::time::timeout(Duration::from_secs(5), &mut self.task)
            .await
            .is_err()
        {
            self.task.abort();
        }
    }
}

/// The accept loop's settings.
struct Accept {
    app: Router,
    tls: Option<TlsAcceptor>,
    limits: ConnLimits,
    what: &'static str,
}

impl Accept {
    /// Accepts until `shutdown`, then asks every connection to finish its request in flight
    /// and close, and waits for them.
    async fn run(self, listener: TcpListener, mut shutdown: tokio::sync::oneshot::Receiver<()>) {
        let slots = Arc::new(Semaphore::new(self.limits.max_connections));
        let refusals = Arc::new(Semaphore::new(MAX_REFUSALS));
        // `stop` flips to true on shutdown; every connection holds a `done` receiver, whose
        // sender's `closed()` fires when the last one is gone.
        let (stop, _) = watch::channel(false);
        let (done, done_rx) = watch::channel(());
        loop {
            let (tcp, peer) = tokio::select! {
                r = listener.accept() => match r {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of descriptors and the like: back off instead of spinning.
                        tracing::warn!(error = %e, "{}: accept failed", self.what);
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
                _ = &mut shutdown => break,
            };
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                metrics::counter!(m::REQUESTS_SHED_TOTAL, m::LABEL_REASON => "connections")
                    .increment(1);
                tracing::debug!(%peer, "{}: connection cap reached, refusing", self.what);
                if self.tls.is_none() {
                    if let Ok(p) = refusals.clone().try_acquire_owned() {
                        tokio::spawn(refuse(tcp, self.limits.max_connections, p));
                    }
                }
                continue;
            };
            let conn = Conn {
                app: self.app.clone(),
                peer,
                limits: self.limits,
                stop: stop.subscribe(),
                _done: done_rx.clone(),
                _slot: slot,
            };
            let tls = self.tls.clone();
            tokio::spawn(async move {
                match tls {
                    None => conn.serve(tcp).await,
                    Some(acceptor) => {
                        let bound = conn.limits.header_read_timeout;
                        match tokio::time::timeout(bound, acceptor.accept(tcp)).await {
                            Ok(Ok(stream)) => conn.serve(stream).await,
                            Ok(Err(e)) => {
                                tracing::debug!(%peer, error = %e, "TLS handshake failed")
                            }
                            Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                        }
                    }
                }
            });
        }
        drop(listener);
        let _ = stop.send(true);
        drop(done_rx);
        done.closed().await;
    }
}

/// One accepted connection and what it holds until it ends.
struct Conn {
    app: Router,
    peer: SocketAddr,
    limits: ConnLimits,
    stop: watch::Receiver<bool>,
    _done: watch::Receiver<()>,
    _slot: OwnedSemaphorePermit,
}

impl Conn {
    async fn serve<I>(mut self, io: I)
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let peer = self.peer;
        let svc =
            tower::ServiceExt::map_request(self.app, move |mut req: hyper::Request<Incoming>| {
                req.extensions_mut().insert(ConnectInfo(peer));
                req
            });
        let mut builder = http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(self.limits.header_read_timeout);
        let conn = builder.serve_connection(TokioIo::new(io), TowerToHyperService::new(svc));
        tokio::pin!(conn);
        let mut stopping = false;
        loop {
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::trace!(%peer, error = %e, "connection ended");
                    }
                    return;
                }
                r = self.stop.wait_for(|s| *s), if !stopping => {
                    stopping = true;
                    if r.is_ok() {
                        conn.as_mut().graceful_shutdown();
                    }
                }
            }
        }
    }
}

/// Answers a connection over the cap with `503` and `Retry-After` once its request header is
/// in (an answer before the request confuses clients), then closes it once the client has,
/// all within [`REFUSAL_TIME`] and reading at most [`REFUSAL_READ`] bytes.
async fn refuse(mut tcp: TcpStream, cap: usize, _permit: OwnedSemaphorePermit) {
    let body = crate::openai::error_json(
        &format!("server overloaded: {cap} connections open"),
        "overloaded",
        503,
    )
    .to_string();
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: {}\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        super::RETRY_AFTER_S,
        body.len()
    );
    let _ = tokio::time::timeout(REFUSAL_TIME, async {
        let mut head = Vec::new();
        let mut buf = [0u8; 4096];
        while head.len() < REFUSAL_READ && !head.windows(4).any(|w| w == b"\r\n\r\n") {
            match tcp.read(&mut buf).await? {
                0 => return Ok(()),
                n => head.extend_from_slice(&buf[..n]),
            }
        }
        tcp.write_all(answer.as_bytes()).await?;
        tcp.shutdown().await?;
        let mut sink = [0u8; 4096];
        while tcp.read(&mut sink).await? > 0 {}
        Ok::<_, std::io::Error>(())
    })
    .await;
}
