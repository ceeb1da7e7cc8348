//! The proxy's encode hop (E/P/D): a request with images goes first to an encode instance,
//! which encodes them (or finds them in its encoder cache) and keeps their embeddings; the
//! request then goes on with `ec_transfer_params: {"encoder_url": ...}`, and the instance that
//! computes the prompt takes the embeddings from that encoder over the transfer engine.
//!
//! **Cache-aware choice**: the encoders are tried in rendezvous-hash order of the request's
//! images, so the same images go to the same encoder while it is routable — the one whose
//! cache already holds them. An encoder that cannot be reached or answers 5xx is skipped
//! (up to [`MAX_ENCODE_ATTEMPTS`]); a 4xx (a bad image) is the client's answer, as it
//! would be from any instance.

use super::registry::Upstream;
use super::state::ProxyState;
use crate::error::RequestError;
use crate::http::ApiError;
use axum::response::{IntoResponse, Response};
use pdserve_runtime::Role;
use serde_json::Value;
use std::time::Instant;

/// Encoders one request is sent to at most.
pub(super) const MAX_ENCODE_ATTEMPTS: usize = 2;
/// Requests the proxy sent to encode instances (`outcome="ok"`, `"refused"` for a 4xx,
/// `"failed"` for an encoder skipped).
pub const PROXY_ENCODE_TOTAL: &str = "pdserve_proxy_encode_total";
/// Seconds of the encode hop, as the proxy sees it.
pub const PROXY_ENCODE_SECONDS: &str = "pdserve_proxy_encode_seconds";

/// `encoders` in the order this request's `images` try them (highest rendezvous score first).
pub fn order(mut encoders: Vec<Upstream>, images: &[String]) -> Vec<Upstream> {
    let mut key = xxhash_rust::xxh3::Xxh3::new();
    for i in images {
        key.update(&(i.len() as u64).to_le_bytes());
        key.update(i.as_bytes());
    }
    let key = key.digest();
    let score = |u: &Upstream| {
        let mut h = xxhash_rust::xxh3::Xxh3::with_seed(key);
        h.update(u.url.as_bytes());
        h.digest()
    };
    encoders.sort_by_key(|u| std::cmp::Reverse(score(u)));
    encoders
}

/// Sends `request` to the routable encoders not in `skip`, in [`order`]: the URL of the one
/// that encoded the images, `Ok(None)` when there is no encoder at all, or the answer to send
/// (an encoder's 4xx as is; a 502 when none could encode them). Encoders that failed are
/// added to `skip`.
pub(super) async fn hop(
    s: &ProxyState,
    request: &Value,
    images: &[String],
    skip: &mut Vec<String>,
) -> Result<Option<String>, Response> {
    let encoders: Vec<Upstream> = s
        .registry()
        .routable_at(Role::Encode, Instant::now())
        .into_iter()
        .filter(|u| !skip.contains(&u.url))
        .collect();
    if encoders.is_empty() && skip.is_empty() {
        return Ok(None);
    }
    let body = serde_json::to_vec(request)
        .map_err(|e| ApiError(RequestError::Internal(e.to_string())).into_response())?;
    let mut last = String::from("no encode instance is routable");
    for e in order(encoders, images)
        .into_iter()
        .take(MAX_ENCODE_ATTEMPTS)
    {
        let started = Instant::now();
        let sent = s
            .upstream(s.http.post(format!("{}/v1/encode", e.url)))
            .header("content-type", "application/json")
            .body(body.clone())
            .timeout(s.timeout)
            .send()
            .await;
        let why = match sent {
            Ok(r) if r.status().is_success() => {
                metrics::counter!(PROXY_ENCODE_TOTAL, "outcome" => "ok").increment(1);
                metrics::histogram!(PROXY_ENCODE_SECONDS).record(started.elapsed().as_secs_f64());
                tracing::debug!(encoder = %e.url, images = images.len(), "images encoded");
                return Ok(Some(e.url));
            }
            Ok(r) if r.status().is_client_error() => {
                metrics::counter!(PROXY_ENCODE_TOTAL, "outcome" => "refused").increment(1);
                let status = r.status();
                let body = r.bytes().await.unwrap_or_default();
                return Err((status, [("content-type", "application/json")], body).into_response());
            }
            Ok(r) => {
                let status = r.status();
                let body = r.bytes().await.unwrap_or_default();
                format!(
                    "HTTP {status}: {}",
                    String::from_utf8_lossy(&body)
                        .chars()
                        .take(200)
                        .collect::<String>()
                )
            }
            Err(err) => err.to_string(),
        };
        metrics::counter!(PROXY_ENCODE_TOTAL, "outcome" => "failed").increment(1);
        tracing::warn!(encoder = %e.url, error = %why, "encode instance failed: trying another");
        last = format!("{}: {why}", e.url);
        skip.push(e.url);
    }
    Err(ApiError(RequestError::Upstream(format!(
        "no encode instance could encode the request's images (last: {last})"
    )))
    .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn up(url: &str) -> Upstream {
        Upstream {
            url: url.into(),
            host_port: None,
            role: Role::Encode,
            load: None,
            control: None,
        }
    }

    #[test]
    fn the_same_images_pick_the_same_encoder_and_others_spread() {
        let encoders: Vec<Upstream> = (0..4).map(|i| up(&format!("http://e{i}:1"))).collect();
        let first = |imgs: &[String]| order(encoders.clone(), imgs)[0].url.clone();
        let a = vec!["data:image/png;base64,AAAA".to_string()];
        assert_eq!(first(&a), first(&a));
        // Removing another encoder keeps the pick (rendezvous hashing).
        let kept: Vec<Upstream> = encoders
            .iter()
            .filter(|u| u.url != first(&a) && u.url.ends_with("e0:1"))
            .cloned()
            .collect();
        let mut fewer = encoders.clone();
        fewer.retain(|u| !kept.iter().any(|k| k.url == u.url));
        assert_eq!(order(fewer, &a)[0].url, first(&a));
        // Different images use more than one encoder.
        let picks: std::collections::HashSet<String> = (0..32)
            .map(|i| first(&[format!("data:image/png;base64,{i}")]))
            .collect();
        assert!(picks.len() > 1, "{picks:?}");
    }
}
