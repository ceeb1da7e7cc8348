//! The Proxy actor: the HTTP front door of a P/D cluster.
//!
//! It keeps a registry of prefill and decode instances, polls each one's `/v1/load` every
//! [`POLL_INTERVAL`] (an instance that misses [`MISSED_POLLS_TO_DROP`] polls in a row is
//! dropped from routing until it answers again), validates requests as an instance does, picks
//! the least-loaded prefill and decode instance (queued + running requests, then free KV
//! blocks; round-robin between equals), gives the request a `transfer_id`, and sends it in
//! one hop to the decode instance with `kv_transfer_params` naming the prefill instance
//! (`do_remote_prefill`, `remote_host`, `remote_port`, no block ids): the decode instance
//! allocates its blocks, asks the prefill instance for the prompt's KV in its configured
//! mode (push or pull) and answers; its answer (JSON or `text/event-stream`) is streamed to
//! the client. With `max_prefill_queue` set, a request arriving while every prefill instance
//! is busier than that goes to the decode instance without `kv_transfer_params` (it prefills
//! locally: conditional disaggregation). Every upstream call has a timeout; no instance of a
//! role → 503. A client that goes away drops the upstream stream, which aborts the request on
//! the decode instance, which aborts the hand-off on the prefill instance. (Instances also
//! accept vLLM's two-hop flow, for a vLLM proxy.)
//!
//! **Registration over the control plane.** Started with [`ProxyControlArgs`] (cluster
//! credentials), the proxy also binds a mutual-TLS QUIC control endpoint. Instances connect
//! there and register (`Opaque` topic `register`, a JSON
//! [`Registration`](crate::control_plane::Registration)); a registration adds a dynamic
//! registry entry keyed by node name (replacing an older one of the same node, or a static
//! entry of the same URL), and the instance's heartbeats carry its load. A registered instance
//! is routed to while its connection is open and its last heartbeat is younger than
//! [`MISSED_HEARTBEATS_TO_DROP`] intervals; it comes back when it heartbeats or registers
//! again. Static URLs (`--prefill`/`--decode`) keep working as before, polled over HTTP.
//!
//! **Inspect.** An `Opaque` request with topic `inspect` on any control connection is answered
//! with a [`ClusterSnapshot`]: the proxy itself, and every registered instance's snapshot
//! fetched over its own control connection within [`ProxyControlArgs::inspect_timeout`] (all at
//! once); an instance that cannot answer is listed as unreachable with the reason.
//!
//! Supervised by whoever starts it (`pdserve proxy`, `pdserve launch`); a failure stops the
//! proxy with an error. The control plane's tasks (accept loop, one per connection, one per
//! inspect request) end with the actor: `post_stop` closes the endpoint.

use crate::control_plane::{
    message_name, Registration, MISSED_HEARTBEATS_TO_DROP, TOPIC_INSPECT, TOPIC_REGISTER,
    TOPIC_REGISTERED,
};
use crate::error::RequestError;
use crate::openai;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use pdserve_runtime::config::InstanceRole;
use pdserve_runtime::supervision::{
    ActorSnapshot, ActorState, ClusterMember, ClusterSnapshot, InstanceSnapshot, MemberStatus,
    ProxySnapshot,
};
use pdserve_runtime::telemetry as m;
use pdserve_runtime::wire::{ControlMessage, ErrorMessage};
use pdserve_transport::control::tls::MemberCredentials;
use pdserve_transport::control::{ControlConfig, ControlConnection, ControlEndpoint};
use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, RpcReplyPort};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

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
    /// Prefill and decode in one instance: registered (and inspected) but not routed by the
    /// P/D flow, which picks one prefill and one decode instance.
    Colocated,
}

impl Role {
    /// The lowercase name used in registrations and `inspect`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Prefill => "prefill",
            Self::Decode => "decode",
            Self::Colocated => "colocated",
        }
    }
}

impl From<InstanceRole> for Role {
    fn from(r: InstanceRole) -> Self {
        match r {
            InstanceRole::Prefill => Self::Prefill,
            InstanceRole::Decode => Self::Decode,
            InstanceRole::Colocated => Self::Colocated,
        }
    }
}

/// Liveness of an entry that registered over the control plane (heartbeat-driven).
#[derive(Debug, Clone)]
struct Registered {
    node: String,
    control_addr: String,
    heartbeat: Duration,
    last_seen: Instant,
    connected: bool,
    generation: u64,
}

#[derive(Debug, Clone)]
struct Upstream {
    url: String,
    role: Role,
    load: Option<(usize, usize)>,
    /// Polls missed in a row (static entries only).
    missed: u32,
    /// `Some` for an entry that registered over the control plane.
    registered: Option<Registered>,
}

impl Upstream {
    fn live(&self, now: Instant) -> bool {
        match &self.registered {
            None => self.missed < MISSED_POLLS_TO_DROP,
            Some(r) => {
                r.connected
                    && now.saturating_duration_since(r.last_seen)
                        < r.heartbeat * MISSED_HEARTBEATS_TO_DROP
            }
        }
    }
}

