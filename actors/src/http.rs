//! The HttpFrontend actor: the OpenAI-compatible API of one instance (axum).
//!
//! `POST /v1/completions`, `POST /v1/chat/completions` (JSON or SSE), `GET /v1/models`,
//! `GET /health`, `GET /metrics`. Requests are validated here ([`crate::openai`]), admitted
//! under a concurrency bound (503 beyond it), tokenized, and handed to the Scheduler; the
//! answer streams back from the Scheduler's events. A client that disconnects drops its
//! handler, whose guard aborts the request so its KV blocks return to the pool.
//!
//! The actor owns the listening socket (bound in `pre_start`, so a bad address reaches whoever
//! starts the instance) and the server task, which it shuts down gracefully in `post_stop`.
//! Supervised by the `InstanceSupervisor`; a failure escalates (the instance stops serving).

use crate::error::RequestError;
use crate::kv_receiver::KvSource;
use crate::kv_sender::{KvSenderMsg, PushTarget};
use crate::kv_transfer::KvPeerInfo;
use crate::mailbox::{Inbox, Mailbox};
use crate::openai::{self, ParsedRequest, PromptInput};
use crate::scheduler::{NewRequest, RequestEvent, SchedulerMsg};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream};
use pdserve_gpu::chat::ChatTemplate;
use pdserve_gpu::tokenizer::Tokenizer;
use pdserve_runtime::ids::RequestId;
use pdserve_runtime::ids::TransferId;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// What every handler shares.
pub struct AppState {
    /// The instance's scheduler.
    pub scheduler: Mailbox<SchedulerMsg>,
    /// Tokenizer.
    pub tokenizer: Tokenizer,
    /// Chat template.
    pub chat_template: ChatTemplate,
    /// Served model name.
    pub model_name: String,
    /// Longest sequence.
    pub max_model_len: usize,
    /// Vocabulary size (for validating token ids).
    pub vocab_size: usize,
    /// Admission bound.
    pub admission: Arc<Semaphore>,
    /// Per-request deadline.
    pub request_timeout: Duration,
    /// Required bearer token, if any.
    pub api_key: Option<String>,
    /// Source of request ids.
    pub next_id: AtomicU64,
    /// Prometheus registry.
    pub metrics: pdserve_runtime::telemetry::MetricsHandle,
    /// The KV hand-off context (instances with a transfer engine).
    pub kv: Option<Arc<crate::kv_receiver::KvContext>>,
    /// The KvSender (instances with a transfer engine).
    pub kv_sender: Option<Mailbox<crate::kv_sender::KvSenderMsg>>,
    /// Hand-offs a decode instance aborted, remembered for a while (with when) so a
    /// remote-prefill request that arrives after its own abort is refused.
    pub aborted: std::sync::Mutex<std::collections::HashMap<TransferId, std::time::Instant>>,
    /// Where this frontend listens (set once bound).
    pub addr: std::sync::OnceLock<SocketAddr>,
}

/// An error as an HTTP response (OpenAI's shape).
struct ApiError(RequestError);

impl From<RequestError> for ApiError {
    fn from(e: RequestError) -> Self {
        Self(e)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.0.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, Json(openai::error_body(&self.0))).into_response()
    }
}

/// The routes of one instance. With `server.api_key` set, every `/v1/*` route — the OpenAI
/// API and the instance-to-instance KV calls alike — needs `Authorization: Bearer KEY`;
/// `/health` and `/metrics` stay open. A cluster shares one key: the proxy and decode
/// instances send their own key on their calls (see `KvContext::api_key`).
pub fn router(state: Arc<AppState>) -> Router {
    let guarded = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/v1/kv/info", get(kv_info))
        .route("/v1/load", get(load))
        .route("/v1/kv/release", post(kv_release))
        .route("/v1/kv/renew", post(kv_renew))
        .route("/v1/kv/abort", post(kv_abort))
        .route("/v1/kv/prefill", post(kv_prefill))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            require_key,
        ));
    Router::new()
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
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

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn models(State(app): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [{
        "id": app.model_name, "object": "model", "created": unix_now(), "owned_by": "pdserve",
        "max_model_len": app.max_model_len,
    }]}))
}

