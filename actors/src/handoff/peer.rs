//! The client side of the peer protocol: how a decode instance reaches a prefill instance.
//!
//! [`Peers`] carries [`PeerRequest`]s to a [`PeerAddr`] over one of two carriers, the same
//! rkyv frames on both:
//! - **control plane** (`PeerAddr::Control`): the mutual-TLS QUIC connection to the peer's
//!   control endpoint (one per peer, opened on first use, reopened when it broke), topic
//!   [`PEER_TOPIC`]. The peer's node name is bound to its certificate, and checked against the
//!   engine id we expect. This is the path of every cluster with credentials (`pdserve
//!   launch`, `pdserve serve --config`).
//! - **HTTP** (`PeerAddr::Http`): `POST /v1/kv/peer` on the peer's API with the cluster's API
//!   key, for instances without cluster credentials driven by a vLLM-style proxy (whose
//!   `kv_transfer_params` name only `remote_host`/`remote_port`).
//!
//! It also caches per peer what the handshake learned (the peer's [`KvPeerInfo`], validated
//! against ours) and one transfer session per peer engine, in concurrent maps with one
//! connect in flight per peer: a peer that never answers delays only the hand-offs to it.
//! And it renews the leases of held blocks being read, batched per peer.

use super::plan::validate_peer;
use super::protocol::TransferFailure;
use super::protocol::{
    decode_answer, encode_request, HandoffError, KvPeerInfo, PeerAnswer, PeerRequest, SessionOffer,
    PEER_CONTENT_TYPE, PEER_TOPIC,
};
use super::session::Security;
use pdserve_core::handoff::kv_path::{KvPath, KvPlacement};
use pdserve_runtime::faults::{ControlFault, FaultInjector};
use pdserve_runtime::ids::TransferId;
use pdserve_runtime::wire::ControlMessage;
use pdserve_transport::control::{ControlConnection, ControlEndpoint};
use pdserve_transport::{Session, SessionCredentials, SessionKey, TransferEngine, TransportError};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Peer URLs whose control address [`Peers`] remembers.
const MAX_DISCOVERED: usize = 4096;

/// Where a peer instance answers the peer protocol.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum PeerAddr {
    /// Its control endpoint; `node`: the node name it must prove (its engine id), when known.
    Control {
        /// `IP:port` (UDP).
        addr: SocketAddr,
        /// Expected node name.
        node: Option<String>,
    },
    /// Its HTTP API (`http://host:port`).
    Http {
        /// Base URL.
        url: String,
    },
}

impl std::fmt::Display for PeerAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Control {
                addr,
                node: Some(n),
            } => write!(f, "{n} (control {addr})"),
            Self::Control { addr, node: None } => write!(f, "control {addr}"),
            Self::Http { url } => f.write_str(url),
        }
    }
}

/// One slot per key, each with its own lock: a slow connect to one peer holds only its slot.
type Slots<T> = dashmap::DashMap<String, Arc<tokio::sync::Mutex<Option<T>>>>;

fn slot<T>(slots: &Slots<T>, key: &str) -> Arc<tokio::sync::Mutex<Option<T>>> {
    slots.entry(key.to_string()).or_default().clone()
}

/// A cached transfer session and the key it proved (`None`: unkeyed).
struct Cached {
    session: Arc<Session>,
    key: Option<[u8; 32]>,
}

/// The KV path negotiated with one peer (`Peers::kv_path`, in `super::device`), cached by
/// [`Peers`].
#[derive(Clone, Debug)]
pub struct Negotiated {
    /// The path.
    pub path: KvPath,
    /// The peer's advertisement when the path is CUDA IPC (its handles).
    pub remote: Option<Arc<KvPlacement>>,
}

/// The client side of the peer protocol (one per instance).
pub struct Peers {
    engine_id: String,
    control: Option<Arc<ControlEndpoint>>,
    http: reqwest::Client,
    api_key: Option<String>,
    faults: Option<Arc<FaultInjector>>,
    pub(super) timeout: Duration,
    conns: Slots<Arc<ControlConnection>>,
    infos: dashmap::DashMap<PeerAddr, KvPeerInfo>,
    /// The KV path negotiated per peer (`super::device`), forgotten with its handshake.
    pub(super) paths: dashmap::DashMap<PeerAddr, Negotiated>,
    /// Per peer URL, its control address and node when it has one ([`Peers::control_of`]).
    discovered: dashmap::DashMap<String, Option<(SocketAddr, String)>>,
    sessions: Slots<Cached>,
    renewals: Mutex<HashMap<PeerAddr, HashMap<TransferId, usize>>>,
    tasks: TaskTracker,
    shutdown: CancellationToken,
}

