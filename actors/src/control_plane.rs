//! An instance's side of the control plane: its mutual-TLS QUIC endpoint (see
//! `pdserve_transport::control`), what it answers there, and its registration with a proxy.
//!
//! - **Answers** (on every control connection, accepted or opened by the instance):
//!   `InspectRequest` → `Inspect` with this instance's [`InstanceSnapshot`] (live supervision
//!   tree, queue, KV block and transfer figures; typed rkyv, see `pdserve_runtime::wire`);
//!   `Opaque` topic [`PEER_TOPIC`] → the P/D peer protocol (rkyv frames, answered by the
//!   instance's [`PeerService`]); `Opaque` topic [`EC_TOPIC`] → the encoder protocol of an
//!   encode instance (E/P/D, answered by its `EncoderService`, the caller the node of its
//!   certificate). Anything else is answered with `ControlMessage::Error` kind
//!   `unsupported`.
//! - **Registration** (when a proxy address is configured): the instance connects to the proxy,
//!   sends `Register` with its [`Registration`] (node, role, HTTP API URL, control address,
//!   heartbeat interval), answered `Registered` or `RegistrationRefused` (the field at fault
//!   and why), then a `Heartbeat` with its scheduler's [`LoadFigures`] every interval. When the connection breaks (the proxy restarted, the
//!   network failed) it reconnects with exponential backoff and registers again. The proxy asks
//!   for `inspect` over the same connection, so it needs no route back to the instance.
//! - A heartbeat reflects the scheduler's health: when the scheduler does not answer its stats
//!   in time, no heartbeat is sent, and the proxy stops routing to this instance after
//!   [`MISSED_HEARTBEATS_TO_DROP`] intervals.
//!
//! This is not an actor: it is a few tasks owned by [`ControlPlane`] (the accept loop, the
//! registration loop, one task per connection and one per request, all tracked), started by
//! `Instance::start` after the supervision tree is up (the endpoint itself is bound before,
//! so the hand-off can reach peers through it) and stopped in phases by `Instance::stop`:
//! first the registration ends (the proxy stops routing here at once), last the endpoint
//! closes. Every wait is bounded; a request handler never blocks the connection's receive
//! loop (each answer is built on a task of its own).

use crate::encode::protocol::EC_TOPIC;
use crate::error::StartError;
use crate::handoff::protocol::{decode_request, encode_answer, PeerAnswer, PEER_TOPIC};
use crate::handoff::{KvContext, PeerService};
use crate::scheduler::SchedulerHandle;
use crate::supervisor::SupervisorHandle;
use pdserve_runtime::config::ServeConfig;
use pdserve_runtime::faults::ControlFault;
use pdserve_runtime::supervision::InstanceSnapshot;
use pdserve_runtime::wire::{ControlMessage, ErrorMessage, Heartbeat, InspectAnswer, LoadFigures};
use pdserve_runtime::Role;
use pdserve_transport::control::tls::MemberCredentials;
use pdserve_transport::control::{ControlConfig, ControlConnection, ControlEndpoint};
use tokio_util::task::TaskTracker;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Bound on the proxy's answer to `Draining` (a registered instance telling the proxy it is
/// draining: the proxy stops routing to it at once, keeps its entry, shown `draining` by
/// `pdserve inspect`, and answers `DrainingAck`); without one in time the instance deregisters
/// (closes its control connection) instead.
pub const DRAINING_ANSWER_TIMEOUT: Duration = Duration::from_secs(1);
/// Heartbeat intervals an instance may miss before the proxy stops routing to it.
pub const MISSED_HEARTBEATS_TO_DROP: u32 = 3;
/// Bound on building one inspect answer (supervisor and scheduler queries).
pub const INSPECT_TIMEOUT: Duration = Duration::from_secs(3);
/// How often an instance sends its prefix cache's new events to the proxy (at most; the
/// heartbeat interval when that is shorter).
pub const KV_EVENTS_INTERVAL: Duration = Duration::from_millis(100);
/// Longest pause between reconnect attempts to the proxy.
pub const MAX_RECONNECT_DELAY: Duration = Duration::from_secs(2);

