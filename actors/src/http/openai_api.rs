//! The OpenAI-compatible routes of an instance: `POST /v1/completions`,
//! `POST /v1/chat/completions` (JSON or SSE), `GET /v1/models`. Requests are validated
//! ([`crate::openai`]), admitted under the instance's concurrency bound (503 beyond it),
//! tokenized and handed to the Scheduler; the answer streams back from the request's events.
//! A client that disconnects drops its handler, whose [`RequestStream`] aborts the request so
//! its KV blocks return to the pool. `kv_transfer_params` (vLLM's P/D fields) turn a request
//! into the prefill or the decode half of a hand-off. A request of `n` > 1 choices runs as `n`
//! scheduler requests: the first alone, the others once it has the prompt's KV (they take the
//! full prompt blocks from the prefix cache), merged into one answer or one SSE stream. A chat
//! with tools reads the model's calls out of its text as it is generated
//! ([`tools::CallParser`]): a stream sends content as it comes and each call as a start delta
//! then its arguments piece by piece; a whole answer is read by the same parser, so both agree.

use super::error::ApiError;
use super::state::AppState;
use crate::error::RequestError;
use crate::handoff::receiver::KvSource;
use crate::multimodal::{self, EncodedImage, MultimodalError};
use crate::openai::response::{
    Answer, Choice, Delta, FunctionDelta, Message, ToolCall, ToolCallDelta, UsageBody, CHAT_CHUNK,
    CHAT_COMPLETION, TEXT_COMPLETION,
};
use crate::openai::{self, KvDirective, PromptInput};
use crate::scheduler::{NewRequest, PromptImage, RequestEvent, RequestStream};
use crate::tools::{self, CallEvent, CallParser};
use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream, StreamExt};
use pdserve_gpu::grammar::GrammarCompiler;
use pdserve_gpu::sampling::TokenLogprobs;
use pdserve_runtime::ids::TransferId;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::OwnedSemaphorePermit;

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub(super) async fn models(State(app): State<Arc<AppState>>) -> Json<Value> {
    let created = unix_now();
    let data: Vec<Value> = app
        .served_names
        .iter()
        .map(|name| {
            json!({
                "id": name, "object": "model", "created": created, "owned_by": "pdserve",
                "root": app.own_model_name, "max_model_len": app.max_model_len,
            })
        })
        .collect();
    Json(json!({"object": "list", "data": data}))
}