async fn metrics(State(app): State<Arc<AppState>>) -> impl IntoResponse {
    (
        [("content-type", "text/plain; version=0.0.4")],
        app.metrics.render(),
    )
}

/// Queue and pool figures, for a proxy's routing.
async fn load(State(app): State<Arc<AppState>>) -> Response {
    match crate::supervisor::scheduler_stats(&app.scheduler).await {
        Ok(s) => Json(s).into_response(),
        Err(e) => ApiError(RequestError::Internal(e.to_string())).into_response(),
    }
}

async fn kv_info(State(app): State<Arc<AppState>>) -> Response {
    match &app.kv {
        Some(kv) => Json(kv.info()).into_response(),
        None => ApiError(RequestError::BadRequest(
            "this instance has no KV transfer engine".into(),
        ))
        .into_response(),
    }
}

async fn kv_release(State(app): State<Arc<AppState>>, body: Bytes) -> Response {
    let transfer = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| {
            v.get("transfer_id")
                .and_then(Value::as_str)
                .map(str::to_string)
        })
        .and_then(|t| t.parse::<pdserve_runtime::ids::TransferId>().ok());
    let Some(transfer) = transfer else {
        return ApiError(RequestError::BadRequest(
            "body must be {\"transfer_id\": \"<32 hex digits>\"}".into(),
        ))
        .into_response();
    };
    match ractor::call_t!(app.scheduler, SchedulerMsg::ReleaseHeld, 5_000, transfer) {
        Ok(true) => Json(json!({"released": true})).into_response(),
        Ok(false) => (StatusCode::GONE, Json(json!({"error": {"message": format!("transfer {transfer} is not held (released, expired, or unknown)"), "type": "lease_expired", "param": null, "code": 410}}))).into_response(),
        Err(e) => ApiError(RequestError::Internal(e.to_string())).into_response(),
    }
}

fn body_transfer_id(v: &Value) -> Option<TransferId> {
    v.get("transfer_id")?.as_str()?.parse().ok()
}

fn no_engine() -> ApiError {
    ApiError(RequestError::BadRequest(
        "this instance has no KV transfer engine (role prefill or decode)".into(),
    ))
}

/// `POST /v1/kv/renew {"transfer_ids": [...]}`: a decode instance renews the leases of the
/// blocks held for it (batched). Answers the ids no longer held.
async fn kv_renew(State(app): State<Arc<AppState>>, body: Bytes) -> Response {
    let ids = serde_json::from_slice::<Value>(&body).ok().and_then(|v| {
        v.get("transfer_ids")?
            .as_array()?
            .iter()
            .map(|t| t.as_str()?.parse::<TransferId>().ok())
            .collect::<Option<Vec<_>>>()
    });
    let Some(ids) = ids else {
        return ApiError(RequestError::BadRequest(
            "body must be {\"transfer_ids\": [\"<32 hex digits>\", ...]}".into(),
        ))
        .into_response();
    };
    match ractor::call_t!(app.scheduler, SchedulerMsg::RenewHeld, 5_000, ids.clone()) {
        Ok(gone) => Json(json!({
            "renewed": ids.len() - gone.len(),
            "unknown": gone.iter().map(ToString::to_string).collect::<Vec<_>>(),
        }))
        .into_response(),
        Err(e) => ApiError(RequestError::Internal(e.to_string())).into_response(),
    }
}

