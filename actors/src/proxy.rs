//! The Proxy actor: the HTTP front door of a P/D cluster.
//!
//! It keeps a registry of prefill and decode instances, polls each one's `/v1/load` every
//! [`POLL_INTERVAL`] (an instance that misses [`MISSED_POLLS_TO_DROP`] polls in a row is
//! dropped from routing until it answers again), validates requests as an instance does, picks
//! the least-loaded prefill and decode instance (queued + running requests, then free KV
//! blocks; round-robin between equals), and drives the two hops of a vLLM-style P/D proxy:
//! the prefill instance gets the request with `max_tokens: 1`, `stream: false` and
//! `kv_transfer_params.do_remote_decode`; the decode instance gets the original request with
//! the `kv_transfer_params` that came back, and its answer (JSON or `text/event-stream`) is
//! streamed to the client. Every upstream call has a timeout; no instance of a role → 503. A
//! client that goes away drops the upstream stream, which aborts the request on the decode
//! instance.
//!
//! Supervised by whoever starts it (`pdserve proxy`, `pdserve launch`); a failure stops the
//! proxy with an error.

use crate::error::RequestError;
use crate::openai;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often the proxy asks each instance for its load.
pub const POLL_INTERVAL: Duration = Duration::from_millis(500);
/// Polls an instance may miss in a row before it stops getting requests.
pub const MISSED_POLLS_TO_DROP: u32 = 3;

/// Role of a registered instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Runs prompts.
    Prefill,
    /// Generates from transferred KV.
    Decode,
}

#[derive(Debug, Clone)]
struct Upstream {
    url: String,
    role: Role,
    load: Option<(usize, usize)>,
    missed: u32,
}

/// The registry of instances, as a pure structure (tested without HTTP).
#[derive(Debug, Default)]
pub struct Registry {
    instances: Vec<Upstream>,
    rr: AtomicUsize,
}

impl Registry {
    /// Registers an instance.
    pub fn add(&mut self, role: Role, url: impl Into<String>) {
        self.instances.push(Upstream {
            url: url.into(),
            role,
            load: None,
            missed: MISSED_POLLS_TO_DROP,
        });
    }

    /// Records a poll: `Some((queued + running, free blocks))`, or `None` when it failed.
    pub fn record(&mut self, url: &str, load: Option<(usize, usize)>) {
        if let Some(u) = self.instances.iter_mut().find(|u| u.url == url) {
            match load {
                Some(l) => {
                    u.load = Some(l);
                    u.missed = 0;
                }
                None => u.missed = u.missed.saturating_add(1),
            }
        }
    }

    /// Instances of `role` that answered recently.
    pub fn alive(&self, role: Role) -> Vec<String> {
        self.instances
            .iter()
            .filter(|u| u.role == role && u.missed < MISSED_POLLS_TO_DROP)
            .map(|u| u.url.clone())
            .collect()
    }

    /// The least-loaded live instance of `role` (fewest queued+running, then most free
    /// blocks), round-robin among equals.
    pub fn pick(&self, role: Role) -> Option<String> {
        let live: Vec<&Upstream> = self
            .instances
            .iter()
            .filter(|u| u.role == role && u.missed < MISSED_POLLS_TO_DROP)
            .collect();
        let key = |u: &Upstream| {
            u.load
                .map(|(busy, free)| (busy, usize::MAX - free))
                .unwrap_or((usize::MAX, usize::MAX))
        };
        let best = live.iter().map(|u| key(u)).min()?;
        let ties: Vec<&&Upstream> = live.iter().filter(|u| key(u) == best).collect();
        let n = self.rr.fetch_add(1, Ordering::Relaxed);
        Some(ties[n % ties.len()].url.clone())
    }

    /// All URLs.
    pub fn urls(&self) -> Vec<String> {
        self.instances.iter().map(|u| u.url.clone()).collect()
    }
}

/// Shared by the proxy's handlers and its poller.
pub struct ProxyState {
    registry: Mutex<Registry>,
    http: reqwest::Client,
    timeout: Duration,
    metrics: pdserve_runtime::telemetry::MetricsHandle,
}

fn error(e: RequestError) -> Response {
    let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, Json(openai::error_body(&e))).into_response()
}

