//! The control plane between instances and the proxy, over loopback QUIC with mutual TLS:
//! instances register themselves and are routed to without any static URL; one that stops
//! heartbeating is dropped from routing and comes back; after a proxy restart every instance
//! registers again; a stranger (credentials of another cluster CA) is refused and never
//! registers; `inspect` through the proxy shows the proxy and every instance's actor tree,
//! worker restarts, and an instance that left as unreachable.
//!
//! Every instance and proxy gets a unique name (actor names are process-global and tests run
//! in parallel); every wait polls a condition under a deadline.

use pdserve_actors::control_plane::InstanceControl;
use pdserve_actors::proxy::{start_proxy_with_control, ProxyArgs, ProxyControlArgs, StartedProxy};
use pdserve_actors::{Instance, InstanceOptions};
use pdserve_gpu::loader::{load_model, ModelSource};
use pdserve_runtime::supervision::{
    ActorSnapshot, ActorState, ClusterSnapshot, InstanceSnapshot, MemberStatus,
};
use pdserve_runtime::wire::{ControlMessage, InspectAnswer};
use pdserve_runtime::Role;
use pdserve_transport::control::tls::{ClusterCredentials, MemberCredentials};
use pdserve_transport::control::{ControlConfig, ControlEndpoint};
use pdserve_transport::{BackendKind, TransferConfig};
use serde_json::{json, Value};
use std::future::Future;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Heartbeat interval of the test instances (the proxy drops one after 3 missed).
const HEARTBEAT: Duration = Duration::from_millis(100);

/// The one cluster CA of these tests.
fn cluster() -> &'static ClusterCredentials {
    static CLUSTER: std::sync::OnceLock<ClusterCredentials> = std::sync::OnceLock::new();
    CLUSTER.get_or_init(|| ClusterCredentials::ephemeral("cp-test").unwrap())
}

fn member(node: &str) -> MemberCredentials {
    cluster().issue(node).unwrap()
}

