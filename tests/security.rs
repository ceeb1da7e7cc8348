//! Security checks against real processes: a 1P1D deployment from one file on 127.0.0.1
//! (ports chosen at run time) with cluster credentials, started as `pdserve serve --config
//! FILE --node NAME`, the proxy with an API key (`PDSERVE_PROXY_API_KEY`).
//!
//! - The proxy's API key guards `/v1/*`; `/health` and `/metrics` stay open.
//! - The control plane refuses what lacks this cluster's credentials, without effect: a member
//!   of another cluster (same name, another CA) cannot register — not even under the name of
//!   a real node — and `pdserve inspect` with its credentials fails with a clear message. A
//!   member of this cluster cannot pose as another node: its certificate is bound to its name.
//! - Forged `kv_transfer_params` (block ids outside the pool, too many or too few, a
//!   `transfer_id` never issued, malformed fields) and forged push targets are refused with a
//!   message naming the problem; blocks the prefill instance holds for a real hand-off are
//!   untouched, and every pool returns to full.
//! - Garbage UDP datagrams, and malformed, truncated, misplaced and oversized control frames
//!   from an authenticated member (plus registrations it may not make) are refused; the
//!   proxy keeps serving and keeps its registrations.

mod common;

use common::{free_port, inspect, Procs};
use pdserve_actors::control_plane::{Registration, RegistrationField};
use pdserve_actors::handoff::peer::{PeerAddr, Peers};
use pdserve_actors::handoff::protocol::{
    KvPeerInfo, PeerAnswer, PeerRequest, PrefillMode, PrefillRequest,
};
use pdserve_runtime::wire::bounds::MAX_NAME_BYTES;
use pdserve_runtime::wire::{
    encode_frame, ArchivedEnvelope, ControlMessage, Envelope, EnvelopeKind, Heartbeat, LoadFigures,
    DEFAULT_MAX_FRAME_BYTES,
};
use pdserve_runtime::Role;
use pdserve_transport::control::tls::{ClusterCredentials, MemberCredentials};
use pdserve_transport::control::{ControlConfig, ControlEndpoint};
use pdserve_transport::TransportError;
use serde_json::{json, Value};
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::process::Command;
use std::time::{Duration, Instant};

const MODEL: &str = "synthetic:tiny";
const API_KEY: &str = "sk-test-7f3a";
/// Tokens of the prompt every check uses (7 blocks of 16).
const PROMPT_TOKENS: usize = 100;
const MAX_TOKENS: usize = 8;

fn prompt() -> Vec<u32> {
    (0..PROMPT_TOKENS)
        .map(|t| ((t * 37 + 11) % 250) as u32)
        .collect()
}

/// Tests run one at a time: each starts a cluster on a machine that may have two cores.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Proxy, prefill and decode as `pdserve serve --config FILE --node NAME` processes, stopped
/// on drop (their logs, stdout and stderr, are printed after a panic).
struct Cluster {
    dir: tempfile::TempDir,
    name: String,
    creds: PathBuf,
    proxy: String,
    prefill: String,
    decode: String,
    control: String,
    procs: Procs,
    http: reqwest::Client,
    /// Whether the instances have the key too (`--api-key` on every node).
    instance_key: bool,
}