pub use pdserve_runtime::wire::{Registration, RegistrationError, RegistrationField};

/// An instance's control-plane settings ([`crate::InstanceOptions::control`]).
#[derive(Clone, Debug)]
pub struct InstanceControl {
    /// This member's certificate (its node name is the instance name).
    pub credentials: MemberCredentials,
    /// Where the endpoint listens (UDP); also the source of connections to the proxy.
    pub listen: SocketAddr,
    /// The proxy's control address to register with; `None`: answer `inspect` only.
    pub proxy: Option<SocketAddr>,
    /// Time between heartbeats.
    pub heartbeat: Duration,
    /// The role the instance registers as.
    pub role: Role,
    /// Requests from peers answered at once, over every connection (peer protocol, encoder
    /// protocol, inspect); past it a request is answered `overloaded` at once instead of
    /// starting another task. Default [`MAX_CONTROL_REQUESTS`].
    pub max_requests: usize,
}

/// Requests an instance's control plane answers at once by default
/// ([`InstanceControl::max_requests`]).
pub const MAX_CONTROL_REQUESTS: usize = 256;

/// Control requests refused because [`InstanceControl::max_requests`] were being answered.
pub const CONTROL_REQUESTS_REFUSED_TOTAL: &str = "pdserve_control_requests_refused_total";

/// How long the `overloaded` answer to a refused request may take to send.
const REFUSAL_TIMEOUT: Duration = Duration::from_secs(1);

impl InstanceControl {
    /// Settings with the defaults of `[control]`: listen on `127.0.0.1:0`, no proxy, a
    /// heartbeat every 500 ms.
    pub fn new(credentials: MemberCredentials, role: Role) -> Self {
        let defaults = pdserve_runtime::config::ControlSection::default();
        Self {
            credentials,
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            proxy: None,
            heartbeat: Duration::from_millis(defaults.heartbeat_ms),
            role,
            max_requests: MAX_CONTROL_REQUESTS,
        }
    }

    /// The settings of a loaded config: `Some` when `transfer.credentials_dir` is set (the
    /// member is `instance.name`).
    ///
    /// # Errors
    /// [`StartError::Config`] when the credentials cannot be loaded or an address does not
    /// parse, naming the key.
    pub fn from_config(cfg: &ServeConfig) -> Result<Option<Self>, StartError> {
        let Some(dir) = &cfg.transfer.credentials_dir else {
            if let Some(proxy) = &cfg.control.proxy {
                return Err(StartError::config(
                    "control.proxy",
                    format!("control.proxy is {proxy} but transfer.credentials_dir is not set: registering with a proxy needs cluster credentials (pdserve cluster init)"),
                ));
            }
            return Ok(None);
        };
        let credentials = MemberCredentials::load(std::path::Path::new(dir), &cfg.instance.name)
            .map_err(|e| {
                StartError::config(
                    "transfer.credentials_dir",
                    format!(
                        "no usable member credentials for `{}` in {dir}: {e}",
                        cfg.instance.name
                    ),
                )
            })?;
        let listen = cfg
            .control
            .listen
            .parse()
            .map_err(|e| StartError::config("control.listen", e))?;
        let proxy = cfg
            .control
            .proxy
            .as_deref()
            .map(|p| {
                p.parse()
                    .map_err(|e| StartError::config("control.proxy", e))
            })
            .transpose()?;
        Ok(Some(Self {
            credentials,
            listen,
            proxy,
            heartbeat: Duration::from_millis(cfg.control.heartbeat_ms),
            role: cfg.instance.role,
            max_requests: MAX_CONTROL_REQUESTS,
        }))
    }
}

