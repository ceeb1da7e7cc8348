//! The Proxy: the HTTP front door of a P/D cluster, as a supervised actor.
//!
//! | module | what it holds |
//! |---|---|
//! | [`registry`] | the instances it knows: static URLs polled over HTTP, instances registered over the control plane |
//! | [`routing`] | the pure routing decision (least loaded, round-robin ties, conditional disaggregation) |
//! | [`forward`] | the HTTP handlers: validate once, route, one hop to decode, stream the answer back |
//! | [`control`] | its control plane: registrations, heartbeats, `inspect` |
//!
//! A request is validated as an instance would (a bad field gets a 400, never an upstream
//! call), routed to the least-loaded prefill and decode instance, given a `transfer_id`, and
//! sent in one hop to the decode instance with `kv_transfer_params` naming the prefill
//! instance: the decode instance allocates its blocks, asks the prefill instance for the
//! prompt's KV over the peer protocol in its configured mode (push or pull) and answers; its
//! answer (JSON or `text/event-stream`) is streamed to the client. Every upstream call has a
//! timeout; no instance of a role → 503. A client that goes away drops the upstream stream,
//! which aborts the request on the decode instance, which aborts the hand-off on the prefill
//! instance. (Instances also accept vLLM's two-hop flow, for a vLLM proxy.)
//!
//! Supervision: [`ProxySupervisor`] starts the [`Proxy`] and restarts it when it fails (its
//! own budget, the instance actors' default: 3 in 60 s; beyond it the supervisor fails too),
//! with the same figures in `pdserve inspect` (restarts, last error, mailbox depth). A
//! restarted proxy binds the same addresses; registered instances notice their control
//! connection closed and register again, static instances are polled again.

pub mod control;
pub mod encode;
pub mod forward;
mod messages;
pub mod registry;
pub mod routing;
mod state;

use self::control::ProxyControl;
pub use self::messages::{ProxyArgs, ProxyControlArgs, ProxyMsg, ProxyStart, SupervisedFigures};
use self::registry::Registry;
use self::routing::RoundRobin;
pub use self::state::{PromptTokenizer, ProxyState};
use crate::discovery::{Announcement, MemberKind, MemberRecord, MemberWatch};
use crate::error::StartError;
use crate::http::HttpServer;
use crate::mailbox::{Inbox, Mailbox, PanicHook};
use axum::extract::State;
use axum::routing::{get, post};
use axum::Router;
use pdserve_runtime::supervision::{
    ActorSnapshot, ActorState, RestartDecision, RestartPolicy, RestartTracker,
};
use pdserve_runtime::telemetry as m;
use pdserve_runtime::Role;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use crate::control_plane::MISSED_HEARTBEATS_TO_DROP;

/// How often the proxy asks each static instance for its load.
pub const POLL_INTERVAL: Duration = Duration::from_millis(500);
/// Polls an instance may miss in a row before it stops getting requests.
pub const MISSED_POLLS_TO_DROP: u32 = 3;

fn router(state: Arc<ProxyState>) -> Router {
    Router::new()
        .route(
            "/v1/completions",
            post(|s, h, b| forward::forward(s, h, b, false)),
        )
        .route(
            "/v1/chat/completions",
            post(|s, h, b| forward::forward(s, h, b, true)),
        )
        .route("/v1/models", get(forward::models))
        .route("/health", get(forward::health))
        .route("/health/ready", get(forward::health))
        .route(
            "/health/live",
            get(|| async { axum::Json(serde_json::json!({"status": "live", "live": true})) }),
        )
        .route(
            "/metrics",
            get(|State(s): State<Arc<ProxyState>>| async move { s.metrics.render() }),
        )
        .with_state(state)
}