fn router(state: Arc<ProxyState>) -> Router {
    Router::new()
        .route("/v1/completions", post(|s, b| forward(s, b, false)))
        .route("/v1/chat/completions", post(|s, b| forward(s, b, true)))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route(
            "/metrics",
            get(|State(s): State<Arc<ProxyState>>| async move { s.metrics.render() }),
        )
        .with_state(state)
}

async fn health(State(s): State<Arc<ProxyState>>) -> Response {
    let (p, d) = {
        let r = s.registry.lock().unwrap_or_else(|e| e.into_inner());
        (r.alive(Role::Prefill).len(), r.alive(Role::Decode).len())
    };
    let status = if p > 0 && d > 0 {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(json!({"status": if status == StatusCode::OK { "ok" } else { "degraded" }, "prefill": p, "decode": d}))).into_response()
}

async fn models(State(s): State<Arc<ProxyState>>) -> Response {
    let url = s
        .registry
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .pick(Role::Decode);
    let Some(url) = url else {
        return error(RequestError::Overloaded(
            "no decode instance is available".into(),
        ));
    };
    match s
        .http
        .get(format!("{url}/v1/models"))
        .timeout(s.timeout)
        .send()
        .await
    {
        Ok(r) => relay(r).await,
        Err(e) => error(RequestError::Internal(format!(
            "decode instance {url}: {e}"
        ))),
    }
}

/// Copies an upstream answer (status, content type, body as it arrives) to the client.
async fn relay(resp: reqwest::Response) -> Response {
    let status = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let ctype = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("application/json")
        .to_string();
    let stream = futures_util::stream::unfold(Some(resp), |resp| async move {
        let mut resp = resp?;
        match resp.chunk().await {
            Ok(Some(bytes)) => Some((Ok::<Bytes, std::io::Error>(bytes), Some(resp))),
            Ok(None) => None,
            Err(e) => Some((Err(std::io::Error::other(e)), None)),
        }
    });
    (status, [("content-type", ctype)], Body::from_stream(stream)).into_response()
}

async fn forward(State(s): State<Arc<ProxyState>>, body: Bytes, chat: bool) -> Response {
    // Validate like an instance would, so bad input never reaches an upstream.
    if let Err(e) = openai::parse_request(&body, chat) {
        return error(e);
    }
    let original: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let path = if chat {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    };
    let (prefill, decode) = {
        let r = s.registry.lock().unwrap_or_else(|e| e.into_inner());
        (r.pick(Role::Prefill), r.pick(Role::Decode))
    };
    let Some(prefill) = prefill else {
        return error(RequestError::Overloaded(
            "no prefill instance is available".into(),
        ));
    };
    let Some(decode) = decode else {
        return error(RequestError::Overloaded(
            "no decode instance is available".into(),
        ));
    };

    let mut first = original.clone();
    first["max_tokens"] = json!(1);
    if chat {
        first["max_completion_tokens"] = json!(1);
    }
    first["stream"] = json!(false);
    first.as_object_mut().map(|o| o.remove("stream_options"));
    first["kv_transfer_params"] = json!({"do_remote_decode": true});
    let answer = match s
        .http
        .post(format!("{prefill}{path}"))
        .json(&first)
        .timeout(s.timeout)
        .send()
        .await
    {
        Ok(r) if r.status().is_success() => r.json::<Value>().await,
        Ok(r) => return relay(r).await,
        Err(e) => {
            return error(RequestError::KvTransfer(format!(
                "prefill instance {prefill}: {e}"
            )))
        }
    };
    let params = match answer {
        Ok(v) if v["kv_transfer_params"].is_object() => v["kv_transfer_params"].clone(),
        Ok(v) => {
            return error(RequestError::Internal(format!(
                "prefill instance {prefill} returned no kv_transfer_params: {v}"
            )))
        }
        Err(e) => {
            return error(RequestError::Internal(format!(
                "prefill instance {prefill}: {e}"
            )))
        }
    };
    let mut second = original;
    second["kv_transfer_params"] = params;
    match s
        .http
        .post(format!("{decode}{path}"))
        .json(&second)
        .timeout(s.timeout)
        .send()
        .await
    {
        Ok(r) => relay(r).await,
        Err(e) => error(RequestError::KvTransfer(format!(
            "decode instance {decode}: {e}"
        ))),
    }
}

