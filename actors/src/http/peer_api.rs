//! The instance-to-instance routes on the HTTP API: a thin adapter for instances without
//! cluster credentials (a vLLM-style proxy driving plain instances), plus read-only figures.
//!
//! - `POST /v1/kv/peer`: one request of the peer protocol, as an rkyv frame — only on
//!   instances without cluster credentials (theirs runs on the control plane), and without
//!   `server.api_key` only from loopback peers
//!   ([`PEER_CONTENT_TYPE`]); answered `200` with the rkyv frame of its
//!   [`PeerAnswer`](crate::handoff::protocol::PeerAnswer) — a failure included, in-band, as
//!   on the control plane. Served by the same [`PeerService`](crate::handoff::PeerService).
//! - `GET /v1/kv/info`: this instance's KV memory (the handshake's answer) and its control
//!   address as JSON, for peers that know only the URL, people and scripts.
//! - `GET /v1/load`: queue and pool figures, for a proxy polling static instances.

use super::error::ApiError;
use super::state::AppState;
use crate::error::RequestError;
use crate::handoff::protocol::{decode_request, encode_answer, PeerAnswer, PEER_CONTENT_TYPE};
use crate::handoff::Caller;
use axum::body::Bytes;
use axum::extract::{ConnectInfo, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use std::net::SocketAddr;
use std::sync::Arc;

fn no_engine() -> ApiError {
    ApiError(RequestError::BadRequest(
        "this instance has no KV transfer engine (role prefill or decode)".into(),
    ))
}

pub(super) async fn peer(
    State(app): State<Arc<AppState>>,
    ConnectInfo(from): ConnectInfo<SocketAddr>,
    body: Bytes,
) -> Response {
    let Some(service) = app.peer.clone() else {
        return no_engine().into_response();
    };
    if app.control_addr().is_some() {
        return forbidden(
            "this instance has cluster credentials: its peer protocol runs on the control plane \
             (mutual TLS), not on POST /v1/kv/peer",
        );
    }
    if app.api_key.is_none() && !from.ip().is_loopback() {
        return forbidden(
            "without server.api_key, POST /v1/kv/peer is taken from loopback peers only: give \
             the cluster a key (server.api_key) or cluster credentials",
        );
    }
    let caller = Caller {
        node: None,
        ip: Some(from.ip()),
    };
    let answer = match decode_request(&body) {
        Ok(request) => service.handle(request, caller).await,
        Err(e) => PeerAnswer::Failed(e),
    };
    match encode_answer(&answer) {
        Ok(bytes) => (StatusCode::OK, [("content-type", PEER_CONTENT_TYPE)], bytes).into_response(),
        Err(e) => ApiError(RequestError::Internal(e.to_string())).into_response(),
    }
}

fn forbidden(why: &str) -> Response {
    ApiError(RequestError::Forbidden(why.into())).into_response()
}

/// `GET /v1/kv/info`: the handshake's answer, plus `control_addr` — where an instance with
/// cluster credentials takes the peer protocol (a peer that knows only this URL finds it here).
pub(super) async fn kv_info(State(app): State<Arc<AppState>>) -> Response {
    match &app.kv {
        Some(kv) => {
            let mut v = serde_json::to_value(kv.info()).unwrap_or_default();
            if let Some(o) = v.as_object_mut() {
                o.insert(
                    "control_addr".into(),
                    app.control_addr().map(|a| a.to_string()).into(),
                );
            }
            Json(v).into_response()
        }
        None => no_engine().into_response(),
    }
}

pub(super) async fn load(State(app): State<Arc<AppState>>) -> Response {
    match app.scheduler.stats().await {
        Ok(s) => {
            // The figures, and whether new requests are taken (a proxy polling a static
            // instance stops routing to it at once when it drains).
            let mut v = serde_json::to_value(s).unwrap_or_default();
            if let Some(o) = v.as_object_mut() {
                o.insert("ready".into(), app.is_ready().into());
            }
            Json(v).into_response()
        }
        Err(e) => ApiError(e).into_response(),
    }
}