pub(super) async fn completions(State(app): State<Arc<AppState>>, body: Bytes) -> Response {
    serve(app, body, false)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

pub(super) async fn chat_completions(State(app): State<Arc<AppState>>, body: Bytes) -> Response {
    serve(app, body, true)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// A running request (one choice of it): its events, and its admission permit (shared by
/// the request's choices) for its lifetime.
struct Running {
    events: RequestStream,
    /// An event read ahead (the first choice's first event, read before the other choices
    /// are submitted).
    ahead: Option<RequestEvent>,
    _permit: Arc<OwnedSemaphorePermit>,
}

impl Running {
    /// The next event, or a timeout (see [`next_event`]).
    async fn next(&mut self, deadline: tokio::time::Instant, timeout: Duration) -> RequestEvent {
        match self.ahead.take() {
            Some(e) => e,
            None => next_event(&mut self.events, deadline, timeout).await,
        }
    }
}

async fn serve(app: Arc<AppState>, body: Bytes, chat: bool) -> Result<Response, ApiError> {
    if app.encoder.is_some() {
        return Err(RequestError::BadRequest(
            "this is an encode instance (instance.role = \"encode\"): it encodes images (POST /v1/encode) and generates nothing; send completions to the proxy or to a colocated, prefill or decode instance".into(),
        )
        .into());
    }
    let mut req = openai::parse_request(&body, chat)?;
    drop(body);
    if let Some(m) = &req.model {
        if !app.serves_model(m) {
            return Err(RequestError::UnknownModel(m.clone()).into());
        }
    }
    let permit = Arc::new(app.admit()?);
    let urls = std::mem::take(&mut req.images);
    let images = prepare_images(&app, &req, urls).await?;
    if !req.more_prompts.is_empty() && req.kv_transfer_params.is_some() {
        return Err(RequestError::BadRequest("a list of prompts cannot be combined with kv_transfer_params (a hand-off carries one prompt's KV)".into()).into());
    }
    let deadline = tokio::time::Instant::now() + app.request_timeout;
    // Choices in OpenAI's order: prompt-major, `n` per prompt.
    let mut choices: Vec<(Running, ResponseMeta)> = Vec::new();
    for (j, input) in std::iter::once(&req.prompt)
        .chain(&req.more_prompts)
        .enumerate()
    {
        let (runs, meta) =
            start_prompt(&app, &req, input, &images, chat, &permit, deadline).await?;
        let id = choices.first().map(|(_, m)| m.id.clone());
        for (i, r) in runs.into_iter().enumerate() {
            let mut m = meta.for_choice(j * req.n + i);
            if let Some(id) = &id {
                m.id = id.clone();
            }
            choices.push((r, m));
        }
    }
    let timeout = app.request_timeout;
    if choices.len() == 1 {
        let (running, meta) = choices.pop().expect("one choice");
        return Ok(if req.stream {
            Sse::new(sse_stream(running, meta, deadline, timeout, StreamEnd::Own))
                .keep_alive(KeepAlive::default())
                .into_response()
        } else {
            Json(collect(running, meta, deadline, timeout).await?).into_response()
        });
    }
    let n = req.n;
    if req.stream {
        let usages = Arc::new(std::sync::Mutex::new(vec![None; choices.len()]));
        let last = choices[0].1.clone();
        let streams: Vec<_> = choices
            .into_iter()
            .map(|(r, meta)| {
                let end = StreamEnd::Shared(usages.clone());
                sse_stream(r, meta, deadline, timeout, end).boxed()
            })
            .collect();
        let tail = stream::once(async move {
            let mut out = Vec::new();
            let usage = usages
                .lock()
                .map(|u| total_usage(&u, n))
                .unwrap_or_default();
            if let (true, Some(u)) = (last.include_usage, usage) {
                out.push(Ok(sse_data(&last.usage_chunk(u))));
            }
            out.push(Ok(Event::default().data("[DONE]")));
            stream::iter(out)
        })
        .flatten();
        return Ok(Sse::new(stream::select_all(streams).chain(tail))
            .keep_alive(KeepAlive::default())
            .into_response());
    }
    let answers = futures_util::future::try_join_all(
        choices
            .into_iter()
            .map(|(r, meta)| collect(r, meta, deadline, timeout)),
    )
    .await?;
    let merged = merge_choices(answers, n)
        .ok_or_else(|| RequestError::Internal("a request of no choices".into()))?;
    Ok(Json(merged).into_response())
}

/// Compiles the request's grammar (structured output) on a blocking thread, so neither the
/// async workers nor the Scheduler wait on it; a grammar that cannot be compiled is a 400
/// naming the problem, before anything is queued.
async fn compile_grammar(
    app: &AppState,
    params: &pdserve_gpu::SamplingParams,
) -> Result<Option<pdserve_gpu::grammar::Constraint>, RequestError> {
    let Some(spec) = params.grammar.clone() else {
        return Ok(None);
    };
    let tokenizer = app.tokenizer.clone();
    tokio::task::spawn_blocking(move || GrammarCompiler::for_tokenizer(&tokenizer)?.compile(&spec))
        .await
        .map_err(|e| RequestError::Internal(format!("grammar compilation: {e}")))?
        .map(Some)
        .map_err(|e| RequestError::BadRequest(e.to_string()))
}

/// Checks and encodes a chat request's images (`image_url` parts) with the model's vision
/// tower on a blocking thread; every refusal is a 400 naming the image and the problem.
async fn prepare_images(
    app: &Arc<AppState>,
    req: &openai::ParsedRequest,
    urls: Vec<String>,
) -> Result<Vec<EncodedImage>, RequestError> {
    if urls.is_empty() {
        return Ok(Vec::new());
    }
    let Some(tower) = app.vision.clone() else {
        return Err(MultimodalError::TextOnlyModel(app.model_name.clone()).into());
    };
    let cfg = app.multimodal.clone();
    if urls.len() > cfg.max_images_per_request {
        return Err(MultimodalError::TooManyImages {
            count: urls.len(),
            max: cfg.max_images_per_request,
        }
        .into());
    }
    // E/P/D: the embeddings come from the encode instance the proxy named.
    if let Some(ec) = &req.ec_transfer_params {
        return fetch_images(app, tower, cfg, &ec.encoder_url, urls).await;
    }
    // vLLM's two hops send both instances the whole request, images included: the prefill
    // hop computes the prompt with the image rows, the decode hop keys its prefix cache by
    // the same digests and decodes unchanged. A decode instance that drives its prefill
    // itself sends the images by reference, so it needs an encode instance holding them.
    if app.kv.is_some() {
        let directive = openai::kv_directive(req.kv_transfer_params.as_ref(), app.tls.scheme())?;
        if matches!(directive, KvDirective::DriveRemote { .. }) {
            return Err(MultimodalError::NotColocated.into());
        }
    }
    encode_here(app, urls).await
}

/// Encodes a request's images on this instance's VisionEncoder (through its encoder cache).
async fn encode_here(app: &AppState, urls: Vec<String>) -> Result<Vec<EncodedImage>, RequestError> {
    match &app.vision_encoder {
        Some(encoder) => encoder.encode(urls).await,
        None => Err(MultimodalError::TextOnlyModel(app.model_name.clone()).into()),
    }
}

/// A request's images taken from the encode instance at `encoder`: each URL checked as for
/// encoding, the images' plans — digests, tile grids, sub-images' digests — read from their
/// headers (off the async threads), the sub-images' embeddings taken from this instance's
/// encoder cache or that encoder. An image the encoder no longer holds (its cache evicted it
/// since `POST /v1/encode`) is encoded here instead.
async fn fetch_images(
    app: &Arc<AppState>,
    tower: Arc<pdserve_gpu::vision::VisionTower>,
    cfg: pdserve_runtime::config::MultimodalSection,
    encoder: &str,
    urls: Vec<String>,
) -> Result<Vec<EncodedImage>, RequestError> {
    let Some(resolver) = app.images.clone() else {
        return Err(RequestError::BadRequest(
            "ec_transfer_params: this instance has no transfer engine to take image embeddings with (configure [transfer])".into(),
        ));
    };
    let checked = urls.clone();
    let grids_and_digests = tokio::task::spawn_blocking(move || {
        multimodal::plan_images(tower.config(), &cfg, &checked).map(|planned| {
            let grids: Vec<_> = planned
                .iter()
                .map(|(_, p)| (p.grid, p.parts.len()))
                .collect();
            let digests: Vec<_> = planned.into_iter().flat_map(|(_, p)| p.parts).collect();
            (grids, digests)
        })
    })
    .await
    .map_err(|e| RequestError::Internal(format!("image digests: {e}")))??;
    let (grids, digests) = grids_and_digests;
    match resolver.resolve(encoder, &digests).await {
        Ok(embeds) => {
            let mut embeds = embeds.into_iter();
            Ok(grids
                .into_iter()
                .map(|(grid, n)| EncodedImage {
                    grid,
                    parts: embeds.by_ref().take(n).collect(),
                })
                .collect())
        }
        Err(crate::encode::EncoderError::NotCached(digest)) => {
            tracing::info!(%encoder, %digest, "the encoder no longer holds an image: encoding here");
            encode_here(app, urls).await
        }
        Err(error) => Err(RequestError::Encoder {
            encoder: encoder.to_string(),
            error,
        }),
    }
}

/// Starts the `n` choices of one prompt of `req`: their events and the answer's metadata (for
/// choice 0 of this prompt).
async fn start_prompt(
    app: &Arc<AppState>,
    req: &openai::ParsedRequest,
    input: &PromptInput,
    images: &[EncodedImage],
    chat: bool,
    permit: &Arc<OwnedSemaphorePermit>,
    deadline: tokio::time::Instant,
) -> Result<(Vec<Running>, ResponseMeta), ApiError> {
    let (prompt, prompt_images) = if images.is_empty() {
        (tokenize(app, input)?, Vec::new())
    } else {
        tokenize_with_images(app, input, images)?
    };
    let score_only = req.scores_only();
    let max_tokens = openai::resolve_max_tokens(
        req.max_tokens_to_run(),
        chat,
        prompt.len(),
        app.max_model_len,
    )?;
    let mut params = req.params.clone();
    params.max_tokens = max_tokens;
    params
        .validate(app.vocab_size)
        .map_err(|e| RequestError::BadRequest(e.to_string()))?;
    let constraint = compile_grammar(app, &params).await?;

    if let Some(bad) = req
        .resume_tokens
        .iter()
        .find(|&&t| t as usize >= app.vocab_size)
    {
        return Err(RequestError::BadRequest(format!(
            "resume_tokens: token id {bad} is outside the vocabulary of {}",
            app.vocab_size
        ))
        .into());
    }
    let directive = openai::kv_directive(req.kv_transfer_params.as_ref(), app.tls.scheme())?;
    if !matches!(directive, KvDirective::None) && app.kv.is_none() {
        return Err(RequestError::BadRequest("kv_transfer_params need an instance with a KV transfer engine (role prefill or decode)".into()).into());
    }
    let prompt_logprobs = params.prompt_logprobs.is_some();
    if req.n > 1 && matches!(directive, KvDirective::HoldForDecode(_)) {
        return Err(RequestError::BadRequest("`n` > 1 with kv_transfer_params.do_remote_decode: the prefill hop computes one first token; send `n` to the decode hop (or through pdserve's proxy)".into()).into());
    }
    match &directive {
        KvDirective::HoldForDecode(_) | KvDirective::FromPrefill { .. } if prompt_logprobs => {
            return Err(RequestError::BadRequest("`echo` with `logprobs` (prompt logprobs) is computed where the prompt's answer is made: send it without vLLM's two-hop kv_transfer_params (pdserve's one-hop flow prefills such a request on the decode instance)".into()).into());
        }
        KvDirective::FromPrefill {
            first_token,
            first_logprobs,
            ..
        } => {
            // What the prefill instance sent for T0 must be what this request asks.
            let asked = params.logprobs.map(|n| n as usize);
            let problem = match (first_logprobs, asked) {
                (None, None) => None,
                (Some(_), None) => Some("given, but the request asks no `logprobs`".to_string()),
                (None, Some(_)) => Some("missing: the request asks `logprobs`".to_string()),
                (Some(lp), Some(n)) => lp.validate(app.vocab_size, n).err().map(|e| e.to_string()),
            };
            if let Some(p) = problem {
                return Err(RequestError::BadRequest(format!(
                    "kv_transfer_params.first_token_logprobs (first token {first_token}): {p}"
                ))
                .into());
            }
        }
        _ => {}
    }
    let id = app.scheduler.next_request_id();
    let token_ids = req.return_token_ids.then(|| prompt.clone());
    let echo = if req.echo {
        let text = match input {
            PromptInput::Text(t) => t.clone(),
            _ => app
                .tokenizer
                .decode(&prompt, false)
                .map_err(|e| RequestError::Internal(e.to_string()))?,
        };
        Some(Echo {
            text,
            first_token: prompt[0],
        })
    } else {
        None
    };
    let logprobs = params.logprobs.is_some();
    let resumed_text = match (&req.tools, req.resume_tokens.is_empty()) {
        (Some(_), false) => Some(
            app.tokenizer
                .decode(&req.resume_tokens, true)
                .map_err(|e| RequestError::Internal(e.to_string()))?,
        ),
        _ => None,
    };
    // Choices after the first: the same prompt, seed + i.
    let branch_base = (req.n > 1).then(|| {
        (
            prompt.clone(),
            params.clone(),
            constraint.clone(),
            prompt_images.clone(),
        )
    });
    let remote_kv = !matches!(directive, KvDirective::None);
    let mut hand_off = None;
    let mut request = NewRequest {
        id,
        prompt,
        params,
        hold_for: None,
        push: false,
        resume: req.resume_tokens.clone(),
        constraint,
        images: prompt_images,
    };
    let scheduler = &app.scheduler;
    let events = match (directive, app.kv.as_ref()) {
        (KvDirective::None, _) => scheduler.submit(request)?,
        (KvDirective::HoldForDecode(transfer), _) => {
            if req.stream {
                return Err(RequestError::BadRequest("do_remote_decode needs `stream: false` (the answer carries kv_transfer_params)".into()).into());
            }
            tracing::info!(request = %id, %transfer, "prefill for a remote decode");
            hand_off = Some(transfer);
            request.hold_for = Some(transfer);
            scheduler.submit(request)?
        }
        (
            KvDirective::FromPrefill {
                peer,
                transfer,
                block_ids,
                first_token,
                first_logprobs,
                lease,
                cached_tokens,
            },
            Some(kv),
        ) => {
            if cached_tokens as usize >= request.prompt.len() {
                return Err(RequestError::BadRequest(format!(
                    "kv_transfer_params.cached_tokens: {cached_tokens} of a {}-token prompt (at most all but its last token)",
                    request.prompt.len()
                ))
                .into());
            }
            let peer = kv
                .peers
                .addr_of(&peer.url, peer.control, peer.engine_id.as_deref());
            tracing::info!(request = %id, %transfer, prefill = %peer, "decoding from held KV");
            let source = KvSource::Held {
                peer,
                transfer,
                block_ids,
                first_token,
                first_logprobs,
                lease,
                cached_tokens,
            };
            scheduler.submit_remote(request, source)?
        }
        (KvDirective::DriveRemote { peer, transfer }, Some(kv)) => {
            let threshold = kv.settings.min_remote_prompt_tokens;
            if prompt_logprobs {
                // Every prompt token's logits are needed here, not only the KV.
                tracing::info!(request = %id, %transfer, "prefilling locally: prompt logprobs");
                metrics::counter!(pdserve_runtime::telemetry::LOCAL_PREFILLS_TOTAL, pdserve_runtime::telemetry::LABEL_REASON => "prompt_logprobs").increment(1);
                scheduler.submit(request)?
            } else if request.prompt.len() < threshold {
                // Conditional disaggregation: a short prompt costs less here than a hand-off.
                tracing::info!(request = %id, %transfer, prompt_tokens = request.prompt.len(), threshold, "prefilling locally: short prompt");
                metrics::counter!(pdserve_runtime::telemetry::LOCAL_PREFILLS_TOTAL, pdserve_runtime::telemetry::LABEL_REASON => "short_prompt").increment(1);
                scheduler.submit(request)?
            } else {
                let peer = kv
                    .peers
                    .addr_of(&peer.url, peer.control, peer.engine_id.as_deref());
                tracing::info!(request = %id, %transfer, prefill = %peer, "remote prefill");
                let encoder = req
                    .ec_transfer_params
                    .as_ref()
                    .map(|e| e.encoder_url.clone());
                scheduler.submit_remote(
                    request,
                    KvSource::Drive {
                        peer,
                        transfer,
                        encoder,
                    },
                )?
            }
        }
        (_, None) => unreachable!("checked above: kv_transfer_params need a KV engine"),
    };
    let mut runs = vec![Running {
        events,
        ahead: None,
        _permit: permit.clone(),
    }];
    if let Some((prompt, params, constraint, images)) = branch_base {
        // The other choices start once the first has its prompt's KV (its first event): their
        // full prompt blocks then come from the prefix cache — on a decode instance, the
        // blocks the hand-off brought — so the prompt is prefilled (and handed over) once.
        let first = next_event(&mut runs[0].events, deadline, app.request_timeout).await;
        if let RequestEvent::Failed(e) = first {
            return Err(e.into());
        }
        runs[0].ahead = Some(first);
        for i in 1..req.n {
            let mut params = params.clone();
            params.seed = params.seed.map(|s| s.wrapping_add(i as u64));
            if remote_kv {
                metrics::counter!(pdserve_runtime::telemetry::LOCAL_PREFILLS_TOTAL, pdserve_runtime::telemetry::LABEL_REASON => "parallel_sampling").increment(1);
            }
            let branch = NewRequest {
                id: scheduler.next_request_id(),
                prompt: prompt.clone(),
                params,
                hold_for: None,
                push: false,
                resume: Vec::new(),
                constraint: constraint.clone(),
                images: images.clone(),
            };
            runs.push(Running {
                events: scheduler.submit(branch)?,
                ahead: None,
                _permit: permit.clone(),
            });
        }
    }
    let meta = ResponseMeta {
        index: 0,
        id: format!("{}-{}", if chat { "chatcmpl" } else { "cmpl" }, id.0),
        created: unix_now(),
        model: app.model_name.clone(),
        chat,
        include_usage: req.include_usage,
        resumed: !req.resume_tokens.is_empty(),
        token_ids,
        tokenizer: app.tokenizer.clone(),
        logprobs,
        echo,
        score_only,
        tools: req.tools.is_some(),
        resumed_text,
        lease_ms: app
            .kv
            .as_ref()
            .map_or(0, |k| k.settings.lease.as_millis() as u64),
        hand_off: hand_off.map(|t| HandOff {
            transfer: t,
            engine_id: app
                .kv
                .as_ref()
                .map(|k| k.settings.engine_id.clone())
                .unwrap_or_default(),
            addr: app.addr.get().copied(),
            control: app.control_addr(),
        }),
    };
    Ok((runs, meta))
}

/// The usage of a request of several choices, `n` per prompt in prompt-major order: each
/// prompt counted once (with its cached tokens, those of its first choice) and every choice's
/// completion tokens; `None` until every choice ended.
fn total_usage(choices: &[Option<openai::Usage>], n: usize) -> Option<openai::Usage> {
    choices
        .iter()
        .enumerate()
        .try_fold(openai::Usage::default(), |mut total, (i, u)| {
            let u = u.as_ref()?;
            if i % n.max(1) == 0 {
                total.prompt_tokens += u.prompt_tokens;
                total.cached_tokens += u.cached_tokens;
            }
            total.completion_tokens += u.completion_tokens;
            Some(total)
        })
}

/// One answer of several choices (each a whole answer of its own, in choice order, `n` per
/// prompt): their choices, the first's id, usage as [`total_usage`].
fn merge_choices(answers: Vec<Answer>, n: usize) -> Option<Answer> {
    let usages: Vec<_> = answers
        .iter()
        .map(|a| a.usage.map(openai::Usage::from))
        .collect();
    let mut answers = answers.into_iter();
    let mut out = answers.next()?;
    out.choices.truncate(1);
    out.choices
        .extend(answers.flat_map(|a| a.choices.into_iter().take(1)));
    out.usage = total_usage(&usages, n).map(UsageBody::from);
    Some(out)
}

/// A chat with images as the model's prompt: rendered, each image's place turned into its
/// rows' placeholder tokens ([`multimodal::splice_prompt`]).
fn tokenize_with_images(
    app: &AppState,
    prompt: &PromptInput,
    images: &[EncodedImage],
) -> Result<(Vec<u32>, Vec<PromptImage>), RequestError> {
    let (PromptInput::Chat(messages), Some(tower)) = (prompt, &app.vision) else {
        return Err(MultimodalError::Unsupported(
            "images come in chat messages' image_url parts".into(),
        )
        .into());
    };
    let rendered = app
        .chat_template
        .render(messages, true)
        .map_err(|e| RequestError::BadRequest(e.to_string()))?;
    let (ids, placed) =
        multimodal::splice_prompt(&app.tokenizer, &rendered, images, tower.config())?;
    if let Some(bad) = ids.iter().find(|&&t| t as usize >= app.vocab_size) {
        return Err(RequestError::BadRequest(format!(
            "token id {bad} is outside the vocabulary of {}",
            app.vocab_size
        )));
    }
    Ok((ids, placed))
}

fn tokenize(app: &AppState, prompt: &PromptInput) -> Result<Vec<u32>, RequestError> {
    let ids = prompt
        .token_ids(&app.tokenizer, &app.chat_template)
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

/// Prefill side of vLLM's two-hop flow: what the answer's `kv_transfer_params` name.
#[derive(Clone)]
struct HandOff {
    transfer: TransferId,
    engine_id: String,
    addr: Option<SocketAddr>,
    control: Option<SocketAddr>,
}

/// Completions' `echo`: the prompt's text, and its first token (whose logprob is null).
#[derive(Clone)]
struct Echo {
    text: String,
    first_token: u32,
}

#[derive(Clone)]
struct ResponseMeta {
    /// The choice's index (`n` > 1: one meta per choice).
    index: usize,
    id: String,
    created: u64,
    model: String,
    chat: bool,
    include_usage: bool,
    /// A migrated request continuing an earlier attempt: its stream carries on the one the
    /// client already has (no second `role` delta in chat).
    resumed: bool,
    /// `Some(prompt ids)` when the client asked for token ids.
    token_ids: Option<Vec<u32>>,
    /// Renders logprobs' token texts.
    tokenizer: pdserve_gpu::Tokenizer,
    /// The client asked for logprobs.
    logprobs: bool,
    /// The prompt to echo (completions' `echo`).
    echo: Option<Echo>,
    /// `echo` with `max_tokens` 0: the one token generated is not reported.
    score_only: bool,
    hand_off: Option<HandOff>,
    /// How long held blocks wait for the decode side, in ms (published with them).
    lease_ms: u64,
    /// Chat with tools the model may call: its calls are parsed into `tool_calls`.
    tools: bool,
    /// Chat with tools continuing an earlier attempt (`resume_tokens`): the text that attempt
    /// generated, read by the stream's call parser first (the client has its events).
    resumed_text: Option<String>,
}

impl ResponseMeta {
    /// This meta for choice `index`.
    fn for_choice(&self, index: usize) -> Self {
        Self {
            index,
            ..self.clone()
        }
    }

    /// An answer or chunk of this request with `choices`.
    fn answer(&self, object: &'static str, choices: Vec<Choice>) -> Answer {
        Answer {
            id: self.id.clone(),
            object,
            created: self.created,
            model: self.model.clone(),
            choices,
            usage: None,
            kv_transfer_params: None,
        }
    }

    fn chunk(
        &self,
        text: &str,
        finish: Option<&'static str>,
        first: bool,
        tokens: &[u32],
        logprobs: Option<Value>,
    ) -> Answer {
        let mut choice = if self.chat {
            let delta = if first {
                Delta::content(text).opening()
            } else if finish.is_some() && text.is_empty() {
                Delta::default()
            } else {
                Delta::content(text)
            };
            Choice::delta(self.index, delta)
        } else {
            Choice::text(self.index, text)
        };
        choice.finish_reason = finish;
        choice.logprobs = logprobs;
        if self.token_ids.is_some() {
            choice.token_ids = Some(tokens.to_vec());
        }
        let object = if self.chat {
            CHAT_CHUNK
        } else {
            TEXT_COMPLETION
        };
        self.answer(object, vec![choice])
    }

    /// The `logprobs` value of the generated tokens `lps` (and, with `echo`, of the prompt
    /// first: `prompt` holds prompt tokens 2.. and `echo_first` is set on the first piece of
    /// the answer); `None` when the client asked for none. `offset` is the completions' text
    /// offset counter.
    fn logprobs_value(
        &self,
        prompt: Option<&[TokenLogprobs]>,
        echo_first: bool,
        lps: &[TokenLogprobs],
        offset: &mut usize,
    ) -> Option<Value> {
        if !self.logprobs {
            return None;
        }
        if self.chat {
            return Some(openai::chat_logprobs(&self.tokenizer, lps));
        }
        let mut entries: Vec<(u32, Option<&TokenLogprobs>)> = Vec::new();
        if let (true, Some(e)) = (echo_first, &self.echo) {
            entries.push((e.first_token, None));
        }
        entries.extend(
            prompt
                .unwrap_or_default()
                .iter()
                .map(|t| (t.token, Some(t))),
        );
        entries.extend(lps.iter().map(|t| (t.token, Some(t))));
        Some(openai::completion_logprobs(
            &self.tokenizer,
            &entries,
            offset,
        ))
    }

    /// The id of the choice's call `k`, the same streamed and not.
    fn call_id(&self, k: usize) -> String {
        let id = self.id.trim_start_matches("chatcmpl-");
        format!("call_{id}_{}_{k}", self.index)
    }

    /// The calls the model wrote in `text`, when the request has tools: the content before
    /// them and OpenAI's `tool_calls` entries.
    fn tool_calls(&self, text: &str) -> Option<(Option<String>, Vec<ToolCall>)> {
        if !self.tools {
            return None;
        }
        let (content, calls) = tools::parse_calls(text)?;
        let calls = calls
            .iter()
            .enumerate()
            .map(|(k, c)| c.to_openai(&self.call_id(k)))
            .collect();
        Some((content, calls))
    }

    /// The streamed deltas of what the call parser read, in order: content runs as
    /// `{"content"}`, a call's start as `{"tool_calls": [{index, id, type, function: {name,
    /// arguments: ""}}]}`, each run of its arguments' pieces as `{"tool_calls": [{index,
    /// function: {arguments}}]}`.
    fn call_deltas(&self, events: Vec<CallEvent>) -> Vec<Delta> {
        let mut deltas: Vec<Delta> = Vec::new();
        // The kind of the last delta, to join runs: content, or call k's arguments.
        let mut last: Option<Option<usize>> = None;
        for e in events {
            match e {
                CallEvent::Content(t) => {
                    if last == Some(None) {
                        if let Some(Some(c)) = deltas.last_mut().and_then(|d| d.content.as_mut()) {
                            c.push_str(&t);
                            continue;
                        }
                    }
                    deltas.push(Delta::content(t));
                    last = Some(None);
                }
                CallEvent::CallStart { index, name } => {
                    let start = ToolCallDelta {
                        index,
                        id: Some(self.call_id(index)),
                        kind: Some("function"),
                        function: FunctionDelta {
                            name: Some(name),
                            arguments: String::new(),
                        },
                    };
                    deltas.push(Delta {
                        tool_calls: Some(vec![start]),
                        ..Delta::default()
                    });
                    last = None;
                }
                CallEvent::ArgsDelta { index, text } => {
                    if last == Some(Some(index)) {
                        if let Some(call) = deltas
                            .last_mut()
                            .and_then(|d| d.tool_calls.as_mut())
                            .and_then(|calls| calls.first_mut())
                        {
                            call.function.arguments.push_str(&text);
                            continue;
                        }
                    }
                    let args = ToolCallDelta {
                        index,
                        id: None,
                        kind: None,
                        function: FunctionDelta {
                            name: None,
                            arguments: text,
                        },
                    };
                    deltas.push(Delta {
                        tool_calls: Some(vec![args]),
                        ..Delta::default()
                    });
                    last = Some(Some(index));
                }
                CallEvent::CallEnd { .. } => {}
            }
        }
        deltas
    }

    /// `chunk` as one that carries no tokens: `token_ids: []` when the client asked for ids
    /// (the tokens rode on an earlier chunk).
    fn with_no_tokens(&self, mut chunk: Answer) -> Answer {
        if self.token_ids.is_some() {
            for choice in &mut chunk.choices {
                choice.token_ids = Some(Vec::new());
            }
        }
        chunk
    }

    /// A chat chunk of `delta` (with the `role` when it opens the choice).
    fn delta_chunk(&self, delta: Delta, first: bool) -> Answer {
        let delta = if first { delta.opening() } else { delta };
        self.answer(CHAT_CHUNK, vec![Choice::delta(self.index, delta)])
    }

    fn usage_chunk(&self, usage: openai::Usage) -> Answer {
        let object = if self.chat {
            CHAT_CHUNK
        } else {
            TEXT_COMPLETION
        };
        Answer {
            usage: Some(usage.into()),
            ..self.answer(object, Vec::new())
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn full(
        &self,
        text: &str,
        finish: &'static str,
        usage: openai::Usage,
        tokens: &[u32],
        held: Option<&[u32]>,
        logprobs: Option<Value>,
        first_logprobs: Option<&TokenLogprobs>,
    ) -> Answer {
        let (mut choice, object) = if self.chat {
            let (message, finish) = match self.tool_calls(text) {
                Some((content, calls)) => (Message::assistant(content, Some(calls)), "tool_calls"),
                None => (Message::assistant(Some(text.to_string()), None), finish),
            };
            let mut choice = Choice::message(self.index, message);
            choice.finish_reason = Some(finish);
            (choice, CHAT_COMPLETION)
        } else {
            let mut choice = Choice::text(self.index, text);
            choice.finish_reason = Some(finish);
            (choice, TEXT_COMPLETION)
        };
        choice.logprobs = logprobs;
        if let Some(prompt_ids) = &self.token_ids {
            choice.token_ids = Some(tokens.to_vec());
            choice.prompt_token_ids = Some(prompt_ids.clone());
        }
        let mut answer = Answer {
            usage: Some(usage.into()),
            ..self.answer(object, vec![choice])
        };
        if let (Some(h), Some(blocks)) = (&self.hand_off, held) {
            let params = openai::KvTransferParams {
                do_remote_decode: false,
                do_remote_prefill: true,
                remote_host: h.addr.map(|a| a.ip().to_string()),
                remote_port: h.addr.map(|a| a.port()),
                remote_engine_id: Some(h.engine_id.clone()),
                remote_control_addr: h.control.map(|a| a.to_string()),
                remote_block_ids: Some(blocks.to_vec()),
                transfer_id: h.transfer.to_string(),
                first_token_id: tokens.first().copied(),
                first_token_logprobs: first_logprobs.cloned(),
                kv_lease_ms: Some(self.lease_ms),
                cached_tokens: u32::try_from(usage.cached_tokens).ok(),
            };
            answer.kv_transfer_params = Some(params);
        }
        answer
    }
}

/// One SSE event of an answer chunk.
fn sse_data(answer: &Answer) -> Event {
    // Serializing these types cannot fail (string keys, no maps of other keys).
    Event::default().data(serde_json::to_string(answer).unwrap_or_default())
}

/// The next event, or a timeout (which leaves the request to be aborted on drop).
async fn next_event(
    events: &mut RequestStream,
    deadline: tokio::time::Instant,
    timeout: Duration,
) -> RequestEvent {
    match tokio::time::timeout_at(deadline, events.next()).await {
        Ok(Some(e)) => e,
        Ok(None) => RequestEvent::Failed(RequestError::Internal(
            "the scheduler dropped the request".into(),
        )),
        Err(_) => {
            events.abort_on_drop();
            RequestEvent::Failed(RequestError::Timeout(timeout.as_secs()))
        }
    }
}

async fn collect(
    mut running: Running,
    meta: ResponseMeta,
    deadline: tokio::time::Instant,
    timeout: Duration,
) -> Result<Answer, ApiError> {
    let mut text = String::new();
    let mut tokens = Vec::new();
    let mut lps = Vec::new();
    let mut prompt_lps = None;
    loop {
        match running.next(deadline, timeout).await {
            RequestEvent::Token {
                text: t,
                token,
                logprobs,
            } => {
                text.push_str(&t);
                tokens.push(token);
                lps.extend(logprobs);
            }
            RequestEvent::PromptLogprobs(p) => prompt_lps = Some(p),
            RequestEvent::Finished {
                reason,
                text: t,
                mut usage,
                held_blocks,
            } => {
                text.push_str(&t);
                let mut finish = reason.as_openai();
                if meta.score_only {
                    text.clear();
                    tokens.clear();
                    lps.clear();
                    usage.completion_tokens = 0;
                    finish = "length";
                }
                if let Some(e) = &meta.echo {
                    text.insert_str(0, &e.text);
                }
                let logprobs = meta.logprobs_value(prompt_lps.as_deref(), true, &lps, &mut 0);
                return Ok(meta.full(
                    &text,
                    finish,
                    usage,
                    &tokens,
                    held_blocks.as_deref(),
                    logprobs,
                    lps.first(),
                ));
            }
            RequestEvent::Failed(e) => return Err(e.into()),
        }
    }
}

/// How a choice's event stream ends.
enum StreamEnd {
    /// The request's only choice: it sends the usage chunk (when asked) and `[DONE]` itself.
    Own,
    /// One of several choices: it records its usage in its slot (by choice index) and leaves
    /// the usage chunk and `[DONE]` to the merged stream.
    Shared(Arc<std::sync::Mutex<Vec<Option<openai::Usage>>>>),
}

fn sse_stream(
    running: Running,
    meta: ResponseMeta,
    deadline: tokio::time::Instant,
    timeout: Duration,
    end: StreamEnd,
) -> impl Stream<Item = Result<Event, std::convert::Infallible>> {
    struct S {
        end: StreamEnd,
        running: Running,
        meta: ResponseMeta,
        done: bool,
        first: bool,
        /// The prompt is still to be echoed (completions' `echo`).
        echo_pending: bool,
        /// The prompt's logprobs, until the echo sends them.
        prompt_lps: Option<Vec<TokenLogprobs>>,
        /// Completions' text offset of the next token's logprobs.
        offset: usize,
        /// Events to send before the next read, emitted from the end.
        pending: Vec<Event>,
        /// Chat with tools: reads the calls out of the answer's text as it comes (content,
        /// then each call's start and its arguments piece by piece, as `delta.tool_calls`).
        calls: Option<CallParser>,
    }
    let calls = meta.tools.then(|| {
        let mut parser = CallParser::new();
        if let Some(earlier) = &meta.resumed_text {
            // What the earlier attempt read; its events reached the client through it.
            parser.push(earlier, &mut Vec::new());
        }
        parser
    });
    let state = S {
        calls,
        end,
        first: !meta.resumed,
        echo_pending: meta.echo.is_some() && !meta.resumed,
        running,
        meta,
        done: false,
        prompt_lps: None,
        offset: 0,
        pending: Vec::new(),
    };
    stream::unfold(state, move |mut s| async move {
        if let Some(ev) = s.pending.pop() {
            return Some((Ok(ev), s));
        }
        if s.done {
            return None;
        }
        let data = |a: Answer| sse_data(&a);
        // Tokens whose text is not final yet (half a UTF-8 character, a possible stop string)
        // are carried into the next chunk rather than sent as empty chunks.
        let mut held: Vec<u32> = Vec::new();
        let mut held_lps: Vec<TokenLogprobs> = Vec::new();
        let ev = loop {
            let event = s.running.next(deadline, timeout).await;
            if let RequestEvent::PromptLogprobs(p) = event {
                s.prompt_lps = Some(p);
                continue;
            }
            // The echoed prompt (with its logprobs) goes first, as a chunk of its own.
            let mut echoed = None;
            if s.echo_pending && !matches!(event, RequestEvent::Failed(_)) {
                s.echo_pending = false;
                let prompt_lps = s.prompt_lps.take();
                let lp = s
                    .meta
                    .logprobs_value(prompt_lps.as_deref(), true, &[], &mut s.offset);
                let text = s
                    .meta
                    .echo
                    .as_ref()
                    .map(|e| e.text.clone())
                    .unwrap_or_default();
                echoed = Some(data(s.meta.chunk(&text, None, s.first, &[], lp)));
                s.first = false;
            }
            match event {
                RequestEvent::PromptLogprobs(_) => unreachable!("handled above"),
                RequestEvent::Token { .. } if s.meta.score_only => {
                    if let Some(e) = echoed {
                        return Some((Ok(e), s));
                    }
                }
                RequestEvent::Token {
                    text,
                    token,
                    logprobs,
                } => {
                    held.push(token);
                    held_lps.extend(logprobs);
                    if let Some(parser) = &mut s.calls {
                        let mut events = Vec::new();
                        parser.push(&text, &mut events);
                        let mut deltas = s.meta.call_deltas(events).into_iter();
                        let Some(delta) = deltas.next() else {
                            // Held by the parser: its tokens go with the next chunk.
                            continue;
                        };
                        // The tokens (and their logprobs) ride on the first chunk.
                        let mut chunk = s.meta.delta_chunk(delta, s.first);
                        let lp = s.meta.logprobs_value(None, false, &held_lps, &mut s.offset);
                        if let Some(choice) = chunk.choices.first_mut() {
                            if s.meta.token_ids.is_some() {
                                choice.token_ids = Some(std::mem::take(&mut held));
                            }
                            choice.logprobs = lp;
                        }
                        s.first = false;
                        let mut rest: Vec<Event> = deltas
                            .map(|d| data(s.meta.with_no_tokens(s.meta.delta_chunk(d, false))))
                            .collect();
                        rest.reverse();
                        s.pending.extend(rest);
                        return Some((Ok(data(chunk)), s));
                    }
                    if text.is_empty() && !(s.first && s.meta.chat) && echoed.is_none() {
                        continue;
                    }
                    let lp = s.meta.logprobs_value(None, false, &held_lps, &mut s.offset);
                    let e = data(s.meta.chunk(&text, None, s.first, &held, lp));
                    s.first = false;
                    return Some((
                        Ok(match echoed {
                            Some(echo) => {
                                s.pending.push(e);
                                echo
                            }
                            None => e,
                        }),
                        s,
                    ));
                }
                RequestEvent::Finished {
                    reason,
                    text,
                    mut usage,
                    ..
                } => {
                    let (mut text, mut finish) = (text, reason.as_openai());
                    if s.meta.score_only {
                        (held, held_lps) = (Vec::new(), Vec::new());
                        text.clear();
                        usage.completion_tokens = 0;
                        finish = "length";
                    }
                    match &s.end {
                        StreamEnd::Own => {
                            s.pending.push(Event::default().data("[DONE]"));
                            if s.meta.include_usage {
                                s.pending.push(data(s.meta.usage_chunk(usage)));
                            }
                        }
                        StreamEnd::Shared(usages) => {
                            if let Some(slot) = usages
                                .lock()
                                .ok()
                                .as_deref_mut()
                                .and_then(|u| u.get_mut(s.meta.index))
                            {
                                *slot = Some(usage);
                            }
                        }
                    }
                    let lp = (!held_lps.is_empty())
                        .then(|| s.meta.logprobs_value(None, false, &held_lps, &mut s.offset))
                        .flatten();
                    let mut deltas = Vec::new();
                    if let Some(mut parser) = s.calls.take() {
                        let mut events = Vec::new();
                        parser.push(&text, &mut events);
                        parser.finish(&mut events);
                        deltas = s.meta.call_deltas(events);
                        text.clear();
                        if parser.calls() > 0 {
                            finish = "tool_calls";
                        }
                    }
                    // The parser's last deltas go before the finishing chunk, which carries
                    // the tokens not sent yet (`pending` is emitted from the end).
                    let first = s.first && deltas.is_empty();
                    s.pending
                        .push(data(s.meta.chunk(&text, Some(finish), first, &held, lp)));
                    for (k, delta) in deltas.into_iter().enumerate().rev() {
                        let c = s.meta.delta_chunk(delta, s.first && k == 0);
                        s.pending.push(data(s.meta.with_no_tokens(c)));
                    }
                    s.first = false;
                    break echoed.unwrap_or_else(|| s.pending.pop().expect("just pushed"));
                }
                RequestEvent::Failed(e) => {
                    if matches!(s.end, StreamEnd::Own) {
                        s.pending.push(Event::default().data("[DONE]"));
                    }
                    break Event::default().data(openai::error_body(&e).to_string());
                }
            }
        };
        s.done = true;
        Some((Ok(ev), s))
    })
}