/// `POST /v1/kv/abort {"transfer_id": ...}`: the decode side gave up on a hand-off. The
/// prefill running for it is aborted, its pushes stop, blocks held for it are freed.
async fn kv_abort(State(app): State<Arc<AppState>>, body: Bytes) -> Response {
    let Some(transfer) = serde_json::from_slice::<Value>(&body)
        .ok()
        .as_ref()
        .and_then(body_transfer_id)
    else {
        return ApiError(RequestError::BadRequest(
            "body must be {\"transfer_id\": \"<32 hex digits>\"}".into(),
        ))
        .into_response();
    };
    {
        let mut aborted = app.aborted.lock().unwrap_or_else(|e| e.into_inner());
        let now = std::time::Instant::now();
        aborted.retain(|_, at| now.duration_since(*at) < ABORT_MEMORY);
        aborted.insert(transfer, now);
    }
    let found = match ractor::call_t!(app.scheduler, SchedulerMsg::AbortTransfer, 5_000, transfer) {
        Ok(found) => found,
        Err(e) => return ApiError(RequestError::Internal(e.to_string())).into_response(),
    };
    // Answer only once no write of this hand-off can land any more: the decode side frees
    // its destination blocks when it gets this answer.
    let mut drained = true;
    if let Some(sender) = &app.kv_sender {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let _ = sender.cast(KvSenderMsg::Cancel {
            transfer,
            reason: "aborted by the decode instance".into(),
            drained: Some(tx),
        });
        let bound = app
            .kv
            .as_ref()
            .map_or(Duration::from_secs(30), |k| k.timeout);
        drained = matches!(tokio::time::timeout(bound, rx).await, Ok(Ok(())));
    }
    if !drained {
        return ApiError(RequestError::Internal(format!(
            "the writes of transfer {transfer} did not drain"
        )))
        .into_response();
    }
    Json(json!({"aborted": found, "drained": true})).into_response()
}

/// How long an aborted hand-off is remembered (a remote-prefill request for it is refused).
const ABORT_MEMORY: Duration = Duration::from_secs(600);

/// The body of `POST /v1/kv/prefill`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct KvPrefillBody {
    transfer_id: String,
    prompt_token_ids: Vec<u32>,
    sampling: pdserve_gpu::sampling::SamplingParams,
    mode: String,
    #[serde(default)]
    target: Option<PushTargetBody>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PushTargetBody {
    peer: KvPeerInfo,
    block_ids: Vec<u32>,
}

/// Frees held blocks and stops pushes of a hand-off whose handler ends early (the decode
/// side hung up, a timeout): nothing waits for a release that will not come.
struct HandoffGuard {
    transfer: TransferId,
    scheduler: Mailbox<SchedulerMsg>,
    sender: Option<Mailbox<KvSenderMsg>>,
    settled: bool,
}

impl Drop for HandoffGuard {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        if let Some(sender) = &self.sender {
            let _ = sender.cast(KvSenderMsg::Cancel {
                transfer: self.transfer,
                reason: "the decode instance went away".into(),
                drained: None,
            });
        }
        let (tx, _rx) = ractor::concurrency::oneshot();
        let _ = self
            .scheduler
            .cast(SchedulerMsg::AbortTransfer(self.transfer, tx.into()));
    }
}