impl Peers {
    /// A client for instance `engine_id`: `control` reaches peers' control endpoints (when the
    /// instance has cluster credentials), `api_key` goes with HTTP calls, `timeout` bounds
    /// every call but a Prefill; `http` carries the calls to peers without a control plane
    /// (its TLS trust verifies `https://` peers: [`crate::http::HttpTls::client`]).
    pub fn new(
        engine_id: String,
        control: Option<Arc<ControlEndpoint>>,
        api_key: Option<String>,
        faults: Option<Arc<FaultInjector>>,
        timeout: Duration,
        http: reqwest::ClientBuilder,
    ) -> Arc<Self> {
        Arc::new(Self {
            engine_id,
            control,
            http: http.build().unwrap_or_default(),
            api_key,
            faults,
            timeout,
            conns: Slots::default(),
            infos: dashmap::DashMap::new(),
            paths: dashmap::DashMap::new(),
            discovered: dashmap::DashMap::new(),
            sessions: Slots::default(),
            renewals: Mutex::new(HashMap::new()),
            tasks: TaskTracker::new(),
            shutdown: CancellationToken::new(),
        })
    }

    /// Whether this instance can reach peers over the control plane.
    pub fn has_control_plane(&self) -> bool {
        self.control.is_some()
    }

    /// The control endpoint, when the instance has one.
    pub fn control_endpoint(&self) -> Option<&Arc<ControlEndpoint>> {
        self.control.as_ref()
    }

    /// The best address of a peer: its control endpoint when we have a control plane and
    /// know its control address, its HTTP API otherwise.
    pub fn addr_of(&self, url: &str, control: Option<SocketAddr>, node: Option<&str>) -> PeerAddr {
        match control {
            Some(addr) if self.control.is_some() => PeerAddr::Control {
                addr,
                node: node.map(str::to_string),
            },
            _ => PeerAddr::Http {
                url: url.trim_end_matches('/').to_string(),
            },
        }
    }

    /// Sends `request` to `peer` and returns its answer (`PeerAnswer::Failed` included: the
    /// peer answered), bounded by `within`; through the fault injector when one is configured
    /// (a dropped request fails after `within`, a corrupted one carries a body the peer must
    /// refuse).
    ///
    /// # Errors
    /// The carrier's failure: [`HandoffError::Timeout`], [`HandoffError::PeerGone`],
    /// [`HandoffError::Protocol`] (an answer that does not decode), [`HandoffError::NotSupported`]
    /// (the peer refused the call itself, e.g. a wrong API key).
    pub async fn call(
        &self,
        peer: &PeerAddr,
        request: &PeerRequest,
        within: Duration,
    ) -> Result<PeerAnswer, HandoffError> {
        let mut body = encode_request(request)?;
        match self
            .faults
            .as_ref()
            .map_or(ControlFault::Send, |f| f.control())
        {
            ControlFault::Send => {}
            ControlFault::Drop => {
                tokio::time::sleep(within).await;
                return Err(HandoffError::timeout(
                    format!(
                        "{} to {peer} (injected fault: the message was dropped)",
                        request.name()
                    ),
                    within,
                ));
            }
            ControlFault::Delay(d) => tokio::time::sleep(d).await,
            ControlFault::Corrupt => body = b"\x00injected fault: corrupted".to_vec(),
        }
        let what = || format!("{} to {peer}", request.name());
        let call = async {
            match peer {
                PeerAddr::Control { addr, node } => {
                    self.call_control(*addr, node.as_deref(), body, within)
                        .await
                }
                PeerAddr::Http { url } => match self.control_of(url, within).await? {
                    Some((addr, node)) => {
                        let r = self.call_control(addr, Some(&node), body, within).await;
                        if r.is_err() {
                            // Found again on the next call (it may have moved).
                            self.discovered.remove(url);
                        }
                        r
                    }
                    None => self.call_http(url, body, within).await,
                },
            }
        };
        tokio::time::timeout(within, call)
            .await
            .map_err(|_| HandoffError::timeout(what(), within))?
    }

