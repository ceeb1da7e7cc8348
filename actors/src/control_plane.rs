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

use crate::discovery::{Announcement, EtcdSettings, MemberKind, MemberRecord, MemberWatch};
use pdserve_runtime::wire::kv_events::KvEventBatch;
use std::collections::HashMap;
use tokio::sync::{broadcast, watch};

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
    /// The proxy's control address to register with; `None`: answer `inspect` only (or
    /// register with the proxies etcd lists, with [`InstanceControl::discovery`]).
    pub proxy: Option<SocketAddr>,
    /// Membership in etcd: keep this instance's record there under a lease, and register
    /// with every proxy listed there (`control.discovery.kind = "etcd"`).
    pub discovery: Option<EtcdSettings>,
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
            discovery: None,
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
        let discovery = EtcdSettings::from_config(&cfg.control.discovery, credentials.cluster());
        Ok(Some(Self {
            credentials,
            listen,
            proxy,
            discovery,
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
    /// Set once the instance began draining: the registration loops no longer register again
    /// after a lost connection.
    draining: AtomicBool,
    /// The connection to each proxy this instance is registered with.
    proxy_conns: std::sync::Mutex<HashMap<SocketAddr, Arc<ControlConnection>>>,
}

impl Shared {
    fn conns(&self) -> std::sync::MutexGuard<'_, HashMap<SocketAddr, Arc<ControlConnection>>> {
        self.proxy_conns.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The prefix cache's events, drained from the scheduler once and sent to every proxy this
/// instance is registered with (each proxy builds its KV index from them).
struct KvFeed {
    batches: broadcast::Sender<Arc<KvEventBatch>>,
    /// A proxy (newly registered, or one that missed a batch) needs a snapshot: the next drain
    /// is one, sent to every proxy (a snapshot replaces what a proxy knew, so the others lose
    /// nothing).
    snapshot_due: AtomicBool,
}

impl KvFeed {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            batches: broadcast::channel(KV_FEED_DEPTH).0,
            snapshot_due: AtomicBool::new(true),
        })
    }

    fn want_snapshot(&self) {
        self.snapshot_due.store(true, Ordering::SeqCst);
    }
}

/// Batches a registration loop may fall behind the feed before it asks for a snapshot.
const KV_FEED_DEPTH: usize = 64;

/// A running instance control plane. Dropping it (or [`ControlPlane::shutdown`]) closes the
/// endpoint and every connection, so a proxy sees this instance leave at once.
pub struct ControlPlane {
    endpoint: Arc<ControlEndpoint>,
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<tokio::task::JoinHandle<()>>,
    /// Follows the set of proxies and runs one registration loop per proxy.
    registration: Option<tokio::task::JoinHandle<()>>,
    /// Drains the prefix cache's events for the registration loops.
    kv_pump: Option<tokio::task::JoinHandle<()>>,
    /// This instance's record in etcd (discovery = etcd).
    announcement: Option<Announcement>,
    /// The proxies etcd lists (discovery = etcd).
    proxies: Option<MemberWatch>,
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