/// `POST /v1/kv/prefill`: a decode instance asks this (prefill) instance to run a prompt and
/// hand its KV over. Pull: answers `{first_token_id, block_ids, kv_lease_ms}` with the blocks
/// held under a lease. Push: `target` names the decode instance's layout and destination
/// blocks (validated here: the handshake); each layer's blocks are written as they are
/// computed and the answer `{first_token_id}` comes once the last write finished.
async fn kv_prefill(State(app): State<Arc<AppState>>, body: Bytes) -> Response {
    kv_prefill_inner(app, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn kv_prefill_inner(app: Arc<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let bad = |m: String| ApiError(RequestError::BadRequest(m));
    let kv = app.kv.clone().ok_or_else(no_engine)?;
    let b: KvPrefillBody =
        serde_json::from_slice(&body).map_err(|e| bad(format!("bad /v1/kv/prefill body: {e}")))?;
    let transfer: TransferId = b
        .transfer_id
        .parse()
        .map_err(|e| bad(format!("transfer_id: {e}")))?;
    if app
        .aborted
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&transfer)
        .is_some_and(|at| at.elapsed() < ABORT_MEMORY)
    {
        return Err(bad(format!(
            "transfer {transfer} was aborted by the decode instance"
        )));
    }
    let prompt = b.prompt_token_ids;
    if prompt.is_empty() {
        return Err(bad("the prompt is empty".into()));
    }
    if let Some(t) = prompt.iter().find(|&&t| t as usize >= app.vocab_size) {
        return Err(bad(format!(
            "token id {t} is outside the vocabulary of {}",
            app.vocab_size
        )));
    }
    if prompt.len() + 1 > app.max_model_len {
        return Err(RequestError::ContextOverflow {
            max: app.max_model_len,
            requested: prompt.len() + 1,
            prompt: prompt.len(),
            completion: 1,
        }
        .into());
    }
    let mut params = b.sampling;
    params.max_tokens = 1;
    params
        .validate(app.vocab_size)
        .map_err(|e| bad(e.to_string()))?;
    let target = match (b.mode.as_str(), b.target) {
        ("pull", None) => None,
        ("push", Some(t)) => Some(t),
        ("pull", Some(_)) => return Err(bad("mode pull takes no target".into())),
        ("push", None) => return Err(bad("mode push needs a target".into())),
        (other, _) => {
            return Err(bad(format!(
                "unknown mode `{other}` (expected push or pull)"
            )))
        }
    };
    let permit = app.admission.clone().try_acquire_owned().map_err(|_| {
        RequestError::Overloaded(format!(
            "{} requests in flight",
            app.admission.available_permits()
        ))
    })?;
    let id = RequestId(app.next_id.fetch_add(1, Ordering::Relaxed));
    let mut pushed = None;
    if let Some(t) = target {
        let sender = app.kv_sender.clone().ok_or_else(no_engine)?;
        // The handshake: the writer validates the reader's layout before writing anything.
        crate::kv_transfer::validate_peer(&kv.info(), &t.peer).map_err(|e| bad(e.to_string()))?;
        let n = prompt.len().div_ceil(kv.block_size);
        let pool = t.peer.ranks[0].layout.num_blocks;
        if t.block_ids.len() != n {
            return Err(bad(format!(
                "invalid block ids: {} tokens need {n} destination blocks, got {}",
                prompt.len(),
                t.block_ids.len()
            )));
        }
        if let Some(b) = t.block_ids.iter().find(|&&b| b as usize >= pool) {
            return Err(bad(format!(
                "invalid block ids: destination block {b} is outside the peer's pool of {pool}"
            )));
        }
        let session = kv
            .session_for(&t.peer)
            .await
            .map_err(|e| ApiError(RequestError::KvTransfer(e)))?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        sender
            .cast(KvSenderMsg::Open {
                target: Arc::new(PushTarget {
                    transfer,
                    peer: t.peer,
                    blocks: t.block_ids,
                    prompt_len: prompt.len(),
                }),
                session,
                done: tx,
            })
            .map_err(|_| RequestError::ShuttingDown)?;
        pushed = Some(rx);
    }
    tracing::info!(request = %id, %transfer, mode = %b.mode, prompt_tokens = prompt.len(), "prefill for a remote decode");
    let mut handoff = HandoffGuard {
        transfer,
        scheduler: app.scheduler.clone(),
        sender: app.kv_sender.clone(),
        settled: false,
    };
    let (tx, mut rx) = unbounded_channel();
    app.scheduler
        .cast(SchedulerMsg::Submit {
            request: NewRequest {
                id,
                prompt,
                params,
                hold_for: Some(transfer),
                push: pushed.is_some(),
            },
            sink: tx,
        })
        .map_err(|_| RequestError::ShuttingDown)?;
    let mut guard = RequestGuard {
        id,
        scheduler: app.scheduler.clone(),
        finished: false,
        _permit: permit,
    };
    let deadline = tokio::time::Instant::now() + app.request_timeout;
    let mut first = None;
    let outcome = loop {
        match next_event(&mut rx, deadline, app.request_timeout).await {
            RequestEvent::Token { token, .. } => {
                first.get_or_insert(token);
            }
            RequestEvent::Finished { held_blocks, .. } => {
                guard.finished = true;
                break Ok(held_blocks.unwrap_or_default());
            }
            RequestEvent::Failed(e) => {
                guard.finished = !matches!(e, RequestError::Timeout(_));
                break Err(e);
            }
        }
    };
    let Some(pushed) = pushed else {
        // Pull: the blocks stay held under the lease until the decode side releases them.
        let blocks = outcome?;
        handoff.settled = true;
        return Ok(Json(json!({
            "transfer_id": transfer.to_string(),
            "first_token_id": first,
            "block_ids": blocks,
            "remote_engine_id": kv.engine_id,
            "kv_lease_ms": kv.lease.as_millis() as u64,
        }))
        .into_response());
    };
    if let (Err(e), Some(sender)) = (&outcome, &app.kv_sender) {
        let _ = sender.cast(KvSenderMsg::Cancel {
            transfer,
            reason: e.to_string(),
            drained: None,
        });
    }
    // Wait for the last write (or, after a failure, for the writes in flight to drain):
    // the decode side frees its blocks when it gets this answer.
    let written = match tokio::time::timeout(kv.timeout, pushed).await {
        Ok(Ok(r)) => r,
        Ok(Err(_)) => {
            // The KvSender (or the Aggregator) failed with the hand-off open: nobody can
            // say whether its writes have drained. Each ends within the transfer bound, so
            // wait that out before decode may reuse its blocks (and before ours are freed).
            tokio::time::sleep(kv.timeout).await;
            Err("the KV sender failed during the hand-off".into())
        }
        Err(_) => Err(format!(
            "the KV writes did not finish within {} s",
            kv.timeout.as_secs()
        )),
    };
    // Push holds the blocks only until the writes are done.
    let _ = ractor::call_t!(app.scheduler, SchedulerMsg::ReleaseHeld, 5_000, transfer);
    handoff.settled = written.is_ok();
    outcome?;
    written.map_err(|e| ApiError(RequestError::KvTransfer(e)))?;
    Ok(Json(json!({
        "transfer_id": transfer.to_string(),
        "first_token_id": first,
    }))
    .into_response())
}

async fn completions(State(app): State<Arc<AppState>>, body: Bytes) -> Response {
    serve(app, body, false)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn chat_completions(State(app): State<Arc<AppState>>, body: Bytes) -> Response {
    serve(app, body, true)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// Aborts its request in the scheduler when dropped before the request ended (client gone,
/// timeout), and holds the admission permit for the request's lifetime.
struct RequestGuard {
    id: RequestId,
    scheduler: Mailbox<SchedulerMsg>,
    finished: bool,
    _permit: OwnedSemaphorePermit,
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.scheduler.cast(SchedulerMsg::Abort(self.id));
        }
    }
}

/// Whether `headers` carry `Authorization: Bearer KEY` for `key` (always, when no key is set).
pub(crate) fn bearer_matches(key: Option<&str>, headers: &HeaderMap) -> bool {
    let Some(key) = key else { return true };
    let given = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    given == Some(key)
}

/// The 401 answer to a missing or wrong API key (OpenAI's error shape).
pub(crate) fn unauthorized() -> Response {
    let body = json!({"error": {"message": "missing or invalid API key", "type": "authentication_error", "param": null, "code": 401}});
    (StatusCode::UNAUTHORIZED, Json(body)).into_response()
}

async fn serve(app: Arc<AppState>, body: Bytes, chat: bool) -> Result<Response, ApiError> {
    let req = openai::parse_request(&body, chat)?;
    if let Some(m) = &req.model {
        if m != &app.model_name {
            return Err(RequestError::UnknownModel(m.clone()).into());
        }
    }
    let permit = app.admission.clone().try_acquire_owned().map_err(|_| {
        RequestError::Overloaded(format!(
            "{} requests in flight",
            app.admission.available_permits()
        ))
    })?;
    let prompt = tokenize(&app, &req.prompt)?;
    let max_tokens =
        openai::resolve_max_tokens(req.max_tokens, chat, prompt.len(), app.max_model_len)?;
    let mut params = req.params.clone();
    params.max_tokens = max_tokens;
    params
        .validate(app.vocab_size)
        .map_err(|e| RequestError::BadRequest(e.to_string()))?;

    let directive = openai::kv_directive(req.kv_transfer_params.as_ref())?;
    if !matches!(directive, openai::KvDirective::None) && app.kv.is_none() {
        return Err(RequestError::BadRequest("kv_transfer_params need an instance with a KV transfer engine (role prefill or decode)".into()).into());
    }
    let id = RequestId(app.next_id.fetch_add(1, Ordering::Relaxed));
    let token_ids = req.return_token_ids.then(|| prompt.clone());
    let (tx, rx) = unbounded_channel();
    let mut hand_off = None;
    let mut request = NewRequest {
        id,
        prompt,
        params,
        hold_for: None,
        push: false,
    };
    let msg = match directive {
        openai::KvDirective::None => SchedulerMsg::Submit { request, sink: tx },
        openai::KvDirective::HoldForDecode(transfer) => {
            if req.stream {
                return Err(RequestError::BadRequest("do_remote_decode needs `stream: false` (the answer carries kv_transfer_params)".into()).into());
            }
            tracing::info!(request = %id, %transfer, "prefill for a remote decode");
            hand_off = Some(transfer);
            request.hold_for = Some(transfer);
            SchedulerMsg::Submit { request, sink: tx }
        }
        openai::KvDirective::FromPrefill(remote) => {
            tracing::info!(request = %id, transfer = %remote.transfer_id, prefill = %remote.url, "decoding from held KV");
            SchedulerMsg::SubmitRemote {
                request,
                sink: tx,
                source: KvSource::Held(remote),
            }
        }
        openai::KvDirective::DriveRemote { url, transfer_id } => {
            let threshold = app.kv.as_ref().map_or(0, |k| k.min_remote_prompt_tokens);
            if request.prompt.len() < threshold {
                // Conditional disaggregation: a short prompt costs less here than a hand-off.
                tracing::info!(request = %id, transfer = %transfer_id, prompt_tokens = request.prompt.len(), threshold, "prefilling locally: short prompt");
                metrics::counter!(pdserve_runtime::telemetry::LOCAL_PREFILLS_TOTAL, pdserve_runtime::telemetry::LABEL_REASON => "short_prompt").increment(1);
                SchedulerMsg::Submit { request, sink: tx }
            } else {
                tracing::info!(request = %id, transfer = %transfer_id, prefill = %url, "remote prefill");
                SchedulerMsg::SubmitRemote {
                    request,
                    sink: tx,
                    source: KvSource::Drive { url, transfer_id },
                }
            }
        }
    };
    app.scheduler
        .cast(msg)
        .map_err(|_| RequestError::ShuttingDown)?;
    let guard = RequestGuard {
        id,
        scheduler: app.scheduler.clone(),
        finished: false,
        _permit: permit,
    };
    let meta = ResponseMeta {
        id: format!("{}-{}", if chat { "chatcmpl" } else { "cmpl" }, id.0),
        created: unix_now(),
        model: app.model_name.clone(),
        chat,
        include_usage: req.include_usage,
        token_ids,
        lease_ms: app.kv.as_ref().map_or(0, |k| k.lease.as_millis() as u64),
        hand_off: hand_off.map(|t| {
            (
                t,
                app.kv
                    .as_ref()
                    .map(|k| k.engine_id.clone())
                    .unwrap_or_default(),
                app.addr.get().copied(),
            )
        }),
    };
    let deadline = tokio::time::Instant::now() + app.request_timeout;
    if req.stream {
        Ok(
            Sse::new(sse_stream(rx, guard, meta, deadline, app.request_timeout))
                .keep_alive(KeepAlive::default())
                .into_response(),
        )
    } else {
        collect(rx, guard, meta, deadline, app.request_timeout, &req).await
    }
}

fn tokenize(app: &AppState, prompt: &PromptInput) -> Result<Vec<u32>, RequestError> {
    let ids = match prompt {
        PromptInput::Text(t) => app.tokenizer.encode(t, true),
        PromptInput::Tokens(t) => Ok(t.clone()),
        PromptInput::Chat(messages) => app
            .chat_template
            .render(messages, true)
            .and_then(|text| app.tokenizer.encode(&text, false)),
    }
    .map_err(|e| RequestError::BadRequest(e.to_string()))?;
    if ids.is_empty() {
        return Err(RequestError::BadRequest("the prompt is empty".into()));
    }
    if let Some(bad) = ids.iter().find(|&&t| t as usize >= app.vocab_size) {
        return Err(RequestError::BadRequest(format!(
            "token id {bad} is outside the vocabulary of {}",
            app.vocab_size
        )));
    }
    Ok(ids)
}

struct ResponseMeta {
    id: String,
    created: u64,
    model: String,
    chat: bool,
    include_usage: bool,
    /// `Some(prompt ids)` when the client asked for token ids.
    token_ids: Option<Vec<u32>>,
    /// Prefill side of P/D: (transfer, engine id, our address) for the answer's
    /// `kv_transfer_params`.
    hand_off: Option<(pdserve_runtime::ids::TransferId, String, Option<SocketAddr>)>,
    /// How long held blocks wait for the decode side, in ms (published with them).
    lease_ms: u64,
}

impl ResponseMeta {
    fn chunk(&self, text: &str, finish: Option<&str>, first: bool, tokens: &[u32]) -> Value {
        let mut v = self.chunk_body(text, finish, first);
        if self.token_ids.is_some() {
            v["choices"][0]["token_ids"] = json!(tokens);
        }
        v
    }

    fn chunk_body(&self, text: &str, finish: Option<&str>, first: bool) -> Value {
        if self.chat {
            let delta = if first {
                json!({"role": "assistant", "content": text})
            } else if finish.is_some() && text.is_empty() {
                json!({})
            } else {
                json!({"content": text})
            };
            json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                   "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]})
        } else {
            json!({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                   "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}]})
        }
    }

    fn usage_chunk(&self, prompt: usize, completion: usize) -> Value {
        let object = if self.chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model,
               "choices": [], "usage": openai::usage(prompt, completion)})
    }

    fn full(
        &self,
        text: &str,
        finish: &str,
        prompt: usize,
        completion: usize,
        tokens: &[u32],
        held: Option<&[u32]>,
    ) -> Value {
        let mut v = if self.chat {
            json!({"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": finish}],
                   "usage": openai::usage(prompt, completion)})
        } else {
            json!({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                   "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}],
                   "usage": openai::usage(prompt, completion)})
        };
        if let (Some((transfer, engine, addr)), Some(blocks)) = (&self.hand_off, held) {
            v["kv_transfer_params"] = json!({
                "do_remote_decode": false,
                "do_remote_prefill": true,
                "remote_engine_id": engine,
                "remote_block_ids": blocks,
                "remote_host": addr.map(|a| a.ip().to_string()),
                "remote_port": addr.map(|a| a.port()),
                "transfer_id": transfer.to_string(),
                "first_token_id": tokens.first(),
                "kv_lease_ms": self.lease_ms,
            });
        }
        if let Some(prompt_ids) = &self.token_ids {
            v["choices"][0]["token_ids"] = json!(tokens);
            v["choices"][0]["prompt_token_ids"] = json!(prompt_ids);
        }
        v
    }
}

