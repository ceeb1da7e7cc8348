//! Cluster membership in etcd (`discovery.kind = "etcd"`): several proxies side by side, and
//! members that leave when their lease does.
//!
//! Every member keeps one record under a lease it keeps alive:
//!
//! ```text
//! PREFIX/CLUSTER/proxies/NODE    {"node": .., "role": "proxy",  "url": .., "control_addr": ..}
//! PREFIX/CLUSTER/instances/NODE  {"node": .., "role": "decode", "url": .., "control_addr": ..}
//! ```
//!
//! - An **instance** ([`Announcement`]) puts its record and watches the proxies
//!   ([`watch_members`]); it registers with every proxy listed, over the control plane, as with
//!   a configured `control.proxy` (registration, heartbeats, KV events), and stops when one
//!   leaves.
//! - A **proxy** puts its record and watches the instances: it routes only to instances
//!   whose record is alive. A frozen instance (SIGSTOP, a cut link) stops keeping its lease
//!   alive; etcd deletes its record within `lease_ttl_s` and every proxy stops routing to it. A
//!   member that comes back finds its lease gone and puts its record under a new one.
//! - etcd out of reach: a member keeps trying (with backoff) and the proxies keep the last
//!   view they had (registrations and heartbeats still decide liveness), so an etcd outage
//!   does not stop serving; a proxy that never reached etcd routes to no instance.
//!
//! The client speaks etcd's v3 API in its JSON form (the gateway every etcd since 3.4 serves
//! on its client port beside gRPC: `/v3/lease/grant`, `/v3/kv/put`, `/v3/kv/range`,
//! `/v3/watch`, ...) over the HTTP client the proxy already uses, so building pdserve needs no
//! protobuf compiler and no second HTTP/2 stack.
//!
//! Nothing read from etcd is trusted: a record is at most [`MAX_RECORD_BYTES`], its node must
//! be the key's, its strings are bounded, its control address must parse, and at most
//! [`MAX_MEMBERS`] records are kept per kind.

use pdserve_runtime::config::DiscoveryConfig;
use pdserve_runtime::Role;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// Largest record read from etcd.
pub const MAX_RECORD_BYTES: usize = 4096;
/// Most members of one kind a watcher keeps.
pub const MAX_MEMBERS: usize = 4096;
/// Longest pause between attempts to reach etcd.
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// Bound on one etcd call (connect, grant, put, get, revoke).
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// Which members a key holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemberKind {
    /// Proxies (instances watch them).
    Proxy,
    /// Prefill, decode, colocated and encode instances (proxies watch them).
    Instance,
}

impl MemberKind {
    fn dir(self) -> &'static str {
        match self {
            Self::Proxy => "proxies",
            Self::Instance => "instances",
        }
    }
}

/// Largest answer read from etcd (a range of [`MAX_MEMBERS`] records, base64, fits).
const MAX_ANSWER_BYTES: usize = 32 << 20;
/// A watch that says nothing for this long is started again (list, then watch): a silent
/// partition cannot leave a proxy on a stale view for longer.
const WATCH_IDLE: Duration = Duration::from_secs(30);

/// Why etcd could not be used.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// No endpoint answered the call.
    #[error("etcd {call}: {detail}")]
    Unreachable {
        /// The API path.
        call: &'static str,
        /// What each endpoint answered.
        detail: String,
    },
    /// etcd answered with something this client does not read.
    #[error("etcd {call}: {detail}")]
    BadAnswer {
        /// The API path.
        call: &'static str,
        /// What was wrong.
        detail: String,
    },
    /// etcd says the lease is gone (the member was frozen longer than its TTL).
    #[error("the lease expired")]
    LeaseExpired,
    /// The watch ended, or was cancelled or compacted.
    #[error("the watch ended: {0}")]
    WatchEnded(String),
    /// The watch stayed silent for [`WATCH_IDLE`] (routine on a quiet cluster: it is listed
    /// and watched again).
    #[error("the watch was silent for {0:?}")]
    WatchIdle(Duration),
}

/// An int64 of etcd's JSON (a string, as proto3 JSON writes 64-bit numbers; absent = 0).
fn int64<'de, D: serde::Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Int {
        Text(String),
        Number(i64),
    }
    match Int::deserialize(d)? {
        Int::Number(n) => Ok(n),
        Int::Text(t) => t.parse().map_err(serde::de::Error::custom),
    }
}