    /// Starts answering on `endpoint` and (with a proxy configured, or etcd discovery)
    /// registering and heartbeating. Must run inside a tokio runtime.
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
        let mut plane = Self {
            endpoint: endpoint.clone(),
            addr,
            shared: shared.clone(),
            accept: Some(accept),
            registration: None,
            kv_pump: None,
            announcement: None,
            proxies: None,
            tasks,
        };
        if ctl.proxy.is_none() && ctl.discovery.is_none() {
            tracing::info!(%addr, "control plane listening (no proxy to register with)");
            return Ok(plane);
        }
        let url = api_url.ok_or_else(|| {
            StartError::ControlPlane(
                "registering with a proxy needs the HTTP API (no bind address)".into(),
            )
        })?;
        let reg = Registration {
            node: source.name.clone(),
            role: ctl.role,
            url: url.clone(),
            control_addr: addr.to_string(),
            heartbeat_ms: ctl.heartbeat.as_millis() as u64,
            block_size: source.kv_scheme.map(|k| k.block_size),
            cache_salt: source.kv_scheme.map(|k| k.salt),
        };
        let feed = KvFeed::new();
        if source.kv_scheme.is_some() {
            plane.kv_pump = Some(tokio::spawn(pump_kv_events(
                feed.clone(),
                source.clone(),
                shared.clone(),
                ctl.heartbeat,
            )));
        }
        let looped = Looped {
            endpoint,
            registration: reg,
            interval: ctl.heartbeat,
            source: source.clone(),
            shared,
            dispatch,
            feed,
        };
        let proxies = match (&ctl.discovery, ctl.proxy) {
            (Some(etcd), _) => {
                plane.announcement = Some(Announcement::start(
                    etcd.clone(),
                    MemberKind::Instance,
                    MemberRecord {
                        node: source.name.clone(),
                        role: ctl.role,
                        url,
                        control_addr: addr.to_string(),
                    },
                ));
                let watch = MemberWatch::start(etcd.clone(), MemberKind::Proxy);
                let (tx, rx) = watch::channel(Vec::new());
                let mut members = watch.members.clone();
                plane.proxies = Some(watch);
                // The proxies' control addresses, as etcd lists them.
                let follow = async move {
                    loop {
                        let addrs = crate::discovery::control_addrs(&members.borrow_and_update());
                        tx.send_replace(addrs);
                        if members.changed().await.is_err() {
                            return;
                        }
                    }
                };
                (rx, Some(follow))
            }
            (None, Some(proxy)) => (watch::channel(vec![proxy]).1, None),
            (None, None) => unreachable!("returned above"),
        };
        plane.registration = Some(tokio::spawn(follow_proxies(looped, proxies.0, proxies.1)));
        tracing::info!(%addr, proxy = ?ctl.proxy, etcd = ctl.discovery.is_some(), "control plane listening");
        Ok(plane)
    }

    /// Where the endpoint listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Successful registrations with a proxy so far (1 + re-registrations, over every proxy).
    pub fn registrations(&self) -> u64 {
        self.shared.registrations.load(Ordering::Relaxed)
    }

    /// Heartbeats sent so far (to every proxy).
    pub fn heartbeats(&self) -> u64 {
        self.shared.heartbeats.load(Ordering::Relaxed)
    }

    /// The proxies this instance is registered with now.
    pub fn registered_with(&self) -> Vec<SocketAddr> {
        let mut v: Vec<_> = self.shared.conns().keys().copied().collect();
        v.sort();
        v
    }

    /// Fault hook for tests and drills: while paused, no heartbeat is sent (the connection
    /// stays open), as when the instance hangs.
    pub fn set_heartbeats_paused(&self, paused: bool) {
        self.shared.paused.store(paused, Ordering::SeqCst);
    }

    /// Tells every proxy this instance is draining: they stop routing here at once but keep
    /// the registration (and the control connection, so `pdserve inspect` still shows the
    /// instance, `draining`, with its requests finishing) until the instance stops; its etcd
    /// record (with etcd discovery) is withdrawn. Returns whether every proxy acknowledged
    /// within [`DRAINING_ANSWER_TIMEOUT`]; when one did not (no proxy, not registered, an
    /// older proxy), the caller should [`ControlPlane::deregister`]. Either way the instance
    /// does not register again.
    pub async fn announce_draining(&mut self) -> bool {
        self.shared.draining.store(true, Ordering::SeqCst);
        if let Some(a) = self.announcement.take() {
            a.withdraw(DRAINING_ANSWER_TIMEOUT).await;
        }
        let conns: Vec<_> = self.shared.conns().values().cloned().collect();
        if conns.is_empty() {
            return false;
        }
        let asks = conns.iter().map(|conn| async move {
            let ask = conn.request(ControlMessage::Draining);
            matches!(
                tokio::time::timeout(DRAINING_ANSWER_TIMEOUT, ask).await,
                Ok(Ok(ControlMessage::DrainingAck))
            )
        });
        futures_util::future::join_all(asks)
            .await
            .into_iter()
            .all(|acked| acked)
    }

    /// Leaves every proxy's routing set: ends the registrations and closes their connections
    /// (the proxies stop routing here at once). Peer requests keep being answered.
    pub fn deregister(&mut self) {
        if let Some(r) = self.registration.take() {
            r.abort();
        }
        if let Some(p) = self.kv_pump.take() {
            p.abort();
        }
        self.announcement = None;
        self.proxies = None;
        for (_, conn) in self.shared.conns().drain() {
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

/// Drains the scheduler's prefix-cache events every [`KV_EVENTS_INTERVAL`] (at most; the
/// heartbeat interval when shorter) while some proxy listens, and hands them to every
/// registration loop. A failed drain loses what it held: the next one is a snapshot.
async fn pump_kv_events(
    feed: Arc<KvFeed>,
    source: InspectSource,
    shared: Arc<Shared>,
    interval: Duration,
) {
    let within = interval.max(Duration::from_millis(200));
    let mut tick = tokio::time::interval(KV_EVENTS_INTERVAL.min(interval));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if feed.batches.receiver_count() == 0 || shared.paused.load(Ordering::SeqCst) {
            continue;
        }
        let snapshot = feed.snapshot_due.swap(false, Ordering::SeqCst);
        match tokio::time::timeout(within, source.scheduler.kv_events(snapshot)).await {
            Ok(Ok(batch)) if batch.is_empty() => {}
            Ok(Ok(batch)) => {
                // No receiver left since the check: the next listener asks for a snapshot.
                let _ = feed.batches.send(Arc::new(batch));
            }
            Ok(Err(e)) => {
                feed.want_snapshot();
                tracing::debug!(error = %e, "KV events not drained");
            }
            Err(_) => {
                feed.want_snapshot();
                tracing::debug!(
                    "KV events not drained: the scheduler did not answer within {within:?}"
                );
            }
        }
    }
}

/// What every registration loop shares.
#[derive(Clone)]
struct Looped {
    endpoint: Arc<ControlEndpoint>,
    registration: Registration,
    interval: Duration,
    source: InspectSource,
    shared: Arc<Shared>,
    dispatch: Dispatch,
    feed: Arc<KvFeed>,
}

/// Keeps one registration loop per proxy in `proxies` (a fixed one, or those etcd lists):
/// starts a loop for a proxy that appears, stops the loop and closes the connection of one
/// that leaves. `follow` (etcd) keeps `proxies` up to date and runs beside the loops.
async fn follow_proxies(
    looped: Looped,
    mut proxies: watch::Receiver<Vec<SocketAddr>>,
    follow: Option<impl std::future::Future<Output = ()>>,
) {
    let follower = async {
        match follow {
            Some(f) => f.await,
            None => std::future::pending().await,
        }
    };
    let loops = async {
        // Dropping the set (when this task is aborted) aborts every loop.
        let mut running = tokio::task::JoinSet::new();
        let mut by_proxy: HashMap<SocketAddr, tokio::task::AbortHandle> = HashMap::new();
        loop {
            let want: Vec<SocketAddr> = proxies.borrow_and_update().clone();
            by_proxy.retain(|proxy, handle| {
                let keep = want.contains(proxy);
                if !keep {
                    handle.abort();
                    if let Some(conn) = looped.shared.conns().remove(proxy) {
                        conn.close();
                    }
                    tracing::info!(%proxy, "the proxy left the cluster: registration ended");
                }
                keep
            });
            for proxy in want {
                if let std::collections::hash_map::Entry::Vacant(e) = by_proxy.entry(proxy) {
                    e.insert(running.spawn(register_and_heartbeat(looped.clone(), proxy)));
                }
            }
            tokio::select! {
                changed = proxies.changed() => {
                    if changed.is_err() {
                        // No more changes: keep the loops running as they are.
                        std::future::pending::<()>().await;
                    }
                }
                Some(_) = running.join_next(), if !running.is_empty() => {}
            }
        }
    };
    tokio::select! {
        () = follower => {}
        () = loops => {}
    }
}

/// Connect, register, heartbeat until the connection breaks; then again, with backoff.
async fn register_and_heartbeat(looped: Looped, proxy: SocketAddr) {
    let Looped {
        endpoint,
        registration,
        interval,
        source,
        shared,
        dispatch,
        feed,
    } = looped;
    let tasks = dispatch.tasks.clone();
    let initial_delay = interval.min(Duration::from_millis(100));
    let mut delay = initial_delay;
    let mut last_error: Option<String> = None;
    let mut seq = 0u64;
    let within = interval.max(Duration::from_millis(200));
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
        shared.conns().insert(proxy, conn.clone());
        tracing::info!(%proxy, node = %registration.node, "registered with the proxy");
        delay = initial_delay;
        last_error = None;
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The proxy's view of our prefix cache starts over with each registration.
        // (`None` once the feed closed, which it does not while this loop holds `feed`.)
        let mut events = Some(feed.batches.subscribe());
        feed.want_snapshot();
        while conn.is_alive() {
            tokio::select! {
                _ = tick.tick() => {}
                // Between heartbeats: KV events only, so the router learns of new blocks fast.
                batch = async { events.as_mut().expect("guarded").recv().await }, if events.is_some() => {
                    match batch {
                        Ok(batch) => {
                            let send = conn.send(ControlMessage::KvEvents(Box::new((*batch).clone())));
                            match tokio::time::timeout(within, send).await {
                                Ok(Ok(())) => {}
                                Ok(Err(e)) => {
                                    feed.want_snapshot();
                                    tracing::debug!(%proxy, error = %e, "KV events not sent");
                                }
                                Err(_) => {
                                    feed.want_snapshot();
                                    tracing::debug!(%proxy, "KV events not sent in time");
                                }
                            }
                        }
                        Err(broadcast::error::RecvError::Lagged(_)) => feed.want_snapshot(),
                        Err(broadcast::error::RecvError::Closed) => events = None,
                    }
                    continue;
                }
            }
            if shared.paused.load(Ordering::SeqCst) {
                continue;
            }
            let load = match source.load(within).await {
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
            match tokio::time::timeout(within, send).await {
                Ok(Ok(())) => {
                    shared.heartbeats.fetch_add(1, Ordering::Relaxed);
                }
                Ok(Err(e)) => tracing::debug!(%proxy, error = %e, "heartbeat not sent"),
                Err(_) => tracing::debug!(%proxy, "heartbeat not sent in time"),
            }
        }
        server.abort();
        shared.conns().remove(&proxy);
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