async fn next_event(
    rx: &mut UnboundedReceiver<RequestEvent>,
    deadline: tokio::time::Instant,
    timeout: Duration,
) -> RequestEvent {
    match tokio::time::timeout_at(deadline, rx.recv()).await {
        Ok(Some(e)) => e,
        Ok(None) => RequestEvent::Failed(RequestError::Internal(
            "the scheduler dropped the request".into(),
        )),
        Err(_) => RequestEvent::Failed(RequestError::Timeout(timeout.as_secs())),
    }
}

async fn collect(
    mut rx: UnboundedReceiver<RequestEvent>,
    mut guard: RequestGuard,
    meta: ResponseMeta,
    deadline: tokio::time::Instant,
    timeout: Duration,
    _req: &ParsedRequest,
) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut tokens = Vec::new();
    loop {
        match next_event(&mut rx, deadline, timeout).await {
            RequestEvent::Token { text: t, token } => {
                text.push_str(&t);
                tokens.push(token);
            }
            RequestEvent::Finished {
                reason,
                text: t,
                prompt_tokens,
                completion_tokens,
                held_blocks,
            } => {
                guard.finished = true;
                text.push_str(&t);
                return Ok(Json(meta.full(
                    &text,
                    reason.as_openai(),
                    prompt_tokens,
                    completion_tokens,
                    &tokens,
                    held_blocks.as_deref(),
                ))
                .into_response());
            }
            RequestEvent::Failed(e) => {
                guard.finished = !matches!(e, RequestError::Timeout(_));
                return Err(e.into());
            }
        }
    }
}