/// A registered instance as the registry sees it (for `inspect`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegisteredInstance {
    /// Node name.
    pub node: String,
    /// Its role.
    pub role: Role,
    /// Its HTTP API.
    pub url: String,
    /// Its control address.
    pub control_addr: String,
    /// Whether requests are routed to it now.
    pub routable: bool,
    /// Time since its last heartbeat or registration.
    pub since_seen: Duration,
    /// Which registration this is (increases with every registration).
    pub generation: u64,
}

/// The registry of instances, as a pure structure (tested without HTTP or QUIC): static
/// entries polled over HTTP, and entries registered over the control plane, kept alive by
/// heartbeats. Time is passed in (`*_at`), so liveness is tested without sleeping.
#[derive(Debug, Default)]
pub struct Registry {
    instances: Vec<Upstream>,
    /// Round-robin counters, one per role (a shared one would make every pick of one role
    /// land on the same instance when the picks of the two roles alternate).
    rr: [AtomicUsize; 2],
    generations: u64,
}

impl Registry {
    /// Adds a static instance (polled on `/v1/load`).
    pub fn add(&mut self, role: Role, url: impl Into<String>) {
        self.instances.push(Upstream {
            url: url.into(),
            role,
            load: None,
            missed: MISSED_POLLS_TO_DROP,
            registered: None,
        });
    }

    /// Adds or replaces the entry of `node`, registered over the control plane at `now`: an
    /// older entry of the same node, or any entry of the same URL (a static one included), is
    /// replaced. Returns the registration's generation, which its heartbeats and disconnect
    /// must carry.
    pub fn register(
        &mut self,
        node: &str,
        role: Role,
        url: &str,
        control_addr: &str,
        heartbeat: Duration,
        now: Instant,
    ) -> u64 {
        self.instances
            .retain(|u| u.url != url && u.registered.as_ref().is_none_or(|r| r.node != node));
        self.generations += 1;
        self.instances.push(Upstream {
            url: url.to_string(),
            role,
            load: None,
            missed: 0,
            registered: Some(Registered {
                node: node.to_string(),
                control_addr: control_addr.to_string(),
                heartbeat,
                last_seen: now,
                connected: true,
                generation: self.generations,
            }),
        });
        self.generations
    }

    fn registered_mut(&mut self, node: &str, generation: u64) -> Option<&mut Upstream> {
        self.instances.iter_mut().find(|u| {
            u.registered
                .as_ref()
                .is_some_and(|r| r.node == node && r.generation == generation)
        })
    }

    /// Records a heartbeat of registration `generation` of `node`: `(queued + running, free
    /// blocks)` at `now`. A heartbeat of an older registration is ignored (returns `false`).
    pub fn heartbeat(
        &mut self,
        node: &str,
        generation: u64,
        load: (usize, usize),
        now: Instant,
    ) -> bool {
        let Some(u) = self.registered_mut(node, generation) else {
            return false;
        };
        u.load = Some(load);
        if let Some(r) = u.registered.as_mut() {
            r.last_seen = now;
        }
        true
    }

    /// The control connection of registration `generation` of `node` closed: it is no longer
    /// routed to (its entry stays, for `inspect`, until it registers again). Returns whether
    /// that registration was the current one.
    pub fn disconnect(&mut self, node: &str, generation: u64) -> bool {
        let Some(u) = self.registered_mut(node, generation) else {
            return false;
        };
        if let Some(r) = u.registered.as_mut() {
            r.connected = false;
        }
        true
    }