#[derive(Debug, Default, Deserialize)]
struct Header {
    #[serde(default, deserialize_with = "int64")]
    revision: i64,
}

#[derive(Debug, Deserialize)]
struct Lease {
    #[serde(rename = "ID", default, deserialize_with = "int64")]
    id: i64,
    #[serde(rename = "TTL", default, deserialize_with = "int64")]
    ttl: i64,
}

#[derive(Debug, Deserialize)]
struct KeepAlive {
    result: Option<Lease>,
}

#[derive(Debug, Deserialize)]
struct Kv {
    /// base64.
    key: String,
    /// base64 (absent on a delete).
    #[serde(default)]
    value: String,
}

#[derive(Debug, Deserialize)]
struct Range {
    #[serde(default)]
    header: Header,
    #[serde(default)]
    kvs: Vec<Kv>,
}

#[derive(Debug, Deserialize)]
struct WatchEvent {
    /// `PUT` is proto3's default, so it is left out; `DELETE` is written.
    #[serde(rename = "type", default)]
    kind: Option<String>,
    kv: Kv,
}

#[derive(Debug, Default, Deserialize)]
struct WatchResult {
    #[serde(default)]
    canceled: bool,
    #[serde(default, deserialize_with = "int64")]
    compact_revision: i64,
    #[serde(default)]
    events: Vec<WatchEvent>,
}

#[derive(Debug, Deserialize)]
struct WatchLine {
    #[serde(default)]
    result: WatchResult,
}