    async fn call_control(
        &self,
        addr: SocketAddr,
        node: Option<&str>,
        body: Vec<u8>,
        within: Duration,
    ) -> Result<PeerAnswer, HandoffError> {
        let conn = self.connection(addr, node).await?;
        let answer = conn
            .request_within(
                ControlMessage::Opaque {
                    topic: PEER_TOPIC.into(),
                    body,
                },
                within,
            )
            .await;
        match answer {
            Ok(ControlMessage::Opaque { topic, body }) if topic == PEER_TOPIC => {
                decode_answer(&body)
            }
            Ok(other) => Err(HandoffError::Protocol(format!(
                "{addr} answered a peer request with {other:?}"
            ))),
            Err(e) => {
                if !conn.is_alive() {
                    self.conns.remove(&addr.to_string());
                }
                Err(carrier_error(&addr.to_string(), &e))
            }
        }
    }

    /// Sends `body` to the instance at `url` and returns its answer's body: under `topic`
    /// over the control plane when both it and this instance have cluster credentials (found
    /// as for the peer protocol, [`Peers::control_of`]), else POSTed to the peer's HTTP route
    /// `http.0` as content type `http.1` (with this instance's API key, the answer read up to
    /// [`MAX_HTTP_ANSWER_BYTES`]). The carrier of the protocols beside the peer protocol (the
    /// encoder protocol: `ec/1`, `/v1/ec/peer`); bounded by `within` either way.
    ///
    /// # Errors
    /// The carrier's failure, as for [`Peers::call`].
    pub async fn exchange(
        &self,
        url: &str,
        topic: &str,
        http: (&str, &str),
        body: Vec<u8>,
        within: Duration,
    ) -> Result<Vec<u8>, HandoffError> {
        let call = async {
            match self.control_of(url, within).await? {
                Some((addr, node)) => {
                    self.exchange_control(url, addr, &node, topic, body, within)
                        .await
                }
                None => self.post_capped(url, http.0, http.1, body, within).await,
            }
        };
        tokio::time::timeout(within, call)
            .await
            .map_err(|_| HandoffError::timeout(format!("{topic} call to {url}"), within))?
    }

    async fn exchange_control(
        &self,
        url: &str,
        addr: SocketAddr,
        node: &str,
        topic: &str,
        body: Vec<u8>,
        within: Duration,
    ) -> Result<Vec<u8>, HandoffError> {
        let conn = match self.connection(addr, Some(node)).await {
            Ok(c) => c,
            Err(e) => {
                self.discovered.remove(url);
                return Err(e);
            }
        };
        let message = ControlMessage::Opaque {
            topic: topic.into(),
            body,
        };
        match conn.request_within(message, within).await {
            Ok(ControlMessage::Opaque { topic: t, body }) if t == topic => Ok(body),
            Ok(other) => Err(HandoffError::Protocol(format!(
                "{addr} answered a {topic} request with {other:?}"
            ))),
            Err(e) => {
                if !conn.is_alive() {
                    self.conns.remove(&addr.to_string());
                }
                self.discovered.remove(url);
                Err(carrier_error(&addr.to_string(), &e))
            }
        }
    }

    /// The control connection to `addr` (opened once, reopened when broken); its peer must be
    /// `node` when given.
    async fn connection(
        &self,
        addr: SocketAddr,
        node: Option<&str>,
    ) -> Result<Arc<ControlConnection>, HandoffError> {
        let endpoint = self.control.as_ref().ok_or_else(|| {
            HandoffError::NotSupported(
                "this instance has no control plane (no cluster credentials)".into(),
            )
        })?;
        let slot = slot(&self.conns, &addr.to_string());
        let mut conn = slot.lock().await;
        if let Some(c) = conn.as_ref().filter(|c| c.is_alive()) {
            return check_node(c.clone(), addr, node);
        }
        let c = tokio::time::timeout(self.timeout, endpoint.connect(addr))
            .await
            .map_err(|_| HandoffError::timeout(format!("connecting to {addr}"), self.timeout))?
            .map_err(|e| carrier_error(&addr.to_string(), &e))?;
        let c = Arc::new(c);
        *conn = Some(c.clone());
        check_node(c, addr, node)
    }

