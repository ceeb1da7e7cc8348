//! The proxy's control plane: where instances register and `pdserve inspect` connects.
//!
//! Instances connect to the proxy's mutual-TLS QUIC endpoint and register (`Register`, a typed
//! [`Registration`], answered `Registered` or `RegistrationRefused` with the field at fault); a
//! registration adds a dynamic registry entry keyed by node name (replacing an older one of the
//! same node, or a static entry of the same URL), and the instance's heartbeats carry its load.
//! A registered instance is routed to while its connection is open and its last heartbeat is
//! younger than [`MISSED_HEARTBEATS_TO_DROP`] intervals; it comes back when it heartbeats or
//! registers again.
//!
//! A registered instance that drains says so (`Draining`, answered `DrainingAck`): it is no
//! longer routed to but keeps its entry. An `InspectRequest` on any control connection is
//! answered with `Inspect` carrying a [`ClusterSnapshot`]: the proxy itself, and every
//! registered instance's snapshot fetched over its own control connection within the inspect
//! timeout (all at once); an instance that cannot answer is listed as unreachable with the
//! reason. Every task here is tracked and ends
//! with the proxy.

use super::messages::{ProxyControlArgs, ProxyMsg, SupervisedFigures};
use super::registry::Registry;
use super::state::ProxyState;
use crate::control_plane::{Registration, RegistrationError, RegistrationField};
use crate::error::StartError;
use crate::kv_events::KvIndex;
use pdserve_runtime::supervision::{
    ActorSnapshot, ActorState, ClusterMember, ClusterSnapshot, IndexedInstance, MemberStatus,
    ProxySnapshot, RouterDecisions, RouterSnapshot,
};
use pdserve_runtime::wire::{ControlMessage, ErrorMessage, InspectAnswer};
use pdserve_runtime::Role;
use pdserve_transport::control::{ControlConfig, ControlConnection, ControlEndpoint};
use ractor::{ActorCell, ActorRef};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tokio_util::task::TaskTracker;

pub(super) struct ProxyControl {
    pub(super) endpoint: Arc<ControlEndpoint>,
    pub(super) addr: SocketAddr,
    state: Arc<ProxyState>,
    /// node → (registration generation, its control connection).
    conns: Mutex<HashMap<String, (u64, Arc<ControlConnection>)>>,
    proxy: ActorCell,
    inbox: crate::mailbox::Inbox,
    started: Instant,
    pub(super) http_url: OnceLock<String>,
    inspect_timeout: Duration,
    pub(super) tasks: TaskTracker,
    /// Answers being built or sent at once ([`ProxyControlArgs::max_requests`]).
    answers: Arc<tokio::sync::Semaphore>,
    figures: Arc<Mutex<SupervisedFigures>>,
}

/// `pdserve_router_kv_index_blocks{instance}` from the index.
fn publish_index_sizes(index: &KvIndex) {
    for size in index.sizes() {
        metrics::gauge!(pdserve_runtime::telemetry::ROUTER_KV_INDEX_BLOCKS, "instance" => size.url)
            .set(size.blocks as f64);
    }
}

fn control_error(kind: &str, message: impl Into<String>) -> ControlMessage {
    ControlMessage::Error(ErrorMessage {
        kind: kind.to_string(),
        message: message.into(),
    })
}

/// `addr` with an unspecified IP (`0.0.0.0`, `::`) replaced by `peer` — what an instance
/// bound to all interfaces is reachable at, seen from this proxy.
pub(super) fn reachable(addr: SocketAddr, peer: IpAddr) -> SocketAddr {
    if addr.ip().is_unspecified() {
        SocketAddr::new(peer, addr.port())
    } else {
        addr
    }
}