fn b64(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn unb64(text: &str) -> Option<Vec<u8>> {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.decode(text).ok()
}

/// The end of the key range that holds every key starting with `prefix` (etcd's
/// `range_end` for a prefix: the prefix with its last byte plus one).
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// etcd's v3 JSON API at a list of endpoints (tried in turn).
#[derive(Clone)]
struct EtcdClient {
    http: reqwest::Client,
    /// For the watch: no whole-answer timeout (it streams), only a connect timeout.
    stream: reqwest::Client,
    endpoints: Arc<Vec<String>>,
}

impl EtcdClient {
    fn new(endpoints: &[String]) -> Result<Self, DiscoveryError> {
        let build = |b: reqwest::ClientBuilder| {
            b.connect_timeout(CALL_TIMEOUT)
                .build()
                .map_err(|e| DiscoveryError::Unreachable {
                    call: "client",
                    detail: e.to_string(),
                })
        };
        Ok(Self {
            http: build(crate::http::http_client().timeout(CALL_TIMEOUT))?,
            stream: build(crate::http::http_client())?,
            endpoints: Arc::new(
                endpoints
                    .iter()
                    .map(|e| e.trim_end_matches('/').to_string())
                    .collect(),
            ),
        })
    }

    /// POSTs `body` to `path` on the first endpoint that answers; its answer, bounded.
    async fn call<T: serde::de::DeserializeOwned>(
        &self,
        path: &'static str,
        body: serde_json::Value,
    ) -> Result<T, DiscoveryError> {
        let mut detail = Vec::new();
        for endpoint in self.endpoints.iter() {
            let sent = self
                .http
                .post(format!("{endpoint}{path}"))
                .json(&body)
                .send()
                .await;
            let answer = match sent {
                Ok(r) => r,
                Err(e) => {
                    detail.push(format!("{endpoint}: {e}"));
                    continue;
                }
            };
            let status = answer.status();
            let bytes = read_bounded(answer, path).await?;
            if !status.is_success() {
                detail.push(format!(
                    "{endpoint}: {status} {}",
                    String::from_utf8_lossy(&bytes[..bytes.len().min(256)])
                ));
                continue;
            }
            return serde_json::from_slice(&bytes).map_err(|e| DiscoveryError::BadAnswer {
                call: path,
                detail: e.to_string(),
            });
        }
        Err(DiscoveryError::Unreachable {
            call: path,
            detail: detail.join("; "),
        })
    }

    async fn grant(&self, ttl: i64) -> Result<i64, DiscoveryError> {
        let lease: Lease = self
            .call("/v3/lease/grant", serde_json::json!({ "TTL": ttl }))
            .await?;
        Ok(lease.id)
    }

    async fn put(&self, key: &str, value: &[u8], lease: i64) -> Result<(), DiscoveryError> {
        let body = serde_json::json!({
            "key": b64(key.as_bytes()),
            "value": b64(value),
            "lease": lease.to_string(),
        });
        self.call::<serde_json::Value>("/v3/kv/put", body)
            .await
            .map(drop)
    }

    /// One keep-alive: the lease's remaining TTL (0: it is gone).
    async fn keep_alive(&self, lease: i64) -> Result<i64, DiscoveryError> {
        let answer: KeepAlive = self
            .call(
                "/v3/lease/keepalive",
                serde_json::json!({ "ID": lease.to_string() }),
            )
            .await?;
        Ok(answer.result.map_or(0, |l| l.ttl))
    }

    async fn revoke(&self, lease: i64) -> Result<(), DiscoveryError> {
        self.call::<serde_json::Value>(
            "/v3/lease/revoke",
            serde_json::json!({ "ID": lease.to_string() }),
        )
        .await
        .map(drop)
    }

    /// Every key under `prefix` with its value, and the store's revision then.
    async fn range(&self, prefix: &str) -> Result<(i64, Vec<(String, Vec<u8>)>), DiscoveryError> {
        let body = serde_json::json!({
            "key": b64(prefix.as_bytes()),
            "range_end": b64(&prefix_end(prefix)),
        });
        let range: Range = self.call("/v3/kv/range", body).await?;
        Ok((range.header.revision, decode_kvs(range.kvs)))
    }

    /// Opens a watch of `prefix` from `revision` on the first endpoint that answers.
    async fn watch(
        &self,
        prefix: &str,
        revision: i64,
    ) -> Result<reqwest::Response, DiscoveryError> {
        let body = serde_json::json!({ "create_request": {
            "key": b64(prefix.as_bytes()),
            "range_end": b64(&prefix_end(prefix)),
            "start_revision": revision.to_string(),
        }});
        let mut detail = Vec::new();
        for endpoint in self.endpoints.iter() {
            match self
                .stream
                .post(format!("{endpoint}/v3/watch"))
                .json(&body)
                .send()
                .await
            {
                Ok(r) if r.status().is_success() => return Ok(r),
                Ok(r) => detail.push(format!("{endpoint}: {}", r.status())),
                Err(e) => detail.push(format!("{endpoint}: {e}")),
            }
        }
        Err(DiscoveryError::Unreachable {
            call: "/v3/watch",
            detail: detail.join("; "),
        })
    }
}

/// The keys and values of `kvs` (base64 in etcd's JSON); a pair that does not decode is left
/// out (it names no member).
fn decode_kvs(kvs: Vec<Kv>) -> Vec<(String, Vec<u8>)> {
    kvs.into_iter()
        .filter_map(|kv| {
            let key = String::from_utf8(unb64(&kv.key)?).ok()?;
            Some((key, unb64(&kv.value)?))
        })
        .collect()
}

/// An answer's body, refused past [`MAX_ANSWER_BYTES`].
async fn read_bounded(
    mut answer: reqwest::Response,
    call: &'static str,
) -> Result<Vec<u8>, DiscoveryError> {
    let mut body = Vec::new();
    loop {
        match answer.chunk().await {
            Ok(Some(c)) => {
                if body.len() + c.len() > MAX_ANSWER_BYTES {
                    return Err(DiscoveryError::BadAnswer {
                        call,
                        detail: format!("answer over {MAX_ANSWER_BYTES} bytes"),
                    });
                }
                body.extend_from_slice(&c);
            }
            Ok(None) => return Ok(body),
            Err(e) => {
                return Err(DiscoveryError::Unreachable {
                    call,
                    detail: e.to_string(),
                })
            }
        }
    }
}

/// One member as etcd lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemberRecord {
    /// Its node name (the key's last part).
    pub node: String,
    /// Its role.
    pub role: Role,
    /// Its HTTP API.
    pub url: String,
    /// Its control-plane address (`IP:port`, UDP).
    pub control_addr: String,
}

