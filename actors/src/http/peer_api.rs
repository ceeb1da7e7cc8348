//! The instance-to-instance routes on the HTTP API: a thin adapter for instances without
//! cluster credentials (a vLLM-style proxy driving plain instances), plus read-only figures.
//!
//! - `POST /v1/kv/peer`: one request of the peer protocol, as an rkyv frame
//!   ([`PEER_CONTENT_TYPE`]); answered `200` with the rkyv frame of its
//!   [`PeerAnswer`](crate::handoff::protocol::PeerAnswer) — a failure included, in-band, as
//!   on the control plane. Served by the same [`PeerService`](crate::handoff::PeerService).
//! - `GET /v1/kv/info`: this instance's KV memory (the handshake's answer) as JSON, for people
//!   and scripts.
//! - `GET /v1/load`: queue and pool figures, for a proxy polling static instances.

use super::error::ApiError;
use super::state::AppState;
use crate::error::RequestError;
use crate::handoff::protocol::{decode_request, encode_answer, PeerAnswer, PEER_CONTENT_TYPE};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use std::sync::Arc;

fn no_engine() -> ApiError {
    ApiError(RequestError::BadRequest(
        "this instance has no KV transfer engine (role prefill or decode)".into(),
    ))
}

pub(super) async fn peer(State(app): State<Arc<AppState>>, body: Bytes) -> Response {
    let Some(service) = app.peer.clone() else {
        return no_engine().into_response();
    };
    let answer = match decode_request(&body) {
        Ok(request) => service.handle(request, None).await,
        Err(e) => PeerAnswer::Failed(e),
    };
    match encode_answer(&answer) {
        Ok(bytes) => (StatusCode::OK, [("content-type", PEER_CONTENT_TYPE)], bytes).into_response(),
        Err(e) => ApiError(RequestError::Internal(e.to_string())).into_response(),
    }
}

pub(super) async fn kv_info(State(app): State<Arc<AppState>>) -> Response {
    match &app.kv {
        Some(kv) => Json(kv.info()).into_response(),
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