impl ProxyControl {
    pub(super) fn bind(
        args: ProxyControlArgs,
        state: Arc<ProxyState>,
        myself: &ActorRef<ProxyMsg>,
        inbox: &crate::mailbox::Inbox,
        figures: Arc<Mutex<SupervisedFigures>>,
    ) -> Result<Self, StartError> {
        let config = ControlConfig {
            listen: args.listen,
            role: Role::Proxy,
            ..ControlConfig::default()
        };
        let endpoint = ControlEndpoint::bind(&args.credentials, config).map_err(|e| {
            StartError::ControlPlane(format!("cannot listen on {}: {e}", args.listen))
        })?;
        let addr = endpoint
            .local_addr()
            .map_err(|e| StartError::ControlPlane(e.to_string()))?;
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
            tasks: TaskTracker::new(),
            answers: Arc::new(tokio::sync::Semaphore::new(args.max_requests)),
            figures,
        })
    }

    fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.state.registry()
    }

    pub(super) async fn accept_forever(self: Arc<Self>) {
        while let Some(conn) = self.endpoint.accept().await {
            self.tasks.spawn(self.clone().serve_member(Arc::new(conn)));
        }
    }

    /// Handles one control connection (an instance, or a tool such as `pdserve inspect`)
    /// until it closes; then the registration made on it stops being routed to.
    async fn serve_member(self: Arc<Self>, conn: Arc<ControlConnection>) {
        let mut registered: Option<(String, u64)> = None;
        // The registered instance's URL: its KV events index under it.
        let mut registered_url: Option<String> = None;
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
                (ControlMessage::Register(reg), Some(responder)) => {
                    let answer = match self.register(&conn, *reg) {
                        Ok((node, generation, url)) => {
                            registered = Some((node, generation));
                            registered_url = Some(url);
                            ControlMessage::Registered {
                                proxy: self.endpoint.hello().node.clone(),
                            }
                        }
                        Err(e) => {
                            tracing::warn!(peer = %conn.peer().node, field = %e.field, error = %e, "registration refused");
                            ControlMessage::RegistrationRefused(e)
                        }
                    };
                    self.answer(responder, async move { answer }).await;
                }
                (ControlMessage::KvEvents(batch), None) => match &registered_url {
                    Some(url) => {
                        let mut index = self.state.kv_index();
                        if let Err(e) = index.apply(url, *batch) {
                            tracing::warn!(instance = %url, kind = e.kind(), error = %e, "KV events refused: the instance's index entries are dropped until its next snapshot");
                        }
                        publish_index_sizes(&index);
                    }
                    None => tracing::debug!(
                        peer = %conn.peer().node,
                        "KV events from an unregistered connection ignored"
                    ),
                },
                (ControlMessage::Draining, Some(responder)) => {
                    let answer = match &registered {
                        Some((node, generation)) if self.registry().draining(node, *generation) => {
                            tracing::info!(%node, "instance draining: no longer routed to");
                            ControlMessage::DrainingAck
                        }
                        _ => control_error(
                            "not_registered",
                            "draining announced on a connection without a current registration",
                        ),
                    };
                    self.answer(responder, async move { answer }).await;
                }
                (ControlMessage::InspectRequest, Some(responder)) => {
                    let me = self.clone();
                    let answer = async move {
                        let snap = me.cluster_snapshot().await;
                        ControlMessage::Inspect(Box::new(InspectAnswer::Cluster(snap)))
                    };
                    self.answer(responder, answer).await;
                }
                (other, Some(responder)) => {
                    let answer = control_error(
                        "unsupported",
                        format!("the proxy does not answer {}", other.name()),
                    );
                    self.answer(responder, async move { answer }).await;
                }
                (_, None) => {}
            }
        }
        if let Some((node, generation)) = registered {
            if self.registry().disconnect(&node, generation) {
                tracing::warn!(%node, "control connection closed: no longer routed to");
                if let Some(url) = &registered_url {
                    let mut index = self.state.kv_index();
                    index.forget(url);
                    metrics::gauge!(pdserve_runtime::telemetry::ROUTER_KV_INDEX_BLOCKS, "instance" => url.clone())
                        .set(0.0);
                }
            }
            let mut conns = self.conns.lock().unwrap_or_else(|e| e.into_inner());
            if conns.get(&node).is_some_and(|(g, _)| *g == generation) {
                conns.remove(&node);
            }
        }
    }

    /// Sends `answer` once it is built, on a tracked task, with at most
    /// [`ProxyControlArgs::max_requests`] such tasks at once over every connection; past that
    /// the request is answered `overloaded` at once and nothing is started (a member flooding
    /// requests, an inspect fanning out to every instance each time, cannot grow the proxy's
    /// tasks without bound).
    async fn answer(
        &self,
        responder: pdserve_transport::control::Responder,
        answer: impl std::future::Future<Output = ControlMessage> + Send + 'static,
    ) {
        let Ok(permit) = self.answers.clone().try_acquire_owned() else {
            let who = format!("the proxy {}", self.endpoint.hello().node);
            crate::control_plane::refuse_overloaded(responder, &who).await;
            return;
        };
        self.tasks.spawn(async move {
            let _permit = permit;
            if let Err(e) = responder.respond(answer.await).await {
                tracing::debug!(error = %e, "control answer not delivered");
            }
        });
    }

    /// Validates and records a registration made on `conn`.
    fn register(
        &self,
        conn: &Arc<ControlConnection>,
        reg: Registration,
    ) -> Result<(String, u64, String), RegistrationError> {
        use RegistrationField as F;
        let bad = RegistrationError::new;
        reg.validate(&conn.peer().node)?;
        let peer_ip = conn.remote_address().ip();
        let mut url = reqwest::Url::parse(&reg.url).map_err(|e| bad(F::Url, e.to_string()))?;
        if let Some(host) = url.host_str() {
            if host
                .trim_matches(['[', ']'])
                .parse::<IpAddr>()
                .is_ok_and(|ip| ip.is_unspecified())
            {
                url.set_ip_host(peer_ip)
                    .map_err(|()| bad(F::Url, format!("cannot rewrite the host of {}", reg.url)))?;
            }
        }
        let url = url.as_str().trim_end_matches('/').to_string();
        let control_addr: SocketAddr = reg
            .control_addr
            .parse()
            .map_err(|e| bad(F::ControlAddr, format!("{e}")))?;
        let control_addr = reachable(control_addr, peer_ip).to_string();
        let role = reg.role;
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
        {
            // What the index knew of this instance is stale: its snapshot follows.
            let mut index = self.state.kv_index();
            match (reg.block_size, reg.cache_salt) {
                (Some(block_size), Some(salt)) => {
                    index.register(&url, crate::kv_events::HashScheme { block_size, salt })
                }
                _ => {
                    index.forget(&url);
                    metrics::gauge!(pdserve_runtime::telemetry::ROUTER_KV_INDEX_BLOCKS, "instance" => url.clone())
                        .set(0.0);
                }
            }
            publish_index_sizes(&index);
        }
        tracing::info!(node = %reg.node, role = role.as_str(), %url, "instance registered");
        Ok((reg.node, generation, url))
    }

    fn router_snapshot(&self) -> RouterSnapshot {
        RouterSnapshot {
            kind: self.state.router.as_str().into(),
            decisions: self
                .state
                .decisions()
                .into_iter()
                .map(|(role, reason, count)| RouterDecisions {
                    role: role.as_str().into(),
                    reason: reason.into(),
                    count,
                })
                .collect(),
            kv_index: self
                .state
                .kv_index()
                .sizes()
                .into_iter()
                .map(|s| IndexedInstance {
                    url: s.url,
                    blocks: s.blocks,
                    dropped: s.dropped,
                    by_medium: s
                        .by_medium
                        .into_iter()
                        .map(|(m, n)| (m.as_str().to_string(), n))
                        .collect(),
                })
                .collect(),
        }
    }

    fn proxy_actor(&self) -> ActorSnapshot {
        let figures = self
            .figures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
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
            restarts: figures.restarts,
            mailbox_depth: self.inbox.depth(),
            last_error: figures.last_error,
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
                    draining: m.draining,
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
                router: Some(self.router_snapshot()),
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
    let ask = conn.request(ControlMessage::InspectRequest);
    match tokio::time::timeout(timeout, ask).await {
        Err(_) => MemberStatus::Unreachable(format!("no inspect answer within {timeout:?}")),
        Ok(Err(e)) => MemberStatus::Unreachable(e.to_string()),
        Ok(Ok(ControlMessage::Inspect(answer))) => match *answer {
            InspectAnswer::Instance(snap) => MemberStatus::Snapshot(Box::new(snap)),
            InspectAnswer::Cluster(_) => {
                MemberStatus::Unreachable("inspect answered with a cluster snapshot".into())
            }
        },
        Ok(Ok(other)) => {
            MemberStatus::Unreachable(format!("inspect answered with {}", other.name()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