impl MemberRecord {
    /// The record under `key` (ending in `/NODE`) from its stored `value`, checked.
    fn parse(key: &str, value: &[u8]) -> Result<Self, String> {
        if value.len() > MAX_RECORD_BYTES {
            return Err(format!(
                "{} bytes (at most {MAX_RECORD_BYTES})",
                value.len()
            ));
        }
        let r: Self = serde_json::from_slice(value).map_err(|e| e.to_string())?;
        let node = key.rsplit('/').next().unwrap_or_default();
        if r.node != node {
            return Err(format!("node `{}` under the key of `{node}`", r.node));
        }
        if r.node.is_empty() || r.node.len() > 255 || r.url.len() > 1024 {
            return Err("node or url out of bounds".into());
        }
        if !(r.url.starts_with("http://") || r.url.starts_with("https://")) {
            return Err(format!("url `{}` is not http(s)", r.url));
        }
        r.control_addr
            .parse::<SocketAddr>()
            .map_err(|_| format!("control_addr `{}` is not IP:port", r.control_addr))?;
        Ok(r)
    }
}

/// Where a cluster's members live in etcd.
#[derive(Debug, Clone)]
pub struct EtcdSettings {
    /// etcd client URLs.
    pub endpoints: Vec<String>,
    /// `PREFIX/CLUSTER`.
    pub root: String,
    /// A member's lease.
    pub lease_ttl: Duration,
}

impl EtcdSettings {
    /// The settings of `cluster` from `cfg`, or `None` when discovery is not etcd.
    pub fn from_config(cfg: &DiscoveryConfig, cluster: &str) -> Option<Self> {
        cfg.is_etcd().then(|| Self {
            endpoints: cfg.etcd_endpoints.clone(),
            root: format!("{}/{cluster}", cfg.etcd_prefix.trim_end_matches('/')),
            lease_ttl: Duration::from_secs(cfg.lease_ttl_s),
        })
    }

    /// The directory of `kind` (`PREFIX/CLUSTER/instances/`).
    pub fn dir(&self, kind: MemberKind) -> String {
        format!("{}/{}/", self.root, kind.dir())
    }
}

/// Logs a failure loudly the first time, quietly while it repeats; returns the next backoff.
fn backoff(
    last: &mut Option<String>,
    error: &DiscoveryError,
    what: &str,
    delay: Duration,
) -> Duration {
    let text = error.to_string();
    if last.as_deref() != Some(text.as_str()) {
        tracing::warn!(error = %text, "{what}; retrying");
    } else {
        tracing::debug!(error = %text, "{what}; retrying");
    }
    *last = Some(text);
    (delay * 2).min(MAX_BACKOFF)
}

/// A member's record kept alive in etcd under a lease, while this lives. Dropping it stops
/// the keep-alive (the record goes when the lease expires); [`Announcement::withdraw`]
/// removes it at once.
pub struct Announcement {
    task: tokio::task::JoinHandle<()>,
    stop: Arc<tokio::sync::Notify>,
    /// How many times the record was put (1 + re-puts after a lost lease or connection).
    puts: watch::Receiver<u64>,
}

impl std::fmt::Debug for Announcement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Announcement")
            .field("puts", &*self.puts.borrow())
            .finish_non_exhaustive()
    }
}

impl Announcement {
    /// Starts keeping `record` under `kind` in etcd. Must run inside a tokio runtime.
    pub fn start(settings: EtcdSettings, kind: MemberKind, record: MemberRecord) -> Self {
        let stop = Arc::new(tokio::sync::Notify::new());
        let (tx, puts) = watch::channel(0);
        let task = tokio::spawn(announce(settings, kind, record, stop.clone(), tx));
        Self { task, stop, puts }
    }

