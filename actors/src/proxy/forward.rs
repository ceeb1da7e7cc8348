//! The proxy's HTTP front door: validation, routing, the one hop to the decode instance, and
//! the answer streamed back.
//!
//! Each body is parsed once: validated like an instance would (so bad input never reaches an
//! upstream), given `kv_transfer_params` naming the prefill instance (`do_remote_prefill`,
//! `remote_host`, `remote_port`, and for a registered instance `remote_engine_id` and
//! `remote_control_addr`, so the decode instance reaches it over the control plane) and a
//! `transfer_id`, and sent as is.
//!
//! **Keeping a request alive when instances come and go** ([`Job`]):
//! - *Reroute before it starts*: a decode instance that cannot be reached, or that answers
//!   503 (draining, stopping, overloaded) before anything was sent, is skipped and the next
//!   least-loaded one is tried (each at most once).
//! - *Prefill failure before the hand-off* (the decode instance answers `kv_transfer_failed`
//!   before any token): `proxy.prefill_retry` — `retry` another prefill instance (or, with
//!   none left, prefill on the decode instance), `local`, or `fail`; once per request.
//! - *Migration mid-generation*: a stream that breaks (connection lost, instance killed) or
//!   ends with a `shutting_down` / `worker_failed` error is re-issued to another decode
//!   instance with `resume_tokens` = the tokens the client already has (the proxy asks for
//!   `return_token_ids` upstream and strips them unless the client asked too); the instance
//!   prefills prompt + those tokens and continues, sending only new text, so greedy and
//!   seeded sampling continue exactly. Chunks keep the first attempt's `id` and `created`;
//!   a repeated `role` delta is dropped. Up to `proxy.migration_limit` times per request.
//!   A non-streaming request that fails the same way is re-issued whole (the client has
//!   seen nothing), within the same limit.

use super::registry::Upstream;
use super::routing::{route, route_with, Route};
use super::state::ProxyState;
use super::state::{Charge, PromptInfo};
use crate::error::RequestError;
use crate::http::{bearer_matches, unauthorized, ApiError};
use crate::json_field::{present, Lenient, Object};
use crate::openai;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use pdserve_runtime::config::PrefillRetry;
use pdserve_runtime::ids::TransferId;
use pdserve_runtime::telemetry as m;
use pdserve_runtime::Role;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

