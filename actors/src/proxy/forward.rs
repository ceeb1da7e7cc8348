//! The proxy's HTTP front door: validation, routing, the one hop to the decode instance, and
//! the answer streamed back.
//!
//! Each body is parsed once: validated like an instance would (so bad input never reaches an
//! upstream), given `kv_transfer_params` naming the prefill instance (`do_remote_prefill`,
//! `remote_host`, `remote_port`, and for a registered instance `remote_engine_id` and
//! `remote_control_addr`, so the decode instance reaches it over the control plane) and a
//! `transfer_id`, and sent as is.

use super::routing::{route, Route};
use super::state::ProxyState;
use crate::error::RequestError;
use crate::http::{bearer_matches, unauthorized, ApiError};
use crate::openai;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use pdserve_runtime::telemetry as m;
use pdserve_runtime::Role;
use serde_json::json;
use std::sync::Arc;
use std::time::Instant;

pub(super) async fn health(State(s): State<Arc<ProxyState>>) -> Response {
    let (p, d) = {
        let r = s.registry();
        (r.alive(Role::Prefill).len(), r.alive(Role::Decode).len())
    };
    let status = if p > 0 && d > 0 {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(json!({"status": if status == StatusCode::OK { "ok" } else { "degraded" }, "prefill": p, "decode": d}))).into_response()
}

pub(super) async fn models(State(s): State<Arc<ProxyState>>, headers: HeaderMap) -> Response {
    if !authorized(&s, &headers) {
        return refused();
    }
    let decode = route(&s.registry(), &s.rr, None, Instant::now()).map(|r| match r {
        Route::Disaggregated { decode, .. } | Route::LocalPrefill { decode, .. } => decode,
    });
    let decode = match decode {
        Ok(d) => d,
        Err(e) => return ApiError(e).into_response(),
    };
    match s
        .upstream(s.http.get(format!("{}/v1/models", decode.url)))
        .timeout(s.timeout)
        .send()
        .await
    {
        Ok(r) => relay(r, None).await,
        Err(e) => ApiError(RequestError::Upstream(format!(
            "decode instance {}: {e}",
            decode.url
        )))
        .into_response(),
    }
}

/// Copies an upstream answer (status, content type, body as it arrives) to the client; with
/// `arrived`, records the time to the first body chunk and to the end of the body (the
/// proxy's view of TTFT and end-to-end latency).
async fn relay(resp: reqwest::Response, arrived: Option<Instant>) -> Response {
    let status = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let ctype = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("application/json")
        .to_string();
    let mut first = arrived;
    let done = arrived.map(EndTimer);
    let stream = futures_util::stream::unfold(Some((resp, done)), move |state| {
        let first_chunk = first.take();
        async move {
            let (mut resp, done) = state?;
            match resp.chunk().await {
                Ok(Some(bytes)) => {
                    if let Some(t) = first_chunk {
                        metrics::histogram!(m::PROXY_TIME_TO_FIRST_BYTE_SECONDS)
                            .record(t.elapsed().as_secs_f64());
                    }
                    Some((Ok::<Bytes, std::io::Error>(bytes), Some((resp, done))))
                }
                Ok(None) => None,
                Err(e) => Some((Err(std::io::Error::other(e)), None)),
            }
        }
    });
    (status, [("content-type", ctype)], Body::from_stream(stream)).into_response()
}

/// Records a proxied request's end-to-end latency when its body stream is dropped (finished
/// or abandoned by the client).
struct EndTimer(Instant);

impl Drop for EndTimer {
    fn drop(&mut self) {
        metrics::histogram!(m::PROXY_REQUEST_SECONDS).record(self.0.elapsed().as_secs_f64());
    }
}

fn outcome(kind: &'static str) {
    metrics::counter!(m::PROXY_REQUESTS_TOTAL, m::LABEL_OUTCOME => kind).increment(1);
}

fn authorized(s: &ProxyState, headers: &HeaderMap) -> bool {
    bearer_matches(s.api_key.as_deref(), headers)
}

fn refused() -> Response {
    outcome("unauthorized");
    unauthorized()
}

pub(super) async fn forward(
    State(s): State<Arc<ProxyState>>,
    headers: HeaderMap,
    body: Bytes,
    chat: bool,
) -> Response {
    let arrived = Instant::now();
    if !authorized(&s, &headers) {
        return refused();
    }
    // Parsed once, validated like an instance would, forwarded as is.
    let mut request = match openai::parse_json(&body).and_then(|v| {
        openai::parse_value(&v, chat)?;
        Ok(v)
    }) {
        Ok(v) => v,
        Err(e) => {
            outcome("invalid");
            return ApiError(e).into_response();
        }
    };
    let path = if chat {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    };
    let picked = route(&s.registry(), &s.rr, s.max_prefill_queue, Instant::now());
    let transfer = pdserve_runtime::ids::TransferId::new_random();
    let decode = match picked {
        Err(e) => {
            outcome("unavailable");
            return ApiError(e).into_response();
        }
        Ok(Route::LocalPrefill {
            decode,
            prefill_queue,
        }) => {
            tracing::info!(%transfer, decode = %decode.url, prefill_queue, "prefilling on decode: the prefill queue is over the threshold");
            metrics::counter!(m::LOCAL_PREFILLS_TOTAL, m::LABEL_REASON => "prefill_queue")
                .increment(1);
            if let Some(o) = request.as_object_mut() {
                o.remove("kv_transfer_params");
            }
            outcome("local_prefill");
            decode
        }
        Ok(Route::Disaggregated { prefill, decode }) => {
            let Some((host, port)) = prefill.host_port.clone() else {
                return ApiError(RequestError::Internal(format!(
                    "prefill instance URL `{}` has no host:port",
                    prefill.url
                )))
                .into_response();
            };
            tracing::info!(%transfer, prefill = %prefill.url, decode = %decode.url, "routing");
            outcome("disaggregated");
            // One hop: the decode instance allocates its blocks, asks the prefill instance for
            // the prompt's KV (push or pull, its `transfer.mode`) and streams the answer.
            let params = openai::KvTransferParams {
                do_remote_decode: false,
                do_remote_prefill: true,
                remote_host: Some(host),
                remote_port: Some(port),
                remote_engine_id: prefill.control.as_ref().map(|(_, node)| node.clone()),
                remote_control_addr: prefill.control.as_ref().map(|(a, _)| a.to_string()),
                remote_block_ids: None,
                transfer_id: transfer.to_string(),
                first_token_id: None,
                kv_lease_ms: None,
            };
            match serde_json::to_value(params) {
                Ok(v) => request["kv_transfer_params"] = v,
                Err(e) => return ApiError(RequestError::Internal(e.to_string())).into_response(),
            }
            decode
        }
    };
    let body = match serde_json::to_vec(&request) {
        Ok(b) => b,
        Err(e) => return ApiError(RequestError::Internal(e.to_string())).into_response(),
    };
    match s
        .upstream(s.http.post(format!("{}{path}", decode.url)))
        .header("content-type", "application/json")
        .body(body)
        .timeout(s.timeout)
        .send()
        .await
    {
        Ok(r) => relay(r, Some(arrived)).await,
        Err(e) => {
            outcome("upstream_error");
            tracing::warn!(%transfer, decode = %decode.url, error = %e, "decode instance unreachable");
            ApiError(RequestError::Upstream(format!(
                "decode instance {}: {e}",
                decode.url
            )))
            .into_response()
        }
    }
}