    /// Waits (at most `within`) until the record has been put once.
    pub async fn announced(&self, within: Duration) -> bool {
        let mut puts = self.puts.clone();
        tokio::time::timeout(within, puts.wait_for(|n| *n > 0))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Removes the record now (revokes its lease), bounded by `within`; the keep-alive ends
    /// either way.
    pub async fn withdraw(mut self, within: Duration) {
        self.stop.notify_one();
        if tokio::time::timeout(within, &mut self.task).await.is_err() {
            self.task.abort();
        }
    }
}

impl Drop for Announcement {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Put `record` under a fresh lease and keep it alive; again after any failure; revoke on stop.
async fn announce(
    settings: EtcdSettings,
    kind: MemberKind,
    record: MemberRecord,
    stop: Arc<tokio::sync::Notify>,
    puts: watch::Sender<u64>,
) {
    let key = format!("{}{}", settings.dir(kind), record.node);
    let value = match serde_json::to_vec(&record) {
        Ok(v) => v,
        Err(e) => {
            tracing::error!(error = %e, "cannot encode the etcd record");
            return;
        }
    };
    let client = match EtcdClient::new(&settings.endpoints) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "no etcd client");
            return;
        }
    };
    let ttl = settings.lease_ttl.as_secs().max(1) as i64;
    let initial = Duration::from_millis(100);
    let mut delay = initial;
    let mut last = None;
    // The lease the record is under, once granted (revoked on stop).
    let lease = std::sync::Mutex::new(None);
    loop {
        let kept = async {
            let id = client.grant(ttl).await?;
            *lease.lock().unwrap_or_else(|e| e.into_inner()) = Some(id);
            client.put(&key, &value, id).await?;
            puts.send_modify(|n| *n += 1);
            tracing::info!(%key, lease = id, ttl, "member record put in etcd");
            // Three keep-alives per TTL: one lost or late does not lose the lease.
            let mut tick = tokio::time::interval(settings.lease_ttl / 3);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                if client.keep_alive(id).await? <= 0 {
                    return Err::<(), _>(DiscoveryError::LeaseExpired);
                }
            }
        };
        let error = tokio::select! {
            r = kept => match r {
                Ok(()) => continue,
                Err(e) => e,
            },
            _ = stop.notified() => {
                let held = lease.lock().unwrap_or_else(|e| e.into_inner()).take();
                if let Some(id) = held {
                    match client.revoke(id).await {
                        Ok(()) => tracing::info!(%key, "member record withdrawn from etcd"),
                        Err(e) => tracing::warn!(%key, error = %e, "cannot revoke the lease; the record goes when it expires"),
                    }
                }
                return;
            }
        };
        if matches!(error, DiscoveryError::LeaseExpired) {
            // A frozen member came back: put the record again at once.
            tracing::warn!(%key, "the etcd lease expired; putting the record under a new one");
            delay = initial;
            continue;
        }
        delay = backoff(
            &mut last,
            &error,
            "cannot keep the member record in etcd",
            delay,
        );
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = stop.notified() => return,
        }
    }
}

/// Puts `value` (JSON) at `PREFIX/CLUSTER/planner/recommendation` under a fresh lease of
/// `ttl`: a reader sees the planner's latest advice, and none once the planner has stopped
/// for longer than `ttl`. Returns the key.
///
/// # Errors
/// etcd could not be reached or refused the put.
pub async fn put_recommendation(
    settings: &EtcdSettings,
    value: &serde_json::Value,
    ttl: Duration,
) -> Result<String, DiscoveryError> {
    let client = EtcdClient::new(&settings.endpoints)?;
    let key = format!("{}/planner/recommendation", settings.root);
    let lease = client.grant(ttl.as_secs().max(2) as i64).await?;
    let bytes = serde_json::to_vec(value).map_err(|e| DiscoveryError::BadAnswer {
        call: "/v3/kv/put",
        detail: e.to_string(),
    })?;
    client.put(&key, &bytes, lease).await?;
    Ok(key)
}

/// The live members of one kind, as a watcher last saw them: `None` until etcd first
/// answered.
pub type Members = Option<BTreeMap<String, MemberRecord>>;

/// A watch of one kind of member.
pub struct MemberWatch {
    task: tokio::task::JoinHandle<()>,
    /// The latest view.
    pub members: watch::Receiver<Members>,
}

impl MemberWatch {
    /// Starts watching the members of `kind`. Must run inside a tokio runtime.
    pub fn start(settings: EtcdSettings, kind: MemberKind) -> Self {
        let (tx, members) = watch::channel(None);
        let task = tokio::spawn(watch_members(settings, kind, tx));
        Self { task, members }
    }
}

impl Drop for MemberWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Applies one key's value (a put) or its absence (a delete) to `view`.
fn apply(view: &mut BTreeMap<String, MemberRecord>, key: &str, value: Option<&[u8]>) {
    let node = key.rsplit('/').next().unwrap_or_default().to_string();
    match value {
        None => {
            view.remove(&node);
        }
        Some(v) => match MemberRecord::parse(key, v) {
            Ok(r) if view.contains_key(&node) || view.len() < MAX_MEMBERS => {
                view.insert(node, r);
            }
            Ok(_) => tracing::warn!(%key, "member record ignored: {MAX_MEMBERS} members already"),
            Err(e) => {
                // A record that does not parse names no reachable member.
                view.remove(&node);
                tracing::warn!(%key, error = %e, "member record refused");
            }
        },
    }
}

