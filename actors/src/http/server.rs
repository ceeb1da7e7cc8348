//! [`HttpServer`]: an axum server on its own task, shared by an instance's HttpFrontend and
//! the proxy; plain HTTP or HTTPS ([`super::tls`]).

use super::tls::TlsListener;
use axum::serve::{Listener, ListenerExt};
use axum::Router;
use ractor::ActorProcessingErr;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// An axum server on its own task, bound before it is returned (so a bad address reaches
/// whoever starts it) and stopped gracefully by [`HttpServer::stop`].
pub struct HttpServer {
    addr: SocketAddr,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

/// Serves `app` on `listener` until `shutdown`, then lets requests in flight finish.
/// Handlers may ask for the peer's address (`POST /drain` from loopback): `tap_io` makes any
/// listener's address axum's `ConnectInfo`.
async fn serve<L>(
    listener: L,
    app: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    what: &'static str,
) where
    L: Listener<Addr = SocketAddr>,
{
    let app = app.into_make_service_with_connect_info::<SocketAddr>();
    if let Err(e) = axum::serve(listener.tap_io(|_| {}), app)
        .with_graceful_shutdown(shutdown)
        .await
    {
        tracing::error!(error = %e, "{what} failed");
    }
}

impl HttpServer {
    /// Binds `bind` and starts serving `app`, over TLS with `tls`; `what` names it in logs.
    ///
    /// # Errors
    /// When the address cannot be bound.
    pub async fn start(
        bind: SocketAddr,
        app: Router,
        tls: Option<Arc<rustls::ServerConfig>>,
        what: &'static str,
    ) -> Result<Self, ActorProcessingErr> {
        let listener = tokio::net::TcpListener::bind(bind)
            .await
            .map_err(|e| format!("{what}: cannot listen on {bind}: {e}"))?;
        let addr = listener.local_addr()?;
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let shutdown = async move {
            let _ = rx.await;
        };
        let scheme = if tls.is_some() { "https" } else { "http" };
        let task = match tls {
            None => tokio::spawn(serve(listener, app, shutdown, what)),
            Some(config) => {
                let listener = TlsListener::new(listener, config)?;
                tokio::spawn(serve(listener, app, shutdown, what))
            }
        };
        tracing::info!(%addr, scheme, "{what} listening");
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