impl Cluster {
    /// Starts the cluster; the proxy gets its API key from `PDSERVE_PROXY_API_KEY`, or with
    /// `key_flag` every node gets it from `--api-key` on its `serve --config FILE --node N`
    /// command line (one key for the cluster).
    fn start(key_flag: bool) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let creds = dir.path().join("credentials");
        let name = format!("sec-{}", std::process::id());
        let out = Command::new(env!("CARGO_BIN_EXE_pdserve"))
            .args(["cluster", "init"])
            .arg(&creds)
            .args(["--name", &name])
            .args([
                "--node",
                "proxy",
                "--node",
                "prefill-0",
                "--node",
                "decode-0",
            ])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let (proxy, prefill, decode, control) =
            (free_port(), free_port(), free_port(), free_port());
        let file = dir.path().join("cluster.toml");
        common::write_deployment(
            &file,
            &name,
            MODEL,
            Some((&creds, control)),
            proxy,
            &[
                ("prefill-0", "prefill", prefill),
                ("decode-0", "decode", decode),
            ],
        );
        let mut procs = Procs::new();
        for node in ["prefill-0", "decode-0", "proxy"] {
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_pdserve"));
            cmd.args(["serve", "--config"])
                .arg(&file)
                .args(["--node", node]);
            match (node, key_flag) {
                (_, true) => cmd.args(["--api-key", API_KEY]),
                ("proxy", false) => cmd.env("PDSERVE_PROXY_API_KEY", API_KEY),
                _ => &mut cmd,
            };
            cmd.env("PDSERVE_LOGGING__FILTER", "warn")
                .env("PDSERVE_LOG", "warn");
            procs.spawn(node, &mut cmd);
        }
        Cluster {
            dir,
            name,
            creds,
            proxy: format!("http://127.0.0.1:{proxy}"),
            prefill: format!("http://127.0.0.1:{prefill}"),
            decode: format!("http://127.0.0.1:{decode}"),
            control: format!("127.0.0.1:{control}"),
            procs,
            http: pdserve_actors::http::http_client().build().unwrap(),
            instance_key: key_flag,
        }
    }

    fn assert_running(&mut self) {
        self.procs.assert_running();
    }

    /// The proxy's view over the control plane (`pdserve inspect --json`, right credentials).
    fn snapshot(&self) -> Value {
        let (ok, out, err) = inspect(&[
            &self.control,
            "--credentials-dir",
            self.creds.to_str().unwrap(),
            "--json",
        ]);
        assert!(ok, "inspect with the cluster's credentials failed: {err}");
        serde_json::from_str(&out).unwrap()
    }

    /// Asserts the two real instances are registered under their own URLs and routable.
    fn assert_registrations(&self) -> Value {
        let snap = self.snapshot();
        let p = &snap["proxy"];
        assert_eq!(
            (
                &p["registered"],
                &p["routable_prefill"],
                &p["routable_decode"]
            ),
            (&json!(2), &json!(1), &json!(1)),
            "{snap}"
        );
        for (node, url) in [("prefill-0", &self.prefill), ("decode-0", &self.decode)] {
            let m = snap["instances"]
                .as_array()
                .unwrap()
                .iter()
                .find(|m| m["node"] == node)
                .unwrap_or_else(|| panic!("{node} not registered: {snap}"));
            assert_eq!(m["url"], json!(url), "{node}: {m}");
            assert_eq!(m["routable"], true, "{node}: {m}");
        }
        snap
    }

    async fn ready(&mut self) {
        // Liveness bound: the cluster is ready in about a second; 60 s only catches one that
        // never forms (a node that exits fails at once, with its log).
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            self.assert_running();
            let health = self
                .http
                .get(format!("{}/health", self.proxy))
                .timeout(Duration::from_secs(5))
                .send()
                .await;
            if let Ok(r) = health {
                let v: Value = r.json().await.unwrap_or_default();
                if v["prefill"] == 1 && v["decode"] == 1 {
                    let p = &self.snapshot()["proxy"];
                    if p["registered"] == 2 && p["routable_decode"] == 1 {
                        return;
                    }
                }
            }
            assert!(Instant::now() < deadline, "the cluster never became ready");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// GET `url` (with `Authorization: Bearer key` when given); the status.
    async fn get(&self, url: &str, key: Option<&str>) -> u16 {
        let mut req = self.http.get(url).timeout(Duration::from_secs(60));
        if let Some(k) = key {
            req = req.bearer_auth(k);
        }
        req.send().await.unwrap().status().as_u16()
    }

    /// POST `body` to `url` (with `Authorization: Bearer key` when given).
    async fn post(&self, url: &str, body: &Value, key: Option<&str>) -> (u16, Value) {
        let mut req = self
            .http
            .post(url)
            .timeout(Duration::from_secs(60))
            .json(body);
        if let Some(k) = key {
            req = req.bearer_auth(k);
        }
        let r = req.send().await.unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    /// A completion through the proxy, with the key.
    async fn through_proxy(&self, extra: Value) -> (u16, Value) {
        let mut body = completion();
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        self.post(
            &format!("{}/v1/completions", self.proxy),
            &body,
            Some(API_KEY),
        )
        .await
    }

    async fn load(&self, url: &str) -> Value {
        self.http
            .get(format!("{url}/v1/load"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    async fn pool_full(&self, url: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let l = self.load(url).await;
            if l["blocks_free"] == l["blocks_total"] && l["running"] == 0 && l["waiting"] == 0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{url}: pool not back to full: {l}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A greedy completion of [`prompt`] that returns its token ids.
fn completion() -> Value {
    json!({"prompt": prompt(), "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": true, "return_token_ids": true})
}

fn tokens(v: &Value) -> Vec<u64> {
    v["choices"][0]["token_ids"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default()
}

fn message(v: &Value) -> &str {
    v["error"]["message"].as_str().unwrap_or("")
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// The checks a test runs against its cluster.
type Check = Box<dyn for<'a> FnOnce(&'a mut Cluster) -> Pin<Box<dyn Future<Output = ()> + 'a>>>;

/// Runs `check` against a fresh, ready cluster.
fn with_cluster<F>(check: F)
where
    F: for<'a> FnOnce(&'a mut Cluster) -> Pin<Box<dyn Future<Output = ()> + 'a>> + 'static,
{
    run_cluster(false, Box::new(check));
}

fn run_cluster(key_flag: bool, check: Check) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let started = Instant::now();
    let mut cluster = Cluster::start(key_flag);
    runtime().block_on(async {
        cluster.ready().await;
        check(&mut cluster).await;
        cluster.assert_running();
    });
    println!("took {:.1} s", started.elapsed().as_secs_f64());
}

/// The proxy's API key: `/v1/*` needs `Authorization: Bearer KEY`; `/health` and
/// `/metrics` stay open.
async fn check_api_key(c: &mut Cluster) {
    let url = format!("{}/v1/completions", c.proxy);
    for (key, what) in [
        (None, "no key"),
        (Some("sk-wrong"), "a wrong key"),
        (Some(""), "an empty key"),
    ] {
        let (status, v) = c.post(&url, &completion(), key).await;
        assert_eq!(status, 401, "{what}: {v}");
        assert_eq!(v["error"]["type"], "authentication_error", "{what}: {v}");
        assert!(message(&v).contains("API key"), "{what}: {v}");
    }
    // Not a bearer token: the key alone, or another scheme.
    for header in [API_KEY.to_string(), format!("Basic {API_KEY}")] {
        let r = c
            .http
            .post(&url)
            .header("authorization", header.as_str())
            .json(&completion())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401, "Authorization: {header}");
    }
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let (status, _) = c
        .post(&format!("{}/v1/chat/completions", c.proxy), &chat, None)
        .await;
    assert_eq!(status, 401, "chat without a key");
    let status = c.get(&format!("{}/v1/models", c.proxy), None).await;
    assert_eq!(status, 401, "models without a key");
    // The right key.
    let (status, v) = c.post(&url, &completion(), Some(API_KEY)).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(tokens(&v).len(), MAX_TOKENS, "{v}");
    let (status, v) = c
        .post(
            &format!("{}/v1/chat/completions", c.proxy),
            &chat,
            Some(API_KEY),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    // Health and metrics stay open.
    for path in ["/health", "/metrics"] {
        let status = c.get(&format!("{}{path}", c.proxy), None).await;
        assert_eq!(status, 200, "{path}");
    }
    let metrics = c
        .http
        .get(format!("{}/metrics", c.proxy))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("outcome=\"unauthorized\""),
        "refusals are counted"
    );
    if !c.instance_key {
        return;
    }
    // The instances hold the same key: the disaggregated answers above went through (the
    // proxy and the decode instance sent it), and every `/v1/*` route of an instance,
    // the KV calls included, refuses a caller without it.
    for base in [&c.prefill, &c.decode] {
        let info = format!("{base}/v1/kv/info");
        assert_eq!(c.get(&info, None).await, 401, "{info} without a key");
        assert_eq!(
            c.get(&info, Some(API_KEY)).await,
            200,
            "{info} with the key"
        );
        let body = json!({"transfer_id": "00000000000000000000000000000001"});
        for path in ["/v1/kv/peer", "/v1/load", "/v1/completions"] {
            let (status, v) = c.post(&format!("{base}{path}"), &body, None).await;
            assert_eq!(status, 401, "{base}{path} without a key: {v}");
            assert_eq!(v["error"]["type"], "authentication_error", "{v}");
        }
        let status = c.get(&format!("{base}/health"), None).await;
        assert_eq!(status, 200, "{base}/health stays open");
    }
}

#[test]
fn the_proxy_api_key_guards_v1_and_leaves_health_and_metrics_open() {
    with_cluster(|c| Box::pin(check_api_key(c)));
}

/// `pdserve serve --config FILE --node N --api-key KEY` on every node: the proxy enforces the
/// key (the flag, not only `PDSERVE_PROXY_API_KEY`), the instances too, and disaggregated
/// requests still work because the proxy and decode send it on.
#[test]
fn one_api_key_on_every_deployment_node_guards_them_all_and_pd_still_works() {
    run_cluster(true, Box::new(|c| Box::pin(check_api_key(c))));
}

#[test]
fn a_member_of_another_cluster_can_neither_register_nor_inspect() {
    with_cluster(|c| {
        Box::pin(async move {
            let before = c.assert_registrations();
            let refused_before = before["proxy"]["refused_connections"].as_u64().unwrap();
            // Another cluster with the same name and its own CA, with a member named like a
            // real node: an impersonation attempt.
            let other = c.dir.path().join("other-cluster");
            let out = Command::new(env!("CARGO_BIN_EXE_pdserve"))
                .args(["cluster", "init"])
                .arg(&other)
                .args(["--name", &c.name, "--node", "decode-0"])
                .output()
                .unwrap();
            assert!(out.status.success(), "{out:?}");

            // `pdserve inspect` with those credentials: a non-zero exit with a clear reason.
            let (ok, out, err) = inspect(&[
                &c.control,
                "--credentials-dir",
                other.to_str().unwrap(),
                "--node",
                "decode-0",
                "--json",
            ]);
            println!("inspect with foreign credentials: {}", err.trim());
            assert!(!ok, "inspect with foreign credentials succeeded: {out}");
            assert!(out.trim().is_empty(), "no snapshot may leak: {out}");
            assert!(
                err.contains(&c.control)
                    && (err.contains("refused our credentials")
                        || err.contains("closed the connection during the handshake")),
                "unclear refusal: {err}"
            );

            // A decode instance of the other cluster, named `decode-0`, told to register with
            // our proxy.
            let port = free_port();
            let mut intruder = Command::new(env!("CARGO_BIN_EXE_pdserve"));
            intruder
                .args([
                    "serve", "--role", "decode", "--name", "decode-0", "--model", MODEL,
                ])
                .args([
                    "--port",
                    &port.to_string(),
                    "--transfer",
                    "tcp",
                    "--threads",
                    "1",
                ])
                .arg("--credentials-dir")
                .arg(&other)
                .args(["--control-proxy", &c.control])
                .env("PDSERVE_LOGGING__FILTER", "warn");
            // Its log is printed with the cluster's when the test fails.
            c.procs.spawn("intruder", &mut intruder);
            let intruder_url = format!("http://127.0.0.1:{port}");
            // Wait until it serves and the proxy has refused it (the inspect attempt above
            // was one refusal; the intruder adds its own).
            // Liveness bound: it starts and is refused within seconds; 30 s only catches an
            // intruder never refused (or never up).
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                c.assert_running();
                let up = c
                    .http
                    .get(format!("{intruder_url}/health"))
                    .send()
                    .await
                    .is_ok_and(|r| r.status() == 200);
                let refused = c.snapshot()["proxy"]["refused_connections"]
                    .as_u64()
                    .unwrap();
                if up && refused >= refused_before + 2 {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "the intruder was never refused (refused_connections {refused}, up {up}): {}",
                    c.procs.log("intruder")
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            // The direct transport API, too: a connection with a certificate of another CA
            // fails, typed.
            let stranger = ClusterCredentials::ephemeral(&c.name)
                .unwrap()
                .issue("prefill-0")
                .unwrap();
            let ep = ControlEndpoint::bind(&stranger, ControlConfig::default()).unwrap();
            let err = ep.connect(c.control.parse().unwrap()).await.unwrap_err();
            assert!(
                matches!(
                    err,
                    TransportError::Unauthenticated(_) | TransportError::PeerGone { .. }
                ),
                "{err:?}"
            );
            // Without effect: the same registrations, under the real URLs; requests go to
            // the real instances only.
            let snap = c.assert_registrations();
            assert!(
                !snap.to_string().contains(&format!(":{port}")),
                "the intruder shows up: {snap}"
            );
            for _ in 0..3 {
                let (status, v) = c.through_proxy(json!({})).await;
                assert_eq!(status, 200, "{v}");
            }
            let served = c
                .http
                .get(format!("{intruder_url}/metrics"))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            assert!(
                !served.contains("outcome=\"finished\""),
                "the intruder served requests"
            );
            c.procs.kill("intruder");
        })
    });
}

#[test]
fn forged_kv_transfer_params_are_refused_and_held_blocks_stay_untouched() {
    with_cluster(|c| {
        Box::pin(async move {
            let (status, v) = c.through_proxy(json!({})).await;
            assert_eq!(status, 200, "{v}");
            let reference = tokens(&v);
            assert_eq!(reference.len(), MAX_TOKENS);
            c.pool_full(&c.prefill).await;

            // A real hand-off, vLLM's two hops: prefill holds the prompt's blocks for decode.
            let mut first = completion();
            first["max_tokens"] = json!(1);
            first["kv_transfer_params"] = json!({"do_remote_decode": true});
            let (status, v) = c
                .post(&format!("{}/v1/completions", c.prefill), &first, None)
                .await;
            assert_eq!(status, 200, "{v}");
            let held = v["kv_transfer_params"].clone();
            let ids: Vec<u64> = held["remote_block_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap())
                .collect();
            assert_eq!(ids.len(), PROMPT_TOKENS.div_ceil(16), "{held}");
            let load = c.load(&c.prefill).await;
            let total = load["blocks_total"].as_u64().unwrap();
            let free_while_held = load["blocks_free"].as_u64().unwrap();
            assert_eq!(free_while_held, total - ids.len() as u64, "{load}");

            // Forgeries sent straight to the decode instance.
            let never_issued = "0123456789abcdef0123456789abcdef";
            let mut extra = ids.clone();
            extra.extend([ids[0] + 100, ids[0] + 101, ids[0] + 102]);
            let forged: Vec<(&str, Value, u16, Vec<&str>)> = vec![
                (
                    "a block outside the pool",
                    json!({"remote_block_ids": ids.iter().map(|&b| if b == ids[0] { total + 5 } else { b }).collect::<Vec<_>>()}),
                    502,
                    vec!["invalid block ids", "outside the peer's pool"],
                ),
                (
                    "too many block ids",
                    json!({"remote_block_ids": extra}),
                    502,
                    vec!["invalid block ids", "need 7 blocks"],
                ),
                (
                    "too few block ids",
                    json!({"remote_block_ids": &ids[..3]}),
                    502,
                    vec!["invalid block ids", "need 7 blocks"],
                ),
                (
                    "a transfer_id never issued",
                    json!({"transfer_id": never_issued}),
                    502,
                    vec![never_issued, "lease"],
                ),
                (
                    "block ids that are not ids",
                    json!({"remote_block_ids": ["all"]}),
                    400,
                    vec!["remote_block_ids"],
                ),
                (
                    "a malformed transfer_id",
                    json!({"transfer_id": "../../etc"}),
                    400,
                    vec!["transfer_id"],
                ),
                (
                    "no port",
                    json!({"remote_port": 0}),
                    400,
                    vec!["remote_port"],
                ),
            ];
            for (what, change, want_status, needles) in forged {
                let mut params = held.clone();
                for (k, v) in change.as_object().unwrap() {
                    params[k] = v.clone();
                }
                let mut body = completion();
                body["kv_transfer_params"] = params;
                let (status, v) = c
                    .post(&format!("{}/v1/completions", c.decode), &body, None)
                    .await;
                let msg = message(&v);
                println!("{what}: {status} {msg}");
                assert_eq!(status, want_status, "{what}: {v}");
                for n in needles {
                    assert!(msg.contains(n), "{what}: `{n}` missing from {msg:?}");
                }
                // The held blocks are untouched; decode gave back what it allocated.
                assert_eq!(
                    c.load(&c.prefill).await["blocks_free"].as_u64().unwrap(),
                    free_while_held,
                    "{what}: the prefill instance's held blocks changed"
                );
                c.pool_full(&c.decode).await;
            }

            // The prefill instance has credentials: a stranger's peer call over HTTP is
            // refused outright.
            let stranger = Peers::new(
                "stranger".into(),
                None,
                None,
                None,
                Duration::from_secs(30),
                pdserve_actors::http::http_client(),
            );
            let e = stranger
                .call(
                    &PeerAddr::Http {
                        url: c.prefill.clone(),
                    },
                    &PeerRequest::Info,
                    Duration::from_secs(30),
                )
                .await
                .unwrap_err();
            println!("a peer call over HTTP: {e}");
            assert!(e.to_string().contains("HTTP 403"), "{e}");

            // Forged push targets sent straight to the prefill instance by a member (which
            // finds its control address from its URL).
            let peer: KvPeerInfo = c
                .http
                .get(format!("{}/v1/kv/info", c.decode))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            let pool = peer.ranks[0].layout.num_blocks as u32;
            let forger = ClusterCredentials::load(&c.creds)
                .unwrap()
                .issue("forger")
                .unwrap();
            let endpoint = ControlEndpoint::bind(&forger, ControlConfig::default()).unwrap();
            let client = Peers::new(
                "forger".into(),
                Some(std::sync::Arc::new(endpoint)),
                None,
                None,
                Duration::from_secs(30),
                pdserve_actors::http::http_client(),
            );
            for (what, blocks, needle) in [
                (
                    "a destination outside the pool",
                    (0..7)
                        .map(|b| if b == 3 { pool + 1 } else { b })
                        .collect::<Vec<_>>(),
                    "outside the peer's pool",
                ),
                (
                    "too many destinations",
                    (0..9).collect(),
                    "need 7 destination blocks",
                ),
            ] {
                let request = PeerRequest::Prefill(PrefillRequest {
                    transfer: "fedcba9876543210fedcba9876543210".parse().unwrap(),
                    prompt: prompt(),
                    sampling: pdserve_gpu::sampling::SamplingParams::default(),
                    mode: PrefillMode::Push {
                        peer: peer.clone(),
                        block_ids: blocks,
                        session: None,
                    },
                    cached_blocks: 0,
                });
                let answer = client
                    .call(
                        &PeerAddr::Http {
                            url: c.prefill.clone(),
                        },
                        &request,
                        Duration::from_secs(30),
                    )
                    .await
                    .expect("the prefill instance answers");
                let PeerAnswer::Failed(e) = answer else {
                    panic!("push target with {what}: answered {answer:?}");
                };
                println!("push target with {what}: {e}");
                assert_eq!(e.kind(), "invalid_blocks", "{what}: {e}");
                assert!(
                    e.to_string().contains("invalid block ids") && e.to_string().contains(needle),
                    "{what}: {e}"
                );
                assert_eq!(
                    c.load(&c.prefill).await["blocks_free"].as_u64().unwrap(),
                    free_while_held,
                    "{what}"
                );
            }

            // Through the proxy, client-supplied kv_transfer_params are replaced by the
            // proxy's own: the forgery has no effect and the request is served.
            let (status, v) = c
                .through_proxy(json!({"kv_transfer_params": {
                    "do_remote_prefill": true, "remote_host": "127.0.0.1", "remote_port": 1,
                    "remote_block_ids": [total + 9], "transfer_id": never_issued,
                    "first_token_id": 0}}))
                .await;
            assert_eq!((status, tokens(&v)), (200, reference.clone()), "{v}");

            // The real hand-off still completes, with the reference tokens; then every pool
            // is full.
            let mut body = completion();
            body["kv_transfer_params"] = held;
            let (status, v) = c
                .post(&format!("{}/v1/completions", c.decode), &body, None)
                .await;
            assert_eq!((status, tokens(&v)), (200, reference), "{v}");
            c.pool_full(&c.prefill).await;
            c.pool_full(&c.decode).await;
        })
    });
}

/// Sends `bytes` as one raw request stream on `conn` and returns the answer's message.
async fn raw_request(
    conn: &pdserve_transport::control::ControlConnection,
    bytes: &[u8],
) -> ControlMessage {
    let (mut send, mut recv) = conn.quic_connection().open_bi().await.unwrap();
    // A peer that refuses early may stop the stream: a failed write is fine, the answer counts.
    let _ = send.write_all(bytes).await;
    let _ = send.finish();
    // Liveness bound: answers come within milliseconds; 30 s only catches a frame left
    // unanswered (64 of these run at once on what may be a two-core machine).
    let answer = tokio::time::timeout(Duration::from_secs(30), recv.read_to_end(1 << 20))
        .await
        .expect("the proxy did not answer a bad frame")
        .unwrap();
    pdserve_runtime::wire::decode_frame(&answer, 1 << 20)
        .unwrap()
        .0
        .message
}

fn error_kind(m: &ControlMessage) -> &str {
    match m {
        ControlMessage::Error(e) => &e.kind,
        other => panic!("expected an error answer, got {other:?}"),
    }
}

#[test]
fn garbage_and_malformed_control_frames_are_refused_and_the_proxy_keeps_its_registrations() {
    with_cluster(|c| {
        Box::pin(async move {
            c.assert_registrations();
            // Garbage datagrams at the control port: not QUIC, or QUIC-looking but bogus.
            let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
            let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
            let mut noise = |n: usize| {
                (0..n)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        x as u8
                    })
                    .collect::<Vec<u8>>()
            };
            for i in 0..300 {
                let mut d = noise(1 + (i * 37) % 1400);
                if i % 3 == 0 {
                    // A long-header Initial with version 1 and garbage after it.
                    d[0] = 0xC3;
                    if d.len() > 5 {
                        d[1..5].copy_from_slice(&1u32.to_be_bytes());
                    }
                }
                udp.send_to(&d, &c.control).unwrap();
            }
            udp.send_to(&noise(60_000), &c.control).unwrap();

            // An authenticated member, issued from this cluster's CA, that misbehaves.
            let member = ClusterCredentials::load(&c.creds)
                .unwrap()
                .issue("prober")
                .unwrap();
            let ep = ControlEndpoint::bind(&member, ControlConfig::default()).unwrap();
            let conn = ep.connect(c.control.parse().unwrap()).await.unwrap();
            assert_eq!(conn.peer().node, "proxy");

            let request = |message: ControlMessage| {
                encode_frame(
                    &Envelope {
                        id: 7,
                        kind: EnvelopeKind::Request,
                        message,
                    },
                    DEFAULT_MAX_FRAME_BYTES,
                )
                .unwrap()
            };
            let ping = request(ControlMessage::Ping { nonce: 1 });
            let mut garbage = 64u32.to_le_bytes().to_vec();
            garbage.extend(noise(64));
            let mut huge = (1u32 << 30).to_le_bytes().to_vec();
            huge.extend(noise(1024));
            let just_over = (DEFAULT_MAX_FRAME_BYTES as u32 + 1).to_le_bytes().to_vec();
            let response = encode_frame(
                &Envelope {
                    id: 7,
                    kind: EnvelopeKind::Response,
                    message: ControlMessage::Ping { nonce: 2 },
                },
                DEFAULT_MAX_FRAME_BYTES,
            )
            .unwrap();
            for (what, bytes, kind) in [
                ("garbage payload", garbage.clone(), "malformed_frame"),
                (
                    "truncated frame",
                    ping[..ping.len() - 3].to_vec(),
                    "truncated_frame",
                ),
                ("truncated header", ping[..2].to_vec(), "truncated_frame"),
                ("a 1 GiB length", huge, "frame_too_large"),
                ("one byte over the limit", just_over, "frame_too_large"),
                ("a response as a request", response, "protocol"),
            ] {
                let answer = raw_request(&conn, &bytes).await;
                assert_eq!(error_kind(&answer), kind, "{what}: {answer:?}");
            }
            // Typed messages past their bounds, and a tag from a newer version: refused by
            // name before anything is built; the connection lives on (it registers below).
            let request_frame = |message: ControlMessage| {
                encode_frame(
                    &Envelope {
                        id: 9,
                        kind: EnvelopeKind::Request,
                        message,
                    },
                    DEFAULT_MAX_FRAME_BYTES,
                )
                .unwrap()
            };
            let long_node = request_frame(ControlMessage::Register(Box::new(Registration {
                node: "x".repeat(MAX_NAME_BYTES + 1),
                role: Role::Decode,
                url: "http://127.0.0.1:1".into(),
                control_addr: "127.0.0.1:1".into(),
                heartbeat_ms: 500,
                block_size: None,
                cache_salt: None,
            })));
            assert_eq!(
                error_kind(&raw_request(&conn, &long_node).await),
                "field_too_long"
            );
            let mut newer = request_frame(ControlMessage::InspectRequest);
            let tag_at = newer.len() - std::mem::size_of::<ArchivedEnvelope>()
                + std::mem::offset_of!(ArchivedEnvelope, message);
            newer[tag_at] = 0xf0;
            assert_eq!(
                error_kind(&raw_request(&conn, &newer).await),
                "unknown_message"
            );
            // A frame really larger than the proxy's limit, sent whole: refused on its header
            // (the proxy stops the stream instead of reading 16 MiB).
            let big = encode_frame(
                &Envelope {
                    id: 8,
                    kind: EnvelopeKind::Request,
                    message: ControlMessage::Opaque {
                        topic: "inspect".into(),
                        body: vec![0; DEFAULT_MAX_FRAME_BYTES + 4096],
                    },
                },
                64 << 20,
            )
            .unwrap();
            assert_eq!(
                error_kind(&raw_request(&conn, &big).await),
                "frame_too_large"
            );
            // Registrations it may not make: malformed, for another node (hijacking
            // decode-0), or with absurd settings.
            let registration = |node: &str, heartbeat_ms: u64| Registration {
                node: node.into(),
                role: Role::Decode,
                url: "http://127.0.0.1:1".into(),
                control_addr: "127.0.0.1:1".into(),
                heartbeat_ms,
                block_size: None,
                cache_salt: None,
            };
            for (what, reg, field, needle) in [
                (
                    "an unparsable url",
                    Registration {
                        url: "{not a url".into(),
                        ..registration("prober", 500)
                    },
                    RegistrationField::Url,
                    "does not parse",
                ),
                (
                    "for decode-0",
                    registration("decode-0", 500),
                    RegistrationField::Node,
                    "control connection of `prober`",
                ),
                (
                    "heartbeat 0 ms",
                    registration("prober", 0),
                    RegistrationField::HeartbeatMs,
                    "heartbeat_ms",
                ),
            ] {
                let answer = conn
                    .request(ControlMessage::Register(Box::new(reg)))
                    .await
                    .unwrap();
                match &answer {
                    ControlMessage::RegistrationRefused(refusal) => {
                        assert_eq!(refusal.field, field, "{what}: {refusal:?}");
                        assert!(refusal.message.contains(needle), "{what}: {refusal:?}");
                    }
                    other => panic!("{what}: {other:?}"),
                }
            }
            // A flood: garbage one-way streams, a spoofed heartbeat for decode-0, and garbage
            // requests at once.
            for _ in 0..200 {
                let mut s = conn.quic_connection().open_uni().await.unwrap();
                let _ = s.write_all(&garbage).await;
                let _ = s.finish();
            }
            conn.send(ControlMessage::Heartbeat(Heartbeat {
                node: "decode-0".into(),
                seq: 1,
                load: LoadFigures {
                    running: 1_000_000,
                    waiting: 1_000_000,
                    free_blocks: 0,
                    total_blocks: 1,
                },
            }))
            .await
            .unwrap();
            let answers =
                futures_util::future::join_all((0..64).map(|_| raw_request(&conn, &garbage))).await;
            assert!(answers.iter().all(|a| error_kind(a) == "malformed_frame"));
            // The connection itself lives on.
            conn.ping().await.unwrap();

            // The proxy still serves, routes to the real instances, and keeps them registered
            // (heartbeats kept flowing through all this).
            for _ in 0..3 {
                let (status, v) = c.through_proxy(json!({})).await;
                assert_eq!(status, 200, "{v}");
            }
            // Heartbeats still flow: each instance heartbeated after the flood ended. Liveness
            // bound: heartbeats come every 500 ms; 30 s only catches heartbeats that stopped
            // (the registrations would be dropped as well).
            let flood_end = Instant::now();
            let deadline = flood_end + Duration::from_secs(30);
            loop {
                let waited = flood_end.elapsed().as_secs_f64();
                let snap = c.snapshot();
                let ages: Vec<f64> = snap["instances"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|m| m["last_heartbeat_s"].as_f64().unwrap())
                    .collect();
                if ages.len() == 2 && ages.iter().all(|&a| a < waited) {
                    break;
                }
                assert!(Instant::now() < deadline, "heartbeats stopped: {snap}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            c.assert_registrations();
            c.pool_full(&c.decode).await;
        })
    });
}

/// A member's certificate is bound to its node name: a real member certificate (`prober`)
/// filed under another node's name (`decode-0`, which `MemberCredentials::load` takes from
/// the file name) is refused at the greeting, or its registration is, and the proxy's
/// registrations are unchanged.
#[test]
fn a_member_cannot_claim_another_members_node_name() {
    with_cluster(|c| {
        Box::pin(async move {
            c.assert_registrations();
            // A real member certificate (`prober`) filed under the name of another node.
            let out = Command::new(env!("CARGO_BIN_EXE_pdserve"))
                .args(["cluster", "issue"])
                .arg(&c.creds)
                .arg("prober")
                .output()
                .unwrap();
            assert!(out.status.success(), "{out:?}");
            let renamed = c.dir.path().join("renamed");
            std::fs::create_dir_all(renamed.join("members")).unwrap();
            for f in ["cluster-name", "ca.crt"] {
                std::fs::copy(c.creds.join(f), renamed.join(f)).unwrap();
            }
            for ext in ["crt", "key"] {
                std::fs::copy(
                    c.creds.join("members").join(format!("prober.{ext}")),
                    renamed.join("members").join(format!("decode-0.{ext}")),
                )
                .unwrap();
            }
            let creds = MemberCredentials::load(&renamed, "decode-0").unwrap();
            let ep = ControlEndpoint::bind(&creds, ControlConfig::default()).unwrap();
            // Refused at the greeting (saying why), or its registration is refused.
            match ep.connect(c.control.parse().unwrap()).await {
                Err(e) => assert!(
                    matches!(&e, TransportError::Unauthenticated(m) if m.contains("issued for node `prober`")),
                    "{e:?}"
                ),
                Ok(conn) => {
                    let reg = Registration {
                        node: "decode-0".into(),
                        role: Role::Decode,
                        url: "http://127.0.0.1:1".into(),
                        control_addr: "127.0.0.1:1".into(),
                        heartbeat_ms: 500,
                        block_size: None,
                        cache_salt: None,
                    };
                    let answer = conn.request(ControlMessage::Register(Box::new(reg))).await;
                    assert!(
                        matches!(&answer, Ok(ControlMessage::RegistrationRefused(r)) if r.field == RegistrationField::Node),
                        "`prober` registered as decode-0: {answer:?}"
                    );
                    c.assert_registrations();
                }
            }
            c.assert_registrations();
        })
    });
}