    /// The control address and node name of the peer at `url`, when both it and this
    /// instance have cluster credentials: such a peer takes the peer protocol only on its
    /// control plane, and names its address in `GET /v1/kv/info`. Asked once per URL.
    async fn control_of(
        &self,
        url: &str,
        within: Duration,
    ) -> Result<Option<(SocketAddr, String)>, HandoffError> {
        if self.control.is_none() {
            return Ok(None);
        }
        if let Some(found) = self.discovered.get(url) {
            return Ok(found.clone());
        }
        #[derive(serde::Deserialize)]
        struct Found {
            engine_id: String,
            control_addr: Option<SocketAddr>,
        }
        let mut req = self.http.get(format!("{url}/v1/kv/info")).timeout(within);
        if let Some(key) = &self.api_key {
            req = req.bearer_auth(key);
        }
        let gone = |reason: String| HandoffError::PeerGone {
            peer: url.to_string(),
            reason,
        };
        let resp = req.send().await.map_err(|e| gone(error_chain(&e)))?;
        let status = resp.status();
        let bytes = read_capped(resp, MAX_HTTP_ANSWER_BYTES, url).await?;
        if !status.is_success() {
            // Not a pdserve instance that publishes its control address (or not now): the
            // HTTP carrier, which says for itself whether it takes the call. A peer without
            // the route is remembered as such; a passing failure (5xx, 401) is asked again.
            tracing::debug!(%url, %status, "no control address from GET /v1/kv/info");
            if matches!(status.as_u16(), 404 | 405) {
                self.remember(url, None);
            }
            return Ok(None);
        }
        let found: Found = serde_json::from_slice(&bytes).map_err(|e| {
            HandoffError::Protocol(format!("{url}/v1/kv/info is not an instance's answer: {e}"))
        })?;
        let found = found.control_addr.map(|a| (a, found.engine_id));
        self.remember(url, found.clone());
        Ok(found)
    }

    fn remember(&self, url: &str, found: Option<(SocketAddr, String)>) {
        if self.discovered.len() >= MAX_DISCOVERED {
            // URLs come from requests: a caller naming ever new ones only costs lookups.
            self.discovered.clear();
        }
        self.discovered.insert(url.to_string(), found);
    }

    async fn call_http(
        &self,
        url: &str,
        body: Vec<u8>,
        within: Duration,
    ) -> Result<PeerAnswer, HandoffError> {
        let bytes = self
            .post_capped(url, "/v1/kv/peer", PEER_CONTENT_TYPE, body, within)
            .await?;
        decode_answer(&bytes)
    }

    /// POSTs `body` to the instance at `url` under `path` (with this instance's API key) and
    /// returns the answer's body, read up to [`MAX_HTTP_ANSWER_BYTES`]: the HTTP carrier of
    /// the peer protocol and of the protocols beside it.
    ///
    /// # Errors
    /// [`HandoffError::Timeout`], [`HandoffError::PeerGone`] (no answer), a body past the cap
    /// ([`HandoffError::Protocol`]), a non-success status ([`HandoffError::NotSupported`],
    /// with the start of the peer's answer).
    async fn post_capped(
        &self,
        url: &str,
        path: &str,
        content_type: &str,
        body: Vec<u8>,
        within: Duration,
    ) -> Result<Vec<u8>, HandoffError> {
        let mut req = self
            .http
            .post(format!("{url}{path}"))
            .timeout(within)
            .header("content-type", content_type)
            .body(body);
        if let Some(key) = &self.api_key {
            req = req.bearer_auth(key);
        }
        let resp = req.send().await.map_err(|e| {
            if e.is_timeout() {
                HandoffError::timeout(format!("peer call to {url}{path}"), within)
            } else {
                HandoffError::PeerGone {
                    peer: url.to_string(),
                    reason: error_chain(&e),
                }
            }
        })?;
        let status = resp.status();
        let bytes = read_capped(resp, MAX_HTTP_ANSWER_BYTES, url).await?;
        if !status.is_success() {
            return Err(HandoffError::NotSupported(format!(
                "{url} refused the peer call with HTTP {status}: {}",
                String::from_utf8_lossy(&bytes)
                    .chars()
                    .take(200)
                    .collect::<String>()
            )));
        }
        Ok(bytes)
    }