/// Polls the static instances' load until the proxy stops.
async fn poll_forever(state: Arc<ProxyState>, client: reqwest::Client) {
    #[derive(serde::Deserialize)]
    struct Load {
        waiting: usize,
        running: usize,
        blocks_free: usize,
        /// Whether it takes new requests (absent: an older instance, taken as ready).
        #[serde(default = "yes")]
        ready: bool,
    }
    fn yes() -> bool {
        true
    }
    let mut tick = tokio::time::interval(POLL_INTERVAL);
    loop {
        tick.tick().await;
        let urls = state.registry().static_urls();
        for url in urls {
            let load = match state
                .upstream(client.get(format!("{url}/v1/load")))
                .send()
                .await
            {
                Ok(r) if r.status().is_success() => r.json::<Load>().await.ok(),
                _ => None,
            };
            let mut registry = state.registry();
            if let Some(l) = &load {
                registry.set_ready(&url, l.ready);
            }
            registry.record(&url, load.map(|l| (l.waiting + l.running, l.blocks_free)));
        }
        let (p, d, e) = {
            let r = state.registry();
            (
                r.alive(Role::Prefill).len(),
                r.alive(Role::Decode).len(),
                r.alive(Role::Encode).len(),
            )
        };
        metrics::gauge!(m::PROXY_INSTANCES, "role" => "prefill").set(p as f64);
        metrics::gauge!(m::PROXY_INSTANCES, "role" => "decode").set(d as f64);
        metrics::gauge!(m::PROXY_INSTANCES, "role" => "encode").set(e as f64);
    }
}

/// The Proxy actor (its mailbox count; its supervisor's view of its restarts for inspect).
#[derive(Debug)]
pub struct Proxy(pub Inbox, pub Arc<Mutex<SupervisedFigures>>);

/// The Proxy's state: its server, poller and control plane.
pub struct ProxyActorState {
    server: HttpServer,
    state: Arc<ProxyState>,
    poller: tokio::task::JoinHandle<()>,
    control: Option<(Arc<ProxyControl>, tokio::task::JoinHandle<()>)>,
    /// With etcd discovery: this proxy's record, and the task that keeps the registry's
    /// member set to the instances etcd lists.
    etcd: Option<(Announcement, tokio::task::JoinHandle<()>)>,
}

/// The record a proxy keeps in etcd: its API and control addresses as bound, with the IP
/// replaced by `advertise` when set (a proxy bound to `0.0.0.0` in a pod publishes its pod IP:
/// instances connect to the control address they read here, and `0.0.0.0` would be
/// themselves).
fn proxy_record(
    node: String,
    scheme: &str,
    http: SocketAddr,
    control: SocketAddr,
    advertise: Option<std::net::IpAddr>,
) -> MemberRecord {
    let published = |a: SocketAddr| advertise.map_or(a, |ip| SocketAddr::new(ip, a.port()));
    MemberRecord {
        node,
        role: Role::Proxy,
        url: format!("{scheme}://{}", published(http)),
        control_addr: published(control).to_string(),
    }
}