async fn poll_forever(state: Arc<ProxyState>) {
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(POLL_INTERVAL * 2)
        .build()
        .unwrap_or_default();
    let mut tick = tokio::time::interval(POLL_INTERVAL);
    loop {
        tick.tick().await;
        let urls = state
            .registry
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .urls();
        for url in urls {
            let load = match client.get(format!("{url}/v1/load")).send().await {
                Ok(r) if r.status().is_success() => r.json::<Value>().await.ok().map(|v| {
                    let n = |k: &str| v[k].as_u64().unwrap_or(0) as usize;
                    (n("waiting") + n("running"), n("blocks_free"))
                }),
                _ => None,
            };
            state
                .registry
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .record(&url, load);
        }
    }
}

/// Messages of the Proxy.
pub enum ProxyMsg {
    /// The bound address.
    LocalAddr(RpcReplyPort<SocketAddr>),
}

/// Where the proxy listens and what it routes to.
#[derive(Clone, Debug)]
pub struct ProxyArgs {
    /// Address to bind.
    pub bind: SocketAddr,
    /// Prefill instance URLs (`http://host:port`).
    pub prefill: Vec<String>,
    /// Decode instance URLs.
    pub decode: Vec<String>,
    /// Bound on each upstream call.
    pub timeout: Duration,
}

/// The Proxy actor.
#[derive(Debug)]
pub struct Proxy;

/// Its state: the server and the registry poller.
pub struct ProxyActorState {
    server: crate::http::HttpServer,
    poller: tokio::task::JoinHandle<()>,
}

impl Actor for Proxy {
    type Msg = ProxyMsg;
    type State = ProxyActorState;
    type Arguments = ProxyArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: ProxyArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let mut registry = Registry::default();
        args.prefill
            .iter()
            .for_each(|u| registry.add(Role::Prefill, u.trim_end_matches('/')));
        args.decode
            .iter()
            .for_each(|u| registry.add(Role::Decode, u.trim_end_matches('/')));
        let state = Arc::new(ProxyState {
            registry: Mutex::new(registry),
            http: reqwest::Client::builder().no_proxy().build()?,
            timeout: args.timeout,
            metrics: pdserve_runtime::telemetry::install_metrics(),
        });
        let server =
            crate::http::HttpServer::start(args.bind, router(state.clone()), "proxy").await?;
        let poller = tokio::spawn(poll_forever(state));
        Ok(ProxyActorState { server, poller })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            ProxyMsg::LocalAddr(reply) => {
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
        st.poller.abort();
        st.server.stop().await;
        Ok(())
    }
}

/// Starts a proxy; returns its actor and address.
///
/// # Errors
/// When it cannot bind.
pub async fn start_proxy(
    name: &str,
    args: ProxyArgs,
) -> Result<(ActorRef<ProxyMsg>, SocketAddr, tokio::task::JoinHandle<()>), String> {
    let (proxy, join) = Actor::spawn(Some(name.to_string()), Proxy, args)
        .await
        .map_err(|e| e.to_string())?;
    let addr = ractor::call_t!(proxy, ProxyMsg::LocalAddr, 5_000).map_err(|e| e.to_string())?;
    Ok((proxy, addr, join))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_least_loaded_live_instance_with_round_robin_ties() {
        let mut r = Registry::default();
        r.add(Role::Decode, "a");
        r.add(Role::Decode, "b");
        r.add(Role::Prefill, "p");
        assert_eq!(r.pick(Role::Decode), None, "nothing has answered yet");
        r.record("a", Some((0, 100)));
        r.record("b", Some((0, 100)));
        r.record("p", Some((3, 10)));
        let picks: Vec<_> = (0..4).map(|_| r.pick(Role::Decode).unwrap()).collect();
        assert!(
            picks.contains(&"a".to_string()) && picks.contains(&"b".to_string()),
            "{picks:?}"
        );
        r.record("a", Some((5, 100)));
        assert_eq!(r.pick(Role::Decode).unwrap(), "b", "fewer requests wins");
        r.record("b", Some((5, 50)));
        assert_eq!(r.pick(Role::Decode).unwrap(), "a", "then more free blocks");
        for _ in 0..MISSED_POLLS_TO_DROP {
            r.record("a", None);
        }
        assert_eq!(
            r.alive(Role::Decode),
            vec!["b".to_string()],
            "a missed its polls"
        );
        r.record("a", Some((0, 100)));
        assert_eq!(r.pick(Role::Decode).unwrap(), "a", "back once it answers");
        assert_eq!(r.pick(Role::Prefill).unwrap(), "p");
    }
}