    /// The handshake with `peer`: its published KV memory, fetched once and validated against
    /// `ours` (cached per peer until [`Peers::forget`]).
    ///
    /// # Errors
    /// The call's failure, the peer's error answer, or the validation's.
    pub async fn info(
        &self,
        peer: &PeerAddr,
        ours: &KvPeerInfo,
    ) -> Result<KvPeerInfo, HandoffError> {
        if let Some(p) = self.infos.get(peer) {
            return Ok(p.clone());
        }
        let info = match self.call(peer, &PeerRequest::Info, self.timeout).await? {
            PeerAnswer::Info(info) => info,
            PeerAnswer::Failed(e) => return Err(e),
            other => {
                return Err(HandoffError::Protocol(format!(
                    "{peer} answered Info with {}",
                    other.name()
                )))
            }
        };
        validate_peer(ours, &info)?;
        metrics::counter!(pdserve_runtime::telemetry::KV_HANDSHAKES_TOTAL).increment(1);
        self.infos.insert(peer.clone(), info.clone());
        Ok(info)
    }

    /// Forgets what the handshake with `peer` learned (after a failed hand-off: the peer may
    /// have restarted a worker and registered new regions, or restarted altogether).
    pub fn forget(&self, peer: &PeerAddr) {
        self.infos.remove(peer);
        self.paths.remove(peer);
    }

    /// A transfer session from `engine` to the engine of `peer` (whose handshake answer is
    /// `theirs`), to read its held blocks (pull mode): cached per peer engine address, opened
    /// with a key the peer grants us over the peer protocol ([`PeerRequest::OpenSession`]) on
    /// every backend with sessions (unkeyed on `local`). Its view of the peer's regions covers
    /// every region the peer published (a restarted peer worker registers new ones).
    /// Connecting to one peer never waits for another.
    ///
    /// # Errors
    /// [`HandoffError::Timeout`], the peer's refusal of the session, or the transport's
    /// failure as [`HandoffError::Transfer`].
    pub async fn session_for(
        &self,
        engine: &TransferEngine,
        peer: &PeerAddr,
        theirs: &KvPeerInfo,
    ) -> Result<Arc<Session>, HandoffError> {
        let addr = &theirs.transfer_addr;
        let slot = slot(&self.sessions, addr);
        let mut cached = slot.lock().await;
        let session = match cached.as_ref().filter(|c| c.session.is_alive()) {
            Some(c) => c.session.clone(),
            None => {
                let offer = if Security::of(engine.backend()) == Security::None {
                    None
                } else {
                    // A new session needs a new key: the old one stays bound to the old
                    // session (which may linger behind a broken link) until it ends.
                    let request = PeerRequest::OpenSession {
                        initiator: self.engine_id.clone(),
                        fresh: true,
                    };
                    match self.call(peer, &request, self.timeout).await? {
                        PeerAnswer::Session(offer) => Some(offer),
                        PeerAnswer::Failed(e) => return Err(e),
                        other => {
                            return Err(HandoffError::Protocol(format!(
                                "{peer} answered OpenSession with {}",
                                other.name()
                            )))
                        }
                    }
                };
                let new = self.connect(engine, addr, offer.as_ref()).await?;
                *cached = Some(Cached {
                    session: new.clone(),
                    key: offer.map(|o| o.key),
                });
                new
            }
        };
        drop(cached);
        self.ready(session, theirs).await
    }

    /// A transfer session from `engine` to the engine of `theirs`, to write a push's
    /// destination blocks: opened with the key the decode instance granted in `offer` (reused
    /// while that key's session lives), or unkeyed when it granted none (`local`).
    ///
    /// # Errors
    /// As [`Peers::session_for`].
    pub async fn session_with(
        &self,
        engine: &TransferEngine,
        theirs: &KvPeerInfo,
        offer: Option<&SessionOffer>,
    ) -> Result<Arc<Session>, HandoffError> {
        let addr = &theirs.transfer_addr;
        let slot = slot(&self.sessions, addr);
        let mut cached = slot.lock().await;
        let key = offer.map(|o| o.key);
        let session = match cached
            .as_ref()
            .filter(|c| c.session.is_alive() && c.key == key)
        {
            Some(c) => c.session.clone(),
            None => {
                let new = self.connect(engine, addr, offer).await?;
                *cached = Some(Cached {
                    session: new.clone(),
                    key,
                });
                new
            }
        };
        drop(cached);
        self.ready(session, theirs).await
    }

