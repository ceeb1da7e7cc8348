//! [`HttpServer`]: an axum server on its own task, shared by an instance's HttpFrontend and
//! the proxy.

use axum::Router;
use ractor::ActorProcessingErr;
use std::net::SocketAddr;
use std::time::Duration;

/// An axum server on its own task, bound before it is returned (so a bad address reaches
/// whoever starts it) and stopped gracefully by [`HttpServer::stop`].
pub struct HttpServer {
    addr: SocketAddr,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl HttpServer {
    /// Binds `bind` and starts serving `app`; `what` names it in logs.
    ///
    /// # Errors
    /// When the address cannot be bound.
    pub async fn start(
        bind: SocketAddr,
        app: Router,
        what: &'static str,
    ) -> Result<Self, ActorProcessingErr> {
        let listener = tokio::net::TcpListener::bind(bind)
            .await
            .map_err(|e| format!("{what}: cannot listen on {bind}: {e}"))?;
        let addr = listener.local_addr()?;
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            // Handlers may ask for the peer's address (`POST /drain` from loopback).
            let app = app.into_make_service_with_connect_info::<SocketAddr>();
            let server = axum::serve(listener, app).with_graceful_shutdown(async move {
                let _ = rx.await;
            });
            if let Err(e) = server.await {
                tracing::error!(error = %e, "{what} failed");
            }
        });
        tracing::info!(%addr, "{what} listening");
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