pub(super) async fn health(State(s): State<Arc<ProxyState>>) -> Response {
    let (p, d, e) = {
        let r = s.registry();
        (
            r.alive(Role::Prefill).len(),
            r.alive(Role::Decode).len(),
            r.alive(Role::Encode).len(),
        )
    };
    let status = if p > 0 && d > 0 {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    // Draining (stopping): not ready, whatever it routes to, so load balancers move on.
    let draining = s.draining.load(std::sync::atomic::Ordering::SeqCst);
    let status = if draining {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        status
    };
    let ready = status == StatusCode::OK;
    let word = match (ready, draining) {
        (true, _) => "ok",
        (false, true) => "draining",
        (false, false) => "degraded",
    };
    (status, Json(json!({"status": word, "live": true, "ready": ready, "draining": draining, "prefill": p, "decode": d, "encode": e}))).into_response()
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

/// The upstream answer's content type, `default` when it names none.
fn content_type(resp: &reqwest::Response, default: &str) -> String {
    resp.headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or(default)
        .to_string()
}

/// Copies an upstream answer (status, content type, body as it arrives) to the client; with
/// `arrived`, records the time to the first body chunk and to the end of the body (the
/// proxy's view of TTFT and end-to-end latency).
async fn relay(resp: reqwest::Response, arrived: Option<Instant>) -> Response {
    let status = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let ctype = content_type(&resp, "application/json");
    // An instance's refusal keeps its advice on when to come back.
    let retry_after = resp
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| axum::http::HeaderValue::from_str(v).ok());
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
    let mut r = (status, [("content-type", ctype)], Body::from_stream(stream)).into_response();
    if let Some(v) = retry_after {
        r.headers_mut().insert(axum::http::header::RETRY_AFTER, v);
    }
    r
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
    let Ok(slot) = s.admission.clone().try_acquire_owned() else {
        outcome("overloaded");
        metrics::counter!(m::REQUESTS_SHED_TOTAL, m::LABEL_REASON => "requests").increment(1);
        return ApiError(RequestError::Overloaded(format!(
            "{} requests in flight at the proxy (proxy.max_concurrent_requests)",
            s.max_concurrent_requests
        )))
        .into_response();
    };
    held_until_sent(admitted(s, body, chat, arrived).await, slot)
}

/// A response whose body keeps `slot` until it is sent or dropped: a streamed answer
/// counts against `proxy.max_concurrent_requests` for as long as it streams.
fn held_until_sent(resp: Response, slot: tokio::sync::OwnedSemaphorePermit) -> Response {
    let (parts, body) = resp.into_parts();
    let stream = body.into_data_stream().map(move |chunk| {
        let _held = &slot;
        chunk
    });
    Response::from_parts(parts, Body::from_stream(stream))
}

/// A request within the proxy's admission bound, from parsing to its answer.
async fn admitted(s: Arc<ProxyState>, body: Bytes, chat: bool, arrived: Instant) -> Response {
    // Parsed once, validated like an instance would, forwarded as is.
    let (mut request, parsed) = match openai::parse_json(&body).and_then(|v| {
        let parsed = openai::parse_value(&v, chat)?;
        Ok((v, parsed))
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
    // The proxy owns these fields: client-supplied ones have no effect.
    if let Some(o) = request.as_object_mut() {
        o.remove("kv_transfer_params");
        o.remove("ec_transfer_params");
        o.remove("resume_tokens");
    }
    let stream = parsed.stream;
    let client_token_ids = parsed.return_token_ids;
    let choices = parsed.n;
    let prompts = 1 + parsed.more_prompts.len();
    let images = parsed.images.clone();
    let prompt = prompt_info(&s, parsed).await;
    // E/P/D: images go to an encode instance first; the instance computing the prompt takes
    // their embeddings from it.
    let mut tried_encode = Vec::new();
    let encoder = if images.is_empty() {
        None
    } else {
        match super::encode::hop(&s, &request, &images, &mut tried_encode).await {
            Ok(e) => e,
            Err(r) => {
                outcome("encode_failed");
                return r;
            }
        }
    };
    if let Some(e) = &encoder {
        if let Err(e) = set_field(
            &mut request,
            "ec_transfer_params",
            json!({"encoder_url": e}),
        ) {
            return ApiError(e).into_response();
        }
    }
    let picked = route_with(
        &s.registry(),
        s.max_prefill_queue,
        Instant::now(),
        |role, c| s.choose(role, c, &prompt),
    );
    let (decode, prefill) = match picked {
        Err(e) => {
            outcome("unavailable");
            return ApiError(e).into_response();
        }
        Ok(Route::LocalPrefill {
            decode,
            prefill_queue,
        }) => {
            tracing::info!(decode = %decode.url, prefill_queue, "prefilling on decode: the prefill queue is over the threshold");
            metrics::counter!(m::LOCAL_PREFILLS_TOTAL, m::LABEL_REASON => "prefill_queue")
                .increment(1);
            outcome("local_prefill");
            (decode, None)
        }
        Ok(Route::Disaggregated { decode, .. }) if !images.is_empty() && encoder.is_none() => {
            // A prefill instance takes images by reference from an encoder only: without
            // one, the decode instance encodes and prefills them itself.
            tracing::info!(decode = %decode.url, "prefilling on decode: images and no encode instance");
            metrics::counter!(m::LOCAL_PREFILLS_TOTAL, m::LABEL_REASON => "images").increment(1);
            outcome("local_prefill");
            (decode, None)
        }
        Ok(Route::Disaggregated { decode, .. }) if prompts > 1 => {
            // A hand-off carries one prompt's KV: a list of prompts is prefilled on decode.
            tracing::info!(decode = %decode.url, prompts, "prefilling on decode: a list of prompts");
            metrics::counter!(m::LOCAL_PREFILLS_TOTAL, m::LABEL_REASON => "batched_prompts")
                .increment(1);
            outcome("local_prefill");
            (decode, None)
        }
        Ok(Route::Disaggregated { prefill, decode }) => {
            outcome("disaggregated");
            (decode, Some(prefill))
        }
    };
    let mut charges = vec![s.charge(&decode.url, Role::Decode, &prompt)];
    if let Some(p) = &prefill {
        charges.push(s.charge(&p.url, Role::Prefill, &prompt));
    }
    let mut job = Job {
        s,
        prompt,
        charges,
        path,
        request,
        stream,
        client_token_ids,
        choices: choices * prompts,
        tried_decode: Vec::new(),
        tried_prefill: Vec::new(),
        migrations: 0,
        prefill_retried: false,
        images,
        encoder,
        tried_encode,
        encode_retried: false,
    };
    let started = job.start(decode, prefill, &[]).await;
    let (resp, decode, prefill) = match started {
        Ok(ok) => ok,
        Err(r) => return r,
    };
    if stream {
        stream_response(job, resp, decode, prefill, arrived)
    } else {
        job.whole(resp, decode, arrived).await
    }
}

/// The most output tokens the router counts for one request (2^24, past any model's context).
const MAX_ESTIMATED_TOKENS: usize = 1 << 24;

/// What the router needs of a request: its token ids (when the proxy can compute them:
/// token-id prompts, or text and chat with `proxy.model`'s tokenizer, off the async threads)
/// and `max_tokens`.
async fn prompt_info(s: &ProxyState, parsed: openai::ParsedRequest) -> PromptInfo {
    // An estimate for the router only (the instance refuses what exceeds its context); capped
    // so that an absurd value cannot overflow the load figures it is added to.
    let max_tokens = parsed
        .max_tokens
        .unwrap_or(openai::DEFAULT_COMPLETION_MAX_TOKENS)
        .min(MAX_ESTIMATED_TOKENS);
    let tokens = match (&parsed.prompt, &s.tokenizer) {
        (openai::PromptInput::Tokens(t), _) => Some(t.clone()),
        (_, None) => None,
        (_, Some(tok)) => {
            let tok = tok.clone();
            let prompt = parsed.prompt;
            // An error here is the instance's to report: the router just goes without.
            tokio::task::spawn_blocking(move || prompt.token_ids(&tok.tokenizer, &tok.template))
                .await
                .ok()
                .and_then(Result::ok)
        }
    };
    PromptInfo {
        tokens: tokens.map(Arc::new),
        max_tokens,
    }
}

/// One client request as the proxy carries it across attempts.
struct Job {
    s: Arc<ProxyState>,
    /// What the router knows of the prompt.
    prompt: PromptInfo,
    /// The load this request puts on the instances it was sent to (given back at its end).
    charges: Vec<Charge>,
    path: &'static str,
    /// The client's request (validated; without `kv_transfer_params` and `resume_tokens`).
    request: Value,
    stream: bool,
    /// The client asked for `return_token_ids` itself (else they are stripped).
    client_token_ids: bool,
    /// Choices of the answer (`n` per prompt): a stream of several is not migrated once it
    /// started (a resumed request continues one choice).
    choices: usize,
    /// Decode instances that failed this request (not picked again).
    tried_decode: Vec<String>,
    /// Prefill instances that failed this request.
    tried_prefill: Vec<String>,
    /// Migrations so far (bounded by `migration_limit`).
    migrations: u32,
    /// Whether the prefill retry was used.
    prefill_retried: bool,
    /// The request's images (their URLs), for the encode hop.
    images: Vec<String>,
    /// The encode instance whose embeddings the request names (`ec_transfer_params`).
    encoder: Option<String>,
    /// Encode instances that failed this request.
    tried_encode: Vec<String>,
    /// Whether the encode hop was run again after an instance failed to take the embeddings.
    encode_retried: bool,
}

/// The `type` of an OpenAI error body, if `body` is one.
fn error_kind(body: &[u8]) -> Option<String> {
    let Object(ErrorBody { error }) = serde_json::from_slice(body).ok()?;
    error?.ok()?.0.kind?.ok()
}

/// An OpenAI error body, `{"error": {"type": ...}}`, as far as the relay reads it.
#[derive(Debug, Deserialize)]
struct ErrorBody {
    error: Option<Lenient<Object<ErrorObject>>>,
}

#[derive(Debug, Deserialize)]
struct ErrorObject {
    #[serde(rename = "type")]
    kind: Option<Lenient<String>>,
}

/// An upstream SSE chunk as the relay reads and rewrites it: the fields it looks at, typed,
/// and the rest passed through untouched.
#[derive(Debug, Deserialize, Serialize)]
struct Chunk {
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    id: Option<Value>,
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    created: Option<Value>,
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    prompt_token_ids: Option<Value>,
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    error: Option<Lenient<ErrorFields>>,
    /// The first choice is read as [`ChunkChoice`] (an instance's chunk holds one).
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    choices: Option<Lenient<Vec<Value>>>,
    #[serde(flatten)]
    rest: Map<String, Value>,
}

/// A chunk's `error`, passed through; its `type` is read.
#[derive(Debug, Deserialize, Serialize)]
struct ErrorFields {
    #[serde(
        rename = "type",
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    kind: Option<Lenient<String>>,
    #[serde(flatten)]
    rest: Map<String, Value>,
}

/// A chunk's choice as the relay reads and rewrites it.
#[derive(Debug, Deserialize, Serialize)]
struct ChunkChoice {
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    index: Option<Lenient<u64>>,
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    token_ids: Option<Lenient<Vec<Lenient<u64>>>>,
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    finish_reason: Option<Value>,
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    delta: Option<Lenient<Delta>>,
    #[serde(flatten)]
    rest: Map<String, Value>,
}

/// A chat chunk's `delta`: its `role` may be dropped.
#[derive(Debug, Deserialize, Serialize)]
struct Delta {
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    role: Option<Value>,
    #[serde(flatten)]
    rest: Map<String, Value>,
}

/// Sets `key` in the client's request body. The proxy forwards the body as the client sent
/// it (an instance refuses unknown fields by name), but for the fields it sets itself.
fn set_field(request: &mut Value, key: &str, value: Value) -> Result<(), RequestError> {
    let fields = request
        .as_object_mut()
        .ok_or_else(|| RequestError::BadRequest("the request body is not a JSON object".into()))?;
    fields.insert(key.to_string(), value);
    Ok(())
}

/// An error kind after which the same request may go on elsewhere: the instance is stopping
/// or its worker failed (nothing about the request itself is wrong).
fn migratable(kind: &str) -> bool {
    matches!(kind, "shutting_down" | "worker_failed")
}

impl Job {
    /// The router's pick among the routable instances of `role` not tried yet.
    fn pick(&mut self, role: Role) -> Option<Upstream> {
        let tried = if role == Role::Decode {
            &self.tried_decode
        } else {
            &self.tried_prefill
        };
        let candidates: Vec<Upstream> = self
            .s
            .registry()
            .routable_at(role, Instant::now())
            .into_iter()
            .filter(|u| !tried.contains(&u.url))
            .collect();
        let picked = self.s.choose(role, &candidates, &self.prompt)?;
        self.charges
            .push(self.s.charge(&picked.url, role, &self.prompt));
        Some(picked)
    }

    /// The body of one attempt — prefilled on `prefill` (else on the decode instance itself),
    /// continuing after `resume` — and the `transfer_id` its hand-off uses (none when the
    /// decode instance prefills).
    fn body(
        &self,
        prefill: Option<&Upstream>,
        resume: &[u32],
    ) -> Result<(Vec<u8>, Option<TransferId>), RequestError> {
        let mut request = self.request.clone();
        let mut transfer = None;
        if let Some(prefill) = prefill {
            let Some((host, port)) = prefill.host_port.clone() else {
                return Err(RequestError::Internal(format!(
                    "prefill instance URL `{}` has no host:port",
                    prefill.url
                )));
            };
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
                transfer_id: {
                    let t = TransferId::new_random();
                    transfer = Some(t);
                    t.to_string()
                },
                first_token_id: None,
                first_token_logprobs: None,
                kv_lease_ms: None,
                cached_tokens: None,
            };
            let params =
                serde_json::to_value(params).map_err(|e| RequestError::Internal(e.to_string()))?;
            set_field(&mut request, "kv_transfer_params", params)?;
        }
        if !resume.is_empty() {
            set_field(&mut request, "resume_tokens", json!(resume))?;
        }
        if self.stream && self.choices == 1 {
            // Migration needs to know which tokens the client has.
            set_field(&mut request, "return_token_ids", json!(true))?;
        }
        let body =
            serde_json::to_vec(&request).map_err(|e| RequestError::Internal(e.to_string()))?;
        Ok((body, transfer))
    }

    /// Sends one attempt: the outer `Err` when the request cannot be built, the inner one
    /// when `decode` could not be reached at all.
    async fn send(
        &self,
        decode: &Upstream,
        prefill: Option<&Upstream>,
        resume: &[u32],
    ) -> Result<Result<reqwest::Response, reqwest::Error>, RequestError> {
        let (body, transfer) = self.body(prefill, resume)?;
        match (transfer, prefill) {
            (Some(transfer), Some(p)) => {
                tracing::info!(%transfer, prefill = %p.url, decode = %decode.url, resumed = resume.len(), "routing")
            }
            _ => {
                tracing::info!(decode = %decode.url, resumed = resume.len(), "routing: the decode instance prefills")
            }
        }
        Ok(self
            .s
            .upstream(self.s.http.post(format!("{}{}", decode.url, self.path)))
            .header("content-type", "application/json")
            .body(body)
            .timeout(self.s.timeout)
            .send()
            .await)
    }

    /// Starts the request on `decode` (prefilled on `prefill`): reroutes while a decode
    /// instance cannot be reached or answers 503 before starting, applies the prefill retry
    /// policy to a non-streamed hand-off failure. Returns the answer to relay (status 200, or
    /// an error to pass on), with the instances it came from; `Err`: the answer to send.
    async fn start(
        &mut self,
        mut decode: Upstream,
        mut prefill: Option<Upstream>,
        resume: &[u32],
    ) -> Result<(reqwest::Response, Upstream, Option<Upstream>), Response> {
        loop {
            let resp = match self.send(&decode, prefill.as_ref(), resume).await {
                Err(e) => return Err(ApiError(e).into_response()),
                Ok(Err(e)) => {
                    tracing::warn!(decode = %decode.url, error = %e, "decode instance unreachable: trying another");
                    self.tried_decode.push(decode.url.clone());
                    match self.pick(Role::Decode) {
                        Some(next) => {
                            decode = next;
                            continue;
                        }
                        None => {
                            outcome("upstream_error");
                            return Err(ApiError(RequestError::Upstream(format!(
                                "decode instance {}: {e}",
                                decode.url
                            )))
                            .into_response());
                        }
                    }
                }
                Ok(Ok(r)) => r,
            };
            let status = resp.status().as_u16();
            if status == 200 {
                return Ok((resp, decode, prefill));
            }
            // 503: another decode instance may take it; 502: the encoder failed (before
            // anything streamed), or, for a non-streamed request, the hand-off may have
            // failed (a stream reports that in its body).
            let decide = status == 503 || status == 502;
            if !decide {
                return Ok((resp, decode, prefill));
            }
            // Read the refusal to decide; it is small.
            let body = resp.bytes().await.unwrap_or_default();
            let kind = error_kind(&body).unwrap_or_default();
            if status == 503 {
                // Draining, stopping or full: another decode instance may take it.
                self.tried_decode.push(decode.url.clone());
                if let Some(next) = self.pick(Role::Decode) {
                    tracing::info!(decode = %decode.url, %kind, next = %next.url, "decode instance refused (503): rerouting");
                    decode = next;
                    continue;
                }
            } else if kind == "encoder_failed" && !self.encode_retried {
                // The encoder that held the images failed them: encode again elsewhere.
                self.encode_retried = true;
                if let Some(o) = self.request.as_object_mut() {
                    o.remove("ec_transfer_params");
                }
                self.tried_encode.extend(self.encoder.take());
                let images = self.images.clone();
                let mut tried = std::mem::take(&mut self.tried_encode);
                let next = super::encode::hop(&self.s, &self.request, &images, &mut tried).await;
                self.tried_encode = tried;
                match next {
                    Ok(Some(e)) => {
                        tracing::info!(encoder = %e, "an instance could not take the embeddings: encoded again");
                        if let Err(e) = set_field(
                            &mut self.request,
                            "ec_transfer_params",
                            json!({"encoder_url": e}),
                        ) {
                            return Err(ApiError(e).into_response());
                        }
                        self.encoder = Some(e);
                        continue;
                    }
                    Ok(None) => {}
                    Err(r) => return Err(r),
                }
            } else if kind == "kv_transfer_failed" && !self.stream {
                if let Some(next) = self.prefill_failed(prefill.as_ref()) {
                    prefill = next;
                    continue;
                }
            }
            return Err(passthrough(status, body));
        }
    }

    /// The prefill instance of this request failed before the hand-off: where to prefill now
    /// (`Some(None)`: on the decode instance), or `None` to pass the failure on.
    fn prefill_failed(&mut self, prefill: Option<&Upstream>) -> Option<Option<Upstream>> {
        let failed = prefill?;
        if self.prefill_retried {
            return None;
        }
        self.prefill_retried = true;
        self.tried_prefill.push(failed.url.clone());
        let next = match self.s.prefill_retry {
            PrefillRetry::Fail => None,
            PrefillRetry::Local => Some(None),
            PrefillRetry::Retry => Some(self.pick(Role::Prefill)),
        };
        let action = match &next {
            None => "fail",
            Some(None) => "local",
            Some(Some(_)) => "retry",
        };
        metrics::counter!(m::PREFILL_RETRIES_TOTAL, m::LABEL_ACTION => action).increment(1);
        tracing::warn!(prefill = %failed.url, action, "the prefill instance failed before the hand-off");
        next
    }

    /// A non-streamed answer: relayed when it completed; re-issued whole to another decode
    /// instance when the instance died mid-way or failed it for a reason of its own.
    async fn whole(
        mut self,
        mut resp: reqwest::Response,
        mut decode: Upstream,
        arrived: Instant,
    ) -> Response {
        loop {
            let status = resp.status().as_u16();
            let ctype = content_type(&resp, "application/json");
            let (reason, error) = match resp.bytes().await {
                Ok(body) => {
                    let kind = (status >= 500).then(|| error_kind(&body)).flatten();
                    match kind {
                        Some(k) if migratable(&k) => ("instance_failed", k),
                        _ => {
                            metrics::histogram!(m::PROXY_TIME_TO_FIRST_BYTE_SECONDS)
                                .record(arrived.elapsed().as_secs_f64());
                            metrics::histogram!(m::PROXY_REQUEST_SECONDS)
                                .record(arrived.elapsed().as_secs_f64());
                            let code =
                                StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
                            return (code, [("content-type", ctype)], body).into_response();
                        }
                    }
                }
                Err(e) => ("stream_broken", e.to_string()),
            };
            match self.migrate_from(&decode, reason, &error, &[]).await {
                Ok((r, d)) => {
                    resp = r;
                    decode = d;
                }
                Err(e) => return ApiError(e).into_response(),
            }
        }
    }

    /// Moves the request off `failed` to another decode instance, continuing after `resume`:
    /// the new answer (status 200) and where it comes from.
    async fn migrate_from(
        &mut self,
        failed: &Upstream,
        reason: &'static str,
        error: &str,
        resume: &[u32],
    ) -> Result<(reqwest::Response, Upstream), RequestError> {
        self.tried_decode.push(failed.url.clone());
        loop {
            if self.migrations >= self.s.migration_limit {
                outcome("upstream_error");
                return Err(RequestError::Upstream(format!(
                    "decode instance {} failed mid-generation ({error}) and the migration limit ({}) is spent",
                    failed.url, self.s.migration_limit
                )));
            }
            let Some(next) = self.pick(Role::Decode) else {
                outcome("upstream_error");
                return Err(RequestError::Upstream(format!(
                    "decode instance {} failed mid-generation ({error}) and no other decode instance is available",
                    failed.url
                )));
            };
            self.migrations += 1;
            metrics::counter!(m::MIGRATIONS_TOTAL, m::LABEL_REASON => reason).increment(1);
            tracing::warn!(from = %failed.url, to = %next.url, reason, %error, resumed = resume.len(), "migrating a request");
            match self.send(&next, None, resume).await? {
                Ok(r) if r.status().is_success() => return Ok((r, next)),
                Ok(r) => {
                    let status = r.status();
                    let body = r.bytes().await.unwrap_or_default();
                    tracing::warn!(decode = %next.url, %status, body = %String::from_utf8_lossy(&body), "migration target refused");
                    self.tried_decode.push(next.url.clone());
                }
                Err(e) => {
                    tracing::warn!(decode = %next.url, error = %e, "migration target unreachable");
                    self.tried_decode.push(next.url.clone());
                }
            }
        }
    }
}

/// An upstream refusal passed to the client as it came.
fn passthrough(status: u16, body: Bytes) -> Response {
    let code = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    (code, [("content-type", "application/json")], body).into_response()
}

/// What the relay of one stream knows: the SSE parser, the tokens the client has, the ids
/// the client saw first. Pure (no I/O), so it is unit-tested.
#[derive(Debug, Default)]
struct StreamView {
    buf: Vec<u8>,
    /// Tokens whose text the client has.
    generated: Vec<u32>,
    /// `id` and `created` of the first attempt's chunks.
    first_id: Option<(Value, Value)>,
    /// A chunk carried a `role` delta (chat): later ones drop theirs.
    role_sent: bool,
    /// Every choice's chunk with a `finish_reason` arrived.
    finished: bool,
    /// Choices (`n`) of the request.
    choices: usize,
    /// Choices finished so far.
    choices_finished: usize,
    /// `data: [DONE]` went out.
    done: bool,
    /// Any chunk went out.
    started: bool,
    client_token_ids: bool,
}

/// What one upstream SSE event means for the relay.
#[derive(Debug, PartialEq)]
enum Seen {
    /// Send these bytes to the client.
    Relay(Bytes),
    /// An error event of this kind (its bytes, to relay if nothing better can be done).
    Error(String, Bytes),
}

impl StreamView {
    fn new(client_token_ids: bool, choices: usize) -> Self {
        Self {
            client_token_ids,
            choices,
            ..Self::default()
        }
    }

    /// A new upstream (after a migration): drop what was half-read from the old one.
    fn reset_upstream(&mut self) {
        self.buf.clear();
    }

    /// Feeds upstream bytes; returns the complete events they finished.
    fn feed(&mut self, bytes: &[u8]) -> Vec<Seen> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(end) = find_event_end(&self.buf) {
            let event: Vec<u8> = self.buf.drain(..end.0).collect();
            self.buf.drain(..end.1);
            if let Some(seen) = self.event(&event) {
                out.push(seen);
            }
        }
        out
    }

    /// Reads a chunk's (first) choice: its token ids and whether it finished; strips the
    /// token ids the client did not ask for and a migrated stream's repeated `role`.
    fn see_choice(&mut self, choice: &mut ChunkChoice) {
        if let Some(Lenient::Ok(ids)) = &choice.token_ids {
            self.generated.extend(ids.iter().filter_map(|t| match t {
                Lenient::Ok(t) => Some(*t as u32),
                Lenient::Bad(_) => None,
            }));
        }
        if !self.client_token_ids {
            choice.token_ids = None;
        }
        if choice.finish_reason.as_ref().is_some_and(|f| !f.is_null()) {
            self.choices_finished += 1;
            self.finished = self.choices_finished >= self.choices;
        }
        // Each choice opens with its own `role` delta; only a migrated stream's repeat
        // (one choice) is dropped.
        let first_choice = match &choice.index {
            Some(Lenient::Ok(i)) => *i == 0,
            _ => true,
        };
        if let (true, Some(Lenient::Ok(delta))) = (first_choice, &mut choice.delta) {
            if delta.role.is_some() {
                if self.role_sent {
                    delta.role = None;
                }
                self.role_sent = true;
            }
        }
    }

    fn event(&mut self, event: &[u8]) -> Option<Seen> {
        let text = String::from_utf8_lossy(event);
        let data: String = text
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(|d| d.strip_prefix(' ').unwrap_or(d))
            .collect::<Vec<_>>()
            .join("\n");
        if data.is_empty() {
            // A comment or keep-alive: pass it on as is.
            return Some(Seen::Relay(Bytes::from(format!("{text}\n\n"))));
        }
        if data.trim() == "[DONE]" {
            self.done = true;
            return Some(Seen::Relay(Bytes::from_static(b"data: [DONE]\n\n")));
        }
        let Ok(v) = serde_json::from_str::<Value>(&data) else {
            return Some(Seen::Relay(Bytes::from(format!("data: {data}\n\n"))));
        };
        // Not an object: nothing to read or rewrite (read through the `Value`, so that a
        // repeated key counts once, as JSON reads it).
        let chunk = match v.is_object().then(|| Chunk::deserialize(&v)) {
            Some(Ok(chunk)) => chunk,
            _ => {
                self.started = true;
                return Some(Seen::Relay(Bytes::from(format!("data: {v}\n\n"))));
            }
        };
        let mut chunk = chunk;
        if let Some(Lenient::Ok(ErrorFields {
            kind: Some(Lenient::Ok(kind)),
            ..
        })) = chunk.error
        {
            return Some(Seen::Error(kind, Bytes::from(format!("data: {data}\n\n"))));
        }
        if let Some(Lenient::Ok(choices)) = &mut chunk.choices {
            if let Some(first) = choices.first_mut().filter(|c| c.is_object()) {
                if let Ok(mut choice) = ChunkChoice::deserialize(&*first) {
                    self.see_choice(&mut choice);
                    if let Ok(c) = serde_json::to_value(choice) {
                        *first = c;
                    }
                }
            }
        }
        if !self.client_token_ids {
            chunk.prompt_token_ids = None;
        }
        match &self.first_id {
            None => {
                self.first_id = Some((
                    chunk.id.clone().unwrap_or(Value::Null),
                    chunk.created.clone().unwrap_or(Value::Null),
                ))
            }
            Some((id, created)) => {
                chunk.id = Some(id.clone());
                chunk.created = Some(created.clone());
            }
        }
        let v = serde_json::to_value(chunk).unwrap_or(v);
        self.started = true;
        Some(Seen::Relay(Bytes::from(format!("data: {v}\n\n"))))
    }
}

/// `(end of the event, length of its separator)` of the first complete SSE event in `buf`.
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| (i, 2));
    let crlf = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| (i, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

/// The state of one relayed stream.
struct Relay {
    job: Job,
    resp: Option<reqwest::Response>,
    decode: Upstream,
    prefill: Option<Upstream>,
    view: StreamView,
    out: VecDeque<Bytes>,
    end: bool,
    first_byte: Option<Instant>,
    _timer: EndTimer,
}

impl Relay {
    /// The next bytes for the client.
    async fn next(&mut self) -> Option<Bytes> {
        loop {
            if let Some(b) = self.out.pop_front() {
                if let Some(t) = self.first_byte.take() {
                    metrics::histogram!(m::PROXY_TIME_TO_FIRST_BYTE_SECONDS)
                        .record(t.elapsed().as_secs_f64());
                }
                return Some(b);
            }
            if self.end || self.view.done {
                return None;
            }
            let chunk = match self.resp.as_mut() {
                Some(r) => r.chunk().await,
                None => return None,
            };
            match chunk {
                Ok(Some(bytes)) => {
                    for seen in self.view.feed(&bytes) {
                        match seen {
                            Seen::Relay(b) => self.out.push_back(b),
                            Seen::Error(kind, bytes) => self.on_error(kind, bytes).await,
                        }
                        if self.end {
                            break;
                        }
                    }
                }
                Ok(None) | Err(_) if self.view.finished => {
                    // Everything but the trailer arrived: end the stream properly.
                    self.out.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
                    self.end = true;
                }
                Ok(None) => {
                    self.migrate("stream_broken", "the stream ended early".into())
                        .await
                }
                Err(e) => self.migrate("stream_broken", e.to_string()).await,
            }
        }
    }

    async fn on_error(&mut self, kind: String, bytes: Bytes) {
        if kind == "kv_transfer_failed" && !self.view.started {
            if let Some(next) = self.job.prefill_failed(self.prefill.as_ref()) {
                let decode = self.decode.clone();
                match self.job.start(decode, next, &[]).await {
                    Ok((resp, d, p)) if resp.status().is_success() => {
                        self.view.reset_upstream();
                        self.resp = Some(resp);
                        self.decode = d;
                        self.prefill = p;
                        return;
                    }
                    Ok((resp, _, _)) => {
                        let body = resp.bytes().await.unwrap_or_default();
                        self.fail_with(Bytes::from(format!(
                            "data: {}\n\n",
                            String::from_utf8_lossy(&body)
                        )));
                        return;
                    }
                    Err(_) => {}
                }
            }
        } else if migratable(&kind) {
            self.migrate("instance_failed", kind).await;
            return;
        }
        self.fail_with(bytes);
    }

    /// Ends the client's stream with `error` (an SSE error event).
    fn fail_with(&mut self, error: Bytes) {
        self.out.push_back(error);
        self.out.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
        self.end = true;
    }

    async fn migrate(&mut self, reason: &'static str, error: String) {
        self.resp = None;
        if self.job.choices > 1 && self.view.started {
            let e = RequestError::Upstream(format!(
                "decode instance {} failed mid-generation ({error}); a stream of several choices (`n` > 1) is not migrated",
                self.decode.url
            ));
            let body = openai::error_body(&e);
            self.fail_with(Bytes::from(format!("data: {body}\n\n")));
            return;
        }
        let failed = self.decode.clone();
        let resume = self.view.generated.clone();
        match self
            .job
            .migrate_from(&failed, reason, &error, &resume)
            .await
        {
            Ok((resp, decode)) => {
                self.view.reset_upstream();
                self.resp = Some(resp);
                self.decode = decode;
                self.prefill = None;
            }
            Err(e) => {
                let body = openai::error_body(&e);
                self.fail_with(Bytes::from(format!("data: {body}\n\n")));
            }
        }
    }
}

/// Streams `resp` (status 200, `text/event-stream`) to the client through a [`Relay`].
fn stream_response(
    job: Job,
    resp: reqwest::Response,
    decode: Upstream,
    prefill: Option<Upstream>,
    arrived: Instant,
) -> Response {
    let ctype = content_type(&resp, "text/event-stream");
    let relay = Relay {
        view: StreamView::new(job.client_token_ids, job.choices),
        job,
        resp: Some(resp),
        decode,
        prefill,
        out: VecDeque::new(),
        end: false,
        first_byte: Some(arrived),
        _timer: EndTimer(arrived),
    };
    let stream = futures_util::stream::unfold(relay, |mut relay| async move {
        let bytes = relay.next().await?;
        Some((Ok::<Bytes, std::io::Error>(bytes), relay))
    });
    (
        StatusCode::OK,
        [("content-type", ctype)],
        Body::from_stream(stream),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(id: &str, text: &str, ids: &[u32], finish: Option<&str>) -> String {
        format!(
            "data: {}\n\n",
            json!({"id": id, "created": 7, "object": "text_completion",
                   "choices": [{"index": 0, "text": text, "token_ids": ids, "finish_reason": finish}]})
        )
    }

    fn relayed(seen: Vec<Seen>) -> Vec<Value> {
        seen.into_iter()
            .map(|s| match s {
                Seen::Relay(b) => {
                    let t = String::from_utf8(b.to_vec()).unwrap();
                    let d = t.trim().strip_prefix("data: ").unwrap().to_string();
                    serde_json::from_str(&d).unwrap_or(Value::String(d))
                }
                other => panic!("{other:?}"),
            })
            .collect()
    }

    #[test]
    fn the_view_counts_relayed_tokens_and_keeps_the_first_ids_across_upstreams() {
        let mut v = StreamView::new(false, 1);
        // Split across reads, and one half event left when the upstream breaks.
        let a = chunk("cmpl-1", "he", &[104, 101], None);
        let b = chunk("cmpl-1", "l", &[108], None);
        let (a1, a2) = a.split_at(10);
        assert!(v.feed(a1.as_bytes()).is_empty());
        let out = relayed(v.feed(format!("{a2}{b}data: {{\"id\"").as_bytes()));
        assert_eq!(out.len(), 2);
        assert!(out[0]["choices"][0].get("token_ids").is_none(), "stripped");
        assert_eq!(v.generated, vec![104, 101, 108]);
        // The new upstream's chunks are re-labelled with the first ids; the half event is
        // gone with the old upstream.
        v.reset_upstream();
        let c = chunk("cmpl-9", "lo", &[108, 111], Some("length"));
        let out = relayed(v.feed(format!("{c}data: [DONE]\n\n").as_bytes()));
        assert_eq!(out[0]["id"], "cmpl-1");
        assert_eq!(out[0]["created"], 7);
        assert_eq!(out[1], Value::String("[DONE]".into()));
        assert_eq!(v.generated, vec![104, 101, 108, 108, 111]);
        assert!(v.finished && v.done);
    }

    #[test]
    fn the_view_reports_errors_and_drops_a_repeated_role() {
        let mut v = StreamView::new(true, 1);
        let role = |id: &str| {
            format!(
                "data: {}\n\n",
                json!({"id": id, "created": 1, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "x"}, "token_ids": [120], "finish_reason": null}]})
            )
        };
        let out = relayed(v.feed(role("a").as_bytes()));
        assert_eq!(out[0]["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(
            out[0]["choices"][0]["token_ids"],
            json!([120]),
            "kept: asked for"
        );
        let out = relayed(v.feed(role("b").as_bytes()));
        assert!(out[0]["choices"][0]["delta"].get("role").is_none());
        assert_eq!(out[0]["id"], "a");
        let err = format!(
            "data: {}\n\n",
            openai::error_body(&RequestError::ShuttingDown)
        );
        match &v.feed(err.as_bytes())[..] {
            [Seen::Error(kind, _)] => assert_eq!(kind, "shutting_down"),
            other => panic!("{other:?}"),
        }
        assert!(migratable("shutting_down") && migratable("worker_failed"));
        assert!(!migratable("invalid_request_error"));
    }
}