/// Lists `kind`, then follows its changes; lists again after any failure.
async fn watch_members(settings: EtcdSettings, kind: MemberKind, tx: watch::Sender<Members>) {
    let dir = settings.dir(kind);
    let client = match EtcdClient::new(&settings.endpoints) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "no etcd client");
            return;
        }
    };
    let initial = Duration::from_millis(100);
    let mut delay = initial;
    let mut last = None;
    loop {
        let followed = async {
            let (revision, kvs) = client.range(&dir).await?;
            let mut view = BTreeMap::new();
            for (key, value) in kvs {
                apply(&mut view, &key, Some(&value));
            }
            tx.send_replace(Some(view.clone()));
            delay = initial;
            last = None;
            let mut stream = client.watch(&dir, revision + 1).await?;
            // etcd's JSON watch writes one result per line.
            let mut pending: Vec<u8> = Vec::new();
            loop {
                let chunk = tokio::time::timeout(WATCH_IDLE, stream.chunk())
                    .await
                    .map_err(|_| DiscoveryError::WatchIdle(WATCH_IDLE))?
                    .map_err(|e| DiscoveryError::WatchEnded(e.to_string()))?
                    .ok_or_else(|| DiscoveryError::WatchEnded("etcd closed it".into()))?;
                pending.extend_from_slice(&chunk);
                if pending.len() > MAX_ANSWER_BYTES {
                    return Err::<std::convert::Infallible, _>(DiscoveryError::WatchEnded(
                        format!("a line over {MAX_ANSWER_BYTES} bytes"),
                    ));
                }
                while let Some(end) = pending.iter().position(|b| *b == b'\n') {
                    let line: Vec<u8> = pending.drain(..=end).collect();
                    if line.iter().all(u8::is_ascii_whitespace) {
                        continue;
                    }
                    let parsed: WatchLine =
                        serde_json::from_slice(&line).map_err(|e| DiscoveryError::BadAnswer {
                            call: "/v3/watch",
                            detail: e.to_string(),
                        })?;
                    let r = parsed.result;
                    if r.canceled {
                        return Err(DiscoveryError::WatchEnded(format!(
                            "cancelled (compacted at revision {})",
                            r.compact_revision
                        )));
                    }
                    if r.events.is_empty() {
                        continue;
                    }
                    for event in r.events {
                        let delete = event.kind.as_deref() == Some("DELETE");
                        let Some(key) =
                            unb64(&event.kv.key).and_then(|k| String::from_utf8(k).ok())
                        else {
                            continue;
                        };
                        let value = if delete { None } else { unb64(&event.kv.value) };
                        if !delete && value.is_none() {
                            // A put whose value does not decode names no member.
                            apply(&mut view, &key, Some(b"not base64"));
                            continue;
                        }
                        apply(&mut view, &key, value.as_deref());
                    }
                    tx.send_replace(Some(view.clone()));
                }
            }
        };
        let e: DiscoveryError = match followed.await {
            Ok(never) => match never {},
            Err(e) => e,
        };
        if let DiscoveryError::WatchIdle(_) = e {
            // A quiet cluster: list and watch again at once (a silent partition cannot leave
            // the view stale for longer than this).
            tracing::debug!(error = %e, "watching the cluster's members again");
            continue;
        }
        delay = backoff(
            &mut last,
            &e,
            "cannot watch the cluster's members in etcd",
            delay,
        );
        tokio::time::sleep(delay).await;
    }
}