/// What the control plane answers from (handles into the running instance).
#[derive(Clone)]
pub(crate) struct InspectSource {
    pub(crate) name: String,
    pub(crate) role: Role,
    pub(crate) model: String,
    pub(crate) tp: usize,
    pub(crate) supervisor: SupervisorHandle,
    pub(crate) scheduler: SchedulerHandle,
    pub(crate) kv: Option<Arc<KvContext>>,
    pub(crate) peer: Option<Arc<PeerService<SchedulerHandle>>>,
    /// How its prefix cache hashes blocks; `None` with the cache off (no KV events).
    pub(crate) kv_scheme: Option<crate::kv_events::HashScheme>,
    /// The KV cache tiers, when on.
    pub(crate) tiers: Option<Arc<crate::kv_tiers::KvTiers>>,
    /// An encode instance's encoder.
    pub(crate) encoder: Option<Arc<crate::encode::EncoderService>>,
}

/// KV hand-off figures of an instance (zeros without a transfer engine).
fn kv_figures(kv: Option<&KvContext>) -> crate::handoff::KvFigures {
    kv.map(KvContext::figures).unwrap_or_default()
}

impl InspectSource {
    /// The live snapshot: the supervisor's tree and the scheduler's figures (each query
    /// bounded).
    pub(crate) async fn snapshot(&self) -> Result<InstanceSnapshot, crate::error::RequestError> {
        let actors = self.supervisor.snapshot().await?;
        let stats = self.scheduler.stats().await?;
        let kv = kv_figures(self.kv.as_deref());
        Ok(InstanceSnapshot {
            instance: self.name.clone(),
            role: self.role.as_str().to_string(),
            model: self.model.clone(),
            tp: self.tp,
            waiting: stats.waiting,
            running: stats.running,
            kv_blocks_total: stats.blocks_total,
            kv_blocks_free: stats.blocks_free,
            kv_blocks_used: stats.blocks_total.saturating_sub(stats.blocks_free),
            preemptions: stats.preemptions,
            transfers_in_flight: kv.transfers_in_flight,
            bytes_sent: kv.bytes_sent,
            bytes_received: kv.bytes_received,
            transfer_failures: kv.failures,
            kv_blocks_cached: stats.blocks_cached,
            prompt_tokens: stats.prompt_tokens,
            prompt_tokens_cached: stats.prompt_tokens_cached,
            cache_evictions: stats.cache_evictions,
            local_prefills: stats.local_prefills,
            handoffs_done: kv.handoffs_done,
            handoff_bytes: kv.blocks_moved * kv.block_bytes,
            handoff_bytes_skipped: kv.blocks_skipped * kv.block_bytes,
            kv_paths: self
                .kv
                .as_ref()
                .map(|k| k.peers.kv_paths())
                .unwrap_or_default(),
            kv_tiers: self
                .tiers
                .as_ref()
                .map(|t| t.figures().snapshots())
                .unwrap_or_default(),
            encoder: self.encoder.as_ref().map(|e| {
                let (cache, holds) = (e.cache().figures(), e.figures());
                pdserve_runtime::supervision::EncoderSnapshot {
                    cache_images: cache.entries as u64,
                    cache_bytes: cache.bytes as u64,
                    hold_slots: holds.slots as u64,
                    hold_slots_used: holds.used as u64,
                    holds_served: holds.served,
                }
            }),
            actors,
        })
    }

    /// Heartbeat load figures from the scheduler (bounded by `within`).
    async fn load(&self, within: Duration) -> Result<LoadFigures, crate::error::RequestError> {
        let stats = tokio::time::timeout(within, self.scheduler.stats())
            .await
            .map_err(|_| {
                crate::error::RequestError::Internal(format!(
                    "the scheduler did not answer within {within:?}"
                ))
            })??;
        let sat = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        Ok(LoadFigures {
            running: sat(stats.running),
            waiting: sat(stats.waiting),
            free_blocks: stats.blocks_free as u64,
            total_blocks: stats.blocks_total as u64,
        })
    }
}

