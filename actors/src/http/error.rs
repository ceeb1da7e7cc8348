//! Errors as HTTP answers — the one place a [`RequestError`] becomes a status code and an
//! OpenAI-shaped body (a `503` with `Retry-After`), for an instance's API and the proxy alike —
//! and the API-key check.

use crate::error::RequestError;
use crate::openai;
use axum::http::header::RETRY_AFTER;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

/// A request error as an HTTP response (OpenAI's error shape, status from
/// [`RequestError::status`]).
#[derive(Debug)]
pub struct ApiError(pub RequestError);

impl From<RequestError> for ApiError {
    fn from(e: RequestError) -> Self {
        Self(e)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.0.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut r = (status, Json(openai::error_body(&self.0))).into_response();
        if status == StatusCode::SERVICE_UNAVAILABLE {
            r.headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(super::RETRY_AFTER_S));
        }
        r
    }
}

/// Whether `headers` carry `Authorization: Bearer KEY` for `key` (always, when no key is set).
/// The comparison takes the same time wherever the first difference is.
pub fn bearer_matches(key: Option<&str>, headers: &HeaderMap) -> bool {
    let Some(key) = key else { return true };
    let given = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    constant_time_eq(given.as_bytes(), key.as_bytes())
}

/// Equality of two byte strings in time independent of where they differ (their lengths are
/// not secret).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The 401 answer to a missing or wrong API key (OpenAI's error shape).
pub fn unauthorized() -> Response {
    let body = openai::error_json("missing or invalid API key", "authentication_error", 401);
    (StatusCode::UNAUTHORIZED, Json(body)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_match_exactly() {
        let mut h = HeaderMap::new();
        assert!(bearer_matches(None, &h));
        assert!(!bearer_matches(Some("k1"), &h));
        h.insert("authorization", "Bearer k1".parse().unwrap());
        assert!(bearer_matches(Some("k1"), &h));
        assert!(!bearer_matches(Some("k2"), &h));
        assert!(!bearer_matches(Some("k1x"), &h));
        assert!(constant_time_eq(b"", b""));
    }
}