/// The control addresses of the members in `view` (those that parse; a record was checked
/// when read).
pub fn control_addrs(view: &Members) -> Vec<SocketAddr> {
    view.iter()
        .flat_map(|m| m.values())
        .filter_map(|r| r.control_addr.parse().ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(node: &str) -> Vec<u8> {
        serde_json::to_vec(&MemberRecord {
            node: node.into(),
            role: Role::Decode,
            url: "http://127.0.0.1:8100".into(),
            control_addr: "127.0.0.1:7100".into(),
        })
        .unwrap()
    }

    #[test]
    fn records_from_etcd_are_checked_before_they_count() {
        let mut view = BTreeMap::new();
        apply(&mut view, "/p/c/instances/d0", Some(&record("d0")));
        assert_eq!(view.len(), 1);
        // Another node's record under this key, junk, an oversized value, a bad address.
        apply(&mut view, "/p/c/instances/d1", Some(&record("d0")));
        apply(&mut view, "/p/c/instances/d2", Some(b"{not json"));
        let mut big = record("d3");
        big.resize(MAX_RECORD_BYTES + 1, b' ');
        apply(&mut view, "/p/c/instances/d3", Some(&big));
        let bad_addr = String::from_utf8(record("d4"))
            .unwrap()
            .replace("127.0.0.1:7100", "nowhere");
        apply(&mut view, "/p/c/instances/d4", Some(bad_addr.as_bytes()));
        let unknown_field = String::from_utf8(record("d5"))
            .unwrap()
            .replace("{", "{\"extra\":1,");
        apply(
            &mut view,
            "/p/c/instances/d5",
            Some(unknown_field.as_bytes()),
        );
        assert_eq!(view.keys().collect::<Vec<_>>(), ["d0"]);
        // A bad put over a good record removes it; a delete removes it.
        apply(&mut view, "/p/c/instances/d6", Some(&record("d6")));
        apply(&mut view, "/p/c/instances/d6", Some(b"[]"));
        assert!(!view.contains_key("d6"));
        apply(&mut view, "/p/c/instances/d0", None);
        assert!(view.is_empty());
    }

    #[test]
    fn a_watcher_keeps_at_most_max_members() {
        let mut view = BTreeMap::new();
        for i in 0..MAX_MEMBERS + 3 {
            let node = format!("n{i}");
            apply(
                &mut view,
                &format!("/p/c/instances/{node}"),
                Some(&record(&node)),
            );
        }
        assert_eq!(view.len(), MAX_MEMBERS);
        // A member already known is still updated.
        apply(&mut view, "/p/c/instances/n0", Some(&record("n0")));
        assert_eq!(view.len(), MAX_MEMBERS);
    }

    #[test]
    fn etcd_json_answers_read_as_etcd_writes_them() {
        assert_eq!(prefix_end("/p/c/instances/"), b"/p/c/instances0");
        assert_eq!(prefix_end("a\u{7f}"), b"a\x80");
        // Lines as etcd 3.4's watch wrote them (64-bit numbers as strings, PUT left out).
        let put = r#"{"result":{"header":{"revision":"2"},"events":[{"kv":{"key":"L3AvYy9pbnN0YW5jZXMvYQ==","create_revision":"2","mod_revision":"2","version":"1","value":"eyJ4IjoxfQ==","lease":"4111120309934884871"}}]}}"#;
        let del = r#"{"result":{"header":{"revision":"3"},"events":[{"type":"DELETE","kv":{"key":"L3AvYy9pbnN0YW5jZXMvYQ==","mod_revision":"3"}}]}}"#;
        let cancel =
            r#"{"result":{"header":{"revision":"9"},"canceled":true,"compact_revision":"7"}}"#;
        let p: WatchLine = serde_json::from_str(put).unwrap();
        assert_eq!(p.result.events[0].kind, None);
        assert_eq!(unb64(&p.result.events[0].kv.value).unwrap(), br#"{"x":1}"#);
        let d: WatchLine = serde_json::from_str(del).unwrap();
        assert_eq!(d.result.events[0].kind.as_deref(), Some("DELETE"));
        assert_eq!(
            unb64(&d.result.events[0].kv.key).unwrap(),
            b"/p/c/instances/a"
        );
        let c: WatchLine = serde_json::from_str(cancel).unwrap();
        assert!(c.result.canceled);
        assert_eq!(c.result.compact_revision, 7);
        // A keep-alive of a lease that is gone has no TTL: 0.
        let gone: KeepAlive =
            serde_json::from_str(r#"{"result":{"header":{"revision":"3"},"ID":"41"}}"#).unwrap();
        assert_eq!(gone.result.map(|l| (l.id, l.ttl)), Some((41, 0)));
    }

    #[test]
    fn keys_live_under_prefix_and_cluster() {
        let cfg = DiscoveryConfig::etcd(vec!["http://127.0.0.1:2379".into()]);
        let s = EtcdSettings::from_config(&cfg, "prod").unwrap();
        assert_eq!(s.dir(MemberKind::Instance), "/pdserve/prod/instances/");
        assert_eq!(s.dir(MemberKind::Proxy), "/pdserve/prod/proxies/");
        assert!(EtcdSettings::from_config(&DiscoveryConfig::default(), "prod").is_none());
    }
}