fn error_answer(kind: &str, message: impl Into<String>) -> ControlMessage {
    ControlMessage::Error(ErrorMessage {
        kind: kind.to_string(),
        message: message.into(),
    })
}

/// Answers a request past the control plane's bound: `overloaded`, naming `who`, at once (the
/// send bounded by a second), counted in [`CONTROL_REQUESTS_REFUSED_TOTAL`]. Instances and the
/// proxy refuse alike.
pub(crate) async fn refuse_overloaded(responder: pdserve_transport::control::Responder, who: &str) {
    metrics::counter!(CONTROL_REQUESTS_REFUSED_TOTAL).increment(1);
    let answer = error_answer(
        "overloaded",
        format!("{who} is answering as many control requests as it takes at once; try again"),
    );
    if !matches!(
        tokio::time::timeout(REFUSAL_TIMEOUT, responder.respond(answer)).await,
        Ok(Ok(()))
    ) {
        tracing::debug!("overloaded answer not delivered");
    }
}

/// Where the control plane's answers run: tracked tasks (drained at shutdown), at most
/// `permits`' worth at once over every connection.
#[derive(Clone)]
struct Dispatch {
    tasks: TaskTracker,
    permits: Arc<tokio::sync::Semaphore>,
}

/// Answers the requests that arrive on `conn` until it closes. Each answer is built on its
/// own (tracked) task, so a slow snapshot or a remote prefill never holds up the next request;
/// at most `dispatch`'s permits' worth at once, the rest refused as `overloaded`.
async fn serve_requests(conn: Arc<ControlConnection>, source: InspectSource, dispatch: Dispatch) {
    let Dispatch { tasks, permits } = dispatch;
    while let Some(incoming) = conn.recv().await {
        // One-way messages (a peer's heartbeats) carry nothing an instance acts on.
        let Some(responder) = incoming.responder else {
            continue;
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            refuse_overloaded(responder, &source.name).await;
            continue;
        };
        let source = source.clone();
        let (caller, from) = (conn.peer().node.clone(), conn.remote_address().ip());
        tasks.spawn(async move {
            let _permit = permit;
            let answer = match incoming.message {
                ControlMessage::Opaque { topic, body } if topic == PEER_TOPIC => {
                    let answer = match (&source.peer, decode_request(&body)) {
                        (Some(service), Ok(request)) => {
                            let caller = crate::handoff::Caller {
                                node: Some(&caller),
                                ip: Some(from),
                            };
                            service.handle(request, caller).await
                        }
                        (None, _) => {
                            PeerAnswer::Failed(crate::handoff::HandoffError::NotSupported(
                                "this instance has no KV transfer engine".into(),
                            ))
                        }
                        (_, Err(e)) => PeerAnswer::Failed(e),
                    };
                    match encode_answer(&answer) {
                        Ok(body) => ControlMessage::Opaque {
                            topic: PEER_TOPIC.into(),
                            body,
                        },
                        Err(e) => error_answer("internal", e.to_string()),
                    }
                }
                ControlMessage::Opaque { topic, body } if topic == EC_TOPIC => {
                    use crate::encode::protocol as ec;
                    let answer = match (&source.encoder, ec::decode_request(&body)) {
                        (Some(service), Ok(request)) => {
                            let caller = crate::handoff::Caller {
                                node: Some(&caller),
                                ip: Some(from),
                            };
                            service.handle(request, caller)
                        }
                        (None, _) => ec::EcAnswer::Failed(ec::EncoderError::NotSupported(
                            "this is not an encode instance".into(),
                        )),
                        (_, Err(e)) => ec::EcAnswer::Failed(e),
                    };
                    match ec::encode_answer(&answer) {
                        Ok(body) => ControlMessage::Opaque {
                            topic: EC_TOPIC.into(),
                            body,
                        },
                        Err(e) => error_answer("internal", e.to_string()),
                    }
                }
                ControlMessage::InspectRequest => {
                    match tokio::time::timeout(INSPECT_TIMEOUT, source.snapshot()).await {
                        Ok(Ok(snap)) => {
                            ControlMessage::Inspect(Box::new(InspectAnswer::Instance(snap)))
                        }
                        Ok(Err(e)) => error_answer("inspect_failed", e.to_string()),
                        Err(_) => error_answer(
                            "timeout",
                            format!("the snapshot took longer than {INSPECT_TIMEOUT:?}"),
                        ),
                    }
                }
                ControlMessage::Opaque { topic, .. } => {
                    error_answer("unsupported", format!("unknown topic {topic:?}"))
                }
                other => error_answer(
                    "unsupported",
                    format!("an instance does not answer {}", other.name()),
                ),
            };
            if let Err(e) = responder.respond(answer).await {
                tracing::debug!(error = %e, "control answer not delivered");
            }
        });
    }
}