    /// Records a poll of a static entry: `Some((queued + running, free blocks))`, or `None`
    /// when it failed.
    pub fn record(&mut self, url: &str, load: Option<(usize, usize)>) {
        if let Some(u) = self
            .instances
            .iter_mut()
            .find(|u| u.url == url && u.registered.is_none())
        {
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
        self.alive_at(role, Instant::now())
    }

    /// Instances of `role` routable at `now`.
    pub fn alive_at(&self, role: Role, now: Instant) -> Vec<String> {
        self.instances
            .iter()
            .filter(|u| u.role == role && u.live(now))
            .map(|u| u.url.clone())
            .collect()
    }

    /// The least-loaded live instance of `role` (fewest queued+running, then most free
    /// blocks), round-robin among equals.
    pub fn pick(&self, role: Role) -> Option<String> {
        self.pick_at(role, Instant::now())
    }

    /// [`Registry::pick`] at `now`.
    pub fn pick_at(&self, role: Role, now: Instant) -> Option<String> {
        let live: Vec<&Upstream> = self
            .instances
            .iter()
            .filter(|u| u.role == role && u.live(now))
            .collect();
        let key = |u: &Upstream| {
            u.load
                .map(|(busy, free)| (busy, usize::MAX - free))
                .unwrap_or((usize::MAX, usize::MAX))
        };
        let best = live.iter().map(|u| key(u)).min()?;
        let ties: Vec<&&Upstream> = live.iter().filter(|u| key(u) == best).collect();
        let n = self.rr[usize::from(role == Role::Decode)].fetch_add(1, Ordering::Relaxed);
        Some(ties[n % ties.len()].url.clone())
    }

    /// The last load an instance reported: `(queued + running, free blocks)`.
    pub fn load_of(&self, url: &str) -> Option<(usize, usize)> {
        self.instances.iter().find(|u| u.url == url)?.load
    }

    /// All URLs.
    pub fn urls(&self) -> Vec<String> {
        self.instances.iter().map(|u| u.url.clone()).collect()
    }

    /// URLs of the static entries (the ones polled over HTTP).
    pub fn static_urls(&self) -> Vec<String> {
        self.instances
            .iter()
            .filter(|u| u.registered.is_none())
            .map(|u| u.url.clone())
            .collect()
    }

    /// Every registered entry, in registration order, as seen at `now`.
    pub fn registered_at(&self, now: Instant) -> Vec<RegisteredInstance> {
        self.instances
            .iter()
            .filter_map(|u| {
                let r = u.registered.as_ref()?;
                Some(RegisteredInstance {
                    node: r.node.clone(),
                    role: u.role,
                    url: u.url.clone(),
                    control_addr: r.control_addr.clone(),
                    routable: u.live(now),
                    since_seen: now.saturating_duration_since(r.last_seen),
                    generation: r.generation,
                })
            })
            .collect()
    }
}

/// Shared by the proxy's handlers and its poller.
pub struct ProxyState {
    registry: Mutex<Registry>,
    http: reqwest::Client,
    timeout: Duration,
    max_prefill_queue: Option<usize>,
    api_key: Option<String>,
    metrics: pdserve_runtime::telemetry::MetricsHandle,
}

impl ProxyState {
    /// A call to an instance, with the cluster's API key when the proxy has one (instances
    /// of a cluster share the proxy's key; one without a key ignores it).
    fn upstream(&self, req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.api_key {
            Some(key) => req.bearer_auth(key),
            None => req,
        }
    }
}

fn error(e: RequestError) -> Response {
    let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, Json(openai::error_body(&e))).into_response()
}

