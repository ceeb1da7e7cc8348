//! The encode instance's routes (E/P/D, `instance.role = "encode"`):
//!
//! - `POST /v1/encode`: a chat request (the client's, as the proxy forwards it). Its images
//!   are checked against `[multimodal]`'s limits, encoded (or found in the encoder cache by
//!   digest) and kept in the encoder cache for the instances that compute the prompt to take.
//!   Answered `200` with each image's digest and rows, in request order (with image
//!   splitting, also its tile grid and its sub-images' digests and rows: tiles row-major,
//!   then the global image); every bad image is a `400` naming it, as on a colocated
//!   instance.
//! - `POST /v1/ec/peer`: one request of the encoder protocol
//!   ([`crate::encode::protocol`]), as an rkyv frame, answered `200` with the rkyv frame of
//!   its answer (a failure included, in-band) — only on instances without cluster
//!   credentials (theirs runs on the control plane), and without `server.api_key` only from
//!   loopback peers: it hands out transfer-session keys.
//! - `GET /v1/encoder`: the encoder's figures (cache, hold slots) as JSON, for `inspect`.

use super::error::ApiError;
use super::state::AppState;
use crate::encode::protocol::{decode_request, encode_answer, EcAnswer, EC_CONTENT_TYPE};
use crate::error::RequestError;
use crate::handoff::Caller;
use crate::multimodal::MultimodalError;
use crate::openai;
use axum::body::Bytes;
use axum::extract::{ConnectInfo, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use std::net::SocketAddr;
use std::sync::Arc;

fn not_encoder() -> ApiError {
    ApiError(RequestError::BadRequest(
        "this is not an encode instance (instance.role = \"encode\" serves POST /v1/encode and the encoder protocol)".into(),
    ))
}

pub(super) async fn encode(State(app): State<Arc<AppState>>, body: Bytes) -> Response {
    run(app, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn run(app: Arc<AppState>, body: Bytes) -> Result<Response, ApiError> {
    if app.encoder.is_none() {
        return Err(not_encoder());
    }
    let mut req = openai::parse_request(&body, true)?;
    drop(body);
    if let Some(m) = &req.model {
        if !app.serves_model(m) {
            return Err(RequestError::UnknownModel(m.clone()).into());
        }
    }
    let urls = std::mem::take(&mut req.images);
    if urls.is_empty() {
        return Err(RequestError::BadRequest(
            "the request has no images (image_url parts) to encode".into(),
        )
        .into());
    }
    let cfg = app.multimodal.clone();
    if urls.len() > cfg.max_images_per_request {
        return Err(RequestError::from(MultimodalError::TooManyImages {
            count: urls.len(),
            max: cfg.max_images_per_request,
        })
        .into());
    }
    let _permit = app.admit()?;
    let started = std::time::Instant::now();
    let encoder = app.vision_encoder.clone().ok_or_else(not_encoder)?;
    let embeds = encoder.encode(urls).await?;
    let hex = |d: &pdserve_gpu::vision::ImageDigest| {
        d.0.iter().map(|b| format!("{b:02x}")).collect::<String>()
    };
    let images: Vec<_> = embeds
        .iter()
        .map(|img| {
            let mut v = json!({
                // An image that is not cut is its own one sub-image; a cut one is named by
                // its global image (last).
                "digest": img.parts.last().map(|e| hex(&e.digest)),
                "rows": img.parts.iter().map(|e| e.rows).sum::<usize>(),
            });
            if img.parts.len() > 1 {
                v["grid"] = json!([img.grid.rows, img.grid.cols]);
                v["sub_images"] = img
                    .parts
                    .iter()
                    .map(|e| json!({"digest": hex(&e.digest), "rows": e.rows}))
                    .collect();
            }
            v
        })
        .collect();
    Ok(Json(json!({
        "object": "encoding",
        "model": app.model_name,
        "images": images,
        "seconds": started.elapsed().as_secs_f64(),
    }))
    .into_response())
}

pub(super) async fn peer(
    State(app): State<Arc<AppState>>,
    ConnectInfo(from): ConnectInfo<SocketAddr>,
    body: Bytes,
) -> Response {
    let Some(service) = app.encoder.clone() else {
        return not_encoder().into_response();
    };
    if app.control_addr().is_some() {
        return ApiError(RequestError::Forbidden(
            "this instance has cluster credentials: its encoder protocol runs on the control plane (mutual TLS), not on POST /v1/ec/peer".into(),
        ))
        .into_response();
    }
    if app.api_key.is_none() && !from.ip().is_loopback() {
        return ApiError(RequestError::Forbidden(
            "without server.api_key, POST /v1/ec/peer is taken from loopback peers only: give the cluster a key (server.api_key)".into(),
        ))
        .into_response();
    }
    let caller = Caller {
        node: None,
        ip: Some(from.ip()),
    };
    let answer = match decode_request(&body) {
        Ok(request) => service.handle(request, caller),
        Err(e) => EcAnswer::Failed(e),
    };
    match encode_answer(&answer) {
        Ok(bytes) => (StatusCode::OK, [("content-type", EC_CONTENT_TYPE)], bytes).into_response(),
        Err(e) => ApiError(RequestError::Internal(e.to_string())).into_response(),
    }
}

pub(super) async fn figures(State(app): State<Arc<AppState>>) -> Response {
    let Some(service) = app.encoder.clone() else {
        return not_encoder().into_response();
    };
    let cache = service.cache().figures();
    let holds = service.figures();
    let info = service.info();
    Json(json!({
        "engine_id": info.engine_id,
        "model": info.model,
        "backend": info.backend,
        "rows_per_image": info.rows,
        "cache": {"images": cache.entries, "bytes": cache.bytes},
        "hold_slots": holds,
    }))
    .into_response()
}