/// Counters and switches shared by the control plane's tasks.
#[derive(Default)]
struct Shared {
    registrations: AtomicU64,
    heartbeats: AtomicU64,
    paused: AtomicBool,
    /// Set once the instance began draining: the registration loop no longer registers again
    /// after a lost connection.
    draining: AtomicBool,
    /// The connection to the proxy while registered.
    proxy_conn: std::sync::Mutex<Option<Arc<ControlConnection>>>,
}

/// A running instance control plane. Dropping it (or [`ControlPlane::shutdown`]) closes the
/// endpoint and every connection, so a proxy sees this instance leave at once.
pub struct ControlPlane {
    endpoint: Arc<ControlEndpoint>,
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<tokio::task::JoinHandle<()>>,
    registration: Option<tokio::task::JoinHandle<()>>,
    tasks: TaskTracker,
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl ControlPlane {
    /// Binds the instance's control endpoint (before its actors start, so the hand-off can
    /// reach peers through it).
    ///
    /// # Errors
    /// [`StartError::ControlPlane`] when the credentials are not the instance's or the address
    /// cannot be bound.
    pub(crate) fn bind(
        ctl: &InstanceControl,
        name: &str,
    ) -> Result<Arc<ControlEndpoint>, StartError> {
        if ctl.credentials.node() != name {
            return Err(StartError::ControlPlane(format!(
                "the member credentials are for `{}`, the instance is `{name}`",
                ctl.credentials.node(),
            )));
        }
        let config = ControlConfig {
            listen: ctl.listen,
            role: ctl.role,
            ..ControlConfig::default()
        };
        ControlEndpoint::bind(&ctl.credentials, config)
            .map(Arc::new)
            .map_err(|e| StartError::ControlPlane(format!("cannot listen on {}: {e}", ctl.listen)))
    }

    /// Starts answering on `endpoint` and (with a proxy configured) registering and
    /// heartbeating. Must run inside a tokio runtime.
    ///
    /// # Errors
    /// [`StartError::ControlPlane`] when registering needs an HTTP API the instance lacks.
    pub(crate) fn start(
        ctl: InstanceControl,
        endpoint: Arc<ControlEndpoint>,
        source: InspectSource,
        api_url: Option<String>,
    ) -> Result<Self, StartError> {
        let addr = endpoint
            .local_addr()
            .map_err(|e| StartError::ControlPlane(e.to_string()))?;
        let shared = Arc::new(Shared::default());
        let tasks = TaskTracker::new();
        let (ep, src, t) = (endpoint.clone(), source.clone(), tasks.clone());
        let dispatch = Dispatch {
            tasks: tasks.clone(),
            permits: Arc::new(tokio::sync::Semaphore::new(ctl.max_requests)),
        };
        let accept_dispatch = dispatch.clone();
        let accept = tokio::spawn(async move {
            while let Some(conn) = ep.accept().await {
                t.spawn(serve_requests(
                    Arc::new(conn),
                    src.clone(),
                    accept_dispatch.clone(),
                ));
            }
        });
        let mut registration = None;
        if let Some(proxy) = ctl.proxy {
            let url = api_url.ok_or_else(|| {
                StartError::ControlPlane(
                    "registering with a proxy needs the HTTP API (no bind address)".into(),
                )
            })?;
            let reg = Registration {
                node: source.name.clone(),
                role: ctl.role,
                url,
                control_addr: addr.to_string(),
                heartbeat_ms: ctl.heartbeat.as_millis() as u64,
                block_size: source.kv_scheme.map(|k| k.block_size),
                cache_salt: source.kv_scheme.map(|k| k.salt),
            };
            registration = Some(tokio::spawn(register_and_heartbeat(
                endpoint.clone(),
                proxy,
                reg,
                ctl.heartbeat,
                source,
                shared.clone(),
                dispatch,
            )));
        }
        tracing::info!(%addr, proxy = ?ctl.proxy, "control plane listening");
        Ok(Self {
            endpoint,
            addr,
            shared,
            accept: Some(accept),
            registration,
            tasks,
        })
    }

    /// Where the endpoint listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Successful registrations with the proxy so far (1 + re-registrations).
    pub fn registrations(&self) -> u64 {
        self.shared.registrations.load(Ordering::Relaxed)
    }

    /// Heartbeats sent so far.
    pub fn heartbeats(&self) -> u64 {
        self.shared.heartbeats.load(Ordering::Relaxed)
    }

    /// Fault hook for tests and drills: while paused, no heartbeat is sent (the connection
    /// stays open), as when the instance hangs.
    pub fn set_heartbeats_paused(&self, paused: bool) {
        self.shared.paused.store(paused, Ordering::SeqCst);
    }

    /// Tells the proxy this instance is draining: it stops routing here at once but keeps the
    /// registration (and the control connection, so `pdserve inspect` still shows the instance,
    /// `draining`, with its requests finishing) until the instance stops. Returns whether the
    /// proxy acknowledged within [`DRAINING_ANSWER_TIMEOUT`]; when it did not (no proxy,
    /// not registered, an older proxy), the caller should [`ControlPlane::deregister`]. Either
    /// way the instance does not register again.
    pub async fn announce_draining(&self) -> bool {
        self.shared.draining.store(true, Ordering::SeqCst);
        let conn = self
            .shared
            .proxy_conn
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let Some(conn) = conn else {
            return false;
        };
        let ask = conn.request(ControlMessage::Draining);
        matches!(
            tokio::time::timeout(DRAINING_ANSWER_TIMEOUT, ask).await,
            Ok(Ok(ControlMessage::DrainingAck))
        )
    }

    /// Leaves the proxy's routing set: ends the registration and closes its connection (the
    /// proxy stops routing here at once). Peer requests keep being answered.
    pub fn deregister(&mut self) {
        if let Some(r) = self.registration.take() {
            r.abort();
        }
        if let Some(conn) = self
            .shared
            .proxy_conn
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            conn.close();
        }
    }