fn router(state: Arc<ProxyState>) -> Router {
    Router::new()
        .route("/v1/completions", post(|s, h, b| forward(s, h, b, false)))
        .route(
            "/v1/chat/completions",
            post(|s, h, b| forward(s, h, b, true)),
        )
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

async fn models(State(s): State<Arc<ProxyState>>, headers: HeaderMap) -> Response {
    if !authorized(&s, &headers) {
        return unauthorized();
    }
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
        .upstream(s.http.get(format!("{url}/v1/models")))
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
    relay_timed(resp, None).await
}

/// [`relay`], recording the time to the first body chunk and to the end of the body from
/// `arrived` (the proxy's view of TTFT and end-to-end latency).
async fn relay_timed(resp: reqwest::Response, arrived: Option<Instant>) -> Response {
    let status = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let ctype = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("application/json")
        .to_string();
    let mut first = arrived;
    let stream = futures_util::stream::unfold(Some(resp), move |resp| {
        let first_chunk = first.take();
        async move {
            let mut resp = resp?;
            match resp.chunk().await {
                Ok(Some(bytes)) => {
                    if let Some(t) = first_chunk {
                        metrics::histogram!(m::PROXY_TIME_TO_FIRST_BYTE_SECONDS)
                            .record(t.elapsed().as_secs_f64());
                    }
                    Some((Ok::<Bytes, std::io::Error>(bytes), Some(resp)))
                }
                Ok(None) => None,
                Err(e) => Some((Err(std::io::Error::other(e)), None)),
            }
        }
    });
    if let Some(t) = arrived {
        let done = EndTimer(t);
        let stream = futures_util::StreamExt::map(stream, move |chunk| {
            let _ = &done;
            chunk
        });
        return (status, [("content-type", ctype)], Body::from_stream(stream)).into_response();
    }
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
    crate::http::bearer_matches(s.api_key.as_deref(), headers)
}

fn unauthorized() -> Response {
    outcome("unauthorized");
    crate::http::unauthorized()
}

async fn forward(
    State(s): State<Arc<ProxyState>>,
    headers: HeaderMap,
    body: Bytes,
    chat: bool,
) -> Response {
    let arrived = Instant::now();
    if !authorized(&s, &headers) {
        return unauthorized();
    }
    // Validate like an instance would, so bad input never reaches an upstream.
    if let Err(e) = openai::parse_request(&body, chat) {
        outcome("invalid");
        return error(e);
    }
    let mut request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let path = if chat {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    };
    let (prefill, decode, prefill_load) = {
        let r = s.registry.lock().unwrap_or_else(|e| e.into_inner());
        let prefill = r.pick(Role::Prefill);
        let load = prefill.as_deref().and_then(|u| r.load_of(u));
        (prefill, r.pick(Role::Decode), load)
    };
    let Some(prefill) = prefill else {
        outcome("unavailable");
        return error(RequestError::Overloaded(
            "no prefill instance is available".into(),
        ));
    };
    let Some(decode) = decode else {
        outcome("unavailable");
        return error(RequestError::Overloaded(
            "no decode instance is available".into(),
        ));
    };
    let transfer = pdserve_runtime::ids::TransferId::new_random();
    // Conditional disaggregation: when even the least-loaded prefill instance has more
    // requests queued than the threshold, the decode instance prefills this one itself.
    let busy = prefill_load.map_or(0, |(busy, _)| busy);
    if s.max_prefill_queue.is_some_and(|max| busy > max) {
        tracing::info!(%transfer, %decode, prefill_queue = busy, "prefilling on decode: the prefill queue is over the threshold");
        metrics::counter!(pdserve_runtime::telemetry::LOCAL_PREFILLS_TOTAL, pdserve_runtime::telemetry::LABEL_REASON => "prefill_queue").increment(1);
        request
            .as_object_mut()
            .map(|o| o.remove("kv_transfer_params"));
        outcome("local_prefill");
    } else {
        let Some((host, port)) = host_port(&prefill) else {
            return error(RequestError::Internal(format!(
                "prefill instance URL `{prefill}` has no host:port"
            )));
        };
        tracing::info!(%transfer, %prefill, %decode, "routing");
        outcome("disaggregated");
        // One hop: the decode instance allocates its blocks, asks the prefill instance for the
        // prompt's KV (push or pull, its `transfer.mode`) and streams the answer.
        request["kv_transfer_params"] = json!({
            "do_remote_prefill": true,
            "remote_host": host,
            "remote_port": port,
            "transfer_id": transfer.to_string(),
        });
    }
    match s
        .upstream(s.http.post(format!("{decode}{path}")))
        .json(&request)
        .timeout(s.timeout)
        .send()
        .await
    {
        Ok(r) => relay_timed(r, Some(arrived)).await,
        Err(e) => {
            outcome("upstream_error");
            tracing::warn!(%transfer, %decode, error = %e, "decode instance unreachable");
            error(RequestError::KvTransfer(format!(
                "decode instance {decode}: {e}"
            )))
        }
    }
}

/// `(host, port)` of an `http://host:port` URL.
fn host_port(url: &str) -> Option<(String, u16)> {
    let rest = url.split("://").nth(1).unwrap_or(url);
    let authority = rest.split('/').next()?;
    let (host, port) = authority.rsplit_once(':')?;
    Some((
        host.trim_start_matches('[')
            .trim_end_matches(']')
            .to_string(),
        port.parse().ok()?,
    ))
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
            .static_urls();
        for url in urls {
            let load = match state
                .upstream(client.get(format!("{url}/v1/load")))
                .send()
                .await
            {
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
        let (p, d) = {
            let r = state.registry.lock().unwrap_or_else(|e| e.into_inner());
            (r.alive(Role::Prefill).len(), r.alive(Role::Decode).len())
        };
        metrics::gauge!(m::PROXY_INSTANCES, "role" => "prefill").set(p as f64);
        metrics::gauge!(m::PROXY_INSTANCES, "role" => "decode").set(d as f64);
    }
}

/// Messages of the Proxy.
pub enum ProxyMsg {
    /// The bound address.
    LocalAddr(RpcReplyPort<SocketAddr>),
    /// Where the control plane listens (`None`: started without one).
    ControlAddr(RpcReplyPort<Option<SocketAddr>>),
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
    /// Conditional disaggregation: when the least-loaded prefill instance has more requests
    /// queued or running than this, the decode instance prefills the request itself.
    pub max_prefill_queue: Option<usize>,
    /// Bearer token the front door requires (`/v1/*`; `/health` and `/metrics` stay open).
    pub api_key: Option<String>,
}

/// The proxy's control plane: where instances register and `pdserve inspect` connects.
#[derive(Clone, Debug)]
pub struct ProxyControlArgs {
    /// The proxy's member credentials (its node name is the certificate's).
    pub credentials: MemberCredentials,
    /// Where the control endpoint listens (UDP; port 0 picks one).
    pub listen: SocketAddr,
    /// Bound on fetching one instance's snapshot for `inspect`.
    pub inspect_timeout: Duration,
}

impl ProxyControlArgs {
    /// Control-plane settings with a 2 s inspect timeout.
    pub fn new(credentials: MemberCredentials, listen: SocketAddr) -> Self {
        Self {
            credentials,
            listen,
            inspect_timeout: Duration::from_secs(2),
        }
    }
}

/// Everything a Proxy is started from.
#[derive(Clone, Debug)]
pub struct ProxyStart {
    /// HTTP side and static instances.
    pub args: ProxyArgs,
    /// The control plane, if the cluster has credentials.
    pub control: Option<ProxyControlArgs>,
}

impl From<ProxyArgs> for ProxyStart {
    fn from(args: ProxyArgs) -> Self {
        Self {
            args,
            control: None,
        }
    }
}

/// The Proxy actor.
#[derive(Debug)]
pub struct Proxy(pub crate::mailbox::Inbox);

/// Its state: the server, the registry poller and the control plane.
pub struct ProxyActorState {
    server: crate::http::HttpServer,
    poller: tokio::task::JoinHandle<()>,
    control: Option<(Arc<ProxyControl>, tokio::task::JoinHandle<()>)>,
}

impl Actor for Proxy {
    type Msg = ProxyMsg;
    type State = ProxyActorState;
    type Arguments = ProxyStart;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        start: ProxyStart,
    ) -> Result<Self::State, ActorProcessingErr> {
        let args = start.args;
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
            max_prefill_queue: args.max_prefill_queue,
            api_key: args.api_key.clone(),
            metrics: pdserve_runtime::telemetry::install_metrics(),
        });
        // Bind the control endpoint first: if it fails, nothing else is running yet.
        let control = match start.control {
            Some(c) => Some(Arc::new(ProxyControl::bind(
                c,
                state.clone(),
                &myself,
                &self.0,
            )?)),
            None => None,
        };
        let server =
            crate::http::HttpServer::start(args.bind, router(state.clone()), "proxy").await?;
        let poller = tokio::spawn(poll_forever(state));
        let control = control.map(|c| {
            let _ = c.http_url.set(format!("http://{}", server.addr()));
            let accept = tokio::spawn(c.clone().accept_forever());
            (c, accept)
        });
        Ok(ProxyActorState {
            server,
            poller,
            control,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        self.0.take();
        match msg {
            ProxyMsg::LocalAddr(reply) => {
                if !reply.is_closed() {
                    let _ = reply.send(st.server.addr());
                }
            }
            ProxyMsg::ControlAddr(reply) => {
                if !reply.is_closed() {
                    let _ = reply.send(st.control.as_ref().map(|(c, _)| c.addr));
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
        if let Some((control, accept)) = &st.control {
            accept.abort();
            control.endpoint.close();
        }
        st.server.stop().await;
        Ok(())
    }
}

/// The proxy's control plane: its endpoint, the live connection of every registered node,
/// and what `inspect` reports about the proxy itself.
struct ProxyControl {
    endpoint: Arc<ControlEndpoint>,
    addr: SocketAddr,
    state: Arc<ProxyState>,
    /// node → (registration generation, its control connection).
    conns: Mutex<HashMap<String, (u64, Arc<ControlConnection>)>>,
    proxy: ActorCell,
    inbox: crate::mailbox::Inbox,
    started: Instant,
    http_url: OnceLock<String>,
    inspect_timeout: Duration,
}

fn control_error(kind: &str, message: impl Into<String>) -> ControlMessage {
    ControlMessage::Error(ErrorMessage {
        kind: kind.to_string(),
        message: message.into(),
    })
}

/// `addr` with an unspecified IP (`0.0.0.0`, `::`) replaced by `peer` — what an instance
/// bound to all interfaces is reachable at, seen from this proxy.
fn reachable(addr: SocketAddr, peer: IpAddr) -> SocketAddr {
    if addr.ip().is_unspecified() {
        SocketAddr::new(peer, addr.port())
    } else {
        addr
    }
}

impl ProxyControl {
    fn bind(
        args: ProxyControlArgs,
        state: Arc<ProxyState>,
        myself: &ActorRef<ProxyMsg>,
        inbox: &crate::mailbox::Inbox,
    ) -> Result<Self, String> {
        let config = ControlConfig {
            listen: args.listen,
            role: pdserve_runtime::wire::Role::Proxy,
            ..ControlConfig::default()
        };
        let endpoint = ControlEndpoint::bind(&args.credentials, config)
            .map_err(|e| format!("proxy control plane: cannot listen on {}: {e}", args.listen))?;
        let addr = endpoint
            .local_addr()
            .map_err(|e| format!("proxy control plane: {e}"))?;
        tracing::info!(%addr, "proxy control plane listening");
        Ok(Self {
            endpoint: Arc::new(endpoint),
            addr,
            state,
            conns: Mutex::new(HashMap::new()),
            proxy: myself.get_cell(),
            inbox: inbox.clone(),
            started: Instant::now(),
            http_url: OnceLock::new(),
            inspect_timeout: args.inspect_timeout,
        })
    }

    fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.state
            .registry
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    async fn accept_forever(self: Arc<Self>) {
        while let Some(conn) = self.endpoint.accept().await {
            tokio::spawn(self.clone().serve_member(Arc::new(conn)));
        }
    }

    /// Handles one control connection (an instance, or a tool such as `pdserve inspect`)
    /// until it closes; then the registration made on it stops being routed to.
    async fn serve_member(self: Arc<Self>, conn: Arc<ControlConnection>) {
        let mut registered: Option<(String, u64)> = None;
        while let Some(incoming) = conn.recv().await {
            match (incoming.message, incoming.responder) {
                (ControlMessage::Heartbeat(hb), _) => match &registered {
                    Some((node, generation)) if *node == hb.node => {
                        let load = (
                            hb.load.waiting as usize + hb.load.running as usize,
                            usize::try_from(hb.load.free_blocks).unwrap_or(usize::MAX),
                        );
                        self.registry()
                            .heartbeat(node, *generation, load, Instant::now());
                    }
                    _ => tracing::debug!(
                        peer = %conn.peer().node,
                        node = %hb.node,
                        "heartbeat from an unregistered connection ignored"
                    ),
                },
                (ControlMessage::Opaque { topic, body }, Some(responder))
                    if topic == TOPIC_REGISTER =>
                {
                    let answer = match self.register(&conn, &body) {
                        Ok((node, generation)) => {
                            registered = Some((node, generation));
                            ControlMessage::Opaque {
                                topic: TOPIC_REGISTERED.into(),
                                body: serde_json::to_vec(
                                    &json!({"proxy": self.endpoint.hello().node}),
                                )
                                .unwrap_or_default(),
                            }
                        }
                        Err(e) => {
                            tracing::warn!(peer = %conn.peer().node, error = %e, "registration refused");
                            control_error("bad_registration", e)
                        }
                    };
                    tokio::spawn(async move {
                        let _ = responder.respond(answer).await;
                    });
                }
                (ControlMessage::Opaque { topic, .. }, Some(responder))
                    if topic == TOPIC_INSPECT =>
                {
                    let me = self.clone();
                    tokio::spawn(async move {
                        let snap = me.cluster_snapshot().await;
                        let answer = match serde_json::to_vec(&snap) {
                            Ok(body) => ControlMessage::Opaque {
                                topic: TOPIC_INSPECT.into(),
                                body,
                            },
                            Err(e) => control_error("internal", e.to_string()),
                        };
                        let _ = responder.respond(answer).await;
                    });
                }
                (other, Some(responder)) => {
                    let answer = control_error(
                        "unsupported",
                        format!("the proxy does not answer {}", message_name(&other)),
                    );
                    tokio::spawn(async move {
                        let _ = responder.respond(answer).await;
                    });
                }
                (_, None) => {}
            }
        }
        if let Some((node, generation)) = registered {
            if self.registry().disconnect(&node, generation) {
                tracing::warn!(%node, "control connection closed: no longer routed to");
            }
            let mut conns = self.conns.lock().unwrap_or_else(|e| e.into_inner());
            if conns.get(&node).is_some_and(|(g, _)| *g == generation) {
                conns.remove(&node);
            }
        }
    }

    /// Validates and records a registration made on `conn`.
    fn register(
        &self,
        conn: &Arc<ControlConnection>,
        body: &[u8],
    ) -> Result<(String, u64), String> {
        let reg: Registration =
            serde_json::from_slice(body).map_err(|e| format!("malformed registration: {e}"))?;
        reg.validate(&conn.peer().node)?;
        let peer_ip = conn.remote_address().ip();
        let mut url = reqwest::Url::parse(&reg.url).map_err(|e| e.to_string())?;
        if let Some(host) = url.host_str() {
            if host
                .trim_matches(['[', ']'])
                .parse::<IpAddr>()
                .is_ok_and(|ip| ip.is_unspecified())
            {
                url.set_ip_host(peer_ip)
                    .map_err(|()| format!("cannot rewrite the host of {}", reg.url))?;
            }
        }
        let url = url.as_str().trim_end_matches('/').to_string();
        let control_addr: SocketAddr = reg.control_addr.parse().map_err(|e| format!("{e}"))?;
        let control_addr = reachable(control_addr, peer_ip).to_string();
        let role = Role::from(reg.role);
        let heartbeat = Duration::from_millis(reg.heartbeat_ms);
        let generation = self.registry().register(
            &reg.node,
            role,
            &url,
            &control_addr,
            heartbeat,
            Instant::now(),
        );
        let previous = self
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(reg.node.clone(), (generation, conn.clone()));
        if let Some((_, old)) = previous {
            if !Arc::ptr_eq(&old, conn) {
                tracing::warn!(node = %reg.node, "node registered again from a new connection: closing the old one");
                old.close();
            }
        }
        tracing::info!(node = %reg.node, role = role.as_str(), %url, "instance registered");
        Ok((reg.node, generation))
    }

    fn proxy_actor(&self) -> ActorSnapshot {
        use ractor::ActorStatus;
        let state = match self.proxy.get_status() {
            ActorStatus::Unstarted | ActorStatus::Starting => ActorState::Starting,
            ActorStatus::Running | ActorStatus::Upgrading | ActorStatus::Draining => {
                ActorState::Running
            }
            ActorStatus::Stopping | ActorStatus::Stopped => ActorState::Stopped,
        };
        ActorSnapshot {
            name: self.proxy.get_name().unwrap_or_else(|| "proxy".into()),
            kind: "Proxy".into(),
            state,
            restarts: 0,
            mailbox_depth: self.inbox.depth(),
            last_error: None,
            uptime_s: self.started.elapsed().as_secs_f64(),
            children: Vec::new(),
        }
    }

    /// The proxy and every registered instance; instance snapshots are fetched concurrently,
    /// each within `inspect_timeout`.
    async fn cluster_snapshot(&self) -> ClusterSnapshot {
        let now = Instant::now();
        let (members, routable_prefill, routable_decode) = {
            let r = self.registry();
            (
                r.registered_at(now),
                r.alive_at(Role::Prefill, now).len(),
                r.alive_at(Role::Decode, now).len(),
            )
        };
        let conns = self.conns.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let timeout = self.inspect_timeout;
        let fetches = members.into_iter().map(|m| {
            let conn = conns
                .get(&m.node)
                .filter(|(g, _)| *g == m.generation)
                .map(|(_, c)| c.clone());
            async move {
                let status = match conn {
                    Some(c) => fetch_instance(&c, timeout).await,
                    None => MemberStatus::Unreachable("control connection closed".into()),
                };
                ClusterMember {
                    node: m.node,
                    role: m.role.as_str().to_string(),
                    url: m.url,
                    control_addr: m.control_addr,
                    routable: m.routable,
                    last_heartbeat_s: m.since_seen.as_secs_f64(),
                    status,
                }
            }
        });
        let instances = futures_util::future::join_all(fetches).await;
        let hello = self.endpoint.hello();
        ClusterSnapshot {
            proxy: ProxySnapshot {
                node: hello.node.clone(),
                cluster: hello.cluster.clone(),
                url: self.http_url.get().cloned().unwrap_or_default(),
                control_addr: self.addr.to_string(),
                registered: instances.len(),
                routable_prefill,
                routable_decode,
                refused_connections: self.endpoint.refused_connections(),
                actors: self.proxy_actor(),
            },
            instances,
        }
    }
}

/// One instance's snapshot over its control connection, or why there is none.
async fn fetch_instance(conn: &ControlConnection, timeout: Duration) -> MemberStatus {
    if let Some(reason) = conn.quic_connection().close_reason() {
        return MemberStatus::Unreachable(format!("control connection closed: {reason}"));
    }
    let ask = conn.request(ControlMessage::Opaque {
        topic: TOPIC_INSPECT.into(),
        body: Vec::new(),
    });
    match tokio::time::timeout(timeout, ask).await {
        Err(_) => MemberStatus::Unreachable(format!("no inspect answer within {timeout:?}")),
        Ok(Err(e)) => MemberStatus::Unreachable(e.to_string()),
        Ok(Ok(ControlMessage::Opaque { topic, body })) if topic == TOPIC_INSPECT => {
            match serde_json::from_slice::<InstanceSnapshot>(&body) {
                Ok(snap) => MemberStatus::Snapshot(Box::new(snap)),
                Err(e) => MemberStatus::Unreachable(format!("malformed inspect answer: {e}")),
            }
        }
        Ok(Ok(other)) => {
            MemberStatus::Unreachable(format!("inspect answered with {}", message_name(&other)))
        }
    }
}

/// A started proxy: its actor, HTTP address, and the task that ends when it stops.
pub type StartedProxy = (
    crate::mailbox::Mailbox<ProxyMsg>,
    SocketAddr,
    tokio::task::JoinHandle<()>,
);

/// Starts a proxy; returns its actor and address.
///
/// # Errors
/// When it cannot bind.
pub async fn start_proxy(name: &str, args: ProxyArgs) -> Result<StartedProxy, String> {
    start_proxy_with_control(name, args, None).await
}

/// Starts a proxy, with a control plane when `control` is given (see the module docs);
/// returns its actor and HTTP address ([`proxy_control_addr`] gives the control address).
///
/// # Errors
/// When it cannot bind either address or the credentials are unusable.
pub async fn start_proxy_with_control(
    name: &str,
    args: ProxyArgs,
    control: Option<ProxyControlArgs>,
) -> Result<StartedProxy, String> {
    let (proxy, join) =
        crate::mailbox::Mailbox::spawn(Some(name.to_string()), Proxy, ProxyStart { args, control })
            .await
            .map_err(|e| e.to_string())?;
    let addr = ractor::call_t!(proxy, ProxyMsg::LocalAddr, 5_000).map_err(|e| e.to_string())?;
    Ok((proxy, addr, join))
}

/// Where a running proxy's control plane listens (`None`: it has none).
///
/// # Errors
/// When the proxy is gone or does not answer within 5 s.
pub async fn proxy_control_addr(
    proxy: &crate::mailbox::Mailbox<ProxyMsg>,
) -> Result<Option<SocketAddr>, String> {
    ractor::call_t!(proxy, ProxyMsg::ControlAddr, 5_000).map_err(|e| e.to_string())
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
        // As the proxy picks: a prefill, then a decode, per request.
        let picks: Vec<_> = (0..4)
            .map(|_| {
                r.pick(Role::Prefill).unwrap();
                r.pick(Role::Decode).unwrap()
            })
            .collect();
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

    #[test]
    fn registered_instances_live_by_heartbeat_and_connection() {
        let t0 = Instant::now();
        let hb = Duration::from_millis(100);
        let mut r = Registry::default();
        let g1 = r.register("d0", Role::Decode, "http://d0", "127.0.0.1:1", hb, t0);
        assert_eq!(
            r.pick_at(Role::Decode, t0),
            Some("http://d0".into()),
            "routable as soon as it registers"
        );
        assert!(
            r.static_urls().is_empty(),
            "registered entries are not polled"
        );
        // Heartbeats keep it alive; three missed intervals drop it.
        assert!(r.heartbeat("d0", g1, (0, 10), t0 + hb));
        assert!(!r.alive_at(Role::Decode, t0 + hb * 3).is_empty());
        assert!(r.alive_at(Role::Decode, t0 + hb * 4).is_empty(), "missed 3");
        let view = r.registered_at(t0 + hb * 4);
        assert_eq!(view.len(), 1, "still listed for inspect");
        assert!(!view[0].routable);
        assert_eq!(view[0].since_seen, hb * 3);
        // A heartbeat brings it back.
        assert!(r.heartbeat("d0", g1, (0, 10), t0 + hb * 5));
        assert_eq!(
            r.pick_at(Role::Decode, t0 + hb * 5),
            Some("http://d0".into())
        );
        // A closed connection drops it at once.
        assert!(r.disconnect("d0", g1));
        assert!(r.alive_at(Role::Decode, t0 + hb * 5).is_empty());
        // Registering again replaces the old entry; the old registration's reports are stale.
        let g2 = r.register(
            "d0",
            Role::Decode,
            "http://d0-new",
            "127.0.0.1:2",
            hb,
            t0 + hb * 6,
        );
        assert!(g2 > g1);
        assert!(
            !r.heartbeat("d0", g1, (9, 0), t0 + hb * 6),
            "stale heartbeat"
        );
        assert!(!r.disconnect("d0", g1), "stale disconnect");
        assert_eq!(r.registered_at(t0 + hb * 6).len(), 1);
        assert_eq!(
            r.pick_at(Role::Decode, t0 + hb * 6),
            Some("http://d0-new".into())
        );
    }

    #[test]
    fn registration_takes_over_a_static_entry_and_picks_by_load() {
        let t0 = Instant::now();
        let hb = Duration::from_millis(500);
        let mut r = Registry::default();
        r.add(Role::Decode, "http://a");
        r.record("http://a", Some((0, 100)));
        let ga = r.register("a", Role::Decode, "http://a", "127.0.0.1:1", hb, t0);
        assert_eq!(r.urls(), vec!["http://a".to_string()], "no duplicate entry");
        assert!(r.static_urls().is_empty());
        let gb = r.register("b", Role::Decode, "http://b", "127.0.0.1:2", hb, t0);
        r.heartbeat("a", ga, (4, 100), t0);
        r.heartbeat("b", gb, (1, 100), t0);
        assert_eq!(
            r.pick_at(Role::Decode, t0),
            Some("http://b".into()),
            "least loaded"
        );
        r.heartbeat("b", gb, (4, 100), t0);
        let picks: Vec<_> = (0..4)
            .map(|_| r.pick_at(Role::Decode, t0).unwrap())
            .collect();
        assert!(
            picks.contains(&"http://a".to_string()) && picks.contains(&"http://b".to_string()),
            "round-robin between equals: {picks:?}"
        );
        // A colocated instance is listed but never picked for a P/D role.
        r.register("c", Role::Colocated, "http://c", "127.0.0.1:3", hb, t0);
        assert_eq!(r.registered_at(t0).len(), 3);
        assert!(r.alive_at(Role::Prefill, t0).is_empty());
    }

    #[test]
    fn unspecified_addresses_become_the_peer_address() {
        let peer: IpAddr = "10.0.0.7".parse().unwrap();
        assert_eq!(
            reachable("0.0.0.0:7100".parse().unwrap(), peer),
            "10.0.0.7:7100".parse::<SocketAddr>().unwrap()
        );
        assert_eq!(
            reachable("10.0.0.9:7100".parse().unwrap(), peer),
            "10.0.0.9:7100".parse::<SocketAddr>().unwrap()
        );
    }
}