enum StreamPhase {
    Running,
    Done,
}

fn sse_stream(
    rx: UnboundedReceiver<RequestEvent>,
    guard: RequestGuard,
    meta: ResponseMeta,
    deadline: tokio::time::Instant,
    timeout: Duration,
) -> impl Stream<Item = Result<Event, std::convert::Infallible>> {
    let state = (
        rx,
        guard,
        meta,
        StreamPhase::Running,
        true,
        Vec::<Event>::new(),
    );
    stream::unfold(
        state,
        move |(mut rx, mut guard, meta, phase, mut first, mut pending)| async move {
            if let Some(ev) = pending.pop() {
                return Some((Ok(ev), (rx, guard, meta, phase, first, pending)));
            }
            if let StreamPhase::Done = phase {
                return None;
            }
            let data = |v: Value| Event::default().data(v.to_string());
            // Tokens whose text is not final yet (half a UTF-8 character, a possible stop string)
            // are carried into the next chunk rather than sent as empty chunks.
            let mut held: Vec<u32> = Vec::new();
            let ev = loop {
                match next_event(&mut rx, deadline, timeout).await {
                    RequestEvent::Token { text, token } => {
                        held.push(token);
                        if text.is_empty() && !(first && meta.chat) {
                            continue;
                        }
                        let e = data(meta.chunk(&text, None, first, &held));
                        first = false;
                        return Some((
                            Ok(e),
                            (rx, guard, meta, StreamPhase::Running, first, pending),
                        ));
                    }
                    RequestEvent::Finished {
                        reason,
                        text,
                        prompt_tokens,
                        completion_tokens,
                        ..
                    } => {
                        guard.finished = true;
                        // `pending` is emitted from its end.
                        pending.push(Event::default().data("[DONE]"));
                        if meta.include_usage {
                            pending.push(data(meta.usage_chunk(prompt_tokens, completion_tokens)));
                        }
                        break data(meta.chunk(&text, Some(reason.as_openai()), first, &held));
                    }
                    RequestEvent::Failed(e) => {
                        guard.finished = !matches!(e, RequestError::Timeout(_));
                        pending.push(Event::default().data("[DONE]"));
                        break data(openai::error_body(&e));
                    }
                }
            };
            Some((Ok(ev), (rx, guard, meta, StreamPhase::Done, false, pending)))
        },
    )
}

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
        let server = HttpServer::start(args.bind, router(args.app), "HTTP frontend").await?;
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