/// Polls `cond` every 50 ms until it holds; fails the test after `within`.
async fn wait_for<F, Fut>(what: &str, within: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    loop {
        if cond().await {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

struct Proxy {
    started: StartedProxy,
    url: String,
    control: SocketAddr,
}

impl Proxy {
    async fn stop(self) {
        self.started.stop().await;
    }
}

/// A proxy with a control plane on `listen` and no static instance.
async fn proxy_at(name: &str, listen: SocketAddr) -> Result<Proxy, String> {
    proxy_bounded(
        name,
        listen,
        pdserve_actors::control_plane::MAX_CONTROL_REQUESTS,
    )
    .await
}

/// [`proxy_at`] answering at most `max_requests` control requests at once.
async fn proxy_bounded(
    name: &str,
    listen: SocketAddr,
    max_requests: usize,
) -> Result<Proxy, String> {
    let mut args = ProxyArgs::new("127.0.0.1:0".parse().unwrap(), Vec::new(), Vec::new());
    args.timeout = Duration::from_secs(30);
    let mut control = ProxyControlArgs::new(member(name), listen);
    control.max_requests = max_requests;
    let started = start_proxy_with_control(name, args, Some(control))
        .await
        .map_err(|e| e.to_string())?;
    let control = started
        .control_addr()
        .await
        .map_err(|e| e.to_string())?
        .expect("a proxy started with control args has a control address");
    Ok(Proxy {
        url: format!("http://{}", started.addr),
        started,
        control,
    })
}

/// Stops `px` and starts `name` on the same control address.
async fn restart(px: Proxy, name: &str) -> Proxy {
    let control = px.control;
    px.stop().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        // The old endpoint's socket is released once its connections have drained.
        match proxy_at(name, control).await {
            Ok(p) => return p,
            Err(e) => {
                assert!(Instant::now() < deadline, "cannot rebind {control}: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn proxy(name: &str) -> Proxy {
    proxy_at(name, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap()
}

/// An instance of the tiny synthetic model that registers with `proxy` as `role`.
async fn instance(
    name: &str,
    role: Role,
    proxy: SocketAddr,
    credentials: MemberCredentials,
    tp: usize,
) -> Instance {
    let model = load_model(&ModelSource::Synthetic("tiny".into())).unwrap();
    let mut o = InstanceOptions::local(name, model);
    o.tp = tp;
    o.transfer = Some(TransferConfig::new(BackendKind::Local, name));
    let mut control = InstanceControl::new(credentials, role);
    control.proxy = Some(proxy);
    control.heartbeat = HEARTBEAT;
    o.control = Some(control);
    Instance::start(o).await.unwrap()
}

async fn complete(url: &str) -> (u16, Value) {
    complete_tokens(url, &[1, 2, 3, 4, 5, 6, 7], 4).await
}

async fn complete_tokens(url: &str, prompt: &[u32], max_tokens: usize) -> (u16, Value) {
    let r = pdserve_actors::http::http_client().build().unwrap()
        .post(format!("{url}/v1/completions"))
        .json(&json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true}))
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

async fn healthy(url: &str) -> bool {
    match pdserve_actors::http::http_client()
        .build()
        .unwrap()
        .get(format!("{url}/health"))
        .send()
        .await
    {
        Ok(r) => r.status() == 200,
        Err(_) => false,
    }
}

/// Asks the member at `addr` for its snapshot, as `pdserve inspect` does (a typed
/// `InspectRequest`): the greeting's role and the answer's JSON, as `pdserve inspect --json`
/// prints it.
async fn inspect_raw(addr: SocketAddr, as_node: &str) -> (Role, Vec<u8>) {
    let endpoint = ControlEndpoint::bind(
        &member(as_node),
        ControlConfig {
            role: Role::Other,
            ..ControlConfig::default()
        },
    )
    .unwrap();
    let conn = endpoint.connect(addr).await.unwrap();
    let answer = conn.request(ControlMessage::InspectRequest).await.unwrap();
    let json = match answer {
        ControlMessage::Inspect(answer) => match *answer {
            InspectAnswer::Cluster(c) => serde_json::to_vec(&c).unwrap(),
            InspectAnswer::Instance(i) => serde_json::to_vec(&i).unwrap(),
        },
        other => panic!("inspect answered with {other:?}"),
    };
    (conn.peer().role, json)
}

async fn inspect_cluster(proxy: &Proxy) -> ClusterSnapshot {
    let (role, body) = inspect_raw(proxy.control, "inspector").await;
    assert_eq!(role, Role::Proxy);
    serde_json::from_slice(&body).unwrap()
}

fn kinds(actor: &ActorSnapshot, out: &mut Vec<String>) {
    out.push(actor.kind.clone());
    for c in &actor.children {
        kinds(c, out);
    }
}

fn find<'a>(actor: &'a ActorSnapshot, name: &str) -> Option<&'a ActorSnapshot> {
    if actor.name == name {
        return Some(actor);
    }
    actor.children.iter().find_map(|c| find(c, name))
}

fn snapshot_of<'a>(snap: &'a ClusterSnapshot, node: &str) -> &'a InstanceSnapshot {
    let m = snap
        .instances
        .iter()
        .find(|m| m.node == node)
        .unwrap_or_else(|| panic!("{node} not registered: {snap:?}"));
    match &m.status {
        MemberStatus::Snapshot(s) => s,
        MemberStatus::Unreachable(why) => panic!("{node} unreachable: {why}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registered_instances_are_routed_to_without_static_urls() {
    let px = proxy("cp-route-proxy").await;
    assert!(!healthy(&px.url).await, "nothing registered yet");
    let (status, v) = complete(&px.url).await;
    assert_eq!(status, 503, "{v}");
    let p = instance(
        "cp-route-p",
        Role::Prefill,
        px.control,
        member("cp-route-p"),
        1,
    )
    .await;
    let d = instance(
        "cp-route-d",
        Role::Decode,
        px.control,
        member("cp-route-d"),
        1,
    )
    .await;
    wait_for("both instances routable", Duration::from_secs(10), || {
        healthy(&px.url)
    })
    .await;
    for _ in 0..3 {
        let (status, v) = complete(&px.url).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
    }
    for inst in [&p, &d] {
        let cp = inst.control_plane().unwrap();
        assert_eq!(cp.registrations(), 1);
        assert!(cp.heartbeats() >= 1);
    }
    let snap = inspect_cluster(&px).await;
    assert_eq!(snap.proxy.registered, 2);
    assert_eq!(
        (snap.proxy.routable_prefill, snap.proxy.routable_decode),
        (1, 1)
    );
    let m = snap
        .instances
        .iter()
        .find(|m| m.node == "cp-route-d")
        .unwrap();
    assert_eq!(
        (m.role.as_str(), m.url.as_str()),
        ("decode", d.url().as_str())
    );
    assert_eq!(
        m.control_addr,
        d.control_plane().unwrap().local_addr().to_string()
    );
    assert!(m.routable);
    // The requests went prefill → decode: the KV bytes moved show in the figures.
    let (ps, ds) = (
        snapshot_of(&snap, "cp-route-p"),
        snapshot_of(&snap, "cp-route-d"),
    );
    assert!(
        ps.bytes_sent + ds.bytes_received > 0,
        "no KV bytes counted: {ps:?} {ds:?}"
    );
    assert_eq!(ps.transfer_failures + ds.transfer_failures, 0);
    px.stop().await;
    p.stop().await;
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_instances_are_dropped_and_a_restarted_proxy_gets_everyone_back() {
    let px = proxy("cp-hb-proxy").await;
    let p = instance("cp-hb-p", Role::Prefill, px.control, member("cp-hb-p"), 1).await;
    let d = instance("cp-hb-d", Role::Decode, px.control, member("cp-hb-d"), 1).await;
    wait_for("both instances routable", Duration::from_secs(10), || {
        healthy(&px.url)
    })
    .await;

    // The decode instance goes silent (its connection stays open): it is dropped.
    d.control_plane().unwrap().set_heartbeats_paused(true);
    let url = px.url.clone();
    wait_for(
        "the silent decode instance to be dropped",
        Duration::from_secs(5),
        || {
            let url = url.clone();
            async move {
                let (status, v) = complete(&url).await;
                status == 503
                    && v["error"]["message"]
                        .as_str()
                        .is_some_and(|m| m.contains("no decode instance is available"))
            }
        },
    )
    .await;
    let snap = inspect_cluster(&px).await;
    let m = snap.instances.iter().find(|m| m.node == "cp-hb-d").unwrap();
    assert!(!m.routable, "{m:?}");
    assert!(m.last_heartbeat_s >= (HEARTBEAT * 3).as_secs_f64(), "{m:?}");
    assert!(
        matches!(m.status, MemberStatus::Snapshot(_)),
        "still connected, so still inspectable: {m:?}"
    );

    // Heartbeats again: routed to again.
    d.control_plane().unwrap().set_heartbeats_paused(false);
    wait_for(
        "the decode instance to come back",
        Duration::from_secs(5),
        || {
            let url = url.clone();
            async move { complete(&url).await.0 == 200 }
        },
    )
    .await;

    // The proxy restarts on the same control address: both instances register again.
    let px2 = restart(px, "cp-hb-proxy-2").await;
    wait_for(
        "re-registration with the new proxy",
        Duration::from_secs(15),
        || healthy(&px2.url),
    )
    .await;
    assert_eq!(p.control_plane().unwrap().registrations(), 2);
    assert_eq!(d.control_plane().unwrap().registrations(), 2);
    let (status, v) = complete(&px2.url).await;
    assert_eq!(status, 200, "{v}");
    px2.stop().await;
    p.stop().await;
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_without_this_clusters_credentials_is_refused_and_never_registers() {
    let px = proxy("cp-stranger-proxy").await;
    // Same cluster name, another CA: a stranger.
    let other = ClusterCredentials::ephemeral("cp-test").unwrap();
    let s = instance(
        "cp-stranger-d",
        Role::Decode,
        px.control,
        other.issue("cp-stranger-d").unwrap(),
        1,
    )
    .await;
    wait_for(
        "the proxy to refuse the stranger's connections",
        Duration::from_secs(10),
        || async { inspect_cluster(&px).await.proxy.refused_connections >= 2 },
    )
    .await;
    assert_eq!(s.control_plane().unwrap().registrations(), 0);
    assert_eq!(s.control_plane().unwrap().heartbeats(), 0);
    let snap = inspect_cluster(&px).await;
    assert!(snap.instances.is_empty(), "{snap:?}");
    let (status, v) = complete(&px.url).await;
    assert_eq!(status, 503, "{v}");
    // A stranger tool cannot inspect either.
    let endpoint = ControlEndpoint::bind(
        &other.issue("cp-stranger-tool").unwrap(),
        ControlConfig::default(),
    )
    .unwrap();
    assert!(endpoint.connect(px.control).await.is_err());
    px.stop().await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_through_the_proxy_shows_every_tree_restarts_and_unreachable_instances() {
    let px = proxy("cp-insp-proxy").await;
    let p = instance(
        "cp-insp-p",
        Role::Prefill,
        px.control,
        member("cp-insp-p"),
        2,
    )
    .await;
    let d = instance(
        "cp-insp-d",
        Role::Decode,
        px.control,
        member("cp-insp-d"),
        1,
    )
    .await;
    wait_for("both instances routable", Duration::from_secs(10), || {
        healthy(&px.url)
    })
    .await;

    let snap = inspect_cluster(&px).await;
    assert_eq!(snap.proxy.cluster, "cp-test");
    assert_eq!(snap.proxy.node, "cp-insp-proxy");
    assert_eq!(snap.proxy.url, px.url);
    assert_eq!(snap.proxy.actors.kind, "Proxy");
    assert_eq!(snap.proxy.actors.state, ActorState::Running);
    assert_eq!(snap.instances.len(), 2);
    for (node, role, tp) in [("cp-insp-p", "prefill", 2), ("cp-insp-d", "decode", 1)] {
        let s = snapshot_of(&snap, node);
        assert_eq!(
            (s.instance.as_str(), s.role.as_str(), s.tp),
            (node, role, tp)
        );
        assert_eq!(s.kv_blocks_total, 256);
        assert_eq!(s.kv_blocks_used + s.kv_blocks_free, s.kv_blocks_total);
        assert_eq!(s.actors.kind, "InstanceSupervisor");
        let mut all = Vec::new();
        kinds(&s.actors, &mut all);
        for kind in ["Scheduler", "HttpFrontend"] {
            assert!(
                all.iter().any(|k| k == kind),
                "{node}: no {kind} in {all:?}"
            );
        }
        assert_eq!(
            all.iter().filter(|k| *k == "TpWorker").count(),
            tp,
            "{node}: {all:?}"
        );
        assert!(
            all.iter().any(|k| k.starts_with("Kv")),
            "{node} has a transfer engine, so KV actors: {all:?}"
        );
        for c in &s.actors.children {
            assert_eq!(c.state, ActorState::Running, "{node}: {c:?}");
            assert_eq!(c.restarts, 0, "{node}: {c:?}");
        }
    }
    // The JSON a user sees: a member carries `snapshot`, not `unreachable`.
    let (_, raw) = inspect_raw(px.control, "inspector-json").await;
    let v: Value = serde_json::from_slice(&raw).unwrap();
    assert!(
        v["instances"][0]["snapshot"]["actors"]["children"].is_array(),
        "{v}"
    );
    assert!(v["instances"][0].get("unreachable").is_none(), "{v}");

    // A crashed worker is restarted; the next inspect counts it.
    p.inject_panic("TpWorker", 1).await.unwrap();
    let (status, v) = complete(&p.url()).await;
    assert_eq!(status, 500, "the injected fault fails the step: {v}");
    let worker = "cp-insp-p/tp-worker-1";
    let restarted = std::sync::Arc::new(std::sync::Mutex::new(None));
    wait_for(
        "the worker's restart to show",
        Duration::from_secs(10),
        || {
            let (px, restarted) = (&px, restarted.clone());
            async move {
                let snap = inspect_cluster(px).await;
                let s = snapshot_of(&snap, "cp-insp-p");
                let w = find(&s.actors, worker).cloned();
                let done = w
                    .as_ref()
                    .is_some_and(|w| w.restarts == 1 && w.state == ActorState::Running);
                *restarted.lock().unwrap() = w;
                done
            }
        },
    )
    .await;
    let w = restarted.lock().unwrap().clone().unwrap();
    assert!(
        w.last_error
            .as_deref()
            .is_some_and(|e| e.contains("injected")),
        "{w:?}"
    );
    let snap = inspect_cluster(&px).await;
    let other = find(
        &snapshot_of(&snap, "cp-insp-p").actors,
        "cp-insp-p/tp-worker-0",
    )
    .unwrap()
    .clone();
    assert_eq!(other.restarts, 0, "only rank 1 crashed: {other:?}");

    // One instance straight over its own control address.
    let (role, raw) =
        inspect_raw(p.control_plane().unwrap().local_addr(), "inspector-direct").await;
    assert_eq!(role, Role::Prefill);
    let direct: InstanceSnapshot = serde_json::from_slice(&raw).unwrap();
    assert_eq!((direct.instance.as_str(), direct.tp), ("cp-insp-p", 2));

    // The decode instance goes away: inspect still answers, listing it as unreachable.
    d.stop().await;
    wait_for(
        "the stopped instance to show as unreachable",
        Duration::from_secs(10),
        || {
            let px = &px;
            async move {
                let snap = inspect_cluster(px).await;
                let m = snap
                    .instances
                    .iter()
                    .find(|m| m.node == "cp-insp-d")
                    .expect("a stopped instance stays listed");
                !m.routable
                    && matches!(&m.status, MemberStatus::Unreachable(why) if why.contains("closed"))
                    && matches!(
                        snap.instances
                            .iter()
                            .find(|m| m.node == "cp-insp-p")
                            .map(|m| &m.status),
                        Some(MemberStatus::Snapshot(_))
                    )
            }
        },
    )
    .await;
    let (_, raw) = inspect_raw(px.control, "inspector-json-2").await;
    let v: Value = serde_json::from_slice(&raw).unwrap();
    let gone = v["instances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["node"] == "cp-insp-d")
        .unwrap();
    assert!(gone["unreachable"].is_string(), "{gone}");
    assert!(gone.get("snapshot").is_none(), "{gone}");
    px.stop().await;
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_instance_leaves_routing_at_once_and_inspect_shows_it_draining() {
    let px = proxy("cp-drain-proxy").await;
    let d = instance(
        "cp-drain-d",
        Role::Decode,
        px.control,
        member("cp-drain-d"),
        1,
    )
    .await;
    let url = d.url();
    wait_for("the instance routable", Duration::from_secs(10), || async {
        inspect_cluster(&px).await.proxy.routable_decode == 1
    })
    .await;
    // A long request runs on the instance itself while it drains.
    let long = tokio::spawn(async move {
        let r = pdserve_actors::http::http_client()
            .build()
            .unwrap()
            .post(format!("{url}/v1/completions"))
            .json(&json!({"prompt": [1, 2, 3], "max_tokens": 1000, "temperature": 0, "ignore_eos": true}))
            .timeout(Duration::from_secs(120))
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json::<Value>().await.unwrap_or_default())
    });
    wait_for(
        "the long request running",
        Duration::from_secs(10),
        || async { snapshot_of(&inspect_cluster(&px).await, "cp-drain-d").running == 1 },
    )
    .await;
    let stopping = tokio::spawn(d.stop());
    // While its request finishes: not routable, listed as draining, still inspectable.
    let deadline = Instant::now() + Duration::from_secs(10);
    let seen = loop {
        let snap = inspect_cluster(&px).await;
        let m = snap
            .instances
            .iter()
            .find(|m| m.node == "cp-drain-d")
            .unwrap()
            .clone();
        if m.draining {
            break (snap, m);
        }
        assert!(Instant::now() < deadline, "never shown draining: {m:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let (snap, m) = seen;
    assert!(!m.routable, "{m:?}");
    assert_eq!(snap.proxy.routable_decode, 0, "{:?}", snap.proxy);
    match &m.status {
        MemberStatus::Snapshot(s) => assert_eq!(s.running, 1, "observed mid-drain: {s:?}"),
        other => panic!("a draining instance stays inspectable: {other:?}"),
    }
    let p = instance(
        "cp-drain-p",
        Role::Prefill,
        px.control,
        member("cp-drain-p"),
        1,
    )
    .await;
    wait_for(
        "the prefill instance routable",
        Duration::from_secs(10),
        || async { inspect_cluster(&px).await.proxy.routable_prefill == 1 },
    )
    .await;
    let (status, v) = complete(&px.url).await;
    assert_eq!(status, 503, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("no decode instance is available")),
        "nothing to decode on while it drains: {v}"
    );
    // The request it ran completes; the instance stops clean; the proxy forgets it.
    let (status, v) = long.await.unwrap();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 1000, "{v}");
    let report = stopping.await.unwrap();
    assert!(report.clean(), "{report:?}");
    assert_eq!(report.blocks_free, report.blocks_total, "{report:?}");
    wait_for(
        "the entry to stop draining",
        Duration::from_secs(10),
        || async {
            let snap = inspect_cluster(&px).await;
            let m = snap
                .instances
                .iter()
                .find(|m| m.node == "cp-drain-d")
                .unwrap();
            !m.routable && matches!(m.status, MemberStatus::Unreachable(_))
        },
    )
    .await;
    px.stop().await;
    p.stop().await;
}

/// Prompt tokens each instance has admitted so far (which one served a request).
async fn prompt_tokens(instances: &[&Instance]) -> Vec<u64> {
    let mut v = Vec::new();
    for i in instances {
        v.push(i.stats().await.unwrap().prompt_tokens);
    }
    v
}

/// The one instance whose admitted prompt tokens grew.
fn served_by(before: &[u64], after: &[u64]) -> usize {
    let grew: Vec<usize> = (0..before.len())
        .filter(|&i| after[i] > before[i])
        .collect();
    assert_eq!(grew.len(), 1, "{before:?} -> {after:?}");
    grew[0]
}

/// Blocks the proxy's KV index holds for each of `urls`.
async fn indexed_blocks(px: &Proxy, urls: &[String]) -> Vec<usize> {
    let snap = inspect_cluster(px).await;
    let router = snap.proxy.router.expect("the proxy reports its router");
    urls.iter()
        .map(|u| {
            router
                .kv_index
                .iter()
                .find(|ix| &ix.url == u)
                .map_or(0, |ix| ix.blocks)
        })
        .collect()
}

/// A session's long prefix: 5 blocks of 16 tokens, different for each session.
fn session(i: u32, len: u32) -> Vec<u32> {
    (0..len).map(|t| (i * 61 + t * 7) % 300 + 1).collect()
}

/// The KV router (the proxy's default) learns every instance's prefix cache from its KV
/// events: a session's later turns go to the decode instance that holds its prefix; a hot
/// prefix spreads once the holder is busier than its credit; a restarted proxy rebuilds the
/// index from the instances' snapshots and routes by prefix again; inspect shows the router.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kv_router_follows_cached_prefixes_spreads_a_hot_one_and_rebuilds_after_a_restart() {
    let px = proxy("kvr-proxy").await;
    let joined = |name: &'static str, role| instance(name, role, px.control, member(name), 1);
    let p = joined("kvr-prefill", Role::Prefill).await;
    let d0 = joined("kvr-decode-0", Role::Decode).await;
    let d1 = joined("kvr-decode-1", Role::Decode).await;
    wait_for("all three routable", Duration::from_secs(10), || async {
        let s = inspect_cluster(&px).await.proxy;
        (s.routable_prefill, s.routable_decode) == (1, 2)
    })
    .await;
    let decodes = [&d0, &d1];
    let urls = [d0.url(), d1.url()];
    // First turns: nothing cached anywhere, the sessions spread over both decodes.
    let mut home = Vec::new();
    for i in 0..4 {
        let before = prompt_tokens(&decodes).await;
        let (status, v) = complete_tokens(&px.url, &session(i, 80), 2).await;
        assert_eq!(status, 200, "{v}");
        home.push(served_by(&before, &prompt_tokens(&decodes).await));
    }
    assert!(home.contains(&0) && home.contains(&1), "{home:?}");
    // The decodes' KV events reach the index: 5 blocks per session.
    wait_for(
        "the index holds every session",
        Duration::from_secs(10),
        || async { indexed_blocks(&px, &urls).await.iter().sum::<usize>() >= 20 },
    )
    .await;
    // Second turns (the prefix plus a new block) go home, asked in another order than the
    // first turns (so that taking turns could not pass for following the prefix).
    for i in [1, 0, 3, 2u32] {
        let mut prompt = session(i, 80);
        prompt.extend(session(100 + i, 20));
        let before = prompt_tokens(&decodes).await;
        let (status, v) = complete_tokens(&px.url, &prompt, 2).await;
        assert_eq!(status, 200, "{v}");
        let got = served_by(&before, &prompt_tokens(&decodes).await);
        assert_eq!(
            got, home[i as usize],
            "session {i} left the instance holding its prefix"
        );
    }
    // A hot prefix: six at once. Each adds 8 blocks of load to its decode; the holder's
    // credit is 5 blocks, so the second one already goes to the other instance.
    let before = prompt_tokens(&decodes).await;
    let hot = (0..6u32).map(|k| {
        let mut prompt = session(0, 80);
        prompt.extend(session(200 + k, 16));
        let url = px.url.clone();
        tokio::spawn(async move { complete_tokens(&url, &prompt, 24).await })
    });
    for r in futures_util::future::join_all(hot).await {
        let (status, v) = r.unwrap();
        assert_eq!(status, 200, "{v}");
    }
    let after = prompt_tokens(&decodes).await;
    assert!(
        after[0] > before[0] && after[1] > before[1],
        "the hot prefix stayed on one instance: {before:?} -> {after:?}"
    );
    let snap = inspect_cluster(&px).await;
    let router = snap.proxy.router.clone().unwrap();
    assert_eq!(router.kind, "kv");
    let count = |role: &str, reason: &str| {
        router
            .decisions
            .iter()
            .find(|d| d.role == role && d.reason == reason)
            .map_or(0, |d| d.count)
    };
    assert!(count("decode", "kv_overlap") >= 5, "{router:?}");
    assert!(count("decode", "load") >= 1, "{router:?}");
    let text = pdserve_runtime::supervision::render_cluster(&snap, false);
    assert!(text.contains("router kv decisions"), "{text}");
    // A restarted proxy knows nothing until the instances register again with snapshots.
    let px = restart(px, "kvr-proxy-2").await;
    wait_for(
        "all three back and the index rebuilt",
        Duration::from_secs(15),
        || async {
            let s = inspect_cluster(&px).await.proxy;
            (s.routable_prefill, s.routable_decode) == (1, 2)
                && indexed_blocks(&px, &urls).await.iter().sum::<usize>() >= 20
        },
    )
    .await;
    for i in 1..4u32 {
        let mut prompt = session(i, 80);
        prompt.extend(session(300 + i, 20));
        let before = prompt_tokens(&decodes).await;
        let (status, v) = complete_tokens(&px.url, &prompt, 2).await;
        assert_eq!(status, 200, "{v}");
        let got = served_by(&before, &prompt_tokens(&decodes).await);
        assert_eq!(
            got, home[i as usize],
            "after the restart, session {i} went elsewhere"
        );
    }
    // Nothing is left held anywhere.
    for inst in [&p, &d0, &d1] {
        wait_for("every block released", Duration::from_secs(10), || async {
            inst.stats().await.unwrap().blocks_in_use == 0
        })
        .await;
    }
    px.stop().await;
    for inst in [p, d0, d1] {
        inst.stop().await;
    }
}

/// What the proxy's KV index holds of `url` at `medium`.
async fn indexed_at(px: &Proxy, url: &str, medium: &str) -> usize {
    let snap = inspect_cluster(px).await;
    let router = snap.proxy.router.expect("the proxy reports its router");
    router
        .kv_index
        .iter()
        .find(|ix| ix.url == url)
        .and_then(|ix| ix.by_medium.iter().find(|(m, _)| m == medium))
        .map_or(0, |(_, n)| *n)
}

/// A decode instance whose pool evicted a session's prefix into its host tier still holds
/// it: its KV events say so (medium `host`), the KV router credits that overlap (at
/// `proxy.kv_tier_credit.host`) and sends the session's next turn there rather than to an
/// instance that never saw the prefix, and the instance restores the prefix from the tier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kv_router_prefers_an_instance_holding_the_prefix_in_its_host_tier() {
    let px = proxy("kvt-proxy").await;
    let joined = |name: &'static str, role| {
        let control = px.control;
        async move {
            let model = load_model(&ModelSource::Synthetic("tiny".into())).unwrap();
            let mut o = InstanceOptions::local(name, model);
            o.transfer = Some(TransferConfig::new(BackendKind::Local, name));
            if role == Role::Decode {
                // Room for one request (7 blocks of 16 tokens) and little else.
                o.num_blocks = Some(12);
                o.watermark = 0.0;
                o.kv_tiers = Some(pdserve_actors::kv_tiers::TierSettings::host_only(64 << 20));
            }
            let mut c = InstanceControl::new(member(name), role);
            c.proxy = Some(control);
            c.heartbeat = HEARTBEAT;
            o.control = Some(c);
            Instance::start(o).await.unwrap()
        }
    };
    let p = joined("kvt-prefill", Role::Prefill).await;
    let d0 = joined("kvt-decode-0", Role::Decode).await;
    let d1 = joined("kvt-decode-1", Role::Decode).await;
    wait_for("all three routable", Duration::from_secs(10), || async {
        let s = inspect_cluster(&px).await.proxy;
        (s.routable_prefill, s.routable_decode) == (1, 2)
    })
    .await;
    // d0 serves the session's first turn itself, then four others that evict it from its
    // pool into its host tier; d1 sees none of it.
    let first = session(7, 80);
    let (status, v) = complete_tokens(&d0.url(), &first, 2).await;
    assert_eq!(status, 200, "{v}");
    for k in 0..4 {
        let (status, v) = complete_tokens(&d0.url(), &session(50 + k, 80), 2).await;
        assert_eq!(status, 200, "{v}");
    }
    let tiers = d0.kv_tiers().expect("d0 has tiers").clone();
    let hashes = tiers.block_hashes(&first);
    assert_eq!(hashes.len(), 5);
    wait_for(
        "the prefix in d0's host tier",
        Duration::from_secs(10),
        || async { tiers.contains_run(&hashes) == 5 },
    )
    .await;
    wait_for(
        "the proxy indexes d0's host tier",
        Duration::from_secs(10),
        || async { indexed_at(&px, &d0.url(), "host").await >= 5 },
    )
    .await;
    assert_eq!(indexed_at(&px, &d1.url(), "host").await, 0);
    let decisions = |snap: &ClusterSnapshot| {
        snap.proxy
            .router
            .as_ref()
            .unwrap()
            .decisions
            .iter()
            .find(|d| d.role == "decode" && d.reason == "kv_overlap")
            .map_or(0, |d| d.count)
    };
    let overlap_before = decisions(&inspect_cluster(&px).await);
    let hits_before = tiers.figures().host.unwrap().hits;
    // The second turn through the proxy (prefill on p, decode on the pick).
    let mut second = first.clone();
    second.extend(session(99, 16));
    let decodes = [&d0, &d1];
    let before = prompt_tokens(&decodes).await;
    let (status, v) = complete_tokens(&px.url, &second, 2).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        served_by(&before, &prompt_tokens(&decodes).await),
        0,
        "the turn left the instance holding its prefix in a tier"
    );
    assert_eq!(
        decisions(&inspect_cluster(&px).await),
        overlap_before + 1,
        "picked for its overlap"
    );
    assert!(
        tiers.figures().host.unwrap().hits >= hits_before + 5,
        "the prefix came back from the host tier: {:?}",
        tiers.figures()
    );
    px.stop().await;
    for i in [p, d0, d1] {
        i.stop().await;
    }
}

/// An instance's control plane answers at most `max_requests` peer requests at once; past
/// that a request is answered `overloaded` at once (no task started for it), the permit of an
/// answered request comes back, and the instance keeps serving its API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_requests_past_the_bound_are_answered_overloaded() {
    let start = |name: &'static str, max_requests: usize| async move {
        let model = load_model(&ModelSource::Synthetic("tiny".into())).unwrap();
        let mut o = InstanceOptions::local(name, model);
        let mut control = InstanceControl::new(member(name), Role::Colocated);
        control.max_requests = max_requests;
        o.control = Some(control);
        Instance::start(o).await.unwrap()
    };
    // One at a time: answered again and again (each answer gives its permit back).
    let one = start("cp-bound-one", 1).await;
    let addr = one.control_plane().unwrap().local_addr();
    for _ in 0..3 {
        let (role, json) = inspect_raw(addr, "inspector-bound").await;
        assert_eq!(role, Role::Colocated);
        assert!(!json.is_empty());
    }
    one.stop().await;

    // None at all: every request is refused by name, and the API still serves.
    let none = start("cp-bound-none", 0).await;
    let endpoint = ControlEndpoint::bind(
        &member("inspector-bound-0"),
        ControlConfig {
            role: Role::Other,
            ..ControlConfig::default()
        },
    )
    .unwrap();
    let conn = endpoint
        .connect(none.control_plane().unwrap().local_addr())
        .await
        .unwrap();
    for _ in 0..3 {
        match conn.request(ControlMessage::InspectRequest).await {
            Err(pdserve_transport::TransportError::Remote { kind, message }) => {
                assert_eq!(kind, "overloaded", "{message}");
                assert!(message.contains("cp-bound-none"), "{message}");
            }
            other => panic!("answered past the bound: {other:?}"),
        }
    }
    let (status, v) = complete(&none.url()).await;
    assert_eq!(status, 200, "{v}");
    none.stop().await;
}

/// The proxy's control plane is bounded as an instance's: at most `max_requests` answers at
/// once over every member connection (an inspect fans out to every instance, so a member
/// asking in a loop would otherwise grow the proxy's tasks without bound); past that a
/// request is refused `overloaded` naming the proxy, the permit of an answered request comes
/// back, and the proxy keeps serving HTTP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_control_requests_past_the_bound_are_answered_overloaded() {
    let any = "127.0.0.1:0".parse().unwrap();
    // One at a time: answered again and again.
    let one = proxy_bounded("px-bound-one", any, 1).await.unwrap();
    for _ in 0..3 {
        let snap = inspect_cluster(&one).await;
        assert_eq!(snap.proxy.node, "px-bound-one");
    }
    one.stop().await;

    // None at all: inspect refused by name; the HTTP side still answers.
    let none = proxy_bounded("px-bound-none", any, 0).await.unwrap();
    let endpoint = ControlEndpoint::bind(
        &member("inspector-px-bound"),
        ControlConfig {
            role: Role::Other,
            ..ControlConfig::default()
        },
    )
    .unwrap();
    let conn = endpoint.connect(none.control).await.unwrap();
    for _ in 0..3 {
        match conn.request(ControlMessage::InspectRequest).await {
            Err(pdserve_transport::TransportError::Remote { kind, message }) => {
                assert_eq!(kind, "overloaded", "{message}");
                assert!(message.contains("px-bound-none"), "{message}");
            }
            other => panic!("answered past the bound: {other:?}"),
        }
    }
    // No instance registered: degraded, but live and answering.
    let health = pdserve_actors::http::http_client()
        .build()
        .unwrap()
        .get(format!("{}/health", none.url))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status().as_u16(), 503);
    let v: Value = health.json().await.unwrap();
    assert_eq!(v["live"], true, "{v}");
    none.stop().await;
}