    /// Drops the cached session to the engine at `transfer_addr` (after a failed transfer:
    /// its connections may be stuck behind a broken link). Hand-offs using it keep it until
    /// they end; the next one opens a new session, with a new key.
    pub fn forget_session(&self, transfer_addr: &str) {
        self.sessions.remove(transfer_addr);
    }

    async fn connect(
        &self,
        engine: &TransferEngine,
        addr: &str,
        offer: Option<&SessionOffer>,
    ) -> Result<Arc<Session>, HandoffError> {
        let connect = async {
            match offer {
                Some(o) => {
                    let creds = SessionCredentials {
                        key: SessionKey::from_bytes(o.key),
                    };
                    engine.connect_with(&o.transfer_addr, creds).await
                }
                None => engine.connect(addr).await,
            }
        };
        let session = tokio::time::timeout(self.timeout, connect)
            .await
            .map_err(|_| HandoffError::timeout(format!("connecting to {addr}"), self.timeout))?
            .map_err(|e| HandoffError::transfer(&e))?;
        Ok(Arc::new(session))
    }

    /// Checks that `session` reached the engine `theirs` describes (on `quic`, the node its
    /// certificate names) and refreshes its view of the peer's regions when one is missing (a
    /// restarted peer worker registers new ones; a fenced session sees only the regions of
    /// its open scopes).
    ///
    /// # Errors
    /// [`HandoffError::PeerGone`] for another node, the refresh's failure.
    pub async fn ready(
        &self,
        session: Arc<Session>,
        theirs: &KvPeerInfo,
    ) -> Result<Arc<Session>, HandoffError> {
        let addr = &theirs.transfer_addr;
        if let Some(node) = session.peer_node() {
            if node != theirs.engine_id {
                self.forget_session(addr);
                return Err(HandoffError::PeerGone {
                    peer: addr.clone(),
                    reason: format!(
                        "the transfer engine there is node `{node}`, not `{}`",
                        theirs.engine_id
                    ),
                });
            }
        }
        let known: std::collections::HashSet<u64> =
            session.remote_regions().iter().map(|r| r.id).collect();
        if theirs
            .ranks
            .iter()
            .flat_map(|r| &r.regions)
            .any(|id| !known.contains(id))
        {
            tokio::time::timeout(self.timeout, session.refresh_regions())
                .await
                .map_err(|_| {
                    HandoffError::timeout(format!("refreshing the regions of {addr}"), self.timeout)
                })?
                .map_err(|e| HandoffError::transfer(&e))?;
        }
        Ok(session)
    }

    /// Asks `peer` to open the read scope of `transfer`'s held blocks on our session.
    ///
    /// # Errors
    /// The call's failure or the peer's refusal.
    pub async fn open_read(
        &self,
        peer: &PeerAddr,
        transfer: TransferId,
    ) -> Result<(), HandoffError> {
        let request = PeerRequest::OpenRead {
            transfer,
            initiator: self.engine_id.clone(),
        };
        match self.call(peer, &request, self.timeout).await? {
            PeerAnswer::ReadOpened => Ok(()),
            PeerAnswer::Failed(e) => Err(e),
            other => Err(HandoffError::Protocol(format!(
                "{peer} answered OpenRead with {}",
                other.name()
            ))),
        }
    }