/// Keeps the registry's member set to the instances `watch` lists (etcd discovery), and the
/// `pdserve_proxy_etcd_members` gauge to their count.
async fn follow_members(state: Arc<ProxyState>, watch: MemberWatch) {
    let mut members = watch.members.clone();
    loop {
        let names = members
            .borrow_and_update()
            .as_ref()
            .map(|m| m.keys().cloned().collect::<std::collections::HashSet<_>>());
        let count = names.as_ref().map_or(0, |n| n.len());
        // Until etcd first answers, an empty set: no registered instance is routed to. (The
        // registry first, then the gauge: a reader who sees the gauge sees the routing too.)
        state
            .registry()
            .set_members(Some(names.unwrap_or_default()));
        metrics::gauge!(m::PROXY_ETCD_MEMBERS).set(count as f64);
        if members.changed().await.is_err() {
            return;
        }
    }
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
        args.encode
            .iter()
            .for_each(|u| registry.add(Role::Encode, u.trim_end_matches('/')));
        let state = Arc::new(ProxyState {
            registry: Mutex::new(registry),
            rr: RoundRobin::default(),
            http: args.tls.client().build()?,
            timeout: args.timeout,
            max_prefill_queue: args.max_prefill_queue,
            admission: Arc::new(tokio::sync::Semaphore::new(args.max_concurrent_requests)),
            max_concurrent_requests: args.max_concurrent_requests,
            api_key: args.api_key.clone(),
            migration_limit: args.migration_limit,
            prefill_retry: args.prefill_retry,
            metrics: pdserve_runtime::telemetry::install_metrics(),
            router: args.router,
            prefill_load_scale: args.prefill_load_scale,
            kv_index: Mutex::new(crate::kv_events::KvIndex::new(args.kv_index_max_blocks)),
            kv_tier_credit: args.kv_tier_credit,
            tokenizer: args.tokenizer.clone(),
            outstanding: Mutex::new(Default::default()),
            decisions: Mutex::new(Default::default()),
            draining: std::sync::atomic::AtomicBool::new(false),
        });
        let etcd_member = start.control.as_ref().and_then(|c| {
            Some((
                c.discovery.clone()?,
                c.credentials.node().to_string(),
                c.advertise,
            ))
        });
        // Bind the control endpoint first: if it fails, nothing else is running yet.
        let control = match start.control {
            Some(c) => Some(Arc::new(ProxyControl::bind(
                c,
                state.clone(),
                &myself,
                &self.0,
                self.1.clone(),
            )?)),
            None => None,
        };
        let server = HttpServer::start(
            args.bind,
            router(state.clone()),
            args.tls.server_config(),
            args.conn_limits,
            "proxy",
        )
        .await?;
        let poll = args.tls.client().timeout(POLL_INTERVAL * 2).build()?;
        let poller = tokio::spawn(poll_forever(state.clone(), poll));
        let http_url = format!("{}://{}", args.tls.scheme(), server.addr());
        let etcd = etcd_member
            .zip(control.as_ref())
            .map(|((settings, node, advertise), c)| {
                let record =
                    proxy_record(node, args.tls.scheme(), server.addr(), c.addr, advertise);
                let watch = MemberWatch::start(settings.clone(), MemberKind::Instance);
                (
                    Announcement::start(settings, MemberKind::Proxy, record),
                    tokio::spawn(follow_members(state.clone(), watch)),
                )
            });
        let control = control.map(|c| {
            let _ = c.http_url.set(http_url);
            let accept = tokio::spawn(c.clone().accept_forever());
            (c, accept)
        });
        Ok(ProxyActorState {
            server,
            state,
            poller,
            control,
            etcd,
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
            ProxyMsg::Drain(reply) => {
                st.state
                    .draining
                    .store(true, std::sync::atomic::Ordering::SeqCst);
                let in_flight = st
                    .state
                    .max_concurrent_requests
                    .saturating_sub(st.state.admission.available_permits());
                let _ = reply.send(in_flight);
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
        if let Some((announcement, follow)) = st.etcd.take() {
            follow.abort();
            announcement.withdraw(Duration::from_secs(1)).await;
        }
        if let Some((control, accept)) = &st.control {
            accept.abort();
            control.endpoint.close();
            control.tasks.close();
            let _ = tokio::time::timeout(Duration::from_secs(5), control.tasks.wait()).await;
        }
        st.server.stop().await;
        Ok(())
    }
}

/// Messages of the ProxySupervisor.
pub enum ProxySupervisorMsg {
    /// The Proxy's current address.
    Proxy(RpcReplyPort<Mailbox<ProxyMsg>>),
    /// The supervisor's own view (for `inspect` of a bare proxy).
    Snapshot(RpcReplyPort<ActorSnapshot>),
}

/// Supervises the Proxy: restarts it in place (same addresses) under a restart budget.
#[derive(Debug)]
pub struct ProxySupervisor(pub Inbox);

/// The ProxySupervisor's state.
pub struct ProxySupervisorState {
    name: String,
    start: ProxyStart,
    proxy: Mailbox<ProxyMsg>,
    tracker: RestartTracker,
    figures: Arc<Mutex<SupervisedFigures>>,
    started: Instant,
}

/// Arguments of the ProxySupervisor.
pub struct ProxySupervisorArgs {
    /// The proxy's name (its actor's registered name).
    pub name: String,
    /// How the proxy starts (addresses are pinned after the first start, so a restart binds
    /// the same ones).
    pub start: ProxyStart,
    /// Restart budget.
    pub policy: RestartPolicy,
}

impl Actor for ProxySupervisor {
    type Msg = ProxySupervisorMsg;
    type State = ProxySupervisorState;
    type Arguments = ProxySupervisorArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: ProxySupervisorArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let figures = Arc::new(Mutex::new(SupervisedFigures::default()));
        let f = figures.clone();
        let (proxy, _) = Mailbox::spawn_linked(
            args.name.clone(),
            move |i| Proxy(i, f),
            args.start.clone(),
            myself.get_cell(),
            PanicHook::default(),
        )
        .await?;
        // Pin the bound addresses: a restart must come back where clients and instances
        // look for it.
        let mut start = args.start;
        let ms = start.args.call_ms();
        start.args.bind = ractor::call_t!(proxy, ProxyMsg::LocalAddr, ms)?;
        if let Some(c) = start.control.as_mut() {
            if let Some(addr) = ractor::call_t!(proxy, ProxyMsg::ControlAddr, ms)? {
                c.listen = addr;
            }
        }
        Ok(ProxySupervisorState {
            name: args.name,
            start,
            proxy,
            tracker: RestartTracker::new(args.policy),
            figures,
            started: Instant::now(),
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
            ProxySupervisorMsg::Proxy(reply) => {
                if !reply.is_closed() {
                    let _ = reply.send(st.proxy.clone());
                }
            }
            ProxySupervisorMsg::Snapshot(reply) => {
                let figures = st.figures.lock().unwrap_or_else(|e| e.into_inner()).clone();
                let snap = ActorSnapshot {
                    name: st.name.clone(),
                    kind: "Proxy".into(),
                    state: ActorState::Running,
                    restarts: figures.restarts,
                    mailbox_depth: st.proxy.depth(),
                    last_error: figures.last_error,
                    uptime_s: st.started.elapsed().as_secs_f64(),
                    children: Vec::new(),
                };
                if !reply.is_closed() {
                    let _ = reply.send(snap);
                }
            }
        }
        Ok(())
    }

    /// Stops the proxy with the supervisor and waits for it (its `post_stop` closes its
    /// listener and control endpoint).
    async fn post_stop(
        &self,
        myself: ActorRef<Self::Msg>,
        _st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        myself
            .stop_children_and_wait(
                Some("the proxy is stopping".into()),
                Some(Duration::from_secs(10)),
            )
            .await;
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<Self::Msg>,
        evt: SupervisionEvent,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let reason = match evt {
            SupervisionEvent::ActorFailed(cell, err)
                if cell.get_id() == st.proxy.get_cell().get_id() =>
            {
                err.to_string()
            }
            SupervisionEvent::ActorTerminated(cell, _, reason)
                if cell.get_id() == st.proxy.get_cell().get_id() =>
            {
                // A clean stop of the proxy (its owner stopping it) ends the supervisor too.
                myself.stop(reason);
                return Ok(());
            }
            _ => return Ok(()),
        };
        metrics::counter!(m::ACTOR_RESTARTS_TOTAL, "actor" => "Proxy").increment(1);
        tracing::error!(proxy = %st.name, %reason, "proxy failed");
        st.figures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .last_error = Some(reason.clone());
        match st.tracker.on_failure(Instant::now()) {
            RestartDecision::Restart { attempt } => {
                let f = st.figures.clone();
                st.proxy
                    .respawn_linked(
                        st.name.clone(),
                        move |i| Proxy(i, f),
                        st.start.clone(),
                        myself.get_cell(),
                    )
                    .await?;
                st.figures.lock().unwrap_or_else(|e| e.into_inner()).restarts += 1;
                tracing::warn!(proxy = %st.name, attempt, "proxy restarted");
                Ok(())
            }
            RestartDecision::Escalate { restarts_in_window } => Err(format!(
                "the proxy failed {restarts_in_window} times within the restart window: escalating ({reason})"
            )
            .into()),
        }
    }
}

/// A started proxy: its supervisor, its address and the supervisor's join handle.
pub struct StartedProxy {
    /// The supervisor.
    pub supervisor: Mailbox<ProxySupervisorMsg>,
    /// Bound on calls to it.
    pub call_timeout: Duration,
    /// Where the proxy's HTTP API listens.
    pub addr: SocketAddr,
    /// Resolves when the supervisor stopped (a stop, or an escalated failure).
    pub join: tokio::task::JoinHandle<()>,
}

impl StartedProxy {
    /// The proxy actor as it is now (a restart re-points the same mailbox).
    ///
    /// # Errors
    /// [`StartError::Actor`] when the supervisor does not answer.
    pub async fn proxy(&self) -> Result<Mailbox<ProxyMsg>, StartError> {
        ractor::call_t!(
            self.supervisor,
            ProxySupervisorMsg::Proxy,
            self.call_timeout.as_millis() as u64
        )
        .map_err(|e| StartError::actor("proxy supervisor", e))
    }

    /// Where the control plane listens (`None`: started without one).
    ///
    /// # Errors
    /// [`StartError::Actor`] when the proxy does not answer.
    pub async fn control_addr(&self) -> Result<Option<SocketAddr>, StartError> {
        let proxy = self.proxy().await?;
        ractor::call_t!(
            proxy,
            ProxyMsg::ControlAddr,
            self.call_timeout.as_millis() as u64
        )
        .map_err(|e| StartError::actor("proxy", e))
    }

    /// Drains the proxy: `/health` answers 503 (`draining`) from now on, so load balancers
    /// and clients move to another proxy, while the requests in flight (and any still sent
    /// here) are served. Returns once none is in flight, or after `within`, with the number
    /// left.
    ///
    /// # Errors
    /// The proxy did not answer.
    pub async fn drain(&self, within: Duration) -> Result<usize, StartError> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let proxy = self.proxy().await?;
            let left =
                ractor::call_t!(proxy, ProxyMsg::Drain, self.call_timeout.as_millis() as u64)
                    .map_err(|e| StartError::actor("proxy", e))?;
            if left == 0 || tokio::time::Instant::now() >= deadline {
                return Ok(left);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops the proxy and its supervisor (bounded).
    pub async fn stop(self) {
        self.supervisor.stop(Some("shutdown".into()));
        let _ = tokio::time::timeout(Duration::from_secs(10), self.join).await;
    }
}

/// Starts a supervised proxy named `name` without a control plane.
///
/// # Errors
/// When it cannot bind its address.
pub async fn start_proxy(name: &str, args: ProxyArgs) -> Result<StartedProxy, StartError> {
    start_proxy_with_control(name, args, None).await
}

/// Starts a supervised proxy named `name`, with a control plane when `control` is given.
///
/// # Errors
/// When it cannot bind its addresses.
pub async fn start_proxy_with_control(
    name: &str,
    args: ProxyArgs,
    control: Option<ProxyControlArgs>,
) -> Result<StartedProxy, StartError> {
    let call_timeout = args.call_timeout;
    let (supervisor, join) = Mailbox::spawn(
        Some(format!("{name}/supervisor")),
        ProxySupervisor,
        ProxySupervisorArgs {
            name: name.to_string(),
            start: ProxyStart { args, control },
            policy: RestartPolicy::default(),
        },
    )
    .await
    .map_err(|e| StartError::actor(format!("proxy {name}"), e))?;
    let started = StartedProxy {
        supervisor,
        call_timeout,
        addr: SocketAddr::from(([0, 0, 0, 0], 0)),
        join,
    };
    let proxy = started.proxy().await?;
    let addr = ractor::call_t!(proxy, ProxyMsg::LocalAddr, call_timeout.as_millis() as u64)
        .map_err(|e| StartError::actor("proxy", e))?;
    Ok(StartedProxy { addr, ..started })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proxy_bound_to_every_interface_publishes_its_advertised_ip() {
        let http: SocketAddr = "0.0.0.0:8000".parse().unwrap();
        let control: SocketAddr = "0.0.0.0:7000".parse().unwrap();
        let r = proxy_record(
            "proxy-0".into(),
            "http",
            http,
            control,
            Some("10.244.1.7".parse().unwrap()),
        );
        assert_eq!(r.node, "proxy-0");
        assert_eq!(r.role, Role::Proxy);
        assert_eq!(r.url, "http://10.244.1.7:8000");
        assert_eq!(r.control_addr, "10.244.1.7:7000");
        // What instances read back: the advertised address, not 0.0.0.0.
        let view = Some(std::collections::BTreeMap::from([(r.node.clone(), r)]));
        assert_eq!(
            crate::discovery::control_addrs(&view),
            vec!["10.244.1.7:7000".parse::<SocketAddr>().unwrap()]
        );
        // Without an advertised IP the bound addresses are published as they are.
        let bound: SocketAddr = "10.0.0.1:7000".parse().unwrap();
        let r = proxy_record(
            "proxy".into(),
            "https",
            "10.0.0.1:8443".parse().unwrap(),
            bound,
            None,
        );
        assert_eq!(r.url, "https://10.0.0.1:8443");
        assert_eq!(r.control_addr, "10.0.0.1:7000");
    }
}