    /// Stops every task and closes the endpoint and its connections.
    pub fn shutdown(&mut self) {
        self.deregister();
        if let Some(a) = self.accept.take() {
            a.abort();
        }
        self.endpoint.close();
        self.tasks.close();
    }

    /// Waits (bounded by `within`) for the answer tasks to end after [`ControlPlane::shutdown`].
    pub async fn wait(&self, within: Duration) -> bool {
        tokio::time::timeout(within, self.tasks.wait())
            .await
            .is_ok()
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Sends the registration and checks the proxy's answer.
async fn register(
    conn: &ControlConnection,
    registration: &Registration,
) -> Result<(), RegistrationError> {
    let failed = |message: String| RegistrationError::new(RegistrationField::Registration, message);
    match conn
        .request(ControlMessage::Register(Box::new(registration.clone())))
        .await
    {
        Ok(ControlMessage::Registered { .. }) => Ok(()),
        Ok(ControlMessage::RegistrationRefused(refusal)) => Err(refusal),
        Ok(other) => Err(failed(format!(
            "the proxy answered the registration with {}",
            other.name()
        ))),
        Err(e) => Err(failed(e.to_string())),
    }
}

/// Why a batch of prefix-cache events did not reach the proxy ([`send_kv_events`]).
#[derive(Debug, thiserror::Error)]
enum KvEventsError {
    /// The scheduler did not answer within the wait.
    #[error("the scheduler did not answer within {0:?}")]
    SchedulerSlow(Duration),
    /// The scheduler could not be asked (it is gone).
    #[error(transparent)]
    Scheduler(#[from] crate::error::RequestError),
    /// The control connection refused the message.
    #[error(transparent)]
    Send(#[from] pdserve_transport::TransportError),
    /// The control connection did not take the message within the wait.
    #[error("not sent in time")]
    SendSlow,
}

/// Drains the scheduler's prefix-cache events and sends them to the proxy (one-way). On an
/// error whatever was drained is lost, and the next batch must be a snapshot.
async fn send_kv_events(
    conn: &ControlConnection,
    source: &InspectSource,
    snapshot: bool,
    within: Duration,
) -> Result<(), KvEventsError> {
    let batch = tokio::time::timeout(within, source.scheduler.kv_events(snapshot))
        .await
        .map_err(|_| KvEventsError::SchedulerSlow(within))??;
    if batch.is_empty() {
        return Ok(());
    }
    let send = conn.send(ControlMessage::KvEvents(Box::new(batch)));
    tokio::time::timeout(within, send)
        .await
        .map_err(|_| KvEventsError::SendSlow)?
        .map_err(KvEventsError::from)
}

/// Connect, register, heartbeat until the connection breaks; then again, with backoff.
async fn register_and_heartbeat(
    endpoint: Arc<ControlEndpoint>,
    proxy: SocketAddr,
    registration: Registration,
    interval: Duration,
    source: InspectSource,
    shared: Arc<Shared>,
    dispatch: Dispatch,
) {
    let tasks = dispatch.tasks.clone();
    let initial_delay = interval.min(Duration::from_millis(100));
    let mut delay = initial_delay;
    let mut last_error: Option<String> = None;
    let mut seq = 0u64;
    loop {
        if shared.draining.load(Ordering::SeqCst) {
            tracing::info!(%proxy, "draining: not registering again");
            return;
        }
        let attempt = async {
            let conn = Arc::new(endpoint.connect(proxy).await.map_err(|e| e.to_string())?);
            // Answer the proxy's requests (inspect) on this connection, from before we register.
            let server = tasks.spawn(serve_requests(
                conn.clone(),
                source.clone(),
                dispatch.clone(),
            ));
            match register(&conn, &registration).await {
                Ok(()) => Ok((conn, server)),
                Err(e) => {
                    server.abort();
                    conn.close();
                    Err(format!("registration refused: {e}"))
                }
            }
        };
        let (conn, server) = match attempt.await {
            Ok(ok) => ok,
            Err(e) => {
                // Log a new failure loudly, a repeated one quietly.
                if last_error.as_deref() != Some(e.as_str()) {
                    tracing::warn!(%proxy, error = %e, "cannot register with the proxy; retrying");
                } else {
                    tracing::debug!(%proxy, error = %e, "cannot register with the proxy; retrying");
                }
                last_error = Some(e);
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(MAX_RECONNECT_DELAY);
                continue;
            }
        };
        shared.registrations.fetch_add(1, Ordering::Relaxed);
        *shared.proxy_conn.lock().unwrap_or_else(|e| e.into_inner()) = Some(conn.clone());
        tracing::info!(%proxy, node = %registration.node, "registered with the proxy");
        delay = initial_delay;
        last_error = None;
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The proxy's view of our prefix cache starts over with each registration.
        let mut kv_snapshot_due = true;
        let mut events_tick = tokio::time::interval(KV_EVENTS_INTERVAL.min(interval));
        events_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while conn.is_alive() {
            tokio::select! {
                _ = tick.tick() => {}
                // Between heartbeats: KV events only, so the router learns of new blocks fast.
                _ = events_tick.tick() => {
                    if source.kv_scheme.is_some() && !shared.paused.load(Ordering::SeqCst) {
                        kv_snapshot_due = send_kv_events(&conn, &source, kv_snapshot_due, interval.max(Duration::from_millis(200)))
                            .await
                            .map_err(|e| tracing::debug!(%proxy, error = %e, "KV events not sent"))
                            .is_err();
                    }
                    continue;
                }
            }
            if shared.paused.load(Ordering::SeqCst) {
                continue;
            }
            let load = match source.load(interval.max(Duration::from_millis(200))).await {
                Ok(l) => l,
                Err(e) => {
                    tracing::warn!(error = %e, "heartbeat skipped");
                    continue;
                }
            };
            let faults = source.kv.as_ref().and_then(|k| k.settings.faults.clone());
            match faults.map_or(ControlFault::Send, |f| f.control()) {
                ControlFault::Send => {}
                ControlFault::Drop => continue,
                ControlFault::Delay(d) => tokio::time::sleep(d).await,
                ControlFault::Corrupt => {
                    // A registration with a field that does not parse: the proxy must refuse
                    // it and keep the registration it has.
                    let bad = ControlMessage::Register(Box::new(Registration {
                        url: "\u{0}injected fault".into(),
                        ..registration.clone()
                    }));
                    let _ = tokio::time::timeout(interval, conn.request(bad)).await;
                    continue;
                }
            }
            seq += 1;
            let hb = Heartbeat {
                node: registration.node.clone(),
                seq,
                load,
            };
            let send = conn.send(ControlMessage::Heartbeat(hb));
            match tokio::time::timeout(interval.max(Duration::from_millis(200)), send).await {
                Ok(Ok(())) => {
                    shared.heartbeats.fetch_add(1, Ordering::Relaxed);
                }
                Ok(Err(e)) => tracing::debug!(%proxy, error = %e, "heartbeat not sent"),
                Err(_) => tracing::debug!(%proxy, "heartbeat not sent in time"),
            }
        }
        server.abort();
        tracing::warn!(%proxy, "control connection to the proxy lost; reconnecting");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_enables_the_control_plane_only_with_credentials() {
        let mut cfg = ServeConfig::default();
        assert!(InstanceControl::from_config(&cfg).unwrap().is_none());
        cfg.control.proxy = Some("127.0.0.1:7000".into());
        let e = InstanceControl::from_config(&cfg).unwrap_err().to_string();
        assert!(e.contains("transfer.credentials_dir"), "{e}");

        let dir = tempfile::tempdir().unwrap();
        pdserve_transport::control::tls::init_cluster(dir.path(), "cfg-test").unwrap();
        pdserve_transport::control::tls::issue_member(dir.path(), "decode-7").unwrap();
        cfg.transfer.credentials_dir = Some(dir.path().display().to_string());
        cfg.instance.name = "decode-7".into();
        cfg.instance.role = Role::Decode;
        cfg.control.listen = "127.0.0.1:7107".into();
        cfg.control.heartbeat_ms = 250;
        let ctl = InstanceControl::from_config(&cfg).unwrap().unwrap();
        assert_eq!(ctl.credentials.node(), "decode-7");
        assert_eq!(ctl.credentials.cluster(), "cfg-test");
        assert_eq!(ctl.listen, "127.0.0.1:7107".parse::<SocketAddr>().unwrap());
        assert_eq!(
            ctl.proxy,
            Some("127.0.0.1:7000".parse::<SocketAddr>().unwrap())
        );
        assert_eq!(ctl.heartbeat, Duration::from_millis(250));
        assert_eq!(ctl.role, Role::Decode);

        cfg.instance.name = "decode-8".into();
        let e = InstanceControl::from_config(&cfg).unwrap_err().to_string();
        assert!(
            e.contains("no usable member credentials for `decode-8`"),
            "{e}"
        );
    }
}
