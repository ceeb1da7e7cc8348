//! The HttpFrontend actor: the HTTP API of one instance (axum).
//!
//! | route | module |
//! |---|---|
//! | `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models` | [`openai_api`] (OpenAI-compatible, JSON or SSE) |
//! | `POST /v1/kv/peer`, `GET /v1/kv/info`, `GET /v1/load` | [`peer_api`] (instance to instance) |
//! | `POST /v1/encode`, `POST /v1/ec/peer`, `GET /v1/encoder` | [`encode_api`] (encode instances, E/P/D) |
//! | `GET /health` (= `/health/ready`), `GET /health/live`, `POST /drain`, `GET /metrics` | here |
//!
//! With `server.api_key` set, every `/v1/*` route and `POST /drain` need `Authorization:
//! Bearer KEY`; without a key `POST /drain` is taken from loopback peers only. `/health*` and
//! `/metrics` stay open.
//!
//! **Health.** *Live*: the process answers and its Scheduler answers its figures within
//! [`LIVE_TIMEOUT`] (200, else 503 `unresponsive`). *Ready*: live and taking new requests
//! (200 `ok`; 503 `draining` once a drain or a stop began). Errors become responses in one place ([`ApiError`]), shared with
//! the proxy.
//!
//! The actor owns the listening socket (bound in `pre_start`, so a bad address reaches whoever
//! starts the instance) and the server task, which it shuts down gracefully in `post_stop`.
//! Supervised by the `InstanceSupervisor`; a failure escalates (the instance stops serving).

mod encode_api;
mod error;
mod openai_api;
mod peer_api;
mod server;
mod state;
pub mod tls;

pub use error::{bearer_matches, unauthorized, ApiError};
pub use server::{ConnLimits, HttpServer};
pub use state::AppState;
pub use tls::{http_client, HttpTls, TlsError};

use crate::mailbox::Inbox;
use axum::extract::{ConnectInfo, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use serde_json::json;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// The routes of one instance.
pub fn router(state: Arc<AppState>) -> Router {
    // A vision-language model's chat requests may carry images up to `[multimodal]`'s limits:
    // the body limit fits them, so an in-limit image is checked (and an oversized one named
    // in a 400) rather than cut off by axum's 2 MiB default.
    let chat = post(openai_api::chat_completions);
    let chat = match state.vision {
        Some(_) => chat.layer(axum::extract::DefaultBodyLimit::max(
            crate::multimodal::body_limit(&state.multimodal),
        )),
        None => chat,
    };
    let encode = post(encode_api::encode);
    let encode = match state.vision {
        Some(_) => encode.layer(axum::extract::DefaultBodyLimit::max(
            crate::multimodal::body_limit(&state.multimodal),
        )),
        None => encode,
    };
    let guarded = Router::new()
        .route("/v1/completions", post(openai_api::completions))
        .route("/v1/chat/completions", chat)
        .route("/v1/encode", encode)
        .route("/v1/ec/peer", post(encode_api::peer))
        .route("/v1/encoder", get(encode_api::figures))
        .route("/v1/models", get(openai_api::models))
        .route("/v1/kv/peer", post(peer_api::peer))
        .route("/v1/kv/info", get(peer_api::kv_info))
        .route("/v1/load", get(peer_api::load))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            require_key,
        ));
    Router::new()
        .route("/health", get(ready))
        .route("/health/ready", get(ready))
        .route("/health/live", get(live))
        .route("/drain", post(drain))
        .route("/metrics", get(metrics))
        .merge(guarded)
        .with_state(state)
}

async fn require_key(
    State(app): State<Arc<AppState>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if bearer_matches(app.api_key.as_deref(), req.headers()) {
        next.run(req).await
    } else {
        unauthorized()
    }
}

/// `Retry-After` (seconds) of every `503` refusal: over a bound, or shutting down.
pub const RETRY_AFTER_S: u64 = 1;

/// Bound on the Scheduler's answer for `/health/live`.
pub const LIVE_TIMEOUT: Duration = Duration::from_secs(2);

/// `GET /health/live`: the Scheduler answers its figures in time.
async fn live(State(app): State<Arc<AppState>>) -> Response {
    match tokio::time::timeout(LIVE_TIMEOUT, app.scheduler.stats()).await {
        Ok(Ok(_)) => Json(json!({"status": "live", "live": true})).into_response(),
        Ok(Err(e)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "unresponsive", "live": false, "error": e.to_string()})),
        )
            .into_response(),
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "unresponsive", "live": false,
                "error": format!("the scheduler did not answer within {LIVE_TIMEOUT:?}")})),
        )
            .into_response(),
    }
}

/// `GET /health` and `GET /health/ready`: whether new requests are taken.
async fn ready(State(app): State<Arc<AppState>>) -> Response {
    if app.is_ready() {
        Json(json!({"status": "ok", "live": true, "ready": true})).into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "draining", "live": true, "ready": false})),
        )
            .into_response()
    }
}

/// `POST /drain`: leave the routing set, finish what runs, stop (the owner of the instance
/// does the phased stop; `pdserve serve` then exits 0). Answered 202 at once.
async fn drain(
    State(app): State<Arc<AppState>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: axum::http::HeaderMap,
) -> Response {
    let allowed = match app.api_key.as_deref() {
        Some(_) => bearer_matches(app.api_key.as_deref(), &headers),
        None => peer.ip().is_loopback(),
    };
    if !allowed {
        if app.api_key.is_none() {
            return ApiError(crate::error::RequestError::Forbidden(
                "POST /drain without server.api_key is taken from loopback peers only".into(),
            ))
            .into_response();
        }
        return unauthorized();
    }
    let already = !app.is_ready();
    app.start_drain();
    tracing::warn!(%peer, "drain requested over the API");
    (
        StatusCode::ACCEPTED,
        Json(json!({"status": "draining", "already_draining": already})),
    )
        .into_response()
}

async fn metrics(State(app): State<Arc<AppState>>) -> impl IntoResponse {
    (
        [("content-type", "text/plain; version=0.0.4")],
        app.metrics.render(),
    )
}

/// Messages of the HttpFrontend.
pub enum HttpMsg {
    /// The bound address.
    LocalAddr(RpcReplyPort<SocketAddr>),
}

/// The HttpFrontend actor (its mailbox count).
#[derive(Debug)]
pub struct HttpFrontend(pub Inbox);

/// Arguments: where to listen and what to serve.
pub struct HttpArgs {
    /// Address to bind (port 0 picks one).
    pub bind: SocketAddr,
    /// Shared handler state.
    pub app: Arc<AppState>,
    /// Bounds on the server's connections.
    pub limits: ConnLimits,
}

/// The frontend's state: its server.
pub struct HttpState {
    server: HttpServer,
}

impl Actor for HttpFrontend {
    type Msg = HttpMsg;
    type State = HttpState;
    type Arguments = HttpArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: HttpArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let app = args.app.clone();
        let tls = app.tls.server_config();
        let server = HttpServer::start(
            args.bind,
            router(args.app),
            tls,
            args.limits,
            "HTTP frontend",
        )
        .await?;
        let _ = app.addr.set(server.addr());
        Ok(HttpState { server })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        self.0.take();
        match msg {
            HttpMsg::LocalAddr(reply) => {
                if !reply.is_closed() {
                    let _ = reply.send(st.server.addr());
                }
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        st.server.stop().await;
        Ok(())
    }
}