    /// Keeps renewing `transfer`'s lease at `peer` until the returned guard drops. Renewals
    /// are batched per peer: one task per peer sends one request naming every transfer being
    /// read from it, every third of the lease; it ends when none is left or the instance stops.
    pub fn renew_while_alive(
        self: &Arc<Self>,
        peer: &PeerAddr,
        transfer: TransferId,
        lease: Duration,
    ) -> RenewGuard {
        let mut all = self.renewals.lock().unwrap_or_else(|e| e.into_inner());
        if !all.contains_key(peer) {
            let (peers, peer) = (self.clone(), peer.clone());
            let interval = (lease / 3).max(Duration::from_millis(50));
            self.tasks.spawn(async move {
                loop {
                    tokio::select! {
                        () = tokio::time::sleep(interval) => {}
                        () = peers.shutdown.cancelled() => return,
                    }
                    let ids = {
                        let mut all = peers.renewals.lock().unwrap_or_else(|e| e.into_inner());
                        match all.get(&peer).filter(|p| !p.is_empty()) {
                            Some(p) => p.keys().copied().collect::<Vec<_>>(),
                            None => {
                                all.remove(&peer);
                                return;
                            }
                        }
                    };
                    match peers
                        .call(&peer, &PeerRequest::Renew(ids), peers.timeout)
                        .await
                    {
                        Ok(PeerAnswer::Renewed { unknown }) if !unknown.is_empty() => {
                            tracing::debug!(%peer, ?unknown, "leases no longer held at the peer");
                        }
                        Ok(_) => {}
                        Err(e) => tracing::debug!(%peer, error = %e, "lease renewal failed"),
                    }
                }
            });
        }
        *all.entry(peer.clone())
            .or_default()
            .entry(transfer)
            .or_default() += 1;
        RenewGuard {
            peers: self.clone(),
            peer: peer.clone(),
            transfer,
        }
    }

    /// Stops the renewal tasks and waits for them (bounded by one call).
    pub async fn close(&self) {
        self.shutdown.cancel();
        self.tasks.close();
        let _ = tokio::time::timeout(self.timeout, self.tasks.wait()).await;
        for c in self.conns.iter() {
            if let Ok(c) = c.value().try_lock() {
                if let Some(c) = c.as_ref() {
                    c.close();
                }
            }
        }
    }

    /// This instance's engine id.
    pub fn engine_id(&self) -> &str {
        &self.engine_id
    }
}

fn check_node(
    c: Arc<ControlConnection>,
    addr: SocketAddr,
    node: Option<&str>,
) -> Result<Arc<ControlConnection>, HandoffError> {
    match node {
        Some(n) if c.peer().node != n => Err(HandoffError::PeerGone {
            peer: addr.to_string(),
            reason: format!(
                "the control endpoint there is node `{}`, not `{n}`",
                c.peer().node
            ),
        }),
        _ => Ok(c),
    }
}

/// A control-plane carrier failure as a hand-off error.
fn carrier_error(peer: &str, e: &TransportError) -> HandoffError {
    match e {
        TransportError::Timeout { what, after } => {
            HandoffError::timeout(format!("{what} to {peer}"), *after)
        }
        TransportError::Remote { kind, message } => {
            HandoffError::Protocol(format!("{peer} answered {kind}: {message}"))
        }
        TransportError::Wire(w) => HandoffError::Protocol(w.to_string()),
        other => HandoffError::PeerGone {
            peer: peer.to_string(),
            reason: other.to_string(),
        },
    }
}

/// An error with its causes (`reqwest` prints only the outermost: "error sending request").
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}

/// One transfer's registration with its peer's renewal task; dropping it stops renewing
/// that transfer.
pub struct RenewGuard {
    peers: Arc<Peers>,
    peer: PeerAddr,
    transfer: TransferId,
}

impl Drop for RenewGuard {
    fn drop(&mut self) {
        let mut all = self
            .peers
            .renewals
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(peer) = all.get_mut(&self.peer) {
            if let Some(n) = peer.get_mut(&self.transfer) {
                *n -= 1;
                if *n == 0 {
                    peer.remove(&self.transfer);
                }
            }
        }
    }
}

/// The largest peer answer read over the HTTP carrier: the control plane's frame limit (an
/// answer is one frame there). A peer that sends more is cut off, not buffered.
pub const MAX_HTTP_ANSWER_BYTES: usize = pdserve_runtime::wire::DEFAULT_MAX_FRAME_BYTES;

/// Reads a response body of at most `max` bytes, chunk by chunk, refusing a longer one as
/// soon as it declares or delivers more.
async fn read_capped(
    mut resp: reqwest::Response,
    max: usize,
    url: &str,
) -> Result<Vec<u8>, HandoffError> {
    let too_large = |n: u64| {
        HandoffError::Protocol(format!(
            "{url} answered the peer call with more than {max} bytes ({n} so far)"
        ))
    };
    if let Some(n) = resp.content_length().filter(|&n| n > max as u64) {
        return Err(too_large(n));
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| HandoffError::PeerGone {
        peer: url.to_string(),
        reason: error_chain(&e),
    })? {
        if body.len() + chunk.len() > max {
            return Err(too_large((body.len() + chunk.len()) as u64));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}
